//! The core's errors as Python exceptions: the exception classes of `tpuc._native` and the
//! mapping of each core error type onto them (the message is always the core's).

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use tpuc_cache::CacheError;
use tpuc_compiler::lower::LowerError;
use tpuc_compiler::pipeline::CompileError;
use tpuc_frontend_fx::DType;
use tpuc_runtime::{PjrtError, RunError};

create_exception!(
    _native,
    TpucError,
    PyRuntimeError,
    "Base class of tpuc's errors."
);
create_exception!(
    _native,
    UnsupportedOpError,
    TpucError,
    "An op tpuc cannot lower (the message names the op and the FX node)."
);
create_exception!(
    _native,
    PjrtError_,
    TpucError,
    "An error reported by the PJRT plugin (the message is the plugin's)."
);
create_exception!(
    _native,
    ShardingError,
    PyValueError,
    "A mesh or sharding spec that cannot apply (the message names the tensor, dim and mesh axis)."
);
create_exception!(
    _native,
    GraphImportError,
    TpucError,
    "An FX graph tpuc cannot import."
);

/// Adds the exception classes to the module, under their Python names.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("TpucError", py.get_type::<TpucError>())?;
    m.add("UnsupportedOpError", py.get_type::<UnsupportedOpError>())?;
    m.add("PjrtError", py.get_type::<PjrtError_>())?;
    m.add("GraphImportError", py.get_type::<GraphImportError>())?;
    m.add("ShardingError", py.get_type::<ShardingError>())?;
    Ok(())
}

/// A lowering error as a Python exception; `op` and `node` attributes name the failing node.
pub(crate) fn lower_err(e: LowerError) -> PyErr {
    let (op, node) = match &e {
        LowerError::Unsupported { op, node } | LowerError::Node { op, node, .. } => {
            (Some(op.clone()), Some(node.clone()))
        }
        LowerError::Internal(_) => (None, None),
    };
    let err = match e {
        LowerError::Unsupported { .. } => UnsupportedOpError::new_err(e.to_string()),
        other => TpucError::new_err(other.to_string()),
    };
    Python::attach(|py| {
        let value = err.value(py);
        let _ = value.setattr("op", op);
        let _ = value.setattr("node", node);
    });
    err
}

pub(crate) fn pjrt_err(e: PjrtError) -> PyErr {
    PjrtError_::new_err(e.to_string())
}

pub(crate) fn compile_err(e: CompileError) -> PyErr {
    match e {
        CompileError::Lower(l) => lower_err(l),
        CompileError::Pjrt(p) => pjrt_err(p),
        CompileError::Cache(c) => cache_err(c),
        CompileError::Sharding(e) => ShardingError::new_err(format!("tpuc: {e}")),
        other => TpucError::new_err(other.to_string()),
    }
}

/// A run's error: the plugin's as `PjrtError`, a call that does not fit as `TpucError`.
pub(crate) fn run_err(e: RunError) -> PyErr {
    match e {
        RunError::Pjrt(p) => pjrt_err(p),
        RunError::Call(m) => TpucError::new_err(m),
    }
}

pub(crate) fn cache_err(e: CacheError) -> PyErr {
    match e {
        CacheError::Unsafe { .. } | CacheError::Foreign { .. } => {
            pyo3::exceptions::PyPermissionError::new_err(e.to_string())
        }
        other => TpucError::new_err(other.to_string()),
    }
}

/// Runs `f`, turning a panic (a bug in tpuc) into a `TpucError` instead of a `PanicException`,
/// which is a BaseException that `except Exception` and the eager fallback would not catch.
pub(crate) fn no_panic<T>(f: impl FnOnce() -> T) -> PyResult<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
        let msg = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        TpucError::new_err(format!(
            "internal error in tpuc (a bug, please report it): {msg}"
        ))
    })
}

/// The dtype named `name` (torch's name), or a `TpucError`.
pub(crate) fn dtype(name: &str) -> PyResult<DType> {
    DType::from_name(name).ok_or_else(|| TpucError::new_err(format!("unsupported dtype {name}")))
}
