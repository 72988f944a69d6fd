//! `weft-fi`: weft as a libfabric provider.
//!
//! libfabric loads `libweft-fi.so` from `FI_PROVIDER_PATH` and calls [`fi_prov_ini`]; the
//! provider is named `weft` and offers one `fi_info` per weft provider usable here, the domain
//! named after it (`shm`, `tcp-sim`, `verbs-rc`, `hybrid`, ...). Its endpoints are reliable
//! datagram (`FI_EP_RDM`) with `FI_MSG` and `FI_TAGGED` (64-bit tags, any ignore mask, remote
//! CQ data, `FI_PEEK`/`FI_CLAIM`/`FI_DISCARD`), `FI_RMA` and `FI_ATOMIC` with counters: a
//! process finds its job through weft's
//! bootstrap when it opens a domain (`weft run`, Hydra, Open MPI's `mpirun`, `srun`) and
//! meets it at its first `fi_av_insert`; its libfabric names identify it within that job.
//!
//! * [`info`]: the `fi_info` lists, matched against hints (what weft cannot meet is
//!   `-FI_ENODATA`), allocated with `calloc`/`strdup` because `fi_freeinfo` frees them.
//! * [`obj`]: fabric, domain, endpoint, completion queue, address vector, event queue and
//!   memory region objects, each a `#[repr(C)]` struct that begins with libfabric's `fid_*`
//!   and carries its own operation tables.
//! * [`data`]: the data-path entry points (`fi_send`, `fi_tsenddata`, `fi_trecvmsg`, ...).
//! * [`matching`]: libfabric's matching rules and the header weft-fi's messages carry over
//!   weft (why weft-fi matches itself rather than through the core: that module's doc).
//! * [`state`]: the process's weft world, the queues and the operations in flight, behind one
//!   lock (the provider is `FI_THREAD_SAFE`).
//! * [`rma`], [`remote`], [`oneside`], [`cntr`]: RMA and atomics over weft messages (why
//!   weft-fi carries them itself: [`rma`]'s doc), both ends, their entry points, counters.
//!
//! Every entry point runs inside [`guard`]: a Rust panic becomes `-FI_EOTHER`, never an
//! unwind into C.

use std::os::raw::{c_char, c_int, c_void};
use weft_ofi_sys as fi;

// The weft providers a libfabric program may use (not ofi: weft over libfabric over weft).
use weft_hybrid as _;
use weft_limic as _;
use weft_shm as _;
use weft_tcp_sim as _;
use weft_verbs_rc as _;
use weft_verbs_ud as _;

pub mod cntr;
pub mod data;
pub mod info;
pub mod matching;
pub mod obj;
pub mod oneside;
pub mod remote;
pub mod rma;
pub mod state;

/// The libfabric API version weft-fi implements (libfabric skips a provider below the version
/// a program asks for; fi_info and fi_pingpong ask for their own, 1.17 on Debian 12).
pub const API_VERSION: u32 = fi::fi_version(1, 17);
/// weft-fi's own version.
pub const PROV_VERSION: u32 = fi::fi_version(0, 1);
/// The provider's and the fabric's name.
pub const NAME: &std::ffi::CStr = c"weft";

/// libfabric's view of this provider. It writes its own bookkeeping into `context`, so the
/// struct lives in writable memory.
struct ProviderCell(std::cell::UnsafeCell<fi::fi_provider>);

// SAFETY: libfabric reads the struct and writes `context` under its own initialisation lock;
// weft-fi never touches it after building it.
unsafe impl Sync for ProviderCell {}

static PROVIDER: ProviderCell = ProviderCell(std::cell::UnsafeCell::new(fi::fi_provider {
    version: PROV_VERSION,
    fi_version: API_VERSION,
    context: fi::fi_context {
        internal: [std::ptr::null_mut(); 4],
    },
    name: NAME.as_ptr(),
    getinfo: Some(info::getinfo),
    fabric: Some(obj::fabric_open),
    cleanup: Some(cleanup),
}));

/// libfabric's entry point for a provider loaded from `FI_PROVIDER_PATH`.
#[no_mangle]
pub extern "C" fn fi_prov_ini() -> *mut fi::fi_provider {
    PROVIDER.0.get()
}

unsafe extern "C" fn cleanup() {
    guard((), state::shutdown);
}

/// Run `f`, turning a panic into `fail`: no unwind may cross into C.
pub(crate) fn guard<T>(fail: T, f: impl FnOnce() -> T) -> T {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(fail)
}

/// A negative libfabric error code as the `int` entry points return it.
pub(crate) const fn err(code: u64) -> c_int {
    -(code as c_int)
}

/// The same as the `ssize_t` the data-path entry points return.
pub(crate) const fn serr(code: u64) -> isize {
    -(code as isize)
}

/// A C string or "" for null.
///
/// # Safety
/// `p` is null or a NUL-terminated string that outlives the result's use.
pub(crate) unsafe fn cstr<'a>(p: *const c_char) -> &'a str {
    if p.is_null() {
        ""
    } else {
        // SAFETY: per the contract above.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_str()
            .unwrap_or("")
    }
}

/// `strdup` of `s` (libfabric frees these strings with `free`).
pub(crate) fn strdup(s: &str) -> *mut c_char {
    let c = std::ffi::CString::new(s).unwrap_or_default();
    // SAFETY: `c` is a valid NUL-terminated string.
    unsafe { libc::strdup(c.as_ptr()) }
}

/// `calloc` of one `T` (libfabric frees `fi_info` and its attributes with `free`); null when
/// out of memory.
pub(crate) fn calloc<T>() -> *mut T {
    // SAFETY: calloc has no preconditions; the zeroed bytes are a valid `T` for the plain C
    // structs this is used with (integers, raw pointers and `Option` of function pointers).
    unsafe { libc::calloc(1, std::mem::size_of::<T>()) as *mut T }
}

/// An unused `void *` for contexts.
pub(crate) const NULL: *mut c_void = std::ptr::null_mut();
