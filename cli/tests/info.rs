//! `weft info` and `weft info -e`, snapshot-tested with a clean environment.

mod common;
use common::*;
use std::process::Command;

fn weft_clean() -> Command {
    let mut c = Command::new(weft());
    c.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default());
    c
}

/// `weft info` without what depends on the machine's optional libraries: the `[ofi]`
/// section (libfabric built in and found, or the one line saying why not) is checked apart,
/// so that the snapshot holds with or without libfabric installed.
fn machine_independent(out: &str) -> String {
    // The line that says which libfabric was opened, or why none.
    let out: String = out
        .lines()
        .map(|l| {
            if l.starts_with("libfabric (WEFT_OFI_LIB): ") {
                "libfabric (WEFT_OFI_LIB): (as this machine has it)"
            } else {
                l
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n";
    let out = out.as_str();
    let Some(a) = out.find("\n[ofi]\n") else {
        return out.to_string();
    };
    let body = a + "\n[ofi]\n".len();
    let end = out[body..].find("\n\n").map_or(out.len(), |e| body + e);
    let section = &out[body..end];
    assert!(
        section.starts_with("  capabilities:")
            || (section.lines().count() == 1 && section.contains("ofi")),
        "the [ofi] section is either the provider or one line of why not: {section}"
    );
    format!(
        "{}  (as this machine's libfabric has it){}",
        &out[..body],
        &out[end..]
    )
}

#[test]
fn info_lists_providers() {
    let o = run_bounded(weft_clean().arg("info"), 30);
    assert!(o.status.success(), "{}", stderr(&o));
    insta::assert_snapshot!(machine_independent(&stdout(&o)));
}

#[test]
fn info_env_lists_parameters() {
    let o = run_bounded(weft_clean().args(["info", "-e"]), 30);
    assert!(o.status.success(), "{}", stderr(&o));
    insta::assert_snapshot!(stdout(&o));
}

#[test]
fn info_env_reports_bad_values() {
    let o = run_bounded(
        weft_clean()
            .args(["info", "-e"])
            .env("WEFT_SHM_CHUNK", "lots"),
        30,
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stdout(&o).contains("ERROR: bad value for WEFT_SHM_CHUNK='lots': expected a size in bytes"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn unknown_provider_fails_and_lists_providers() {
    let o = run_bounded(weft_clean().arg("info").env("WEFT_PROVIDER", "nope"), 30);
    assert_eq!(o.status.code(), Some(2));
    insta::assert_snapshot!(stderr(&o));
}

#[test]
fn provider_selection_is_shown() {
    let o = run_bounded(weft_clean().arg("info").env("WEFT_PROVIDER", "^shm"), 30);
    assert!(o.status.success());
    assert!(
        stdout(&o).contains(
            "WEFT_PROVIDER selects, in order: limic, tcp-sim, verbs-rc, verbs-ud, hybrid, ofi, loopback"
        ),
        "{}",
        stdout(&o)
    );
}

#[test]
fn every_parameter_is_documented() {
    let o = run_bounded(weft_clean().args(["info", "-e"]), 30);
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/environment.md"),
    )
    .expect("docs/environment.md");
    let missing: Vec<String> = stdout(&o)
        .lines()
        .filter_map(|l| l.split_once(" = ").map(|(k, _)| k.to_string()))
        .filter(|k| k.starts_with("WEFT_") && !doc.contains(&format!("`{k}`")))
        .collect();
    assert!(missing.is_empty(), "docs/environment.md lacks {missing:?}");
}

/// An HCA's atomics (8-byte SUM and CSWAP only): `weft info` says which windows get them (the
/// ones whose accumulate_ops hint stays within those two), and lists contract 2's capabilities.
#[test]
fn info_says_which_windows_get_native_atomics() {
    let o = run_bounded(
        weft_clean()
            .arg("info")
            .env("WEFT_LOOPBACK_RMA", "1")
            .env("WEFT_LOOPBACK_ATOMICS", "hca")
            .env("WEFT_LOOPBACK_COMPLETION", "transmit")
            .env("WEFT_LOOPBACK_ZCOPY", "1")
            .env("WEFT_LOOPBACK_MR_LOCAL", "1")
            .env("WEFT_LOOPBACK_LAZY", "1"),
        30,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = machine_independent(&stdout(&o));
    let lb = &out[out.find("[loopback]").expect("loopback section")..];
    insta::assert_snapshot!(lb);
}
