//! The hybrid's RC-FP slots follow its chain. A test binary of its own: it changes the
//! environment, which no other thread of the process may read meanwhile.

use weft_hybrid::Hybrid;
use weft_provider::bootstrap::Singleton;
use weft_provider::provider::StaticProvider;
use weft_verbs::channel::RcChannel;

/// RC-FP slots are sized for what the chain sends through them: the default chain sends up to
/// 2 KiB by RC-FP, so its slots (2,816 bytes with their slack) are well below verbs-rc's own
/// 4 KiB ones; a chain without RC-FP sets up none.
#[test]
fn rc_fp_slots_follow_the_chain() {
    let rc_own = {
        let mut boot = Singleton::new();
        let rc = weft_verbs::rc::VerbsRc::open(&mut boot).expect("open verbs-rc");
        rc.ring_bytes_per_peer()
    };
    let fp = |rules: Option<&str>| {
        match rules {
            Some(r) => std::env::set_var("WEFT_HYBRID_RULES", r),
            None => std::env::remove_var("WEFT_HYBRID_RULES"),
        }
        let h = Hybrid::open(&mut Singleton::new()).expect("open hybrid");
        h.fp_bytes_per_peer()
    };
    let default = fp(None).expect("the default chain has RC-FP");
    // 16 slots of a 2 KiB payload, the largest header and the record's framing, both ways.
    assert!(
        default >= 2 * 16 * 2048 && default * 4 < rc_own * 3,
        "hybrid {default} B per peer against verbs-rc's {rc_own} B"
    );
    let wide = fp(Some("{size<=8192: RC-FP}, {true: UD-SR}")).expect("a chain with RC-FP");
    assert!(wide >= 2 * 16 * 8192, "8 KiB by RC-FP in {wide} B of slots");
    assert_eq!(fp(Some("{size<=8192: RC-SR}, {true: UD-SR}")), None);
    // Slots for 64 KiB, 1024 of them: more than a ring may take, an error saying so.
    std::env::set_var("WEFT_VERBS_RC_FP_BUFS", "1024");
    std::env::set_var("WEFT_HYBRID_RULES", "{size<=65536: RC-FP}, {true: UD-SR}");
    let e = Hybrid::open(&mut Singleton::new())
        .err()
        .expect("a ring over 8 MiB refused");
    assert!(e.to_string().contains("WEFT_VERBS_RC_FP_BUFS=1024"), "{e}");
    std::env::remove_var("WEFT_VERBS_RC_FP_BUFS");
    std::env::remove_var("WEFT_HYBRID_RULES");
}
