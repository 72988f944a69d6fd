//! Bootstrap: the contract's [`Bootstrap`] and its implementations (from `weft-provider`), plus
//! the PMI-1 client ([`pmi`]) that finds the job under a launcher, and the choice between them
//! ([`Choice`]): PMI-1 under a launcher that speaks it, a singleton when no launcher started
//! the process, and a refusal under a launcher weft cannot talk to.

pub use weft_provider::bootstrap::*;

pub mod pmi;
pub mod pmix;

crate::param!(PMI: Enum(&["auto", "pmi1", "pmix", "singleton"]) = "", "PMI", "auto",
    "bootstrap: auto (PMI-1 under a launcher that speaks it — weft run, MPICH's mpiexec (Hydra); PMIx under a PMIx server — Open MPI's mpirun, srun --mpi=pmix; refused under a launcher weft cannot join, such as srun without PMI; else a singleton), pmi1 or pmix (that one or fail), singleton (this process alone, whatever launched it)");

/// Launchers weft cannot join (when they offer neither PMI-1 nor PMIx), by a variable each
/// sets in every process it starts, and the variable holding the job's size (`None`: the
/// environment does not say).
const FOREIGN: &[(&str, &str, Option<&str>)] = &[
    (
        "Open MPI's mpirun",
        "OMPI_COMM_WORLD_SIZE",
        Some("OMPI_COMM_WORLD_SIZE"),
    ),
    (
        "Slurm's srun",
        "SLURM_STEP_NUM_TASKS",
        Some("SLURM_STEP_NUM_TASKS"),
    ),
    (
        "MVAPICH's mpirun_rsh",
        "MV2_COMM_WORLD_SIZE",
        Some("MV2_COMM_WORLD_SIZE"),
    ),
    ("a PMIx server", "PMIX_NAMESPACE", None),
    (
        "a launcher without a PMI-1 wire",
        "PMI_SIZE",
        Some("PMI_SIZE"),
    ),
];

/// How this process finds its job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// PMI-1 through the server the environment names (`PMI_FD`, `PMI_PORT`).
    Pmi1,
    /// PMIx through the server that started us (`PMIX_NAMESPACE`, `PMIX_RANK`).
    Pmix,
    /// A job of one process; the reason, for `weft info`.
    Singleton(&'static str),
    /// Started by a launcher weft cannot join: running alone would make each process an
    /// unrelated job of one (which then reports success); the message says what to do.
    Refused(String),
}

impl Choice {
    /// The choice `WEFT_PMI` and the environment make.
    pub fn from_env() -> crate::Result<Choice> {
        Ok(Self::decide(PMI.get_enum()?, |k| std::env::var(k).ok()))
    }

    /// The choice for `mode` (a `WEFT_PMI` value) in an environment read through `var`.
    pub fn decide(mode: &str, var: impl Fn(&str) -> Option<String>) -> Choice {
        let pmi1 = var("PMI_FD").is_some() || var("PMI_PORT").is_some();
        let pmix = pmix::Pmix::in_env(&var);
        match mode {
            "singleton" => return Choice::Singleton("WEFT_PMI=singleton"),
            "pmi1" if !pmi1 => {
                return Choice::Refused(
                    "WEFT_PMI=pmi1, but no PMI-1 server in the environment (PMI_FD or PMI_PORT); \
                     start the program with `weft run -n N` or MPICH's mpiexec"
                        .into(),
                )
            }
            "pmix" if !pmix => {
                return Choice::Refused(
                    "WEFT_PMI=pmix, but no PMIx server in the environment (PMIX_NAMESPACE and \
                     PMIX_RANK); start the program with Open MPI's mpirun or srun --mpi=pmix"
                        .into(),
                )
            }
            "pmix" => return Choice::Pmix,
            _ if pmi1 => return Choice::Pmi1,
            _ if pmix => return Choice::Pmix,
            _ => {}
        }
        for &(who, mark, size) in FOREIGN {
            let Some(seen) = var(mark) else { continue };
            let n = size.map(|s| var(s).and_then(|v| v.trim().parse::<u64>().ok()));
            // A job of one is what a singleton is; an unknown size is not taken for one.
            if n == Some(Some(1)) {
                continue;
            }
            let job = match n {
                Some(Some(n)) => format!("a job of {n} processes"),
                _ => "a job".into(),
            };
            return Choice::Refused(format!(
                "this process was started by {who} ({mark}={seen}) as part of {job}, but that \
                 launcher offers neither PMI-1 nor PMIx here: on its own each process would run \
                 as a separate job of one rank. Start weft programs with `weft run -n N`, \
                 MPICH's `mpiexec` (Hydra), Open MPI's `mpirun` or `srun --mpi=pmix`, or set \
                 WEFT_PMI=singleton to run this process alone on purpose"
            ));
        }
        Choice::Singleton("no launcher in the environment")
    }

    /// One line for `weft info`.
    pub fn describe(&self) -> String {
        match self {
            Choice::Pmi1 => "PMI-1 (the launcher's server in PMI_FD / PMI_PORT)".into(),
            Choice::Pmix => format!(
                "PMIx (the server that started this process; library {})",
                pmix::PMIX_LIB.get_str()
            ),
            Choice::Singleton(why) => format!("singleton, a job of one process ({why})"),
            Choice::Refused(why) => format!("none: {why}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(kv: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| kv.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn pmi1_launchers_are_joined_and_no_launcher_is_a_singleton() {
        assert_eq!(
            Choice::decide("auto", env(&[("PMI_FD", "5")])),
            Choice::Pmi1
        );
        assert_eq!(
            Choice::decide("auto", env(&[("PMI_PORT", "h:1"), ("PMI_SIZE", "4")])),
            Choice::Pmi1
        );
        assert!(matches!(
            Choice::decide("auto", env(&[])),
            Choice::Singleton(_)
        ));
    }

    #[test]
    fn foreign_launchers_of_more_than_one_process_are_refused_with_the_way_out() {
        for kv in [
            &[("OMPI_COMM_WORLD_SIZE", "2")][..],
            &[("SLURM_STEP_NUM_TASKS", "4"), ("SLURM_PROCID", "0")][..],
            &[("MV2_COMM_WORLD_SIZE", "8")][..],
            &[("PMIX_NAMESPACE", "prterun-h-1@1")][..],
            &[("PMI_SIZE", "2"), ("PMI_RANK", "1")][..],
        ] {
            match Choice::decide("auto", env(kv)) {
                Choice::Refused(m) => {
                    assert!(m.contains(kv[0].0), "{m}");
                    assert!(
                        m.contains("weft run") && m.contains("WEFT_PMI=singleton"),
                        "{m}"
                    );
                }
                c => panic!("{kv:?}: {c:?}"),
            }
        }
        // One process: a singleton is that job.
        assert!(matches!(
            Choice::decide("auto", env(&[("OMPI_COMM_WORLD_SIZE", "1")])),
            Choice::Singleton(_)
        ));
        // Asked for on purpose.
        assert!(matches!(
            Choice::decide("singleton", env(&[("OMPI_COMM_WORLD_SIZE", "2")])),
            Choice::Singleton(_)
        ));
        assert!(matches!(
            Choice::decide("pmi1", env(&[])),
            Choice::Refused(_)
        ));
        assert!(matches!(
            Choice::decide("pmix", env(&[("PMI_FD", "5")])),
            Choice::Refused(_)
        ));
    }

    #[test]
    fn a_pmix_server_is_joined_unless_pmi1_is_there_too() {
        let ompi = [
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("PMIX_NAMESPACE", "prterun-h-1@1"),
            ("PMIX_RANK", "0"),
        ];
        assert_eq!(Choice::decide("auto", env(&ompi)), Choice::Pmix);
        assert_eq!(Choice::decide("pmix", env(&ompi)), Choice::Pmix);
        let both = [("PMIX_NAMESPACE", "x"), ("PMIX_RANK", "0"), ("PMI_FD", "4")];
        assert_eq!(Choice::decide("auto", env(&both)), Choice::Pmi1);
        assert_eq!(Choice::decide("pmix", env(&both)), Choice::Pmix);
    }
}
