//! Native RMA and atomics: work requests queued per peer until it is connected and its send
//! queue has room, posted with generational ids (`weft_proto::slab`), their SGEs and keys.

use super::*;

impl VerbsRc {
    /// Post `r`'s queued RMA operations while its send queue has room.
    pub(super) fn flush_queued(&mut self, r: Rank) -> Result<()> {
        let i = r as usize;
        // A closing connection still takes RDMA operations (a rendezvous read decided
        // before the close): they complete before it is quiet.
        while matches!(self.peers[i].conn, Conn::Up | Conn::Draining)
            && self.peers[i].inflight < self.sq_depth
            && self.ops_posted < self.ops_in_flight
        {
            let Some((wr, _)) = self.peers[i].queued.pop_front() else {
                break;
            };
            let qp = self.peers[i].qp.expect("connected peers have a QP");
            self.hca.post_send(qp, std::slice::from_ref(&wr))?;
            self.peers[i].inflight += 1;
            self.ops_posted += 1;
        }
        Ok(())
    }

    /// Post (or queue) an RMA or atomic work request towards `dest`.
    pub(super) fn submit(&mut self, dest: Rank, mut wr: SendWr, done: Completion) -> Result<()> {
        let i = self.check_rank(dest)?;
        if self.peers[i].conn == Conn::Failed {
            return Err(self.peer_gone(dest));
        }
        let op = self.ops.insert(OpRec { peer: dest, done });
        debug_assert_eq!(op & K_MASK, 0);
        wr.wr_id = K_OP | op;
        wr.signaled = true;
        self.peers[i].queued.push_back((wr, op));
        if self.peers[i].conn == Conn::Idle {
            self.start(dest)?;
        }
        self.flush_queued(dest)?;
        let p = &mut self.peers[i];
        if !p.queued.is_empty() && !p.backlogged {
            p.backlogged = true;
            self.backlog.push(dest);
        }
        Ok(())
    }

    /// Local SGEs of an RMA operation (empty pieces dropped).
    pub(super) fn sges<'a>(
        &self,
        pieces: impl Iterator<Item = (u64, usize, u64)> + 'a,
    ) -> Result<SmallVec<[verbs::Sge; 2]>> {
        let mut v = SmallVec::new();
        for (addr, len, desc) in pieces {
            if len == 0 {
                continue;
            }
            if len > u32::MAX as usize || desc > u32::MAX as u64 {
                return Err(Error::invalid(
                    "verbs-rc: an iovec piece over 4 GiB or a foreign descriptor",
                ));
            }
            v.push(verbs::Sge {
                addr,
                length: len as u32,
                lkey: desc as u32,
            });
        }
        if v.len() > self.max_sge {
            return Err(Error::invalid(format!(
                "verbs-rc: {} iovec pieces, the HCA takes {} per operation",
                v.len(),
                self.max_sge
            )));
        }
        Ok(v)
    }

    /// Post (or queue) one RDMA read, write or write with immediate of `sg`; a read or write
    /// that moves nothing completes at once.
    pub(super) fn rdma(
        &mut self,
        peer: Rank,
        op: WrOpcode,
        sg: SmallVec<[verbs::Sge; 2]>,
        remote: RemoteAddr,
        imm: u32,
        done: Completion,
    ) -> Result<()> {
        if sg.is_empty() && op != WrOpcode::RdmaWriteWithImm {
            self.check_rank(peer)?;
            self.table.finish(done, Ok(()));
            return Ok(());
        }
        let key = Self::rkey(remote)?;
        let wr = match op {
            WrOpcode::RdmaRead => {
                self.stats.rma_read += 1;
                SendWr::read(0, &sg, remote.addr, key)
            }
            WrOpcode::RdmaWriteWithImm => {
                self.stats.rma_write += 1;
                SendWr::write_imm(0, &sg, remote.addr, key, imm)
            }
            _ => {
                self.stats.rma_write += 1;
                SendWr::write(0, &sg, remote.addr, key)
            }
        };
        self.submit(peer, wr, done)
    }

    pub(super) fn rkey(remote: RemoteAddr) -> Result<u32> {
        u32::try_from(remote.key)
            .map_err(|_| Error::invalid(format!("verbs-rc: {:#x} is not an rkey", remote.key)))
    }
}
