//! The `weft` command: `info`, `run`, `bench`, `test`.
//!
//! This binary links every built-in provider; it is the only place that names them all.

use clap::{Parser, Subcommand};
use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

// Every built-in provider, linked so that it registers itself.
use weft_hybrid as _;
use weft_limic as _;
use weft_loopback as _;
use weft_ofi as _;
use weft_shm as _;
use weft_tcp_sim as _;
use weft_verbs_rc as _;
use weft_verbs_ud as _;

mod bench;
mod conformance;
mod info;
mod launch;
mod soft_hca;

#[derive(Parser)]
#[command(
    name = "weft",
    version,
    about = "MPI-style messaging over pluggable fabric providers"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum SoftHcaCmd {
    /// Install libibverbs.so.1 into DIR (default: soft-hca/ next to this program) and print
    /// the shell lines that point programs at it.
    Env {
        /// Where to put libibverbs.so.1.
        #[arg(long, value_name = "DIR")]
        dir: Option<std::path::PathBuf>,
    },
    /// Install as `env` does, then run PROGRAM with libibverbs.so.1 pointing at the soft HCA
    /// and, in a private mount namespace (root), the device node /dev/infiniband/uverbs-weft0
    /// that UCX looks for before it lists a verbs device.
    Exec {
        /// Where to put libibverbs.so.1.
        #[arg(long, value_name = "DIR")]
        dir: Option<std::path::PathBuf>,
        /// The program and its arguments.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<OsString>,
    },
}

#[derive(Subcommand)]
enum Cmd {
    /// List providers (capabilities, limits, native atomics); -e lists every parameter.
    Info {
        /// List every parameter (WEFT_*) with its current value, type, default and doc.
        #[arg(short = 'e', long = "env")]
        env: bool,
        /// Also list each provider's parameters.
        #[arg(short, long)]
        verbose: bool,
    },
    /// Start N ranks of PROGRAM on this host (an embedded PMI-1 launcher).
    Run {
        /// Number of ranks.
        #[arg(short = 'n', long = "np", value_parser = clap::value_parser!(u32).range(1..=4096))]
        n: u32,
        /// Provider for the ranks (sets WEFT_PROVIDER).
        #[arg(long)]
        provider: Option<String>,
        /// Environment variable for the ranks (repeatable).
        #[arg(long = "env", value_name = "K=V", value_parser = parse_kv)]
        env: Vec<(String, String)>,
        /// Prefix every output line with its rank, as "[r] ".
        #[arg(long)]
        tag_output: bool,
        /// Pin rank i to the i-th allowed CPU.
        #[arg(long)]
        bind: bool,
        /// Serve PMI on a loopback TCP port (PMI_PORT) instead of inherited sockets.
        #[arg(long)]
        pmi_port: bool,
        /// End the job after this many seconds (exit status 143, as if SIGTERM ended it).
        #[arg(long, value_name = "SECS", value_parser = parse_secs)]
        timeout: Option<f64>,
        /// A failing rank does not end the others (for fault-tolerance tests); the exit
        /// status is still that of the first failure.
        #[arg(long)]
        keep_going: bool,
        /// Pretend the ranks are on this many hosts (consecutive blocks of ranks; sets
        /// WEFT_HOST_ID per rank): per-host composition on one machine.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
        hosts: u32,
        /// The program and its arguments.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<OsString>,
    },
    /// Benchmark providers side by side: TESTS is a comma-separated list of latency, bw, bibw,
    /// mr, alltoall.
    Bench(Box<BenchArgs>),
    /// Run the provider conformance suite (two-sided, datatypes, rma, atomics, stress) and
    /// print a pass/fail table per group; exits non-zero on any failure.
    Test {
        /// The provider under test (built in, or libweft-NAME.so on the provider path).
        #[arg(long)]
        provider: String,
        /// A directory searched first for provider libraries (prepended to
        /// WEFT_PROVIDER_PATH).
        #[arg(long, value_name = "DIR")]
        provider_path: Option<std::path::PathBuf>,
        /// Number of ranks.
        #[arg(short = 'n', long = "np", default_value_t = 3,
              value_parser = clap::value_parser!(u32).range(2..=256))]
        n: u32,
        /// Run only this group.
        #[arg(long)]
        group: Option<String>,
        /// Run the ranks as threads of this process instead of launching processes.
        #[arg(long)]
        in_process: bool,
        /// Seconds the whole run may take before it is ended.
        #[arg(long, default_value_t = 300.0, value_name = "SECS", value_parser = parse_secs)]
        timeout: f64,
        /// Environment variable for the ranks (repeatable).
        #[arg(long = "env", value_name = "K=V", value_parser = parse_kv)]
        env: Vec<(String, String)>,
        /// Pretend the ranks are on this many hosts (as `weft run --hosts`): the provider
        /// under test carries traffic between hosts, WEFT_SHM_PROVIDER within one.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
        hosts: u32,
    },
    /// The soft HCA as a drop-in libibverbs.so.1 (export/ibverbs): `eval "$(weft soft-hca
    /// env)"` points unmodified verbs programs (ibv_rc_pingpong, perftest) at it.
    SoftHca {
        #[command(subcommand)]
        cmd: SoftHcaCmd,
    },
    /// (internal) The rank side of `weft test`.
    #[command(hide = true)]
    TestRank {
        #[arg(long)]
        group: Option<String>,
    },
    /// (internal) The rank side of a bench job.
    #[command(hide = true)]
    BenchRank {
        #[arg(long)]
        test: String,
        #[arg(long)]
        sizes: String,
        #[arg(long)]
        iters: usize,
        #[arg(long)]
        warmup: usize,
        #[arg(long)]
        window: usize,
        #[arg(long)]
        one_buffer: bool,
        #[arg(long)]
        distinct_buffers: bool,
        #[arg(long)]
        thp: bool,
    },
}

#[derive(clap::Args)]
struct BenchArgs {
    /// Tests to run, comma separated: latency, bw, bibw, mr, alltoall, put_lat, get_lat,
    /// acc_lat, put_bw, get_bw, epoch_mix, epoch_pingpong.
    tests: String,
    /// Providers to compare, comma separated (default: every built-in provider that can run
    /// here).
    #[arg(long)]
    providers: Option<String>,
    /// Message sizes: a list (8,64,4K,1M) or a range of powers of two MIN:MAX.
    #[arg(long)]
    sizes: Option<String>,
    /// Iterations per size for small messages (scaled down for large ones).
    #[arg(long)]
    iters: Option<usize>,
    /// Warm-up iterations per size.
    #[arg(long)]
    warmup: Option<usize>,
    /// Messages in flight for bw, bibw and mr.
    #[arg(long, default_value_t = 64)]
    window: usize,
    /// Latency: each rank sends from the buffer it receives into, as NetPIPE does (the ompi,
    /// mpich and nptcp baselines); default: separate send and receive buffers, as OSU and
    /// ucx_perftest do.
    #[arg(long)]
    one_buffer: bool,
    /// bw, bibw, mr: each message of a window into its own receive buffer, as an application's
    /// would (windows are then capped at 256 MiB); default: the whole window into one receive
    /// buffer, as OSU and ucx_perftest do.
    #[arg(long)]
    distinct_buffers: bool,
    /// Latency: buffers in transparent huge pages (2 MiB-aligned, madvise(MADV_HUGEPAGE)), as
    /// ucx_perftest's are (UCX's `thp` allocation); compare with the ucx:* baselines this way.
    #[arg(long)]
    thp: bool,
    /// Ranks per job.
    #[arg(short = 'n', long = "np", default_value_t = 2)]
    n: u32,
    /// Interleaved repetitions; the table shows their median.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Write every result (median, min, max, reps, env) as JSON.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Write every result as CSV.
    #[arg(long)]
    csv: Option<std::path::PathBuf>,
    /// Draw latency/bandwidth against size, log-log (.svg or .png).
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// Environment for every rank (repeatable), recorded in the results.
    #[arg(long = "env", value_name = "K=V", value_parser = parse_kv)]
    env: Vec<(String, String)>,
    /// A column per variant: NAME:K=V[,K=V...] (repeatable), e.g. agg:WEFT_RMA_SCHED=aggregate;
    /// PROVIDER/NAME:K=V,... adds the column to that provider only, next to its plain one.
    #[arg(long = "variant", value_name = "NAME:K=V,...")]
    variants: Vec<String>,
    /// Third-party baselines, comma separated: ucx:posix, ucx:sysv, ucx:cma, ucx:tcp, ucx:put,
    /// ofi:tcp, ofi:udp, ofi:shm, ompi, ompi:2copy, ompi:tcp, mpich, nptcp; over the soft HCA (weft
    /// soft-hca exec, root): ucx:rc_verbs, ucx:ud_verbs, ucx:rc_ud, ompi:ucx, mpich:ucx.
    #[arg(long)]
    baseline: Option<String>,
    /// Add ratio columns against this column.
    #[arg(long)]
    ratio: Option<String>,
    /// Seconds one job may take before it is killed.
    #[arg(long, default_value_t = 600.0, value_parser = parse_secs)]
    job_timeout: f64,
}

fn parse_variant(s: &str) -> Result<(String, Vec<(String, String)>), String> {
    let (name, kvs) = s
        .split_once(':')
        .ok_or_else(|| format!("--variant '{s}' is not NAME:K=V[,K=V...]"))?;
    if name.is_empty() {
        return Err(format!("--variant '{s}' has no name"));
    }
    let env = kvs
        .split(',')
        .filter(|x| !x.is_empty())
        .map(parse_kv)
        .collect::<Result<Vec<_>, _>>()?;
    Ok((name.to_string(), env))
}

/// Turn the command line into a bench plan, or a usage error naming the problem.
fn bench_plan(a: &BenchArgs) -> Result<bench::Plan, String> {
    use bench::tests::Test;
    let tests = a
        .tests
        .split(',')
        .map(Test::parse)
        .collect::<Result<Vec<_>, _>>()?;
    for t in &tests {
        if a.n < t.min_ranks() {
            return Err(format!(
                "-n {}: {} needs at least {} ranks",
                a.n,
                t.name(),
                t.min_ranks()
            ));
        }
    }
    let sizes = a
        .sizes
        .as_deref()
        .map(bench::tests::parse_sizes)
        .transpose()?;
    if a.reps == 0 || a.window == 0 || a.iters == Some(0) {
        return Err("--reps, --window and --iters must be at least 1".into());
    }
    let (all, _) = weft::registry::providers();
    let mut notes = vec![];
    let providers: Vec<String> = match &a.providers {
        Some(list) => {
            let sel = weft::registry::Selection::parse(list).map_err(|e| e.to_string())?;
            weft::registry::candidates(&sel, &all, None)
                .map_err(|e| e.to_string())?
                .iter()
                .map(|f| f.name().to_string())
                .collect()
        }
        None => {
            let ctx = weft::provider::ProbeContext {
                rank: 0,
                size: a.n,
                in_process: false,
                hosts: 1,
                local_ranks: a.n,
            };
            all.iter()
                .filter(|f| match f.probe(&ctx) {
                    Ok(()) => true,
                    Err(why) => {
                        if f.name() != "loopback" {
                            notes.push(format!("{} skipped: {why}", f.name()));
                        }
                        false
                    }
                })
                .map(|f| f.name().to_string())
                .collect()
        }
    };
    let variants = a
        .variants
        .iter()
        .map(|v| parse_variant(v))
        .collect::<Result<Vec<_>, _>>()?;
    // "PROVIDER/NAME" variants belong to one provider; the others to every provider.
    let (scoped, general): (Vec<_>, Vec<_>) =
        variants.into_iter().partition(|(n, _)| n.contains('/'));
    for (name, _) in &scoped {
        let p = name.split('/').next().unwrap_or_default();
        if !providers.iter().any(|x| x == p) {
            return Err(format!(
                "--variant '{name}': provider '{p}' is not among those compared ({})",
                providers.join(", ")
            ));
        }
    }
    let mut columns = vec![];
    for p in &providers {
        if general.is_empty() {
            columns.push(bench::Column {
                label: p.clone(),
                provider: Some(p.clone()),
                env: vec![],
                baseline: None,
            });
        }
        for (name, env) in &general {
            columns.push(bench::Column {
                label: if providers.len() == 1 {
                    name.clone()
                } else {
                    format!("{p}/{name}")
                },
                provider: Some(p.clone()),
                env: env.clone(),
                baseline: None,
            });
        }
        for (name, env) in scoped
            .iter()
            .filter(|(n, _)| n.split('/').next() == Some(p))
        {
            columns.push(bench::Column {
                label: name.clone(),
                provider: Some(p.clone()),
                env: env.clone(),
                baseline: None,
            });
        }
    }
    if let Some(list) = &a.baseline {
        for name in list.split(',') {
            let b = bench::baseline::Baseline::parse(name)?;
            match b.available() {
                Ok(()) => columns.push(bench::Column {
                    label: b.name.clone(),
                    provider: None,
                    env: vec![],
                    baseline: Some(b),
                }),
                Err(note) => notes.push(note),
            }
        }
    }
    if columns.is_empty() {
        return Err(
            "nothing to compare: no provider can run here and no baseline is installed".into(),
        );
    }
    if let Some(r) = &a.ratio {
        if !columns.iter().any(|c| &c.label == r) {
            return Err(format!(
                "--ratio {r}: no such column (columns: {})",
                columns
                    .iter()
                    .map(|c| c.label.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
    }
    Ok(bench::Plan {
        tests,
        columns,
        sizes,
        iters: a.iters,
        warmup: a.warmup,
        window: a.window,
        one_buffer: a.one_buffer,
        distinct_buffers: a.distinct_buffers,
        thp: a.thp,
        n: a.n,
        reps: a.reps,
        env: a.env.clone(),
        job_timeout: Duration::from_secs_f64(a.job_timeout.max(1.0)),
        notes,
    })
}

fn bench_main(a: &BenchArgs) -> ExitCode {
    let plan = match bench_plan(a) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("weft bench: {e}");
            return ExitCode::from(2);
        }
    };
    let (report, notes) = bench::execute(&plan);
    print!(
        "{}",
        bench::render_tables(&plan, &report, a.ratio.as_deref())
    );
    for n in &notes {
        println!("note: {n}");
    }
    let mut ok = true;
    if let Some(p) = &a.json {
        let r = serde_json::to_string_pretty(&report)
            .map_err(|e| e.to_string())
            .and_then(|j| std::fs::write(p, j + "\n").map_err(|e| e.to_string()));
        if let Err(e) = r {
            eprintln!("weft bench: writing {}: {e}", p.display());
            ok = false;
        }
    }
    if let Some(p) = &a.csv {
        if let Err(e) = std::fs::write(p, bench::to_csv(&report)) {
            eprintln!("weft bench: writing {}: {e}", p.display());
            ok = false;
        }
    }
    if let Some(p) = &a.plot {
        match bench::plot_report(&plan, &report, p) {
            Ok(()) => eprintln!("weft bench: plot written to {}", p.display()),
            Err(e) => {
                eprintln!("weft bench: plot: {e}");
                ok = false;
            }
        }
    }
    if report.results.is_empty() {
        eprintln!("weft bench: no measurement succeeded");
        return ExitCode::from(1);
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// A number of seconds for a command-line timeout: finite, positive, at most 10^9.
fn parse_secs(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(t) if t > 0.0 && t <= 1e9 => Ok(t),
        _ => Err(format!("'{s}' is not a number of seconds from 0 to 10^9")),
    }
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("'{s}' is not K=V")),
    }
}

fn main() -> ExitCode {
    weft::init_logging();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Bench(a) => bench_main(&a),
        Cmd::Test {
            provider,
            provider_path,
            n,
            group,
            in_process,
            timeout,
            env,
            hosts,
        } => conformance::main(&conformance::Args {
            provider,
            provider_path,
            n,
            group,
            in_process,
            timeout,
            env,
            hosts,
        }),
        Cmd::TestRank { group } => conformance::rank_main(group.as_deref()),
        Cmd::BenchRank {
            test,
            sizes,
            iters,
            warmup,
            window,
            one_buffer,
            distinct_buffers,
            thp,
        } => {
            let args = bench::tests::Test::parse(&test).and_then(|t| {
                Ok(bench::rank::RankArgs {
                    test: t,
                    sizes: bench::tests::parse_sizes(&sizes)?,
                    iters,
                    warmup,
                    window,
                    one_buffer,
                    distinct_buffers,
                    thp,
                })
            });
            match args
                .map_err(weft::Error::invalid)
                .and_then(|a| bench::rank::run(&a))
            {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("weft bench-rank: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Cmd::SoftHca {
            cmd: SoftHcaCmd::Exec { dir, command },
        } => {
            eprintln!("weft soft-hca exec: {}", soft_hca::exec(dir, &command));
            ExitCode::from(2)
        }
        Cmd::SoftHca {
            cmd: SoftHcaCmd::Env { dir },
        } => match soft_hca::env(dir) {
            Ok(s) => {
                print!("{s}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("weft soft-hca env: {e}");
                ExitCode::from(2)
            }
        },
        Cmd::Info { env, verbose } => {
            if env {
                let (s, ok) = info::params_report();
                print!("{s}");
                if !ok {
                    return ExitCode::from(2);
                }
                return ExitCode::SUCCESS;
            }
            match info::providers_report(verbose) {
                Ok(s) => {
                    print!("{s}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("weft: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Cmd::Run {
            n,
            provider,
            env,
            tag_output,
            bind,
            pmi_port,
            timeout,
            keep_going,
            hosts,
            command,
        } => {
            // The ranks see the launcher's environment plus --env: so does this check (a
            // provider library named only through --env WEFT_PROVIDER_PATH=... is found).
            // Nothing else runs yet, so changing this process's environment races with no one.
            for (k, v) in env.iter().filter(|(k, _)| k == "WEFT_PROVIDER_PATH") {
                std::env::set_var(k, v);
            }
            if let Some(p) = &provider {
                let (all, failures) = weft::registry::providers();
                let sel = match weft::registry::Selection::parse(p) {
                    Ok(s) => s,
                    Err(e) => {
                        eprintln!("weft run: {e}");
                        return ExitCode::from(2);
                    }
                };
                if let Err(e) = weft::registry::candidates_with(&sel, &all, &failures, None) {
                    eprintln!("weft run: {e}");
                    return ExitCode::from(2);
                }
            }
            let mut spec = launch::Spec::new(n, command[0].clone());
            spec.args = command[1..].to_vec();
            spec.env = env;
            spec.provider = provider;
            spec.tag_output = tag_output;
            spec.bind = bind;
            spec.pmi_port = pmi_port;
            spec.keep_going = keep_going;
            spec.hosts = hosts;
            spec.timeout = timeout.map(Duration::from_secs_f64);
            match launch::run(&spec) {
                Ok(o) => ExitCode::from(o.code.clamp(0, 255) as u8),
                Err(e) => {
                    eprintln!("weft run: {e}");
                    ExitCode::from(1)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(args: &[&str]) -> Result<bench::Plan, String> {
        let cli =
            Cli::try_parse_from(["weft", "bench"].iter().chain(args)).map_err(|e| e.to_string())?;
        match cli.cmd {
            Cmd::Bench(a) => bench_plan(&a),
            _ => unreachable!("parsed a bench command"),
        }
    }

    fn labels(p: &bench::Plan) -> Vec<(String, Vec<(String, String)>)> {
        p.columns
            .iter()
            .map(|c| (c.label.clone(), c.env.clone()))
            .collect()
    }

    fn kv(k: &str, v: &str) -> (String, String) {
        (k.to_string(), v.to_string())
    }

    #[test]
    fn variants_replace_or_join_plain_columns() {
        let p = plan(&["latency", "--providers", "shm,limic", "--variant", "a:X=1"]).unwrap();
        assert_eq!(
            labels(&p),
            vec![
                ("shm/a".into(), vec![kv("X", "1")]),
                ("limic/a".into(), vec![kv("X", "1")])
            ]
        );
        let p = plan(&[
            "latency",
            "--providers",
            "shm,limic",
            "--variant",
            "limic/push:WEFT_LIMIC_PULL=0,Y=2",
            "--ratio",
            "limic/push",
        ])
        .unwrap();
        assert_eq!(
            labels(&p),
            vec![
                ("shm".into(), vec![]),
                ("limic".into(), vec![]),
                (
                    "limic/push".into(),
                    vec![kv("WEFT_LIMIC_PULL", "0"), kv("Y", "2")]
                )
            ]
        );
        let e = plan(&[
            "latency",
            "--providers",
            "shm",
            "--variant",
            "tcp-sim/x:A=1",
        ])
        .err()
        .unwrap();
        assert!(e.contains("'tcp-sim' is not among"), "{e}");
        let e = plan(&["latency", "--variant", "noname"]).err().unwrap();
        assert!(e.contains("NAME:K=V"), "{e}");
    }
}
