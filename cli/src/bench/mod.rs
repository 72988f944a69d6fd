//! `weft bench`: the same tests over several providers (and variants and third-party
//! baselines) in one invocation, side by side.
//!
//! Every (test, column) pair is one job of the embedded launcher per repetition, ranks pinned
//! to cores. Repetitions are interleaved — rep 1 of every column, then rep 2, ... with the
//! column order rotated each time — because this kind of machine drifts between fast and slow
//! phases; the table shows the median over repetitions, the JSON/CSV also min and max.

pub mod baseline;
pub mod plot;
pub mod rank;
pub mod tests;
pub mod verbs;

use crate::launch;
use baseline::Baseline;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;
use tests::{fmt_size, Test};

/// A column of the table.
#[derive(Debug, Clone)]
pub struct Column {
    pub label: String,
    pub provider: Option<String>,
    pub env: Vec<(String, String)>,
    pub baseline: Option<Baseline>,
}

/// Everything `weft bench` was asked to do.
#[derive(Debug, Clone)]
pub struct Plan {
    pub tests: Vec<Test>,
    pub columns: Vec<Column>,
    pub sizes: Option<Vec<usize>>,
    pub iters: Option<usize>,
    pub warmup: Option<usize>,
    pub window: usize,
    /// Latency ping-pong from and into one buffer per rank (NetPIPE's convention).
    pub one_buffer: bool,
    /// Streaming tests: a receive buffer per message of the window (default: one for all).
    pub distinct_buffers: bool,
    /// Latency: buffers in transparent huge pages.
    pub thp: bool,
    pub n: u32,
    pub reps: usize,
    pub env: Vec<(String, String)>,
    pub job_timeout: Duration,
    pub notes: Vec<String>,
}

/// One row of the results (JSON and CSV).
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub test: String,
    pub provider: String,
    pub baseline: bool,
    pub size: usize,
    pub unit: String,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub reps: usize,
    /// weft's buffer convention for this test ([`buffers`]); empty for baselines.
    pub buffers: String,
    pub env: BTreeMap<String, String>,
}

/// How `test` uses buffers under `plan`, for the report: (description, whether it is the
/// non-default choice and so goes into the table header too). Empty for tests without a choice.
pub fn buffers(plan: &Plan, test: Test) -> (&'static str, bool) {
    match test {
        Test::Latency if plan.one_buffer && plan.thp => {
            ("one buffer per rank, in transparent huge pages", true)
        }
        Test::Latency if plan.thp => (
            "separate send and receive buffers, in transparent huge pages",
            true,
        ),
        Test::Latency if plan.one_buffer => ("one buffer per rank", true),
        Test::Latency => ("separate send and receive buffers", false),
        Test::Bw | Test::Bibw | Test::Mr if plan.distinct_buffers => {
            ("a receive buffer per message", true)
        }
        Test::Bw | Test::Bibw | Test::Mr => ("one receive buffer per window", false),
        _ => ("", false),
    }
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub machine: BTreeMap<String, String>,
    pub results: Vec<Row>,
    /// The provider's counters of each weft job (test, column), summed over its ranks, from the
    /// last repetition: the hybrid provider's messages and bytes per channel, RC connections,
    /// memory counters... (JSON only).
    pub counters: Vec<JobCounters>,
}

/// One job's provider counters.
#[derive(Debug, Clone, Serialize)]
pub struct JobCounters {
    pub test: String,
    pub provider: String,
    pub counters: BTreeMap<String, u64>,
}

fn read_trim(p: &str) -> String {
    std::fs::read_to_string(p)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Facts about the machine for the report.
pub fn machine() -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    m.insert("host".into(), read_trim("/proc/sys/kernel/hostname"));
    m.insert("kernel".into(), read_trim("/proc/sys/kernel/osrelease"));
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default();
    m.insert("cpu".into(), cpu);
    m.insert(
        "cpus".into(),
        std::thread::available_parallelism()
            .map(|n| n.get().to_string())
            .unwrap_or_default(),
    );
    m.insert("date".into(), utc_now());
    m.insert("weft".into(), env!("CARGO_PKG_VERSION").into());
    m
}

/// `YYYY-MM-DD HH:MM UTC` without a date crate (civil-from-days).
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        rem / 3600,
        (rem % 3600) / 60
    )
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Format a value with about three significant digits.
pub fn fmt_val(x: f64) -> String {
    if !x.is_finite() {
        return "-".into();
    }
    let a = x.abs();
    if a >= 1e6 {
        format!("{:.3e}", x)
    } else if a >= 100.0 {
        format!("{x:.0}")
    } else if a >= 10.0 {
        format!("{x:.1}")
    } else if a >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

/// A job's provider counters by name.
type Counters = BTreeMap<String, u64>;

fn parse_counters(out: &[u8]) -> Counters {
    String::from_utf8_lossy(out)
        .lines()
        .filter_map(|l| l.strip_prefix("COUNTERS "))
        .flat_map(|l| l.split_whitespace())
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

fn parse_results(out: &[u8]) -> Vec<(usize, f64)> {
    String::from_utf8_lossy(out)
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            (it.next()? == "RESULT").then_some(())?;
            Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
        })
        .collect()
}

/// Run one job of `test` for a weft column.
fn run_weft(
    plan: &Plan,
    test: Test,
    col: &Column,
    sizes: &[usize],
) -> Result<(Vec<(usize, f64)>, Counters), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut spec = launch::Spec::new(plan.n, exe);
    let csv: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
    spec.args = vec![
        "bench-rank".into(),
        "--test".into(),
        test.name().into(),
        "--sizes".into(),
        csv.join(",").into(),
        "--iters".into(),
        plan.iters
            .unwrap_or(test.default_iters())
            .to_string()
            .into(),
        "--warmup".into(),
        plan.warmup
            .unwrap_or((plan.iters.unwrap_or(test.default_iters()) / 10).max(2))
            .to_string()
            .into(),
        "--window".into(),
        plan.window.to_string().into(),
    ];
    if plan.one_buffer {
        spec.args.push("--one-buffer".into());
    }
    if plan.distinct_buffers {
        spec.args.push("--distinct-buffers".into());
    }
    if plan.thp {
        spec.args.push("--thp".into());
    }
    spec.provider = col.provider.clone();
    spec.env = plan.env.iter().chain(col.env.iter()).cloned().collect();
    spec.bind = true;
    spec.capture = true;
    spec.quiet = true;
    spec.timeout = Some(plan.job_timeout);
    let o = launch::run(&spec).map_err(|e| e.to_string())?;
    if o.code != 0 {
        return Err(o
            .failure
            .unwrap_or_else(|| format!("exit status {}", o.code)));
    }
    let r = parse_results(&o.stdout[0]);
    if r.is_empty() {
        return Err("no results printed".into());
    }
    Ok((r, parse_counters(&o.stdout[0])))
}

/// Run the plan; returns the report and notes for skipped or failed parts.
pub fn execute(plan: &Plan) -> (Report, Vec<String>) {
    let mut notes = plan.notes.clone();
    // samples[(test, column)][size] -> values
    let mut samples: BTreeMap<(usize, usize), BTreeMap<usize, Vec<f64>>> = BTreeMap::new();
    let mut dead: Vec<(usize, usize)> = Vec::new();
    let mut counters: BTreeMap<(usize, usize), BTreeMap<String, u64>> = BTreeMap::new();
    let work = std::env::temp_dir();
    let jobs: Vec<(usize, usize)> = (0..plan.tests.len())
        .flat_map(|t| (0..plan.columns.len()).map(move |c| (t, c)))
        .filter(|(t, c)| {
            plan.columns[*c]
                .baseline
                .as_ref()
                .is_none_or(|b| b.supports(plan.tests[*t]))
        })
        .collect();
    let bar = indicatif::ProgressBar::new((jobs.len() * plan.reps) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} jobs, {elapsed} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    for rep in 0..plan.reps {
        let k = jobs.len().max(1);
        for j in 0..jobs.len() {
            // Rotate the order every repetition so no column always runs first.
            let (ti, ci) = jobs[(j + rep) % k];
            let test = plan.tests[ti];
            let col = &plan.columns[ci];
            bar.set_message(format!("{} {} rep {}", test.name(), col.label, rep + 1));
            if dead.contains(&(ti, ci)) {
                bar.inc(1);
                continue;
            }
            let sizes = plan.sizes.clone().unwrap_or_else(|| test.default_sizes());
            let r = match &col.baseline {
                Some(b) => b.run(test, &sizes, &work),
                None => run_weft(plan, test, col, &sizes).map(|(r, k)| {
                    if !k.is_empty() {
                        counters.insert((ti, ci), k);
                    }
                    r
                }),
            };
            match r {
                Ok(vals) => {
                    let e = samples.entry((ti, ci)).or_default();
                    for (s, v) in vals {
                        e.entry(s).or_default().push(v);
                    }
                }
                Err(e) => {
                    notes.push(format!("{} on {} failed: {e}", test.name(), col.label));
                    dead.push((ti, ci));
                }
            }
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let mut results = Vec::new();
    for ((ti, ci), by_size) in samples {
        let test = plan.tests[ti];
        let col = &plan.columns[ci];
        for (size, mut v) in by_size {
            let (mn, mx) = v
                .iter()
                .fold((f64::MAX, f64::MIN), |a, x| (a.0.min(*x), a.1.max(*x)));
            let reps = v.len();
            results.push(Row {
                test: test.name().into(),
                provider: col.label.clone(),
                baseline: col.baseline.is_some(),
                size,
                unit: test.unit().into(),
                median: median(&mut v),
                min: mn,
                max: mx,
                reps,
                buffers: match col.baseline {
                    Some(_) => String::new(),
                    None => buffers(plan, test).0.into(),
                },
                env: plan.env.iter().chain(col.env.iter()).cloned().collect(),
            });
        }
    }
    let counters = counters
        .into_iter()
        .map(|((ti, ci), counters)| JobCounters {
            test: plan.tests[ti].name().into(),
            provider: plan.columns[ci].label.clone(),
            counters,
        })
        .collect();
    (
        Report {
            machine: machine(),
            results,
            counters,
        },
        notes,
    )
}

/// The OSU-style tables: a size column, then one column per provider.
pub fn render_tables(plan: &Plan, report: &Report, ratio_to: Option<&str>) -> String {
    let mut s = String::new();
    let m = &report.machine;
    for test in &plan.tests {
        let cols: Vec<&Column> = plan
            .columns
            .iter()
            .filter(|c| {
                report
                    .results
                    .iter()
                    .any(|r| r.test == test.name() && r.provider == c.label)
            })
            .collect();
        if cols.is_empty() {
            continue;
        }
        writeln!(
            s,
            "# {}: {} — median of {} interleaved repetitions, {} ranks{}",
            test.name(),
            test.describe(),
            plan.reps,
            plan.n,
            match buffers(plan, *test) {
                (b, true) => format!(", {b}"),
                _ => String::new(),
            }
        )
        .unwrap();
        writeln!(
            s,
            "# {}, {} CPUs, {}, {}",
            m.get("cpu").map_or("", |x| x),
            m.get("cpus").map_or("", |x| x),
            m.get("kernel").map_or("", |x| x),
            m.get("date").map_or("", |x| x)
        )
        .unwrap();
        let base = ratio_to.and_then(|r| cols.iter().position(|c| c.label == r));
        let ratio_len = base.map_or(0, |b| cols[b].label.len() + 1);
        let width = cols
            .iter()
            .map(|c| c.label.len() + ratio_len + 2)
            .max()
            .unwrap_or(10)
            .max(10);
        write!(s, "{:<10}", "size").unwrap();
        for c in &cols {
            let mark = if c.baseline.is_some() { "*" } else { "" };
            write!(s, "{:>width$}", format!("{}{mark}", c.label)).unwrap();
        }
        if let Some(b) = base {
            for c in &cols {
                if c.label != cols[b].label {
                    write!(s, "{:>width$}", format!("{}/{}", c.label, cols[b].label)).unwrap();
                }
            }
        }
        writeln!(s).unwrap();
        let mut sizes: Vec<usize> = report
            .results
            .iter()
            .filter(|r| r.test == test.name())
            .map(|r| r.size)
            .collect();
        sizes.sort();
        sizes.dedup();
        let get = |c: &Column, size: usize| {
            report
                .results
                .iter()
                .find(|r| r.test == test.name() && r.provider == c.label && r.size == size)
                .map(|r| r.median)
        };
        for size in sizes {
            write!(s, "{:<10}", fmt_size(size)).unwrap();
            for c in &cols {
                write!(s, "{:>width$}", get(c, size).map_or("-".into(), fmt_val)).unwrap();
            }
            if let Some(b) = base {
                for c in &cols {
                    if c.label != cols[b].label {
                        let r = match (get(c, size), get(cols[b], size)) {
                            (Some(x), Some(y)) if y != 0.0 => format!("{:.2}", x / y),
                            _ => "-".into(),
                        };
                        write!(s, "{r:>width$}").unwrap();
                    }
                }
            }
            writeln!(s).unwrap();
        }
        if cols.iter().any(|c| c.baseline.is_some()) {
            let pp = cols
                .iter()
                .filter(|c| c.baseline.as_ref().is_some_and(|b| b.pingpong_bw()))
                .map(|c| c.label.as_str())
                .collect::<Vec<_>>();
            write!(s, "* third-party baseline").unwrap();
            if test.higher_is_better() && !pp.is_empty() {
                write!(
                    s,
                    "; {} bandwidth is size / one-way ping-pong time",
                    pp.join(", ")
                )
                .unwrap();
            }
            writeln!(s).unwrap();
        }
        writeln!(s).unwrap();
    }
    s
}

pub fn to_csv(report: &Report) -> String {
    let mut s = String::from("test,provider,baseline,size,unit,median,min,max,reps,buffers,env\n");
    for r in &report.results {
        let env: Vec<String> = r.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        writeln!(
            s,
            "{},{},{},{},{},{},{},{},{},{},\"{}\"",
            r.test,
            r.provider,
            r.baseline,
            r.size,
            r.unit,
            r.median,
            r.min,
            r.max,
            r.reps,
            r.buffers,
            env.join(" ")
        )
        .unwrap();
    }
    s
}

/// Plot panels from a report.
pub fn plot_report(plan: &Plan, report: &Report, path: &std::path::Path) -> Result<(), String> {
    let panels: Vec<(Test, Vec<plot::Series>)> = plan
        .tests
        .iter()
        .map(|t| {
            let series = plan
                .columns
                .iter()
                .map(|c| plot::Series {
                    label: c.label.clone(),
                    baseline: c.baseline.is_some(),
                    points: report
                        .results
                        .iter()
                        .filter(|r| r.test == t.name() && r.provider == c.label)
                        .map(|r| (r.size, r.median))
                        .collect(),
                })
                .filter(|s| !s.points.is_empty())
                .collect();
            (*t, series)
        })
        .collect();
    plot::plot(path, "weft bench", &panels)
}

#[cfg(test)]
mod t {
    use super::*;

    #[test]
    fn median_and_format() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&mut []).is_nan());
        assert_eq!(fmt_val(0.1234), "0.123");
        assert_eq!(fmt_val(5.678), "5.68");
        assert_eq!(fmt_val(12345.6), "12346");
        assert_eq!(fmt_val(f64::NAN), "-");
    }

    #[test]
    fn results_parse() {
        let k = parse_counters(b"RESULT 8 1\nCOUNTERS rc_sr_msgs=12 ud_sr_msgs=3 bad=x\n");
        assert_eq!(k.len(), 2);
        assert_eq!(k["rc_sr_msgs"], 12);
        let r = parse_results(b"noise\nRESULT 8 0.25\nRESULT 1024 11.5\nRESULT x y\n");
        assert_eq!(r, vec![(8, 0.25), (1024, 11.5)]);
    }

    #[test]
    fn tables_have_a_column_per_provider_and_ratios() {
        let col = |label: &str, baseline: bool| Column {
            label: label.into(),
            provider: (!baseline).then(|| label.into()),
            env: vec![],
            baseline: baseline.then(|| Baseline::parse(label).unwrap()),
        };
        let plan = Plan {
            tests: vec![Test::Latency, Test::Bw],
            columns: vec![
                col("shm", false),
                col("limic/push", false),
                col("ucx:cma", true),
            ],
            sizes: None,
            iters: None,
            warmup: None,
            window: 64,
            one_buffer: false,
            distinct_buffers: false,
            thp: false,
            n: 2,
            reps: 5,
            env: vec![],
            job_timeout: Duration::from_secs(1),
            notes: vec![],
        };
        let mut results = vec![];
        for (test, unit, vals) in [
            (
                "latency",
                "us",
                [(8, [0.41, 0.79, 0.45]), (65536, [11.4, 6.24, 7.2])],
            ),
            (
                "bw",
                "MB/s",
                [(8, [9.5, 4.1, 8.8]), (65536, [8566.0, 10409.0, 13753.0])],
            ),
        ] {
            for (size, v) in vals {
                for (c, x) in plan.columns.iter().zip(v) {
                    results.push(Row {
                        test: test.into(),
                        provider: c.label.clone(),
                        baseline: c.baseline.is_some(),
                        size,
                        unit: unit.into(),
                        median: x,
                        min: x,
                        max: x,
                        reps: 5,
                        buffers: String::new(),
                        env: BTreeMap::new(),
                    });
                }
            }
        }
        let machine = [
            ("cpu", "Test CPU"),
            ("cpus", "2"),
            ("kernel", "6.0"),
            ("date", "2026-11-21 12:00 UTC"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let report = Report {
            machine,
            results,
            counters: vec![],
        };
        insta::assert_snapshot!(render_tables(&plan, &report, Some("shm")));
    }

    #[test]
    fn utc_format() {
        let s = utc_now();
        assert_eq!(s.len(), "2026-11-21 15:00 UTC".len(), "{s}");
        assert!(s.starts_with("20"));
    }
}
