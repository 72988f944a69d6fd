//! Launch by a PMIx server: Open MPI's `mpirun` (Debian's Open MPI 4.1, which serves PMIx
//! through the system's libpmix). The ring over every provider that spans processes, the
//! conformance suite, and a killed rank.

mod common;
use common::*;
use std::path::PathBuf;
use std::process::Command;

/// Open MPI's `mpirun`, if installed (tests never install software: `tools/deps.sh` does; a
/// missing tool skips, or fails under `WEFT_REQUIRE_TOOLS=1`, as in CI).
fn mpirun() -> Option<Command> {
    let found = ["/usr/bin/mpirun.openmpi", "/usr/local/bin/mpirun.openmpi"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists());
    let Some(path) = found else {
        skip("mpirun.openmpi is missing (Debian's openmpi-bin; tools/deps.sh installs it)");
        return None;
    };
    let mut c = Command::new(path);
    // Two cores here: more ranks than slots; CI runs as root.
    c.args(["--oversubscribe", "--allow-run-as-root"])
        .args(["--mca", "btl", "self,tcp"])
        .env_remove("WEFT_PROVIDER")
        .env_remove("WEFT_PMI")
        .env_remove("PMI_FD")
        .env_remove("PMI_PORT");
    Some(c)
}

#[test]
fn mpirun_runs_ring_over_every_process_provider() {
    let ring = example("weft-cli", "ring");
    for p in ["shm", "limic", "tcp-sim", "verbs-rc", "verbs-ud"] {
        let Some(mut c) = mpirun() else { return };
        let o = run_bounded(
            c.args(["-n", "4", "-x", &format!("WEFT_PROVIDER={p}")])
                .args(["-x", "WEFT_VERBS_DEVICE=soft"])
                .arg(&ring),
            180,
        );
        assert!(o.status.success(), "{p}: {}\n{}", stdout(&o), stderr(&o));
        assert!(
            stdout(&o).contains(&format!("ring: ok over 4 ranks on 1 host(s), provider {p}")),
            "{}",
            stdout(&o)
        );
    }
    assert!(
        shm_leftovers().is_empty(),
        "left in /dev/shm: {:?}",
        shm_leftovers()
    );
}

#[test]
fn mpirun_runs_the_conformance_suite() {
    let Some(mut c) = mpirun() else { return };
    let o = run_bounded(c.args(["-n", "4"]).arg(weft()).arg("test-rank"), 300);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("PROVIDER shm"), "{out}");
    assert_eq!(out.matches("CHECK pass").count(), 16, "{out}");
    assert!(!out.contains("CHECK fail"), "{out}");
}

#[test]
fn a_rank_killed_under_mpirun_ends_the_job_and_says_which() {
    let ring = example("weft-cli", "ring");
    let Some(mut c) = mpirun() else { return };
    let mark = marker("pmix-kill");
    let t0 = std::time::Instant::now();
    let o = run_bounded(
        c.args(["-n", "4", "-x", "RING_KILL_RANK=2"])
            .args(["-x", &format!("WEFT_TEST_MARK={mark}")])
            .arg(&ring),
        120,
    );
    assert!(!o.status.success());
    let all = format!("{}{}", stdout(&o), stderr(&o));
    assert!(all.contains("rank 2") && all.contains("signal 9"), "{all}");
    assert!(t0.elapsed().as_secs() < 60);
    assert_eq!(survivors(&mark), Vec::<u32>::new(), "ranks survived");
}

#[test]
fn weft_info_names_the_pmix_bootstrap_under_mpirun() {
    let Some(mut c) = mpirun() else { return };
    let o = run_bounded(c.args(["-n", "1"]).arg(weft()).arg("info"), 60);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("bootstrap (WEFT_PMI): PMIx"),
        "{}",
        stdout(&o)
    );
}
