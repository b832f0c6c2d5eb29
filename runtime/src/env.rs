//! One rule for every on/off environment variable tpuc reads (docs/api.md, "Environment"), the
//! same as the Python package's `tpuc.runtime.env_flag`: on/off words in any case, unset or
//! empty means the default, anything else warns and means the default.

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

/// The on/off environment variable `name`: `default` when it is unset or empty; a value that is
/// neither on nor off logs a warning naming the variable and gives `default` too (a switch only
/// picks between correct paths, so the default is always a safe reading).
pub fn flag(name: &str, default: bool) -> bool {
    let Some(value) = std::env::var_os(name) else {
        return default;
    };
    let text = value.to_string_lossy();
    if text.trim().is_empty() {
        return default;
    }
    parse_flag(&text).unwrap_or_else(|| {
        tracing::warn!(
            "{name}={text:?} is neither on ({}) nor off ({}); using the default ({})",
            ON.join("/"),
            OFF.join("/"),
            if default { "on" } else { "off" },
        );
        default
    })
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

    #[test]
    fn unset_empty_and_unknown_give_the_default() {
        // A name no other test reads (tests run in threads of one process).
        const NAME: &str = "ENV_RS_FLAG_UNDER_TEST";
        std::env::remove_var(NAME);
        assert!(flag(NAME, true));
        assert!(!flag(NAME, false));
        for (value, default, want) in [
            ("", true, true),
            ("  ", false, false),
            ("off", true, false),
            ("yes", false, true),
            ("maybe", true, true),
            ("maybe", false, false),
        ] {
            std::env::set_var(NAME, value);
            assert_eq!(
                flag(NAME, default),
                want,
                "{value:?} with default {default}"
            );
        }
        std::env::remove_var(NAME);
    }
}
