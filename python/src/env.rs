//! tpuc's switch variables for Python (`tpuc.env`): `TPUC_HOST_KERNELS` and `TPUC_DEBUG` read by
//! the one parser the Rust side uses (`tpuc_runtime::env`), and the test hooks that replace
//! what used to be tuning variables.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tpuc_runtime::env::{self as tenv, DebugKind, DebugValue, HostKernels};

/// `[(path, on)]` for every host path: `value`, or `TPUC_HOST_KERNELS` as set now where `value`
/// is None. A malformed value raises ValueError naming the accepted values.
#[pyfunction]
#[pyo3(signature = (value=None))]
pub fn host_kernels(value: Option<&str>) -> PyResult<Vec<(&'static str, bool)>> {
    let set = match value {
        Some(v) => HostKernels::parse(v),
        None => HostKernels::from_env(),
    }
    .map_err(PyValueError::new_err)?;
    Ok(tenv::HostKernel::ALL
        .into_iter()
        .map(|k| (k.name(), set.contains(k)))
        .collect())
}

/// `{key: value}` of the keys given: `value`, or `TPUC_DEBUG` as set now where `value` is None
/// (flags as bool, counts as int, choices as str). An unknown key or a bad value raises
/// ValueError naming the known keys or values.
#[pyfunction]
#[pyo3(signature = (value=None))]
pub fn debug_settings<'py>(py: Python<'py>, value: Option<&str>) -> PyResult<Bound<'py, PyDict>> {
    let text = match value {
        Some(v) => v.to_owned(),
        None => std::env::var(tenv::DEBUG_VAR).unwrap_or_default(),
    };
    let parsed = tenv::parse_debug(&text).map_err(PyValueError::new_err)?;
    let out = PyDict::new(py);
    for (key, v) in parsed {
        match v {
            DebugValue::Flag(b) => out.set_item(key, b)?,
            DebugValue::Count(n) => out.set_item(key, n)?,
            DebugValue::Choice(w) => out.set_item(key, w)?,
        }
    }
    Ok(out)
}

/// `[(key, kind, values, what)]` of every `TPUC_DEBUG` key: kind "flag", "count" or "choice",
/// values the words of a choice.
#[pyfunction]
pub fn debug_keys() -> Vec<(&'static str, &'static str, Vec<&'static str>, &'static str)> {
    tenv::DEBUG_KEYS
        .iter()
        .map(|k| {
            let (kind, values) = match k.kind {
                DebugKind::Flag => ("flag", Vec::new()),
                DebugKind::Count => ("count", Vec::new()),
                DebugKind::Choice(words) => ("choice", words.to_vec()),
            };
            (k.name, kind, values, k.what)
        })
        .collect()
}

/// The words an on/off value of a `TPUC_DEBUG` flag accepts: `(on, off)`.
#[pyfunction]
pub fn flag_words() -> (Vec<&'static str>, Vec<&'static str>) {
    (tenv::ON.to_vec(), tenv::OFF.to_vec())
}

/// Test hook: the element bound under which the CPU plugin's compiles run unpartitioned, for
/// later compiles of this process (0: never); returns the previous one.
#[pyfunction]
pub fn set_unpartitioned_max(elements: i64) -> i64 {
    tpuc_compiler::pipeline::set_unpartitioned_max(elements)
}

/// Test and benchmark hook: which kinds of XLA's YNNPACK fusions the CPU plugin's later
/// compiles in this process make (None: XLA's default; "": none; else `LibraryFusionType` names
/// joined by commas); part of each executable's cache key. Returns the previous setting.
#[pyfunction]
#[pyo3(signature = (types))]
pub fn set_cpu_ynn_fusion_types(types: Option<String>) -> Option<String> {
    tpuc_compiler::pipeline::set_cpu_ynn_fusion_types(types)
}

/// Test hook: host BLAS products cut into one-thread pieces on the calling thread too (the path
/// of XLA's threads), from now on in this process.
#[pyfunction]
pub fn set_host_gemm_always_pieces(on: bool) {
    tpuc_hostkernels::host_blas::set_always_pieces(on);
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(host_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(debug_settings, m)?)?;
    m.add_function(wrap_pyfunction!(debug_keys, m)?)?;
    m.add_function(wrap_pyfunction!(flag_words, m)?)?;
    m.add_function(wrap_pyfunction!(set_unpartitioned_max, m)?)?;
    m.add_function(wrap_pyfunction!(set_host_gemm_always_pieces, m)?)?;
    m.add_function(wrap_pyfunction!(set_cpu_ynn_fusion_types, m)?)?;
    Ok(())
}
