// Over 800 lines: its unit tests, below the code (which is under 800), test it through its private state.
//! The soft HCA between hosts: verbs carried over UDP, as Soft-RoCE carries them.
//!
//! Within a host the requester executes the responder in the peer's segment (`exec`). A peer
//! on another host cannot be reached that way, so each soft HCA runs a **wire service**: a
//! thread with a UDP socket that receives request packets, runs the very same responder
//! (`exec::rc`, `exec::ud`) on its own segment, and answers. The target process still takes no
//! part in any call: the service thread plays the part of the HCA's firmware.
//!
//! Protocol (little endian; the packet formats are [`Msg`]):
//! - An RC request is one message of up to [`CHUNK`] bytes of payload per packet. A longer
//!   payload (send, write) goes as fragments, each acknowledged (`FragOk`) before the next is
//!   sent, so no socket buffer ever overflows; the responder executes the request when the
//!   last fragment arrives, exactly once per PSN (the duplicate detection and atomic replay of
//!   `exec` apply unchanged), and answers `Done`, `Rnr` or `Fail` as an ACK, RNR NAK or NAK.
//! - A read's data comes back in the `Done` answer, the rest fragment by fragment on request
//!   (`More`), from a copy the responder keeps for a few seconds.
//! - A request, fragment or answer that is lost is noticed by the requester's timeout; it
//!   retries the whole request under the same PSN (a new exchange id), which is what the
//!   retry count and transport-retry-exceeded of the QP count.
//! - UD: one packet, no answer; the requester's fault injection applies as on one host.
//!
//! The requester never waits on the network: a request to another host is an [`Exchange`] that
//! the requester moves on whenever it runs (`post_send`, `poll_cq`, `progress`, and the HCA's
//! engine thread), so a silent host delays only the QPs that talk to it, by their own ACK
//! timeouts ([`wait_for`]), as on hardware. The responder is `service`: what a hostile sender
//! can make it hold is bounded there.

use super::exec::{Outcome, Peer};
use super::seg::Net;
use super::service::{Service, Stats, BUDGET};
use crate::types::*;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use weft_provider::{Error, Result};

/// Payload bytes per packet (a UDP datagram carries up to 65,507).
pub const CHUNK: usize = 60 * 1024;
/// The largest request the wire carries: a read result or a reassembled payload is buffered
/// whole at the responder. A longer request between hosts completes with a local length
/// error at once (rather than retrying into a buffer that can never be had).
pub const MAX_MSG: usize = 256 << 20;
/// The shortest a requester waits for an answer from another host: a user-space service on
/// a loaded machine cannot promise the microsecond turnaround a small ACK timeout code asks
/// for (HCAs clamp small codes too).
pub const MIN_WAIT: Duration = Duration::from_millis(50);

const MAGIC: [u8; 4] = *b"wsw1";
const KIND_REQ: u8 = 1;
const KIND_RESP: u8 = 2;
const KIND_MORE: u8 = 3;
const HDR_REQ: usize = 4 + 1 + 8 + 1 + 1 + 4 + 16 + 4 + 4 + 8 + 4 + 4 + 8 + 8 + 4 + 4 + 2 + 2 + 4;
const HDR_RESP: usize = 4 + 1 + 8 + 1 + 1 + 4 + 8 + 2 + 4 + 4;

/// The responder-visible part of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReqHdr {
    pub ud: bool,
    pub op: WrOpcode,
    pub src_qpn: u32,
    pub src_gid: Gid,
    pub dest_qpn: u32,
    pub psn: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub imm: u32,
    pub compare_add: u64,
    pub swap: u64,
    pub len: u32,
    pub qkey: u32,
}

impl ReqHdr {
    /// Whether the request carries its payload to the responder (send, write).
    pub fn carries(&self) -> bool {
        !matches!(
            self.op,
            WrOpcode::RdmaRead | WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd
        )
    }

    /// Packets the request's payload takes.
    pub fn frags(&self) -> usize {
        if self.carries() {
            (self.len as usize).div_ceil(CHUNK).max(1)
        } else {
            1
        }
    }
}

/// What the responder answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// A fragment arrived; send the next.
    FragOk,
    Done {
        byte_len: u32,
        value: u64,
    },
    Rnr(u8),
    Fail(WcStatus),
}

/// One packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg<'a> {
    Req {
        xid: u64,
        hdr: ReqHdr,
        frag: u16,
        data: &'a [u8],
    },
    /// `total`: the read result's length (fragments of it follow on request).
    Resp {
        xid: u64,
        reply: Reply,
        frag: u16,
        total: u32,
        data: &'a [u8],
    },
    More {
        xid: u64,
        frag: u16,
    },
}

fn bad(what: &str) -> Error {
    Error::invalid(format!("malformed soft-HCA packet: {what}"))
}

struct Cur<'a>(&'a [u8]);

impl<'a> Cur<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(bad("too short"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

fn opcode(v: u8) -> Option<WrOpcode> {
    WR_OPCODES.iter().copied().find(|o| *o as u8 == v)
}

impl Msg<'_> {
    /// Append the packet's bytes to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&MAGIC);
        match self {
            Msg::Req {
                xid,
                hdr,
                frag,
                data,
            } => {
                out.push(KIND_REQ);
                out.extend_from_slice(&xid.to_le_bytes());
                out.push(hdr.ud as u8);
                out.push(hdr.op as u8);
                out.extend_from_slice(&hdr.src_qpn.to_le_bytes());
                out.extend_from_slice(&hdr.src_gid.0);
                out.extend_from_slice(&hdr.dest_qpn.to_le_bytes());
                out.extend_from_slice(&hdr.psn.to_le_bytes());
                out.extend_from_slice(&hdr.remote_addr.to_le_bytes());
                out.extend_from_slice(&hdr.rkey.to_le_bytes());
                out.extend_from_slice(&hdr.imm.to_le_bytes());
                out.extend_from_slice(&hdr.compare_add.to_le_bytes());
                out.extend_from_slice(&hdr.swap.to_le_bytes());
                out.extend_from_slice(&hdr.len.to_le_bytes());
                out.extend_from_slice(&hdr.qkey.to_le_bytes());
                out.extend_from_slice(&frag.to_le_bytes());
                out.extend_from_slice(&(hdr.frags() as u16).to_le_bytes());
                out.extend_from_slice(&(data.len() as u32).to_le_bytes());
                out.extend_from_slice(data);
            }
            Msg::Resp {
                xid,
                reply,
                frag,
                total,
                data,
            } => {
                out.push(KIND_RESP);
                out.extend_from_slice(&xid.to_le_bytes());
                let (k, code, bl, v) = match *reply {
                    Reply::FragOk => (0u8, 0u8, 0u32, 0u64),
                    Reply::Done { byte_len, value } => (1, 0, byte_len, value),
                    Reply::Rnr(c) => (2, c, 0, 0),
                    Reply::Fail(st) => (3, st as u8, 0, 0),
                };
                out.push(k);
                out.push(code);
                out.extend_from_slice(&bl.to_le_bytes());
                out.extend_from_slice(&v.to_le_bytes());
                out.extend_from_slice(&frag.to_le_bytes());
                out.extend_from_slice(&total.to_le_bytes());
                out.extend_from_slice(&(data.len() as u32).to_le_bytes());
                out.extend_from_slice(data);
            }
            Msg::More { xid, frag } => {
                out.push(KIND_MORE);
                out.extend_from_slice(&xid.to_le_bytes());
                out.extend_from_slice(&frag.to_le_bytes());
            }
        }
    }

    /// Parse a packet, checking every field a peer could get wrong; never panics.
    pub fn decode(b: &[u8]) -> Result<Msg<'_>> {
        let mut c = Cur(b);
        if c.take(4)? != MAGIC {
            return Err(bad("not a soft-HCA packet"));
        }
        let kind = c.u8()?;
        let xid = c.u64()?;
        match kind {
            KIND_REQ => {
                let ud = match c.u8()? {
                    0 => false,
                    1 => true,
                    _ => return Err(bad("transport")),
                };
                let op = opcode(c.u8()?).ok_or_else(|| bad("opcode"))?;
                let src_qpn = c.u32()?;
                let mut g = [0u8; 16];
                g.copy_from_slice(c.take(16)?);
                let hdr = ReqHdr {
                    ud,
                    op,
                    src_qpn,
                    src_gid: Gid(g),
                    dest_qpn: c.u32()?,
                    psn: c.u32()?,
                    remote_addr: c.u64()?,
                    rkey: c.u32()?,
                    imm: c.u32()?,
                    compare_add: c.u64()?,
                    swap: c.u64()?,
                    len: c.u32()?,
                    qkey: c.u32()?,
                };
                let frag = c.u16()?;
                let nfrags = c.u16()? as usize;
                let n = c.u32()? as usize;
                let data = c.take(n)?;
                if !c.0.is_empty() {
                    return Err(bad("trailing bytes"));
                }
                if hdr.len as usize > MAX_MSG
                    || (ud
                        && (hdr.len as usize > 4096
                            || !matches!(op, WrOpcode::Send | WrOpcode::SendWithImm)))
                {
                    return Err(bad("length"));
                }
                if nfrags != hdr.frags() || frag as usize >= nfrags {
                    return Err(bad("fragment numbering"));
                }
                let off = frag as usize * CHUNK;
                let want = if hdr.carries() {
                    (hdr.len as usize - off).min(CHUNK)
                } else {
                    0
                };
                if n != want {
                    return Err(bad("fragment length"));
                }
                Ok(Msg::Req {
                    xid,
                    hdr,
                    frag,
                    data,
                })
            }
            KIND_RESP => {
                let k = c.u8()?;
                let code = c.u8()?;
                let byte_len = c.u32()?;
                let value = c.u64()?;
                // Fields an answer does not use must be zero.
                let unused = byte_len == 0 && value == 0;
                let reply = match k {
                    0 if unused && code == 0 => Reply::FragOk,
                    1 if code == 0 => Reply::Done { byte_len, value },
                    2 if unused && code < 32 => Reply::Rnr(code),
                    3 if unused => Reply::Fail(
                        WcStatus::from_u32(code as u32)
                            .filter(|s| *s != WcStatus::Success)
                            .ok_or_else(|| bad("status"))?,
                    ),
                    _ => return Err(bad("answer")),
                };
                let frag = c.u16()?;
                let total = c.u32()?;
                let n = c.u32()? as usize;
                let data = c.take(n)?;
                if !c.0.is_empty() {
                    return Err(bad("trailing bytes"));
                }
                if total as usize > MAX_MSG
                    || n > CHUNK
                    || (n > 0 && (frag as usize) * CHUNK + n > total as usize)
                {
                    return Err(bad("read data"));
                }
                Ok(Msg::Resp {
                    xid,
                    reply,
                    frag,
                    total,
                    data,
                })
            }
            KIND_MORE => {
                let frag = c.u16()?;
                if !c.0.is_empty() {
                    return Err(bad("trailing bytes"));
                }
                Ok(Msg::More { xid, frag })
            }
            _ => Err(bad("kind")),
        }
    }
}

/// The tag of the host this thread runs on: its boot and its network namespace (two network
/// namespaces are two hosts, as they are for Soft-RoCE). Never 0.
pub fn host_tag() -> u16 {
    let boot = std::fs::read("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let ns = std::fs::metadata("/proc/thread-self/ns/net")
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap_or(0);
    // FNV-1a over both.
    let mut h: u32 = 0x811c_9dc5;
    for b in boot.iter().chain(ns.to_le_bytes().iter()) {
        h ^= *b as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    ((h >> 16) as u16 ^ h as u16) | 1
}

/// The IPv4 address peers on other hosts reach this one at: `WEFT_VERBS_SOFT_ADDR`, or the
/// first up, non-loopback IPv4 interface address of this thread's network namespace, else
/// the loopback address. `None`: `off`.
fn advertised(choice: &str) -> Result<Option<Ipv4Addr>> {
    match choice.trim() {
        "off" | "none" => return Ok(None),
        "" | "auto" => {}
        s => {
            return s.parse::<Ipv4Addr>().map(Some).map_err(|_| {
                Error::invalid(format!(
                    "WEFT_VERBS_SOFT_ADDR={s}: expected an IPv4 address, `auto` or `off`"
                ))
            })
        }
    }
    let mut found = None;
    let mut ifa: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `ifa` with a list we free below.
    if unsafe { libc::getifaddrs(&mut ifa) } == 0 {
        let mut p = ifa;
        while !p.is_null() {
            // SAFETY: a node of the list getifaddrs returned, valid until freeifaddrs.
            let e = unsafe { &*p };
            let up = e.ifa_flags & libc::IFF_UP as u32 != 0;
            let lo = e.ifa_flags & libc::IFF_LOOPBACK as u32 != 0;
            // SAFETY: a non-null ifa_addr points to a sockaddr whose family says its type.
            if up
                && !lo
                && !e.ifa_addr.is_null()
                && unsafe { (*e.ifa_addr).sa_family } == libc::AF_INET as libc::sa_family_t
            {
                // SAFETY: AF_INET: the sockaddr is a sockaddr_in.
                let sin = unsafe { &*(e.ifa_addr as *const libc::sockaddr_in) };
                found = Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
                break;
            }
            p = e.ifa_next;
        }
        // SAFETY: the list getifaddrs allocated.
        unsafe { libc::freeifaddrs(ifa) };
    }
    Ok(Some(found.unwrap_or(Ipv4Addr::LOCALHOST)))
}

/// Wait this long for an answer to a request on a QP with ACK timeout code `code`.
pub fn wait_for(code: u8) -> Duration {
    ack_timeout(code).map_or(Duration::from_secs(1), |t| t.max(MIN_WAIT))
}

/// Sockets bound before the segment exists (the GID carries the port).
pub struct Bound {
    pub net: Net,
    service: Option<UdpSocket>,
    client: Option<UdpSocket>,
}

/// Bind the service and client sockets in this thread's network namespace, both to the
/// advertised address: the service takes requests only where the job reaches it (not on
/// every interface), and requests leave from the address their GID names, which the service
/// on the other side checks.
pub fn bind(choice: &str) -> Result<Bound> {
    let host = host_tag();
    let Some(ip) = advertised(choice)? else {
        return Ok(Bound {
            net: Net { addr: None, host },
            service: None,
            client: None,
        });
    };
    let io = |what: &str, e: std::io::Error| {
        Error::invalid(format!("soft HCA wire: {what} on {ip}: {e}"))
    };
    let service = UdpSocket::bind((ip, 0)).map_err(|e| io("bind", e))?;
    let client = UdpSocket::bind((ip, 0)).map_err(|e| io("bind", e))?;
    client
        .set_nonblocking(true)
        .map_err(|e| io("non-blocking client", e))?;
    let port = service
        .local_addr()
        .map_err(|e| io("local address", e))?
        .port();
    Ok(Bound {
        net: Net {
            addr: Some(SocketAddrV4::new(ip, port)),
            host,
        },
        service: Some(service),
        client: Some(client),
    })
}

/// This HCA's end of the wire: the client socket its requests leave from (never waited on:
/// answers are collected by [`Wire::drain`] when the requester runs) and the service thread.
pub struct Wire {
    client: Option<UdpSocket>,
    service: Option<SocketAddrV4>,
    /// High 16 bits: this HCA's nonce; the rest: see [`Wire::next_xid`].
    xid: AtomicU64,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    tx: std::sync::Mutex<Vec<u8>>,
    rx: std::sync::Mutex<Vec<u8>>,
    stats: Arc<Stats>,
}

impl Wire {
    /// Start the service for the segment `gid` names (ours).
    pub fn start(b: Bound, gid: Gid) -> Result<Wire> {
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Stats::default());
        let thread = match b.service {
            Some(sock) => {
                let svc = Service::new(Peer::attach(&gid)?, BUDGET, stats.clone());
                let st = stop.clone();
                Some(
                    std::thread::Builder::new()
                        .name("weft-soft-hca".into())
                        .spawn(move || super::service::serve(sock, svc, st))
                        .map_err(|e| Error::invalid(format!("soft HCA wire thread: {e}")))?,
                )
            }
            None => None,
        };
        Ok(Wire {
            client: b.client,
            service: b.net.addr,
            xid: AtomicU64::new((super::seg::nonce() & 0xffff) << 48),
            stop,
            thread,
            tx: std::sync::Mutex::new(Vec::with_capacity(CHUNK + HDR_REQ)),
            rx: std::sync::Mutex::new(vec![0u8; CHUNK + HDR_RESP + 64]),
            stats,
        })
    }

    /// Requests from other hosts executed here.
    pub fn served(&self) -> u64 {
        self.stats.served.load(Ordering::Relaxed)
    }

    /// UD datagrams from other hosts dropped here (the sender cannot know of them).
    pub fn ud_dropped(&self) -> u64 {
        self.stats.dropped.load(Ordering::Relaxed)
    }

    /// Packets from other hosts refused before execution (malformed, from an address that is
    /// not the claimed HCA's, contradicting their reassembly, over the budget).
    pub fn refused(&self) -> u64 {
        self.stats.refused.load(Ordering::Relaxed)
    }

    /// Bytes the service holds now for reassemblies and read results.
    pub fn held(&self) -> usize {
        self.stats.held.load(Ordering::Relaxed) as usize
    }

    /// A new exchange id for a request of QP index `qi`: the HCA's nonce, `qi` (so an answer
    /// finds its QP without a table) and a counter.
    pub fn next_xid(&self, qi: usize) -> u64 {
        let n = self.xid.fetch_add(1, Ordering::Relaxed);
        (n & !0xffff_ffff_ffff) | ((qi as u64 & 0xffff) << 32) | (n & 0xffff_ffff)
    }

    /// The QP index an exchange id of ours names.
    pub fn xid_qp(xid: u64) -> usize {
        ((xid >> 32) & 0xffff) as usize
    }

    fn send(&self, to: SocketAddrV4, m: &Msg) -> bool {
        let Some(c) = &self.client else { return false };
        let mut b = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        b.clear();
        m.encode(&mut b);
        c.send_to(&b, to).is_ok()
    }

    /// Hand every answer waiting on the client socket to `got` (sender, exchange id, answer,
    /// fragment, total, data), without waiting for one.
    pub fn drain(&self, mut got: impl FnMut(SocketAddrV4, u64, Reply, u16, u32, &[u8])) {
        let Some(c) = &self.client else { return };
        let mut rx = self.rx.lock().unwrap_or_else(|p| p.into_inner());
        while let Ok((n, from)) = c.recv_from(&mut rx) {
            let SocketAddr::V4(from) = from else { continue };
            if let Ok(Msg::Resp {
                xid,
                reply,
                frag,
                total,
                data,
            }) = Msg::decode(&rx[..n])
            {
                got(from, xid, reply, frag, total, data);
            }
        }
    }

    /// Wait until an answer is waiting on the client socket, at most `t`.
    pub fn wait_answer(&self, t: Duration) {
        let Some(c) = &self.client else {
            std::thread::sleep(t);
            return;
        };
        let mut p = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(c),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd (our socket's descriptor, alive while `self` is).
        unsafe { libc::poll(&mut p, 1, t.as_millis().clamp(1, 1000) as i32) };
    }

    /// A UD datagram to another host (no answer).
    pub fn ud(&self, to: SocketAddrV4, hdr: &ReqHdr, data: &[u8]) {
        let _ = self.send(
            to,
            &Msg::Req {
                xid: self.xid.fetch_add(1, Ordering::Relaxed),
                hdr: *hdr,
                frag: 0,
                data,
            },
        );
    }
}

impl Drop for Wire {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let (Some(c), Some(to), Some(t)) = (&self.client, self.service, self.thread.take()) {
            // Wake the service (from our client socket: it lives in the service's namespace).
            let _ = c.send_to(b"stop", to);
            let _ = t.join();
        }
    }
}

/// One RC request to another host, run by the requester without waiting (sans-IO but for the
/// sends it makes through the [`Wire`]): the payload goes fragment by fragment, each sent once
/// the previous one is acknowledged; a read's result is fetched fragment by fragment after
/// the answer. The HCA feeds it the answers [`Wire::drain`] collects and asks
/// [`Exchange::poll`] for the outcome: `NoResponse` once any packet has gone unanswered for the
/// QP's ACK timeout, which the QP counts as a transport retry, as for a peer on its host. So no
/// call ever waits on the network, and a silent host holds up only the QPs talking to it.
pub struct Exchange {
    pub xid: u64,
    pub to: SocketAddrV4,
    hdr: ReqHdr,
    payload: Vec<u8>,
    wait: Duration,
    /// The answer awaited: to fragment `frag` of the request, or (`fetching`) of the result.
    frag: u16,
    fetching: bool,
    deadline: Instant,
    /// The answer to the request, kept while a read's result is fetched.
    fin: Option<Outcome>,
    total: usize,
    result: Vec<u8>,
    done: Option<Outcome>,
}

impl Exchange {
    /// Start `hdr` (with `payload`: a send's or write's bytes) to the service at `to`.
    pub fn start(
        wire: &Wire,
        xid: u64,
        to: SocketAddrV4,
        hdr: ReqHdr,
        payload: Vec<u8>,
        wait: Duration,
        now: Instant,
    ) -> Exchange {
        let mut x = Exchange {
            xid,
            to,
            hdr,
            payload,
            wait,
            frag: 0,
            fetching: false,
            deadline: now,
            fin: None,
            total: 0,
            result: Vec::new(),
            done: None,
        };
        x.send_frag(wire, 0, now);
        x
    }

    fn send_frag(&mut self, wire: &Wire, f: u16, now: Instant) {
        let piece = if self.hdr.carries() {
            let a = f as usize * CHUNK;
            &self.payload[a.min(self.payload.len())..(a + CHUNK).min(self.payload.len())]
        } else {
            &[][..]
        };
        let m = Msg::Req {
            xid: self.xid,
            hdr: self.hdr,
            frag: f,
            data: piece,
        };
        self.await_answer(wire.send(self.to, &m), f, now);
    }

    fn fetch(&mut self, wire: &Wire, f: u16, now: Instant) {
        let sent = wire.send(
            self.to,
            &Msg::More {
                xid: self.xid,
                frag: f,
            },
        );
        self.await_answer(sent, f, now);
    }

    fn await_answer(&mut self, sent: bool, f: u16, now: Instant) {
        if !sent {
            self.done = Some(Outcome::NoResponse);
        }
        self.frag = f;
        self.deadline = now + self.wait;
    }

    /// An answer from `from` with this exchange's id arrived.
    #[allow(clippy::too_many_arguments)]
    pub fn on_answer(
        &mut self,
        wire: &Wire,
        from: SocketAddrV4,
        reply: Reply,
        frag: u16,
        total: u32,
        data: &[u8],
        now: Instant,
    ) {
        if self.done.is_some() || from != self.to || frag != self.frag {
            // Late or duplicated, or not from where the request went: dropped.
            return;
        }
        let want = self.hdr.len as usize;
        let read = self.hdr.op == WrOpcode::RdmaRead;
        if self.fetching {
            // A piece of the read's result.
            if data.is_empty() || self.result.len() + data.len() > self.total {
                self.done = Some(Outcome::NoResponse);
                return;
            }
            self.result.extend_from_slice(data);
            if self.result.len() == self.total {
                self.done = self.fin;
            } else {
                self.fetch(wire, frag.wrapping_add(1), now);
            }
            return;
        }
        match reply {
            Reply::FragOk if (frag as usize) + 1 < self.hdr.frags() => {
                self.send_frag(wire, frag + 1, now)
            }
            Reply::FragOk => self.done = Some(Outcome::NoResponse),
            Reply::Done { byte_len, value } => {
                let o = Outcome::Done { byte_len, value };
                if !read {
                    self.done = Some(o);
                    return;
                }
                // Only as much as was asked, the first piece in the answer.
                if total as usize != want || data.len() > want {
                    self.done = Some(Outcome::NoResponse);
                    return;
                }
                self.total = want;
                self.result.extend_from_slice(data);
                if self.result.len() == want {
                    self.done = Some(o);
                } else {
                    self.fin = Some(o);
                    self.fetching = true;
                    self.fetch(wire, 1, now);
                }
            }
            Reply::Rnr(c) => self.done = Some(Outcome::Rnr(c)),
            Reply::Fail(st) => self.done = Some(Outcome::Fail(st)),
        }
    }

    /// The outcome, once known: the answer, or `NoResponse` once the awaited packet is late.
    pub fn poll(&mut self, now: Instant) -> Option<Outcome> {
        if self.done.is_none() && now >= self.deadline {
            self.done = Some(Outcome::NoResponse);
        }
        self.done
    }

    /// A read's result (whole once [`Exchange::poll`] says `Done`).
    pub fn result(&self) -> &[u8] {
        &self.result
    }
}

/// The GRH a UD receive finds in front of the payload.
pub fn grh(src: &Gid, len: usize) -> [u8; GRH_LEN] {
    let mut grh = [0u8; GRH_LEN];
    grh[0] = 0x60; // IPv6-style version nibble, as a routed header carries
    grh[4..6].copy_from_slice(&(len as u16).to_be_bytes());
    grh[6] = 0x1b; // next header: IB transport
    grh[7] = 64;
    grh[8..24].copy_from_slice(&src.0);
    grh
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn hdr_strategy() -> impl Strategy<Value = ReqHdr> {
        (
            any::<bool>(),
            0usize..7,
            any::<u32>(),
            any::<[u8; 16]>(),
            any::<(u32, u32, u64, u32, u32, u64, u64)>(),
            0u32..300_000,
            any::<u32>(),
        )
            .prop_map(
                |(ud, op, sq, g, (dq, psn, ra, rk, imm, ca, sw), len, qkey)| {
                    let op = WR_OPCODES[op];
                    let ud = ud && matches!(op, WrOpcode::Send | WrOpcode::SendWithImm);
                    ReqHdr {
                        ud,
                        op,
                        src_qpn: sq,
                        src_gid: Gid(g),
                        dest_qpn: dq,
                        psn,
                        remote_addr: ra,
                        rkey: rk,
                        imm,
                        compare_add: ca,
                        swap: sw,
                        len: if ud { len % 4097 } else { len },
                        qkey,
                    }
                },
            )
    }

    proptest! {
        #[test]
        fn requests_round_trip(h in hdr_strategy(), xid in any::<u64>(), pick in any::<usize>()) {
            let frag = pick % h.frags();
            let n = if h.carries() {
                (h.len as usize - frag * CHUNK).min(CHUNK)
            } else {
                0
            };
            let data = vec![0xa5u8; n];
            let m = Msg::Req { xid, hdr: h, frag: frag as u16, data: &data };
            let mut b = Vec::new();
            m.encode(&mut b);
            prop_assert_eq!(Msg::decode(&b).unwrap(), m);
            // Every truncation is an error, never a panic.
            for cut in 0..b.len().min(HDR_REQ + 2) {
                prop_assert!(Msg::decode(&b[..cut]).is_err());
            }
        }

        #[test]
        fn answers_round_trip(xid in any::<u64>(), k in 0u8..4, code in any::<u8>(),
                              bl in any::<u32>(), v in any::<u64>(), n in 0usize..200) {
            let reply = match k {
                0 => Reply::FragOk,
                1 => Reply::Done { byte_len: bl, value: v },
                2 => Reply::Rnr(code & 31),
                _ => Reply::Fail(WcStatus::RemAccessErr),
            };
            let data = vec![1u8; n];
            let m = Msg::Resp { xid, reply, frag: 0, total: n as u32, data: &data };
            let mut b = Vec::new();
            m.encode(&mut b);
            prop_assert_eq!(Msg::decode(&b).unwrap(), m);
            let more = Msg::More { xid, frag: code as u16 };
            b.clear();
            more.encode(&mut b);
            prop_assert_eq!(Msg::decode(&b).unwrap(), more);
        }

        #[test]
        fn garbage_is_an_error_not_a_panic(b in proptest::collection::vec(any::<u8>(), 0..200),
                                           kind in 1u8..4) {
            let _ = Msg::decode(&b);
            let mut p = MAGIC.to_vec();
            p.push(kind);
            p.extend_from_slice(&b);
            let _ = Msg::decode(&p);
        }
    }

    #[test]
    fn inconsistent_fragments_are_refused() {
        let h = ReqHdr {
            ud: false,
            op: WrOpcode::RdmaWrite,
            src_qpn: 1,
            src_gid: Gid([1; 16]),
            dest_qpn: 2,
            psn: 3,
            remote_addr: 0,
            rkey: 5,
            imm: 0,
            compare_add: 0,
            swap: 0,
            len: (CHUNK + 10) as u32,
            qkey: 0,
        };
        let d = vec![0u8; 10];
        let mut b = Vec::new();
        // Fragment 0 must be full.
        Msg::Req {
            xid: 1,
            hdr: h,
            frag: 0,
            data: &d,
        }
        .encode(&mut b);
        assert!(Msg::decode(&b).is_err());
        b.clear();
        Msg::Req {
            xid: 1,
            hdr: h,
            frag: 1,
            data: &d,
        }
        .encode(&mut b);
        assert!(Msg::decode(&b).is_ok());
        // A UD datagram above 4096 bytes, or a UD write, is refused.
        let ud = ReqHdr {
            ud: true,
            len: 5000,
            op: WrOpcode::Send,
            ..h
        };
        b.clear();
        Msg::Req {
            xid: 1,
            hdr: ud,
            frag: 0,
            data: &vec![0; 5000],
        }
        .encode(&mut b);
        assert!(Msg::decode(&b).is_err());
        assert!(wait_for(1) >= MIN_WAIT && wait_for(0) == Duration::from_secs(1));
    }
}
