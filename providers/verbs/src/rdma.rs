// Over 800 lines: the `Hca` implementation on libibverbs, one call per verb.
//! The rdma-core backend: [`Hca`] on a real HCA through libibverbs (`ibverbs-sys`, the raw
//! bindings of the `ibverbs` crate; built with the `rdma-core` cargo feature). The `ibverbs`
//! crate's safe layer covers RC set-up and plain sends, not SRQs, UD address handles, atomics
//! or the send flags the providers need, so this backend speaks the raw calls.
//!
//! A thin translation: each call is the `ibv_*` call of the same name, objects are named by
//! small handles into tables of the raw pointers, and the data-path calls (`post_send`,
//! `post_recv`, `post_srq_recv`, `poll_cq`) go through the context's provider operations as
//! rdma-core's inline functions do. Two choices differ from the soft HCA and are documented in
//! `docs/verbs.md`: `alloc_dm` returns page-aligned host memory (what the providers put their
//! eager rings in; on-device memory is not addressable by the CPU), and the SRQ limit event is
//! read from the context's asynchronous event queue without blocking.
//!
//! Accounting follows the same documented model as the soft HCA (the driver's own figures are
//! not observable); counters count what was posted (no RNR or retry figures: the HCA keeps
//! those in hardware counters).

use crate::hca::{Accounting, Counters, Hca};
use crate::types::*;
use ibverbs_sys as ffi;
use std::collections::{HashMap, HashSet};
use std::ffi::CStr;
use std::os::raw::{c_int, c_void};
use std::sync::{Mutex, MutexGuard};
use weft_provider::{Error, ErrorDetail, Result};

fn os(what: &str) -> Error {
    Error::last_os(format!("rdma-core: {what}"))
}

fn inval(what: impl Into<String>) -> Error {
    Error::invalid(what.into())
}

/// The names of the devices libibverbs offers (empty without RDMA hardware or drivers).
pub fn device_names() -> Vec<String> {
    let mut n: c_int = 0;
    // SAFETY: FFI; returns a NULL-terminated array we free below, or NULL.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Vec::new();
    }
    let mut v = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: `i < n` entries of the array are valid device pointers.
        let d = unsafe { *list.add(i) };
        if d.is_null() {
            break;
        }
        // SAFETY: a valid device; the name is a NUL-terminated string owned by it.
        let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(d)) };
        v.push(name.to_string_lossy().into_owned());
    }
    // SAFETY: the list ibv_get_device_list returned.
    unsafe { ffi::ibv_free_device_list(list) };
    v
}

struct QpEntry {
    qp: *mut ffi::ibv_qp,
    ty: QpType,
    cap: QpCap,
    srq: bool,
}

#[derive(Default)]
struct Tables {
    pds: HashMap<u32, *mut ffi::ibv_pd>,
    mrs: HashMap<u32, (*mut ffi::ibv_mr, u64)>,
    cqs: HashMap<u32, (*mut ffi::ibv_cq, u32)>,
    qps: HashMap<u32, QpEntry>,
    srqs: HashMap<u32, (*mut ffi::ibv_srq, u32, u32)>,
    ahs: HashMap<u32, *mut ffi::ibv_ah>,
    dms: HashMap<u32, (*mut u8, usize)>,
    /// SRQs whose limit event arrived.
    srq_fired: HashSet<usize>,
    next: u32,
    acct: Accounting,
    ctr: Counters,
}

impl Tables {
    fn handle(&mut self) -> u32 {
        self.next += 1;
        self.next
    }
}

/// An opened rdma-core device (port 1, GID index 0).
pub struct RdmaHca {
    ctx: *mut ffi::ibv_context,
    attr: DeviceAttr,
    gid: Gid,
    lid: u16,
    t: Mutex<Tables>,
}

// SAFETY: libibverbs objects may be used from any thread (the library and its providers lock
// internally); the tables of pointers are behind a mutex.
unsafe impl Send for RdmaHca {}
// SAFETY: as above.
unsafe impl Sync for RdmaHca {}

const PORT: u8 = 1;

impl RdmaHca {
    /// Open device `name`.
    pub fn open(name: &str) -> Result<RdmaHca> {
        let mut n: c_int = 0;
        // SAFETY: as in device_names.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(Error::from(ErrorDetail::Unsupported(
                "no RDMA device (libibverbs lists none)".into(),
            )));
        }
        let mut ctx = std::ptr::null_mut();
        for i in 0..n.max(0) as usize {
            // SAFETY: valid entries of the list.
            let d = unsafe { *list.add(i) };
            // SAFETY: a valid device and its name.
            let dn = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(d)) };
            if dn.to_string_lossy() == name {
                // SAFETY: opening a listed device; NULL on failure.
                ctx = unsafe { ffi::ibv_open_device(d) };
                break;
            }
        }
        // SAFETY: the list we got; an opened context stays valid after freeing it.
        unsafe { ffi::ibv_free_device_list(list) };
        if ctx.is_null() {
            return Err(Error::from(ErrorDetail::Unsupported(format!(
                "no RDMA device '{name}' could be opened"
            ))));
        }
        // SAFETY: zeroed plain-data out-structs filled by the queries on our open context.
        let mut da: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut pa: ffi::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut g: ffi::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: our context and out-structs; the port query takes the compat layout, a
        // prefix of ibv_port_attr.
        let ok = unsafe {
            ffi::ibv_query_device(ctx, &mut da) == 0
                && ffi::ibv_query_port(ctx, PORT, &mut pa as *mut _ as *mut _) == 0
                && ffi::ibv_query_gid(ctx, PORT, 0, &mut g) == 0
        };
        if !ok {
            let e = os("querying the device");
            // SAFETY: closing the context we opened.
            unsafe { ffi::ibv_close_device(ctx) };
            return Err(e);
        }
        // The asynchronous events (SRQ limit) are read without blocking.
        // SAFETY: fcntl on the context's own descriptor.
        unsafe {
            let fd = (*ctx).async_fd;
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        let atomic_cap = match da.atomic_cap {
            ffi::IBV_ATOMIC_HCA => AtomicCap::Hca,
            ffi::IBV_ATOMIC_GLOB => AtomicCap::Glob,
            _ => AtomicCap::None,
        };
        let mtu = match pa.active_mtu {
            1 => Mtu::M256,
            2 => Mtu::M512,
            3 => Mtu::M1024,
            5 => Mtu::M4096,
            _ => Mtu::M2048,
        };
        let u = |v: c_int| v.max(0) as u32;
        let attr = DeviceAttr {
            name: name.to_string(),
            kind: "rdma-core",
            max_qp: u(da.max_qp),
            max_qp_wr: u(da.max_qp_wr),
            max_sge: u(da.max_sge),
            max_cq: u(da.max_cq),
            max_cqe: u(da.max_cqe),
            max_mr: u(da.max_mr),
            max_mr_size: da.max_mr_size,
            max_pd: u(da.max_pd),
            max_srq: u(da.max_srq),
            max_srq_wr: u(da.max_srq_wr),
            max_qp_rd_atom: u(da.max_qp_rd_atom),
            // Not reported by the device; mlx5 supports this much on RC and UD.
            max_inline_data: 256,
            atomic_cap,
            active_mtu: mtu,
            max_dm_size: 1 << 30,
        };
        // SAFETY: the union's raw view is always valid.
        let gid = Gid(unsafe { g.raw });
        Ok(RdmaHca {
            ctx,
            attr,
            gid,
            lid: pa.lid,
            t: Mutex::new(Tables::default()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Tables> {
        self.t.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Read pending asynchronous events (without blocking); note SRQ limit events.
    fn drain_events(&self, t: &mut Tables) {
        loop {
            // SAFETY: zeroed out-struct; the descriptor is non-blocking, so this returns at once.
            let mut ev: ffi::ibv_async_event = unsafe { std::mem::zeroed() };
            // SAFETY: our context.
            if unsafe { ffi::ibv_get_async_event(self.ctx, &mut ev) } != 0 {
                return;
            }
            if ev.event_type == ffi::IBV_EVENT_SRQ_LIMIT_REACHED {
                // SAFETY: for this event type the element is the SRQ.
                t.srq_fired.insert(unsafe { ev.element.srq } as usize);
            }
            // SAFETY: every event read is acknowledged once.
            unsafe { ffi::ibv_ack_async_event(&mut ev) };
        }
    }
}

impl Drop for RdmaHca {
    fn drop(&mut self) {
        let t = self.t.get_mut().unwrap_or_else(|p| p.into_inner());
        // SAFETY: destroying what we created, dependents first; nothing else uses them.
        unsafe {
            for (_, a) in t.ahs.drain() {
                ffi::ibv_destroy_ah(a);
            }
            for (_, q) in t.qps.drain() {
                ffi::ibv_destroy_qp(q.qp);
            }
            for (_, s) in t.srqs.drain() {
                ffi::ibv_destroy_srq(s.0);
            }
            for (_, c) in t.cqs.drain() {
                ffi::ibv_destroy_cq(c.0);
            }
            for (_, m) in t.mrs.drain() {
                ffi::ibv_dereg_mr(m.0);
            }
            for (_, d) in t.dms.drain() {
                libc::munmap(d.0 as *mut c_void, d.1);
            }
            for (_, p) in t.pds.drain() {
                ffi::ibv_dealloc_pd(p);
            }
            ffi::ibv_close_device(self.ctx);
        }
    }
}

fn sges(v: &[Sge]) -> smallvec::SmallVec<[ffi::ibv_sge; 4]> {
    v.iter()
        .map(|s| ffi::ibv_sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        })
        .collect()
}

impl Hca for RdmaHca {
    fn attr(&self) -> &DeviceAttr {
        &self.attr
    }

    fn gid(&self) -> Gid {
        self.gid
    }

    fn lid(&self) -> u16 {
        self.lid
    }

    fn alloc_pd(&self) -> Result<Pd> {
        // SAFETY: our context.
        let p = unsafe { ffi::ibv_alloc_pd(self.ctx) };
        if p.is_null() {
            return Err(os("ibv_alloc_pd"));
        }
        let mut t = self.lock();
        let h = t.handle();
        t.pds.insert(h, p);
        Ok(Pd(h))
    }

    fn dealloc_pd(&self, pd: Pd) -> Result<()> {
        let mut t = self.lock();
        let p = *t
            .pds
            .get(&pd.0)
            .ok_or_else(|| inval("dealloc_pd: no such PD"))?;
        // SAFETY: a PD we allocated; the library refuses (EBUSY) while objects use it.
        if unsafe { ffi::ibv_dealloc_pd(p) } != 0 {
            return Err(os("ibv_dealloc_pd"));
        }
        t.pds.remove(&pd.0);
        Ok(())
    }

    unsafe fn reg_mr(&self, pd: Pd, addr: *mut u8, len: usize, access: Access) -> Result<Mr> {
        let mut t = self.lock();
        let p = *t
            .pds
            .get(&pd.0)
            .ok_or_else(|| inval("reg_mr: no such PD"))?;
        // SAFETY: the caller keeps the memory alive and unreferenced as the trait requires.
        let m = unsafe { ffi::ibv_reg_mr(p, addr as *mut c_void, len, access.0 as c_int) };
        if m.is_null() {
            return Err(os("ibv_reg_mr"));
        }
        let h = t.handle();
        let bytes = crate::soft::model::mr_bytes(addr as u64, len);
        t.acct.mrs += 1;
        t.acct.mr_bytes += bytes;
        t.mrs.insert(h, (m, bytes));
        // SAFETY: a valid MR the library returned.
        let (lkey, rkey) = unsafe { ((*m).lkey, (*m).rkey) };
        Ok(Mr {
            handle: h,
            lkey,
            rkey,
            addr: addr as u64,
            len,
        })
    }

    fn dereg_mr(&self, mr: Mr) -> Result<()> {
        let mut t = self.lock();
        let (m, bytes) = *t
            .mrs
            .get(&mr.handle)
            .ok_or_else(|| inval("dereg_mr: no such MR"))?;
        // SAFETY: an MR we registered; the HCA stops using it when this returns.
        if unsafe { ffi::ibv_dereg_mr(m) } != 0 {
            return Err(os("ibv_dereg_mr"));
        }
        t.mrs.remove(&mr.handle);
        t.acct.mrs -= 1;
        t.acct.mr_bytes -= bytes;
        Ok(())
    }

    fn alloc_dm(&self, len: usize) -> Result<Dm> {
        let len = len.max(1).div_ceil(4096) * 4096;
        // SAFETY: a fresh anonymous private mapping (zeroed), unmapped in free_dm or drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os("allocating host memory for alloc_dm"));
        }
        let mut t = self.lock();
        let h = t.handle();
        t.dms.insert(h, (p as *mut u8, len));
        t.acct.dm_bytes += len as u64;
        Ok(Dm {
            handle: h,
            ptr: p as *mut u8,
            len,
        })
    }

    fn free_dm(&self, dm: Dm) -> Result<()> {
        let mut t = self.lock();
        let (p, len) = *t
            .dms
            .get(&dm.handle)
            .ok_or_else(|| inval("free_dm: no such DM"))?;
        let (lo, hi) = (p as u64, p as u64 + len as u64);
        for (m, _) in t.mrs.values() {
            // SAFETY: a live MR of ours.
            let a = unsafe { (**m).addr } as u64;
            if a >= lo && a < hi {
                return Err(inval("free_dm: an MR still covers it"));
            }
        }
        t.dms.remove(&dm.handle);
        t.acct.dm_bytes -= len as u64;
        // SAFETY: the mapping alloc_dm made; no MR covers it any more.
        unsafe { libc::munmap(p as *mut c_void, len) };
        Ok(())
    }

    fn create_cq(&self, cqe: u32) -> Result<Cq> {
        // SAFETY: our context; no channel.
        let c = unsafe {
            ffi::ibv_create_cq(
                self.ctx,
                cqe as c_int,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if c.is_null() {
            return Err(os("ibv_create_cq"));
        }
        let mut t = self.lock();
        let h = t.handle();
        t.cqs.insert(h, (c, cqe));
        t.acct.cqs += 1;
        t.acct.cq_bytes += crate::soft::model::cq_bytes(cqe);
        Ok(Cq(h))
    }

    fn destroy_cq(&self, cq: Cq) -> Result<()> {
        let mut t = self.lock();
        let (c, n) = *t
            .cqs
            .get(&cq.0)
            .ok_or_else(|| inval("destroy_cq: no such CQ"))?;
        // SAFETY: a CQ we created; the library refuses while QPs use it.
        if unsafe { ffi::ibv_destroy_cq(c) } != 0 {
            return Err(os("ibv_destroy_cq"));
        }
        t.cqs.remove(&cq.0);
        t.acct.cqs -= 1;
        t.acct.cq_bytes -= crate::soft::model::cq_bytes(n);
        Ok(())
    }

    fn poll_cq(&self, cq: Cq, out: &mut [Wc]) -> Result<usize> {
        let c = self
            .lock()
            .cqs
            .get(&cq.0)
            .map(|x| x.0)
            .ok_or_else(|| inval("poll_cq: no such CQ"))?;
        let mut raw: [ffi::ibv_wc; 16] = Default::default();
        let want = out.len().min(raw.len());
        // SAFETY: the provider's poll_cq of the CQ's context (what ibv_poll_cq inlines), into
        // `want` entries of our array.
        let n = unsafe {
            let ctx = (*c).context;
            match (*ctx).ops.poll_cq {
                Some(f) => f(c, want as c_int, raw.as_mut_ptr()),
                None => -1,
            }
        };
        if n < 0 {
            return Err(os("ibv_poll_cq (CQ error)"));
        }
        let mut t = self.lock();
        for (w, o) in raw[..n as usize].iter().zip(out.iter_mut()) {
            let status = match w.error() {
                None => WcStatus::Success,
                Some((s, _)) => WcStatus::from_u32(s).unwrap_or(WcStatus::GeneralErr),
            };
            let opcode = WcOpcode::from_u32(w.opcode()).unwrap_or(WcOpcode::Send);
            *o = Wc {
                wr_id: w.wr_id(),
                status,
                opcode,
                byte_len: w.len() as u32,
                imm: w.imm_data().map(u32::from_be),
                qp_num: w.qp_num,
                src_qp: w.src_qp,
                grh: w.wc_flags.0 & ffi::ibv_wc_flags::IBV_WC_GRH.0 != 0,
            };
            if o.opcode == WcOpcode::Recv || o.opcode == WcOpcode::RecvRdmaWithImm {
                t.acct.posted_recvs = t.acct.posted_recvs.saturating_sub(1);
            }
        }
        Ok(n as usize)
    }

    fn create_srq(&self, pd: Pd, max_wr: u32, max_sge: u32) -> Result<Srq> {
        let mut t = self.lock();
        let p = *t
            .pds
            .get(&pd.0)
            .ok_or_else(|| inval("create_srq: no such PD"))?;
        let mut a = ffi::ibv_srq_init_attr {
            srq_context: std::ptr::null_mut(),
            attr: ffi::ibv_srq_attr {
                max_wr,
                max_sge,
                srq_limit: 0,
            },
        };
        // SAFETY: our PD and an initialised attribute struct.
        let s = unsafe { ffi::ibv_create_srq(p, &mut a) };
        if s.is_null() {
            return Err(os("ibv_create_srq"));
        }
        let h = t.handle();
        t.srqs.insert(h, (s, max_wr, max_sge));
        t.acct.srqs += 1;
        t.acct.srq_bytes += crate::soft::model::srq_bytes(max_wr, max_sge);
        Ok(Srq(h))
    }

    fn destroy_srq(&self, srq: Srq) -> Result<()> {
        let mut t = self.lock();
        let (s, w, g) = *t.srqs.get(&srq.0).ok_or_else(|| inval("no such SRQ"))?;
        // SAFETY: an SRQ we created; the library refuses while QPs use it.
        if unsafe { ffi::ibv_destroy_srq(s) } != 0 {
            return Err(os("ibv_destroy_srq"));
        }
        t.srqs.remove(&srq.0);
        t.srq_fired.remove(&(s as usize));
        t.acct.srqs -= 1;
        t.acct.srq_bytes -= crate::soft::model::srq_bytes(w, g);
        Ok(())
    }

    fn arm_srq_limit(&self, srq: Srq, limit: u32) -> Result<()> {
        let mut t = self.lock();
        let s = t.srqs.get(&srq.0).ok_or_else(|| inval("no such SRQ"))?.0;
        let mut a = ffi::ibv_srq_attr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: limit,
        };
        // SAFETY: our SRQ; only the limit is modified.
        if unsafe { ffi::ibv_modify_srq(s, &mut a, ffi::IBV_SRQ_LIMIT as c_int) } != 0 {
            return Err(os("ibv_modify_srq"));
        }
        t.srq_fired.remove(&(s as usize));
        Ok(())
    }

    fn srq_limit_reached(&self, srq: Srq) -> Result<bool> {
        let mut t = self.lock();
        let s = t.srqs.get(&srq.0).ok_or_else(|| inval("no such SRQ"))?.0;
        self.drain_events(&mut t);
        Ok(t.srq_fired.remove(&(s as usize)))
    }

    fn post_srq_recv(&self, srq: Srq, wrs: &[RecvWr]) -> Result<()> {
        let mut t = self.lock();
        let s = t.srqs.get(&srq.0).ok_or_else(|| inval("no such SRQ"))?.0;
        post_recvs(wrs, |wr, bad| {
            // SAFETY: the provider's post_srq_recv of our SRQ's context, as ibv_post_srq_recv
            // inlines it; the chain and its SGE arrays live until it returns.
            unsafe {
                match (*(*s).context).ops.post_srq_recv {
                    Some(f) => f(s, wr, bad),
                    None => libc::EOPNOTSUPP,
                }
            }
        })?;
        t.acct.posted_recvs += wrs.len() as u64;
        Ok(())
    }

    fn create_qp(&self, pd: Pd, init: &QpInitAttr) -> Result<Qp> {
        let mut t = self.lock();
        let p = *t
            .pds
            .get(&pd.0)
            .ok_or_else(|| inval("create_qp: no such PD"))?;
        let cq = |c: Cq| {
            t.cqs
                .get(&c.0)
                .map(|x| x.0)
                .ok_or_else(|| inval("no such CQ"))
        };
        let (scq, rcq) = (cq(init.send_cq)?, cq(init.recv_cq)?);
        let srq = match init.srq {
            Some(s) => t.srqs.get(&s.0).ok_or_else(|| inval("no such SRQ"))?.0,
            None => std::ptr::null_mut(),
        };
        let mut a = ffi::ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: scq,
            recv_cq: rcq,
            srq,
            cap: ffi::ibv_qp_cap {
                max_send_wr: init.cap.max_send_wr,
                max_recv_wr: init.cap.max_recv_wr,
                max_send_sge: init.cap.max_send_sge,
                max_recv_sge: init.cap.max_recv_sge,
                max_inline_data: init.cap.max_inline_data,
            },
            qp_type: init.qp_type as u32,
            sq_sig_all: init.sq_sig_all as c_int,
        };
        // SAFETY: our PD, CQs and SRQ, and an initialised attribute struct.
        let q = unsafe { ffi::ibv_create_qp(p, &mut a) };
        if q.is_null() {
            return Err(os("ibv_create_qp"));
        }
        let cap = QpCap {
            max_send_wr: a.cap.max_send_wr,
            max_recv_wr: a.cap.max_recv_wr,
            max_send_sge: a.cap.max_send_sge,
            max_recv_sge: a.cap.max_recv_sge,
            max_inline_data: a.cap.max_inline_data,
        };
        let ud = init.qp_type == QpType::Ud;
        let bytes = crate::soft::model::qp_bytes(ud, &cap, init.srq.is_some());
        if ud {
            t.acct.ud_qps += 1;
            t.acct.ud_qp_bytes += bytes;
        } else {
            t.acct.rc_qps += 1;
            t.acct.rc_qp_bytes += bytes;
        }
        let h = t.handle();
        // SAFETY: a valid QP.
        let qpn = unsafe { (*q).qp_num };
        t.qps.insert(
            h,
            QpEntry {
                qp: q,
                ty: init.qp_type,
                cap,
                srq: init.srq.is_some(),
            },
        );
        Ok(Qp { handle: h, qpn })
    }

    fn modify_qp(&self, qp: Qp, at: &QpAttr) -> Result<()> {
        let t = self.lock();
        let q = t.qps.get(&qp.handle).ok_or_else(|| inval("no such QP"))?.qp;
        // SAFETY: a plain-data struct; zero is a valid value of every field.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        let mut mask = 0u32;
        let mut set = |m: ffi::ibv_qp_attr_mask| mask |= m.0;
        use ffi::ibv_qp_attr_mask as M;
        if let Some(s) = at.qp_state {
            a.qp_state = s as u32;
            set(M::IBV_QP_STATE);
        }
        if let Some(v) = at.qp_access_flags {
            a.qp_access_flags = v.0;
            set(M::IBV_QP_ACCESS_FLAGS);
        }
        if let Some(v) = at.pkey_index {
            a.pkey_index = v;
            set(M::IBV_QP_PKEY_INDEX);
        }
        if let Some(v) = at.port_num {
            a.port_num = v;
            set(M::IBV_QP_PORT);
        }
        if let Some(v) = at.qkey {
            a.qkey = v;
            set(M::IBV_QP_QKEY);
        }
        if let Some(v) = at.path_mtu {
            a.path_mtu = v as u32;
            set(M::IBV_QP_PATH_MTU);
        }
        if let Some(ah) = at.ah_attr {
            a.ah_attr = ah_attr(&ah);
            set(M::IBV_QP_AV);
        }
        if let Some(v) = at.dest_qp_num {
            a.dest_qp_num = v;
            set(M::IBV_QP_DEST_QPN);
        }
        if let Some(v) = at.rq_psn {
            a.rq_psn = v;
            set(M::IBV_QP_RQ_PSN);
        }
        if let Some(v) = at.sq_psn {
            a.sq_psn = v;
            set(M::IBV_QP_SQ_PSN);
        }
        if let Some(v) = at.max_dest_rd_atomic {
            a.max_dest_rd_atomic = v;
            set(M::IBV_QP_MAX_DEST_RD_ATOMIC);
        }
        if let Some(v) = at.max_rd_atomic {
            a.max_rd_atomic = v;
            set(M::IBV_QP_MAX_QP_RD_ATOMIC);
        }
        if let Some(v) = at.min_rnr_timer {
            a.min_rnr_timer = v;
            set(M::IBV_QP_MIN_RNR_TIMER);
        }
        if let Some(v) = at.timeout {
            a.timeout = v;
            set(M::IBV_QP_TIMEOUT);
        }
        if let Some(v) = at.retry_cnt {
            a.retry_cnt = v;
            set(M::IBV_QP_RETRY_CNT);
        }
        if let Some(v) = at.rnr_retry {
            a.rnr_retry = v;
            set(M::IBV_QP_RNR_RETRY);
        }
        // SAFETY: our QP, an initialised attribute struct and the mask of what is set.
        let r = unsafe { ffi::ibv_modify_qp(q, &mut a, mask as c_int) };
        if r != 0 {
            return Err(Error::invalid(format!(
                "ibv_modify_qp: {}",
                std::io::Error::from_raw_os_error(r)
            )));
        }
        Ok(())
    }

    fn query_qp_state(&self, qp: Qp) -> Result<QpState> {
        let t = self.lock();
        let q = t.qps.get(&qp.handle).ok_or_else(|| inval("no such QP"))?.qp;
        // SAFETY: plain-data out-structs.
        let mut a: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut i: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: our QP and out-structs.
        let r = unsafe {
            ffi::ibv_query_qp(
                q,
                &mut a,
                ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int,
                &mut i,
            )
        };
        if r != 0 {
            return Err(os("ibv_query_qp"));
        }
        Ok(QpState::from_u32(a.qp_state).unwrap_or(QpState::Err))
    }

    fn query_qp_cap(&self, qp: Qp) -> Result<QpCap> {
        let t = self.lock();
        Ok(t.qps
            .get(&qp.handle)
            .ok_or_else(|| inval("no such QP"))?
            .cap)
    }

    fn destroy_qp(&self, qp: Qp) -> Result<()> {
        let mut t = self.lock();
        let e = t.qps.get(&qp.handle).ok_or_else(|| inval("no such QP"))?;
        // SAFETY: a QP we created.
        if unsafe { ffi::ibv_destroy_qp(e.qp) } != 0 {
            return Err(os("ibv_destroy_qp"));
        }
        let bytes = crate::soft::model::qp_bytes(e.ty == QpType::Ud, &e.cap, e.srq);
        if e.ty == QpType::Ud {
            t.acct.ud_qps -= 1;
            t.acct.ud_qp_bytes -= bytes;
        } else {
            t.acct.rc_qps -= 1;
            t.acct.rc_qp_bytes -= bytes;
        }
        t.qps.remove(&qp.handle);
        Ok(())
    }

    fn create_ah(&self, pd: Pd, attr: &AhAttr) -> Result<Ah> {
        let mut t = self.lock();
        let p = *t
            .pds
            .get(&pd.0)
            .ok_or_else(|| inval("create_ah: no such PD"))?;
        let mut a = ah_attr(attr);
        // SAFETY: our PD and an initialised address vector.
        let ah = unsafe { ffi::ibv_create_ah(p, &mut a) };
        if ah.is_null() {
            return Err(os("ibv_create_ah"));
        }
        let h = t.handle();
        t.ahs.insert(h, ah);
        Ok(Ah(h))
    }

    fn destroy_ah(&self, ah: Ah) -> Result<()> {
        let mut t = self.lock();
        let a = t
            .ahs
            .remove(&ah.0)
            .ok_or_else(|| inval("destroy_ah: no such AH"))?;
        // SAFETY: an AH we created.
        unsafe { ffi::ibv_destroy_ah(a) };
        Ok(())
    }

    fn post_send(&self, qp: Qp, wrs: &[SendWr]) -> Result<()> {
        let mut t = self.lock();
        let e = t.qps.get(&qp.handle).ok_or_else(|| inval("no such QP"))?;
        let (q, ud) = (e.qp, e.ty == QpType::Ud);
        let lists: Vec<_> = wrs.iter().map(|w| sges(&w.sg_list)).collect();
        let mut raw: Vec<ffi::ibv_send_wr> = Vec::with_capacity(wrs.len());
        for (w, sl) in wrs.iter().zip(&lists) {
            // SAFETY: a plain-data struct; zero is valid for every field.
            let mut r: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
            r.wr_id = w.wr_id;
            r.sg_list = sl.as_ptr() as *mut _;
            r.num_sge = sl.len() as c_int;
            r.opcode = w.opcode as u32;
            let mut flags = 0u32;
            if w.signaled {
                flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if w.is_inline() {
                flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
            }
            r.send_flags = flags;
            r.__bindgen_anon_1.imm_data = w.imm.to_be();
            if ud {
                let d =
                    w.ud.ok_or_else(|| inval("post_send: a UD send needs a destination"))?;
                let ah = *t
                    .ahs
                    .get(&d.ah.0)
                    .ok_or_else(|| inval("post_send: no such AH"))?;
                r.wr.ud = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_3 {
                    ah,
                    remote_qpn: d.remote_qpn,
                    remote_qkey: d.remote_qkey,
                };
            } else if w.opcode.is_atomic() {
                r.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                    remote_addr: w.remote_addr,
                    compare_add: w.compare_add,
                    swap: w.swap,
                    rkey: w.rkey,
                };
            } else {
                r.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                    remote_addr: w.remote_addr,
                    rkey: w.rkey,
                };
            }
            raw.push(r);
        }
        let base = raw.as_mut_ptr();
        for i in 1..raw.len() {
            // SAFETY: linking element i-1 to i of the same vector.
            unsafe { (*base.add(i - 1)).next = base.add(i) };
        }
        if raw.is_empty() {
            return Ok(());
        }
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the provider's post_send of our QP's context (as ibv_post_send inlines it);
        // the chain and SGE arrays live until it returns (the HCA copies the descriptors).
        let r = unsafe {
            match (*(*q).context).ops.post_send {
                Some(f) => f(q, base, &mut bad),
                None => libc::EOPNOTSUPP,
            }
        };
        if r != 0 {
            // SAFETY: on failure `bad` points into our chain.
            let idx = if bad.is_null() {
                0
            } else {
                unsafe { bad.offset_from(base) }.max(0) as usize
            };
            return Err(Error::invalid(format!(
                "post_send: work request {idx} refused: {}",
                std::io::Error::from_raw_os_error(r)
            )));
        }
        for w in wrs {
            let i = WR_OPCODES.iter().position(|o| *o == w.opcode).unwrap_or(0);
            t.ctr.ops[i] += 1;
            let len = w.len();
            t.ctr.payload_bytes += len as u64;
            let (pk, b) = crate::soft::model::wire(w.opcode, len, self.attr.active_mtu.bytes(), ud);
            t.ctr.packets += pk;
            t.ctr.wire_bytes += b;
        }
        Ok(())
    }

    fn post_recv(&self, qp: Qp, wrs: &[RecvWr]) -> Result<()> {
        let mut t = self.lock();
        let q = t.qps.get(&qp.handle).ok_or_else(|| inval("no such QP"))?.qp;
        post_recvs(wrs, |wr, bad| {
            // SAFETY: the provider's post_recv of our QP's context, as ibv_post_recv inlines
            // it; the chain and its SGE arrays live until it returns.
            unsafe {
                match (*(*q).context).ops.post_recv {
                    Some(f) => f(q, wr, bad),
                    None => libc::EOPNOTSUPP,
                }
            }
        })?;
        t.acct.posted_recvs += wrs.len() as u64;
        Ok(())
    }

    fn accounting(&self) -> Accounting {
        self.lock().acct
    }

    fn counters(&self) -> Counters {
        self.lock().ctr.clone()
    }
}

/// Build the receive chain for `wrs` and hand it to `post`.
fn post_recvs(
    wrs: &[RecvWr],
    post: impl FnOnce(*mut ffi::ibv_recv_wr, *mut *mut ffi::ibv_recv_wr) -> c_int,
) -> Result<()> {
    if wrs.is_empty() {
        return Ok(());
    }
    let lists: Vec<_> = wrs.iter().map(|w| sges(&w.sg_list)).collect();
    let mut raw: Vec<ffi::ibv_recv_wr> = wrs
        .iter()
        .zip(&lists)
        .map(|(w, sl)| ffi::ibv_recv_wr {
            wr_id: w.wr_id,
            next: std::ptr::null_mut(),
            sg_list: sl.as_ptr() as *mut _,
            num_sge: sl.len() as c_int,
        })
        .collect();
    let base = raw.as_mut_ptr();
    for i in 1..raw.len() {
        // SAFETY: linking element i-1 to i of the same vector.
        unsafe { (*base.add(i - 1)).next = base.add(i) };
    }
    let mut bad = std::ptr::null_mut();
    let r = post(base, &mut bad);
    if r != 0 {
        return Err(Error::invalid(format!(
            "post_recv refused: {}",
            std::io::Error::from_raw_os_error(r)
        )));
    }
    Ok(())
}

/// An address vector: global routing (GRH) when the destination has a GID (RoCE needs it;
/// on InfiniBand the LID routes and a zero GID means local).
fn ah_attr(a: &AhAttr) -> ffi::ibv_ah_attr {
    // SAFETY: a plain-data struct; zero is valid for every field.
    let mut r: ffi::ibv_ah_attr = unsafe { std::mem::zeroed() };
    r.dlid = a.dlid;
    r.port_num = if a.port_num == 0 { PORT } else { a.port_num };
    if a.dgid.0 != [0; 16] {
        r.is_global = 1;
        r.grh.dgid = ffi::ibv_gid { raw: a.dgid.0 };
        r.grh.sgid_index = 0;
        r.grh.hop_limit = 64;
    }
    r
}
