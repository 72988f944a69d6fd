//! Every parameter, set to hostile or arbitrary text, is accepted or refused with an error by
//! the code that reads it — never a panic (`WEFT_TIMEOUT=1e300` and
//! `WEFT_TCP_SIM_BW_MBPS=1e-300` used to panic converting to a `Duration`). One test function:
//! it changes the process environment.

use proptest::test_runner::{Config, TestRunner};
use weft_hybrid as _;
use weft_limic as _;
use weft_loopback as _;
use weft_ofi as _;
use weft_shm as _;
use weft_tcp_sim as _;

mod common;
use common::*;

/// Run every reader of parameters: the core's, each provider's (its capabilities and its
/// probe read its configuration), the soft HCA's and the verbs providers' footprints (their
/// whole configuration: `WEFT_VERBS_UD_TIMEOUT=1e30` panicked there).
fn read_everything() {
    let _ = weft::check_params();
    let _ = weft_verbs::soft::model::Config::from_env();
    let _ = weft_verbs_rc::footprint();
    let _ = weft_verbs_ud::footprint();
    let (all, _) = weft::registry::providers();
    let ctx = weft::provider::ProbeContext {
        rank: 0,
        size: 2,
        in_process: false,
        hosts: 1,
        local_ranks: 2,
    };
    for f in &all {
        let _ = f.caps();
        let _ = f.probe(&ctx);
    }
}

fn check(var: &str, value: &str) {
    std::env::set_var(var, value);
    let r = std::panic::catch_unwind(read_everything);
    std::env::remove_var(var);
    assert!(r.is_ok(), "{var}={value:?} panicked");
}

#[test]
fn no_parameter_value_panics() {
    let hostile = [
        "",
        " ",
        "abc",
        "-1",
        "0",
        "1",
        "1e300",
        "2e19",
        "-2e19",
        "1e-300",
        "nan",
        "NaN",
        "inf",
        "-inf",
        "18446744073709551616",
        "99999999999999999999K",
        "16E",
        "1G",
        "4G",
        "4294967296",
        "0x10",
        "1.5",
        "%",
        "∞",
        "1K1",
        " 7 ",
        "yes",
        "auto",
    ];
    let params = weft::param::all();
    assert!(
        params.len() > 20,
        "only {} parameters registered",
        params.len()
    );
    for p in &params {
        for v in hostile {
            check(&p.env_name(), v);
        }
    }
    // And arbitrary text.
    let mut runner = TestRunner::new(Config {
        cases: 16,
        ..Config::default()
    });
    for p in &params {
        let name = p.env_name();
        runner
            .run(&"[ -~]{0,24}", |v| {
                check(&name, &v);
                Ok(())
            })
            .unwrap();
    }
    // Values that parse but are out of range are errors, not accepted silently: every
    // parameter that `check_params` lets through, its readers accept too (one parser).
    for p in &params {
        for v in hostile {
            std::env::set_var(p.env_name(), v);
            let checked = weft::check_params().is_ok();
            let soft = weft_verbs::soft::model::Config::from_env();
            let rc = weft_verbs_rc::footprint();
            let ud = weft_verbs_ud::footprint();
            std::env::remove_var(p.env_name());
            if checked {
                for (what, r) in [
                    ("soft HCA", soft.map(|_| ())),
                    ("verbs-rc", rc.map(|_| ())),
                    ("verbs-ud", ud.map(|_| ())),
                ] {
                    if let Err(e) = r {
                        assert!(
                            e.kind() != weft::ErrorKind::Param,
                            "{}={v:?} passed the check but {what} refused it: {e}",
                            p.env_name()
                        );
                    }
                }
            }
        }
    }
    for (var, v) in [
        ("WEFT_TIMEOUT", "1e300"),
        ("WEFT_PMI_TIMEOUT", "1e300"),
        ("WEFT_TCP_SIM_BW_MBPS", "1e-300"),
        ("WEFT_TCP_SIM_DELAY_US", "18446744073709551615"),
    ] {
        std::env::set_var(var, v);
        let core = weft::check_params();
        let tcp = weft::registry::providers()
            .0
            .iter()
            .find(|f| f.name() == "tcp-sim")
            .map(|f| f.caps().map(|_| ()));
        std::env::remove_var(var);
        assert!(
            core.is_err() || tcp.is_some_and(|r| r.is_err()),
            "{var}={v} was accepted"
        );
    }
}

/// The values of issue 67 that panicked the binaries (exit 101): through `weft info`,
/// `weft info -e` and a job under the hybrid provider, each is refused (exit 2) naming the
/// variable; durations above 10^9 s are refused everywhere (the RC ones took 1e12).
#[test]
fn out_of_range_durations_and_rates_are_refused_by_the_binaries() {
    let vars = [
        "WEFT_VERBS_UD_TIMEOUT",
        "WEFT_VERBS_UD_KEEPALIVE",
        "WEFT_VERBS_RC_KEEPALIVE",
        "WEFT_VERBS_RC_CONNECT_TIMEOUT",
        "WEFT_VERBS_SOFT_FENCE",
        "WEFT_TIMEOUT",
        "WEFT_PMI_TIMEOUT",
    ];
    let mut cases: Vec<(&str, &str)> = vec![];
    for v in vars {
        for x in ["1e30", "1e11", "1e12", "1e300", "18446744073709551616"] {
            cases.push((v, x));
        }
    }
    cases.push(("WEFT_VERBS_SOFT_BANDWIDTH_MBS", "1e-300"));
    cases.push(("WEFT_TCP_SIM_BW_MBPS", "1e-300"));
    // The other test of this binary changes the environment: the commands get a clean one.
    let clean = || {
        let mut c = std::process::Command::new(weft());
        c.env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default());
        c
    };
    for (var, x) in cases {
        for args in [&["info"][..], &["info", "-e"]] {
            let o = run_bounded(clean().args(args).env(var, x), 60);
            let out = format!("{}{}", stdout(&o), stderr(&o));
            assert_eq!(
                o.status.code(),
                Some(2),
                "weft {args:?} with {var}={x}: {out}"
            );
            assert!(out.contains(&format!("{var}='{x}'")), "{var}={x}: {out}");
        }
    }
    let ring = example("weft-cli", "ring");
    let o = run_bounded(
        clean()
            .args(["run", "-n", "2", "--provider", "hybrid", "--"])
            .arg(&ring)
            .env("WEFT_VERBS_UD_TIMEOUT", "1e30"),
        60,
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("WEFT_VERBS_UD_TIMEOUT='1e30'"),
        "{}",
        stderr(&o)
    );
}

/// Issue 67, items 10, 11 and 13, as a user meets them. A bad value is an error whichever
/// provider ends up selected (these ran on shm with exit 0); `weft info -e` exits 2 quoting
/// the value; excluding a provider the program does not have is a warning, not an error.
#[test]
fn bad_values_fail_the_job_and_info_whichever_provider_is_selected() {
    let clean = || {
        let mut c = std::process::Command::new(weft());
        c.env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default());
        c
    };
    let ring = example("weft-cli", "ring");
    let jobs: [&[(&str, &str)]; 3] = [
        &[
            ("WEFT_PROVIDER", "verbs-ud,shm"),
            ("WEFT_VERBS_UD_MTU", "0"),
        ],
        &[("WEFT_VERBS_RC_SQ", "0")],
        &[
            ("WEFT_PROVIDER", "hybrid,shm"),
            ("WEFT_HYBRID_RULES", "garbage"),
        ],
    ];
    for env in jobs {
        let mut c = clean();
        c.args(["run", "-n", "2", "--"]).arg(&ring);
        for (k, v) in env {
            c.env(k, v);
        }
        let o = run_bounded(&mut c, 120);
        let (var, value) = env[env.len() - 1];
        assert_eq!(o.status.code(), Some(2), "{env:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(&format!("{var}='{value}'")),
            "{env:?}: {}",
            stderr(&o)
        );
    }
    for (var, value) in [
        ("WEFT_VERBS_UD_MTU", "0"),
        ("WEFT_VERBS_RC_SQ", "0"),
        ("WEFT_HYBRID_RULES", "garbage"),
        ("WEFT_OFI_AM_BUF", "0"),
        ("WEFT_OFI_AM_RX", "0"),
        ("WEFT_OFI_RNDV", "abc"),
        ("WEFT_OFI_RNDV", "0"),
        ("WEFT_OFI_RNDV", "1e300"),
        ("WEFT_OFI_NATIVE", "abc"),
        ("WEFT_OFI_NATIVE", "2"),
    ] {
        let o = run_bounded(clean().args(["info", "-e"]).env(var, value), 60);
        let out = format!("{}{}", stdout(&o), stderr(&o));
        assert_eq!(o.status.code(), Some(2), "{var}={value}: {out}");
        assert!(
            out.contains(&format!("ERROR: bad value for {var}='{value}'")),
            "{var}={value}: {out}"
        );
    }
    let o = run_bounded(
        clean()
            .args(["run", "-n", "2", "--"])
            .arg(&ring)
            .env("WEFT_PROVIDER", "^loopback"),
        120,
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("excludes 'loopback', which this program does not have"),
        "{}",
        stderr(&o)
    );
}
