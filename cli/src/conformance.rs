//! `weft test`: the provider conformance suite (crate `weft-conformance`) across processes
//! through the embedded launcher, or in-process with `--in-process`.
//!
//! Each rank runs the hidden `test-rank` subcommand; rank 0 prints one `CHECK` line per check
//! once all ranks agree on it, and the launcher side turns those lines into the table. A rank
//! that dies or hangs ends the job (the launcher's failure handling and `--timeout`); checks
//! that never reported are listed as failed, "not run".

use crate::launch;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use weft_conformance::{Outcome, CHECKS};

/// Seconds one blocking operation of a check may wait across processes (`WEFT_TIMEOUT` for
/// the ranks, unless given).
const CHECK_TIMEOUT: u32 = 60;

/// What `weft test` was asked to do.
pub struct Args {
    pub provider: String,
    pub provider_path: Option<PathBuf>,
    pub n: u32,
    pub group: Option<String>,
    pub in_process: bool,
    pub timeout: f64,
    pub env: Vec<(String, String)>,
    /// Pretend hosts (`--hosts`).
    pub hosts: u32,
}

/// `WEFT_PROVIDER_PATH` with `dir` first.
fn provider_path(dir: &Option<PathBuf>) -> Option<OsString> {
    let dir = dir.as_ref()?;
    let mut all = vec![dir.clone()];
    if let Some(old) = std::env::var_os("WEFT_PROVIDER_PATH") {
        all.extend(std::env::split_paths(&old));
    }
    std::env::join_paths(all).ok()
}

/// Check the request before launching anything: a known group, a provider that exists (with
/// the loader's reason when a library named like it was refused).
fn validate(a: &Args) -> Result<(), String> {
    if let Some(g) = &a.group {
        let groups = weft_conformance::groups();
        if !groups.contains(&g.as_str()) {
            return Err(format!(
                "--group {g}: no such group (groups: {})",
                groups.join(", ")
            ));
        }
    }
    if let Some(d) = &a.provider_path {
        if !d.is_dir() {
            return Err(format!("--provider-path {}: not a directory", d.display()));
        }
    }
    let (all, failures) = weft::registry::providers();
    if let Some(f) = all.iter().find(|f| f.name() == a.provider) {
        if !a.in_process {
            let ctx = weft::provider::ProbeContext {
                rank: 0,
                size: a.n,
                in_process: false,
                hosts: 1,
                local_ranks: a.n,
            };
            if let Err(why) = f.probe(&ctx) {
                return Err(format!(
                    "provider '{}' cannot run across processes here: {why} (try --in-process)",
                    a.provider
                ));
            }
        }
    } else {
        let lib = format!("libweft-{}.so", a.provider);
        if let Some(f) = failures.iter().find(|f| {
            f.path
                .file_name()
                .is_some_and(|n| n.to_string_lossy() == lib)
        }) {
            return Err(format!(
                "provider '{}' failed to load from {}: {}",
                a.provider,
                f.path.display(),
                f.error
            ));
        }
        let names: Vec<&str> = all.iter().map(|f| f.name()).collect();
        return Err(format!(
            "unknown provider '{}' (known: {}; libraries are found as libweft-<name>.so in \
             --provider-path or WEFT_PROVIDER_PATH)",
            a.provider,
            names.join(", ")
        ));
    }
    Ok(())
}

/// The checks `group` selects.
fn selected(group: Option<&str>) -> Vec<(&'static str, &'static str)> {
    CHECKS
        .iter()
        .filter(|(g, _, _)| group.is_none_or(|x| x == *g))
        .map(|(g, t, _)| (*g, *t))
        .collect()
}

/// What a run across processes gave: the outcomes, why the job ended early if it did, and
/// the provider the ranks ended up with (a composition on several hosts: `net+host`).
type Across = (Vec<Outcome>, Option<String>, Option<String>);

/// Outcomes of a run across processes, and why the job ended early if it did.
fn across_processes(a: &Args) -> Result<Across, String> {
    let exe = std::env::current_exe().map_err(|e| format!("finding this executable: {e}"))?;
    let mut spec = launch::Spec::new(a.n, exe);
    spec.args = vec!["test-rank".into()];
    if let Some(g) = &a.group {
        spec.args.push("--group".into());
        spec.args.push(g.into());
    }
    spec.provider = Some(a.provider.clone());
    spec.env = a.env.clone();
    spec.hosts = a.hosts;
    // Ranks inherit WEFT_PROVIDER_PATH, which `main` has set with --provider-path first.
    // A bound on every blocking wait: a check that loses a message fails with a timeout
    // instead of hanging the run (unless the caller chose a bound).
    if !a.env.iter().any(|(k, _)| k == "WEFT_TIMEOUT") && std::env::var_os("WEFT_TIMEOUT").is_none()
    {
        spec.env
            .push(("WEFT_TIMEOUT".into(), format!("{}", CHECK_TIMEOUT)));
    }
    spec.capture = true;
    spec.quiet = true;
    spec.timeout = Some(Duration::from_secs_f64(a.timeout.max(1.0)));
    let o = launch::run(&spec).map_err(|e| format!("launching: {e}"))?;
    let text =
        String::from_utf8_lossy(o.stdout.first().map(Vec::as_slice).unwrap_or(&[])).into_owned();
    let mut got: Vec<Outcome> = text.lines().filter_map(Outcome::from_line).collect();
    let used = text
        .lines()
        .find_map(|l| l.strip_prefix("PROVIDER "))
        .map(str::to_string);
    let mut ended = None;
    if o.code != 0 || got.len() < selected(a.group.as_deref()).len() {
        ended = Some(
            o.failure
                .clone()
                .unwrap_or_else(|| format!("the job exited with status {}", o.code)),
        );
        // Every check that never reported failed: the one running when the job ended did not
        // finish (with the reason: a timeout, a dead rank), the ones after it did not run.
        let why = ended.clone().unwrap_or_default();
        let mut first = true;
        for (g, t) in selected(a.group.as_deref()) {
            if !got.iter().any(|x| x.group == g && x.test == t) {
                got.push(Outcome {
                    group: g,
                    test: t,
                    ok: false,
                    detail: if std::mem::replace(&mut first, false) {
                        format!("did not finish: {why}")
                    } else {
                        "not run".into()
                    },
                });
            }
        }
    }
    Ok((got, ended, used))
}

fn in_process(a: &Args) -> Result<Vec<Outcome>, String> {
    for (k, v) in &a.env {
        std::env::set_var(k, v);
    }
    // What a refusal names as asked for.
    std::env::set_var("WEFT_PROVIDER", &a.provider);
    let group = a.group.clone();
    let opts = weft_testing::Options::default();
    weft_testing::try_world_dyn_with(a.n, &a.provider, &opts, |c| {
        weft_conformance::run(c, group.as_deref())
    })
    .map(|r| r.into_iter().next().unwrap_or_default())
}

/// `weft test`.
pub fn main(a: &Args) -> ExitCode {
    if let Some(p) = provider_path(&a.provider_path) {
        // Read by the registry of this process (for validation and --in-process).
        std::env::set_var("WEFT_PROVIDER_PATH", p);
    }
    if let Err(e) = validate(a) {
        eprintln!("weft test: {e}");
        return ExitCode::from(2);
    }
    let (outcomes, ended, used) = if a.in_process {
        match in_process(a) {
            Ok(o) => (o, None, None),
            Err(e) => {
                eprintln!("weft test: {e}");
                return ExitCode::from(2);
            }
        }
    } else {
        match across_processes(a) {
            Ok(o) => o,
            Err(e) => {
                eprintln!("weft test: {e}");
                return ExitCode::from(1);
            }
        }
    };
    let where_ = if a.in_process {
        format!("{} ranks in-process", a.n)
    } else if a.hosts > 1 {
        format!("{} processes on {} pretend hosts", a.n, a.hosts)
    } else {
        format!("{} processes", a.n)
    };
    let name = used.unwrap_or_else(|| a.provider.clone());
    print!(
        "{}",
        weft_conformance::table(&format!("{name} ({where_})"), &outcomes)
    );
    if let Some(why) = ended {
        println!("the job ended early: {why}");
    }
    if !outcomes.is_empty() && outcomes.iter().all(|o| o.ok) {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The rank side: run the suite and, on rank 0, print each agreed outcome as a line.
pub fn rank_main(group: Option<&str>) -> ExitCode {
    let world = match weft::init() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("weft test-rank: {e}");
            return ExitCode::from(1);
        }
    };
    let c = world.comm();
    let me = c.rank();
    if me == 0 {
        println!("PROVIDER {}", c.provider_name());
    }
    weft_conformance::run_with(c, group, |o| {
        if me == 0 {
            println!("{}", o.to_line());
        }
    });
    match world.finalize() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weft test-rank: finalize: {e}");
            ExitCode::from(1)
        }
    }
}
