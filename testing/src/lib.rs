//! In-process worlds for tests: `n` ranks as `n` threads of this process.
//!
//! ```
//! let sums = weft_testing::world(4, |comm| {
//!     let mut out = [0u64];
//!     comm.allreduce(&[comm.rank() as u64], &mut out, weft::Op::Sum).unwrap();
//!     out[0]
//! });
//! assert_eq!(sums, vec![6; 4]);
//! ```
//!
//! Every wait is bounded: the engine, the bootstrap fences and the whole world time out (60 s
//! by default) and fail loudly instead of hanging a test run. A panicking rank is reported with
//! its rank number, and its peers see it as failed instead of waiting for it.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::time::Duration;
use weft::bootstrap::{Bootstrap, InProcessJob};
use weft::registry::{select_and_open, Selection};
use weft::{Comm, DynProvider, EngineConfig, Provider, Result, World};
use weft_loopback::{Loopback, LoopbackConfig};

/// Settings of an in-process world.
#[derive(Debug, Clone)]
pub struct Options {
    /// Bound on every wait (engine waits and bootstrap fences).
    pub timeout: Duration,
    /// Loopback settings (eager limit, mailbox depth, RMA).
    pub loopback: LoopbackConfig,
    /// Engine settings; `timeout` above overrides its timeout.
    pub engine: EngineConfig,
    /// The test makes peers fail on purpose: an error from `finalize` (whose barrier needs
    /// every rank) is not a test failure.
    pub finalize_may_fail: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            timeout: Duration::from_secs(60),
            loopback: LoopbackConfig::default(),
            engine: EngineConfig {
                spin: 50,
                ..EngineConfig::default()
            },
            finalize_may_fail: false,
        }
    }
}

/// Run `f` on `n` ranks over the loopback provider through the **static** path
/// (`Comm<Loopback>`); returns each rank's result in rank order.
pub fn world<R: Send>(n: u32, f: impl Fn(&Comm<Loopback>) -> R + Sync) -> Vec<R> {
    world_with(n, &Options::default(), f)
}

/// Like [`world`] with explicit options.
pub fn world_with<R: Send>(
    n: u32,
    opts: &Options,
    f: impl Fn(&Comm<Loopback>) -> R + Sync,
) -> Vec<R> {
    let lb = opts.loopback.clone();
    run(n, opts, move |b| Loopback::open_with(b, &lb), f)
}

/// Run `f` on `n` ranks through the **dynamic** path: the provider is chosen at run time by
/// name through the registry (`Comm<Box<dyn Provider>>`).
pub fn world_dyn<R: Send>(
    n: u32,
    provider: &str,
    f: impl Fn(&Comm<DynProvider>) -> R + Sync,
) -> Vec<R> {
    world_dyn_with(n, provider, &Options::default(), f)
}

/// Like [`world_dyn`] with explicit options (the loopback settings apply when it is chosen).
pub fn world_dyn_with<R: Send>(
    n: u32,
    provider: &str,
    opts: &Options,
    f: impl Fn(&Comm<DynProvider>) -> R + Sync,
) -> Vec<R> {
    try_world_dyn_with(n, provider, opts, f).unwrap_or_else(|e| panic!("{e}"))
}

/// [`world_dyn_with`], with a provider that cannot be opened (or named) an error, not a panic:
/// what `weft test --in-process` reports.
pub fn try_world_dyn_with<R: Send>(
    n: u32,
    provider: &str,
    opts: &Options,
    f: impl Fn(&Comm<DynProvider>) -> R + Sync,
) -> std::result::Result<Vec<R>, String> {
    let sel = Selection::parse(provider).map_err(|e| e.to_string())?;
    let lb = opts.loopback.clone();
    let prov = provider.to_string();
    try_run(
        n,
        opts,
        move |b| {
            if prov == "loopback" {
                // Honour the explicit loopback options on the dynamic path too.
                return Ok(Box::new(Loopback::open_with(b, &lb)?) as DynProvider);
            }
            select_and_open(b, &sel).map(|(p, _)| p)
        },
        f,
    )
}

fn run<P: Provider, R: Send>(
    n: u32,
    opts: &Options,
    open: impl Fn(&mut dyn Bootstrap) -> Result<P> + Sync,
    f: impl Fn(&Comm<P>) -> R + Sync,
) -> Vec<R> {
    try_run(n, opts, open, f).unwrap_or_else(|e| panic!("{e}"))
}

/// [`run`], with a provider that cannot be opened (on any rank) an error rather than a panic:
/// the first rank's own reason.
fn try_run<P: Provider, R: Send>(
    n: u32,
    opts: &Options,
    open: impl Fn(&mut dyn Bootstrap) -> Result<P> + Sync,
    f: impl Fn(&Comm<P>) -> R + Sync,
) -> std::result::Result<Vec<R>, String> {
    assert!(n > 0, "a world needs at least one rank");
    let unopened = std::sync::Mutex::new(Vec::<(u32, String)>::new());
    let job = InProcessJob::new(n, opts.timeout);
    let mut cfg = opts.engine.clone();
    cfg.timeout = Some(opts.timeout);
    let may_fail = opts.finalize_may_fail;
    let results: Vec<std::thread::Result<Option<R>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let job = job.clone();
                let (open, f, cfg, unopened) = (&open, &f, cfg.clone(), &unopened);
                std::thread::Builder::new()
                    .name(format!("rank{r}"))
                    .spawn_scoped(s, move || {
                        let out = catch_unwind(AssertUnwindSafe(|| {
                            let mut boot = job.rank(r);
                            let p = match open(&mut boot) {
                                Ok(p) => p,
                                Err(e) => {
                                    // Every rank stops here (the others' opening fails once
                                    // the job is broken); the first own reason is the answer.
                                    job.break_job(&format!("rank {r} could not open it"));
                                    lock(unopened).push((r, e.to_string()));
                                    return None;
                                }
                            };
                            let world = World::from_parts(p, Box::new(boot), cfg)
                                .unwrap_or_else(|e| panic!("rank {r}: {e}"));
                            let out = f(world.comm());
                            if let Err(e) = world.finalize() {
                                if !may_fail {
                                    panic!("rank {r}: finalize: {e}");
                                }
                            }
                            Some(out)
                        }));
                        if out.is_err() {
                            job.break_job(&format!("rank {r} panicked"));
                        }
                        out
                    })
                    .expect("spawn rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(Err))
            .collect()
    });
    let mut unopened = unopened.into_inner().unwrap_or_else(|e| e.into_inner());
    if !unopened.is_empty() {
        // The rank whose own reason it is, not one that saw the job broken by it.
        unopened.sort_by_key(|(r, e)| (e.contains("job broken"), *r));
        let (r, e) = &unopened[0];
        return Err(format!("rank {r}: opening the provider: {e}"));
    }
    let mut out = Vec::with_capacity(n as usize);
    let mut first_panic = None;
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(Some(v)) => out.push(v),
            Ok(None) => {}
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "(non-string panic)".into());
                eprintln!("weft_testing: rank {r} panicked: {msg}");
                first_panic.get_or_insert(p);
            }
        }
    }
    if let Some(p) = first_panic {
        resume_unwind(p);
    }
    Ok(out)
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The value an accumulate-class operation leaves: `op(target, origin)`, computed independently
/// of the library's own reduction code (wide integers and `f64`, then narrowed), so that tests
/// of accumulates and atomics are checked against something other than what they exercise.
/// `Replace` gives `origin`, `NoOp` `target`; compare-and-swap is not an accumulate.
pub fn oracle<T: weft::Element>(op: weft::Op, target: T, origin: T) -> T {
    use weft::{BasicType as B, Op};
    let ty = T::TYPE;
    let (a, b) = (bytemuck::bytes_of(&target), bytemuck::bytes_of(&origin));
    if ty.is_float() {
        let f = |x: &[u8]| match ty {
            B::F32 => f32::from_le_bytes(x.try_into().expect("4 bytes")) as f64,
            _ => f64::from_le_bytes(x.try_into().expect("8 bytes")),
        };
        let (x, y) = (f(a), f(b));
        let truth = |v: bool| if v { 1.0 } else { 0.0 };
        let r = match op {
            Op::Sum => x + y,
            Op::Prod => x * y,
            Op::Min => x.min(y),
            Op::Max => x.max(y),
            Op::Land => truth(x != 0.0 && y != 0.0),
            Op::Lor => truth(x != 0.0 || y != 0.0),
            Op::Lxor => truth((x != 0.0) != (y != 0.0)),
            Op::Replace => y,
            Op::NoOp => x,
            _ => panic!("{} is not an accumulate on {}", op.name(), ty.name()),
        };
        // Computing in f64 and rounding once to f32 is exact for + and * (double rounding is
        // harmless at this width).
        let bytes: Vec<u8> = match ty {
            B::F32 => (r as f32).to_le_bytes().to_vec(),
            _ => r.to_le_bytes().to_vec(),
        };
        return *bytemuck::from_bytes(&bytes);
    }
    let signed = matches!(ty, B::I8 | B::I16 | B::I32 | B::I64);
    let wide = |x: &[u8]| -> i128 {
        let mut v = [0u8; 16];
        v[..x.len()].copy_from_slice(x);
        if signed && x[x.len() - 1] & 0x80 != 0 {
            v[x.len()..].fill(0xff);
        }
        i128::from_le_bytes(v)
    };
    let (x, y) = (wide(a), wide(b));
    let truth = |v: bool| v as i128;
    let r = match op {
        Op::Sum => x.wrapping_add(y),
        Op::Prod => x.wrapping_mul(y),
        Op::Min => x.min(y),
        Op::Max => x.max(y),
        Op::Band => x & y,
        Op::Bor => x | y,
        Op::Bxor => x ^ y,
        Op::Land => truth(x != 0 && y != 0),
        Op::Lor => truth(x != 0 || y != 0),
        Op::Lxor => truth((x != 0) != (y != 0)),
        Op::Replace => y,
        Op::NoOp => x,
        Op::Cswap => panic!("compare-and-swap is not an accumulate"),
    };
    // Narrow by keeping the low bytes: two's-complement wrapping.
    *bytemuck::from_bytes(&r.to_le_bytes()[..ty.size()])
}

pub use weft_proto::testkit::thread_cpu_ticks;

#[cfg(test)]
mod oracle_tests {
    use super::oracle;
    use weft::Op;

    #[test]
    fn oracle_wraps_and_compares_like_the_types() {
        assert_eq!(oracle(Op::Sum, 250u8, 10), 4);
        assert_eq!(oracle(Op::Sum, i8::MAX, 1), i8::MIN);
        assert_eq!(oracle(Op::Prod, u64::MAX, u64::MAX), 1);
        assert_eq!(oracle(Op::Min, -3i16, 2), -3);
        assert_eq!(oracle(Op::Max, 3u32, 4_000_000_000), 4_000_000_000);
        assert_eq!(oracle(Op::Land, 2i64, 0), 0);
        assert_eq!(oracle(Op::Lxor, 2i64, 0), 1);
        assert_eq!(oracle(Op::Sum, 1.5f32, -2.25), -0.75);
        assert_eq!(oracle(Op::Max, -0.5f64, 3.75), 3.75);
        assert_eq!(oracle(Op::Replace, 1u8, 9), 9);
        assert_eq!(oracle(Op::NoOp, 1u8, 9), 1);
    }
}
