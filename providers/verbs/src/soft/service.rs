//! The responder side of the wire: what an HCA's service thread does with each packet that
//! arrives from another host (the packets and the requester side are in [`super::wire`]).
//!
//! Anyone who can reach the service's UDP port can send it anything, so [`Service`] trusts no
//! field of a packet beyond what it checks here, and what a sender can make it hold is bounded:
//! - a request claims a source GID, and the GID names the address of its HCA's wire service;
//!   a request whose UDP source address is not that address is dropped (a host cannot speak
//!   for another host's HCA);
//! - a reassembly is held to the header of its first fragment: every later fragment must carry
//!   the same header, come next in order and fit the announced length;
//! - reassemblies and read results kept for fetching count against one budget
//!   ([`BUDGET`], counted as they are admitted, not summed per packet) and are dropped after
//!   [`KEEP`]; a request that would exceed the budget is dropped, which the requester sees as
//!   a lost packet (it retries, then completes with a retry-exceeded error).
//!
//! [`Service::on_packet`] does no I/O of its own (answers go through the `send` it is given), so
//! tests and the fuzz target drive it with sequences of packets directly.

use super::exec::{self, Outcome, Peer, Request};
use super::seg;
use super::wire::{grh, Msg, Reply, ReqHdr, CHUNK, MAX_MSG};
use crate::types::*;
use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft_provider::cma::Range;

/// Bytes of reassemblies and read results the service keeps at most, together.
pub const BUDGET: usize = 2 * MAX_MSG;
/// How long the service keeps an unfinished reassembly or an unfetched read result.
pub const KEEP: Duration = Duration::from_secs(5);
/// How often kept state is looked at for expiry (not on every packet: that walk would be the
/// sender's to make long).
const SWEEP: Duration = Duration::from_millis(100);

type Key = (SocketAddr, u64);

/// Where answers go: (exchange id, answer, fragment, total, data).
type Answer<'a> = dyn FnMut(u64, Reply, u16, u32, &[u8]) + 'a;

/// A message arriving in fragments: its first fragment's header, what came so far.
struct Asm {
    hdr: ReqHdr,
    buf: Vec<u8>,
    next: usize,
    at: Instant,
}

/// Counters the HCA reads while the service runs.
#[derive(Default)]
pub struct Stats {
    /// UD datagrams dropped (no receive, wrong qkey, ...).
    pub dropped: AtomicU64,
    /// Requests executed (RC answered, UD delivered).
    pub served: AtomicU64,
    /// Packets refused before execution: malformed, from an address that is not the claimed
    /// HCA's, contradicting their reassembly, or over the budget.
    pub refused: AtomicU64,
    /// Bytes held now in reassemblies and read results.
    pub held: AtomicU64,
}

/// The responder of one HCA for requests from other hosts.
pub struct Service {
    me: Peer,
    asm: HashMap<Key, Asm>,
    reads: HashMap<Key, (Vec<u8>, Instant)>,
    /// Bytes admitted into `asm` and `reads` (their announced lengths).
    held: usize,
    budget: usize,
    swept: Instant,
    tx: Vec<u8>,
    stats: Arc<Stats>,
}

impl Service {
    /// A responder for the segment `me` maps, holding at most `budget` bytes.
    pub fn new(me: Peer, budget: usize, stats: Arc<Stats>) -> Service {
        Service {
            me,
            asm: HashMap::new(),
            reads: HashMap::new(),
            held: 0,
            budget,
            swept: Instant::now(),
            tx: Vec::with_capacity(CHUNK + 64),
            stats,
        }
    }

    /// Bytes held now (reassemblies and read results).
    pub fn held(&self) -> usize {
        self.held
    }

    /// Requests executed, and packets refused before execution, so far.
    pub fn served_refused(&self) -> (u64, u64) {
        (
            self.stats.served.load(Ordering::Relaxed),
            self.stats.refused.load(Ordering::Relaxed),
        )
    }

    fn refuse(&self) {
        self.stats.refused.fetch_add(1, Ordering::Relaxed);
    }

    fn publish(&self) {
        self.stats.held.store(self.held as u64, Ordering::Relaxed);
    }

    fn sweep(&mut self, now: Instant) {
        if now.duration_since(self.swept) < SWEEP {
            return;
        }
        self.swept = now;
        let mut freed = 0;
        self.asm.retain(|_, a| {
            let keep = now.duration_since(a.at) < KEEP;
            if !keep {
                freed += a.hdr.len as usize;
            }
            keep
        });
        self.reads.retain(|_, r| {
            let keep = now.duration_since(r.1) < KEEP;
            if !keep {
                freed += r.0.len();
            }
            keep
        });
        self.held -= freed;
    }

    /// Take one packet from `from`; answers go to `send` (addressed to `from`).
    pub fn on_packet(
        &mut self,
        from: SocketAddr,
        pkt: &[u8],
        now: Instant,
        send: &mut dyn FnMut(&[u8]),
    ) {
        let Ok(m) = Msg::decode(pkt) else {
            tracing::debug!(target: "weft::verbs", "soft HCA wire: dropped a malformed packet from {from}");
            self.refuse();
            return;
        };
        // A muted or closed HCA answers nothing, as a hung node would not.
        if !self.me.responsive(false) {
            return;
        }
        self.sweep(now);
        let mut tx = std::mem::take(&mut self.tx);
        let mut reply = |xid: u64, r: Reply, frag: u16, total: u32, data: &[u8]| {
            tx.clear();
            Msg::Resp {
                xid,
                reply: r,
                frag,
                total,
                data,
            }
            .encode(&mut tx);
            send(&tx);
        };
        match m {
            Msg::More { xid, frag } => {
                if let Some((b, _)) = self.reads.get(&(from, xid)) {
                    let off = frag as usize * CHUNK;
                    if off < b.len() {
                        let end = (off + CHUNK).min(b.len());
                        let done = end == b.len();
                        reply(xid, Reply::FragOk, frag, b.len() as u32, &b[off..end]);
                        if done {
                            if let Some((b, _)) = self.reads.remove(&(from, xid)) {
                                self.held -= b.len();
                            }
                        }
                    }
                }
            }
            Msg::Resp { .. } => {}
            Msg::Req {
                xid,
                hdr,
                frag,
                data,
            } => {
                if !from_claimed_host(&hdr.src_gid, from) {
                    self.refuse();
                } else {
                    self.request(from, xid, hdr, frag, data, now, &mut reply);
                }
            }
        }
        self.tx = tx;
        self.publish();
    }

    #[allow(clippy::too_many_arguments)]
    fn request(
        &mut self,
        from: SocketAddr,
        xid: u64,
        hdr: ReqHdr,
        frag: u16,
        data: &[u8],
        now: Instant,
        reply: &mut Answer,
    ) {
        let nf = hdr.frags();
        let key = (from, xid);
        let payload: std::borrow::Cow<[u8]> = if nf == 1 {
            std::borrow::Cow::Borrowed(data)
        } else {
            if !self.asm.contains_key(&key) {
                let len = hdr.len as usize;
                if frag != 0 || self.held + len > self.budget {
                    self.refuse();
                    return;
                }
                self.held += len;
                self.asm.insert(
                    key,
                    Asm {
                        hdr,
                        buf: Vec::with_capacity(len),
                        next: 0,
                        at: now,
                    },
                );
            }
            let Some(a) = self.asm.get_mut(&key) else {
                return;
            };
            // Every fragment is of the message the first one announced.
            if a.hdr != hdr {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                return;
            }
            let f = frag as usize;
            if f < a.next {
                // A repeated fragment (our FragOk was lost): acknowledge again.
                if f + 1 < nf {
                    reply(xid, Reply::FragOk, frag, 0, &[]);
                }
                return;
            }
            if f > a.next || a.buf.len() + data.len() > a.hdr.len as usize {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                return;
            }
            a.buf.extend_from_slice(data);
            a.next += 1;
            a.at = now;
            if f + 1 < nf {
                reply(xid, Reply::FragOk, frag, 0, &[]);
                return;
            }
            match self.asm.remove(&key) {
                Some(a) => {
                    self.held -= a.hdr.len as usize;
                    std::borrow::Cow::Owned(a.buf)
                }
                None => return,
            }
        };
        let is_read = hdr.op == WrOpcode::RdmaRead;
        let mut result = Vec::new();
        if is_read && hdr.len > 0 {
            if self.held + hdr.len as usize > self.budget {
                self.refuse();
                return;
            }
            result = vec![0u8; hdr.len as usize];
        }
        let mut out = [0u8; 8];
        let local = [if is_read {
            Range {
                base: result.as_mut_ptr() as u64,
                len: result.len(),
            }
        } else if hdr.op.is_atomic() {
            Range {
                base: out.as_mut_ptr() as u64,
                len: 8,
            }
        } else {
            Range {
                base: payload.as_ptr() as u64,
                len: payload.len(),
            }
        }];
        let g = grh(&hdr.src_gid, hdr.len as usize);
        let req = Request {
            op: hdr.op,
            src_qpn: hdr.src_qpn,
            src_gid: hdr.src_gid,
            dest_qpn: hdr.dest_qpn,
            psn: hdr.psn,
            local: &local[..usize::from(local[0].len > 0)],
            remote_addr: hdr.remote_addr,
            rkey: hdr.rkey,
            imm: hdr.imm,
            compare_add: hdr.compare_add,
            swap: hdr.swap,
            len: hdr.len as usize,
            qkey: hdr.qkey,
            grh: hdr.ud.then_some(g),
        };
        if hdr.ud {
            if exec::ud(&self.me, &req) {
                self.stats.served.fetch_add(1, Ordering::Relaxed);
            } else {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        let o = exec::rc(&self.me, &req);
        if o != Outcome::NoResponse {
            self.stats.served.fetch_add(1, Ordering::Relaxed);
        }
        let last = (nf - 1) as u16;
        match o {
            Outcome::Done { byte_len, value } => {
                let r = Reply::Done { byte_len, value };
                if is_read {
                    let first = result.len().min(CHUNK);
                    reply(xid, r, last, result.len() as u32, &result[..first]);
                    if result.len() > CHUNK {
                        self.held += result.len();
                        if let Some((old, _)) = self.reads.insert(key, (result, now)) {
                            self.held -= old.len();
                        }
                    }
                } else {
                    reply(xid, r, last, 0, &[]);
                }
            }
            Outcome::Rnr(c) => reply(xid, Reply::Rnr(c), last, 0, &[]),
            Outcome::Fail(st) => reply(xid, Reply::Fail(st), last, 0, &[]),
            Outcome::NoResponse => {}
        }
    }
}

/// Whether a request claiming source GID `gid` comes from the address of the wire service
/// that GID names (the requester's client socket is bound to that address).
fn from_claimed_host(gid: &Gid, from: SocketAddr) -> bool {
    match (seg::gid_net(gid).addr, from) {
        (Some(a), SocketAddr::V4(f)) => a.ip() == f.ip(),
        _ => false,
    }
}

/// The service thread: answer requests from other hosts until `stop`.
pub fn serve(sock: UdpSocket, mut svc: Service, stop: Arc<AtomicBool>) {
    let _ = sock.set_read_timeout(Some(Duration::from_millis(500)));
    let mut rx = vec![0u8; 65_536];
    while !stop.load(Ordering::SeqCst) {
        let Ok((n, from)) = sock.recv_from(&mut rx) else {
            continue;
        };
        svc.on_packet(from, &rx[..n], Instant::now(), &mut |b| {
            let _ = sock.send_to(b, from);
        });
    }
}

impl Service {
    /// A responder for `hca`'s own segment, as its wire service thread runs one, holding at
    /// most `budget` bytes: for tests and the fuzz target, which feed it packets directly.
    pub fn on(hca: &super::SoftHca, budget: usize) -> weft_provider::Result<Service> {
        use crate::hca::Hca;
        Ok(Service::new(
            Peer::attach(&hca.gid())?,
            budget,
            Arc::default(),
        ))
    }
}

/// A hostile sender's packets for [`Service::on_packet`], made from arbitrary bytes: requests
/// of every kind (fragments of long payloads among them, with headers that agree or disagree
/// with their first fragment), answers and fetches, from a few senders, some naming the QP,
/// key and GID a target set up (`good`) so that requests also execute. The fuzz target
/// `verbs_wire_service` and a property test drive a service with them and check what it holds
/// against its budget after every packet.
#[doc(hidden)]
pub mod hostile {
    use super::*;

    /// What the target set up: an RC QP connected to `gid`/`src_qpn`, a region at `addr` of
    /// `len` bytes with key `rkey`.
    #[derive(Debug, Clone, Copy)]
    pub struct Good {
        pub gid: Gid,
        pub src_qpn: u32,
        pub dest_qpn: u32,
        pub rkey: u32,
        pub addr: u64,
        pub len: u32,
    }

    struct Bytes<'a>(&'a [u8]);

    impl Bytes<'_> {
        fn u8(&mut self) -> u8 {
            let (b, rest) = self.0.split_first().map_or((0, &[][..]), |(b, r)| (*b, r));
            self.0 = rest;
            b
        }
        fn u32(&mut self) -> u32 {
            u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
        }
        fn u64(&mut self) -> u64 {
            (self.u32() as u64) << 32 | self.u32() as u64
        }
    }

    /// Packets (sender, bytes) made from `input`, for a target whose setup is `good`.
    pub fn packets(input: &[u8], good: &Good) -> Vec<(SocketAddr, Vec<u8>)> {
        let mut b = Bytes(input);
        let mut out = Vec::new();
        let payload = vec![0xa5u8; CHUNK];
        while !b.0.is_empty() && out.len() < 256 {
            let sel = b.u8();
            let from: SocketAddr = ([127, 0, 0, 1], 4000 + (sel & 3) as u16).into();
            let xid = (b.u8() & 7) as u64;
            let mut pkt = Vec::new();
            match sel >> 6 {
                0 | 1 => {
                    let g = sel & 4 != 0;
                    let op = WR_OPCODES[b.u8() as usize % WR_OPCODES.len()];
                    // Lengths around the fragment size, up to the largest message.
                    let len = match b.u8() % 4 {
                        0 => b.u8() as u32,
                        1 => (CHUNK as u32).wrapping_add(b.u8() as u32),
                        2 => (b.u32() % (4 * CHUNK as u32)).max(1),
                        _ => MAX_MSG as u32 - (b.u8() as u32),
                    };
                    let hdr = ReqHdr {
                        ud: sel & 8 != 0 && matches!(op, WrOpcode::Send | WrOpcode::SendWithImm),
                        op,
                        src_qpn: if g { good.src_qpn } else { b.u32() & 0xff_ffff },
                        src_gid: if g { good.gid } else { Gid([b.u8(); 16]) },
                        dest_qpn: if g {
                            good.dest_qpn
                        } else {
                            b.u32() & 0xff_ffff
                        },
                        psn: b.u8() as u32,
                        remote_addr: if g {
                            good.addr + (b.u32() % good.len.max(1)) as u64
                        } else {
                            b.u64()
                        },
                        rkey: if g { good.rkey } else { b.u32() },
                        imm: b.u32(),
                        compare_add: b.u64(),
                        swap: b.u64(),
                        len: if sel & 8 != 0 { len % 4097 } else { len },
                        qkey: b.u32(),
                    };
                    let nf = hdr.frags();
                    let frag = (b.u8() as usize % nf) as u16;
                    let n = if hdr.carries() {
                        (hdr.len as usize - frag as usize * CHUNK).min(CHUNK)
                    } else {
                        0
                    };
                    Msg::Req {
                        xid,
                        hdr,
                        frag,
                        data: &payload[..n],
                    }
                    .encode(&mut pkt);
                }
                2 => Msg::More {
                    xid,
                    frag: b.u8() as u16,
                }
                .encode(&mut pkt),
                _ => {
                    // Raw bytes, or a packet cut short.
                    let n = b.u8() as usize;
                    pkt.extend_from_slice(&b.0[..n.min(b.0.len())]);
                    b.0 = &b.0[n.min(b.0.len())..];
                }
            }
            out.push((from, pkt));
        }
        out
    }

    /// A target as the harness needs it: an HCA (its wire on loopback), an RC QP connected to
    /// a QP of an HCA "on another host" at 127.0.0.1, and a registered region of 64 KiB.
    pub struct Target {
        /// Declared before `_buf`, so dropped first: the region's registration ends with it.
        pub hca: super::super::SoftHca,
        pub good: Good,
        _buf: Box<[u8]>,
    }

    /// Make a [`Target`].
    pub fn target() -> weft_provider::Result<Target> {
        use crate::hca::Hca;
        let h = super::super::SoftHca::with_config(super::super::model::Config {
            addr: "127.0.0.1".into(),
            heap: 8 << 20,
            max_qp: 8,
            max_mr: 8,
            max_cq: 4,
            max_srq: 1,
            ..Default::default()
        })?;
        let pd = h.alloc_pd()?;
        let cq = h.create_cq(64)?;
        let qp = h.create_qp(
            pd,
            &QpInitAttr {
                qp_type: QpType::Rc,
                send_cq: cq,
                recv_cq: cq,
                srq: None,
                cap: QpCap::default(),
                sq_sig_all: false,
            },
        )?;
        let mut g = [0u8; 16];
        g[..4].copy_from_slice(&[127, 0, 0, 1]);
        g[4..6].copy_from_slice(&4791u16.to_be_bytes());
        g[6..8].copy_from_slice(&(super::super::wire::host_tag() ^ 0x5a5a | 1).to_le_bytes());
        g[8..12].copy_from_slice(&1u32.to_le_bytes());
        let remote = crate::Endpoint {
            gid: Gid(g),
            qpn: 77,
            psn: 0,
            lid: 0,
        };
        crate::connect_rc(&h, qp, 0, &remote, &crate::RcParams::default())?;
        let mut buf = vec![0u8; 64 << 10].into_boxed_slice();
        // SAFETY: the buffer moves into the `Target` with the HCA, which drops the HCA (and
        // with it the registration) before the buffer; the heap allocation does not move.
        let mr = unsafe { h.reg_mr(pd, buf.as_mut_ptr(), buf.len(), Access::ALL) }?;
        let good = Good {
            gid: Gid(g),
            src_qpn: 77,
            dest_qpn: qp.qpn,
            rkey: mr.rkey,
            addr: mr.addr,
            len: buf.len() as u32,
        };
        Ok(Target {
            hca: h,
            good,
            _buf: buf,
        })
    }

    /// Feed `svc` the packets of `input`; `Err` names the first packet after which it held
    /// more than `budget`.
    pub fn drive(
        svc: &mut Service,
        input: &[u8],
        good: &Good,
        budget: usize,
    ) -> Result<(), String> {
        let now = Instant::now();
        for (k, (from, p)) in packets(input, good).into_iter().enumerate() {
            svc.on_packet(from, &p, now, &mut |_| {});
            if svc.held() > budget {
                return Err(format!("after packet {k}: {} bytes held", svc.held()));
            }
        }
        Ok(())
    }
}
