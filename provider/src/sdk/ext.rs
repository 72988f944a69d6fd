//! The ABI 1.1 entries of the SDK (`WeftExtOps`): contract 2's connections, per-peer
//! capabilities, zero-copy active messages, and RMA and atomics with local descriptors, the
//! fence flag and completion data, each forwarded to the provider's trait method.

use super::{completion, with};
use crate::provider::{Completion, RawIov, RawIovMut, RemoteAddr, SendOutcome, StaticProvider};
use crate::types::{BasicType, Op};
use crate::Error;
use std::ffi::c_void;
use weft_abi::*;

/// A 1.1 completion: with the `WEFT_OP_*` flags.
fn completion_flags(token: u64, cntr: u64, flags: u32) -> Completion {
    Completion {
        fence: flags & WEFT_OP_FENCE != 0,
        ..completion(token, cntr)
    }
}

/// Descriptor `i` of a 1.1 call's array (0 when the host passed none).
unsafe fn desc_at(descs: *const u64, i: usize) -> u64 {
    if descs.is_null() {
        0
    } else {
        *descs.add(i)
    }
}

// ------------------------------------------------------------------------- ABI 1.1 entries

/// # Safety
/// As for the other exported functions.
pub unsafe extern "C" fn ext_connect<P: StaticProvider>(h: *mut c_void, peer: u32) -> i32 {
    with::<P, _>(h, |p| {
        p.connect(peer)?;
        Ok(WEFT_OK)
    })
}

/// # Safety
/// As for the other exported functions; `out` valid for a write.
pub unsafe extern "C" fn ext_peer_caps<P: StaticProvider>(
    h: *mut c_void,
    peer: u32,
    out: *mut WeftPeerCaps,
) -> i32 {
    with::<P, _>(h, |p| {
        let Some(c) = p.peer_caps(peer) else {
            return Ok(0);
        };
        let mut flags = 0;
        if c.rma_read {
            flags |= WEFT_PEER_RMA_READ;
        }
        if c.rma_write {
            flags |= WEFT_PEER_RMA_WRITE;
        }
        if c.am_isend {
            flags |= WEFT_PEER_AM_ISEND;
        }
        *out = WeftPeerCaps {
            size: std::mem::size_of::<WeftPeerCaps>() as u32,
            flags,
            max_am_payload: c.max_am_payload as u64,
            eager_limit: c.eager_limit as u64,
        };
        Ok(1)
    })
}

/// # Safety
/// As for the other exported functions; the payload stays valid until `token` completes.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ext_am_isend<P: StaticProvider>(
    h: *mut c_void,
    dest: u32,
    hdr: *const u8,
    hdr_len: usize,
    iov: *const WeftIov,
    descs: *const u64,
    iovcnt: usize,
    token: u64,
) -> i32 {
    with::<P, _>(h, |p| {
        let header = if hdr_len == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(hdr, hdr_len)
        };
        let pieces = raw_iovs(iov, descs, iovcnt);
        Ok(match p.am_isend(dest, header, &pieces, token)? {
            SendOutcome::Sent => WEFT_OK,
            SendOutcome::Busy => WEFT_BUSY,
        })
    })
}

/// # Safety
/// As for the other exported functions.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ext_read<P: StaticProvider>(
    h: *mut c_void,
    src: u32,
    local: *const WeftIovMut,
    descs: *const u64,
    cnt: usize,
    addr: u64,
    key: u64,
    token: u64,
    cntr: u64,
    flags: u32,
) -> i32 {
    with::<P, _>(h, |p| {
        let l = raw_iovs_mut(local, descs, cnt);
        p.rma_read(
            src,
            &l,
            RemoteAddr { addr, key },
            completion_flags(token, cntr, flags),
        )?;
        Ok(WEFT_OK)
    })
}

/// The local pieces of a 1.1 read (`descs` null: none).
unsafe fn raw_iovs_mut(local: *const WeftIovMut, descs: *const u64, cnt: usize) -> Vec<RawIovMut> {
    (0..cnt)
        .map(|i| {
            let v = *local.add(i);
            RawIovMut {
                ptr: v.base,
                len: v.len,
                desc: desc_at(descs, i),
            }
        })
        .collect()
}

/// The local pieces of a 1.1 write or zero-copy send (`descs` null: none).
unsafe fn raw_iovs(local: *const WeftIov, descs: *const u64, cnt: usize) -> Vec<RawIov> {
    (0..cnt)
        .map(|i| {
            let v = *local.add(i);
            RawIov {
                ptr: v.base,
                len: v.len,
                desc: desc_at(descs, i),
            }
        })
        .collect()
}

/// # Safety
/// As for the other exported functions.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ext_write<P: StaticProvider>(
    h: *mut c_void,
    dest: u32,
    local: *const WeftIov,
    descs: *const u64,
    cnt: usize,
    addr: u64,
    key: u64,
    token: u64,
    cntr: u64,
    flags: u32,
) -> i32 {
    with::<P, _>(h, |p| {
        let l = raw_iovs(local, descs, cnt);
        p.rma_write(
            dest,
            &l,
            RemoteAddr { addr, key },
            completion_flags(token, cntr, flags),
        )?;
        Ok(WEFT_OK)
    })
}

/// # Safety
/// As for the other exported functions.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ext_write_data<P: StaticProvider>(
    h: *mut c_void,
    dest: u32,
    local: *const WeftIov,
    descs: *const u64,
    cnt: usize,
    addr: u64,
    key: u64,
    data: u64,
    token: u64,
    cntr: u64,
    flags: u32,
) -> i32 {
    with::<P, _>(h, |p| {
        let l = raw_iovs(local, descs, cnt);
        p.rma_write_data(
            dest,
            &l,
            RemoteAddr { addr, key },
            data,
            completion_flags(token, cntr, flags),
        )?;
        Ok(WEFT_OK)
    })
}

/// # Safety
/// As for the other exported functions; `descs` null or 3 entries.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn ext_atomic<P: StaticProvider>(
    h: *mut c_void,
    dest: u32,
    op: u32,
    ty: u32,
    count: usize,
    origin: *const u8,
    compare: *const u8,
    result: *mut u8,
    descs: *const u64,
    addr: u64,
    key: u64,
    token: u64,
    cntr: u64,
    flags: u32,
) -> i32 {
    with::<P, _>(h, |p| {
        let op = Op::from_u8(op as u8).ok_or_else(|| Error::invalid("unknown atomic operation"))?;
        let ty = BasicType::from_u8(ty as u8).ok_or_else(|| Error::invalid("unknown type"))?;
        let a = crate::provider::AtomicOp {
            op,
            ty,
            count,
            origin,
            compare,
            result,
            desc: [desc_at(descs, 0), desc_at(descs, 1), desc_at(descs, 2)],
        };
        p.atomic(
            dest,
            &a,
            RemoteAddr { addr, key },
            completion_flags(token, cntr, flags),
        )?;
        Ok(WEFT_OK)
    })
}

/// The ABI 1.1 table of `P`.
pub const fn ext_ops<P: StaticProvider>() -> WeftExtOps {
    WeftExtOps {
        size: std::mem::size_of::<WeftExtOps>() as u32,
        reserved: 0,
        connect: Some(ext_connect::<P>),
        peer_caps: Some(ext_peer_caps::<P>),
        am_isend: Some(ext_am_isend::<P>),
        read: Some(ext_read::<P>),
        write: Some(ext_write::<P>),
        write_data: Some(ext_write_data::<P>),
        atomic: Some(ext_atomic::<P>),
    }
}
