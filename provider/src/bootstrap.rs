//! Bootstrap: how ranks find each other before any provider is open.
//!
//! A [`Bootstrap`] gives a rank its place in the job, a key-value space where providers publish
//! their addresses, collective fences, and the [`NodeMap`] (which ranks share a host).
//! Implementations: PMI-1 (`weft::bootstrap::pmi`, for processes started by `weft run`, Hydra
//! or Slurm), [`Singleton`] (a program started without a launcher is a world of one) and
//! [`InProcess`] (ranks as threads of one process, for tests).

use crate::types::Rank;
use crate::{Error, ErrorDetail, Result};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Which ranks share a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeMap {
    /// Host index of every world rank (hosts numbered in order of first appearance).
    pub host_of: Vec<u32>,
    /// This rank's host index.
    pub my_host: u32,
}

impl NodeMap {
    /// Everyone on one host.
    pub fn single_host(size: u32) -> Self {
        NodeMap {
            host_of: vec![0; size as usize],
            my_host: 0,
        }
    }

    /// Build from per-rank host identifiers.
    pub fn from_ids(ids: &[String], me: Rank) -> Self {
        let mut index: HashMap<&str, u32> = HashMap::new();
        let host_of: Vec<u32> = ids
            .iter()
            .map(|id| {
                let n = index.len() as u32;
                *index.entry(id.as_str()).or_insert(n)
            })
            .collect();
        let my_host = host_of[me as usize];
        NodeMap { host_of, my_host }
    }

    pub fn hosts(&self) -> u32 {
        self.host_of.iter().copied().max().map_or(1, |m| m + 1)
    }

    pub fn is_local(&self, rank: Rank) -> bool {
        self.host_of.get(rank as usize) == Some(&self.my_host)
    }

    /// World ranks on this host, ascending.
    pub fn local_ranks(&self) -> Vec<Rank> {
        (0..self.host_of.len() as Rank)
            .filter(|r| self.is_local(*r))
            .collect()
    }

    /// Index of `rank` among the ranks of its host.
    pub fn local_index(&self, rank: Rank) -> Option<usize> {
        let h = *self.host_of.get(rank as usize)?;
        Some(
            self.host_of[..rank as usize]
                .iter()
                .filter(|x| **x == h)
                .count(),
        )
    }
}

crate::param!(HOST_ID: Str = "", "HOST_ID", "",
    "this rank's host identity (ranks with equal ones share a host); empty: hostname, boot id and network namespace");

/// This host's identity: hostname, boot id and network namespace, so that two network namespaces
/// on one machine count as two hosts. `WEFT_HOST_ID` overrides it.
pub fn host_id() -> String {
    let v = HOST_ID.raw();
    if !v.is_empty() {
        return v;
    }
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into());
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let netns = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("{hostname}/{boot}/{netns}")
}

/// The job's key-value space, as a provider keeps it after `open` ([`Bootstrap::kv`]): to
/// look a peer's address up the first time it talks to that peer (lazy connection) instead of
/// reading every rank's at open.
pub trait KvSpace: Send + Sync {
    /// Publish `key = value` for the others; visible to them after the next collective fence
    /// (the core fences once right after opening the provider), or sooner where the launcher
    /// allows.
    fn put(&self, key: &str, value: &str) -> Result<()>;
    /// A published value; `Ok(None)` if `key` was not published (or not visible yet).
    fn get(&self, key: &str) -> Result<Option<String>>;
}

/// The launcher-side services a rank uses to find its peers.
pub trait Bootstrap {
    fn rank(&self) -> Rank;
    fn size(&self) -> u32;
    /// A name unique to this job (the PMI kvsname).
    fn job_id(&self) -> &str;
    /// Publish `key = value` (visible to everyone after the next [`Bootstrap::fence`]).
    fn put(&mut self, key: &str, value: &str) -> Result<()>;
    /// Collective: commit puts and wait for every rank.
    fn fence(&mut self) -> Result<()>;
    /// Read a key published by any rank before the last fence.
    fn get(&mut self, key: &str) -> Result<String>;
    fn nodes(&self) -> &NodeMap;
    /// The ranks are threads of one process.
    fn in_process(&self) -> bool {
        false
    }
    /// A handle to the key-value space that stays usable after `open` (see [`KvSpace`]);
    /// `None` if this bootstrap cannot give one.
    fn kv(&self) -> Option<Arc<dyn KvSpace>> {
        None
    }
    /// Tell the launcher this job is failing; best effort.
    fn abort(&mut self, _code: i32, _msg: &str) {}
    /// Orderly end of the job for this rank.
    fn finalize(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Jobs up to this size gather directly: every rank reads every other rank's key.
pub const DIRECT_GATHER_MAX: u32 = 32;

/// Collective helper: every rank publishes `value` under `key`, then learns everyone's.
///
/// Up to [`DIRECT_GATHER_MAX`] ranks, every rank reads every other rank's key after one fence.
/// Beyond, that is `size²` requests to the launcher (three million for the three exchanges of
/// a 1024-rank start-up, answered one at a time by a PMI-1 server), so rank 0 reads the `size`
/// keys, publishes them as one table (each distinct value once, then the ranks' indices in
/// runs: ranks of one host share a host identity and a selection verdict, so the table stays
/// small) under `{key}.all`, and after a second fence every rank reads that one key (which the
/// bootstrap splits over several where the launcher's value length asks).
pub fn allgather(boot: &mut dyn Bootstrap, key: &str, value: &str) -> Result<Vec<String>> {
    let (me, n) = (boot.rank(), boot.size());
    boot.put(&format!("{key}.{me}"), value)?;
    boot.fence()?;
    if n <= DIRECT_GATHER_MAX {
        return (0..n)
            .map(|r| {
                if r == me {
                    Ok(value.to_string())
                } else {
                    boot.get(&format!("{key}.{r}"))
                }
            })
            .collect();
    }
    let table = if me == 0 {
        let mut all = Vec::with_capacity(n as usize);
        all.push(value.to_string());
        for r in 1..n {
            all.push(boot.get(&format!("{key}.{r}"))?);
        }
        let t = encode_table(&all);
        boot.put(&format!("{key}.all"), &t)?;
        boot.fence()?;
        return Ok(all);
    } else {
        boot.fence()?;
        boot.get(&format!("{key}.all"))?
    };
    decode_table(&table, n as usize).map_err(|why| {
        Error::from(ErrorDetail::Bootstrap(format!(
            "the table of '{key}' that rank 0 published is malformed: {why}"
        )))
    })
}

/// `values` as `<distinct>;<len>:<value>...;<index>*<run>,...` (lengths in bytes).
fn encode_table(values: &[String]) -> String {
    let mut distinct: Vec<&str> = vec![];
    let mut runs: Vec<(usize, usize)> = vec![];
    for v in values {
        let i = match distinct.iter().position(|d| *d == v.as_str()) {
            Some(i) => i,
            None => {
                distinct.push(v);
                distinct.len() - 1
            }
        };
        match runs.last_mut() {
            Some((j, c)) if *j == i => *c += 1,
            _ => runs.push((i, 1)),
        }
    }
    let mut t = format!("{};", distinct.len());
    for d in &distinct {
        t.push_str(&format!("{}:{d}", d.len()));
    }
    t.push(';');
    let runs: Vec<String> = runs.iter().map(|(i, c)| format!("{i}*{c}")).collect();
    t.push_str(&runs.join(","));
    t
}

/// Undo [`encode_table`], checking that it covers exactly `n` ranks.
fn decode_table(t: &str, n: usize) -> std::result::Result<Vec<String>, String> {
    let (count, mut rest) = t.split_once(';').ok_or("no distinct-value count")?;
    let count: usize = count.parse().map_err(|_| format!("bad count '{count}'"))?;
    if count > n {
        return Err(format!("{count} distinct values for {n} ranks"));
    }
    let mut distinct = Vec::with_capacity(count);
    for _ in 0..count {
        let (len, tail) = rest.split_once(':').ok_or("a value without its length")?;
        let len: usize = len.parse().map_err(|_| format!("bad length '{len}'"))?;
        let v = tail
            .get(..len)
            .ok_or_else(|| format!("a value of {len} bytes cut short"))?;
        distinct.push(v.to_string());
        rest = &tail[len..];
    }
    let runs = rest.strip_prefix(';').ok_or("no ';' before the runs")?;
    let mut all = Vec::with_capacity(n);
    for run in runs.split(',').filter(|r| !r.is_empty()) {
        let (i, c) = run
            .split_once('*')
            .ok_or_else(|| format!("bad run '{run}'"))?;
        let i: usize = i.parse().map_err(|_| format!("bad index in '{run}'"))?;
        let c: usize = c.parse().map_err(|_| format!("bad count in '{run}'"))?;
        let v = distinct
            .get(i)
            .ok_or_else(|| format!("index {i} beyond {count} values"))?;
        if c > n - all.len() {
            return Err(format!("runs cover more than {n} ranks"));
        }
        all.extend(std::iter::repeat_n(v.clone(), c));
    }
    if all.len() != n {
        return Err(format!("runs cover {} of {n} ranks", all.len()));
    }
    Ok(all)
}

/// A program started without a launcher: a world of one.
#[derive(Debug)]
pub struct Singleton {
    kv: Arc<Mutex<HashMap<String, String>>>,
    nodes: NodeMap,
    job: String,
}

impl Default for Singleton {
    fn default() -> Self {
        Self::new()
    }
}

impl Singleton {
    pub fn new() -> Self {
        // Unique per instance: two singleton worlds in one process are two jobs.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Singleton {
            kv: Arc::default(),
            nodes: NodeMap::single_host(1),
            job: format!("singleton-{}-{n}", std::process::id()),
        }
    }
}

impl Bootstrap for Singleton {
    fn rank(&self) -> Rank {
        0
    }
    fn size(&self) -> u32 {
        1
    }
    fn job_id(&self) -> &str {
        &self.job
    }
    fn put(&mut self, key: &str, value: &str) -> Result<()> {
        MapKv(self.kv.clone()).put(key, value)
    }
    fn fence(&mut self) -> Result<()> {
        Ok(())
    }
    fn get(&mut self, key: &str) -> Result<String> {
        MapKv(self.kv.clone())
            .get(key)?
            .ok_or_else(|| never_published(key))
    }
    fn nodes(&self) -> &NodeMap {
        &self.nodes
    }
    fn kv(&self) -> Option<Arc<dyn KvSpace>> {
        Some(Arc::new(MapKv(self.kv.clone())))
    }
}

fn never_published(key: &str) -> Error {
    Error::from(ErrorDetail::Bootstrap(format!(
        "key '{key}' was never published"
    )))
}

/// A key-value space in this process's memory (a singleton's, an in-process job's).
struct MapKv(Arc<Mutex<HashMap<String, String>>>);

impl KvSpace for MapKv {
    fn put(&self, key: &str, value: &str) -> Result<()> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.insert(key.to_string(), value.to_string());
        Ok(())
    }
    fn get(&self, key: &str) -> Result<Option<String>> {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        Ok(m.get(key).cloned())
    }
}

#[derive(Debug, Default)]
struct JobState {
    kv: HashMap<String, String>,
    arrived: u32,
    generation: u64,
    /// A rank left the job (panicked or dropped its bootstrap mid-job).
    broken: Option<String>,
}

/// Shared state of an in-process job.
#[derive(Debug)]
pub struct InProcessJob {
    size: u32,
    id: String,
    timeout: Duration,
    state: Mutex<JobState>,
    cv: Condvar,
}

impl InProcessJob {
    /// A job of `size` thread ranks; fences fail after `timeout`.
    pub fn new(size: u32, timeout: Duration) -> Arc<Self> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Arc::new(InProcessJob {
            size,
            id: format!(
                "inproc-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ),
            timeout,
            state: Mutex::new(JobState::default()),
            cv: Condvar::new(),
        })
    }

    /// The bootstrap of one rank.
    pub fn rank(self: &Arc<Self>, rank: Rank) -> InProcess {
        InProcess {
            job: self.clone(),
            rank,
            nodes: NodeMap::single_host(self.size),
            pending: Vec::new(),
        }
    }

    /// Mark the job broken (a rank died): every fence then fails instead of waiting.
    pub fn break_job(&self, why: &str) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.broken.get_or_insert_with(|| why.to_string());
        self.cv.notify_all();
    }

    pub fn id(&self) -> &str {
        &self.id
    }
}

/// An in-process job's key-value space, after open: a put is visible at once.
struct JobKv(Arc<InProcessJob>);

impl KvSpace for JobKv {
    fn put(&self, key: &str, value: &str) -> Result<()> {
        let mut st = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        st.kv.insert(key.to_string(), value.to_string());
        Ok(())
    }
    fn get(&self, key: &str) -> Result<Option<String>> {
        let st = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        Ok(st.kv.get(key).cloned())
    }
}

/// One thread rank's bootstrap.
#[derive(Debug)]
pub struct InProcess {
    job: Arc<InProcessJob>,
    rank: Rank,
    nodes: NodeMap,
    pending: Vec<(String, String)>,
}

impl Bootstrap for InProcess {
    fn rank(&self) -> Rank {
        self.rank
    }
    fn size(&self) -> u32 {
        self.job.size
    }
    fn job_id(&self) -> &str {
        &self.job.id
    }
    fn put(&mut self, key: &str, value: &str) -> Result<()> {
        self.pending.push((key.to_string(), value.to_string()));
        Ok(())
    }
    fn fence(&mut self) -> Result<()> {
        let deadline = Instant::now() + self.job.timeout;
        let mut st = self.job.state.lock().unwrap_or_else(|e| e.into_inner());
        for (k, v) in self.pending.drain(..) {
            st.kv.insert(k, v);
        }
        if let Some(b) = &st.broken {
            return Err(Error::from(ErrorDetail::Bootstrap(format!(
                "job broken: {b}"
            ))));
        }
        let gen = st.generation;
        st.arrived += 1;
        if st.arrived == self.job.size {
            st.arrived = 0;
            st.generation += 1;
            self.job.cv.notify_all();
            return Ok(());
        }
        while st.generation == gen {
            if let Some(b) = &st.broken {
                return Err(Error::from(ErrorDetail::Bootstrap(format!(
                    "job broken: {b}"
                ))));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::from(ErrorDetail::Timeout {
                    what: format!("bootstrap fence (rank {})", self.rank),
                    secs: self.job.timeout.as_secs_f64(),
                }));
            }
            st = self
                .job
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }
    fn get(&mut self, key: &str) -> Result<String> {
        JobKv(self.job.clone())
            .get(key)?
            .ok_or_else(|| never_published(key))
    }
    fn nodes(&self) -> &NodeMap {
        &self.nodes
    }
    fn in_process(&self) -> bool {
        true
    }
    fn kv(&self) -> Option<Arc<dyn KvSpace>> {
        Some(Arc::new(JobKv(self.job.clone())))
    }
    fn abort(&mut self, _code: i32, msg: &str) {
        self.job.break_job(msg);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_map_from_ids() {
        let ids: Vec<String> = ["a", "b", "a", "b", "c"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let m = NodeMap::from_ids(&ids, 2);
        assert_eq!(m.host_of, vec![0, 1, 0, 1, 2]);
        assert_eq!(m.hosts(), 3);
        assert_eq!(m.local_ranks(), vec![0, 2]);
        assert_eq!(m.local_index(2), Some(1));
        assert!(!m.is_local(1));
    }

    #[test]
    fn gathered_allgather_beyond_the_direct_size() {
        // 40 ranks on 3 "hosts" (runs of equal values) plus one unique value per rank.
        let n = DIRECT_GATHER_MAX + 8;
        let job = InProcessJob::new(n, Duration::from_secs(30));
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let mut b = job.rank(r);
                std::thread::spawn(move || {
                    let host = allgather(&mut b, "h", &format!("host {}", r * 3 / n)).unwrap();
                    let uniq = allgather(&mut b, "u", &format!("addr:{r};")).unwrap();
                    (host, uniq)
                })
            })
            .collect();
        for h in hs {
            let (host, uniq) = h.join().unwrap();
            let want: Vec<String> = (0..n).map(|r| format!("host {}", r * 3 / n)).collect();
            assert_eq!(host, want);
            let want: Vec<String> = (0..n).map(|r| format!("addr:{r};")).collect();
            assert_eq!(uniq, want);
        }
        // Rank 0 published one table per exchange, and it is small when values repeat.
        let kv = job.rank(1).kv().unwrap();
        let t = kv.get("h.all").unwrap().unwrap();
        assert!(t.len() < 60, "{t}");
    }

    #[test]
    fn malformed_tables_are_errors() {
        for t in [
            "",
            "x;",
            "1;",
            "1;3:ab",
            "1;2:ab",
            "1;2:ab;0*2",
            "1;2:ab;1*3",
            "1;2:ab;0*4",
            "1;2:ab;0x3",
            "5;1:a;0*3",
            "1;9:ab;0*3",
            "1;2:ab;0*3,",
        ] {
            if t == "1;2:ab;0*3," {
                assert!(decode_table(t, 3).is_ok());
                continue;
            }
            assert!(decode_table(t, 3).is_err(), "{t:?}");
        }
    }

    proptest::proptest! {
        #[test]
        fn table_round_trip(values in proptest::collection::vec("[a-c;:*,0-9é]{0,6}", 1..80)) {
            let t = encode_table(&values);
            proptest::prop_assert_eq!(decode_table(&t, values.len()).unwrap(), values);
        }
    }

    #[test]
    fn in_process_allgather_and_timeout() {
        let job = InProcessJob::new(3, Duration::from_secs(20));
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let mut b = job.rank(r);
                std::thread::spawn(move || allgather(&mut b, "x", &format!("v{r}")).unwrap())
            })
            .collect();
        for h in hs {
            assert_eq!(h.join().unwrap(), vec!["v0", "v1", "v2"]);
        }
        let job = InProcessJob::new(2, Duration::from_millis(50));
        let mut b = job.rank(0);
        let e = b.fence().unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Timeout);
    }
}
