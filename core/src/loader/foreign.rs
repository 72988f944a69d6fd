//! A provider opened from a library: the Rust `Provider` over the C tables, and the sink
//! callbacks the library reports through.

use super::*;

/// An opened provider from a library (the library stays loaded for the process's life, so its
/// tables are `'static`).
pub(super) struct Foreign {
    pub(super) name: String,
    pub(super) am: &'static WeftAmOps,
    pub(super) tagged: Option<&'static WeftTaggedOps>,
    pub(super) rma: Option<&'static WeftRmaOps>,
    pub(super) atomics: Option<&'static WeftAtomicOps>,
    pub(super) cntr: Option<&'static WeftCntrOps>,
    /// ABI 1.1 entries, and the library's minor version.
    pub(super) ext: Option<&'static WeftExtOps>,
    pub(super) minor: u32,
    /// The key-value space handed to a 1.1 library at `open` (`WeftBoot::kv_ctx` points into
    /// this box), kept until the instance is closed.
    pub(super) kv: Option<Box<Arc<dyn KvSpace>>>,
    pub(super) handle: *mut c_void,
    pub(super) caps: Caps,
    pub(super) rank: Rank,
    pub(super) size: u32,
    pub(super) closed: bool,
}

impl Foreign {
    /// The error for `code` from operation `what`, described by the instance's `last_error`.
    /// `peer`: the rank the operation was about, when it names one (a `WEFT_EPEER` or
    /// `WEFT_EACCESS` is then about that rank; otherwise it is reported as the provider's own).
    fn err(&self, code: i32, what: &str, peer: Option<Rank>) -> Error {
        let text = error_text(self.am, self.handle, code);
        code_error(&self.name, code, what, text, peer)
    }

    fn ext(&self, what: &str) -> Result<&'static WeftExtOps> {
        self.ext.ok_or_else(|| {
            Error::from(ErrorDetail::Unsupported(format!(
                "{}: {what} needs ABI 1.1 entries the library does not have",
                self.name
            )))
        })
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

unsafe extern "C" fn sink_rma_data(ctx: *mut c_void, src: u32, data: u64) {
    // SAFETY: see sink_am.
    let c = &mut *(ctx as *mut SinkCtx<'_>);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.sink.rma_data(src, data)));
    c.panicked |= r.is_err();
}

unsafe extern "C" fn sink_connection(ctx: *mut c_void, peer: u32, event: u32) {
    // SAFETY: see sink_am.
    let c = &mut *(ctx as *mut SinkCtx<'_>);
    let ev = match event {
        WEFT_CONN_CONNECTED => ConnEvent::Connected,
        WEFT_CONN_CAPS_CHANGED => ConnEvent::CapsChanged,
        _ => return, // an event of a newer minor: nothing this weft acts on
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.sink.connection(peer, ev)));
    c.panicked |= r.is_err();
}

/// Descriptors of `n` local pieces for a 1.1 call: null unless the provider asked for them.
fn descs_ptr(mr_local: bool, d: &[u64]) -> *const u64 {
    if mr_local {
        d.as_ptr()
    } else {
        std::ptr::null()
    }
}

/// Local pieces as the C ABI's iovec, and their descriptors (parallel arrays).
fn c_iov(local: &[RawIov]) -> (SmallVec<[WeftIov; 8]>, SmallVec<[u64; 8]>) {
    local
        .iter()
        .map(|d| {
            (
                WeftIov {
                    base: d.ptr,
                    len: d.len,
                },
                d.desc,
            )
        })
        .unzip()
}

/// Writable local pieces as the C ABI's iovec, and their descriptors.
fn c_iov_mut(local: &[RawIovMut]) -> (SmallVec<[WeftIovMut; 8]>, SmallVec<[u64; 8]>) {
    local
        .iter()
        .map(|d| {
            (
                WeftIovMut {
                    base: d.ptr,
                    len: d.len,
                },
                d.desc,
            )
        })
        .unzip()
}

/// The `WEFT_OP_*` flags of a completion.
fn op_flags(done: &Completion) -> u32 {
    if done.fence {
        WEFT_OP_FENCE
    } else {
        0
    }
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
            rma_data: Some(sink_rma_data),
            connection: Some(sink_connection),
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
        // The library may use the key-value space until close returns, not after.
        self.kv = None;
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
        let (iov, _) = c_iov(data);
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
        let (iov, _) = c_iov_mut(buf);
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
        let mut bits = access.remote_read as u32
            | (access.remote_write as u32) << 1
            | (access.remote_atomic as u32) << 2;
        // A 1.0 library knows only the remote bits.
        if self.minor >= 1 && access.local_write {
            bits |= WEFT_ACCESS_LOCAL_WRITE;
        }
        let r = (t.reg.expect("checked"))(self.handle, base, len, bits, &mut mr);
        self.check(r, "memory registration", None)?;
        Ok(MemRegion {
            key: mr.key,
            addr: mr.addr,
            len: mr.len as usize,
            handle: mr.handle,
            desc: if self.minor >= 1 { mr.desc } else { mr.handle },
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
            desc: mr.desc,
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
        let (iov, d) = c_iov_mut(local);
        if self.caps.mr_local || done.fence {
            let x = self.ext("RMA read with descriptors or a fence")?;
            let r = (x.read.expect("checked by caps"))(
                self.handle,
                src,
                iov.as_ptr(),
                descs_ptr(self.caps.mr_local, &d),
                iov.len(),
                remote.addr,
                remote.key,
                done.cq.unwrap_or(0),
                done.cntr.unwrap_or(0),
                op_flags(&done),
            );
            return self.check(r, "RMA read", Some(src));
        }
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
        let (iov, d) = c_iov(local);
        if self.caps.mr_local || done.fence {
            let x = self.ext("RMA write with descriptors or a fence")?;
            let r = (x.write.expect("checked by caps"))(
                self.handle,
                dest,
                iov.as_ptr(),
                descs_ptr(self.caps.mr_local, &d),
                iov.len(),
                remote.addr,
                remote.key,
                done.cq.unwrap_or(0),
                done.cntr.unwrap_or(0),
                op_flags(&done),
            );
            return self.check(r, "RMA write", Some(dest));
        }
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
        a: &crate::provider::AtomicOp,
        remote: RemoteAddr,
        done: Completion,
    ) -> Result<()> {
        let t = self
            .atomics
            .ok_or_else(|| Error::from(ErrorDetail::Unsupported("atomics".into())))?;
        if self.caps.mr_local || done.fence {
            if let Some(f) = self.ext.and_then(|x| x.atomic) {
                let r = f(
                    self.handle,
                    dest,
                    a.op as u32,
                    a.ty as u32,
                    a.count,
                    a.origin,
                    a.compare,
                    a.result,
                    descs_ptr(self.caps.mr_local, &a.desc),
                    remote.addr,
                    remote.key,
                    done.cq.unwrap_or(0),
                    done.cntr.unwrap_or(0),
                    op_flags(&done),
                );
                return self.check(r, "atomic", Some(dest));
            }
            if self.caps.mr_local {
                return Err(Error::from(ErrorDetail::Unsupported(format!(
                    "{}: atomics with descriptors need the ABI 1.1 atomic entry",
                    self.name
                ))));
            }
        }
        let r = (t.atomic.expect("checked"))(
            self.handle,
            dest,
            a.op as u32,
            a.ty as u32,
            a.count,
            a.origin,
            a.compare,
            a.result,
            remote.addr,
            remote.key,
            done.cq.unwrap_or(0),
            done.cntr.unwrap_or(0),
        );
        self.check(r, "atomic", Some(dest))
    }

    fn connect(&mut self, peer: Rank) -> Result<()> {
        if !self.caps.lazy_connect {
            return Ok(());
        }
        let f = self.ext("connect")?.connect.expect("checked by caps");
        // SAFETY: the library's function with our instance.
        let r = unsafe { f(self.handle, peer) };
        self.check(r, "connect", Some(peer))
    }

    fn peer_caps(&self, peer: Rank) -> Option<PeerCaps> {
        if !self.caps.per_peer {
            return None;
        }
        let f = self.ext?.peer_caps?;
        let mut w = WeftPeerCaps {
            size: std::mem::size_of::<WeftPeerCaps>() as u32,
            ..Default::default()
        };
        // SAFETY: the library's function with our instance and a valid out pointer.
        if unsafe { f(self.handle, peer, &mut w) } != 1 {
            return None;
        }
        // Each field can only narrow the provider-wide value.
        let wide = PeerCaps::from(&self.caps);
        Some(PeerCaps {
            max_am_payload: (w.max_am_payload as usize).clamp(1, wide.max_am_payload),
            eager_limit: (w.eager_limit as usize).min(wide.eager_limit),
            rma_read: wide.rma_read && w.flags & WEFT_PEER_RMA_READ != 0,
            rma_write: wide.rma_write && w.flags & WEFT_PEER_RMA_WRITE != 0,
            am_isend: wide.am_isend && w.flags & WEFT_PEER_AM_ISEND != 0,
        })
    }

    unsafe fn am_isend(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[RawIov],
        token: Token,
    ) -> Result<SendOutcome> {
        let f = self.ext("am_isend")?.am_isend.ok_or_else(|| {
            Error::from(ErrorDetail::Unsupported(format!(
                "{}: no am_isend",
                self.name
            )))
        })?;
        let (iov, d) = c_iov(payload);
        let r = f(
            self.handle,
            dest,
            header.as_ptr(),
            header.len(),
            iov.as_ptr(),
            descs_ptr(self.caps.mr_local, &d),
            iov.len(),
            token,
        );
        match r {
            WEFT_OK => Ok(SendOutcome::Sent),
            WEFT_BUSY => Ok(SendOutcome::Busy),
            c => Err(self.err(c, "am_isend", Some(dest))),
        }
    }

    unsafe fn rma_write_data(
        &mut self,
        dest: Rank,
        local: &[RawIov],
        remote: RemoteAddr,
        data: u64,
        done: Completion,
    ) -> Result<()> {
        let f = self
            .ext("remote completion data")?
            .write_data
            .ok_or_else(|| {
                Error::from(ErrorDetail::Unsupported(format!(
                    "{}: no write_data",
                    self.name
                )))
            })?;
        let (iov, d) = c_iov(local);
        let r = f(
            self.handle,
            dest,
            iov.as_ptr(),
            descs_ptr(self.caps.mr_local, &d),
            iov.len(),
            remote.addr,
            remote.key,
            data,
            done.cq.unwrap_or(0),
            done.cntr.unwrap_or(0),
            op_flags(&done),
        );
        self.check(r, "RMA write with data", Some(dest))
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
