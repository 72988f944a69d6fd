//! `weft info`: providers, capabilities, limits and native atomics; `-e`: every parameter.

use std::fmt::Write;
use weft::registry::{candidates_with, providers, Selection};
use weft::{BasicType, Op};

/// Render the provider listing. `Err` carries the message for an invalid `WEFT_PROVIDER`.
pub fn providers_report(verbose: bool) -> Result<String, String> {
    let (all, failures) = providers();
    let sel = Selection::from_env().map_err(|e| e.to_string())?;
    // Validate WEFT_PROVIDER and every parameter the way init() would.
    let chosen = candidates_with(&sel, &all, &failures, None).map_err(|e| e.to_string())?;
    weft::check_params().map_err(|e| e.to_string())?;
    let mut s = String::new();
    writeln!(
        s,
        "{:<10} {:<8} {:<4} {:<9} summary",
        "provider", "version", "prio", "origin"
    )
    .unwrap();
    for f in &all {
        writeln!(
            s,
            "{:<10} {:<8} {:<4} {:<9} {}",
            f.name(),
            f.version(),
            f.priority(),
            f.origin().to_string(),
            f.summary()
        )
        .unwrap();
    }
    for f in &all {
        writeln!(s).unwrap();
        writeln!(s, "[{}]", f.name()).unwrap();
        match f.caps() {
            Err(e) => writeln!(s, "  capabilities: unknown ({e})").unwrap(),
            Ok(c) => {
                writeln!(s, "  capabilities: {}", c.names().join(" ")).unwrap();
                writeln!(
                    s,
                    "  limits: am header {} B, am payload {} B, {}, iov {}{}",
                    c.max_am_header,
                    c.max_am_payload,
                    if c.tagged {
                        // The core's eager limit applies only to its own protocols.
                        "tagged messages matched by the provider (its own thresholds)".to_string()
                    } else {
                        format!("eager {} B", c.eager_limit)
                    },
                    c.max_iov,
                    c.rma
                        .map(|r| format!(", rma iov {}", r.max_iov))
                        .unwrap_or_default()
                )
                .unwrap();
                if let Some(r) = c.rma.filter(|r| r.rndv_only) {
                    writeln!(
                        s,
                        "  rma: none on windows (active messages); large messages are placed by the {} rendezvous",
                        match (r.read, r.write) {
                            (true, true) => "read or the write (per peer)",
                            (false, true) => "write",
                            _ => "read",
                        }
                    )
                    .unwrap();
                } else if let Some(r) = c.rma {
                    writeln!(
                        s,
                        "  rma: {}{}",
                        match (r.read, r.write) {
                            (true, true) => "native put and get",
                            (true, false) => "native get",
                            (false, true) => "native put",
                            _ => "none native",
                        },
                        if r.user_memory {
                            " on any window"
                        } else {
                            " on windows the provider allocates (win_allocate); windows over user memory use active messages"
                        }
                    )
                    .unwrap();
                }
                writeln!(
                    s,
                    "  reach: {}",
                    if c.spans_hosts {
                        "processes on any host"
                    } else if c.spans_processes {
                        "processes on one host"
                    } else {
                        "threads of one process"
                    }
                )
                .unwrap();
                if c.atomics.is_empty() {
                    writeln!(
                        s,
                        "  native atomics: none (all atomics use active messages)"
                    )
                    .unwrap();
                } else {
                    writeln!(
                        s,
                        "  native atomics (x = native, - = active-message path), used by a window{} only when every (op, type) its accumulate_ops hint allows is native; otherwise all its atomics use active messages:",
                        if c.rma.is_some_and(|r| !r.user_memory) {
                            " the provider allocates"
                        } else {
                            ""
                        }
                    )
                    .unwrap();
                    write!(s, "    {:<8}", "").unwrap();
                    for t in BasicType::ALL {
                        write!(s, "{:>4}", t.name()).unwrap();
                    }
                    writeln!(s).unwrap();
                    for op in Op::ALL {
                        write!(s, "    {:<8}", op.name()).unwrap();
                        for t in BasicType::ALL {
                            let mark = if !op.valid_for(t) {
                                " "
                            } else if c.atomics.query(op, t) {
                                "x"
                            } else {
                                "-"
                            };
                            write!(s, "{mark:>4}").unwrap();
                        }
                        writeln!(s).unwrap();
                    }
                    writeln!(s, "  {}", atomic_windows(&c)).unwrap();
                }
            }
        }
        if verbose {
            let params: Vec<_> = weft::param::all()
                .into_iter()
                .filter(|p| p.component == f.name())
                .collect();
            for p in params {
                writeln!(s, "  param {} = {}", p.env_name(), p.raw()).unwrap();
            }
        }
    }
    if !matches!(sel, Selection::Any) {
        writeln!(s).unwrap();
        writeln!(
            s,
            "WEFT_PROVIDER selects, in order: {}",
            chosen
                .iter()
                .map(|f| f.name())
                .collect::<Vec<_>>()
                .join(", ")
        )
        .unwrap();
    }
    for f in failures {
        writeln!(s, "not loaded: {}: {}", f.path.display(), f.error).unwrap();
    }
    let boot = weft::bootstrap::Choice::from_env().map_err(|e| e.to_string())?;
    writeln!(s).unwrap();
    writeln!(s, "bootstrap (WEFT_PMI): {}", boot.describe()).unwrap();
    writeln!(s, "libfabric (WEFT_OFI_LIB): {}", weft_ofi::library()).unwrap();
    s.push_str(&verbs_report());
    Ok(s)
}

/// The RDMA devices the verbs layer sees, with the attributes of those it can open.
pub fn verbs_report() -> String {
    let mut s = String::new();
    writeln!(s).unwrap();
    writeln!(
        s,
        "RDMA devices (WEFT_VERBS_DEVICE={}):",
        weft_verbs::soft::model::DEVICE.raw()
    )
    .unwrap();
    for d in weft_verbs::devices() {
        if !d.usable {
            writeln!(s, "  {} ({}): unusable: {}", d.name, d.backend, d.note).unwrap();
            continue;
        }
        match weft_verbs::open_device(&d.name) {
            Ok(h) => {
                let a = h.attr();
                writeln!(
                    s,
                    "  {} ({}): max_qp {} max_qp_wr {} max_sge {} max_cq {} max_cqe {} max_mr {} \
                     max_srq {} max_qp_rd_atom {} max_inline {} atomics {:?} mtu {} dm {} MiB",
                    d.name,
                    d.note,
                    a.max_qp,
                    a.max_qp_wr,
                    a.max_sge,
                    a.max_cq,
                    a.max_cqe,
                    a.max_mr,
                    a.max_srq,
                    a.max_qp_rd_atom,
                    a.max_inline_data,
                    a.atomic_cap,
                    a.active_mtu.bytes(),
                    a.max_dm_size >> 20
                )
                .unwrap();
            }
            Err(e) => writeln!(s, "  {}: cannot open: {e}", d.name).unwrap(),
        }
        if d.backend == "soft" {
            match weft_verbs::soft::model::Config::from_env() {
                Ok(c) => writeln!(
                    s,
                    "    soft: {} processes of this host may reach one HCA \
                     (WEFT_VERBS_SOFT_MAX_PEERS); a peer that holds one up is fenced out after {}",
                    c.max_peers,
                    c.fence
                        .map_or("never (WEFT_VERBS_SOFT_FENCE=0)".to_string(), |f| format!(
                            "{} s (WEFT_VERBS_SOFT_FENCE)",
                            f.as_secs_f64()
                        ))
                )
                .unwrap(),
                Err(e) => writeln!(s, "    soft: {e}").unwrap(),
            }
        }
    }
    if let Some(why) = weft_verbs::no_hardware_reason() {
        writeln!(s, "  real HCAs: {why}; `auto` opens the soft HCA").unwrap();
    }
    match weft_verbs_rc::footprint() {
        Ok(f) => writeln!(
            s,
            "  verbs-rc memory: {} B of HCA memory per connected peer (its RC QP) and {} KiB of \
             eager rings ({}); per process {} B of HCA memory (CQ, SRQ, connection manager) and \
             {} KiB of registered buffers",
            f.per_peer,
            f.eager_per_peer >> 10,
            f.eager,
            f.hca_shared,
            f.buffers >> 10
        )
        .unwrap(),
        Err(e) => writeln!(s, "  verbs-rc memory: {e}").unwrap(),
    }
    match weft_verbs_ud::footprint() {
        Ok(f) => writeln!(
            s,
            "  verbs-ud memory: {} B per rank of the job (address book and a slot), {} B more per \
             peer talked to (its record and link), no HCA memory per peer; per process {} B of \
             HCA memory (CQ, UD QP, zero-copy QPs) and {} KiB of registered buffers",
            f.per_rank,
            f.per_peer,
            f.hca,
            f.buffers >> 10
        )
        .unwrap(),
        Err(e) => writeln!(s, "  verbs-ud memory: {e}").unwrap(),
    }
    match weft_hybrid::chain_in_force(2) {
        Ok(c) => writeln!(s, "  hybrid send rules (WEFT_HYBRID_RULES): {c}").unwrap(),
        Err(e) => writeln!(s, "  hybrid send rules: {e}").unwrap(),
    }
    match weft_hybrid::limits_in_force() {
        Ok(l) => writeln!(
            s,
            "  hybrid limits (WEFT_HYBRID_MAX_RC, _MAX_FP, _RC_THRESHOLD): {l}"
        )
        .unwrap(),
        Err(e) => writeln!(s, "  hybrid limits: {e}").unwrap(),
    }
    s
}

/// Render every parameter with its current value, default, type and doc.
pub fn params_report() -> (String, bool) {
    let mut s = String::new();
    let mut ok = true;
    for p in weft::param::all() {
        let cur = p.raw();
        let bad = p.validate().err();
        ok &= bad.is_none();
        writeln!(
            s,
            "{} = {}{}",
            p.env_name(),
            if cur.is_empty() { "\"\"" } else { &cur },
            if p.is_set() { "  (set)" } else { "" }
        )
        .unwrap();
        let ty = match p.ty {
            weft::param::ParamType::Enum(o) => format!("one of {}", o.join("|")),
            t => t.short().to_string(),
        };
        writeln!(
            s,
            "    {}; type {ty}, default {}",
            p.doc,
            if p.default.is_empty() {
                "\"\""
            } else {
                p.default
            }
        )
        .unwrap();
        if let Some(e) = bad {
            writeln!(s, "    ERROR: {e}").unwrap();
        }
    }
    // Values of the right type can still be out of range or inconsistent: ask the code that
    // reads them (the core's settings, each provider's configuration).
    let mut errors = vec![];
    if let Err(e) = weft::check_params() {
        errors.push(e.to_string());
    }
    for f in providers().0 {
        if let Err(e) = f.caps() {
            if e.kind() == weft::ErrorKind::Param {
                errors.push(format!("{}: {e}", f.name()));
            }
        }
    }
    errors.dedup();
    for e in errors {
        ok = false;
        writeln!(s, "ERROR: {e}").unwrap();
    }
    (s, ok)
}

/// Which windows get native atomics under the rule above, in a sentence.
fn atomic_windows(c: &weft::provider::Caps) -> String {
    let valid: Vec<(Op, BasicType)> = Op::ALL
        .iter()
        .flat_map(|o| BasicType::ALL.iter().map(move |t| (*o, *t)))
        .filter(|(o, t)| o.valid_for(*t))
        .collect();
    let native: Vec<&(Op, BasicType)> = valid
        .iter()
        .filter(|(o, t)| c.atomics.query(*o, *t))
        .collect();
    let which = if c.rma.is_some_and(|r| !r.user_memory) {
        "window the provider allocates"
    } else {
        "window"
    };
    if native.len() == valid.len() {
        format!("windows: every {which} uses native atomics (no hint needed)")
    } else if native.len() <= 8 {
        let list: Vec<String> = native
            .iter()
            .map(|(o, t)| format!("{}:{}", o.name(), t.name()))
            .collect();
        format!(
            "windows: only a {which} whose accumulate_ops hint allows no more than {{{}}} uses native atomics; a window without a hint uses active messages",
            list.join(", ")
        )
    } else {
        format!(
            "windows: only a {which} whose accumulate_ops hint allows no more than the x entries uses native atomics; a window without a hint uses active messages"
        )
    }
}
