//! Per-host composition (MPICH CH4's shared-memory module beside its network module): on a
//! job that spans hosts, ranks of one host talk through a host provider (`WEFT_SHM_PROVIDER`:
//! `shm` by default, `limic`, any other provider that reaches the ranks of one host, or `none`)
//! and every other pair through the network provider `WEFT_PROVIDER` selected.
//!
//! The host provider is opened over [`LocalBoot`], a bootstrap of this host's ranks alone
//! (ranks renumbered 0..n, keys and the job id made per host); [`Routed`] then presents both as
//! one active-message provider to the core, translating the host provider's ranks back.
//!
//! **Order.** The route of a pair is fixed for the life of the job (by host identity, known
//! before anything is sent), so all of one source's messages to one destination travel through
//! one provider, which delivers them in send order (the contract's per-pair rule); the core's
//! per-destination outbox never lets one overtake another. Matching's non-overtaking rule per
//! source and communicator therefore holds as it does with one provider.
//!
//! **What the composition offers** is what both providers share: active messages with the
//! smaller of their limits. Native tagged messaging, RMA and atomics of either are not used
//! (the core's active-message protocols carry them for every pair), so a window or a receive
//! never depends on which route a peer has.

use crate::bootstrap::{Bootstrap, KvSpace, NodeMap};
use crate::provider::{
    Caps, Completed, ConnEvent, DynProvider, ProbeContext, Provider, SendOutcome, Sink, Token,
};
use crate::registry::Factory;
use crate::types::Rank;
use crate::{Error, ErrorDetail, Result};
use std::io::IoSlice;
use std::sync::Arc;

crate::param!(SHM_PROVIDER: Str = "", "SHM_PROVIDER", "shm",
    "on a job spanning hosts, the provider between ranks of one host (shm, limic, ...; none: the network provider carries everything)");

/// The bootstrap of this host's ranks, over the job's.
pub struct LocalBoot<'a> {
    inner: &'a mut dyn Bootstrap,
    /// World rank of each local rank.
    members: Vec<Rank>,
    me: Rank,
    host: u32,
    job: String,
    nodes: NodeMap,
}

impl<'a> LocalBoot<'a> {
    pub fn new(inner: &'a mut dyn Bootstrap) -> LocalBoot<'a> {
        let nodes = inner.nodes().clone();
        let members = nodes.local_ranks();
        let me = nodes.local_index(inner.rank()).unwrap_or(0) as Rank;
        let host = nodes.my_host;
        let job = format!("{}-h{host}", inner.job_id());
        LocalBoot {
            nodes: NodeMap::single_host(members.len() as u32),
            inner,
            members,
            me,
            host,
            job,
        }
    }

    fn key(&self, k: &str) -> String {
        format!("h{}.{k}", self.host)
    }
}

impl Bootstrap for LocalBoot<'_> {
    fn rank(&self) -> Rank {
        self.me
    }
    fn size(&self) -> u32 {
        self.members.len() as u32
    }
    fn job_id(&self) -> &str {
        &self.job
    }
    fn put(&mut self, key: &str, value: &str) -> Result<()> {
        let k = self.key(key);
        self.inner.put(&k, value)
    }
    /// The job's fence: every host's provider makes the same calls while opening (they run
    /// the same code), so the fences pair up across hosts.
    fn fence(&mut self) -> Result<()> {
        self.inner.fence()
    }
    fn get(&mut self, key: &str) -> Result<String> {
        let k = self.key(key);
        self.inner.get(&k)
    }
    fn nodes(&self) -> &NodeMap {
        &self.nodes
    }
    fn kv(&self) -> Option<Arc<dyn KvSpace>> {
        let inner = self.inner.kv()?;
        Some(Arc::new(PrefixKv {
            inner,
            prefix: format!("h{}.", self.host),
        }))
    }
    fn abort(&mut self, code: i32, msg: &str) {
        self.inner.abort(code, msg)
    }
}

struct PrefixKv {
    inner: Arc<dyn KvSpace>,
    prefix: String,
}

impl KvSpace for PrefixKv {
    fn put(&self, key: &str, value: &str) -> Result<()> {
        self.inner.put(&format!("{}{key}", self.prefix), value)
    }
    fn get(&self, key: &str) -> Result<Option<String>> {
        self.inner.get(&format!("{}{key}", self.prefix))
    }
}

/// Which provider reaches a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// Through the host provider, as its local rank.
    Host(Rank),
    Net,
}

/// Counts per path ([`Provider::counters`]).
#[derive(Debug, Default, Clone, Copy)]
struct PathCounts {
    sends: u64,
    bytes: u64,
    arrivals: u64,
}

/// The route to every world rank: the host provider (as its rank there) for ranks of this
/// host, the network provider for the others.
fn routes(nodes: &NodeMap) -> Vec<Path> {
    (0..nodes.host_of.len() as Rank)
        .map(|r| match nodes.local_index(r) {
            Some(i) if nodes.is_local(r) => Path::Host(i as Rank),
            _ => Path::Net,
        })
        .collect()
}

/// The network provider and the host provider as one.
pub struct Routed {
    name: String,
    net: DynProvider,
    host: DynProvider,
    route: Vec<Path>,
    /// World rank of each of the host provider's ranks.
    members: Vec<Rank>,
    caps: Caps,
    host_n: PathCounts,
    net_n: PathCounts,
}

impl Routed {
    fn new(net: DynProvider, host: DynProvider, nodes: &NodeMap) -> Routed {
        let members = nodes.local_ranks();
        let route = routes(nodes);
        let (a, b) = (net.caps(), host.caps());
        let mut caps = Caps::am_only(
            a.max_am_header.min(b.max_am_header),
            a.max_am_payload.min(b.max_am_payload),
            a.max_iov.min(b.max_iov),
        );
        caps.eager_limit = a.eager_limit.min(b.eager_limit).min(caps.max_am_payload);
        caps.spans_processes = true;
        caps.spans_hosts = true;
        caps.lazy_connect = a.lazy_connect || b.lazy_connect;
        Routed {
            name: format!("{}+{}", net.name(), host.name()),
            net,
            host,
            route,
            members,
            caps,
            host_n: PathCounts::default(),
            net_n: PathCounts::default(),
        }
    }

    fn path(&self, dest: Rank) -> Result<Path> {
        self.route.get(dest as usize).copied().ok_or_else(|| {
            Error::from(ErrorDetail::InvalidRank {
                rank: dest as i64,
                size: self.route.len() as u32,
            })
        })
    }
}

/// The host provider's events with its ranks made world ranks.
struct HostSink<'a> {
    inner: &'a mut dyn Sink,
    members: &'a [Rank],
    arrivals: u64,
}

impl HostSink<'_> {
    fn world(&self, r: Rank) -> Rank {
        // A rank outside the host's list is passed through as an impossible world rank: the
        // core treats a source >= size as a provider fault, never as someone else's message.
        self.members.get(r as usize).copied().unwrap_or(Rank::MAX)
    }
}

impl Sink for HostSink<'_> {
    fn am(&mut self, src: Rank, header: &[u8], payload: &[u8]) {
        self.arrivals += 1;
        let w = self.world(src);
        self.inner.am(w, header, payload)
    }
    fn complete(&mut self, token: Token, result: Result<Completed>) {
        self.inner.complete(token, result)
    }
    fn peer_failed(&mut self, rank: Rank, reason: &str) {
        let w = self.world(rank);
        self.inner.peer_failed(w, reason)
    }
    fn am_target(
        &mut self,
        src: Rank,
        header: &[u8],
        off: usize,
        len: usize,
    ) -> Option<std::ptr::NonNull<u8>> {
        let w = self.world(src);
        self.inner.am_target(w, header, off, len)
    }
    fn am_placed(&mut self, src: Rank, header: &[u8], off: usize, k: usize) {
        let w = self.world(src);
        self.inner.am_placed(w, header, off, k)
    }
    fn rma_data(&mut self, src: Rank, data: u64) {
        let w = self.world(src);
        self.inner.rma_data(w, data)
    }
    fn connection(&mut self, peer: Rank, event: ConnEvent) {
        let w = self.world(peer);
        self.inner.connection(w, event)
    }
}

/// Counts the network provider's arrivals on their way through.
struct NetSink<'a> {
    inner: &'a mut dyn Sink,
    arrivals: u64,
}

impl Sink for NetSink<'_> {
    fn am(&mut self, src: Rank, header: &[u8], payload: &[u8]) {
        self.arrivals += 1;
        self.inner.am(src, header, payload)
    }
    fn complete(&mut self, token: Token, result: Result<Completed>) {
        self.inner.complete(token, result)
    }
    fn peer_failed(&mut self, rank: Rank, reason: &str) {
        self.inner.peer_failed(rank, reason)
    }
    fn am_target(
        &mut self,
        src: Rank,
        header: &[u8],
        off: usize,
        len: usize,
    ) -> Option<std::ptr::NonNull<u8>> {
        self.inner.am_target(src, header, off, len)
    }
    fn am_placed(&mut self, src: Rank, header: &[u8], off: usize, k: usize) {
        self.inner.am_placed(src, header, off, k)
    }
    fn rma_data(&mut self, src: Rank, data: u64) {
        self.inner.rma_data(src, data)
    }
    fn connection(&mut self, peer: Rank, event: ConnEvent) {
        self.inner.connection(peer, event)
    }
}

impl Provider for Routed {
    fn name(&self) -> &str {
        &self.name
    }
    fn caps(&self) -> &Caps {
        &self.caps
    }
    fn rank(&self) -> Rank {
        self.net.rank()
    }
    fn size(&self) -> u32 {
        self.net.size()
    }

    fn am_send(
        &mut self,
        dest: Rank,
        header: &[u8],
        payload: &[IoSlice<'_>],
    ) -> Result<SendOutcome> {
        let bytes: usize = payload.iter().map(|p| p.len()).sum();
        let (r, n) = match self.path(dest)? {
            Path::Host(l) => (self.host.am_send(l, header, payload), &mut self.host_n),
            Path::Net => (self.net.am_send(dest, header, payload), &mut self.net_n),
        };
        if let Ok(SendOutcome::Sent) = r {
            n.sends += 1;
            n.bytes += bytes as u64;
        }
        match r {
            // The host provider names its own ranks in errors: name the world's.
            Err(e) if e.kind() == crate::ErrorKind::PeerFailed => {
                Err(Error::peer_failed(dest, e.to_string()))
            }
            r => r,
        }
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> Result<usize> {
        let mut hs = HostSink {
            inner: sink,
            members: &self.members,
            arrivals: 0,
        };
        let a = self.host.progress(&mut hs)?;
        self.host_n.arrivals += hs.arrivals;
        let mut ns = NetSink {
            inner: sink,
            arrivals: 0,
        };
        let b = self.net.progress(&mut ns)?;
        self.net_n.arrivals += ns.arrivals;
        Ok(a + b)
    }

    fn close(&mut self) -> Result<()> {
        let a = self.host.close();
        let b = self.net.close();
        a.and(b)
    }

    fn connect(&mut self, peer: Rank) -> Result<()> {
        match self.path(peer)? {
            Path::Host(l) => self.host.connect(l),
            Path::Net => self.net.connect(peer),
        }
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("host.sends", self.host_n.sends),
            ("host.bytes", self.host_n.bytes),
            ("host.arrivals", self.host_n.arrivals),
            ("net.sends", self.net_n.sends),
            ("net.bytes", self.net_n.bytes),
            ("net.arrivals", self.net_n.arrivals),
        ]
    }
}

/// On a job spanning hosts, put the host provider beside `net` (collective; every rank calls
/// it with the same selection). Returns `net` unchanged on one host, with `WEFT_SHM_PROVIDER=none`,
/// or when the host provider cannot run on some host (a warning says why).
pub(crate) fn compose(
    boot: &mut dyn Bootstrap,
    net: DynProvider,
    all: &[&'static dyn Factory],
) -> Result<DynProvider> {
    let nodes = boot.nodes().clone();
    if nodes.hosts() <= 1 || boot.size() <= 1 {
        return Ok(net);
    }
    let want = SHM_PROVIDER.raw();
    let want = if want.is_empty() { "shm".into() } else { want };
    if want == "none" {
        return Ok(net);
    }
    // Judge locally, agree across the job (every rank takes the same branch).
    let here = nodes.local_ranks().len() as u32;
    let ctx = ProbeContext {
        rank: nodes.local_index(boot.rank()).unwrap_or(0) as Rank,
        size: here,
        in_process: false,
        hosts: 1,
        local_ranks: here,
    };
    let verdict = match all.iter().find(|f| f.name() == want) {
        None => "\x1dunknown".to_string(),
        Some(f) => match f.probe(&ctx) {
            Ok(()) => "ok".into(),
            Err(why) => why,
        },
    };
    let votes = crate::bootstrap::allgather(boot, "weft.hostsel", &verdict)?;
    if votes.iter().any(|v| v == "\x1dunknown") {
        // A misspelt name is an error on every rank (they all took part in the exchange).
        return Err(Error::from(ErrorDetail::UnknownProvider {
            requested: format!("{want} (WEFT_SHM_PROVIDER)"),
            available: all
                .iter()
                .map(|f| f.name())
                .chain(["none"])
                .collect::<Vec<_>>()
                .join(", "),
        }));
    }
    if let Some((r, why)) = votes.iter().enumerate().find(|(_, v)| *v != "ok") {
        if boot.rank() == 0 {
            tracing::warn!(
                "WEFT_SHM_PROVIDER={want} cannot run on rank {r} ({why}): the network provider carries every pair"
            );
        }
        return Ok(net);
    }
    let f = all
        .iter()
        .find(|f| f.name() == want)
        .expect("every rank found it");
    let host = {
        let mut local = LocalBoot::new(boot);
        f.open(&mut local)?
    };
    tracing::debug!(host = host.name(), net = net.name(), "per-host composition");
    Ok(Box::new(Routed::new(net, host, &nodes)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_follow_hosts_and_local_ranks_are_renumbered() {
        // Ranks 0 and 2 on host 0, 1 and 3 on host 1; this is rank 2.
        let nodes = NodeMap {
            host_of: vec![0, 1, 0, 1],
            my_host: 0,
        };
        assert_eq!(nodes.local_ranks(), vec![0, 2]);
        assert_eq!(
            routes(&nodes),
            vec![Path::Host(0), Path::Net, Path::Host(1), Path::Net]
        );
    }
}
