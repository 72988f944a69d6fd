//! `weft bench` end to end: usage errors name the problem, and a short real sweep writes the
//! documented JSON, CSV and plot.

mod common;
use common::*;
use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    let mut c = Command::new(weft());
    c.arg("bench").args(args).env_remove("WEFT_PROVIDER");
    run_bounded(&mut c, 300)
}

#[test]
fn bad_input_is_a_usage_error_naming_the_problem() {
    let cases: &[(&[&str], &str)] = &[
        (&["nope"], "unknown test 'nope'"),
        (
            &["latency", "--providers", "nope"],
            "unknown provider 'nope'",
        ),
        (&["latency", "--sizes", "8,x"], "x"),
        (&["latency", "--sizes", "1M:4K"], "1M:4K"),
        (&["latency", "-n", "1"], "latency needs at least 2 ranks"),
        (
            &["latency", "--baseline", "ucx:nope"],
            "unknown baseline 'ucx:nope'",
        ),
        (
            &["latency", "--providers", "shm", "--ratio", "tcp-sim"],
            "--ratio tcp-sim: no such column",
        ),
        (&["latency", "--variant", "noname"], "is not NAME:K=V"),
        (
            &["latency", "--providers", "shm", "--variant", "limic/x:A=1"],
            "'limic' is not among",
        ),
        (&["latency", "--reps", "0"], "--reps"),
    ];
    let mut report = String::new();
    for (args, want) in cases {
        let o = bench(args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: wanted '{want}' in: {err}");
        report += &format!("{}\n  {}\n", args.join(" "), err.trim());
    }
    insta::assert_snapshot!(report);
}

#[test]
fn a_short_sweep_writes_json_csv_and_plot() {
    let dir = std::env::temp_dir().join(format!("weft-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, csv, svg) = (dir.join("r.json"), dir.join("r.csv"), dir.join("r.svg"));
    let o = bench(&[
        "latency,bw,put_lat",
        "--providers",
        "shm,tcp-sim",
        "--variant",
        "shm/mpsc:WEFT_SHM_QUEUE=mpsc",
        "--sizes",
        "8,4K",
        "--reps",
        "2",
        "--iters",
        "200",
        "--warmup",
        "20",
        "--ratio",
        "shm",
        "--json",
        json.to_str().unwrap(),
        "--csv",
        csv.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    // One table per test, a row per size, a column per provider/variant and one ratio each.
    for t in ["# latency:", "# bw:", "# put_lat:"] {
        assert!(out.contains(t), "{out}");
    }
    let header = out
        .lines()
        .find(|l| l.starts_with("size"))
        .expect("a table header");
    let cols: Vec<&str> = header.split_whitespace().collect();
    assert_eq!(
        cols,
        [
            "size",
            "shm",
            "shm/mpsc",
            "tcp-sim",
            "shm/mpsc/shm",
            "tcp-sim/shm"
        ],
        "{out}"
    );
    // The JSON object is the documented one, with a positive measurement in every row.
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for k in ["cpu", "cpus", "date", "kernel", "weft"] {
        assert!(j["machine"][k].is_string(), "machine.{k}: {j}");
    }
    let rows = j["results"].as_array().unwrap();
    assert_eq!(rows.len(), 3 * 3 * 2, "3 tests x 3 columns x 2 sizes: {j}");
    for r in rows {
        let med = r["median"].as_f64().unwrap();
        let (lo, hi) = (r["min"].as_f64().unwrap(), r["max"].as_f64().unwrap());
        assert!(med > 0.0 && lo <= med && med <= hi, "{r}");
        assert_eq!(r["reps"], 2, "{r}");
        assert_eq!(r["baseline"], false, "{r}");
        let unit = if r["test"] == "bw" { "MB/s" } else { "us" };
        assert_eq!(r["unit"], unit, "{r}");
        let buffers = match r["test"].as_str() {
            Some("bw") => "one receive buffer per window",
            Some("latency") => "separate send and receive buffers",
            _ => "",
        };
        assert_eq!(r["buffers"], buffers, "{r}");
        let variant = r["provider"] == "shm/mpsc";
        assert_eq!(r["env"]["WEFT_SHM_QUEUE"].is_string(), variant, "{r}");
    }
    let csv = std::fs::read_to_string(&csv).unwrap();
    assert!(
        csv.starts_with("test,provider,baseline,size,unit,median,min,max,reps,buffers,env"),
        "{csv}"
    );
    assert_eq!(csv.lines().count(), 1 + rows.len(), "{csv}");
    assert!(
        stderr(&o).contains(&format!("weft bench: plot written to {}", svg.display())),
        "{}",
        stderr(&o)
    );
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(
        svg.contains("<svg") && svg.contains("tcp-sim"),
        "plot has no lines"
    );
    // The measured sizes label the x axis, in the tables' units; µs, not "us", the y axis.
    let texts: Vec<&str> = svg.lines().map(str::trim).collect();
    for label in ["8 B", "4 KiB", "µs", "MB/s"] {
        assert!(texts.contains(&label), "no {label} in the plot");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--one-buffer` (NetPIPE's ping-pong convention) reaches the ranks and labels the table.
#[test]
fn one_buffer_ping_pong_runs_and_says_so() {
    let o = bench(&[
        "latency",
        "--one-buffer",
        "--providers",
        "shm",
        "--sizes",
        "8,64K",
        "--reps",
        "1",
        "--iters",
        "50",
        "--warmup",
        "5",
    ]);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("2 ranks, one buffer per rank"), "{out}");
    let rows: Vec<f64> = out
        .lines()
        .filter(|l| l.starts_with("8 ") || l.starts_with("64K"))
        .map(|l| l.split_whitespace().nth(1).unwrap().parse().unwrap())
        .collect();
    assert!(rows.len() == 2 && rows.iter().all(|v| *v > 0.0), "{out}");
}

/// The soft HCA's one-sided semantics between two processes started by the launcher, the
/// target in no HCA call meanwhile (`examples/verbs_peers.rs`: write, read back, fetch-add,
/// send into a posted receive, a wrong key that touches nothing and fails the target's QP).
/// Across two hosts the same program runs in `hydra.rs`.
#[test]
fn verbs_semantics_hold_between_two_processes() {
    let peers = example("weft-cli", "verbs_peers");
    let o = run_bounded(
        Command::new(weft())
            .args(["run", "-n", "2", "--env", "WEFT_VERBS_DEVICE=soft", "--"])
            .arg(&peers),
        120,
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    for r in 0..2 {
        assert!(
            out.contains(&format!(
                "verbs_peers: rank {r} ok on host 0 device soft (requests served for other hosts: 0)"
            )),
            "{out}"
        );
    }
}

/// The raw verbs tests run between two processes of the embedded launcher on the soft HCA
/// (the requester of one process reaching into the other's segment and memory), every one of
/// them, with the Cross-Memory Attach references beside them.
#[test]
fn raw_verbs_tests_run_across_processes_on_the_soft_hca() {
    let tests =
        "verbs_send_lat,verbs_write_lat,verbs_write_lat_dm,verbs_read_lat,verbs_atomic_lat,\
                 verbs_write_bw,verbs_send_bw,cma_write_lat,cma_write_bw";
    let o = bench(&[
        tests,
        "--providers",
        "shm",
        "--sizes",
        "8,64K",
        "--reps",
        "1",
        "--iters",
        "100",
        "--warmup",
        "5",
        "--env",
        "WEFT_VERBS_DEVICE=soft",
    ]);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    for t in tests.split(',') {
        assert!(
            out.contains(&format!("# {t}:")),
            "{t} missing:\n{out}\n{}",
            stderr(&o)
        );
    }
    let rows: Vec<f64> = out
        .lines()
        .filter(|l| l.starts_with("8 ") || l.starts_with("64K"))
        .map(|l| l.split_whitespace().nth(1).unwrap().parse().unwrap())
        .collect();
    assert!(rows.len() == 18 && rows.iter().all(|v| *v > 0.0), "{out}");
}

/// `mem` reads the providers' own memory counters after all-to-all traffic: verbs-rc grows by
/// at least one RC queue pair per added peer, verbs-ud stays within a small per-peer table, and
/// a provider that reports no memory says so instead of printing a zero.
#[test]
fn mem_shows_rc_growing_and_ud_flat_with_job_size() {
    let kib = |n: &str| -> Vec<f64> {
        let o = bench(&[
            "mem",
            "--providers",
            "verbs-rc,verbs-ud,shm",
            "-n",
            n,
            "--sizes",
            "8",
            "--reps",
            "1",
            "--iters",
            "2",
            "--env",
            "WEFT_VERBS_DEVICE=soft",
        ]);
        let (out, err) = (stdout(&o), stderr(&o));
        assert!(o.status.success(), "{out}\n{err}");
        assert!(
            out.contains("mem on shm failed") && err.contains("reports no memory counters"),
            "{out}\n{err}"
        );
        let row = out.lines().find(|l| l.starts_with("8 ")).expect(&out);
        row.split_whitespace()
            .skip(1)
            .map(|v| v.parse().unwrap())
            .collect()
    };
    let (two, six) = (kib("2"), kib("6"));
    assert_eq!(two.len(), 2, "{two:?}");
    // One RC QP is 26944 B in the soft HCA's model: four more peers, at least 4 x 26 KiB.
    assert!(six[0] - two[0] >= 4.0 * 26.0, "verbs-rc {two:?} -> {six:?}");
    assert!(six[1] - two[1] < 4.0 * 4.0, "verbs-ud {two:?} -> {six:?}");
    assert!(
        two.iter().chain(&six).all(|v| *v > 1000.0),
        "{two:?} {six:?}"
    );
}

/// hybrid's RC memory is bounded by WEFT_HYBRID_MAX_RC: every pair earns RC at the first
/// message, but each process holds one or three RC QPs at most (no RC-FP slots, which would
/// add 128 KiB per connected peer); RC's shared pools appear with the first connection.
#[test]
fn hybrid_rc_memory_is_bounded_by_its_limit() {
    let o = bench(&[
        "mem",
        "--providers",
        "hybrid",
        "--variant",
        "hybrid/rc1:WEFT_HYBRID_RC_THRESHOLD=1,WEFT_HYBRID_MAX_RC=1,WEFT_HYBRID_MAX_FP=0",
        "--variant",
        "hybrid/rc3:WEFT_HYBRID_RC_THRESHOLD=1,WEFT_HYBRID_MAX_RC=3,WEFT_HYBRID_MAX_FP=0",
        "-n",
        "6",
        "--sizes",
        "8",
        "--reps",
        "1",
        "--iters",
        "2",
        "--env",
        "WEFT_VERBS_DEVICE=soft",
    ]);
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(o.status.success(), "{out}\n{err}");
    let row = out.lines().find(|l| l.starts_with("8 ")).expect(&out);
    let v: Vec<f64> = row
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap())
        .collect();
    assert_eq!(v.len(), 3, "{out}");
    // No pair earned RC in 2 iterations at the default threshold: no pools, no QPs.
    assert!(
        v[1] - v[0] > 1024.0,
        "RC's pools at the first connection: {v:?}\n{out}"
    );
    // Two more RC QPs (the hybrid's: 64 one-entry requests, 5.8 KiB each in the soft HCA's
    // model) and their bookkeeping; not four.
    let extra = v[2] - v[1];
    assert!((2.0 * 5.5..3.0 * 5.8).contains(&extra), "{v:?}\n{out}");
}

/// The application patterns run on every rank and report a time per step.
#[test]
fn halo_sparse_and_mixed_patterns_run() {
    let o = bench(&[
        "halo,sparse,mixed",
        "--providers",
        "shm,hybrid",
        "-n",
        "4",
        "--sizes",
        "64,4K",
        "--reps",
        "1",
        "--iters",
        "20",
        "--env",
        "WEFT_VERBS_DEVICE=soft",
    ]);
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(o.status.success(), "{out}\n{err}");
    for t in ["# halo:", "# sparse:", "# mixed:"] {
        assert!(out.contains(t), "{out}");
    }
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("64 ") || l.starts_with("4K "))
        .collect();
    assert_eq!(rows.len(), 6, "{out}");
    for r in rows {
        let v: Vec<f64> = r
            .split_whitespace()
            .skip(1)
            .map(|v| v.parse().unwrap())
            .collect();
        assert!(v.len() == 2 && v.iter().all(|x| *x > 0.0), "{r}");
    }
}

/// `weft bench ARGS --json` on the soft device: the report's per-job provider counters.
fn bench_counters(tag: &str, args: &[&str]) -> Vec<serde_json::Value> {
    let dir = std::env::temp_dir().join(format!("weft-bench-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("r.json");
    let mut all = args.to_vec();
    all.extend([
        "--json",
        json.to_str().unwrap(),
        "--env",
        "WEFT_VERBS_DEVICE=soft",
    ]);
    let o = bench(&all);
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    v["counters"].as_array().expect("a counters list").to_vec()
}

/// The report's JSON records each weft job's provider counters, summed over the ranks: for the
/// hybrid provider, the messages it sent over each channel.
#[test]
fn json_records_the_hybrid_channel_statistics() {
    let jobs = bench_counters(
        "hybrid",
        &[
            "latency",
            "--providers",
            "hybrid",
            "--sizes",
            "8,4K",
            "--reps",
            "1",
            "--iters",
            "400",
        ],
    );
    let h = jobs
        .iter()
        .find(|j| j["provider"] == "hybrid" && j["test"] == "latency")
        .expect("hybrid's latency job");
    let k = &h["counters"];
    // 2 x 400 iterations and warm-up: past the RC threshold (100) both ranks connect.
    for key in ["ud_sr_msgs", "rc_fp_msgs", "rc_sr_msgs"] {
        assert!(k[key].as_u64().unwrap_or(0) > 0, "{key}: {h}");
    }
    assert_eq!(k["rc_opened"].as_u64(), Some(2), "{h}");
    // Each side offers the other RC-FP slots at connection.
    assert_eq!(k["fp_opened"].as_u64(), Some(2), "{h}");
    assert_eq!(k["fp_closed"].as_u64(), Some(0), "{h}");
    // What UD's reliability adds: every UD-SR message is at least one datagram, besides the
    // control messages and acknowledgements.
    let n = |key: &str| {
        k[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} missing: {h}"))
    };
    assert!(n("ud_packets_sent") > n("ud_sr_msgs"), "{h}");
    assert!(
        n("ud_pure_acks") + n("ud_resent") < n("ud_packets_sent"),
        "{h}"
    );
}

/// The verbs providers report the QP-context cache misses of their device (the soft HCA's
/// timing model): some with the model on, none with it off.
#[test]
fn json_records_the_qp_cache_misses_of_the_verbs_providers() {
    let jobs = bench_counters(
        "qpc",
        &[
            "latency",
            "--providers",
            "verbs-rc,verbs-ud,hybrid",
            "--variant",
            "hybrid/cache:WEFT_VERBS_SOFT_QP_CACHE=1",
            "--variant",
            "verbs-rc/cache:WEFT_VERBS_SOFT_QP_CACHE=1",
            "--variant",
            "verbs-ud/cache:WEFT_VERBS_SOFT_QP_CACHE=1",
            "--sizes",
            "8",
            "--reps",
            "1",
            "--iters",
            "200",
        ],
    );
    for p in ["verbs-rc", "verbs-ud", "hybrid"] {
        let misses = |col: &str| {
            let j = jobs
                .iter()
                .find(|j| j["provider"] == col)
                .unwrap_or_else(|| panic!("no job for {col}: {jobs:?}"));
            j["counters"]["hca_qp_cache_misses"]
                .as_u64()
                .unwrap_or_else(|| panic!("{col} reports no hca_qp_cache_misses: {j}"))
        };
        assert_eq!(misses(p), 0, "{p} without the cache model");
        assert!(
            misses(&format!("{p}/cache")) > 0,
            "{p} with one cached context"
        );
    }
}
