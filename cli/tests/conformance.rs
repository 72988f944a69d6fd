//! `weft test` across processes: every built-in provider that spans processes and both
//! example providers (Rust and C, loaded from --provider-path) pass the conformance suite; a
//! provider that corrupts data fails it with a non-zero exit; bad requests are usage errors.

mod common;
use common::{provider_dir, run_bounded, weft};
use std::process::Command;

fn weft_test(args: &[&str]) -> (i32, String, String) {
    let mut cmd = Command::new(weft());
    cmd.arg("test").args(args).env_remove("WEFT_PROVIDER_PATH");
    let out = run_bounded(&mut cmd, 600);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn passes(args: &[&str]) {
    let (code, out, err) = weft_test(args);
    passed(args, code, &out, &err);
}

/// The report of `weft test args` says every check passed.
fn passed(args: &[&str], code: i32, out: &str, err: &str) {
    assert_eq!(code, 0, "weft test {args:?}:\n{out}\n{err}");
    let n = weft_conformance::CHECKS.len();
    assert!(
        out.contains(&format!("PASS: {n}/{n} checks passed")),
        "{out}"
    );
    for g in ["two-sided", "datatypes", "rma", "atomics", "stress"] {
        assert!(
            out.lines().any(|l| l.starts_with(g) && l.contains(" 0")),
            "{out}"
        );
    }
}

#[test]
fn builtin_providers_pass_across_processes() {
    passes(&["--provider", "shm", "-n", "3"]);
    passes(&["--provider", "tcp-sim", "-n", "4"]);
    // Large payloads through the connection buffer instead of direct placement; speculative
    // data dropped instead of staged (tcp-sim speculates up to 4 MiB by default); the plain
    // RTS/CTS rendezvous.
    for env in [
        "WEFT_TCP_SIM_DIRECT=0",
        "WEFT_SPEC_BUFFER=0",
        "WEFT_SPEC_LIMIT=0",
    ] {
        passes(&["--provider", "tcp-sim", "-n", "3", "--env", env]);
    }
    passes(&["--provider", "limic", "-n", "3"]);
}

/// Aggregation on native windows over registered memory (limic's CMA, verbs-rc's RDMA): small
/// puts and gets are packed into active-message batches while large ones stay native, and the
/// windows synchronise by active messages; under `full` the gets of an epoch leave first.
#[test]
fn aggregation_packs_on_native_windows_across_processes() {
    let soft = "WEFT_VERBS_DEVICE=soft"; // verbs-rc's device; limic does not read it
    for sched in ["WEFT_RMA_SCHED=aggregate", "WEFT_RMA_SCHED=full"] {
        for p in ["limic", "verbs-rc"] {
            passes(&["--provider", p, "-n", "3", "--env", soft, "--env", sched]);
        }
    }
}

/// verbs-rc on the soft HCA, with every eager design and every rendezvous mode: the receiver's
/// RDMA read of the sender's buffer, the sender's RDMA write into the receiver's, and the copy
/// through active messages.
#[test]
fn verbs_rc_passes_across_processes() {
    // Every eager design with every rendezvous mode; the fast path's slots from the third
    // message on, so the suite runs on both of its channels.
    for eager in ["fastpath", "basic", "piggyback", "pipeline"] {
        for rndv in ["read", "write", "copy"] {
            passes(&[
                "--provider",
                "verbs-rc",
                "-n",
                "3",
                "--env",
                "WEFT_VERBS_DEVICE=soft",
                "--env",
                &format!("WEFT_VERBS_RC_EAGER={eager}"),
                "--env",
                "WEFT_VERBS_RC_FP_THRESHOLD=2",
                "--env",
                &format!("WEFT_VERBS_RC_RNDV={rndv}"),
            ]);
        }
    }
}

/// verbs-ud on the soft HCA: as it is, and with datagrams dropped, duplicated and held back
/// by the soft HCA's fault injection (its reliability engine retransmits, orders, drops
/// duplicates).
#[test]
fn verbs_ud_passes_across_processes_with_loss() {
    passes(&[
        "--provider",
        "verbs-ud",
        "-n",
        "3",
        "--env",
        "WEFT_VERBS_DEVICE=soft",
    ]);
    passes(&[
        "--provider",
        "verbs-ud",
        "-n",
        "3",
        "--env",
        "WEFT_VERBS_DEVICE=soft",
        "--env",
        "WEFT_VERBS_SOFT_UD_DROP=0.01",
        "--env",
        "WEFT_VERBS_SOFT_UD_DUP=0.01",
        "--env",
        "WEFT_VERBS_SOFT_UD_REORDER=0.05",
    ]);
}

/// limic's paths: every message by cross-memory attach, every message inline, senders that
/// push instead of leaving the copy to the receiver, and so few descriptor slots that
/// operations wait for them.
#[test]
fn limic_passes_on_every_path() {
    passes(&[
        "--provider",
        "limic",
        "-n",
        "3",
        "--env",
        "WEFT_LIMIC_INLINE=0",
    ]);
    passes(&[
        "--provider",
        "limic",
        "-n",
        "2",
        "--env",
        "WEFT_LIMIC_INLINE=1M",
    ]);
    passes(&[
        "--provider",
        "limic",
        "-n",
        "3",
        "--env",
        "WEFT_LIMIC_PULL=0",
        "--env",
        "WEFT_LIMIC_INLINE=0",
    ]);
    passes(&[
        "--provider",
        "limic",
        "-n",
        "4",
        "--env",
        "WEFT_LIMIC_SLOTS=16",
    ]);
}

#[test]
fn example_providers_pass_across_processes() {
    let dir = provider_dir();
    let dir = dir.to_str().unwrap();
    passes(&["--provider", "rdgram", "--provider-path", dir, "-n", "3"]);
    passes(&["--provider", "cdgram", "--provider-path", dir, "-n", "3"]);
    // The same C example built as an ABI 1.0 library still loads and passes.
    passes(&["--provider", "cdgram10", "--provider-path", dir, "-n", "3"]);
}

#[test]
fn a_corrupting_provider_fails_with_the_reason() {
    let dir = provider_dir();
    let (code, out, err) = weft_test(&[
        "--provider",
        "faulty",
        "--provider-path",
        dir.to_str().unwrap(),
        "-n",
        "3",
    ]);
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(out.contains("FAIL: "), "{out}");
    let sizes = out
        .lines()
        .find(|l| l.starts_with("two-sided"))
        .unwrap_or_default();
    assert!(
        sizes.contains("sizes 0 B to 16 MiB (rank 0: 65536 B: payload differs"),
        "{out}"
    );
    // The suite goes on after a failure: the RMA group still ran and passed.
    assert!(
        out.lines()
            .any(|l| l.starts_with("rma") && l.split_whitespace().nth(2) == Some("0")),
        "{out}"
    );
}

#[test]
fn in_process_runs_and_usage_errors() {
    let (code, out, _) = weft_test(&["--provider", "loopback", "--in-process", "--group", "rma"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("PASS: 4/4 checks passed"), "{out}");

    let (code, _, err) = weft_test(&["--provider", "loopback"]);
    assert_eq!(code, 2);
    assert!(
        err.contains("cannot run across processes") && err.contains("--in-process"),
        "{err}"
    );

    let (code, _, err) = weft_test(&["--provider", "nosuch"]);
    assert_eq!(code, 2);
    assert!(err.contains("unknown provider 'nosuch'"), "{err}");

    // A provider that cannot open in-process is a refusal naming it and why (it was three
    // panics and exit 101).
    let (code, out, err) = weft_test(&[
        "--provider",
        "ofi",
        "--in-process",
        "--env",
        "WEFT_OFI_PROVIDER=nosuch",
    ]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("weft test: rank 0: opening the provider")
            && err.contains("WEFT_PROVIDER='ofi'")
            && !err.contains("panicked"),
        "{err}"
    );

    let (code, _, err) = weft_test(&["--provider", "shm", "--group", "nosuch"]);
    assert_eq!(code, 2);
    assert!(err.contains("no such group"), "{err}");

    // A library that fails to load is named with the loader's reason.
    let broken = std::path::Path::new(weft_conformance::BROKEN_DIR);
    let (code, _, err) = weft_test(&[
        "--provider",
        "badmajor",
        "--provider-path",
        broken.to_str().unwrap(),
    ]);
    assert_eq!(code, 2);
    assert!(
        err.contains("failed to load")
            && err.contains("libweft-badmajor.so")
            && err.contains("ABI 2.0"),
        "{err}"
    );
}

/// `ofi` over libfabric's providers on this machine: `tcp;ofi_rxm` (tcp's connections under
/// ofi_rxm, native tag matching, RMA and software atomics), `udp;ofi_rxd` (datagrams made
/// reliable by ofi_rxd, native atomics) and `shm` (active messages only before libfabric 1.19).
/// Skipped where libfabric is missing (tools/deps.sh installs it).
#[test]
fn ofi_passes_across_processes() {
    for prov in ["tcp;ofi_rxm", "udp;ofi_rxd", "shm"] {
        let env = format!("WEFT_OFI_PROVIDER={prov}");
        let args = ["--provider", "ofi", "-n", "3", "--env", &env];
        let (code, out, err) = weft_test(&args);
        if code == 2 && err.contains("cannot run across processes here") {
            common::skip(&format!("libfabric provider {prov}: {err}"));
            continue;
        }
        passed(&args, code, &out, &err);
    }
}
