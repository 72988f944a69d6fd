//! The provider SDK: write a provider in Rust against [`crate::Provider`] and
//! [`crate::StaticProvider`], then export it from a `cdylib` with
//!
//! ```ignore
//! weft::export_provider!(MyProvider, name = "mine", priority = 20, summary = "what it is");
//! ```
//!
//! which generates `weft_provider_entry` and the C tables of ABI 1.1 (the contract-2 entries in
//! `WeftExtOps` forward to the trait's optional methods). Every exported function
//! catches panics and turns them into errors (`WEFT_EFAIL` with the panic message available
//! from `last_error`): a panic never crosses into the host.

use crate::provider::{
    Access, Caps, Completion, CompletionLevel, ProbeContext, SendOutcome, StaticProvider,
};
use crate::types::Op;
use crate::{Error, ErrorKind, Result};
use std::cell::RefCell;
use std::ffi::{c_char, c_void, CString};
use std::io::IoSlice;
use std::panic::{catch_unwind, AssertUnwindSafe};
use weft_abi::*;

/// An opened provider and its last error message.
pub struct Instance<P> {
    p: P,
    err: CString,
}

thread_local! {
    /// Errors of calls without an instance (probe, caps, a failed open).
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last(msg: &str) {
    LAST.with(|l| *l.borrow_mut() = CString::new(msg.replace('\0', " ")).unwrap_or_default());
}

fn code(e: &Error) -> i32 {
    match e.kind() {
        ErrorKind::PeerFailed => WEFT_EPEER,
        ErrorKind::InvalidArgument | ErrorKind::InvalidRank | ErrorKind::InvalidTag => WEFT_EINVAL,
        ErrorKind::Unsupported => WEFT_ENOSYS,
        ErrorKind::RemoteAccess => WEFT_EACCESS,
        ErrorKind::ProviderUnavailable => WEFT_EUNAVAIL,
        _ => WEFT_EFAIL,
    }
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    let m = p
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(non-string panic)".into());
    format!("provider panicked: {m}")
}

/// Run `f` on an instance, catching panics and recording errors.
///
/// # Safety
/// `h` must be a pointer returned by `open` for provider type `P` and not yet closed.
unsafe fn with<P, F: FnOnce(&mut P) -> Result<i32>>(h: *mut c_void, f: F) -> i32 {
    if h.is_null() {
        set_last("null provider handle");
        return WEFT_EINVAL;
    }
    let inst = &mut *(h as *mut Instance<P>);
    match catch_unwind(AssertUnwindSafe(|| f(&mut inst.p))) {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            inst.err = CString::new(e.to_string().replace('\0', " ")).unwrap_or_default();
            code(&e)
        }
        Err(p) => {
            inst.err = CString::new(panic_text(p)).unwrap_or_default();
            WEFT_EFAIL
        }
    }
}

/// Fill a C caps struct from [`Caps`].
pub fn caps_to_c(c: &Caps) -> WeftCaps {
    let mut flags = 0;
    if c.tagged {
        flags |= WEFT_CAP_TAGGED;
    }
    if let Some(r) = c.rma {
        if r.read {
            flags |= WEFT_CAP_RMA_READ;
        }
        if r.write {
            flags |= WEFT_CAP_RMA_WRITE;
        }
    }
    if c.counters {
        flags |= WEFT_CAP_COUNTERS;
    }
    if c.spans_processes {
        flags |= WEFT_CAP_SPANS_PROCESSES;
    }
    if c.spans_hosts {
        flags |= WEFT_CAP_SPANS_HOSTS;
    }
    for (on, bit) in [
        (c.mr_local, WEFT_CAP_MR_LOCAL),
        (c.mr_pins, WEFT_CAP_MR_PINS),
        (c.am_isend, WEFT_CAP_AM_ISEND),
        (c.lazy_connect, WEFT_CAP_LAZY_CONNECT),
        (c.per_peer, WEFT_CAP_PER_PEER),
        (
            c.rma
                .is_some_and(|r| r.completion == CompletionLevel::Transmit),
            WEFT_CAP_RMA_TRANSMIT,
        ),
        (c.rma.is_some_and(|r| r.fence), WEFT_CAP_RMA_FENCE),
    ] {
        if on {
            flags |= bit;
        }
    }
    let mut atomics = [0u16; 13];
    for op in Op::ALL {
        atomics[op as usize] = c.atomics.mask(op);
    }
    WeftCaps {
        size: std::mem::size_of::<WeftCaps>() as u32,
        max_am_header: c.max_am_header as u32,
        max_am_payload: c.max_am_payload as u64,
        eager_limit: c.eager_limit as u64,
        max_iov: c.max_iov as u32,
        flags,
        rma_max_iov: c.rma.map_or(0, |r| r.max_iov as u32),
        reserved: 0,
        atomics,
        reserved2: 0,
        inject_size: c.inject_size as u64,
        cq_data_size: c.rma.map_or(0, |r| r.cq_data_size as u32),
        atomic_max_count: c.atomic_max_count as u32,
    }
}

/// `probe` of provider `P`.
///
/// # Safety
/// Called by a weft host with valid pointers.
pub unsafe extern "C" fn probe<P: StaticProvider>(
    ctx: *const WeftProbeCtx,
    why: *mut c_char,
    why_len: usize,
) -> i32 {
    let r = catch_unwind(|| {
        let c = &*ctx;
        P::probe(&ProbeContext {
            rank: c.rank,
            size: c.nranks,
            in_process: c.in_process != 0,
            hosts: c.hosts,
            local_ranks: c.local_ranks,
        })
    });
    let msg = match r {
        Ok(Ok(())) => return WEFT_OK,
        Ok(Err(w)) => w,
        Err(p) => panic_text(p),
    };
    if !why.is_null() && why_len > 0 {
        let n = msg.len().min(why_len - 1);
        std::ptr::copy_nonoverlapping(msg.as_ptr() as *const c_char, why, n);
        *why.add(n) = 0;
    }
    WEFT_EUNAVAIL
}

/// `caps` of provider `P`.
///
/// # Safety
/// `out` must point at a `WeftCaps`.
pub unsafe extern "C" fn caps<P: StaticProvider>(out: *mut WeftCaps) -> i32 {
    match catch_unwind(P::static_caps) {
        Ok(Ok(c)) => {
            *out = caps_to_c(&c);
            WEFT_OK
        }
        Ok(Err(e)) => {
            set_last(&e.to_string());
            code(&e)
        }
        Err(p) => {
            set_last(&panic_text(p));
            WEFT_EFAIL
        }
    }
}

/// `open` of provider `P`.
///
/// # Safety
/// `boot` valid for the call, `out` writable.
pub unsafe extern "C" fn open<P: StaticProvider>(
    boot: *const WeftBoot,
    out: *mut *mut c_void,
) -> i32 {
    let r = catch_unwind(AssertUnwindSafe(|| -> Result<P> {
        let mut b = HostBoot::new(boot)?;
        P::open(&mut b)
    }));
    match r {
        Ok(Ok(p)) => {
            *out = Box::into_raw(Box::new(Instance {
                p,
                err: CString::default(),
            })) as *mut c_void;
            WEFT_OK
        }
        Ok(Err(e)) => {
            set_last(&e.to_string());
            code(&e)
        }
        Err(p) => {
            set_last(&panic_text(p));
            WEFT_EFAIL
        }
    }
}

/// `close` of provider `P`: closes and frees the instance.
///
/// # Safety
/// `h` from `open`, not used afterwards.
pub unsafe extern "C" fn close<P: StaticProvider>(h: *mut c_void) -> i32 {
    let r = with::<P, _>(h, |p| p.close().map(|_| WEFT_OK));
    if !h.is_null() {
        let inst = Box::from_raw(h as *mut Instance<P>);
        if r != WEFT_OK {
            set_last(&inst.err.to_string_lossy());
        }
        drop(inst);
    }
    r
}

/// `am_send` of provider `P`.
///
/// # Safety
/// Valid handle and buffers for the call.
pub unsafe extern "C" fn am_send<P: StaticProvider>(
    h: *mut c_void,
    dest: u32,
    hdr: *const u8,
    hdr_len: usize,
    iov: *const WeftIov,
    iovcnt: usize,
) -> i32 {
    with::<P, _>(h, |p| {
        let header = if hdr_len == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(hdr, hdr_len)
        };
        let pieces = if iovcnt == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(iov, iovcnt)
        };
        let outcome = if pieces.iter().all(|v| !v.base.is_null()) {
            // SAFETY: `IoSlice` is ABI-compatible with `struct iovec` on Unix (std's
            // documented guarantee) and so with `WeftIov` (checked at compile time above); every base is non-null
            // and valid for its length during the call (the host's contract), which is what an
            // `IoSlice` needs.
            let io = std::slice::from_raw_parts(pieces.as_ptr() as *const IoSlice<'_>, iovcnt);
            p.am_send(dest, header, io)?
        } else {
            // A host that passes null bases (with zero lengths): rebuild the slices.
            let io: smallvec::SmallVec<[IoSlice<'_>; 8]> = pieces
                .iter()
                .map(|v| {
                    IoSlice::new(if v.base.is_null() {
                        &[][..]
                    } else {
                        std::slice::from_raw_parts(v.base, v.len)
                    })
                })
                .collect();
            p.am_send(dest, header, &io)?
        };
        Ok(match outcome {
            SendOutcome::Sent => WEFT_OK,
            SendOutcome::Busy => WEFT_BUSY,
        })
    })
}

/// `progress` of provider `P`.
///
/// # Safety
/// Valid handle, sink and out-pointer for the call.
pub unsafe extern "C" fn progress<P: StaticProvider>(
    h: *mut c_void,
    sink: *const WeftSink,
    events: *mut usize,
) -> i32 {
    with::<P, _>(h, |p| {
        let mut s = HostSink(sink);
        let n = p.progress(&mut s)?;
        if !events.is_null() {
            *events = n;
        }
        Ok(WEFT_OK)
    })
}

/// `last_error` of provider `P`.
///
/// # Safety
/// `h` null or from `open`.
pub unsafe extern "C" fn last_error<P: StaticProvider>(h: *mut c_void) -> *const c_char {
    if h.is_null() {
        return LAST.with(|l| l.borrow().as_ptr());
    }
    (*(h as *const Instance<P>)).err.as_ptr()
}

/// Optional groups: forwarded to the provider's trait methods (which report `Unsupported`
/// unless implemented); the host only calls them when the caps say so.
///
/// # Safety
/// As for the other exported functions.
pub unsafe extern "C" fn rma_reg<P: StaticProvider>(
    h: *mut c_void,
    base: *mut u8,
    len: usize,
    access: u32,
    mr: *mut WeftMr,
) -> i32 {
    with::<P, _>(h, |p| {
        let a = Access {
            local_write: access & 8 != 0,
            remote_read: access & 1 != 0,
            remote_write: access & 2 != 0,
            remote_atomic: access & 4 != 0,
            shared: false,
        };
        let m = p.mr_register(base, len, a)?;
        *mr = WeftMr {
            key: m.key,
            addr: m.addr,
            len: m.len as u64,
            handle: m.handle,
            desc: m.desc,
        };
        Ok(WEFT_OK)
    })
}

/// # Safety
/// As for the other exported functions.
pub unsafe extern "C" fn rma_dereg<P: StaticProvider>(h: *mut c_void, mr: *const WeftMr) -> i32 {
    with::<P, _>(h, |p| {
        let m = &*mr;
        p.mr_deregister(&crate::provider::MemRegion {
            key: m.key,
            addr: m.addr,
            len: m.len as usize,
            handle: m.handle,
            desc: m.desc,
        })?;
        Ok(WEFT_OK)
    })
}

/// # Safety
/// As for the other exported functions.
pub unsafe extern "C" fn rma_read<P: StaticProvider>(
    h: *mut c_void,
    src: u32,
    local: *const WeftIovMut,
    cnt: usize,
    addr: u64,
    key: u64,
    token: u64,
    cntr: u64,
) -> i32 {
    // The 1.0 entry is the 1.1 one without descriptors or flags.
    ext_read::<P>(
        h,
        src,
        local,
        std::ptr::null(),
        cnt,
        addr,
        key,
        token,
        cntr,
        0,
    )
}

/// # Safety
/// As for the other exported functions.
pub unsafe extern "C" fn rma_write<P: StaticProvider>(
    h: *mut c_void,
    dest: u32,
    local: *const WeftIov,
    cnt: usize,
    addr: u64,
    key: u64,
    token: u64,
    cntr: u64,
) -> i32 {
    ext_write::<P>(
        h,
        dest,
        local,
        std::ptr::null(),
        cnt,
        addr,
        key,
        token,
        cntr,
        0,
    )
}

/// # Safety
/// As for the other exported functions.
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn atomic<P: StaticProvider>(
    h: *mut c_void,
    dest: u32,
    op: u32,
    ty: u32,
    count: usize,
    origin: *const u8,
    compare: *const u8,
    result: *mut u8,
    addr: u64,
    key: u64,
    token: u64,
    cntr: u64,
) -> i32 {
    ext_atomic::<P>(
        h,
        dest,
        op,
        ty,
        count,
        origin,
        compare,
        result,
        std::ptr::null(),
        addr,
        key,
        token,
        cntr,
        0,
    )
}

/// The ABI's (token, counter) pair, 0 meaning "none", as a [`Completion`].
fn completion(token: u64, cntr: u64) -> Completion {
    Completion {
        cq: (token != 0).then_some(token),
        cntr: (cntr != 0).then_some(cntr),
        fence: false,
    }
}

/// # Safety
/// As for the other exported functions; `out` is valid for a write.
pub unsafe extern "C" fn cntr_open<P: StaticProvider>(h: *mut c_void, out: *mut u64) -> i32 {
    with::<P, _>(h, |p| {
        let c = p.cntr_open()?;
        *out = c;
        Ok(WEFT_OK)
    })
}

/// # Safety
/// As for the other exported functions; `ok` and `err` are valid for writes.
pub unsafe extern "C" fn cntr_read<P: StaticProvider>(
    h: *mut c_void,
    cntr: u64,
    ok: *mut u64,
    err: *mut u64,
) -> i32 {
    with::<P, _>(h, |p| {
        let v = p.cntr_read(cntr)?;
        *ok = v.ok;
        *err = v.err;
        Ok(WEFT_OK)
    })
}

/// # Safety
/// As for the other exported functions.
pub unsafe extern "C" fn cntr_close<P: StaticProvider>(h: *mut c_void, cntr: u64) -> i32 {
    with::<P, _>(h, |p| {
        p.cntr_close(cntr)?;
        Ok(WEFT_OK)
    })
}

/// The counters table of `P`.
pub const fn cntr_ops<P: StaticProvider>() -> WeftCntrOps {
    WeftCntrOps {
        size: std::mem::size_of::<WeftCntrOps>() as u32,
        reserved: 0,
        open: Some(cntr_open::<P>),
        read: Some(cntr_read::<P>),
        close: Some(cntr_close::<P>),
    }
}

/// The active-message table of `P`.
pub const fn am_ops<P: StaticProvider>() -> WeftAmOps {
    WeftAmOps {
        size: std::mem::size_of::<WeftAmOps>() as u32,
        reserved: 0,
        probe: Some(probe::<P>),
        caps: Some(caps::<P>),
        open: Some(open::<P>),
        close: Some(close::<P>),
        am_send: Some(am_send::<P>),
        progress: Some(progress::<P>),
        last_error: Some(last_error::<P>),
    }
}

/// The RMA table of `P`.
pub const fn rma_ops<P: StaticProvider>() -> WeftRmaOps {
    WeftRmaOps {
        size: std::mem::size_of::<WeftRmaOps>() as u32,
        reserved: 0,
        reg: Some(rma_reg::<P>),
        dereg: Some(rma_dereg::<P>),
        read: Some(rma_read::<P>),
        write: Some(rma_write::<P>),
    }
}

/// The atomics table of `P`.
pub const fn atomic_ops<P: StaticProvider>() -> WeftAtomicOps {
    WeftAtomicOps {
        size: std::mem::size_of::<WeftAtomicOps>() as u32,
        reserved: 0,
        atomic: Some(atomic::<P>),
    }
}

mod ext;
mod host;
pub use ext::*;
use host::{HostBoot, HostSink};

#[doc(hidden)]
pub use weft_abi as __abi;

/// Export a provider from a `cdylib`: `export_provider!(Type, name = "x", priority = N,
/// summary = "...")`. The library must be installed as `libweft-<name>.so`.
#[macro_export]
macro_rules! export_provider {
    ($ty:ty, name = $name:literal, priority = $prio:expr, summary = $summary:literal) => {
        static __WEFT_AM: $crate::sdk::__abi::WeftAmOps = $crate::sdk::am_ops::<$ty>();
        static __WEFT_RMA: $crate::sdk::__abi::WeftRmaOps = $crate::sdk::rma_ops::<$ty>();
        static __WEFT_ATOMICS: $crate::sdk::__abi::WeftAtomicOps = $crate::sdk::atomic_ops::<$ty>();
        static __WEFT_CNTR: $crate::sdk::__abi::WeftCntrOps = $crate::sdk::cntr_ops::<$ty>();
        static __WEFT_EXT: $crate::sdk::__abi::WeftExtOps = $crate::sdk::ext_ops::<$ty>();
        static __WEFT_ENTRY: $crate::sdk::__abi::WeftEntry = $crate::sdk::__abi::WeftEntry {
            abi_version: $crate::sdk::__abi::WEFT_ABI_VERSION,
            size: ::std::mem::size_of::<$crate::sdk::__abi::WeftEntry>() as u32,
            name: concat!($name, "\0").as_ptr() as *const ::std::ffi::c_char,
            version: concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const ::std::ffi::c_char,
            summary: concat!($summary, "\0").as_ptr() as *const ::std::ffi::c_char,
            priority: $prio,
            reserved: 0,
            am: &__WEFT_AM,
            tagged: ::std::ptr::null(),
            rma: &__WEFT_RMA,
            atomics: &__WEFT_ATOMICS,
            cntr: &__WEFT_CNTR,
            ext: &__WEFT_EXT,
        };
        /// The provider's entry point (weft provider ABI 1.1).
        #[no_mangle]
        pub extern "C" fn weft_provider_entry() -> *const $crate::sdk::__abi::WeftEntry {
            &__WEFT_ENTRY
        }
    };
}
