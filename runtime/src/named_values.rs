//! Options and attributes that cross the PJRT C API as `PJRT_NamedValue`s, both ways: client
//! create options and a topology's compile options out, a plugin's attributes and analyses back.

use std::ffi::c_char;

use super::api::{copy_str, Args};
use super::sys;

/// The value of one `PJRT_Client_Create` option (`PJRT_NamedValue`). Which names and types a
/// plugin accepts is the plugin's own (the CPU plugin: `cpu_device_count`; the CUDA/ROCm plugins:
/// `preallocate`, `memory_fraction`, `allocator`, `visible_devices` ...); a plugin rejects names
/// it does not know.
#[derive(Clone, Debug, PartialEq)]
pub enum OptionValue {
    Str(String),
    Int64(i64),
    Int64List(Vec<i64>),
    Float(f32),
    Bool(bool),
}

/// `(name, value)` options of `PJRT_Client_Create`.
pub type CreateOptions = Vec<(String, OptionValue)>;

/// `options` as `PJRT_NamedValue`s. They point into `options`' strings and lists: keep
/// `options` alive and unchanged while the plugin may read them.
pub(crate) fn named_values(options: &[(String, OptionValue)]) -> Vec<sys::PJRT_NamedValue> {
    options
        .iter()
        .map(|(name, value)| {
            let mut nv = sys::PJRT_NamedValue::new();
            nv.name = name.as_ptr().cast::<c_char>();
            nv.name_size = name.len();
            match value {
                OptionValue::Str(v) => {
                    nv.type_ = sys::PJRT_NamedValue_kString;
                    nv.__bindgen_anon_1.string_value = v.as_ptr().cast::<c_char>();
                    nv.value_size = v.len();
                }
                OptionValue::Int64(v) => {
                    nv.type_ = sys::PJRT_NamedValue_kInt64;
                    nv.__bindgen_anon_1.int64_value = *v;
                    nv.value_size = 1;
                }
                OptionValue::Int64List(v) => {
                    nv.type_ = sys::PJRT_NamedValue_kInt64List;
                    nv.__bindgen_anon_1.int64_array_value = v.as_ptr();
                    nv.value_size = v.len();
                }
                OptionValue::Float(v) => {
                    nv.type_ = sys::PJRT_NamedValue_kFloat;
                    nv.__bindgen_anon_1.float_value = *v;
                    nv.value_size = 1;
                }
                OptionValue::Bool(v) => {
                    nv.type_ = sys::PJRT_NamedValue_kBool;
                    nv.__bindgen_anon_1.bool_value = *v;
                    nv.value_size = 1;
                }
            }
            nv
        })
        .collect()
}

/// The CPU plugin's option for its number of devices (its default is 4).
pub fn cpu_device_options(count: Option<i64>) -> CreateOptions {
    count
        .map(|n| vec![("cpu_device_count".to_string(), OptionValue::Int64(n))])
        .unwrap_or_default()
}

/// Copies `n` named values (attributes, cost properties) owned by the plugin; values of a type
/// this header does not know are skipped.
///
/// # Safety
/// `values` must be null or point to `n` live `PJRT_NamedValue`s, each string and list lying
/// where its value points.
pub(crate) unsafe fn read_named_values(
    values: *const sys::PJRT_NamedValue,
    n: usize,
) -> Vec<(String, OptionValue)> {
    if values.is_null() || n == 0 {
        return Vec::new();
    }
    // SAFETY: guaranteed by the caller.
    let values = unsafe { std::slice::from_raw_parts(values, n) };
    values
        .iter()
        // SAFETY: each value's union member is the one its type names (the caller's contract).
        .filter_map(|nv| unsafe {
            let name = copy_str(nv.name, nv.name_size);
            let value = match nv.type_ {
                sys::PJRT_NamedValue_kString => {
                    OptionValue::Str(copy_str(nv.__bindgen_anon_1.string_value, nv.value_size))
                }
                sys::PJRT_NamedValue_kInt64 => OptionValue::Int64(nv.__bindgen_anon_1.int64_value),
                sys::PJRT_NamedValue_kInt64List => OptionValue::Int64List(
                    std::slice::from_raw_parts(
                        nv.__bindgen_anon_1.int64_array_value,
                        nv.value_size,
                    )
                    .to_vec(),
                ),
                sys::PJRT_NamedValue_kFloat => OptionValue::Float(nv.__bindgen_anon_1.float_value),
                sys::PJRT_NamedValue_kBool => OptionValue::Bool(nv.__bindgen_anon_1.bool_value),
                _ => return None,
            };
            Some((name, value))
        })
        .collect()
}
