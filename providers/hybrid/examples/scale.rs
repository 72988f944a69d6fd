//! Memory per process against job size without the processes (see `weft_hybrid::scale`):
//! `scale [SIZES] [PROVIDERS]`, e.g. `scale 2,1024,16384 verbs-ud,hybrid`. Prints one line per
//! (provider, size): `provider size hca buffers tables total` in bytes, then one line per
//! (provider, size) of what an idle progress call costs once every rank has been contacted:
//! `provider size idle_progress_ns`; before those, per (provider, size), the memory of a process
//! that talks to 16 peers only, `provider size peers_talked_to total`, and for verbs-ud and the
//! hybrid the links the first keepalive round probes: `provider size keepalive_probes`.

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let sizes = args.get(1).map_or("2,256,1024,4096,16384", |s| s.as_str());
    let provs = args
        .get(2)
        .map_or("verbs-ud,hybrid,verbs-rc", |s| s.as_str());
    println!("provider size hca buffers tables total");
    for p in provs.split(',') {
        for s in sizes.split(',') {
            let Ok(n) = s.parse::<u32>() else {
                eprintln!("scale: {s} is not a job size");
                std::process::exit(2);
            };
            match weft_hybrid::scale::measure(p, n) {
                Ok(f) => println!("{p} {n} {} {} {} {}", f.hca, f.buffers, f.tables, f.total()),
                Err(e) => {
                    eprintln!("scale: {p} at {n} ranks: {e}");
                    std::process::exit(1);
                }
            }
        }
    }
    // A process that talks to 16 peers of the job (a stencil's neighbourhood).
    println!("provider size peers_talked_to total");
    for p in provs.split(',') {
        for n in sizes.split(',').filter_map(|s| s.parse::<u32>().ok()) {
            match weft_hybrid::scale::measure_talking_to(p, n, 16) {
                Ok(f) => println!("{p} {n} {} {}", f.touched, f.total()),
                Err(e) => {
                    eprintln!("scale: {p} at {n} ranks: {e}");
                    std::process::exit(1);
                }
            }
        }
    }
    // Keepalive probes (on by default): the links the first round probes.
    println!("provider size keepalive_probes");
    for p in provs.split(',').filter(|p| *p != "verbs-rc") {
        for n in sizes.split(',').filter_map(|s| s.parse::<u32>().ok()) {
            match weft_hybrid::scale::keepalive_probes(p, n) {
                Ok(probes) => println!("{p} {n} {probes}"),
                Err(e) => {
                    eprintln!("scale: {p} at {n} ranks: {e}");
                    std::process::exit(1);
                }
            }
        }
    }
    // The phantoms never answer a keepalive probe, whose link would stay busy: no probes.
    // (Set before any thread reads the environment: this one is the only thread.)
    std::env::set_var("WEFT_VERBS_UD_KEEPALIVE", "0");
    println!("provider size idle_progress_ns");
    for p in provs.split(',') {
        for n in sizes.split(',').filter_map(|s| s.parse::<u32>().ok()) {
            match weft_hybrid::scale::idle_progress_ns(p, n, 20_000) {
                Ok(ns) => println!("{p} {n} {ns:.1}"),
                Err(e) => {
                    eprintln!("scale: {p} at {n} ranks: {e}");
                    std::process::exit(1);
                }
            }
        }
    }
}
