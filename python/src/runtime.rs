//! `Runtime`: one PJRT plugin's client in Python's hands: the compiler's engine
//! (`tpuc_compiler::pipeline::Engine`) and the runtime's runner (`tpuc_runtime::Runner`) on it,
//! with the plugin's settings (host kernels, own math) and process-wide PJRT facts.

use crate::errors::{compile_err, no_panic, pjrt_err, run_err};
use crate::executable::{host_array, DeviceBuffer, Executable};
use crate::graph::FxGraph;
use crate::options::{create_options_of, parse_precision, sharding_request};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use tpuc_compiler::pipeline::{Compiled, DiskCacheOptions, Engine};
use tpuc_frontend_fx::Graph;
use tpuc_runtime::Runner;

/// A PJRT client for one plugin, with its in-memory executable cache.
#[pyclass(module = "tpuc._native", frozen)]
pub(crate) struct Runtime {
    /// Compiles (and keeps the executables).
    engine: Arc<Engine>,
    /// Runs what `engine` compiled, on the same PJRT client.
    runner: Arc<Runner>,
}

#[pymethods]
impl Runtime {
    /// `create_options`: `PJRT_Client_Create`'s options, `{name: value}` with values of type
    /// bool, int, float, str or list of int (`runtime.create_options` picks them per plugin).
    /// `lower_for`: a platform ("tpu") whose lowering rules this runtime's modules follow
    /// instead of its own (a stand-in for a target, road.py); None: the plugin's own.
    #[new]
    #[pyo3(signature = (plugin_path, create_options=None, lower_for=None))]
    fn new(
        py: Python<'_>,
        plugin_path: PathBuf,
        create_options: Option<&Bound<'_, PyDict>>,
        lower_for: Option<String>,
    ) -> PyResult<Runtime> {
        let options = create_options_of(create_options)?;
        let (engine, runner) = crate::exit::detach(py, || {
            let engine = Engine::new(&plugin_path, &options)?;
            let runner = Runner::new(engine.client().clone())?;
            Ok((engine, runner))
        })
        .map_err(pjrt_err)?;
        let engine = match lower_for {
            Some(platform) => {
                engine.lower_for_device(tpuc_compiler::lower::Device::of_platform(&platform))
            }
            None => engine,
        };
        Ok(Runtime {
            engine: Arc::new(engine),
            runner: Arc::new(runner),
        })
    }

    #[getter]
    fn platform(&self) -> String {
        self.engine.platform().to_string()
    }

    #[getter]
    fn platform_version(&self) -> PyResult<String> {
        self.engine.client().platform_version().map_err(pjrt_err)
    }

    /// `((major, minor, patch) current, (...) minimum)` StableHLO versions the plugin accepts, or
    /// None where it does not say.
    #[getter]
    fn stablehlo_versions(&self) -> Option<(Vec<i64>, Vec<i64>)> {
        self.engine.stablehlo_versions().cloned()
    }

    /// How modules go to the plugin: `"bytecode"` or `"text"` (MLIR).
    #[getter]
    fn module_format(&self) -> &'static str {
        if self.engine.sends_text() {
            "text"
        } else {
            "bytecode"
        }
    }

    /// Whether device memory is host memory (the CPU plugin).
    #[getter]
    fn host_zero_copy(&self) -> bool {
        self.runner.host_zero_copy()
    }

    /// From now on, lowers f32 matrix products of at least `min_macs` multiply-adds to calls of
    /// the `sgemm_` in `library` (already loaded by the process: PyTorch's own), registered
    /// with the plugin; 0 turns it off. Returns whether products can go there.
    fn enable_host_gemm(&self, py: Python<'_>, library: PathBuf, min_macs: u64) -> PyResult<bool> {
        crate::exit::detach(py, || self.engine.enable_host_gemm(&library, min_macs))
            .map_err(pjrt_err)
    }

    /// The fewest multiply-adds an f32 matrix product needs to run in the host BLAS (MKL), or
    /// None where every product stays in XLA.
    #[getter]
    fn host_gemm_min_macs(&self) -> Option<u64> {
        self.engine.host_gemm_min_macs()
    }

    /// `(on the calling thread, in one-thread pieces, pieces that packed B first)`: how many
    /// host BLAS products (and pieces) ran each way in this process.
    #[staticmethod]
    fn host_gemm_calls() -> (u64, u64, u64) {
        tpuc_hostkernels::host_blas::calls()
    }

    /// Sets how long the host BLAS's helper threads poll for the next product after their last
    /// one before they sleep (`tpuc_hostkernels::spin_helpers::SPIN`), for this process.
    #[staticmethod]
    fn set_host_gemm_spin_us(us: u64) {
        tpuc_hostkernels::spin_helpers::set_spin(std::time::Duration::from_micros(us));
    }

    /// From now on, lowers 2-D f32 convolutions to calls of oneDNN loaded from `library` (None:
    /// off), registered with the plugin. Returns whether convolutions go there.
    #[pyo3(signature = (library))]
    fn enable_host_conv(&self, py: Python<'_>, library: Option<String>) -> PyResult<bool> {
        crate::exit::detach(py, || self.engine.enable_host_conv(library.as_deref()))
            .map_err(pjrt_err)
    }

    /// Whether 2-D f32 convolutions run in oneDNN.
    #[getter]
    fn host_conv(&self) -> bool {
        self.engine.host_conv()
    }

    /// From now on, lowers large f32 layer norms to the runtime's row kernels (registered with
    /// the plugin), or (false) keeps them in XLA. Returns whether they go there.
    fn enable_host_rows(&self, py: Python<'_>, on: bool) -> PyResult<bool> {
        crate::exit::detach(py, || self.engine.enable_host_rows(on)).map_err(pjrt_err)
    }

    /// From now on, lowers the math primitives (exp, log, atan2, tanh ...) of these ATen ops
    /// (`"aten.exp.default"`) to tpuc's own expansions instead of the plugin's code.
    fn set_own_math(&self, ops: Vec<String>) {
        self.engine.set_own_math(ops);
    }

    /// `(plugin identity hex, host CPU features, XLA_FLAGS)`: what compiled numbers depend on
    /// besides the module (as in the cache key).
    #[getter]
    fn numerics_identity(&self) -> (String, String, String) {
        self.engine.numerics_identity()
    }

    /// The ATen ops lowered with tpuc's own math (sorted).
    #[getter]
    fn own_math(&self) -> Vec<String> {
        self.engine.own_math().iter().cloned().collect()
    }

    /// Whether large f32 layer norms run in the host row kernels.
    #[getter]
    fn host_rows(&self) -> bool {
        self.engine.host_rows()
    }

    /// Whether the fused CPU attention goes to tpuc's host kernel (the row kernels and the host
    /// BLAS both on).
    #[getter]
    fn host_attention(&self) -> bool {
        self.engine.host_attention()
    }

    /// `(forward, input gradient, weight gradient)`: how many oneDNN convolutions ran in this
    /// process.
    #[staticmethod]
    fn host_conv_calls() -> (u64, u64, u64) {
        tpuc_hostkernels::host_conv::calls()
    }

    /// `(major, minor, patch)` of the oneDNN that convolutions run in; None where none loaded.
    #[staticmethod]
    fn host_conv_version() -> Option<(i32, i32, i32)> {
        tpuc_hostkernels::host_conv::version()
    }

    /// The alignment host memory needs for the plugin to compute on it in place.
    #[classattr]
    fn host_align() -> usize {
        tpuc_runtime::runner::HOST_VIEW_ALIGN
    }

    #[getter]
    fn device_count(&self) -> usize {
        self.engine.client().addressable_device_count()
    }

    #[getter]
    fn plugin_path(&self) -> String {
        self.engine.client().plugin().path().display().to_string()
    }

    #[getter]
    fn api_version(&self) -> (i32, i32) {
        self.engine.client().plugin().api_version()
    }

    #[getter]
    fn cached_executables(&self) -> usize {
        self.engine.cached_executables()
    }

    /// Specializes `graph` to `bindings`, lowers and compiles it, or loads it from the caches
    /// (GIL released).
    /// `sharding`: a dict with `mesh_shape`, `mesh_axes`, `strategy`, `inputs` and `outputs`
    /// (one `(role, name, fixed spec or None)` per tensor input/output) and `batch` (or None); a
    /// spec is a list with, per dim, the list of mesh axis indices it is split over.
    #[pyo3(signature = (graph, bindings, precision, cache_dir=None, cache_max_bytes=None, sharding=None))]
    #[allow(clippy::too_many_arguments)]
    fn compile(
        &self,
        py: Python<'_>,
        graph: &FxGraph,
        bindings: HashMap<String, i64>,
        precision: &str,
        cache_dir: Option<PathBuf>,
        cache_max_bytes: Option<u64>,
        sharding: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Executable> {
        let precision = parse_precision(precision)?;
        let disk = DiskCacheOptions {
            dir: cache_dir,
            max_bytes: cache_max_bytes,
        };
        let request = sharding.map(sharding_request).transpose()?;
        let engine = self.engine.clone();
        let compiled = crate::exit::detach(py, || {
            no_panic(|| {
                engine.compile_sharded(&graph.graph, &bindings, precision, &disk, request.as_ref())
            })
        })?
        .map_err(compile_err)?;
        Ok(self.executable(compiled))
    }

    /// Compiles one specialization per bindings dict, in parallel; a progress bar on stderr
    /// when `progress`. Returns the executables in order (the first error raises).
    #[pyo3(signature = (graph, all_bindings, precision, cache_dir=None, cache_max_bytes=None, progress=false))]
    #[allow(clippy::too_many_arguments)]
    fn compile_many(
        &self,
        py: Python<'_>,
        graph: &FxGraph,
        all_bindings: Vec<HashMap<String, i64>>,
        precision: &str,
        cache_dir: Option<PathBuf>,
        cache_max_bytes: Option<u64>,
        progress: bool,
    ) -> PyResult<Vec<Executable>> {
        let precision = parse_precision(precision)?;
        let disk = DiskCacheOptions {
            dir: cache_dir,
            max_bytes: cache_max_bytes,
        };
        let engine = self.engine.clone();
        let results = crate::exit::detach(py, || {
            no_panic(|| {
                engine.compile_many(&graph.graph, &all_bindings, precision, &disk, progress)
            })
        })?;
        results
            .into_iter()
            .map(|r| r.map(|c| self.executable(c)).map_err(compile_err))
            .collect()
    }

    /// Compiles static graphs (no bindings) in parallel, like `compile_many`.
    #[pyo3(signature = (graphs, precision, cache_dir=None, cache_max_bytes=None, progress=false))]
    fn compile_graphs(
        &self,
        py: Python<'_>,
        graphs: Vec<PyRef<'_, FxGraph>>,
        precision: &str,
        cache_dir: Option<PathBuf>,
        cache_max_bytes: Option<u64>,
        progress: bool,
    ) -> PyResult<Vec<Executable>> {
        let precision = parse_precision(precision)?;
        let disk = DiskCacheOptions {
            dir: cache_dir,
            max_bytes: cache_max_bytes,
        };
        let engine = self.engine.clone();
        let graphs: Vec<Arc<Graph>> = graphs.iter().map(|g| g.graph.clone()).collect();
        let none = HashMap::new();
        let results = crate::exit::detach(py, || {
            no_panic(|| {
                let jobs: Vec<(&Arc<Graph>, &HashMap<String, i64>)> =
                    graphs.iter().map(|g| (g, &none)).collect();
                engine.compile_jobs(&jobs, precision, &disk, progress)
            })
        })?;
        results
            .into_iter()
            .map(|r| r.map(|c| self.executable(c)).map_err(compile_err))
            .collect()
    }

    /// Puts a host array on device `device` (aliasing it on the CPU plugin).
    #[pyo3(signature = (array, device=0))]
    fn upload(&self, array: &Bound<'_, PyTuple>, device: usize) -> PyResult<DeviceBuffer> {
        let a = host_array(array)?;
        // SAFETY: the Python caller passes a live, contiguous tensor's data pointer and keeps the
        // tensor alive as long as this DeviceBuffer.
        let (buffer, aliases_host) =
            unsafe { self.runner.upload_resident(&a, device) }.map_err(run_err)?;
        Ok(DeviceBuffer {
            buffer,
            aliases_host,
        })
    }
}

impl Runtime {
    fn executable(&self, compiled: Compiled) -> Executable {
        Executable {
            runner: self.runner.clone(),
            compiled: Arc::new(compiled),
        }
    }
}

/// `(major, minor)` PJRT C API version of the plugin at `path`, loading it (once per process;
/// plugins are never unloaded) without creating a client (GIL released).
#[pyfunction]
pub(crate) fn plugin_api_version(py: Python<'_>, path: PathBuf) -> PyResult<(i32, i32)> {
    let plugin = crate::exit::detach(py, || tpuc_runtime::load_plugin(&path)).map_err(pjrt_err)?;
    Ok(plugin.api_version())
}

/// Live PJRT objects of this process: `{"buffers", "events", "executables"}` (leak tests).
#[pyfunction]
pub(crate) fn live_objects() -> HashMap<&'static str, usize> {
    let live = tpuc_runtime::live_objects();
    HashMap::from([
        ("buffers", live.buffers),
        ("events", live.events),
        ("executables", live.executables),
    ])
}

/// How long a wait for an execution polls before it sleeps, in microseconds (see
/// `tpuc_runtime::EXECUTE_SPIN`); with an argument, sets it for this process first.
#[pyfunction]
#[pyo3(signature = (us=None))]
pub(crate) fn execute_spin_us(us: Option<u64>) -> u64 {
    if let Some(us) = us {
        tpuc_runtime::set_execute_spin(std::time::Duration::from_micros(us));
    }
    u64::try_from(tpuc_runtime::execute_spin().as_micros()).unwrap_or(u64::MAX)
}
