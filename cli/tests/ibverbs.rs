//! The soft HCA as a drop-in `libibverbs.so.1` (`export/ibverbs`), judged by unmodified
//! programs: rdma-core's examples (Debian's ibverbs-utils) with their data checks (`-c`) and
//! perftest, each server and client on this host (ranks 0 and 1 of `weft run -n 2`), loaded
//! through the `LD_LIBRARY_PATH` that `weft soft-hca env` prints; and weft's own C checks of
//! what a verbs program can get wrong (`export/ibverbs/tests/errors.c`). Skipped without
//! Debian's tools, unless `WEFT_REQUIRE_TOOLS=1`.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Build the drop-in with the tests' profile and install it with `weft soft-hca env`.
fn install(test: &str) -> PathBuf {
    build_package("weft-ibverbs");
    let out = std::env::temp_dir().join(format!("weft-ibv-{test}-{}", std::process::id()));
    let o = run_bounded(
        Command::new(weft())
            .args(["soft-hca", "env", "--dir"])
            .arg(&out),
        60,
    );
    assert!(o.status.success(), "weft soft-hca env: {}", stderr(&o));
    let text = stdout(&o);
    let out = out.canonicalize().unwrap();
    assert!(
        text.contains(&format!("export LD_LIBRARY_PATH={}", out.display())),
        "{text}"
    );
    assert!(out.join("libibverbs.so.1").is_file());
    out
}

/// Rank 0 serves on `port`; rank 1 waits (bounded) until the port listens, then connects.
fn wrapper(dir: &Path) -> PathBuf {
    let p = dir.join("serve-or-connect.sh");
    std::fs::write(
        &p,
        r#"#!/bin/sh
port=$1; shift
if [ "$PMI_RANK" = 0 ]; then exec "$@" -p "$port"; fi
i=0
until ss -Hltn "sport = :$port" | grep -q .; do
  i=$((i + 1)); [ $i -gt 3000 ] && { echo "the server never listened on $port" >&2; exit 9; }
  sleep 0.01
done
exec "$@" -p "$port" 127.0.0.1
"#,
    )
    .unwrap();
    let _ = Command::new("chmod").arg("+x").arg(&p).status();
    p
}

/// Server and client of `args` over the drop-in; returns (success, stdout, stderr).
fn pair(dir: &Path, port: u16, args: &[&str]) -> (bool, String, String) {
    let o = run_bounded(
        Command::new(weft())
            .args(["run", "-n", "2", "--tag-output", "--timeout", "120", "--"])
            .arg(wrapper(dir))
            .arg(port.to_string())
            .args(args)
            .env("LD_LIBRARY_PATH", dir),
        180,
    );
    (o.status.success(), stdout(&o), stderr(&o))
}

/// Ports the servers listen on: below Linux's ephemeral range (32768 up), where an outgoing
/// connection of any other test could hold the port first; spread by pid.
fn base_port() -> u16 {
    20000 + (std::process::id() % 500) as u16 * 8
}

#[test]
fn ibv_devices_and_ibv_devinfo_see_the_soft_hca() {
    if !have("ibv_devinfo") {
        return skip("ibv_devinfo (Debian's ibverbs-utils)");
    }
    let dir = install("devinfo");
    let o = run_bounded(Command::new("ibv_devices").env("LD_LIBRARY_PATH", &dir), 60);
    assert!(
        o.status.success() && stdout(&o).contains("weft0"),
        "{}{}",
        stdout(&o),
        stderr(&o)
    );
    let o = run_bounded(
        Command::new("ibv_devinfo")
            .arg("-v")
            .env("LD_LIBRARY_PATH", &dir),
        60,
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{out}{}", stderr(&o));
    for want in [
        "hca_id:\tweft0",
        "PORT_ACTIVE",
        "link_layer:\t\tEthernet",
        "RoCE v2",
        "atomic_cap:\t\t\tATOMIC_HCA",
    ] {
        assert!(out.contains(want), "no {want:?} in:\n{out}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn rdma_cores_examples_run_with_their_data_checks() {
    if !have("ibv_rc_pingpong") || !have("ss") {
        return skip("ibv_rc_pingpong (Debian's ibverbs-utils) and ss (iproute2)");
    }
    let dir = install("pingpong");
    let mut port = base_port();
    for args in [
        &["ibv_rc_pingpong", "-g", "0", "-c", "-n", "200"][..],
        &[
            "ibv_rc_pingpong",
            "-g",
            "0",
            "-c",
            "-n",
            "200",
            "-s",
            "65536",
        ],
        &["ibv_rc_pingpong", "-g", "0", "-c", "-n", "200", "-e"],
        &["ibv_ud_pingpong", "-g", "0", "-c", "-n", "200"],
        &["ibv_srq_pingpong", "-g", "0", "-c", "-n", "200"],
        &[
            "ibv_srq_pingpong",
            "-g",
            "0",
            "-c",
            "-n",
            "200",
            "-e",
            "-q",
            "4",
        ],
    ] {
        port += 1;
        let (ok, out, err) = pair(&dir, port, args);
        let what = args.join(" ");
        assert!(ok, "{what}:\n{out}{err}");
        for r in ["[0] ", "[1] "] {
            assert!(
                out.lines()
                    .any(|l| l.starts_with(r) && l.contains("iters in")),
                "{what}: rank {r} reported no rate:\n{out}"
            );
        }
    }
    // Without a GID the port cannot address the peer (RoCE-style): both sides fail, with the
    // reason, in bounded time.
    port += 1;
    let (ok, out, err) = pair(&dir, port, &["ibv_rc_pingpong", "-n", "10"]);
    assert!(!ok, "ran without a GID:\n{out}");
    assert!(err.contains("addresses peers by GID"), "{out}{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn perftest_runs_to_completion() {
    if !have("ib_write_lat") || !have("ss") {
        return skip("perftest (Debian's perftest) and ss (iproute2)");
    }
    let dir = install("perftest");
    let mut port = base_port() + 4000;
    for args in [
        &["ib_write_lat", "-n", "200"][..],
        &["ib_write_bw", "-n", "200"],
        &["ib_read_lat", "-n", "200"],
        &["ib_read_bw", "-n", "200"],
        &["ib_send_lat", "-n", "200"],
        &["ib_send_bw", "-n", "200"],
        &["ib_send_lat", "-c", "UD", "-n", "200"],
        &["ib_send_bw", "-c", "UD", "-n", "200"],
        &["ib_atomic_lat", "-n", "200"],
        &["ib_atomic_bw", "-n", "200"],
        &["ib_write_bw", "-n", "200", "-a"],
    ] {
        port += 1;
        let (ok, out, err) = pair(&dir, port, args);
        let what = args.join(" ");
        assert!(ok, "{what}:\n{out}{err}");
        // The client prints its table: a header and at least one row of figures.
        let rows = out
            .lines()
            .skip_while(|l| !(l.starts_with("[1] ") && l.contains("#bytes")))
            .skip(1)
            .filter(|l| {
                l.starts_with("[1] ")
                    && l[4..]
                        .split_whitespace()
                        .next()
                        .is_some_and(|w| w.parse::<u64>().is_ok())
            })
            .count();
        assert!(rows >= 1, "{what}: no result row:\n{out}");
        assert!(
            !out.contains("Couldn't") && !out.contains("Failed"),
            "{what}:\n{out}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `weft soft-hca exec`: the program sees `/dev/infiniband/uverbs-weft0` (a character device
/// it may read and write) and the host's own `/dev/shm`; the host sees neither the node nor a
/// staging directory afterwards; a program that cannot start is an error, not a hang.
#[test]
fn soft_hca_exec_gives_the_program_a_device_node_and_leaves_nothing() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip("root (weft soft-hca exec makes a mount namespace)");
    }
    let dir = install("exec");
    let mark = format!("/dev/shm/weft-soft-hca-exec-{}", std::process::id());
    let script = format!(
        "test -c /dev/infiniband/uverbs-weft0 && test -r /dev/infiniband/uverbs-weft0 && \
         test -w /dev/infiniband/uverbs-weft0 && touch {mark} && echo \"$$ $LD_LIBRARY_PATH\""
    );
    let o = run_bounded(
        Command::new(weft())
            .args(["soft-hca", "exec", "--dir"])
            .arg(&dir)
            .args(["--", "sh", "-c", &script]),
        60,
    );
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    // The shell is the process weft became (exec), so `$$` is the pid that named its staging
    // directory.
    let out = stdout(&o);
    let (pid, path) = out.trim().split_once(' ').unwrap();
    assert!(path.starts_with(dir.to_str().unwrap()), "{out}");
    // The program's /dev/shm is the host's.
    assert!(Path::new(&mark).exists());
    let _ = std::fs::remove_file(&mark);
    assert!(!Path::new("/dev/infiniband/uverbs-weft0").exists());
    let stage = std::env::temp_dir().join(format!("weft-soft-hca-dev.{pid}"));
    assert!(!stage.exists(), "{} left behind", stage.display());
    let o = run_bounded(
        Command::new(weft())
            .args(["soft-hca", "exec", "--dir"])
            .arg(&dir)
            .args(["--", "/nonexistent/program"]),
        60,
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("weft soft-hca exec: /nonexistent/program: No such file"),
        "{}",
        stderr(&o)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// UCX 1.13 (Debian's ucx-utils) over the drop-in. UCX lists a verbs device only if
/// `/dev/infiniband/<dev_name>` is a character device: `weft soft-hca exec` gives it one in a
/// private mount namespace. `rc_v` is UCX's alias for rc_verbs with ud_verbs as the wire-up
/// transport (rc_verbs alone has none: "no auxiliary transport", on any HCA); `ud_v` is
/// ud_verbs alone. tag_bw at 1 MiB takes UCX's rendezvous (RDMA reads on rc_verbs).
#[test]
fn ucx_runs_over_the_soft_hca() {
    if !have("ucx_perftest") || !have("ss") {
        return skip("UCX (Debian's ucx-utils) and ss (iproute2)");
    }
    let dir = install("ucx");
    // Without the node UCX does not see the device, even with the drop-in loaded.
    let o = run_bounded(
        Command::new("ucx_info")
            .arg("-d")
            .env("LD_LIBRARY_PATH", &dir),
        60,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stdout(&o).contains("weft0"), "{}", stdout(&o));
    let exec = |args: &[&str]| {
        let mut c = Command::new(weft());
        c.args(["soft-hca", "exec", "--dir"]).arg(&dir).arg("--");
        c.args(args);
        c
    };
    let o = run_bounded(&mut exec(&["ucx_info", "-d"]), 60);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}{}", stderr(&o));
    for want in [
        "Memory domain: weft0",
        "Transport: rc_verbs",
        "Transport: ud_verbs",
        "Device: weft0:1",
        "atomic_fadd: 64 bit",
    ] {
        assert!(out.contains(want), "no {want:?} in:\n{out}");
    }
    // Nothing of the namespace is left on the host.
    assert!(!Path::new("/dev/infiniband/uverbs-weft0").exists());
    let mut port = base_port() + 5000;
    for tls in ["rc_v", "ud_v"] {
        for test in [
            &["-t", "tag_lat", "-n", "2000"][..],
            &["-t", "tag_bw", "-s", "1048576", "-n", "100"],
        ] {
            port += 1;
            let (me, wrap, p) = (weft(), wrapper(&dir), port.to_string());
            let mut args = vec![me.to_str().unwrap(), "run", "-n", "2", "--tag-output"];
            args.extend(["--timeout", "120", "--", wrap.to_str().unwrap(), &p]);
            args.push("ucx_perftest");
            args.extend(test);
            let o = run_bounded(
                exec(&args)
                    .env("UCX_TLS", tls)
                    .env("UCX_NET_DEVICES", "weft0:1"),
                180,
            );
            let (out, err) = (stdout(&o), stderr(&o));
            let what = format!("UCX_TLS={tls} ucx_perftest {}", test.join(" "));
            assert!(o.status.success(), "{what}:\n{out}{err}");
            // The client's last line: "Final: iterations, latency x3, bandwidth x2, rate x2".
            let fin = out
                .lines()
                .find(|l| l.starts_with("[1] Final:"))
                .unwrap_or_else(|| panic!("{what}: no Final line:\n{out}{err}"));
            let nums: Vec<f64> = fin[10..]
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect();
            assert!(
                nums.len() == 8 && nums[0] >= 100.0 && nums[4] > 0.0,
                "{what}: {fin}"
            );
            assert!(
                !out.contains("UCX  ERROR") && !err.contains("UCX  ERROR"),
                "{what}:\n{out}{err}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// MPI over UCX over the drop-in: Open MPI (`--mca pml ucx`, `--mca osc ucx`) and Debian's
/// MPICH (ch4:ucx; `MPIR_CVAR_NOLOCAL=1`, or MPICH keeps ranks of one host on its own shared
/// memory) run weft's MPI checks (`export/libfabric/tests/c/`: two-sided 0 B–4 MiB with data
/// checks, probes, cancel, truncation, collectives; one-sided puts, gets, accumulates, atomics)
/// at 4 ranks, UCX restricted to the soft HCA (`UCX_TLS` rc_v or ud_v, `UCX_NET_DEVICES=weft0:1`)
/// and saying so (`ep_cfg` lines at `UCX_LOG_LEVEL=info`).
#[test]
fn mpi_over_ucx_runs_on_the_soft_hca() {
    if !have("ucx_info") || !have("mpicc.openmpi") || !have("mpicc.mpich") {
        return skip(
            "UCX (ucx-utils), Open MPI's and MPICH's mpicc (libopenmpi-dev, libmpich-dev)",
        );
    }
    let dir = install("mpi-ucx");
    let c = Path::new(env!("CARGO_MANIFEST_DIR")).join("../export/libfabric/tests/c");
    let mut bins = Vec::new();
    for (mpicc, prog) in [
        ("mpicc.openmpi", "mpi_checks"),
        ("mpicc.openmpi", "mpi_rma"),
        ("mpicc.mpich", "mpi_checks"),
        ("mpicc.mpich", "mpi_rma"),
    ] {
        let bin = dir.join(format!("{prog}.{mpicc}"));
        // MPICH's header makes gcc 12 see MPI_STATUSES_IGNORE as a zero-sized array.
        let o = run_bounded(
            Command::new(mpicc)
                .args(["-O1", "-Wall", "-Wno-stringop-overflow", "-o"])
                .arg(&bin)
                .arg(c.join(format!("{prog}.c"))),
            120,
        );
        assert!(o.status.success(), "{mpicc} {prog}.c: {}", stderr(&o));
        bins.push((mpicc, prog, bin));
    }
    for tls in ["rc_v", "ud_v"] {
        for (mpicc, prog, bin) in &bins {
            let mut cmd = Command::new(weft());
            cmd.args(["soft-hca", "exec", "--dir"]).arg(&dir).arg("--");
            if *mpicc == "mpicc.openmpi" {
                cmd.args(["mpirun.openmpi", "--allow-run-as-root", "--oversubscribe"])
                    .args(["-np", "4", "--mca", "pml", "ucx", "--mca", "osc", "ucx"])
                    .args(["--mca", "btl", "self"]);
                for v in [
                    "LD_LIBRARY_PATH",
                    "UCX_TLS",
                    "UCX_NET_DEVICES",
                    "UCX_LOG_LEVEL",
                ] {
                    cmd.args(["-x", v]);
                }
            } else {
                cmd.args(["mpiexec.mpich", "-n", "4"])
                    .env("MPIR_CVAR_NOLOCAL", "1");
            }
            let o = run_bounded(
                cmd.arg(bin)
                    .env("UCX_TLS", tls)
                    .env("UCX_NET_DEVICES", "weft0:1")
                    .env("UCX_LOG_LEVEL", "info"),
                300,
            );
            let (out, err) = (stdout(&o), stderr(&o));
            let what = format!("{prog} ({mpicc}) over UCX_TLS={tls}");
            assert!(o.status.success(), "{what}:\n{out}{err}");
            let pass = if *prog == "mpi_rma" {
                "rma passed at 4 ranks"
            } else {
                "all passed at 4 ranks"
            };
            assert!(out.contains(pass), "{what}:\n{out}{err}");
            let transport = &tls[..2];
            let lane = format!("{transport}_verbs/weft0:1");
            let used = format!("{out}{err}")
                .lines()
                .filter(|l| l.contains("ep_cfg") && l.contains(&lane))
                .count();
            assert!(
                used >= 4,
                "{what}: UCX did not say it used {lane}:\n{out}{err}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn verbs_mistakes_are_errors_and_completions_as_on_a_real_hca() {
    if !have("cc") || !Path::new("/usr/include/infiniband/verbs.h").exists() {
        return skip("cc and libibverbs-dev");
    }
    let dir = install("errors");
    let bin = dir.join("errors");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../export/ibverbs/tests/errors.c");
    let o = run_bounded(
        Command::new("cc")
            .args(["-Wall", "-Werror", "-o"])
            .arg(&bin)
            .arg(&src)
            .arg("-libverbs"),
        120,
    );
    assert!(o.status.success(), "cc errors.c: {}", stderr(&o));
    let o = run_bounded(Command::new(&bin).env("LD_LIBRARY_PATH", &dir), 120);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}{}", stderr(&o));
    assert!(out.contains("all ok"), "{out}");
    assert!(
        out.lines().filter(|l| l.starts_with("ok ")).count() >= 39,
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two named network namespaces joined by a veth pair, deleted on drop.
struct TwoHosts {
    ns: [String; 2],
}

impl TwoHosts {
    fn new() -> Result<TwoHosts, String> {
        let id = std::process::id();
        let t = TwoHosts {
            ns: [format!("weft-ibv-a{id}"), format!("weft-ibv-b{id}")],
        };
        let (va, vb) = (
            format!("wiva{}", id % 100_000),
            format!("wivb{}", id % 100_000),
        );
        let ip = |args: &[&str]| -> Result<(), String> {
            let o = Command::new("ip")
                .args(args)
                .output()
                .map_err(|e| e.to_string())?;
            if o.status.success() {
                Ok(())
            } else {
                Err(format!("ip {}: {}", args.join(" "), stderr(&o)))
            }
        };
        for n in &t.ns {
            ip(&["netns", "add", n])?;
        }
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        for (i, (dev, addr)) in [(&va, "10.79.0.1/24"), (&vb, "10.79.0.2/24")]
            .into_iter()
            .enumerate()
        {
            let n = t.ns[i].as_str();
            ip(&["link", "set", dev, "netns", n])?;
            ip(&["-n", n, "addr", "add", addr, "dev", dev])?;
            ip(&["-n", n, "link", "set", dev, "up"])?;
            ip(&["-n", n, "link", "set", "lo", "up"])?;
        }
        Ok(t)
    }

    fn cmd(&self, host: usize, dir: &Path, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns[host]])
            .arg("env")
            .arg(format!("LD_LIBRARY_PATH={}", dir.display()))
            .args(args);
        c
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for n in &self.ns {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

/// Server in one namespace, client in the other: every verb crosses the soft HCA's UDP path.
#[test]
fn verbs_programs_run_between_two_hosts() {
    if !have("ibv_rc_pingpong") || !have("ib_send_lat") || !have("ip") {
        return skip("ibverbs-utils, perftest and ip (iproute2)");
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip("root (network namespaces)");
    }
    let hosts = match TwoHosts::new() {
        Ok(h) => h,
        Err(e) => return skip(&format!("network namespaces: {e}")),
    };
    let dir = install("twohosts");
    let mut port = base_port() + 6000;
    for args in [
        &["ibv_rc_pingpong", "-g", "0", "-c", "-n", "100"][..],
        &["ibv_ud_pingpong", "-g", "0", "-c", "-n", "100"],
        &["ib_write_bw", "-n", "100"],
        &["ib_send_lat", "-c", "UD", "-n", "100"],
        &["ib_atomic_lat", "-n", "100"],
    ] {
        port += 1;
        let p = port.to_string();
        let mut srv_args = args.to_vec();
        srv_args.extend(["-p", &p]);
        let server = hosts
            .cmd(0, &dir, &srv_args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("server");
        // Bounded wait until the server listens, in its namespace.
        let listening = (0..3000).any(|_| {
            let o = hosts
                .cmd(0, &dir, &["ss", "-Hltn", &format!("sport = :{p}")])
                .output();
            if o.is_ok_and(|o| !o.stdout.is_empty()) {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
            false
        });
        let mut cli_args = srv_args.clone();
        cli_args.push("10.79.0.1");
        let client = listening.then(|| run_bounded(&mut hosts.cmd(1, &dir, &cli_args), 120));
        let srv = run_bounded_child(server, 120);
        let what = args.join(" ");
        assert!(listening, "{what}: the server never listened");
        let client = client.unwrap();
        assert!(
            client.status.success() && srv.status.success(),
            "{what}:\nclient {}{}\nserver {}{}",
            stdout(&client),
            stderr(&client),
            stdout(&srv),
            stderr(&srv)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Wait (bounded) for a spawned child; kill it when the bound passes.
fn run_bounded_child(mut c: std::process::Child, secs: u64) -> std::process::Output {
    let end = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while std::time::Instant::now() < end {
        if c.try_wait().ok().flatten().is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let _ = c.kill();
    c.wait_with_output().expect("child output")
}

/// A server killed in the middle of a transfer: the client's requests complete with an error
/// (the soft HCA sees the process gone: transport retries exhausted, then flushes), perftest
/// says so and exits, in bounded time; nothing hangs.
#[test]
fn a_peer_killed_mid_transfer_ends_in_error_completions() {
    if !have("ib_write_bw") || !have("ss") {
        return skip("perftest and ss (iproute2)");
    }
    let dir = install("killed");
    let port = (base_port() + 7000).to_string();
    let args = ["ib_write_bw", "-D", "30", "-p", &port];
    let mut server = Command::new(args[0])
        .args(&args[1..])
        .env("LD_LIBRARY_PATH", &dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("server");
    let listening = (0..3000).any(|_| {
        let o = Command::new("ss")
            .args(["-Hltn", &format!("sport = :{port}")])
            .output();
        if o.is_ok_and(|o| !o.stdout.is_empty()) {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
        false
    });
    assert!(listening, "the server never listened");
    let out = dir.join("client.out");
    // Line-buffered (stdbuf), so that its table header shows when the transfer starts.
    let client = Command::new("stdbuf")
        .arg("-oL")
        .args(args)
        .arg("127.0.0.1")
        .env("LD_LIBRARY_PATH", &dir)
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(dir.join("client.err")).unwrap())
        .spawn()
        .expect("client");
    // Kill the server once the client has printed its table header (the transfer is running).
    let running = (0..3000).any(|_| {
        if std::fs::read_to_string(&out).is_ok_and(|s| s.contains("#bytes")) {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
        false
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    let _ = server.kill();
    let _ = server.wait();
    let t0 = std::time::Instant::now();
    let o = run_bounded_child(client, 60);
    let took = t0.elapsed();
    let text = std::fs::read_to_string(&out).unwrap_or_default()
        + &std::fs::read_to_string(dir.join("client.err")).unwrap_or_default();
    assert!(running, "the transfer never started:\n{text}");
    assert!(!o.status.success(), "the client did not notice:\n{text}");
    assert!(
        took < std::time::Duration::from_secs(30),
        "the client took {took:?} to notice"
    );
    assert!(text.contains("Completion with error"), "{text}");
    eprintln!("the client noticed its peer's death after {took:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
