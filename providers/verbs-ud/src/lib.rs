//! The `verbs-ud` provider: active messages over one InfiniBand Unreliable Datagram queue
//! pair per process (MVAPICH-Aptus' UD-SR channel), made reliable and ordered by the sans-IO
//! engine of `weft_verbs::reliable`, one link per peer.
//!
//! * **Constant memory per peer.** One UD QP reaches every peer; receive buffers come from one
//!   pool posted to it (`WEFT_VERBS_UD_RECVS`), send buffers from one pool
//!   (`WEFT_VERBS_UD_SEND_BUFS`). What a peer costs is its address handle and its link's
//!   state (sequence numbers, timers, the packets it holds out of order, bounded by the
//!   window), never queue pairs or buffers of its own.
//! * **Packets.** A message is cut into packets of at most the path MTU
//!   (`WEFT_VERBS_UD_MTU`, 2048; the receive buffers hold the 40-byte GRH in front). Each
//!   packet carries a 20-byte header: kind, first/last flags, the active message's header
//!   length, the sender's rank, the packet's sequence number, the cumulative
//!   acknowledgement and the message's payload length. The queue key is derived from the job
//!   id, so datagrams of another job never arrive.
//! * **Reliability** is the engine's: a window of `WEFT_VERBS_UD_WINDOW` packets per peer,
//!   acknowledgements on every packet going back (and alone when due), retransmission on a
//!   measured timeout and on duplicate acknowledgements, in-order delivery. A send buffer is
//!   reused only once the peer has acknowledged it and the HCA no longer reads it. A peer that
//!   owes acknowledgements and stays silent for `WEFT_VERBS_UD_TIMEOUT` seconds is failed
//!   (`peer failed: rank N`).
//! * **No RDMA on UD**: RMA and atomics go through the core's active-message path.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::time::{Duration, Instant};
use weft_provider::bootstrap::{Bootstrap, KvSpace};
use weft_provider::provider::{Caps, ProbeContext, Provider, SendOutcome, Sink, StaticProvider};
use weft_provider::types::Rank;
use weft_provider::{Error, ErrorDetail, Result};
use weft_verbs::reliable::{self, Header, Link};
use weft_verbs::{self as verbs, Endpoint, Hca, QpType, SendWr, WcOpcode, WcStatus};

weft_provider::param!(MTU: Uint = "verbs", "UD_MTU", "2048",
    "verbs-ud: bytes of one packet (the path MTU; 256 to 4096, a power of two)");
weft_provider::param!(WINDOW: Uint = "verbs", "UD_WINDOW", "128",
    "verbs-ud: packets in flight to one peer before its acknowledgements (1 to 4096)");
weft_provider::param!(RECVS: Uint = "verbs", "UD_RECVS", "512",
    "verbs-ud: receive buffers of the one UD queue pair, shared by every peer (16 to 16384)");
weft_provider::param!(SEND_BUFS: Uint = "verbs", "UD_SEND_BUFS", "1024",
    "verbs-ud: send buffers shared by every peer; a packet holds one until acknowledged (16 to 65536)");
weft_provider::param!(TIMEOUT: Float = "verbs", "UD_TIMEOUT", "30",
    "verbs-ud: seconds a peer that owes acknowledgements may stay silent before it is failed (UCX ud: 30)");
weft_provider::param!(KEEPALIVE: Float = "verbs", "UD_KEEPALIVE", "2",
    "verbs-ud: seconds between probes of peers we talk to that have nothing unacknowledged, so that a dead one is noticed (0: never)");

/// Largest active-message header.
const MAX_HDR: usize = 128;
/// The GRH in front of every UD receive.
const GRH: usize = 40;
/// Our packet header.
const PKT: usize = 20;
const KIND_DATA: u8 = 1;
const KIND_ACK: u8 = 2;
const F_FIRST: u8 = 1;
const F_LAST: u8 = 2;
/// A keepalive probe: acknowledged like data, delivered to no one.
const F_PING: u8 = 4;
/// Buffers for acknowledgements without data.
const CTL: usize = 64;
/// Send queue depth of the UD QP.
const SQ: u32 = 512;
/// Largest active-message payload (the core's rendezvous chunk).
const MAX_PAYLOAD: usize = 64 << 10;
const POLL: usize = 32;
// wr_id kinds.
const K_RECV: u64 = 1 << 56;
const K_SEND: u64 = 2 << 56;
const K_CTL: u64 = 3 << 56;
const K_MASK: u64 = 0xff << 56;

struct Config {
    mtu: usize,
    window: u32,
    recvs: usize,
    send_bufs: usize,
    timeout: Duration,
    keepalive: Option<Duration>,
}

impl Config {
    fn from_env() -> Result<Config> {
        let mtu = MTU.get_u64()? as usize;
        if !(256..=4096).contains(&mtu) || !mtu.is_power_of_two() {
            return Err(Error::invalid(format!(
                "WEFT_VERBS_UD_MTU={mtu}: 256 to 4096, a power of two"
            )));
        }
        let range = |p: &weft_provider::param::ParamDesc, lo: u64, hi: u64| -> Result<u64> {
            let v = p.get_u64()?;
            if !(lo..=hi).contains(&v) {
                return Err(Error::invalid(format!(
                    "{}={v}: {lo} to {hi}",
                    p.env_name()
                )));
            }
            Ok(v)
        };
        let secs = TIMEOUT.get_f64()?;
        if !(secs > 0.0 && secs.is_finite()) {
            return Err(Error::invalid(
                "WEFT_VERBS_UD_TIMEOUT: seconds, more than 0",
            ));
        }
        let ka = KEEPALIVE.get_f64()?;
        if !(ka >= 0.0 && ka.is_finite()) {
            return Err(Error::invalid(
                "WEFT_VERBS_UD_KEEPALIVE: seconds, 0 or more",
            ));
        }
        Ok(Config {
            keepalive: (ka > 0.0).then(|| Duration::from_secs_f64(ka)),
            mtu,
            window: range(&WINDOW, 1, 4096)? as u32,
            recvs: range(&RECVS, 16, 16384)? as usize,
            send_bufs: range(&SEND_BUFS, 16, 65536)? as usize,
            timeout: Duration::from_secs_f64(secs),
        })
    }

    fn caps(&self) -> Caps {
        let mut c = Caps::am_only(MAX_HDR, MAX_PAYLOAD, 16);
        // Aptus sends up to 8 KiB by UD-SR; larger messages by rendezvous.
        c.eager_limit = 8 << 10;
        c.spans_hosts = true;
        c
    }

    fn link(&self) -> reliable::Config {
        reliable::Config {
            window: self.window,
            peer_timeout: self.timeout,
            ..reliable::Config::default()
        }
    }
}

/// Where a pool's memory comes from.
enum Backing {
    Host(#[allow(dead_code)] Box<[u64]>),
    /// Memory of the HCA (`alloc_dm`): on the soft HCA a peer's requester writes it with plain
    /// stores instead of Cross-Memory Attach (the receive pool, where every packet lands).
    Device(verbs::Dm),
}

/// A registered array of equal slots.
struct Pool {
    base: *mut u8,
    len: usize,
    backing: Backing,
    mr: verbs::Mr,
    slot: usize,
    free: Vec<u32>,
}

impl Pool {
    /// `n` slots of `slot` bytes; in device memory when `device` and the HCA has enough.
    fn new(hca: &dyn Hca, pd: verbs::Pd, n: usize, slot: usize, device: bool) -> Result<Pool> {
        let len = n * slot;
        let backing = match device.then(|| hca.alloc_dm(len)) {
            Some(Ok(dm)) => Backing::Device(dm),
            _ => Backing::Host(vec![0u64; len.div_ceil(8)].into_boxed_slice()),
        };
        let base = match &backing {
            Backing::Host(b) => b.as_ptr() as *mut u8,
            Backing::Device(d) => d.ptr,
        };
        // SAFETY: the memory lives in the pool, which is deregistered (the provider's Drop,
        // after its QP is destroyed) before it is freed; it never moves.
        let mr = match unsafe { hca.reg_mr(pd, base, len, verbs::Access::LOCAL_WRITE) } {
            Ok(mr) => mr,
            Err(e) => {
                if let Backing::Device(d) = backing {
                    let _ = hca.free_dm(d);
                }
                return Err(e);
            }
        };
        Ok(Pool {
            base,
            len,
            backing,
            mr,
            slot,
            free: (0..n as u32).rev().collect(),
        })
    }

    /// Deregister and give device memory back (the provider's Drop, the QP already gone).
    fn release(&self, hca: &dyn Hca) {
        let _ = hca.dereg_mr(self.mr);
        if let Backing::Device(d) = &self.backing {
            let _ = hca.free_dm(*d);
        }
    }

    fn sge(&self, i: u32, len: usize) -> verbs::Sge {
        self.mr.sge(i as usize * self.slot, len)
    }

    /// Slot `i`, which must not be posted (receive) or read by the HCA (send) meanwhile.
    fn buf(&mut self, i: u32) -> &mut [u8] {
        let s = self.slot;
        assert!(
            (i as usize + 1) * s <= self.len,
            "slot {i} outside its pool"
        );
        // SAFETY: bytes of the pool's memory (host words or device memory, mapped for as long
        // as the pool lives); the slot lies within it (checked above) and only it is
        // borrowed: other slots may be in the HCA's hands. The provider touches a receive
        // slot only between its completion and its repost, and a send slot only while no post
        // of it is outstanding (`send_refs` == 0).
        unsafe { std::slice::from_raw_parts_mut(self.base.add(i as usize * s), s) }
    }
}

/// A message being put together from its packets (they arrive in order).
#[derive(Default)]
struct Rx {
    active: bool,
    hlen: usize,
    total: usize,
    data: Vec<u8>,
}

#[derive(Default)]
struct Peer {
    ah: Option<(verbs::Ah, u32)>,
    link: Option<Link<u32, Vec<u8>>>,
    rx: Rx,
    failed: bool,
}

#[derive(Default)]
struct Stats {
    am_sent: u64,
    am_recv: u64,
    packets_sent: u64,
    packets_recv: u64,
    malformed: u64,
}

pub struct VerbsUd {
    rank: Rank,
    size: u32,
    caps: Caps,
    cfg: Config,
    hca: std::sync::Arc<dyn Hca>,
    pd: verbs::Pd,
    cq: verbs::Cq,
    qp: verbs::Qp,
    qkey: u32,
    recv: Pool,
    send: Pool,
    ctl: Pool,
    /// Per send slot: bytes of its packet, posts the HCA has not completed, acknowledged.
    send_len: Vec<u32>,
    send_refs: Vec<u16>,
    send_acked: Vec<bool>,
    sq_used: u32,
    peers: Vec<Peer>,
    /// Peers with a link, in the order they got one.
    active: Vec<Rank>,
    kv: Option<std::sync::Arc<dyn KvSpace>>,
    addrs: Vec<Option<Endpoint>>,
    failures: VecDeque<(Rank, String)>,
    wcs: Vec<verbs::Wc>,
    next_keepalive: Instant,
    stats: Stats,
}

fn put_u16(b: &mut [u8], v: u16) {
    b.copy_from_slice(&v.to_le_bytes());
}
fn put_u32(b: &mut [u8], v: u32) {
    b.copy_from_slice(&v.to_le_bytes());
}
fn get_u16(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}
fn get_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn job_qkey(job: &str) -> u32 {
    let h = job.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    });
    // The top bit set is a privileged qkey in InfiniBand: keep it clear.
    h & 0x7fff_ffff
}

impl VerbsUd {
    fn open_with(boot: &mut dyn Bootstrap, cfg: Config) -> Result<VerbsUd> {
        let hca = verbs::open_default()?;
        let pd = hca.alloc_pd()?;
        let cq = hca.create_cq((cfg.recvs as u32 + SQ + 16).min(hca.attr().max_cqe.max(64)))?;
        let qp = hca.create_qp(pd, &qp_init(cq, cfg.recvs as u32))?;
        let qkey = job_qkey(boot.job_id());
        verbs::activate_ud(&*hca, qp, qkey)?;
        // Every packet lands in a receive buffer: HCA memory where there is enough of it.
        let recv = Pool::new(&*hca, pd, cfg.recvs, GRH + cfg.mtu, true)?;
        let send = Pool::new(&*hca, pd, cfg.send_bufs, cfg.mtu, false)?;
        let ctl = Pool::new(&*hca, pd, CTL, PKT, false)?;
        let (rank, size) = (boot.rank(), boot.size());
        let n = cfg.send_bufs;
        let mut me = VerbsUd {
            rank,
            size,
            caps: cfg.caps(),
            hca,
            pd,
            cq,
            qp,
            qkey,
            recv,
            send,
            ctl,
            send_len: vec![0; n],
            send_refs: vec![0; n],
            send_acked: vec![false; n],
            sq_used: 0,
            peers: (0..size).map(|_| Peer::default()).collect(),
            active: Vec::new(),
            kv: None,
            addrs: vec![None; size as usize],
            failures: VecDeque::new(),
            wcs: vec![
                verbs::Wc {
                    wr_id: 0,
                    status: WcStatus::Success,
                    opcode: WcOpcode::Send,
                    byte_len: 0,
                    imm: None,
                    qp_num: 0,
                    src_qp: 0,
                    grh: false,
                };
                POLL
            ],
            next_keepalive: Instant::now(),
            stats: Stats::default(),
            cfg,
        };
        for i in 0..me.cfg.recvs as u32 {
            me.post_recv(i)?;
        }
        me.recv.free.clear();
        let ep = Endpoint::of(&*me.hca, me.qp, 0);
        boot.put(&format!("verbs-ud.{rank}"), &ep.to_string())?;
        boot.fence()?;
        me.kv = boot.kv();
        if me.kv.is_none() {
            for r in 0..size {
                let v = boot.get(&format!("verbs-ud.{r}"))?;
                me.addrs[r as usize] = Some(v.parse()?);
            }
        }
        Ok(me)
    }

    fn post_recv(&mut self, i: u32) -> Result<()> {
        let sge = self.recv.sge(i, self.recv.slot);
        self.hca
            .post_recv(self.qp, &[verbs::RecvWr::new(K_RECV | i as u64, &[sge])])
    }

    fn check_rank(&self, r: Rank) -> Result<usize> {
        if r >= self.size {
            return Err(Error::from(ErrorDetail::InvalidRank {
                rank: r as i64,
                size: self.size,
            }));
        }
        Ok(r as usize)
    }

    /// The peer's address handle and QP number.
    fn ah_of(&mut self, r: Rank) -> Result<(verbs::Ah, u32)> {
        if let Some(a) = self.peers[r as usize].ah {
            return Ok(a);
        }
        let ep = match self.addrs[r as usize] {
            Some(e) => e,
            None => {
                let kv = self
                    .kv
                    .as_ref()
                    .ok_or_else(|| Error::invalid("verbs-ud: no key-value space"))?;
                let v = kv.get(&format!("verbs-ud.{r}"))?.ok_or_else(|| {
                    Error::invalid(format!("verbs-ud: rank {r} published no address"))
                })?;
                let e: Endpoint = v.parse()?;
                self.addrs[r as usize] = Some(e);
                e
            }
        };
        let ah = self.hca.create_ah(
            self.pd,
            &verbs::AhAttr {
                dgid: ep.gid,
                dlid: ep.lid,
                port_num: 1,
            },
        )?;
        self.peers[r as usize].ah = Some((ah, ep.qpn));
        Ok((ah, ep.qpn))
    }

    /// The link to `r`, made on first use (both sides start their sequences at 0).
    fn link(&mut self, r: Rank) -> &mut Link<u32, Vec<u8>> {
        let i = r as usize;
        if self.peers[i].link.is_none() {
            self.peers[i].link = Some(Link::new(self.cfg.link(), Instant::now(), 0, 0));
            self.active.push(r);
        }
        self.peers[i].link.as_mut().expect("made above")
    }

    fn peer_gone(&self, r: Rank) -> Error {
        Error::from(ErrorDetail::PeerFailed {
            rank: r,
            reason: format!(
                "no acknowledgement for {} s",
                self.cfg.timeout.as_secs_f64()
            ),
        })
    }

    /// Post what `r`'s link has to send, while the send queue has room.
    fn transmit(&mut self, r: Rank, now: Instant) -> Result<()> {
        let i = r as usize;
        if self.peers[i].link.is_none() || self.peers[i].failed {
            return Ok(());
        }
        let (ah, qpn) = self.ah_of(r)?;
        while self.sq_used < SQ {
            let link = self.peers[i].link.as_mut().expect("checked above");
            let Some(tx) = link.poll_transmit(now) else {
                break;
            };
            let h = tx.header;
            let wr = match tx.payload {
                Some(&slot) => {
                    // A copy of this packet still in the HCA's hands keeps the header it had
                    // (same sequence number, an older acknowledgement, still true): the HCA
                    // may be reading those bytes.
                    if self.send_refs[slot as usize] == 0 {
                        let b = self.send.buf(slot);
                        put_u32(&mut b[8..12], h.psn.unwrap_or(0));
                        put_u32(&mut b[12..16], h.ack);
                    }
                    self.send_refs[slot as usize] += 1;
                    let len = self.send_len[slot as usize] as usize;
                    SendWr::send(K_SEND | slot as u64, &[self.send.sge(slot, len)])
                }
                None => {
                    // A pure acknowledgement; with no buffer free it is dropped (the peer's
                    // timer or its next packet brings another).
                    let Some(c) = self.ctl.free.pop() else {
                        continue;
                    };
                    let b = self.ctl.buf(c);
                    b.fill(0);
                    b[0] = KIND_ACK;
                    put_u32(&mut b[4..8], self.rank);
                    put_u32(&mut b[12..16], h.ack);
                    SendWr::send(K_CTL | c as u64, &[self.ctl.sge(c, PKT)])
                }
            };
            self.hca.post_send(self.qp, &[wr.to(ah, qpn, self.qkey)])?;
            self.sq_used += 1;
            self.stats.packets_sent += 1;
        }
        Ok(())
    }

    /// Probe every peer we have a link to and nothing unacknowledged with: a dead one then
    /// owes an acknowledgement and is failed after `WEFT_VERBS_UD_TIMEOUT` (a rank that only
    /// waits to receive would otherwise never notice).
    fn keepalives(&mut self) {
        for k in 0..self.active.len() {
            let r = self.active[k];
            let p = &mut self.peers[r as usize];
            if r == self.rank || p.failed || p.link.as_ref().is_none_or(|l| l.in_flight() > 0) {
                continue;
            }
            let Some(slot) = self.send.free.pop() else {
                return;
            };
            let b = self.send.buf(slot);
            b[..PKT].fill(0);
            b[0] = KIND_DATA;
            b[1] = F_FIRST | F_LAST | F_PING;
            put_u32(&mut b[4..8], self.rank);
            self.send_len[slot as usize] = PKT as u32;
            let link = self.peers[r as usize].link.as_mut().expect("checked above");
            if link.send(slot).is_err() {
                self.send.free.push(slot);
            }
        }
    }

    /// A send slot is free once acknowledged and no longer read by the HCA.
    fn maybe_free(&mut self, slot: u32) {
        let s = slot as usize;
        if self.send_acked[s] && self.send_refs[s] == 0 {
            self.send_acked[s] = false;
            self.send.free.push(slot);
        }
    }

    /// A packet arrived in receive slot `i` (`n` bytes after the GRH).
    fn on_recv(&mut self, i: u32, n: usize, now: Instant) {
        let mtu = self.cfg.mtu;
        let b = &self.recv.buf(i)[GRH..GRH + n.min(mtu)];
        if b.len() < PKT {
            self.stats.malformed += 1;
            return;
        }
        let (kind, flags, hlen) = (b[0], b[1], get_u16(&b[2..4]) as usize);
        let (src, psn, ack, total) = (
            get_u32(&b[4..8]),
            get_u32(&b[8..12]),
            get_u32(&b[12..16]),
            get_u32(&b[16..20]),
        );
        if src >= self.size
            || !(kind == KIND_DATA || kind == KIND_ACK)
            || hlen > MAX_HDR
            || total as usize > MAX_PAYLOAD
        {
            self.stats.malformed += 1;
            return;
        }
        if self.peers[src as usize].failed {
            return;
        }
        self.stats.packets_recv += 1;
        let header = Header {
            psn: (kind == KIND_DATA).then_some(psn),
            ack,
        };
        // The engine keeps the packet (flags, lengths and bytes) until it is next in order.
        let payload = (kind == KIND_DATA).then(|| {
            let mut v = Vec::with_capacity(b.len() - 1);
            v.push(flags);
            v.extend_from_slice(&b[2..4]);
            v.extend_from_slice(&b[16..20]);
            v.extend_from_slice(&b[PKT..]);
            v
        });
        let link = self.link(src);
        link.on_packet(now, header, payload);
    }

    /// Deliver `r`'s packets that are next in order, and free the send slots it acknowledged.
    fn drain(&mut self, r: Rank, sink: &mut dyn Sink) -> usize {
        let i = r as usize;
        let mut n = 0;
        loop {
            let Some(link) = self.peers[i].link.as_mut() else {
                return n;
            };
            let Some(p) = link.poll_deliver() else {
                break;
            };
            let (flags, hlen, total) = (p[0], get_u16(&p[1..3]) as usize, get_u32(&p[3..7]));
            let body = &p[7..];
            if flags & F_PING != 0 {
                continue;
            }
            let rx = &mut self.peers[i].rx;
            if flags & F_FIRST != 0 {
                if body.len() < hlen || rx.active {
                    self.stats.malformed += 1;
                    rx.active = false;
                    continue;
                }
                if flags & F_LAST != 0 {
                    if body.len() - hlen != total as usize {
                        self.stats.malformed += 1;
                        continue;
                    }
                    self.stats.am_recv += 1;
                    sink.am(r, &body[..hlen], &body[hlen..]);
                    n += 1;
                    continue;
                }
                rx.active = true;
                rx.hlen = hlen;
                rx.total = total as usize;
                rx.data.clear();
                rx.data.extend_from_slice(body);
                continue;
            }
            if !rx.active {
                self.stats.malformed += 1;
                continue;
            }
            rx.data.extend_from_slice(body);
            if rx.data.len() > rx.hlen + rx.total {
                self.stats.malformed += 1;
                rx.active = false;
                continue;
            }
            if flags & F_LAST != 0 {
                rx.active = false;
                if rx.data.len() != rx.hlen + rx.total {
                    self.stats.malformed += 1;
                    continue;
                }
                let data = std::mem::take(&mut rx.data);
                self.stats.am_recv += 1;
                sink.am(r, &data[..rx.hlen], &data[rx.hlen..]);
                self.peers[i].rx.data = data;
                n += 1;
            }
        }
        while let Some(slot) = self.peers[i].link.as_mut().and_then(|l| l.poll_acked()) {
            self.send_acked[slot as usize] = true;
            self.maybe_free(slot);
        }
        n
    }
}

impl Provider for VerbsUd {
    fn name(&self) -> &str {
        "verbs-ud"
    }

    fn rank(&self) -> Rank {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    fn caps(&self) -> &Caps {
        &self.caps
    }

    fn am_send(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        let i = self.check_rank(dest)?;
        if header.len() > MAX_HDR {
            return Err(Error::invalid(format!(
                "verbs-ud: header of {} bytes (at most {MAX_HDR})",
                header.len()
            )));
        }
        let total: usize = payload.iter().map(|p| p.len()).sum();
        if total > MAX_PAYLOAD {
            return Err(Error::invalid(format!(
                "verbs-ud: payload of {total} bytes (at most {MAX_PAYLOAD})"
            )));
        }
        if self.peers[i].failed {
            return Err(self.peer_gone(dest));
        }
        let room = self.cfg.mtu - PKT;
        let bytes = header.len() + total;
        let packets = bytes.div_ceil(room).max(1);
        if self.link(dest).room() < packets || self.send.free.len() < packets {
            return Ok(SendOutcome::Busy);
        }
        // Header and payload, cut into packets: slices copied whole (not byte by byte).
        let parts: smallvec::SmallVec<[&[u8]; 8]> = std::iter::once(header)
            .chain(payload.iter().map(|p| &**p))
            .filter(|p| !p.is_empty())
            .collect();
        let (mut part, mut at) = (0usize, 0usize);
        for k in 0..packets {
            let slot = self.send.free.pop().expect("counted above");
            let n = room.min(bytes - k * room);
            let b = self.send.buf(slot);
            b[0] = KIND_DATA;
            b[1] = if k == 0 { F_FIRST } else { 0 } | if k + 1 == packets { F_LAST } else { 0 };
            put_u16(&mut b[2..4], header.len() as u16);
            put_u32(&mut b[4..8], self.rank);
            put_u32(&mut b[16..20], total as u32);
            let mut filled = 0;
            while filled < n {
                let src = &parts[part][at..];
                let c = src.len().min(n - filled);
                b[PKT + filled..PKT + filled + c].copy_from_slice(&src[..c]);
                filled += c;
                at += c;
                if at == parts[part].len() {
                    part += 1;
                    at = 0;
                }
            }
            self.send_len[slot as usize] = (PKT + n) as u32;
            if self.link(dest).send(slot).is_err() {
                // Counted above: the window had room.
                self.send.free.push(slot);
                return Err(Error::invalid("verbs-ud: send window accounting"));
            }
        }
        self.stats.am_sent += 1;
        self.transmit(dest, Instant::now())?;
        Ok(SendOutcome::Sent)
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut events = 0;
        let now = Instant::now();
        let mut touched: Vec<Rank> = Vec::new();
        loop {
            let mut wcs = std::mem::take(&mut self.wcs);
            let n = self.hca.poll_cq(self.cq, &mut wcs)?;
            for wc in &wcs[..n] {
                let idx = (wc.wr_id & 0xffff_ffff) as u32;
                match wc.wr_id & K_MASK {
                    K_RECV => {
                        if wc.status == WcStatus::Success {
                            let len = (wc.byte_len as usize).saturating_sub(GRH);
                            self.on_recv(idx, len, now);
                        }
                        self.post_recv(idx)?;
                    }
                    K_SEND => {
                        self.sq_used -= 1;
                        let s = idx as usize;
                        self.send_refs[s] = self.send_refs[s].saturating_sub(1);
                        self.maybe_free(idx);
                    }
                    K_CTL => {
                        self.sq_used -= 1;
                        self.ctl.free.push(idx);
                    }
                    _ => {}
                }
            }
            self.wcs = wcs;
            if n < POLL {
                break;
            }
        }
        if let Some(every) = self.cfg.keepalive {
            if now >= self.next_keepalive {
                self.next_keepalive = now + every;
                self.keepalives();
            }
        }
        let active = std::mem::take(&mut self.active);
        for &r in &active {
            events += self.drain(r, sink);
            let link = self.peers[r as usize].link.as_mut().expect("active");
            if link.next_timeout().is_some_and(|t| t <= now) {
                link.on_timeout(now);
            }
            if link.failed() && !self.peers[r as usize].failed {
                self.peers[r as usize].failed = true;
                let why = format!(
                    "no acknowledgement for {} s",
                    self.cfg.timeout.as_secs_f64()
                );
                self.failures.push_back((r, why));
            }
            touched.push(r);
        }
        // Links made while draining (a first packet from a new peer) joined `self.active`.
        let mut active = active;
        active.append(&mut self.active);
        self.active = active;
        for r in touched {
            self.transmit(r, now)?;
        }
        while let Some((r, why)) = self.failures.pop_front() {
            sink.peer_failed(r, &why);
            events += 1;
        }
        Ok(events)
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let s = &self.stats;
        let mut st = reliable::Stats::default();
        for p in &self.peers {
            if let Some(l) = &p.link {
                let x = l.stats();
                st.resent += x.resent;
                st.timeouts += x.timeouts;
                st.fast_resends += x.fast_resends;
                st.pure_acks += x.pure_acks;
                st.duplicates += x.duplicates;
                st.kept += x.kept;
            }
        }
        let hc = self.hca.counters();
        vec![
            ("am_sent", s.am_sent),
            ("am_received", s.am_recv),
            ("packets_sent", s.packets_sent),
            ("packets_received", s.packets_recv),
            ("resent", st.resent),
            ("timeouts", st.timeouts),
            ("fast_resends", st.fast_resends),
            ("pure_acks", st.pure_acks),
            ("duplicates", st.duplicates),
            ("out_of_order_kept", st.kept),
            ("malformed", s.malformed),
            ("links", self.active.len() as u64),
            ("hca_ud_dropped", hc.ud_dropped),
            ("hca_ud_duplicated", hc.ud_duplicated),
        ]
    }

    fn close(&mut self) -> Result<()> {
        // After the final barrier: let the last packets be acknowledged (a peer may still
        // need them), bounded — a peer that already left never acknowledges.
        struct Discard;
        impl Sink for Discard {
            fn am(&mut self, _: Rank, _: &[u8], _: &[u8]) {}
            fn complete(
                &mut self,
                _: weft_provider::provider::Token,
                _: Result<weft_provider::provider::Completed>,
            ) {
            }
            fn peer_failed(&mut self, _: Rank, _: &str) {}
        }
        let deadline = Instant::now() + Duration::from_millis(250);
        while self
            .peers
            .iter()
            .any(|p| !p.failed && p.link.as_ref().is_some_and(|l| l.in_flight() > 0))
            && Instant::now() < deadline
        {
            self.progress(&mut Discard)?;
        }
        Ok(())
    }
}

impl Drop for VerbsUd {
    fn drop(&mut self) {
        let _ = self.hca.destroy_qp(self.qp);
        for p in &self.peers {
            if let Some((ah, _)) = p.ah {
                let _ = self.hca.destroy_ah(ah);
            }
        }
        for pool in [&self.recv, &self.send, &self.ctl] {
            pool.release(&*self.hca);
        }
        let _ = self.hca.destroy_cq(self.cq);
        let _ = self.hca.dealloc_pd(self.pd);
    }
}

impl StaticProvider for VerbsUd {
    const NAME: &'static str = "verbs-ud";

    fn probe(_ctx: &ProbeContext) -> std::result::Result<(), String> {
        Config::from_env().map(|_| ()).map_err(|e| e.to_string())
    }

    fn open(boot: &mut dyn Bootstrap) -> Result<Self> {
        Self::open_with(boot, Config::from_env()?)
    }

    fn static_caps() -> Result<Caps> {
        Ok(Config::from_env()?.caps())
    }
}

weft_provider::register_provider!(
    VerbsUd,
    priority = 7,
    summary = "InfiniBand Unreliable Datagram on the verbs layer (soft HCA or rdma-core): one UD queue pair for every peer, constant memory per peer, reliability and order by a sans-IO engine; RMA and atomics by active messages"
);

/// The UD queue pair: receives from the shared pool.
fn qp_init(cq: verbs::Cq, recvs: u32) -> verbs::QpInitAttr {
    verbs::QpInitAttr {
        qp_type: QpType::Ud,
        send_cq: cq,
        recv_cq: cq,
        srq: None,
        cap: verbs::QpCap {
            max_send_wr: SQ,
            max_recv_wr: recvs,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        sq_sig_all: true,
    }
}
