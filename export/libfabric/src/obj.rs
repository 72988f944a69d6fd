// Over 800 lines: libfabric's object structs and their operation tables, every entry filled, one kind after another.
//! libfabric's objects for the `weft` provider. Each is a `#[repr(C)]` struct whose first
//! field is libfabric's `fid_*` (so a `*mut fid_ep` is a `*mut Ep`) and which carries its own
//! operation tables; it is leaked, never freed, so that a call through a closed object's
//! pointer finds valid memory and is refused (`-FI_EINVAL`) by the live set in
//! [`crate::state`]. Every table entry is filled: libfabric's inline calls do not check for
//! null, so what weft does not offer answers `-FI_ENOSYS`.

use crate::data;
use crate::state::{self, Entry, NAME_LEN};
use crate::{err, guard, serr, NULL};
use std::os::raw::{c_char, c_int, c_void};
use weft_ofi_sys as fi;

pub(crate) type Fid = *mut fi::fid;

pub(crate) fn addr<T>(p: *const T) -> usize {
    p as usize
}

/// Leak `b` and register it live; its address.
pub(crate) fn live<T>(b: Box<T>) -> *mut T {
    let p = Box::leak(b) as *mut T;
    state::with(|g| g.live.insert(addr(p)));
    p
}

pub(crate) fn is_live(p: usize) -> bool {
    state::with(|g| g.live.contains(&p))
}

pub(crate) fn fid_ops(close: unsafe extern "C" fn(Fid) -> c_int) -> fi::fi_ops {
    fi::fi_ops {
        size: std::mem::size_of::<fi::fi_ops>(),
        close: Some(close),
        bind: Some(bind_none),
        control: Some(control_none),
        ops_open: Some(ops_open_none),
        tostr: None,
        ops_set: None,
    }
}

unsafe extern "C" fn bind_none(_: Fid, _: Fid, _: u64) -> c_int {
    err(fi::FI_ENOSYS)
}
unsafe extern "C" fn control_none(_: Fid, _: c_int, _: *mut c_void) -> c_int {
    err(fi::FI_ENOSYS)
}
unsafe extern "C" fn ops_open_none(
    _: Fid,
    _: *const c_char,
    _: u64,
    _: *mut *mut c_void,
    _: *mut c_void,
) -> c_int {
    err(fi::FI_ENOSYS)
}

/// Close: the object leaves the live set (its memory stays).
pub(crate) unsafe extern "C" fn close_plain(f: Fid) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        state::with(|g| {
            let a = addr(f);
            if !g.live.remove(&a) {
                return err(fi::FI_EINVAL);
            }
            g.cqs.remove(&a);
            g.avs.remove(&a);
            g.cntrs.remove(&a);
            0
        })
    })
}

// ---- fabric ---------------------------------------------------------------------------

#[repr(C)]
pub struct Fabric {
    fid: fi::fid_fabric,
    ops: fi::fi_ops,
    fabric_ops: fi::fi_ops_fabric,
}

/// The provider's `fabric`: open the `weft` fabric.
///
/// # Safety
/// libfabric's contract for a provider's `fabric`: `out` is null or writable.
pub unsafe extern "C" fn fabric_open(
    _attr: *mut fi::fi_fabric_attr,
    out: *mut *mut fi::fid_fabric,
    context: *mut c_void,
) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        if out.is_null() {
            return err(fi::FI_EINVAL);
        }
        let mut b = Box::new(Fabric {
            fid: fi::fid_fabric::default(),
            ops: fid_ops(close_plain),
            fabric_ops: fi::fi_ops_fabric {
                size: std::mem::size_of::<fi::fi_ops_fabric>(),
                domain: Some(domain_open),
                passive_ep: Some(passive_ep_none),
                eq_open: Some(eq_open),
                wait_open: Some(wait_open_none),
                trywait: Some(trywait_none),
                domain2: Some(domain2_open),
            },
        });
        b.fid.fid.fclass = fi::FI_CLASS_FABRIC as usize;
        b.fid.fid.context = context;
        b.fid.api_version = crate::API_VERSION;
        let p = live(b);
        // SAFETY: `p` is the leaked box (never freed); the tables live inside it.
        unsafe {
            (*p).fid.fid.ops = &mut (*p).ops;
            (*p).fid.ops = &mut (*p).fabric_ops;
            *out = &mut (*p).fid;
        }
        0
    })
}

unsafe extern "C" fn passive_ep_none(
    _: *mut fi::fid_fabric,
    _: *mut fi::fi_info,
    _: *mut *mut fi::fid_pep,
    _: *mut c_void,
) -> c_int {
    err(fi::FI_ENOSYS)
}
unsafe extern "C" fn wait_open_none(
    _: *mut fi::fid_fabric,
    _: *mut fi::fi_wait_attr,
    _: *mut *mut fi::fid_wait,
) -> c_int {
    err(fi::FI_ENOSYS)
}
unsafe extern "C" fn trywait_none(_: *mut fi::fid_fabric, _: *mut *mut fi::fid, _: c_int) -> c_int {
    err(fi::FI_ENOSYS)
}

// ---- domain ---------------------------------------------------------------------------

#[repr(C)]
pub struct Domain {
    fid: fi::fid_domain,
    ops: fi::fi_ops,
    domain_ops: fi::fi_ops_domain,
    mr_ops: fi::fi_ops_mr,
}

unsafe extern "C" fn domain2_open(
    fabric: *mut fi::fid_fabric,
    info: *mut fi::fi_info,
    dom: *mut *mut fi::fid_domain,
    flags: u64,
    context: *mut c_void,
) -> c_int {
    if flags != 0 {
        return err(fi::FI_EINVAL);
    }
    // SAFETY: the same contract as fi_domain's.
    unsafe { domain_open(fabric, info, dom, context) }
}

/// `fi_domain`: join the job over the weft provider the domain names (collective).
unsafe extern "C" fn domain_open(
    fabric: *mut fi::fid_fabric,
    info: *mut fi::fi_info,
    out: *mut *mut fi::fid_domain,
    context: *mut c_void,
) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        if out.is_null() || info.is_null() || !is_live(addr(fabric)) {
            return err(fi::FI_EINVAL);
        }
        // SAFETY: libfabric passes a valid fi_info (one getinfo returned, or the app's copy).
        let name = unsafe {
            (*info)
                .domain_attr
                .as_ref()
                .map(|d| crate::cstr(d.name).to_string())
                .unwrap_or_default()
        };
        let name = if name.is_empty() {
            match crate::info::domains().into_iter().next() {
                Some(n) => n,
                None => return err(fi::FI_ENODATA),
            }
        } else {
            name
        };
        if let Err(e) = state::with(|g| g.open_world(&name)) {
            return err(e);
        }
        // SAFETY: as above.
        let mr_mode = unsafe { (*info).domain_attr.as_ref() }.map_or(0, |d| d.mr_mode as u64);
        let mut b = Box::new(Domain {
            fid: fi::fid_domain::default(),
            ops: fid_ops(domain_close),
            domain_ops: fi::fi_ops_domain {
                size: std::mem::size_of::<fi::fi_ops_domain>(),
                av_open: Some(av_open),
                cq_open: Some(cq_open),
                endpoint: Some(ep_open),
                scalable_ep: Some(scalable_ep_none),
                cntr_open: Some(crate::cntr::open),
                poll_open: Some(poll_open_none),
                stx_ctx: Some(stx_none),
                srx_ctx: Some(srx_none),
                query_atomic: Some(query_atomic),
                query_collective: Some(query_collective_none),
                endpoint2: Some(ep_open2),
            },
            mr_ops: fi::fi_ops_mr {
                size: std::mem::size_of::<fi::fi_ops_mr>(),
                reg: Some(mr_reg),
                regv: Some(mr_regv),
                regattr: Some(mr_regattr),
            },
        });
        b.fid.fid.fclass = fi::FI_CLASS_DOMAIN as usize;
        b.fid.fid.context = context;
        let p = live(b);
        state::with(|g| g.domains.insert(addr(p), crate::info::mr_mode(mr_mode)));
        // SAFETY: `p` is the leaked box; the tables live inside it.
        unsafe {
            (*p).fid.fid.ops = &mut (*p).ops;
            (*p).fid.ops = &mut (*p).domain_ops;
            (*p).fid.mr = &mut (*p).mr_ops;
            *out = &mut (*p).fid;
        }
        0
    })
}

/// Closing the last domain ends this process's part in the job (collective, like opening it).
unsafe extern "C" fn domain_close(f: Fid) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        state::with(|g| {
            if !g.live.remove(&addr(f)) {
                return err(fi::FI_EINVAL);
            }
            // A process may have several domains open (Open MPI's mtl/ofi and btl/ofi each
            // open one); they share the process's weft world, which ends with the last.
            g.domains.remove(&addr(f));
            if g.domains.is_empty() {
                g.close_world();
            }
            0
        })
    })
}

unsafe extern "C" fn scalable_ep_none(
    _: *mut fi::fid_domain,
    _: *mut fi::fi_info,
    _: *mut *mut fi::fid_ep,
    _: *mut c_void,
) -> c_int {
    err(fi::FI_ENOSYS)
}
unsafe extern "C" fn poll_open_none(
    _: *mut fi::fid_domain,
    _: *mut fi::fi_poll_attr,
    _: *mut *mut fi::fid_poll,
) -> c_int {
    err(fi::FI_ENOSYS)
}
unsafe extern "C" fn stx_none(
    _: *mut fi::fid_domain,
    _: *mut fi::fi_tx_attr,
    _: *mut *mut fi::fid_stx,
    _: *mut c_void,
) -> c_int {
    err(fi::FI_ENOSYS)
}
unsafe extern "C" fn srx_none(
    _: *mut fi::fid_domain,
    _: *mut fi::fi_rx_attr,
    _: *mut *mut fi::fid_ep,
    _: *mut c_void,
) -> c_int {
    err(fi::FI_ENOSYS)
}
/// `fi_query_atomic`: whether weft-fi offers `op` on `dtype` for the call `flags` names
/// (`FI_FETCH_ATOMIC`, `FI_COMPARE_ATOMIC`, else `fi_atomic`), and how many elements one
/// operation may carry.
unsafe extern "C" fn query_atomic(
    d: *mut fi::fid_domain,
    dtype: fi::fi_datatype,
    op: fi::fi_op,
    attr: *mut fi::fi_atomic_attr,
    flags: u64,
) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        if !is_live(addr(d)) || attr.is_null() {
            return err(fi::FI_EINVAL);
        }
        match crate::oneside::elements(flags, op, dtype) {
            Some((count, size)) => {
                // SAFETY: non-null, the caller's attribute struct.
                unsafe {
                    (*attr).count = count;
                    (*attr).size = size;
                }
                0
            }
            None => err(fi::FI_EOPNOTSUPP),
        }
    })
}
unsafe extern "C" fn query_collective_none(
    _: *mut fi::fid_domain,
    _: fi::fi_collective_op,
    _: *mut fi::fi_collective_attr,
    _: u64,
) -> c_int {
    err(fi::FI_ENOSYS)
}

// ---- memory regions: the targets of RMA and atomics (messages need none) ---------------

#[repr(C)]
pub struct Mr {
    fid: fi::fid_mr,
    ops: fi::fi_ops,
}

/// Register `len` bytes at `buf` on domain `f` (the key requested or, in `FI_MR_PROV_KEY`
/// mode, chosen).
#[allow(clippy::too_many_arguments)]
fn mr_new(
    f: Fid,
    buf: *const c_void,
    len: usize,
    access: u64,
    offset: u64,
    key: u64,
    context: *mut c_void,
    out: *mut *mut fi::fid_mr,
) -> c_int {
    if out.is_null() || !is_live(addr(f)) || (buf.is_null() && len > 0) {
        return err(fi::FI_EINVAL);
    }
    let mut b = Box::new(Mr {
        fid: fi::fid_mr::default(),
        ops: fid_ops(mr_close),
    });
    b.fid.fid.fclass = fi::FI_CLASS_MR as usize;
    b.fid.fid.context = context;
    b.fid.mem_desc = NULL;
    let p = Box::leak(b) as *mut Mr;
    let key = state::with(|g| {
        let k = g.mr_reg(addr(f), addr(p), buf as usize, len, access, offset, key)?;
        g.live.insert(addr(p));
        Ok::<u64, u64>(k)
    });
    let key = match key {
        Ok(k) => k,
        Err(e) => return err(e),
    };
    // SAFETY: the leaked box; `out` is non-null.
    unsafe {
        (*p).fid.key = key;
        (*p).fid.fid.ops = &mut (*p).ops;
        *out = &mut (*p).fid;
    }
    0
}

/// Close a region: no remote access reaches it afterwards; waits (bounded) until the
/// accesses already under way are done, so that the application may free the memory.
unsafe extern "C" fn mr_close(f: Fid) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        let a = addr(f);
        if !is_live(a) {
            return err(fi::FI_EINVAL);
        }
        let t0 = std::time::Instant::now();
        while state::with(|g| g.mr_close(a)) > 0 {
            if t0.elapsed() > std::time::Duration::from_secs(10) {
                return err(fi::FI_EBUSY);
            }
            std::thread::yield_now();
        }
        state::with(|g| g.live.remove(&a));
        0
    })
}

unsafe extern "C" fn mr_reg(
    f: Fid,
    buf: *const c_void,
    len: usize,
    access: u64,
    offset: u64,
    key: u64,
    _flags: u64,
    out: *mut *mut fi::fid_mr,
    context: *mut c_void,
) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        mr_new(f, buf, len, access, offset, key, context, out)
    })
}

unsafe extern "C" fn mr_regv(
    f: Fid,
    iov: *const fi::iovec,
    count: usize,
    access: u64,
    offset: u64,
    key: u64,
    _flags: u64,
    out: *mut *mut fi::fid_mr,
    context: *mut c_void,
) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        // SAFETY: fi_mr_regv's iovec of `count` entries.
        let (buf, len) = match (count, unsafe { iov.as_ref() }) {
            (0, _) => (NULL as *const c_void, 0),
            (1, Some(v)) => (v.iov_base as *const c_void, v.iov_len),
            _ => return err(fi::FI_EINVAL),
        };
        mr_new(f, buf, len, access, offset, key, context, out)
    })
}

unsafe extern "C" fn mr_regattr(
    f: Fid,
    attr: *const fi::fi_mr_attr,
    _flags: u64,
    out: *mut *mut fi::fid_mr,
) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        // SAFETY: null or libfabric's attribute struct for the call.
        let Some(a) = (unsafe { attr.as_ref() }) else {
            return err(fi::FI_EINVAL);
        };
        // SAFETY: the attribute's iovec of `iov_count` entries.
        let (buf, len) = match (a.iov_count, unsafe { a.mr_iov.as_ref() }) {
            (0, _) => (NULL as *const c_void, 0),
            (1, Some(v)) => (v.iov_base as *const c_void, v.iov_len),
            _ => return err(fi::FI_EINVAL),
        };
        mr_new(
            f,
            buf,
            len,
            a.access,
            a.offset,
            a.requested_key,
            a.context,
            out,
        )
    })
}

// ---- event queue: no connection events on RDM endpoints ---------------------------------

#[repr(C)]
pub struct Eq {
    fid: fi::fid_eq,
    ops: fi::fi_ops,
    eq_ops: fi::fi_ops_eq,
}

unsafe extern "C" fn eq_open(
    fabric: *mut fi::fid_fabric,
    _attr: *mut fi::fi_eq_attr,
    out: *mut *mut fi::fid_eq,
    context: *mut c_void,
) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        if out.is_null() || !is_live(addr(fabric)) {
            return err(fi::FI_EINVAL);
        }
        let mut b = Box::new(Eq {
            fid: fi::fid_eq::default(),
            ops: fid_ops(close_plain),
            eq_ops: fi::fi_ops_eq {
                size: std::mem::size_of::<fi::fi_ops_eq>(),
                read: Some(eq_read),
                readerr: Some(eq_readerr),
                write: Some(eq_write),
                sread: Some(eq_sread),
                strerror: Some(eq_strerror),
            },
        });
        b.fid.fid.fclass = fi::FI_CLASS_EQ as usize;
        b.fid.fid.context = context;
        let p = live(b);
        // SAFETY: the leaked box; `out` is non-null.
        unsafe {
            (*p).fid.fid.ops = &mut (*p).ops;
            (*p).fid.ops = &mut (*p).eq_ops;
            *out = &mut (*p).fid;
        }
        0
    })
}

unsafe extern "C" fn eq_read(
    eq: *mut fi::fid_eq,
    _: *mut u32,
    _: *mut c_void,
    _: usize,
    _: u64,
) -> isize {
    if is_live(addr(eq)) {
        serr(fi::FI_EAGAIN)
    } else {
        serr(fi::FI_EINVAL)
    }
}
unsafe extern "C" fn eq_readerr(eq: *mut fi::fid_eq, _: *mut fi::fi_eq_err_entry, _: u64) -> isize {
    if is_live(addr(eq)) {
        serr(fi::FI_EAGAIN)
    } else {
        serr(fi::FI_EINVAL)
    }
}
unsafe extern "C" fn eq_write(
    _: *mut fi::fid_eq,
    _: u32,
    _: *const c_void,
    _: usize,
    _: u64,
) -> isize {
    serr(fi::FI_ENOSYS)
}
unsafe extern "C" fn eq_sread(
    eq: *mut fi::fid_eq,
    _: *mut u32,
    _: *mut c_void,
    _: usize,
    _: c_int,
    _: u64,
) -> isize {
    // No event ever comes on an RDM endpoint's queue.
    if is_live(addr(eq)) {
        serr(fi::FI_EAGAIN)
    } else {
        serr(fi::FI_EINVAL)
    }
}
unsafe extern "C" fn eq_strerror(
    _: *mut fi::fid_eq,
    _: c_int,
    _: *const c_void,
    _: *mut c_char,
    _: usize,
) -> *const c_char {
    c"weft event queue error".as_ptr()
}

// ---- completion queue -------------------------------------------------------------------

#[repr(C)]
pub struct Cq {
    fid: fi::fid_cq,
    ops: fi::fi_ops,
    cq_ops: fi::fi_ops_cq,
}

unsafe extern "C" fn cq_open(
    domain: *mut fi::fid_domain,
    attr: *mut fi::fi_cq_attr,
    out: *mut *mut fi::fid_cq,
    context: *mut c_void,
) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        if out.is_null() || !is_live(addr(domain)) {
            return err(fi::FI_EINVAL);
        }
        // SAFETY: null or the application's attributes for the call.
        let format = unsafe { attr.as_ref() }.map_or(fi::FI_CQ_FORMAT_UNSPEC, |a| a.format);
        let format = match format {
            fi::FI_CQ_FORMAT_UNSPEC => fi::FI_CQ_FORMAT_CONTEXT,
            f @ (fi::FI_CQ_FORMAT_CONTEXT
            | fi::FI_CQ_FORMAT_MSG
            | fi::FI_CQ_FORMAT_DATA
            | fi::FI_CQ_FORMAT_TAGGED) => f,
            _ => return err(fi::FI_ENOSYS),
        };
        // SAFETY: as above.
        if unsafe { attr.as_ref() }
            .is_some_and(|a| a.wait_obj != fi::FI_WAIT_NONE && a.wait_obj != fi::FI_WAIT_UNSPEC)
        {
            return err(fi::FI_ENOSYS);
        }
        let mut b = Box::new(Cq {
            fid: fi::fid_cq::default(),
            ops: fid_ops(close_plain),
            cq_ops: fi::fi_ops_cq {
                size: std::mem::size_of::<fi::fi_ops_cq>(),
                read: Some(cq_read),
                readfrom: Some(cq_readfrom),
                readerr: Some(cq_readerr),
                sread: Some(cq_sread),
                sreadfrom: Some(cq_sreadfrom),
                signal: Some(cq_signal),
                strerror: Some(cq_strerror),
            },
        });
        b.fid.fid.fclass = fi::FI_CLASS_CQ as usize;
        b.fid.fid.context = context;
        let p = live(b);
        state::with(|g| {
            g.cqs.insert(
                addr(p),
                state::Cq {
                    format,
                    ..Default::default()
                },
            )
        });
        // SAFETY: the leaked box; `out` is non-null.
        unsafe {
            (*p).fid.fid.ops = &mut (*p).ops;
            (*p).fid.ops = &mut (*p).cq_ops;
            *out = &mut (*p).fid;
        }
        0
    })
}

/// Write `e` as entry `i` of `buf` in `format`.
///
/// # Safety
/// `buf` holds at least `i + 1` entries of `format`.
unsafe fn put(buf: *mut c_void, i: usize, format: u32, e: &Entry) {
    // SAFETY: per the contract; each format's struct is libfabric's.
    unsafe {
        match format {
            fi::FI_CQ_FORMAT_CONTEXT => {
                let o = (buf as *mut fi::fi_cq_entry).add(i);
                (*o).op_context = e.ctx;
            }
            fi::FI_CQ_FORMAT_MSG => {
                let o = (buf as *mut fi::fi_cq_msg_entry).add(i);
                (*o).op_context = e.ctx;
                (*o).flags = e.flags;
                (*o).len = e.len;
            }
            fi::FI_CQ_FORMAT_DATA => {
                let o = (buf as *mut fi::fi_cq_data_entry).add(i);
                (*o).op_context = e.ctx;
                (*o).flags = e.flags;
                (*o).len = e.len;
                (*o).buf = e.buf;
                (*o).data = e.data;
            }
            _ => {
                let o = (buf as *mut fi::fi_cq_tagged_entry).add(i);
                (*o).op_context = e.ctx;
                (*o).flags = e.flags;
                (*o).len = e.len;
                (*o).buf = e.buf;
                (*o).data = e.data;
                (*o).tag = e.tag;
            }
        }
    }
}

fn read_into(cq: usize, buf: *mut c_void, count: usize, src: *mut fi::fi_addr_t) -> isize {
    state::with(|g| {
        if !g.live.contains(&cq) || !g.cqs.contains_key(&cq) {
            return serr(fi::FI_EINVAL);
        }
        g.poll();
        let q = g.cqs.get(&cq).expect("checked");
        if q.ok.is_empty() {
            return if q.err.is_empty() {
                serr(fi::FI_EAGAIN)
            } else {
                serr(fi::FI_EAVAIL as u64)
            };
        }
        if buf.is_null() || count == 0 {
            return serr(fi::FI_EINVAL);
        }
        let av = if src.is_null() { 0 } else { g.av_of_cq(cq) };
        let (n, format) = (count.min(q.ok.len()), q.format);
        let mut entries = [Entry::default(); 16];
        let mut done = 0;
        while done < n {
            let q = g.cqs.get_mut(&cq).expect("checked");
            let k = (n - done).min(entries.len());
            for (slot, e) in entries.iter_mut().zip(q.ok.drain(..k)) {
                *slot = e;
            }
            for (i, e) in entries[..k].iter().enumerate() {
                // SAFETY: the application's buffer holds `count` >= n entries of the format.
                unsafe { put(buf, done + i, format, e) };
                if !src.is_null() {
                    let a = e.src.map_or(fi::FI_ADDR_UNSPEC, |r| g.addr_of(av, r));
                    // SAFETY: fi_cq_readfrom's array has `count` addresses.
                    unsafe { *src.add(done + i) = a };
                }
            }
            done += k;
        }
        n as isize
    })
}

unsafe extern "C" fn cq_read(cq: *mut fi::fid_cq, buf: *mut c_void, count: usize) -> isize {
    guard(serr(fi::FI_EOTHER as u64), || {
        read_into(addr(cq), buf, count, std::ptr::null_mut())
    })
}

unsafe extern "C" fn cq_readfrom(
    cq: *mut fi::fid_cq,
    buf: *mut c_void,
    count: usize,
    src: *mut fi::fi_addr_t,
) -> isize {
    guard(serr(fi::FI_EOTHER as u64), || {
        read_into(addr(cq), buf, count, src)
    })
}

unsafe extern "C" fn cq_readerr(
    cq: *mut fi::fid_cq,
    buf: *mut fi::fi_cq_err_entry,
    _: u64,
) -> isize {
    guard(serr(fi::FI_EOTHER as u64), || {
        state::with(|g| {
            let a = addr(cq);
            if !g.live.contains(&a) || buf.is_null() {
                return serr(fi::FI_EINVAL);
            }
            let Some(q) = g.cqs.get_mut(&a) else {
                return serr(fi::FI_EINVAL);
            };
            let Some(e) = q.err.pop_front() else {
                return serr(fi::FI_EAGAIN);
            };
            // SAFETY: the application's error entry for the call.
            unsafe {
                let o = &mut *buf;
                o.op_context = e.ctx;
                o.flags = e.flags;
                o.len = e.len;
                o.buf = e.buf;
                o.data = e.data;
                o.tag = e.tag;
                o.olen = e.olen;
                o.err = e.err as c_int;
                o.prov_errno = e.err as c_int;
                // No provider data: a caller's err_data buffer is left as it is.
                o.err_data_size = 0;
            }
            1
        })
    })
}

unsafe extern "C" fn cq_sread(
    cq: *mut fi::fid_cq,
    buf: *mut c_void,
    count: usize,
    _cond: *const c_void,
    timeout: c_int,
) -> isize {
    // SAFETY: the same contract as fi_cq_sreadfrom's.
    unsafe { cq_sreadfrom(cq, buf, count, std::ptr::null_mut(), _cond, timeout) }
}

/// Blocking read: progress until an entry comes or `timeout` ms pass (< 0: no limit).
unsafe extern "C" fn cq_sreadfrom(
    cq: *mut fi::fid_cq,
    buf: *mut c_void,
    count: usize,
    src: *mut fi::fi_addr_t,
    _cond: *const c_void,
    timeout: c_int,
) -> isize {
    guard(serr(fi::FI_EOTHER as u64), || {
        let t0 = std::time::Instant::now();
        loop {
            let r = read_into(addr(cq), buf, count, src);
            if r != serr(fi::FI_EAGAIN) {
                return r;
            }
            if timeout >= 0 && t0.elapsed() >= std::time::Duration::from_millis(timeout as u64) {
                return serr(fi::FI_EAGAIN);
            }
            std::thread::yield_now();
        }
    })
}

unsafe extern "C" fn cq_signal(_: *mut fi::fid_cq) -> c_int {
    err(fi::FI_ENOSYS)
}

unsafe extern "C" fn cq_strerror(
    _: *mut fi::fid_cq,
    prov_errno: c_int,
    _: *const c_void,
    _: *mut c_char,
    _: usize,
) -> *const c_char {
    match prov_errno as u64 {
        e if e == fi::FI_ETRUNC as u64 => c"message truncated (the receive buffer is smaller)",
        fi::FI_ECANCELED => c"operation cancelled",
        fi::FI_EIO => c"peer failed",
        _ => c"weft error",
    }
    .as_ptr()
}

// ---- address vector ---------------------------------------------------------------------

#[repr(C)]
pub struct Av {
    fid: fi::fid_av,
    ops: fi::fi_ops,
    av_ops: fi::fi_ops_av,
}

unsafe extern "C" fn av_open(
    domain: *mut fi::fid_domain,
    attr: *mut fi::fi_av_attr,
    out: *mut *mut fi::fid_av,
    context: *mut c_void,
) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        if out.is_null() || !is_live(addr(domain)) {
            return err(fi::FI_EINVAL);
        }
        // SAFETY: null or the application's attributes.
        if let Some(a) = unsafe { attr.as_ref() } {
            if a.type_ != fi::FI_AV_UNSPEC && a.type_ != fi::FI_AV_MAP && a.type_ != fi::FI_AV_TABLE
            {
                return err(fi::FI_EINVAL);
            }
            if a.flags != 0 || !a.name.is_null() {
                // Shared and asynchronous address vectors.
                return err(fi::FI_ENOSYS);
            }
        }
        let mut b = Box::new(Av {
            fid: fi::fid_av::default(),
            ops: fid_ops(close_plain),
            av_ops: fi::fi_ops_av {
                size: std::mem::size_of::<fi::fi_ops_av>(),
                insert: Some(av_insert),
                insertsvc: Some(av_insertsvc),
                insertsym: Some(av_insertsym),
                remove: Some(av_remove),
                lookup: Some(av_lookup),
                straddr: Some(av_straddr),
                av_set: Some(av_set_none),
            },
        });
        b.fid.fid.fclass = fi::FI_CLASS_AV as usize;
        b.fid.fid.context = context;
        let p = live(b);
        state::with(|g| g.avs.insert(addr(p), state::Av::default()));
        // SAFETY: the leaked box; `out` is non-null.
        unsafe {
            (*p).fid.fid.ops = &mut (*p).ops;
            (*p).fid.ops = &mut (*p).av_ops;
            *out = &mut (*p).fid;
        }
        0
    })
}

unsafe extern "C" fn av_insert(
    av: *mut fi::fid_av,
    names: *const c_void,
    count: usize,
    fi_addr: *mut fi::fi_addr_t,
    _flags: u64,
    _ctx: *mut c_void,
) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        state::with(|g| {
            let a = addr(av);
            if !g.live.contains(&a) || !g.avs.contains_key(&a) || (names.is_null() && count > 0) {
                return err(fi::FI_EINVAL);
            }
            if count > 0 {
                if let Err(e) = g.join() {
                    return err(e);
                }
            }
            let mut ok = 0;
            for i in 0..count {
                // SAFETY: fi_av_insert's array holds `count` names of the provider's length.
                let name = unsafe {
                    std::slice::from_raw_parts((names as *const u8).add(i * NAME_LEN), NAME_LEN)
                };
                let out = match g.rank_of_name(name) {
                    Some(r) => {
                        let t = &mut g.avs.get_mut(&a).expect("checked").table;
                        t.push(r);
                        ok += 1;
                        (t.len() - 1) as u64
                    }
                    None => fi::FI_ADDR_UNSPEC,
                };
                if !fi_addr.is_null() {
                    // SAFETY: the caller's array of `count` addresses.
                    unsafe { *fi_addr.add(i) = out };
                }
            }
            ok
        })
    })
}

unsafe extern "C" fn av_insertsvc(
    _: *mut fi::fid_av,
    _: *const c_char,
    _: *const c_char,
    _: *mut fi::fi_addr_t,
    _: u64,
    _: *mut c_void,
) -> c_int {
    err(fi::FI_ENOSYS)
}
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn av_insertsym(
    _: *mut fi::fid_av,
    _: *const c_char,
    _: usize,
    _: *const c_char,
    _: usize,
    _: *mut fi::fi_addr_t,
    _: u64,
    _: *mut c_void,
) -> c_int {
    err(fi::FI_ENOSYS)
}

unsafe extern "C" fn av_remove(
    av: *mut fi::fid_av,
    fi_addr: *mut fi::fi_addr_t,
    count: usize,
    _: u64,
) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        state::with(|g| {
            let Some(t) = g.avs.get_mut(&addr(av)) else {
                return err(fi::FI_EINVAL);
            };
            for i in 0..count {
                // SAFETY: the caller's array of `count` addresses.
                let x = unsafe { *fi_addr.add(i) } as usize;
                match t.table.get_mut(x) {
                    Some(r) => *r = u32::MAX,
                    None => return err(fi::FI_EINVAL),
                }
            }
            0
        })
    })
}

unsafe extern "C" fn av_lookup(
    av: *mut fi::fid_av,
    fi_addr: fi::fi_addr_t,
    out: *mut c_void,
    len: *mut usize,
) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        if len.is_null() {
            return err(fi::FI_EINVAL);
        }
        let Some(name) = state::with(|g| g.name_at(addr(av), fi_addr)) else {
            return err(fi::FI_EINVAL);
        };
        // SAFETY: `len` is non-null; `out` holds `*len` bytes.
        unsafe { copy_name(&name, out, len) };
        0
    })
}

/// Copy a name into a buffer of `*len` bytes, truncated, and set `*len` to its full size.
///
/// # Safety
/// `len` is valid; `out` holds `*len` bytes (or is null with `*len` 0).
unsafe fn copy_name(name: &[u8], out: *mut c_void, len: *mut usize) {
    // SAFETY: per the contract.
    unsafe {
        let n = (*len).min(name.len());
        if n > 0 && !out.is_null() {
            std::ptr::copy_nonoverlapping(name.as_ptr(), out as *mut u8, n);
        }
        *len = name.len();
    }
}

unsafe extern "C" fn av_straddr(
    _: *mut fi::fid_av,
    name: *const c_void,
    buf: *mut c_char,
    len: *mut usize,
) -> *const c_char {
    guard(std::ptr::null(), || {
        if name.is_null() || len.is_null() {
            return std::ptr::null();
        }
        // SAFETY: a name of the provider's length.
        let n = unsafe { std::slice::from_raw_parts(name as *const u8, NAME_LEN) };
        let rank = u32::from_le_bytes(n[4..8].try_into().unwrap_or_default());
        let job = u64::from_le_bytes(n[8..16].try_into().unwrap_or_default());
        let s = format!("weft://{rank}@{job:016x}\0");
        // SAFETY: the caller's buffer of `*len` bytes; the string is NUL-terminated in it
        // when it fits (fi_av_straddr's rule: `*len` says the size needed).
        unsafe {
            let cap = *len;
            if cap > 0 && !buf.is_null() {
                let k = (cap - 1).min(s.len() - 1);
                std::ptr::copy_nonoverlapping(s.as_ptr(), buf as *mut u8, k);
                *buf.add(k) = 0;
            }
            *len = s.len();
        }
        buf
    })
}

unsafe extern "C" fn av_set_none(
    _: *mut fi::fid_av,
    _: *mut fi::fi_av_set_attr,
    _: *mut *mut fi::fid_av_set,
    _: *mut c_void,
) -> c_int {
    err(fi::FI_ENOSYS)
}

// ---- endpoint ---------------------------------------------------------------------------

#[repr(C)]
pub struct Ep {
    fid: fi::fid_ep,
    ops: fi::fi_ops,
    ep_ops: fi::fi_ops_ep,
    cm: fi::fi_ops_cm,
    msg: fi::fi_ops_msg,
    tagged: fi::fi_ops_tagged,
    rma: fi::fi_ops_rma,
    atomic: fi::fi_ops_atomic,
}

unsafe extern "C" fn ep_open2(
    domain: *mut fi::fid_domain,
    info: *mut fi::fi_info,
    ep: *mut *mut fi::fid_ep,
    flags: u64,
    context: *mut c_void,
) -> c_int {
    if flags != 0 {
        return err(fi::FI_EINVAL);
    }
    // SAFETY: fi_endpoint's contract.
    unsafe { ep_open(domain, info, ep, context) }
}

unsafe extern "C" fn ep_open(
    domain: *mut fi::fid_domain,
    info: *mut fi::fi_info,
    out: *mut *mut fi::fid_ep,
    context: *mut c_void,
) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        if out.is_null() || !is_live(addr(domain)) {
            return err(fi::FI_EINVAL);
        }
        // SAFETY: null or a valid fi_info.
        let (tx_flags, rx_flags, ep_type, caps) = unsafe {
            match info.as_ref() {
                Some(i) => (
                    i.tx_attr.as_ref().map_or(0, |t| t.op_flags),
                    i.rx_attr.as_ref().map_or(0, |r| r.op_flags),
                    i.ep_attr.as_ref().map_or(fi::FI_EP_RDM, |e| e.type_),
                    i.caps | i.rx_attr.as_ref().map_or(0, |r| r.caps),
                ),
                None => (0, 0, fi::FI_EP_RDM, 0),
            }
        };
        if ep_type != fi::FI_EP_RDM && ep_type != fi::FI_EP_UNSPEC {
            return err(fi::FI_ENOSYS);
        }
        let mut b = Box::new(Ep {
            fid: fi::fid_ep::default(),
            ops: fi::fi_ops {
                size: std::mem::size_of::<fi::fi_ops>(),
                close: Some(ep_close),
                bind: Some(ep_bind),
                control: Some(ep_control),
                ops_open: Some(ops_open_none),
                tostr: None,
                ops_set: None,
            },
            ep_ops: fi::fi_ops_ep {
                size: std::mem::size_of::<fi::fi_ops_ep>(),
                cancel: Some(ep_cancel),
                getopt: Some(ep_getopt),
                setopt: Some(ep_setopt),
                tx_ctx: Some(ep_tx_ctx),
                rx_ctx: Some(ep_rx_ctx),
                rx_size_left: Some(ep_size_left),
                tx_size_left: Some(ep_size_left),
            },
            cm: fi::fi_ops_cm {
                size: std::mem::size_of::<fi::fi_ops_cm>(),
                setname: Some(cm_setname),
                getname: Some(cm_getname),
                getpeer: Some(cm_getpeer),
                connect: Some(cm_connect),
                listen: Some(cm_listen),
                accept: Some(cm_accept),
                reject: Some(cm_reject),
                shutdown: Some(cm_shutdown),
                join: Some(cm_join),
            },
            msg: fi::fi_ops_msg {
                size: std::mem::size_of::<fi::fi_ops_msg>(),
                recv: Some(data::msg_recv),
                recvv: Some(data::msg_recvv),
                recvmsg: Some(data::msg_recvmsg),
                send: Some(data::msg_send),
                sendv: Some(data::msg_sendv),
                sendmsg: Some(data::msg_sendmsg),
                inject: Some(data::msg_inject),
                senddata: Some(data::msg_senddata),
                injectdata: Some(data::msg_injectdata),
            },
            tagged: fi::fi_ops_tagged {
                size: std::mem::size_of::<fi::fi_ops_tagged>(),
                recv: Some(data::t_recv),
                recvv: Some(data::t_recvv),
                recvmsg: Some(data::t_recvmsg),
                send: Some(data::t_send),
                sendv: Some(data::t_sendv),
                sendmsg: Some(data::t_sendmsg),
                inject: Some(data::t_inject),
                senddata: Some(data::t_senddata),
                injectdata: Some(data::t_injectdata),
            },
            rma: crate::oneside::rma_ops(),
            atomic: crate::oneside::atomic_ops(),
        });
        b.fid.fid.fclass = fi::FI_CLASS_EP as usize;
        b.fid.fid.context = context;
        let p = live(b);
        state::with(|g| {
            g.eps.insert(
                addr(p),
                state::Ep {
                    tx_op_flags: tx_flags,
                    rx_op_flags: rx_flags,
                    directed: caps & fi::FI_DIRECTED_RECV != 0,
                    rma: caps & crate::info::ONE_SIDED != 0,
                    ..Default::default()
                },
            )
        });
        // SAFETY: the leaked box; `out` is non-null.
        unsafe {
            (*p).fid.fid.ops = &mut (*p).ops;
            (*p).fid.ops = &mut (*p).ep_ops;
            (*p).fid.cm = &mut (*p).cm;
            (*p).fid.msg = &mut (*p).msg;
            (*p).fid.tagged = &mut (*p).tagged;
            (*p).fid.rma = &mut (*p).rma;
            (*p).fid.atomic = &mut (*p).atomic;
            *out = &mut (*p).fid;
        }
        0
    })
}

/// Close an endpoint: its receives still posted are cancelled, and the close waits (bounded)
/// until weft is done with every buffer the endpoint was given.
unsafe extern "C" fn ep_close(f: Fid) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        let a = addr(f);
        if !is_live(a) {
            return err(fi::FI_EINVAL);
        }
        let t0 = std::time::Instant::now();
        loop {
            let left = state::with(|g| g.drain_ep(a));
            if left == 0 {
                break;
            }
            if t0.elapsed() > std::time::Duration::from_secs(10) {
                // Its buffers may still be written: keep the endpoint (and the
                // operations) rather than let the application free them.
                return err(fi::FI_EBUSY);
            }
            std::thread::yield_now();
        }
        state::with(|g| {
            g.live.remove(&a);
            g.eps.remove(&a);
        });
        0
    })
}

unsafe extern "C" fn ep_bind(f: Fid, b: Fid, flags: u64) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        if b.is_null() {
            return err(fi::FI_EINVAL);
        }
        // SAFETY: a fid the application opened (checked live below before use as state).
        let class = unsafe { (*b).fclass } as u32;
        state::with(|g| {
            let (a, o) = (addr(f), addr(b));
            if !g.live.contains(&a) || !g.live.contains(&o) {
                return err(fi::FI_EINVAL);
            }
            let is_cq = g.cqs.contains_key(&o);
            let is_av = g.avs.contains_key(&o);
            let is_cntr = g.cntrs.contains_key(&o);
            let Some(ep) = g.eps.get_mut(&a) else {
                return err(fi::FI_EINVAL);
            };
            match class {
                c if c == fi::FI_CLASS_CQ && is_cq => {
                    if flags & fi::FI_TRANSMIT != 0 {
                        ep.tx_cq = o;
                        ep.tx_selective = flags & fi::FI_SELECTIVE_COMPLETION != 0;
                    }
                    if flags & fi::FI_RECV != 0 {
                        ep.rx_cq = o;
                        ep.rx_selective = flags & fi::FI_SELECTIVE_COMPLETION != 0;
                    }
                    0
                }
                c if c == fi::FI_CLASS_AV && is_av => {
                    ep.av = o;
                    0
                }
                c if c == fi::FI_CLASS_EQ => 0,
                c if c == fi::FI_CLASS_CNTR && is_cntr => {
                    let c = &mut ep.cntrs;
                    for (bit, slot) in [
                        (fi::FI_SEND, &mut c.send),
                        (fi::FI_RECV, &mut c.recv),
                        (fi::FI_READ, &mut c.read),
                        (fi::FI_WRITE, &mut c.write),
                        (fi::FI_REMOTE_READ, &mut c.remote_read),
                        (fi::FI_REMOTE_WRITE, &mut c.remote_write),
                    ] {
                        if flags & bit != 0 {
                            *slot = o;
                        }
                    }
                    0
                }
                _ => err(fi::FI_ENOSYS),
            }
        })
    })
}

unsafe extern "C" fn ep_control(f: Fid, command: c_int, _arg: *mut c_void) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        state::with(|g| {
            let has_world = g.has_world();
            let Some(ep) = g.eps.get_mut(&addr(f)) else {
                return err(fi::FI_EINVAL);
            };
            if command as u32 != fi::FI_ENABLE {
                return err(fi::FI_ENOSYS);
            }
            if ep.av == 0 || !has_world {
                // An RDM endpoint needs its address vector before it is enabled.
                return err(fi::FI_ENOAV as u64);
            }
            ep.enabled = true;
            0
        })
    })
}

unsafe extern "C" fn ep_cancel(f: fi::fid_t, context: *mut c_void) -> isize {
    guard(serr(fi::FI_EOTHER as u64), || {
        state::with(|g| g.cancel(addr(f), context))
    })
}

unsafe extern "C" fn ep_getopt(
    _: fi::fid_t,
    _: c_int,
    _: c_int,
    _: *mut c_void,
    _: *mut usize,
) -> c_int {
    err(fi::FI_ENOPROTOOPT)
}
unsafe extern "C" fn ep_setopt(
    _: fi::fid_t,
    _: c_int,
    _: c_int,
    _: *const c_void,
    _: usize,
) -> c_int {
    err(fi::FI_ENOPROTOOPT)
}
unsafe extern "C" fn ep_tx_ctx(
    _: *mut fi::fid_ep,
    _: c_int,
    _: *mut fi::fi_tx_attr,
    _: *mut *mut fi::fid_ep,
    _: *mut c_void,
) -> c_int {
    err(fi::FI_ENOSYS)
}
unsafe extern "C" fn ep_rx_ctx(
    _: *mut fi::fid_ep,
    _: c_int,
    _: *mut fi::fi_rx_attr,
    _: *mut *mut fi::fid_ep,
    _: *mut c_void,
) -> c_int {
    err(fi::FI_ENOSYS)
}
unsafe extern "C" fn ep_size_left(_: *mut fi::fid_ep) -> isize {
    crate::info::QUEUE as isize
}

unsafe extern "C" fn cm_getname(f: fi::fid_t, out: *mut c_void, len: *mut usize) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        if len.is_null() || !is_live(addr(f)) {
            return err(fi::FI_EINVAL);
        }
        let Some(name) = state::with(|g| g.name()) else {
            return err(fi::FI_EOPBADSTATE as u64);
        };
        // SAFETY: `len` is non-null; `out` holds `*len` bytes.
        let fits = unsafe { *len } >= NAME_LEN;
        // SAFETY: as above.
        unsafe { copy_name(&name, out, len) };
        if fits {
            0
        } else {
            err(fi::FI_ETOOSMALL as u64)
        }
    })
}
unsafe extern "C" fn cm_setname(_: fi::fid_t, _: *mut c_void, _: usize) -> c_int {
    err(fi::FI_ENOSYS)
}
unsafe extern "C" fn cm_getpeer(_: *mut fi::fid_ep, _: *mut c_void, _: *mut usize) -> c_int {
    err(fi::FI_ENOSYS)
}
unsafe extern "C" fn cm_connect(
    _: *mut fi::fid_ep,
    _: *const c_void,
    _: *const c_void,
    _: usize,
) -> c_int {
    err(fi::FI_ENOSYS)
}
unsafe extern "C" fn cm_listen(_: *mut fi::fid_pep) -> c_int {
    err(fi::FI_ENOSYS)
}
unsafe extern "C" fn cm_accept(_: *mut fi::fid_ep, _: *const c_void, _: usize) -> c_int {
    err(fi::FI_ENOSYS)
}
unsafe extern "C" fn cm_reject(
    _: *mut fi::fid_pep,
    _: fi::fid_t,
    _: *const c_void,
    _: usize,
) -> c_int {
    err(fi::FI_ENOSYS)
}
unsafe extern "C" fn cm_shutdown(_: *mut fi::fid_ep, _: u64) -> c_int {
    err(fi::FI_ENOSYS)
}
unsafe extern "C" fn cm_join(
    _: *mut fi::fid_ep,
    _: *const c_void,
    _: u64,
    _: *mut *mut fi::fid_mc,
    _: *mut c_void,
) -> c_int {
    err(fi::FI_ENOSYS)
}
