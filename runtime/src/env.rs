//! The one parser of tpuc's switch variables (docs/api.md, "Environment variables"): which host
//! paths the CPU plugin's compiles take (`TPUC_HOST_KERNELS`) and the debugging hooks
//! (`TPUC_DEBUG`). Python reads both through this module (`tpuc.env`), so the names, values and
//! error texts are defined here alone.

use std::collections::BTreeMap;

/// The variable that picks the host paths.
pub const HOST_KERNELS_VAR: &str = "TPUC_HOST_KERNELS";
/// The variable that holds the debugging hooks.
pub const DEBUG_VAR: &str = "TPUC_DEBUG";

/// Values that switch a flag on (compared ASCII case-insensitively, surrounding spaces ignored).
pub const ON: [&str; 4] = ["1", "on", "true", "yes"];
/// Values that switch a flag off.
pub const OFF: [&str; 4] = ["0", "off", "false", "no"];

/// `value` as a flag: `Some(true)` for one of [`ON`], `Some(false)` for one of [`OFF`], `None`
/// for anything else (the empty string included).
pub fn parse_flag(value: &str) -> Option<bool> {
    let v = value.trim();
    if ON.iter().any(|w| w.eq_ignore_ascii_case(v)) {
        Some(true)
    } else if OFF.iter().any(|w| w.eq_ignore_ascii_case(v)) {
        Some(false)
    } else {
        None
    }
}

/// A path of the CPU plugin that `TPUC_HOST_KERNELS` switches. Each only picks between correct
/// ways of computing the same thing; all are on by default where they apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostKernel {
    /// Large f32 matrix products in PyTorch's MKL (host_blas).
    Gemm,
    /// 2-D f32 convolutions in oneDNN (host_conv).
    Conv,
    /// Large f32 layer norms and attention in tpuc's row kernels (host_rows, host_attention).
    Rows,
    /// Long inference attention in PyTorch's own kernel, between compiled partitions.
    Torch,
    /// Saved activations handed from a forward graph to its backward channels-last.
    Handoff,
    /// 2-D forward convolutions computed channels-last (NHWC).
    ChannelsLast,
    /// glibc's malloc tuned for XLA's CPU temporaries.
    Malloc,
}

impl HostKernel {
    /// Every path, in the order docs/api.md lists them.
    pub const ALL: [HostKernel; 7] = [
        HostKernel::Gemm,
        HostKernel::Conv,
        HostKernel::Rows,
        HostKernel::Torch,
        HostKernel::Handoff,
        HostKernel::ChannelsLast,
        HostKernel::Malloc,
    ];

    /// The path's name in `TPUC_HOST_KERNELS`.
    pub fn name(self) -> &'static str {
        match self {
            HostKernel::Gemm => "gemm",
            HostKernel::Conv => "conv",
            HostKernel::Rows => "rows",
            HostKernel::Torch => "torch",
            HostKernel::Handoff => "handoff",
            HostKernel::ChannelsLast => "channels_last",
            HostKernel::Malloc => "malloc",
        }
    }

    pub fn from_name(name: &str) -> Option<HostKernel> {
        HostKernel::ALL.into_iter().find(|k| k.name() == name)
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

/// A set of host paths: the ones switched on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostKernels(u8);

impl HostKernels {
    /// Every path on (`auto`, the default: each where it applies).
    pub const AUTO: HostKernels = HostKernels(0x7f);
    /// Every path off.
    pub const OFF: HostKernels = HostKernels(0);

    pub fn contains(self, k: HostKernel) -> bool {
        self.0 & k.bit() != 0
    }

    /// Parses a value of `TPUC_HOST_KERNELS`: empty or `auto` (every path, where it applies),
    /// `off` (none), a comma list of paths to keep on (`gemm,conv`: only those), or a comma list
    /// of `-path`s to turn off (`-rows,-torch`: all but those). Names in any case, spaces
    /// ignored. An error names the accepted values.
    pub fn parse(value: &str) -> Result<HostKernels, String> {
        let text = value.trim().to_ascii_lowercase();
        if text.is_empty() || text == "auto" {
            return Ok(HostKernels::AUTO);
        }
        if text == "off" {
            return Ok(HostKernels::OFF);
        }
        let bad = |why: String| {
            format!(
                "{HOST_KERNELS_VAR}={value:?}: {why}; accepted: \"auto\" (the default), \"off\", \
                 a comma list of paths to keep on, or of \"-path\"s to turn off, paths being {}",
                host_kernel_names().join(", ")
            )
        };
        let items: Vec<&str> = text
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        let removing = items.iter().filter(|s| s.starts_with('-')).count();
        if removing != 0 && removing != items.len() {
            return Err(bad(
                "either paths to keep on or \"-path\"s to turn off, not both".into(),
            ));
        }
        let mut set = if removing == 0 {
            HostKernels::OFF
        } else {
            HostKernels::AUTO
        };
        for item in items {
            let name = item.trim_start_matches('-').trim();
            let k = HostKernel::from_name(name)
                .ok_or_else(|| bad(format!("unknown host path {name:?}")))?;
            if removing == 0 {
                set.0 |= k.bit();
            } else {
                set.0 &= !k.bit();
            }
        }
        Ok(set)
    }

    /// `TPUC_HOST_KERNELS` as set now (read at each call).
    pub fn from_env() -> Result<HostKernels, String> {
        HostKernels::parse(&std::env::var(HOST_KERNELS_VAR).unwrap_or_default())
    }
}

/// The names of the host paths, in [`HostKernel::ALL`]'s order.
pub fn host_kernel_names() -> Vec<&'static str> {
    HostKernel::ALL.iter().map(|k| k.name()).collect()
}

/// Whether `TPUC_HOST_KERNELS` leaves path `k` on. A malformed value logs a warning and counts
/// as `auto` (Python raises `ValueError` for it before any compile: `tpuc.env.check`).
pub fn host_kernel(k: HostKernel) -> bool {
    HostKernels::from_env()
        .unwrap_or_else(|e| {
            tracing::warn!("{e}; using \"auto\"");
            HostKernels::AUTO
        })
        .contains(k)
}

/// What a `TPUC_DEBUG` key takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DebugKind {
    /// `key` alone (on), or `key=` one of [`ON`] / [`OFF`].
    Flag,
    /// `key=N`, a non-negative integer.
    Count,
    /// `key=` one of the words.
    Choice(&'static [&'static str]),
}

/// A debugging hook of `TPUC_DEBUG`.
pub struct DebugKey {
    pub name: &'static str,
    pub kind: DebugKind,
    /// What it does (docs/api.md holds the same words).
    pub what: &'static str,
}

/// Every `TPUC_DEBUG` key.
pub const DEBUG_KEYS: [DebugKey; 7] = [
    DebugKey {
        name: "discrete_device",
        kind: DebugKind::Flag,
        what: "treat the CPU plugin as a device with memory of its own",
    },
    DebugKey {
        name: "no_host_views",
        kind: DebugKind::Flag,
        what: "wrap host inputs with BufferFromHostBuffer instead of views of their memory",
    },
    DebugKey {
        name: "module_format",
        kind: DebugKind::Choice(&["text", "bytecode"]),
        what: "how modules are handed to the plugin",
    },
    DebugKey {
        name: "skip_device_check",
        kind: DebugKind::Flag,
        what: "skip the check that a GPU/TPU plugin's hardware is present",
    },
    DebugKey {
        name: "profile_every",
        kind: DebugKind::Count,
        what: "with TPUC_LOG=debug, log per-phase call times every this many calls",
    },
    DebugKey {
        name: "serial",
        kind: DebugKind::Flag,
        what: "run every host-kernel job on the thread that calls it, with no helper threads (a race from a numeric difference)",
    },
    DebugKey {
        name: "cache_write_pause_ms",
        kind: DebugKind::Count,
        what: "a cache writer sleeps this long half-way through an entry (crash-safety tests)",
    },
];

/// A `TPUC_DEBUG` key's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DebugValue {
    Flag(bool),
    Count(u64),
    Choice(&'static str),
}

/// Parses a value of `TPUC_DEBUG`: comma-separated `key` or `key=value` items (a later item
/// wins over an earlier one of the same key). An unknown key or a bad value is an error naming
/// the known keys or values.
pub fn parse_debug(value: &str) -> Result<BTreeMap<&'static str, DebugValue>, String> {
    let mut out = BTreeMap::new();
    for item in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, arg) = match item.split_once('=') {
            Some((n, a)) => (n.trim(), Some(a.trim())),
            None => (item, None),
        };
        let key = DEBUG_KEYS
            .iter()
            .find(|k| k.name.eq_ignore_ascii_case(name))
            .ok_or_else(|| {
                let known: Vec<&str> = DEBUG_KEYS.iter().map(|k| k.name).collect();
                format!(
                    "{DEBUG_VAR}: unknown key {name:?}; known keys: {}",
                    known.join(", ")
                )
            })?;
        let parsed = match (key.kind, arg) {
            (DebugKind::Flag, None) => Some(DebugValue::Flag(true)),
            (DebugKind::Flag, Some(a)) => parse_flag(a).map(DebugValue::Flag),
            (DebugKind::Count, Some(a)) => a.parse().ok().map(DebugValue::Count),
            (DebugKind::Choice(words), Some(a)) => words
                .iter()
                .find(|w| w.eq_ignore_ascii_case(a))
                .map(|w| DebugValue::Choice(w)),
            (_, None) => None,
        };
        let v = parsed.ok_or_else(|| {
            let wants = match key.kind {
                DebugKind::Flag => format!(
                    "{0} alone, or {0}= one of {1} / {2}",
                    key.name,
                    ON.join("/"),
                    OFF.join("/")
                ),
                DebugKind::Count => format!("{}=N, a non-negative integer", key.name),
                DebugKind::Choice(words) => format!("{}= one of {}", key.name, words.join(", ")),
            };
            format!("{DEBUG_VAR}: bad item {item:?}; {wants}")
        })?;
        out.insert(key.name, v);
    }
    Ok(out)
}

/// `TPUC_DEBUG`'s value for `key` as set now, or `None` where it is not given. A malformed
/// variable logs a warning and counts as empty (Python raises `ValueError` for it before any
/// compile: `tpuc.env.check`).
pub fn debug(key: &str) -> Option<DebugValue> {
    debug_assert!(DEBUG_KEYS.iter().any(|k| k.name == key), "{key}");
    let value = std::env::var(DEBUG_VAR).unwrap_or_default();
    match parse_debug(&value) {
        Ok(mut map) => map.remove(key),
        Err(e) => {
            tracing::warn!("{e}; ignoring {DEBUG_VAR}");
            None
        }
    }
}

/// Whether flag `key` of `TPUC_DEBUG` is on (off where not given).
pub fn debug_flag(key: &str) -> bool {
    matches!(debug(key), Some(DebugValue::Flag(true)))
}

/// Count `key` of `TPUC_DEBUG`, where given.
pub fn debug_count(key: &str) -> Option<u64> {
    match debug(key) {
        Some(DebugValue::Count(n)) => Some(n),
        _ => None,
    }
}

/// Choice `key` of `TPUC_DEBUG`, where given.
pub fn debug_choice(key: &str) -> Option<&'static str> {
    match debug(key) {
        Some(DebugValue::Choice(w)) => Some(w),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_in_any_case_and_with_spaces() {
        for v in ["1", "on", "ON", "True", " yes ", "Yes"] {
            assert_eq!(parse_flag(v), Some(true), "{v:?}");
        }
        for v in ["0", "off", "Off", "FALSE", "no\n", " 0"] {
            assert_eq!(parse_flag(v), Some(false), "{v:?}");
        }
        for v in ["", "2", "-1", "y", "enabled", "o n", "00"] {
            assert_eq!(parse_flag(v), None, "{v:?}");
        }
    }

    fn on(set: HostKernels) -> Vec<&'static str> {
        HostKernel::ALL
            .into_iter()
            .filter(|k| set.contains(*k))
            .map(HostKernel::name)
            .collect()
    }

    #[test]
    fn host_kernels_grammar() {
        let all = host_kernel_names();
        for v in ["", "  ", "auto", "AUTO", " auto "] {
            assert_eq!(on(HostKernels::parse(v).unwrap()), all, "{v:?}");
        }
        assert!(on(HostKernels::parse("off").unwrap()).is_empty());
        assert_eq!(
            on(HostKernels::parse("gemm, Conv,").unwrap()),
            ["gemm", "conv"]
        );
        assert_eq!(
            on(HostKernels::parse("-rows,-channels_last").unwrap()),
            ["gemm", "conv", "torch", "handoff", "malloc"]
        );
        assert_eq!(on(HostKernels::parse("malloc").unwrap()), ["malloc"]);
        for (v, says) in [
            ("gemm,-conv", "not both"),
            ("blas", "unknown host path \"blas\""),
            ("-blas", "unknown host path \"blas\""),
            ("on", "unknown host path \"on\""),
        ] {
            let e = HostKernels::parse(v).unwrap_err();
            assert!(e.contains(says), "{v:?}: {e}");
            assert!(e.contains("TPUC_HOST_KERNELS"), "{e}");
            assert!(e.contains("channels_last") && e.contains("\"auto\""), "{e}");
        }
    }

    #[test]
    fn debug_grammar() {
        let m =
            parse_debug("discrete_device, module_format=TEXT,profile_every=50,no_host_views=off")
                .unwrap();
        assert_eq!(m["discrete_device"], DebugValue::Flag(true));
        assert_eq!(m["no_host_views"], DebugValue::Flag(false));
        assert_eq!(m["module_format"], DebugValue::Choice("text"));
        assert_eq!(m["profile_every"], DebugValue::Count(50));
        assert!(parse_debug("").unwrap().is_empty());
        // A later item wins.
        let m = parse_debug("discrete_device,discrete_device=0").unwrap();
        assert_eq!(m["discrete_device"], DebugValue::Flag(false));
        for (v, says) in [
            (
                "discrete",
                "unknown key \"discrete\"; known keys: discrete_device,",
            ),
            ("module_format=mlir", "module_format= one of text, bytecode"),
            ("module_format", "module_format= one of"),
            ("profile_every=-1", "non-negative integer"),
            ("profile_every", "non-negative integer"),
            ("skip_device_check=maybe", "skip_device_check alone"),
        ] {
            let e = parse_debug(v).unwrap_err();
            assert!(e.contains(says), "{v:?}: {e}");
            assert!(e.starts_with("TPUC_DEBUG"), "{e}");
        }
    }

    #[test]
    fn read_from_the_environment_at_each_call() {
        // The only test here that sets the variables (tests run in threads of one process).
        std::env::set_var(HOST_KERNELS_VAR, "-conv");
        assert!(host_kernel(HostKernel::Gemm) && !host_kernel(HostKernel::Conv));
        std::env::set_var(HOST_KERNELS_VAR, "not-a-path");
        assert!(
            host_kernel(HostKernel::Conv),
            "a malformed value counts as auto"
        );
        std::env::remove_var(HOST_KERNELS_VAR);
        assert!(host_kernel(HostKernel::Conv));

        std::env::set_var(DEBUG_VAR, "discrete_device,cache_write_pause_ms=7");
        assert!(debug_flag("discrete_device") && !debug_flag("no_host_views"));
        assert_eq!(debug_count("cache_write_pause_ms"), Some(7));
        assert_eq!(debug_choice("module_format"), None);
        std::env::set_var(DEBUG_VAR, "discrete_device,bogus");
        assert!(
            !debug_flag("discrete_device"),
            "a malformed value counts as empty"
        );
        std::env::remove_var(DEBUG_VAR);
        assert!(!debug_flag("discrete_device"));
    }
}
