//! The synthetic scale run: one process opens a provider for a job of thousands of ranks and
//! makes it take the resources it would hold for each of them, without the thousands of
//! processes.
//!
//! The process is rank 0 of a job of `size` ranks whose other ranks are *phantoms*: their
//! published addresses are rank 0's own with a queue-pair number no queue pair has, so the
//! HCA drops whatever is sent to them (as a fabric drops datagrams to a QP that does not
//! exist). First contact with every phantom (`Provider::connect`, which the core calls before
//! the first operation towards a peer) makes each provider create what it holds per peer:
//! verbs-ud the address handle and the reliability engine's link, the hybrid that and its
//! one record per peer (order and budget), verbs-rc its RC queue pair, address handle and records (its
//! connection requests go unanswered). The memory counters are read right after. Messages in
//! flight are not part of the figure: a real peer acknowledges them, a phantom cannot.
//!
//! What a phantom cannot show: the state a completed RC connection adds (verbs-rc's RC-FP
//! rings, at most `WEFT_VERBS_RC_FP_PEERS` of them; the hybrid's RC connections, at most
//! `WEFT_HYBRID_MAX_RC`). Both are bounded and measured with real ranks (`weft bench mem`);
//! docs/history/benchmarks-notebook.md adds them to the synthetic figures (example `scale` prints these).

use crate::Hybrid;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use weft_provider::bootstrap::{Bootstrap, KvSpace, NodeMap};
use weft_provider::provider::{Discard, Provider, StaticProvider};
use weft_provider::types::Rank;
use weft_provider::{Error, Result};
use weft_verbs::rc::VerbsRc;
use weft_verbs::ud::VerbsUd;

/// The queue-pair number the phantoms' addresses carry: the largest a 24-bit field holds, which
/// no HCA hands out before the 16 millionth queue pair.
const PHANTOM_QPN: u32 = 0xff_ffff;

/// Memory of one provider in one process of a job, from its `mem_*` counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    /// Ranks in the job.
    pub size: u32,
    /// Peers this process sent to (or connected to).
    pub touched: u32,
    /// HCA structures: queue pairs, completion and shared receive queues, registrations.
    pub hca: u64,
    /// Buffers: pools, rings, their mirrors.
    pub buffers: u64,
    /// Per-peer tables.
    pub tables: u64,
}

impl Footprint {
    pub fn total(&self) -> u64 {
        self.hca + self.buffers + self.tables
    }
}

/// Key-value space of a phantom job: what rank 0 publishes, and for any other rank the same
/// key with rank 0's address pointed at [`PHANTOM_QPN`].
#[derive(Default)]
struct PhantomKv(Mutex<HashMap<String, String>>);

impl PhantomKv {
    fn lookup(&self, key: &str) -> Option<String> {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = map.get(key) {
            return Some(v.clone());
        }
        let (prefix, rank) = key.rsplit_once('.')?;
        rank.parse::<u32>().ok().filter(|&r| r > 0)?;
        let mine = map.get(&format!("{prefix}.0"))?;
        phantom_address(mine)
    }
}

/// `gid:qpn:psn[:lid]` (a verbs endpoint) with the queue-pair number replaced.
fn phantom_address(ep: &str) -> Option<String> {
    let mut parts: Vec<&str> = ep.split(':').collect();
    if parts.len() < 3 || u32::from_str_radix(parts[1], 16).is_err() {
        return None;
    }
    let q = format!("{PHANTOM_QPN:x}");
    parts[1] = &q;
    Some(parts.join(":"))
}

impl KvSpace for PhantomKv {
    fn put(&self, key: &str, value: &str) -> Result<()> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.to_string(), value.to_string());
        Ok(())
    }

    fn get(&self, key: &str) -> Result<Option<String>> {
        Ok(self.lookup(key))
    }
}

/// Rank 0 of a job of `size` ranks whose other ranks are phantoms, every rank on its own host
/// (so that nothing is routed to shared memory).
struct Phantom {
    size: u32,
    kv: Arc<PhantomKv>,
    nodes: NodeMap,
    job: String,
}

impl Phantom {
    fn new(size: u32) -> Phantom {
        Phantom {
            size,
            kv: Arc::default(),
            nodes: NodeMap {
                host_of: (0..size).collect(),
                my_host: 0,
            },
            job: format!("phantom-{}-{size}", std::process::id()),
        }
    }
}

impl Bootstrap for Phantom {
    fn rank(&self) -> Rank {
        0
    }
    fn size(&self) -> u32 {
        self.size
    }
    fn job_id(&self) -> &str {
        &self.job
    }
    fn put(&mut self, key: &str, value: &str) -> Result<()> {
        self.kv.put(key, value)
    }
    fn fence(&mut self) -> Result<()> {
        Ok(())
    }
    fn get(&mut self, key: &str) -> Result<String> {
        self.kv
            .lookup(key)
            .ok_or_else(|| Error::invalid(format!("phantom job: nothing published as {key}")))
    }
    fn nodes(&self) -> &NodeMap {
        &self.nodes
    }
    fn kv(&self) -> Option<Arc<dyn KvSpace>> {
        Some(self.kv.clone())
    }
}

fn footprint(p: &dyn Provider, size: u32, touched: u32) -> Result<Footprint> {
    let c = p.counters();
    let get = |k: &str| c.iter().find(|(n, _)| *n == k).map(|(_, v)| *v);
    match (
        get("mem_hca_bytes"),
        get("mem_buffer_bytes"),
        get("mem_peer_bytes"),
    ) {
        (Some(hca), Some(buffers), Some(tables)) => Ok(Footprint {
            size,
            touched,
            hca,
            buffers,
            tables,
        }),
        _ => Err(Error::invalid("this provider reports no mem_* counters")),
    }
}

/// Measurements take turns: the HCA's accounting covers the whole process, so nothing else in
/// it should open the HCA meanwhile.
static TURN: Mutex<()> = Mutex::new(());

/// `provider` (verbs-ud, verbs-rc or hybrid) opened as rank 0 of a phantom job of `size` ranks,
/// after first contact with every other rank and one progress call.
fn opened(provider: &str, size: u32) -> Result<Box<dyn Provider>> {
    let mut p = contacted(provider, size, size)?;
    p.progress(&mut Discard::default())?;
    Ok(p)
}

/// `provider` opened as rank 0 of a phantom job of `size` ranks, after first contact with ranks
/// 1 to `peers` (every other rank at most), not progressed yet.
fn contacted(provider: &str, size: u32, peers: u32) -> Result<Box<dyn Provider>> {
    if size < 2 {
        return Err(Error::invalid("synthetic run: a job of at least 2 ranks"));
    }
    let mut boot = Phantom::new(size);
    let mut p: Box<dyn Provider> = match provider {
        "verbs-ud" => Box::new(VerbsUd::open(&mut boot)?),
        "hybrid" => Box::new(Hybrid::open(&mut boot)?),
        "verbs-rc" => Box::new(VerbsRc::open(&mut boot)?),
        other => {
            return Err(Error::invalid(format!(
                "synthetic run: {other} is not one of verbs-ud, verbs-rc, hybrid"
            )))
        }
    };
    for r in 1..=peers.min(size - 1) {
        p.connect(r)?;
    }
    Ok(p)
}

/// Memory of `provider` (verbs-ud, verbs-rc or hybrid) in a process of a job of `size` ranks
/// that has sent to (verbs-rc: asked to connect to) every other rank.
pub fn measure(provider: &str, size: u32) -> Result<Footprint> {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let p = opened(provider, size)?;
    footprint(&*p, size, size - 1)
}

/// Memory of `provider` in a process of a job of `size` ranks that has talked to `peers` of
/// them (ranks 1 to `peers`: a neighbourhood, as a stencil code's): what the job's size costs a
/// process that does not talk to everyone.
pub fn measure_talking_to(provider: &str, size: u32, peers: u32) -> Result<Footprint> {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let mut p = contacted(provider, size, peers)?;
    p.progress(&mut Discard::default())?;
    footprint(&*p, size, peers.min(size - 1))
}

/// Nanoseconds an idle progress call of `provider` takes on average (over `calls`), in a
/// process of a job of `size` ranks that has made first contact with every other rank: what a
/// waiting rank pays per poll for the peers it has talked to. Phantoms never answer, so
/// set `WEFT_VERBS_UD_KEEPALIVE=0` first (the example `scale` does): an unanswered keepalive
/// probe would keep its link busy.
pub fn idle_progress_ns(provider: &str, size: u32, calls: u32) -> Result<f64> {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let mut p = opened(provider, size)?;
    // Past the first calls, which still find the contacts' work.
    for _ in 0..64 {
        p.progress(&mut Discard::default())?;
    }
    let t0 = std::time::Instant::now();
    for _ in 0..calls.max(1) {
        p.progress(&mut Discard::default())?;
    }
    Ok(t0.elapsed().as_nanos() as f64 / f64::from(calls.max(1)))
}

/// The links the first keepalive round of `provider` (verbs-ud or hybrid) probes in a process
/// of a job of `size` ranks that has made first contact with every other rank. A round is due
/// at once after opening (with `WEFT_VERBS_UD_KEEPALIVE` above 0, as by default); a phantom
/// never acknowledges, so each probed link stays busy and counts.
pub fn keepalive_probes(provider: &str, size: u32) -> Result<u64> {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let mut p = contacted(provider, size, size)?;
    // An idle call only polls; the timers (the keepalive round among them) run on every
    // 16th. Links that were busy only with first contact leave the list on that call.
    for _ in 0..32 {
        p.progress(&mut Discard::default())?;
    }
    p.counters()
        .iter()
        .find(|(k, _)| *k == "busy_links" || *k == "ud_busy_links")
        .map(|(_, v)| *v)
        .ok_or_else(|| Error::invalid(format!("synthetic run: {provider} has no UD links")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phantom_addresses_point_nowhere() {
        let kv = PhantomKv::default();
        kv.put("verbs-ud.0", "fe80000000000000000000000000abcd:2a:7:1")
            .unwrap();
        assert_eq!(
            kv.get("verbs-ud.5").unwrap().as_deref(),
            Some("fe80000000000000000000000000abcd:ffffff:7:1")
        );
        assert_eq!(
            kv.get("verbs-ud.0").unwrap().as_deref(),
            Some("fe80000000000000000000000000abcd:2a:7:1")
        );
        assert_eq!(kv.get("verbs-rc.5").unwrap(), None);
        assert_eq!(kv.get("nodot").unwrap(), None);
        assert_eq!(phantom_address("nonsense"), None);
    }

    /// verbs-ud's memory counters agree with what `weft info` prints per peer: an address
    /// book entry and a slot per rank, a record per peer talked to. (The counters added the
    /// link's size a second time, though it sits inside the record: 912 bytes a peer against
    /// 520.)
    #[test]
    fn ud_counters_count_each_peer_once() {
        let f = {
            let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
            weft_verbs::ud::footprint().expect("footprint")
        };
        let (a, b) = (
            measure("verbs-ud", 2).expect("measured"),
            measure("verbs-ud", 1025).expect("measured"),
        );
        // 1,024 peers: the lists' capacities are exact (they double).
        let per_peer = (b.tables - a.tables) as f64 / 1023.0;
        let want = (f.per_rank + f.per_peer) as f64;
        assert!(
            (per_peer - want).abs() <= 8.0,
            "counters {per_peer} B a peer, footprint {want}"
        );
    }

    #[test]
    fn idle_progress_is_measured_for_each_provider() {
        for p in ["verbs-ud", "hybrid", "verbs-rc"] {
            let ns = idle_progress_ns(p, 64, 100).expect("measured");
            assert!(ns.is_finite() && ns > 0.0, "{p}: {ns}");
        }
        assert!(idle_progress_ns("tcp-sim", 4, 1).is_err());
    }

    /// A keepalive round probes `WEFT_VERBS_UD_KEEPALIVE_PEERS` (128) links at most, whatever
    /// the peers talked to (it probed every link until the send buffers ran out).
    #[test]
    fn a_keepalive_round_probes_a_bounded_number_of_links() {
        for p in ["verbs-ud", "hybrid"] {
            assert_eq!(keepalive_probes(p, 3).expect("measured"), 2, "{p}");
            assert_eq!(keepalive_probes(p, 300).expect("measured"), 128, "{p}");
        }
        assert!(keepalive_probes("verbs-rc", 3).is_err());
    }

    /// From LIMITS_FROM ranks on the hybrid gives RC-FP to as many peers as it may connect,
    /// each ring half as deep as a small job's: the same slots as paper 001's 8 whole rings.
    /// A mid-sized job gives every peer RC and up to 64 of them rings of the same half depth.
    #[test]
    fn a_large_job_shares_the_rc_fp_slots_of_eight_rings_among_sixteen_peers() {
        let open = |n| Hybrid::open(&mut Phantom::new(n)).expect("open hybrid");
        let (small, mid, large) = (open(16), open(64), open(512));
        let (ls, lm, ll) = (small.limits(), mid.limits(), large.limits());
        assert_eq!((ls.max_rc, ls.max_fp), (16, 15), "a small job: every peer");
        assert_eq!(
            (lm.max_rc, lm.max_fp),
            (63, 63),
            "a mid-sized job: every peer"
        );
        assert_eq!((ll.max_rc, ll.max_fp), (16, 16));
        assert_eq!(
            mid.fp_bytes_per_peer(),
            large.fp_bytes_per_peer(),
            "half rings in both"
        );
        let (fs, fl) = (small.fp_bytes_per_peer(), large.fp_bytes_per_peer());
        let (fs, fl) = (fs.expect("RC-FP"), fl.expect("RC-FP"));
        // Half the slots; each ring keeps a few words of its own besides them.
        assert!(
            fl < fs && (fl * 2).abs_diff(fs) <= 64,
            "{fl} B a peer against {fs}"
        );
        let (shared, whole) = (fl * ll.max_fp as u64, fs * 8);
        assert!(
            shared <= whole + 64 * 16,
            "{shared} B of slots against {whole}"
        );
    }
}
