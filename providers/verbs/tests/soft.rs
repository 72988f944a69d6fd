//! The soft HCA's semantic suite (`suite/`) with both contexts on this host: requests go
//! through the peer's shared segment, Cross-Memory Attach and device-memory mappings.

use weft_verbs::soft::model::Config;
use weft_verbs::soft::SoftHca;

fn open(_host: usize, cfg: Config) -> SoftHca {
    SoftHca::with_config(cfg).expect("open a soft HCA")
}

/// Whether both contexts of the suite are on one host (no wire between them).
const ONE_HOST: bool = true;

mod suite;
