//! The registration cache: local registrations of user buffers for providers that need a
//! descriptor on every buffer they are handed (`Caps::mr_local`, libfabric's `FI_MR_LOCAL`).
//!
//! Registering is expensive (a system call and page pinning on an HCA), and applications send
//! from the same buffers again and again, so registrations outlive the operations that made
//! them: an entry is kept, unused, until the cache is over its bounds (`WEFT_MR_CACHE_MAX_COUNT`
//! entries, 1024 by default as in libfabric; `WEFT_MR_CACHE_MAX_SIZE` bytes), and then the least
//! recently used unused entries are deregistered. Entries cover whole pages, keyed by their page
//! range and access rights.
//!
//! Local rights, and remote **read** rights of rendezvous send buffers, are cached. A remote
//! *write* or atomic key that outlived the buffer's borrow would let a peer write into memory
//! weft no longer owns: those are never cached ([`MrCache::acquire_remote`] refuses them). A
//! cached read key lets the job's peers read pages the application may since have reused —
//! what MVAPICH's and UCX's registration caches accept too, since the ranks of one job trust
//! each other; a quarantined request's entry is revoked at once. The core caches rendezvous
//! registrations only for providers where registering is costly (`Caps::mr_local` or
//! `Caps::mr_pins`); the others register per message.
//!
//! # The stale-registration rule
//! A buffer freed and reallocated at the same address must never reuse the old registration
//! when that registration no longer describes its memory. Which registrations can go stale is
//! the provider's to say (`Caps::mr_pins`):
//! * registrations that follow the page tables (CMA, a soft HCA, on-demand paging) reach
//!   whatever is mapped at the address when they are used: they cannot go stale, and the cache
//!   reuses them freely;
//! * registrations that pin pages (an HCA without on-demand paging) keep reaching the pages
//!   they pinned. For those the cache records the page frames of every page at registration
//!   and compares them before each reuse (`/proc/self/pagemap`); any difference means the
//!   memory was unmapped and mapped again, and the entry is dropped and registered anew. Where
//!   page frames are not readable (they read as 0 without `CAP_SYS_ADMIN`), nothing is cached:
//!   every operation registers and deregisters its buffer.

use crate::provider::{Access, MemRegion, MrDesc, Provider, RemoteAddr};
use crate::{Error, ErrorDetail, Result};
use hashbrown::HashMap;

crate::param!(MR_CACHE_MAX_COUNT: Uint = "", "MR_CACHE_MAX_COUNT", "1024",
    "registrations the registration cache keeps (for providers that need local descriptors; 0: no cache)");
crate::param!(MR_CACHE_MAX_SIZE: Str = "", "MR_CACHE_MAX_SIZE", "auto",
    "bytes the registration cache keeps registered: a size, or auto (memory / CPUs / 2, libfabric's default)");

const PAGE: usize = 4096;

/// A use of a cache entry, given back with [`MrCache::release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MrRef {
    idx: u32,
    gen: u32,
}

/// How reuse is checked (see the module documentation).
#[derive(Debug)]
pub(crate) enum Check {
    /// Registrations follow the page tables: reuse freely.
    Follows,
    /// Registrations pin pages: compare page frames before reuse.
    Frames(PageFrames),
    /// Registrations pin pages and frames cannot be read: do not cache.
    NoCache,
}

struct Entry {
    start: usize,
    end: usize,
    access: Access,
    mr: MemRegion,
    users: u32,
    last: u64,
    gen: u32,
    /// Page frames at registration (`Check::Frames`).
    frames: Vec<u64>,
    /// Not kept once unused (over the bounds, stale, or not caching).
    transient: bool,
}

/// Counters for diagnostics and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Entries found stale (their pages changed) and registered anew.
    pub stale: u64,
}

type Key = (usize, usize, u8);

fn access_bits(a: Access) -> u8 {
    a.local_write as u8
        | (a.remote_read as u8) << 1
        | (a.remote_write as u8) << 2
        | (a.remote_atomic as u8) << 3
}

/// Local registrations of user buffers, bounded and least-recently-used.
pub(crate) struct MrCache {
    entries: Vec<Option<Entry>>,
    free: Vec<u32>,
    by_key: HashMap<Key, u32>,
    max_count: usize,
    max_bytes: usize,
    bytes: usize,
    tick: u64,
    check: Check,
    /// Registrations to release once the provider is at hand (`MrCache::reap`).
    dead: Vec<MemRegion>,
    pub(crate) stats: CacheStats,
}

impl MrCache {
    /// A cache with the given bounds; `pins`: the provider's registrations pin pages.
    pub(crate) fn new(max_count: usize, max_bytes: usize, pins: bool) -> Self {
        let check = if !pins {
            Check::Follows
        } else {
            match PageFrames::open() {
                Some(f) => Check::Frames(f),
                None => {
                    tracing::debug!(
                        "page frames are not readable: registrations are not cached (they pin pages)"
                    );
                    Check::NoCache
                }
            }
        };
        Self::with_check(max_count, max_bytes, check)
    }

    pub(crate) fn with_check(max_count: usize, max_bytes: usize, check: Check) -> Self {
        MrCache {
            entries: Vec::new(),
            free: Vec::new(),
            by_key: HashMap::new(),
            max_count,
            max_bytes,
            bytes: 0,
            tick: 0,
            check,
            dead: Vec::new(),
            stats: CacheStats::default(),
        }
    }

    /// `WEFT_MR_CACHE_MAX_COUNT` and `WEFT_MR_CACHE_MAX_SIZE`.
    pub(crate) fn bounds_from_env() -> Result<(usize, usize)> {
        let count = MR_CACHE_MAX_COUNT.get_u64()? as usize;
        let raw = MR_CACHE_MAX_SIZE.raw();
        let bytes = if raw.trim().eq_ignore_ascii_case("auto") {
            default_max_bytes()
        } else {
            crate::param::parse_size(raw.trim()).ok_or_else(|| {
                Error::from(ErrorDetail::Param {
                    var: MR_CACHE_MAX_SIZE.env_name(),
                    value: raw.clone(),
                    expected: "auto or a size such as 1G".into(),
                })
            })?
        };
        Ok((count, bytes))
    }

    /// Entries currently registered.
    pub(crate) fn len(&self) -> usize {
        self.by_key.len()
            + self
                .entries
                .iter()
                .flatten()
                .filter(|e| e.transient)
                .count()
    }

    /// A registration covering `[ptr, ptr + len)` with at least `access`, reused when an entry
    /// for the same pages and rights is valid, else made with `p`.
    pub(crate) fn acquire<P: Provider>(
        &mut self,
        p: &mut P,
        ptr: *const u8,
        len: usize,
        access: Access,
    ) -> Result<(MrDesc, MrRef)> {
        let start = ptr as usize & !(PAGE - 1);
        let end = (ptr as usize)
            .checked_add(len.max(1))
            .and_then(|e| e.checked_next_multiple_of(PAGE))
            .ok_or_else(|| Error::invalid("buffer wraps around the address space"))?;
        let key = (start, end, access_bits(access));
        self.tick += 1;
        if let Some(&i) = self.by_key.get(&key) {
            let fresh = match &self.check {
                Check::Frames(f) => {
                    let e = self.entries[i as usize].as_ref().expect("indexed entry");
                    f.frames(start, end).is_some_and(|now| now == e.frames)
                }
                _ => true,
            };
            if fresh {
                let e = self.entries[i as usize].as_mut().expect("indexed entry");
                e.users += 1;
                e.last = self.tick;
                self.stats.hits += 1;
                return Ok((e.mr.desc, MrRef { idx: i, gen: e.gen }));
            }
            // Its pages changed: the memory was unmapped and mapped again.
            self.stats.stale += 1;
            self.by_key.remove(&key);
            let e = self.entries[i as usize].as_mut().expect("indexed entry");
            if e.users == 0 {
                let e = self.entries[i as usize].take().expect("indexed entry");
                self.retire(i, e);
            } else {
                e.transient = true;
            }
        }
        self.stats.misses += 1;
        // SAFETY: the provider touches the memory for operations the core posts while it
        // borrows the buffer, and for peers' reads of a rendezvous send buffer (read rights
        // only: no peer can write through a cached registration, and a quarantined request's
        // entry is revoked); entries whose pages could have changed are checked before reuse.
        let mr = unsafe { p.mr_register(start as *mut u8, end - start, access)? };
        let frames = match &self.check {
            Check::Frames(f) => f.frames(start, end).unwrap_or_default(),
            _ => Vec::new(),
        };
        let cache = !matches!(self.check, Check::NoCache) && self.max_count > 0;
        let size = end - start;
        if cache {
            self.make_room(size);
        }
        let transient =
            !cache || self.by_key.len() >= self.max_count || self.bytes + size > self.max_bytes;
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                self.entries.push(None);
                (self.entries.len() - 1) as u32
            }
        };
        let gen = self.tick as u32;
        self.entries[i as usize] = Some(Entry {
            start,
            end,
            access,
            mr,
            users: 1,
            last: self.tick,
            gen,
            frames,
            transient,
        });
        if !transient {
            self.by_key.insert(key, i);
            self.bytes += size;
        }
        Ok((mr.desc, MrRef { idx: i, gen }))
    }

    /// Like [`MrCache::acquire`], for memory a peer will access: the address and key it
    /// presents for `ptr`. The rights stay granted while the entry is cached (as in MVAPICH's
    /// and UCX's registration caches: the ranks of a job trust each other), unless revoked.
    pub(crate) fn acquire_remote<P: Provider>(
        &mut self,
        p: &mut P,
        ptr: *const u8,
        len: usize,
        access: Access,
    ) -> Result<(RemoteAddr, MrRef)> {
        if access.remote_write || access.remote_atomic {
            return Err(Error::invalid(
                "remote write or atomic rights are never cached (a stale key could write)",
            ));
        }
        let (_, r) = self.acquire(p, ptr, len, access)?;
        let e = self.entries[r.idx as usize]
            .as_ref()
            .expect("just acquired");
        let ra = RemoteAddr {
            addr: e.mr.addr + (ptr as usize - e.start) as u64,
            key: e.mr.key,
        };
        Ok((ra, r))
    }

    /// Withdraw `r`'s registration now, whoever else uses it (a quarantined request whose
    /// peer may still hold the key): it is deregistered at the next reap, and other holders'
    /// references become inert.
    pub(crate) fn revoke(&mut self, r: MrRef) {
        let Some(Some(e)) = self.entries.get(r.idx as usize) else {
            return;
        };
        if e.gen != r.gen {
            return;
        }
        let e = self.entries[r.idx as usize].take().expect("checked");
        let k = (e.start, e.end, access_bits(e.access));
        if self.by_key.get(&k) == Some(&r.idx) {
            self.by_key.remove(&k);
        }
        self.retire(r.idx, e);
    }

    /// The operation that acquired `r` is over.
    pub(crate) fn release(&mut self, r: MrRef) {
        let Some(Some(e)) = self.entries.get_mut(r.idx as usize) else {
            return;
        };
        if e.gen != r.gen || e.users == 0 {
            return;
        }
        e.users -= 1;
        if e.users == 0 && e.transient {
            let e = self.entries[r.idx as usize].take().expect("checked");
            self.retire(r.idx, e);
        }
    }

    /// Deregister what was dropped since the last call.
    pub(crate) fn reap<P: Provider>(&mut self, p: &mut P) {
        for m in self.dead.drain(..) {
            if let Err(e) = p.mr_deregister(&m) {
                tracing::warn!("deregistration failed: {e}");
            }
        }
    }

    /// Something to deregister.
    #[inline]
    pub(crate) fn has_dead(&self) -> bool {
        !self.dead.is_empty()
    }

    /// Drop every unused entry (before the provider closes).
    pub(crate) fn clear<P: Provider>(&mut self, p: &mut P) {
        let unused: Vec<u32> = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.as_ref().is_some_and(|e| e.users == 0))
            .map(|(i, _)| i as u32)
            .collect();
        for i in unused {
            self.evict(i);
        }
        self.reap(p);
    }

    /// Evict least recently used unused entries until one of `size` bytes fits.
    fn make_room(&mut self, size: usize) {
        while self.by_key.len() >= self.max_count || self.bytes + size > self.max_bytes {
            let victim = self
                .by_key
                .values()
                .copied()
                .filter(|i| {
                    self.entries[*i as usize]
                        .as_ref()
                        .is_some_and(|e| e.users == 0)
                })
                .min_by_key(|i| self.entries[*i as usize].as_ref().map_or(0, |e| e.last));
            match victim {
                Some(i) => {
                    self.evict(i);
                    self.stats.evictions += 1;
                }
                None => return,
            }
        }
    }

    fn evict(&mut self, i: u32) {
        if let Some(e) = self.entries[i as usize].take() {
            self.by_key.remove(&(e.start, e.end, access_bits(e.access)));
            self.retire(i, e);
        }
    }

    fn retire(&mut self, i: u32, e: Entry) {
        if !e.transient {
            self.bytes -= e.end - e.start;
        }
        self.dead.push(e.mr);
        self.free.push(i);
    }
}

/// Half the memory per CPU, libfabric's default bound.
fn default_max_bytes() -> usize {
    // SAFETY: sysconf only reads system configuration.
    let (pages, size, cpus) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
            libc::sysconf(libc::_SC_NPROCESSORS_ONLN),
        )
    };
    if pages <= 0 || size <= 0 {
        return 1 << 30;
    }
    (pages as usize * size as usize) / (cpus.max(1) as usize) / 2
}

/// Page frame numbers of this process's pages, from `/proc/self/pagemap`.
#[derive(Debug)]
pub(crate) struct PageFrames {
    file: std::fs::File,
}

impl PageFrames {
    /// `None` when frames cannot be read (no pagemap, or frame numbers hidden).
    pub(crate) fn open() -> Option<Self> {
        let file = std::fs::File::open("/proc/self/pagemap").ok()?;
        let f = PageFrames { file };
        // A page we certainly have: the one this variable lives on.
        let probe = [1u8; 1];
        let at = std::hint::black_box(probe.as_ptr()) as usize & !(PAGE - 1);
        let v = f.frames(at, at + PAGE)?;
        (v[0] != 0).then_some(f)
    }

    /// Frame of each page of `[start, end)` (0 for a page not present).
    pub(crate) fn frames(&self, start: usize, end: usize) -> Option<Vec<u64>> {
        use std::os::unix::fs::FileExt;
        let n = (end - start) / PAGE;
        let mut raw = vec![0u8; n * 8];
        self.file
            .read_exact_at(&mut raw, (start / PAGE * 8) as u64)
            .ok()?;
        Some(
            raw.chunks_exact(8)
                .map(|c| {
                    let v = u64::from_le_bytes(c.try_into().expect("8 bytes"));
                    if v >> 63 == 1 {
                        v & ((1 << 55) - 1)
                    } else {
                        0
                    }
                })
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_loopback::{Loopback, LoopbackConfig};
    use weft_provider::bootstrap::Singleton;

    fn provider() -> Loopback {
        let cfg = LoopbackConfig {
            rma: true,
            ..Default::default()
        };
        Loopback::open_with(&mut Singleton::new(), &cfg).unwrap()
    }

    /// Anonymous memory of `pages` pages, touched.
    fn map(pages: usize, at: Option<usize>) -> *mut u8 {
        let len = pages * PAGE;
        let (hint, flags) = match at {
            Some(a) => (a as *mut libc::c_void, libc::MAP_FIXED),
            None => (std::ptr::null_mut(), 0),
        };
        // SAFETY: anonymous private mapping; with MAP_FIXED only over a range this test
        // unmapped itself.
        let p = unsafe {
            libc::mmap(
                hint,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: just mapped, `len` bytes writable.
        unsafe { std::ptr::write_bytes(p as *mut u8, 7, len) };
        p as *mut u8
    }

    fn unmap(p: *mut u8, pages: usize) {
        // SAFETY: a mapping made by `map` with this length.
        assert_eq!(
            unsafe { libc::munmap(p as *mut libc::c_void, pages * PAGE) },
            0
        );
    }

    #[test]
    fn remote_read_keys_are_cached_write_keys_refused_and_revocation_is_immediate() {
        let mut p = provider();
        let mut c = MrCache::with_check(8, usize::MAX, Check::Follows);
        let buf = vec![0u8; 3 * PAGE];
        let at = buf.as_ptr().wrapping_add(100);
        let (ra, r) = c.acquire_remote(&mut p, at, 5000, Access::READ).unwrap();
        let (ra2, r2) = c.acquire_remote(&mut p, at, 5000, Access::READ).unwrap();
        assert_eq!(ra, ra2, "one registration for both sends");
        assert_eq!((c.stats.hits, c.stats.misses), (1, 1));
        // The address a peer presents is the buffer's, inside the page-aligned registration.
        assert_eq!(ra.addr % PAGE as u64, at as u64 % PAGE as u64);
        let w = Access {
            remote_write: true,
            ..Access::LOCAL
        };
        assert!(c.acquire_remote(&mut p, at, 10, w).is_err());
        // Revoked: deregistered at the next reap whoever still holds it; later releases are
        // inert and the next acquire registers anew.
        c.revoke(r);
        assert!(c.has_dead());
        c.reap(&mut p);
        c.release(r2);
        assert_eq!(c.len(), 0);
        let (_, r3) = c.acquire_remote(&mut p, at, 5000, Access::READ).unwrap();
        assert_eq!(c.stats.misses, 2);
        c.release(r3);
        c.clear(&mut p);
    }

    #[test]
    fn reuse_release_and_lru_eviction() {
        let mut p = provider();
        let mut c = MrCache::with_check(2, usize::MAX, Check::Follows);
        let bufs: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; 3 * PAGE]).collect();
        let (d0, r0) = c
            .acquire(&mut p, bufs[0].as_ptr(), 100, Access::LOCAL)
            .unwrap();
        let (d0b, r0b) = c
            .acquire(&mut p, bufs[0].as_ptr(), 100, Access::LOCAL)
            .unwrap();
        assert_eq!(d0, d0b, "same buffer, same rights: one registration");
        assert_eq!(c.stats.hits, 1);
        // Other rights are another registration.
        let (d0w, r0w) = c
            .acquire(&mut p, bufs[0].as_ptr(), 100, Access::LOCAL_WRITE)
            .unwrap();
        assert_ne!(d0, d0w);
        c.release(r0);
        c.release(r0b);
        c.release(r0w);
        // Full (2 entries): a third buffer evicts the least recently used unused one (the
        // LOCAL entry of buffer 0, used before the LOCAL_WRITE one).
        let (_, r2) = c
            .acquire(&mut p, bufs[2].as_ptr(), 100, Access::LOCAL)
            .unwrap();
        assert_eq!(c.stats.evictions, 1);
        assert_eq!(c.len(), 2);
        let (d0c, r0c) = c
            .acquire(&mut p, bufs[0].as_ptr(), 100, Access::LOCAL_WRITE)
            .unwrap();
        assert_eq!(d0c, d0w, "the recently used entry stayed");
        c.reap(&mut p);
        // Every entry in use and the cache full: a registration just for this use.
        let (_, r1) = c
            .acquire(&mut p, bufs[1].as_ptr(), 100, Access::LOCAL)
            .unwrap();
        assert_eq!(c.len(), 3);
        c.release(r1);
        assert_eq!(c.len(), 2, "the transient registration went with its use");
        c.release(r2);
        c.release(r0c);
        c.clear(&mut p);
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn byte_bound_is_kept() {
        let mut p = provider();
        let mut c = MrCache::with_check(100, 4 * PAGE, Check::Follows);
        let a = vec![0u8; 8 * PAGE];
        let (_, r) = c
            .acquire(&mut p, a.as_ptr(), 6 * PAGE, Access::LOCAL)
            .unwrap();
        c.release(r);
        assert_eq!(c.len(), 0, "larger than the byte bound: not kept");
        let (_, r) = c.acquire(&mut p, a.as_ptr(), PAGE, Access::LOCAL).unwrap();
        c.release(r);
        assert_eq!(c.len(), 1);
        assert!(c.bytes <= 4 * PAGE);
    }

    /// The stale-registration rule for pinning providers: a buffer unmapped and mapped again at
    /// the same address gets a new registration, not the old one; an untouched one keeps it.
    #[test]
    fn a_remapped_buffer_never_gets_the_old_registration() {
        let Some(frames) = PageFrames::open() else {
            eprintln!("skipped: page frames are not readable here (needs CAP_SYS_ADMIN)");
            return;
        };
        let mut p = provider();
        let mut c = MrCache::with_check(16, usize::MAX, Check::Frames(frames));
        let a = map(4, None);
        let (d1, r) = c.acquire(&mut p, a, 4 * PAGE, Access::LOCAL).unwrap();
        c.release(r);
        let (d2, r) = c.acquire(&mut p, a, 4 * PAGE, Access::LOCAL).unwrap();
        c.release(r);
        assert_eq!(d1, d2, "same memory: the entry is reused");
        assert_eq!(c.stats.stale, 0);
        // Free and reallocate at the same address: new pages behind the same addresses.
        unmap(a, 4);
        let b = map(4, Some(a as usize));
        assert_eq!(a, b);
        let (d3, r) = c.acquire(&mut p, b, 4 * PAGE, Access::LOCAL).unwrap();
        c.release(r);
        assert_ne!(d3, d1, "a stale registration was reused");
        assert_eq!(c.stats.stale, 1);
        c.clear(&mut p);
        unmap(b, 4);
    }

    #[test]
    fn without_readable_frames_pinning_registrations_are_not_cached() {
        let mut p = provider();
        let mut c = MrCache::with_check(16, usize::MAX, Check::NoCache);
        let a = vec![0u8; PAGE];
        let (d1, r) = c.acquire(&mut p, a.as_ptr(), 10, Access::LOCAL).unwrap();
        c.release(r);
        assert_eq!(c.len(), 0);
        c.reap(&mut p);
        let (d2, r) = c.acquire(&mut p, a.as_ptr(), 10, Access::LOCAL).unwrap();
        c.release(r);
        assert_ne!(d1, d2);
        assert_eq!(c.stats.hits, 0);
    }
}
