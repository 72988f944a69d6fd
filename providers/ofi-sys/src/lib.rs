//! libfabric for weft.
//!
//! The types and constants were generated once by bindgen from libfabric 1.17's headers
//! (Debian 12's `libfabric-dev`) and are checked in (`src/generated/libfabric.rs`; the test
//! `tests/bindings.rs` compares them with the installed headers where those exist), so
//! building weft needs neither libfabric nor libclang. Nothing is linked: the library is
//! opened at run time ([`fabric`]), so installing libfabric (`libfabric1`, or any build on
//! `LD_LIBRARY_PATH`, or the file `WEFT_OFI_LIB` names) makes the `ofi` provider available
//! with no rebuild, and a missing or older library is one line of explanation.
//!
//! libfabric keeps ABI 1 compatible across 1.x by adding fields at the ends of its structures
//! and versioning its symbols; a library older than the headers may lack fields these
//! bindings read, so [`fabric`] refuses one older than 1.17.
//!
//! Most of libfabric's API is `static inline` functions that call through the operation tables
//! of its objects (`ep->tagged->send`, `domain->ops->cq_open`); bindgen does not emit them, so
//! [`ops`] restates the ones weft uses, each one call through the table, returning `-FI_ENOSYS`
//! where a provider left the entry empty.
#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code
)]
#![allow(clippy::all)]

mod generated {
    #![allow(
        non_camel_case_types,
        non_upper_case_globals,
        non_snake_case,
        dead_code,
        clippy::all
    )]
    include!("generated/libfabric.rs");
}
pub use generated::*;

pub mod ops;

/// `FI_ADDR_UNSPEC` (a cast in the header, which bindgen does not evaluate).
pub const FI_ADDR_UNSPEC: u64 = u64::MAX;

/// `FI_VERSION(major, minor)`.
pub const fn fi_version(major: u32, minor: u32) -> u32 {
    (major << 16) | minor
}

/// The shared library's name (libfabric's ABI 1), as the dynamic loader looks for it.
pub const LIBRARY: &str = "libfabric.so.1";

/// The variable that names another library file (a path, or a name the loader resolves).
pub const LIBRARY_VAR: &str = "WEFT_OFI_LIB";

/// The oldest libfabric these bindings can drive: the version of their headers.
pub const MIN_VERSION: u32 = fi_version(FI_MAJOR_VERSION as u32, FI_MINOR_VERSION as u32);

/// `major.minor` of an `FI_VERSION` number.
pub fn version_text(v: u32) -> String {
    format!("{}.{}", v >> 16, v & 0xffff)
}

/// libfabric, opened once per process: its exported entry points, or one line saying why it
/// cannot be used (not found, too old, an entry point missing).
pub fn fabric() -> Result<&'static Fabric, String> {
    static LIB: std::sync::OnceLock<Result<Fabric, String>> = std::sync::OnceLock::new();
    LIB.get_or_init(|| open(&library_name()))
        .as_ref()
        .map_err(Clone::clone)
}

/// The library this process opens: `WEFT_OFI_LIB`, or [`LIBRARY`].
pub fn library_name() -> String {
    std::env::var(LIBRARY_VAR)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| LIBRARY.to_string())
}

/// One line: the libfabric this process opened and its version, or why there is none.
pub fn describe() -> String {
    match fabric() {
        Ok(f) => {
            // SAFETY: fi_version takes no arguments and returns the library's version.
            let v = unsafe { (f.fi_version)() };
            format!("{}, libfabric {}", library_name(), version_text(v))
        }
        Err(e) => format!("{e}; the ofi provider cannot run"),
    }
}

fn open(name: &str) -> Result<Fabric, String> {
    // SAFETY: loading libfabric runs its constructors, which only initialise its own state.
    let lib = unsafe { libloading::Library::new(name) }.map_err(|e| {
        let e = e.to_string();
        if e.contains("No such file") || e.contains("cannot open shared object") {
            format!("{name} not found (install libfabric1)")
        } else {
            format!("cannot open {name}: {e}")
        }
    })?;
    // SAFETY: fi_version is `uint32_t fi_version(void)` in every libfabric 1.x.
    let version = unsafe {
        let f = lib
            .get::<unsafe extern "C" fn() -> u32>(b"fi_version\0")
            .map_err(|e| format!("{name} is not libfabric: {e}"))?;
        f()
    };
    if version >> 16 != FI_MAJOR_VERSION as u32 {
        return Err(format!(
            "{name} is libfabric {}, not 1.x",
            version_text(version)
        ));
    }
    if version < MIN_VERSION {
        return Err(format!(
            "libfabric {} ({name}) is older than {}, the oldest weft's ofi supports",
            version_text(version),
            version_text(MIN_VERSION)
        ));
    }
    // SAFETY: each entry point is resolved by name with the prototype bindgen generated from
    // the 1.17 headers; the library is 1.x and at least 1.17, whose exported functions keep
    // those prototypes (ABI 1).
    unsafe { Fabric::from_library(lib) }
        .map_err(|e| format!("{name} lacks an entry point weft needs: {e}"))
}

/// libfabric's text for a (positive) error number.
pub fn strerror(errnum: i64) -> String {
    match fabric() {
        Ok(f) => {
            // SAFETY: fi_strerror returns a pointer to a static NUL-terminated string for any
            // number.
            let p = unsafe { (f.fi_strerror)(errnum.unsigned_abs() as i32) };
            if p.is_null() {
                format!("error {errnum}")
            } else {
                // SAFETY: non-null, NUL-terminated, static (see above).
                unsafe { std::ffi::CStr::from_ptr(p) }
                    .to_string_lossy()
                    .into_owned()
            }
        }
        Err(_) => format!("error {errnum}"),
    }
}
