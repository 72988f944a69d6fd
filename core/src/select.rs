//! Provider registry and selection.
//!
//! Built-in providers register at link time (`weft_provider::register_provider!`): an
//! executable gets every provider crate it links with `use weft_<name> as _;`. Providers loaded
//! from shared libraries (`WEFT_PROVIDER_PATH`) join the same list at run time.
//!
//! `WEFT_PROVIDER` picks among them with libfabric's `FI_PROVIDER` syntax: `name`, a preference
//! list `a,b`, or exclusions `^a,b`. Without it, the highest-priority provider that can run here
//! wins. Selection is collective: every rank probes locally, the ranks agree through the
//! bootstrap, and only a provider that every rank can run is opened.

use crate::bootstrap::{allgather, Bootstrap};
use crate::provider::{DynProvider, ProbeContext};
use crate::{Error, ErrorDetail, ErrorKind, Result};
use std::path::PathBuf;

pub use weft_provider::registry::*;

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

/// The library file a refused provider `name` came from, and why it was refused.
pub fn refused<'a>(name: &str, failures: &'a [LoadFailure]) -> Option<&'a LoadFailure> {
    let file = format!("libweft-{name}.so");
    failures.iter().find(|f| {
        f.path
            .file_name()
            .is_some_and(|x| x.to_string_lossy() == file)
    })
}

/// "libweft-x.so was found but not loaded: why" for a refused library.
fn refusal(f: &LoadFailure) -> String {
    format!("{} was found but not loaded: {}", f.path.display(), f.error)
}

/// The candidates `sel` names, in trial order. Unknown names are an error that lists what exists
/// (and, for a name whose library was found but refused, why it was refused).
pub fn candidates(
    sel: &Selection,
    all: &[&'static dyn Factory],
    ctx: Option<&ProbeContext>,
) -> Result<Vec<&'static dyn Factory>> {
    candidates_with(sel, all, &[], ctx)
}

/// [`candidates`], knowing which libraries failed to load: a preference list may name one of
/// them; it is skipped (the next name is tried) unless it is the only one.
pub fn candidates_with(
    sel: &Selection,
    all: &[&'static dyn Factory],
    failures: &[LoadFailure],
    ctx: Option<&ProbeContext>,
) -> Result<Vec<&'static dyn Factory>> {
    let find = |n: &str| all.iter().find(|f| f.name() == n).copied();
    match sel {
        Selection::Any => Ok(all.to_vec()),
        Selection::Prefer(names) | Selection::Exclude(names) => {
            let mut skipped = vec![];
            let excluding = matches!(sel, Selection::Exclude(_));
            for n in names {
                if find(n).is_some() {
                    continue;
                }
                if excluding {
                    // Excluding what is not here excludes nothing (libfabric ignores an
                    // exclusion it cannot match too): said once, not an error.
                    if ctx.is_none_or(|c| c.rank == 0) {
                        tracing::warn!(
                            "WEFT_PROVIDER excludes '{n}', which this program does not have; ignored"
                        );
                    }
                    continue;
                }
                match refused(n, failures) {
                    Some(f) => skipped.push(format!("{n}: {}", refusal(f))),
                    None => {
                        return Err(Error::from(ErrorDetail::UnknownProvider {
                            requested: n.clone(),
                            available: describe_available(all, ctx),
                        }))
                    }
                }
            }
            let list: Vec<&'static dyn Factory> = match sel {
                Selection::Prefer(_) => names.iter().filter_map(|n| find(n)).collect(),
                _ => all
                    .iter()
                    .filter(|f| !names.iter().any(|n| n == f.name()))
                    .copied()
                    .collect(),
            };
            if list.is_empty() && !skipped.is_empty() {
                return Err(Error::from(ErrorDetail::ProviderUnavailable {
                    requested: names.join(","),
                    details: skipped.join("; "),
                }));
            }
            for why in &skipped {
                tracing::warn!("skipping provider {why}");
            }
            Ok(list)
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

/// What one rank makes of one candidate.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    Ok,
    /// It cannot run here (the probe's reason).
    No(String),
    /// Its parameters are wrong: an error wherever the provider is a candidate. (Variable,
    /// value, what was expected.)
    BadParam(String, String, String),
}

/// A rank's verdicts as one bootstrap value: `name\x1fverdict` records separated by `\x1e`.
fn encode(v: &[(String, Verdict)]) -> String {
    v.iter()
        .map(|(n, x)| match x {
            Verdict::Ok => format!("{n}\x1fok"),
            Verdict::No(w) => format!("{n}\x1fno:{w}"),
            Verdict::BadParam(var, val, exp) => {
                format!("{n}\x1fparam:{var}\x1d{val}\x1d{exp}")
            }
        })
        .collect::<Vec<_>>()
        .join("\x1e")
}

fn decode(s: &str) -> Vec<(String, Verdict)> {
    s.split('\x1e')
        .filter(|r| !r.is_empty())
        .filter_map(|r| {
            let (n, x) = r.split_once('\x1f')?;
            let v = if x == "ok" {
                Verdict::Ok
            } else if let Some(w) = x.strip_prefix("param:") {
                let mut f = w.splitn(3, '\x1d').map(str::to_string);
                let (var, val, exp) = (f.next()?, f.next()?, f.next()?);
                Verdict::BadParam(var, val, exp)
            } else {
                Verdict::No(x.strip_prefix("no:").unwrap_or(x).to_string())
            };
            Some((n.to_string(), v))
        })
        .collect()
}

/// This rank's verdict on each candidate, in its trial order. Names are matched across ranks,
/// never positions: ranks may see different libraries (a path missing on one host).
fn local_verdicts(
    sel: &Selection,
    all: &[&'static dyn Factory],
    failures: &[LoadFailure],
    ctx: &ProbeContext,
) -> Result<Vec<(String, Verdict)>> {
    let cands = candidates_with(sel, all, failures, Some(ctx))?;
    let mut out: Vec<(String, Verdict)> = cands
        .iter()
        .map(|f| {
            let v = match f.caps().map_err(|e| e.detail().clone()) {
                Err(ErrorDetail::Param {
                    var,
                    value,
                    expected,
                }) => Verdict::BadParam(var, value, expected),
                _ => match f.probe(ctx) {
                    Ok(()) => Verdict::Ok,
                    Err(why) => Verdict::No(why),
                },
            };
            (f.name().to_string(), v)
        })
        .collect();
    // Named but refused here: a candidate this rank cannot run, with the reason.
    if let Selection::Prefer(names) = sel {
        for n in names {
            if !out.iter().any(|(x, _)| x == n) {
                if let Some(f) = refused(n, failures) {
                    out.push((n.clone(), Verdict::No(refusal(f))));
                }
            }
        }
        // Keep the user's order.
        out.sort_by_key(|(x, _)| names.iter().position(|n| n == x).unwrap_or(usize::MAX));
    }
    Ok(out)
}

/// Collective selection: every rank judges every candidate locally, one exchange through the
/// bootstrap agrees on them by name, and the first candidate (in rank 0's order) that every rank
/// can run is opened. A bad parameter of a candidate is an error on every rank. Returns the
/// provider and its factory.
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
    // A local error (an unknown name) still takes part in the exchange, so that no rank is
    // left waiting in it; every rank then reports the first error any rank had.
    let (mine, local_err) =
        match crate::check_params().and_then(|_| local_verdicts(sel, &all, &failures, &ctx)) {
            Ok(v) => (encode(&v), None),
            Err(e) => (
                format!("\x1derror\x1f{}", e.to_string().replace('\x1e', " ")),
                Some(e),
            ),
        };
    let votes = if boot.size() == 1 {
        vec![mine]
    } else {
        allgather(boot, "weft.select", &mine)?
    };
    if let Some(e) = local_err {
        return Err(e);
    }
    if let Some((r, v)) = votes
        .iter()
        .enumerate()
        .find(|(_, v)| v.starts_with('\x1d'))
    {
        let why = v.split_once('\x1f').map_or("", |x| x.1);
        return Err(Error::from(ErrorDetail::ProviderUnavailable {
            requested: or_any(&requested),
            details: format!("rank {r}: {why}"),
        }));
    }
    let per_rank: Vec<Vec<(String, Verdict)>> = votes.iter().map(|v| decode(v)).collect();
    // A parameter error anywhere, on any candidate, is the answer on every rank.
    for vs in &per_rank {
        if let Some((_, Verdict::BadParam(var, value, expected))) =
            vs.iter().find(|(_, v)| matches!(v, Verdict::BadParam(..)))
        {
            return Err(Error::from(ErrorDetail::Param {
                var: var.clone(),
                value: value.clone(),
                expected: expected.clone(),
            }));
        }
    }
    let (order, mut reasons) = agree(&per_rank);
    for name in &order {
        let Some(f) = all.iter().find(|f| f.name() == name) else {
            continue;
        };
        tracing::debug!(provider = f.name(), "selected");
        match f.open(boot) {
            // On a job spanning hosts, the host provider joins it for ranks of one host.
            Ok(p) => return Ok((crate::route::compose(boot, p, &all)?, *f)),
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
        requested: or_any(&requested),
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

/// Which candidates every rank can run, in rank 0's order, matched by name (never by
/// position: ranks can see different candidate lists); and why each of the others cannot.
fn agree(per_rank: &[Vec<(String, Verdict)>]) -> (Vec<String>, Vec<String>) {
    let (mut ok, mut reasons) = (vec![], vec![]);
    let Some(first) = per_rank.first() else {
        return (ok, reasons);
    };
    for (name, _) in first {
        let blocked = per_rank.iter().enumerate().find_map(|(r, vs)| {
            match vs.iter().find(|(n, _)| n == name) {
                Some((_, Verdict::Ok)) => None,
                Some((_, Verdict::No(w))) => Some(format!("{name}: {w} (rank {r})")),
                Some((_, Verdict::BadParam(var, ..))) => {
                    Some(format!("{name}: bad {var} (rank {r})"))
                }
                None => Some(format!("{name}: not available on rank {r}")),
            }
        });
        match blocked {
            Some(why) => reasons.push(why),
            None => ok.push(name.clone()),
        }
    }
    (ok, reasons)
}

fn or_any(requested: &str) -> String {
    if requested.is_empty() {
        "(any)".into()
    } else {
        requested.to_string()
    }
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

    /// Excluding a provider the program does not link excludes nothing (it was an "unknown
    /// provider" error, exit 2); preferring one is still an error.
    #[test]
    fn excluding_what_is_not_here_is_no_error() {
        let ex = Selection::parse("^loopback").unwrap();
        assert!(candidates_with(&ex, &[], &[], None).unwrap().is_empty());
        let pre = Selection::parse("loopback").unwrap();
        assert!(candidates_with(&pre, &[], &[], None).is_err());
    }

    /// Ranks that see different candidates (a library missing on one host, another order)
    /// agree by name: the first of rank 0's candidates that every rank runs. (Voting by
    /// position picked "b" on rank 0 and "c" on rank 1 here.)
    #[test]
    fn selection_agrees_by_name_not_position() {
        let ok = |n: &str| (n.to_string(), Verdict::Ok);
        let no = |n: &str| (n.to_string(), Verdict::No("cannot".into()));
        let per_rank = vec![
            vec![no("a"), ok("b"), ok("c")],
            vec![ok("c"), ok("b")], // no "a" here, and another order
            vec![ok("a"), ok("b"), no("c")],
        ];
        let (order, reasons) = agree(&per_rank);
        assert_eq!(order, vec!["b".to_string()]);
        assert_eq!(reasons.len(), 2, "{reasons:?}");
        assert!(reasons[0].starts_with("a: cannot (rank 0)"), "{reasons:?}");
        assert!(reasons[1].contains("c: cannot (rank 2)"), "{reasons:?}");
        let per_rank = vec![vec![ok("x")], vec![]];
        let (order, reasons) = agree(&per_rank);
        assert!(order.is_empty());
        assert_eq!(reasons, vec!["x: not available on rank 1".to_string()]);
        // The encoding survives the trip through the bootstrap.
        let v = vec![
            ok("shm"),
            no("limic"),
            (
                "tcp-sim".into(),
                Verdict::BadParam("WEFT_X".into(), "abc".into(), "a size".into()),
            ),
        ];
        assert_eq!(decode(&encode(&v)), v);
    }

    #[test]
    fn unknown_name_lists_available() {
        // No provider is linked into the core's own tests: the list is empty, and says so.
        let (all, _) = providers();
        let Err(e) = candidates(&Selection::parse("nope").unwrap(), &all, None) else {
            panic!("'nope' was accepted");
        };
        let msg = e.to_string();
        assert_eq!(e.kind(), crate::ErrorKind::UnknownProvider);
        assert!(
            msg.contains("'nope'") && msg.contains("available:"),
            "{msg}"
        );
    }
}
