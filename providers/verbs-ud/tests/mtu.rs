//! The packet size against the port's MTU. A `WEFT_VERBS_UD_MTU` above the port's active MTU
//! used to open, then lose every datagram (the HCA fails a send larger than the MTU) until the
//! peers failed each other for silence; it is now refused at open, and a port with the larger
//! MTU carries it. (Its own test binary: it sets environment variables, in one test.)

use weft_provider::bootstrap::InProcessJob;
use weft_provider::provider::{Provider, StaticProvider};
use weft_verbs_ud::VerbsUd;

#[path = "common.rs"]
mod common;
use common::*;

/// Rank 0 sends a message of several 4 KiB packets; rank 1 checks every byte.
fn exchange() {
    const LEN: usize = 6000;
    let out = world(2, |mut p, bar| {
        let mut ev = Events::default();
        bar.wait();
        if p.rank() == 0 {
            let data: Vec<u8> = (0..LEN).map(|i| (i * 7 + 3) as u8).collect();
            send(&mut p, &mut ev, 1, b"big", &data);
            until(&mut p, &mut ev, "the reply", |e| !e.am.is_empty());
            None
        } else {
            until(&mut p, &mut ev, "the message", |e| !e.am.is_empty());
            send(&mut p, &mut ev, 0, b"ok", &[]);
            Some(ev.am[0].2.clone())
        }
    });
    let got = out[1].clone().expect("rank 1's message");
    assert_eq!(got.len(), LEN);
    assert!(got.iter().enumerate().all(|(i, &b)| b == (i * 7 + 3) as u8));
}

#[test]
fn an_mtu_above_the_port_is_refused_at_open_and_carried_where_the_port_has_it() {
    std::env::set_var("WEFT_VERBS_DEVICE", "soft");
    std::env::set_var("WEFT_VERBS_UD_MTU", "4096");

    // The soft HCA's port at its default, 2048 bytes.
    let job = InProcessJob::new(1, T);
    let err = match VerbsUd::open(&mut job.rank(0)) {
        Ok(_) => panic!("a 4096-byte packet size opened on a 2048-byte port"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("WEFT_VERBS_UD_MTU=4096") && err.contains("active MTU (2048"),
        "{err}"
    );

    // A 4096-byte port carries 4096-byte packets.
    std::env::set_var("WEFT_VERBS_SOFT_MTU", "4096");
    exchange();

    // Left at its default, the packet size follows a smaller port.
    std::env::remove_var("WEFT_VERBS_UD_MTU");
    std::env::set_var("WEFT_VERBS_SOFT_MTU", "1024");
    exchange();
}
