//! `tcp-sim`: TCP between ranks on any hosts, with knobs that simulate a slower network.
//!
//! * One connection per pair of ranks, opened lazily on first use. Both ranks may connect at
//!   once; the connection opened by the lower rank wins (`HELLO`/`ACK` handshake), so no pair
//!   ever uses two. Everything is nonblocking on `mio`, with `TCP_NODELAY`.
//! * Frames ([`frame`]): an 8-byte versioned header, the active-message header and the payload,
//!   written with one `writev` straight from the caller's iovec when the socket has room (frames
//!   up to 256 bytes are gathered on the stack and written with one `send`, which the kernel
//!   handles faster).
//! * Flow control: a connection buffers at most `WEFT_TCP_SIM_QUEUE` bytes of unsent frames,
//!   then `am_send` reports Busy; a large frame that finds the socket full is refused at once
//!   rather than copied (the core retries it); large messages use the core's rendezvous.
//! * Failure: EOF, reset or a malformed frame fails that peer ("peer failed: rank N"); the
//!   others go on.
//! * Simulation: `WEFT_TCP_SIM_DELAY_US`, `WEFT_TCP_SIM_BW_MBPS`, `WEFT_TCP_SIM_JITTER_US` hold
//!   each frame at the sender until its simulated arrival time: one-way delay plus jitter, after
//!   serialising through a token bucket at the given rate. Order per pair is kept.
//!
//! Size (over 800 lines): one connection state machine (lazy connect, the simultaneous-connect
//! handshake, framing into `am_target` buffers, the simulated delay/bandwidth queue, failure
//! detection) over one `mio` poll; the frame format is in `frame.rs`.

pub mod frame;

use frame::{decode_header, FrameHeader, Limits, FRAME_HDR, K_ACK, K_AM, K_HELLO};
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};
use std::collections::VecDeque;
use std::io::{IoSlice, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};
use weft_provider::bootstrap::Bootstrap;
use weft_provider::provider::{
    Caps, Discard, ProbeContext, Provider, SendOutcome, Sink, StaticProvider,
};
use weft_provider::{Error, ErrorDetail, Rank, Result};

weft_provider::param!(BIND: Str = "tcp-sim", "BIND", "auto",
    "address or interface to listen on (auto: loopback when every rank is on this host, else the first non-loopback IPv4 address)");
weft_provider::param!(CHUNK: Size[4 << 10, 64 << 20] = "tcp-sim", "CHUNK", "512K",
    "largest frame payload: the rendezvous chunk size (4K to 64M)");
weft_provider::param!(EAGER: Size = "tcp-sim", "EAGER", "64K",
    "messages up to this size are sent eagerly");
weft_provider::param!(DIRECT: Bool = "tcp-sim", "DIRECT", "1",
    "read large payloads from the socket straight into the receive buffer when the core names it (0: always through the connection's buffer)");
weft_provider::param!(QUEUE: Size[0, 1 << 30] = "tcp-sim", "QUEUE", "1M",
    "unsent bytes a connection may buffer before senders see Busy (at least two frames; simulating, plus the bytes on the simulated wire; at most 1G)");
weft_provider::param!(DELAY_US: Uint[0, 1_000_000] = "tcp-sim", "DELAY_US", "0",
    "simulated one-way delay added to every frame, in microseconds (at most 10^6)");
weft_provider::param!(BW_MBPS: Float[0, 1e7] check(weft_provider::param::checks::zero_or_a_rate) = "tcp-sim", "BW_MBPS", "0",
    "simulated bandwidth per rank in MB/s (10^6 B/s; 0: unlimited, else 0.001 to 10^7)");
weft_provider::param!(JITTER_US: Uint[0, 1_000_000] = "tcp-sim", "JITTER_US", "0",
    "simulated random extra delay per frame, uniform in [0, JITTER_US] microseconds (at most 10^6)");

const LISTENER: Token = Token(usize::MAX);
const MAX_HEADER: usize = 64;

#[derive(Debug, Clone)]
struct Config {
    bind: String,
    chunk: usize,
    eager: usize,
    direct: bool,
    queue: usize,
    delay: Duration,
    jitter: Duration,
    rate: Option<f64>,
}

impl Config {
    fn from_env() -> Result<Config> {
        // Every range is in the parameter's declaration.
        let chunk = CHUNK.get_size()?;
        let bw = BW_MBPS.get_f64()?;
        let micros = |p: &weft_provider::param::ParamDesc| -> Result<Duration> {
            Ok(Duration::from_micros(p.get_u64()?))
        };
        let queue = QUEUE.get_size()?;
        Ok(Config {
            bind: BIND.get_str(),
            chunk,
            eager: EAGER.get_size()?.min(chunk),
            direct: DIRECT.get_bool()?,
            // At least two whole frames: when simulating, one is being serialised through the
            // token bucket while the next waits (with one, the link idles between frames).
            queue: queue.max(2 * (FRAME_HDR + MAX_HEADER + chunk)),
            delay: micros(&DELAY_US)?,
            jitter: micros(&JITTER_US)?,
            rate: (bw > 0.0).then_some(bw * 1e6),
        })
    }

    fn caps(&self) -> Caps {
        let mut c = Caps::am_only(MAX_HEADER, self.chunk, 64);
        c.eager_limit = self.eager;
        c.spans_processes = true;
        c.spans_hosts = true;
        c
    }

    fn simulating(&self) -> bool {
        !self.delay.is_zero() || !self.jitter.is_zero() || self.rate.is_some()
    }
}

/// First IPv4 address of an up, non-loopback interface (or of the named interface).
fn interface_addr(name: Option<&str>) -> Option<Ipv4Addr> {
    let mut found = None;
    // SAFETY: getifaddrs allocates a list we walk read-only and free with freeifaddrs.
    unsafe {
        let mut ifs: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut ifs) != 0 {
            return None;
        }
        let mut p = ifs;
        while !p.is_null() {
            let ifa = &*p;
            p = ifa.ifa_next;
            if ifa.ifa_addr.is_null() || (*ifa.ifa_addr).sa_family as i32 != libc::AF_INET {
                continue;
            }
            let up = ifa.ifa_flags & libc::IFF_UP as u32 != 0;
            let lo = ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0;
            let ifname = std::ffi::CStr::from_ptr(ifa.ifa_name).to_string_lossy();
            let wanted = match name {
                Some(n) => ifname == n,
                None => up && !lo,
            };
            if wanted {
                let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                found = Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
                break;
            }
        }
        libc::freeifaddrs(ifs);
    }
    found
}

fn bind_ip(spec: &str, one_host: bool) -> Result<IpAddr> {
    let s = spec.trim();
    if s.is_empty() || s == "auto" {
        if one_host {
            return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
        }
        return interface_addr(None).map(IpAddr::V4).ok_or_else(|| {
            Error::from(ErrorDetail::Unsupported(
                "no up, non-loopback IPv4 interface to listen on; set WEFT_TCP_SIM_BIND".into(),
            ))
        });
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(ip);
    }
    interface_addr(Some(s)).map(IpAddr::V4).ok_or_else(|| {
        Error::from(ErrorDetail::Param {
            var: BIND.env_name(),
            value: s.into(),
            expected: "auto, an IP address or an interface with an IPv4 address".into(),
        })
    })
}

enum Role {
    /// We connected to `peer`; `hello` once our HELLO is written.
    Outgoing { hello: bool },
    /// Accepted; the peer is known after its HELLO.
    Incoming,
}

struct Conn {
    stream: TcpStream,
    peer: Option<Rank>,
    role: Role,
    rx: Vec<u8>,
    start: usize,
    end: usize,
    /// A payload being read from the socket straight into its destination.
    direct: Option<Direct>,
    /// The core declined direct placement for the frame at `start`: wait for all of it.
    buffered: bool,
    /// A frame was placed directly and no frame with a payload came since, so the next is
    /// likely another large one: read only up to its header, leaving its payload in the socket
    /// for direct placement.
    expect_large: bool,
}

/// Rate at which a simulated link without `WEFT_TCP_SIM_BW_MBPS` is assumed to carry data when
/// sizing what may be in flight on it (loopback TCP moves 3–5 GB/s here).
const SIM_FAST_LINK: f64 = 10e9;

/// Frames up to this long are gathered on the stack and written with one `send`.
const SMALL_FRAME: usize = 256;

/// Payloads at least this long are offered for direct placement when they arrive in pieces.
const DIRECT_MIN: usize = 16 * 1024;

/// Without simulation, a payload at least this long that finds the socket full (or frames
/// queued before it) is refused with `Busy` instead of being copied into the queue: the core
/// keeps it and retries, so the bytes are copied once, by the kernel. Shorter frames are queued,
/// which lets small sends complete at once.
const COPY_MAX: usize = 16 * 1024;

/// An active message whose payload is read from the socket into the memory the core named
/// (`Sink::am_target`), skipping the copy through `rx`.
struct Direct {
    src: Rank,
    hdr: [u8; MAX_HEADER],
    hdr_len: usize,
    len: usize,
    done: usize,
    /// The destination went away (its receive failed): read and drop the rest.
    discard: bool,
}

impl Conn {
    /// Continue a direct payload: `Ok(true)` when it is complete, `Ok(false)` when the socket
    /// has nothing more for now, `Err` when the connection broke.
    fn read_direct(&mut self, sink: &mut dyn Sink) -> std::result::Result<bool, String> {
        let Conn {
            stream, rx, direct, ..
        } = self;
        let Some(d) = direct.as_mut() else {
            return Ok(true);
        };
        loop {
            if d.done == d.len {
                *direct = None;
                return Ok(true);
            }
            let want = d.len - d.done;
            let hdr = &d.hdr[..d.hdr_len];
            let target = if d.discard {
                None
            } else {
                sink.am_target(d.src, hdr, d.done, want)
            };
            let res = match target {
                Some(p) => {
                    // SAFETY: the sink made `p` valid for writes of `want` bytes until our next
                    // call into it, which is the `am_placed` below; the bytes are initialised
                    // (the receive buffer is a borrowed slice of plain data).
                    let buf = unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), want) };
                    stream.read(buf)
                }
                None => {
                    d.discard = true;
                    let m = want.min(rx.len());
                    stream.read(&mut rx[..m])
                }
            };
            match res {
                Ok(0) => return Err("connection closed (EOF)".into()),
                Ok(n) => {
                    if target.is_some() {
                        sink.am_placed(d.src, hdr, d.done, n);
                    }
                    d.done += n;
                }
                Err(e) if would_block(&e) => return Ok(false),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("connection error: {e}")),
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Idle,
    /// Our outgoing connection (slot) is being set up.
    Connecting(usize),
    /// Our attempt lost; the peer's connection will arrive.
    WaitIncoming,
    Established(usize),
    Failed,
}

struct OutFrame {
    data: Vec<u8>,
    off: usize,
    due: Option<Instant>,
}

struct Peer {
    state: State,
    outq: VecDeque<OutFrame>,
    out_bytes: usize,
    last_due: Option<Instant>,
}

struct Sim {
    delay: Duration,
    jitter: Duration,
    rate: Option<f64>,
    /// Frames wait in the connection's queue until their arrival time: this many bytes of them
    /// may be "on the wire" on top of `WEFT_TCP_SIM_QUEUE` (the bandwidth-delay product), as a
    /// real connection keeps its window in flight. Without it a 100 µs delay lets one or two
    /// frames through per delay; with much more, frames are copied long before they are
    /// written and have left the cache (both measured slower).
    in_flight: usize,
    nic_free: Instant,
    rng: u64,
}

impl Sim {
    fn due(&mut self, peer: &mut Peer, bytes: usize) -> Instant {
        let now = Instant::now();
        let mut depart = now;
        if let Some(r) = self.rate {
            depart = self.nic_free.max(now);
            self.nic_free = depart + Duration::from_secs_f64(bytes as f64 / r);
            depart = self.nic_free;
        }
        let mut due = depart + self.delay;
        if !self.jitter.is_zero() {
            // xorshift64
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            due += Duration::from_nanos(self.rng % (self.jitter.as_nanos() as u64 + 1));
        }
        if let Some(l) = peer.last_due {
            due = due.max(l);
        }
        peer.last_due = Some(due);
        due
    }
}

/// The TCP provider of one rank.
pub struct TcpSim {
    rank: Rank,
    size: u32,
    caps: Caps,
    cfg: Config,
    poll: Poll,
    events: Events,
    listener: TcpListener,
    addrs: Vec<SocketAddr>,
    conns: Vec<Option<Conn>>,
    peers: Vec<Peer>,
    busy_peers: Vec<Rank>,
    sim: Option<Sim>,
    selfq: VecDeque<(Vec<u8>, Vec<u8>)>,
    failures: Vec<(Rank, String)>,
    /// Buffers of frames already written, kept for the next queued frame (a fresh frame-sized
    /// allocation per partial write would cost a page fault per page).
    spare: weft_provider::BufPool,
    limits: Limits,
    /// Established connections polled with direct reads (when there are few of them).
    direct: Vec<usize>,
    polls: u32,
}

/// Written frame buffers kept for reuse.
const SPARE_FRAMES: usize = 8;

/// Up to this many established connections are polled with direct reads instead of epoll.
const DIRECT_MAX: usize = 8;
/// With direct polling, epoll (accepts, connects) runs once every this many progress calls.
const EPOLL_EVERY: u32 = 256;

fn would_block(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::WouldBlock
}

impl TcpSim {
    fn open_with(boot: &mut dyn Bootstrap, cfg: Config) -> Result<Self> {
        let rank = boot.rank();
        let size = boot.size();
        let one_host = boot.nodes().hosts() == 1;
        let ip = bind_ip(&cfg.bind, one_host)?;
        let std_l = std::net::TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| Error::io(format!("listening on {ip}"), e))?;
        std_l
            .set_nonblocking(true)
            .map_err(|e| Error::io("making the listener nonblocking", e))?;
        let local = std_l
            .local_addr()
            .map_err(|e| Error::io("reading the listening address", e))?;
        let mut listener = TcpListener::from_std(std_l);
        let poll = Poll::new().map_err(|e| Error::io("creating the poller", e))?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)
            .map_err(|e| Error::io("registering the listener", e))?;
        let addrs = weft_provider::bootstrap::allgather(boot, "tcp-sim.addr", &local.to_string())?
            .into_iter()
            .enumerate()
            .map(|(r, a)| {
                a.parse::<SocketAddr>().map_err(|_| {
                    Error::from(ErrorDetail::Bootstrap(format!(
                        "rank {r} published a bad address '{a}'"
                    )))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let sim = cfg.simulating().then(|| Sim {
            delay: cfg.delay,
            jitter: cfg.jitter,
            rate: cfg.rate,
            // Bounded: the simulated wire never holds more than 256 MiB.
            in_flight: ((cfg.delay + cfg.jitter).as_secs_f64() * cfg.rate.unwrap_or(SIM_FAST_LINK))
                .min((256 << 20) as f64) as usize,
            nic_free: Instant::now(),
            rng: 0x9E37_79B9_7F4A_7C15 ^ (rank as u64 + 1),
        });
        let limits = Limits {
            max_hdr: MAX_HEADER,
            max_payload: cfg.chunk,
        };
        // Simulating, every frame goes through the queue, up to the bytes on the simulated wire:
        // keep enough buffers for them (fresh frame-sized allocations fault in every page).
        let spare_frames = match &sim {
            Some(s) => SPARE_FRAMES + (cfg.queue + s.in_flight) / cfg.chunk,
            None => SPARE_FRAMES,
        };
        Ok(TcpSim {
            rank,
            size,
            caps: cfg.caps(),
            poll,
            events: Events::with_capacity(256),
            listener,
            addrs,
            conns: Vec::new(),
            peers: (0..size)
                .map(|_| Peer {
                    state: State::Idle,
                    outq: VecDeque::new(),
                    out_bytes: 0,
                    last_due: None,
                })
                .collect(),
            busy_peers: Vec::new(),
            sim,
            selfq: VecDeque::new(),
            failures: Vec::new(),
            spare: weft_provider::BufPool::new(spare_frames, usize::MAX),
            limits,
            direct: Vec::new(),
            polls: 0,
            cfg,
        })
    }

    fn rx_capacity(&self) -> usize {
        2 * (FRAME_HDR + MAX_HEADER + self.cfg.chunk)
    }

    fn add_conn(&mut self, mut stream: TcpStream, peer: Option<Rank>, role: Role) -> Result<usize> {
        let slot = match self.conns.iter().position(|c| c.is_none()) {
            Some(i) => i,
            None => {
                self.conns.push(None);
                self.conns.len() - 1
            }
        };
        let _ = stream.set_nodelay(true);
        self.poll
            .registry()
            .register(
                &mut stream,
                Token(slot),
                Interest::READABLE | Interest::WRITABLE,
            )
            .map_err(|e| Error::io("registering a connection", e))?;
        let cap = self.rx_capacity();
        self.conns[slot] = Some(Conn {
            stream,
            peer,
            role,
            rx: vec![0u8; cap],
            start: 0,
            end: 0,
            direct: None,
            buffered: false,
            expect_large: false,
        });
        Ok(slot)
    }

    fn drop_conn(&mut self, slot: usize) {
        if let Some(mut c) = self.conns.get_mut(slot).and_then(|c| c.take()) {
            let _ = self.poll.registry().deregister(&mut c.stream);
        }
        self.direct.retain(|s| *s != slot);
    }

    fn established(&mut self, r: Rank, slot: usize) {
        self.peers[r as usize].state = State::Established(slot);
        if !self.direct.contains(&slot) {
            self.direct.push(slot);
        }
        self.mark_busy(r);
    }

    /// Poll with direct reads: few connections, all established, nothing being set up.
    fn direct_mode(&self) -> bool {
        self.direct.len() <= DIRECT_MAX
            && self.conns.iter().flatten().count() == self.direct.len()
            && self.polls % EPOLL_EVERY != 0
    }

    fn fail_peer(&mut self, r: Rank, why: String) {
        let p = &mut self.peers[r as usize];
        if p.state == State::Failed {
            return;
        }
        let slot = match p.state {
            State::Connecting(s) | State::Established(s) => Some(s),
            _ => None,
        };
        p.state = State::Failed;
        p.outq.clear();
        p.out_bytes = 0;
        if let Some(s) = slot {
            self.drop_conn(s);
        }
        self.failures.push((r, why));
    }

    fn connect(&mut self, r: Rank) -> Result<()> {
        let addr = self.addrs[r as usize];
        match TcpStream::connect(addr) {
            Ok(s) => {
                let slot = self.add_conn(s, Some(r), Role::Outgoing { hello: false })?;
                self.peers[r as usize].state = State::Connecting(slot);
            }
            Err(e) => self.fail_peer(r, format!("cannot connect to {addr}: {e}")),
        }
        Ok(())
    }

    /// Write a small control frame on a fresh connection (retries briefly on WouldBlock).
    fn write_ctrl(stream: &mut TcpStream, kind: u8, payload: &[u8]) -> std::io::Result<()> {
        let h = FrameHeader {
            kind,
            hdr_len: 0,
            payload_len: payload.len(),
        }
        .encode();
        let mut buf = h.to_vec();
        buf.extend_from_slice(payload);
        let mut off = 0;
        let t0 = Instant::now();
        while off < buf.len() {
            match stream.write(&buf[off..]) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => off += n,
                Err(e) if would_block(&e) => {
                    if t0.elapsed() > Duration::from_secs(5) {
                        return Err(std::io::ErrorKind::TimedOut.into());
                    }
                    std::thread::yield_now();
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn on_writable(&mut self, slot: usize) {
        let Some(c) = self.conns[slot].as_mut() else {
            return;
        };
        if let Role::Outgoing { hello: false } = c.role {
            let Some(r) = c.peer else { return };
            match c.stream.take_error() {
                Ok(Some(e)) | Err(e) => {
                    let a = self.addrs[r as usize];
                    self.fail_peer(r, format!("cannot connect to {a}: {e}"));
                    return;
                }
                Ok(None) => {}
            }
            if c.stream.peer_addr().is_err() {
                return; // still connecting
            }
            let mut hello = Vec::with_capacity(4);
            hello.extend_from_slice(&self.rank.to_le_bytes());
            match Self::write_ctrl(&mut c.stream, K_HELLO, &hello) {
                Ok(()) => c.role = Role::Outgoing { hello: true },
                Err(e) => self.fail_peer(r, format!("connection lost during the handshake: {e}")),
            }
        }
    }

    fn on_hello(&mut self, slot: usize, from: Rank) {
        if from >= self.size || from == self.rank {
            tracing::warn!(from, "tcp-sim: HELLO with a bad rank; closing");
            self.drop_conn(slot);
            return;
        }
        let me = self.rank;
        let state = self.peers[from as usize].state;
        let accept = match state {
            State::Idle | State::WaitIncoming => true,
            // Both connected at once: the lower rank's connection wins.
            State::Connecting(_) => from < me,
            State::Established(_) | State::Failed => false,
        };
        let Some(c) = self.conns[slot].as_mut() else {
            return;
        };
        let r = Self::write_ctrl(&mut c.stream, K_ACK, &[accept as u8]);
        if !accept || r.is_err() {
            self.drop_conn(slot);
            return;
        }
        c.peer = Some(from);
        if let State::Connecting(old) = state {
            self.drop_conn(old);
        }
        self.established(from, slot);
    }

    fn on_ack(&mut self, slot: usize, ok: bool) {
        let Some(r) = self.conns[slot].as_ref().and_then(|c| c.peer) else {
            self.drop_conn(slot);
            return;
        };
        if self.peers[r as usize].state != State::Connecting(slot) {
            self.drop_conn(slot);
            return;
        }
        if ok {
            self.established(r, slot);
        } else {
            self.drop_conn(slot);
            self.peers[r as usize].state = State::WaitIncoming;
        }
    }

    fn mark_busy(&mut self, r: Rank) {
        if !self.peers[r as usize].outq.is_empty() && !self.busy_peers.contains(&r) {
            self.busy_peers.push(r);
        }
    }

    /// Read everything available on a connection and deliver its frames.
    fn on_readable(&mut self, slot: usize, sink: &mut dyn Sink) -> usize {
        let mut delivered = 0;
        'read: loop {
            let Some(c) = self.conns[slot].as_mut() else {
                return delivered;
            };
            if c.direct.is_some() {
                match c.read_direct(sink) {
                    Ok(true) => {
                        delivered += 1;
                        c.expect_large = true;
                        continue;
                    }
                    Ok(false) => return delivered,
                    Err(why) => {
                        self.closed(slot, why);
                        return delivered;
                    }
                }
            }
            if c.end == c.rx.len() {
                // Compact: the partial frame at the front moves to the start.
                c.rx.copy_within(c.start..c.end, 0);
                c.end -= c.start;
                c.start = 0;
            }
            let mut room = c.rx.len() - c.end;
            if c.expect_large && c.start == c.end {
                room = room.min(FRAME_HDR + MAX_HEADER);
            }
            let n = match c.stream.read(&mut c.rx[c.end..c.end + room]) {
                Ok(0) => {
                    self.closed(slot, "connection closed (EOF)".into());
                    return delivered;
                }
                Ok(n) => n,
                Err(e) if would_block(&e) => return delivered,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.closed(slot, format!("connection error: {e}"));
                    return delivered;
                }
            };
            c.end += n;
            // A short read drained the socket: no need for another read that returns EAGAIN
            // (new data raises a new edge for epoll, and direct polling reads again anyway).
            let drained = n < room;
            loop {
                let Some(c) = self.conns[slot].as_mut() else {
                    return delivered;
                };
                let h = match decode_header(&c.rx[c.start..c.end], self.limits) {
                    Ok(Some(h)) => h,
                    Ok(None) => break,
                    Err(e) => {
                        self.closed(slot, format!("malformed frame: {e}"));
                        return delivered;
                    }
                };
                let f = c.start + FRAME_HDR;
                let (hs, ps) = (f, f + h.hdr_len);
                let pe = ps + h.payload_len;
                if c.end < pe {
                    // Part of a frame. A large active-message payload may go straight to its
                    // destination instead of waiting for all of it in `rx`.
                    let est = c
                        .peer
                        .filter(|&r| self.peers[r as usize].state == State::Established(slot));
                    if let (K_AM, false, true, true, Some(r)) = (
                        h.kind,
                        c.buffered || !self.cfg.direct,
                        h.payload_len >= DIRECT_MIN,
                        c.end >= ps,
                        est,
                    ) {
                        let pre = c.end - ps;
                        match sink.am_target(r, &c.rx[hs..ps], 0, h.payload_len) {
                            Some(p) => {
                                // SAFETY: `p` is valid for `payload_len >= pre` bytes until our
                                // next call into the sink (`am_placed` below); `rx` is ours.
                                unsafe {
                                    std::ptr::copy_nonoverlapping(
                                        c.rx[ps..].as_ptr(),
                                        p.as_ptr(),
                                        pre,
                                    )
                                };
                                if pre > 0 {
                                    sink.am_placed(r, &c.rx[hs..ps], 0, pre);
                                }
                                let mut hdr = [0u8; MAX_HEADER];
                                hdr[..h.hdr_len].copy_from_slice(&c.rx[hs..ps]);
                                c.direct = Some(Direct {
                                    src: r,
                                    hdr,
                                    hdr_len: h.hdr_len,
                                    len: h.payload_len,
                                    done: pre,
                                    discard: false,
                                });
                                c.start = 0;
                                c.end = 0;
                                continue 'read;
                            }
                            None => c.buffered = true,
                        }
                    }
                    break;
                }
                c.buffered = false;
                // A control frame (CTS, SACK: no payload) between two large frames keeps the
                // header-only reads on; a small data frame ends them.
                if h.payload_len > 0 {
                    c.expect_large = false;
                }
                c.start += h.total();
                match h.kind {
                    K_AM => match c.peer {
                        Some(r) if self.peers[r as usize].state == State::Established(slot) => {
                            sink.am(r, &c.rx[hs..ps], &c.rx[ps..pe]);
                            delivered += 1;
                        }
                        _ => {
                            self.closed(slot, "data before the handshake".into());
                            return delivered;
                        }
                    },
                    K_HELLO => {
                        let from = (h.payload_len == 4 && matches!(c.role, Role::Incoming))
                            .then(|| u32::from_le_bytes(c.rx[ps..ps + 4].try_into().unwrap()));
                        match from {
                            Some(r) => self.on_hello(slot, r),
                            None => {
                                self.closed(slot, "bad HELLO".into());
                                return delivered;
                            }
                        }
                    }
                    _ => {
                        let ok = h.payload_len == 1 && c.rx[ps] == 1;
                        self.on_ack(slot, ok);
                    }
                }
            }
            if drained {
                return delivered;
            }
        }
    }

    fn closed(&mut self, slot: usize, why: String) {
        let conn = self.conns[slot].as_ref().map(|c| (c.peer, &c.role));
        match conn {
            Some((Some(r), _))
                if matches!(self.peers[r as usize].state,
                    State::Established(s) | State::Connecting(s) if s == slot) =>
            {
                self.fail_peer(r, why)
            }
            Some((None, Role::Incoming)) => {
                // A peer connected and went away before saying who it is: it may have died
                // while connecting. Connect to every peer we have no connection with; a dead
                // one refuses (its listener is gone) and fails, a live one gets its lazy
                // connection a little early.
                self.drop_conn(slot);
                self.probe_unconnected();
            }
            _ => self.drop_conn(slot),
        }
    }

    /// Connect to every peer with no connection and none under way (see `closed`).
    fn probe_unconnected(&mut self) {
        for r in 0..self.size {
            if r == self.rank {
                continue;
            }
            if matches!(
                self.peers[r as usize].state,
                State::Idle | State::WaitIncoming
            ) {
                tracing::debug!(peer = r, "tcp-sim: probing after an anonymous disconnect");
                if let Err(e) = self.connect(r) {
                    tracing::warn!("tcp-sim: probing rank {r}: {e}");
                }
            }
        }
    }

    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((s, _)) => {
                    if let Err(e) = self.add_conn(s, None, Role::Incoming) {
                        tracing::warn!("tcp-sim: {e}");
                    }
                }
                Err(e) if would_block(&e) => return,
                Err(e) => {
                    tracing::warn!("tcp-sim: accept: {e}");
                    return;
                }
            }
        }
    }

    /// Write queued frames that are due. Returns frames completed.
    fn flush(&mut self) -> usize {
        let mut done = 0;
        let now = self.sim.as_ref().map(|_| Instant::now());
        let mut i = 0;
        while i < self.busy_peers.len() {
            let r = self.busy_peers[i];
            match self.peers[r as usize].state {
                State::Established(slot) => done += self.flush_peer(r, slot, now),
                State::Failed => {}
                _ => {
                    i += 1;
                    continue;
                }
            }
            if self.peers[r as usize].outq.is_empty() {
                self.busy_peers.swap_remove(i);
            } else {
                i += 1;
            }
        }
        done
    }

    /// Write `r`'s queued frames (those due by `now` when simulating) on its connection `slot`
    /// until the socket is full; a write error fails the peer. Returns frames completed.
    fn flush_peer(&mut self, r: Rank, slot: usize, now: Option<Instant>) -> usize {
        let mut done = 0;
        let mut failed = None;
        let p = &mut self.peers[r as usize];
        let c = self.conns[slot]
            .as_mut()
            .expect("established connection exists");
        while let Some(f) = p.outq.front_mut() {
            if let (Some(d), Some(n)) = (f.due, now) {
                if d > n {
                    break;
                }
            }
            match c.stream.write(&f.data[f.off..]) {
                Ok(n) => {
                    f.off += n;
                    if f.off == f.data.len() {
                        p.out_bytes -= f.data.len();
                        if let Some(f) = p.outq.pop_front() {
                            self.spare.give(f.data);
                        }
                        done += 1;
                    }
                }
                Err(e) if would_block(&e) => break,
                Err(e) => {
                    failed = Some(format!("connection error: {e}"));
                    break;
                }
            }
        }
        if let Some(w) = failed {
            self.fail_peer(r, w);
        }
        done
    }
}

impl Provider for TcpSim {
    fn name(&self) -> &str {
        "tcp-sim"
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
        let total: usize = payload.iter().map(|s| s.len()).sum();
        if header.len() > MAX_HEADER || total > self.cfg.chunk {
            return Err(Error::invalid(format!(
                "tcp-sim frame of {}+{total} bytes exceeds {MAX_HEADER}+{}",
                header.len(),
                self.cfg.chunk
            )));
        }
        if dest >= self.size {
            return Err(Error::from(ErrorDetail::InvalidRank {
                rank: dest as i64,
                size: self.size,
            }));
        }
        if dest == self.rank {
            let mut d = Vec::with_capacity(total);
            for s in payload {
                d.extend_from_slice(s);
            }
            self.selfq.push_back((header.to_vec(), d));
            return Ok(SendOutcome::Sent);
        }
        let fh = FrameHeader {
            kind: K_AM,
            hdr_len: header.len(),
            payload_len: total,
        }
        .encode();
        let flen = FRAME_HDR + header.len() + total;
        let state = self.peers[dest as usize].state;
        if state == State::Failed {
            return Err(Error::peer_failed(dest, "connection lost"));
        }
        let mut written = 0;
        if let (State::Established(slot), None) = (state, &self.sim) {
            // Frames queued earlier go first; when they are all out, this one can go straight.
            if !self.peers[dest as usize].outq.is_empty() {
                self.flush_peer(dest, slot, None);
                if self.peers[dest as usize].state == State::Failed {
                    return Err(Error::peer_failed(dest, "connection lost"));
                }
            }
        }
        let large = total >= COPY_MAX;
        if let (State::Established(slot), true, None) =
            (state, self.peers[dest as usize].outq.is_empty(), &self.sim)
        {
            // Straight from the caller's buffers: one writev.
            let mut iov: smallvec::SmallVec<[IoSlice<'_>; 8]> = smallvec::SmallVec::new();
            iov.push(IoSlice::new(&fh));
            iov.push(IoSlice::new(header));
            iov.extend(payload.iter().map(|s| IoSlice::new(s)));
            let c = self.conns[slot]
                .as_mut()
                .expect("established connection exists");
            let res = if flen <= SMALL_FRAME {
                // A small frame costs less as one contiguous `send` than as a writev.
                let mut one = [0u8; SMALL_FRAME];
                let mut at = 0;
                for s in &iov {
                    one[at..at + s.len()].copy_from_slice(s);
                    at += s.len();
                }
                c.stream.write(&one[..flen])
            } else {
                c.stream.write_vectored(&iov)
            };
            match res {
                Ok(n) if n == flen => return Ok(SendOutcome::Sent),
                Ok(n) => written = n,
                // A full socket: a large payload stays with the caller (it retries after
                // `progress`) rather than being copied here.
                Err(e) if would_block(&e) && large => return Ok(SendOutcome::Busy),
                Err(e) if would_block(&e) => {}
                Err(e) => {
                    let w = format!("connection error: {e}");
                    self.fail_peer(dest, w.clone());
                    return Err(Error::peer_failed(dest, w));
                }
            }
        }
        let p = &mut self.peers[dest as usize];
        // When simulating, the queue also holds the frames on the simulated wire.
        let limit = self.cfg.queue + self.sim.as_ref().map_or(0, |s| s.in_flight);
        if written == 0
            && !p.outq.is_empty()
            && (p.out_bytes + flen > limit || (large && self.sim.is_none()))
        {
            return Ok(SendOutcome::Busy);
        }
        // Queue (the rest of) the frame.
        let mut data = self.spare.take();
        data.reserve(flen);
        data.extend_from_slice(&fh);
        data.extend_from_slice(header);
        for s in payload {
            data.extend_from_slice(s);
        }
        let due = self.sim.as_mut().map(|sim| sim.due(p, flen));
        p.out_bytes += flen;
        p.outq.push_back(OutFrame {
            data,
            off: written,
            due,
        });
        if state == State::Idle {
            self.connect(dest)?;
        }
        if !self.busy_peers.contains(&dest) {
            self.busy_peers.push(dest);
        }
        Ok(SendOutcome::Sent)
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut n = 0;
        while let Some((h, d)) = self.selfq.pop_front() {
            sink.am(self.rank, &h, &d);
            n += 1;
        }
        self.polls = self.polls.wrapping_add(1);
        if self.direct_mode() {
            let mut i = 0;
            while i < self.direct.len() {
                let slot = self.direct[i];
                n += self.on_readable(slot, sink);
                i += 1;
            }
            if !self.busy_peers.is_empty() {
                n += self.flush();
            }
            for (r, why) in self.failures.drain(..) {
                sink.peer_failed(r, &why);
                n += 1;
            }
            return Ok(n);
        }
        let mut events = std::mem::replace(&mut self.events, Events::with_capacity(0));
        match self.poll.poll(&mut events, Some(Duration::ZERO)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                self.events = events;
                return Err(Error::io("polling sockets", e));
            }
        }
        for ev in events.iter() {
            let t = ev.token();
            if t == LISTENER {
                self.accept_all();
                continue;
            }
            if ev.is_writable() || ev.is_error() {
                self.on_writable(t.0);
            }
            if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                n += self.on_readable(t.0, sink);
            }
        }
        self.events = events;
        if !self.busy_peers.is_empty() {
            n += self.flush();
        }
        for (r, why) in self.failures.drain(..) {
            sink.peer_failed(r, &why);
            n += 1;
        }
        Ok(n)
    }

    fn close(&mut self) -> Result<()> {
        // Write out what is queued (bounded), then let the sockets close.
        let t0 = Instant::now();
        while !self.busy_peers.is_empty() && t0.elapsed() < Duration::from_secs(10) {
            self.flush();
            // Keep handshakes moving for peers we have not connected to yet.
            let mut events = std::mem::replace(&mut self.events, Events::with_capacity(0));
            let _ = self.poll.poll(&mut events, Some(Duration::from_millis(1)));
            for ev in events.iter() {
                let t = ev.token();
                if t == LISTENER {
                    self.accept_all();
                    continue;
                }
                if ev.is_writable() {
                    self.on_writable(t.0);
                }
                if ev.is_readable() {
                    // Only handshakes matter now; messages arriving after finalize are dropped.
                    self.on_readable(t.0, &mut Discard::default());
                }
            }
            self.events = events;
        }
        Ok(())
    }
}

impl StaticProvider for TcpSim {
    const NAME: &'static str = "tcp-sim";

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
    TcpSim,
    priority = 10,
    summary = "TCP between ranks on any hosts, with a simulated-network mode"
);

#[cfg(test)]
mod tests {
    use super::*;
    use weft_provider::bootstrap::InProcessJob;
    use weft_provider::provider::{Completed, Token};

    #[derive(Default)]
    struct Failures(Vec<(Rank, String)>);

    impl Sink for Failures {
        fn am(&mut self, _: Rank, _: &[u8], _: &[u8]) {}
        fn complete(&mut self, _: Token, _: Result<Completed>) {}
        fn peer_failed(&mut self, r: Rank, why: &str) {
            self.0.push((r, why.to_string()));
        }
    }

    fn config() -> Config {
        Config {
            bind: "127.0.0.1".into(),
            chunk: 64 << 10,
            eager: 16 << 10,
            direct: true,
            queue: 1 << 20,
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            rate: None,
        }
    }

    /// Two ranks of one job, opened concurrently (opening exchanges addresses).
    fn pair() -> (TcpSim, TcpSim) {
        let job = InProcessJob::new(2, Duration::from_secs(30));
        let (a, b) = std::thread::scope(|s| {
            let open = |r| {
                let job = job.clone();
                s.spawn(move || TcpSim::open_with(&mut job.rank(r), config()).unwrap())
            };
            let (a, b) = (open(0), open(1));
            (a.join().unwrap(), b.join().unwrap())
        });
        (a, b)
    }

    /// A peer that dies after connecting but before its HELLO leaves an anonymous EOF; the
    /// survivor must still learn which rank failed (by probing), not wait for it forever.
    #[test]
    fn death_before_hello_is_detected() {
        let (zero, mut one) = pair();
        let addr_one = zero.addrs[1];
        drop(zero); // rank 0's listener is gone: it "died"...
        let half = std::net::TcpStream::connect(addr_one).unwrap();
        drop(half); // ...right after connecting, before saying who it was.
        let mut sink = Failures::default();
        let t0 = Instant::now();
        while sink.0.is_empty() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "rank 1 did not detect rank 0's death"
            );
            one.progress(&mut sink).unwrap();
            std::thread::yield_now();
        }
        assert_eq!(sink.0[0].0, 0, "{:?}", sink.0);
        assert!(sink.0[0].1.contains("cannot connect"), "{:?}", sink.0);
    }

    /// The probe is harmless among live ranks: the anonymous EOF leads to an ordinary
    /// connection, and messages then flow both ways.
    #[test]
    fn probe_among_live_ranks_connects() {
        let (mut zero, mut one) = pair();
        drop(std::net::TcpStream::connect(zero.addrs[1]).unwrap());
        let mut sink = Failures::default();
        let t0 = Instant::now();
        while !matches!(one.peers[0].state, State::Established(_)) {
            assert!(t0.elapsed() < Duration::from_secs(10), "no connection");
            one.progress(&mut sink).unwrap();
            zero.progress(&mut sink).unwrap();
        }
        assert!(sink.0.is_empty(), "{:?}", sink.0);
        #[derive(Default)]
        struct Count(usize);
        impl Sink for Count {
            fn am(&mut self, _: Rank, _: &[u8], p: &[u8]) {
                assert_eq!(p, b"hi");
                self.0 += 1;
            }
            fn complete(&mut self, _: Token, _: Result<Completed>) {}
            fn peer_failed(&mut self, r: Rank, why: &str) {
                panic!("rank {r} failed: {why}");
            }
        }
        let (mut c0, mut c1) = (Count::default(), Count::default());
        zero.am_send(1, b"h", &[IoSlice::new(b"hi")]).unwrap();
        one.am_send(0, b"h", &[IoSlice::new(b"hi")]).unwrap();
        let t0 = Instant::now();
        while c0.0 + c1.0 < 2 {
            assert!(t0.elapsed() < Duration::from_secs(10), "messages lost");
            zero.progress(&mut c0).unwrap();
            one.progress(&mut c1).unwrap();
        }
    }
}
