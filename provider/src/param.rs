//! The parameter registry: every tunable is declared once — component, name, type, default and a
//! one-line doc — and read from `WEFT_<COMPONENT>_<NAME>` (`WEFT_<NAME>` for the core).
//! `weft info -e` lists them all with their current values.
//!
//! ```ignore
//! weft::param!(CHUNK: Size = "shm", "CHUNK_SIZE", "32K", "bytes per large-message ring chunk");
//! let chunk: usize = CHUNK.get()?;
//! ```

use crate::{Error, ErrorDetail, Result};

/// The type of a parameter's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamType {
    Bool,
    /// Unsigned integer.
    Uint,
    /// Byte size with optional K/M/G suffix (powers of 1024).
    Size,
    /// Floating point.
    Float,
    /// Free text.
    Str,
    /// One of a fixed set of words.
    Enum(&'static [&'static str]),
}

impl ParamType {
    pub fn describe(&self) -> String {
        match self {
            ParamType::Bool => "a boolean (1/0, true/false, yes/no, on/off)".into(),
            ParamType::Uint => "a non-negative integer".into(),
            ParamType::Size => "a size in bytes (e.g. 4096, 64K, 1M)".into(),
            ParamType::Float => "a number".into(),
            ParamType::Str => "text".into(),
            ParamType::Enum(opts) => format!("one of {}", opts.join("|")),
        }
    }

    pub fn short(&self) -> &'static str {
        match self {
            ParamType::Bool => "bool",
            ParamType::Uint => "uint",
            ParamType::Size => "size",
            ParamType::Float => "float",
            ParamType::Str => "string",
            ParamType::Enum(_) => "enum",
        }
    }
}

/// A declared parameter.
#[derive(Debug)]
pub struct ParamDesc {
    /// `""` for the core, else the provider or subsystem name (`shm`, `tcp-sim`, `pmi`).
    pub component: &'static str,
    pub name: &'static str,
    pub ty: ParamType,
    pub default: &'static str,
    pub doc: &'static str,
}

#[linkme::distributed_slice]
pub static PARAMS: [ParamDesc];

/// Every declared parameter, sorted by environment-variable name.
pub fn all() -> Vec<&'static ParamDesc> {
    let mut v: Vec<_> = PARAMS.iter().collect();
    v.sort_by_key(|p| p.env_name());
    v
}

/// `WEFT_*` variables of the environment that no parameter is read from — most likely typing
/// mistakes (`WEFT_TIMOUT`) that would otherwise be ignored without a word — each with the
/// nearest known name, when one is close. `WEFT_TEST_*` is left to test harnesses.
pub fn unknown_vars() -> Vec<(String, Option<String>)> {
    let known: Vec<String> = all().iter().map(|p| p.env_name()).collect();
    let mut out: Vec<(String, Option<String>)> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter(|k| k.starts_with("WEFT_") && !k.starts_with("WEFT_TEST_"))
        .filter(|k| !known.contains(k))
        .map(|k| {
            let near = known
                .iter()
                .map(|c| (edit_distance(&k, c), c))
                .min()
                .filter(|(d, c)| *d <= 3.max(c.len() / 6))
                .map(|(_, c)| c.clone());
            (k, near)
        })
        .collect();
    out.sort();
    out
}

/// Warn about [`unknown_vars`] (call once per job: rank 0).
pub fn warn_unknown_vars() {
    for (k, near) in unknown_vars() {
        match near {
            Some(n) => tracing::warn!("{k} is not a weft parameter (did you mean {n}?); ignored"),
            None => {
                tracing::warn!("{k} is not a weft parameter; ignored (weft info -e lists them)")
            }
        }
    }
}

/// Levenshtein distance (insertions, deletions, substitutions).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Parse a boolean the way users write them.
pub fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" | "y" => Some(true),
        "0" | "false" | "no" | "off" | "n" | "" => Some(false),
        _ => None,
    }
}

/// Parse a size such as `4096`, `64K`, `1M`, `2g`, `512KiB`.
pub fn parse_size(s: &str) -> Option<usize> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let body = lower
        .strip_suffix("ib")
        .or_else(|| lower.strip_suffix('b'))
        .unwrap_or(&lower);
    let (num, mul) = match body.chars().last()? {
        'k' => (&body[..body.len() - 1], 1usize << 10),
        'm' => (&body[..body.len() - 1], 1 << 20),
        'g' => (&body[..body.len() - 1], 1 << 30),
        _ => (body, 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mul)
}

impl ParamDesc {
    /// The environment variable that sets it.
    pub fn env_name(&self) -> String {
        let mut s = String::from("WEFT_");
        if !self.component.is_empty() {
            s.push_str(&self.component.to_ascii_uppercase().replace('-', "_"));
            s.push('_');
        }
        s.push_str(self.name);
        s
    }

    /// The raw current value: the environment's, else the default.
    pub fn raw(&self) -> String {
        std::env::var(self.env_name()).unwrap_or_else(|_| self.default.to_string())
    }

    /// Whether the environment sets it.
    pub fn is_set(&self) -> bool {
        std::env::var_os(self.env_name()).is_some()
    }

    fn bad(&self, value: &str) -> Error {
        Error::from(ErrorDetail::Param {
            var: self.env_name(),
            value: value.to_string(),
            expected: self.ty.describe(),
        })
    }

    /// Check that the current value parses.
    pub fn validate(&self) -> Result<()> {
        let v = self.raw();
        let ok = match self.ty {
            ParamType::Bool => parse_bool(&v).is_some(),
            ParamType::Uint => v.trim().parse::<u64>().is_ok(),
            ParamType::Size => parse_size(&v).is_some(),
            ParamType::Float => v.trim().parse::<f64>().is_ok(),
            ParamType::Str => true,
            ParamType::Enum(opts) => opts.contains(&v.trim()),
        };
        if ok {
            Ok(())
        } else {
            Err(self.bad(&v))
        }
    }

    pub fn get_bool(&self) -> Result<bool> {
        let v = self.raw();
        parse_bool(&v).ok_or_else(|| self.bad(&v))
    }

    pub fn get_u64(&self) -> Result<u64> {
        let v = self.raw();
        v.trim().parse().map_err(|_| self.bad(&v))
    }

    pub fn get_size(&self) -> Result<usize> {
        let v = self.raw();
        parse_size(&v).ok_or_else(|| self.bad(&v))
    }

    pub fn get_f64(&self) -> Result<f64> {
        let v = self.raw();
        v.trim().parse().map_err(|_| self.bad(&v))
    }

    /// A number of seconds as a duration: `None` for 0 when `zero_is_none`; anything that is
    /// not a finite, non-negative number a `Duration` can hold is an error (it used to panic).
    pub fn get_seconds(&self, zero_is_none: bool) -> Result<Option<std::time::Duration>> {
        let v = self.raw();
        let t = self.get_f64()?;
        let expected = if zero_is_none {
            "a non-negative number of seconds (0: no limit), at most 10^9"
        } else {
            "a positive number of seconds, at most 10^9"
        };
        let bad = || {
            Error::from(ErrorDetail::Param {
                var: self.env_name(),
                value: v.clone(),
                expected: expected.into(),
            })
        };
        if zero_is_none && t == 0.0 {
            return Ok(None);
        }
        if !(t > 0.0 && t <= 1e9) {
            return Err(bad());
        }
        std::time::Duration::try_from_secs_f64(t)
            .map(Some)
            .map_err(|_| bad())
    }

    pub fn get_str(&self) -> String {
        self.raw()
    }

    /// An enum parameter's value (validated against its options).
    pub fn get_enum(&self) -> Result<&'static str> {
        let v = self.raw();
        match self.ty {
            ParamType::Enum(opts) => opts
                .iter()
                .find(|o| **o == v.trim())
                .copied()
                .ok_or_else(|| self.bad(&v)),
            _ => Err(self.bad(&v)),
        }
    }
}

/// Declare a parameter and register it: `param!(NAME: Type = "component", "ENV_NAME", "default",
/// "doc")`. `Type` is one of `Bool`, `Uint`, `Size`, `Float`, `Str`, or `Enum(&[..])`.
#[macro_export]
macro_rules! param {
    ($(#[$m:meta])* $vis:vis $id:ident : $ty:ident $(($opts:expr))? = $comp:expr, $name:expr, $default:expr, $doc:expr) => {
        $(#[$m])*
        #[$crate::__linkme::distributed_slice($crate::param::PARAMS)]
        #[linkme(crate = $crate::__linkme)]
        $vis static $id: $crate::param::ParamDesc = $crate::param::ParamDesc {
            component: $comp,
            name: $name,
            ty: $crate::param::ParamType::$ty $(($opts))?,
            default: $default,
            doc: $doc,
        };
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_bools() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("64K"), Some(65536));
        assert_eq!(parse_size("1m"), Some(1 << 20));
        assert_eq!(parse_size("2GiB"), Some(2 << 30));
        assert_eq!(parse_size("12kb"), Some(12 << 10));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("-1"), None);
        assert_eq!(parse_bool("Yes"), Some(true));
        assert_eq!(parse_bool("off"), Some(false));
        assert_eq!(parse_bool("maybe"), None);
    }

    #[test]
    fn env_names() {
        let p = ParamDesc {
            component: "tcp-sim",
            name: "DELAY_US",
            ty: ParamType::Uint,
            default: "0",
            doc: "",
        };
        assert_eq!(p.env_name(), "WEFT_TCP_SIM_DELAY_US");
        let c = ParamDesc {
            component: "",
            name: "RMA_SCHED",
            ty: ParamType::Enum(&["off", "full"]),
            default: "off",
            doc: "",
        };
        assert_eq!(c.env_name(), "WEFT_RMA_SCHED");
        assert_eq!(c.get_enum().unwrap(), "off");
    }

    #[test]
    fn misspelled_variables_get_the_nearest_name() {
        assert_eq!(edit_distance("WEFT_TIMOUT", "WEFT_TIMEOUT"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        // Set in this test process only for the check; names no other test uses.
        std::env::set_var("WEFT_HOST_IDD", "a");
        std::env::set_var("WEFT_TEST_WHATEVER", "1");
        std::env::set_var("WEFT_ZZZZZZZZZZZZZZZZZZZZ", "1");
        let u = unknown_vars();
        std::env::remove_var("WEFT_HOST_IDD");
        std::env::remove_var("WEFT_TEST_WHATEVER");
        std::env::remove_var("WEFT_ZZZZZZZZZZZZZZZZZZZZ");
        assert!(
            u.contains(&("WEFT_HOST_IDD".into(), Some("WEFT_HOST_ID".into()))),
            "{u:?}"
        );
        assert!(
            u.contains(&("WEFT_ZZZZZZZZZZZZZZZZZZZZ".into(), None)),
            "{u:?}"
        );
        assert!(!u.iter().any(|(k, _)| k.starts_with("WEFT_TEST_")));
    }

    proptest::proptest! {
        #[test]
        fn size_parser_never_panics(s in ".{0,24}") {
            let _ = parse_size(&s);
        }
    }
}
