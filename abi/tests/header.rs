//! `include/weft_provider.h` is generated from `src/lib.rs` with cbindgen and checked in; this
//! test fails when it is stale. `WEFT_BLESS_HEADER=1` rewrites it.

use std::path::Path;

#[test]
fn header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cfg = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_config(cfg)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut out);
    let path = dir.join("include/weft_provider.h");
    let current = std::fs::read(&path).unwrap_or_default();
    if std::env::var_os("WEFT_BLESS_HEADER").is_some() {
        std::fs::write(&path, &out).unwrap();
        return;
    }
    assert!(
        current == out,
        "{} is stale: run WEFT_BLESS_HEADER=1 cargo test -p weft-abi --test header",
        path.display()
    );
}

/// The header's first line names the ABI version `src/lib.rs` declares (it said 1.0 after the
/// ABI became 1.1).
#[test]
fn header_names_the_current_version() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let h = std::fs::read_to_string(dir.join("include/weft_provider.h")).unwrap();
    let first = h.lines().next().unwrap_or_default();
    let v = format!(
        "version {}.{}.",
        weft_abi::WEFT_ABI_MAJOR,
        weft_abi::WEFT_ABI_MINOR
    );
    assert!(first.contains(&v), "{first:?} does not name {v}");
}
