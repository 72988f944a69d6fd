//! Launch by Slurm: `srun --mpi=pmix` on a single-node cluster (Debian's slurmctld, slurmd and
//! munge, configured and started by `tools/slurm.sh`, which needs root). The ring over every
//! provider that spans processes, the conformance suite, a killed rank, and a plain `srun`
//! (no PMI plugin), under which weft refuses to run each process as a job of its own; and
//! `srun --mpi=pmi2`, whose server also speaks PMI-1.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};

/// The cluster's configuration file, once `tools/slurm.sh hold` has the node taking jobs; the
/// error says why not (not root, packages missing, a daemon that did not start). The holder
/// lives in a static, never dropped: the daemons it started stop when this test binary exits,
/// on success, failure or interrupt (cli/tests/slurm_hold.rs checks that).
fn cluster() -> &'static Result<PathBuf, String> {
    static HOLDER: OnceLock<Mutex<Option<Child>>> = OnceLock::new();
    static UP: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    UP.get_or_init(|| {
        let (child, conf) = slurm_hold(Stdio::piped())?;
        let _ = HOLDER.set(Mutex::new(Some(child)));
        Ok(conf)
    })
}

/// `srun` bound to the test cluster, or None (skipped; fails under `WEFT_REQUIRE_TOOLS=1`).
fn srun() -> Option<Command> {
    let conf = match cluster() {
        Ok(c) => c,
        Err(why) => {
            skip(&format!("no single-node Slurm cluster: {why}"));
            return None;
        }
    };
    let mut c = Command::new("srun");
    c.env("SLURM_CONF", conf)
        // Bounded by Slurm as well as by run_bounded: a step that hangs is killed after 3 min.
        .args(["--time=3", "--quiet"])
        .env_remove("WEFT_PROVIDER")
        .env_remove("WEFT_PMI")
        .env_remove("PMI_FD")
        .env_remove("PMI_PORT");
    Some(c)
}

#[test]
fn srun_pmix_runs_ring_over_every_process_provider() {
    let ring = example("weft-cli", "ring");
    for p in ["shm", "limic", "tcp-sim", "verbs-rc", "verbs-ud"] {
        let Some(mut c) = srun() else { return };
        let o = run_bounded(
            c.args(["--mpi=pmix", "-n", "4"])
                .env("WEFT_PROVIDER", p)
                .env("WEFT_VERBS_DEVICE", "soft")
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
fn srun_pmix_runs_the_conformance_suite() {
    let Some(mut c) = srun() else { return };
    let o = run_bounded(
        c.args(["--mpi=pmix", "-n", "4"])
            .arg(weft())
            .arg("test-rank"),
        300,
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("PROVIDER shm"), "{out}");
    assert_eq!(out.matches("CHECK pass").count(), 16, "{out}");
    assert!(!out.contains("CHECK fail"), "{out}");
}

#[test]
fn a_rank_killed_under_srun_ends_the_job_and_says_which() {
    let ring = example("weft-cli", "ring");
    let Some(mut c) = srun() else { return };
    let mark = marker("slurm-kill");
    let t0 = std::time::Instant::now();
    let o = run_bounded(
        c.args(["--mpi=pmix", "-n", "4"])
            .env("RING_KILL_RANK", "2")
            .env("WEFT_TEST_MARK", &mark)
            .arg(&ring),
        120,
    );
    assert!(!o.status.success());
    let all = format!("{}{}", stdout(&o), stderr(&o));
    // Slurm names the killed task; the survivors name the rank they lost.
    assert!(all.contains("task 2: Killed"), "{all}");
    assert!(all.contains("peer failed: rank 2"), "{all}");
    assert!(t0.elapsed().as_secs() < 60);
    assert_eq!(survivors(&mark), Vec::<u32>::new(), "ranks survived");
}

#[test]
fn plain_srun_is_refused_rather_than_run_as_separate_jobs() {
    let ring = example("weft-cli", "ring");
    let Some(mut c) = srun() else { return };
    let o = run_bounded(c.args(["--mpi=none", "-n", "2"]).arg(&ring), 60);
    assert!(!o.status.success(), "{}", stdout(&o));
    assert!(!stdout(&o).contains("ok over 1 ranks"), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("started by Slurm's srun") && stderr(&o).contains("srun --mpi=pmix"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn weft_info_names_the_pmix_bootstrap_under_srun() {
    let Some(mut c) = srun() else { return };
    let o = run_bounded(
        c.args(["--mpi=pmix", "-n", "1"]).arg(weft()).arg("info"),
        60,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("bootstrap (WEFT_PMI): PMIx"),
        "{}",
        stdout(&o)
    );
}

/// Slurm's `pmi2` plugin also answers the PMI-1 wire protocol on `PMI_FD`, so weft runs under
/// `srun --mpi=pmi2` through its PMI-1 client (lazy key-value reads after open included:
/// verbs-ud reads a peer's address on first contact).
#[test]
fn srun_pmi2_runs_the_ring_through_pmi1() {
    let ring = example("weft-cli", "ring");
    for p in ["shm", "verbs-ud"] {
        let Some(mut c) = srun() else { return };
        let o = run_bounded(
            c.args(["--mpi=pmi2", "-n", "4"])
                .env("WEFT_PROVIDER", p)
                .env("WEFT_VERBS_DEVICE", "soft")
                .arg(&ring),
            120,
        );
        assert!(o.status.success(), "{p}: {}\n{}", stdout(&o), stderr(&o));
        assert!(
            stdout(&o).contains(&format!("ring: ok over 4 ranks on 1 host(s), provider {p}")),
            "{}",
            stdout(&o)
        );
    }
    let Some(mut c) = srun() else { return };
    let o = run_bounded(
        c.args(["--mpi=pmi2", "-n", "1"]).arg(weft()).arg("info"),
        60,
    );
    assert!(
        stdout(&o).contains("bootstrap (WEFT_PMI): PMI-1"),
        "{}",
        stdout(&o)
    );
}

/// weft-fi under Slurm: a libfabric program (`export/libfabric/tests/c/rma_checks.c`:
/// messages, RMA, atomics and counters with their checks) started by `srun --mpi=pmix`, whose
/// weft-fi joins the job through weft's PMIx client, over shm and tcp-sim.
#[test]
fn srun_pmix_runs_a_libfabric_program_over_weft_fi() {
    if !have("cc") || !Path::new("/usr/include/rdma/fi_atomic.h").exists() {
        return skip("a C compiler and libfabric's headers (libfabric-dev)");
    }
    if srun().is_none() {
        return;
    }
    let dir = fi_provider_dir("srun");
    let bin = fi_program(&dir, "rma_checks");
    for domain in ["shm", "tcp-sim"] {
        let Some(mut c) = srun() else { return };
        let o = run_bounded(
            c.args(["--mpi=pmix", "-n", "2"])
                .env("FI_PROVIDER_PATH", &dir)
                .env("DOMAIN", domain)
                .arg(&bin)
                .arg(dir.join(format!("names-{domain}"))),
            180,
        );
        let (out, err) = (stdout(&o), stderr(&o));
        assert!(o.status.success(), "{domain}: {out}{err}");
        for r in 0..2 {
            assert!(
                out.contains(&format!("rank {r}: all checks passed")),
                "{domain}: {out}{err}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
