//! From symbols.txt: the linker version script (rdma-core's version nodes, in order, each
//! inheriting the one before), the `.symver` bindings that put each exported function under
//! its node, and the bodies of the symbols weft does not offer. Also the SONAME, and
//! `-z nodelete` (weft's threads may outlive a `dlclose`).
use std::fmt::Write;

fn main() {
    println!("cargo:rerun-if-changed=symbols.txt");
    let src = std::fs::read_to_string("symbols.txt").expect("symbols.txt");
    let mut nodes: Vec<(String, Vec<String>)> = Vec::new();
    let mut asm = String::new();
    let mut stubs = String::new();
    for line in src
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
    {
        let mut w = line.split_whitespace();
        let (node, kind) = (w.next().unwrap(), w.next().unwrap());
        if !nodes.iter().any(|(n, _)| n == node) {
            nodes.push((node.to_string(), Vec::new()));
        }
        for sym in w {
            nodes
                .iter_mut()
                .find(|(n, _)| n == node)
                .unwrap()
                .1
                .push(sym.into());
            writeln!(asm, "    \".symver {sym}, {sym}@@{node}\",").unwrap();
            match kind {
                "impl" => {}
                "err" => writeln!(
                    stubs,
                    "#[no_mangle]\npub extern \"C\" fn {sym}() -> libc::c_int {{ crate::unoffered_err(\"{sym}\") }}"
                )
                .unwrap(),
                "null" => writeln!(
                    stubs,
                    "#[no_mangle]\npub extern \"C\" fn {sym}() -> *mut libc::c_void {{ crate::unoffered_null(\"{sym}\") }}"
                )
                .unwrap(),
                k => panic!("symbols.txt: unknown kind {k}"),
            }
        }
    }
    let mut map = String::new();
    let mut prev: Option<&str> = None;
    let last = nodes.len() - 1;
    for (i, (n, syms)) in nodes.iter().enumerate() {
        writeln!(map, "{n} {{\n  global:").unwrap();
        for s in syms {
            writeln!(map, "    {s};").unwrap();
        }
        if i == last {
            writeln!(map, "  local: *;").unwrap();
        }
        match prev {
            Some(p) => writeln!(map, "}} {p};").unwrap(),
            None => writeln!(map, "}};").unwrap(),
        }
        prev = Some(n);
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
    std::fs::write(out.join("libibverbs.map"), map).unwrap();
    std::fs::write(
        out.join("symver.rs"),
        format!("std::arch::global_asm!(\n{asm});\n\n{stubs}"),
    )
    .unwrap();
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        out.join("libibverbs.map").display()
    );
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibverbs.so.1");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
