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
//! The requester side runs under the HCA's lock (one exchange at a time per HCA): a request to
//! another host blocks the calling thread for a round trip, at most the QP's ACK timeout
//! ([`wait_for`]).

use super::exec::{self, Outcome, Peer, Request};
use super::seg::Net;
use crate::types::*;
use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use weft_provider::cma::Range;
use weft_provider::{Error, Result};

/// Payload bytes per packet (a UDP datagram carries up to 65,507).
pub const CHUNK: usize = 60 * 1024;
/// The largest request the wire carries: a read result or a reassembled payload is buffered
/// whole at the responder. A longer request between hosts completes with a local length
/// error at once (rather than retrying into a buffer that can never be had).
pub const MAX_MSG: usize = 256 << 20;
/// Buffered reassemblies and read results the service keeps at most, in bytes.
const BUDGET: usize = 2 * MAX_MSG;
/// How long the service keeps an unfinished reassembly or an unfetched read result.
const KEEP: Duration = Duration::from_secs(5);
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
    fn carries(&self) -> bool {
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

/// Bind the service and client sockets in this thread's network namespace.
pub fn bind(choice: &str) -> Result<Bound> {
    let host = host_tag();
    let Some(ip) = advertised(choice)? else {
        return Ok(Bound {
            net: Net { addr: None, host },
            service: None,
            client: None,
        });
    };
    let io = |what: &str, e: std::io::Error| Error::invalid(format!("soft HCA wire: {what}: {e}"));
    let service = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(|e| io("bind", e))?;
    let client = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(|e| io("bind", e))?;
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

/// This HCA's end of the wire: the client socket for its requests and the service thread.
pub struct Wire {
    client: Option<UdpSocket>,
    port: u16,
    xid: AtomicU64,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    buf: std::sync::Mutex<Vec<u8>>,
    /// UD datagrams from other hosts the service dropped (no receive, wrong qkey, ...).
    dropped: Arc<AtomicU64>,
    /// Requests from other hosts the service executed (RC answered, UD delivered).
    served: Arc<AtomicU64>,
}

impl Wire {
    /// Start the service for the segment `gid` names (ours).
    pub fn start(b: Bound, gid: Gid) -> Result<Wire> {
        let stop = Arc::new(AtomicBool::new(false));
        let dropped = Arc::new(AtomicU64::new(0));
        let served = Arc::new(AtomicU64::new(0));
        let port = b.net.addr.map_or(0, |a| a.port());
        let thread = match b.service {
            Some(sock) => {
                let me = Peer::attach(&gid)?;
                let st = stop.clone();
                let dr = (dropped.clone(), served.clone());
                Some(
                    std::thread::Builder::new()
                        .name("weft-soft-hca".into())
                        .spawn(move || serve(sock, me, st, dr))
                        .map_err(|e| Error::invalid(format!("soft HCA wire thread: {e}")))?,
                )
            }
            None => None,
        };
        Ok(Wire {
            client: b.client,
            port,
            xid: AtomicU64::new(super::seg::nonce() << 32),
            stop,
            thread,
            buf: std::sync::Mutex::new(Vec::with_capacity(CHUNK + HDR_REQ)),
            dropped,
            served,
        })
    }

    /// Requests from other hosts executed here.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    /// UD datagrams from other hosts dropped here (the sender cannot know of them).
    pub fn ud_dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    fn send(&self, to: SocketAddrV4, m: &Msg) -> bool {
        let Some(c) = &self.client else { return false };
        let mut b = self.buf.lock().unwrap_or_else(|p| p.into_inner());
        b.clear();
        m.encode(&mut b);
        c.send_to(&b, to).is_ok()
    }

    /// Wait for the answer `xid`/`frag` until `deadline`.
    fn answer(
        &self,
        xid: u64,
        frag: u16,
        deadline: Instant,
        rx: &mut [u8],
        mut got: impl FnMut(Reply, u32, &[u8]),
    ) -> bool {
        let Some(c) = &self.client else { return false };
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || c.set_read_timeout(Some(left)).is_err() {
                return false;
            }
            let Ok(n) = c.recv(rx) else {
                if Instant::now() >= deadline {
                    return false;
                }
                continue;
            };
            if let Ok(Msg::Resp {
                xid: x,
                reply,
                frag: f,
                total,
                data,
            }) = Msg::decode(&rx[..n])
            {
                if x == xid && f == frag {
                    got(reply, total, data);
                    return true;
                }
            }
            // Anything else is a late answer to an exchange we gave up on: dropped.
        }
    }

    /// One RC request to another host: send the payload `data` (send, write) fragment by
    /// fragment, wait for the answer, fetch a read's result into `result`. `NoResponse`
    /// when any packet goes unanswered for `wait`.
    pub fn rc(
        &self,
        to: SocketAddrV4,
        hdr: &ReqHdr,
        data: &[u8],
        wait: Duration,
        result: &mut Vec<u8>,
    ) -> Outcome {
        let xid = self.xid.fetch_add(1, Ordering::Relaxed);
        let mut rx = vec![0u8; CHUNK + HDR_RESP + 64];
        let nf = hdr.frags();
        let mut fin = None;
        let mut total = 0u32;
        result.clear();
        for f in 0..nf {
            let piece = if hdr.carries() {
                &data[f * CHUNK..((f + 1) * CHUNK).min(data.len())]
            } else {
                &[][..]
            };
            let m = Msg::Req {
                xid,
                hdr: *hdr,
                frag: f as u16,
                data: piece,
            };
            if !self.send(to, &m) {
                return Outcome::NoResponse;
            }
            let deadline = Instant::now() + wait;
            let mut rep = None;
            let ok = self.answer(xid, f as u16, deadline, &mut rx, |r, t, d| {
                rep = Some(r);
                // Only a read's answer carries data, and only as much as was asked.
                if hdr.op == WrOpcode::RdmaRead && t == hdr.len && matches!(r, Reply::Done { .. }) {
                    total = t;
                    result.extend_from_slice(d);
                }
            });
            if !ok {
                return Outcome::NoResponse;
            }
            match rep {
                Some(Reply::FragOk) if f + 1 < nf => {}
                Some(Reply::FragOk) | None => return Outcome::NoResponse,
                Some(r) => {
                    fin = Some(r);
                    break;
                }
            }
        }
        let out = match fin {
            Some(Reply::Done { byte_len, value }) => Outcome::Done { byte_len, value },
            Some(Reply::Rnr(c)) => return Outcome::Rnr(c),
            Some(Reply::Fail(st)) => return Outcome::Fail(st),
            _ => return Outcome::NoResponse,
        };
        // The rest of a read's data, one fragment at a time.
        let total = total as usize;
        if hdr.op == WrOpcode::RdmaRead && (total != hdr.len as usize || result.len() > total) {
            return Outcome::NoResponse;
        }
        let mut f = 1u16;
        while result.len() < total {
            if !self.send(to, &Msg::More { xid, frag: f }) {
                return Outcome::NoResponse;
            }
            let before = result.len();
            let ok = self.answer(xid, f, Instant::now() + wait, &mut rx, |_, _, d| {
                if result.len() + d.len() <= total {
                    result.extend_from_slice(d)
                }
            });
            if !ok || result.len() == before {
                return Outcome::NoResponse;
            }
            f += 1;
        }
        out
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
        if let (Some(c), Some(t)) = (&self.client, self.thread.take()) {
            // Wake the service (from our client socket: it lives in the service's namespace).
            let _ = c.send_to(b"stop", (Ipv4Addr::LOCALHOST, self.port));
            let _ = t.join();
        }
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

struct Asm {
    buf: Vec<u8>,
    next: usize,
    at: Instant,
}

/// The service: answer requests from other hosts until stopped.
fn serve(
    sock: UdpSocket,
    me: Peer,
    stop: Arc<AtomicBool>,
    (dropped, served): (Arc<AtomicU64>, Arc<AtomicU64>),
) {
    let _ = sock.set_read_timeout(Some(Duration::from_millis(500)));
    let mut rx = vec![0u8; 65_536];
    let mut tx = Vec::with_capacity(CHUNK + HDR_RESP);
    let mut asm: HashMap<(SocketAddr, u64), Asm> = HashMap::new();
    let mut reads: HashMap<(SocketAddr, u64), (Vec<u8>, Instant)> = HashMap::new();
    let mut out = [0u8; 8];
    while !stop.load(Ordering::SeqCst) {
        let Ok((n, from)) = sock.recv_from(&mut rx) else {
            continue;
        };
        let Ok(m) = Msg::decode(&rx[..n]) else {
            tracing::debug!(target: "weft::verbs", "soft HCA wire: dropped a malformed packet from {from}");
            continue;
        };
        // A muted or closed HCA answers nothing, as a hung node would not.
        if !me.responsive(false) {
            continue;
        }
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
            let _ = sock.send_to(&tx, from);
        };
        match m {
            Msg::More { xid, frag } => {
                if let Some((b, _)) = reads.get(&(from, xid)) {
                    let off = frag as usize * CHUNK;
                    if off < b.len() {
                        let end = (off + CHUNK).min(b.len());
                        let done = end == b.len();
                        reply(xid, Reply::FragOk, frag, b.len() as u32, &b[off..end]);
                        if done {
                            reads.remove(&(from, xid));
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
                let now = Instant::now();
                let held = |a: &HashMap<_, Asm>, r: &HashMap<_, (Vec<u8>, Instant)>| {
                    a.values().map(|x| x.buf.capacity()).sum::<usize>()
                        + r.values().map(|x| x.0.capacity()).sum::<usize>()
                };
                asm.retain(|_, a| now.duration_since(a.at) < KEEP);
                reads.retain(|_, r| now.duration_since(r.1) < KEEP);
                let nf = hdr.frags();
                let payload: std::borrow::Cow<[u8]> = if nf == 1 {
                    std::borrow::Cow::Borrowed(data)
                } else {
                    let key = (from, xid);
                    if !asm.contains_key(&key) {
                        if frag != 0 || held(&asm, &reads) + hdr.len as usize > BUDGET {
                            continue;
                        }
                        asm.insert(
                            key,
                            Asm {
                                buf: Vec::with_capacity(hdr.len as usize),
                                next: 0,
                                at: now,
                            },
                        );
                    }
                    let Some(a) = asm.get_mut(&key) else { continue };
                    let f = frag as usize;
                    if f < a.next {
                        // A repeated fragment (our FragOk was lost): acknowledge again.
                        if f + 1 < nf {
                            reply(xid, Reply::FragOk, frag, 0, &[]);
                        }
                        continue;
                    }
                    if f > a.next {
                        continue;
                    }
                    a.buf.extend_from_slice(data);
                    a.next += 1;
                    a.at = now;
                    if f + 1 < nf {
                        reply(xid, Reply::FragOk, frag, 0, &[]);
                        continue;
                    }
                    match asm.remove(&key) {
                        Some(a) => std::borrow::Cow::Owned(a.buf),
                        None => continue,
                    }
                };
                let is_read = hdr.op == WrOpcode::RdmaRead;
                let mut result = Vec::new();
                if is_read && hdr.len > 0 {
                    if held(&asm, &reads) + hdr.len as usize > BUDGET {
                        continue;
                    }
                    result = vec![0u8; hdr.len as usize];
                }
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
                    if exec::ud(&me, &req) {
                        served.fetch_add(1, Ordering::Relaxed);
                    } else {
                        dropped.fetch_add(1, Ordering::Relaxed);
                    }
                    continue;
                }
                let o = exec::rc(&me, &req);
                if o != Outcome::NoResponse {
                    served.fetch_add(1, Ordering::Relaxed);
                }
                let last = (nf - 1) as u16;
                match o {
                    Outcome::Done { byte_len, value } => {
                        let r = Reply::Done { byte_len, value };
                        if is_read {
                            let first = result.len().min(CHUNK);
                            reply(xid, r, last, result.len() as u32, &result[..first]);
                            if result.len() > CHUNK {
                                reads.insert((from, xid), (result, now));
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
    }
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
