//! Shared-memory building blocks for providers that put queues or windows in memory shared by
//! the ranks of one host (shm, limic, third-party providers): named mappings, the naming
//! convention the launcher relies on to clean up after a crash, and peer liveness.
//!
//! Naming: every object is `/dev/shm/weft-<job id>-h<host>...`; a provider creates its objects,
//! lets the other local ranks map them and unlinks them before `open` returns on any rank, so
//! a crash later leaves nothing behind (and `weft run` removes `weft-<job id>-*` leftovers of
//! ranks killed during start-up).

use crate::{Error, ErrorDetail, Result};
use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};

/// `/weft-<job>-h<host>` with the job id reduced to safe characters.
pub fn object_name(job: &str, host: u32) -> String {
    let clean: String = job
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(180)
        .collect();
    format!("/weft-{clean}-h{host}")
}

fn os_err(what: String) -> Error {
    Error::last_os(what)
}

/// A named, mapped shared-memory object: created by one rank (mode 0600), opened by the
/// others, unlinked once everyone has it (or when its creator drops it early).
pub struct Mapping {
    base: *mut u8,
    len: usize,
    name: CString,
    created: bool,
    unlinked: bool,
}

// SAFETY: the mapping is plain shared memory owned by this value; concurrent access goes
// through atomics or the queue protocols, and the owner is used from one thread at a time.
unsafe impl Send for Mapping {}

impl Mapping {
    /// Create and map `len` bytes (zero-filled). `populate` pre-faults the pages.
    pub fn create(name: &str, len: usize, populate: bool) -> Result<Mapping> {
        let cname = CString::new(name).map_err(|_| Error::invalid("segment name has a NUL"))?;
        // SAFETY: FFI with a valid C string; O_EXCL makes us the only creator.
        let fd = unsafe {
            libc::shm_open(
                cname.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC,
                0o600,
            )
        };
        if fd < 0 {
            return Err(os_err(format!("creating shared memory {name}")));
        }
        let mut m = Mapping {
            base: std::ptr::null_mut(),
            len,
            name: cname,
            created: true,
            unlinked: false,
        };
        // SAFETY: fd is ours; ftruncate zero-fills.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            let e = os_err(format!("sizing {name} to {len} bytes"));
            // SAFETY: closing our own fd.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        let r = m.map(fd, populate);
        // SAFETY: closing our own fd; the mapping stays.
        unsafe { libc::close(fd) };
        r?;
        Ok(m)
    }

    /// Open and map an object another rank created; its size must be at least `min_len`.
    pub fn open(name: &str, min_len: usize, populate: bool) -> Result<Mapping> {
        let cname = CString::new(name).map_err(|_| Error::invalid("segment name has a NUL"))?;
        // SAFETY: FFI with a valid C string.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
        if fd < 0 {
            return Err(os_err(format!("opening shared memory {name}")));
        }
        // SAFETY: fstat on our fd into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(fd, &mut st) } != 0 || (st.st_size as usize) < min_len.max(1) {
            // SAFETY: closing our own fd.
            unsafe { libc::close(fd) };
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "shared memory {name} is missing or too small"
            ))));
        }
        let mut m = Mapping {
            base: std::ptr::null_mut(),
            len: st.st_size as usize,
            name: cname,
            created: false,
            unlinked: false,
        };
        let r = m.map(fd, populate);
        // SAFETY: closing our own fd.
        unsafe { libc::close(fd) };
        r?;
        Ok(m)
    }

    fn map(&mut self, fd: i32, populate: bool) -> Result<()> {
        let flags = libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 };
        // SAFETY: mapping `len` bytes of a shared memory object we just sized/checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mapping shared memory".to_string()));
        }
        self.base = p as *mut u8;
        Ok(())
    }

    pub fn base(&self) -> *mut u8 {
        self.base
    }

    #[allow(clippy::len_without_is_empty)] // a mapping is never empty
    pub fn len(&self) -> usize {
        self.len
    }

    /// Remove the name (idempotent; the mapping stays valid).
    pub fn unlink(&mut self) {
        if !self.unlinked {
            // SAFETY: FFI with a valid C string; failure (already gone) is harmless.
            unsafe { libc::shm_unlink(self.name.as_ptr()) };
            self.unlinked = true;
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.created && !self.unlinked {
            self.unlink();
        }
        if !self.base.is_null() {
            // SAFETY: unmapping our own mapping; nothing borrows it past the owner's life.
            unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
        }
    }
}

/// Rank states in [`RankSlot::state`].
pub const ST_OPEN: u64 = 1;
pub const ST_CLOSED: u64 = 2;

/// A rank's liveness record in shared memory: its pid and whether it has closed.
#[repr(C, align(64))]
pub struct RankSlot {
    pub pid: AtomicU64,
    pub state: AtomicU64,
}

impl RankSlot {
    /// Mark this process open (at the end of `open`).
    pub fn set_open(&self) {
        self.pid.store(std::process::id() as u64, Ordering::Relaxed);
        self.state.store(ST_OPEN, Ordering::Release);
    }

    /// Mark this process closed (orderly shutdown).
    pub fn set_closed(&self) {
        self.state.store(ST_CLOSED, Ordering::Release);
    }

    /// Why the rank this slot describes is gone, if it is: it closed, or its process no
    /// longer runs (exited, including a zombie nobody has reaped yet). Prefer [`Watch::gone`],
    /// which follows the process itself rather than its pid.
    pub fn gone(&self) -> Option<&'static str> {
        let state = self.state.load(Ordering::Acquire);
        let pid = self.pid.load(Ordering::Relaxed) as i32;
        if state == ST_CLOSED {
            Some("rank exited")
        } else if state == ST_OPEN && pid > 0 && pid as u32 != std::process::id() {
            pid_gone(pid).then_some("process died")
        } else {
            None
        }
    }
}

/// Whether process `pid` no longer runs: it does not exist, or it is a zombie (`kill(pid, 0)`
/// alone calls a zombie alive). A killed process whose parent has not reaped it yet (`weft run`
/// keeps a killed rank's status until it reports it) will never finish what it was doing.
pub fn pid_gone(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence.
    let r = unsafe { libc::kill(pid, 0) };
    if r != 0 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    }
    // /proc/<pid>/stat: "pid (comm) S ...", the state after the last ')'.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|st| {
            st.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with(['Z', 'X']))
        })
        .unwrap_or(false)
}

/// Liveness of the local peers by process handle: a pidfd (`pidfd_open`, Linux 5.3) names one
/// process for good, so a recycled pid is never taken for the peer, and it becomes readable
/// when the process exits, zombie or not. Where pidfds are not available, falls back to the
/// pid (with the zombie check).
pub struct Watch {
    fds: Vec<Option<std::os::fd::OwnedFd>>,
}

impl Watch {
    /// Watch the processes of `slots` (every one open), except this process's own.
    pub fn new<'a>(slots: impl Iterator<Item = &'a RankSlot>) -> Watch {
        Watch::of_pids(slots.map(|s| s.pid.load(Ordering::Relaxed) as i32))
    }

    /// Watch processes by pid, the `i`-th as `i`; 0 or less, or this process's own, is not
    /// watched. A process that exits before this call is never reported (its pidfd cannot
    /// be opened): callers watch peers known to run, e.g. right after an exchange with them.
    pub fn of_pids(pids: impl Iterator<Item = i32>) -> Watch {
        let fds = pids
            .map(|pid| {
                if pid <= 0 || pid as u32 == std::process::id() {
                    return None;
                }
                // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
                let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
                // SAFETY: a descriptor the kernel just gave us, owned from here on.
                (fd >= 0).then(|| unsafe {
                    <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32)
                })
            })
            .collect();
        Watch { fds }
    }

    /// The watched processes that have exited, by index, with one `poll` for all of them;
    /// `skip(i)` leaves out those the caller already knows about.
    pub fn exited(&self, skip: impl Fn(usize) -> bool) -> Vec<usize> {
        let (mut fds, mut idx) = (Vec::new(), Vec::new());
        for (i, fd) in self.fds.iter().enumerate() {
            if let Some(fd) = fd.as_ref().filter(|_| !skip(i)) {
                fds.push(libc::pollfd {
                    fd: std::os::fd::AsRawFd::as_raw_fd(fd),
                    events: libc::POLLIN,
                    revents: 0,
                });
                idx.push(i);
            }
        }
        if fds.is_empty() {
            return Vec::new();
        }
        // SAFETY: `fds` is a valid array of `fds.len()` pollfds on descriptors we own; no wait.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) };
        if n <= 0 {
            return Vec::new();
        }
        fds.iter()
            .zip(idx)
            .filter(|(p, _)| p.revents & libc::POLLIN != 0)
            .map(|(_, i)| i)
            .collect()
    }

    /// Why local rank `i` (whose liveness record is `slot`) is gone, if it is.
    pub fn gone(&self, i: usize, slot: &RankSlot) -> Option<&'static str> {
        if slot.state.load(Ordering::Acquire) == ST_CLOSED {
            return Some("rank exited");
        }
        match self.fds.get(i) {
            Some(Some(fd)) => {
                let mut p = libc::pollfd {
                    fd: std::os::fd::AsRawFd::as_raw_fd(fd),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, no waiting.
                let n = unsafe { libc::poll(&mut p, 1, 0) };
                (n > 0 && p.revents & libc::POLLIN != 0).then_some("process died")
            }
            _ => slot.gone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_reports_a_process_that_exits() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let w = Watch::of_pids([0, std::process::id() as i32, child.id() as i32].into_iter());
        assert!(w.exited(|_| false).is_empty());
        child.kill().unwrap();
        // Not reaped yet: a zombie counts as exited.
        let t0 = std::time::Instant::now();
        let got = loop {
            let e = w.exited(|_| false);
            if !e.is_empty() || t0.elapsed().as_secs() > 10 {
                break e;
            }
            std::thread::yield_now();
        };
        assert_eq!(got, vec![2]);
        assert!(w.exited(|i| i == 2).is_empty(), "skipped");
        child.wait().unwrap();
    }

    #[test]
    fn create_open_unlink() {
        let name = format!(
            "{}-test",
            object_name(&format!("t{}", std::process::id()), 0)
        );
        let a = Mapping::create(&name, 8192, false).unwrap();
        // SAFETY: writing into our fresh mapping.
        unsafe { *a.base() = 42 };
        let mut b = Mapping::open(&name, 4096, false).unwrap();
        // SAFETY: reading the byte written through the other mapping.
        assert_eq!(unsafe { *b.base() }, 42);
        assert!(Mapping::create(&name, 8192, false).is_err(), "O_EXCL");
        b.unlink();
        assert!(Mapping::open(&name, 1, false).is_err());
        drop(a);
        let slot = RankSlot {
            pid: AtomicU64::new(0),
            state: AtomicU64::new(0),
        };
        assert_eq!(slot.gone(), None);
        slot.set_open();
        assert_eq!(slot.gone(), None);
        slot.set_closed();
        assert_eq!(slot.gone(), Some("rank exited"));
    }

    /// A process that exited is gone even while it is a zombie (before, `kill(pid, 0)`
    /// called it alive until its parent reaped it), and a watch follows the process, not a
    /// pid that could be given to another.
    #[test]
    fn zombies_are_gone() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let slot = RankSlot {
            pid: AtomicU64::new(child.id() as u64),
            state: AtomicU64::new(ST_OPEN),
        };
        let watch = Watch::new(std::iter::once(&slot));
        let t0 = std::time::Instant::now();
        // Not reaped: the child stays a zombie while we look.
        while watch.gone(0, &slot).is_none() || slot.gone().is_none() {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(20),
                "never seen gone"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(pid_gone(child.id() as i32), "a zombie counts as gone");
        child.wait().unwrap();
        assert_eq!(watch.gone(0, &slot), Some("process died"));
    }

    #[test]
    fn names_are_safe() {
        assert_eq!(object_name("weft-1-2", 3), "/weft-weft-1-2-h3");
        assert_eq!(object_name("a/b c", 0), "/weft-a_b_c-h0");
    }
}
