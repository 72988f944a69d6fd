//! The capability ladder: which libfabric provider and domain `fi_getinfo` offers, down the
//! ladder of what weft asks (tagged, RMA, atomics, then active messages alone), and what the
//! chosen one gives weft (`Caps`, the atomic table, the rendezvous).

use super::*;

/// What `fi_getinfo` chose, and the capabilities weft takes from it.
pub(super) struct Chosen {
    pub(super) info: *mut fi_info,
    pub(super) caps: u64,
    pub(super) delivery: bool,
}

/// The capability sets tried in order: each step drops one capability the core can replace.
pub(super) const LADDER: [u64; 4] = [
    FI_TAGGED | FI_MSG | FI_RMA | FI_ATOMIC,
    FI_TAGGED | FI_MSG | FI_RMA,
    FI_TAGGED | FI_MSG,
    FI_MSG,
];

/// Ask `fi_getinfo` for an RDM endpoint, down the capability ladder; with RMA, first with
/// delivery-complete writes.
pub(super) fn choose(prov: &str, dom: &str) -> Result<Chosen> {
    let lib = fabric().map_err(|e| Error::from(ErrorDetail::Unsupported(e)))?;
    let mut tried = Vec::new();
    for caps in LADDER {
        for delivery in [true, false] {
            if delivery && caps & FI_RMA == 0 {
                continue;
            }
            // SAFETY: fi_dupinfo(NULL) allocates a zeroed fi_info with its attribute structs;
            // the strings stored in it are malloc'd (strdup) because fi_freeinfo frees them.
            let hints = unsafe { (lib.fi_dupinfo)(null()) };
            if hints.is_null() {
                return Err(fi_err("fi_allocinfo", -(FI_ENOMEM as isize)));
            }
            // SAFETY: `hints` and its attribute pointers were just allocated by libfabric.
            let rc = unsafe {
                let h = &mut *hints;
                h.caps = caps;
                h.mode = 0;
                (*h.ep_attr).type_ = FI_EP_RDM;
                (*h.domain_attr).mr_mode =
                    (FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY) as i32;
                (*h.domain_attr).threading = FI_THREAD_DOMAIN;
                if delivery {
                    (*h.tx_attr).op_flags = FI_DELIVERY_COMPLETE;
                }
                if !prov.is_empty() {
                    let c = CString::new(prov)
                        .map_err(|_| Error::invalid("NUL in WEFT_OFI_PROVIDER"))?;
                    (*h.fabric_attr).prov_name = libc::strdup(c.as_ptr());
                }
                if !dom.is_empty() {
                    let c =
                        CString::new(dom).map_err(|_| Error::invalid("NUL in WEFT_OFI_DOMAIN"))?;
                    (*h.domain_attr).name = libc::strdup(c.as_ptr());
                }
                let mut info = null_mut();
                let rc = (lib.fi_getinfo)(
                    fi_version(FI_MAJOR_VERSION as u32, FI_MINOR_VERSION as u32),
                    null(),
                    null(),
                    0,
                    hints,
                    &mut info,
                );
                (lib.fi_freeinfo)(hints);
                if rc == 0 && !info.is_null() {
                    // Keep the first answer only.
                    let first = (lib.fi_dupinfo)(info);
                    (lib.fi_freeinfo)(info);
                    if !first.is_null() {
                        return Ok(Chosen {
                            info: first,
                            caps,
                            delivery,
                        });
                    }
                }
                rc
            };
            tried.push(format!("{} {}", caps_name(caps), strerror(rc as i64)));
        }
    }
    Err(Error::from(ErrorDetail::Unsupported(format!(
        "ofi: fi_getinfo offers no FI_EP_RDM endpoint{}{} ({})",
        if prov.is_empty() {
            String::new()
        } else {
            format!(" of provider '{prov}'")
        },
        if dom.is_empty() {
            String::new()
        } else {
            format!(" in domain '{dom}'")
        },
        tried.join("; ")
    ))))
}

/// `WEFT_OFI_NATIVE`: whether the core hands tagged messages, RMA and atomics to libfabric, or
/// only active messages. Not on shm before 1.19 (unless asked): across processes its shared
/// receive context matches a message that arrived before its receive against the message's own
/// ignore mask instead of the receive's (a receive with a wildcard tag never matches it;
/// libfabric 1.17 `util_srx`), and its RMA operations never complete in the conformance suite.
pub(super) fn native_ops(prov: &str) -> bool {
    match NATIVE.raw().trim().to_ascii_lowercase().as_str() {
        "1" | "on" | "yes" | "true" => true,
        "0" | "off" | "no" | "false" => false,
        _ => {
            let version = fabric().map_or(0, |f| {
                // SAFETY: fi_version takes no arguments and returns the library's version.
                unsafe { (f.fi_version)() }
            });
            !(prov.split(';').next() == Some("shm") && version < fi_version(1, 19))
        }
    }
}

/// `WEFT_OFI_RNDV`: a size, or `auto`: 16 KiB, but the inject size on libfabric 1.17's shm,
/// whose larger messages hang when they arrive before their receive (libfabric issue 9143,
/// fixed in 1.19).
pub(super) fn rndv_for(ch: &Chosen) -> Result<usize> {
    let v = RNDV.raw();
    if v.trim().eq_ignore_ascii_case("auto") {
        // SAFETY: a live fi_info from fi_getinfo.
        let (name, inject) = unsafe {
            let i = &*ch.info;
            (cstr((*i.fabric_attr).prov_name), (*i.tx_attr).inject_size)
        };
        let shm = name.split(';').next() == Some("shm");
        return Ok(if shm {
            inject.clamp(64, 16 << 10)
        } else {
            16 << 10
        });
    }
    // The range is in the parameter's check.
    RNDV.get_size()
}

pub(super) fn caps_name(c: u64) -> String {
    let mut v = Vec::new();
    for (b, n) in [
        (FI_TAGGED, "tagged"),
        (FI_MSG, "msg"),
        (FI_RMA, "rma"),
        (FI_ATOMIC, "atomic"),
    ] {
        if c & b != 0 {
            v.push(n);
        }
    }
    v.join("+")
}

pub(super) fn cstr(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: libfabric's attribute strings are NUL-terminated and live as long as the info.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}

/// weft's (operation, type) in libfabric's terms.
pub(super) fn fi_types(op: WOp, ty: BasicType) -> (fi_op, fi_datatype) {
    let o = match op {
        WOp::Sum => FI_SUM,
        WOp::Prod => FI_PROD,
        WOp::Min => FI_MIN,
        WOp::Max => FI_MAX,
        WOp::Band => FI_BAND,
        WOp::Bor => FI_BOR,
        WOp::Bxor => FI_BXOR,
        WOp::Land => FI_LAND,
        WOp::Lor => FI_LOR,
        WOp::Lxor => FI_LXOR,
        WOp::Replace => FI_ATOMIC_WRITE,
        WOp::NoOp => FI_ATOMIC_READ,
        WOp::Cswap => FI_CSWAP,
    };
    let t = match ty {
        BasicType::I8 => FI_INT8,
        BasicType::U8 => FI_UINT8,
        BasicType::I16 => FI_INT16,
        BasicType::U16 => FI_UINT16,
        BasicType::I32 => FI_INT32,
        BasicType::U32 => FI_UINT32,
        BasicType::I64 => FI_INT64,
        BasicType::U64 => FI_UINT64,
        BasicType::F32 => FI_FLOAT,
        BasicType::F64 => FI_DOUBLE,
    };
    (o, t)
}

/// Capabilities of a chosen endpoint; `dom` (an open domain) answers `fi_query_atomic`.
/// `native`: `WEFT_OFI_NATIVE`'s answer unless given.
pub(super) fn caps_of(ch: &Chosen, dom: Option<*mut fid_domain>, native: Option<bool>) -> Caps {
    // SAFETY: `ch.info` is a live fi_info from fi_getinfo with its attribute structs.
    let (tx, rx, d) = unsafe {
        let i = &*ch.info;
        (&*i.tx_attr, &*i.rx_attr, &*i.domain_attr)
    };
    let am_buf = AM_BUF.get_size().unwrap_or(16 << 10);
    let iov = tx.iov_limit.min(rx.iov_limit).clamp(1, 64);
    let mut c = Caps::am_only(MAX_HDR, am_buf - PREFIX - MAX_HDR, iov);
    // SAFETY: as above.
    let name = unsafe { cstr((*(*ch.info).fabric_attr).prov_name) };
    let native = native.unwrap_or_else(|| native_ops(&name));
    c.tagged = ch.caps & FI_TAGGED != 0 && native;
    // shm reaches the processes of one host; the others go through a network.
    c.spans_hosts = name.split(';').next() != Some("shm");
    let mr_mode = d.mr_mode as u64;
    c.mr_local = mr_mode & FI_MR_LOCAL != 0;
    // A fabric that needs local registration pins pages (verbs); the cache then checks frames.
    c.mr_pins = c.mr_local;
    c.inject_size = tx.inject_size;
    if ch.caps & FI_RMA != 0 && native {
        c.rma = Some(RmaCaps {
            read: true,
            write: true,
            max_iov: tx.iov_limit.clamp(1, 64),
            scalable_keys: mr_mode & FI_MR_PROV_KEY == 0,
            alloc: false,
            native_locks: false,
            user_memory: true,
            completion: if ch.delivery {
                CompletionLevel::Delivery
            } else {
                CompletionLevel::Transmit
            },
            fence: ch.caps & FI_FENCE != 0,
            cq_data_size: 0,
            rndv_only: false,
        });
        c.counters = d.cntr_cnt > 0;
    }
    if ch.caps & FI_TAGGED != 0 && !native && !c.mr_local {
        // Active messages only, but the core's write rendezvous still moves large messages
        // without copies: a "registration" posts the receive buffer as a tagged receive in the
        // provider's data context, the "write" is a tagged send to it (see `wrecv_open`).
        c.rma = Some(RmaCaps {
            write: true,
            max_iov: iov,
            user_memory: true,
            completion: CompletionLevel::Delivery,
            rndv_only: true,
            ..RmaCaps::default()
        });
        c.per_peer = true;
    }
    if ch.caps & FI_ATOMIC != 0 && native {
        if let Some(dom) = dom {
            let (t, max) = atomic_table(dom);
            c.atomics = t;
            c.atomic_max_count = max;
        }
    }
    c
}

/// The pairs every form of which (plain, fetching; compare for CSWAP, fetch for NO_OP) the
/// domain performs, and the fewest elements any of them allows per call.
pub(super) fn atomic_table(dom: *mut fid_domain) -> (AtomicTable, usize) {
    let mut t = AtomicTable::NONE;
    let mut max = usize::MAX;
    for op in WOp::ALL {
        for ty in BasicType::ALL {
            if !op.valid_for(ty) {
                continue;
            }
            let (o, d) = fi_types(op, ty);
            let forms: &[u64] = match op {
                WOp::Cswap => &[FI_COMPARE_ATOMIC],
                WOp::NoOp => &[FI_FETCH_ATOMIC],
                _ => &[0, FI_FETCH_ATOMIC],
            };
            let mut ok = true;
            for f in forms {
                let mut attr = fi_atomic_attr::default();
                // SAFETY: `dom` is an open domain; `attr` is ours to fill.
                let rc = unsafe { fi_query_atomic(dom, d, o, &mut attr, *f) };
                if rc != 0 || attr.count == 0 {
                    ok = false;
                    break;
                }
                max = max.min(attr.count);
            }
            t.set(op, ty, ok);
        }
    }
    (t, if t.is_empty() { 0 } else { max })
}
