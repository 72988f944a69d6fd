//! Every parameter, set to hostile or arbitrary text, is accepted or refused with an error by
//! the code that reads it — never a panic (`WEFT_TIMEOUT=1e300` and
//! `WEFT_TCP_SIM_BW_MBPS=1e-300` used to panic converting to a `Duration`). One test function:
//! it changes the process environment.

use proptest::test_runner::{Config, TestRunner};
use weft_limic as _;
use weft_ofi as _;
use weft_shm as _;
use weft_tcp_sim as _;

/// Run every reader of parameters: the core's, and each provider's (its capabilities and its
/// probe read its configuration).
fn read_everything() {
    let _ = weft::check_params();
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
    // Values that parse but are out of range are errors, not accepted silently.
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
