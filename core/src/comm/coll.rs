//! Collectives on point-to-point, correct for any rank count. They run in the communicator's
//! collective context (`ctx + 1`), so they never match user messages.

use crate::comm::{Comm, Source, TagSel};
use crate::p2p::{Layout, RecvBuf, SendBuf};
use crate::provider::Provider;
use crate::types::{apply_op, Element, Op};
use crate::{Error, ErrorDetail, Result};
use bytemuck::Pod;

const T_BARRIER: i32 = 1;
const T_BCAST: i32 = 2;
const T_REDUCE: i32 = 3;
const T_ALLGATHER: i32 = 4;
const T_ALLTOALL: i32 = 5;

fn sb(b: &[u8]) -> SendBuf {
    SendBuf {
        base: b.as_ptr(),
        len: b.len(),
        layout: Layout::Contig,
    }
}

fn rb(b: &mut [u8]) -> RecvBuf {
    RecvBuf {
        base: b.as_mut_ptr(),
        cap: b.len(),
        layout: Layout::Contig,
        shared: false,
    }
}

impl<P: Provider> Comm<P> {
    fn cctx(&self) -> u32 {
        self.ctx + 1
    }

    fn exchange(&self, send: &[u8], dest: u32, recv: &mut [u8], src: u32, tag: i32) -> Result<()> {
        self.sendrecv_ctx(
            sb(send),
            dest,
            tag,
            rb(recv),
            Source::Rank(src),
            TagSel::Tag(tag),
            self.cctx(),
        )
        .map(|_| ())
    }

    /// Block until every rank has entered (MPI_Barrier). Dissemination: ⌈log2 n⌉ rounds.
    pub fn barrier(&self) -> Result<()> {
        let n = self.size();
        let r = self.rank();
        let mut k = 1;
        while k < n {
            let to = (r + k) % n;
            let from = (r + n - k) % n;
            self.exchange(&[], to, &mut [], from, T_BARRIER)?;
            k *= 2;
        }
        Ok(())
    }

    /// Broadcast `buf` from `root` to every rank (MPI_Bcast). Binomial tree.
    pub fn bcast<T: Pod>(&self, buf: &mut [T], root: u32) -> Result<()> {
        let n = self.size();
        if root >= n {
            return Err(Error::from(ErrorDetail::InvalidRank {
                rank: root as i64,
                size: n,
            }));
        }
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        let vr = (self.rank() + n - root) % n;
        let mut mask = 1;
        while mask < n {
            if vr & mask != 0 {
                let src = (vr - mask + root) % n;
                self.recv_ctx(rb(bytes), src, T_BCAST, self.cctx())?;
                break;
            }
            mask <<= 1;
        }
        mask >>= 1;
        while mask > 0 {
            if vr + mask < n {
                let dst = (vr + mask + root) % n;
                self.send_ctx(sb(bytes), dst, T_BCAST, self.cctx())?;
            }
            mask >>= 1;
        }
        Ok(())
    }

    /// Combine `send` from every rank with `op` into `recv` on every rank (MPI_Allreduce).
    /// Recursive doubling with a fold for non-powers of two; every rank gets the bitwise same
    /// result.
    pub fn allreduce<T: Element>(&self, send: &[T], recv: &mut [T], op: Op) -> Result<()> {
        if send.len() != recv.len() {
            return Err(Error::invalid(format!(
                "allreduce of {} elements into {}",
                send.len(),
                recv.len()
            )));
        }
        if !op.valid_for(T::TYPE) || matches!(op, Op::Cswap | Op::NoOp) {
            return Err(Error::invalid(format!(
                "{} is not a reduction on {}",
                op.name(),
                T::TYPE.name()
            )));
        }
        recv.copy_from_slice(send);
        let n = self.size();
        let r = self.rank();
        let acc: &mut [u8] = bytemuck::cast_slice_mut(recv);
        let mut tmp = vec![0u8; acc.len()];
        let pof2 = if n.is_power_of_two() {
            n
        } else {
            n.next_power_of_two() / 2
        };
        let rem = n - pof2;
        // Fold the first 2*rem ranks pairwise: even ranks hand their data to the odd neighbour.
        let newrank: Option<u32> = if r < 2 * rem {
            if r % 2 == 0 {
                self.send_ctx(sb(acc), r + 1, T_REDUCE, self.cctx())?;
                None
            } else {
                self.recv_ctx(rb(&mut tmp), r - 1, T_REDUCE, self.cctx())?;
                apply_op(op, T::TYPE, acc, &tmp)?;
                Some(r / 2)
            }
        } else {
            Some(r - rem)
        };
        if let Some(nr) = newrank {
            let mut mask = 1;
            while mask < pof2 {
                let peer_new = nr ^ mask;
                let peer = if peer_new < rem {
                    peer_new * 2 + 1
                } else {
                    peer_new + rem
                };
                self.exchange(acc, peer, &mut tmp, peer, T_REDUCE)?;
                // Combine in rank order so both partners compute the same value.
                if peer < r {
                    let mut a = tmp.clone();
                    apply_op(op, T::TYPE, &mut a, acc)?;
                    acc.copy_from_slice(&a);
                } else {
                    apply_op(op, T::TYPE, acc, &tmp)?;
                }
                mask <<= 1;
            }
        }
        // Unfold: odd ranks return the result to their even neighbour.
        if r < 2 * rem {
            if r % 2 == 1 {
                self.send_ctx(sb(acc), r - 1, T_REDUCE, self.cctx())?;
            } else {
                self.recv_ctx(rb(acc), r + 1, T_REDUCE, self.cctx())?;
            }
        }
        Ok(())
    }

    /// Gather every rank's `send` into `recv` on every rank, in rank order (MPI_Allgather).
    /// Ring algorithm.
    pub fn allgather<T: Pod>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let n = self.size() as usize;
        if recv.len() != send.len() * n {
            return Err(Error::invalid(format!(
                "allgather of {} elements from {n} ranks into {}",
                send.len(),
                recv.len()
            )));
        }
        let block = std::mem::size_of_val(send);
        let r = self.rank() as usize;
        let out: &mut [u8] = bytemuck::cast_slice_mut(recv);
        out[r * block..(r + 1) * block].copy_from_slice(bytemuck::cast_slice(send));
        let right = ((r + 1) % n) as u32;
        let left = ((r + n - 1) % n) as u32;
        let mut tmp = vec![0u8; block];
        for step in 0..n.saturating_sub(1) {
            let sidx = (r + n - step) % n;
            let ridx = (r + n - step - 1) % n;
            let sendblk = out[sidx * block..(sidx + 1) * block].to_vec();
            self.exchange(&sendblk, right, &mut tmp, left, T_ALLGATHER)?;
            out[ridx * block..(ridx + 1) * block].copy_from_slice(&tmp);
        }
        Ok(())
    }

    /// Block `i` of `send` goes to rank `i`; block `j` of `recv` comes from rank `j`
    /// (MPI_Alltoall). Pairwise exchange, `n - 1` rounds.
    pub fn alltoall<T: Pod>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let n = self.size() as usize;
        if send.len() != recv.len() || send.len() % n != 0 {
            return Err(Error::invalid(format!(
                "alltoall needs equal send and receive lengths divisible by {n} (got {} and {})",
                send.len(),
                recv.len()
            )));
        }
        let block = std::mem::size_of_val(send) / n;
        let r = self.rank() as usize;
        let s: &[u8] = bytemuck::cast_slice(send);
        let out: &mut [u8] = bytemuck::cast_slice_mut(recv);
        out[r * block..(r + 1) * block].copy_from_slice(&s[r * block..(r + 1) * block]);
        for i in 1..n {
            let dest = (r + i) % n;
            let src = (r + n - i) % n;
            let (sblk, rblk) = (
                &s[dest * block..(dest + 1) * block],
                &mut out[src * block..(src + 1) * block],
            );
            self.exchange(sblk, dest as u32, rblk, src as u32, T_ALLTOALL)?;
        }
        Ok(())
    }
}
