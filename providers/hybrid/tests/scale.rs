//! The synthetic scale run (phantom peers): what each provider holds per peer, measured with
//! the soft HCA's accounting in one process.

use weft_hybrid::scale::{measure, Footprint};

fn at(p: &str, n: u32) -> Footprint {
    measure(p, n).unwrap_or_else(|e| panic!("{p} at {n} ranks: {e}"))
}

#[test]
fn ud_and_hybrid_hold_no_queue_or_buffer_per_peer() {
    for p in ["verbs-ud", "hybrid"] {
        let (small, big) = (at(p, 2), at(p, 2048));
        // Registration tables count pages, and where a pool starts in a page varies by a
        // few bytes of table between runs: no growth means less than a word per 32 peers.
        assert!(
            big.hca.abs_diff(small.hca) <= 64,
            "{p}: HCA structures grew with peers: {} -> {}",
            small.hca,
            big.hca
        );
        assert_eq!(small.buffers, big.buffers, "{p}: buffers grew with peers");
        let per_peer = (big.tables - small.tables) / 2046;
        assert!(
            (64..=2048).contains(&per_peer),
            "{p}: {per_peer} B of tables per peer"
        );
    }
}

#[test]
fn hybrid_adds_little_per_peer_over_ud() {
    let (u, h) = (at("verbs-ud", 2048), at("hybrid", 2048));
    let (u0, h0) = (at("verbs-ud", 2), at("hybrid", 2));
    let ud = (u.tables - u0.tables) / 2046;
    let hy = (h.tables - h0.tables) / 2046;
    // The hybrid's one record per peer (order both ways, the budget's link; 20 bytes) and its
    // table's slot and list entry, and verbs-rc's slot per rank: 32 bytes (68 with separate
    // order and budget tables).
    assert!(
        hy > ud && hy - ud <= 40,
        "verbs-ud {ud} B, hybrid {hy} B per peer"
    );
}

/// A process that talks to a few peers pays for the ranks it never talks to only a slot and an
/// address-book entry each. verbs-ud kept a whole peer record, its reliability link among it,
/// for every rank of the job (520 bytes a rank); verbs-rc sized its completion queue for a
/// keepalive probe per rank of the job (130 bytes a rank), where it now probes its connections
/// in turns of at most 256.
#[test]
fn ranks_never_talked_to_cost_a_few_bytes() {
    for p in ["verbs-ud", "hybrid", "verbs-rc"] {
        let few = |n| {
            weft_hybrid::scale::measure_talking_to(p, n, 16)
                .unwrap_or_else(|e| panic!("{p} at {n} ranks: {e}"))
        };
        // Both at or above the hybrid's LIMITS_FROM (512), so that both take the same limits.
        let (small, big) = (few(512), few(4096));
        assert_eq!((small.touched, big.touched), (16, 16));
        let per_rank = big.total().saturating_sub(small.total()) / (4096 - 512);
        assert!(per_rank <= 48, "{p}: {per_rank} B per rank never talked to");
    }
}

#[test]
fn rc_holds_a_queue_pair_per_peer_and_sparse_tables() {
    let (a, b) = (at("verbs-rc", 2), at("verbs-rc", 258));
    let qp = (b.hca - a.hca) / 256;
    assert!(qp >= 1024, "{qp} B of HCA structures per RC peer");
    let per_peer = (b.tables - a.tables) / 256;
    assert!(per_peer <= 2048, "{per_peer} B of tables per RC peer");
}

#[test]
fn bad_requests_are_errors() {
    assert!(measure("shm", 4).is_err());
    assert!(measure("verbs-ud", 1).is_err());
}
