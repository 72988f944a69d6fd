//! The single copy: data moved between this process and a peer's iovecs by Cross-Memory
//! Attach, the outcome told to both sides through the descriptor slot, and what a failed copy
//! means (a dead peer, a ptrace policy that forbids it).

use super::*;

/// Why cross-memory attach may be refused here, for error messages.
pub(crate) fn ptrace_hint() -> String {
    match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        Ok(v) => format!(
            " (Yama ptrace_scope is {}; the processes must share a user and a container, be \
             dumpable, and no seccomp profile may forbid process_vm_readv)",
            v.trim()
        ),
        Err(_) => " (the processes must share a user and a container, be dumpable, and no \
                   seccomp profile may forbid process_vm_readv)"
            .into(),
    }
}

pub(crate) fn ranges_of(v: &[RawIov]) -> SmallVec<[Range; 4]> {
    v.iter()
        .map(|r| Range {
            base: r.ptr as u64,
            len: r.len,
        })
        .collect()
}

pub(crate) fn ranges_of_mut(v: &[RawIovMut]) -> SmallVec<[Range; 4]> {
    v.iter()
        .map(|r| Range {
            base: r.ptr as u64,
            len: r.len,
        })
        .collect()
}

impl Limic {
    /// Copy between this process and local rank `peer`'s memory (a plain copy for ourselves).
    pub(crate) fn xfer(
        &self,
        peer: usize,
        dir: Dir,
        local: &[Range],
        remote: &[Range],
        limit: usize,
    ) -> std::result::Result<usize, CopyError> {
        if peer == self.me {
            let (dst, src) = match dir {
                Dir::Pull => (local, remote),
                Dir::Push => (remote, local),
            };
            // SAFETY: both sides are memory of this process that the operation's contract
            // keeps valid (user buffers borrowed until completion, or slot inline areas).
            return Ok(unsafe { copy_local(dst, src, limit) });
        }
        // SAFETY: `local` is this process's memory valid for the operation; the kernel checks
        // the remote side.
        unsafe { cma::copy(self.pids[peer], dir, local, remote, limit) }
    }

    /// The slot status and the caller's result for a finished copy with `peer`.
    pub(crate) fn copy_outcome(
        &self,
        peer: usize,
        res: std::result::Result<usize, CopyError>,
        what: &str,
        ok: Completed,
    ) -> (u32, Result<Completed>) {
        match res {
            Ok(_) => (E_OK, Ok(ok)),
            Err(e) => {
                let code = if matches!(e, CopyError::Gone) {
                    E_PEER
                } else {
                    E_FAULT
                };
                (code, Err(self.copy_error(peer, e, what)))
            }
        }
    }

    pub(crate) fn copy_error(&self, peer: usize, e: CopyError, what: &str) -> Error {
        match e {
            CopyError::Gone => self.peer_err(peer, "process died"),
            CopyError::Fault { done } => Error::from(ErrorDetail::RemoteAccess {
                rank: peer as Rank,
                what: format!("{what}: bad address after {done} bytes"),
            }),
            e => Error::from(ErrorDetail::Io {
                what: format!("{what} with rank {peer}"),
                source: std::io::Error::other(e.to_string()).into(),
            }),
        }
    }

    pub(crate) fn write_iov(&self, s: &Slot, iov: &[Range]) {
        s.niov.store(iov.len() as u32, Ordering::Relaxed);
        for (k, r) in iov.iter().enumerate() {
            s.iov[k][0].store(r.base, Ordering::Relaxed);
            s.iov[k][1].store(r.len as u64, Ordering::Relaxed);
        }
    }

    pub(crate) fn read_iov(s: &Slot) -> SmallVec<[Range; 4]> {
        let n = (s.niov.load(Ordering::Relaxed) as usize).min(MAX_IOV);
        (0..n)
            .map(|k| Range {
                base: s.iov[k][0].load(Ordering::Relaxed),
                len: s.iov[k][1].load(Ordering::Relaxed) as usize,
            })
            .collect()
    }

    /// Describe a send of ours in slot `s` (by reference: its iovec).
    pub(crate) fn fill_send(
        &self,
        s: &Slot,
        ctx: u32,
        tag: i32,
        len: usize,
        sync: bool,
        iov: &[Range],
    ) {
        s.kind.store(SEND, Ordering::Relaxed);
        s.src.store(self.me as u32, Ordering::Relaxed);
        s.ctx.store(ctx, Ordering::Relaxed);
        s.tag.store(tag as i64, Ordering::Relaxed);
        s.len.store(len as u64, Ordering::Relaxed);
        s.sync.store(sync as u32, Ordering::Relaxed);
        s.inline_len.store(0, Ordering::Relaxed);
        self.write_iov(s, iov);
    }

    /// Pull the message a sender matched to our posted receive `o`.
    pub(crate) fn pull_matched(&self, o: &Out) -> Result<Completed> {
        let me = self.me;
        let rs = self.seg.slot(me, o.slot);
        let Some((sender, si)) = self.seg.sref_ok(rs.matched.load(Ordering::Relaxed)) else {
            return Err(Error::malformed(
                me as Rank,
                "limic: a matched receive names no slot of the segment",
            ));
        };
        let ss = self.seg.slot(sender, si);
        let len = ss.len.load(Ordering::Relaxed) as usize;
        let tag = ss.tag.load(Ordering::Relaxed);
        let cap = total(&o.iov);
        let remote = Self::read_iov(ss);
        let res = self.xfer(sender, Dir::Pull, &o.iov, &remote, len.min(cap));
        let status = Completed::Received(TaggedStatus {
            source: sender as Rank,
            tag: tag as i32,
            bytes: len,
        });
        let (err, r) = self.copy_outcome(sender, res, "pulling a message", status);
        self.finish_slot(sender, si, me as u32, tag, len as u64, err);
        r
    }

    /// Mark `owner`'s slot done with a status and tell the owner.
    pub(crate) fn finish_slot(
        &self,
        owner: usize,
        i: usize,
        src: u32,
        tag: i64,
        bytes: u64,
        err: u32,
    ) {
        let s = self.seg.slot(owner, i);
        s.st_src.store(src, Ordering::Relaxed);
        s.st_tag.store(tag, Ordering::Relaxed);
        s.st_bytes.store(bytes, Ordering::Relaxed);
        s.st_err.store(err, Ordering::Relaxed);
        s.state.store(DONE, Ordering::Release);
        self.seg.area(owner).done.v.fetch_add(1, Ordering::AcqRel);
    }
}
