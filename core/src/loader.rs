//! Loading provider libraries: every `libweft-<name>.so` in the directories of
//! `WEFT_PROVIDER_PATH` is opened with `libloading`, and its `weft_provider_entry` table is
//! checked before anything else is called: ABI major equal, minor not newer than ours, every
//! table at least as large as ABI 1.0's, every mandatory function present, the name matching
//! the file. A library that fails a check is reported (with the file and the reason) and
//! skipped; it never takes the process down.

use crate::bootstrap::Bootstrap;
use crate::provider::{
    Access, Caps, CntrId, CntrValue, Completed, Completion, MemRegion, ProbeContext, Provider,
    RawIov, RawIovMut, RemoteAddr, RmaCaps, SendOutcome, Sink, TaggedStatus, Token,
};
use crate::registry::{Factory, LoadFailure, Origin};
use crate::types::{AtomicTable, BasicType, Op, Rank};
use crate::{Error, ErrorDetail, Result};
use smallvec::SmallVec;
use std::ffi::{c_char, c_void, CStr, CString};
use std::io::IoSlice;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use weft_abi::*;

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
    if (size as usize) < std::mem::size_of::<WeftEntry>() {
        return Err(fail(
            path,
            format!(
                "entry table of {size} bytes is smaller than ABI 1.0's {}",
                std::mem::size_of::<WeftEntry>()
            ),
        ));
    }
    // SAFETY: the table is at least as large as the struct we read.
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
    // The library stays loaded for the rest of the process: instances keep pointers into it.
    std::mem::forget(lib);
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

/// An opened provider from a library (the library stays loaded for the process's life, so its
/// tables are `'static`).
struct Foreign {
    name: String,
    am: &'static WeftAmOps,
    tagged: Option<&'static WeftTaggedOps>,
    rma: Option<&'static WeftRmaOps>,
    atomics: Option<&'static WeftAtomicOps>,
    cntr: Option<&'static WeftCntrOps>,
    handle: *mut c_void,
    caps: Caps,
    rank: Rank,
    size: u32,
    closed: bool,
}

impl Foreign {
    /// The error for `code` from operation `what`, described by the instance's `last_error`.
    /// `peer`: the rank the operation was about, when it names one (a `WEFT_EPEER` or
    /// `WEFT_EACCESS` is then about that rank; otherwise it is reported as the provider's own).
    fn err(&self, code: i32, what: &str, peer: Option<Rank>) -> Error {
        let text = error_text(self.am, self.handle, code);
        code_error(&self.name, code, what, text, peer)
    }

    fn check(&self, code: i32, what: &str, peer: Option<Rank>) -> Result<()> {
        if code == WEFT_OK {
            Ok(())
        } else {
            Err(self.err(code, what, peer))
        }
    }
}

/// An error value for a library's status `code` with its description `text`.
fn code_error(name: &str, code: i32, what: &str, text: String, peer: Option<Rank>) -> Error {
    match (code, peer) {
        (WEFT_EPEER, Some(rank)) => Error::peer_failed(rank, text),
        (WEFT_EACCESS, Some(rank)) => Error::from(ErrorDetail::RemoteAccess { rank, what: text }),
        (WEFT_EINVAL, _) => Error::invalid(format!("{name}: {what}: {text}")),
        (WEFT_ENOSYS, _) => {
            Error::from(ErrorDetail::Unsupported(format!("{name}: {what}: {text}")))
        }
        _ => Error::from(ErrorDetail::Provider {
            provider: name.to_string(),
            what: format!("{what}: {text} ({})", code_name(code)),
        }),
    }
}

/// The name of a `WEFT_*` status code, for messages.
fn code_name(code: i32) -> String {
    match code {
        WEFT_EFAIL => "WEFT_EFAIL".into(),
        WEFT_EINVAL => "WEFT_EINVAL".into(),
        WEFT_EPEER => "WEFT_EPEER".into(),
        WEFT_ENOSYS => "WEFT_ENOSYS".into(),
        WEFT_EUNAVAIL => "WEFT_EUNAVAIL".into(),
        WEFT_EACCESS => "WEFT_EACCESS".into(),
        c => format!("code {c}"),
    }
}

struct SinkCtx<'a> {
    sink: &'a mut dyn Sink,
    panicked: bool,
    name: &'a str,
}

unsafe extern "C" fn sink_am(
    ctx: *mut c_void,
    src: u32,
    hdr: *const u8,
    hdr_len: usize,
    payload: *const u8,
    payload_len: usize,
) {
    // SAFETY: ctx is the SinkCtx passed to progress, alive during the call.
    let c = &mut *(ctx as *mut SinkCtx<'_>);
    let h = if hdr_len == 0 {
        &[][..]
    } else {
        std::slice::from_raw_parts(hdr, hdr_len)
    };
    let p = if payload_len == 0 {
        &[][..]
    } else {
        std::slice::from_raw_parts(payload, payload_len)
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.sink.am(src, h, p)));
    c.panicked |= r.is_err();
}

unsafe extern "C" fn sink_complete(
    ctx: *mut c_void,
    token: u64,
    status: i32,
    tagged: *const WeftTaggedStatus,
) {
    // SAFETY: see sink_am.
    let c = &mut *(ctx as *mut SinkCtx<'_>);
    let res = if status != WEFT_OK {
        Err(Error::from(ErrorDetail::Provider {
            provider: c.name.to_string(),
            what: format!("an operation completed with {}", code_name(status)),
        }))
    } else if tagged.is_null() {
        Ok(Completed::Done)
    } else {
        let t = &*tagged;
        if t.cancelled != 0 {
            Ok(Completed::Cancelled)
        } else {
            Ok(Completed::Received(TaggedStatus {
                source: t.source,
                tag: t.tag,
                bytes: t.bytes as usize,
            }))
        }
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.sink.complete(token, res)));
    c.panicked |= r.is_err();
}

unsafe extern "C" fn sink_peer_failed(ctx: *mut c_void, rank: u32, reason: *const c_char) {
    // SAFETY: see sink_am.
    let c = &mut *(ctx as *mut SinkCtx<'_>);
    let why = cstr(reason).unwrap_or_else(|| "no reason given".into());
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        c.sink.peer_failed(rank, &why)
    }));
    c.panicked |= r.is_err();
}

impl Provider for Foreign {
    fn name(&self) -> &str {
        &self.name
    }
    fn caps(&self) -> &Caps {
        &self.caps
    }
    fn rank(&self) -> Rank {
        self.rank
    }
    fn size(&self) -> u32 {
        self.size
    }

    fn am_send(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        // SAFETY: header and iovecs are valid for the call; the provider copies what it keeps.
        // `IoSlice` is ABI-compatible with `struct iovec` on Unix (std's documented guarantee),
        // which is `WeftIov`'s layout (checked at compile time in `sdk.rs`), so the payload
        // slice is passed as it is, without a copy.
        let r = unsafe {
            (self.am.am_send.expect("checked at load"))(
                self.handle,
                dest,
                header.as_ptr(),
                header.len(),
                payload.as_ptr() as *const WeftIov,
                payload.len(),
            )
        };
        match r {
            WEFT_OK => Ok(SendOutcome::Sent),
            WEFT_BUSY => Ok(SendOutcome::Busy),
            WEFT_EPEER => Err(Error::peer_failed(
                dest,
                error_text(self.am, self.handle, r),
            )),
            c => Err(self.err(c, "am_send", Some(dest))),
        }
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut ctx = SinkCtx {
            sink,
            panicked: false,
            name: &self.name,
        };
        let s = WeftSink {
            size: std::mem::size_of::<WeftSink>() as u32,
            reserved: 0,
            ctx: &mut ctx as *mut SinkCtx<'_> as *mut c_void,
            am: Some(sink_am),
            complete: Some(sink_complete),
            peer_failed: Some(sink_peer_failed),
        };
        let mut n = 0usize;
        // SAFETY: `s` and `ctx` outlive the call.
        let r = unsafe { (self.am.progress.expect("checked at load"))(self.handle, &s, &mut n) };
        if ctx.panicked {
            return Err(Error::invalid(
                "a weft handler panicked while a provider library delivered to it",
            ));
        }
        self.check(r, "progress", None)?;
        Ok(n)
    }

    fn close(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.closed, true) {
            return Ok(());
        }
        // SAFETY: closing our own instance once; it is not used afterwards.
        let r = unsafe { (self.am.close.expect("checked at load"))(self.handle) };
        if r == WEFT_OK {
            return Ok(());
        }
        // `close` released the instance whatever it returned: the reason is the thread's last
        // error (`last_error(NULL)`), never the closed instance's.
        let text = error_text(self.am, std::ptr::null_mut(), r);
        Err(code_error(&self.name, r, "close", text, None))
    }

    unsafe fn tagged_send(
        &mut self,
        dest: Rank,
        ctx: u32,
        tag: i32,
        data: &[RawIov],
        sync: bool,
        token: Token,
    ) -> Result<()> {
        let t = self
            .tagged
            .ok_or_else(|| Error::from(ErrorDetail::Unsupported("tagged".into())))?;
        let iov: Vec<WeftIov> = data
            .iter()
            .map(|d| WeftIov {
                base: d.ptr,
                len: d.len,
            })
            .collect();
        let r = (t.send.expect("checked"))(
            self.handle,
            dest,
            ctx,
            tag,
            iov.as_ptr(),
            iov.len(),
            sync as u32,
            token,
        );
        self.check(r, "tagged send", Some(dest))
    }

    unsafe fn tagged_recv(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
        buf: &[RawIovMut],
        token: Token,
    ) -> Result<()> {
        let t = self
            .tagged
            .ok_or_else(|| Error::from(ErrorDetail::Unsupported("tagged".into())))?;
        let iov: Vec<WeftIovMut> = buf
            .iter()
            .map(|d| WeftIovMut {
                base: d.ptr,
                len: d.len,
            })
            .collect();
        let r = (t.recv.expect("checked"))(
            self.handle,
            src.map_or(-1, |s| s as i64),
            ctx,
            tag.map_or(-1, |t| t as i64),
            iov.as_ptr(),
            iov.len(),
            token,
        );
        self.check(r, "tagged receive", src)
    }

    fn tagged_probe(
        &mut self,
        src: Option<Rank>,
        ctx: u32,
        tag: Option<i32>,
    ) -> Result<Option<TaggedStatus>> {
        let t = self
            .tagged
            .ok_or_else(|| Error::from(ErrorDetail::Unsupported("tagged".into())))?;
        let mut found = 0u32;
        let mut st = WeftTaggedStatus::default();
        // SAFETY: valid out-pointers for the call.
        let r = unsafe {
            (t.probe.expect("checked"))(
                self.handle,
                src.map_or(-1, |s| s as i64),
                ctx,
                tag.map_or(-1, |t| t as i64),
                &mut found,
                &mut st,
            )
        };
        self.check(r, "tagged probe", src)?;
        Ok((found != 0).then_some(TaggedStatus {
            source: st.source,
            tag: st.tag,
            bytes: st.bytes as usize,
        }))
    }

    fn tagged_cancel(&mut self, token: Token) -> Result<bool> {
        let t = self
            .tagged
            .ok_or_else(|| Error::from(ErrorDetail::Unsupported("tagged".into())))?;
        let mut c = 0u32;
        // SAFETY: valid out-pointer.
        let r = unsafe { (t.cancel.expect("checked"))(self.handle, token, &mut c) };
        self.check(r, "tagged cancel", None)?;
        Ok(c != 0)
    }

    unsafe fn mr_register(
        &mut self,
        base: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemRegion> {
        let t = self
            .rma
            .ok_or_else(|| Error::from(ErrorDetail::Unsupported("RMA".into())))?;
        let mut mr = WeftMr::default();
        let bits = access.remote_read as u32
            | (access.remote_write as u32) << 1
            | (access.remote_atomic as u32) << 2;
        let r = (t.reg.expect("checked"))(self.handle, base, len, bits, &mut mr);
        self.check(r, "memory registration", None)?;
        Ok(MemRegion {
            key: mr.key,
            addr: mr.addr,
            len: mr.len as usize,
            handle: mr.handle,
        })
    }

    fn mr_deregister(&mut self, mr: &MemRegion) -> Result<()> {
        let t = self
            .rma
            .ok_or_else(|| Error::from(ErrorDetail::Unsupported("RMA".into())))?;
        let w = WeftMr {
            key: mr.key,
            addr: mr.addr,
            len: mr.len as u64,
            handle: mr.handle,
        };
        // SAFETY: valid pointer for the call.
        let r = unsafe { (t.dereg.expect("checked"))(self.handle, &w) };
        self.check(r, "deregistration", None)
    }

    unsafe fn rma_read(
        &mut self,
        src: Rank,
        local: &[RawIovMut],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        let t = self
            .rma
            .ok_or_else(|| Error::from(ErrorDetail::Unsupported("RMA".into())))?;
        let iov: SmallVec<[WeftIovMut; 8]> = local
            .iter()
            .map(|d| WeftIovMut {
                base: d.ptr,
                len: d.len,
            })
            .collect();
        let r = (t.read.expect("checked"))(
            self.handle,
            src,
            iov.as_ptr(),
            iov.len(),
            remote.addr,
            remote.key,
            done.cq.unwrap_or(0),
            done.cntr.unwrap_or(0),
        );
        self.check(r, "RMA read", Some(src))
    }

    unsafe fn rma_write(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        let t = self
            .rma
            .ok_or_else(|| Error::from(ErrorDetail::Unsupported("RMA".into())))?;
        let iov: SmallVec<[WeftIov; 8]> = local
            .iter()
            .map(|d| WeftIov {
                base: d.ptr,
                len: d.len,
            })
            .collect();
        let r = (t.write.expect("checked"))(
            self.handle,
            dest,
            iov.as_ptr(),
            iov.len(),
            remote.addr,
            remote.key,
            done.cq.unwrap_or(0),
            done.cntr.unwrap_or(0),
        );
        self.check(r, "RMA write", Some(dest))
    }

    unsafe fn atomic(
        &mut self,
        dest: Rank,
        op: Op,
        ty: BasicType,
        count: usize,
        origin: *const u8,
        compare: *const u8,
        result: *mut u8,
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        let t = self
            .atomics
            .ok_or_else(|| Error::from(ErrorDetail::Unsupported("atomics".into())))?;
        let r = (t.atomic.expect("checked"))(
            self.handle,
            dest,
            op as u32,
            ty as u32,
            count,
            origin,
            compare,
            result,
            remote.addr,
            remote.key,
            done.cq.unwrap_or(0),
            done.cntr.unwrap_or(0),
        );
        self.check(r, "atomic", Some(dest))
    }

    fn cntr_open(&mut self) -> Result<CntrId> {
        let t = self
            .cntr
            .ok_or_else(|| Error::from(ErrorDetail::Unsupported("counters".into())))?;
        let mut c = 0u64;
        // SAFETY: the library's function with our instance and a valid out pointer.
        let r = unsafe { (t.open.expect("checked"))(self.handle, &mut c) };
        self.check(r, "counter open", None)?;
        if c == 0 {
            return Err(Error::invalid(format!(
                "provider {} returned counter id 0 from open",
                self.name
            )));
        }
        Ok(c)
    }

    fn cntr_read(&mut self, cntr: CntrId) -> Result<CntrValue> {
        let t = self
            .cntr
            .ok_or_else(|| Error::from(ErrorDetail::Unsupported("counters".into())))?;
        let (mut ok, mut err) = (0u64, 0u64);
        // SAFETY: as in cntr_open.
        let r = unsafe { (t.read.expect("checked"))(self.handle, cntr, &mut ok, &mut err) };
        self.check(r, "counter read", None)?;
        Ok(CntrValue { ok, err })
    }

    fn cntr_close(&mut self, cntr: CntrId) -> Result<()> {
        let t = self
            .cntr
            .ok_or_else(|| Error::from(ErrorDetail::Unsupported("counters".into())))?;
        // SAFETY: as in cntr_open.
        let r = unsafe { (t.close.expect("checked"))(self.handle, cntr) };
        self.check(r, "counter close", None)
    }
}

impl Drop for Foreign {
    fn drop(&mut self) {
        if !self.closed {
            let _ = self.close();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A library's codes become errors that name the right rank, or none: `WEFT_EPEER` from an
    /// operation on rank 3 is "peer failed: rank 3"; from `progress`, which names no rank, it
    /// is the provider's own failure (it used to say rank 4294967295), never "bootstrap:".
    #[test]
    fn library_codes_name_the_right_rank() {
        let e = code_error("lib", WEFT_EPEER, "am_send", "gone".into(), Some(3));
        assert_eq!(e.kind(), crate::ErrorKind::PeerFailed);
        assert!(e.to_string().contains("rank 3"), "{e}");
        let e = code_error("lib", WEFT_EPEER, "progress", "gone".into(), None);
        assert_eq!(e.kind(), crate::ErrorKind::Provider);
        assert!(!e.to_string().contains("4294967295"), "{e}");
        assert_eq!(e.to_string(), "provider 'lib': progress: gone (WEFT_EPEER)");
        let e = code_error("lib", WEFT_EFAIL, "close", "no".into(), None);
        assert!(!e.to_string().starts_with("bootstrap"), "{e}");
        let e = code_error("lib", WEFT_EACCESS, "RMA write", "bad key".into(), Some(1));
        assert_eq!(e.kind(), crate::ErrorKind::RemoteAccess);
    }
}
