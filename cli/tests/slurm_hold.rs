//! The test harness leaves no daemon running (issue 66): the single-node Slurm cluster the
//! launch tests use (`tools/slurm.sh hold`) stops when its holder goes away — its standard
//! input closed, a SIGINT, or the process that held it killed with SIGKILL — and a cluster
//! someone started by hand (`tools/slurm.sh up`) is left as it was.

mod common;
use common::*;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The pid in a daemon's pid file, if that process runs (zombies do not count).
fn running(pidfile: &Path) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(pidfile).ok()?.trim().parse().ok()?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    (!stat.contains(") Z ")).then_some(pid)
}

/// The daemons of the cluster whose configuration is `conf`, and munged if the script
/// started it (only then is it the script's to stop).
fn daemons(conf: &Path) -> Vec<(String, i32)> {
    let dir = conf.parent().expect("configuration has a directory");
    let mut v = vec![];
    for d in ["slurmctld", "slurmd"] {
        if let Some(pid) = running(&dir.join(format!("{d}.pid"))) {
            v.push((d.to_string(), pid));
        }
    }
    if dir.join("munged.ours").exists() {
        if let Some(pid) = running(Path::new("/run/munge/munged.pid")) {
            v.push(("munged".to_string(), pid));
        }
    }
    v
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

fn wait_bounded(child: &mut Child, secs: u64, what: &str) {
    let t0 = Instant::now();
    loop {
        if child.try_wait().expect("waiting for the holder").is_some() {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(secs),
            "the holder did not stop within {secs} s after {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A cluster started with `tools/slurm.sh up` belongs to whoever started it: a holder that
/// found it running leaves it up. False if there is no cluster (skipped).
fn a_cluster_started_by_hand_outlives_a_holder() -> bool {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/slurm.sh");
    let o = run_bounded(Command::new("bash").arg(&script).arg("up"), 400);
    if !o.status.success() {
        skip(&format!(
            "no single-node Slurm cluster: {}",
            stderr(&o).trim()
        ));
        return false;
    }
    let conf = std::path::PathBuf::from(stdout(&o).trim());
    let before = daemons(&conf);
    let mut held = slurm_hold(Stdio::piped()).expect("hold a running cluster");
    assert_eq!(held.1, conf);
    drop(held.0.stdin.take());
    wait_bounded(&mut held.0, 120, "its stdin closed");
    let after = daemons(&conf);
    let o = run_bounded(Command::new("bash").arg(&script).arg("down"), 120);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        before, after,
        "the holder stopped a cluster it did not start"
    );
    let left: Vec<_> = before.iter().filter(|(_, pid)| alive(*pid)).collect();
    assert!(left.is_empty(), "tools/slurm.sh down left {left:?}");
    true
}

#[test]
fn a_held_cluster_stops_with_its_holder_however_the_holder_ends() {
    // One test function: the cases share the one cluster these ports allow.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip("tools/slurm.sh needs root");
        return;
    }
    if !a_cluster_started_by_hand_outlives_a_holder() {
        return;
    }
    for how in [
        "its stdin closed",
        "SIGINT",
        "its owner killed with SIGKILL",
    ] {
        // The owner of the pipe: this test, or a process killed with SIGKILL in the last case.
        let mut owner: Option<Child> = None;
        let stdin = if how == "its owner killed with SIGKILL" {
            let mut o = Command::new("sleep")
                .arg("3600")
                .stdout(Stdio::piped())
                .spawn()
                .expect("sleep");
            let s = Stdio::from(o.stdout.take().expect("piped"));
            owner = Some(o);
            s
        } else {
            Stdio::piped()
        };
        let mut held = match slurm_hold(stdin) {
            Ok(h) => h,
            Err(why) => {
                skip(&format!("no single-node Slurm cluster: {why}"));
                return;
            }
        };
        let conf = held.1.clone();
        let before = daemons(&conf);
        assert!(
            before.iter().any(|(d, _)| d == "slurmctld")
                && before.iter().any(|(d, _)| d == "slurmd"),
            "{before:?}"
        );
        match how {
            "its stdin closed" => drop(held.0.stdin.take()),
            "SIGINT" => {
                // SAFETY: signalling the child this test started.
                unsafe { libc::kill(held.0.id() as i32, libc::SIGINT) };
            }
            _ => {
                let mut o = owner.take().expect("owner");
                o.kill().expect("SIGKILL the owner");
                let _ = o.wait();
            }
        }
        wait_bounded(&mut held.0, 120, how);
        let left: Vec<_> = before.iter().filter(|(_, pid)| alive(*pid)).collect();
        assert!(left.is_empty(), "after {how}, still running: {left:?}");
    }
}
