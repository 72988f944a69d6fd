//! PMIx client: how a rank finds its job under a PMIx server — Open MPI's `mpirun` (4.x and
//! later), PRRTE's `prterun`, Slurm's `srun --mpi=pmix`.
//!
//! The PMIx library (`libpmix.so.2`, Debian's `libpmix2`) is opened at run time with `dlopen`,
//! not linked: weft builds and runs where PMIx is absent, a process takes whichever PMIx its
//! launcher's installation provides (`WEFT_PMIX_LIB` names another), and no C headers or
//! bindgen are needed at build time. The price is that the few structures crossing the
//! interface are declared here by hand; their layout is PMIx's stable ABI (unchanged since
//! v2) and a test checks it against the installed `pmix_common.h` when there is one.
//!
//! Used: `PMIx_Init` (namespace and rank), `PMIx_Get` of `pmix.job.size`, `PMIx_Put` and
//! `PMIx_Commit` of string values, `PMIx_Fence` collecting the data, `PMIx_Get` of another
//! rank's values, `PMIx_Abort`, `PMIx_Finalize`. The node map comes from every rank's host
//! identity exchanged at start, as under PMI-1.

use super::{host_id, Bootstrap, KvSpace, NodeMap};
use crate::{Error, ErrorDetail, Rank, Result};
use std::ffi::{c_char, c_int, CStr, CString};
use std::sync::Arc;
use std::time::Duration;

crate::param!(pub PMIX_LIB: Str = "pmix", "LIB", "libpmix.so.2",
    "PMIx library to open (dlopen) when a PMIx server started this process");

const NSLEN: usize = 256;
const KEYLEN: usize = 512;
const RANK_WILDCARD: u32 = u32::MAX - 1;
const RANK_UNDEF: u32 = u32::MAX;
const SUCCESS: c_int = 0;
const NOT_FOUND: c_int = -46;
/// Deprecated since v4, still returned by older servers.
const PROC_ENTRY_NOT_FOUND: c_int = -17;
const SCOPE_GLOBAL: u8 = 3;
// Data types of pmix_value_t.
const T_BOOL: u16 = 1;
const T_STRING: u16 = 3;
const T_SIZE: u16 = 4;
const T_INT: u16 = 6;
const T_UINT32: u16 = 14;
const T_UINT64: u16 = 15;

/// `pmix_proc_t`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Proc {
    nspace: [c_char; NSLEN],
    rank: u32,
}

/// `pmix_value_t`: a type tag and a 24-byte union (8-byte aligned).
#[repr(C)]
#[derive(Clone, Copy)]
struct Value {
    ty: u16,
    data: [u64; 3],
}

/// `pmix_info_t`.
#[repr(C)]
struct Info {
    key: [c_char; KEYLEN],
    flags: u32,
    value: Value,
}

const _: () = assert!(std::mem::size_of::<Proc>() == 260);
const _: () = assert!(std::mem::size_of::<Value>() == 32);
const _: () = assert!(std::mem::size_of::<Info>() == 552);
const _: () = assert!(std::mem::offset_of!(Info, value) == 520);

impl Info {
    fn new(key: &str, ty: u16, word: u64) -> Info {
        let mut k = [0 as c_char; KEYLEN];
        for (d, s) in k.iter_mut().zip(key.bytes().take(KEYLEN - 1)) {
            *d = s as c_char;
        }
        Info {
            key: k,
            flags: 0,
            value: Value {
                ty,
                data: [word, 0, 0],
            },
        }
    }
}

type InitFn = unsafe extern "C" fn(*mut Proc, *mut Info, usize) -> c_int;
type FinalizeFn = unsafe extern "C" fn(*const Info, usize) -> c_int;
type AbortFn = unsafe extern "C" fn(c_int, *const c_char, *mut Proc, usize) -> c_int;
type PutFn = unsafe extern "C" fn(u8, *const c_char, *mut Value) -> c_int;
type CommitFn = unsafe extern "C" fn() -> c_int;
type FenceFn = unsafe extern "C" fn(*const Proc, usize, *const Info, usize) -> c_int;
type GetFn =
    unsafe extern "C" fn(*const Proc, *const c_char, *const Info, usize, *mut *mut Value) -> c_int;
type DestructFn = unsafe extern "C" fn(*mut Value);
type ErrStrFn = unsafe extern "C" fn(c_int) -> *const c_char;

/// The library and the entry points weft calls (valid while `_lib` is loaded).
struct Lib {
    init: InitFn,
    finalize: FinalizeFn,
    abort: AbortFn,
    put: PutFn,
    commit: CommitFn,
    fence: FenceFn,
    get: GetFn,
    destruct: DestructFn,
    errstr: ErrStrFn,
    _lib: libloading::Library,
}

impl Lib {
    fn open(name: &str) -> std::result::Result<Lib, String> {
        // SAFETY: loading PMIx runs its constructors, which only set up the library's state;
        // the library is the one the launcher's installation provides for this purpose.
        let lib = unsafe { libloading::Library::new(name) }.map_err(|e| e.to_string())?;
        macro_rules! sym {
            ($n:literal) => {
                // SAFETY: the symbol is PMIx's public C function of this name, whose signature
                // (pmix.h, stable since v2) is the type it is read as; it stays valid while
                // the library is loaded, which `Lib` keeps.
                *unsafe { lib.get(concat!($n, "\0").as_bytes()) }.map_err(|e| format!("{e}"))?
            };
        }
        Ok(Lib {
            init: sym!("PMIx_Init"),
            finalize: sym!("PMIx_Finalize"),
            abort: sym!("PMIx_Abort"),
            put: sym!("PMIx_Put"),
            commit: sym!("PMIx_Commit"),
            fence: sym!("PMIx_Fence"),
            get: sym!("PMIx_Get"),
            destruct: sym!("PMIx_Value_destruct"),
            errstr: sym!("PMIx_Error_string"),
            _lib: lib,
        })
    }

    fn why(&self, st: c_int) -> String {
        // SAFETY: PMIx_Error_string returns a static string for any status (or null).
        let p = unsafe { (self.errstr)(st) };
        if p.is_null() {
            format!("status {st}")
        } else {
            // SAFETY: a NUL-terminated static string owned by the library.
            let s = unsafe { CStr::from_ptr(p) }.to_string_lossy();
            format!("{s} ({st})")
        }
    }

    fn check(&self, what: &str, st: c_int) -> Result<()> {
        if st == SUCCESS {
            Ok(())
        } else {
            Err(boot_err(format!("PMIx: {what}: {}", self.why(st))))
        }
    }

    /// `PMIx_Get` of `key` from `proc`; `Ok(None)` if not found. `optional`: answer from what
    /// is here, without asking the server to wait for the key.
    fn get(&self, proc: &Proc, key: &str, optional: bool, timeout: u64) -> Result<Option<Got<'_>>> {
        let k = CString::new(key).map_err(|_| boot_err(format!("PMIx: key {key:?} has a NUL")))?;
        let info = [
            Info::new("pmix.optional", T_BOOL, optional as u64),
            Info::new("pmix.timeout", T_INT, timeout),
        ];
        let mut v: *mut Value = std::ptr::null_mut();
        // SAFETY: valid proc, NUL-terminated key, an info array of `info.len()` entries, and
        // an out pointer PMIx fills with a value it allocated (released in `Got::drop`).
        let st = unsafe { (self.get)(proc, k.as_ptr(), info.as_ptr(), info.len(), &mut v) };
        if st != SUCCESS || v.is_null() {
            return match st {
                NOT_FOUND | PROC_ENTRY_NOT_FOUND | SUCCESS => Ok(None),
                _ => Err(boot_err(format!("PMIx: get {key}: {}", self.why(st)))),
            };
        }
        Ok(Some(Got { lib: self, v }))
    }
}

/// A value `PMIx_Get` returned (released when dropped).
struct Got<'a> {
    lib: &'a Lib,
    v: *mut Value,
}

impl Got<'_> {
    fn value(&self) -> Value {
        // SAFETY: a value PMIx returned, alive until drop.
        unsafe { *self.v }
    }

    fn string(&self) -> Option<String> {
        let v = self.value();
        if v.ty != T_STRING || v.data[0] == 0 {
            return None;
        }
        // SAFETY: a PMIX_STRING value holds a NUL-terminated string owned by the value.
        Some(
            unsafe { CStr::from_ptr(v.data[0] as *const c_char) }
                .to_string_lossy()
                .into_owned(),
        )
    }

    fn number(&self) -> Option<u64> {
        let v = self.value();
        match v.ty {
            T_UINT32 => Some(v.data[0] & 0xffff_ffff),
            T_UINT64 | T_SIZE => Some(v.data[0]),
            _ => None,
        }
    }
}

impl Drop for Got<'_> {
    fn drop(&mut self) {
        // SAFETY: PMIX_VALUE_RELEASE: free the value's contents with PMIx, the value itself
        // (allocated by PMIx with malloc) with free.
        unsafe {
            (self.lib.destruct)(self.v);
            libc::free(self.v.cast());
        }
    }
}

fn boot_err(s: String) -> Error {
    Error::from(ErrorDetail::Bootstrap(s))
}

/// A rank of a job a PMIx server started.
pub struct Pmix {
    lib: Arc<Lib>,
    me: Proc,
    nspace: String,
    rank: Rank,
    size: u32,
    nodes: NodeMap,
    timeout: u64,
    finalized: bool,
}

// SAFETY: PMIx's client calls are thread-safe (its progress thread serialises them); the
// struct holds plain data and function pointers into a library that stays loaded.
unsafe impl Send for Lib {}
// SAFETY: as above.
unsafe impl Sync for Lib {}

impl Pmix {
    /// Whether a PMIx server started this process.
    pub fn in_env(var: &impl Fn(&str) -> Option<String>) -> bool {
        var("PMIX_NAMESPACE").is_some() && var("PMIX_RANK").is_some()
    }

    /// Connect to the server, learn rank and size, exchange host identities.
    pub fn from_env(timeout: Duration) -> Result<Pmix> {
        let name = PMIX_LIB.get_str();
        let lib = Lib::open(&name).map_err(|e| {
            boot_err(format!(
                "a PMIx server started this process (PMIX_NAMESPACE={}), but the PMIx library \
                 could not be opened: {e}; install libpmix2 (Debian) or name the library in \
                 WEFT_PMIX_LIB",
                std::env::var("PMIX_NAMESPACE").unwrap_or_default()
            ))
        })?;
        let mut me = Proc {
            nspace: [0; NSLEN],
            rank: 0,
        };
        // SAFETY: PMIx fills `me`; no info.
        let st = unsafe { (lib.init)(&mut me, std::ptr::null_mut(), 0) };
        if st != SUCCESS {
            return Err(boot_err(format!(
                "PMIx: the server that started this process (PMIX_NAMESPACE={}) did not \
                 accept PMIx_Init: {}",
                std::env::var("PMIX_NAMESPACE").unwrap_or_default(),
                lib.why(st)
            )));
        }
        // SAFETY: PMIx wrote a NUL-terminated namespace into the array (zeroed beforehand,
        // one byte longer than its longest namespace).
        let nspace = unsafe { CStr::from_ptr(me.nspace.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let secs = timeout.as_secs().max(1);
        let job = Proc {
            rank: RANK_WILDCARD,
            ..me
        };
        let size = lib
            .get(&job, "pmix.job.size", false, secs)?
            .and_then(|g| g.number())
            .ok_or_else(|| boot_err("PMIx: the server gave no job size".into()))?;
        let mut p = Pmix {
            lib: Arc::new(lib),
            me,
            nspace,
            rank: me.rank,
            size: size as u32,
            nodes: NodeMap::single_host(1),
            timeout: secs,
            finalized: false,
        };
        if p.rank >= p.size {
            return Err(boot_err(format!(
                "PMIx: rank {} in a job of {}",
                p.rank, p.size
            )));
        }
        let ids = super::allgather(&mut p, "weft.host", &host_id())?;
        p.nodes = NodeMap::from_ids(&ids, p.rank);
        Ok(p)
    }

    fn put_value(lib: &Lib, key: &str, value: &str) -> Result<()> {
        let k = CString::new(key).map_err(|_| boot_err(format!("PMIx: key {key:?} has a NUL")))?;
        let v =
            CString::new(value).map_err(|_| boot_err(format!("PMIx: value of {key} has a NUL")))?;
        let mut val = Value {
            ty: T_STRING,
            data: [v.as_ptr() as u64, 0, 0],
        };
        // SAFETY: NUL-terminated key; a string value PMIx copies before returning.
        let st = unsafe { (lib.put)(SCOPE_GLOBAL, k.as_ptr(), &mut val) };
        lib.check(&format!("put {key}"), st)?;
        // SAFETY: no arguments.
        lib.check("commit", unsafe { (lib.commit)() })
    }
}

/// Who published `key`: weft's keys end in the publishing rank (`name.R`) or name the rank they
/// are about; that rank first, then any rank, then each.
fn owners(size: u32, key: &str) -> Vec<u32> {
    let hint = key
        .rsplit('.')
        .next()
        .and_then(|t| t.parse::<u32>().ok())
        .filter(|r| *r < size);
    let mut v: Vec<u32> = hint.into_iter().collect();
    v.push(RANK_UNDEF);
    v.extend((0..size).filter(|r| Some(*r) != hint));
    v
}

/// `key` as published by some rank of `me`'s namespace, from what is here.
fn lookup(lib: &Lib, me: &Proc, size: u32, timeout: u64, key: &str) -> Result<Option<String>> {
    for r in owners(size, key) {
        let p = Proc { rank: r, ..*me };
        if let Some(g) = lib.get(&p, key, true, timeout)? {
            return Ok(g.string());
        }
    }
    Ok(None)
}

impl std::fmt::Debug for Pmix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pmix")
            .field("nspace", &self.nspace)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

/// The key-value space after open (lazy connections): puts are committed at once.
struct PmixKv {
    lib: Arc<Lib>,
    boot: Proc,
    size: u32,
    timeout: u64,
}

impl KvSpace for PmixKv {
    fn put(&self, key: &str, value: &str) -> Result<()> {
        Pmix::put_value(&self.lib, key, value)
    }

    fn get(&self, key: &str) -> Result<Option<String>> {
        lookup(&self.lib, &self.boot, self.size, self.timeout, key)
    }
}

impl Bootstrap for Pmix {
    fn rank(&self) -> Rank {
        self.rank
    }
    fn size(&self) -> u32 {
        self.size
    }
    fn job_id(&self) -> &str {
        &self.nspace
    }
    fn put(&mut self, key: &str, value: &str) -> Result<()> {
        Self::put_value(&self.lib, key, value)
    }
    fn fence(&mut self) -> Result<()> {
        let all = Proc {
            rank: RANK_WILDCARD,
            ..self.me
        };
        let info = [
            Info::new("pmix.collect", T_BOOL, 1),
            Info::new("pmix.timeout", T_INT, self.timeout),
        ];
        // SAFETY: one proc (every rank of our namespace), an info array of its length.
        let st = unsafe { (self.lib.fence)(&all, 1, info.as_ptr(), info.len()) };
        self.lib.check("fence", st)
    }
    fn get(&mut self, key: &str) -> Result<String> {
        lookup(&self.lib, &self.me, self.size, self.timeout, key)?
            .ok_or_else(|| boot_err(format!("PMIx: no rank published {key}")))
    }
    fn nodes(&self) -> &NodeMap {
        &self.nodes
    }
    fn kv(&self) -> Option<Arc<dyn KvSpace>> {
        Some(Arc::new(PmixKv {
            lib: self.lib.clone(),
            boot: self.me,
            size: self.size,
            timeout: self.timeout,
        }))
    }
    fn abort(&mut self, code: i32, msg: &str) {
        let m = CString::new(msg.replace('\0', " ")).unwrap_or_default();
        // SAFETY: NUL-terminated message; no procs = every process of the job.
        unsafe { (self.lib.abort)(code, m.as_ptr(), std::ptr::null_mut(), 0) };
    }
    fn finalize(&mut self) -> Result<()> {
        if self.finalized {
            return Ok(());
        }
        self.finalized = true;
        // SAFETY: no info.
        let st = unsafe { (self.lib.finalize)(std::ptr::null(), 0) };
        self.lib.check("finalize", st)
    }
}

impl Drop for Pmix {
    fn drop(&mut self) {
        let _ = self.finalize();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hand-written layouts against the installed header, where there is one.
    #[test]
    fn layouts_match_the_installed_pmix_header() {
        let inc = "/usr/lib/x86_64-linux-gnu/pmix2/include";
        if !std::path::Path::new(inc).join("pmix_common.h").exists() {
            let why = "pmix_common.h is missing (Debian's libpmix-dev; tools/deps.sh installs it)";
            assert!(
                std::env::var_os("WEFT_REQUIRE_TOOLS").is_none(),
                "{why} (WEFT_REQUIRE_TOOLS is set)"
            );
            eprintln!("skipped: {why}");
            return;
        }
        let dir = std::env::temp_dir().join(format!("weft-pmix-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let c = dir.join("l.c");
        std::fs::write(
            &c,
            r#"#include <pmix_common.h>
#include <stdio.h>
#include <stddef.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu\n", sizeof(pmix_proc_t), offsetof(pmix_proc_t, rank),
         sizeof(pmix_value_t), offsetof(pmix_value_t, data), sizeof(pmix_info_t),
         offsetof(pmix_info_t, value));
  printf("%u %u %d %d %d %d %d %d %d %d\n", PMIX_RANK_WILDCARD, PMIX_RANK_UNDEF, PMIX_GLOBAL,
         PMIX_BOOL, PMIX_STRING, PMIX_SIZE, PMIX_INT, PMIX_UINT32, PMIX_UINT64,
         PMIX_ERR_NOT_FOUND);
  printf("%s %s %s %s\n", PMIX_JOB_SIZE, PMIX_COLLECT_DATA, PMIX_OPTIONAL, PMIX_TIMEOUT);
  return 0;
}"#,
        )
        .unwrap();
        let exe = dir.join("l");
        let o = std::process::Command::new("cc")
            .arg(format!("-I{inc}"))
            .arg(&c)
            .arg("-o")
            .arg(&exe)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let out = std::process::Command::new(&exe).output().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let got = String::from_utf8_lossy(&out.stdout).into_owned();
        let want = format!(
            "{} {} {} {} {} {}\n{} {} {} {} {} {} {} {} {} -46\n\
             pmix.job.size pmix.collect pmix.optional pmix.timeout\n",
            std::mem::size_of::<Proc>(),
            std::mem::offset_of!(Proc, rank),
            std::mem::size_of::<Value>(),
            std::mem::offset_of!(Value, data),
            std::mem::size_of::<Info>(),
            std::mem::offset_of!(Info, value),
            RANK_WILDCARD,
            RANK_UNDEF,
            SCOPE_GLOBAL,
            T_BOOL,
            T_STRING,
            T_SIZE,
            T_INT,
            T_UINT32,
            T_UINT64,
        );
        assert_eq!(got, want);
    }
}
