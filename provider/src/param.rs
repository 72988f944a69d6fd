//! The parameter registry: every tunable is declared once — component, name, type, default and a
//! one-line doc — and read from `WEFT_<COMPONENT>_<NAME>` (`WEFT_<NAME>` for the core).
//! `weft info -e` lists them all with their current values.
//!
//! ```ignore
//! weft::param!(CHUNK: Size[64, 1 << 30] = "shm", "CHUNK_SIZE", "32K", "bytes per large-message ring chunk");
//! let chunk: usize = CHUNK.get_size()?;
//! ```
//!
//! A declaration carries everything a value is checked against — its type, a range for the
//! numeric ones (`Uint[lo, hi]`, `Size[..]`, `Float[..]`, `Seconds[..]`: durations, at most
//! [`MAX_SECONDS`]) and, where text must follow a grammar, a `check(fn)` — so one parser
//! ([`ParamDesc::parse`]) decides for every reader: a provider's `from_env`, `weft info -e`
//! and the check of the whole environment at start ([`check_set`]) never disagree, and no
//! value a user can write panics anything downstream.

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
    /// A duration in seconds (a number; at most [`MAX_SECONDS`]).
    Seconds,
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
            ParamType::Seconds => "a number of seconds".into(),
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
            ParamType::Seconds => "seconds",
            ParamType::Str => "string",
            ParamType::Enum(_) => "enum",
        }
    }
}

/// The longest duration a parameter may give (about 31 years): `Instant + Duration` and
/// `Duration::from_secs_f64` hold it anywhere.
pub const MAX_SECONDS: f64 = 1e9;

/// A check of a text value beyond its type (a grammar): `Err` says what is expected.
pub type Check = fn(&str) -> std::result::Result<(), String>;

/// A declared parameter.
#[derive(Debug)]
pub struct ParamDesc {
    /// `""` for the core, else the provider or subsystem name (`shm`, `tcp-sim`, `pmi`).
    pub component: &'static str,
    pub name: &'static str,
    pub ty: ParamType,
    /// The values a numeric parameter may take, inclusive (for a size, in bytes).
    pub range: Option<(f64, f64)>,
    /// A further check of the text (`Str` and `Enum` ones, or an `auto` beside a number).
    pub check: Option<Check>,
    pub default: &'static str,
    pub doc: &'static str,
}

/// A value as [`ParamDesc::parse`] read it.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Bool(bool),
    Uint(u64),
    Size(usize),
    Float(f64),
    /// `None`: 0 (for the parameters where 0 means "off" or "no limit").
    Seconds(Option<std::time::Duration>),
    Str(String),
}

#[linkme::distributed_slice]
pub static PARAMS: [ParamDesc];

/// Every declared parameter, sorted by environment-variable name.
pub fn all() -> Vec<&'static ParamDesc> {
    let mut v: Vec<_> = PARAMS.iter().collect();
    v.sort_by_key(|p| p.env_name());
    v
}

/// Check every parameter the environment sets, with the very parser its readers use: all the
/// bad values, each with its reason. Called once at start, before any provider is chosen, so
/// that a bad value is an error whichever provider ends up selected (not a silent fall-back to
/// another one), and by `weft info -e`.
pub fn check_set() -> Vec<Error> {
    all()
        .into_iter()
        .filter(|p| p.is_set())
        .filter_map(|p| p.validate().err())
        .collect()
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
        let mut expected = self.ty.describe();
        if let Some((lo, hi)) = self.range {
            let f = |v: f64| match self.ty {
                ParamType::Size => fmt_size(v),
                _ => format!("{v}"),
            };
            expected = format!("{expected} from {} to {}", f(lo), f(hi));
        }
        self.bad_because(value, expected)
    }

    fn bad_because(&self, value: &str, expected: String) -> Error {
        Error::from(ErrorDetail::Param {
            var: self.env_name(),
            value: value.to_string(),
            expected,
        })
    }

    fn in_range(&self, v: f64) -> bool {
        self.range.is_none_or(|(lo, hi)| v >= lo && v <= hi)
    }

    /// Read `v` as this parameter's value: its type, its range and its check. The one parser
    /// every reader of the parameter goes through; never panics, whatever the text.
    pub fn parse(&self, v: &str) -> Result<Value> {
        let t = v.trim();
        let value = match self.ty {
            ParamType::Bool => Value::Bool(parse_bool(t).ok_or_else(|| self.bad(v))?),
            ParamType::Uint => {
                let n: u64 = t.parse().map_err(|_| self.bad(v))?;
                if !self.in_range(n as f64) {
                    return Err(self.bad(v));
                }
                Value::Uint(n)
            }
            ParamType::Size => {
                let n = parse_size(t).ok_or_else(|| self.bad(v))?;
                if !self.in_range(n as f64) {
                    return Err(self.bad(v));
                }
                Value::Size(n)
            }
            ParamType::Float => {
                let f: f64 = t.parse().map_err(|_| self.bad(v))?;
                if !f.is_finite() || !self.in_range(f) {
                    return Err(self.bad(v));
                }
                Value::Float(f)
            }
            ParamType::Seconds => {
                let f: f64 = t.parse().map_err(|_| self.bad(v))?;
                let (lo, hi) = self.range.unwrap_or((0.0, MAX_SECONDS));
                if !(f.is_finite() && f >= lo.max(0.0) && f <= hi.min(MAX_SECONDS)) {
                    return Err(self.bad_because(
                        v,
                        format!(
                            "a number of seconds from {} to {}{}",
                            lo.max(0.0),
                            hi.min(MAX_SECONDS),
                            if lo <= 0.0 { " (0: off)" } else { "" }
                        ),
                    ));
                }
                Value::Seconds(if f == 0.0 {
                    None
                } else {
                    Some(std::time::Duration::try_from_secs_f64(f).map_err(|_| self.bad(v))?)
                })
            }
            ParamType::Str => Value::Str(v.to_string()),
            ParamType::Enum(opts) => {
                if !opts.contains(&t) {
                    return Err(self.bad(v));
                }
                Value::Str(t.to_string())
            }
        };
        if let Some(check) = self.check {
            check(t).map_err(|why| self.bad_because(v, why))?;
        }
        Ok(value)
    }

    /// Check that the current value parses.
    pub fn validate(&self) -> Result<()> {
        self.parse(&self.raw()).map(|_| ())
    }

    fn value(&self) -> Result<Value> {
        self.parse(&self.raw())
    }

    fn wrong_type(&self) -> Error {
        Error::invalid(format!(
            "{} is a {} parameter, read as another type",
            self.env_name(),
            self.ty.short()
        ))
    }

    pub fn get_bool(&self) -> Result<bool> {
        match self.value()? {
            Value::Bool(b) => Ok(b),
            _ => Err(self.wrong_type()),
        }
    }

    /// A `Uint`; of a `Str` parameter (`auto` or a number), the number its (checked) text is.
    pub fn get_u64(&self) -> Result<u64> {
        match self.value()? {
            Value::Uint(n) => Ok(n),
            Value::Str(t) => t.trim().parse().map_err(|_| self.bad(&t)),
            _ => Err(self.wrong_type()),
        }
    }

    /// A `Size`; of a `Str` parameter, the size its (checked) text is.
    pub fn get_size(&self) -> Result<usize> {
        match self.value()? {
            Value::Size(n) => Ok(n),
            Value::Str(t) => parse_size(&t).ok_or_else(|| self.bad(&t)),
            _ => Err(self.wrong_type()),
        }
    }

    /// A `Float`; of a `Str` parameter, the finite number its (checked) text is.
    pub fn get_f64(&self) -> Result<f64> {
        match self.value()? {
            Value::Float(f) => Ok(f),
            Value::Str(t) => t
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|f| f.is_finite())
                .ok_or_else(|| self.bad(&t)),
            _ => Err(self.wrong_type()),
        }
    }

    /// A duration (`Seconds` parameter): `None` for 0, which the parameter's doc gives a
    /// meaning ("off", "no limit"); refused when `zero_is_none` is false.
    pub fn get_seconds(&self, zero_is_none: bool) -> Result<Option<std::time::Duration>> {
        match self.value()? {
            Value::Seconds(None) if !zero_is_none => {
                Err(self.bad_because(&self.raw(), "a positive number of seconds".into()))
            }
            Value::Seconds(d) => Ok(d),
            _ => Err(self.wrong_type()),
        }
    }

    /// A duration that is never 0 (`Seconds` parameter with a positive lower bound).
    pub fn get_duration(&self) -> Result<std::time::Duration> {
        self.get_seconds(false)?
            .ok_or_else(|| self.bad_because(&self.raw(), "a positive number of seconds".into()))
    }

    /// The current text (checked, for a parameter with a check).
    pub fn get_str(&self) -> String {
        self.raw()
    }

    /// An enum parameter's value (validated against its options).
    pub fn get_enum(&self) -> Result<&'static str> {
        let v = self.raw();
        match self.ty {
            ParamType::Enum(opts) => {
                self.parse(&v)?;
                opts.iter()
                    .find(|o| **o == v.trim())
                    .copied()
                    .ok_or_else(|| self.bad(&v))
            }
            _ => Err(self.bad(&v)),
        }
    }
}

impl ParamDesc {
    /// An error naming this parameter and its current value, with `why` (a constraint the
    /// declaration cannot state: one between two parameters).
    pub fn refuse(&self, why: impl Into<String>) -> Error {
        self.bad_because(&self.raw(), why.into())
    }
}

/// Checks for `param!(..check(..))`.
pub mod checks {
    /// A size that is a multiple of 8 bytes.
    pub fn multiple_of_8(v: &str) -> std::result::Result<(), String> {
        match super::parse_size(v) {
            Some(n) if n % 8 == 0 => Ok(()),
            _ => Err("a multiple of 8 bytes".into()),
        }
    }

    /// A whole number that is a power of two.
    pub fn power_of_two(v: &str) -> std::result::Result<(), String> {
        match v.trim().parse::<u64>() {
            Ok(n) if n.is_power_of_two() => Ok(()),
            _ => Err("a power of two".into()),
        }
    }

    /// A rate that is 0 ("unlimited") or at least 0.001 (a smaller one makes a byte take
    /// longer than a `Duration` holds).
    pub fn zero_or_a_rate(v: &str) -> std::result::Result<(), String> {
        match v.trim().parse::<f64>() {
            Ok(f) if f == 0.0 || f >= 1e-3 => Ok(()),
            _ => Err("0 (unlimited) or a rate of at least 0.001".into()),
        }
    }

    /// `auto`, or a number a check of its own takes (`Str` parameters that default to
    /// `auto`).
    pub fn auto_or(
        v: &str,
        num: impl Fn(&str) -> bool,
        what: &str,
    ) -> std::result::Result<(), String> {
        if v.trim().eq_ignore_ascii_case("auto") || num(v.trim()) {
            Ok(())
        } else {
            Err(format!("auto or {what}"))
        }
    }
}

/// A size as the docs write it (`64K`, `1M`), for messages.
fn fmt_size(v: f64) -> String {
    let n = v as u64;
    for (m, u) in [(1u64 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")] {
        if n >= m && n % m == 0 {
            return format!("{}{u}", n / m);
        }
    }
    format!("{n}")
}

/// Declare a parameter and register it: `param!(NAME: Type = "component", "ENV_NAME", "default",
/// "doc")`. `Type` is one of `Bool`, `Uint`, `Size`, `Float`, `Str`, or `Enum(&[..])`.
#[macro_export]
macro_rules! param {
    ($(#[$m:meta])* $vis:vis $id:ident : $ty:ident $(($opts:expr))? $([$lo:expr, $hi:expr])? $(check($chk:expr))? = $comp:expr, $name:expr, $default:expr, $doc:expr) => {
        $(#[$m])*
        #[$crate::__linkme::distributed_slice($crate::param::PARAMS)]
        #[linkme(crate = $crate::__linkme)]
        $vis static $id: $crate::param::ParamDesc = $crate::param::ParamDesc {
            component: $comp,
            name: $name,
            ty: $crate::param::ParamType::$ty $(($opts))?,
            range: $crate::__param_range!($($lo, $hi)?),
            check: $crate::__param_check!($($chk)?),
            default: $default,
            doc: $doc,
        };
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __param_range {
    () => {
        None
    };
    ($lo:expr, $hi:expr) => {
        Some(($lo as f64, $hi as f64))
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __param_check {
    () => {
        None
    };
    ($chk:expr) => {
        Some($chk)
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
            range: None,
            check: None,
            default: "0",
            doc: "",
        };
        assert_eq!(p.env_name(), "WEFT_TCP_SIM_DELAY_US");
        let c = ParamDesc {
            component: "",
            name: "RMA_SCHED",
            ty: ParamType::Enum(&["off", "full"]),
            range: None,
            check: None,
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

    #[test]
    fn ranges_and_seconds_are_checked_and_quoted() {
        let d = |ty, range| ParamDesc {
            component: "x",
            name: "Y",
            ty,
            range,
            check: None,
            default: "0",
            doc: "",
        };
        let mtu = d(ParamType::Uint, Some((256.0, 4096.0)));
        assert_eq!(mtu.parse("2048").unwrap(), Value::Uint(2048));
        let e = mtu.parse("0").unwrap_err().to_string();
        assert!(e.contains("'0'") && e.contains("from 256 to 4096"), "{e}");
        let t = d(ParamType::Seconds, None);
        assert_eq!(t.parse("0").unwrap(), Value::Seconds(None));
        for bad in [
            "1e30",
            "1e11",
            "1e300",
            "-1",
            "nan",
            "inf",
            "18446744073709551616e0",
        ] {
            assert!(t.parse(bad).is_err(), "{bad}");
        }
        assert!(t.parse("1e9").is_ok());
        let bw = d(ParamType::Float, Some((0.0, 1e9)));
        assert!(bw.parse("1e-300").is_ok(), "in range, however small");
        assert!(bw.parse("1e300").is_err() && bw.parse("NaN").is_err());
        let s = d(ParamType::Size, Some((1024.0, (1 << 20) as f64)));
        let e = s.parse("2M").unwrap_err().to_string();
        assert!(e.contains("from 1K to 1M"), "{e}");
    }

    fn value_text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        prop_oneof![
            ".{0,24}",
            any::<f64>().prop_map(|f| f.to_string()),
            any::<u64>().prop_map(|n| n.to_string()),
            any::<i64>().prop_map(|n| format!("{n}e{}", n % 400)),
            Just("18446744073709551616".to_string()),
            Just("1e-300".to_string()),
            Just("auto".to_string()),
        ]
    }

    proptest::proptest! {
        #[test]
        fn size_parser_never_panics(s in ".{0,24}") {
            let _ = parse_size(&s);
        }

        /// Every parameter this crate declares, through its one parser: a value or an error,
        /// never a panic; a value that is accepted lies in the declared range.
        #[test]
        fn every_declared_parameter_parses_or_refuses(v in value_text()) {
            for p in all() {
                if let Ok(x) = p.parse(&v) {
                    if let (Some((lo, hi)), Value::Uint(n)) = (p.range, &x) {
                        proptest::prop_assert!((*n as f64) >= lo && (*n as f64) <= hi);
                    }
                    if let Value::Seconds(Some(d)) = x {
                        proptest::prop_assert!(d.as_secs_f64() <= MAX_SECONDS);
                    }
                }
            }
        }
    }
}
