//! A soft HCA whose process has exited but not been reaped (a zombie: its pid lives on, its
//! descriptors do not — as a finished rank under a launcher that reaps late) is a failed peer,
//! not an unsupported one: a slower rank that first addresses it after it finished must see
//! "peer failed", which a provider handles, rather than an error that ends the job (seen with
//! 1024 verbs-ud ranks under Hydra).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use weft_provider::ErrorKind;
use weft_verbs::soft::SoftHca;
use weft_verbs::*;

const CHILD: &str = "WEFT_TEST_GONE_CHILD";

/// Run in the child only: open a soft HCA, print its address, exit without closing it.
#[test]
fn child_opens_an_hca_and_exits() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let h = SoftHca::with_config(Default::default()).expect("soft HCA");
    let ep = Endpoint {
        gid: h.gid(),
        qpn: 1,
        psn: 0,
        lid: 0,
    };
    println!("EP {ep}");
    std::process::exit(0);
}

fn state(pid: u32) -> Option<char> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s.rsplit(')').next()?.trim_start().chars().next()
}

#[test]
fn an_hca_whose_process_exited_is_a_failed_peer() {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_opens_an_hca_and_exits", "--nocapture"])
        .env(CHILD, "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let ep: Endpoint = out
        .lines()
        .map_while(|l| l.ok())
        .find_map(|l| l.strip_prefix("EP ").map(|e| e.parse().unwrap()))
        .expect("the child printed its address");
    // Exited, not reaped: a zombie.
    let t0 = Instant::now();
    while state(child.id()) != Some('Z') {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the child did not exit: {:?}",
            state(child.id())
        );
        std::thread::yield_now();
    }
    let h = SoftHca::with_config(Default::default()).unwrap();
    let pd = h.alloc_pd().unwrap();
    let e = h
        .create_ah(
            pd,
            &AhAttr {
                dgid: ep.gid,
                ..AhAttr::default()
            },
        )
        .expect_err("the peer is gone");
    assert_eq!(e.kind(), ErrorKind::PeerFailed, "{e}");
    assert!(e.to_string().contains("is gone"), "{e}");
    child.wait().unwrap();
    // Reaped: still a failed peer.
    let e = h
        .create_ah(
            pd,
            &AhAttr {
                dgid: ep.gid,
                ..AhAttr::default()
            },
        )
        .expect_err("the peer is gone");
    assert_eq!(e.kind(), ErrorKind::PeerFailed, "{e}");
}
