//! Per-host composition on one machine: `weft run --hosts 2` gives the ranks two host
//! identities, so the job spans "hosts"; tcp-sim carries pairs across them and the host provider
//! (`WEFT_SHM_PROVIDER`: shm by default, limic, or none) pairs within one. The ring's per-path
//! counters show which provider carried what; the conformance suite passes on the composition.
//! (The same over two real network namespaces, launched by Hydra, is in `hydra.rs`.)

mod common;
use common::*;
use std::collections::HashMap;
use std::process::Command;

/// Rank -> its counters, from the ring's per-rank lines.
fn counters(out: &str) -> HashMap<u32, HashMap<String, u64>> {
    out.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("ring: rank ")?;
            let (r, rest) = rest.split_once(' ')?;
            let kv = rest
                .split_whitespace()
                .filter_map(|w| w.split_once('='))
                .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
                .collect();
            Some((r.parse().ok()?, kv))
        })
        .collect()
}

fn ring(env: &[(&str, &str)]) -> std::process::Output {
    let mut c = Command::new(weft());
    c.args(["run", "-n", "4", "--hosts", "2", "--"])
        .arg(example("weft-cli", "ring"))
        .env_remove("WEFT_PROVIDER")
        .env_remove("WEFT_SHM_PROVIDER");
    for (k, v) in env {
        c.env(k, v);
    }
    run_bounded(&mut c, 120)
}

#[test]
fn the_ring_takes_the_host_provider_within_a_host_and_tcp_between() {
    for (host, name) in [("", "tcp-sim+shm"), ("limic", "tcp-sim+limic")] {
        let o = if host.is_empty() {
            ring(&[])
        } else {
            ring(&[("WEFT_SHM_PROVIDER", host)])
        };
        let out = stdout(&o);
        assert!(o.status.success(), "{out}\n{}", stderr(&o));
        assert!(
            out.contains(&format!(
                "ring: ok over 4 ranks on 2 host(s), provider {name}"
            )),
            "{out}"
        );
        // Ranks 0,1 on host 0 and 2,3 on host 1: the ring's hops 0->1 and 2->3 stay on a host,
        // 1->2 and 3->0 cross. Each rank sends its ring payloads (3.2 MB) one way only.
        let c = counters(&out);
        for r in 0..4u32 {
            let k = &c[&r];
            let (on_host, across) = (k["host.bytes"], k["net.bytes"]);
            if r % 2 == 0 {
                assert!(on_host > 3_000_000 && across < 1000, "rank {r}: {k:?}");
            } else {
                assert!(across > 3_000_000 && on_host < 1000, "rank {r}: {k:?}");
            }
            assert!(
                k["host.arrivals"] > 0 && k["net.arrivals"] > 0,
                "rank {r}: {k:?}"
            );
        }
    }
    assert!(shm_leftovers().is_empty(), "{:?}", shm_leftovers());
}

#[test]
fn without_a_host_provider_the_network_carries_everything() {
    let o = ring(&[("WEFT_SHM_PROVIDER", "none")]);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(
        out.contains("ring: ok over 4 ranks on 2 host(s), provider tcp-sim,"),
        "{out}"
    );
}

#[test]
fn a_misspelt_host_provider_is_an_error_not_a_fallback() {
    let o = ring(&[("WEFT_SHM_PROVIDER", "shmm")]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains(
            "unknown provider 'shmm (WEFT_SHM_PROVIDER)'; available: shm, limic, tcp-sim, verbs-rc, verbs-ud, hybrid, ofi, none"
        ),
        "{err}"
    );
}

#[test]
fn conformance_passes_on_the_composition() {
    for host in ["shm", "limic"] {
        let o = run_bounded(
            Command::new(weft())
                .args(["test", "--provider", "tcp-sim", "-n", "4", "--hosts", "2"])
                .args(["--env", &format!("WEFT_SHM_PROVIDER={host}")])
                .env_remove("WEFT_SHM_PROVIDER"),
            600,
        );
        let out = stdout(&o);
        assert!(o.status.success(), "{out}\n{}", stderr(&o));
        assert!(
            out.contains(&format!(
                "conformance of provider 'tcp-sim+{host} (4 processes on 2 pretend hosts)'"
            )) && out.contains("PASS: 16/16"),
            "{out}"
        );
    }
}
