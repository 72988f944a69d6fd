//! What the host (weft) offers a provider exported through the SDK, seen from the provider:
//! the bootstrap during `open` (and its key-value space until `close`, ABI 1.1), and the sink
//! during `progress`.

use super::code;
use crate::bootstrap::{Bootstrap, KvSpace, NodeMap};
use crate::provider::{Completed, ConnEvent, Sink, Token};
use crate::types::Rank;
use crate::{Error, ErrorDetail, Result};
use std::ffi::{c_char, c_void, CStr, CString};
use std::io::IoSlice;
use std::sync::Arc;
use weft_abi::*;

/// Bootstrap services offered by the host, seen from the provider.
pub(super) struct HostBoot {
    b: *const WeftBoot,
    job: String,
    nodes: NodeMap,
}

impl HostBoot {
    /// # Safety
    /// `b` must point at a valid `WeftBoot` for the duration of `open`.
    pub(super) unsafe fn new(b: *const WeftBoot) -> Result<HostBoot> {
        let r = &*b;
        let job = if r.job_id.is_null() {
            String::new()
        } else {
            CStr::from_ptr(r.job_id).to_string_lossy().into_owned()
        };
        let host_of = r
            .host_of
            .ok_or_else(|| Error::invalid("bootstrap without host_of"))?;
        let hosts: Vec<u32> = (0..r.nranks).map(|i| host_of(r.ctx, i)).collect();
        let my_host = hosts.get(r.rank as usize).copied().unwrap_or(0);
        Ok(HostBoot {
            b,
            job,
            nodes: NodeMap {
                host_of: hosts,
                my_host,
            },
        })
    }

    fn boot(&self) -> &WeftBoot {
        // SAFETY: valid for the duration of open (see `new`).
        unsafe { &*self.b }
    }
}

fn cstring(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid("string with a NUL byte"))
}

impl Bootstrap for HostBoot {
    fn rank(&self) -> Rank {
        self.boot().rank
    }
    // `WeftBoot::size` is the struct's size (ABI convention); the job size is `nranks`.
    #[allow(clippy::misnamed_getters)]
    fn size(&self) -> u32 {
        self.boot().nranks
    }
    fn job_id(&self) -> &str {
        &self.job
    }
    fn put(&mut self, key: &str, value: &str) -> Result<()> {
        let (k, v) = (cstring(key)?, cstring(value)?);
        let f = self
            .boot()
            .put
            .ok_or_else(|| Error::invalid("bootstrap without put"))?;
        // SAFETY: host callback with valid strings.
        match unsafe { f(self.boot().ctx, k.as_ptr(), v.as_ptr()) } {
            WEFT_OK => Ok(()),
            c => Err(Error::from(ErrorDetail::Bootstrap(format!(
                "put failed ({c})"
            )))),
        }
    }
    fn fence(&mut self) -> Result<()> {
        let f = self
            .boot()
            .fence
            .ok_or_else(|| Error::invalid("bootstrap without fence"))?;
        // SAFETY: host callback.
        match unsafe { f(self.boot().ctx) } {
            WEFT_OK => Ok(()),
            c => Err(Error::from(ErrorDetail::Bootstrap(format!(
                "fence failed ({c})"
            )))),
        }
    }
    fn get(&mut self, key: &str) -> Result<String> {
        let k = cstring(key)?;
        let f = self
            .boot()
            .get
            .ok_or_else(|| Error::invalid("bootstrap without get"))?;
        let mut buf = vec![0 as c_char; 256];
        loop {
            let mut need = 0usize;
            // SAFETY: host callback with a buffer of the announced length.
            let r = unsafe {
                f(
                    self.boot().ctx,
                    k.as_ptr(),
                    buf.as_mut_ptr(),
                    buf.len(),
                    &mut need,
                )
            };
            match r {
                WEFT_OK => {
                    // SAFETY: the host wrote a NUL-terminated string.
                    return Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
                        .to_string_lossy()
                        .into_owned());
                }
                WEFT_EINVAL if need > buf.len() => buf.resize(need, 0),
                c => {
                    return Err(Error::from(ErrorDetail::Bootstrap(format!(
                        "key '{key}': get failed ({c})"
                    ))))
                }
            }
        }
    }
    fn nodes(&self) -> &NodeMap {
        &self.nodes
    }
    fn kv(&self) -> Option<Arc<dyn KvSpace>> {
        let b = self.boot();
        if (b.size as usize) < std::mem::size_of::<WeftBoot>() || b.kv_ctx.is_null() {
            return None;
        }
        Some(Arc::new(HostKv {
            ctx: b.kv_ctx,
            put: b.kv_put?,
            get: b.kv_get?,
        }))
    }
}

/// The host's key-value space (ABI 1.1 `WeftBoot::kv_*`), valid until the instance is closed.
struct HostKv {
    ctx: *mut c_void,
    put: unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char) -> i32,
    get: unsafe extern "C" fn(*mut c_void, *const c_char, *mut c_char, usize, *mut usize) -> i32,
}

// SAFETY: `ctx` is the host's `Arc<dyn KvSpace>`, which is `Send + Sync`; the functions only
// reach it through that shared reference.
unsafe impl Send for HostKv {}
// SAFETY: as above.
unsafe impl Sync for HostKv {}

impl KvSpace for HostKv {
    fn put(&self, key: &str, value: &str) -> Result<()> {
        let (k, v) = (cstring(key)?, cstring(value)?);
        // SAFETY: host callback with valid strings; the space outlives the instance's use.
        match unsafe { (self.put)(self.ctx, k.as_ptr(), v.as_ptr()) } {
            WEFT_OK => Ok(()),
            c => Err(Error::from(ErrorDetail::Bootstrap(format!(
                "key-value put failed ({c})"
            )))),
        }
    }
    fn get(&self, key: &str) -> Result<Option<String>> {
        let k = cstring(key)?;
        let mut buf = vec![0 as c_char; 256];
        loop {
            let mut need = 0usize;
            // SAFETY: host callback with a buffer of the announced length.
            let r =
                unsafe { (self.get)(self.ctx, k.as_ptr(), buf.as_mut_ptr(), buf.len(), &mut need) };
            match r {
                WEFT_OK if need == 0 => return Ok(None),
                WEFT_OK => {
                    // SAFETY: the host wrote a NUL-terminated string.
                    return Ok(Some(
                        unsafe { CStr::from_ptr(buf.as_ptr()) }
                            .to_string_lossy()
                            .into_owned(),
                    ));
                }
                WEFT_EINVAL if need > buf.len() => buf.resize(need, 0),
                c => {
                    return Err(Error::from(ErrorDetail::Bootstrap(format!(
                        "key '{key}': key-value get failed ({c})"
                    ))))
                }
            }
        }
    }
}

/// The host's sink, seen from the provider.
/// `WeftIov` and `IoSlice` (= `struct iovec` on Unix) have the same size and alignment, so
/// iovec arrays cross the ABI without copies (with the field order fixed by `struct iovec`:
/// base, then length).
const _: () = {
    assert!(std::mem::size_of::<WeftIov>() == std::mem::size_of::<IoSlice<'static>>());
    assert!(std::mem::align_of::<WeftIov>() == std::mem::align_of::<IoSlice<'static>>());
    assert!(std::mem::size_of::<WeftIov>() == std::mem::size_of::<libc::iovec>());
    assert!(std::mem::offset_of!(WeftIov, base) == std::mem::offset_of!(libc::iovec, iov_base));
    assert!(std::mem::offset_of!(WeftIov, len) == std::mem::offset_of!(libc::iovec, iov_len));
};

pub(super) struct HostSink(pub(super) *const WeftSink);

impl Sink for HostSink {
    fn am(&mut self, src: Rank, header: &[u8], payload: &[u8]) {
        // SAFETY: the host's sink, valid during progress; slices valid for the call.
        unsafe {
            let s = &*self.0;
            if let Some(f) = s.am {
                f(
                    s.ctx,
                    src,
                    header.as_ptr(),
                    header.len(),
                    payload.as_ptr(),
                    payload.len(),
                );
            }
        }
    }
    fn complete(&mut self, token: Token, result: Result<Completed>) {
        let (status, tagged) = match result {
            Ok(Completed::Done) => (WEFT_OK, None),
            Ok(Completed::Received(t)) => (
                WEFT_OK,
                Some(WeftTaggedStatus {
                    source: t.source,
                    tag: t.tag,
                    bytes: t.bytes as u64,
                    cancelled: 0,
                    reserved: 0,
                }),
            ),
            Ok(Completed::Cancelled) => (
                WEFT_OK,
                Some(WeftTaggedStatus {
                    cancelled: 1,
                    ..Default::default()
                }),
            ),
            Err(e) => (code(&e), None),
        };
        // SAFETY: as in `am`.
        unsafe {
            let s = &*self.0;
            if let Some(f) = s.complete {
                f(
                    s.ctx,
                    token,
                    status,
                    tagged.as_ref().map_or(std::ptr::null(), |t| t as *const _),
                );
            }
        }
    }
    fn peer_failed(&mut self, rank: Rank, reason: &str) {
        let r = CString::new(reason.replace('\0', " ")).unwrap_or_default();
        // SAFETY: as in `am`.
        unsafe {
            let s = &*self.0;
            if let Some(f) = s.peer_failed {
                f(s.ctx, rank, r.as_ptr());
            }
        }
    }
    fn rma_data(&mut self, src: Rank, data: u64) {
        // SAFETY: as in `am`; the 1.1 field is read only when the host's sink has it.
        unsafe {
            let s = &*self.0;
            if s.size as usize >= std::mem::size_of::<WeftSink>() {
                if let Some(f) = s.rma_data {
                    f(s.ctx, src, data);
                }
            }
        }
    }
    fn connection(&mut self, peer: Rank, event: ConnEvent) {
        let ev = match event {
            ConnEvent::Connected => WEFT_CONN_CONNECTED,
            ConnEvent::CapsChanged => WEFT_CONN_CAPS_CHANGED,
        };
        // SAFETY: as in `rma_data`.
        unsafe {
            let s = &*self.0;
            if s.size as usize >= std::mem::size_of::<WeftSink>() {
                if let Some(f) = s.connection {
                    f(s.ctx, peer, ev);
                }
            }
        }
    }
}
