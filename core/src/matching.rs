//! MPI message matching: posted-receive and unexpected-message queues.
//!
//! Both queues are intrusive doubly-linked lists living in slabs (no allocation per message in
//! steady state), bucketed in hash maps so that every operation costs O(1) expected, whatever the
//! number of peers and tags:
//!
//! * A posted receive sits in exactly one bucket, keyed by its own pattern
//!   `(ctx, src|ANY, tag|ANY)`. An arriving message `(ctx, s, t)` looks at the heads of at most
//!   four buckets — `(ctx,s,t)`, `(ctx,s,ANY)`, `(ctx,ANY,t)`, `(ctx,ANY,ANY)` — and takes the one
//!   posted first (lowest sequence number). Wildcard buckets are skipped entirely while no
//!   wildcard receive is posted.
//! * An unexpected message is linked into four lists at once — by `(ctx,s,t)`, `(ctx,s)`,
//!   `(ctx,t)` and `(ctx)` — so a receive of any pattern finds the earliest matching message at
//!   the head of one list, and unlinking from all four is O(1).
//!
//! A key is hashed at most once per operation: nodes remember the index of their bucket, so
//! unlinking one needs no lookup, and each map remembers the last key it was asked for (a
//! ping-pong asks for the same one every time), which a comparison answers without hashing.
//!
//! Sequence numbers keep MPI's ordering: among matching candidates the earliest wins, which
//! gives non-overtaking order per (source, communicator) when arrivals are fed in order.

use hashbrown::HashMap;

/// Wildcard source in keys.
const ANY_SRC: u32 = u32::MAX;
/// Wildcard tag in keys.
const ANY_TAG: i32 = -1;

/// The pattern of a posted key: 0 exact, 1 any tag, 2 any source, 3 both.
#[inline]
fn kind(src: u32, tag: i32) -> usize {
    ((src == ANY_SRC) as usize) << 1 | (tag == ANY_TAG) as usize
}
const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug, Default)]
struct List {
    head: u32,
    tail: u32,
}

const EMPTY: List = List {
    head: NIL,
    tail: NIL,
};

/// Put `x` into a free slot of `v` (one `free` names) or at its end; its index.
#[inline]
fn place<T>(v: &mut Vec<T>, free: &mut Vec<u32>, x: T) -> u32 {
    match free.pop() {
        Some(i) => {
            v[i as usize] = x;
            i
        }
        None => {
            v.push(x);
            (v.len() - 1) as u32
        }
    }
}

/// Buckets by key: the map gives a key's bucket *index* once, the node remembers it, so
/// unlinking a node needs no hashing. A bucket that empties stays (the next post with the same
/// key, the steady state of a ping-pong, reuses it with one lookup) until more than
/// [`PURGE_AT`] are empty, when the empty ones are dropped and their indices reused (bounds
/// memory when keys are many and short-lived, e.g. one tag per message).
struct Buckets<K> {
    /// The last key looked up and its bucket: a ping-pong asks for the same key over and over,
    /// and comparing it costs less than hashing it. Cleared when buckets are purged.
    hot: Option<(K, u32)>,
    map: HashMap<K, u32>,
    lists: Vec<List>,
    free: Vec<u32>,
    empty: usize,
}

/// Empty buckets kept before a purge. Under Miri 64: its tests then reach the same purges
/// with a sixty-fourth of the keys (the purge test took 400 s of CI there, its wildcard takes
/// being quadratic in the keys).
const PURGE_AT: usize = if cfg!(miri) { 64 } else { 4096 };

impl<K: std::hash::Hash + Eq + Copy> Buckets<K> {
    fn new() -> Self {
        Buckets {
            hot: None,
            map: HashMap::new(),
            lists: Vec::new(),
            free: Vec::new(),
            empty: 0,
        }
    }

    /// The bucket of `key`, if it has one.
    #[inline]
    fn find(&self, key: &K) -> Option<u32> {
        match self.hot {
            Some((k, b)) if k == *key => Some(b),
            _ => self.find_cold(key),
        }
    }

    #[inline(never)]
    fn find_cold(&self, key: &K) -> Option<u32> {
        self.map.get(key).copied()
    }

    /// The first node of `key`'s bucket.
    #[inline]
    fn head(&self, key: &K) -> Option<u32> {
        let b = self.find(key)?;
        let h = self.lists[b as usize].head;
        (h != NIL).then_some(h)
    }

    /// The bucket of `key`, made (or revived) if needed.
    #[inline]
    fn bucket(&mut self, key: K) -> u32 {
        if let Some(b) = self.find(&key) {
            if self.lists[b as usize].head == NIL {
                self.empty -= 1;
            }
            self.hot = Some((key, b));
            return b;
        }
        let b = place(&mut self.lists, &mut self.free, EMPTY);
        self.map.insert(key, b);
        self.hot = Some((key, b));
        b
    }

    /// Append node `idx` to bucket `b` (list number `which` of the node).
    #[inline]
    fn push<N: Links>(&mut self, nodes: &mut [N], b: u32, idx: u32, which: usize) {
        let list = &mut self.lists[b as usize];
        let tail = list.tail;
        *nodes[idx as usize].link(which) = (tail, NIL);
        if tail == NIL {
            list.head = idx;
        } else {
            nodes[tail as usize].link(which).1 = idx;
        }
        list.tail = idx;
    }

    /// Unlink node `idx` from bucket `b`.
    #[inline]
    fn unlink<N: Links>(&mut self, nodes: &mut [N], b: u32, idx: u32, which: usize) {
        let (prev, next) = *nodes[idx as usize].link(which);
        if prev != NIL {
            nodes[prev as usize].link(which).1 = next;
        }
        if next != NIL {
            nodes[next as usize].link(which).0 = prev;
        }
        let list = &mut self.lists[b as usize];
        if list.head == idx {
            list.head = next;
        }
        if list.tail == idx {
            list.tail = prev;
        }
        if list.head == NIL {
            self.empty += 1;
            if self.empty > PURGE_AT {
                self.purge();
            }
        }
    }

    /// Drop the empty buckets (no live node refers to one), keeping their indices for reuse.
    #[cold]
    fn purge(&mut self) {
        self.hot = None;
        let (lists, free) = (&self.lists, &mut self.free);
        self.map.retain(|_, b| {
            let keep = lists[*b as usize].head != NIL;
            if !keep {
                free.push(*b);
            }
            keep
        });
        self.empty = 0;
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PKey {
    ctx: u32,
    src: u32,
    tag: i32,
}

struct PNode<R> {
    seq: u64,
    key: PKey,
    /// Its bucket in `posted`.
    bucket: u32,
    /// (prev, next) in its bucket.
    link: (u32, u32),
    val: Option<R>,
}

struct UNode<M> {
    src: u32,
    tag: i32,
    /// Its buckets in the exact, by-source, by-tag and by-context maps.
    buckets: [u32; 4],
    /// (prev, next) in those four lists.
    links: [(u32, u32); 4],
    val: Option<M>,
}

/// Handle of a posted receive, for cancellation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PostedHandle {
    idx: u32,
    seq: u64,
}

impl PostedHandle {
    /// A handle that matches nothing (placeholder before posting).
    pub fn dangling() -> Self {
        PostedHandle { idx: NIL, seq: 0 }
    }
}

/// The matching engine. `R` is what a posted receive carries (a request id), `M` what an
/// unexpected message carries (its header and data).
pub struct Matcher<R, M> {
    pnodes: Vec<PNode<R>>,
    pfree: Vec<u32>,
    posted: Buckets<PKey>,
    /// Posted receives by pattern ([`kind`]): exact, any tag, any source, both. An arrival
    /// looks only at the buckets of patterns that have receives posted (a job that posts only
    /// `MPI_ANY_SOURCE` receives pays one lookup per message, not four).
    by_kind: [usize; 4],
    posted_count: usize,

    unodes: Vec<UNode<M>>,
    ufree: Vec<u32>,
    u_exact: Buckets<(u32, u32, i32)>,
    u_src: Buckets<(u32, u32)>,
    u_tag: Buckets<(u32, i32)>,
    u_ctx: Buckets<u32>,
    unexpected_count: usize,

    seq: u64,
}

impl<R, M> Default for Matcher<R, M> {
    fn default() -> Self {
        Self::new()
    }
}

/// Nodes that sit in one or more intrusive lists; `link(i)` is their `(prev, next)` in list `i`.
trait Links {
    fn link(&mut self, i: usize) -> &mut (u32, u32);
}

impl<R> Links for PNode<R> {
    #[inline]
    fn link(&mut self, _i: usize) -> &mut (u32, u32) {
        &mut self.link
    }
}

impl<M> Links for UNode<M> {
    #[inline]
    fn link(&mut self, i: usize) -> &mut (u32, u32) {
        &mut self.links[i]
    }
}

impl<R, M> Matcher<R, M> {
    pub fn new() -> Self {
        Matcher {
            pnodes: Vec::new(),
            pfree: Vec::new(),
            posted: Buckets::new(),
            by_kind: [0; 4],
            posted_count: 0,
            unodes: Vec::new(),
            ufree: Vec::new(),
            u_exact: Buckets::new(),
            u_src: Buckets::new(),
            u_tag: Buckets::new(),
            u_ctx: Buckets::new(),
            unexpected_count: 0,
            seq: 0,
        }
    }

    /// Number of posted receives.
    pub fn posted_len(&self) -> usize {
        self.posted_count
    }

    /// Number of unexpected messages.
    #[inline]
    pub fn unexpected_len(&self) -> usize {
        self.unexpected_count
    }

    // ---------------------------------------------------------------- posted receives

    /// Append a receive to the posted queue. Call only after [`Self::take_unexpected`] found
    /// nothing, or the order would be wrong.
    #[inline]
    pub fn post(&mut self, ctx: u32, src: Option<u32>, tag: Option<i32>, r: R) -> PostedHandle {
        let key = PKey {
            ctx,
            src: src.unwrap_or(ANY_SRC),
            tag: tag.unwrap_or(ANY_TAG),
        };
        self.seq += 1;
        let seq = self.seq;
        let bucket = self.posted.bucket(key);
        let node = PNode {
            seq,
            key,
            bucket,
            link: (NIL, NIL),
            val: Some(r),
        };
        let idx = place(&mut self.pnodes, &mut self.pfree, node);
        self.posted.push(&mut self.pnodes, bucket, idx, 0);
        self.by_kind[kind(key.src, key.tag)] += 1;
        self.posted_count += 1;
        PostedHandle { idx, seq }
    }

    #[inline]
    fn remove_posted(&mut self, idx: u32) -> R {
        let n = &self.pnodes[idx as usize];
        let (key, bucket) = (n.key, n.bucket);
        self.posted.unlink(&mut self.pnodes, bucket, idx, 0);
        self.by_kind[kind(key.src, key.tag)] -= 1;
        self.posted_count -= 1;
        self.pfree.push(idx);
        self.pnodes[idx as usize]
            .val
            .take()
            .expect("posted node holds a value")
    }

    /// A message `(ctx, src, tag)` arrived: take the earliest posted receive it matches.
    #[inline]
    pub fn take_posted(&mut self, ctx: u32, src: u32, tag: i32) -> Option<R> {
        let [exact_n, any_tag_n, any_src_n, both_n] = self.by_kind;
        let exact = if exact_n > 0 {
            self.posted.head(&PKey { ctx, src, tag })
        } else {
            None
        };
        if any_tag_n + any_src_n + both_n == 0 {
            return exact.map(|idx| self.remove_posted(idx));
        }
        let head = |n: usize, src: u32, tag: i32| {
            if n > 0 {
                self.posted.head(&PKey { ctx, src, tag })
            } else {
                None
            }
        };
        let mut best: Option<(u64, u32)> = None;
        for head in [
            exact,
            head(any_tag_n, src, ANY_TAG),
            head(any_src_n, ANY_SRC, tag),
            head(both_n, ANY_SRC, ANY_TAG),
        ]
        .into_iter()
        .flatten()
        {
            let s = self.pnodes[head as usize].seq;
            if best.is_none_or(|(bs, _)| s < bs) {
                best = Some((s, head));
            }
        }
        best.map(|(_, idx)| self.remove_posted(idx))
    }

    /// Remove a posted receive that has not matched. `None` if it already matched.
    pub fn cancel(&mut self, h: PostedHandle) -> Option<R> {
        let n = self.pnodes.get(h.idx as usize)?;
        if n.seq != h.seq || n.val.is_none() {
            return None;
        }
        Some(self.remove_posted(h.idx))
    }

    // ---------------------------------------------------------------- unexpected messages

    /// Store a message that matched no posted receive.
    pub fn add_unexpected(&mut self, ctx: u32, src: u32, tag: i32, m: M) {
        let buckets = [
            self.u_exact.bucket((ctx, src, tag)),
            self.u_src.bucket((ctx, src)),
            self.u_tag.bucket((ctx, tag)),
            self.u_ctx.bucket(ctx),
        ];
        let node = UNode {
            src,
            tag,
            buckets,
            links: [(NIL, NIL); 4],
            val: Some(m),
        };
        let idx = place(&mut self.unodes, &mut self.ufree, node);
        let n = &mut self.unodes;
        self.u_exact.push(n, buckets[0], idx, 0);
        self.u_src.push(n, buckets[1], idx, 1);
        self.u_tag.push(n, buckets[2], idx, 2);
        self.u_ctx.push(n, buckets[3], idx, 3);
        self.unexpected_count += 1;
    }

    #[inline]
    fn find_unexpected(&self, ctx: u32, src: Option<u32>, tag: Option<i32>) -> Option<u32> {
        if self.unexpected_count == 0 {
            return None;
        }
        match (src, tag) {
            (Some(s), Some(t)) => self.u_exact.head(&(ctx, s, t)),
            (Some(s), None) => self.u_src.head(&(ctx, s)),
            (None, Some(t)) => self.u_tag.head(&(ctx, t)),
            (None, None) => self.u_ctx.head(&ctx),
        }
    }

    /// Take the earliest unexpected message matching a receive pattern.
    #[inline]
    pub fn take_unexpected(
        &mut self,
        ctx: u32,
        src: Option<u32>,
        tag: Option<i32>,
    ) -> Option<(u32, i32, M)> {
        let idx = self.find_unexpected(ctx, src, tag)?;
        let (s, t, b) = {
            let n = &self.unodes[idx as usize];
            (n.src, n.tag, n.buckets)
        };
        let n = &mut self.unodes;
        self.u_exact.unlink(n, b[0], idx, 0);
        self.u_src.unlink(n, b[1], idx, 1);
        self.u_tag.unlink(n, b[2], idx, 2);
        self.u_ctx.unlink(n, b[3], idx, 3);
        self.unexpected_count -= 1;
        self.ufree.push(idx);
        let m = self.unodes[idx as usize]
            .val
            .take()
            .expect("unexpected node holds a value");
        Some((s, t, m))
    }

    /// Peek at the earliest unexpected message matching a pattern (probe).
    pub fn peek_unexpected(
        &self,
        ctx: u32,
        src: Option<u32>,
        tag: Option<i32>,
    ) -> Option<(u32, i32, &M)> {
        let idx = self.find_unexpected(ctx, src, tag)?;
        let n = &self.unodes[idx as usize];
        Some((
            n.src,
            n.tag,
            n.val.as_ref().expect("unexpected node holds a value"),
        ))
    }

    /// Remove every posted receive and unexpected message for which `f` says so (peer failure).
    pub fn drain_posted_where(
        &mut self,
        mut f: impl FnMut(u32, Option<u32>, &R) -> bool,
    ) -> Vec<R> {
        let mut victims = Vec::new();
        for (i, n) in self.pnodes.iter().enumerate() {
            if let Some(v) = &n.val {
                let src = (n.key.src != ANY_SRC).then_some(n.key.src);
                if f(n.key.ctx, src, v) {
                    victims.push(i as u32);
                }
            }
        }
        victims.into_iter().map(|i| self.remove_posted(i)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_match_in_order() {
        let mut m: Matcher<u32, u32> = Matcher::new();
        m.post(0, Some(1), Some(5), 10);
        m.post(0, Some(1), Some(5), 11);
        assert_eq!(m.take_posted(0, 1, 5), Some(10));
        assert_eq!(m.take_posted(0, 1, 5), Some(11));
        assert_eq!(m.take_posted(0, 1, 5), None);
        assert_eq!(m.posted_len(), 0);
    }

    #[test]
    fn wildcard_respects_post_order() {
        let mut m: Matcher<u32, u32> = Matcher::new();
        m.post(0, None, None, 1);
        m.post(0, Some(2), Some(3), 2);
        assert_eq!(m.take_posted(0, 2, 3), Some(1));
        assert_eq!(m.take_posted(0, 2, 3), Some(2));
    }

    #[test]
    fn unexpected_wildcards_and_cancel() {
        let mut m: Matcher<u32, &str> = Matcher::new();
        m.add_unexpected(0, 1, 7, "a");
        m.add_unexpected(0, 2, 7, "b");
        m.add_unexpected(0, 1, 8, "c");
        assert_eq!(m.peek_unexpected(0, None, Some(8)).map(|x| *x.2), Some("c"));
        assert_eq!(m.take_unexpected(0, Some(2), None).map(|x| x.2), Some("b"));
        assert_eq!(m.take_unexpected(0, None, None).map(|x| x.2), Some("a"));
        assert_eq!(m.take_unexpected(0, None, Some(7)).map(|x| x.2), None);
        assert_eq!(m.take_unexpected(1, None, None).map(|x| x.2), None);
        assert_eq!(m.unexpected_len(), 1);
        let h = m.post(0, Some(3), None, 9);
        assert_eq!(m.cancel(h), Some(9));
        assert_eq!(m.cancel(h), None);
        assert_eq!(m.take_posted(0, 3, 1), None);
    }

    /// Many short-lived keys (one tag per message) empty thousands of buckets: they are
    /// dropped and their slots reused, and matching stays right across the purges.
    #[test]
    fn empty_buckets_are_purged_and_reused() {
        let mut m: Matcher<u32, u32> = Matcher::new();
        for t in 0..3 * PURGE_AT as i32 {
            m.post(0, Some(1), Some(t), t as u32);
            m.add_unexpected(1, 2, t, t as u32);
            if t % 3 == 0 {
                // Some keys stay live across purges.
                continue;
            }
            assert_eq!(m.take_posted(0, 1, t), Some(t as u32));
            assert_eq!(
                m.take_unexpected(1, None, Some(t)).map(|x| x.2),
                Some(t as u32)
            );
        }
        assert!(
            m.posted.map.len() <= PURGE_AT + PURGE_AT,
            "{}",
            m.posted.map.len()
        );
        assert!(
            m.posted.lists.len() < 2 * PURGE_AT + 16,
            "{}",
            m.posted.lists.len()
        );
        for t in (0..3 * PURGE_AT as i32).step_by(3) {
            assert_eq!(m.take_posted(0, 1, t), Some(t as u32), "tag {t}");
            assert_eq!(
                m.take_unexpected(1, Some(2), None).map(|x| x.2),
                Some(t as u32)
            );
        }
        assert_eq!((m.posted_len(), m.unexpected_len()), (0, 0));
        assert_eq!(m.take_posted(0, 1, 3), None);
    }

    /// The obvious matcher: linear scans over two lists in order.
    #[derive(Default)]
    struct Naive {
        posted: Vec<(u32, Option<u32>, Option<i32>, u32)>,
        unexpected: Vec<(u32, u32, i32, u32)>,
    }

    impl Naive {
        fn post(&mut self, c: u32, s: Option<u32>, t: Option<i32>, id: u32) -> Option<u32> {
            let i = self
                .unexpected
                .iter()
                .position(|u| u.0 == c && s.is_none_or(|s| s == u.1) && t.is_none_or(|t| t == u.2));
            match i {
                Some(i) => Some(self.unexpected.remove(i).3),
                None => {
                    self.posted.push((c, s, t, id));
                    None
                }
            }
        }
        fn arrive(&mut self, c: u32, s: u32, t: i32, id: u32) -> Option<u32> {
            let i = self
                .posted
                .iter()
                .position(|p| p.0 == c && p.1.is_none_or(|x| x == s) && p.2.is_none_or(|x| x == t));
            match i {
                Some(i) => Some(self.posted.remove(i).3),
                None => {
                    self.unexpected.push((c, s, t, id));
                    None
                }
            }
        }
        fn probe(&self, c: u32, s: Option<u32>, t: Option<i32>) -> Option<u32> {
            self.unexpected
                .iter()
                .find(|u| u.0 == c && s.is_none_or(|s| s == u.1) && t.is_none_or(|t| t == u.2))
                .map(|u| u.3)
        }
        fn cancel(&mut self, id: u32) -> bool {
            match self.posted.iter().position(|p| p.3 == id) {
                Some(i) => {
                    self.posted.remove(i);
                    true
                }
                None => false,
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Step {
        Post(u32, Option<u32>, Option<i32>),
        Arrive(u32, u32, i32),
        Probe(u32, Option<u32>, Option<i32>),
        Cancel(usize),
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        let src = prop_oneof![3 => (0u32..3).prop_map(Some), 1 => Just(None)];
        let tag = prop_oneof![3 => (0i32..3).prop_map(Some), 1 => Just(None)];
        prop_oneof![
            4 => (0u32..2, src.clone(), tag.clone()).prop_map(|(c, s, t)| Step::Post(c, s, t)),
            4 => (0u32..2, 0u32..3, 0i32..3).prop_map(|(c, s, t)| Step::Arrive(c, s, t)),
            1 => (0u32..2, src, tag).prop_map(|(c, s, t)| Step::Probe(c, s, t)),
            1 => (0usize..64).prop_map(Step::Cancel),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]
        /// Arbitrary interleavings of receives, arrivals, wildcards, probes and cancels give
        /// exactly the reference matcher's pairings.
        #[cfg_attr(miri, ignore)] // hundreds of cases under Miri take hours; file I/O is isolated
        #[test]
        fn matches_like_the_reference(steps in proptest::collection::vec(step(), 1..200)) {
            let mut m: Matcher<u32, u32> = Matcher::new();
            let mut n = Naive::default();
            let mut handles: Vec<(u32, PostedHandle)> = vec![];
            for (id, st) in steps.into_iter().enumerate() {
                let id = id as u32;
                match st {
                    Step::Post(c, s, t) => {
                        let got = m.take_unexpected(c, s, t).map(|x| x.2);
                        let want = n.post(c, s, t, id);
                        proptest::prop_assert_eq!(got, want);
                        if got.is_none() {
                            handles.push((id, m.post(c, s, t, id)));
                        }
                    }
                    Step::Arrive(c, s, t) => {
                        let got = m.take_posted(c, s, t);
                        let want = n.arrive(c, s, t, id);
                        proptest::prop_assert_eq!(got, want);
                        if got.is_none() {
                            m.add_unexpected(c, s, t, id);
                        }
                    }
                    Step::Probe(c, s, t) => {
                        proptest::prop_assert_eq!(m.peek_unexpected(c, s, t).map(|x| *x.2), n.probe(c, s, t));
                    }
                    Step::Cancel(k) => {
                        if let Some(&(rid, h)) = handles.get(k % handles.len().max(1)) {
                            let got = m.cancel(h).is_some();
                            proptest::prop_assert_eq!(got, n.cancel(rid));
                        }
                    }
                }
                proptest::prop_assert_eq!(m.posted_len(), n.posted.len());
                proptest::prop_assert_eq!(m.unexpected_len(), n.unexpected.len());
            }
        }
    }
}
