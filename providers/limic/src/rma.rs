//! RMA: regions registered in the segment, one-sided copies into and out of them by CMA, and the
//! lock areas of windows.

use super::*;

/// Hold area `a`'s matching lock as local rank `me` (borrowing only the segment); if it was
/// taken over from a rank that died holding it, the queues it may have been editing are
/// rebuilt first.
pub(crate) fn lock_area<'s>(
    seg: &'s Seg,
    watch: &weft_provider::shmem::Watch,
    a: usize,
    me: usize,
) -> Guard<'s> {
    let g = lock(&seg.area(a).lock, me, |r| {
        watch.gone(r, &seg.area(r).live).is_none()
    });
    if g.took_over {
        seg.repair(a);
    }
    g
}

impl Limic {
    /// The target's registered region holding `[addr, addr + len)` under `key`, as an absolute
    /// address range.
    pub(crate) fn region(
        &self,
        target: usize,
        remote: RemoteAddr,
        len: usize,
        write: bool,
    ) -> Result<Range> {
        let area = self.seg.area(target);
        for reg in &area.regions {
            if reg.key.load(Ordering::Acquire) != remote.key {
                continue;
            }
            let base = reg.base.load(Ordering::Relaxed);
            let rlen = reg.len.load(Ordering::Relaxed);
            let flags = reg.flags.load(Ordering::Relaxed);
            let allowed = flags & if write { R_WRITE } else { R_READ } != 0;
            let start = if flags & R_KEYED != 0 {
                base.checked_add(remote.addr)
            } else {
                Some(remote.addr)
            };
            return match start {
                Some(s)
                    if allowed
                        && s >= base
                        && s.checked_add(len as u64).is_some_and(|e| e <= base + rlen) =>
                {
                    Ok(Range { base: s, len })
                }
                _ => Err(Error::from(ErrorDetail::RemoteAccess {
                    rank: target as Rank,
                    what: if allowed {
                        format!(
                            "{len} bytes at {:#x} lie outside the registered region",
                            remote.addr
                        )
                    } else {
                        "the region does not allow this access".into()
                    },
                })),
            };
        }
        Err(Error::from(ErrorDetail::RemoteAccess {
            rank: target as Rank,
            what: format!("no region with key {}", remote.key),
        }))
    }

    pub(crate) fn register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
        key: u64,
        keyed: bool,
    ) -> Result<MemRegion> {
        let area = self.seg.area(self.me);
        let Some((i, reg)) = area
            .regions
            .iter()
            .enumerate()
            .find(|(_, r)| r.key.load(Ordering::Relaxed) == 0)
        else {
            return Err(Error::from(ErrorDetail::Unsupported(format!(
                "limic: all {MAX_REGIONS} region entries are in use"
            ))));
        };
        let mut flags = 0;
        if access.remote_read {
            flags |= R_READ;
        }
        if access.remote_write {
            flags |= R_WRITE;
        }
        if keyed {
            flags |= R_KEYED;
        }
        reg.base.store(base as u64, Ordering::Relaxed);
        reg.len.store(len as u64, Ordering::Relaxed);
        reg.flags.store(flags, Ordering::Relaxed);
        reg.key.store(key, Ordering::Release);
        Ok(MemRegion {
            key,
            addr: if keyed { 0 } else { base as u64 },
            len,
            handle: i as u64,
            desc: i as u64,
        })
    }

    pub(crate) fn one_sided(
        &mut self,
        target: Rank,
        dir: Dir,
        local: &[Range],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        let t = target as usize;
        self.check_dest(t)?;
        let len = total(local);
        // Announce the access before looking the region up (see `mr_deregister`).
        let access = &self.seg.area(self.me).rma_access.v;
        access.store(t as u64 + 1, Ordering::SeqCst);
        let res = self.region(t, remote, len, dir == Dir::Push).map(|r| {
            #[cfg(test)]
            tests::after_lookup();
            self.xfer(t, dir, local, &[r], len)
        });
        access.store(0, Ordering::Release);
        match res? {
            Ok(n) if n == len => {
                self.done.finish(done, Ok(()));
                Ok(())
            }
            Ok(n) => Err(Error::from(ErrorDetail::RemoteAccess {
                rank: target,
                what: format!("copied {n} of {len} bytes"),
            })),
            Err(e) => Err(self.copy_error(t, e, "RMA")),
        }
    }
}
