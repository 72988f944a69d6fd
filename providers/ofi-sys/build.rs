//! Generate libfabric's types and constants from the system's headers (`libfabric-dev`, found
//! with pkg-config). Nothing is linked: the library is opened at run time (`dlopen`), so the
//! `weft` binary starts on machines without it. Without the headers (or without libclang) the
//! crate builds empty and says why through `BUILD_NOTE`.
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let note = match generate(&out) {
        Ok(version) => {
            println!("cargo:rustc-cfg=weft_libfabric");
            // weft-ofi reads it as DEP_FABRIC_HAVE.
            println!("cargo:have=1");
            format!("built against libfabric {version} headers")
        }
        Err((short, why)) => {
            // The details (pkg-config's or bindgen's own words) go to the build log; what a
            // rank, `weft info` and `weft test` say is one line.
            println!("cargo:warning=weft-ofi-sys: no libfabric bindings: {why}");
            format!("not built: {short}; install it and rebuild weft (the build log says more)")
        }
    };
    std::fs::write(out.join("note.rs"), format!("{note:?}")).expect("OUT_DIR is writable");
}

/// The bindings, or (one line for users, the details).
fn generate(out: &std::path::Path) -> Result<String, (String, String)> {
    let lib = pkg_config::Config::new()
        .cargo_metadata(false)
        .probe("libfabric")
        .map_err(|e| {
            (
                "libfabric-dev was missing at build time".to_string(),
                format!("pkg-config libfabric: {e}"),
            )
        })?;
    let mut b = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_type("fi_.*|fid.*")
        .allowlist_var("FI_.*")
        .allowlist_function("fi_(getinfo|freeinfo|dupinfo|fabric|strerror|version)")
        // The exported entry points become a struct of function pointers filled by dlopen.
        .dynamic_library_name("Fabric")
        .dynamic_link_require_all(true)
        .parse_callbacks(Box::new(U64Flags))
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(true)
        .generate_comments(false);
    for p in &lib.include_paths {
        b = b.clang_arg(format!("-I{}", p.display()));
    }
    // bindgen loads libclang at run time and panics when it cannot.
    let bindings = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || b.generate()))
        .map_err(|_| {
            let s = "libclang-dev was missing at build time".to_string();
            (s.clone(), s)
        })?
        .map_err(|e| {
            (
                "libfabric's headers did not parse".to_string(),
                format!("bindgen: {e}"),
            )
        })?;
    bindings
        .write_to_file(out.join("bindings.rs"))
        .map_err(|e| {
            (
                "its bindings could not be written".to_string(),
                e.to_string(),
            )
        })?;
    Ok(lib.version)
}

/// Flag macros as `u64` (libfabric's flags are 64-bit; bindgen would make the small ones `u32`).
#[derive(Debug)]
struct U64Flags;

impl bindgen::callbacks::ParseCallbacks for U64Flags {
    fn int_macro(&self, name: &str, _value: i64) -> Option<bindgen::callbacks::IntKind> {
        name.starts_with("FI_")
            .then_some(bindgen::callbacks::IntKind::U64)
    }
}
