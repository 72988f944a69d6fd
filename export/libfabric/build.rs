//! libfabric `dlclose`s its providers at exit while weft's threads and thread-locals may still
//! refer to the library's code: keep it mapped (`-z nodelete`).
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
