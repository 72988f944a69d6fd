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
//! Sequence numbers keep MPI's ordering: among matching candidates the earliest wins, which
//! gives non-overtaking order per (source, communicator) when arrivals are fed in order.

use hashbrown::HashMap;

/// Wildcard source in keys.
const ANY_SRC: u32 = u32::MAX;
/// Wildcard tag in keys.
const ANY_TAG: i32 = -1;
const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug, Default)]
struct List {
    head: u32,
    tail: u32,
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
    /// (prev, next) in its bucket.
    link: (u32, u32),
    val: Option<R>,
}

struct UNode<M> {
    ctx: u32,
    src: u32,
    tag: i32,
    /// (prev, next) in the exact, by-source, by-tag and by-context lists.
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
    posted: HashMap<PKey, List>,
    wild_posted: usize,
    posted_count: usize,
    /// Empty buckets kept in `posted` / the unexpected maps (see `purge`).
    posted_empty: usize,
    unexpected_empty: usize,

    unodes: Vec<UNode<M>>,
    ufree: Vec<u32>,
    u_exact: HashMap<(u32, u32, i32), List>,
    u_src: HashMap<(u32, u32), List>,
    u_tag: HashMap<(u32, i32), List>,
    u_ctx: HashMap<u32, List>,
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
    fn link(&mut self, _i: usize) -> &mut (u32, u32) {
        &mut self.link
    }
}

impl<M> Links for UNode<M> {
    fn link(&mut self, i: usize) -> &mut (u32, u32) {
        &mut self.links[i]
    }
}

/// Append node `idx` to `list` (list number `which` of the node).
fn list_push<N: Links>(nodes: &mut [N], list: &mut List, idx: u32, which: usize) {
    let tail = list.tail;
    *nodes[idx as usize].link(which) = (tail, NIL);
    if tail == NIL {
        list.head = idx;
    } else {
        nodes[tail as usize].link(which).1 = idx;
    }
    list.tail = idx;
}

/// Unlink node `idx` from the list stored under `key` in `map`. Returns true when the list
/// became empty; the entry stays in the map (reused by the next post with the same key, so a
/// steady post/match cycle costs one lookup and no insert/remove) until [`purge`] drops it.
fn list_unlink<N: Links, K: std::hash::Hash + Eq>(
    nodes: &mut [N],
    map: &mut HashMap<K, List>,
    key: &K,
    idx: u32,
    which: usize,
) -> bool {
    let (prev, next) = *nodes[idx as usize].link(which);
    if prev != NIL {
        nodes[prev as usize].link(which).1 = next;
    }
    if next != NIL {
        nodes[next as usize].link(which).0 = prev;
    }
    match map.get_mut(key) {
        Some(list) => {
            if list.head == idx {
                list.head = next;
            }
            if list.tail == idx {
                list.tail = prev;
            }
            list.head == NIL
        }
        None => false,
    }
}

/// Drop empty buckets once there are many (bounds memory when keys are many and short-lived,
/// e.g. one tag per message).
fn purge<K: std::hash::Hash + Eq>(maps: &mut [&mut HashMap<K, List>], empty: &mut usize) {
    if *empty > 4096 {
        for m in maps.iter_mut() {
            m.retain(|_, l| l.head != NIL);
        }
        *empty = 0;
    }
}

/// Append node `idx` to the bucket `key`, reviving a kept empty bucket or creating one.
fn bucket_push<K: std::hash::Hash + Eq, N: Links>(
    map: &mut HashMap<K, List>,
    key: K,
    nodes: &mut [N],
    idx: u32,
    which: usize,
    empty: &mut usize,
) {
    match map.get_mut(&key) {
        Some(l) => {
            if l.head == NIL {
                *empty -= 1;
            }
            list_push(nodes, l, idx, which);
        }
        None => {
            let l = map.entry(key).or_insert(List {
                head: NIL,
                tail: NIL,
            });
            list_push(nodes, l, idx, which);
        }
    }
}

impl<R, M> Matcher<R, M> {
    pub fn new() -> Self {
        Matcher {
            pnodes: Vec::new(),
            pfree: Vec::new(),
            posted: HashMap::new(),
            wild_posted: 0,
            posted_count: 0,
            posted_empty: 0,
            unexpected_empty: 0,
            unodes: Vec::new(),
            ufree: Vec::new(),
            u_exact: HashMap::new(),
            u_src: HashMap::new(),
            u_tag: HashMap::new(),
            u_ctx: HashMap::new(),
            unexpected_count: 0,
            seq: 0,
        }
    }

    /// Number of posted receives.
    pub fn posted_len(&self) -> usize {
        self.posted_count
    }

    /// Number of unexpected messages.
    pub fn unexpected_len(&self) -> usize {
        self.unexpected_count
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    // ---------------------------------------------------------------- posted receives

    /// Append a receive to the posted queue. Call only after [`Self::take_unexpected`] found
    /// nothing, or the order would be wrong.
    pub fn post(&mut self, ctx: u32, src: Option<u32>, tag: Option<i32>, r: R) -> PostedHandle {
        let key = PKey {
            ctx,
            src: src.unwrap_or(ANY_SRC),
            tag: tag.unwrap_or(ANY_TAG),
        };
        let seq = self.next_seq();
        let node = PNode {
            seq,
            key,
            link: (NIL, NIL),
            val: Some(r),
        };
        let idx = match self.pfree.pop() {
            Some(i) => {
                self.pnodes[i as usize] = node;
                i
            }
            None => {
                self.pnodes.push(node);
                (self.pnodes.len() - 1) as u32
            }
        };
        bucket_push(
            &mut self.posted,
            key,
            &mut self.pnodes,
            idx,
            0,
            &mut self.posted_empty,
        );
        if src.is_none() || tag.is_none() {
            self.wild_posted += 1;
        }
        self.posted_count += 1;
        PostedHandle { idx, seq }
    }

    fn remove_posted(&mut self, idx: u32) -> R {
        let key = self.pnodes[idx as usize].key;
        if list_unlink(&mut self.pnodes, &mut self.posted, &key, idx, 0) {
            self.posted_empty += 1;
            purge(&mut [&mut self.posted], &mut self.posted_empty);
        }
        if key.src == ANY_SRC || key.tag == ANY_TAG {
            self.wild_posted -= 1;
        }
        self.posted_count -= 1;
        self.pfree.push(idx);
        self.pnodes[idx as usize]
            .val
            .take()
            .expect("posted node holds a value")
    }

    /// A message `(ctx, src, tag)` arrived: take the earliest posted receive it matches.
    pub fn take_posted(&mut self, ctx: u32, src: u32, tag: i32) -> Option<R> {
        let mut best: Option<(u64, u32)> = None;
        let mut consider = |this: &Self, key: PKey| {
            if let Some(l) = this.posted.get(&key).filter(|l| l.head != NIL) {
                let s = this.pnodes[l.head as usize].seq;
                if best.is_none_or(|(bs, _)| s < bs) {
                    best = Some((s, l.head));
                }
            }
        };
        consider(self, PKey { ctx, src, tag });
        if self.wild_posted > 0 {
            consider(
                self,
                PKey {
                    ctx,
                    src,
                    tag: ANY_TAG,
                },
            );
            consider(
                self,
                PKey {
                    ctx,
                    src: ANY_SRC,
                    tag,
                },
            );
            consider(
                self,
                PKey {
                    ctx,
                    src: ANY_SRC,
                    tag: ANY_TAG,
                },
            );
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
        let node = UNode {
            ctx,
            src,
            tag,
            links: [(NIL, NIL); 4],
            val: Some(m),
        };
        let idx = match self.ufree.pop() {
            Some(i) => {
                self.unodes[i as usize] = node;
                i
            }
            None => {
                self.unodes.push(node);
                (self.unodes.len() - 1) as u32
            }
        };
        let e = &mut self.unexpected_empty;
        bucket_push(
            &mut self.u_exact,
            (ctx, src, tag),
            &mut self.unodes,
            idx,
            0,
            e,
        );
        bucket_push(&mut self.u_src, (ctx, src), &mut self.unodes, idx, 1, e);
        bucket_push(&mut self.u_tag, (ctx, tag), &mut self.unodes, idx, 2, e);
        bucket_push(&mut self.u_ctx, ctx, &mut self.unodes, idx, 3, e);
        self.unexpected_count += 1;
    }

    fn find_unexpected(&self, ctx: u32, src: Option<u32>, tag: Option<i32>) -> Option<u32> {
        let l = match (src, tag) {
            (Some(s), Some(t)) => self.u_exact.get(&(ctx, s, t)),
            (Some(s), None) => self.u_src.get(&(ctx, s)),
            (None, Some(t)) => self.u_tag.get(&(ctx, t)),
            (None, None) => self.u_ctx.get(&ctx),
        }?;
        (l.head != NIL).then_some(l.head)
    }

    /// Take the earliest unexpected message matching a receive pattern.
    pub fn take_unexpected(
        &mut self,
        ctx: u32,
        src: Option<u32>,
        tag: Option<i32>,
    ) -> Option<(u32, i32, M)> {
        let idx = self.find_unexpected(ctx, src, tag)?;
        let (c, s, t) = {
            let n = &self.unodes[idx as usize];
            (n.ctx, n.src, n.tag)
        };
        let emptied = list_unlink(&mut self.unodes, &mut self.u_exact, &(c, s, t), idx, 0) as usize
            + list_unlink(&mut self.unodes, &mut self.u_src, &(c, s), idx, 1) as usize
            + list_unlink(&mut self.unodes, &mut self.u_tag, &(c, t), idx, 2) as usize
            + list_unlink(&mut self.unodes, &mut self.u_ctx, &c, idx, 3) as usize;
        if emptied > 0 {
            self.unexpected_empty += emptied;
            if self.unexpected_empty > 4096 {
                self.u_exact.retain(|_, l| l.head != NIL);
                self.u_src.retain(|_, l| l.head != NIL);
                self.u_tag.retain(|_, l| l.head != NIL);
                self.u_ctx.retain(|_, l| l.head != NIL);
                self.unexpected_empty = 0;
            }
        }
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
