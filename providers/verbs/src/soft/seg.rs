//! The soft HCA's shared segment: what one process's HCA exposes to the initiators of other
//! processes on its host — its memory-region table, the responder half of its QPs (receive
//! queues, expected PSN, atomic replay table), its completion queues and shared receive queues,
//! the stripes of its atomic lock, and its device memory.
//!
//! The segment is an anonymous `memfd`: there is no name in `/dev/shm` to leak. A peer maps it
//! by duplicating the descriptor out of the owner with `pidfd_getfd` (Linux 5.6; the same
//! ptrace permission Cross-Memory Attach already needs), so the first contact needs nothing
//! but the owner's GID, which carries its pid, the descriptor number and a nonce (and, for
//! peers on other hosts, the UDP address of its wire service and a host tag; see `wire`).
//!
//! Everything a peer reads or writes in here is an atomic (or a ring record published through
//! one); a peer's header is validated before use, so a stray or malicious GID is an error, not
//! an out-of-range access.

use crate::types::Gid;
use std::sync::atomic::Ordering;
use std::sync::atomic::{AtomicU32, AtomicU64};
use weft_provider::{Error, ErrorDetail, Result};

pub const MAGIC: u64 = u64::from_le_bytes(*b"WEFTHCA1");
/// The seals a segment carries: fixed size, seals fixed.
const SEALS: i32 = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
pub const VERSION: u32 = 3;
/// SGEs a receive work request may have (the device's `max_sge`).
pub const MAX_SGE: usize = 8;
/// Words of a receive WQE record: wr_id, SGE count, then address and (length, lkey) per SGE.
pub const WQE_WORDS: usize = 2 + 2 * MAX_SGE;
/// Words of a completion record.
pub const CQE_WORDS: usize = 5;
/// Hazard words per attached initiator (one per key it may hold at once).
pub const HAZARDS: usize = 15;
/// Attach slots (initiators that may map a segment at once) unless configured
/// (`WEFT_VERBS_SOFT_MAX_PEERS`; the owner's wire service takes one).
pub const ATTACH_SLOTS: u32 = 4096;
pub const LOCK_STRIPES: usize = 64;
/// Hazard words: the rkey of an RDMA operation, the lkeys of a receive's SGEs, and the QP,
/// SRQ and CQ an operation is using (tagged so they never equal a key).
pub const HZ_RKEY: usize = 0;
pub const HZ_RECV: usize = 1;
pub const HZ_QP: usize = 9;
pub const HZ_SRQ: usize = 10;
pub const HZ_CQ: usize = 11;
/// The ring position an initiator is claiming (`ring::claim_tag`).
pub const HZ_RING: usize = 12;
pub const TAG_QP: u64 = 1 << 62;
pub const TAG_SRQ: u64 = 1 << 61;
pub const TAG_CQ: u64 = 1 << 60;
/// Atomic replay entries per QP (above `max_dest_rd_atomic`'s largest value, 16).
pub const REPLAY: usize = 16;

/// MR kinds.
pub const MR_USER: u32 = 0;
pub const MR_DM: u32 = 1;

#[repr(C, align(128))]
pub struct Header {
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub pid: AtomicU32,
    pub nonce: AtomicU64,
    pub len: AtomicU64,
    pub max_mr: AtomicU32,
    pub max_qp: AtomicU32,
    pub max_cq: AtomicU32,
    pub max_srq: AtomicU32,
    pub heap_off: AtomicU64,
    pub heap_len: AtomicU64,
    /// Set when the owner closes the device.
    pub closed: AtomicU32,
    /// Fault injection: set, the HCA answers nothing (a peer that stops responding).
    pub mute: AtomicU32,
    /// Attach slots the segment has, and one past the highest ever taken (owners scan up to
    /// it only).
    pub max_attach: AtomicU32,
    pub attach_hw: AtomicU32,
}

/// An initiator's claim on this segment: its pid, and the keys it is using right now.
#[repr(C, align(128))]
pub struct AttachSlot {
    pub pid: AtomicU64,
    pub hz: [AtomicU64; HAZARDS],
}

#[repr(C, align(64))]
pub struct MrEntry {
    /// 0 while free or being changed; else the key (lkey = rkey).
    pub key: AtomicU32,
    pub pd: AtomicU32,
    pub access: AtomicU32,
    pub kind: AtomicU32,
    /// The region as the owner registered it: its virtual address and length.
    pub addr: AtomicU64,
    pub len: AtomicU64,
    /// [`MR_DM`]: where `addr` is in the heap.
    pub off: AtomicU64,
}

#[repr(C, align(128))]
pub struct QpEntry {
    /// 0 while the slot is free.
    pub qpn: AtomicU32,
    pub state: AtomicU32,
    pub qp_type: AtomicU32,
    pub pd: AtomicU32,
    pub recv_cq: AtomicU32,
    /// SRQ index + 1, 0 for none.
    pub srq: AtomicU32,
    pub rq_cap: AtomicU32,
    pub min_rnr_timer: AtomicU32,
    pub rq_off: AtomicU64,
    pub dest_qpn: AtomicU32,
    pub qkey: AtomicU32,
    pub dest_gid: [AtomicU64; 2],
    /// Responder: the PSN it expects next.
    pub epsn: AtomicU32,
    pub max_dest_rd_atomic: AtomicU32,
    /// Remote rights the QP grants (`qp_access_flags`).
    pub access: AtomicU32,
    /// Why a peer moved this responder QP to the error state (the `WcStatus` its request
    /// got: remote access or invalid request), 0 if none did; cleared at create and reset.
    /// Lets the owner raise the asynchronous event a hardware HCA would.
    pub fault: AtomicU32,
    /// Buffer bytes of the receives taken (by initiators, or flushed) since the QP was made
    /// or reset. The owner keeps what it posted in its own memory: a counter both sides
    /// wrote moved a cache line between them on every message.
    pub rq_taken: AtomicU64,
    /// Atomic replay: PSN + 1 (0 = empty) and the value the atomic returned.
    pub replay_psn: [AtomicU64; REPLAY],
    pub replay_val: [AtomicU64; REPLAY],
}

#[repr(C, align(64))]
pub struct CqEntry {
    pub cap: AtomicU32,
    pub live: AtomicU32,
    /// Set by a producer that found the ring full (`IBV_EVENT_CQ_ERR`).
    pub overrun: AtomicU32,
    pub _r: AtomicU32,
    pub off: AtomicU64,
}

#[repr(C, align(64))]
pub struct SrqEntry {
    pub cap: AtomicU32,
    pub live: AtomicU32,
    pub pd: AtomicU32,
    /// Armed limit (0 = disarmed) and whether it fired.
    pub limit: AtomicU32,
    pub event: AtomicU32,
    pub _r: AtomicU32,
    pub off: AtomicU64,
    /// Buffer bytes of the receives taken since the SRQ was made (the owner keeps what it
    /// posted, as for a QP's `rq_taken`).
    pub taken: AtomicU64,
}

/// Offsets of the tables, from the limits (identical on both sides, checked on attach).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub max_attach: u32,
    pub max_mr: u32,
    pub max_qp: u32,
    pub max_cq: u32,
    pub max_srq: u32,
    pub attach: usize,
    pub locks: usize,
    pub mr: usize,
    pub qp: usize,
    pub cq: usize,
    pub srq: usize,
    pub heap: usize,
    pub heap_len: usize,
    pub len: usize,
}

fn up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

impl Layout {
    pub fn new(
        max_attach: u32,
        max_mr: u32,
        max_qp: u32,
        max_cq: u32,
        max_srq: u32,
        heap_len: usize,
    ) -> Layout {
        let attach = up(std::mem::size_of::<Header>(), 4096);
        let locks = attach + max_attach as usize * std::mem::size_of::<AttachSlot>();
        let mr = up(locks + LOCK_STRIPES * 8, 128);
        let qp = up(mr + max_mr as usize * std::mem::size_of::<MrEntry>(), 128);
        let cq = up(qp + max_qp as usize * std::mem::size_of::<QpEntry>(), 128);
        let srq = up(cq + max_cq as usize * std::mem::size_of::<CqEntry>(), 128);
        let heap = up(
            srq + max_srq as usize * std::mem::size_of::<SrqEntry>(),
            4096,
        );
        let heap_len = up(heap_len, 4096);
        Layout {
            max_attach,
            max_mr,
            max_qp,
            max_cq,
            max_srq,
            attach,
            locks,
            mr,
            qp,
            cq,
            srq,
            heap,
            heap_len,
            len: heap + heap_len,
        }
    }
}

/// How a soft HCA is reached from other hosts: the address of its wire service (none when
/// `WEFT_VERBS_SOFT_ADDR=off`) and the tag of its host (boot and network namespace).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Net {
    pub addr: Option<std::net::SocketAddrV4>,
    pub host: u16,
}

/// A mapping of some process's segment (our own, or a peer's).
pub struct Seg {
    base: *mut u8,
    pub lay: Layout,
    fd: i32,
    /// The GID of a segment we created (computed once: `getpid` is a system call).
    own: Option<Gid>,
}

// SAFETY: the mapping is shared memory accessed only through atomics and the ring protocol;
// the pointer stays valid until drop, which unmaps it.
unsafe impl Send for Seg {}
// SAFETY: as above.
unsafe impl Sync for Seg {}

fn os(what: &str) -> Error {
    Error::last_os(what.to_string())
}

impl Seg {
    /// Create this process's segment; `net` goes into its GID.
    pub fn create(lay: Layout, net: Net) -> Result<Seg> {
        // SAFETY: FFI with a valid C string; returns a new descriptor or -1.
        let fd = unsafe {
            libc::memfd_create(
                c"weft-soft-hca".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(os("memfd_create for the soft HCA"));
        }
        // SAFETY: our descriptor; ftruncate zero-fills (sparse: untouched pages cost nothing).
        if unsafe { libc::ftruncate(fd, lay.len as libc::off_t) } != 0 {
            let e = os("sizing the soft HCA segment");
            // SAFETY: closing our own descriptor.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        // Sealed at its size: no process that maps it (a peer holds a duplicate of the
        // descriptor) can shrink it under the others' mappings, which would make their next
        // access a SIGBUS, nor grow it or lift the seals.
        // SAFETY: fcntl on our own descriptor.
        if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, SEALS) } != 0 {
            let e = os("sealing the soft HCA segment");
            // SAFETY: closing our own descriptor.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        let base = map(fd, lay.len).inspect_err(|_| {
            // SAFETY: closing our own descriptor.
            unsafe { libc::close(fd) };
        })?;
        let mut s = Seg {
            base,
            lay,
            fd,
            own: None,
        };
        let h = s.header();
        h.version.store(VERSION, Ordering::Relaxed);
        h.pid.store(std::process::id(), Ordering::Relaxed);
        h.len.store(lay.len as u64, Ordering::Relaxed);
        h.max_mr.store(lay.max_mr, Ordering::Relaxed);
        h.max_qp.store(lay.max_qp, Ordering::Relaxed);
        h.max_cq.store(lay.max_cq, Ordering::Relaxed);
        h.max_srq.store(lay.max_srq, Ordering::Relaxed);
        h.max_attach.store(lay.max_attach, Ordering::Relaxed);
        h.heap_off.store(lay.heap as u64, Ordering::Relaxed);
        h.heap_len.store(lay.heap_len as u64, Ordering::Relaxed);
        h.nonce.store(nonce(), Ordering::Relaxed);
        h.magic.store(MAGIC, Ordering::Release);
        let fd16 = u16::try_from(fd).map_err(|_| {
            Error::invalid("soft HCA: the segment's descriptor number does not fit a GID")
        })?;
        s.own = Some(make_gid(net, fd16, h_nonce(&s)));
        Ok(s)
    }

    /// Map the segment of the process `gid` names, checking that it is one.
    pub fn attach(gid: &Gid) -> Result<Seg> {
        let (pid, fd, nonce) = parse_gid(gid)?;
        let bad = |what: String| Error::from(ErrorDetail::Unsupported(format!("soft HCA: {what}")));
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let pfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) } as i32;
        if pfd < 0 {
            return Err(Error::peer_failed(
                0,
                format!(
                    "soft HCA of process {pid} is gone ({})",
                    std::io::Error::last_os_error()
                ),
            ));
        }
        // SAFETY: pidfd_getfd duplicates descriptor `fd` of the process behind `pfd`.
        let mine = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pfd, fd as i32, 0) } as i32;
        let err = std::io::Error::last_os_error();
        // SAFETY: closing the pidfd we opened.
        unsafe { libc::close(pfd) };
        if mine < 0 {
            // ESRCH: the process has exited (a zombie still has a pid, no descriptors).
            if err.raw_os_error() == Some(libc::ESRCH) {
                return Err(Error::peer_failed(
                    0,
                    format!("soft HCA of process {pid} is gone (it exited)"),
                ));
            }
            return Err(bad(format!(
                "cannot reach the segment of process {pid} (pidfd_getfd: {err})"
            )));
        }
        // A segment that could shrink under our mapping is not mapped.
        // SAFETY: fcntl on our descriptor.
        let seals = unsafe { libc::fcntl(mine, libc::F_GET_SEALS) };
        if seals < 0 || seals & SEALS != SEALS {
            // SAFETY: our descriptor.
            unsafe { libc::close(mine) };
            return Err(bad(format!(
                "process {pid}'s descriptor {fd} is not a sealed HCA segment"
            )));
        }
        // SAFETY: fstat on our descriptor into a zeroed struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let ok = unsafe { libc::fstat(mine, &mut st) } == 0;
        let size = st.st_size as usize;
        if !ok || size < std::mem::size_of::<Header>() {
            // SAFETY: our descriptor.
            unsafe { libc::close(mine) };
            return Err(bad(format!(
                "process {pid}'s descriptor {fd} is not an HCA segment"
            )));
        }
        let base = map(mine, size).inspect_err(|_| {
            // SAFETY: our descriptor.
            unsafe { libc::close(mine) };
        })?;
        let mut s = Seg {
            base,
            lay: Layout::new(0, 0, 0, 0, 0, 0),
            fd: mine,
            own: None,
        };
        let h = s.header();
        if h.magic.load(Ordering::Acquire) != MAGIC
            || h.version.load(Ordering::Relaxed) != VERSION
            || h.nonce.load(Ordering::Relaxed) as u16 != nonce
            || h.pid.load(Ordering::Relaxed) != pid
            || h.len.load(Ordering::Relaxed) as usize != size
        {
            return Err(bad(format!(
                "process {pid}'s descriptor {fd} is not the HCA segment the GID names"
            )));
        }
        let lay = Layout::new(
            h.max_attach.load(Ordering::Relaxed),
            h.max_mr.load(Ordering::Relaxed),
            h.max_qp.load(Ordering::Relaxed),
            h.max_cq.load(Ordering::Relaxed),
            h.max_srq.load(Ordering::Relaxed),
            h.heap_len.load(Ordering::Relaxed) as usize,
        );
        if lay.len != size || lay.heap as u64 != h.heap_off.load(Ordering::Relaxed) {
            return Err(bad(format!(
                "process {pid}'s HCA segment has an inconsistent layout"
            )));
        }
        s.lay = lay;
        Ok(s)
    }

    /// The GID of our own segment.
    pub fn gid(&self) -> Gid {
        self.own.unwrap_or(Gid([0; 16]))
    }

    pub fn header(&self) -> &Header {
        // SAFETY: the header is at the start of a mapping at least that long (checked).
        unsafe { &*(self.base as *const Header) }
    }

    pub fn pid(&self) -> u32 {
        self.header().pid.load(Ordering::Relaxed)
    }

    /// Attach slots that may be taken: up to one past the highest ever taken.
    pub fn attached(&self) -> usize {
        (self.header().attach_hw.load(Ordering::SeqCst) as usize).min(self.lay.max_attach as usize)
    }

    /// Panics if `i` is not below the segment's `max_attach`.
    pub fn attach_slot(&self, i: usize) -> &AttachSlot {
        assert!(i < self.lay.max_attach as usize);
        // SAFETY: within the attach table of the validated layout.
        unsafe { &*(self.base.add(self.lay.attach) as *const AttachSlot).add(i) }
    }

    pub fn lock(&self, i: usize) -> &AtomicU64 {
        // SAFETY: within the lock stripes of the validated layout.
        unsafe { &*(self.base.add(self.lay.locks) as *const AtomicU64).add(i % LOCK_STRIPES) }
    }

    pub fn mr(&self, i: usize) -> Option<&MrEntry> {
        // SAFETY: bounds-checked index into the MR table.
        (i < self.lay.max_mr as usize)
            .then(|| unsafe { &*(self.base.add(self.lay.mr) as *const MrEntry).add(i) })
    }

    pub fn qp(&self, i: usize) -> Option<&QpEntry> {
        // SAFETY: bounds-checked index into the QP table.
        (i < self.lay.max_qp as usize)
            .then(|| unsafe { &*(self.base.add(self.lay.qp) as *const QpEntry).add(i) })
    }

    pub fn cq(&self, i: usize) -> Option<&CqEntry> {
        // SAFETY: bounds-checked index into the CQ table.
        (i < self.lay.max_cq as usize)
            .then(|| unsafe { &*(self.base.add(self.lay.cq) as *const CqEntry).add(i) })
    }

    pub fn srq(&self, i: usize) -> Option<&SrqEntry> {
        // SAFETY: bounds-checked index into the SRQ table.
        (i < self.lay.max_srq as usize)
            .then(|| unsafe { &*(self.base.add(self.lay.srq) as *const SrqEntry).add(i) })
    }

    /// A pointer to `[off, off + len)` of the heap, if that lies inside it.
    pub fn heap(&self, off: u64, len: usize) -> Option<*mut u8> {
        let end = off.checked_add(len as u64)?;
        (end <= self.lay.heap_len as u64)
            // SAFETY: inside the heap part of the mapping (checked just above).
            .then(|| unsafe { self.base.add(self.lay.heap + off as usize) })
    }

    /// The ring at heap offset `off` with `cap` records of at most `W` words, if it fits the
    /// heap.
    pub fn ring<const W: usize>(&self, off: u64, cap: u32) -> Option<super::ring::Ring<'_, W>> {
        if cap == 0 || !cap.is_power_of_two() || off % 128 != 0 {
            return None;
        }
        let p = self.heap(off, super::ring::ring_bytes::<W>(cap as usize))?;
        // SAFETY: the range lies inside our mapping, 128-aligned (heap is page aligned), and
        // rings are only ever reached through their protocol.
        Some(unsafe { super::ring::Ring::at(p, cap as usize) })
    }

    pub fn heap_base(&self) -> *mut u8 {
        // SAFETY: the heap starts inside the mapping.
        unsafe { self.base.add(self.lay.heap) }
    }
}

impl Drop for Seg {
    fn drop(&mut self) {
        // SAFETY: unmapping and closing what this value owns.
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.lay.len.max(1));
            libc::close(self.fd);
        }
    }
}

fn map(fd: i32, len: usize) -> Result<*mut u8> {
    // SAFETY: mapping `len` bytes of a descriptor we hold, shared.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os("mapping the soft HCA segment"));
    }
    Ok(p as *mut u8)
}

pub(crate) fn nonce() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom into our buffer.
    let n = unsafe { libc::getrandom(b.as_mut_ptr() as *mut libc::c_void, 8, 0) };
    let v = u64::from_le_bytes(b);
    if n == 8 && v as u32 != 0 {
        v
    } else {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        (t ^ (std::process::id() as u64) << 20) | 1
    }
}

fn h_nonce(s: &Seg) -> u16 {
    s.header().nonce.load(Ordering::Relaxed) as u16
}

/// A soft-HCA GID: `[0..4]` IPv4 address and `[4..6]` UDP port of the wire service (big
/// endian, as on the wire; zero when it has none), `[6..8]` host tag, `[8..12]` pid,
/// `[12..14]` segment descriptor, `[14..16]` nonce (little endian).
pub fn make_gid(net: Net, fd: u16, nonce: u16) -> Gid {
    let mut g = [0u8; 16];
    if let Some(a) = net.addr {
        g[..4].copy_from_slice(&a.ip().octets());
        g[4..6].copy_from_slice(&a.port().to_be_bytes());
    }
    g[6..8].copy_from_slice(&net.host.to_le_bytes());
    g[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    g[12..14].copy_from_slice(&fd.to_le_bytes());
    g[14..].copy_from_slice(&nonce.to_le_bytes());
    Gid(g)
}

/// How the owner of GID `g` is reached from another host.
pub fn gid_net(g: &Gid) -> Net {
    let ip = std::net::Ipv4Addr::new(g.0[0], g.0[1], g.0[2], g.0[3]);
    let port = u16::from_be_bytes([g.0[4], g.0[5]]);
    Net {
        addr: (port != 0 && !ip.is_unspecified()).then(|| std::net::SocketAddrV4::new(ip, port)),
        host: u16::from_le_bytes([g.0[6], g.0[7]]),
    }
}

/// (pid, descriptor, nonce) of a soft-HCA GID.
pub fn parse_gid(g: &Gid) -> Result<(u32, u32, u16)> {
    let pid = u32::from_le_bytes([g.0[8], g.0[9], g.0[10], g.0[11]]);
    let fd = u16::from_le_bytes([g.0[12], g.0[13]]) as u32;
    let n = u16::from_le_bytes([g.0[14], g.0[15]]);
    if pid == 0 || pid > i32::MAX as u32 || gid_net(g).host == 0 {
        return Err(Error::invalid(
            "not a soft-HCA GID (no host tag, or an impossible pid)",
        ));
    }
    Ok((pid, fd, n))
}

/// Record of a receive WQE.
pub fn wqe_record(wr_id: u64, sges: &[crate::Sge]) -> [u64; WQE_WORDS] {
    let mut r = [0u64; WQE_WORDS];
    r[0] = wr_id;
    r[1] = sges.len() as u64;
    for (i, s) in sges.iter().enumerate() {
        r[2 + 2 * i] = s.addr;
        r[3 + 2 * i] = (s.length as u64) << 32 | s.lkey as u64;
    }
    r
}

/// Words a WQE record with `sges` in its count word uses (what a ring moves of it).
pub fn wqe_words(sges: u64) -> usize {
    2 + 2 * (sges as usize).min(MAX_SGE)
}

/// The words of a WQE record that are used: what to push.
pub fn wqe_used(r: &[u64; WQE_WORDS]) -> &[u64] {
    &r[..wqe_words(r[1])]
}

/// The SGEs of a WQE record (at most [`MAX_SGE`], whatever the record says).
pub fn wqe_sges(r: &[u64; WQE_WORDS]) -> smallvec::SmallVec<[crate::Sge; 4]> {
    let n = (r[1] as usize).min(MAX_SGE);
    (0..n)
        .map(|i| crate::Sge {
            addr: r[2 + 2 * i],
            length: (r[3 + 2 * i] >> 32) as u32,
            lkey: r[3 + 2 * i] as u32,
        })
        .collect()
}

/// Record of a completion, and back.
pub fn cqe_record(wc: &crate::Wc) -> [u64; CQE_WORDS] {
    [
        wc.wr_id,
        wc.status as u64 | (wc.opcode as u64) << 32,
        wc.byte_len as u64 | (wc.imm.unwrap_or(0) as u64) << 32,
        wc.qp_num as u64 | (wc.src_qp as u64) << 32,
        wc.imm.is_some() as u64 | (wc.grh as u64) << 1,
    ]
}

pub fn cqe_parse(r: &[u64; CQE_WORDS]) -> Option<crate::Wc> {
    Some(crate::Wc {
        wr_id: r[0],
        status: crate::WcStatus::from_u32(r[1] as u32)?,
        opcode: crate::WcOpcode::from_u32((r[1] >> 32) as u32)?,
        byte_len: r[2] as u32,
        imm: (r[4] & 1 != 0).then_some((r[2] >> 32) as u32),
        qp_num: r[3] as u32,
        src_qp: (r[3] >> 32) as u32,
        grh: r[4] & 2 != 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attach_to_own_segment_and_refuse_strangers() {
        let net = Net {
            addr: None,
            host: 7,
        };
        let s = Seg::create(Layout::new(8, 16, 16, 4, 4, 1 << 20), net).unwrap();
        let g = s.gid();
        let p = Seg::attach(&g).unwrap();
        assert_eq!(p.lay, s.lay);
        s.mr(3).unwrap().key.store(77, Ordering::Release);
        assert_eq!(p.mr(3).unwrap().key.load(Ordering::Acquire), 77);
        assert!(p.mr(16).is_none() && p.heap((1 << 20) - 8, 16).is_none());
        let mut wrong = g;
        wrong.0[14] ^= 1;
        assert!(Seg::attach(&wrong).is_err(), "nonce mismatch");
        let mut fd0 = g;
        fd0.0[12..14].copy_from_slice(&0u16.to_le_bytes());
        assert!(Seg::attach(&fd0).is_err(), "stdin is not a segment");
        assert!(Seg::attach(&Gid([0; 16])).is_err());
        // Sealed: a process that maps it cannot shrink it under the others (which made their
        // next access a SIGBUS) nor grow it.
        // SAFETY: ftruncate on the peer's duplicate of the descriptor (refused, as checked).
        for len in [0, 2 * p.lay.len] {
            let r = unsafe { libc::ftruncate(p.fd, len as libc::off_t) };
            assert_eq!(r, -1, "resizing to {len}");
            assert_eq!(
                std::io::Error::last_os_error().raw_os_error(),
                Some(libc::EPERM)
            );
        }
        assert_eq!(gid_net(&g), net);
        let a = std::net::SocketAddrV4::new(std::net::Ipv4Addr::new(10, 1, 2, 3), 4791);
        let n2 = Net {
            addr: Some(a),
            host: 9,
        };
        assert_eq!(gid_net(&make_gid(n2, 3, 4)), n2);
    }

    #[test]
    fn records_round_trip() {
        let sg = [crate::Sge {
            addr: 0x1000,
            length: 77,
            lkey: 5,
        }];
        let r = wqe_record(9, &sg);
        assert_eq!(wqe_sges(&r).as_slice(), &sg);
        let wc = crate::Wc {
            wr_id: 1,
            status: crate::WcStatus::RemAccessErr,
            opcode: crate::WcOpcode::RecvRdmaWithImm,
            byte_len: 3,
            imm: Some(0xdead_beef),
            qp_num: 7,
            src_qp: 8,
            grh: true,
        };
        assert_eq!(cqe_parse(&cqe_record(&wc)), Some(wc));
        assert_eq!(cqe_parse(&[0, 99, 0, 0, 0]), None, "unknown status");
    }
}
