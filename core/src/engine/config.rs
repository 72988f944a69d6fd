//! Engine settings and the core parameters they come from.

use crate::p2p::buf::{nt_copy_auto, nt_copy_min_from_env};
use crate::provider::Caps;
use crate::{Error, ErrorDetail, Result};
use std::time::Duration;

/// Engine settings, from the core parameters.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Messages up to this size go eagerly (capped by the provider's payload limit).
    pub eager_limit: Option<usize>,
    /// DATA for receives at least this long is copied with non-temporal stores
    /// (`usize::MAX`: never).
    pub nt_copy_min: usize,
    /// Bound on every blocking wait; `None` waits forever.
    pub timeout: Option<Duration>,
    /// Empty progress rounds before a waiter starts yielding the CPU.
    pub spin: u32,
    /// `spin` holds only while this host has a CPU for each of its ranks; with more ranks
    /// than CPUs a waiting rank yields at every empty round instead (a spinning rank would
    /// only keep the rank it waits for off the CPU), as Open MPI's `mpi_yield_when_idle`
    /// does when it sees oversubscription.
    pub spin_auto: bool,
    /// A waiter that has yielded this long with nothing arriving sleeps between progress
    /// rounds (`None`: it keeps yielding).
    pub sleep_after: Option<Duration>,
    /// `sleep_after` was not set: 1 ms while this host has fewer CPUs than ranks of the job
    /// on it, else `None` (decided when the world starts, as `spin_auto`).
    pub sleep_auto: bool,
    /// Rendezvous messages up to this size send their data speculatively (`None`: 4 MiB on
    /// providers that span hosts and cannot read remote memory, else off).
    pub spec_limit: Option<usize>,
    /// Unexpected speculative data a rank stages for later receives, in bytes; beyond it the
    /// data is dropped and asked for again.
    pub spec_buffer: usize,
    /// Speculate also behind data already queued or streaming to the same peer (by default
    /// only onto an idle link: behind other data the `RTS`/`CTS` round trip overlaps that data).
    pub spec_behind: bool,
    /// Eager bytes a rank may have sent to one peer that the peer has not matched yet; beyond
    /// it, messages go by rendezvous until the peer's receives catch up (flow control: what a
    /// peer can make this rank hold in its unexpected queue is bounded by it).
    pub eager_window: usize,
    /// Bounds of the registration cache (entries, bytes), for providers that need local
    /// descriptors.
    pub mr_cache: (usize, usize),
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            eager_limit: None,
            nt_copy_min: nt_copy_auto(),
            timeout: None,
            spin: 1000,
            spin_auto: true,
            sleep_after: None,
            sleep_auto: true,
            spec_limit: None,
            spec_buffer: 4 << 20,
            spec_behind: false,
            eager_window: 8 << 20,
            mr_cache: (1024, 1 << 30),
        }
    }
}

crate::param!(EAGER_LIMIT: Size = "", "EAGER_LIMIT", "0",
    "eager/rendezvous switch-over in bytes (0: the provider's own threshold)");
crate::param!(TIMEOUT: Seconds = "", "TIMEOUT", "0",
    "seconds any blocking wait may take before it fails with a timeout (0: no limit; at most 10^9)");
crate::param!(POLL_SPIN: Str = "", "POLL_SPIN", "auto",
    "idle progress rounds before a waiting rank starts yielding its core (the first 256 back to back, the rest with the CPU's spin-wait hint); auto: 1000, or 0 (yield at every idle round) when the host has fewer CPUs online than ranks of the job on it");
crate::param!(POLL_SLEEP: Str = "", "POLL_SLEEP", "auto",
    "microseconds a waiting rank yields with nothing arriving before it sleeps between progress rounds (100 µs naps: off the run queue, so the ranks it waits for get the CPU); auto: 1000 when the host has fewer CPUs online than ranks of the job on it, else never; off: never");
crate::param!(SPEC_LIMIT: Str = "", "SPEC_LIMIT", "auto",
    "rendezvous messages up to this size send their data without waiting for the receiver's CTS: a size, 0 (never) or auto (4M on providers that span hosts and cannot read remote memory, else 0)");
crate::param!(SPEC_BEHIND: Bool = "", "SPEC_BEHIND", "0",
    "1: speculate also behind data already queued or streaming to the same peer; 0: only onto an idle link, since behind other data the RTS/CTS round trip is hidden anyway");
crate::param!(EAGER_WINDOW: Size = "", "EAGER_WINDOW", "8M",
    "eager bytes a rank may send to one peer before that peer matches them; beyond, messages go by rendezvous (bounds each peer's share of the receiver's unexpected queue; the same on every rank)");
crate::param!(SPEC_BUFFER: Size = "", "SPEC_BUFFER", "4M",
    "speculative messages that arrive before their receive are held up to this many bytes in all; beyond, their data is dropped and sent again when a receive matches");

/// `WEFT_SPEC_LIMIT`: `None` for auto.
fn spec_limit_from_env() -> Result<Option<usize>> {
    let raw = SPEC_LIMIT.raw();
    let v = raw.trim();
    if v.eq_ignore_ascii_case("auto") {
        return Ok(None);
    }
    crate::param::parse_size(v).map(Some).ok_or_else(|| {
        Error::from(ErrorDetail::Param {
            var: SPEC_LIMIT.env_name(),
            value: raw,
            expected: "auto, 0 or a size such as 4M".into(),
        })
    })
}

/// Speculation saves the `RTS`/`CTS` round trip: worth it where that trip crosses a network
/// stack (providers that span hosts) and there is no zero-copy read to use instead. Past a
/// few MiB the trip is lost in the transfer time (docs/history/benchmarks-notebook.md,
/// "Measurements behind code decisions"), while data that finds no receive and no staging
/// room is sent twice.
pub(crate) fn spec_limit_auto(caps: &Caps) -> usize {
    if caps.spans_hosts && !caps.rma.is_some_and(|r| r.read) {
        4 << 20
    } else {
        0
    }
}

impl EngineConfig {
    /// Read `WEFT_EAGER_LIMIT`, `WEFT_NT_COPY_MIN`, `WEFT_TIMEOUT`, `WEFT_POLL_SPIN`,
    /// `WEFT_POLL_SLEEP`, `WEFT_SPEC_LIMIT`, `WEFT_SPEC_BUFFER` and `WEFT_SPEC_BEHIND`.
    pub fn from_env() -> Result<Self> {
        let e = EAGER_LIMIT.get_size()?;
        let spin = parse_spin(&POLL_SPIN.raw())?;
        let sleep = parse_sleep(&POLL_SLEEP.raw())?;
        Ok(EngineConfig {
            eager_limit: (e > 0).then_some(e),
            nt_copy_min: nt_copy_min_from_env()?,
            timeout: TIMEOUT.get_seconds(true)?,
            spin: spin.unwrap_or(1000),
            spin_auto: spin.is_none(),
            sleep_after: sleep.flatten(),
            sleep_auto: sleep.is_none(),
            spec_limit: spec_limit_from_env()?,
            spec_buffer: SPEC_BUFFER.get_size()?,
            spec_behind: SPEC_BEHIND.get_bool()?,
            eager_window: EAGER_WINDOW.get_size()?,
            mr_cache: crate::am::mr_cache::MrCache::bounds_from_env()?,
        })
    }
}

/// `WEFT_POLL_SPIN`: `auto` (`None`: decided when the world starts) or a number of rounds.
fn parse_spin(v: &str) -> Result<Option<u32>> {
    match v.trim() {
        "auto" => Ok(None),
        n => n
            .parse::<u64>()
            .map(|n| Some(n.min(u32::MAX as u64) as u32))
            .map_err(|_| {
                Error::from(ErrorDetail::Param {
                    var: POLL_SPIN.env_name(),
                    value: v.to_string(),
                    expected: "auto or a number of rounds".into(),
                })
            }),
    }
}

/// The idle time after which an oversubscribed rank's waits sleep ([`EngineConfig::sleep_auto`]).
pub(crate) const SLEEP_AFTER_AUTO: Duration = Duration::from_millis(1);

/// `WEFT_POLL_SLEEP`: `None` for auto, `Some(None)` for off, else the idle time.
fn parse_sleep(v: &str) -> Result<Option<Option<Duration>>> {
    match v.trim() {
        "auto" => Ok(None),
        "off" | "never" => Ok(Some(None)),
        n => n
            .parse::<u64>()
            .map(|us| Some(Some(Duration::from_micros(us))))
            .map_err(|_| {
                Error::from(ErrorDetail::Param {
                    var: POLL_SLEEP.env_name(),
                    value: v.to_string(),
                    expected: "auto, off or a number of microseconds".into(),
                })
            }),
    }
}

/// Whether this host, running `local_ranks` ranks, has fewer CPUs online than ranks. Not the
/// CPUs this process may run on: a launcher that pins each rank to one CPU leaves every rank
/// a single one, oversubscribed or not.
pub(crate) fn oversubscribed(local_ranks: usize) -> bool {
    // SAFETY: sysconf reads a system setting; it takes a constant and touches no memory of ours.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    online > 0 && local_ranks as i64 > online as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_sleep_is_auto_off_or_microseconds() {
        assert_eq!(parse_sleep("auto").unwrap(), None);
        assert_eq!(parse_sleep("off").unwrap(), Some(None));
        assert_eq!(
            parse_sleep(" 250 ").unwrap(),
            Some(Some(Duration::from_micros(250)))
        );
        let e = parse_sleep("1ms").unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Param);
        assert!(e.to_string().contains("WEFT_POLL_SLEEP"), "{e}");
    }

    #[test]
    fn poll_spin_is_auto_or_a_number() {
        assert_eq!(parse_spin("auto").unwrap(), None);
        assert_eq!(parse_spin(" 0 ").unwrap(), Some(0));
        assert_eq!(parse_spin("1000").unwrap(), Some(1000));
        assert_eq!(parse_spin("99999999999").unwrap(), Some(u32::MAX));
        let e = parse_spin("fast").unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Param);
        assert!(e.to_string().contains("WEFT_POLL_SPIN"), "{e}");
    }

    #[test]
    fn more_ranks_than_cpus_is_oversubscribed() {
        assert!(!oversubscribed(1));
        assert!(oversubscribed(1 << 20));
    }
}
