//! weft as a libfabric provider (`export/libfabric`, `libweft-fi.so`): libfabric's own tools,
//! unmodified, run over weft's providers. `fi_info -p weft` lists a domain per weft provider;
//! `fi_pingpong` (Debian's libfabric-bin) runs with its data checks (`-c`), untagged and
//! tagged, rank 0 the server and rank 1 the client under `weft run -n 2`, over shm, tcp-sim,
//! verbs-rc and hybrid (the soft HCA); Open MPI (`pml cm`, `mtl ofi`) runs weft's own MPI
//! checks and NetPIPE's `NPopenmpi` over it. Skipped without libfabric's tools (or Open MPI's),
//! unless `WEFT_REQUIRE_TOOLS=1`.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

/// rank 0 serves on `port`; rank 1 waits (bounded) until the port listens, then connects.
fn wrapper(dir: &Path) -> PathBuf {
    let p = dir.join("pingpong.sh");
    std::fs::write(
        &p,
        r#"#!/bin/sh
port=$1; shift
if [ "$PMI_RANK" = 0 ]; then exec fi_pingpong -B "$port" "$@"; fi
i=0
until ss -Hltn "sport = :$port" | grep -q .; do
  i=$((i + 1)); [ $i -gt 3000 ] && { echo "the server never listened on $port" >&2; exit 9; }
  sleep 0.01
done
exec fi_pingpong -P "$port" "$@" 127.0.0.1
"#,
    )
    .unwrap();
    let _ = Command::new("chmod").arg("+x").arg(&p).status();
    p
}

#[test]
fn fi_info_lists_a_domain_per_weft_provider() {
    if !have("fi_info") {
        return skip("fi_info (Debian's libfabric-bin)");
    }
    let dir = fi_provider_dir("info");
    let o = run_bounded(
        Command::new("fi_info")
            .args(["-p", "weft"])
            .env("FI_PROVIDER_PATH", &dir),
        60,
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{out}{}", stderr(&o));
    for d in ["shm", "tcp-sim", "verbs-rc", "verbs-ud", "hybrid"] {
        assert!(out.contains(&format!("domain: {d}\n")), "{out}");
    }
    assert!(out.contains("type: FI_EP_RDM"), "{out}");
    // What weft cannot meet: a message endpoint.
    let o = run_bounded(
        Command::new("fi_info")
            .args(["-p", "weft", "-t", "FI_EP_MSG"])
            .env("FI_PROVIDER_PATH", &dir),
        60,
    );
    assert!(!o.status.success(), "{}", stdout(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fi_pingpong_runs_over_weft_with_its_data_checks() {
    if !have("fi_pingpong") || !have("ss") {
        return skip("fi_pingpong (Debian's libfabric-bin) and ss (iproute2)");
    }
    let dir = fi_provider_dir("pingpong");
    let pp = wrapper(&dir);
    // fi_pingpong's out-of-band socket: ports below Linux's ephemeral range (32768 up), so
    // that no outgoing connection of a test running beside this one holds the port; and a
    // port another process holds after all ("bind(): ... Address already in use", before
    // any exchange) is tried again with the next one. The run before this rule failed so.
    let mut port = 20_000 + (std::process::id() % 400) as u16 * 24;
    for domain in ["shm", "tcp-sim", "verbs-rc", "hybrid"] {
        for mode in ["msg", "tagged"] {
            for size in ["8", "65536", "1048576"] {
                let mut tries = 0;
                let o = loop {
                    port += 1;
                    tries += 1;
                    let o = run_bounded(
                        Command::new(weft())
                            .args(["run", "-n", "2", "--tag-output", "--"])
                            .arg(&pp)
                            .arg(port.to_string())
                            .args(["-p", "weft", "-e", "rdm", "-d", domain, "-m", mode])
                            .args(["-I", "20", "-S", size, "-c"])
                            .env("FI_PROVIDER_PATH", &dir)
                            .env("WEFT_VERBS_DEVICE", "soft"),
                        180,
                    );
                    let taken =
                        format!("{}{}", stdout(&o), stderr(&o)).contains("Address already in use");
                    if o.status.success() || !taken || tries == 5 {
                        break o;
                    }
                };
                let out = stdout(&o);
                let what = format!("{domain} {mode} {size} B");
                assert!(o.status.success(), "{what}: {out}{}", stderr(&o));
                // Both sides print the table; rank 0's row says 20 sent and 20 acknowledged.
                assert!(
                    out.lines()
                        .any(|l| l.starts_with("[0] ") && l.contains(" 20 ") && l.contains("=20")),
                    "{what}: {out}"
                );
                assert!(
                    !out.contains("error") && !out.contains("rror:"),
                    "{what}: {out}"
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `export/libfabric/tests/c/errors.c`, a libfabric program of weft's own, checks the error
/// paths a libfabric application meets: the two-step `fi_getname`, a name from another job,
/// an unknown `fi_addr`, truncation (`FI_ETRUNC` with `olen`), cancellation, calls on closed
/// objects.
#[test]
fn libfabric_error_paths_are_error_codes() {
    if !have("cc") || !Path::new("/usr/include/rdma/fi_tagged.h").exists() {
        return skip("a C compiler and libfabric's headers (libfabric-dev)");
    }
    let dir = fi_provider_dir("errors");
    let bin = fi_program(&dir, "errors");
    for domain in ["shm", "tcp-sim", "verbs-rc", "hybrid"] {
        let names = dir.join(format!("names-{domain}"));
        let o = run_bounded(
            Command::new(weft())
                .args(["run", "-n", "2", "--tag-output", "--"])
                .arg(&bin)
                .arg(&names)
                .env("FI_PROVIDER_PATH", &dir)
                .env("WEFT_VERBS_DEVICE", "soft")
                .env("DOMAIN", domain),
            120,
        );
        let out = stdout(&o);
        assert!(o.status.success(), "{domain}: {out}{}", stderr(&o));
        for r in 0..2 {
            assert!(
                out.contains(&format!("rank {r}: all checks passed")),
                "{domain}: {out}"
            );
        }
    }
    // A peer killed while the other waits for its message: an FI_EIO error entry, within the
    // provider's configured timeout (verbs-rc: 4 x 67 ms of silence here), never a hang.
    for domain in ["shm", "tcp-sim", "verbs-rc"] {
        let names = dir.join(format!("names-killed-{domain}"));
        let o = run_bounded(
            Command::new(weft())
                .args(["run", "--keep-going", "-n", "2", "--tag-output", "--"])
                .arg(&bin)
                .arg(&names)
                .env("FI_PROVIDER_PATH", &dir)
                .env("WEFT_VERBS_DEVICE", "soft")
                .env("WEFT_VERBS_RC_TIMEOUT", "14")
                .env("WEFT_VERBS_RC_RETRY", "3")
                .env("KILL_AT_END", "1")
                .env("DOMAIN", domain),
            120,
        );
        let out = stdout(&o);
        assert_eq!(o.status.code(), Some(137), "{domain}: {out}{}", stderr(&o));
        assert!(
            out.contains(
                "rank 0: ok: the receive the killed peer would have matched is an FI_EIO entry"
            ) && out.contains("rank 0: all checks passed"),
            "{domain}: {out}{}",
            stderr(&o)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `export/libfabric/tests/c/rma_checks.c`: weft-fi's `FI_RMA`, `FI_ATOMIC` and counters as a
/// libfabric program meets them — writes and reads of 8 B to 4 MiB both ways with data checks,
/// remote CQ data, inject, fetch-and-add from both ranks at once, compare-and-swap, min, atomic
/// read, the `*valid` queries, counters, and the error paths (unknown key, past a region's end
/// with the bytes after it untouched, no right, a closed region) — over every weft provider,
/// with provider keys and virtual addresses (Open MPI's `btl/ofi` asks for these) and with
/// requested keys and offsets. The program leaves its domain open, so libfabric closes weft-fi
/// from its exit handler (where hybrid's and verbs-ud's clock once panicked: thread-locals are
/// gone by then).
#[test]
fn rma_atomics_and_counters_over_weft_fi() {
    if !have("cc") || !Path::new("/usr/include/rdma/fi_atomic.h").exists() {
        return skip("a C compiler and libfabric's headers (libfabric-dev)");
    }
    let dir = fi_provider_dir("rma");
    let bin = fi_program(&dir, "rma_checks");
    let runs = ["shm", "limic", "tcp-sim", "verbs-rc", "verbs-ud", "hybrid"]
        .iter()
        .map(|d| (*d, "virt"))
        .chain([("shm", "offset"), ("tcp-sim", "offset")]);
    for (domain, mode) in runs {
        let names = dir.join(format!("names-{domain}-{mode}"));
        let o = run_bounded(
            Command::new(weft())
                .args(["run", "-n", "2", "--tag-output", "--"])
                .arg(&bin)
                .arg(&names)
                .env("FI_PROVIDER_PATH", &dir)
                .env("WEFT_VERBS_DEVICE", "soft")
                .env("MODE", mode)
                .env("DOMAIN", domain),
            180,
        );
        let (out, err) = (stdout(&o), stderr(&o));
        let what = format!("{domain} ({mode})");
        assert!(o.status.success(), "{what}: {out}{err}");
        for r in 0..2 {
            assert!(
                out.contains(&format!("rank {r}: all checks passed")),
                "{what}: {out}{err}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// An rsh agent for Open MPI that starts the daemon of host `$1` here, in a UTS namespace
/// named `$1`: `mpirun --hostfile` then sees two nodes on one machine (as weft's `--hosts`
/// pretends), so its one-sided component goes over the network for peers on the other one.
fn pretend_nodes(dir: &Path) -> Option<(PathBuf, PathBuf)> {
    let ok = Command::new("unshare")
        .args(["--uts", "true"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        return None;
    }
    let agent = dir.join("pretend-ssh");
    std::fs::write(
        &agent,
        r#"#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
host=$1; shift
exec unshare --uts sh -c "hostname $host && exec $*"
"#,
    )
    .unwrap();
    let _ = Command::new("chmod").arg("+x").arg(&agent).status();
    let hosts = dir.join("hosts");
    std::fs::write(&hosts, "nodea slots=4\nnodeb slots=4\n").unwrap();
    Some((agent, hosts))
}

/// What weft-fi says it carried at the end of a rank (`WEFT_FI_STATS=1`): RMA and atomic
/// operations issued and served, summed over the ranks.
fn rma_carried(out: &str) -> (u64, u64) {
    let mut t = (0, 0);
    for l in out
        .lines()
        .filter(|l| l.contains("RMA and atomic operations issued"))
    {
        let n: Vec<u64> = l
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|w| w.parse().ok())
            .collect();
        // rank, size, messages sent, received, issued, served.
        if n.len() >= 6 {
            t.0 += n[n.len() - 2];
            t.1 += n[n.len() - 1];
        }
    }
    t
}

/// Open MPI's one-sided MPI over weft-fi: `osc/rdma` over `btl/ofi`, which asks weft-fi for
/// `FI_RMA | FI_ATOMIC` with provider keys and virtual addresses.
/// `export/libfabric/tests/c/mpi_rma.c` (puts and gets of 8 B–4 MiB with data checks under
/// fence, accumulate, fetch-and-op, compare-and-swap, exclusive locks, PSCW, get-accumulate,
/// on allocated and created windows) at 4 ranks on two pretend nodes over tcp-sim, verbs-rc
/// and hybrid, where `osc/rdma` sends every access to the other node through weft, and at 2
/// ranks on one node over shm (where it maps allocated windows itself: created windows go
/// through weft). Without `btl/ofi` the same program cannot open a window (`osc/rdma` finds
/// no transport), so the counts weft-fi reports are the one-sided traffic.
#[test]
fn open_mpi_one_sided_runs_over_weft_fi() {
    if !have("mpicc.openmpi") || !have("mpirun.openmpi") {
        return skip("Open MPI's mpicc and mpirun (Debian's libopenmpi-dev, openmpi-bin)");
    }
    let dir = fi_provider_dir("ompi-rma");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../export/libfabric/tests/c/mpi_rma.c");
    let bin = dir.join("mpi_rma");
    let o = run_bounded(
        Command::new("mpicc.openmpi")
            .args(["-O1", "-Wall", "-Werror", "-o"])
            .arg(&bin)
            .arg(&src),
        120,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let one_sided = |c: &mut Command| {
        c.args(["--mca", "osc", "rdma", "--mca", "osc_rdma_btls", "ofi"])
            .args(["--mca", "btl_ofi_provider_include", "weft"])
            .args(["-x", "WEFT_FI_STATS=1"]);
    };
    let check = |o: std::process::Output, what: &str, n: u32| {
        let (out, err) = (stdout(&o), stderr(&o));
        assert!(o.status.success(), "{what}: {out}{err}");
        assert!(
            out.contains(&format!("rma passed at {n} ranks")),
            "{what}: {out}{err}"
        );
        let (issued, served) = rma_carried(&err);
        assert!(
            issued > 0 && issued == served,
            "{what}: weft-fi carried {issued} issued / {served} served: {err}"
        );
        issued
    };
    let mut c = ompi_btl(&dir, 2, "shm", "self,ofi");
    one_sided(&mut c);
    let o = run_bounded(c.arg(&bin), 300);
    check(o, "shm on one node", 2);
    let Some((agent, hosts)) = pretend_nodes(&dir) else {
        return skip("unshare --uts (root), for Open MPI on two pretend nodes");
    };
    for domain in ["tcp-sim", "verbs-rc", "hybrid"] {
        let mut c = ompi_btl(&dir, 4, domain, "self,ofi");
        c.args(["--hostfile"])
            .arg(&hosts)
            .args(["--map-by", "node", "--mca", "plm_rsh_agent"])
            .arg(&agent);
        one_sided(&mut c);
        let o = run_bounded(c.arg(&bin), 300);
        let issued = check(o, &format!("{domain} on two nodes"), 4);
        // Locks, counters and accumulates cross the nodes as atomics: thousands of them.
        assert!(issued > 1000, "{domain}: only {issued} RMA operations");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `mpirun` of Open MPI with its `cm` PML over `mtl/ofi`, restricted to libfabric's `weft`
/// provider and the weft provider `domain`.
fn ompi(dir: &Path, n: u32, domain: &str) -> Command {
    ompi_btl(dir, n, domain, "self")
}

/// The same with the BTLs `btl` (`btl/ofi` is Open MPI's one-sided transport over libfabric).
fn ompi_btl(dir: &Path, n: u32, domain: &str, btl: &str) -> Command {
    let mut c = Command::new("mpirun.openmpi");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &n.to_string(),
    ])
    .args([
        "--mca", "pml", "cm", "--mca", "mtl", "ofi", "--mca", "btl", btl,
    ])
    // Only libfabric's weft provider, and say which domain the MTL took.
    .args(["--mca", "mtl_ofi_provider_include", "weft"])
    .args(["--mca", "mtl_base_verbose", "10"])
    .args(["-x", "FI_PROVIDER=weft", "-x"])
    .arg(format!("FI_PROVIDER_PATH={}", dir.display()))
    .args(["-x", &format!("WEFT_PROVIDER={domain}")])
    .args(["-x", "WEFT_VERBS_DEVICE=soft"]);
    c.env_remove("WEFT_PROVIDER");
    c
}

/// The MTL's own words that it runs over weft's `domain` (not over a fallback).
fn ran_over_weft(out: &str, domain: &str) -> bool {
    out.contains(&format!("mtl:ofi:provider: {domain}"))
        && out.contains("select: component ofi selected")
}

/// Open MPI over weft-fi: `export/libfabric/tests/c/mpi_checks.c` (ping-pong 0 B–4 MiB with
/// data checks, wildcards, non-overtaking order, Probe/Iprobe/Mprobe, cancel, truncation as
/// `MPI_ERR_TRUNCATE`, Ssend, barrier/bcast/allreduce/alltoall) at 2 and 8 ranks over shm,
/// tcp-sim, verbs-rc and hybrid, in each of the MTL's three tag layouts.
#[test]
fn open_mpi_runs_over_weft_fi() {
    if !have("mpicc.openmpi") || !have("mpirun.openmpi") {
        return skip("Open MPI's mpicc and mpirun (Debian's libopenmpi-dev, openmpi-bin)");
    }
    let dir = fi_provider_dir("ompi");
    let src =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../export/libfabric/tests/c/mpi_checks.c");
    let bin = dir.join("mpi_checks");
    let o = run_bounded(
        Command::new("mpicc.openmpi")
            .args(["-O1", "-Wall", "-Werror", "-o"])
            .arg(&bin)
            .arg(&src),
        120,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    for domain in ["shm", "tcp-sim", "verbs-rc", "hybrid"] {
        for n in [2, 8] {
            let o = run_bounded(ompi(&dir, n, domain).arg(&bin), 300);
            let (out, err) = (stdout(&o), stderr(&o));
            let what = format!("{domain} at {n} ranks");
            assert!(o.status.success(), "{what}: {out}{err}");
            assert!(
                ran_over_weft(&format!("{out}{err}"), domain),
                "{what}: {out}{err}"
            );
            assert!(
                out.contains(&format!("all passed at {n} ranks")),
                "{what}: {out}{err}"
            );
        }
    }
    // The MTL's other tag layouts: the source rank in the tag (matched under partial ignore
    // masks) instead of in the remote CQ data (the default, `ofi_tag_full`, above).
    for mode in ["ofi_tag_1", "ofi_tag_2"] {
        let o = run_bounded(
            ompi(&dir, 4, "shm")
                .args(["--mca", "mtl_ofi_tag_mode", mode])
                .arg(&bin),
            300,
        );
        let (out, err) = (stdout(&o), stderr(&o));
        assert!(o.status.success(), "{mode}: {out}{err}");
        assert!(out.contains("all passed at 4 ranks"), "{mode}: {out}{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// NetPIPE's `NPopenmpi` (Debian's netpipe-openmpi), unmodified, to completion (1 B to 8 MiB)
/// over Open MPI over weft-fi on shm.
#[test]
fn netpipe_runs_over_open_mpi_over_weft_fi() {
    if !have("NPopenmpi") || !have("mpirun.openmpi") {
        return skip("NetPIPE's NPopenmpi (Debian's netpipe-openmpi) and Open MPI's mpirun");
    }
    let dir = fi_provider_dir("netpipe");
    let table = dir.join("np.out");
    let o = run_bounded(
        ompi(&dir, 2, "shm").args(["NPopenmpi", "-o"]).arg(&table),
        600,
    );
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(o.status.success(), "{out}{err}");
    assert!(ran_over_weft(&format!("{out}{err}"), "shm"), "{out}{err}");
    // The table's last row is 8 MiB + 3 bytes, with a positive rate.
    let rows = std::fs::read_to_string(&table).unwrap();
    let last: Vec<f64> = rows
        .lines()
        .last()
        .unwrap_or("")
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
    assert!(
        last.len() == 3 && last[0] == 8388611.0 && last[1] > 0.0,
        "{rows}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// mpi4py's tests that fail over Open MPI 4.1's `mtl/ofi` or `btl/ofi` whatever libfabric
/// provider is under them — over libfabric's own `tcp` (two-sided) or `sockets` (one-sided)
/// provider they crash, hang or fail the same way: they are Open MPI's, not weft's, and are
/// left out of both runs below (186 of the suite's 1,358 tests at 2 ranks).
const MPI4PY_DESELECT: &[(&str, &str)] = &[
    (
        r"testAlltoallwBottom",
        "MPI_BOTTOM with absolute-address datatypes: 4.1's MTL hands the provider the buffer \
         without the datatype's offset (a NULL base: weft-fi refuses it with -FI_EINVAL, tcp \
         crashes); Open MPI fixed it in 5.0 (17b09d9, \"mtl: Fix datatype offsetting\")",
    ),
    (
        r"^test_p2p_obj\.|^test_util_pkl5\.",
        "pickled-object point-to-point: the MTL's cancel of a send crashes, its synchronous \
         sends to the process itself never complete, statuses of probed messages carry wrong \
         counts (tcp: the same crash, hangs and failures)",
    ),
    (
        r"test_rma(_nb)?\..*\.(testAccumulate|testGetAccumulate|testFetchAndOp|testCompareAndSwap)$",
        "btl/ofi aborts on atomic operations other than add and swap (\"Unknown or unsupported \
         atomic op\", though osc/rdma asks for them) and crashes in a 1-byte compare-and-swap \
         (sockets: the same)",
    ),
];

/// Where tools/deps.sh unpacked mpi4py's own test suite (its sdist's test/ directory), for
/// Debian's python3-mpi4py.
fn mpi4py_suite() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target");
    std::fs::read_dir(&root)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("test"))
        .find(|p| {
            p.join("runtests.py").exists()
                && p.parent()
                    .and_then(|d| d.file_name())
                    .is_some_and(|n| n.to_string_lossy().starts_with("mpi4py-"))
        })
}

/// unittest's verdict of each rank, from the per-rank files of `mpirun --output-filename
/// DIR` (DIR/1/rank.N/stderr): tests run, failures + errors, skipped.
fn unittest_verdicts(dir: &Path) -> Vec<(u64, u64, u64)> {
    let num = |s: &str, key: &str| -> u64 {
        s.split(key)
            .nth(1)
            .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let mut out = Vec::new();
    for rank in 0.. {
        let Ok(err) = std::fs::read_to_string(dir.join(format!("1/rank.{rank}/stderr"))) else {
            break;
        };
        let ran = err
            .lines()
            .find_map(|l| l.strip_prefix("Ran "))
            .and_then(|r| r.split(' ').next()?.parse().ok());
        let verdict = err
            .lines()
            .find(|l| *l == "OK" || l.starts_with("OK (") || l.starts_with("FAILED ("));
        if let (Some(ran), Some(v)) = (ran, verdict) {
            out.push((
                ran,
                num(v, "failures=") + num(v, "errors="),
                num(v, "skipped="),
            ));
        }
    }
    out
}

/// mpi4py's own test suite (the unmodified test/ of the sdist of Debian's python3-mpi4py,
/// run by its own runner through `export/libfabric/tests/mpi4py_suite.py`, which only leaves
/// out [`MPI4PY_DESELECT`]) at 2 ranks over Open MPI's own transports (ob1, vader) and over
/// weft-fi's shm domain (cm + mtl/ofi, and btl/ofi + osc/rdma for one-sided): every test
/// passes over weft, and weft runs every test the other run does (it skips fewer: Open MPI's
/// own run has no working one-sided component here and skips the RMA tests, which pass over
/// weft); each run's counts go to stderr. Spawn tests are left out of both (Open MPI's btl
/// self,vader cannot reach spawned processes either).
#[test]
fn mpi4py_suite_runs_over_open_mpi_over_weft_fi() {
    if !have("mpirun.openmpi") || !Path::new("/usr/bin/python3").exists() {
        return skip("Open MPI's mpirun and Debian's python3");
    }
    let Some(suite) = mpi4py_suite() else {
        return skip("mpi4py's test suite (tools/deps.sh fetches it with python3-mpi4py)");
    };
    let dir = fi_provider_dir("mpi4py");
    let runner =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../export/libfabric/tests/mpi4py_suite.py");
    let deselect: Vec<&str> = MPI4PY_DESELECT.iter().map(|(p, _)| *p).collect();
    let deselect = deselect.join("|");
    let python = |c: &mut Command, out: &Path| {
        let _ = std::fs::remove_dir_all(out);
        c.arg("--output-filename")
            .arg(out)
            .args(["-x", "MPI4PY_DESELECT", "/usr/bin/python3"])
            .arg(&runner)
            .arg(&suite)
            .args(["--no-builddir", "--no-threads", "-e", "spawn|dynproc"])
            .env("MPI4PY_DESELECT", &deselect);
    };
    let mut own = Command::new("mpirun.openmpi");
    own.args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .args(["--mca", "pml", "ob1", "--mca", "btl", "self,vader"]);
    python(&mut own, &dir.join("own"));
    let o = run_bounded(&mut own, 600);
    let base = unittest_verdicts(&dir.join("own"));
    assert!(
        o.status.success() && base.len() == 2,
        "Open MPI's own: {}",
        stderr(&o)
    );
    let mut c = ompi_btl(&dir, 2, "shm", "self,ofi");
    c.args(["--mca", "osc", "rdma", "--mca", "osc_rdma_btls", "ofi"])
        .args(["--mca", "btl_ofi_provider_include", "weft"]);
    python(&mut c, &dir.join("weft"));
    let o = run_bounded(&mut c, 900);
    let over = unittest_verdicts(&dir.join("weft"));
    let err: String = (0..2)
        .map(|r| {
            std::fs::read_to_string(dir.join(format!("weft/1/rank.{r}/stderr"))).unwrap_or_default()
        })
        .collect();
    let out = format!("{}{}", stdout(&o), stderr(&o));
    eprintln!("mpi4py's suite, per rank (ran, failed, skipped): Open MPI's own {base:?}, over weft-fi {over:?}");
    assert!(
        o.status.success() && over.len() == 2,
        "over weft-fi: {out}{err}"
    );
    assert!(ran_over_weft(&format!("{out}{err}"), "shm"), "{out}{err}");
    for (w, b) in over.iter().zip(&base) {
        assert_eq!(w.1, 0, "failures over weft-fi: {err}");
        assert_eq!(w.0, b.0, "the same tests ran: {over:?} / {base:?}");
        assert!(w.2 <= b.2, "weft-fi skipped more: {over:?} / {base:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
