//! Provider registry and selection.
//!
//! Built-in providers register at link time ([`register_provider!`](crate::register_provider)):
//! an executable gets every provider crate it links with `use weft_<name> as _;`. Providers
//! loaded from shared libraries (`WEFT_PROVIDER_PATH`) join the same list at run time.
//!
//! `WEFT_PROVIDER` picks among them with libfabric's `FI_PROVIDER` syntax: `name`, a preference
//! list `a,b`, or exclusions `^a,b`. Without it, the highest-priority provider that can run here
//! wins. Selection is collective: every rank probes locally, the ranks agree through the
//! bootstrap, and only a provider that every rank can run is opened.

use crate::bootstrap::{allgather, Bootstrap};
use crate::provider::{Caps, DynProvider, ProbeContext, StaticProvider};
use crate::{Error, ErrorDetail, ErrorKind, Result};
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

/// Every provider known to this process: built-ins first (by priority), then loaded libraries.
pub fn providers() -> (Vec<&'static dyn Factory>, Vec<LoadFailure>) {
    let mut v: Vec<&'static dyn Factory> = PROVIDERS.iter().map(|d| d as &dyn Factory).collect();
    v.sort_by(|a, b| b.priority().cmp(&a.priority()).then(a.name().cmp(b.name())));
    let mut failures = Vec::new();
    let (more, fails) = crate::loader::loaded();
    for m in more {
        if v.iter().any(|x| x.name() == m.name()) {
            failures.push(LoadFailure {
                path: match m.origin() {
                    Origin::Library(p) => p,
                    Origin::Builtin => PathBuf::new(),
                },
                error: format!("provider name '{}' is already taken", m.name()),
            });
        } else {
            v.push(*m);
        }
    }
    failures.extend(fails.iter().cloned());
    v.sort_by(|a, b| b.priority().cmp(&a.priority()).then(a.name().cmp(b.name())));
    (v, failures)
}

/// A parsed `WEFT_PROVIDER`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// Unset or empty: highest priority first.
    Any,
    /// `a,b`: these, in this order.
    Prefer(Vec<String>),
    /// `^a,b`: all but these.
    Exclude(Vec<String>),
}

impl Selection {
    pub fn parse(s: &str) -> Result<Selection> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(Selection::Any);
        }
        let (exclude, body) = match s.strip_prefix('^') {
            Some(b) => (true, b),
            None => (false, s),
        };
        let names: Vec<String> = body.split(',').map(|x| x.trim().to_string()).collect();
        if names.iter().any(|n| {
            n.is_empty()
                || !n
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        }) {
            return Err(Error::from(ErrorDetail::Param {
                var: "WEFT_PROVIDER".into(),
                value: s.into(),
                expected: "a provider name, a list 'a,b' or exclusions '^a,b'".into(),
            }));
        }
        Ok(if exclude {
            Selection::Exclude(names)
        } else {
            Selection::Prefer(names)
        })
    }

    pub fn from_env() -> Result<Selection> {
        Selection::parse(&std::env::var("WEFT_PROVIDER").unwrap_or_default())
    }
}

fn describe_available(all: &[&'static dyn Factory], ctx: Option<&ProbeContext>) -> String {
    let mut ok = Vec::new();
    let mut no = Vec::new();
    for f in all {
        match ctx.map(|c| f.probe(c)) {
            Some(Err(why)) => no.push(format!("{} ({why})", f.name())),
            _ => ok.push(f.name().to_string()),
        }
    }
    let mut s = if ok.is_empty() {
        "none".to_string()
    } else {
        ok.join(", ")
    };
    if !no.is_empty() {
        s.push_str("; unavailable here: ");
        s.push_str(&no.join(", "));
    }
    s
}

/// The candidates `sel` names, in trial order. Unknown names are an error that lists what exists.
pub fn candidates(
    sel: &Selection,
    all: &[&'static dyn Factory],
    ctx: Option<&ProbeContext>,
) -> Result<Vec<&'static dyn Factory>> {
    let find = |n: &str| all.iter().find(|f| f.name() == n).copied();
    match sel {
        Selection::Any => Ok(all.to_vec()),
        Selection::Prefer(names) | Selection::Exclude(names) => {
            for n in names {
                if find(n).is_none() {
                    return Err(Error::from(ErrorDetail::UnknownProvider {
                        requested: n.clone(),
                        available: describe_available(all, ctx),
                    }));
                }
            }
            Ok(match sel {
                Selection::Prefer(_) => names.iter().filter_map(|n| find(n)).collect(),
                _ => all
                    .iter()
                    .filter(|f| !names.iter().any(|n| n == f.name()))
                    .copied()
                    .collect(),
            })
        }
    }
}

/// The probe context of a bootstrap.
pub fn probe_context(boot: &dyn Bootstrap) -> ProbeContext {
    let nodes = boot.nodes();
    ProbeContext {
        rank: boot.rank(),
        size: boot.size(),
        in_process: boot.in_process(),
        hosts: nodes.hosts(),
        local_ranks: nodes.local_ranks().len() as u32,
    }
}

/// Collective selection: probe every candidate locally, agree through the bootstrap, open the
/// first one every rank can run. Returns the provider and its factory.
pub fn select_and_open(
    boot: &mut dyn Bootstrap,
    sel: &Selection,
) -> Result<(DynProvider, &'static dyn Factory)> {
    let (all, failures) = providers();
    for f in &failures {
        tracing::warn!(path = %f.path.display(), "provider library not loaded: {}", f.error);
    }
    let ctx = probe_context(boot);
    let requested = std::env::var("WEFT_PROVIDER").unwrap_or_default();
    let cands = candidates(sel, &all, Some(&ctx))?;
    let mut reasons: Vec<String> = Vec::new();
    for (i, f) in cands.iter().enumerate() {
        let local = f.probe(&ctx);
        let mine = match &local {
            Ok(()) => "ok".to_string(),
            Err(why) => format!("no:{why}"),
        };
        let votes = if boot.size() == 1 {
            vec![mine]
        } else {
            allgather(boot, &format!("weft.sel{i}"), &mine)?
        };
        if let Some((r, v)) = votes.iter().enumerate().find(|(_, v)| *v != "ok") {
            let why = v.strip_prefix("no:").unwrap_or(v);
            reasons.push(format!("{}: {why} (rank {r})", f.name()));
            continue;
        }
        tracing::debug!(provider = f.name(), "selected");
        match f.open(boot) {
            Ok(p) => return Ok((p, *f)),
            // A provider that finds out during open that it cannot work (on every rank: the
            // contract asks providers to agree before failing this way) lets the next one try.
            Err(e) if e.kind() == ErrorKind::ProviderUnavailable => {
                tracing::info!(provider = f.name(), "unavailable: {e}");
                reasons.push(format!("{}: {}", f.name(), unavailable_details(&e)));
                continue;
            }
            Err(e) => return Err(e),
        }
    }
    Err(Error::from(ErrorDetail::ProviderUnavailable {
        requested: if requested.is_empty() {
            "(any)".into()
        } else {
            requested
        },
        details: format!(
            "{}; registered: {}",
            if reasons.is_empty() {
                "no candidate".to_string()
            } else {
                reasons.join("; ")
            },
            all.iter()
                .map(|f| f.name().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }))
}

/// The reason inside a `ProviderUnavailable` error.
fn unavailable_details(e: &Error) -> String {
    match e.detail() {
        ErrorDetail::ProviderUnavailable { details, .. } => details.clone(),
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_selection() {
        assert_eq!(Selection::parse("").unwrap(), Selection::Any);
        assert_eq!(
            Selection::parse("shm").unwrap(),
            Selection::Prefer(vec!["shm".into()])
        );
        assert_eq!(
            Selection::parse("shm, tcp-sim").unwrap(),
            Selection::Prefer(vec!["shm".into(), "tcp-sim".into()])
        );
        assert_eq!(
            Selection::parse("^loopback").unwrap(),
            Selection::Exclude(vec!["loopback".into()])
        );
        assert!(Selection::parse("a,,b").is_err());
        assert!(Selection::parse("^").is_err());
        assert!(Selection::parse("a b").is_err());
    }

    #[test]
    fn unknown_name_lists_available() {
        let (all, _) = providers();
        let Err(e) = candidates(&Selection::parse("nope").unwrap(), &all, None) else {
            panic!("'nope' was accepted");
        };
        let msg = e.to_string();
        assert_eq!(e.kind(), crate::ErrorKind::UnknownProvider);
        assert!(msg.contains("nope") && msg.contains("loopback"), "{msg}");
    }
}
