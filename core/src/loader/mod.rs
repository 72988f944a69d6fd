//! Loading provider libraries: every `libweft-<name>.so` in the directories of
//! `WEFT_PROVIDER_PATH` is opened with `libloading`, and its `weft_provider_entry` table is
//! checked before anything else is called: ABI major equal, minor not newer than ours, every
//! table at least as large as its ABI version's, every mandatory function present, the name matching
//! the file. A library that fails a check is reported (with the file and the reason) and
//! skipped; it never takes the process down.

use crate::bootstrap::{Bootstrap, KvSpace};
use crate::provider::{
    Access, Caps, CntrId, CntrValue, Completed, Completion, MemRegion, ProbeContext, Provider,
    RawIov, RawIovMut, RemoteAddr, RmaCaps, SendOutcome, Sink, TaggedStatus, Token,
};
use crate::provider::{CompletionLevel, ConnEvent, PeerCaps};
use crate::registry::{Factory, LoadFailure, Origin};
use crate::types::{AtomicTable, BasicType, Op, Rank};
use crate::{Error, ErrorDetail, Result};
use smallvec::SmallVec;
use std::ffi::{c_char, c_void, CStr, CString};
use std::io::IoSlice;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::OnceLock;
use weft_abi::*;

mod foreign;

use foreign::Foreign;

crate::param!(PROVIDER_PATH: Str = "", "PROVIDER_PATH", "",
    "directories (':'-separated) searched for provider libraries named libweft-<name>.so");

/// Providers loaded from `WEFT_PROVIDER_PATH` (once per process; libraries stay loaded).
pub(crate) fn loaded() -> &'static (Vec<&'static dyn Factory>, Vec<LoadFailure>) {
    static L: OnceLock<(Vec<&'static dyn Factory>, Vec<LoadFailure>)> = OnceLock::new();
    L.get_or_init(|| {
        let mut ok: Vec<&'static dyn Factory> = Vec::new();
        let mut bad = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for dir in std::env::split_paths(&PROVIDER_PATH.raw()) {
            if dir.as_os_str().is_empty() {
                continue;
            }
            // A directory named twice (or through two spellings) is scanned once.
            if !seen.insert(std::fs::canonicalize(&dir).unwrap_or_else(|_| dir.clone())) {
                continue;
            }
            let entries = match std::fs::read_dir(&dir) {
                Ok(e) => e,
                Err(e) => {
                    bad.push(LoadFailure {
                        path: dir.clone(),
                        error: format!("cannot read the directory: {e}"),
                    });
                    continue;
                }
            };
            let mut files: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
            files.sort();
            for f in files {
                let Some(name) = provider_name(&f) else {
                    continue;
                };
                match load(&f, &name) {
                    Ok(l) => ok.push(Box::leak(Box::new(l))),
                    Err(e) => bad.push(LoadFailure {
                        path: f,
                        error: e.to_string(),
                    }),
                }
            }
        }
        (ok, bad)
    })
}

/// `libweft-<name>.so` -> `name`.
fn provider_name(p: &Path) -> Option<String> {
    let f = p.file_name()?.to_str()?;
    let n = f.strip_prefix("libweft-")?.strip_suffix(".so")?;
    (!n.is_empty()).then(|| n.to_string())
}

fn fail(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::from(ErrorDetail::LoadFailed {
        file: path.display().to_string(),
        what: what.to_string(),
    })
}

/// # Safety (internal)
/// `p` must be null or a NUL-terminated string that stays valid (static in the library).
unsafe fn cstr(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    CStr::from_ptr(p).to_str().ok().map(str::to_string)
}

/// Open a library and validate its entry table.
pub fn load(path: &Path, expected_name: &str) -> Result<LoadedProvider> {
    // SAFETY: loading a shared library runs its initialisers; that is the contract of a
    // provider library placed in WEFT_PROVIDER_PATH. Failures are errors, not crashes.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| fail(path, e))?;
    // SAFETY: the symbol's type is fixed by the ABI (WeftEntryFn).
    let f: libloading::Symbol<'_, WeftEntryFn> = unsafe {
        lib.get(b"weft_provider_entry\0")
            .map_err(|_| fail(path, "no weft_provider_entry symbol"))?
    };
    // SAFETY: calling the provider's entry function, which returns a pointer to static data.
    let entry = unsafe { f() };
    // SAFETY: the entry of a library that stays loaded (forgotten below on success).
    let r = unsafe { from_entry(path, expected_name, entry) };
    if r.is_ok() {
        // The library stays loaded for the rest of the process: instances keep pointers into it.
        std::mem::forget(lib);
    }
    r
}

/// The checks of [`load`] on an entry table already in memory (the library's, or, in tests, a
/// table built with the SDK in this process).
///
/// # Safety
/// `entry` is null or points at an entry whose tables and strings live for the rest of the
/// process.
#[doc(hidden)]
pub unsafe fn from_entry(
    path: &Path,
    expected_name: &str,
    entry: *const WeftEntry,
) -> Result<LoadedProvider> {
    if entry.is_null() {
        return Err(fail(path, "weft_provider_entry returned null"));
    }
    // SAFETY: non-null pointer to the library's static entry; the first two fields are the
    // same in every ABI version, so we read them before trusting the rest.
    let (ver, size) = unsafe { ((*entry).abi_version, (*entry).size) };
    let (major, minor) = (ver >> 16, ver & 0xffff);
    if major != WEFT_ABI_MAJOR {
        return Err(Error::from(ErrorDetail::AbiMismatch {
            file: path.display().to_string(),
            found: format!("{major}.{minor}"),
            expected: format!("{WEFT_ABI_MAJOR}.{WEFT_ABI_MINOR}"),
        }));
    }
    if minor > WEFT_ABI_MINOR {
        return Err(Error::from(ErrorDetail::AbiMismatch {
            file: path.display().to_string(),
            found: format!("{major}.{minor} (newer than this weft)"),
            expected: format!("{WEFT_ABI_MAJOR}.{WEFT_ABI_MINOR}"),
        }));
    }
    // ABI 1.0's entry ends before `ext`; 1.1 libraries must have it.
    let size_1_0 = std::mem::offset_of!(WeftEntry, ext);
    let needed = if minor >= 1 {
        std::mem::size_of::<WeftEntry>()
    } else {
        size_1_0
    };
    if (size as usize) < needed {
        return Err(fail(
            path,
            if minor >= 1 {
                format!(
                    "entry table of {size} bytes is smaller than ABI 1.{minor}'s {needed} \
                     bytes (1.0's is {size_1_0})"
                )
            } else {
                format!("entry table of {size} bytes is smaller than ABI 1.0's {needed} bytes")
            },
        ));
    }
    // SAFETY: the table holds at least every field up to `ext` (checked); `ext` itself is read
    // only below, for 1.1 libraries whose table was checked to contain it.
    let e: &'static WeftEntry = unsafe { &*entry };
    // SAFETY: strings in the entry are static NUL-terminated data of the library.
    let name = unsafe { cstr(e.name) }.ok_or_else(|| fail(path, "the entry has no name"))?;
    if name != expected_name {
        return Err(fail(
            path,
            format!("the library calls itself '{name}', but its file name says '{expected_name}'"),
        ));
    }
    if e.am.is_null() {
        return Err(fail(path, "the mandatory active-message table is missing"));
    }
    // SAFETY: non-null pointer to the library's static table; its size is checked next.
    let am = unsafe { &*e.am };
    if (am.size as usize) < std::mem::size_of::<WeftAmOps>() {
        return Err(fail(
            path,
            format!("active-message table of {} bytes is too small", am.size),
        ));
    }
    let missing: Vec<&str> = [
        ("probe", am.probe.is_none()),
        ("caps", am.caps.is_none()),
        ("open", am.open.is_none()),
        ("close", am.close.is_none()),
        ("am_send", am.am_send.is_none()),
        ("progress", am.progress.is_none()),
        ("last_error", am.last_error.is_none()),
    ]
    .iter()
    .filter(|(_, m)| *m)
    .map(|(n, _)| *n)
    .collect();
    if !missing.is_empty() {
        return Err(fail(
            path,
            format!("mandatory functions missing: {}", missing.join(", ")),
        ));
    }
    macro_rules! optional {
        ($ptr:expr, $ty:ty, $what:expr, [$($f:ident),*]) => {{
            if $ptr.is_null() {
                None
            } else {
                // SAFETY: non-null pointer to a static table of the library.
                let t: &'static $ty = unsafe { &*$ptr };
                if (t.size as usize) < std::mem::size_of::<$ty>() {
                    return Err(fail(path, format!("{} table of {} bytes is too small", $what, t.size)));
                }
                $(if t.$f.is_none() {
                    return Err(fail(path, format!("{} table lacks {}", $what, stringify!($f))));
                })*
                Some(t)
            }
        }};
    }
    let tagged = optional!(
        e.tagged,
        WeftTaggedOps,
        "tagged",
        [send, recv, probe, cancel]
    );
    let rma = optional!(e.rma, WeftRmaOps, "RMA", [reg, dereg, read, write]);
    let atomics = optional!(e.atomics, WeftAtomicOps, "atomics", [atomic]);
    let cntr = optional!(e.cntr, WeftCntrOps, "counters", [open, read, close]);
    let ext = if minor >= 1 {
        // The 1.1 entries are each optional within the table: a null one is "not supported".
        optional!(e.ext, WeftExtOps, "extension (ABI 1.1)", [])
    } else {
        None
    };
    Ok(LoadedProvider {
        path: path.to_path_buf(),
        // SAFETY: static strings of the library (which stays loaded).
        version: unsafe { cstr(e.version) }.unwrap_or_default(),
        summary: unsafe { cstr(e.summary) }.unwrap_or_default(),
        priority: e.priority,
        name,
        am,
        tagged,
        rma,
        atomics,
        cntr,
        ext,
        minor,
    })
}

/// A provider library that passed the checks.
pub struct LoadedProvider {
    path: PathBuf,
    name: String,
    version: String,
    summary: String,
    priority: i32,
    am: &'static WeftAmOps,
    tagged: Option<&'static WeftTaggedOps>,
    rma: Option<&'static WeftRmaOps>,
    atomics: Option<&'static WeftAtomicOps>,
    cntr: Option<&'static WeftCntrOps>,
    /// ABI 1.1 entries (libraries of minor 1 or later).
    ext: Option<&'static WeftExtOps>,
    /// The library's ABI minor version: 1.1 fields are read and passed only from 1.
    minor: u32,
}

fn caps_from(c: &WeftCaps, l: &LoadedProvider) -> Caps {
    let f = c.flags;
    let mut caps = Caps::am_only(
        c.max_am_header as usize,
        c.max_am_payload as usize,
        c.max_iov.max(1) as usize,
    );
    caps.eager_limit = (c.eager_limit as usize).min(caps.max_am_payload);
    caps.tagged = f & WEFT_CAP_TAGGED != 0 && l.tagged.is_some();
    let read = f & WEFT_CAP_RMA_READ != 0;
    let write = f & WEFT_CAP_RMA_WRITE != 0;
    if l.rma.is_some() && (read || write) {
        caps.rma = Some(RmaCaps {
            read,
            write,
            max_iov: c.rma_max_iov.max(1) as usize,
            scalable_keys: false,
            alloc: false,
            native_locks: false,
            user_memory: true,
            // ABI 1.0 promised what the core always assumed: delivery completion.
            ..RmaCaps::default()
        });
    }
    if l.atomics.is_some() {
        let mut t = AtomicTable::from_masks(c.atomics);
        // Only valid pairs count.
        for op in Op::ALL {
            for ty in BasicType::ALL {
                if !op.valid_for(ty) {
                    t.set(op, ty, false);
                }
            }
        }
        caps.atomics = t;
    }
    caps.counters = f & WEFT_CAP_COUNTERS != 0 && l.cntr.is_some();
    caps.spans_processes = f & WEFT_CAP_SPANS_PROCESSES != 0;
    caps.spans_hosts = f & WEFT_CAP_SPANS_HOSTS != 0;
    if l.minor >= 1 {
        // ABI 1.1: contract 2, where the library has the entries each bit needs.
        let ext = l.ext;
        let has = |f: fn(&WeftExtOps) -> bool| ext.is_some_and(f);
        caps.mr_local = f & WEFT_CAP_MR_LOCAL != 0 && has(|x| x.read.is_some());
        caps.mr_pins = f & WEFT_CAP_MR_PINS != 0;
        caps.am_isend = f & WEFT_CAP_AM_ISEND != 0 && has(|x| x.am_isend.is_some());
        caps.inject_size = if caps.am_isend {
            c.inject_size as usize
        } else {
            0
        };
        caps.lazy_connect = f & WEFT_CAP_LAZY_CONNECT != 0 && has(|x| x.connect.is_some());
        caps.per_peer = f & WEFT_CAP_PER_PEER != 0 && has(|x| x.peer_caps.is_some());
        caps.atomic_max_count = c.atomic_max_count as usize;
        if let Some(r) = caps.rma.as_mut() {
            if f & WEFT_CAP_RMA_TRANSMIT != 0 {
                r.completion = CompletionLevel::Transmit;
            }
            r.fence = f & WEFT_CAP_RMA_FENCE != 0 && has(|x| x.read.is_some() && x.write.is_some());
            r.cq_data_size = if has(|x| x.write_data.is_some()) {
                c.cq_data_size.min(8) as usize
            } else {
                0
            };
        }
    }
    caps
}

/// The provider's description of its last failure.
fn error_text(am: &WeftAmOps, handle: *mut c_void, code: i32) -> String {
    // SAFETY: last_error returns null or a NUL-terminated string owned by the provider.
    let msg = unsafe { (am.last_error.expect("checked at load"))(handle) };
    // SAFETY: as above.
    unsafe { cstr(msg) }.unwrap_or_else(|| format!("error code {code}"))
}

impl LoadedProvider {
    fn error_text(&self, handle: *mut c_void, code: i32) -> String {
        error_text(self.am, handle, code)
    }

    fn raw_caps(&self) -> Result<WeftCaps> {
        let mut c = WeftCaps {
            size: std::mem::size_of::<WeftCaps>() as u32,
            max_am_header: 0,
            max_am_payload: 0,
            eager_limit: 0,
            max_iov: 0,
            flags: 0,
            rma_max_iov: 0,
            reserved: 0,
            atomics: [0; 13],
            reserved2: 0,
            inject_size: 0,
            cq_data_size: 0,
            atomic_max_count: 0,
        };
        // SAFETY: valid pointer to a caps struct of the size we announce.
        let r = unsafe { (self.am.caps.expect("checked at load"))(&mut c) };
        if r != WEFT_OK {
            return Err(Error::from(ErrorDetail::ProviderUnavailable {
                requested: self.name.clone(),
                details: self.error_text(std::ptr::null_mut(), r),
            }));
        }
        Ok(c)
    }
}

impl Factory for LoadedProvider {
    fn name(&self) -> &str {
        &self.name
    }
    fn version(&self) -> &str {
        &self.version
    }
    fn priority(&self) -> i32 {
        self.priority
    }
    fn summary(&self) -> &str {
        &self.summary
    }
    fn origin(&self) -> Origin {
        Origin::Library(self.path.clone())
    }
    fn caps(&self) -> Result<Caps> {
        Ok(caps_from(&self.raw_caps()?, self))
    }
    fn probe(&self, ctx: &ProbeContext) -> std::result::Result<(), String> {
        let c = WeftProbeCtx {
            size: std::mem::size_of::<WeftProbeCtx>() as u32,
            rank: ctx.rank,
            nranks: ctx.size,
            in_process: ctx.in_process as u32,
            hosts: ctx.hosts,
            local_ranks: ctx.local_ranks,
        };
        let mut why = vec![0 as c_char; 512];
        // SAFETY: valid context and buffer of the announced length.
        let r =
            unsafe { (self.am.probe.expect("checked at load"))(&c, why.as_mut_ptr(), why.len()) };
        if r == WEFT_OK {
            return Ok(());
        }
        *why.last_mut().expect("non-empty") = 0;
        // SAFETY: NUL-terminated (forced above).
        let s = unsafe { CStr::from_ptr(why.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        Err(if s.is_empty() {
            format!("probe failed ({r})")
        } else {
            s
        })
    }
    fn open(&self, boot: &mut dyn Bootstrap) -> Result<crate::DynProvider> {
        let caps = self.caps()?;
        let job = CString::new(boot.job_id()).map_err(|_| Error::invalid("job id has a NUL"))?;
        let (rank, size) = (boot.rank(), boot.size());
        let kv: Option<Box<Arc<dyn KvSpace>>> = if self.minor >= 1 {
            boot.kv().map(Box::new)
        } else {
            None
        };
        let kv_ctx = kv.as_ref().map_or(std::ptr::null_mut(), |k| {
            &**k as *const Arc<dyn KvSpace> as *mut c_void
        });
        let mut ctx = BootCtx { boot };
        let b = WeftBoot {
            size: std::mem::size_of::<WeftBoot>() as u32,
            rank,
            nranks: size,
            reserved: 0,
            job_id: job.as_ptr(),
            ctx: &mut ctx as *mut BootCtx<'_> as *mut c_void,
            put: Some(boot_put),
            fence: Some(boot_fence),
            get: Some(boot_get),
            host_of: Some(boot_host_of),
            kv_ctx,
            kv_put: kv.as_ref().map(|_| kv_put as _),
            kv_get: kv.as_ref().map(|_| kv_get as _),
        };
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: `b` and `ctx` outlive the call; `handle` receives the instance.
        let r = unsafe { (self.am.open.expect("checked at load"))(&b, &mut handle) };
        if r != WEFT_OK || handle.is_null() {
            return Err(Error::from(ErrorDetail::ProviderUnavailable {
                requested: self.name.clone(),
                details: format!("open failed: {}", self.error_text(std::ptr::null_mut(), r)),
            }));
        }
        Ok(Box::new(Foreign {
            name: self.name.clone(),
            am: self.am,
            tagged: self.tagged,
            rma: self.rma,
            atomics: self.atomics,
            cntr: self.cntr,
            ext: self.ext,
            minor: self.minor,
            kv,
            handle,
            caps,
            rank,
            size,
            closed: false,
        }))
    }
}

struct BootCtx<'a> {
    boot: &'a mut dyn Bootstrap,
}

unsafe extern "C" fn boot_put(ctx: *mut c_void, key: *const c_char, value: *const c_char) -> i32 {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: ctx is the BootCtx we passed to open, alive during open.
        let c = &mut *(ctx as *mut BootCtx<'_>);
        let (Some(k), Some(v)) = (cstr(key), cstr(value)) else {
            return WEFT_EINVAL;
        };
        match c.boot.put(&k, &v) {
            Ok(()) => WEFT_OK,
            Err(_) => WEFT_EFAIL,
        }
    }));
    r.unwrap_or(WEFT_EFAIL)
}

unsafe extern "C" fn boot_fence(ctx: *mut c_void) -> i32 {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: see boot_put.
        let c = &mut *(ctx as *mut BootCtx<'_>);
        match c.boot.fence() {
            Ok(()) => WEFT_OK,
            Err(_) => WEFT_EFAIL,
        }
    }));
    r.unwrap_or(WEFT_EFAIL)
}

unsafe extern "C" fn boot_get(
    ctx: *mut c_void,
    key: *const c_char,
    buf: *mut c_char,
    buflen: usize,
    needed: *mut usize,
) -> i32 {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: see boot_put.
        let c = &mut *(ctx as *mut BootCtx<'_>);
        let Some(k) = cstr(key) else {
            return WEFT_EINVAL;
        };
        let v = match c.boot.get(&k) {
            Ok(v) => v,
            Err(_) => return WEFT_EFAIL,
        };
        if !needed.is_null() {
            *needed = v.len() + 1;
        }
        if buf.is_null() || buflen < v.len() + 1 {
            return WEFT_EINVAL;
        }
        // SAFETY: `buf` holds `buflen >= len + 1` bytes (checked).
        std::ptr::copy_nonoverlapping(v.as_ptr() as *const c_char, buf, v.len());
        *buf.add(v.len()) = 0;
        WEFT_OK
    }));
    r.unwrap_or(WEFT_EFAIL)
}

unsafe extern "C" fn boot_host_of(ctx: *mut c_void, rank: u32) -> u32 {
    // SAFETY: see boot_put.
    let c = &*(ctx as *const BootCtx<'_>);
    c.boot
        .nodes()
        .host_of
        .get(rank as usize)
        .copied()
        .unwrap_or(0)
}

/// `WeftBoot::kv_put`: `ctx` is the `Arc<dyn KvSpace>` the instance keeps until it is closed.
unsafe extern "C" fn kv_put(ctx: *mut c_void, key: *const c_char, value: *const c_char) -> i32 {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: ctx points at the boxed handle `Foreign::kv` owns until close.
        let kv = &*(ctx as *const Arc<dyn KvSpace>);
        let (Some(k), Some(v)) = (cstr(key), cstr(value)) else {
            return WEFT_EINVAL;
        };
        match kv.put(&k, &v) {
            Ok(()) => WEFT_OK,
            Err(_) => WEFT_EFAIL,
        }
    }));
    r.unwrap_or(WEFT_EFAIL)
}

/// `WeftBoot::kv_get`: as `boot_get`, with `*needed` = 0 for a key not (yet) published.
unsafe extern "C" fn kv_get(
    ctx: *mut c_void,
    key: *const c_char,
    buf: *mut c_char,
    buflen: usize,
    needed: *mut usize,
) -> i32 {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: see kv_put.
        let kv = &*(ctx as *const Arc<dyn KvSpace>);
        let Some(k) = cstr(key) else {
            return WEFT_EINVAL;
        };
        let v = match kv.get(&k) {
            Ok(Some(v)) => v,
            Ok(None) => {
                if !needed.is_null() {
                    *needed = 0;
                }
                return WEFT_OK;
            }
            Err(_) => return WEFT_EFAIL,
        };
        if !needed.is_null() {
            *needed = v.len() + 1;
        }
        if buf.is_null() || buflen < v.len() + 1 {
            return WEFT_EINVAL;
        }
        // SAFETY: `buf` holds `buflen >= len + 1` bytes (checked).
        std::ptr::copy_nonoverlapping(v.as_ptr() as *const c_char, buf, v.len());
        *buf.add(v.len()) = 0;
        WEFT_OK
    }));
    r.unwrap_or(WEFT_EFAIL)
}
