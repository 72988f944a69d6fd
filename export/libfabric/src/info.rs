//! `fi_getinfo` for the `weft` provider: one entry per weft provider usable here, in weft's
//! own selection order (`WEFT_PROVIDER` applies), the domain named after the provider. Hints
//! weft cannot meet leave an entry out; no entry left is `-FI_ENODATA`.

use crate::{calloc, cstr, err, guard, strdup, API_VERSION, PROV_VERSION};
use std::os::raw::{c_char, c_int};
use weft_ofi_sys as fi;

/// Primary capabilities an endpoint offers.
pub const PRIMARY: u64 = fi::FI_MSG | fi::FI_TAGGED | fi::FI_RMA | fi::FI_ATOMIC;
/// The one-sided primary capabilities, and the secondary ones that go with them.
pub const ONE_SIDED: u64 = fi::FI_RMA | fi::FI_ATOMIC;
pub const ONE_SIDED_SIDES: u64 =
    fi::FI_READ | fi::FI_WRITE | fi::FI_REMOTE_READ | fi::FI_REMOTE_WRITE;
/// Secondary capabilities offered when asked.
pub const ON_REQUEST: u64 = fi::FI_DIRECTED_RECV | fi::FI_SOURCE;
/// Secondary capabilities always offered.
pub const ALWAYS: u64 = fi::FI_SEND | fi::FI_RECV | fi::FI_LOCAL_COMM | fi::FI_REMOTE_COMM;
/// Tag bits an application may use: all 64 (weft-fi matches libfabric's tags itself).
pub const TAG_BITS: u64 = u64::MAX;
/// Bytes of remote CQ data a message may carry.
pub const CQ_DATA: usize = 8;
/// Bytes a message may be: weft sends any size (large ones by rendezvous).
pub const MAX_MSG: usize = 1 << 40;
/// `fi_inject` copies up to this many bytes.
pub const INJECT: usize = 4096;
/// Entries of a send's or receive's iovec (`iov_limit`): gathered into and scattered out of
/// one message, in order.
pub const IOV_LIMIT: usize = 8;
/// Operations a queue of an endpoint accepts before `-FI_EAGAIN`.
pub const QUEUE: usize = 4096;

/// The weft providers a libfabric domain may name here, best first.
pub fn domains() -> Vec<String> {
    let (all, _) = weft::registry::providers();
    let ctx = weft::provider::ProbeContext {
        rank: 0,
        size: 2,
        in_process: false,
        hosts: 1,
        local_ranks: 2,
    };
    let sel = match weft::registry::Selection::from_env() {
        Ok(s) => s,
        Err(_) => weft::registry::Selection::parse("").expect("the empty selection parses"),
    };
    let cands = weft::registry::candidates(&sel, &all, None).unwrap_or_default();
    cands
        .iter()
        .filter(|f| !matches!(f.name(), "loopback" | "ofi"))
        .filter(|f| f.probe(&ctx).is_ok())
        .map(|f| f.name().to_string())
        .collect()
}

/// Whether `hints` allow an entry for `domain`, and the capabilities it then has.
///
/// # Safety
/// `hints` is null or a valid `fi_info` whose attribute pointers are null or valid.
pub unsafe fn admit(hints: *const fi::fi_info, domain: &str) -> Option<u64> {
    if hints.is_null() {
        return Some(PRIMARY | ALWAYS | ONE_SIDED_SIDES);
    }
    // SAFETY: per the contract.
    let h = unsafe { &*hints };
    let wanted = h.caps;
    let all = PRIMARY | ON_REQUEST | ALWAYS | ONE_SIDED_SIDES;
    if wanted & !all != 0 {
        return None;
    }
    if h.addr_format != fi::FI_FORMAT_UNSPEC {
        return None;
    }
    // SAFETY: attribute pointers are null or valid (the contract).
    unsafe {
        if let Some(ep) = h.ep_attr.as_ref() {
            if ep.type_ != fi::FI_EP_UNSPEC && ep.type_ != fi::FI_EP_RDM {
                return None;
            }
        }
        if let Some(d) = h.domain_attr.as_ref() {
            if d.cq_data_size > CQ_DATA {
                return None;
            }
            let name = cstr(d.name);
            if !name.is_empty() && name != domain {
                return None;
            }
        }
        if let Some(f) = h.fabric_attr.as_ref() {
            let name = cstr(f.name);
            if !name.is_empty() && name != "weft" {
                return None;
            }
        }
        if let Some(tx) = h.tx_attr.as_ref() {
            if tx.inject_size > INJECT || tx.caps & !all != 0 {
                return None;
            }
        }
        if let Some(rx) = h.rx_attr.as_ref() {
            if rx.caps & !all != 0 {
                return None;
            }
        }
    }
    let primary = if wanted & PRIMARY != 0 {
        wanted & PRIMARY
    } else {
        PRIMARY
    };
    let sides = if primary & ONE_SIDED != 0 {
        ONE_SIDED_SIDES
    } else {
        0
    };
    Some(primary | (wanted & ON_REQUEST) | ALWAYS | sides)
}

/// The MR mode of an entry, from the modes the application says it supports: weft-fi needs
/// none (it copies through weft), and with `FI_MR_PROV_KEY` or `FI_MR_VIRT_ADDR` allowed it
/// chooses keys and takes virtual addresses (as Open MPI's `btl/ofi` asks); without them the
/// application's requested keys and offsets into regions are used.
pub fn mr_mode(hinted: u64) -> u64 {
    if hinted == fi::FI_MR_BASIC as u64 || hinted == fi::FI_MR_SCALABLE as u64 {
        hinted
    } else {
        hinted & (fi::FI_MR_PROV_KEY | fi::FI_MR_VIRT_ADDR)
    }
}

/// One `fi_info` for `domain` with `caps`, allocated as `fi_freeinfo` frees it; null when out
/// of memory.
///
/// # Safety
/// `hints` as for [`admit`].
pub unsafe fn build(hints: *const fi::fi_info, domain: &str, caps: u64) -> *mut fi::fi_info {
    let info = calloc::<fi::fi_info>();
    if info.is_null() {
        return info;
    }
    // SAFETY: `info` is a fresh zeroed allocation; each attribute likewise, owned by `info`
    // from here on (fi_freeinfo frees them and the strings).
    unsafe {
        let i = &mut *info;
        i.tx_attr = calloc();
        i.rx_attr = calloc();
        i.ep_attr = calloc();
        i.domain_attr = calloc();
        i.fabric_attr = calloc();
        if i.tx_attr.is_null()
            || i.rx_attr.is_null()
            || i.ep_attr.is_null()
            || i.domain_attr.is_null()
            || i.fabric_attr.is_null()
        {
            fi_free(info);
            return std::ptr::null_mut();
        }
        let h = hints.as_ref();
        i.caps = caps;
        i.mode = 0;
        i.addr_format = fi::FI_FORMAT_UNSPEC;
        let tx = &mut *i.tx_attr;
        tx.caps = caps & (PRIMARY | fi::FI_SEND | fi::FI_READ | fi::FI_WRITE);
        tx.msg_order = fi::FI_ORDER_SAS;
        tx.comp_order = fi::FI_ORDER_NONE;
        tx.inject_size = INJECT;
        tx.size = QUEUE;
        tx.iov_limit = IOV_LIMIT;
        tx.rma_iov_limit = if caps & ONE_SIDED != 0 { 1 } else { 0 };
        tx.op_flags = h.and_then(|h| h.tx_attr.as_ref()).map_or(0, |t| {
            t.op_flags & (fi::FI_COMPLETION | fi::FI_TRANSMIT_COMPLETE)
        });
        let rx = &mut *i.rx_attr;
        rx.caps =
            caps & (PRIMARY | fi::FI_RECV | ON_REQUEST | fi::FI_REMOTE_READ | fi::FI_REMOTE_WRITE);
        rx.msg_order = fi::FI_ORDER_SAS;
        rx.comp_order = fi::FI_ORDER_NONE;
        rx.size = QUEUE;
        rx.iov_limit = IOV_LIMIT;
        rx.op_flags = h
            .and_then(|h| h.rx_attr.as_ref())
            .map_or(0, |r| r.op_flags & fi::FI_COMPLETION);
        let ep = &mut *i.ep_attr;
        ep.type_ = fi::FI_EP_RDM;
        ep.protocol = fi::FI_PROTO_UNSPEC;
        ep.protocol_version = 1;
        ep.max_msg_size = MAX_MSG;
        ep.mem_tag_format = TAG_BITS;
        ep.tx_ctx_cnt = 1;
        ep.rx_ctx_cnt = 1;
        let d = &mut *i.domain_attr;
        d.name = strdup(domain);
        let threading = h
            .and_then(|h| h.domain_attr.as_ref())
            .map_or(fi::FI_THREAD_UNSPEC, |d| d.threading);
        d.threading = if threading == fi::FI_THREAD_UNSPEC {
            fi::FI_THREAD_SAFE
        } else {
            // Every level is met: one lock serialises the provider.
            threading
        };
        d.control_progress = fi::FI_PROGRESS_MANUAL;
        d.data_progress = fi::FI_PROGRESS_MANUAL;
        d.resource_mgmt = fi::FI_RM_ENABLED;
        let av = h
            .and_then(|h| h.domain_attr.as_ref())
            .map_or(fi::FI_AV_UNSPEC, |d| d.av_type);
        d.av_type = if av == fi::FI_AV_MAP {
            fi::FI_AV_MAP
        } else {
            fi::FI_AV_TABLE
        };
        d.mr_mode = mr_mode(
            h.and_then(|h| h.domain_attr.as_ref())
                .map_or(0, |d| d.mr_mode as u64),
        ) as i32;
        d.mr_iov_limit = 1;
        d.mr_key_size = 8;
        d.cq_data_size = CQ_DATA;
        d.cq_cnt = 256;
        d.ep_cnt = 1;
        d.tx_ctx_cnt = 1;
        d.rx_ctx_cnt = 1;
        d.max_ep_tx_ctx = 1;
        d.max_ep_rx_ctx = 1;
        d.mr_cnt = 1 << 16;
        d.caps = fi::FI_LOCAL_COMM | fi::FI_REMOTE_COMM;
        let f = &mut *i.fabric_attr;
        f.name = strdup("weft");
        // libfabric fills in prov_name itself.
        f.prov_name = std::ptr::null_mut();
        f.prov_version = PROV_VERSION;
        f.api_version = API_VERSION;
    }
    info
}

/// Free an `fi_info` list built here (as libfabric's `fi_freeinfo` would).
///
/// # Safety
/// `info` is null or a list whose every allocation came from `calloc`/`strdup`.
pub unsafe fn fi_free(mut info: *mut fi::fi_info) {
    while !info.is_null() {
        // SAFETY: per the contract; each pointer is freed once.
        unsafe {
            let i = &mut *info;
            let next = i.next;
            if let Some(d) = i.domain_attr.as_mut() {
                libc::free(d.name as *mut _);
            }
            if let Some(f) = i.fabric_attr.as_mut() {
                libc::free(f.name as *mut _);
                libc::free(f.prov_name as *mut _);
            }
            for p in [
                i.tx_attr as *mut libc::c_void,
                i.rx_attr as *mut _,
                i.ep_attr as *mut _,
                i.domain_attr as *mut _,
                i.fabric_attr as *mut _,
                i.src_addr,
                i.dest_addr,
                info as *mut _,
            ] {
                libc::free(p);
            }
            info = next;
        }
    }
}

/// The provider's `getinfo`.
///
/// # Safety
/// libfabric's contract: `hints` is null or a valid `fi_info`; `out` is null or writable.
pub unsafe extern "C" fn getinfo(
    version: u32,
    _node: *const c_char,
    _service: *const c_char,
    _flags: u64,
    hints: *const fi::fi_info,
    out: *mut *mut fi::fi_info,
) -> c_int {
    guard(err(fi::FI_EOTHER as u64), || {
        if out.is_null() {
            return err(fi::FI_EINVAL);
        }
        if version > API_VERSION {
            return err(fi::FI_ENODATA);
        }
        let mut head: *mut fi::fi_info = std::ptr::null_mut();
        let mut tail: *mut fi::fi_info = std::ptr::null_mut();
        for d in domains() {
            // SAFETY: libfabric passes null or valid hints.
            let Some(caps) = (unsafe { admit(hints, &d) }) else {
                continue;
            };
            // SAFETY: as above.
            let i = unsafe { build(hints, &d, caps) };
            if i.is_null() {
                // SAFETY: `head` is a list built here.
                unsafe { fi_free(head) };
                return err(fi::FI_ENOMEM);
            }
            if tail.is_null() {
                head = i;
            } else {
                // SAFETY: `tail` is the last entry built here.
                unsafe { (*tail).next = i };
            }
            tail = i;
        }
        // SAFETY: `out` is non-null (checked), libfabric's pointer to fill.
        unsafe { *out = head };
        if head.is_null() {
            err(fi::FI_ENODATA)
        } else {
            0
        }
    })
}

#[cfg(test)]
mod t {
    use super::*;

    fn hints() -> Box<fi::fi_info> {
        let mut h = Box::<fi::fi_info>::default();
        h.ep_attr = Box::into_raw(Box::<fi::fi_ep_attr>::default());
        h.domain_attr = Box::into_raw(Box::<fi::fi_domain_attr>::default());
        h
    }

    #[test]
    fn hints_weft_cannot_meet_leave_the_entry_out() {
        // SAFETY: null hints.
        assert_eq!(
            unsafe { admit(std::ptr::null(), "shm") },
            Some(PRIMARY | ALWAYS | ONE_SIDED_SIDES)
        );
        let mut h = hints();
        h.caps = fi::FI_TAGGED;
        // SAFETY: `h` and its attributes are valid for the calls.
        unsafe {
            assert_eq!(admit(&*h, "shm"), Some(fi::FI_TAGGED | ALWAYS));
            (*h.ep_attr).type_ = fi::FI_EP_MSG;
            assert_eq!(admit(&*h, "shm"), None, "message endpoints");
            (*h.ep_attr).type_ = fi::FI_EP_RDM;
            h.caps = fi::FI_RMA | fi::FI_ATOMIC;
            assert_eq!(
                admit(&*h, "shm"),
                Some(fi::FI_RMA | fi::FI_ATOMIC | ALWAYS | ONE_SIDED_SIDES),
                "RMA and atomics"
            );
            h.caps = fi::FI_MULTICAST;
            assert_eq!(admit(&*h, "shm"), None, "multicast");
            h.caps = fi::FI_MSG;
            (*h.ep_attr).mem_tag_format = u64::MAX;
            assert!(admit(&*h, "shm").is_some(), "64-bit tags are met");
            (*h.ep_attr).mem_tag_format = 0;
            (*h.domain_attr).cq_data_size = 4;
            assert!(admit(&*h, "shm").is_some(), "4 bytes of CQ data are met");
            (*h.domain_attr).cq_data_size = 16;
            assert_eq!(admit(&*h, "shm"), None, "16 bytes of CQ data");
            (*h.domain_attr).cq_data_size = 0;
            let name = std::ffi::CString::new("tcp-sim").unwrap();
            (*h.domain_attr).name = name.as_ptr() as *mut _;
            assert_eq!(admit(&*h, "shm"), None, "another domain");
            assert!(admit(&*h, "tcp-sim").is_some());
            (*h.domain_attr).name = std::ptr::null_mut();
            drop(Box::from_raw(h.ep_attr));
            drop(Box::from_raw(h.domain_attr));
        }
    }

    #[test]
    fn an_entry_frees_as_fi_freeinfo_frees() {
        // SAFETY: null hints; the entry is built and freed here.
        unsafe {
            let i = build(std::ptr::null(), "shm", PRIMARY | ALWAYS);
            assert_eq!((*(*i).domain_attr).mr_mode, 0, "application keys, offsets");
            assert!(!i.is_null());
            assert_eq!(cstr((*(*i).domain_attr).name), "shm");
            assert_eq!((*(*i).ep_attr).type_, fi::FI_EP_RDM);
            assert!((*(*i).fabric_attr).prov_name.is_null());
            fi_free(i);
        }
    }
}
