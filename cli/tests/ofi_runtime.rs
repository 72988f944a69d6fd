//! libfabric is found when weft runs, not when it was built (issue 65): the same binaries,
//! with no cargo command between, first without libfabric (`WEFT_OFI_LIB` names a file that
//! is not there yet) and then with it (the system's library copied there, as installing
//! `libfabric1` or pointing `LD_LIBRARY_PATH` at a build would). `weft info` says which in one
//! line, `weft run --provider ofi` fails in one line and then runs, and the main job's
//! benchmark gains its `ofi` column. A library older than the bindings is refused by name.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The system's libfabric, where Debian (or another layout) installs it.
fn system_libfabric() -> Option<PathBuf> {
    [
        "/usr/lib/x86_64-linux-gnu/libfabric.so.1",
        "/usr/lib64/libfabric.so.1",
        "/usr/lib/libfabric.so.1",
        "/usr/local/lib/libfabric.so.1",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
}

fn with_lib<'a>(c: &'a mut Command, lib: &Path) -> &'a mut Command {
    c.env_remove("WEFT_PROVIDER")
        .env_remove("WEFT_OFI_PROVIDER")
        .env("WEFT_OFI_LIB", lib)
}

fn info_line(lib: &Path) -> String {
    let o = run_bounded(with_lib(&mut Command::new(weft()), lib).arg("info"), 60);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("libfabric (WEFT_OFI_LIB): "))
        .collect();
    assert_eq!(lines.len(), 1, "{out}");
    lines[0].to_string()
}

#[test]
fn installing_libfabric_makes_ofi_available_without_a_rebuild() {
    let Some(system) = system_libfabric() else {
        return skip("libfabric.so.1 is not installed (Debian's libfabric1)");
    };
    let dir = std::env::temp_dir().join(format!("weft-ofi-lib-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let lib = dir.join("libfabric.so.1");
    let ring = example("weft-cli", "ring");
    let bench = |lib: &Path| {
        run_bounded(
            with_lib(&mut Command::new(weft()), lib)
                .current_dir(&dir)
                // The main job's selection: every provider that can run here.
                .args(["bench", "latency"])
                .args([
                    "--sizes", "8", "--reps", "1", "--iters", "200", "--warmup", "20",
                ])
                .env("WEFT_OFI_PROVIDER", "tcp;ofi_rxm"),
            300,
        )
    };

    // Not installed.
    let line = info_line(&lib);
    assert_eq!(
        line,
        format!(
            "libfabric (WEFT_OFI_LIB): {} not found (install libfabric1); the ofi provider cannot run",
            lib.display()
        )
    );
    let o = run_bounded(
        with_lib(&mut Command::new(weft()), &lib)
            .args(["run", "-n", "2", "--provider", "ofi", "--"])
            .arg(&ring),
        120,
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let why = format!("{} not found (install libfabric1)", lib.display());
    let err = stderr(&o);
    assert!(err.contains(&why), "{err}");
    // One line per rank, none of a build script's output.
    assert!(
        err.lines().filter(|l| l.contains(&why)).count() <= 2 && !err.contains("pkg-config"),
        "{err}"
    );
    let o = bench(&lib);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let header = out
        .lines()
        .find(|l| l.starts_with("size"))
        .unwrap_or_default();
    let cols: Vec<&str> = header.split_whitespace().collect();
    assert!(cols.contains(&"shm") && !cols.contains(&"ofi"), "{out}");
    assert!(
        out.contains(&format!("note: ofi skipped: unsupported: {why}")),
        "{out}"
    );

    // Installed: the same binaries, nothing rebuilt.
    std::fs::copy(&system, &lib).expect("copy libfabric.so.1");
    let line = info_line(&lib);
    assert!(
        line.starts_with(&format!(
            "libfabric (WEFT_OFI_LIB): {}, libfabric 1.",
            lib.display()
        )),
        "{line}"
    );
    let o = run_bounded(
        with_lib(&mut Command::new(weft()), &lib)
            .args(["run", "-n", "2", "--provider", "ofi", "--"])
            .arg(&ring)
            .env("WEFT_OFI_PROVIDER", "tcp;ofi_rxm"),
        120,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("ring: ok over 2 ranks on 1 host(s), provider ofi"),
        "{}",
        stdout(&o)
    );
    let o = bench(&lib);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let header = out
        .lines()
        .find(|l| l.starts_with("size"))
        .unwrap_or_default();
    let cols: Vec<&str> = header.split_whitespace().collect();
    let at = cols.iter().position(|c| *c == "ofi");
    assert!(at.is_some() && cols.contains(&"shm"), "{out}");
    let row: Vec<&str> = out
        .lines()
        .find(|l| l.starts_with("8 "))
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert!(
        at.and_then(|i| row.get(i))
            .is_some_and(|v| v.parse::<f64>().is_ok_and(|v| v > 0.0)),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A library whose `fi_version` says 1.5 is refused with both versions named, and one that is
/// not libfabric at all is named as such.
#[test]
fn an_older_libfabric_is_refused_by_version() {
    if Command::new("cc").arg("--version").output().is_err() {
        return skip("no C compiler to build a stand-in library");
    }
    let dir = std::env::temp_dir().join(format!("weft-ofi-old-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("old.c");
    std::fs::write(
        &src,
        "unsigned fi_version(void) { return (1u << 16) | 5u; }\n",
    )
    .unwrap();
    let lib = dir.join("libfabric.so.1");
    let o = run_bounded(
        Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(&lib)
            .arg(&src),
        60,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        info_line(&lib),
        format!(
            "libfabric (WEFT_OFI_LIB): libfabric 1.5 ({}) is older than 1.17, the oldest weft's ofi supports; the ofi provider cannot run",
            lib.display()
        )
    );
    std::fs::write(&src, "int not_libfabric(void) { return 0; }\n").unwrap();
    let other = dir.join("libother.so");
    let o = run_bounded(
        Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(&other)
            .arg(&src),
        60,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let line = info_line(&other);
    assert!(
        line.starts_with(&format!(
            "libfabric (WEFT_OFI_LIB): {} is not libfabric",
            other.display()
        )),
        "{line}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
