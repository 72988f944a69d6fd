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

mod config;
mod conn;
mod contract;
pub mod frame;
mod io;
mod sim;

use config::*;
use conn::*;
use sim::*;

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

const LISTENER: Token = Token(usize::MAX);
const MAX_HEADER: usize = 64;

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
            rng: weft_proto::sim::Rng::new(rank as u64 + 1),
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
