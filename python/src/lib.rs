//! `tpuc._native`: the Python face of the Rust core. Thin by design: it converts between Python
//! values and the core's types, releases the GIL around long work, and turns every error into a
//! Python exception carrying the core's message. One module per thing Python holds: the graph
//! (`graph`), the runtime (`runtime`), executables (`executable`, `hot` for the per-call path),
//! targets (`target`), bucketed graphs (`bucket`), the cache's commands (`cache_files`); with
//! the errors (`errors`), option conversion (`options`), the FX walk (`fx_walk`), environment
//! (`env`), interpreter exit (`exit`), logs (`logging`), table writes (`writes`) and the user's
//! source lines for messages (`source`).

mod bucket;
mod cache_files;
mod env;
mod errors;
mod executable;
mod exit;
mod fx_walk;
mod graph;
mod hot;
mod logging;
mod options;
mod runtime;
mod source;
mod target;
mod writes;

/// The Rust side's allocator: lowering makes many small, short-lived allocations (IR nodes,
/// attribute texts, shape vectors), which mimalloc serves faster than the system's malloc.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    logging::init_logging();
    m.add_class::<graph::FxGraph>()?;
    m.add_class::<runtime::Runtime>()?;
    m.add_class::<executable::Executable>()?;
    m.add_class::<executable::DeviceBuffer>()?;
    m.add_class::<bucket::BucketedGraph>()?;
    m.add_class::<hot::CallPlan>()?;
    m.add_class::<target::Target>()?;
    m.add_class::<hot::Slot>()?;
    m.add_class::<hot::Unboxed>()?;
    m.add_function(wrap_pyfunction!(hot::plan_executions, m)?)?;
    m.add_function(wrap_pyfunction!(exit::begin_exit, m)?)?;
    m.add_function(wrap_pyfunction!(exit::exiting, m)?)?;
    m.add_function(wrap_pyfunction!(writes::write_rows, m)?)?;
    m.add_function(wrap_pyfunction!(bucket::bucket_graph, m)?)?;
    m.add_function(wrap_pyfunction!(bucket::eval_sym, m)?)?;
    m.add_function(wrap_pyfunction!(graph::supported_ops, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::live_objects, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::plugin_api_version, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::execute_spin_us, m)?)?;
    m.add_function(wrap_pyfunction!(source::user_frame, m)?)?;
    env::register(m)?;
    cache_files::register(m)?;
    m.add_function(wrap_pyfunction!(target::cache_entry_target, m)?)?;
    m.add_function(wrap_pyfunction!(target::cache_entry_report, m)?)?;
    errors::register(m)?;
    Ok(())
}
