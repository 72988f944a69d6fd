//! `WEFT_HYBRID_RULES=auto`: a send-rule chain derived from what each channel costs on this
//! machine, instead of paper 001's fixed sizes.
//!
//! **Calibration.** The two lowest ranks of a host time ping-pongs between them over UD-SR,
//! RC-SR and RC-FP at [`SIZES`], with the job's own verbs-ud and verbs-rc, in interleaved
//! rounds, keeping each median ([`measure_pair`]); the RC connection made for it is closed
//! again before the job starts, so the budget starts from nothing. It takes some
//! milliseconds. A host with one rank times messages to itself instead ([`measure`]: verbs-ud
//! and verbs-rc of its own, a job of one rank) — a poorer guide, since one process then does
//! both sides' work: on the soft HCA it ranks RC-SR ahead of UD-SR for small messages, which
//! ping-pongs between processes do not (docs/history/benchmarks-notebook.md).
//!
//! **The chain** ([`chain_from`]): the sizes cut the range up to 8192 bytes into buckets; in each,
//! the channels in order of measured cost, so that a message takes the cheapest channel open to
//! its peer; neighbouring buckets with the same order are merged. UD-SR is in every bucket, so a
//! peer with UD alone can be sent every message up to 8192 bytes, as with the default chain
//! (and the provider's limits stay the same); the chain ends as the default does, with the
//! zero-copy channels, which carry the rendezvous of larger messages.
//!
//! **Per host, cached.** The lowest rank of each host calibrates, unless a cache file for this
//! host and these settings exists (`WEFT_HYBRID_AUTO_CACHE`, default `$XDG_CACHE_HOME/weft`
//! or `~/.cache/weft`; `none` calibrates every time), and publishes the chain to the other
//! ranks of its host through the bootstrap. The cache file records the measurements next to
//! the chain, and a key made of weft's version and every `WEFT_VERBS_*` setting: any change
//! there calibrates again.

use crate::rules::{Chain, Channel, Cond, Range, Rule};
use std::io::IoSlice;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use weft_provider::bootstrap::{Bootstrap, Singleton};
use weft_provider::provider::{Discard, Provider, SendOutcome};
use weft_provider::types::Rank;
use weft_provider::{Error, Result};
use weft_verbs::channel::{RcChannel, Sizing, UdChannel};
use weft_verbs::rc::VerbsRc;
use weft_verbs::ud::VerbsUd;

weft_provider::param!(AUTO_CACHE: Str = "hybrid", "AUTO_CACHE", "",
    "hybrid: directory of the calibration cache of WEFT_HYBRID_RULES=auto (empty: $XDG_CACHE_HOME/weft or ~/.cache/weft; none: calibrate at every start)");

/// Message sizes measured (payload, as the chain counts them; a 16-byte header on top): the edges of the
/// auto chain's buckets. The last is the largest message the hybrid sends in one piece.
pub const SIZES: [u64; 7] = [64, 256, 1024, 2048, 4096, 6144, 8192];

/// Calibration: interleaved rounds (medians kept) of this many round trips per channel and
/// size: some tens of milliseconds in all.
const ROUNDS: usize = 9;
const PINGPONGS: usize = 100;

/// The channels compared, in the order of [`Costs::ns`].
pub const CHANNELS: [Channel; 3] = [Channel::UdSr, Channel::RcSr, Channel::RcFp];

/// Measured cost per message, ns, of each channel (rows: [`CHANNELS`]) at each of [`SIZES`];
/// `None` where the channel could not send that size (RC-FP beyond its slots).
#[derive(Debug, Clone, PartialEq)]
pub struct Costs {
    pub ns: [[Option<f64>; SIZES.len()]; 3],
}

impl Costs {
    /// The table as comment lines (the cache file, statistics).
    pub fn table(&self) -> String {
        let mut s = String::from("# size UD-SR RC-SR RC-FP (ns per one-way message)\n");
        for (i, size) in SIZES.iter().enumerate() {
            s.push_str(&format!("# {size}"));
            for row in &self.ns {
                match row[i] {
                    Some(v) => s.push_str(&format!(" {v:.0}")),
                    None => s.push_str(" -"),
                }
            }
            s.push('\n');
        }
        s
    }
}

/// Granularity of the auto chain's size boundaries, bytes.
pub const STEP: u64 = 64;

/// Channel `k`'s cost at `size` bytes, linear between the measured sizes (flat below the
/// first); `None` beyond the last size it was measured at.
pub fn cost_at(c: &Costs, k: usize, size: u64) -> Option<f64> {
    let row = &c.ns[k];
    let mut prev: Option<(u64, f64)> = None;
    for (i, &at) in SIZES.iter().enumerate() {
        let v = row[i]?;
        if size <= at {
            return Some(match prev {
                None => v,
                Some((p, pv)) => pv + (v - pv) * (size - p) as f64 / (at - p) as f64,
            });
        }
        prev = Some((at, v));
    }
    None
}

/// The channels for a message of `size` bytes, cheapest first by [`cost_at`] (on a tie the
/// order of [`CHANNELS`]); UD-SR always among them, since every peer starts with UD alone.
pub fn order_at(c: &Costs, size: u64) -> Vec<Channel> {
    let mut order: Vec<(f64, usize)> = (0..CHANNELS.len())
        .filter_map(|k| cost_at(c, k, size).map(|v| (v, k)))
        .collect();
    order.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut chans: Vec<Channel> = order.iter().map(|&(_, k)| CHANNELS[k]).collect();
    if !chans.contains(&Channel::UdSr) {
        chans.push(Channel::UdSr);
    }
    chans
}

/// The chain the costs call for: sizes up to the last of [`SIZES`] cut into buckets of
/// [`STEP`] bytes, each with the channels cheapest first at its upper edge ([`order_at`]),
/// neighbouring buckets with the same order merged; each bucket becomes one rule per channel
/// in that order, so that a message takes the cheapest channel open to its peer.
pub fn chain_from(c: &Costs) -> Chain {
    let mut buckets: Vec<(Range, Vec<Channel>)> = Vec::new();
    let last = SIZES[SIZES.len() - 1];
    let mut lo = 0;
    while lo <= last {
        let hi = (lo / STEP + 1) * STEP;
        let chans = order_at(c, hi);
        match buckets.last_mut() {
            Some((r, prev)) if *prev == chans => r.hi = hi,
            _ => buckets.push((Range { lo, hi }, chans)),
        }
        lo = hi + 1;
    }
    let mut rules = Vec::new();
    for (size, chans) in buckets {
        for channel in chans {
            rules.push(Rule {
                cond: Cond {
                    size,
                    ranks: Range::ALL,
                },
                channel,
            });
        }
    }
    // Beyond the measured sizes, the default chain's end: the zero-copy channels, which the
    // rendezvous of larger messages takes (RC-RDMA to a connected peer, else UD-ZCOPY).
    rules.extend([
        Rule {
            cond: Cond::TRUE,
            channel: Channel::RcRdma,
        },
        Rule {
            cond: Cond::TRUE,
            channel: Channel::UdZcopy,
        },
    ]);
    Chain(rules)
}

/// Everything this long at most (a channel that does not move is an error, not a hang).
const LIMIT: Duration = Duration::from_secs(10);

/// Send `n` messages of `size` bytes to ourselves over `ch`, each received before the next
/// goes; ns per message.
fn time(ud: &mut VerbsUd, rc: &mut VerbsRc, ch: Channel, size: usize, n: usize) -> Result<f64> {
    let hdr = [0u8; 16];
    let body = vec![0x5au8; size];
    let mut sink = Discard::default();
    let t0 = Instant::now();
    for i in 0..n {
        let payload = [IoSlice::new(&body)];
        loop {
            let out = match ch {
                Channel::UdSr => ud.am_send(0, &hdr, &payload)?,
                Channel::RcSr => rc.am_send_via(0, &hdr, &payload, false)?,
                _ => rc.am_send_via(0, &hdr, &payload, true)?,
            };
            if out == SendOutcome::Sent {
                break;
            }
            ud.progress(&mut sink)?;
            rc.progress(&mut sink)?;
            if t0.elapsed() > LIMIT {
                return Err(Error::invalid(format!(
                    "hybrid auto calibration: {} stayed busy",
                    ch.name()
                )));
            }
        }
        while sink.ams <= i {
            match ch {
                Channel::UdSr => ud.progress(&mut sink)?,
                _ => rc.progress(&mut sink)?,
            };
            if t0.elapsed() > LIMIT {
                return Err(Error::invalid(format!(
                    "hybrid auto calibration: a message to itself over {} never arrived",
                    ch.name()
                )));
            }
        }
    }
    Ok(t0.elapsed().as_nanos() as f64 / n as f64)
}

/// Calibrate: verbs-ud and verbs-rc opened for a job of one rank (sized as the hybrid sizes
/// its RC), `rounds` interleaved rounds of `n` messages per channel and size, medians.
pub fn measure(sizing: Sizing, rounds: usize, n: usize) -> Result<Costs> {
    let mut boot = Singleton::new();
    let hca = weft_verbs::open_default()?;
    let mut ud = VerbsUd::open_on(&mut boot, hca.clone())?;
    let mut rc = VerbsRc::open_sized(&mut boot, sizing, hca)?;
    // RC to ourselves, and its RC-FP slots (offered over the connection itself).
    rc.connect(0)?;
    let t0 = Instant::now();
    let mut sink = Discard::default();
    while !rc.fast_path_to(0) && sizing.fp_peers > 0 {
        rc.progress(&mut sink)?;
        if t0.elapsed() > LIMIT {
            return Err(Error::invalid(
                "hybrid auto calibration: RC-FP slots to itself never came up",
            ));
        }
    }
    let ring_max = rc.ring_max();
    let mut samples = vec![vec![Vec::with_capacity(rounds); SIZES.len()]; CHANNELS.len()];
    // One warm-up round, not kept.
    for round in 0..=rounds {
        for (i, &size) in SIZES.iter().enumerate() {
            for (k, &ch) in CHANNELS.iter().enumerate() {
                if ch == Channel::RcFp && (sizing.fp_peers == 0 || size as usize + 16 > ring_max) {
                    continue;
                }
                let t = time(&mut ud, &mut rc, ch, size as usize, n)?;
                if round > 0 {
                    samples[k][i].push(t);
                }
            }
        }
    }
    let _ = ud.close();
    let _ = rc.close();
    Ok(medians(samples))
}

/// The cache file for this host, or `None` when caching is off.
pub fn cache_path() -> Option<PathBuf> {
    let dir = AUTO_CACHE.get_str();
    let dir = match dir.trim() {
        "none" => return None,
        "" => match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
            Some(x) => PathBuf::from(x).join("weft"),
            None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/weft"),
        },
        d => PathBuf::from(d),
    };
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into());
    let host: String = host
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    Some(dir.join(format!("hybrid-auto-{host}.txt")))
}

/// What the measurements depend on: weft's version and every `WEFT_VERBS_*` setting.
fn key(sizing: &Sizing) -> String {
    let mut vars: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("WEFT_VERBS_"))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    vars.sort();
    format!(
        "weft {} fp_peers={} buf={} pool={} {}",
        env!("CARGO_PKG_VERSION"),
        sizing.fp_peers,
        sizing.buf,
        sizing.pool,
        vars.join(" ")
    )
}

/// The chain cached for `key` in `text` (the cache file's contents), if any.
fn cached(text: &str, key: &str) -> Option<Chain> {
    let mut lines = text.lines();
    let first = lines.next()?;
    if first.strip_prefix("# key: ")? != key {
        return None;
    }
    let chain = lines.find(|l| !l.starts_with('#') && !l.trim().is_empty())?;
    Chain::parse(chain).ok()
}

/// The chain cached for this host and these settings, if any.
fn from_cache(sizing: &Sizing) -> Option<Chain> {
    let t = std::fs::read_to_string(cache_path()?).ok()?;
    cached(&t, &key(sizing))
}

/// Cache `chain` and the `costs` it came from (written whole, then renamed into place). A
/// cache that cannot be written is not an error.
fn store(sizing: &Sizing, costs: &Costs, chain: &Chain, how: &str) {
    let k = key(sizing);
    if let Some(p) = cache_path() {
        let text = format!(
            "# key: {k}\n# measured by {how}\n{}{chain}\n",
            costs.table()
        );
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        let written = p
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|_| std::fs::write(&tmp, text))
            .and_then(|_| std::fs::rename(&tmp, &p));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            tracing::debug!("hybrid: auto chain not cached in {}: {e}", p.display());
        }
    }
}

/// One ping-pong series over `ch`: the leader sends `n` messages of `size` bytes to `peer`,
/// each answered with one of the same size over the same channel before the next goes;
/// the leader returns ns per one-way message, the partner 0.
#[allow(clippy::too_many_arguments)]
fn pingpong(
    ud: &mut VerbsUd,
    rc: &mut VerbsRc,
    sink: &mut Discard,
    peer: Rank,
    lead: bool,
    ch: Channel,
    size: usize,
    n: usize,
) -> Result<f64> {
    let hdr = [0u8; 16];
    let body = vec![0x5au8; size];
    let t0 = Instant::now();
    let send = |ud: &mut VerbsUd, rc: &mut VerbsRc, sink: &mut Discard| -> Result<()> {
        let payload = [IoSlice::new(&body)];
        loop {
            let out = match ch {
                Channel::UdSr => ud.am_send(peer, &hdr, &payload)?,
                Channel::RcSr => rc.am_send_via(peer, &hdr, &payload, false)?,
                _ => rc.am_send_via(peer, &hdr, &payload, true)?,
            };
            if out == SendOutcome::Sent {
                return Ok(());
            }
            ud.progress(sink)?;
            rc.progress(sink)?;
            if t0.elapsed() > LIMIT {
                return Err(Error::invalid(format!(
                    "hybrid auto calibration: {} to rank {peer} stayed busy",
                    ch.name()
                )));
            }
        }
    };
    let wait = |ud: &mut VerbsUd, rc: &mut VerbsRc, sink: &mut Discard, want: usize| {
        while sink.ams < want {
            ud.progress(sink)?;
            rc.progress(sink)?;
            if t0.elapsed() > LIMIT {
                return Err(Error::invalid(format!(
                    "hybrid auto calibration: no answer from rank {peer} over {}",
                    ch.name()
                )));
            }
        }
        Ok(())
    };
    let base = sink.ams;
    for i in 0..n {
        if lead {
            send(ud, rc, sink)?;
            wait(ud, rc, sink, base + i + 1)?;
        } else {
            wait(ud, rc, sink, base + i + 1)?;
            send(ud, rc, sink)?;
        }
    }
    Ok(t0.elapsed().as_nanos() as f64 / (2 * n) as f64)
}

/// Calibrate between `me` and `peer`, two ranks of this host, with the job's own channels
/// (the leader, `lead`, returns the costs): RC connected for it and its RC-FP slots set up
/// (`fp`), `rounds` interleaved rounds of `n` round trips per channel and size, medians. The
/// RC connection is left quiesced and quiet; the caller synchronises both sides, then
/// disconnects.
pub fn measure_pair(
    ud: &mut VerbsUd,
    rc: &mut VerbsRc,
    peer: Rank,
    lead: bool,
    fp: bool,
    rounds: usize,
    n: usize,
) -> Result<Option<Costs>> {
    let mut sink = Discard::default();
    ud.connect(peer)?;
    if lead {
        rc.connect(peer)?;
    }
    let t0 = Instant::now();
    while !rc.connected(peer) || (fp && !rc.fast_path_to(peer)) {
        ud.progress(&mut sink)?;
        rc.progress(&mut sink)?;
        if t0.elapsed() > LIMIT {
            return Err(Error::invalid(format!(
                "hybrid auto calibration: no RC connection (with RC-FP slots) to rank {peer}"
            )));
        }
    }
    let ring_max = rc.ring_max();
    let mut samples = vec![vec![Vec::with_capacity(rounds); SIZES.len()]; CHANNELS.len()];
    for round in 0..=rounds {
        for (i, &size) in SIZES.iter().enumerate() {
            for (k, &ch) in CHANNELS.iter().enumerate() {
                if ch == Channel::RcFp && (!fp || size as usize + 16 > ring_max) {
                    continue;
                }
                let t = pingpong(ud, rc, &mut sink, peer, lead, ch, size as usize, n)?;
                if round > 0 {
                    samples[k][i].push(t);
                }
            }
        }
    }
    rc.quiesce(peer)?;
    let t0 = Instant::now();
    while !rc.quiet(peer) {
        ud.progress(&mut sink)?;
        rc.progress(&mut sink)?;
        if t0.elapsed() > LIMIT {
            return Err(Error::invalid(
                "hybrid auto calibration: RC sends never completed",
            ));
        }
    }
    Ok(lead.then(|| medians(samples)))
}

fn medians(mut samples: Vec<Vec<Vec<f64>>>) -> Costs {
    let mut ns = [[None; SIZES.len()]; 3];
    for (k, row) in samples.iter_mut().enumerate() {
        for (i, s) in row.iter_mut().enumerate() {
            if !s.is_empty() {
                s.sort_by(f64::total_cmp);
                ns[k][i] = Some(s[s.len() / 2]);
            }
        }
    }
    Costs { ns }
}

/// The auto chain agreed across the job, called by every rank once the job's verbs-ud and
/// verbs-rc are open: per host, the lowest rank reads the cache or, failing that, calibrates
/// with the second-lowest ([`measure_pair`]; alone, [`measure`]), caches the result and
/// publishes it; every rank reads its host's. Two fences, on every rank.
pub fn chain_for_job(
    boot: &mut dyn Bootstrap,
    ud: &mut VerbsUd,
    rc: &mut VerbsRc,
    sizing: Sizing,
) -> Result<Chain> {
    let nodes = boot.nodes().clone();
    let me = boot.rank();
    let mut local = nodes
        .host_of
        .iter()
        .enumerate()
        .filter(|&(_, &h)| h == nodes.my_host)
        .map(|(r, _)| r as Rank);
    let (leader, partner) = (local.next(), local.next());
    let host = nodes.my_host;
    let fp = sizing.fp_peers > 0;
    // 1: the leader says whether the pair must measure.
    let mut found = None;
    if leader == Some(me) {
        found = from_cache(&sizing);
        let need = if found.is_some() { "no" } else { "yes" };
        boot.put(&format!("hybrid.auto.need.{host}"), need)?;
    }
    boot.fence()?;
    let mut outcome: Result<Option<(Costs, &str)>> = Ok(None);
    if leader == Some(me) && found.is_none() {
        outcome = match partner {
            Some(p) => {
                measure_pair(ud, rc, p, true, fp, ROUNDS, PINGPONGS).map(|c| c.map(|c| (c, "pair")))
            }
            None => measure(sizing, ROUNDS, PINGPONGS).map(|c| Some((c, "loop"))),
        };
    } else if partner == Some(me) {
        let need = boot.get(&format!("hybrid.auto.need.{host}"))?;
        if need == "yes" {
            let l = leader.expect("a partner has a leader");
            outcome = measure_pair(ud, rc, l, false, fp, ROUNDS, PINGPONGS).map(|_| None);
        }
    }
    // 2: the leader publishes the chain (or the failure, so that nobody waits for it).
    if leader == Some(me) {
        let text = match (&found, &outcome) {
            (Some(c), _) => c.to_string(),
            (None, Ok(Some((costs, how)))) => {
                let chain = chain_from(costs);
                store(
                    &sizing,
                    costs,
                    &chain,
                    if *how == "pair" {
                        "ping-pong between two ranks of this host"
                    } else {
                        "messages to itself (one rank on this host)"
                    },
                );
                chain.to_string()
            }
            (None, Ok(None)) => "error: nothing measured".to_string(),
            (None, Err(e)) => format!("error: {e}"),
        };
        boot.put(&format!("hybrid.auto.{host}"), &text)?;
    }
    boot.fence()?;
    // Both sides are quiet (the fence): the calibration's connection goes.
    if let (Some(l), Some(p)) = (leader, partner) {
        if me == l {
            rc.disconnect(p)?;
        } else if me == p {
            rc.disconnect(l)?;
        }
    }
    outcome?;
    let text = boot.get(&format!("hybrid.auto.{host}"))?;
    if let Some(e) = text.strip_prefix("error: ") {
        return Err(Error::invalid(format!(
            "WEFT_HYBRID_RULES=auto: calibration on this host failed: {e}"
        )));
    }
    Chain::parse(&text).map_err(|e| {
        Error::invalid(format!(
            "WEFT_HYBRID_RULES=auto: the chain published for this host is malformed: {e}"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::Open;

    fn costs(ud: [f64; 7], sr: [f64; 7], fp: [Option<f64>; 7]) -> Costs {
        Costs {
            ns: [ud.map(Some), sr.map(Some), fp],
        }
    }

    /// Every size takes the cheapest channel open to its peer (to within one bucket of the
    /// crossing points), with every peer able to reach every size over UD-SR.
    fn follows_the_costs(c: &Costs) {
        let chain = chain_from(c);
        assert_eq!(Chain::parse(&chain.to_string()).unwrap(), chain);
        let job = chain.for_job(4).unwrap();
        assert_eq!(job.ud_sr_upto(), Some(8192));
        let sets = [
            Open::ALL,
            Open::UD.with(Channel::RcSr),
            Open::UD.with(Channel::RcSr).with(Channel::RcFp),
        ];
        for size in (1..=8192).step_by(7) {
            assert_eq!(job.pick(size, Open::UD), Some(Channel::UdSr), "{size}");
            let edge = size.div_ceil(STEP).max(1) * STEP;
            for open in sets {
                let best = order_at(c, edge).into_iter().find(|&ch| open.has(ch));
                assert_eq!(job.pick(size, open), best, "{size} B, {open:?}: {chain}");
            }
        }
    }

    #[test]
    fn cheapest_first_with_boundaries_where_the_costs_cross() {
        // RC-FP cheapest up to 2 KiB (then beyond its slots); UD-SR cheaper than RC-SR for
        // small messages, RC-SR from where the lines cross (between 1 and 2 KiB).
        let c = costs(
            [1100.0, 1110.0, 1300.0, 1950.0, 2650.0, 3700.0, 4500.0],
            [1370.0, 1370.0, 1400.0, 1400.0, 1460.0, 1480.0, 2300.0],
            [
                Some(490.0),
                Some(545.0),
                Some(566.0),
                Some(635.0),
                None,
                None,
                None,
            ],
        );
        follows_the_costs(&c);
        let chain = chain_from(&c).to_string();
        // UD-SR ahead of RC-SR up to about 1.15 KiB: 1300 + 650 (x - 1024) / 1024 = 1400.
        assert!(chain.starts_with("{size<=1152: RC-FP}, {size<=1152: UD-SR}, {size<=1152: RC-SR}, {size>=1153&size<=2048: RC-FP}, {size>=1153&size<=2048: RC-SR}"), "{chain}");
        assert!(
            chain.ends_with("{true: RC-RDMA}, {true: UD-ZCOPY}"),
            "{chain}"
        );
    }

    #[test]
    fn cost_lines_are_interpolated_and_end_where_measured() {
        let c = costs(
            [100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0],
            [1.0; 7],
            [Some(10.0), Some(20.0), None, None, None, None, None],
        );
        assert_eq!(cost_at(&c, 0, 1), Some(100.0));
        assert_eq!(cost_at(&c, 0, 160), Some(150.0));
        assert_eq!(cost_at(&c, 2, 256), Some(20.0));
        assert_eq!(cost_at(&c, 2, 257), None);
        assert_eq!(cost_at(&c, 0, 8193), None);
        follows_the_costs(&c);
    }

    #[test]
    fn a_channel_cheapest_everywhere_makes_a_short_chain() {
        let c = costs([1.0; 7], [2.0; 7], [None; 7]);
        assert_eq!(
            chain_from(&c).to_string(),
            "{size<=8192: UD-SR}, {size<=8192: RC-SR}, {true: RC-RDMA}, {true: UD-ZCOPY}"
        );
        follows_the_costs(&c);
    }

    #[test]
    fn the_cache_answers_only_for_its_key() {
        let text = "# key: k1\n# size UD-SR RC-SR RC-FP\n{size<=8192: UD-SR}\n";
        assert_eq!(
            cached(text, "k1").map(|c| c.to_string()).as_deref(),
            Some("{size<=8192: UD-SR}")
        );
        assert!(cached(text, "k2").is_none());
        assert!(cached("# key: k1\n{size<=: UD}\n", "k1").is_none());
        assert!(cached("", "k1").is_none());
    }

    #[test]
    fn calibration_measures_every_channel_and_size() {
        let sizing = Sizing {
            fp_peers: 8,
            fp_threshold: 0,
            buf: 8192,
            pool: 64,
            conns: 16,
            fp_payload: 0,
            fp_bufs: 0,
            sq: 0,
            sges: 0,
        };
        let c = measure(sizing, 1, 4).unwrap();
        for (k, row) in c.ns.iter().enumerate() {
            for (i, v) in row.iter().enumerate() {
                if CHANNELS[k] != Channel::RcFp {
                    assert!(v.is_some_and(|v| v > 0.0), "{k} {i}: {c:?}");
                }
            }
        }
        assert!(c.ns[2][0].is_some(), "RC-FP at 64 bytes: {c:?}");
        let job = chain_from(&c).for_job(2).unwrap();
        assert_eq!(job.ud_sr_upto(), Some(8192));
    }
}
