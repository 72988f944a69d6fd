//! The soft HCA's wire service fed sequences of packets from a hostile sender (fragments of
//! long payloads with headers that agree or disagree, answers, fetches, raw bytes; some naming
//! the target's QP, key and GID, so that requests execute against a registered region): no
//! panic, and never more held for reassembly and read results than the service's budget.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use weft_verbs::soft::service::{hostile, Service};
use weft_verbs::soft::wire::CHUNK;

fn target() -> &'static hostile::Target {
    static T: OnceLock<hostile::Target> = OnceLock::new();
    T.get_or_init(|| hostile::target().expect("a soft HCA for the target"))
}

fuzz_target!(|data: &[u8]| {
    let t = target();
    let budget = 4 * CHUNK;
    let mut svc = Service::on(&t.hca, budget).expect("a service on the target");
    if let Err(e) = hostile::drive(&mut svc, data, &t.good, budget) {
        panic!("{e}");
    }
});
