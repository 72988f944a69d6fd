//! The `static inline` calls of libfabric's headers that weft uses, as calls through the
//! objects' operation tables (the headers' definitions, restated). Each returns what the table
//! entry returns, or `-FI_ENOSYS` when the provider left it empty.
//!
//! # Safety
//! Every function here is `unsafe`: the object pointers must be live objects of the right class
//! opened by libfabric, and buffers, descriptors and contexts follow libfabric's rules for the
//! call (valid until the operation's completion for the data calls).

use super::*;
use std::os::raw::c_void;

const ENOSYS: isize = -(FI_ENOSYS as isize);

/// Call table entry `$f` of `$tbl` with the arguments, or return `-FI_ENOSYS`.
macro_rules! via {
    ($tbl:expr, $f:ident ( $($a:expr),* )) => {
        match (*$tbl).$f {
            Some(f) => f($($a),*) as isize,
            None => ENOSYS,
        }
    };
}

// ---- objects ----------------------------------------------------------------------------

pub unsafe fn fi_close(f: *mut fid) -> isize {
    via!((*f).ops, close(f))
}

pub unsafe fn fi_domain(
    fab: *mut fid_fabric,
    info: *mut fi_info,
    dom: *mut *mut fid_domain,
    ctx: *mut c_void,
) -> isize {
    via!((*fab).ops, domain(fab, info, dom, ctx))
}

pub unsafe fn fi_endpoint(
    dom: *mut fid_domain,
    info: *mut fi_info,
    ep: *mut *mut fid_ep,
    ctx: *mut c_void,
) -> isize {
    via!((*dom).ops, endpoint(dom, info, ep, ctx))
}

pub unsafe fn fi_cq_open(
    dom: *mut fid_domain,
    attr: *mut fi_cq_attr,
    cq: *mut *mut fid_cq,
    ctx: *mut c_void,
) -> isize {
    via!((*dom).ops, cq_open(dom, attr, cq, ctx))
}

pub unsafe fn fi_av_open(
    dom: *mut fid_domain,
    attr: *mut fi_av_attr,
    av: *mut *mut fid_av,
    ctx: *mut c_void,
) -> isize {
    via!((*dom).ops, av_open(dom, attr, av, ctx))
}

pub unsafe fn fi_cntr_open(
    dom: *mut fid_domain,
    attr: *mut fi_cntr_attr,
    cntr: *mut *mut fid_cntr,
    ctx: *mut c_void,
) -> isize {
    via!((*dom).ops, cntr_open(dom, attr, cntr, ctx))
}

pub unsafe fn fi_query_atomic(
    dom: *mut fid_domain,
    ty: fi_datatype,
    op: fi_op,
    attr: *mut fi_atomic_attr,
    flags: u64,
) -> isize {
    via!((*dom).ops, query_atomic(dom, ty, op, attr, flags))
}

/// `fi_ep_bind`: bind a CQ, AV or counter to an endpoint.
pub unsafe fn fi_ep_bind(ep: *mut fid_ep, bfid: *mut fid, flags: u64) -> isize {
    let f = &mut (*ep).fid as *mut fid;
    via!((*f).ops, bind(f, bfid, flags))
}

pub unsafe fn fi_enable(ep: *mut fid_ep) -> isize {
    let f = &mut (*ep).fid as *mut fid;
    via!((*f).ops, control(f, FI_ENABLE as i32, std::ptr::null_mut()))
}

pub unsafe fn fi_getname(f: *mut fid, addr: *mut c_void, len: *mut usize) -> isize {
    let ep = f as *mut fid_ep;
    via!((*ep).cm, getname(f, addr, len))
}

pub unsafe fn fi_av_insert(
    av: *mut fid_av,
    addr: *const c_void,
    count: usize,
    out: *mut fi_addr_t,
    flags: u64,
    ctx: *mut c_void,
) -> isize {
    via!((*av).ops, insert(av, addr, count, out, flags, ctx))
}

// ---- memory registration ----------------------------------------------------------------

#[allow(clippy::too_many_arguments)]
pub unsafe fn fi_mr_reg(
    dom: *mut fid_domain,
    buf: *const c_void,
    len: usize,
    access: u64,
    offset: u64,
    key: u64,
    flags: u64,
    mr: *mut *mut fid_mr,
    ctx: *mut c_void,
) -> isize {
    via!(
        (*dom).mr,
        reg(
            &mut (*dom).fid,
            buf,
            len,
            access,
            offset,
            key,
            flags,
            mr,
            ctx
        )
    )
}

/// `fi_mr_bind` + `fi_mr_enable` for `FI_MR_ENDPOINT` domains.
pub unsafe fn fi_mr_bind_enable(mr: *mut fid_mr, ep: *mut fid_ep) -> isize {
    let f = &mut (*mr).fid as *mut fid;
    let r = via!((*f).ops, bind(f, &mut (*ep).fid, 0));
    if r != 0 {
        return r;
    }
    via!((*f).ops, control(f, FI_ENABLE as i32, std::ptr::null_mut()))
}

// ---- completion queues and counters -----------------------------------------------------

pub unsafe fn fi_cq_read(cq: *mut fid_cq, buf: *mut c_void, count: usize) -> isize {
    via!((*cq).ops, read(cq, buf, count))
}

pub unsafe fn fi_cq_readerr(cq: *mut fid_cq, buf: *mut fi_cq_err_entry, flags: u64) -> isize {
    via!((*cq).ops, readerr(cq, buf, flags))
}

/// `fi_cntr_read` (successes); `u64::MAX` if the provider has no read entry.
pub unsafe fn fi_cntr_read(c: *mut fid_cntr) -> u64 {
    match (*(*c).ops).read {
        Some(f) => f(c),
        None => u64::MAX,
    }
}

pub unsafe fn fi_cntr_add(c: *mut fid_cntr, v: u64) -> isize {
    via!((*c).ops, add(c, v))
}

pub unsafe fn fi_cntr_set(c: *mut fid_cntr, v: u64) -> isize {
    via!((*c).ops, set(c, v))
}

pub unsafe fn fi_cntr_seterr(c: *mut fid_cntr, v: u64) -> isize {
    via!((*c).ops, seterr(c, v))
}

pub unsafe fn fi_cntr_readerr(c: *mut fid_cntr) -> u64 {
    match (*(*c).ops).readerr {
        Some(f) => f(c),
        None => 0,
    }
}

// ---- messages -----------------------------------------------------------------------------

pub unsafe fn fi_recv(
    ep: *mut fid_ep,
    buf: *mut c_void,
    len: usize,
    desc: *mut c_void,
    src: fi_addr_t,
    ctx: *mut c_void,
) -> isize {
    via!((*ep).msg, recv(ep, buf, len, desc, src, ctx))
}

pub unsafe fn fi_send(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    dest: fi_addr_t,
    ctx: *mut c_void,
) -> isize {
    via!((*ep).msg, send(ep, buf, len, desc, dest, ctx))
}

pub unsafe fn fi_inject(ep: *mut fid_ep, buf: *const c_void, len: usize, dest: fi_addr_t) -> isize {
    via!((*ep).msg, inject(ep, buf, len, dest))
}

pub unsafe fn fi_cancel(f: *mut fid, ctx: *mut c_void) -> isize {
    let ep = f as *mut fid_ep;
    via!((*ep).ops, cancel(f, ctx))
}

// ---- tagged -------------------------------------------------------------------------------

pub unsafe fn fi_tsendmsg(ep: *mut fid_ep, msg: *const fi_msg_tagged, flags: u64) -> isize {
    via!((*ep).tagged, sendmsg(ep, msg, flags))
}

pub unsafe fn fi_tinject(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    dest: fi_addr_t,
    tag: u64,
) -> isize {
    via!((*ep).tagged, inject(ep, buf, len, dest, tag))
}

pub unsafe fn fi_tinjectdata(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    dest: fi_addr_t,
    tag: u64,
) -> isize {
    via!((*ep).tagged, injectdata(ep, buf, len, data, dest, tag))
}

pub unsafe fn fi_trecvmsg(ep: *mut fid_ep, msg: *const fi_msg_tagged, flags: u64) -> isize {
    via!((*ep).tagged, recvmsg(ep, msg, flags))
}

// ---- RMA and atomics ----------------------------------------------------------------------

pub unsafe fn fi_readmsg(ep: *mut fid_ep, msg: *const fi_msg_rma, flags: u64) -> isize {
    via!((*ep).rma, readmsg(ep, msg, flags))
}

pub unsafe fn fi_writemsg(ep: *mut fid_ep, msg: *const fi_msg_rma, flags: u64) -> isize {
    via!((*ep).rma, writemsg(ep, msg, flags))
}

pub unsafe fn fi_atomicmsg(ep: *mut fid_ep, msg: *const fi_msg_atomic, flags: u64) -> isize {
    via!((*ep).atomic, writemsg(ep, msg, flags))
}

pub unsafe fn fi_fetch_atomicmsg(
    ep: *mut fid_ep,
    msg: *const fi_msg_atomic,
    res: *mut fi_ioc,
    res_desc: *mut *mut c_void,
    res_count: usize,
    flags: u64,
) -> isize {
    via!(
        (*ep).atomic,
        readwritemsg(ep, msg, res, res_desc, res_count, flags)
    )
}

#[allow(clippy::too_many_arguments)]
pub unsafe fn fi_compare_atomicmsg(
    ep: *mut fid_ep,
    msg: *const fi_msg_atomic,
    cmp: *const fi_ioc,
    cmp_desc: *mut *mut c_void,
    cmp_count: usize,
    res: *mut fi_ioc,
    res_desc: *mut *mut c_void,
    res_count: usize,
    flags: u64,
) -> isize {
    via!(
        (*ep).atomic,
        compwritemsg(ep, msg, cmp, cmp_desc, cmp_count, res, res_desc, res_count, flags)
    )
}
