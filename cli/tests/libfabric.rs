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

/// Build weft-fi with the tests' profile and install it as libfabric names providers.
fn provider_dir(test: &str) -> PathBuf {
    let dir = profile_dir();
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "--quiet", "-p", "weft-fi"]);
    if dir.file_name().is_some_and(|f| f == "release") {
        cmd.arg("--release");
    }
    let o = run_bounded(&mut cmd, 900);
    assert!(o.status.success(), "building weft-fi: {}", stderr(&o));
    let out = std::env::temp_dir().join(format!("weft-fi-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    std::fs::copy(dir.join("libweft_fi.so"), out.join("libweft-fi.so")).expect("install");
    out
}

fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

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
    let dir = provider_dir("info");
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
    let dir = provider_dir("pingpong");
    let pp = wrapper(&dir);
    let mut port = 47000 + (std::process::id() % 1000) as u16 * 16;
    for domain in ["shm", "tcp-sim", "verbs-rc", "hybrid"] {
        for mode in ["msg", "tagged"] {
            for size in ["8", "65536", "1048576"] {
                port += 1;
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
    let dir = provider_dir("errors");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../export/libfabric/tests/c/errors.c");
    let bin = dir.join("errors");
    let o = run_bounded(
        Command::new("cc")
            .args(["-O1", "-Wall", "-Werror", "-o"])
            .arg(&bin)
            .arg(&src)
            .arg("-lfabric"),
        120,
    );
    assert!(o.status.success(), "{}", stderr(&o));
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

/// `mpirun` of Open MPI with its `cm` PML over `mtl/ofi`, restricted to libfabric's `weft`
/// provider and the weft provider `domain`.
fn ompi(dir: &Path, n: u32, domain: &str) -> Command {
    let mut c = Command::new("mpirun.openmpi");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &n.to_string(),
    ])
    .args([
        "--mca", "pml", "cm", "--mca", "mtl", "ofi", "--mca", "btl", "self",
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
    let dir = provider_dir("ompi");
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
    let dir = provider_dir("netpipe");
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
