//! The embedded single-host launcher: a PMI-1 server plus process supervision, in one event
//! loop (`mio`) whatever the number of ranks.
//!
//! Each rank gets one end of a socketpair in `PMI_FD` (or, with `pmi_port`, the address of a
//! loopback TCP listener in `PMI_PORT` and its id in `PMI_ID`). The loop answers the PMI-1 wire
//! protocol on every connection (a barrier's answers go out when every rank has arrived),
//! forwards every rank's output line by line, watches the ranks' processes and the signals.
//! One thread means the launcher's address space stays small, so starting a rank (a fork) costs
//! the same for the thousandth as for the first: start-up is linear in the number of ranks
//! (threads per rank made each fork copy more, and start-up quadratic). Ranks are started a
//! few at a time between turns of the loop, so a signal is acted on at once, even during
//! start-up.
//!
//! Supervision: every rank runs in its own process group and dies with the launcher
//! (`PR_SET_PDEATHSIG`). When a rank fails — non-zero exit, a signal, an exit without
//! `finalize` after `init`, `cmd=abort`, a malformed PMI line — the launcher sends SIGTERM to
//! every other rank and SIGKILL half a second later, then exits with the status of the rank
//! that failed first. Ctrl-C (SIGINT/SIGTERM/SIGHUP) does the same. Ranks that exit are not
//! reaped until the job ends, so their pids cannot be given to other processes while peers
//! may still address them (cross-memory attach addresses processes by pid).
//!
//! The launcher writes no files; it removes the job's `/dev/shm/weft-<job>-*` objects that a
//! rank killed during start-up left, and those of earlier jobs whose launcher was killed.
//!
//! Size (over 800 lines): one event loop — the PMI-1 server, process supervision, signals and
//! clean-up share the loop's state; splitting it would pass that state between files.

use mio::net::{TcpListener, TcpStream, UnixStream as MioUnix};
use mio::unix::pipe::Receiver as PipeRx;
use mio::{Events, Interest, Poll, Token};
use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};
use weft::bootstrap::pmi::{parse_line, Line, MAX_LINE};

/// What to launch.
#[derive(Debug, Clone)]
pub struct Spec {
    pub n: u32,
    pub program: OsString,
    pub args: Vec<OsString>,
    pub env: Vec<(String, String)>,
    pub provider: Option<String>,
    pub tag_output: bool,
    /// Pin rank i to the i-th CPU this launcher may run on (modulo their number).
    pub bind: bool,
    /// Collect each rank's stdout instead of forwarding it.
    pub capture: bool,
    /// Use a TCP PMI port (`PMI_PORT` + `PMI_ID`) instead of inherited sockets.
    pub pmi_port: bool,
    /// Kill the job after this long.
    pub timeout: Option<Duration>,
    /// Print a line on stderr when ranks are killed.
    pub quiet: bool,
    /// A rank that exits with an error or is killed does not end the others (Hydra's
    /// `-disable-auto-cleanup`); PMI barriers fail instead of waiting for it.
    pub keep_going: bool,
    /// Pretend the ranks run on this many hosts (blocks of consecutive ranks, through
    /// `WEFT_HOST_ID`), to try per-host composition on one machine. 1: the real identity.
    pub hosts: u32,
}

impl Spec {
    pub fn new(n: u32, program: impl Into<OsString>) -> Self {
        Spec {
            n,
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            provider: None,
            tag_output: false,
            bind: false,
            capture: false,
            pmi_port: false,
            timeout: None,
            quiet: false,
            keep_going: false,
            hosts: 1,
        }
    }
}

/// How a job ended.
#[derive(Debug)]
pub struct Outcome {
    /// The launcher's exit code: the status of the rank that failed first (its exit code, or
    /// 128 + the signal that killed it; an abort's code), else an interrupting signal's
    /// 128 + signal, else 0; 1 for a job the launcher ended itself (protocol error).
    pub code: i32,
    /// Captured stdout per rank (when `capture`).
    pub stdout: Vec<Vec<u8>>,
    /// Why the launcher ended the job, if it did.
    pub failure: Option<String>,
}

const KEY_MAX: usize = 64;
const VAL_MAX: usize = 1024;
/// Ranks started per turn of the loop.
const SPAWN_BATCH: u32 = 16;
/// The signals that end a job; tokens 0..3 are their pipes.
const SIGNALS: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];
const LISTENER: Token = Token(3);
/// Tokens from here on name entries of `Launcher::slots`.
const FIRST_SLOT: usize = 4;

/// A PMI connection.
struct Conn {
    stream: ConnStream,
    /// Known for inherited sockets, learnt from `initack` on the PMI port.
    rank: Option<u32>,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
    writable_armed: bool,
}

enum ConnStream {
    Unix(MioUnix),
    Tcp(TcpStream),
}

impl ConnStream {
    fn source(&mut self) -> &mut dyn mio::event::Source {
        match self {
            ConnStream::Unix(s) => s,
            ConnStream::Tcp(s) => s,
        }
    }
    fn read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            ConnStream::Unix(s) => (&*s).read(buf),
            ConnStream::Tcp(s) => (&*s).read(buf),
        }
    }
    fn write(&self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            ConnStream::Unix(s) => (&*s).write(buf),
            ConnStream::Tcp(s) => (&*s).write(buf),
        }
    }
}

/// One rank's stdout or stderr.
struct Pipe {
    rx: PipeRx,
    rank: u32,
    stderr: bool,
    partial: Vec<u8>,
}

enum Slot {
    Conn(Conn),
    Pipe(Pipe),
    Free,
}

/// PMI state of the job.
#[derive(Default)]
struct Pmi {
    kvs: HashMap<String, String>,
    /// Connections waiting in the current barrier.
    waiting: Vec<usize>,
    initialized: Vec<bool>,
    finalized: Vec<bool>,
    claimed: Vec<bool>,
    /// The job failed: barriers answer with an error instead of waiting.
    failed: bool,
    abort_code: Option<i32>,
}

struct Launcher<'a> {
    spec: &'a Spec,
    poll: Poll,
    kvsname: String,
    slots: Vec<Slot>,
    free: Vec<usize>,
    pmi: Pmi,
    listener: Option<(TcpListener, std::net::SocketAddr)>,
    /// One socketpair per signal: the handler writes a byte, the loop reads it.
    sig_rx: Vec<UnixStream>,
    sig_ids: Vec<signal_hook::SigId>,
    children: Vec<Option<Child>>,
    /// Exited (not yet reaped: see the module docs).
    statuses: Vec<Option<ExitStatus>>,
    /// Per rank, when the launcher first saw one of its descriptors close (a count of such
    /// sightings, in the order the poll delivered them): a rank's end of its pipes and PMI
    /// connection closes when it exits, so this orders exits the launcher learns of in the
    /// same round by when they happened.
    closed: Vec<Option<u64>>,
    closes: u64,
    captured: Vec<Vec<u8>>,
    cpus: Vec<usize>,
    spawned: u32,
    failure: Option<String>,
    cause_code: Option<i32>,
    signal_code: Option<i32>,
    killing: Option<Instant>,
    started: Instant,
}

/// Launch and supervise a job; returns when every rank has exited.
pub fn run(spec: &Spec) -> std::io::Result<Outcome> {
    raise_fd_limit();
    for (name, pid) in remove_orphaned_jobs() {
        if !spec.quiet {
            let who = if name.contains(':') {
                "a libfabric process"
            } else {
                "a launcher"
            };
            eprintln!("weft run: removed /dev/shm/{name}, left by {who} that died (pid {pid})");
        }
    }
    let mut l = Launcher::new(spec)?;
    let r = l.run();
    for id in l.sig_ids.drain(..) {
        signal_hook::low_level::unregister(id);
    }
    r
}

impl<'a> Launcher<'a> {
    fn new(spec: &'a Spec) -> std::io::Result<Launcher<'a>> {
        let n = spec.n as usize;
        let poll = Poll::new()?;
        // Signals arrive as bytes on socketpairs the loop polls (one per signal, so the exit
        // status can name it).
        let mut sig_rx = vec![];
        let mut sig_ids = vec![];
        for (k, s) in SIGNALS.into_iter().enumerate() {
            let (rx, tx) = UnixStream::pair()?;
            rx.set_nonblocking(true)?;
            sig_ids.push(signal_hook::low_level::pipe::register(s, tx)?);
            poll.registry().register(
                &mut mio::unix::SourceFd(&rx.as_raw_fd()),
                Token(k),
                Interest::READABLE,
            )?;
            sig_rx.push(rx);
        }
        let listener = if spec.pmi_port {
            let mut l = TcpListener::bind("127.0.0.1:0".parse().expect("an address"))?;
            let addr = l.local_addr()?;
            poll.registry()
                .register(&mut l, LISTENER, Interest::READABLE)?;
            Some((l, addr))
        } else {
            None
        };
        Ok(Launcher {
            spec,
            poll,
            kvsname: format!("weft-{}-{}", std::process::id(), rand_suffix()),
            slots: Vec::new(),
            free: Vec::new(),
            pmi: Pmi {
                initialized: vec![false; n],
                finalized: vec![false; n],
                claimed: vec![false; n],
                ..Default::default()
            },
            listener,
            sig_rx,
            sig_ids,
            children: Vec::with_capacity(n),
            statuses: vec![None; n],
            closed: vec![None; n],
            closes: 0,
            captured: vec![Vec::new(); n],
            cpus: if spec.bind { allowed_cpus() } else { vec![] },
            spawned: 0,
            failure: None,
            cause_code: None,
            signal_code: None,
            killing: None,
            started: Instant::now(),
        })
    }

    fn run(&mut self) -> std::io::Result<Outcome> {
        let n = self.spec.n;
        let mut events = Events::with_capacity(1024);
        let mut last_reap = Instant::now();
        let mut ended: Option<Instant> = None;
        loop {
            // Start a few more ranks, unless the job is already over.
            if self.spawned < n && self.killing.is_none() && self.failure.is_none() {
                for _ in 0..SPAWN_BATCH.min(n - self.spawned) {
                    if let Err(e) = self.spawn(self.spawned) {
                        let w = e.to_string();
                        if !self.spec.quiet {
                            eprintln!("weft run: {w}");
                        }
                        self.fail(w, true);
                        break;
                    }
                    self.spawned += 1;
                }
            }
            let busy = self.spawned < n && self.failure.is_none();
            let wait = if busy {
                Duration::ZERO
            } else {
                Duration::from_millis(2)
            };
            match self.poll.poll(&mut events, Some(wait)) {
                Ok(()) => {}
                // A signal: its byte is in the signal pipe, read on the next turn.
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            for ev in events.iter() {
                match ev.token() {
                    Token(k) if k < SIGNALS.len() => self.on_signal(k),
                    LISTENER => self.accept(),
                    Token(t) => {
                        // A closed end (a rank that exited) may come without "readable".
                        let readable = ev.is_readable() || ev.is_read_closed() || ev.is_error();
                        self.on_slot(t - FIRST_SLOT, readable, ev.is_writable())
                    }
                }
            }
            if last_reap.elapsed() >= Duration::from_millis(2) || !busy {
                last_reap = Instant::now();
                self.watch_children();
            }
            self.timers();
            let alive =
                self.children.iter().flatten().count() - self.statuses.iter().flatten().count();
            let all_started = self.spawned == n || self.failure.is_some();
            if all_started && alive == 0 {
                // Every rank has exited: collect what is still in the pipes (a process the
                // rank started may keep one open: not for more than a second).
                let t0 = *ended.get_or_insert_with(Instant::now);
                let pipes_open = self.slots.iter().any(|s| matches!(s, Slot::Pipe(_)));
                if !pipes_open || t0.elapsed() > Duration::from_secs(1) {
                    break;
                }
            }
        }
        // Reap every rank now that the job is over.
        for c in self.children.iter_mut().flatten() {
            let _ = c.wait();
        }
        for name in remove_shm_leftovers(&self.kvsname) {
            if !self.spec.quiet {
                eprintln!("weft run: removed /dev/shm/{name}, left behind by the job");
            }
        }
        let mut code = match (self.cause_code, self.signal_code) {
            (Some(c), _) => c,
            (None, Some(s)) => s,
            (None, None) => worst_code(&self.statuses),
        };
        if self.failure.is_some() && code == 0 {
            code = self.pmi.abort_code.filter(|c| *c != 0).unwrap_or(1);
        }
        Ok(Outcome {
            code,
            stdout: std::mem::take(&mut self.captured),
            failure: self.failure.take(),
        })
    }

    // ------------------------------------------------------------------------ ranks

    fn spawn(&mut self, r: u32) -> std::io::Result<()> {
        let spec = self.spec;
        let mut cmd = Command::new(&spec.program);
        cmd.args(&spec.args)
            .stdin(if r == 0 {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env("PMI_RANK", r.to_string())
            .env("PMI_SIZE", spec.n.to_string());
        if let Some(p) = &spec.provider {
            cmd.env("WEFT_PROVIDER", p);
        }
        if spec.hosts > 1 {
            // Rank r on pretend host r * hosts / n; the hostname keeps real hosts apart.
            let host = u64::from(r) * u64::from(spec.hosts) / u64::from(spec.n.max(1));
            let real = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            cmd.env(
                "WEFT_HOST_ID",
                format!("{}/pretend-host-{host}", real.trim()),
            );
        }
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        let mut ends = None;
        if let Some((_, addr)) = &self.listener {
            cmd.env("PMI_PORT", addr.to_string())
                .env("PMI_ID", r.to_string());
            cmd.env_remove("PMI_FD");
        } else {
            let (a, b) = UnixStream::pair()?;
            cmd.env("PMI_FD", b.as_raw_fd().to_string());
            cmd.env_remove("PMI_PORT");
            ends = Some((a, b));
        }
        let keep_fd: RawFd = ends.as_ref().map_or(-1, |(_, b)| b.as_raw_fd());
        let cpu = (!self.cpus.is_empty()).then(|| self.cpus[r as usize % self.cpus.len()]);
        let parent_pid = std::process::id() as i32;
        // SAFETY: the closure runs in the child between fork and exec and only makes
        // async-signal-safe syscalls (fcntl, prctl, getppid, sched_setaffinity) on values
        // captured by copy.
        unsafe {
            cmd.pre_exec(move || {
                if keep_fd >= 0 && libc::fcntl(keep_fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if libc::getppid() != parent_pid {
                    libc::_exit(1);
                }
                if let Some(c) = cpu {
                    let mut set: libc::cpu_set_t = std::mem::zeroed();
                    libc::CPU_SET(c, &mut set);
                    libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
                }
                Ok(())
            });
        }
        cmd.process_group(0);
        let mut child = cmd.spawn().map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot start {}: {e}", spec.program.to_string_lossy()),
            )
        })?;
        if let Some((a, b)) = ends {
            drop(b);
            a.set_nonblocking(true)?;
            self.add(Slot::Conn(Conn {
                stream: ConnStream::Unix(MioUnix::from_std(a)),
                rank: Some(r),
                rbuf: Vec::new(),
                wbuf: Vec::new(),
                writable_armed: false,
            }))?;
        }
        for (pipe, stderr) in [
            (child.stdout.take().map(PipeRx::from), false),
            (child.stderr.take().map(PipeRx::from), true),
        ] {
            let rx = pipe.expect("piped");
            rx.set_nonblocking(true)?;
            self.add(Slot::Pipe(Pipe {
                rx,
                rank: r,
                stderr,
                partial: Vec::new(),
            }))?;
        }
        self.children.push(Some(child));
        Ok(())
    }

    /// Notice ranks that exited (without reaping them) and act on it.
    fn watch_children(&mut self) {
        // When one rank dies and a peer exits with an error because of it, both often show up
        // in the same round, and the first to go is the cause: in the order they exited, as
        // far as the launcher saw it (their descriptors closing), then ranks killed by a
        // signal first, then by rank.
        let mut round: Vec<(u32, ExitStatus)> = vec![];
        for (r, c) in self.children.iter().enumerate() {
            if self.statuses[r].is_some() {
                continue;
            }
            if let Some(st) = c.as_ref().and_then(|c| exited(c.id())) {
                self.statuses[r] = Some(st);
                round.push((r as u32, st));
            }
        }
        let closed = &self.closed;
        round.sort_by_key(|(r, st)| {
            (
                closed[*r as usize].unwrap_or(u64::MAX),
                st.signal().is_none(),
                *r,
            )
        });
        for (r, st) in round {
            self.on_exit(r, st);
        }
    }

    fn on_exit(&mut self, r: u32, st: ExitStatus) {
        if let Some(c) = &self.children[r as usize] {
            remove_libfabric_leftovers(c.id());
        }
        let (init, fin) = (
            self.pmi.initialized[r as usize],
            self.pmi.finalized[r as usize],
        );
        let why = if !st.success() && self.killing.is_none() {
            self.cause_code.get_or_insert(worst_code(&[Some(st)]));
            Some(match (st.code(), st.signal()) {
                (Some(c), _) => format!("rank {r} exited with status {c}"),
                (None, Some(s)) => format!("rank {r} was killed by signal {s}"),
                _ => format!("rank {r} failed"),
            })
        } else if init && !fin && self.killing.is_none() {
            self.cause_code.get_or_insert(1);
            Some(format!("rank {r} exited without finalizing"))
        } else {
            None
        };
        if let Some(w) = why {
            let end = !self.spec.keep_going;
            self.fail(w, end);
        }
    }

    /// The job failed: report it (once), fail PMI barriers, and end the ranks unless
    /// `--keep-going` (`end`).
    fn fail(&mut self, why: String, end: bool) {
        let alive = self.children.iter().flatten().count() - self.statuses.iter().flatten().count();
        if self.failure.is_none() {
            if !self.spec.quiet {
                eprintln!(
                    "weft run: {why}{}",
                    match (alive > 0, end) {
                        (true, true) => "; ending the other ranks",
                        (true, false) => "; the others go on (--keep-going)",
                        _ => "",
                    }
                );
            }
            self.failure = Some(why);
        }
        self.pmi.failed = true;
        self.release_barrier(false);
        if end && self.killing.is_none() {
            self.signal_all(libc::SIGTERM);
            self.killing = Some(Instant::now());
        }
    }

    fn signal_all(&self, sig: i32) {
        for (r, c) in self.children.iter().enumerate() {
            let Some(c) = c else { continue };
            if self.statuses[r].is_some() {
                continue;
            }
            let pid = c.id() as i32;
            // SAFETY: plain syscalls; each rank leads its own process group (pgid == pid), so
            // signalling -pid reaches the rank and anything it started. The rank has not been
            // reaped, so its pid is still its own.
            unsafe {
                libc::kill(-pid, sig);
                libc::kill(pid, sig);
            }
        }
    }

    fn timers(&mut self) {
        if let (Some(t), None) = (self.spec.timeout, self.killing) {
            if self.started.elapsed() > t {
                let w = format!("job timed out after {:.0} s", t.as_secs_f64());
                // As if the job had been sent SIGTERM (documented).
                self.signal_code.get_or_insert(128 + libc::SIGTERM);
                self.fail(w, true);
            }
        }
        if let Some(t0) = self.killing {
            if t0.elapsed() > Duration::from_millis(500) {
                self.signal_all(libc::SIGKILL);
            }
        }
    }

    fn on_signal(&mut self, k: usize) {
        let mut buf = [0u8; 64];
        let mut got = false;
        while let Ok(n) = (&self.sig_rx[k]).read(&mut buf) {
            if n == 0 {
                break;
            }
            got = true;
        }
        if got {
            let sig = SIGNALS[k];
            self.signal_code.get_or_insert(128 + sig);
            if self.killing.is_none() {
                self.fail(format!("interrupted by signal {sig}"), true);
            }
        }
    }

    // ------------------------------------------------------------------------ I/O slots

    fn add(&mut self, mut s: Slot) -> std::io::Result<usize> {
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot::Free);
                self.slots.len() - 1
            }
        };
        let token = Token(i + FIRST_SLOT);
        match &mut s {
            Slot::Conn(c) => {
                self.poll
                    .registry()
                    .register(c.stream.source(), token, Interest::READABLE)?
            }
            Slot::Pipe(p) => self
                .poll
                .registry()
                .register(&mut p.rx, token, Interest::READABLE)?,
            Slot::Free => {}
        }
        self.slots[i] = s;
        Ok(i)
    }

    /// Note that rank `r` closed a descriptor (the first time counts).
    fn saw_close(&mut self, r: u32) {
        if let Some(c) = self.closed.get_mut(r as usize) {
            if c.is_none() {
                self.closes += 1;
                *c = Some(self.closes);
            }
        }
    }

    fn remove(&mut self, i: usize) {
        match std::mem::replace(&mut self.slots[i], Slot::Free) {
            Slot::Conn(mut c) => {
                let _ = self.poll.registry().deregister(c.stream.source());
                if let Some(r) = c.rank {
                    self.saw_close(r);
                }
            }
            Slot::Pipe(mut p) => {
                let _ = self.poll.registry().deregister(&mut p.rx);
                self.saw_close(p.rank);
                if !p.partial.is_empty() {
                    p.partial.push(b'\n');
                    let line = std::mem::take(&mut p.partial);
                    self.emit(p.rank, p.stderr, &line);
                }
            }
            Slot::Free => return,
        }
        self.free.push(i);
    }

    fn accept(&mut self) {
        loop {
            let Some((l, _)) = &self.listener else { return };
            match l.accept() {
                Ok((s, _)) => {
                    let _ = self.add(Slot::Conn(Conn {
                        stream: ConnStream::Tcp(s),
                        rank: None,
                        rbuf: Vec::new(),
                        wbuf: Vec::new(),
                        writable_armed: false,
                    }));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(_) => return,
            }
        }
    }

    fn on_slot(&mut self, i: usize, readable: bool, writable: bool) {
        match self.slots.get(i) {
            Some(Slot::Pipe(_)) if readable => self.read_pipe(i),
            Some(Slot::Conn(_)) => {
                if writable {
                    self.flush(i);
                }
                if readable {
                    self.read_conn(i);
                }
            }
            _ => {}
        }
    }

    fn read_pipe(&mut self, i: usize) {
        let mut buf = [0u8; 64 << 10];
        loop {
            let Slot::Pipe(p) = &mut self.slots[i] else {
                return;
            };
            match p.rx.read(&mut buf) {
                Ok(0) => return self.remove(i),
                Ok(k) => {
                    p.partial.extend_from_slice(&buf[..k]);
                    let (rank, stderr) = (p.rank, p.stderr);
                    let Some(end) = p.partial.iter().rposition(|b| *b == b'\n') else {
                        continue;
                    };
                    let lines: Vec<u8> = p.partial.drain(..=end).collect();
                    self.emit(rank, stderr, &lines);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return self.remove(i),
            }
        }
    }

    /// Forward whole lines of rank `r`'s output (tagged, or captured).
    fn emit(&mut self, r: u32, stderr: bool, lines: &[u8]) {
        if !stderr && self.spec.capture {
            self.captured[r as usize].extend_from_slice(lines);
            return;
        }
        let mut out = Vec::with_capacity(lines.len() + 16);
        for l in lines.split_inclusive(|b| *b == b'\n') {
            if self.spec.tag_output {
                out.extend_from_slice(format!("[{r}] ").as_bytes());
            }
            out.extend_from_slice(l);
        }
        if stderr {
            let _ = std::io::stderr().lock().write_all(&out);
        } else {
            let _ = std::io::stdout().lock().write_all(&out);
        }
    }

    fn read_conn(&mut self, i: usize) {
        let mut buf = [0u8; 16 << 10];
        loop {
            let Slot::Conn(c) = &mut self.slots[i] else {
                return;
            };
            match c.stream.read(&mut buf) {
                // EOF: the rank closed its end (its exit is judged by the process status).
                Ok(0) => return self.remove(i),
                Ok(k) => c.rbuf.extend_from_slice(&buf[..k]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return self.remove(i),
            }
            if c.rbuf.len() > MAX_LINE + 1 && !c.rbuf.contains(&b'\n') {
                break;
            }
        }
        // Serve every whole line.
        loop {
            let Slot::Conn(c) = &mut self.slots[i] else {
                return;
            };
            let who = c
                .rank
                .map_or("an unidentified rank".to_string(), |r| format!("rank {r}"));
            let Some(end) = c.rbuf.iter().position(|b| *b == b'\n') else {
                if c.rbuf.len() > MAX_LINE {
                    let w = format!("PMI line from {who} is longer than {MAX_LINE} bytes");
                    self.remove(i);
                    self.fail(w, true);
                }
                return;
            };
            let line: Vec<u8> = c.rbuf.drain(..=end).collect();
            let text = String::from_utf8_lossy(&line).into_owned();
            match parse_line(&text) {
                Ok(req) => {
                    if !self.serve(i, &req, &text) {
                        return;
                    }
                }
                Err(e) => {
                    let w = format!("malformed PMI request from {who}: {e}");
                    self.remove(i);
                    self.fail(w, true);
                    return;
                }
            }
        }
    }

    fn reply(&mut self, i: usize, fields: &[(&str, &str)]) {
        let l = Line {
            fields: fields
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        if let Slot::Conn(c) = &mut self.slots[i] {
            c.wbuf.extend_from_slice(l.to_wire().as_bytes());
        }
        self.flush(i);
    }

    /// Write what connection `i` has pending; wait for writability when the socket is full.
    fn flush(&mut self, i: usize) {
        let Slot::Conn(c) = &mut self.slots[i] else {
            return;
        };
        while !c.wbuf.is_empty() {
            match c.stream.write(&c.wbuf) {
                Ok(k) => {
                    c.wbuf.drain(..k);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    c.wbuf.clear();
                    break;
                }
            }
        }
        let want = !c.wbuf.is_empty();
        if want != c.writable_armed {
            c.writable_armed = want;
            let interest = if want {
                Interest::READABLE | Interest::WRITABLE
            } else {
                Interest::READABLE
            };
            let token = Token(i + FIRST_SLOT);
            let _ = self
                .poll
                .registry()
                .reregister(c.stream.source(), token, interest);
        }
    }

    /// Answer one PMI request on connection `i`; `false` when the connection is gone.
    fn serve(&mut self, i: usize, req: &Line, text: &str) -> bool {
        let rank = match &self.slots[i] {
            Slot::Conn(c) => c.rank,
            _ => return false,
        };
        let n = self.spec.n;
        match req.cmd() {
            "initack" => {
                let id = req.get("pmiid").and_then(|v| v.parse::<u32>().ok());
                match id {
                    Some(r) if r < n => {
                        if std::mem::replace(&mut self.pmi.claimed[r as usize], true) {
                            self.reply(
                                i,
                                &[("cmd", "initack"), ("rc", "-1"), ("msg", "duplicate_rank")],
                            );
                            self.fail(
                                format!("duplicate rank {r}: a second process claimed PMI id {r}"),
                                true,
                            );
                            return false;
                        }
                        if let Slot::Conn(c) = &mut self.slots[i] {
                            c.rank = Some(r);
                        }
                        let (nn, rr) = (n.to_string(), r.to_string());
                        self.reply(i, &[("cmd", "initack")]);
                        self.reply(i, &[("cmd", "set"), ("size", &nn)]);
                        self.reply(i, &[("cmd", "set"), ("rank", &rr)]);
                        self.reply(i, &[("cmd", "set"), ("debug", "0")]);
                    }
                    _ => {
                        self.fail(format!("PMI initack with a bad id: {}", text.trim()), true);
                        return false;
                    }
                }
            }
            _ if rank.is_none() => {
                self.fail("PMI request before initack on the PMI port".into(), true);
                return false;
            }
            "init" => {
                self.pmi.initialized[rank.unwrap_or(0) as usize] = true;
                let rc = if req.get("pmi_version") == Some("1") {
                    "0"
                } else {
                    "-1"
                };
                self.reply(
                    i,
                    &[
                        ("cmd", "response_to_init"),
                        ("rc", rc),
                        ("pmi_version", "1"),
                        ("pmi_subversion", "1"),
                    ],
                );
            }
            "get_maxes" => self.reply(
                i,
                &[
                    ("cmd", "maxes"),
                    ("rc", "0"),
                    ("kvsname_max", "256"),
                    ("keylen_max", &KEY_MAX.to_string()),
                    ("vallen_max", &VAL_MAX.to_string()),
                ],
            ),
            "get_appnum" => self.reply(i, &[("cmd", "appnum"), ("rc", "0"), ("appnum", "0")]),
            "get_universe_size" => {
                let s = n.to_string();
                self.reply(i, &[("cmd", "universe_size"), ("rc", "0"), ("size", &s)])
            }
            "get_my_kvsname" => {
                let k = self.kvsname.clone();
                self.reply(i, &[("cmd", "my_kvsname"), ("rc", "0"), ("kvsname", &k)])
            }
            "put" => {
                let (k, v) = (req.get("key").unwrap_or(""), req.get("value").unwrap_or(""));
                let msg = if k.is_empty() || k.len() >= KEY_MAX || v.len() >= VAL_MAX {
                    Some("key_or_value_too_long")
                } else if self.pmi.kvs.insert(k.to_string(), v.to_string()).is_some() {
                    Some("duplicate_key")
                } else {
                    None
                };
                match msg {
                    Some(m) => self.reply(i, &[("cmd", "put_result"), ("rc", "-1"), ("msg", m)]),
                    None => {
                        self.reply(i, &[("cmd", "put_result"), ("rc", "0"), ("msg", "success")])
                    }
                }
            }
            "get" => {
                let v = self.pmi.kvs.get(req.get("key").unwrap_or("")).cloned();
                match v {
                    Some(v) => self.reply(
                        i,
                        &[
                            ("cmd", "get_result"),
                            ("rc", "0"),
                            ("msg", "success"),
                            ("value", &v),
                        ],
                    ),
                    None => self.reply(
                        i,
                        &[
                            ("cmd", "get_result"),
                            ("rc", "-1"),
                            ("msg", "key_not_found"),
                        ],
                    ),
                }
            }
            "barrier_in" => {
                if self.pmi.failed {
                    self.reply(
                        i,
                        &[("cmd", "barrier_out"), ("rc", "-1"), ("msg", "job_failed")],
                    );
                    return true;
                }
                self.pmi.waiting.push(i);
                if self.pmi.waiting.len() == n as usize {
                    self.release_barrier(true);
                }
            }
            "finalize" => {
                self.pmi.finalized[rank.unwrap_or(0) as usize] = true;
                self.reply(i, &[("cmd", "finalize_ack"), ("rc", "0")]);
            }
            "abort" => {
                let code = req
                    .get("exitcode")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(1);
                let msg = req
                    .get("error_msg")
                    .and_then(|m| weft::bootstrap::pmi::unescape(m).ok())
                    .unwrap_or_default();
                self.pmi.abort_code = Some(code);
                // The aborting rank's code is the job's status.
                self.cause_code.get_or_insert(code);
                let r = rank.unwrap_or(0);
                self.fail(
                    if msg.is_empty() {
                        format!("rank {r} called abort (exit code {code})")
                    } else {
                        format!("rank {r} called abort (exit code {code}): {msg}")
                    },
                    true,
                );
                return false;
            }
            other => {
                let cmd = format!("{other}_result");
                self.reply(
                    i,
                    &[("cmd", &cmd), ("rc", "-1"), ("msg", "unknown_command")],
                );
            }
        }
        true
    }

    /// Answer every rank waiting in the barrier: released (`ok`) or failed.
    fn release_barrier(&mut self, ok: bool) {
        let waiting = std::mem::take(&mut self.pmi.waiting);
        for i in waiting {
            if ok {
                self.reply(i, &[("cmd", "barrier_out"), ("rc", "0")]);
            } else {
                self.reply(
                    i,
                    &[("cmd", "barrier_out"), ("rc", "-1"), ("msg", "job_failed")],
                );
            }
        }
    }
}

/// Remove what a rank's libfabric left in /dev/shm. libfabric's shm provider names its
/// region `<pid>:<domain>:<endpoint>` and unlinks it when the endpoint closes, so a rank killed
/// (or ending without closing it) leaves a 16 MiB object behind; weft's own objects are
/// unlinked as soon as every rank has them open and need nothing here. Called before the rank
/// is reaped: its pid is still its own, so no live process's object can match.
/// The process that made `name`, if it is a libfabric shm region's name (`<pid>:<n>:<n>`).
fn libfabric_region_of(name: &str) -> Option<i32> {
    let mut it = name.split(':');
    let (p, a, b) = (it.next()?, it.next()?, it.next()?);
    let digits = |x: &str| !x.is_empty() && x.bytes().all(|c| c.is_ascii_digit());
    (it.next().is_none() && digits(p) && digits(a) && digits(b))
        .then(|| p.parse().ok())
        .flatten()
}

fn remove_libfabric_leftovers(pid: u32) {
    use std::os::unix::fs::MetadataExt;
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let prefix = format!("{pid}:");
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let numbers = rest.split(':').collect::<Vec<_>>();
        let theirs = numbers.len() == 2
            && numbers
                .iter()
                .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if theirs && e.metadata().is_ok_and(|m| m.uid() == me) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Has process `pid` (our child) exited? Its status, without reaping it (`WNOWAIT`).
fn exited(pid: u32) -> Option<ExitStatus> {
    // SAFETY: siginfo_t is plain data that waitid fills for our own child.
    let mut si: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid on our own child with a valid siginfo pointer.
    let r = unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut si,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    // SAFETY: waitid filled si; si_pid is 0 when nothing has exited yet.
    if r != 0 || unsafe { si.si_pid() } == 0 {
        return None;
    }
    // SAFETY: as above.
    let status = unsafe { si.si_status() };
    let raw = match si.si_code {
        libc::CLD_EXITED => (status & 0xff) << 8,
        libc::CLD_DUMPED => (status & 0x7f) | 0x80,
        _ => status & 0x7f,
    };
    Some(ExitStatus::from_raw(raw))
}

/// As many descriptors as allowed: each rank costs the launcher three.
fn raise_fd_limit() {
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        let mut l: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max {
            l.rlim_cur = l.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
    }
}

fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it for this process.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return vec![];
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|c| libc::CPU_ISSET(*c, &set))
            .collect()
    }
}

fn worst_code(statuses: &[Option<ExitStatus>]) -> i32 {
    let mut code = 0;
    for s in statuses.iter().flatten() {
        let c = match (s.code(), s.signal()) {
            (Some(c), _) => c,
            (None, Some(sig)) => 128 + sig,
            _ => 1,
        };
        code = code.max(c);
    }
    code
}

/// Remove the job's shared-memory objects that are still named: providers name theirs
/// `/dev/shm/weft-<job id>-*` (docs/writing-a-provider.md), and normally unlink them as soon as
/// every local rank has mapped them; a rank killed during start-up can leave one behind.
fn remove_shm_leftovers(kvsname: &str) -> Vec<String> {
    let prefix = format!("weft-{kvsname}-");
    let mut removed = vec![];
    for e in std::fs::read_dir("/dev/shm")
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(&prefix) && std::fs::remove_file(e.path()).is_ok() {
            removed.push(name);
        }
    }
    removed
}

/// The launcher pid in an object name `weft-weft-<pid>-<suffix>-...`.
fn launcher_of(name: &str) -> Option<i32> {
    name.strip_prefix("weft-weft-")?
        .split('-')
        .next()?
        .parse()
        .ok()
}

/// When process `pid` started (seconds since the epoch), if it exists and is not a zombie.
fn process_start(pid: i32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1.trim_start();
    if rest.starts_with(['Z', 'X']) {
        return None;
    }
    // Field 22 (starttime, in clock ticks since boot) is the 20th after the state.
    let ticks: f64 = rest.split_whitespace().nth(19)?.parse().ok()?;
    let btime: f64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some(btime + ticks / hz.max(1.0))
}

/// Objects of earlier jobs whose launcher is gone (killed before it could clean up): no
/// process with its pid runs, or the one that does started after the object was made (the
/// pid was given to another). Removed; returns (name, launcher pid). An object of a launcher
/// that still runs is never touched.
fn remove_orphaned_jobs() -> Vec<(String, i32)> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let mut removed = vec![];
    for e in std::fs::read_dir("/dev/shm")
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        // A job's own objects, by the launcher that made them; libfabric's shm regions
        // (`<pid>:<n>:<n>`, ours) by the rank that made them, which the launcher removes when
        // the rank exits — unless the launcher itself was killed first.
        let Some(pid) = launcher_of(&name).or_else(|| {
            libfabric_region_of(&name).filter(|_| e.metadata().is_ok_and(|m| m.uid() == me))
        }) else {
            continue;
        };
        let made = e
            .metadata()
            .ok()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_secs_f64());
        let orphaned = match (process_start(pid), made) {
            (None, _) => true,
            // Started more than a second after the object existed: another process.
            (Some(start), Some(made)) => start > made + 1.0,
            (Some(_), None) => false,
        };
        if orphaned && std::fs::remove_file(e.path()).is_ok() {
            removed.push((name, pid));
        }
    }
    removed
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish() & 0xffff_ffff
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn leftovers_of_the_job_and_only_those_are_removed() {
        let job = format!("weft-test-{}", std::process::id());
        let other = format!("weft-{job}0-h0"); // another job whose name extends ours
        let mine = [format!("weft-{job}-h0"), format!("weft-{job}-h0-w")];
        for n in mine.iter().chain([&other]) {
            std::fs::write(Path::new("/dev/shm").join(n), b"x").unwrap();
        }
        let mut removed = remove_shm_leftovers(&job);
        removed.sort();
        assert_eq!(removed, mine);
        assert!(Path::new("/dev/shm").join(&other).exists());
        std::fs::remove_file(Path::new("/dev/shm").join(&other)).unwrap();
    }

    /// Objects of a launcher that died are reclaimed; those of a running one are not.
    #[test]
    fn orphaned_objects_are_reclaimed_and_live_ones_kept() {
        // A pid that certainly runs (ours) and one that has exited (a reaped child).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id() as i32;
        child.wait().unwrap();
        let live = std::process::id() as i32;
        let dead_name = format!("weft-weft-{dead}-123-h0");
        let live_name = format!("weft-weft-{live}-456-h0");
        for n in [&dead_name, &live_name] {
            std::fs::write(Path::new("/dev/shm").join(n), b"x").unwrap();
        }
        let removed = remove_orphaned_jobs();
        assert!(
            removed.iter().any(|(n, p)| *n == dead_name && *p == dead),
            "{removed:?}"
        );
        assert!(Path::new("/dev/shm").join(&live_name).exists());
        assert!(!Path::new("/dev/shm").join(&dead_name).exists());
        std::fs::remove_file(Path::new("/dev/shm").join(&live_name)).unwrap();
    }
}
