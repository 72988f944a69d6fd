//! Registration, RMA and atomics of the loopback provider: key-, rights- and bounds-checked
//! copies between the threads of one process; with transmit completion, writes that land at
//! the target later; an HCA's atomics.

use super::*;

pub(crate) struct Region {
    pub(crate) base: usize,
    pub(crate) len: usize,
    pub(crate) access: Access,
    /// Addressed by offset (scalable registration) rather than by absolute address.
    pub(crate) keyed: bool,
}

/// A write on its way to a rank (transmit completion): its data was copied out of the origin
/// buffer when it was issued.
struct PendingWrite {
    from: Rank,
    remote: RemoteAddr,
    data: Vec<u8>,
    imm: Option<u32>,
    /// Seen by one `progress` of the target already: lands at the next one.
    aged: bool,
}

/// What is on its way to one rank.
#[derive(Default)]
pub(crate) struct Incoming {
    writes: VecDeque<PendingWrite>,
    /// Remote completion data of writes already applied, for the rank's sink.
    imms: VecDeque<(Rank, u64)>,
}

impl Loopback {
    pub(crate) fn register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
        key: u64,
        keyed: bool,
    ) -> Result<MemRegion> {
        if self.caps.rma.is_none() && !self.caps.mr_local {
            return Err(Error::from(ErrorDetail::Unsupported(
                "loopback registration is off (WEFT_LOOPBACK_RMA, WEFT_LOOPBACK_MR_LOCAL)".into(),
            )));
        }
        let mut regs = self.fab.regions.lock().unwrap_or_else(|e| e.into_inner());
        if regs.contains_key(&(self.rank, key)) {
            return Err(Error::invalid(format!("key {key} is already registered")));
        }
        regs.insert(
            (self.rank, key),
            Region {
                base: base as usize,
                len,
                access,
                keyed,
            },
        );
        Ok(MemRegion {
            key,
            addr: if keyed { 0 } else { base as u64 },
            len,
            handle: key,
            desc: key,
        })
    }

    /// With `WEFT_LOOPBACK_MR_LOCAL`: every piece `(ptr, len, desc)` must lie in this rank's
    /// registration `desc`, which must allow local writes when `write`.
    pub(crate) fn check_descs(
        &self,
        pieces: impl Iterator<Item = (usize, usize, u64)>,
        write: bool,
    ) -> Result<()> {
        if !self.caps.mr_local {
            return Ok(());
        }
        let regs = self.fab.regions.lock().unwrap_or_else(|e| e.into_inner());
        for (p, l, d) in pieces {
            if l == 0 {
                continue;
            }
            let ok = regs.get(&(self.rank, d)).is_some_and(|r| {
                !r.keyed
                    && p >= r.base
                    && p.checked_add(l).is_some_and(|e| e <= r.base + r.len)
                    && (!write || r.access.local_write)
            });
            if !ok {
                return Err(Error::invalid(format!(
                    "loopback (mr_local): {l} bytes at {p:#x} are not described by local registration {d}"
                )));
            }
        }
        Ok(())
    }

    /// Run `f` on the absolute start address of `[remote, remote + n)` in `owner`'s region,
    /// checking key, rights and bounds, under the registry lock.
    fn with_region(
        fab: &Fabric,
        owner: Rank,
        remote: RemoteAddr,
        n: usize,
        need: Access,
        f: impl FnOnce(usize),
    ) -> Result<()> {
        let regs = fab.regions.lock().unwrap_or_else(|e| e.into_inner());
        let Some(r) = regs.get(&(owner, remote.key)) else {
            return Err(Error::from(ErrorDetail::RemoteAccess {
                rank: owner,
                what: format!("no region with key {}", remote.key),
            }));
        };
        if !r.access.contains(need) {
            return Err(Error::from(ErrorDetail::RemoteAccess {
                rank: owner,
                what: "the region does not allow this access".into(),
            }));
        }
        let start = if r.keyed {
            r.base.checked_add(remote.addr as usize)
        } else {
            Some(remote.addr as usize)
        };
        match start {
            Some(s) if s >= r.base && s.checked_add(n).is_some_and(|e| e <= r.base + r.len) => {
                f(s);
                Ok(())
            }
            _ => Err(Error::from(ErrorDetail::RemoteAccess {
                rank: owner,
                what: "access outside the registered region".into(),
            })),
        }
    }

    fn transmit(&self) -> bool {
        self.caps
            .rma
            .is_some_and(|r| r.completion == CompletionLevel::Transmit)
    }

    /// A fenced operation (or an atomic) from this rank to `target` starts only after this
    /// rank's earlier writes to it have landed.
    fn drain_writes_to(&self, target: Rank) {
        let mut inc = self.fab.incoming[target as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let inc = &mut *inc;
        let mut keep = VecDeque::new();
        while let Some(w) = inc.writes.pop_front() {
            if w.from == self.rank {
                apply(&self.fab, target, w, &mut inc.imms);
            } else {
                keep.push_back(w);
            }
        }
        inc.writes = keep;
    }

    /// Writes that reached this rank since the last call land, and their completion data is
    /// delivered.
    pub(crate) fn apply_incoming(&mut self, sink: &mut dyn Sink) -> usize {
        let imms: Vec<(Rank, u64)> = {
            let mut inc = self.fab.incoming[self.rank as usize]
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let inc = &mut *inc;
            // A write lands at the second progress call of its target after it was issued, so
            // messages sent after it can overtake it, as on a fabric where writes and messages
            // take different paths: what the core relies on must be proven (a fenced read).
            while inc.writes.front().is_some_and(|w| w.aged) {
                let w = inc.writes.pop_front().expect("checked");
                apply(&self.fab, self.rank, w, &mut inc.imms);
            }
            for w in inc.writes.iter_mut() {
                w.aged = true;
            }
            inc.imms.drain(..).collect()
        };
        let n = imms.len();
        for (src, d) in imms {
            sink.rma_data(src, d);
        }
        n
    }

    pub(crate) unsafe fn read(
        &mut self,
        src: Rank,
        local: &[RawIovMut],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.rma_on()?;
        self.check_descs(local.iter().map(|l| (l.ptr as usize, l.len, l.desc)), true)?;
        self.stats.rma_read += 1;
        self.stats.fenced += done.fence as u64;
        if done.fence && self.transmit() {
            self.drain_writes_to(src);
        }
        let total: usize = local.iter().map(|l| l.len).sum();
        let res = Self::with_region(&self.fab, src, remote, total, Access::READ, |mut at| {
            for l in local {
                // SAFETY: `at..at+total` lies in a region its owner registered and keeps alive
                // until it deregisters, which cannot happen while we hold the registry lock;
                // `l` is the caller's buffer, valid per this function's contract.
                std::ptr::copy_nonoverlapping(at as *const u8, l.ptr, l.len);
                at += l.len;
            }
        });
        self.done.finish(done, res);
        Ok(())
    }

    pub(crate) unsafe fn write(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        imm: Option<u32>,
        done: Completion,
    ) -> Result<()> {
        self.rma_on()?;
        self.check_descs(local.iter().map(|l| (l.ptr as usize, l.len, l.desc)), false)?;
        self.stats.rma_write += 1;
        self.stats.fenced += done.fence as u64;
        if self.transmit() {
            if done.fence {
                self.drain_writes_to(dest);
            }
            // Copied out now (the origin buffer is free once this completes); lands later.
            let mut data = Vec::with_capacity(local.iter().map(|l| l.len).sum());
            for l in local {
                // SAFETY: the caller's buffer, valid per this function's contract.
                data.extend_from_slice(std::slice::from_raw_parts(l.ptr, l.len));
            }
            let mut inc = self.fab.incoming[dest as usize]
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            inc.writes.push_back(PendingWrite {
                from: self.rank,
                remote,
                data,
                imm,
                aged: false,
            });
            drop(inc);
            self.done.finish(done, Ok(()));
            return Ok(());
        }
        let total: usize = local.iter().map(|l| l.len).sum();
        let res = Self::with_region(&self.fab, dest, remote, total, Access::WRITE, |mut at| {
            for l in local {
                // SAFETY: as in `read`, in the other direction.
                std::ptr::copy_nonoverlapping(l.ptr, at as *mut u8, l.len);
                at += l.len;
            }
        });
        if let (Ok(()), Some(d)) = (&res, imm) {
            let mut inc = self.fab.incoming[dest as usize]
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            inc.imms.push_back((self.rank, d as u64));
        }
        self.done.finish(done, res);
        Ok(())
    }

    /// An HCA's atomic: one 8-byte element, fetch-and-add or compare-and-swap, 8-byte aligned,
    /// atomic against the other atomics of the fabric.
    pub(crate) unsafe fn hca_atomic(
        &mut self,
        dest: Rank,
        a: &AtomicOp,
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        self.rma_on()?;
        if !self.caps.atomics.query(a.op, a.ty) {
            return Err(Error::from(ErrorDetail::Unsupported(format!(
                "loopback atomics do only SUM and CSWAP on i64, not {:?} on {:?}",
                a.op, a.ty
            ))));
        }
        if a.count != 1 {
            return Err(Error::invalid(format!(
                "loopback (HCA) atomics take one element, not {}",
                a.count
            )));
        }
        let cmp_desc = if a.compare.is_null() { 0 } else { a.desc[1] };
        let mut pieces: SmallVec<[(usize, usize, u64); 3]> = SmallVec::new();
        pieces.push((a.origin as usize, 8, a.desc[0]));
        if !a.compare.is_null() {
            pieces.push((a.compare as usize, 8, cmp_desc));
        }
        self.check_descs(pieces.into_iter(), false)?;
        if !a.result.is_null() {
            self.check_descs(std::iter::once((a.result as usize, 8, a.desc[2])), true)?;
        }
        self.stats.atomics += 1;
        if self.transmit() {
            self.drain_writes_to(dest);
        }
        let _serial = self.fab.atomics.lock().unwrap_or_else(|e| e.into_inner());
        let need = Access {
            remote_atomic: true,
            ..Access::LOCAL
        };
        let mut misaligned = false;
        let res = Self::with_region(&self.fab, dest, remote, 8, need, |at| {
            if at % 8 != 0 {
                misaligned = true;
                return;
            }
            let t = at as *mut i64;
            // SAFETY: 8 bytes in a registered region (checked), aligned (checked); operands per
            // this function's contract. Window memory is only accessed through raw pointers.
            let old = t.read();
            let o = (a.origin as *const i64).read_unaligned();
            let new = match a.op {
                Op::Cswap => {
                    if old == (a.compare as *const i64).read_unaligned() {
                        o
                    } else {
                        old
                    }
                }
                _ => old.wrapping_add(o),
            };
            t.write(new);
            if !a.result.is_null() {
                (a.result as *mut i64).write_unaligned(old);
            }
        });
        let res = match res {
            Ok(()) if misaligned => Err(Error::from(ErrorDetail::RemoteAccess {
                rank: dest,
                what: "an atomic on an address that is not 8-byte aligned".into(),
            })),
            r => r,
        };
        self.done.finish(done, res);
        Ok(())
    }

    fn rma_on(&self) -> Result<()> {
        if self.caps.rma.is_none() {
            return Err(Error::from(ErrorDetail::Unsupported(
                "loopback RMA is off (WEFT_LOOPBACK_RMA)".into(),
            )));
        }
        Ok(())
    }
}

/// Land write `w` in `target`'s memory (a write whose region went away meanwhile is lost, as
/// on a fabric where the target deregistered: the origin already saw it complete).
fn apply(fab: &Fabric, target: Rank, w: PendingWrite, imms: &mut VecDeque<(Rank, u64)>) {
    let n = w.data.len();
    let r = Loopback::with_region(fab, target, w.remote, n, Access::WRITE, |at| {
        // SAFETY: in a region of the target (checked under the registry lock); the data is
        // this write's own copy.
        unsafe { std::ptr::copy_nonoverlapping(w.data.as_ptr(), at as *mut u8, n) };
    });
    match r {
        Ok(()) => {
            if let Some(d) = w.imm {
                imms.push_back((w.from, d as u64));
            }
        }
        Err(e) => eprintln!("weft loopback: a write from rank {} was lost: {e}", w.from),
    }
}
