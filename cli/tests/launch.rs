//! `weft run`: the embedded PMI-1 launcher, with the `ring` example over every built-in
//! provider that spans processes, and the failure paths.

mod common;
use common::*;
use std::process::Command;

/// Built-in providers whose ranks may be separate processes.
const PROCESS_PROVIDERS: &[&str] = &["shm", "limic", "tcp-sim", "verbs-rc", "verbs-ud", "hybrid"];

fn weft_run(args: &[&str]) -> Command {
    let mut c = Command::new(weft());
    c.arg("run").args(args);
    c.env_remove("WEFT_PROVIDER");
    // verbs-rc on the soft HCA, noticing a dead peer after 4 x 67 ms of silence (not the
    // default 8 x 4.3 s); verbs-ud after 1 s (not 30), probing idle peers every 0.2 s.
    c.env("WEFT_VERBS_DEVICE", "soft")
        .env("WEFT_VERBS_RC_TIMEOUT", "14")
        .env("WEFT_VERBS_RC_RETRY", "3")
        .env("WEFT_VERBS_UD_TIMEOUT", "1")
        .env("WEFT_VERBS_UD_KEEPALIVE", "0.2");
    c
}

#[test]
fn ring_over_every_process_provider() {
    let ring = example("weft-cli", "ring");
    for p in PROCESS_PROVIDERS {
        for pmi_port in [false, true] {
            let mut c = weft_run(&["-n", "4", "--provider", p]);
            if pmi_port {
                c.arg("--pmi-port");
            }
            let o = run_bounded(c.arg("--").arg(&ring), 120);
            assert!(o.status.success(), "{p}: {}\n{}", stdout(&o), stderr(&o));
            assert!(
                stdout(&o).contains(&format!("ring: ok over 4 ranks on 1 host(s), provider {p}")),
                "{}",
                stdout(&o)
            );
        }
    }
    assert!(
        shm_leftovers().is_empty(),
        "left in /dev/shm: {:?}",
        shm_leftovers()
    );
}

#[test]
fn ring_alone_is_a_world_of_one() {
    let ring = example("weft-cli", "ring");
    let o = run_bounded(
        Command::new(&ring)
            .env_remove("PMI_FD")
            .env_remove("PMI_PORT"),
        60,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("ring: ok over 1 ranks"),
        "{}",
        stdout(&o)
    );
}

/// Started by a launcher weft cannot join (the variables an Open MPI without PMIx, Slurm's srun
/// without PMI and MVAPICH's mpirun_rsh set for a job of two): each process must fail and say
/// why, not run as a job of one and report success, as it did before. And a PMIx namespace
/// without a server behind it fails at once, saying so.
#[test]
fn ring_under_a_launcher_it_cannot_join_refuses_to_run_alone() {
    let ring = example("weft-cli", "ring");
    let jobs: [&[(&str, &str)]; 3] = [
        &[("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_RANK", "0")],
        &[("SLURM_STEP_NUM_TASKS", "2"), ("SLURM_PROCID", "1")],
        &[("MV2_COMM_WORLD_SIZE", "2"), ("MV2_COMM_WORLD_RANK", "1")],
    ];
    for env in jobs {
        let mut c = Command::new(&ring);
        c.env_remove("PMI_FD")
            .env_remove("PMI_PORT")
            .env_remove("WEFT_PMI");
        c.envs(env.iter().copied());
        let o = run_bounded(&mut c, 60);
        assert!(!o.status.success(), "{env:?}: {}", stdout(&o));
        assert!(!stdout(&o).contains("ring: ok"), "{}", stdout(&o));
        let e = stderr(&o);
        assert!(
            e.contains(env[0].0) && e.contains("weft run") && e.contains("WEFT_PMI=singleton"),
            "{env:?}: {e}"
        );
        // On purpose: alone.
        let o = run_bounded(c.env("WEFT_PMI", "singleton"), 60);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(
            stdout(&o).contains("ring: ok over 1 ranks"),
            "{}",
            stdout(&o)
        );
    }
    let o = run_bounded(
        Command::new(&ring)
            .env_remove("PMI_FD")
            .env_remove("PMI_PORT")
            .env_remove("WEFT_PMI")
            .env("PMIX_NAMESPACE", "nobody-serves-this")
            .env("PMIX_RANK", "0"),
        60,
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("PMIX_NAMESPACE=nobody-serves-this"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn tag_output_prefixes_ranks() {
    let ring = example("weft-cli", "ring");
    let o = run_bounded(weft_run(&["-n", "3", "--tag-output", "--"]).arg(&ring), 60);
    assert!(o.status.success());
    let out = stdout(&o);
    for r in 0..3 {
        assert!(
            out.contains(&format!("[{r}] ring: rank {r} on host 0 ok=true")),
            "{out}"
        );
    }
    assert!(out.lines().all(|l| l.starts_with('[')), "{out}");
}

#[test]
fn env_reaches_ranks_and_exit_status_is_worst() {
    let o = run_bounded(
        weft_run(&["-n", "3", "--env", "CODE=5", "--"]).args([
            "bash",
            "-c",
            "[ $PMI_RANK = 1 ] && exit $CODE; exit 0",
        ]),
        60,
    );
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
}

#[test]
fn killed_rank_ends_the_job_with_no_survivors() {
    let ring = example("weft-cli", "ring");
    for p in PROCESS_PROVIDERS {
        let mark = marker("kill");
        let t0 = std::time::Instant::now();
        let o = run_bounded(
            weft_run(&["-n", "4", "--provider", p, "--"])
                .arg(&ring)
                .env("RING_KILL_RANK", "2")
                .env("WEFT_TEST_MARK", &mark),
            60,
        );
        assert_eq!(o.status.code(), Some(137), "{p}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("rank 2 was killed by signal 9"),
            "{}",
            stderr(&o)
        );
        assert!(t0.elapsed().as_secs() < 20);
        assert_eq!(survivors(&mark), Vec::<u32>::new(), "{p}: ranks survived");
    }
    assert!(
        shm_leftovers().is_empty(),
        "left in /dev/shm: {:?}",
        shm_leftovers()
    );
}

#[test]
fn exit_without_finalize_fails_the_job() {
    let ring = example("weft-cli", "ring");
    let mark = marker("nofin");
    let o = run_bounded(
        weft_run(&["-n", "3", "--"])
            .arg(&ring)
            .env("RING_NO_FINALIZE", "1")
            .env("WEFT_TEST_MARK", &mark),
        60,
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("rank 1 exited without finalizing"),
        "{}",
        stderr(&o)
    );
    assert!(survivors(&mark).is_empty());
}

#[test]
fn interrupt_ends_every_rank() {
    let mark = marker("sigint");
    let mut c = weft_run(&["-n", "3", "--", "sleep", "300"]);
    c.env("WEFT_TEST_MARK", &mark)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    // Wait (bounded) until the three ranks exist, then interrupt the launcher.
    let t0 = std::time::Instant::now();
    while survivors(&mark).len() < 4 {
        assert!(t0.elapsed().as_secs() < 30, "ranks did not start");
        std::thread::yield_now();
    }
    // SAFETY: signalling the launcher we started.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait()).unwrap());
    let st = rx
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("launcher did not exit after SIGINT")
        .unwrap();
    assert_eq!(st.code(), Some(130));
    assert!(survivors(&mark).is_empty());
}

#[test]
fn malformed_pmi_line_fails_the_job() {
    let o = run_bounded(
        weft_run(&["-n", "2", "--"]).args([
            "bash",
            "-c",
            "printf 'cmd=init pmi_version=1\\nthis is garbage\\n' >&$PMI_FD; sleep 100",
        ]),
        60,
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("malformed PMI request from rank"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn duplicate_rank_is_refused() {
    let ring = example("weft-cli", "ring");
    let o = run_bounded(
        weft_run(&["-n", "2", "--pmi-port", "--"]).args([
            "bash".as_ref(),
            "-c".as_ref(),
            format!("PMI_ID=0 exec {}", ring.display())
                .as_str()
                .as_ref() as &std::ffi::OsStr,
        ]),
        60,
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains("duplicate rank 0"), "{}", stderr(&o));
}

#[test]
fn unknown_provider_is_a_usage_error() {
    let o = run_bounded(
        &mut weft_run(&["-n", "2", "--provider", "nope", "--", "true"]),
        30,
    );
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("unknown provider 'nope'") && e.contains("shm"),
        "{e}"
    );
}

#[test]
fn missing_program_is_an_error() {
    let o = run_bounded(&mut weft_run(&["-n", "2", "--", "/nonexistent/prog"]), 30);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("cannot start /nonexistent/prog"),
        "{}",
        stderr(&o)
    );
}

/// A rank killed in the middle of a large message: its peer's receive fails with "peer
/// failed" (or, where the kernel finished a single copy first, completes intact), a later
/// receive fails, nothing hangs, and /dev/shm keeps no weft file.
#[test]
fn peer_killed_mid_large_message() {
    let fault = example("weft-cli", "fault");
    for p in PROCESS_PROVIDERS {
        let o = run_bounded(
            weft_run(&["--keep-going", "-n", "2", "--provider", p, "--"])
                .arg(&fault)
                .env("FAULT_SIZE", (512u64 << 20).to_string())
                .env("FAULT_SPIN_MS", "2")
                .env("WEFT_TIMEOUT", "60"),
            120,
        );
        let out = stdout(&o);
        assert_eq!(o.status.code(), Some(137), "{p}: {out}\n{}", stderr(&o));
        assert!(
            out.contains(&format!("fault: provider {p}")),
            "{p}: {out}\n{}",
            stderr(&o)
        );
        assert!(
            out.contains("fault: later receive: peer-failed"),
            "{p}: {out}"
        );
        // Two-copy and TCP paths need the sender until the last byte; a single kernel copy
        // (limic, or the soft HCA's RDMA read) may finish on its own.
        let big = if *p == "limic" || *p == "verbs-rc" {
            [
                "fault: large receive: peer-failed",
                "fault: large receive: ok",
            ]
            .iter()
            .any(|l| out.contains(l))
        } else {
            out.contains("fault: large receive: peer-failed")
        };
        assert!(big, "{p}: {out}");
        assert!(
            stderr(&o).contains("rank 0 was killed by signal 9; the others go on"),
            "{}",
            stderr(&o)
        );
    }
    assert!(
        shm_leftovers().is_empty(),
        "left in /dev/shm: {:?}",
        shm_leftovers()
    );
}

/// A rank of `ofi` over libfabric's shm killed mid-transfer (and its peer ended by the
/// launcher): libfabric unlinks its region only when the endpoint closes, so each dead rank
/// left a 16 MiB `<pid>:0:0` in /dev/shm until the launcher learned to remove it.
#[test]
fn killed_ofi_ranks_leave_no_libfabric_region() {
    let fault = example("weft-cli", "fault");
    let o = run_bounded(
        weft_run(&["-n", "2", "--provider", "ofi", "--"])
            .arg(&fault)
            .env("WEFT_OFI_PROVIDER", "shm")
            .env("FAULT_SIZE", (64u64 << 20).to_string())
            .env("WEFT_TIMEOUT", "60"),
        120,
    );
    let out = stdout(&o);
    assert!(
        stderr(&o).contains("rank 0 was killed by signal 9"),
        "{out}\n{}",
        stderr(&o)
    );
    let pids: Vec<String> = out
        .lines()
        .filter_map(|l| l.strip_prefix("fault: rank "))
        .filter_map(|l| l.split(" pid ").nth(1))
        .map(str::to_string)
        .collect();
    assert_eq!(pids.len(), 2, "{out}");
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| pids.iter().any(|p| n.starts_with(&format!("{p}:"))))
        .collect();
    assert!(left.is_empty(), "left in /dev/shm by the ranks: {left:?}");
}

/// `ofi` notices a dead rank on its host (libfabric's shm says nothing; tcp only fails
/// operations towards it): a receive from it, a collective with it and a lock it held end at
/// once. Before, each waited until `WEFT_TIMEOUT` (here 60 s; for ever without one).
#[test]
fn ofi_notices_a_dead_rank_on_its_host() {
    let fault = example("weft-cli", "fault");
    for prov in ["shm", "tcp"] {
        for (case, n, want) in [
            ("send", "2", &["fault: later receive: peer-failed"][..]),
            (
                "collective",
                "3",
                &[
                    "fault: rank 0 barrier: peer-failed",
                    "fault: rank 2 allreduce: peer-failed",
                ][..],
            ),
            ("lock", "3", &["fault: lock after holder died: ok"][..]),
        ] {
            let o = run_bounded(
                weft_run(&["--keep-going", "-n", n, "--provider", "ofi", "--"])
                    .arg(&fault)
                    .env("WEFT_OFI_PROVIDER", prov)
                    .env("FAULT_CASE", case)
                    .env("FAULT_SIZE", (64u64 << 20).to_string())
                    .env("WEFT_TIMEOUT", "60"),
                200,
            );
            let out = stdout(&o);
            for w in want {
                assert!(
                    out.contains(w),
                    "ofi over {prov}, {case}: no '{w}' in\n{out}\n{}",
                    stderr(&o)
                );
            }
        }
    }
}

/// A rank killed while it holds an exclusive window lock: the next rank that asks for the lock
/// gets it — released by the target when the holder's death is noticed (active-message locks),
/// or taken over from the dead holder (shm's native locks on allocated windows). Before, it
/// waited until `WEFT_TIMEOUT`, or for ever without one.
#[test]
fn a_lock_holder_killed_mid_epoch_does_not_block_the_others() {
    let fault = example("weft-cli", "fault");
    for p in PROCESS_PROVIDERS {
        for window in ["create", "alloc"] {
            let o = run_bounded(
                weft_run(&["--keep-going", "-n", "3", "--provider", p, "--"])
                    .arg(&fault)
                    .env("FAULT_CASE", "lock")
                    .env("FAULT_WINDOW", window)
                    .env("WEFT_TIMEOUT", "30"),
                90,
            );
            let out = stdout(&o);
            assert!(
                out.contains("fault: lock after holder died: ok"),
                "{p} {window}: {out}\n{}",
                stderr(&o)
            );
            assert_eq!(o.status.code(), Some(137), "{p} {window}: {out}");
        }
    }
}

/// A rank killed while the others are in a barrier, an allreduce and a window fence with it:
/// each fails with "peer failed" on every survivor, none waits for a message that will not
/// come — also not when the window is freed (no `WEFT_TIMEOUT`: before, freeing waited for the
/// other survivor's DONE of a fence the failure had cut short, for good, or until the timeout).
#[test]
fn a_rank_killed_during_a_collective_fails_it_everywhere() {
    let fault = example("weft-cli", "fault");
    for p in PROCESS_PROVIDERS {
        let o = run_bounded(
            weft_run(&["--keep-going", "-n", "3", "--provider", p, "--"])
                .arg(&fault)
                .env("FAULT_CASE", "collective")
                .env_remove("WEFT_TIMEOUT"),
            90,
        );
        let out = stdout(&o);
        for r in [0, 2] {
            for what in ["barrier", "allreduce", "fence"] {
                assert!(
                    out.contains(&format!("fault: rank {r} {what}: peer-failed")),
                    "{p}: {out}\n{}",
                    stderr(&o)
                );
            }
        }
        assert_eq!(o.status.code(), Some(137), "{p}: {out}");
    }
}

/// A rank that dies while the others finalize: each survivor's finalize returns "peer failed",
/// with no `WEFT_TIMEOUT` set (a receive from the dead rank in finalize's barrier fails with it,
/// a send to it fails at once).
#[test]
fn a_rank_killed_during_finalize_does_not_hang_the_others() {
    let fault = example("weft-cli", "fault");
    for p in ["shm", "tcp-sim", "verbs-ud"] {
        let o = run_bounded(
            weft_run(&["--keep-going", "-n", "4", "--provider", p, "--"])
                .arg(&fault)
                .env("FAULT_CASE", "finalize")
                .env_remove("WEFT_TIMEOUT"),
            60,
        );
        let out = stdout(&o);
        for r in [0, 2, 3] {
            assert!(
                out.contains(&format!("fault: rank {r} finalize: peer-failed")),
                "{p}: {out}\n{}",
                stderr(&o)
            );
        }
        assert_eq!(o.status.code(), Some(137), "{p}: {out}");
    }
}

/// Where cross-memory attach is forbidden (here by a seccomp filter, as container runtimes
/// install), limic reports itself unavailable with the reason on every rank and selection
/// moves on to the next provider.
#[test]
fn limic_unavailable_without_cross_memory_attach() {
    let ring = example("weft-cli", "ring");
    let no_cma = example("weft-limic", "no_cma");
    let o = run_bounded(
        weft_run(&["-n", "2", "--provider", "limic,shm", "--"])
            .arg(&no_cma)
            .arg(&ring),
        60,
    );
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains("ring: ok over 2 ranks on 1 host(s), provider shm"),
        "{}",
        stdout(&o)
    );
    let o = run_bounded(
        weft_run(&["-n", "2", "--provider", "limic", "--"])
            .arg(&no_cma)
            .arg(&ring),
        60,
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("limic: process_vm_readv from rank")
            && stderr(&o).contains("Operation not permitted"),
        "{}",
        stderr(&o)
    );
    assert!(shm_leftovers().is_empty(), "{:?}", shm_leftovers());
}

/// The leftover check of these tests skips only objects of jobs whose launcher still runs
/// (tests run in parallel), under weft's launcher or Hydra; objects of ended jobs, or named
/// otherwise, count.
#[test]
fn leftover_check_skips_only_running_jobs() {
    let me = std::process::id();
    assert!(launcher_running(&format!("weft-weft-{me}-123-h0-limic")));
    assert!(!launcher_running("weft-weft-4000000000-123-h0-limic"));
    // Hydra's job names: `kvs_<mpiexec pid>_<pgid>_<random>_<host>`.
    assert!(launcher_running(&format!("weft-kvs_{me}_0_2105_vm-h0-w")));
    assert!(!launcher_running("weft-kvs_4000000000_0_2105_vm-h0"));
    assert!(!launcher_running("weft-kvs_x_0-h0"));
    assert!(!launcher_running("weft-weft-x-h0"));
    assert!(!launcher_running("weft-other-1-h0"));
}

/// `--provider` naming a library found only through `--env WEFT_PROVIDER_PATH=...`: the
/// launcher checks the name the way the ranks will see it (it used to look only at its own
/// environment and refuse it as unknown).
#[test]
fn provider_found_through_env_provider_path() {
    let ring = example("weft-cli", "ring");
    let dir = provider_dir();
    let o = run_bounded(
        weft_run(&["-n", "2", "--provider", "rdgram", "--env"])
            .arg(format!("WEFT_PROVIDER_PATH={}", dir.display()))
            .arg("--")
            .arg(&ring)
            .env_remove("WEFT_PROVIDER_PATH"),
        60,
    );
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("provider rdgram"), "{}", stdout(&o));
}

/// Every rank stops at an unknown provider; the job's status is that of a failing rank (the
/// ring's 2 for a failed init), not the SIGTERM the launcher sent the others (143, before).
#[test]
fn job_status_is_the_failing_ranks() {
    let ring = example("weft-cli", "ring");
    let o = run_bounded(
        weft_run(&["-n", "8", "--"])
            .arg(&ring)
            .env("WEFT_PROVIDER", "nope"),
        60,
    );
    assert_eq!(o.status.code(), Some(2), "{}\n{}", stdout(&o), stderr(&o));
    assert!(
        stderr(&o).contains("unknown provider 'nope'"),
        "{}",
        stderr(&o)
    );
}

/// Beyond 32 ranks the bootstrap's exchanges go through rank 0's table (one key read per
/// rank instead of one per peer): the host map of two (simulated) hosts, the provider vote,
/// tcp-sim's addresses (one distinct value per rank) and the host provider's vote all arrive
/// whole and in rank order, or the ring would not close.
#[test]
fn forty_ranks_on_two_hosts_start_through_the_gathered_tables() {
    let ring = example("weft-cli", "ring");
    let o = run_bounded(
        weft_run(&["-n", "40", "--hosts", "2", "--provider", "tcp-sim", "--"])
            .arg(&ring)
            .env("RING_LAPS", "1"),
        240,
    );
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains("ring: ok over 40 ranks on 2 host(s), provider tcp-sim+shm"),
        "{}",
        stdout(&o)
    );
}

/// The job's status is the first failing rank's, by when it exited: rank 2 exits with 3, and
/// rank 1, as soon as rank 2 is gone, with 1 (as a rank that sees its peer's connection close
/// does). Both exits used to land in one round of the launcher, which then named the lower
/// rank ("rank 1 exited with status 1", once in 32 runs under tcp-sim); they are now ordered by
/// when their descriptors closed.
#[test]
fn the_job_status_is_the_first_rank_to_fail() {
    let dir = std::env::temp_dir().join(format!("weft-first-fail-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = r#"
        f="$0/pid"
        case "$PMI_RANK" in
          2) echo $$ > "$f.tmp" && mv "$f.tmp" "$f"; exit 3 ;;
          1) i=0
             while [ ! -s "$f" ]; do i=$((i+1)); [ $i -gt 200000 ] && exit 9; done
             p=$(cat "$f")
             st=R
             while [ "$st" != Z ] && [ -e /proc/$p ]; do
               read -r a b st rest < /proc/$p/stat 2>/dev/null || st=Z
               i=$((i+1)); [ $i -gt 400000 ] && exit 9
             done
             exit 1 ;;
          *) read -t 30 x < /dev/zero 2>/dev/null; sleep 30 ;;
        esac"#;
    for run in 0..20 {
        let _ = std::fs::remove_file(dir.join("pid"));
        let o = run_bounded(
            Command::new(weft())
                .args(["run", "-n", "3", "--", "sh", "-c", script])
                .arg(&dir),
            60,
        );
        let err = stderr(&o);
        assert!(
            err.contains("rank 2 exited with status 3") && o.status.code() == Some(3),
            "run {run}: {err} (exit {:?})",
            o.status.code()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// libfabric's shm regions (`/dev/shm/<pid>:<n>:<n>`) of ranks whose launcher was SIGKILLed
/// (so never removed them as their ranks exited) are removed by the next `weft run`; those of
/// a live process stay. Only weft's own `weft-weft-*` objects used to be swept.
#[test]
fn libfabric_regions_of_dead_processes_are_swept() {
    let mut gone = Command::new("true").spawn().unwrap();
    let dead = gone.id();
    gone.wait().unwrap();
    let orphan = format!("/dev/shm/{dead}:0:0");
    let live = format!("/dev/shm/{}:0:7", std::process::id());
    std::fs::write(&orphan, b"x").unwrap();
    std::fs::write(&live, b"x").unwrap();
    let o = run_bounded(
        Command::new(weft()).args(["run", "-n", "1", "--", "true"]),
        30,
    );
    let left = std::path::Path::new(&orphan).exists();
    let kept = std::path::Path::new(&live).exists();
    let _ = std::fs::remove_file(&orphan);
    let _ = std::fs::remove_file(&live);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!left, "the dead process's region is still there");
    assert!(kept, "a live process's region was removed");
    assert!(
        stderr(&o).contains(&format!(
            "removed {orphan}, left by a libfabric process that died"
        )),
        "{}",
        stderr(&o)
    );
}
