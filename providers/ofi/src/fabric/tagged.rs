//! Native tagged messaging's own parts: large messages announced and pulled by the receiver
//! (clear-to-send, data on a tag of its own), bounce buffers for receives libfabric could
//! truncate.

use super::*;

impl Ofi {
    /// A receive matched a large message's announcement: post a receive for the bytes it takes
    /// (in the provider's data context) and ask the sender for them.
    pub(super) fn on_announce(&mut self, i: usize, token: Token, cap: usize, ev: &Ev) {
        let (source, tag) = self.layout.unpack(ev.tag);
        let len = (ev.data & ((1 << LEN_BITS) - 1)) as usize;
        let their = (ev.data & !D_ANNOUNCE) >> LEN_BITS;
        let take = len.min(cap);
        let iov = truncate(&self.iovs[i], take);
        self.free_op(i);
        if ev.flags & FI_REMOTE_CQ_DATA == 0 {
            self.done.push_back((
                token,
                Err(Error::from(ErrorDetail::Malformed {
                    peer: source,
                    what: "a large message announced without its length".into(),
                })),
            ));
            return;
        }
        let id = self.next_data_id;
        self.next_data_id = id.wrapping_add(1);
        let op = self.new_op(Op::LRecv {
            token,
            source,
            tag,
            len,
        });
        let d = Deferred {
            recv: true,
            iov,
            peer: FI_ADDR_UNSPEC,
            tag: self.layout.data_tag(source, id),
            ignore: 0,
            data: 0,
            flags: 0,
            op,
        };
        match self.post(d) {
            Ok(()) => self.cts.push_back((source, their, id, take as u64)),
            Err(e) => self.done.push_back((token, Err(e))),
        }
    }

    /// The receiver of large send `op` asked for `take` bytes under data id `id`.
    pub(super) fn send_data(&mut self, src: Rank, op: usize, id: u32, take: usize) -> Result<()> {
        let Some(Op::LSend {
            token,
            dest,
            owed,
            data: false,
            failed,
        }) = self.ops.get(op).copied()
        else {
            return Err(Error::invalid(format!(
                "asked for the data of unknown send {op}"
            )));
        };
        if dest != src {
            return Err(Error::invalid(format!(
                "asked for the data of a send to rank {dest}"
            )));
        }
        let total: usize = self.iovs[op].iter().map(|x| x.1).sum();
        if take > total {
            return Err(Error::invalid(format!("asked for {take} of {total} bytes")));
        }
        self.ops[op] = Op::LSend {
            token,
            dest,
            owed: owed + 1,
            data: true,
            failed,
        };
        let d = Deferred {
            recv: false,
            iov: truncate(&self.iovs[op], take),
            peer: self.addrs[dest as usize],
            tag: self.layout.data_tag(self.rank, id),
            ignore: 0,
            data: 0,
            flags: 0,
            op,
        };
        self.post(d)
    }

    pub(super) fn take_bounce(&mut self) -> Result<u32> {
        if let Some(b) = self.bounce_free.pop() {
            return Ok(b);
        }
        let mem = vec![0u8; BOUNCE_CHUNK * self.rndv.max(1)];
        let desc = self.own_registration(mem.as_ptr(), mem.len())?;
        let first = self.bounce.len() * BOUNCE_CHUNK;
        self.bounce.push((mem, desc));
        self.bounce_free
            .extend((first + 1..first + BOUNCE_CHUNK).rev().map(|b| b as u32));
        Ok(first as u32)
    }

    pub(super) fn release_bounce(&mut self, b: u32) {
        if b != NO_BOUNCE {
            self.bounce_free.push(b);
        }
    }

    /// Where bounce buffer `b` lies, and its descriptor.
    pub(super) fn bounce_at(&mut self, b: u32) -> (*mut u8, *mut c_void) {
        let (chunk, k) = (b as usize / BOUNCE_CHUNK, b as usize % BOUNCE_CHUNK);
        let (mem, desc) = &mut self.bounce[chunk];
        // SAFETY: `k * rndv` lies inside the chunk of BOUNCE_CHUNK * rndv bytes.
        (unsafe { mem.as_mut_ptr().add(k * self.rndv) }, *desc)
    }

    /// Copy the first `n` bytes of bounce buffer `b` into receive `op`'s buffer.
    pub(super) fn unbounce(&mut self, b: u32, op: usize, mut n: usize) {
        let (src, _) = self.bounce_at(b);
        let mut off = 0;
        for &(p, l, _) in &self.iovs[op] {
            let k = l.min(n);
            // SAFETY: the receive's pieces are the caller's buffer, valid and unaliased until
            // its token completes (now); `src + off .. + k` lies in the bounce buffer (n is at
            // most the message length, which libfabric fitted into the buffer).
            unsafe { std::ptr::copy_nonoverlapping(src.add(off), p as *mut u8, k) };
            off += k;
            n -= k;
            if n == 0 {
                break;
            }
        }
    }
}
