//! Provider registration: built-in providers register at link time
//! ([`register_provider!`](crate::register_provider)): an executable gets every provider crate it
//! links with `use weft_<name> as _;`. The core adds the libraries it loads from
//! `WEFT_PROVIDER_PATH` and selects among them all (`weft::registry`).

use crate::bootstrap::Bootstrap;
use crate::provider::{Caps, DynProvider, ProbeContext, StaticProvider};
use crate::Result;
use std::path::PathBuf;

/// A built-in provider's registration.
pub struct ProviderDescriptor {
    pub name: &'static str,
    pub version: &'static str,
    /// Higher wins when nothing is requested.
    pub priority: i32,
    /// One line for `weft info`.
    pub summary: &'static str,
    pub caps: fn() -> Result<Caps>,
    pub probe: fn(&ProbeContext) -> std::result::Result<(), String>,
    pub open: fn(&mut dyn Bootstrap) -> Result<DynProvider>,
}

fn open_boxed<P: StaticProvider>(b: &mut dyn Bootstrap) -> Result<DynProvider> {
    Ok(Box::new(P::open(b)?))
}

impl ProviderDescriptor {
    /// The descriptor of a statically known provider type.
    pub const fn of<P: StaticProvider>(
        version: &'static str,
        priority: i32,
        summary: &'static str,
    ) -> Self {
        ProviderDescriptor {
            name: P::NAME,
            version,
            priority,
            summary,
            caps: P::static_caps,
            probe: P::probe,
            open: open_boxed::<P>,
        }
    }
}

#[linkme::distributed_slice]
pub static PROVIDERS: [ProviderDescriptor];

/// Register a built-in provider type:
/// `weft::register_provider!(Shm, priority = 50, summary = "...")`.
#[macro_export]
macro_rules! register_provider {
    ($ty:ty, priority = $prio:expr, summary = $summary:expr) => {
        #[$crate::__linkme::distributed_slice($crate::registry::PROVIDERS)]
        #[linkme(crate = $crate::__linkme)]
        static __WEFT_PROVIDER_DESCRIPTOR: $crate::registry::ProviderDescriptor =
            $crate::registry::ProviderDescriptor::of::<$ty>(
                env!("CARGO_PKG_VERSION"),
                $prio,
                $summary,
            );
    };
}

/// Where a provider comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Builtin,
    Library(PathBuf),
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Builtin => f.write_str("builtin"),
            Origin::Library(p) => write!(f, "{}", p.display()),
        }
    }
}

/// A provider that can be selected: built in or loaded.
pub trait Factory: Send + Sync {
    fn name(&self) -> &str;
    fn version(&self) -> &str;
    fn priority(&self) -> i32;
    fn summary(&self) -> &str;
    fn origin(&self) -> Origin;
    fn caps(&self) -> Result<Caps>;
    fn probe(&self, ctx: &ProbeContext) -> std::result::Result<(), String>;
    fn open(&self, boot: &mut dyn Bootstrap) -> Result<DynProvider>;
}

impl Factory for ProviderDescriptor {
    fn name(&self) -> &str {
        self.name
    }
    fn version(&self) -> &str {
        self.version
    }
    fn priority(&self) -> i32 {
        self.priority
    }
    fn summary(&self) -> &str {
        self.summary
    }
    fn origin(&self) -> Origin {
        Origin::Builtin
    }
    fn caps(&self) -> Result<Caps> {
        (self.caps)()
    }
    fn probe(&self, ctx: &ProbeContext) -> std::result::Result<(), String> {
        (self.probe)(ctx)
    }
    fn open(&self, boot: &mut dyn Bootstrap) -> Result<DynProvider> {
        (self.open)(boot)
    }
}

/// A provider library that failed to load (reported by `weft info`, never fatal by itself).
#[derive(Debug, Clone)]
pub struct LoadFailure {
    pub path: PathBuf,
    pub error: String,
}
