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
crate::param!(TIMEOUT: Float = "", "TIMEOUT", "0",
    "seconds any blocking wait may take before it fails with a timeout (0: no limit)");
crate::param!(POLL_SPIN: Uint = "", "POLL_SPIN", "1000",
    "idle progress rounds before a waiting rank starts yielding its core (the first 256 back to back, the rest with the CPU's spin-wait hint)");
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
/// few MiB the trip is lost in the transfer time (≈9 µs against 0.2 ms for 1 MiB on loopback
/// TCP), while data that finds no receive and no staging room is sent twice.
pub(crate) fn spec_limit_auto(caps: &Caps) -> usize {
    if caps.spans_hosts && !caps.rma.is_some_and(|r| r.read) {
        4 << 20
    } else {
        0
    }
}

impl EngineConfig {
    /// Read `WEFT_EAGER_LIMIT`, `WEFT_NT_COPY_MIN`, `WEFT_TIMEOUT`, `WEFT_POLL_SPIN`,
    /// `WEFT_SPEC_LIMIT`, `WEFT_SPEC_BUFFER` and `WEFT_SPEC_BEHIND`.
    pub fn from_env() -> Result<Self> {
        let e = EAGER_LIMIT.get_size()?;
        Ok(EngineConfig {
            eager_limit: (e > 0).then_some(e),
            nt_copy_min: nt_copy_min_from_env()?,
            timeout: TIMEOUT.get_seconds(true)?,
            spin: POLL_SPIN.get_u64()?.min(u32::MAX as u64) as u32,
            spec_limit: spec_limit_from_env()?,
            spec_buffer: SPEC_BUFFER.get_size()?,
            spec_behind: SPEC_BEHIND.get_bool()?,
            eager_window: EAGER_WINDOW.get_size()?,
            mr_cache: crate::am::mr_cache::MrCache::bounds_from_env()?,
        })
    }
}
