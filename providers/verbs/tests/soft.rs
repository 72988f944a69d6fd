//! The soft HCA's semantic suite (`suite/`) with both contexts on this host: requests go
//! through the peer's shared segment, Cross-Memory Attach and device-memory mappings.

use weft_verbs::soft::model::Config;
use weft_verbs::soft::SoftHca;

fn open(_host: usize, cfg: Config) -> SoftHca {
    SoftHca::with_config(cfg).expect("open a soft HCA")
}

mod suite;
