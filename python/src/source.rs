//! The user's source line of a stack trace, for Python's messages: the same reading of FX's
//! `stack_trace` that puts locations on the lowered ops (`tpuc_frontend_fx::SourceLoc`).

use pyo3::prelude::*;
use tpuc_frontend_fx::SourceLoc;

/// `(file, line, function)` of the innermost frame of `trace` whose file does not start with
/// one of `skip` (PyTorch's own package), or None.
#[pyfunction]
pub(crate) fn user_frame(trace: &str, skip: Vec<String>) -> Option<(String, u32, String)> {
    let skip: Vec<&str> = skip.iter().map(String::as_str).collect();
    let loc = SourceLoc::from_stack_trace(trace, &skip)?;
    let f = loc.frame()?;
    Some((f.file.clone(), f.line, f.func.clone()))
}
