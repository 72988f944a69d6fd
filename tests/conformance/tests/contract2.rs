//! The conformance suite over the loopback provider with every optional part of contract 2
//! switched on (local descriptors, transmit-complete writes with completion data, zero-copy
//! active messages, lazy connections, an HCA's atomics), and with each alone.

use weft_loopback::LoopbackConfig;
use weft_testing::Options;

fn check(what: &str, cfg: LoopbackConfig) {
    let opts = Options {
        loopback: cfg,
        ..Options::default()
    };
    let results =
        weft_testing::world_dyn_with(3, "loopback", &opts, |c| weft_conformance::run(c, None));
    let t = weft_conformance::table(&format!("loopback ({what})"), &results[0]);
    println!("{t}");
    assert!(results[0].iter().all(|o| o.ok), "{t}");
}

#[test]
fn conformance_on_contract_2() {
    let rma = LoopbackConfig {
        rma: true,
        ..Default::default()
    };
    check("all of contract 2", LoopbackConfig::contract2());
    check(
        "mr_local",
        LoopbackConfig {
            mr_local: true,
            ..rma.clone()
        },
    );
    check(
        "transmit completion",
        LoopbackConfig {
            transmit: true,
            ..rma.clone()
        },
    );
    check(
        "lazy connections",
        LoopbackConfig {
            lazy: true,
            zcopy: true,
            ..rma
        },
    );
}
