//! The data-path entry points of an endpoint's `fi_ops_msg` and `fi_ops_tagged` tables: each
//! gathers its arguments into a [`SendArgs`] or [`RecvArgs`] and hands them to
//! [`crate::state`], under [`guard`]. Vectored calls take an iovec of up to
//! [`crate::info::IOV_LIMIT`] entries, gathered (sends) and scattered (receives) in their order:
//! copied into or out of the bounce buffer when the message goes inline, or handed to weft as a
//! gather or scatter list when it is long (`Comm::isendv_raw`, `irecvv_raw`: no staging);
//! descriptors are ignored (no `FI_MR_LOCAL`).

use crate::matching::Parts;
use crate::obj::addr;
use crate::state::{self, RecvArgs, SendArgs};
use crate::{guard, serr, NULL};
use std::os::raw::c_void;
use weft_ofi_sys as fi;

fn send(ep: *mut fi::fid_ep, a: SendArgs) -> isize {
    guard(serr(fi::FI_EOTHER as u64), || {
        state::with(|g| g.send(addr(ep), a))
    })
}

fn sendv(ep: *mut fi::fid_ep, parts: Parts, a: SendArgs) -> isize {
    send(ep, SendArgs { parts, ..a })
}

fn recvv(ep: *mut fi::fid_ep, parts: Parts, a: RecvArgs) -> isize {
    recv(ep, RecvArgs { parts, ..a })
}

fn recv(ep: *mut fi::fid_ep, a: RecvArgs) -> isize {
    guard(serr(fi::FI_EOTHER as u64), || {
        state::with(|g| g.recv(addr(ep), a))
    })
}

/// An iovec of at most [`crate::info::IOV_LIMIT`] entries: its first buffer with bytes, the
/// bytes of all, and (several entries) all of them; `None` when it has too many entries, or
/// one with bytes at a null address.
///
/// # Safety
/// `iov` holds `count` entries.
unsafe fn vec_of(iov: *const fi::iovec, count: usize) -> Option<(*mut c_void, usize, Parts)> {
    if count == 0 {
        return Some((NULL, 0, None));
    }
    if count > crate::info::IOV_LIMIT || iov.is_null() {
        return None;
    }
    // SAFETY: per the contract, `count` entries at a non-null `iov`.
    let v = unsafe { std::slice::from_raw_parts(iov, count) };
    if v.iter().any(|e| e.iov_len > 0 && e.iov_base.is_null()) {
        return None;
    }
    let len = v.iter().try_fold(0usize, |n, e| n.checked_add(e.iov_len))?;
    let parts = (count > 1).then(|| v.iter().map(|e| (e.iov_base as usize, e.iov_len)).collect());
    // The buffer a completion names: the first that holds bytes.
    let first = v
        .iter()
        .find(|e| e.iov_len > 0)
        .map_or(v[0].iov_base, |e| e.iov_base);
    Some((first, len, parts))
}

#[allow(clippy::too_many_arguments)]
fn tx(
    tagged: bool,
    buf: *const c_void,
    len: usize,
    dest: u64,
    tag: u64,
    data: Option<u64>,
    ctx: *mut c_void,
    flags: Option<u64>,
    inject: bool,
) -> SendArgs {
    SendArgs {
        tagged,
        buf,
        len,
        dest,
        tag,
        data,
        ctx,
        flags,
        inject,
        parts: None,
    }
}

#[allow(clippy::too_many_arguments)]
fn rx(
    tagged: bool,
    buf: *mut c_void,
    len: usize,
    src: u64,
    tag: u64,
    ignore: u64,
    ctx: *mut c_void,
    flags: Option<u64>,
) -> RecvArgs {
    RecvArgs {
        tagged,
        buf,
        len,
        src,
        tag,
        ignore,
        ctx,
        flags,
        parts: None,
    }
}

/// Remote CQ data of a `*msg` call: its `data` field when the flags ask for it.
fn data_of(flags: u64, data: u64) -> Option<u64> {
    (flags & fi::FI_REMOTE_CQ_DATA != 0).then_some(data)
}

// ---- FI_MSG ---------------------------------------------------------------------------

pub(crate) unsafe extern "C" fn msg_recv(
    ep: *mut fi::fid_ep,
    buf: *mut c_void,
    len: usize,
    _desc: *mut c_void,
    src: fi::fi_addr_t,
    ctx: *mut c_void,
) -> isize {
    recv(ep, rx(false, buf, len, src, 0, 0, ctx, None))
}
pub(crate) unsafe extern "C" fn msg_recvv(
    ep: *mut fi::fid_ep,
    iov: *const fi::iovec,
    _desc: *mut *mut c_void,
    count: usize,
    src: fi::fi_addr_t,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: fi_recvv's iovec of `count` entries.
    match unsafe { vec_of(iov, count) } {
        Some((b, l, parts)) => recvv(ep, parts, rx(false, b, l, src, 0, 0, ctx, None)),
        None => serr(fi::FI_EINVAL),
    }
}
pub(crate) unsafe extern "C" fn msg_recvmsg(
    ep: *mut fi::fid_ep,
    m: *const fi::fi_msg,
    flags: u64,
) -> isize {
    // SAFETY: fi_recvmsg's message.
    let Some(m) = (unsafe { m.as_ref() }) else {
        return serr(fi::FI_EINVAL);
    };
    // SAFETY: its iovec of `iov_count` entries.
    match unsafe { vec_of(m.msg_iov, m.iov_count) } {
        Some((b, l, parts)) => recvv(
            ep,
            parts,
            rx(false, b, l, m.addr, 0, 0, m.context, Some(flags)),
        ),
        None => serr(fi::FI_EINVAL),
    }
}
pub(crate) unsafe extern "C" fn msg_send(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    _desc: *mut c_void,
    dest: fi::fi_addr_t,
    ctx: *mut c_void,
) -> isize {
    send(ep, tx(false, buf, len, dest, 0, None, ctx, None, false))
}
pub(crate) unsafe extern "C" fn msg_sendv(
    ep: *mut fi::fid_ep,
    iov: *const fi::iovec,
    _desc: *mut *mut c_void,
    count: usize,
    dest: fi::fi_addr_t,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: fi_sendv's iovec of `count` entries.
    match unsafe { vec_of(iov, count) } {
        Some((b, l, parts)) => sendv(ep, parts, tx(false, b, l, dest, 0, None, ctx, None, false)),
        None => serr(fi::FI_EINVAL),
    }
}
pub(crate) unsafe extern "C" fn msg_sendmsg(
    ep: *mut fi::fid_ep,
    m: *const fi::fi_msg,
    flags: u64,
) -> isize {
    // SAFETY: fi_sendmsg's message.
    let Some(m) = (unsafe { m.as_ref() }) else {
        return serr(fi::FI_EINVAL);
    };
    let data = data_of(flags, m.data);
    // SAFETY: its iovec of `iov_count` entries.
    match unsafe { vec_of(m.msg_iov, m.iov_count) } {
        Some((b, l, parts)) => sendv(
            ep,
            parts,
            tx(false, b, l, m.addr, 0, data, m.context, Some(flags), false),
        ),
        None => serr(fi::FI_EINVAL),
    }
}
pub(crate) unsafe extern "C" fn msg_inject(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    dest: fi::fi_addr_t,
) -> isize {
    send(ep, tx(false, buf, len, dest, 0, None, NULL, None, true))
}
pub(crate) unsafe extern "C" fn msg_senddata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    _desc: *mut c_void,
    data: u64,
    dest: fi::fi_addr_t,
    ctx: *mut c_void,
) -> isize {
    send(
        ep,
        tx(false, buf, len, dest, 0, Some(data), ctx, None, false),
    )
}
pub(crate) unsafe extern "C" fn msg_injectdata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    dest: fi::fi_addr_t,
) -> isize {
    send(
        ep,
        tx(false, buf, len, dest, 0, Some(data), NULL, None, true),
    )
}

// ---- FI_TAGGED ------------------------------------------------------------------------

#[allow(clippy::too_many_arguments)]
pub(crate) unsafe extern "C" fn t_recv(
    ep: *mut fi::fid_ep,
    buf: *mut c_void,
    len: usize,
    _desc: *mut c_void,
    src: fi::fi_addr_t,
    tag: u64,
    ignore: u64,
    ctx: *mut c_void,
) -> isize {
    recv(ep, rx(true, buf, len, src, tag, ignore, ctx, None))
}
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe extern "C" fn t_recvv(
    ep: *mut fi::fid_ep,
    iov: *const fi::iovec,
    _desc: *mut *mut c_void,
    count: usize,
    src: fi::fi_addr_t,
    tag: u64,
    ignore: u64,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: fi_trecvv's iovec of `count` entries.
    match unsafe { vec_of(iov, count) } {
        Some((b, l, parts)) => recvv(ep, parts, rx(true, b, l, src, tag, ignore, ctx, None)),
        None => serr(fi::FI_EINVAL),
    }
}
pub(crate) unsafe extern "C" fn t_recvmsg(
    ep: *mut fi::fid_ep,
    m: *const fi::fi_msg_tagged,
    flags: u64,
) -> isize {
    // SAFETY: fi_trecvmsg's message.
    let Some(m) = (unsafe { m.as_ref() }) else {
        return serr(fi::FI_EINVAL);
    };
    // SAFETY: its iovec of `iov_count` entries (a peek may give none).
    match unsafe { vec_of(m.msg_iov, m.iov_count) } {
        Some((b, l, parts)) => recvv(
            ep,
            parts,
            rx(true, b, l, m.addr, m.tag, m.ignore, m.context, Some(flags)),
        ),
        None => serr(fi::FI_EINVAL),
    }
}
pub(crate) unsafe extern "C" fn t_send(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    _desc: *mut c_void,
    dest: fi::fi_addr_t,
    tag: u64,
    ctx: *mut c_void,
) -> isize {
    send(ep, tx(true, buf, len, dest, tag, None, ctx, None, false))
}
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe extern "C" fn t_sendv(
    ep: *mut fi::fid_ep,
    iov: *const fi::iovec,
    _desc: *mut *mut c_void,
    count: usize,
    dest: fi::fi_addr_t,
    tag: u64,
    ctx: *mut c_void,
) -> isize {
    // SAFETY: fi_tsendv's iovec of `count` entries.
    match unsafe { vec_of(iov, count) } {
        Some((b, l, parts)) => sendv(ep, parts, tx(true, b, l, dest, tag, None, ctx, None, false)),
        None => serr(fi::FI_EINVAL),
    }
}
pub(crate) unsafe extern "C" fn t_sendmsg(
    ep: *mut fi::fid_ep,
    m: *const fi::fi_msg_tagged,
    flags: u64,
) -> isize {
    // SAFETY: fi_tsendmsg's message.
    let Some(m) = (unsafe { m.as_ref() }) else {
        return serr(fi::FI_EINVAL);
    };
    let data = data_of(flags, m.data);
    // SAFETY: its iovec of `iov_count` entries.
    match unsafe { vec_of(m.msg_iov, m.iov_count) } {
        Some((b, l, parts)) => sendv(
            ep,
            parts,
            tx(
                true,
                b,
                l,
                m.addr,
                m.tag,
                data,
                m.context,
                Some(flags),
                false,
            ),
        ),
        None => serr(fi::FI_EINVAL),
    }
}
pub(crate) unsafe extern "C" fn t_inject(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    dest: fi::fi_addr_t,
    tag: u64,
) -> isize {
    send(ep, tx(true, buf, len, dest, tag, None, NULL, None, true))
}
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe extern "C" fn t_senddata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    _desc: *mut c_void,
    data: u64,
    dest: fi::fi_addr_t,
    tag: u64,
    ctx: *mut c_void,
) -> isize {
    send(
        ep,
        tx(true, buf, len, dest, tag, Some(data), ctx, None, false),
    )
}
pub(crate) unsafe extern "C" fn t_injectdata(
    ep: *mut fi::fid_ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    dest: fi::fi_addr_t,
    tag: u64,
) -> isize {
    send(
        ep,
        tx(true, buf, len, dest, tag, Some(data), NULL, None, true),
    )
}
