//! The embedded single-host launcher: a PMI-1 server plus process supervision.
//!
//! Each rank gets one end of a socketpair in `PMI_FD` (or, with `pmi_port`, the address of a
//! loopback TCP listener in `PMI_PORT` and its id in `PMI_ID`). The server answers the PMI-1
//! wire protocol from one thread per connection; barriers release when every rank has arrived.
//!
//! Supervision: every rank runs in its own process group and dies with the launcher
//! (`PR_SET_PDEATHSIG`). When a rank fails — non-zero exit, a signal, an exit without
//! `finalize` after `init`, `cmd=abort`, a malformed PMI line — the launcher sends SIGTERM to
//! every other rank and SIGKILL half a second later, then exits with the worst status. Ctrl-C
//! (SIGINT/SIGTERM/SIGHUP) does the same. The launcher writes no files.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::io::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
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
        }
    }
}

/// How a job ended.
#[derive(Debug)]
pub struct Outcome {
    /// The launcher's exit code: 0, the worst rank exit code, 128+signal, or 1 for a job the
    /// launcher ended (abort, protocol error, timeout).
    pub code: i32,
    /// Captured stdout per rank (when `capture`).
    pub stdout: Vec<Vec<u8>>,
    /// Why the launcher ended the job, if it did.
    pub failure: Option<String>,
}

#[derive(Default)]
struct JobState {
    kvs: HashMap<String, String>,
    arrived: u32,
    generation: u64,
    initialized: Vec<bool>,
    finalized: Vec<bool>,
    claimed: Vec<bool>,
    failed: Option<String>,
    abort_code: Option<i32>,
}

struct Job {
    n: u32,
    kvsname: String,
    st: Mutex<JobState>,
    cv: Condvar,
    events: Mutex<mpsc::Sender<Event>>,
}

enum Event {
    Exit(u32, ExitStatus),
    Fail(String),
    Signal(i32),
}

impl Job {
    /// The job failed: PMI barriers stop waiting, and the launcher hears about it (and ends
    /// the ranks).
    fn fail(&self, why: String) {
        self.mark_failed(why, true);
    }

    /// Record a failure the launcher already knows about; `event` also reports it.
    fn mark_failed(&self, why: String, event: bool) {
        let mut st = self.st.lock().unwrap_or_else(|e| e.into_inner());
        if st.failed.is_none() {
            st.failed = Some(why.clone());
            if event {
                let _ = self
                    .events
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .send(Event::Fail(why));
            }
        }
        self.cv.notify_all();
    }
}

fn reply(w: &mut dyn Write, fields: &[(&str, &str)]) -> std::io::Result<()> {
    let l = Line {
        fields: fields
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    };
    w.write_all(l.to_wire().as_bytes())
}

const KEY_MAX: usize = 64;
const VAL_MAX: usize = 1024;

/// Serve one PMI connection. `rank` is known for inherited sockets, learnt from `initack` for
/// PMI_PORT connections.
fn serve<S: Read + Write>(job: Arc<Job>, stream: S, mut rank: Option<u32>) {
    let mut rd = BufReader::new(stream);
    let mut line = String::new();
    loop {
        line.clear();
        let n = match (&mut rd).take(MAX_LINE as u64 + 1).read_line(&mut line) {
            Ok(n) => n,
            Err(_) => return,
        };
        if n == 0 {
            return; // EOF: the rank closed its end (its exit is judged by the process status)
        }
        let who = rank.map_or("an unidentified rank".to_string(), |r| format!("rank {r}"));
        if n > MAX_LINE || !line.ends_with('\n') {
            job.fail(format!(
                "PMI line from {who} is longer than {MAX_LINE} bytes or cut short"
            ));
            return;
        }
        let req = match parse_line(&line) {
            Ok(l) => l,
            Err(e) => {
                job.fail(format!("malformed PMI request from {who}: {e}"));
                return;
            }
        };
        let w = rd.get_mut();
        let ok = match req.cmd() {
            "initack" => {
                let id = req.get("pmiid").and_then(|v| v.parse::<u32>().ok());
                match id {
                    Some(r) if r < job.n => {
                        let dup = {
                            let mut st = job.st.lock().unwrap_or_else(|e| e.into_inner());
                            std::mem::replace(&mut st.claimed[r as usize], true)
                        };
                        if dup {
                            let _ = reply(
                                w,
                                &[("cmd", "initack"), ("rc", "-1"), ("msg", "duplicate_rank")],
                            );
                            job.fail(format!(
                                "duplicate rank {r}: a second process claimed PMI id {r}"
                            ));
                            return;
                        }
                        rank = Some(r);
                        let (n, r) = (job.n.to_string(), r.to_string());
                        reply(w, &[("cmd", "initack")])
                            .and_then(|_| reply(w, &[("cmd", "set"), ("size", &n)]))
                            .and_then(|_| reply(w, &[("cmd", "set"), ("rank", &r)]))
                            .and_then(|_| reply(w, &[("cmd", "set"), ("debug", "0")]))
                    }
                    _ => {
                        job.fail(format!("PMI initack with a bad id: {}", line.trim()));
                        return;
                    }
                }
            }
            _ if rank.is_none() => {
                job.fail("PMI request before initack on the PMI port".into());
                return;
            }
            "init" => {
                let r = rank.unwrap_or(0) as usize;
                job.st.lock().unwrap_or_else(|e| e.into_inner()).initialized[r] = true;
                if req.get("pmi_version") != Some("1") {
                    reply(
                        w,
                        &[
                            ("cmd", "response_to_init"),
                            ("rc", "-1"),
                            ("pmi_version", "1"),
                            ("pmi_subversion", "1"),
                        ],
                    )
                } else {
                    reply(
                        w,
                        &[
                            ("cmd", "response_to_init"),
                            ("rc", "0"),
                            ("pmi_version", "1"),
                            ("pmi_subversion", "1"),
                        ],
                    )
                }
            }
            "get_maxes" => reply(
                w,
                &[
                    ("cmd", "maxes"),
                    ("rc", "0"),
                    ("kvsname_max", "256"),
                    ("keylen_max", &KEY_MAX.to_string()),
                    ("vallen_max", &VAL_MAX.to_string()),
                ],
            ),
            "get_appnum" => reply(w, &[("cmd", "appnum"), ("rc", "0"), ("appnum", "0")]),
            "get_universe_size" => reply(
                w,
                &[
                    ("cmd", "universe_size"),
                    ("rc", "0"),
                    ("size", &job.n.to_string()),
                ],
            ),
            "get_my_kvsname" => reply(
                w,
                &[
                    ("cmd", "my_kvsname"),
                    ("rc", "0"),
                    ("kvsname", &job.kvsname),
                ],
            ),
            "put" => {
                let (k, v) = (req.get("key").unwrap_or(""), req.get("value").unwrap_or(""));
                if k.is_empty() || k.len() >= KEY_MAX || v.len() >= VAL_MAX {
                    reply(
                        w,
                        &[
                            ("cmd", "put_result"),
                            ("rc", "-1"),
                            ("msg", "key_or_value_too_long"),
                        ],
                    )
                } else {
                    let dup = {
                        let mut st = job.st.lock().unwrap_or_else(|e| e.into_inner());
                        st.kvs.insert(k.to_string(), v.to_string()).is_some()
                    };
                    if dup {
                        reply(
                            w,
                            &[
                                ("cmd", "put_result"),
                                ("rc", "-1"),
                                ("msg", "duplicate_key"),
                            ],
                        )
                    } else {
                        reply(w, &[("cmd", "put_result"), ("rc", "0"), ("msg", "success")])
                    }
                }
            }
            "get" => {
                let k = req.get("key").unwrap_or("");
                let v = job
                    .st
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .kvs
                    .get(k)
                    .cloned();
                match v {
                    Some(v) => reply(
                        w,
                        &[
                            ("cmd", "get_result"),
                            ("rc", "0"),
                            ("msg", "success"),
                            ("value", &v),
                        ],
                    ),
                    None => reply(
                        w,
                        &[
                            ("cmd", "get_result"),
                            ("rc", "-1"),
                            ("msg", "key_not_found"),
                        ],
                    ),
                }
            }
            "barrier_in" => {
                let mut st = job.st.lock().unwrap_or_else(|e| e.into_inner());
                let gen = st.generation;
                st.arrived += 1;
                if st.arrived == job.n {
                    st.arrived = 0;
                    st.generation += 1;
                    job.cv.notify_all();
                } else {
                    while st.generation == gen && st.failed.is_none() {
                        st = job.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                    }
                }
                if st.failed.is_some() && st.generation == gen {
                    drop(st);
                    let _ = reply(
                        w,
                        &[("cmd", "barrier_out"), ("rc", "-1"), ("msg", "job_failed")],
                    );
                    return;
                }
                drop(st);
                reply(w, &[("cmd", "barrier_out"), ("rc", "0")])
            }
            "finalize" => {
                let r = rank.unwrap_or(0) as usize;
                job.st.lock().unwrap_or_else(|e| e.into_inner()).finalized[r] = true;
                reply(w, &[("cmd", "finalize_ack"), ("rc", "0")])
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
                job.st.lock().unwrap_or_else(|e| e.into_inner()).abort_code = Some(code);
                let rank = rank.unwrap_or(0);
                job.fail(if msg.is_empty() {
                    format!("rank {rank} called abort (exit code {code})")
                } else {
                    format!("rank {rank} called abort (exit code {code}): {msg}")
                });
                return;
            }
            other => reply(
                w,
                &[
                    ("cmd", &format!("{other}_result")),
                    ("rc", "-1"),
                    ("msg", "unknown_command"),
                ],
            ),
        };
        if ok.is_err() {
            return;
        }
    }
}

fn forward(
    mut src: impl Read,
    rank: u32,
    tag: bool,
    to_stderr: bool,
    sink: Option<Arc<Mutex<Vec<u8>>>>,
) {
    let mut rd = BufReader::new(&mut src);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match rd.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if let Some(s) = &sink {
            s.lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(&buf);
            continue;
        }
        let mut line = Vec::with_capacity(buf.len() + 8);
        if tag {
            line.extend_from_slice(format!("[{rank}] ").as_bytes());
        }
        line.extend_from_slice(&buf);
        if to_stderr {
            let _ = std::io::stderr().lock().write_all(&line);
        } else {
            let _ = std::io::stdout().lock().write_all(&line);
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

fn signal_all(children: &[Option<Child>], sig: i32) {
    for c in children.iter().flatten() {
        let pid = c.id() as i32;
        // SAFETY: plain syscalls; each rank leads its own process group (pgid == pid), so
        // signalling -pid reaches the rank and anything it started.
        unsafe {
            libc::kill(-pid, sig);
            libc::kill(pid, sig);
        }
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

/// Launch and supervise a job; returns when every rank has exited.
pub fn run(spec: &Spec) -> std::io::Result<Outcome> {
    let n = spec.n;
    let (tx, rx) = mpsc::channel::<Event>();
    let job = Arc::new(Job {
        n,
        kvsname: format!("weft-{}-{}", std::process::id(), rand_suffix()),
        st: Mutex::new(JobState {
            initialized: vec![false; n as usize],
            finalized: vec![false; n as usize],
            claimed: vec![false; n as usize],
            ..Default::default()
        }),
        cv: Condvar::new(),
        events: Mutex::new(tx.clone()),
    });

    // Signals end the job; the handler thread lives as long as the process (cheap).
    static SIGNALS_INSTALLED: AtomicBool = AtomicBool::new(false);
    static SIGNAL_TX: Mutex<Option<mpsc::Sender<Event>>> = Mutex::new(None);
    *SIGNAL_TX.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx.clone());
    if !SIGNALS_INSTALLED.swap(true, Ordering::SeqCst) {
        let mut sigs = signal_hook::iterator::Signals::new([
            signal_hook::consts::SIGINT,
            signal_hook::consts::SIGTERM,
            signal_hook::consts::SIGHUP,
        ])?;
        std::thread::spawn(move || {
            for s in sigs.forever() {
                if let Some(t) = SIGNAL_TX.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                    let _ = t.send(Event::Signal(s));
                }
            }
        });
    }

    let listener = if spec.pmi_port {
        let l = TcpListener::bind("127.0.0.1:0")?;
        let addr = l.local_addr()?;
        let job2 = job.clone();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                let j = job2.clone();
                std::thread::spawn(move || serve::<TcpStream>(j, s, None));
            }
        });
        Some(addr)
    } else {
        None
    };

    let cpus = if spec.bind { allowed_cpus() } else { vec![] };
    let captured: Vec<Arc<Mutex<Vec<u8>>>> =
        (0..n).map(|_| Arc::new(Mutex::new(Vec::new()))).collect();
    let mut children: Vec<Option<Child>> = Vec::new();
    let mut io_threads = Vec::new();
    let mut spawn_error = None;
    for r in 0..n {
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
            .env("PMI_SIZE", n.to_string())
            .env("WEFT_JOB_SIZE", n.to_string());
        if let Some(p) = &spec.provider {
            cmd.env("WEFT_PROVIDER", p);
        }
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        let mut child_sock: Option<UnixStream> = None;
        let mut parent_sock: Option<UnixStream> = None;
        if let Some(addr) = listener {
            cmd.env("PMI_PORT", addr.to_string())
                .env("PMI_ID", r.to_string());
            cmd.env_remove("PMI_FD");
        } else {
            let (a, b) = UnixStream::pair()?;
            cmd.env("PMI_FD", b.as_raw_fd().to_string());
            cmd.env_remove("PMI_PORT");
            child_sock = Some(b);
            parent_sock = Some(a);
        }
        let keep_fd: RawFd = child_sock.as_ref().map_or(-1, |s| s.as_raw_fd());
        let cpu = (!cpus.is_empty()).then(|| cpus[r as usize % cpus.len()]);
        // SAFETY: the closure runs in the child between fork and exec and only makes
        // async-signal-safe syscalls (fcntl, prctl, getppid, sched_setaffinity) on values
        // captured by copy.
        let parent_pid = std::process::id() as i32;
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
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                spawn_error = Some(std::io::Error::new(
                    e.kind(),
                    format!("cannot start {}: {e}", spec.program.to_string_lossy()),
                ));
                break;
            }
        };
        drop(child_sock);
        if let Some(s) = parent_sock {
            let j = job.clone();
            std::thread::spawn(move || serve::<UnixStream>(j, s, Some(r)));
        }
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        let cap = spec.capture.then(|| captured[r as usize].clone());
        let tag = spec.tag_output;
        io_threads.push(std::thread::spawn(move || forward(out, r, tag, false, cap)));
        io_threads.push(std::thread::spawn(move || forward(err, r, tag, true, None)));
        children.push(Some(child));
    }

    let mut statuses: Vec<Option<ExitStatus>> = vec![None; n as usize];
    let mut failure: Option<String> = None;
    let mut signal_code = None;
    if let Some(e) = spawn_error {
        if !spec.quiet {
            eprintln!("weft run: {e}");
        }
        failure = Some(e.to_string());
    }
    let mut killing: Option<Instant> = None;
    // Exit code of the rank whose failure ended the job.
    let mut cause_code: Option<i32> = None;
    if failure.is_some() {
        signal_all(&children, libc::SIGTERM);
        killing = Some(Instant::now());
    }
    let started = Instant::now();
    let mut alive = children.iter().filter(|c| c.is_some()).count();
    while alive > 0 {
        // Reap whoever exited. Within one round, ranks killed by a signal are reported first:
        // when one rank dies and a peer exits with an error because of it, both often land in
        // the same round, and the death is the cause.
        let mut round: Vec<(u32, ExitStatus)> = Vec::new();
        for (r, slot) in children.iter_mut().enumerate() {
            if let Some(c) = slot {
                if let Ok(Some(st)) = c.try_wait() {
                    statuses[r] = Some(st);
                    round.push((r as u32, st));
                    *slot = None;
                    alive -= 1;
                }
            }
        }
        round.sort_by_key(|(r, st)| (st.signal().is_none(), *r));
        for (r, st) in round {
            let _ = tx.send(Event::Exit(r, st));
        }
        // Events (exits just sent, PMI failures, signals).
        while let Ok(ev) = rx.try_recv() {
            let mut end_job = true;
            let why = match ev {
                Event::Exit(r, st) => {
                    end_job = !spec.keep_going;
                    let (init, fin) = {
                        let s = job.st.lock().unwrap_or_else(|e| e.into_inner());
                        (s.initialized[r as usize], s.finalized[r as usize])
                    };
                    if !st.success() && killing.is_none() {
                        cause_code.get_or_insert(worst_code(&[Some(st)]));
                        Some(match (st.code(), st.signal()) {
                            (Some(c), _) => format!("rank {r} exited with status {c}"),
                            (None, Some(s)) => format!("rank {r} was killed by signal {s}"),
                            _ => format!("rank {r} failed"),
                        })
                    } else if init && !fin && killing.is_none() {
                        Some(format!("rank {r} exited without finalizing"))
                    } else {
                        None
                    }
                }
                Event::Fail(w) => Some(w),
                Event::Signal(s) => {
                    signal_code.get_or_insert(128 + s);
                    Some(format!("interrupted by signal {s}"))
                }
            };
            if let Some(w) = why {
                if failure.is_none() {
                    if !spec.quiet {
                        eprintln!(
                            "weft run: {w}{}",
                            match (alive > 0, end_job) {
                                (true, true) => "; ending the other ranks",
                                (true, false) => "; the others go on (--keep-going)",
                                _ => "",
                            }
                        );
                    }
                    failure = Some(w.clone());
                    // The launcher knows already; PMI barriers must not wait for the dead.
                    job.mark_failed(w, false);
                }
                if end_job && killing.is_none() && alive > 0 {
                    signal_all(&children, libc::SIGTERM);
                    killing = Some(Instant::now());
                }
            }
        }
        if let (Some(t), None) = (spec.timeout, killing) {
            if started.elapsed() > t {
                let w = format!("job timed out after {:.0} s", t.as_secs_f64());
                failure.get_or_insert(w.clone());
                job.fail(w);
                if !spec.quiet {
                    eprintln!("weft run: job timed out; ending every rank");
                }
                signal_all(&children, libc::SIGTERM);
                killing = Some(Instant::now());
            }
        }
        if let Some(t0) = killing {
            if t0.elapsed() > Duration::from_millis(500) {
                signal_all(&children, libc::SIGKILL);
            }
        }
        if alive > 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    // Drain forwarded output.
    for t in io_threads {
        let _ = t.join();
    }
    *SIGNAL_TX.lock().unwrap_or_else(|e| e.into_inner()) = None;
    // Ranks killed while they were setting up shared memory may have left names behind.
    for name in remove_shm_leftovers(&job.kvsname) {
        if !spec.quiet {
            eprintln!("weft run: removed /dev/shm/{name}, left behind by the job");
        }
    }
    // The status of the rank that failed first (not the SIGTERM the launcher sent the
    // others), else an interrupting signal, else the worst exit code.
    let mut code = match (cause_code, signal_code) {
        (_, Some(s)) => s,
        (Some(c), None) => c,
        (None, None) => worst_code(&statuses),
    };
    if failure.is_some() && code == 0 {
        code = job
            .st
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .abort_code
            .filter(|c| *c != 0)
            .unwrap_or(1);
    }
    Ok(Outcome {
        code,
        stdout: captured
            .iter()
            .map(|c| std::mem::take(&mut *c.lock().unwrap_or_else(|e| e.into_inner())))
            .collect(),
        failure,
    })
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
}
