//! The `weft` command: `info`, `run`, `bench`, `test`.
//!
//! This binary links every built-in provider; it is the only place that names them all.

use clap::{Parser, Subcommand};
use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

// Every built-in provider, linked so that it registers itself.
use weft_shm as _;
use weft_tcp_sim as _;

mod info;
mod launch;

#[derive(Parser)]
#[command(name = "weft", version, about = "MPI-style messaging over pluggable fabric providers")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
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
        /// End the job after this many seconds.
        #[arg(long, value_name = "SECS")]
        timeout: Option<f64>,
        /// The program and its arguments.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<OsString>,
    },
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
            command,
        } => {
            if let Some(p) = &provider {
                let (all, _) = weft::registry::providers();
                let sel = match weft::registry::Selection::parse(p) {
                    Ok(s) => s,
                    Err(e) => {
                        eprintln!("weft run: {e}");
                        return ExitCode::from(2);
                    }
                };
                if let Err(e) = weft::registry::candidates(&sel, &all, None) {
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
            spec.timeout = timeout.filter(|t| *t > 0.0).map(Duration::from_secs_f64);
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
