//! Cross-Memory Attach: one `process_vm_readv`/`process_vm_writev` per message (both iovec
//! lists go to the kernel as they are, up to `IOV_MAX` entries each), continued when the kernel
//! copies less than asked, with failures classified as a dead peer, a bad address or a denial.
//! Shared by the providers that copy between processes of one host (limic, the soft HCA).

use std::io;

/// Direction of a copy, seen from the calling process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// Remote memory into local buffers (`process_vm_readv`).
    Pull,
    /// Local buffers into remote memory (`process_vm_writev`).
    Push,
}

/// Why a copy failed.
#[derive(Debug)]
pub enum CopyError {
    /// The other process is gone (ESRCH).
    Gone,
    /// An address on either side is not mapped as needed (EFAULT), after `done` bytes.
    Fault {
        done: usize,
    },
    /// The kernel refused (EPERM: ptrace policy, another user, a container boundary).
    Denied(io::Error),
    Other(io::Error),
}

impl std::fmt::Display for CopyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CopyError::Gone => write!(f, "the process is gone"),
            CopyError::Fault { done } => write!(f, "bad address after {done} bytes"),
            CopyError::Denied(e) => write!(f, "cross-memory attach denied: {e}"),
            CopyError::Other(e) => write!(f, "{e}"),
        }
    }
}

/// One memory range, in either process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    pub base: u64,
    pub len: usize,
}

/// The largest iovec count one call takes.
pub const IOV_MAX: usize = 1024;

/// Copy `min(total(local), total(remote), limit)` bytes between `local` (this process) and
/// `remote` (process `pid`), continuing after partial copies. Returns the bytes copied.
///
/// # Safety
/// For `Pull`, `local` must be writable memory of this process that nothing else accesses
/// during the call; for `Push`, readable. `remote` addresses are checked by the kernel.
pub unsafe fn copy(
    pid: i32,
    dir: Dir,
    local: &[Range],
    remote: &[Range],
    limit: usize,
) -> Result<usize, CopyError> {
    let want = local
        .iter()
        .map(|r| r.len)
        .sum::<usize>()
        .min(remote.iter().map(|r| r.len).sum())
        .min(limit);
    let mut done = 0usize;
    // Cursors: (index, offset within the range) on each side.
    let (mut li, mut lo, mut ri, mut ro) = (0usize, 0usize, 0usize, 0usize);
    // On the stack for the usual few ranges: no allocation per copy.
    let mut lv = Iovecs::new();
    let mut rv = Iovecs::new();
    while done < want {
        lv.clear();
        rv.clear();
        fill(&mut lv, local, li, lo, want - done);
        fill(&mut rv, remote, ri, ro, want - done);
        let n = match dir {
            Dir::Pull => libc::process_vm_readv(
                pid,
                lv.as_ptr(),
                lv.len() as libc::c_ulong,
                rv.as_ptr(),
                rv.len() as libc::c_ulong,
                0,
            ),
            Dir::Push => libc::process_vm_writev(
                pid,
                lv.as_ptr(),
                lv.len() as libc::c_ulong,
                rv.as_ptr(),
                rv.len() as libc::c_ulong,
                0,
            ),
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::ESRCH) => CopyError::Gone,
                Some(libc::EFAULT) => CopyError::Fault { done },
                Some(libc::EPERM) => CopyError::Denied(e),
                Some(libc::EINTR) => continue,
                _ => CopyError::Other(e),
            });
        }
        if n == 0 {
            // Nothing copied and no error: the remote range ends at an unmapped page.
            return Err(CopyError::Fault { done });
        }
        let n = n as usize;
        done += n;
        advance(local, &mut li, &mut lo, n);
        advance(remote, &mut ri, &mut ro, n);
    }
    Ok(done)
}

type Iovecs = smallvec::SmallVec<[libc::iovec; 8]>;

/// Up to `IOV_MAX` iovecs of `ranges` from the cursor, covering at most `max` bytes.
fn fill(out: &mut Iovecs, ranges: &[Range], mut i: usize, mut off: usize, max: usize) {
    let mut left = max;
    while i < ranges.len() && left > 0 && out.len() < IOV_MAX {
        let r = ranges[i];
        let n = (r.len - off).min(left);
        if n > 0 {
            out.push(libc::iovec {
                iov_base: (r.base as usize + off) as *mut libc::c_void,
                iov_len: n,
            });
            left -= n;
        }
        i += 1;
        off = 0;
    }
}

/// Move a cursor forward by `n` bytes.
fn advance(ranges: &[Range], i: &mut usize, off: &mut usize, mut n: usize) {
    while n > 0 && *i < ranges.len() {
        let rest = ranges[*i].len - *off;
        if n < rest {
            *off += n;
            return;
        }
        n -= rest;
        *i += 1;
        *off = 0;
    }
    // Skip empty ranges so the cursor rests on data.
    while *i < ranges.len() && ranges[*i].len == *off {
        *i += 1;
        *off = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(bufs: &mut [Vec<u8>]) -> Vec<Range> {
        bufs.iter_mut()
            .map(|b| Range {
                base: b.as_mut_ptr() as u64,
                len: b.len(),
            })
            .collect()
    }

    #[test]
    fn scatter_gather_within_one_process() {
        let me = std::process::id() as i32;
        let src: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let mut s = vec![
            src[..3].to_vec(),
            vec![],
            src[3..5000].to_vec(),
            src[5000..].to_vec(),
        ];
        let mut d = vec![vec![0u8; 4096], vec![0u8; 0], vec![0u8; 7000]];
        let (rs, rd) = (ranges(&mut s), ranges(&mut d));
        // SAFETY: our own buffers, alive for the call.
        let n = unsafe { copy(me, Dir::Pull, &rd, &rs, usize::MAX) }.unwrap();
        assert_eq!(n, 10_000);
        let got: Vec<u8> = d.concat();
        assert_eq!(&got[..10_000], &src[..]);
        // A limit truncates.
        let mut d2 = vec![vec![0u8; 100]];
        let rd2 = ranges(&mut d2);
        // SAFETY: as above.
        let n = unsafe { copy(me, Dir::Push, &rs, &rd2, 50) }.unwrap();
        assert_eq!(n, 50);
        assert_eq!(&d2[0][..50], &src[..50]);
        assert!(d2[0][50..].iter().all(|x| *x == 0));
    }

    #[test]
    fn more_pieces_than_iov_max_and_bad_addresses() {
        let me = std::process::id() as i32;
        let mut s: Vec<Vec<u8>> = (0..3000).map(|i| vec![i as u8; 3]).collect();
        let mut d = vec![vec![0u8; 9000]];
        let (rs, rd) = (ranges(&mut s), ranges(&mut d));
        // SAFETY: our own buffers.
        let n = unsafe { copy(me, Dir::Pull, &rd, &rs, usize::MAX) }.unwrap();
        assert_eq!(n, 9000);
        assert!(d[0].chunks(3).enumerate().all(|(i, c)| c == [i as u8; 3]));
        let bad = [Range { base: 8, len: 100 }];
        // SAFETY: the local side is ours; the remote side is invalid on purpose.
        let e = unsafe { copy(me, Dir::Pull, &rd, &bad, usize::MAX) }.unwrap_err();
        assert!(matches!(e, CopyError::Fault { done: 0 }), "{e}");
    }

    /// Drop CAP_SYS_PTRACE from this thread's effective set (capabilities are per thread).
    fn drop_ptrace_cap() {
        #[repr(C)]
        struct Hdr {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        #[derive(Clone, Copy, Default)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        let mut h = Hdr {
            version: 0x2008_0522,
            pid: 0,
        };
        let mut d = [Data::default(); 2];
        // SAFETY: capget/capset with a version-3 header and two data words, on this thread.
        unsafe {
            assert_eq!(libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()), 0);
            d[0].effective &= !(1 << 19); // CAP_SYS_PTRACE
            assert_eq!(libc::syscall(libc::SYS_capset, &mut h, d.as_ptr()), 0);
        }
    }

    /// The check `open` relies on: a target that is not dumpable, read by a process without
    /// CAP_SYS_PTRACE, is a denial (EPERM), not a crash or a fault.
    #[test]
    fn a_refused_attach_is_reported_as_denied() {
        static WORD: u64 = 0x5eed;
        let mut to_parent = [0i32; 2];
        let mut to_child = [0i32; 2];
        // SAFETY: plain pipe/fork; the child only calls async-signal-safe functions.
        unsafe {
            assert_eq!(libc::pipe(to_parent.as_mut_ptr()), 0);
            assert_eq!(libc::pipe(to_child.as_mut_ptr()), 0);
            let pid = libc::fork();
            assert!(pid >= 0);
            if pid == 0 {
                libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
                let b = [1u8];
                libc::write(to_parent[1], b.as_ptr() as *const _, 1);
                let mut x = [0u8];
                libc::read(to_child[0], x.as_mut_ptr() as *mut _, 1);
                libc::_exit(0);
            }
            let mut x = [0u8];
            assert_eq!(libc::read(to_parent[0], x.as_mut_ptr() as *mut _, 1), 1);
            let r = std::thread::spawn(move || {
                drop_ptrace_cap();
                let mut got = 0u64;
                let local = [Range {
                    base: &mut got as *mut u64 as u64,
                    len: 8,
                }];
                let remote = [Range {
                    base: &WORD as *const u64 as u64,
                    len: 8,
                }];
                copy(pid, Dir::Pull, &local, &remote, 8)
            })
            .join()
            .unwrap();
            libc::write(to_child[1], [1u8].as_ptr() as *const _, 1);
            let mut st = 0;
            libc::waitpid(pid, &mut st, 0);
            for fd in to_parent.iter().chain(&to_child) {
                libc::close(*fd);
            }
            assert!(matches!(r, Err(CopyError::Denied(_))), "{r:?}");
        }
    }

    #[test]
    fn a_gone_process_is_reported() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        child.wait().unwrap();
        let mut d = vec![vec![0u8; 8]];
        let rd = ranges(&mut d);
        // SAFETY: local buffer is ours; the remote process no longer exists.
        let e = unsafe { copy(pid, Dir::Pull, &rd, &rd, usize::MAX) }.unwrap_err();
        assert!(matches!(e, CopyError::Gone), "{e}");
    }
}
