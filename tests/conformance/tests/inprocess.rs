//! The conformance suite in-process (ranks as threads) over the built-in providers and over
//! both example providers loaded from libraries through WEFT_PROVIDER_PATH; and the loader's
//! refusal of broken libraries. One test function: WEFT_PROVIDER_PATH is read once per process.

use std::path::{Path, PathBuf};
use weft_loopback as _;
use weft_shm as _;
use weft_tcp_sim as _;

/// `target/<profile>` of this test binary.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(Path::parent).unwrap().to_path_buf()
}

/// The Rust example provider, built with this profile, installed as libweft-rdgram.so in `dir`.
fn install_rdgram(dir: &Path) {
    let lib = profile_dir().join("libweft_rdgram.so");
    if !lib.exists() {
        let mut cmd = std::process::Command::new(env!("CARGO"));
        cmd.args(["build", "--quiet", "-p", "weft-example-rdgram"]);
        if profile_dir().file_name().is_some_and(|f| f == "release") {
            cmd.arg("--release");
        }
        assert!(
            cmd.status().unwrap().success(),
            "building the rdgram example"
        );
    }
    std::fs::copy(&lib, dir.join("libweft-rdgram.so")).unwrap();
}

fn check(provider: &str, n: u32) {
    let results = weft_testing::world_dyn(n, provider, |c| weft_conformance::run(c, None));
    let t = weft_conformance::table(provider, &results[0]);
    println!("{t}");
    assert!(results[0].iter().all(|o| o.ok), "{t}");
}

#[test]
fn conformance_in_process_and_loader_checks() {
    let dir = std::env::temp_dir().join(format!("weft-providers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    install_rdgram(&dir);
    for lib in ["libweft-cdgram.so", "libweft-cdgram10.so"] {
        std::fs::copy(
            Path::new(weft_conformance::CDGRAM_DIR).join(lib),
            dir.join(lib),
        )
        .unwrap();
    }
    let path =
        std::env::join_paths([dir.as_path(), Path::new(weft_conformance::BROKEN_DIR)]).unwrap();
    std::env::set_var("WEFT_PROVIDER_PATH", &path);

    // The loader: good libraries load, broken ones are refused with the file and the reason.
    let (all, failures) = weft::registry::providers();
    let names: Vec<&str> = all.iter().map(|f| f.name()).collect();
    assert!(
        names.contains(&"rdgram") && names.contains(&"cdgram"),
        "{names:?}"
    );
    let reason = |n: &str| {
        failures
            .iter()
            .find(|f| {
                f.path
                    .file_name()
                    .is_some_and(|x| x.to_string_lossy() == format!("libweft-{n}.so"))
            })
            .map(|f| f.error.clone())
            .unwrap_or_else(|| panic!("libweft-{n}.so was not refused; failures: {failures:?}"))
    };
    assert!(
        reason("badmajor").contains("provider speaks ABI 2.0, weft speaks ABI 1.1"),
        "{}",
        reason("badmajor")
    );
    assert!(
        reason("newminor").contains("newer than this weft"),
        "{}",
        reason("newminor")
    );
    assert!(
        reason("smallentry").contains("entry table of 8 bytes is smaller than ABI 1.1's"),
        "{}",
        reason("smallentry")
    );
    assert!(
        reason("noprogress").contains("mandatory functions missing: progress"),
        "{}",
        reason("noprogress")
    );
    assert!(
        reason("nullentry").contains("returned null"),
        "{}",
        reason("nullentry")
    );
    assert!(
        reason("nosymbol").contains("no weft_provider_entry symbol"),
        "{}",
        reason("nosymbol")
    );
    assert!(
        reason("wrongname").contains("calls itself 'someoneelse'"),
        "{}",
        reason("wrongname")
    );
    assert!(!reason("notalibrary").is_empty());

    // Asking for a refused library says it was found and why it was not loaded (it used to
    // say "unknown provider"); in a preference list the next name is taken instead.
    use weft::registry::{candidates_with, Selection};
    let e = candidates_with(
        &Selection::parse("badmajor").unwrap(),
        &all,
        &failures,
        None,
    )
    .err()
    .expect("a refused library alone cannot be selected");
    assert_eq!(e.kind(), weft::ErrorKind::ProviderUnavailable, "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("libweft-badmajor.so was found but not loaded")
            && msg.contains("provider speaks ABI 2.0"),
        "{msg}"
    );
    let c = candidates_with(
        &Selection::parse("badmajor,loopback").unwrap(),
        &all,
        &failures,
        None,
    )
    .unwrap();
    assert_eq!(c.iter().map(|f| f.name()).collect::<Vec<_>>(), ["loopback"]);

    // A library whose close fails: the reason comes from the thread's last error, not from
    // the instance close has just released (that read was a use after free).
    let cf = all
        .iter()
        .find(|f| f.name() == "closefail")
        .expect("closefail loads");
    let job = weft::bootstrap::InProcessJob::new(1, std::time::Duration::from_secs(20));
    let mut boot = job.rank(0);
    let mut p = cf.open(&mut boot).unwrap();
    let e = p.close().unwrap_err().to_string();
    assert!(e.contains("the fabric refused to close"), "{e}");
    assert!(!e.contains("USE AFTER CLOSE"), "{e}");

    // ABI 1.1 (cdgram connects lazily through the key-value space) and 1.0 (cdgram10) side by
    // side: the 1.0 library sees none of 1.1.
    let caps_of = |n: &str| {
        all.iter()
            .find(|f| f.name() == n)
            .unwrap_or_else(|| panic!("{n} loads"))
            .caps()
            .unwrap()
    };
    assert!(caps_of("cdgram").lazy_connect);
    assert!(!caps_of("cdgram10").lazy_connect);
    let lazy = weft_testing::world_dyn(3, "cdgram", |c| {
        c.barrier().unwrap();
        // cdgram connects at once and reports the event from its next progress.
        c.progress().unwrap();
        c.connections()
    });
    // A dissemination barrier on 3 ranks sends to 2 peers: asked for and reported up.
    assert!(
        lazy.iter().all(|&(asked, up)| asked == 2 && up == 2),
        "{lazy:?}"
    );
    for (p, n) in [
        ("loopback", 3),
        ("shm", 3),
        ("rdgram", 3),
        ("cdgram", 3),
        ("cdgram10", 3),
    ] {
        check(p, n);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
