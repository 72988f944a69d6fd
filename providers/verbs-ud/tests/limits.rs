//! Parameters that bound a packet or a message, against what the provider then promises.
//!
//! - A `WEFT_VERBS_UD_MTU` above the port's active MTU used to open, then lose every datagram
//!   (the HCA fails a send larger than the MTU) until the peers failed each other for
//!   silence; it is now refused at open, and a port with the larger MTU carries it.
//! - A small `WEFT_VERBS_UD_WINDOW` (or `WEFT_VERBS_UD_SEND_BUFS`) used to leave the largest
//!   message the provider advertised with more packets than the window holds: `am_send`
//!   said "busy" for ever. The advertised payload now fits them.
//!
//! - `WEFT_VERBS_UD_ACK_DELAY_US` is how long a received packet waits for data to carry its
//!   acknowledgement before one goes alone.
//!
//! (Its own test binary: the tests set environment variables, one at a time under a lock.)

use std::sync::Mutex;
use weft_provider::bootstrap::InProcessJob;
use weft_provider::provider::{Provider, StaticProvider};
use weft_verbs_ud::VerbsUd;

#[path = "common.rs"]
mod common;
use common::*;

static ENV: Mutex<()> = Mutex::new(());

/// Set the soft HCA and exactly these `WEFT_VERBS_*` variables of the ones the tests use.
fn env(vars: &[(&str, &str)]) {
    std::env::set_var("WEFT_VERBS_DEVICE", "soft");
    for k in [
        "WEFT_VERBS_UD_MTU",
        "WEFT_VERBS_SOFT_MTU",
        "WEFT_VERBS_UD_WINDOW",
        "WEFT_VERBS_UD_SEND_BUFS",
        "WEFT_VERBS_UD_ACK_DELAY_US",
        "WEFT_VERBS_UD_KEEPALIVE",
    ] {
        std::env::remove_var(k);
    }
    for (k, v) in vars {
        std::env::set_var(k, v);
    }
}

fn pattern(i: usize) -> u8 {
    (i * 7 + 3) as u8
}

/// Rank 0 sends `len` bytes (several packets); rank 1 checks every byte and replies.
fn exchange(len: usize) {
    let out = world(2, move |mut p, bar| {
        let mut ev = Events::default();
        bar.wait();
        if p.rank() == 0 {
            let data: Vec<u8> = (0..len).map(pattern).collect();
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
    assert_eq!(got.len(), len);
    assert!(got.iter().enumerate().all(|(i, &b)| b == pattern(i)));
}

/// The error opening a provider of a one-rank job gives (`what` names the setting).
fn refused(what: &str) -> String {
    let job = InProcessJob::new(1, T);
    match VerbsUd::open(&mut job.rank(0)) {
        Ok(_) => panic!("{what} opened"),
        Err(e) => e.to_string(),
    }
}

fn caps_of_one() -> weft_provider::provider::Caps {
    let job = InProcessJob::new(1, T);
    let p = VerbsUd::open(&mut job.rank(0)).expect("open");
    p.caps().clone()
}

#[test]
fn an_mtu_above_the_port_is_refused_at_open_and_carried_where_the_port_has_it() {
    let _g = ENV.lock().unwrap_or_else(|e| e.into_inner());
    // The soft HCA's port at its default, 2048 bytes.
    env(&[("WEFT_VERBS_UD_MTU", "4096")]);
    let err = refused("a 4096-byte packet size on a 2048-byte port");
    assert!(
        err.contains("WEFT_VERBS_UD_MTU=4096") && err.contains("active MTU (2048"),
        "{err}"
    );

    // A 4096-byte port carries 4096-byte packets.
    env(&[
        ("WEFT_VERBS_UD_MTU", "4096"),
        ("WEFT_VERBS_SOFT_MTU", "4096"),
    ]);
    exchange(6000);

    // Left at its default, the packet size follows a smaller port.
    env(&[("WEFT_VERBS_SOFT_MTU", "1024")]);
    exchange(6000);
}

#[test]
fn the_largest_message_advertised_fits_the_window_and_the_send_buffers() {
    let _g = ENV.lock().unwrap_or_else(|e| e.into_inner());
    // (settings, packets the window and send buffers hold at once, packet size)
    for (vars, packets, mtu) in [
        (&[("WEFT_VERBS_UD_WINDOW", "1")][..], 1, 2048),
        (&[("WEFT_VERBS_UD_WINDOW", "4")][..], 4, 2048),
        (&[("WEFT_VERBS_UD_SEND_BUFS", "16")][..], 16, 2048),
        // 256-byte packets: 64 KiB would take 279, more than the default window of 128.
        (&[("WEFT_VERBS_SOFT_MTU", "256")][..], 128, 256),
    ] {
        env(vars);
        let caps = caps_of_one();
        // Each packet carries a 20-byte header.
        let room = packets * (mtu - 20);
        assert!(
            caps.max_am_payload + 128 <= room && caps.max_am_payload > 0,
            "{vars:?}: {} bytes advertised, {packets} packets hold {room}",
            caps.max_am_payload
        );
        assert!(caps.eager_limit <= caps.max_am_payload, "{vars:?}");
        // The largest message goes, whole.
        exchange(caps.max_am_payload);
    }
    // The defaults keep 64 KiB.
    env(&[]);
    assert_eq!(caps_of_one().max_am_payload, 64 << 10);
}

#[test]
fn the_acknowledgement_delay_is_how_long_a_packet_waits_before_one_goes_alone() {
    let _g = ENV.lock().unwrap_or_else(|e| e.into_inner());
    env(&[("WEFT_VERBS_UD_ACK_DELAY_US", "-1")]);
    let err = refused("a negative acknowledgement delay");
    assert!(err.contains("WEFT_VERBS_UD_ACK_DELAY_US"), "{err}");

    // Rank 1 receives one packet and has nothing to send back: with no delay its
    // acknowledgement goes alone at once; with a second's, not within 50 ms of progress.
    // (No keepalive probes: the first one may carry the acknowledgement.)
    for (delay, alone) in [("0", true), ("1000000", false)] {
        env(&[
            ("WEFT_VERBS_UD_ACK_DELAY_US", delay),
            ("WEFT_VERBS_UD_KEEPALIVE", "0"),
        ]);
        let out = world(2, |mut p, bar| {
            let mut ev = Events::default();
            bar.wait();
            let n = if p.rank() == 0 {
                send(&mut p, &mut ev, 1, b"one", &[1]);
                None
            } else {
                until(&mut p, &mut ev, "the packet", |e| !e.am.is_empty());
                let t0 = std::time::Instant::now();
                while counter(&p, "pure_acks") == 0
                    && t0.elapsed() < std::time::Duration::from_millis(50)
                {
                    p.progress(&mut ev).unwrap();
                }
                Some(counter(&p, "pure_acks"))
            };
            // Both alive until rank 1 has looked.
            bar.wait();
            n
        });
        let acks = out[1].expect("rank 1's count");
        assert_eq!(
            acks > 0,
            alone,
            "WEFT_VERBS_UD_ACK_DELAY_US={delay}: {acks} pure acknowledgements"
        );
    }
}
