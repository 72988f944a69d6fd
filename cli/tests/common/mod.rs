//! Helpers for tests that start real processes: the built `weft` binary, examples built on
//! demand with the same profile, bounded waits and a survivor check.
#![allow(dead_code)]

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::{mpsc, Mutex, OnceLock};
use std::time::Duration;

pub fn weft() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_weft"))
}

/// `target/<profile>`, where the weft binary was built.
pub fn profile_dir() -> PathBuf {
    weft()
        .parent()
        .expect("binary has a directory")
        .to_path_buf()
}

/// Build an example of crate `pkg` with the profile the tests use (once per test binary).
pub fn example(pkg: &str, name: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    let built = BUILT.get_or_init(|| Mutex::new(Vec::new()));
    let mut done = built.lock().unwrap_or_else(|e| e.into_inner());
    let key = format!("{pkg}/{name}");
    let dir = profile_dir();
    let path = dir.join("examples").join(name);
    if !done.contains(&key) {
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "--quiet", "-p", pkg, "--example", name]);
        if dir.file_name().is_some_and(|f| f == "release") {
            cmd.arg("--release");
        }
        let out = run_bounded(&mut cmd, 900);
        assert!(
            out.status.success(),
            "building example {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        done.push(key);
    }
    assert!(path.exists(), "{} was not built", path.display());
    path
}

/// Run a command, failing loudly (and killing its process group) after `secs` seconds.
pub fn run_bounded(cmd: &mut Command, secs: u64) -> Output {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let desc = format!("{cmd:?}");
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {desc}: {e}"));
    let pid = child.id() as i32;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(r) => r.expect("waiting for the command"),
        Err(_) => {
            // SAFETY: killing the process group we created for this command.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            panic!("command did not finish within {secs} s: {desc}");
        }
    }
}

/// A value unique to this test run, to find processes a job leaves behind.
pub fn marker(test: &str) -> String {
    format!(
        "{test}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

/// Processes whose environment holds `WEFT_TEST_MARK=<mark>`.
pub fn survivors(mark: &str) -> Vec<u32> {
    let needle = format!("WEFT_TEST_MARK={mark}");
    let mut v = vec![];
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(env) = std::fs::read(e.path().join("environ")) {
            if env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()) {
                // Zombies are gone for our purposes.
                let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
                if !stat.contains(") Z ") {
                    v.push(pid);
                }
            }
        }
    }
    v
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// weft shared-memory objects in /dev/shm that no running job owns: what ended jobs left.
pub fn shm_leftovers() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("weft-") && !launcher_running(n))
        .collect()
}

/// Objects are named `weft-<job name>-...`. The job name is `weft-<launcher pid>-<suffix>`
/// under weft's launcher and `kvs_<mpiexec pid>_...` under Hydra; while that launcher still
/// runs (another test's job, in parallel with this one), its objects are not leftovers: its
/// ranks remove them when the job ends.
pub fn launcher_running(name: &str) -> bool {
    let pid = if let Some(r) = name.strip_prefix("weft-weft-") {
        r.split('-').next()
    } else if let Some(r) = name.strip_prefix("weft-kvs_") {
        r.split('_').next()
    } else {
        None
    };
    let Some(pid) = pid.and_then(|p| p.parse::<u32>().ok()) else {
        return false;
    };
    // A zombie has already cleaned up and exited.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit(')').next().map(|r| r.trim_start().to_string()))
        .is_some_and(|r| !r.starts_with('Z'))
}

/// A directory holding the example providers as `libweft-rdgram.so` (the Rust cdylib, built
/// with this profile on demand) and `libweft-cdgram.so` / `libweft-faulty.so` (C, built by
/// the conformance crate's build script).
pub fn provider_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let prof = profile_dir();
        let mut cmd = Command::new(env!("CARGO"));
        cmd.args(["build", "--quiet", "-p", "weft-example-rdgram"]);
        if prof.file_name().is_some_and(|f| f == "release") {
            cmd.arg("--release");
        }
        let out = run_bounded(&mut cmd, 900);
        assert!(
            out.status.success(),
            "building the rdgram example: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Under target/, so nothing is left in /tmp.
        let dir = prof.join("test-providers");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(
            prof.join("libweft_rdgram.so"),
            dir.join("libweft-rdgram.so"),
        )
        .unwrap();
        for lib in [
            "libweft-cdgram.so",
            "libweft-cdgram10.so",
            "libweft-faulty.so",
        ] {
            std::fs::copy(
                std::path::Path::new(weft_conformance::CDGRAM_DIR).join(lib),
                dir.join(lib),
            )
            .unwrap();
        }
        dir
    })
    .clone()
}

/// A test cannot run here for want of `what`: say so and skip, or fail when
/// `WEFT_REQUIRE_TOOLS=1` (CI), where a skipped test would hide a broken set-up.
pub fn skip(what: &str) {
    if std::env::var_os("WEFT_REQUIRE_TOOLS").is_some_and(|v| v == "1") {
        panic!("required by WEFT_REQUIRE_TOOLS=1 but unavailable: {what}");
    }
    eprintln!("SKIP: {what}");
}

/// `tools/slurm.sh hold` (needs root and Debian's Slurm): a single-node cluster that lives as
/// long as the holder's standard input stays open. Returns the holder and the path of the
/// configuration to export as `SLURM_CONF`, or why there is no cluster (the script's words).
/// Keep the child (and with it the write end of its stdin) for as long as the cluster is
/// needed: when this process exits, however it exits, the pipe closes and the script stops
/// every daemon it started.
pub fn slurm_hold(stdin: Stdio) -> Result<(std::process::Child, PathBuf), String> {
    use std::io::{BufRead, Read};
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tools/slurm.sh");
    let mut child = Command::new("bash")
        .arg(script)
        .arg("hold")
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start tools/slurm.sh: {e}"))?;
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::BufReader::new(out).read_line(&mut line);
        let _ = tx.send(line);
    });
    // The script waits up to 300 s for another holder to stop, then up to 30 s for the node.
    match rx.recv_timeout(Duration::from_secs(400)) {
        Ok(line) if !line.trim().is_empty() => Ok((child, PathBuf::from(line.trim()))),
        Ok(_) => {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            let _ = child.wait();
            Err(err.trim().to_string())
        }
        Err(_) => {
            let _ = child.kill();
            panic!("tools/slurm.sh hold printed no configuration within 400 s");
        }
    }
}

/// Build workspace package `pkg` with the tests' profile (its library lands in
/// [`profile_dir`]).
pub fn build_package(pkg: &str) {
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "--quiet", "-p", pkg]);
    if profile_dir().file_name().is_some_and(|f| f == "release") {
        cmd.arg("--release");
    }
    let o = run_bounded(&mut cmd, 900);
    assert!(o.status.success(), "building {pkg}: {}", stderr(&o));
}

/// Build weft-fi with the tests' profile and install it as libfabric names providers.
pub fn fi_provider_dir(test: &str) -> PathBuf {
    let dir = profile_dir();
    build_package("weft-fi");
    let out = std::env::temp_dir().join(format!("weft-fi-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    std::fs::copy(dir.join("libweft_fi.so"), out.join("libweft-fi.so")).expect("install");
    out
}

/// Whether `tool` is on the path.
pub fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Compile weft-fi's C test program `export/libfabric/tests/c/NAME.c` against libfabric into
/// `dir`; its path.
pub fn fi_program(dir: &std::path::Path, name: &str) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../export/libfabric/tests/c/{name}.c"));
    let bin = dir.join(name);
    let o = run_bounded(
        Command::new("cc")
            .args(["-O1", "-Wall", "-Werror", "-o"])
            .arg(&bin)
            .arg(&src)
            .arg("-lfabric"),
        120,
    );
    assert!(o.status.success(), "compiling {name}.c: {}", stderr(&o));
    bin
}
