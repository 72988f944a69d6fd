//! Bootstrap: the contract's [`Bootstrap`] and its implementations (from `weft-provider`), plus
//! the PMI-1 client ([`pmi`]) that finds the job under a launcher.

pub use weft_provider::bootstrap::*;

pub mod pmi;
