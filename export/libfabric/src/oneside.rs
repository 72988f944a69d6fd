//! The data-path entry points of an endpoint's `fi_ops_rma` and `fi_ops_atomic` tables: each
//! gathers its arguments into an [`RmaArgs`] and hands them to [`crate::remote`], under
//! [`guard`]. Vectored calls take at most one local entry and one remote entry (`iov_limit`,
//! `rma_iov_limit` 1); descriptors are ignored (no `FI_MR_LOCAL`).

use crate::obj::addr;
use crate::remote::RmaArgs;
use crate::rma::{self, Kind, ATOMIC_MAX};
use crate::{err, guard, serr, state, NULL};
use std::os::raw::{c_int, c_void};
use weft_ofi_sys as fi;

type Ep = *mut fi::fid_ep;
type Desc = *mut c_void;

fn post(ep: Ep, a: RmaArgs) -> isize {
    guard(serr(fi::FI_EOTHER as u64), || {
        state::with(|g| g.rma(addr(ep), a))
    })
}

fn args(kind: Kind, buf: *const c_void, len: usize, dest: u64, addr: u64, key: u64) -> RmaArgs {
    RmaArgs {
        kind,
        buf,
        len,
        compare: NULL,
        result: NULL,
        dest,
        addr,
        key,
        op: 0,
        dtype: 0,
        data: None,
        ctx: NULL,
        flags: None,
        inject: false,
    }
}

/// The one buffer of an iovec of at most one entry.
///
/// # Safety
/// `iov` holds `count` entries.
unsafe fn one(iov: *const fi::iovec, count: usize) -> Option<(*mut c_void, usize)> {
    match count {
        0 => Some((NULL, 0)),
        // SAFETY: per the contract.
        1 => unsafe { iov.as_ref() }.map(|v| (v.iov_base, v.iov_len)),
        _ => None,
    }
}

/// The one remote entry of a `*msg` call.
///
/// # Safety
/// `rma` holds `count` entries.
unsafe fn one_remote(rma: *const fi::fi_rma_iov, count: usize) -> Option<fi::fi_rma_iov> {
    match count {
        // SAFETY: per the contract.
        1 => unsafe { rma.as_ref() }.copied(),
        _ => None,
    }
}

/// The elements (`count`) and element size an atomic of `op` on `dtype` may carry, for the
/// call `flags` names (`FI_FETCH_ATOMIC`, `FI_COMPARE_ATOMIC`, else `fi_atomic`).
pub fn elements(flags: u64, op: u32, dtype: u32) -> Option<(usize, usize)> {
    let kind = if flags & fi::FI_COMPARE_ATOMIC != 0 {
        Kind::Compare
    } else if flags & fi::FI_FETCH_ATOMIC != 0 {
        Kind::Fetch
    } else {
        Kind::Atomic
    };
    let size = rma::size_of(dtype)?;
    rma::valid(kind, op, dtype).then_some((ATOMIC_MAX / size, size))
}

/// Bytes of `count` elements of `dtype` (0 for a type weft-fi does not offer: the operation
/// is then refused as unsupported).
fn bytes(count: usize, dtype: u32) -> usize {
    rma::size_of(dtype).map_or(0, |s| count.saturating_mul(s))
}

// ---- FI_RMA -----------------------------------------------------------------------------

pub fn rma_ops() -> fi::fi_ops_rma {
    fi::fi_ops_rma {
        size: std::mem::size_of::<fi::fi_ops_rma>(),
        read: Some(read),
        readv: Some(readv),
        readmsg: Some(readmsg),
        write: Some(write),
        writev: Some(writev),
        writemsg: Some(writemsg),
        inject: Some(inject_write),
        writedata: Some(writedata),
        injectdata: Some(injectdata),
    }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn read(
    ep: Ep,
    buf: *mut c_void,
    len: usize,
    _desc: Desc,
    src: fi::fi_addr_t,
    addr: u64,
    key: u64,
    ctx: *mut c_void,
) -> isize {
    let mut a = args(Kind::Read, NULL, len, src, addr, key);
    a.result = buf;
    a.ctx = ctx;
    post(ep, a)
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn readv(
    ep: Ep,
    iov: *const fi::iovec,
    _desc: *mut Desc,
    count: usize,
    src: fi::fi_addr_t,
    addr: u64,
    key: u64,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: fi_readv's iovec of `count` entries.
    let Some((b, l)) = (unsafe { one(iov, count) }) else {
        return serr(fi::FI_EINVAL);
    };
    // SAFETY: the same contract as fi_read's.
    unsafe { read(ep, b, l, NULL, src, addr, key, ctx) }
}

unsafe extern "C" fn readmsg(ep: Ep, m: *const fi::fi_msg_rma, flags: u64) -> isize {
    // SAFETY: null or the caller's message, whose arrays hold the counts they give.
    let Some(m) = (unsafe { m.as_ref() }) else {
        return serr(fi::FI_EINVAL);
    };
    // SAFETY: as above.
    let (Some((b, l)), Some(r)) = (unsafe { one(m.msg_iov, m.iov_count) }, unsafe {
        one_remote(m.rma_iov, m.rma_iov_count)
    }) else {
        return serr(fi::FI_EINVAL);
    };
    if r.len != l {
        return serr(fi::FI_EINVAL);
    }
    let mut a = args(Kind::Read, NULL, l, m.addr, r.addr, r.key);
    a.result = b;
    a.ctx = m.context;
    a.flags = Some(flags);
    post(ep, a)
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn write(
    ep: Ep,
    buf: *const c_void,
    len: usize,
    _desc: Desc,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    ctx: *mut c_void,
) -> isize {
    let mut a = args(Kind::Write, buf, len, dest, addr, key);
    a.ctx = ctx;
    post(ep, a)
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn writev(
    ep: Ep,
    iov: *const fi::iovec,
    _desc: *mut Desc,
    count: usize,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: fi_writev's iovec of `count` entries.
    let Some((b, l)) = (unsafe { one(iov, count) }) else {
        return serr(fi::FI_EINVAL);
    };
    // SAFETY: the same contract as fi_write's.
    unsafe { write(ep, b, l, NULL, dest, addr, key, ctx) }
}

unsafe extern "C" fn writemsg(ep: Ep, m: *const fi::fi_msg_rma, flags: u64) -> isize {
    // SAFETY: null or the caller's message, whose arrays hold the counts they give.
    let Some(m) = (unsafe { m.as_ref() }) else {
        return serr(fi::FI_EINVAL);
    };
    // SAFETY: as above.
    let (Some((b, l)), Some(r)) = (unsafe { one(m.msg_iov, m.iov_count) }, unsafe {
        one_remote(m.rma_iov, m.rma_iov_count)
    }) else {
        return serr(fi::FI_EINVAL);
    };
    if r.len != l {
        return serr(fi::FI_EINVAL);
    }
    let mut a = args(Kind::Write, b, l, m.addr, r.addr, r.key);
    a.ctx = m.context;
    a.flags = Some(flags);
    a.data = (flags & fi::FI_REMOTE_CQ_DATA != 0).then_some(m.data);
    post(ep, a)
}

unsafe extern "C" fn inject_write(
    ep: Ep,
    buf: *const c_void,
    len: usize,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
) -> isize {
    let mut a = args(Kind::Write, buf, len, dest, addr, key);
    a.inject = true;
    post(ep, a)
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn writedata(
    ep: Ep,
    buf: *const c_void,
    len: usize,
    _desc: Desc,
    data: u64,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    ctx: *mut c_void,
) -> isize {
    let mut a = args(Kind::Write, buf, len, dest, addr, key);
    a.ctx = ctx;
    a.data = Some(data);
    post(ep, a)
}

unsafe extern "C" fn injectdata(
    ep: Ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
) -> isize {
    let mut a = args(Kind::Write, buf, len, dest, addr, key);
    a.inject = true;
    a.data = Some(data);
    post(ep, a)
}

// ---- FI_ATOMIC ----------------------------------------------------------------------------

pub fn atomic_ops() -> fi::fi_ops_atomic {
    fi::fi_ops_atomic {
        size: std::mem::size_of::<fi::fi_ops_atomic>(),
        write: Some(atomic),
        writev: Some(atomicv),
        writemsg: Some(atomicmsg),
        inject: Some(inject_atomic),
        readwrite: Some(fetch),
        readwritev: Some(fetchv),
        readwritemsg: Some(fetchmsg),
        compwrite: Some(compare),
        compwritev: Some(comparev),
        compwritemsg: Some(comparemsg),
        writevalid: Some(atomic_valid),
        readwritevalid: Some(fetch_valid),
        compwritevalid: Some(compare_valid),
    }
}

/// An atomic's arguments.
#[allow(clippy::too_many_arguments)]
fn atomic_args(
    kind: Kind,
    buf: *const c_void,
    count: usize,
    dest: u64,
    addr: u64,
    key: u64,
    dtype: u32,
    op: u32,
) -> RmaArgs {
    let mut a = args(kind, buf, bytes(count, dtype), dest, addr, key);
    a.op = op;
    a.dtype = dtype;
    a
}

/// The one entry of an ioc array of at most one (element count, not bytes).
///
/// # Safety
/// `ioc` holds `count` entries.
unsafe fn one_ioc(ioc: *const fi::fi_ioc, count: usize) -> Option<(*mut c_void, usize)> {
    match count {
        0 => Some((NULL, 0)),
        // SAFETY: per the contract.
        1 => unsafe { ioc.as_ref() }.map(|v| (v.addr, v.count)),
        _ => None,
    }
}

/// The local operand, the remote entry and the counts of an atomic `*msg` call.
///
/// # Safety
/// `m` is null or a message whose arrays hold the counts they give.
unsafe fn atomic_msg(
    m: *const fi::fi_msg_atomic,
) -> Option<(
    &'static fi::fi_msg_atomic,
    *mut c_void,
    usize,
    fi::fi_rma_ioc,
)> {
    // SAFETY: per the contract.
    let m = unsafe { m.as_ref() }?;
    // SAFETY: per the contract.
    let (b, n) = unsafe { one_ioc(m.msg_iov, m.iov_count) }?;
    let r = match m.rma_iov_count {
        // SAFETY: per the contract.
        1 => unsafe { m.rma_iov.as_ref() }.copied()?,
        _ => return None,
    };
    (r.count == n).then_some((m, b, n, r))
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn atomic(
    ep: Ep,
    buf: *const c_void,
    count: usize,
    _desc: Desc,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    dtype: fi::fi_datatype,
    op: fi::fi_op,
    ctx: *mut c_void,
) -> isize {
    let mut a = atomic_args(Kind::Atomic, buf, count, dest, addr, key, dtype, op);
    a.ctx = ctx;
    post(ep, a)
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn atomicv(
    ep: Ep,
    iov: *const fi::fi_ioc,
    _desc: *mut Desc,
    count: usize,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    dtype: fi::fi_datatype,
    op: fi::fi_op,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: fi_atomicv's array of `count` entries.
    let Some((b, n)) = (unsafe { one_ioc(iov, count) }) else {
        return serr(fi::FI_EINVAL);
    };
    // SAFETY: the same contract as fi_atomic's.
    unsafe { atomic(ep, b, n, NULL, dest, addr, key, dtype, op, ctx) }
}

unsafe extern "C" fn atomicmsg(ep: Ep, m: *const fi::fi_msg_atomic, flags: u64) -> isize {
    // SAFETY: fi_atomicmsg's message.
    let Some((m, b, n, r)) = (unsafe { atomic_msg(m) }) else {
        return serr(fi::FI_EINVAL);
    };
    let mut a = atomic_args(Kind::Atomic, b, n, m.addr, r.addr, r.key, m.datatype, m.op);
    a.ctx = m.context;
    a.flags = Some(flags);
    post(ep, a)
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn inject_atomic(
    ep: Ep,
    buf: *const c_void,
    count: usize,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    dtype: fi::fi_datatype,
    op: fi::fi_op,
) -> isize {
    let mut a = atomic_args(Kind::Atomic, buf, count, dest, addr, key, dtype, op);
    a.inject = true;
    post(ep, a)
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn fetch(
    ep: Ep,
    buf: *const c_void,
    count: usize,
    _desc: Desc,
    result: *mut c_void,
    _result_desc: Desc,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    dtype: fi::fi_datatype,
    op: fi::fi_op,
    ctx: *mut c_void,
) -> isize {
    let mut a = atomic_args(Kind::Fetch, buf, count, dest, addr, key, dtype, op);
    a.result = result;
    a.ctx = ctx;
    post(ep, a)
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn fetchv(
    ep: Ep,
    iov: *const fi::fi_ioc,
    _desc: *mut Desc,
    count: usize,
    resultv: *mut fi::fi_ioc,
    _result_desc: *mut Desc,
    result_count: usize,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    dtype: fi::fi_datatype,
    op: fi::fi_op,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: fi_fetch_atomicv's arrays of the counts given.
    let (Some((b, n)), Some((res, rn))) = (unsafe { one_ioc(iov, count) }, unsafe {
        one_ioc(resultv, result_count)
    }) else {
        return serr(fi::FI_EINVAL);
    };
    if rn != n {
        return serr(fi::FI_EINVAL);
    }
    // SAFETY: the same contract as fi_fetch_atomic's.
    unsafe { fetch(ep, b, n, NULL, res, NULL, dest, addr, key, dtype, op, ctx) }
}

unsafe extern "C" fn fetchmsg(
    ep: Ep,
    m: *const fi::fi_msg_atomic,
    resultv: *mut fi::fi_ioc,
    _result_desc: *mut Desc,
    result_count: usize,
    flags: u64,
) -> isize {
    // SAFETY: fi_fetch_atomicmsg's message and result array.
    let (Some((m, b, n, r)), Some((res, rn))) = (unsafe { atomic_msg(m) }, unsafe {
        one_ioc(resultv, result_count)
    }) else {
        return serr(fi::FI_EINVAL);
    };
    if rn != n {
        return serr(fi::FI_EINVAL);
    }
    let mut a = atomic_args(Kind::Fetch, b, n, m.addr, r.addr, r.key, m.datatype, m.op);
    a.result = res;
    a.ctx = m.context;
    a.flags = Some(flags);
    post(ep, a)
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn compare(
    ep: Ep,
    buf: *const c_void,
    count: usize,
    _desc: Desc,
    cmp: *const c_void,
    _compare_desc: Desc,
    result: *mut c_void,
    _result_desc: Desc,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    dtype: fi::fi_datatype,
    op: fi::fi_op,
    ctx: *mut c_void,
) -> isize {
    let mut a = atomic_args(Kind::Compare, buf, count, dest, addr, key, dtype, op);
    a.compare = cmp;
    a.result = result;
    a.ctx = ctx;
    post(ep, a)
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn comparev(
    ep: Ep,
    iov: *const fi::fi_ioc,
    _desc: *mut Desc,
    count: usize,
    cmpv: *const fi::fi_ioc,
    _compare_desc: *mut Desc,
    compare_count: usize,
    resultv: *mut fi::fi_ioc,
    _result_desc: *mut Desc,
    result_count: usize,
    dest: fi::fi_addr_t,
    addr: u64,
    key: u64,
    dtype: fi::fi_datatype,
    op: fi::fi_op,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: fi_compare_atomicv's arrays of the counts given.
    let (Some((b, n)), Some((c, cn)), Some((res, rn))) = (unsafe {
        (
            one_ioc(iov, count),
            one_ioc(cmpv, compare_count),
            one_ioc(resultv, result_count),
        )
    }) else {
        return serr(fi::FI_EINVAL);
    };
    if cn != n || rn != n {
        return serr(fi::FI_EINVAL);
    }
    // SAFETY: the same contract as fi_compare_atomic's.
    unsafe {
        compare(
            ep, b, n, NULL, c, NULL, res, NULL, dest, addr, key, dtype, op, ctx,
        )
    }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn comparemsg(
    ep: Ep,
    m: *const fi::fi_msg_atomic,
    cmpv: *const fi::fi_ioc,
    _compare_desc: *mut Desc,
    compare_count: usize,
    resultv: *mut fi::fi_ioc,
    _result_desc: *mut Desc,
    result_count: usize,
    flags: u64,
) -> isize {
    // SAFETY: fi_compare_atomicmsg's message and arrays.
    let (Some((m, b, n, r)), Some((c, cn)), Some((res, rn))) = (unsafe {
        (
            atomic_msg(m),
            one_ioc(cmpv, compare_count),
            one_ioc(resultv, result_count),
        )
    }) else {
        return serr(fi::FI_EINVAL);
    };
    if cn != n || rn != n {
        return serr(fi::FI_EINVAL);
    }
    let mut a = atomic_args(Kind::Compare, b, n, m.addr, r.addr, r.key, m.datatype, m.op);
    a.compare = c;
    a.result = res;
    a.ctx = m.context;
    a.flags = Some(flags);
    post(ep, a)
}

fn valid_for(ep: Ep, flags: u64, dtype: u32, op: u32, count: *mut usize) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        if !crate::obj::is_live(addr(ep)) || count.is_null() {
            return err(fi::FI_EINVAL);
        }
        match elements(flags, op, dtype) {
            Some((n, _)) => {
                // SAFETY: non-null, the caller's count.
                unsafe { *count = n };
                0
            }
            None => err(fi::FI_EOPNOTSUPP),
        }
    })
}

unsafe extern "C" fn atomic_valid(
    ep: Ep,
    dtype: fi::fi_datatype,
    op: fi::fi_op,
    count: *mut usize,
) -> c_int {
    valid_for(ep, 0, dtype, op, count)
}
unsafe extern "C" fn fetch_valid(
    ep: Ep,
    dtype: fi::fi_datatype,
    op: fi::fi_op,
    count: *mut usize,
) -> c_int {
    valid_for(ep, fi::FI_FETCH_ATOMIC, dtype, op, count)
}
unsafe extern "C" fn compare_valid(
    ep: Ep,
    dtype: fi::fi_datatype,
    op: fi::fi_op,
    count: *mut usize,
) -> c_int {
    valid_for(ep, fi::FI_COMPARE_ATOMIC, dtype, op, count)
}
