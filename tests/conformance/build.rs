//! Build the C example provider and the broken libraries of the loader tests as shared
//! libraries in OUT_DIR, with the compiler the `cc` crate finds.

use std::path::{Path, PathBuf};
use std::process::Command;

fn shared(out: &Path, file: &str, src: &str, defines: &[&str]) {
    shared_with(out, file, src, defines, None)
}

fn shared_with(out: &Path, file: &str, src: &str, defines: &[&str], extra_include: Option<&str>) {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let include = manifest.join("../../abi/include");
    let compiler = cc::Build::new().get_compiler();
    let mut cmd: Command = compiler.to_command();
    cmd.args(["-shared", "-fPIC", "-O2", "-Wall"])
        .arg("-I")
        .arg(&include);
    if let Some(dir) = extra_include {
        cmd.arg("-I").arg(manifest.join(dir));
    }
    for d in defines {
        cmd.arg(format!("-D{d}"));
    }
    cmd.arg("-o").arg(out.join(file)).arg(manifest.join(src));
    let st = cmd.status().expect("running the C compiler");
    assert!(st.success(), "compiling {src} failed");
}

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed=../../examples/providers/c-dgram/cdgram.c");
    println!("cargo:rerun-if-changed=c/broken.c");
    println!("cargo:rerun-if-changed=c/faulty.c");
    println!("cargo:rerun-if-changed=c/closefail.c");
    println!("cargo:rerun-if-changed=../../abi/include/weft_provider.h");
    let good = out.join("c");
    let bad = out.join("broken");
    std::fs::create_dir_all(&good).unwrap();
    std::fs::create_dir_all(&bad).unwrap();
    shared(
        &good,
        "libweft-cdgram.so",
        "../../examples/providers/c-dgram/cdgram.c",
        &[],
    );
    // The same example as an ABI 1.0 library: a 1.1 weft must still load and run it.
    shared(
        &good,
        "libweft-cdgram10.so",
        "../../examples/providers/c-dgram/cdgram.c",
        &["CDGRAM_ABI_1_0", "CDGRAM_NAME=\"cdgram10\""],
    );
    shared_with(
        &good,
        "libweft-faulty.so",
        "c/faulty.c",
        &[],
        Some("../../examples/providers/c-dgram"),
    );
    shared_with(
        &bad,
        "libweft-closefail.so",
        "c/closefail.c",
        &[],
        Some("../../examples/providers/c-dgram"),
    );
    for (name, defs) in [
        ("badmajor", &["BAD_MAJOR"][..]),
        ("newminor", &["NEWER_MINOR"]),
        ("smallentry", &["SMALL_ENTRY"]),
        ("noprogress", &["NO_PROGRESS"]),
        ("nullentry", &["NULL_ENTRY"]),
        ("nosymbol", &["NO_SYMBOL"]),
        ("wrongname", &[]),
    ] {
        let n = if name == "wrongname" {
            "someoneelse"
        } else {
            name
        };
        let mut d: Vec<String> = defs.iter().map(|s| s.to_string()).collect();
        d.push(format!("NAME=\"{n}\""));
        let refs: Vec<&str> = d.iter().map(String::as_str).collect();
        shared(&bad, &format!("libweft-{name}.so"), "c/broken.c", &refs);
    }
    std::fs::write(
        bad.join("libweft-notalibrary.so"),
        b"this is not an ELF file",
    )
    .unwrap();
}
