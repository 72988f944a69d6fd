//! Compile the provider's libfabric code only where weft-ofi-sys found libfabric's headers.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_FABRIC_HAVE");
    if std::env::var_os("DEP_FABRIC_HAVE").is_some() {
        println!("cargo:rustc-cfg=weft_libfabric");
    }
}
