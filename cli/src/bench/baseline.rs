//! Third-party baselines for `weft bench --baseline`: the installed tools run the same test
//! and sizes on cores 0 and 1 over loopback or shared memory, as ../shared/peers/ does.
//!
//! | name | tool (Debian package) | latency | bandwidth |
//! |---|---|---|---|
//! | `ucx:posix`, `ucx:sysv`, `ucx:cma`, `ucx:tcp` | `ucx_perftest` (ucx-utils) | tag_lat | tag_bw, streaming |
//! | `ucx:put` | `ucx_perftest` over posix (shared memory) | put_poll_lat only: ucp_put_lat | — |
//! | `ucx:rc_verbs`, `ucx:ud_verbs`, `ucx:rc_ud` | `ucx_perftest` over weft's soft HCA (the drop-in libibverbs.so.1 under `weft soft-hca exec`): rc_verbs (ud_verbs only to wire up), ud_verbs, both | tag_lat | tag_bw, streaming |
//! | `ofi:tcp`, `ofi:udp`, `ofi:shm` | `fi_pingpong` (libfabric-bin): `tcp` and `shm` on reliable datagram endpoints (tcp's through `ofi_rxm`, as weft's `ofi` uses them), `udp` on datagrams | ping-pong | size / one-way time |
//! | `ompi` | NetPIPE `NPopenmpi` (netpipe-openmpi), vader with its CMA single copy | ping-pong | size / one-way time |
//! | `ompi:2copy` | the same with `btl_vader_single_copy_mechanism none` (two copies) | ping-pong | size / one-way time |
//! | `ompi:tcp` | NetPIPE `NPopenmpi` over ob1's TCP BTL on loopback | ping-pong | size / one-way time |
//! | `mpich` | NetPIPE `NPmpich2` (netpipe-mpich2) | ping-pong | size / one-way time |
//! | `ompi:ucx`, `mpich:ucx` | NetPIPE over Open MPI's pml ucx / MPICH's ch4:ucx (`MPIR_CVAR_NOLOCAL=1`), UCX over rc_verbs on weft's soft HCA | ping-pong | size / one-way time |
//! | `nptcp` | NetPIPE `NPtcp` (netpipe-tcp) | ping-pong | size / one-way time |

use super::tests::Test;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tool {
    /// `ucx_perftest` over these transports; `put`: its put latency (`ucp_put_lat`), the
    /// counterpart of `put_poll_lat`, instead of tag matching.
    Ucx {
        tls: &'static str,
        put: bool,
    },
    Ofi {
        prov: &'static str,
        ep: &'static str,
    },
    /// Open MPI's ob1 over `btl` (vader, or tcp over loopback); `two_copy` disables vader's
    /// single-copy mechanism.
    Ompi {
        two_copy: bool,
        btl: &'static str,
    },
    Mpich,
    NpTcp,
}

/// A baseline column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Baseline {
    pub name: String,
    pub tool: Tool,
    /// Over weft's soft HCA through the drop-in libibverbs.so.1 (`weft soft-hca exec`), UCX
    /// restricted to its device (`UCX_TLS` of the `Ucx` tool, else `rc_v`).
    pub soft_hca: bool,
}

pub const NAMES: &[&str] = &[
    "ucx:posix",
    "ucx:sysv",
    "ucx:cma",
    "ucx:tcp",
    "ucx:put",
    "ucx:rc_verbs",
    "ucx:ud_verbs",
    "ucx:rc_ud",
    "ofi:tcp",
    "ofi:udp",
    "ofi:shm",
    "ompi",
    "ompi:2copy",
    "ompi:tcp",
    "ompi:ucx",
    "mpich",
    "mpich:ucx",
    "nptcp",
];

impl Baseline {
    pub fn parse(s: &str) -> Result<Baseline, String> {
        let tool = match s.trim() {
            "ucx:posix" => Tool::Ucx {
                tls: "posix,self",
                put: false,
            },
            "ucx:sysv" => Tool::Ucx {
                tls: "sysv,self",
                put: false,
            },
            "ucx:cma" => Tool::Ucx {
                tls: "posix,cma,self",
                put: false,
            },
            "ucx:tcp" => Tool::Ucx {
                tls: "tcp,self",
                put: false,
            },
            "ucx:put" => Tool::Ucx {
                tls: "posix,self",
                put: true,
            },
            // UCX's `rc_v` alias: rc_verbs, with ud_verbs only for wire-up (rc alone has no
            // transport that connects to an interface).
            "ucx:rc_verbs" => Tool::Ucx {
                tls: "rc_v",
                put: false,
            },
            "ucx:ud_verbs" => Tool::Ucx {
                tls: "ud_v",
                put: false,
            },
            "ucx:rc_ud" => Tool::Ucx {
                tls: "rc_verbs,ud_verbs",
                put: false,
            },
            // Reliable datagrams over tcp (tcp;ofi_rxm): the stack weft's `ofi` runs on.
            "ofi:tcp" => Tool::Ofi {
                prov: "tcp",
                ep: "rdm",
            },
            "ofi:udp" => Tool::Ofi {
                prov: "udp",
                ep: "dgram",
            },
            "ofi:shm" => Tool::Ofi {
                prov: "shm",
                ep: "rdm",
            },
            "ompi" => Tool::Ompi {
                two_copy: false,
                btl: "self,vader",
            },
            "ompi:2copy" => Tool::Ompi {
                two_copy: true,
                btl: "self,vader",
            },
            // ob1's TCP BTL over loopback: tcp-sim's peer.
            "ompi:tcp" => Tool::Ompi {
                two_copy: false,
                btl: "self,tcp",
            },
            // pml ucx over rc_verbs on the soft HCA.
            "ompi:ucx" => Tool::Ompi {
                two_copy: false,
                btl: "self",
            },
            "mpich" => Tool::Mpich,
            // ch4:ucx over rc_verbs on the soft HCA, MPICH's own shared memory off.
            "mpich:ucx" => Tool::Mpich,
            "nptcp" => Tool::NpTcp,
            other => {
                return Err(format!(
                    "unknown baseline '{other}'; baselines: {}",
                    NAMES.join(", ")
                ))
            }
        };
        let name = s.trim().to_string();
        Ok(Baseline {
            soft_hca: matches!(
                name.as_str(),
                "ucx:rc_verbs" | "ucx:ud_verbs" | "ucx:rc_ud" | "ompi:ucx" | "mpich:ucx"
            ),
            name,
            tool,
        })
    }

    fn binary(&self) -> &'static str {
        match self.tool {
            Tool::Ucx { .. } => "ucx_perftest",
            Tool::Ofi { .. } => "fi_pingpong",
            Tool::Ompi { .. } => "NPopenmpi",
            Tool::Mpich => "NPmpich2",
            Tool::NpTcp => "NPtcp",
        }
    }

    fn package(&self) -> &'static str {
        match self.tool {
            Tool::Ucx { .. } => "ucx-utils",
            Tool::Ofi { .. } => "libfabric-bin",
            Tool::Ompi { .. } => "netpipe-openmpi",
            Tool::Mpich => "netpipe-mpich2",
            Tool::NpTcp => "netpipe-tcp",
        }
    }

    /// Is the tool installed? `Err` is the one-line note for the report.
    pub fn available(&self) -> Result<(), String> {
        let bin = self.binary();
        let launcher_ok = match self.tool {
            Tool::Ompi { .. } => which("mpirun.openmpi").is_some(),
            Tool::Mpich => which("mpiexec.hydra").is_some(),
            _ => true,
        };
        if self.soft_hca && !drop_in().is_file() {
            return Err(format!(
                "baseline {} skipped: {} is missing (cargo build -p weft-ibverbs, the profile \
                 of weft)",
                self.name,
                drop_in().display()
            ));
        }
        if which(bin).is_some() && launcher_ok {
            Ok(())
        } else {
            Err(format!(
                "baseline {} skipped: {bin} is not installed (Debian package {})",
                self.name,
                self.package()
            ))
        }
    }

    /// Which tests the tool can measure.
    pub fn supports(&self, t: Test) -> bool {
        match self.tool {
            Tool::Ucx { put: true, .. } => t == Test::PutPollLat,
            _ => matches!(t, Test::Latency | Test::Bw),
        }
    }

    /// Largest size the tool handles.
    fn max_size(&self) -> usize {
        match self.tool {
            Tool::Ofi { prov: "udp", .. } => 1472,
            _ => usize::MAX,
        }
    }

    /// Whether the bandwidth column is derived from ping-pong time.
    pub fn pingpong_bw(&self) -> bool {
        !matches!(self.tool, Tool::Ucx { .. })
    }

    /// Measure `sizes` once. Sizes the tool cannot do are left out.
    pub fn run(&self, t: Test, sizes: &[usize], work: &Path) -> Result<Vec<(usize, f64)>, String> {
        let sizes: Vec<usize> = sizes
            .iter()
            .copied()
            .filter(|s| *s <= self.max_size() && (*s > 0 || matches!(self.tool, Tool::Ucx { .. })))
            .collect();
        match &self.tool {
            Tool::Ucx { tls, .. } => run_ucx(tls, self.soft_hca, t, &sizes, work),
            Tool::Ofi { prov, ep } => sizes
                .iter()
                .map(|&s| run_ofi(prov, ep, t, s).map(|v| (s, v)))
                .collect(),
            Tool::Ompi { .. } | Tool::Mpich | Tool::NpTcp => sizes
                .iter()
                .map(|&s| run_netpipe(&self.tool, self.soft_hca, t, s, work).map(|v| (s, v)))
                .collect(),
        }
    }
}

fn which(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(bin))
            .find(|f| f.is_file())
    })
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(14321)
}

/// Is `port` in LISTEN state (/proc/net/tcp{,6})?
fn listening(port: u16) -> bool {
    let needle = format!(":{port:04X} ");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|s| {
            s.lines().skip(1).any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && format!("{} ", cols[1]).ends_with(&needle) && cols[3] == "0A"
            })
        })
    })
}

const TOOL_TIMEOUT: Duration = Duration::from_secs(120);

fn base_env(c: &mut Command) {
    for (k, v) in [
        ("FI_TCP_IFACE", "lo"),
        ("FI_UDP_IFACE", "lo"),
        ("FI_SOCKETS_IFACE", "lo"),
        ("FI_NET_IFACE", "lo"),
        ("UCX_NET_DEVICES", "lo"),
        ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
        ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
    ] {
        c.env(k, v);
    }
    c.env_remove("UCX_TLS").env_remove("FI_PROVIDER");
    c.stdin(Stdio::null()).process_group(0);
}

/// Run a command to completion within TOOL_TIMEOUT, returning stdout.
fn output(mut c: Command, what: &str) -> Result<String, String> {
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = c.spawn().map_err(|e| format!("{what}: {e}"))?;
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(TOOL_TIMEOUT) {
        Ok(Ok(o)) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).into_owned()),
        Ok(Ok(o)) => Err(format!(
            "{what} failed ({}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => {
            // SAFETY: killing the process group we created.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            Err(format!("{what} timed out"))
        }
    }
}

/// A server started in the background; killed on drop.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: killing the process group we created for the server.
        unsafe { libc::kill(-(self.0.id() as i32), libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

fn start_server(mut c: Command, port: u16, what: &str) -> Result<Server, String> {
    c.stdout(Stdio::null()).stderr(Stdio::null());
    let s = Server(c.spawn().map_err(|e| format!("{what}: {e}"))?);
    let t0 = Instant::now();
    while !listening(port) {
        if t0.elapsed() > Duration::from_secs(20) {
            return Err(format!("{what}: server did not listen on port {port}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(s)
}

/// Parse `ucx_perftest -f` rows: `label iters p50 avg overall bw_avg bw_overall mr_avg mr_overall`.
/// Returns (label, overall latency µs, overall bandwidth in 10^6 B/s). UCX prints MiB/s.
pub fn parse_ucx(text: &str) -> Vec<(String, f64, f64)> {
    text.lines()
        .filter_map(|l| {
            let c: Vec<&str> = l.split_whitespace().collect();
            if c.len() != 9 || !(c[0].starts_with('L') || c[0].starts_with('B')) {
                return None;
            }
            let lat: f64 = c[4].parse().ok()?;
            let bw: f64 = c[6].parse().ok()?;
            c[1].parse::<u64>().ok()?;
            Some((c[0].to_string(), lat, bw * 1.048576))
        })
        .collect()
}

/// The drop-in libibverbs that `weft soft-hca exec` installs: built next to this program.
fn drop_in() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("libweft_ibverbs.so")))
        .unwrap_or_default()
}

/// `prog` with `base_env`, or on the soft HCA `weft soft-hca exec -- prog` with UCX restricted
/// to its device over `tls`.
fn tool(prog: &str, soft_hca: bool, tls: &str) -> Command {
    let mut c = if soft_hca {
        let me = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("weft"));
        let mut c = Command::new(me);
        c.args(["soft-hca", "exec", "--", prog]);
        c
    } else {
        Command::new(prog)
    };
    base_env(&mut c);
    if soft_hca {
        c.env("UCX_TLS", tls).env("UCX_NET_DEVICES", "weft0:1");
    }
    c
}

fn run_ucx(
    tls: &str,
    soft_hca: bool,
    t: Test,
    sizes: &[usize],
    work: &Path,
) -> Result<Vec<(usize, f64)>, String> {
    let mut batch = String::new();
    for &s in sizes {
        let s = s.max(1);
        match t {
            Test::Latency | Test::PutPollLat => {
                let n = (1usize << 28) / s.max(8);
                let n = n.clamp(1000, 100_000);
                let test = if t == Test::Latency {
                    "tag_lat"
                } else {
                    "ucp_put_lat"
                };
                batch.push_str(&format!("L{s} -t {test} -s {s} -n {n} -w {}\n", n / 10 + 1));
            }
            _ => {
                let n = ((1usize << 30) / s).clamp(64, 100_000);
                batch.push_str(&format!("B{s} -t tag_bw -s {s} -n {n} -w {}\n", n / 10 + 1));
            }
        }
    }
    let file = work.join(format!("ucx-batch-{}", std::process::id()));
    std::fs::write(&file, batch).map_err(|e| e.to_string())?;
    let port = free_port();
    let mut srv = tool("ucx_perftest", soft_hca, tls);
    srv.env("UCX_TLS", tls);
    srv.args(["-c", "0", "-p", &port.to_string(), "-b"])
        .arg(&file);
    let server = start_server(srv, port, "ucx_perftest server");
    let result = server.and_then(|_s| {
        let mut cli = tool("ucx_perftest", soft_hca, tls);
        cli.env("UCX_TLS", tls);
        cli.args(["127.0.0.1", "-p", &port.to_string(), "-c", "1", "-b"])
            .arg(&file)
            .arg("-f");
        output(cli, "ucx_perftest")
    });
    let _ = std::fs::remove_file(&file);
    let rows = parse_ucx(&result?);
    Ok(sizes
        .iter()
        .filter_map(|&s| {
            let s1 = s.max(1);
            rows.iter()
                .find(|r| r.0[1..].parse::<usize>().ok() == Some(s1))
                .map(|r| (s, if t == Test::Bw { r.2 } else { r.1 }))
        })
        .collect())
}

/// Parse `fi_pingpong` output: the last data row
/// `bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec`; returns usec/xfer (one-way).
pub fn parse_fi(text: &str) -> Option<f64> {
    text.lines().rev().find_map(|l| {
        let c: Vec<&str> = l.split_whitespace().collect();
        (c.len() == 8 && c[0] != "bytes")
            .then(|| c[6].parse::<f64>().ok())
            .flatten()
    })
}

fn run_ofi(prov: &str, ep: &str, t: Test, s: usize) -> Result<f64, String> {
    let iters = if s <= 1024 {
        10_000
    } else {
        ((1usize << 28) / s).max(16)
    };
    let port = free_port();
    let common = |c: &mut Command| {
        c.args([
            "-p",
            prov,
            "-e",
            ep,
            "-I",
            &iters.to_string(),
            "-S",
            &s.to_string(),
        ]);
        base_env(c);
    };
    let mut srv = Command::new("taskset");
    srv.args(["-c", "0", "fi_pingpong"]);
    common(&mut srv);
    srv.args(["-B", &port.to_string()]);
    // udp does not listen on TCP; give it a moment through the dgram path's own retry.
    let server = if prov == "udp" {
        srv.stdout(Stdio::null()).stderr(Stdio::null());
        let s = Server(srv.spawn().map_err(|e| e.to_string())?);
        std::thread::sleep(Duration::from_millis(300));
        s
    } else {
        start_server(srv, port, "fi_pingpong server")?
    };
    let mut cli = Command::new("taskset");
    cli.args(["-c", "1", "fi_pingpong"]);
    common(&mut cli);
    cli.args(["-P", &port.to_string(), "127.0.0.1"]);
    let out = output(cli, "fi_pingpong");
    drop(server);
    let us = parse_fi(&out?).ok_or("fi_pingpong printed no result")?;
    Ok(if t == Test::Latency {
        us
    } else {
        s as f64 / us
    })
}

/// Parse a NetPIPE output file: rows `bytes Mbps seconds` (Mbps are 2^20 bit/s). Returns
/// (bytes, one-way µs, MB/s) per row.
pub fn parse_netpipe(text: &str) -> Vec<(usize, f64, f64)> {
    text.lines()
        .filter_map(|l| {
            let c: Vec<&str> = l.split_whitespace().collect();
            if c.len() < 3 {
                return None;
            }
            let b: usize = c[0].parse().ok()?;
            let mbps: f64 = c[1].parse().ok()?;
            if mbps <= 0.0 {
                return None;
            }
            Some((b, b as f64 * 8.0 / (mbps * 1.048576), mbps * 0.131072))
        })
        .collect()
}

fn run_netpipe(kind: &Tool, soft_hca: bool, t: Test, s: usize, work: &Path) -> Result<f64, String> {
    let out = work.join(format!("np-{}-{s}.out", std::process::id()));
    let np = ["-l", &s.to_string(), "-u", &s.to_string(), "-p", "0", "-o"];
    let r = match kind {
        Tool::Ompi { two_copy, btl } => {
            let mut c = tool("mpirun.openmpi", soft_hca, "rc_v");
            c.args([
                "--allow-run-as-root",
                "-np",
                "2",
                "--bind-to",
                "core",
                "--map-by",
                "core",
                "--mca",
                "oob_tcp_if_include",
                "lo",
            ]);
            if soft_hca {
                c.args(["--mca", "pml", "ucx", "--mca", "btl", "self"]);
                for v in ["LD_LIBRARY_PATH", "UCX_TLS", "UCX_NET_DEVICES"] {
                    c.args(["-x", v]);
                }
            } else {
                c.args(["--mca", "pml", "ob1", "--mca", "btl", btl]);
                c.args(["--mca", "btl_tcp_if_include", "lo"]);
            }
            if *two_copy {
                c.args(["--mca", "btl_vader_single_copy_mechanism", "none"]);
            }
            c.arg("NPopenmpi").args(np).arg(&out);
            output(c, "NPopenmpi")
        }
        Tool::Mpich => {
            let mut c = tool("mpiexec.hydra", soft_hca, "rc_v");
            if soft_hca {
                c.env("MPIR_CVAR_NOLOCAL", "1");
            }
            c.args([
                "-launcher",
                "fork",
                "-n",
                "2",
                "-bind-to",
                "user:0,1",
                "NPmpich2",
            ])
            .args(np)
            .arg(&out);
            output(c, "NPmpich2")
        }
        _ => {
            let port = free_port();
            let mut rcv = Command::new("taskset");
            rcv.args(["-c", "0", "NPtcp", "-P", &port.to_string()])
                .args(&np[..6]);
            base_env(&mut rcv);
            let server = start_server(rcv, port, "NPtcp receiver")?;
            let mut tx = Command::new("taskset");
            tx.args([
                "-c",
                "1",
                "NPtcp",
                "-h",
                "127.0.0.1",
                "-P",
                &port.to_string(),
            ])
            .args(np)
            .arg(&out);
            base_env(&mut tx);
            let r = output(tx, "NPtcp");
            drop(server);
            r
        }
    };
    let text = std::fs::read_to_string(&out);
    let _ = std::fs::remove_file(&out);
    r?;
    let rows = parse_netpipe(&text.map_err(|e| format!("NetPIPE output: {e}"))?);
    let row = rows
        .iter()
        .find(|r| r.0 == s)
        .ok_or("NetPIPE printed no row")?;
    Ok(if t == Test::Latency { row.1 } else { row.2 })
}

#[cfg(test)]
mod t {
    use super::*;

    fn data(name: &str) -> String {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(name);
        std::fs::read_to_string(p).unwrap()
    }

    #[test]
    fn ucx_put_measures_put_latency_only() {
        let put = Baseline::parse("ucx:put").unwrap();
        assert!(put.supports(Test::PutPollLat));
        assert!(!put.supports(Test::Latency) && !put.supports(Test::PutLat));
        let posix = Baseline::parse("ucx:posix").unwrap();
        assert!(posix.supports(Test::Latency) && !posix.supports(Test::PutPollLat));
        assert!(NAMES.iter().all(|n| Baseline::parse(n).is_ok()));
    }

    #[test]
    fn soft_hca_baselines_are_the_ucx_ones_over_the_drop_in() {
        for (name, soft) in [
            ("ucx:rc_verbs", true),
            ("ucx:ud_verbs", true),
            ("ucx:rc_ud", true),
            ("ompi:ucx", true),
            ("mpich:ucx", true),
            ("ucx:posix", false),
            ("ompi", false),
            ("mpich", false),
        ] {
            let b = Baseline::parse(name).unwrap();
            assert_eq!(b.soft_hca, soft, "{name}");
            assert!(b.supports(Test::Latency) && b.supports(Test::Bw), "{name}");
        }
        // Under `weft soft-hca exec`, UCX restricted to the soft HCA's device.
        let c = tool("ucx_perftest", true, "rc_v");
        let args: Vec<_> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(args, ["soft-hca", "exec", "--", "ucx_perftest"]);
        let env: Vec<_> = c
            .get_envs()
            .filter_map(|(k, v)| Some((k.to_str()?.to_string(), v?.to_str()?.to_string())))
            .collect();
        assert!(env.contains(&("UCX_TLS".into(), "rc_v".into())));
        assert!(env.contains(&("UCX_NET_DEVICES".into(), "weft0:1".into())));
        let plain = tool("ucx_perftest", false, "rc_v");
        assert_eq!(plain.get_program(), "ucx_perftest");
    }

    #[test]
    fn ucx_recorded_output() {
        let rows = parse_ucx(&data("ucx_perftest.txt"));
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].0, "L8");
        assert!((rows[0].1 - 0.449).abs() < 1e-9);
        assert_eq!(rows[1].0, "B1048576");
        assert!((rows[1].2 - 8755.45 * 1.048576).abs() < 1e-6);
    }

    #[test]
    fn fi_recorded_output() {
        assert_eq!(parse_fi(&data("fi_pingpong.txt")), Some(5.51));
        assert_eq!(parse_fi("garbage\n"), None);
    }

    #[test]
    fn netpipe_recorded_outputs() {
        let r = parse_netpipe(&data("netpipe_ompi.txt"));
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].0, 8);
        assert!((r[0].1 - 8.0 * 8.0 / (141.392423 * 1.048576)).abs() < 1e-9);
        let r = parse_netpipe(&data("netpipe_mpich.txt"));
        assert!((r[0].2 - 53394.549705 * 0.131072).abs() < 1e-6);
        let r = parse_netpipe(&data("nptcp.txt"));
        assert_eq!(r[0].0, 8);
    }

    #[test]
    fn names() {
        assert!(Baseline::parse("ucx:posix").is_ok());
        let e = Baseline::parse("ucx:nope").unwrap_err();
        assert!(e.contains("ucx:posix") && e.contains("nptcp"));
    }
}
