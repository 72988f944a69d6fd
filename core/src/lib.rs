//! # weft
//!
//! A communication framework for HPC in the style of libfabric and MPICH CH4: a thin core with
//! MPI-style operations (tagged send/receive with matching, collectives, derived datatypes),
//! dispatched to pluggable fabric *providers*.
//!
//! ```no_run
//! // Launched by `weft run -n 2 ./app`, `mpiexec -n 2 ./app`, Slurm, or alone (a world of 1).
//! let world = weft::init()?;                      // provider chosen by WEFT_PROVIDER
//! let (rank, size) = (world.rank(), world.size());
//! let mut buf = [0u64; 4];
//! if rank == 0 && size > 1 {
//!     world.send(&[1u64, 2, 3, 4], 1, 7)?;
//! } else if rank == 1 {
//!     let st = world.recv(&mut buf, weft::ANY_SOURCE, 7)?;
//!     assert_eq!(st.bytes, 32);
//! }
//! world.finalize()?;
//! # Ok::<(), weft::Error>(())
//! ```
//!
//! Layers, each using only those below it:
//! * API — [`comm`] (worlds, communicators, two-sided, collectives) and the window API
//!   ([`Window`], `win/`);
//! * `engine` — a provider plus the protocol state; dispatches arrivals by handler id;
//! * protocols — `p2p` (eager, rendezvous, speculative, placement; [`matching`]) and `rma`
//!   (window state, target-side handlers);
//! * `am` — the active-message layer: handler-id table, outbox, request ids, peer health;
//! * the contract — [`provider::Provider`], in the `weft-provider` crate.
//!
//! See ARCHITECTURE.md.

// The API.
pub mod comm;
mod win;

// The engine and the protocols under it.
mod am;
mod engine;
pub mod matching;
mod p2p;
mod rma;

// Data, start-up and providers.
pub mod bootstrap;
pub mod datatype;
pub mod loader;
/// Provider registration and selection.
pub mod registry {
    pub use crate::select::*;
}
mod route;
mod select;

pub use weft_provider::{
    export_provider, param, pool, provider, register_provider, sdk, shmem, types, BufPool, Error,
    ErrorDetail, ErrorKind, Result,
};

pub use comm::{
    waitall, waitany, Comm, RawRequest, RegistrationStats, Request, Scope, SharedBuf, Source,
    TagSel, World, ANY_SOURCE, ANY_TAG, TAG_UB,
};
pub use datatype::Datatype;
pub use engine::EngineConfig;
pub use provider::{Caps, DynProvider, Provider, StaticProvider};
pub use types::{BasicType, Element, Op, Rank, Status};
pub use win::{Assert, Epoch, LockKind, RmaRequest, Sched, WinCompletion, WinInfo, Window};

#[doc(hidden)]
pub use weft_provider::__linkme;

use bootstrap::{pmi::Pmi, Bootstrap, Singleton};
use std::time::Duration;

param!(PROVIDER: Str = "", "PROVIDER", "",
    "provider choice: a name, a preference list 'a,b', or exclusions '^a,b' (empty: best available)");
param!(LOG: Str = "", "LOG", "warn",
    "log filter for weft's tracing output (e.g. info, debug, weft=trace)");
param!(PMI_TIMEOUT: Seconds[1e-3, 1e9] = "pmi", "TIMEOUT", "60",
    "seconds a rank waits on the PMI server (a barrier waits this long for a missing rank; 0.001 to 10^9)");

/// Install a tracing subscriber filtered by `WEFT_LOG` (once; no-op if the application has its
/// own subscriber).
pub fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_new(LOG.raw())
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        // Colour only for a terminal: not in files, pipes, or a launcher's forwarded output.
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            .try_init();
    });
}

/// The bootstrap the environment describes ([`bootstrap::Choice`]): PMI-1 when a launcher
/// that speaks it started us, a singleton when none did, an error under a launcher we cannot
/// join (rather than a job of one per process).
pub fn bootstrap_from_env() -> Result<Box<dyn Bootstrap>> {
    match bootstrap::Choice::from_env()? {
        bootstrap::Choice::Pmi1 => {
            let t = pmi_timeout()?;
            Ok(Box::new(Pmi::from_env(t)?))
        }
        bootstrap::Choice::Pmix => Ok(Box::new(bootstrap::pmix::Pmix::from_env(pmi_timeout()?)?)),
        bootstrap::Choice::Singleton(_) => Ok(Box::new(Singleton::new())),
        bootstrap::Choice::Refused(why) => Err(Error::from(ErrorDetail::Bootstrap(why))),
    }
}

/// `WEFT_PMI_TIMEOUT` as a duration (what a bootstrap built by hand should wait).
pub fn pmi_timeout() -> Result<Duration> {
    Ok(PMI_TIMEOUT
        .get_seconds(false)?
        .expect("zero is refused, not read as none"))
}

/// Check every core parameter the way the code that reads it does: a bad value of any of
/// them is an error here, at start-up, not later when (or if) something first uses it.
pub fn check_params() -> Result<()> {
    for p in param::all() {
        if p.is_set() {
            p.validate()?;
        }
    }
    EngineConfig::from_env()?;
    win::Sched::from_env()?;
    pmi_timeout()?;
    Ok(())
}

/// Start this rank on the **dynamic** path: bootstrap from the environment and open the
/// provider `WEFT_PROVIDER` asks for (or the best one available). Every rank must call it.
pub fn init() -> Result<World<DynProvider>> {
    init_with(&registry::Selection::from_env()?)
}

/// [`init`] with the providers `sel` allows instead of `WEFT_PROVIDER`'s (a face of weft that
/// was told which provider to use another way, e.g. a libfabric domain name).
pub fn init_with(sel: &registry::Selection) -> Result<World<DynProvider>> {
    init_logging();
    init_on(bootstrap_from_env()?, sel)
}

/// [`init_with`] over a bootstrap made earlier ([`bootstrap_from_env`]): a face of weft that
/// must name this process (its rank and job) before its peers are ready to open a provider
/// together (libfabric's `fi_getname` comes before the address exchange).
pub fn init_on(
    mut boot: Box<dyn Bootstrap>,
    sel: &registry::Selection,
) -> Result<World<DynProvider>> {
    init_logging();
    if boot.rank() == 0 {
        param::warn_unknown_vars();
    }
    let sel = sel.clone();
    match registry::select_and_open(boot.as_mut(), &sel) {
        Ok((p, _)) => comm::world_from(p, boot),
        // Selection is collective: when no provider can run (or the request or a parameter
        // is wrong), every rank reaches this same error. They leave together (a barrier, then PMI finalize) and report it themselves:
        // an abort raced the launcher's kill against that report (Hydra lost it 1 run in 15),
        // and a rank exiting while others still read the votes broke Hydra's proxies.
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::ProviderUnavailable | ErrorKind::UnknownProvider | ErrorKind::Param
            ) =>
        {
            if boot.fence().is_ok() {
                let _ = boot.finalize();
            }
            Err(e)
        }
        Err(e) => {
            boot.abort(1, &e.to_string());
            Err(e)
        }
    }
}

/// Start this rank on the **static** path with provider type `P` (`World<P>`: every call is
/// resolved at compile time). Fails if `P` cannot run in this job.
pub fn init_static<P: StaticProvider>() -> Result<World<P>> {
    init_logging();
    let mut boot = bootstrap_from_env()?;
    if boot.rank() == 0 {
        param::warn_unknown_vars();
    }
    let ctx = registry::probe_context(boot.as_ref());
    let mine = match P::probe(&ctx) {
        Ok(()) => "ok".to_string(),
        Err(w) => format!("no:{w}"),
    };
    let votes = if boot.size() == 1 {
        vec![mine]
    } else {
        bootstrap::allgather(boot.as_mut(), "weft.static", &mine)?
    };
    if let Some((r, v)) = votes.iter().enumerate().find(|(_, v)| *v != "ok") {
        return Err(Error::from(ErrorDetail::ProviderUnavailable {
            requested: P::NAME.into(),
            details: format!("{}: {} (rank {r})", P::NAME, v.trim_start_matches("no:")),
        }));
    }
    let p = P::open(boot.as_mut())?;
    comm::world_from(p, boot)
}

/// The README's code, compiled and run as a doctest so it stays true.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
