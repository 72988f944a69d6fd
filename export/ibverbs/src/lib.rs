// Over 800 lines: a `.symver` binding must sit in the object that defines its symbol, so every exported call shares one module.
//! The soft HCA as `libibverbs.so.1`: a drop-in for Debian 12's rdma-core 44 library (same
//! SONAME, the same version nodes and symbols, the structures of its `infiniband/verbs.h`), so
//! that unmodified verbs programs (rdma-core's `ibv_*` examples, perftest) run on weft-verbs's
//! soft HCA, with its checks, accounting and counters. `weft soft-hca env` prints the
//! `LD_LIBRARY_PATH` that points a program at it.
//!
//! - One device, `weft0`, one port, link layer Ethernet (RoCE-style): a soft-HCA GID names the
//!   peer's HCA (its UDP endpoint, host, process), as a RoCE v2 GID names an IP address, while
//!   an InfiniBand LID would need a subnet manager to hand out and resolve. So, as on RoCE,
//!   address vectors need a GID (`is_global`; `-g 0` for rdma-core's examples).
//! - Every `ibv_context` is a `verbs_context` whose extended entries are NULL: the header's
//!   inline calls then fall back to the legacy ones or answer `EOPNOTSUPP` themselves. The
//!   data path (`ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv`, `ibv_poll_cq`,
//!   `ibv_req_notify_cq`) is the context's operation table.
//! - Completion channels are eventfds (semaphore mode: readable exactly while an event is
//!   pending). A peer writes our completions straight into our shared segment, so nothing in
//!   this process learns of them: each context has a notifier thread that, while a CQ is armed,
//!   watches it (without consuming) and raises the channel's event, and drives this context's
//!   requests as the soft HCA's engine would. The same thread reports SRQ limit events on
//!   `async_fd`.
//! - Symbols weft does not offer (multicast, rereg, resize, import, rdma-core's private
//!   provider interface) answer `ENOSYS`; QP types other than RC and UD answer `EOPNOTSUPP`.
//! - A Rust panic in an `extern "C"` function aborts the process (Rust's rule since 1.81); the
//!   calls below return errors for everything a program can cause.

// Every exported function stays in this module: a `.symver` binding (symver.rs, included
// below) must be assembled in the object that defines its symbol, and a module of its own may
// land in another codegen unit ("default version symbol ... must be defined"). What is not
// exported by name lives beside it: the structures (abi) and the notifier thread (notify).
pub mod abi;
mod notify;

use abi::*;
use libc::{c_char, c_int, c_uint, c_void};
use notify::{notify_loop, take};
use smallvec::SmallVec;
use std::collections::VecDeque;
use std::mem::offset_of;
use std::ptr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use weft_provider::{Error, ErrorKind};
use weft_verbs::soft::SoftHca;
use weft_verbs::*;

include!(concat!(env!("OUT_DIR"), "/symver.rs"));

/// The device's name (`ibv_devices`, `-d`).
pub const DEVICE_NAME: &str = "weft0";
const NODE_GUID: u64 = 0x7765_6674_0000_0001; // "weft", 1
const PORT: u8 = 1;

/// `WEFT_VERBS_IBV_VERBOSE=1`: say why each failing call failed (read once).
fn verbose() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        weft_verbs::soft::model::IBV_VERBOSE
            .get_bool()
            .unwrap_or(false)
    })
}

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

/// Say why a call failed: always for mistakes a user must fix (`hint`), else under
/// `WEFT_VERBS_IBV_VERBOSE=1`.
fn hint(msg: &str) {
    eprintln!("libibverbs (weft soft HCA): {msg}");
}

fn errno_of(e: &Error) -> c_int {
    let m = e.to_string();
    if verbose() {
        hint(&m);
    }
    if e.kind() == ErrorKind::Unsupported {
        libc::EOPNOTSUPP
    } else if m.contains("ENOMEM") || m.contains(" left") {
        libc::ENOMEM
    } else if m.contains("EBUSY") {
        libc::EBUSY
    } else {
        libc::EINVAL
    }
}

fn unoffered_err(name: &str) -> c_int {
    if verbose() {
        hint(&format!("{name} is not offered"));
    }
    set_errno(libc::ENOSYS);
    libc::ENOSYS
}

fn unoffered_null(name: &str) -> *mut c_void {
    unoffered_err(name);
    ptr::null_mut()
}

fn null_with<T>(e: c_int) -> *mut T {
    set_errno(e);
    ptr::null_mut()
}

// ---------------------------------------------------------------- objects

/// A device context: the `verbs_context` first (programs hold a pointer to its last field).
#[repr(C)]
struct Ctx {
    vctx: verbs_context,
    sh: Arc<Shared>,
    notifier: Option<std::thread::JoinHandle<()>>,
}

/// What the notifier thread shares with the calls.
struct Shared {
    hca: Arc<SoftHca>,
    st: Mutex<Watch>,
    cv: Condvar,
    /// Signalled when an asynchronous event is acknowledged (destroys wait for theirs).
    acked: Condvar,
    async_fd: c_int,
}

#[derive(Default)]
struct Watch {
    /// Armed CQs: (the CqBox, its handle, its channel).
    armed: Vec<(usize, Cq, usize)>,
    /// SRQs with an armed limit: (the SrqBox, its handle).
    srqs: Vec<(usize, Srq)>,
    /// Asynchronous events not yet read: (element, event type).
    events: VecDeque<(usize, c_int)>,
    /// Events read by `ibv_get_async_event` and not yet acknowledged, per element: its
    /// destroy waits for them, as rdma-core's does (the event names the object).
    unacked: Vec<(usize, u32)>,
    /// Every QP, for the events of a QP that goes to the error state.
    qps: Vec<QpWatch>,
    stop: bool,
}

/// A QP as the notifier watches it.
#[derive(Clone, Copy)]
struct QpWatch {
    /// The QpBox.
    qp: usize,
    h: Qp,
    /// Attached to an SRQ: `IBV_EVENT_QP_LAST_WQE_REACHED` when it enters the error state.
    srq: bool,
    /// The events of its current error state are raised (until it is reset).
    told: bool,
}

#[repr(C)]
struct Chan {
    ch: ibv_comp_channel,
    /// CQs whose event is pending (one eventfd count each).
    q: Mutex<VecDeque<usize>>,
}

#[repr(C)]
struct PdBox {
    pd: ibv_pd,
    h: Pd,
}

#[repr(C)]
struct MrBox {
    mr: ibv_mr,
    h: Mr,
}

#[repr(C)]
struct CqBox {
    cq: ibv_cq,
    h: Cq,
    /// `IBV_EVENT_CQ_ERR` raised for its overrun.
    overrun_told: std::sync::atomic::AtomicBool,
}

#[repr(C)]
struct SrqBox {
    srq: ibv_srq,
    h: Srq,
    max_wr: u32,
    max_sge: u32,
    limit: Mutex<u32>,
}

#[repr(C)]
struct QpBox {
    qp: ibv_qp,
    h: Qp,
    ty: QpType,
    sig_all: bool,
    /// The attributes last set, for `ibv_query_qp`.
    saved: Mutex<ibv_qp_attr>,
}

#[repr(C)]
struct AhBox {
    ah: ibv_ah,
    h: Ah,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// # Safety
/// `c` must be a context this library opened and not yet closed.
unsafe fn ctx<'a>(c: *mut ibv_context) -> &'a Ctx {
    let off = offset_of!(Ctx, vctx) + offset_of!(verbs_context, context);
    // SAFETY: (caller) `c` points at the `context` field of a live `Ctx`.
    unsafe { &*((c as *mut u8).sub(off) as *const Ctx) }
}

/// Destroy the object `p` (a box from `Box::into_raw`) with `f`, and free the box only if
/// that succeeded; an errno otherwise (EINVAL for NULL).
///
/// # Safety
/// `p` is NULL or a live box of this library, not used again once this returns 0.
unsafe fn destroy<B>(p: *mut B, f: impl FnOnce(&B) -> weft_provider::Result<()>) -> c_int {
    if p.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: (caller) live.
    match f(unsafe { &*p }) {
        Ok(()) => {
            // SAFETY: made by Box::into_raw; freed once, as the caller uses it no more.
            drop(unsafe { Box::from_raw(p) });
            0
        }
        Err(e) => errno_of(&e),
    }
}

/// The capacities a QP got, as the header has them.
fn cap_out(c: QpCap) -> ibv_qp_cap {
    ibv_qp_cap {
        max_send_wr: c.max_send_wr,
        max_recv_wr: c.max_recv_wr,
        max_send_sge: c.max_send_sge,
        max_recv_sge: c.max_recv_sge,
        max_inline_data: c.max_inline_data,
    }
}

/// # Safety
/// `c` must be a context this library opened and not yet closed.
unsafe fn hca<'a>(c: *mut ibv_context) -> &'a SoftHca {
    // SAFETY: as `ctx`.
    unsafe { &ctx(c).sh.hca }
}

// ---------------------------------------------------------------- devices

struct Device(*mut ibv_device);
// SAFETY: the device description is written once, before it is shared, and only read after.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

fn device() -> *mut ibv_device {
    static DEV: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    DEV.get_or_init(|| {
        // SAFETY: all-zero is a valid ibv_device (integers and byte arrays).
        let mut d: Box<ibv_device> = Box::new(unsafe { std::mem::zeroed() });
        d.node_type = 1; // IBV_NODE_CA
        d.transport_type = 0; // IBV_TRANSPORT_IB (RoCE reports IB transport too)
        let put = |dst: &mut [c_char], s: &str| {
            for (d, b) in dst.iter_mut().zip(s.bytes()) {
                *d = b as c_char;
            }
        };
        put(&mut d.name, DEVICE_NAME);
        put(&mut d.dev_name, "uverbs-weft0");
        put(&mut d.dev_path, "/dev/null");
        put(&mut d.ibdev_path, "/dev/null");
        Device(Box::into_raw(d))
    })
    .0
}

/// # Safety
/// `num` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
    // SAFETY: calloc of two pointers; freed by ibv_free_device_list.
    let l =
        unsafe { libc::calloc(2, std::mem::size_of::<*mut ibv_device>()) } as *mut *mut ibv_device;
    if l.is_null() {
        return null_with(libc::ENOMEM);
    }
    // SAFETY: `l` holds two entries; the second stays NULL (the terminator).
    unsafe { *l = device() };
    if !num.is_null() {
        // SAFETY: (caller) writable.
        unsafe { *num = 1 };
    }
    l
}

/// # Safety
/// `l` came from `ibv_get_device_list`.
#[no_mangle]
pub unsafe extern "C" fn ibv_free_device_list(l: *mut *mut ibv_device) {
    // SAFETY: (caller) allocated by calloc above.
    unsafe { libc::free(l as *mut c_void) };
}

/// # Safety
/// `d` is this library's device.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_name(d: *mut ibv_device) -> *const c_char {
    if d.is_null() {
        return ptr::null();
    }
    // SAFETY: (caller) a live device.
    unsafe { (*d).name.as_ptr() }
}

#[no_mangle]
pub extern "C" fn ibv_get_device_guid(_d: *mut ibv_device) -> u64 {
    NODE_GUID.to_be()
}

#[no_mangle]
pub extern "C" fn ibv_get_device_index(_d: *mut ibv_device) -> c_int {
    0
}

/// # Safety
/// `d` is this library's device.
#[no_mangle]
pub unsafe extern "C" fn ibv_open_device(d: *mut ibv_device) -> *mut ibv_context {
    if d != device() {
        return null_with(libc::ENODEV);
    }
    let hca = match SoftHca::open_shared() {
        Ok(h) => h,
        Err(e) => {
            hint(&format!("cannot open the soft HCA: {e}"));
            return null_with(libc::ENODEV);
        }
    };
    // SAFETY: plain eventfd creation.
    let afd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE) };
    if afd < 0 {
        return ptr::null_mut();
    }
    let sh = Arc::new(Shared {
        hca,
        st: Mutex::new(Watch::default()),
        cv: Condvar::new(),
        acked: Condvar::new(),
        async_fd: afd,
    });
    // SAFETY: all-zero is valid for verbs_context (integers, NULL pointers and NULL Option<fn>,
    // and a pthread mutex that is set just below).
    let mut vctx: verbs_context = unsafe { std::mem::zeroed() };
    vctx.sz = std::mem::size_of::<verbs_context>();
    let c = &mut vctx.context;
    c.device = d;
    c.cmd_fd = -1;
    c.async_fd = afd;
    c.num_comp_vectors = 1;
    c.mutex = libc::PTHREAD_MUTEX_INITIALIZER;
    c.abi_compat = VERBS_ABI_IS_EXTENDED;
    c.ops.poll_cq = Some(op_poll_cq);
    c.ops.req_notify_cq = Some(op_req_notify_cq);
    c.ops.post_srq_recv = Some(op_post_srq_recv);
    c.ops.post_send = Some(op_post_send);
    c.ops.post_recv = Some(op_post_recv);
    let w = sh.clone();
    let notifier = std::thread::Builder::new()
        .name("weft-ibv-notify".into())
        .spawn(move || notify_loop(&w))
        .ok();
    let b = Box::new(Ctx { vctx, sh, notifier });
    let p = Box::into_raw(b);
    // SAFETY: just allocated.
    unsafe { ptr::addr_of_mut!((*p).vctx.context) }
}

/// # Safety
/// `c` is a context this library opened; no call on it may run or follow.
#[no_mangle]
pub unsafe extern "C" fn ibv_close_device(c: *mut ibv_context) -> c_int {
    if c.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: (caller) ours, and closed once.
    let p = unsafe { ctx(c) } as *const Ctx as *mut Ctx;
    // SAFETY: made by Box::into_raw in ibv_open_device.
    let mut b = unsafe { Box::from_raw(p) };
    lock(&b.sh.st).stop = true;
    b.sh.cv.notify_all();
    if let Some(t) = b.notifier.take() {
        let _ = t.join();
    }
    // SAFETY: our eventfd, closed once.
    unsafe { libc::close(b.sh.async_fd) };
    0
}

// ---------------------------------------------------------------- queries

/// # Safety
/// `c` is ours; `a` is writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_device(c: *mut ibv_context, a: *mut ibv_device_attr) -> c_int {
    if c.is_null() || a.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: (caller) ours.
    let h = unsafe { hca(c) };
    let d = h.attr();
    // SAFETY: all-zero is a valid ibv_device_attr.
    let mut o: ibv_device_attr = unsafe { std::mem::zeroed() };
    for (dst, b) in o.fw_ver.iter_mut().zip(b"weft soft HCA".iter()) {
        *dst = *b as c_char;
    }
    let i = |v: u32| v.min(i32::MAX as u32) as c_int;
    o.node_guid = NODE_GUID.to_be();
    o.sys_image_guid = NODE_GUID.to_be();
    o.max_mr_size = d.max_mr_size;
    o.page_size_cap = 4096;
    o.vendor_id = 0x7765; // not a registered OUI: weft's own
    o.vendor_part_id = 1;
    o.max_qp = i(d.max_qp);
    o.max_qp_wr = i(d.max_qp_wr);
    o.device_cap_flags = 1 << 12; // IBV_DEVICE_RC_RNR_NAK_GEN
    o.max_sge = i(d.max_sge);
    o.max_sge_rd = i(d.max_sge);
    o.max_cq = i(d.max_cq);
    o.max_cqe = i(d.max_cqe);
    o.max_mr = i(d.max_mr);
    o.max_pd = i(d.max_pd);
    o.max_qp_rd_atom = i(d.max_qp_rd_atom);
    o.max_res_rd_atom = i(d.max_qp_rd_atom * d.max_qp);
    o.max_qp_init_rd_atom = i(d.max_qp_rd_atom);
    o.atomic_cap = match d.atomic_cap {
        AtomicCap::None => 0,
        AtomicCap::Hca => 1,
        AtomicCap::Glob => 2,
    };
    o.max_ah = i32::MAX;
    o.max_srq = i(d.max_srq);
    o.max_srq_wr = i(d.max_srq_wr);
    o.max_srq_sge = i(d.max_sge);
    o.max_pkeys = 1;
    o.local_ca_ack_delay = 16;
    o.phys_port_cnt = 1;
    // SAFETY: (caller) writable.
    unsafe { ptr::write(a, o) };
    0
}

/// Writes the fields of the compat port attributes (all but `port_cap_flags2`): the header's
/// `ibv_query_port` macro zeroes the rest first.
///
/// # Safety
/// `c` is ours; `a` is writable for the compat structure.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_port(c: *mut ibv_context, port: u8, a: *mut c_void) -> c_int {
    if c.is_null() || a.is_null() || port != PORT {
        return libc::EINVAL;
    }
    // SAFETY: (caller) ours.
    let h = unsafe { hca(c) };
    let mtu = h.attr().active_mtu as c_int;
    // SAFETY: all-zero is a valid ibv_port_attr.
    let mut o: ibv_port_attr = unsafe { std::mem::zeroed() };
    o.state = 4; // IBV_PORT_ACTIVE
    o.max_mtu = mtu;
    o.active_mtu = mtu;
    o.gid_tbl_len = 1;
    o.port_cap_flags = 1 << 16; // IBV_PORT_CM_SUP
    o.max_msg_sz = 1 << 31;
    o.pkey_tbl_len = 1;
    o.max_vl_num = 1;
    o.active_width = 2; // 4X
    o.active_speed = 32; // 25 Gb/s per lane (EDR), the model's nominal rate
    o.phys_state = 5; // LinkUp
    o.link_layer = 2; // IBV_LINK_LAYER_ETHERNET
                      // SAFETY: (caller) writable for the compat size, which ends where port_cap_flags2 starts.
    unsafe {
        ptr::copy_nonoverlapping(
            &o as *const ibv_port_attr as *const u8,
            a as *mut u8,
            offset_of!(ibv_port_attr, port_cap_flags2),
        )
    };
    0
}

/// # Safety
/// `c` is ours; `gid` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid(
    c: *mut ibv_context,
    port: u8,
    index: c_int,
    gid: *mut [u8; 16],
) -> c_int {
    if c.is_null() || gid.is_null() || port != PORT || index != 0 {
        return -1;
    }
    // SAFETY: (caller) ours and writable.
    unsafe { *gid = hca(c).gid().0 };
    0
}

/// # Safety
/// `c` is ours; `e` writable for `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_ex(
    c: *mut ibv_context,
    port: u32,
    index: u32,
    e: *mut ibv_gid_entry,
    flags: u32,
    size: usize,
) -> c_int {
    if c.is_null() || e.is_null() || flags != 0 || port != PORT as u32 {
        return libc::EINVAL;
    }
    if index != 0 {
        return libc::ENODATA;
    }
    if size < std::mem::size_of::<ibv_gid_entry>() {
        return libc::EINVAL;
    }
    // SAFETY: (caller) ours; `e` holds at least one entry (checked).
    unsafe {
        ptr::write(
            e,
            ibv_gid_entry {
                gid: hca(c).gid().0,
                gid_index: 0,
                port_num: PORT as u32,
                gid_type: 2, // IBV_GID_TYPE_ROCE_V2
                ndev_ifindex: 0,
            },
        )
    };
    0
}

/// # Safety
/// `c` is ours; `e` holds `max` entries of `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_table(
    c: *mut ibv_context,
    e: *mut ibv_gid_entry,
    max: usize,
    flags: u32,
    size: usize,
) -> isize {
    if max == 0 {
        return -(libc::EINVAL as isize);
    }
    // SAFETY: (caller) as above.
    match unsafe { _ibv_query_gid_ex(c, PORT as u32, 0, e, flags, size) } {
        0 => 1,
        r => -(r as isize),
    }
}

/// # Safety
/// `t` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid_type(
    _c: *mut ibv_context,
    port: u8,
    index: c_uint,
    t: *mut c_int,
) -> c_int {
    if t.is_null() || port != PORT || index != 0 {
        return libc::EINVAL;
    }
    // SAFETY: (caller) writable.
    unsafe { *t = 1 }; // IBV_GID_TYPE_SYSFS_ROCE_V2
    0
}

/// # Safety
/// `pkey` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_pkey(
    _c: *mut ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    if pkey.is_null() || port != PORT || index != 0 {
        return -1;
    }
    // SAFETY: (caller) writable.
    unsafe { *pkey = 0xffff };
    0
}

#[no_mangle]
pub extern "C" fn ibv_get_pkey_index(_c: *mut ibv_context, port: u8, pkey: u16) -> c_int {
    if port == PORT && pkey == 0xffff {
        0
    } else {
        -libc::ENOENT
    }
}

// ---------------------------------------------------------------- PD and MR

/// # Safety
/// `c` is ours.
#[no_mangle]
pub unsafe extern "C" fn ibv_alloc_pd(c: *mut ibv_context) -> *mut ibv_pd {
    if c.is_null() {
        return null_with(libc::EINVAL);
    }
    // SAFETY: (caller) ours.
    match unsafe { hca(c) }.alloc_pd() {
        Ok(h) => Box::into_raw(Box::new(PdBox {
            pd: ibv_pd {
                context: c,
                handle: h.0,
            },
            h,
        })) as *mut ibv_pd,
        Err(e) => null_with(errno_of(&e)),
    }
}

/// # Safety
/// `pd` from `ibv_alloc_pd`.
#[no_mangle]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    // SAFETY: (caller) `pd` is NULL or ours, not used after it is destroyed; its context
    // is live.
    unsafe { destroy(pd as *mut PdBox, |b| hca(b.pd.context).dealloc_pd(b.h)) }
}

/// # Safety
/// `pd` from `ibv_alloc_pd`; the memory stays allocated until `ibv_dereg_mr`.
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: (caller) as ibv_reg_mr_iova2's.
    unsafe { ibv_reg_mr_iova2(pd, addr, len, addr as u64, access as c_uint) }
}

/// # Safety
/// As `ibv_reg_mr`.
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: (caller) as ibv_reg_mr_iova2's.
    unsafe { ibv_reg_mr_iova2(pd, addr, len, iova, access as c_uint) }
}

/// # Safety
/// As `ibv_reg_mr`.
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    if pd.is_null() || addr.is_null() {
        return null_with(libc::EINVAL);
    }
    // Bits from IBV_ACCESS_OPTIONAL_FIRST (1 << 20) up may be ignored; HUGETLB (128) is a hint.
    let must = access & ((1 << 20) - 1) & !128;
    if must & !15 != 0 {
        if verbose() {
            hint("reg_mr: memory windows, zero-based and on-demand MRs are not offered");
        }
        return null_with(libc::EOPNOTSUPP);
    }
    if iova != addr as u64 {
        if verbose() {
            hint("reg_mr: the soft HCA addresses memory by virtual address (iova = addr)");
        }
        return null_with(libc::EOPNOTSUPP);
    }
    // SAFETY: (caller) a live PdBox.
    let b = unsafe { &*(pd as *mut PdBox) };
    // SAFETY: its context is live.
    let h = unsafe { hca(b.pd.context) };
    // SAFETY: (caller) the memory stays allocated until ibv_dereg_mr, as with a real device;
    // what the device writes there, it writes as DMA would, beside any reference.
    match unsafe { h.reg_mr(b.h, addr as *mut u8, len, Access(must)) } {
        Ok(m) => Box::into_raw(Box::new(MrBox {
            mr: ibv_mr {
                context: b.pd.context,
                pd,
                addr,
                length: len,
                handle: m.handle,
                lkey: m.lkey,
                rkey: m.rkey,
            },
            h: m,
        })) as *mut ibv_mr,
        Err(e) => null_with(errno_of(&e)),
    }
}

/// # Safety
/// `mr` from `ibv_reg_mr`.
#[no_mangle]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    // SAFETY: (caller) `mr` is NULL or ours, not used after it is destroyed; its context
    // is live.
    unsafe { destroy(mr as *mut MrBox, |b| hca(b.mr.context).dereg_mr(b.h)) }
}

// ---------------------------------------------------------------- CQs and channels

/// # Safety
/// `c` is ours.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(c: *mut ibv_context) -> *mut ibv_comp_channel {
    if c.is_null() {
        return null_with(libc::EINVAL);
    }
    // SAFETY: plain eventfd creation.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE) };
    if fd < 0 {
        return ptr::null_mut();
    }
    Box::into_raw(Box::new(Chan {
        ch: ibv_comp_channel {
            context: c,
            fd,
            refcnt: 0,
        },
        q: Mutex::new(VecDeque::new()),
    })) as *mut ibv_comp_channel
}

/// # Safety
/// `ch` from `ibv_create_comp_channel`.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    if ch.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: (caller) a live Chan.
    let b = unsafe { &*(ch as *mut Chan) };
    // SAFETY: the channel's context outlives it.
    let st = lock(&unsafe { ctx(b.ch.context) }.sh.st);
    if b.ch.refcnt > 0 {
        return libc::EBUSY;
    }
    drop(st);
    // SAFETY: our eventfd, closed once.
    unsafe { libc::close(b.ch.fd) };
    // SAFETY: made by Box::into_raw; freed once; no CQ names it (refcnt 0).
    drop(unsafe { Box::from_raw(ch as *mut Chan) });
    0
}

/// # Safety
/// `c` is ours; `ch` NULL or one of its channels.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_cq(
    c: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    ch: *mut ibv_comp_channel,
    _vector: c_int,
) -> *mut ibv_cq {
    if c.is_null() || cqe <= 0 {
        return null_with(libc::EINVAL);
    }
    // SAFETY: (caller) ours.
    let x = unsafe { ctx(c) };
    match x.sh.hca.create_cq(cqe as u32) {
        Ok(h) => {
            if !ch.is_null() {
                let _g = lock(&x.sh.st);
                // SAFETY: (caller) a live channel; its count is changed under the watch lock.
                unsafe { (*ch).refcnt += 1 };
            }
            Box::into_raw(Box::new(CqBox {
                cq: ibv_cq {
                    context: c,
                    channel: ch,
                    cq_context,
                    handle: h.0,
                    cqe,
                    mutex: libc::PTHREAD_MUTEX_INITIALIZER,
                    cond: libc::PTHREAD_COND_INITIALIZER,
                    comp_events_completed: 0,
                    async_events_completed: 0,
                },
                h,
                overrun_told: Default::default(),
            })) as *mut ibv_cq
        }
        Err(e) => null_with(errno_of(&e)),
    }
}

/// # Safety
/// `cq` from `ibv_create_cq`.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    if cq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: (caller) a live CqBox.
    let b = unsafe { &*(cq as *mut CqBox) };
    // SAFETY: its context is live.
    let x = unsafe { ctx(b.cq.context) };
    // Under the watch lock: the notifier looks at no CQ that is going away.
    let mut st = wait_acked(&x.sh, lock(&x.sh.st), cq as usize);
    if let Err(e) = x.sh.hca.destroy_cq(b.h) {
        return errno_of(&e);
    }
    st.armed.retain(|a| a.0 != cq as usize);
    st.events.retain(|e| e.0 != cq as usize);
    if !b.cq.channel.is_null() {
        // SAFETY: the channel outlives the CQ (refcnt); changed under the watch lock.
        let chan = unsafe { &mut *(b.cq.channel as *mut Chan) };
        chan.ch.refcnt -= 1;
        lock(&chan.q).retain(|&q| q != cq as usize);
    }
    drop(st);
    // SAFETY: made by Box::into_raw; freed once; no longer armed or queued.
    drop(unsafe { Box::from_raw(cq as *mut CqBox) });
    0
}

/// # Safety
/// `ch` a live channel; `cq`, `cq_context` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_cq_event(
    ch: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    if ch.is_null() || cq.is_null() || cq_context.is_null() {
        return -1;
    }
    // SAFETY: (caller) a live Chan.
    let b = unsafe { &*(ch as *mut Chan) };
    loop {
        if !take(b.ch.fd) {
            return -1;
        }
        if let Some(q) = lock(&b.q).pop_front() {
            let q = q as *mut ibv_cq;
            // SAFETY: queued CQs are live (destroy removes them); out-pointers writable.
            unsafe {
                *cq = q;
                *cq_context = (*q).cq_context;
            }
            return 0;
        }
    }
}

/// # Safety
/// `cq` a live CQ.
#[no_mangle]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, n: c_uint) {
    if cq.is_null() {
        return;
    }
    // SAFETY: (caller) a live CQ; the counter is the program's to read.
    unsafe {
        let x = ctx((*cq).context);
        let _g = lock(&x.sh.st);
        (*cq).comp_events_completed = (*cq).comp_events_completed.wrapping_add(n);
    }
}

unsafe extern "C" fn op_req_notify_cq(cq: *mut ibv_cq, _solicited_only: c_int) -> c_int {
    if cq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: (the header's contract) a live CQ of one of our contexts.
    let b = unsafe { &*(cq as *mut CqBox) };
    if b.cq.channel.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: its context is live.
    let x = unsafe { ctx(b.cq.context) };
    let mut st = lock(&x.sh.st);
    if !st.armed.iter().any(|a| a.0 == cq as usize) {
        st.armed.push((cq as usize, b.h, b.cq.channel as usize));
    }
    drop(st);
    x.sh.cv.notify_all();
    0
}

fn wc_out(w: &Wc) -> ibv_wc {
    ibv_wc {
        wr_id: w.wr_id,
        status: w.status as c_int,
        opcode: w.opcode as c_int,
        vendor_err: 0,
        byte_len: w.byte_len,
        imm_data: w.imm.unwrap_or(0),
        qp_num: w.qp_num,
        src_qp: w.src_qp,
        wc_flags: if w.imm.is_some() { WC_WITH_IMM } else { 0 } | if w.grh { WC_GRH } else { 0 },
        pkey_index: 0,
        slid: 0,
        sl: 0,
        dlid_path_bits: 0,
    }
}

unsafe extern "C" fn op_poll_cq(cq: *mut ibv_cq, n: c_int, out: *mut ibv_wc) -> c_int {
    if cq.is_null() || n < 0 || (out.is_null() && n > 0) {
        return -1;
    }
    // SAFETY: (the header's contract) a live CQ of ours.
    let b = unsafe { &*(cq as *mut CqBox) };
    // SAFETY: its context is live.
    let h = unsafe { hca(b.cq.context) };
    let mut buf = [Wc::EMPTY; 16];
    let mut got = 0usize;
    while got < n as usize {
        let want = (n as usize - got).min(buf.len());
        match h.poll_cq(b.h, &mut buf[..want]) {
            Ok(k) => {
                for (i, w) in buf[..k].iter().enumerate() {
                    // SAFETY: (caller) `out` holds `n` entries; got + i < n.
                    unsafe { ptr::write(out.add(got + i), wc_out(w)) };
                }
                got += k;
                if k < want {
                    break;
                }
            }
            Err(e) => {
                errno_of(&e);
                if h.cq_overrun(b.h) && !b.overrun_told.swap(true, Ordering::Relaxed) {
                    // SAFETY: its context is live.
                    let x = unsafe { ctx(b.cq.context) };
                    lock(&x.sh.st).events.push_back((cq as usize, EVENT_CQ_ERR));
                    notify::bump(x.sh.async_fd, 1);
                }
                return if got > 0 { got as c_int } else { -1 };
            }
        }
    }
    got as c_int
}

// ---------------------------------------------------------------- SRQs

/// # Safety
/// `pd` from `ibv_alloc_pd`; `a` readable and writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_srq(
    pd: *mut ibv_pd,
    a: *mut ibv_srq_init_attr,
) -> *mut ibv_srq {
    if pd.is_null() || a.is_null() {
        return null_with(libc::EINVAL);
    }
    // SAFETY: (caller) live and readable.
    let (p, a) = unsafe { (&*(pd as *mut PdBox), &mut *a) };
    // SAFETY: its context is live.
    let x = unsafe { ctx(p.pd.context) };
    let h = &x.sh.hca;
    if a.attr.srq_limit > a.attr.max_wr {
        return null_with(libc::EINVAL);
    }
    let s = match h.create_srq(p.h, a.attr.max_wr, a.attr.max_sge.max(1)) {
        Ok(s) => s,
        Err(e) => return null_with(errno_of(&e)),
    };
    let b = Box::into_raw(Box::new(SrqBox {
        srq: ibv_srq {
            context: p.pd.context,
            srq_context: a.srq_context,
            pd,
            handle: s.0,
            mutex: libc::PTHREAD_MUTEX_INITIALIZER,
            cond: libc::PTHREAD_COND_INITIALIZER,
            events_completed: 0,
        },
        h: s,
        max_wr: a.attr.max_wr,
        max_sge: a.attr.max_sge.max(1),
        limit: Mutex::new(0),
    }));
    if a.attr.srq_limit > 0 {
        // SAFETY: just made.
        let r = unsafe { arm_srq(b, a.attr.srq_limit) };
        if r != 0 {
            // SAFETY: just made, not yet shared.
            unsafe { ibv_destroy_srq(b as *mut ibv_srq) };
            return null_with(r);
        }
    }
    b as *mut ibv_srq
}

/// # Safety
/// `b` a live SrqBox.
unsafe fn arm_srq(b: *mut SrqBox, limit: u32) -> c_int {
    // SAFETY: (caller) live.
    let s = unsafe { &*b };
    // SAFETY: its context is live.
    let x = unsafe { ctx(s.srq.context) };
    if let Err(e) = x.sh.hca.arm_srq_limit(s.h, limit) {
        return errno_of(&e);
    }
    *lock(&s.limit) = limit;
    let mut st = lock(&x.sh.st);
    st.srqs.retain(|e| e.0 != b as usize);
    if limit > 0 {
        st.srqs.push((b as usize, s.h));
    }
    drop(st);
    x.sh.cv.notify_all();
    0
}

/// # Safety
/// `srq` live; `a` readable.
#[no_mangle]
pub unsafe extern "C" fn ibv_modify_srq(
    srq: *mut ibv_srq,
    a: *mut ibv_srq_attr,
    mask: c_int,
) -> c_int {
    if srq.is_null() || a.is_null() {
        return libc::EINVAL;
    }
    const MAX_WR: c_int = 1;
    const LIMIT: c_int = 2;
    if mask & !(MAX_WR | LIMIT) != 0 || mask & MAX_WR != 0 {
        // Resizing an SRQ is not offered (IBV_DEVICE_SRQ_RESIZE is not reported).
        return libc::EINVAL;
    }
    if mask & LIMIT != 0 {
        // SAFETY: (caller) live and readable.
        return unsafe { arm_srq(srq as *mut SrqBox, (*a).srq_limit) };
    }
    0
}

/// # Safety
/// `srq` live; `a` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_srq(srq: *mut ibv_srq, a: *mut ibv_srq_attr) -> c_int {
    if srq.is_null() || a.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: (caller) live and writable.
    unsafe {
        let s = &*(srq as *mut SrqBox);
        *a = ibv_srq_attr {
            max_wr: s.max_wr,
            max_sge: s.max_sge,
            srq_limit: *lock(&s.limit),
        };
    }
    0
}

/// # Safety
/// `srq` from `ibv_create_srq`.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_srq(srq: *mut ibv_srq) -> c_int {
    if srq.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: (caller) live.
    let b = unsafe { &*(srq as *mut SrqBox) };
    // SAFETY: its context is live.
    let x = unsafe { ctx(b.srq.context) };
    let mut st = wait_acked(&x.sh, lock(&x.sh.st), srq as usize);
    if let Err(e) = x.sh.hca.destroy_srq(b.h) {
        return errno_of(&e);
    }
    st.srqs.retain(|e| e.0 != srq as usize);
    st.events.retain(|e| e.0 != srq as usize);
    drop(st);
    // SAFETY: made by Box::into_raw; freed once; no longer watched.
    drop(unsafe { Box::from_raw(srq as *mut SrqBox) });
    0
}

/// # Safety
/// `sg` holds `n` entries.
unsafe fn sges(sg: *const ibv_sge, n: c_int) -> Option<SmallVec<[Sge; 2]>> {
    if n < 0 || (n > 0 && sg.is_null()) {
        return None;
    }
    if n == 0 {
        return Some(SmallVec::new());
    }
    // SAFETY: (caller) `n` readable entries.
    let s = unsafe { std::slice::from_raw_parts(sg, n as usize) };
    Some(
        s.iter()
            .map(|e| Sge {
                addr: e.addr,
                length: e.length,
                lkey: e.lkey,
            })
            .collect(),
    )
}

/// Which request of a list the soft HCA refused: its errors name it as "request K".
fn refused_index(e: &Error) -> usize {
    let m = e.to_string();
    m.split("request ")
        .nth(1)
        .and_then(|t| t.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|d| d.parse().ok())
        .unwrap_or(0)
}

/// Receive requests converted, and where each came from (for `bad_wr`).
type RecvList = (SmallVec<[RecvWr; 4]>, SmallVec<[*mut ibv_recv_wr; 4]>);

/// # Safety
/// `wr` a NULL-terminated list of readable requests.
unsafe fn recv_list(mut wr: *mut ibv_recv_wr) -> Result<RecvList, *mut ibv_recv_wr> {
    let mut v = SmallVec::new();
    let mut ps = SmallVec::new();
    while !wr.is_null() {
        // SAFETY: (caller) readable.
        let w = unsafe { &*wr };
        // SAFETY: (caller) its SGE list is readable.
        let sg = unsafe { sges(w.sg_list, w.num_sge) }.ok_or(wr)?;
        v.push(RecvWr::new(w.wr_id, &sg));
        ps.push(wr);
        wr = w.next;
    }
    Ok((v, ps))
}

unsafe extern "C" fn op_post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: (the header's contract) a live SRQ of ours and a readable list.
    let (b, l) = unsafe { (&*(srq as *mut SrqBox), recv_list(wr)) };
    let (v, ps) = match l {
        Ok(x) => x,
        Err(p) => {
            // SAFETY: (caller) writable.
            unsafe { set_bad(bad, p) };
            return libc::EINVAL;
        }
    };
    // SAFETY: its context is live.
    match unsafe { hca(b.srq.context) }.post_srq_recv(b.h, &v) {
        Ok(()) => 0,
        Err(e) => {
            // SAFETY: (caller) writable.
            unsafe { set_bad(bad, ps[refused_index(&e).min(ps.len() - 1)]) };
            errno_of(&e)
        }
    }
}

/// # Safety
/// `bad` NULL or writable.
unsafe fn set_bad<T>(bad: *mut *mut T, p: *mut T) {
    if !bad.is_null() {
        // SAFETY: (caller) writable.
        unsafe { *bad = p };
    }
}

// ---------------------------------------------------------------- QPs

/// # Safety
/// `pd` from `ibv_alloc_pd`; `a` readable and writable, its CQs and SRQ ours.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_qp(pd: *mut ibv_pd, a: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    if pd.is_null() || a.is_null() {
        return null_with(libc::EINVAL);
    }
    // SAFETY: (caller) live and readable.
    let (p, a) = unsafe { (&*(pd as *mut PdBox), &mut *a) };
    if a.send_cq.is_null() || a.recv_cq.is_null() {
        return null_with(libc::EINVAL);
    }
    let ty = match a.qp_type {
        2 => QpType::Rc,
        4 => QpType::Ud,
        // UC, raw packet, XRC send and receive, driver-specific: types the device lacks.
        3 | 8 | 9 | 10 | 0xff => {
            if verbose() {
                hint("create_qp: the soft HCA offers RC and UD QPs");
            }
            return null_with(libc::EOPNOTSUPP);
        }
        _ => return null_with(libc::EINVAL),
    };
    // SAFETY: (caller) our CQs and SRQ.
    let (scq, rcq, srq) = unsafe {
        (
            (*(a.send_cq as *mut CqBox)).h,
            (*(a.recv_cq as *mut CqBox)).h,
            (!a.srq.is_null()).then(|| (*(a.srq as *mut SrqBox)).h),
        )
    };
    let init = QpInitAttr {
        qp_type: ty,
        send_cq: scq,
        recv_cq: rcq,
        srq,
        cap: QpCap {
            max_send_wr: a.cap.max_send_wr,
            max_recv_wr: if srq.is_some() { 0 } else { a.cap.max_recv_wr },
            max_send_sge: a.cap.max_send_sge,
            max_recv_sge: if srq.is_some() { 0 } else { a.cap.max_recv_sge },
            max_inline_data: a.cap.max_inline_data,
        },
        sq_sig_all: a.sq_sig_all != 0,
    };
    // SAFETY: its context is live.
    let h = unsafe { hca(p.pd.context) };
    let q = match h.create_qp(p.h, &init) {
        Ok(q) => q,
        Err(e) => return null_with(errno_of(&e)),
    };
    if let Ok(c) = h.query_qp_cap(q) {
        a.cap = cap_out(c);
    }
    // SAFETY: all-zero is a valid ibv_qp_attr.
    let mut saved: ibv_qp_attr = unsafe { std::mem::zeroed() };
    saved.cap = a.cap;
    saved.port_num = PORT;
    let b = Box::into_raw(Box::new(QpBox {
        qp: ibv_qp {
            context: p.pd.context,
            qp_context: a.qp_context,
            pd,
            send_cq: a.send_cq,
            recv_cq: a.recv_cq,
            srq: a.srq,
            handle: q.handle,
            qp_num: q.qpn,
            state: 0,
            qp_type: a.qp_type,
            mutex: libc::PTHREAD_MUTEX_INITIALIZER,
            cond: libc::PTHREAD_COND_INITIALIZER,
            events_completed: 0,
        },
        h: q,
        ty,
        sig_all: a.sq_sig_all != 0,
        saved: Mutex::new(saved),
    }));
    // SAFETY: its context is live.
    let x = unsafe { ctx(p.pd.context) };
    lock(&x.sh.st).qps.push(QpWatch {
        qp: b as usize,
        h: q,
        srq: srq.is_some(),
        told: false,
    });
    x.sh.cv.notify_all();
    b as *mut ibv_qp
}

/// The attribute masks a transition requires and allows, as the kernel's table has them for RC
/// and UD (`ib_modify_qp_is_ok`), without SQD/SQE and alternate paths' use.
fn masks(rc: bool, cur: QpState, next: QpState) -> Option<(c_int, c_int)> {
    use QpState::*;
    let init_attrs = QP_PKEY_INDEX | QP_PORT | if rc { QP_ACCESS_FLAGS } else { QP_QKEY };
    Some(match (cur, next) {
        (_, Reset) | (_, Err) => (0, 0),
        (Reset, Init) => (init_attrs, 0),
        (Init, Init) => (0, init_attrs),
        (Init, Rtr) if rc => (
            QP_AV
                | QP_PATH_MTU
                | QP_DEST_QPN
                | QP_RQ_PSN
                | QP_MAX_DEST_RD_ATOMIC
                | QP_MIN_RNR_TIMER,
            QP_ALT_PATH | QP_ACCESS_FLAGS | QP_PKEY_INDEX,
        ),
        (Init, Rtr) => (0, QP_PKEY_INDEX | QP_QKEY),
        (Rtr, Rts) if rc => (
            QP_SQ_PSN | QP_TIMEOUT | QP_RETRY_CNT | QP_RNR_RETRY | QP_MAX_QP_RD_ATOMIC,
            QP_CUR_STATE | QP_ALT_PATH | QP_ACCESS_FLAGS | QP_MIN_RNR_TIMER | QP_PATH_MIG_STATE,
        ),
        (Rtr, Rts) => (QP_SQ_PSN, QP_CUR_STATE | QP_QKEY),
        (Rts, Rts) if rc => (
            0,
            QP_CUR_STATE | QP_ACCESS_FLAGS | QP_ALT_PATH | QP_PATH_MIG_STATE | QP_MIN_RNR_TIMER,
        ),
        (Rts, Rts) => (0, QP_CUR_STATE | QP_QKEY),
        _ => return None,
    })
}

fn ah_of(a: &ibv_ah_attr) -> Result<AhAttr, c_int> {
    if a.is_global == 0 {
        hint(
            "an address without a GID: the soft HCA's port is RoCE-style and addresses peers \
             by GID (is_global; rdma-core's examples take -g 0)",
        );
        return Err(libc::EINVAL);
    }
    if a.port_num != 0 && a.port_num != PORT {
        return Err(libc::EINVAL);
    }
    Ok(AhAttr {
        dgid: Gid(a.grh.dgid),
        dlid: a.dlid,
        port_num: PORT,
    })
}

/// # Safety
/// `qp` live; `a` readable.
#[no_mangle]
pub unsafe extern "C" fn ibv_modify_qp(qp: *mut ibv_qp, a: *mut ibv_qp_attr, mask: c_int) -> c_int {
    if qp.is_null() || a.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: (caller) live and readable.
    let (b, a) = unsafe { (&mut *(qp as *mut QpBox), &*a) };
    // SAFETY: its context is live.
    let h = unsafe { hca(b.qp.context) };
    let cur = match h.query_qp_state(b.h) {
        Ok(s) => s,
        Err(e) => return errno_of(&e),
    };
    let next = if mask & QP_STATE != 0 {
        match QpState::from_u32(a.qp_state as u32) {
            Some(s) => s,
            None => return libc::EINVAL,
        }
    } else {
        cur
    };
    if mask & QP_CUR_STATE != 0 && a.cur_qp_state != cur as c_int {
        return libc::EINVAL;
    }
    let Some((req, opt)) = masks(b.ty == QpType::Rc, cur, next) else {
        return libc::EINVAL;
    };
    let given = mask & !QP_STATE;
    if given & req != req || given & !(req | opt) != 0 {
        if verbose() {
            hint(&format!(
                "modify_qp {cur:?} -> {next:?}: attribute mask {given:#x}, needs {req:#x}, \
                 allows {opt:#x} more"
            ));
        }
        return libc::EINVAL;
    }
    let has = |m: c_int| mask & m != 0;
    let mut q = QpAttr::default();
    if has(QP_STATE) {
        q.qp_state = Some(next);
    }
    if has(QP_ACCESS_FLAGS) {
        if a.qp_access_flags & !15 != 0 {
            return libc::EINVAL;
        }
        q.qp_access_flags = Some(Access(a.qp_access_flags));
    }
    if has(QP_PKEY_INDEX) {
        if a.pkey_index != 0 {
            return libc::EINVAL;
        }
        q.pkey_index = Some(0);
    }
    if has(QP_PORT) {
        if a.port_num != PORT {
            return libc::EINVAL;
        }
        q.port_num = Some(PORT);
    }
    if has(QP_QKEY) {
        q.qkey = Some(a.qkey);
    }
    if has(QP_PATH_MTU) {
        q.path_mtu = match a.path_mtu {
            1 => Some(Mtu::M256),
            2 => Some(Mtu::M512),
            3 => Some(Mtu::M1024),
            4 => Some(Mtu::M2048),
            5 => Some(Mtu::M4096),
            _ => return libc::EINVAL,
        };
    }
    if has(QP_AV) {
        match ah_of(&a.ah_attr) {
            Ok(x) => q.ah_attr = Some(x),
            Err(e) => return e,
        }
    }
    if has(QP_DEST_QPN) {
        q.dest_qp_num = Some(a.dest_qp_num & 0xff_ffff);
    }
    if has(QP_RQ_PSN) {
        q.rq_psn = Some(a.rq_psn);
    }
    if has(QP_SQ_PSN) {
        q.sq_psn = Some(a.sq_psn);
    }
    if has(QP_MAX_DEST_RD_ATOMIC) {
        q.max_dest_rd_atomic = Some(a.max_dest_rd_atomic);
    }
    if has(QP_MAX_QP_RD_ATOMIC) {
        q.max_rd_atomic = Some(a.max_rd_atomic);
    }
    if has(QP_MIN_RNR_TIMER) {
        q.min_rnr_timer = Some(a.min_rnr_timer);
    }
    if has(QP_TIMEOUT) {
        q.timeout = Some(a.timeout);
    }
    if has(QP_RETRY_CNT) {
        q.retry_cnt = Some(a.retry_cnt);
    }
    if has(QP_RNR_RETRY) {
        q.rnr_retry = Some(a.rnr_retry);
    }
    if let Err(e) = h.modify_qp(b.h, &q) {
        return errno_of(&e);
    }
    let mut s = lock(&b.saved);
    macro_rules! keep {
        ($m:expr, $($f:ident),+) => {
            if has($m) { $(s.$f = a.$f;)+ }
        };
    }
    keep!(QP_ACCESS_FLAGS, qp_access_flags);
    keep!(QP_PKEY_INDEX, pkey_index);
    keep!(QP_QKEY, qkey);
    keep!(QP_PATH_MTU, path_mtu);
    keep!(QP_AV, ah_attr);
    keep!(QP_DEST_QPN, dest_qp_num);
    keep!(QP_RQ_PSN, rq_psn);
    keep!(QP_SQ_PSN, sq_psn);
    keep!(QP_MAX_DEST_RD_ATOMIC, max_dest_rd_atomic);
    keep!(QP_MAX_QP_RD_ATOMIC, max_rd_atomic);
    keep!(QP_MIN_RNR_TIMER, min_rnr_timer);
    keep!(QP_TIMEOUT, timeout);
    keep!(QP_RETRY_CNT, retry_cnt);
    keep!(QP_RNR_RETRY, rnr_retry);
    b.qp.state = next as c_int;
    drop(s);
    if matches!(next, QpState::Err | QpState::Reset) {
        // SAFETY: its context is live.
        let x = unsafe { ctx(b.qp.context) };
        let mut st = lock(&x.sh.st);
        let raised = match st.qps.iter().position(|w| w.qp == qp as usize) {
            Some(i) if next == QpState::Reset => {
                st.qps[i].told = false;
                0
            }
            Some(i) => notify::tell(&x.sh, &mut st, i),
            None => 0,
        };
        drop(st);
        notify::bump(x.sh.async_fd, raised);
    }
    0
}

/// # Safety
/// `qp` live; `a` and `init` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut ibv_qp,
    a: *mut ibv_qp_attr,
    _mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    if qp.is_null() || a.is_null() || init.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: (caller) live.
    let b = unsafe { &mut *(qp as *mut QpBox) };
    // SAFETY: its context is live.
    let h = unsafe { hca(b.qp.context) };
    let st = match h.query_qp_state(b.h) {
        Ok(s) => s as c_int,
        Err(e) => return errno_of(&e),
    };
    b.qp.state = st;
    let mut o = *lock(&b.saved);
    o.qp_state = st;
    o.cur_qp_state = st;
    o.port_num = PORT;
    if let Ok(c) = h.query_qp_cap(b.h) {
        o.cap = cap_out(c);
    }
    // SAFETY: (caller) writable.
    unsafe {
        *a = o;
        *init = ibv_qp_init_attr {
            qp_context: b.qp.qp_context,
            send_cq: b.qp.send_cq,
            recv_cq: b.qp.recv_cq,
            srq: b.qp.srq,
            cap: o.cap,
            qp_type: b.qp.qp_type,
            sq_sig_all: b.sig_all as c_int,
        };
    }
    0
}

/// # Safety
/// `qp` from `ibv_create_qp`.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    if qp.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: (caller) a live QpBox, not used after it is destroyed.
    let b = unsafe { &*(qp as *mut QpBox) };
    // SAFETY: its context is live.
    let x = unsafe { ctx(b.qp.context) };
    // Under the watch lock: the notifier looks at no QP that is going away.
    let mut st = wait_acked(&x.sh, lock(&x.sh.st), qp as usize);
    if let Err(e) = x.sh.hca.destroy_qp(b.h) {
        return errno_of(&e);
    }
    st.qps.retain(|w| w.qp != qp as usize);
    st.events.retain(|e| e.0 != qp as usize);
    drop(st);
    // SAFETY: made by Box::into_raw; freed once; no longer watched or queued.
    drop(unsafe { Box::from_raw(qp as *mut QpBox) });
    0
}

#[no_mangle]
pub extern "C" fn ibv_qp_to_qp_ex(_qp: *mut ibv_qp) -> *mut c_void {
    // Only QPs made by ibv_create_qp_ex have the extended interface; weft makes none.
    ptr::null_mut()
}

#[no_mangle]
pub extern "C" fn ibv_query_qp_data_in_order(_qp: *mut ibv_qp, _op: c_int, _flags: u32) -> c_int {
    0
}

unsafe extern "C" fn op_post_send(
    qp: *mut ibv_qp,
    mut wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    // SAFETY: (the header's contract) a live QP of ours.
    let b = unsafe { &*(qp as *mut QpBox) };
    let mut v: SmallVec<[SendWr; 4]> = SmallVec::new();
    let mut ps: SmallVec<[*mut ibv_send_wr; 4]> = SmallVec::new();
    while !wr.is_null() {
        // SAFETY: (caller) a readable request.
        let w = unsafe { &*wr };
        // SAFETY: (caller) its SGE list is readable.
        let Some(sg) = (unsafe { sges(w.sg_list, w.num_sge) }) else {
            // SAFETY: (caller) writable.
            unsafe { set_bad(bad, wr) };
            return libc::EINVAL;
        };
        // SAFETY: the union member read is the one the opcode names.
        let s = unsafe {
            match w.opcode {
                0 => Some(SendWr::write(
                    w.wr_id,
                    &sg,
                    w.wr.rdma.remote_addr,
                    w.wr.rdma.rkey,
                )),
                1 => Some(SendWr::write_imm(
                    w.wr_id,
                    &sg,
                    w.wr.rdma.remote_addr,
                    w.wr.rdma.rkey,
                    w.imm_data,
                )),
                2 => Some(SendWr::send(w.wr_id, &sg)),
                3 => Some(SendWr::send_imm(w.wr_id, &sg, w.imm_data)),
                4 => Some(SendWr::read(
                    w.wr_id,
                    &sg,
                    w.wr.rdma.remote_addr,
                    w.wr.rdma.rkey,
                )),
                5 if sg.len() == 1 => Some(SendWr::cas(
                    w.wr_id,
                    sg[0],
                    w.wr.atomic.remote_addr,
                    w.wr.atomic.rkey,
                    w.wr.atomic.compare_add,
                    w.wr.atomic.swap,
                )),
                6 if sg.len() == 1 => Some(SendWr::fetch_add(
                    w.wr_id,
                    sg[0],
                    w.wr.atomic.remote_addr,
                    w.wr.atomic.rkey,
                    w.wr.atomic.compare_add,
                )),
                _ => None,
            }
        };
        let Some(mut s) = s else {
            // SAFETY: (caller) writable.
            unsafe { set_bad(bad, wr) };
            return libc::EINVAL;
        };
        if b.ty == QpType::Ud {
            // SAFETY: a UD request names its destination in `wr.ud`.
            let (ah, qpn, qkey) = unsafe { (w.wr.ud.ah, w.wr.ud.remote_qpn, w.wr.ud.remote_qkey) };
            if ah.is_null() {
                // SAFETY: (caller) writable.
                unsafe { set_bad(bad, wr) };
                return libc::EINVAL;
            }
            // SAFETY: (caller) one of our AHs.
            s = s.to(unsafe { (*(ah as *mut AhBox)).h }, qpn, qkey);
        }
        if w.send_flags & SEND_SIGNALED == 0 {
            s = s.unsignaled();
        }
        if w.send_flags & SEND_INLINE != 0 {
            // SAFETY: IBV_SEND_INLINE is the program's promise that the SGEs name readable
            // memory of this process for the duration of ibv_post_send, as `inlined` asks.
            s = unsafe { s.inlined() };
        }
        v.push(s);
        ps.push(wr);
        wr = w.next;
    }
    // SAFETY: its context is live.
    match unsafe { hca(b.qp.context) }.post_send(b.h, &v) {
        Ok(()) => 0,
        Err(e) => {
            if !ps.is_empty() {
                // SAFETY: (caller) writable.
                unsafe { set_bad(bad, ps[refused_index(&e).min(ps.len() - 1)]) };
            }
            errno_of(&e)
        }
    }
}

unsafe extern "C" fn op_post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    // SAFETY: (the header's contract) a live QP of ours and a readable list.
    let (b, l) = unsafe { (&*(qp as *mut QpBox), recv_list(wr)) };
    let (v, ps) = match l {
        Ok(x) => x,
        Err(p) => {
            // SAFETY: (caller) writable.
            unsafe { set_bad(bad, p) };
            return libc::EINVAL;
        }
    };
    // SAFETY: its context is live.
    match unsafe { hca(b.qp.context) }.post_recv(b.h, &v) {
        Ok(()) => 0,
        Err(e) => {
            if !ps.is_empty() {
                // SAFETY: (caller) writable.
                unsafe { set_bad(bad, ps[refused_index(&e).min(ps.len() - 1)]) };
            }
            errno_of(&e)
        }
    }
}

// ---------------------------------------------------------------- AHs

/// # Safety
/// `pd` from `ibv_alloc_pd`; `a` readable.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah(pd: *mut ibv_pd, a: *mut ibv_ah_attr) -> *mut ibv_ah {
    if pd.is_null() || a.is_null() {
        return null_with(libc::EINVAL);
    }
    // SAFETY: (caller) live and readable.
    let (p, a) = unsafe { (&*(pd as *mut PdBox), &*a) };
    let at = match ah_of(a) {
        Ok(x) => x,
        Err(e) => return null_with(e),
    };
    // SAFETY: its context is live.
    match unsafe { hca(p.pd.context) }.create_ah(p.h, &at) {
        Ok(h) => Box::into_raw(Box::new(AhBox {
            ah: ibv_ah {
                context: p.pd.context,
                pd,
                handle: h.0,
            },
            h,
        })) as *mut ibv_ah,
        Err(e) => null_with(errno_of(&e)),
    }
}

/// # Safety
/// `ah` from `ibv_create_ah`.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_ah(ah: *mut ibv_ah) -> c_int {
    // SAFETY: (caller) `ah` is NULL or ours, not used after it is destroyed; its context
    // is live.
    unsafe { destroy(ah as *mut AhBox, |b| hca(b.ah.context).destroy_ah(b.h)) }
}

/// # Safety
/// `wc` readable; `grh` the 40 bytes at the head of its receive buffer; `a` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_init_ah_from_wc(
    _c: *mut ibv_context,
    port: u8,
    wc: *mut ibv_wc,
    grh: *mut u8,
    a: *mut ibv_ah_attr,
) -> c_int {
    if wc.is_null() || grh.is_null() || a.is_null() || port != PORT {
        return libc::EINVAL;
    }
    // SAFETY: (caller) readable.
    if unsafe { (*wc).wc_flags } & WC_GRH == 0 {
        return libc::EINVAL; // RoCE-style: the way back is the GRH's source GID
    }
    let mut dgid = [0u8; 16];
    // SAFETY: (caller) 40 readable GRH bytes.
    dgid.copy_from_slice(unsafe { &std::slice::from_raw_parts(grh, 40)[GRH_SGID] });
    // SAFETY: (caller) writable.
    unsafe {
        *a = ibv_ah_attr {
            grh: ibv_global_route {
                dgid,
                flow_label: 0,
                sgid_index: 0,
                hop_limit: 0xff,
                traffic_class: 0,
            },
            dlid: 0,
            sl: 0,
            src_path_bits: 0,
            static_rate: 0,
            is_global: 1,
            port_num: port,
        }
    };
    0
}

/// # Safety
/// As `ibv_init_ah_from_wc`, with `pd` ours.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah_from_wc(
    pd: *mut ibv_pd,
    wc: *mut ibv_wc,
    grh: *mut u8,
    port: u8,
) -> *mut ibv_ah {
    if pd.is_null() {
        return null_with(libc::EINVAL);
    }
    // SAFETY: all-zero is a valid ibv_ah_attr.
    let mut a: ibv_ah_attr = unsafe { std::mem::zeroed() };
    // SAFETY: (caller) as documented.
    let r = unsafe { ibv_init_ah_from_wc((*pd).context, port, wc, grh, &mut a) };
    if r != 0 {
        return null_with(r);
    }
    // SAFETY: (caller) `pd` ours; `a` a local.
    unsafe { ibv_create_ah(pd, &mut a) }
}

// ---------------------------------------------------------------- async events

/// # Safety
/// `c` ours; `ev` writable.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_async_event(
    c: *mut ibv_context,
    ev: *mut ibv_async_event,
) -> c_int {
    if c.is_null() || ev.is_null() {
        return -1;
    }
    // SAFETY: (caller) ours.
    let x = unsafe { ctx(c) };
    loop {
        if !take(x.sh.async_fd) {
            return -1;
        }
        let mut st = lock(&x.sh.st);
        if let Some((el, t)) = st.events.pop_front() {
            match st.unacked.iter_mut().find(|u| u.0 == el) {
                Some(u) => u.1 += 1,
                None if el != 0 => st.unacked.push((el, 1)),
                None => {}
            }
            // SAFETY: (caller) writable.
            unsafe {
                *ev = ibv_async_event {
                    element: el as *mut c_void,
                    event_type: t,
                }
            };
            return 0;
        }
    }
}

/// # Safety
/// `ev` from `ibv_get_async_event`.
#[no_mangle]
pub unsafe extern "C" fn ibv_ack_async_event(ev: *mut ibv_async_event) {
    if ev.is_null() {
        return;
    }
    // SAFETY: (caller) readable.
    let (el, t) = unsafe { ((*ev).element, (*ev).event_type) };
    if el.is_null() {
        return;
    }
    // SAFETY: the event names a live object until it is acknowledged (its destroy waits for
    // that), and so its live context. The counters are rdma-core's, kept under our lock.
    unsafe {
        let c = match t {
            EVENT_CQ_ERR => (*(el as *mut ibv_cq)).context,
            EVENT_SRQ_LIMIT_REACHED => (*(el as *mut ibv_srq)).context,
            _ => (*(el as *mut ibv_qp)).context,
        };
        let x = ctx(c);
        let mut st = lock(&x.sh.st);
        let Some(i) = st.unacked.iter().position(|u| u.0 == el as usize) else {
            return; // not an event we gave out (or acknowledged twice)
        };
        st.unacked[i].1 -= 1;
        if st.unacked[i].1 == 0 {
            st.unacked.swap_remove(i);
        }
        match t {
            EVENT_CQ_ERR => {
                let q = el as *mut ibv_cq;
                (*q).async_events_completed = (*q).async_events_completed.wrapping_add(1);
            }
            EVENT_SRQ_LIMIT_REACHED => {
                let q = el as *mut ibv_srq;
                (*q).events_completed = (*q).events_completed.wrapping_add(1);
            }
            _ => {
                let q = el as *mut ibv_qp;
                (*q).events_completed = (*q).events_completed.wrapping_add(1);
            }
        }
        drop(st);
        x.sh.acked.notify_all();
    }
}

/// Wait (with the watch lock `st`, released meanwhile) until every asynchronous event given
/// out for `el` is acknowledged, as rdma-core's destroy calls do.
fn wait_acked<'a>(sh: &Shared, mut st: MutexGuard<'a, Watch>, el: usize) -> MutexGuard<'a, Watch> {
    while st.unacked.iter().any(|u| u.0 == el) {
        st = sh.acked.wait(st).unwrap_or_else(|p| p.into_inner());
    }
    st
}

// ---------------------------------------------------------------- the rest of the API

#[no_mangle]
pub extern "C" fn ibv_fork_init() -> c_int {
    0
}

#[no_mangle]
pub extern "C" fn ibv_is_fork_initialized() -> c_int {
    2 // IBV_FORK_UNNEEDED: the soft HCA pins nothing
}

#[no_mangle]
pub extern "C" fn ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

#[no_mangle]
pub extern "C" fn ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

#[no_mangle]
pub extern "C" fn ibv_copy_qp_attr_from_kern(_dst: *mut c_void, _src: *mut c_void) {}
#[no_mangle]
pub extern "C" fn ibv_copy_ah_attr_from_kern(_dst: *mut c_void, _src: *mut c_void) {}
#[no_mangle]
pub extern "C" fn ibv_copy_path_rec_from_kern(_dst: *mut c_void, _src: *mut c_void) {}
#[no_mangle]
pub extern "C" fn ibv_copy_path_rec_to_kern(_dst: *mut c_void, _src: *mut c_void) {}

#[no_mangle]
pub extern "C" fn ibv_get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

/// There is no sysfs for the soft HCA: every read fails (-1), as for a file that is missing.
#[no_mangle]
pub extern "C" fn ibv_read_sysfs_file(
    _dir: *const c_char,
    _file: *const c_char,
    _buf: *mut c_char,
    _size: usize,
) -> c_int {
    -1
}

#[no_mangle]
pub extern "C" fn ibv_wc_status_str(s: c_int) -> *const c_char {
    let t: &'static std::ffi::CStr = match s {
        0 => c"success",
        1 => c"local length error",
        2 => c"local QP operation error",
        3 => c"local EE context operation error",
        4 => c"local protection error",
        5 => c"Work Request Flushed Error",
        6 => c"memory management operation error",
        7 => c"bad response error",
        8 => c"local access error",
        9 => c"remote invalid request error",
        10 => c"remote access error",
        11 => c"remote operation error",
        12 => c"transport retry counter exceeded",
        13 => c"RNR retry counter exceeded",
        21 => c"general error",
        _ => c"unknown",
    };
    t.as_ptr()
}

#[no_mangle]
pub extern "C" fn ibv_node_type_str(t: c_int) -> *const c_char {
    match t {
        1 => c"InfiniBand channel adapter",
        2 => c"InfiniBand switch",
        3 => c"InfiniBand router",
        4 => c"iWARP NIC",
        _ => c"unknown",
    }
    .as_ptr()
}

#[no_mangle]
pub extern "C" fn ibv_port_state_str(s: c_int) -> *const c_char {
    match s {
        0 => c"PORT_NOP",
        1 => c"PORT_DOWN",
        2 => c"PORT_INIT",
        3 => c"PORT_ARMED",
        4 => c"PORT_ACTIVE",
        5 => c"PORT_ACTIVE_DEFER",
        _ => c"invalid state",
    }
    .as_ptr()
}

#[no_mangle]
pub extern "C" fn ibv_event_type_str(e: c_int) -> *const c_char {
    match e {
        0 => c"CQ error",
        1 => c"local work queue catastrophic error",
        2 => c"invalid request local work queue error",
        3 => c"local access violation work queue error",
        9 => c"port active",
        10 => c"port error",
        15 => c"SRQ limit reached",
        16 => c"last WQE reached",
        _ => c"unknown",
    }
    .as_ptr()
}

/// (enum ibv_rate, multiple of 2.5 Gb/s, Mb/s) for the classic rates.
const RATES: [(c_int, c_int, c_int); 9] = [
    (2, 1, 2_500),
    (5, 2, 5_000),
    (3, 4, 10_000),
    (6, 8, 20_000),
    (4, 12, 30_000),
    (7, 16, 40_000),
    (8, 24, 60_000),
    (9, 32, 80_000),
    (10, 48, 120_000),
];

#[no_mangle]
pub extern "C" fn ibv_rate_to_mult(r: c_int) -> c_int {
    RATES.iter().find(|x| x.0 == r).map_or(-1, |x| x.1)
}

#[no_mangle]
pub extern "C" fn mult_to_ibv_rate(m: c_int) -> c_int {
    RATES.iter().find(|x| x.1 == m).map_or(0, |x| x.0)
}

#[no_mangle]
pub extern "C" fn ibv_rate_to_mbps(r: c_int) -> c_int {
    RATES.iter().find(|x| x.0 == r).map_or(-1, |x| x.2)
}

#[no_mangle]
pub extern "C" fn mbps_to_ibv_rate(m: c_int) -> c_int {
    RATES.iter().find(|x| x.2 == m).map_or(0, |x| x.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transition_masks_follow_the_kernel() {
        let rc_rtr = masks(true, QpState::Init, QpState::Rtr).unwrap();
        assert_eq!(rc_rtr.0 & QP_AV, QP_AV);
        assert!(masks(true, QpState::Reset, QpState::Rts).is_none());
        assert_eq!(
            masks(false, QpState::Reset, QpState::Init).unwrap().0,
            QP_PKEY_INDEX | QP_PORT | QP_QKEY
        );
        assert_eq!(
            masks(false, QpState::Rtr, QpState::Rts).unwrap().0,
            QP_SQ_PSN
        );
    }

    #[test]
    fn refused_index_reads_the_soft_hcas_wording() {
        let e = Error::invalid("post_send: request 3 (wr_id 9): the send queue is full (ENOMEM)");
        assert_eq!(refused_index(&e), 3);
        assert_eq!(errno_of(&e), libc::ENOMEM);
        assert_eq!(refused_index(&Error::invalid("no such QP")), 0);
    }
}
