//! `tpuc._native`: the Python face of the Rust core. Thin by design: it converts between Python
//! values and the core's types, releases the GIL around long work, and turns every error into a
//! Python exception carrying the core's message.

mod bucket;
mod env;
mod exit;
mod fx_walk;
mod hot;
mod target;
mod writes;

/// The Rust side's allocator: lowering makes many small, short-lived allocations (IR nodes,
/// attribute texts, shape vectors), which mimalloc serves faster than the system's malloc.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyList, PyTuple};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use tpuc_cache::{CacheError, DiskCache};
use tpuc_compiler::lower::{LowerError, Precision};
use tpuc_compiler::pipeline::{
    CacheOutcome, CompileError, Compiled, DiskCacheOptions, Engine, HostArray, RunArg,
};
use tpuc_frontend_fx::{DType, Dim, Graph, InputKind, Output};
use tpuc_passes::sharding::{Mesh, Role, ShardingRequest, Slot, Spec, Strategy};
use tpuc_runtime::{Buffer, OptionValue, PjrtError};

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

/// A lowering error as a Python exception; `op` and `node` attributes name the failing node.
fn lower_err(e: LowerError) -> PyErr {
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

fn pjrt_err(e: PjrtError) -> PyErr {
    PjrtError_::new_err(e.to_string())
}

fn compile_err(e: CompileError) -> PyErr {
    match e {
        CompileError::Lower(l) => lower_err(l),
        CompileError::Pjrt(p) => pjrt_err(p),
        CompileError::Cache(c) => cache_err(c),
        CompileError::Sharding(e) => ShardingError::new_err(format!("tpuc: {e}")),
        other => TpucError::new_err(other.to_string()),
    }
}

fn cache_err(e: CacheError) -> PyErr {
    match e {
        CacheError::Unsafe { .. } | CacheError::Foreign { .. } => {
            pyo3::exceptions::PyPermissionError::new_err(e.to_string())
        }
        other => TpucError::new_err(other.to_string()),
    }
}

/// Runs `f`, turning a panic (a bug in tpuc) into a `TpucError` instead of a `PanicException`,
/// which is a BaseException that `except Exception` and the eager fallback would not catch.
fn no_panic<T>(f: impl FnOnce() -> T) -> PyResult<T> {
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

fn dtype(name: &str) -> PyResult<DType> {
    DType::from_name(name).ok_or_else(|| TpucError::new_err(format!("unsupported dtype {name}")))
}

/// An imported FX graph (symbolic shapes kept), after the cleanup passes.
#[pyclass(module = "tpuc._native", frozen)]
struct FxGraph {
    /// Shared with the executables compiled from it (a static graph is lowered as it is).
    graph: Arc<Graph>,
}

fn dim_to_py(py: Python<'_>, d: &Dim) -> PyResult<Py<PyAny>> {
    Ok(match d {
        Dim::Static(n) => n.into_pyobject(py)?.into_any().unbind(),
        Dim::Sym(e) => e.to_string().into_pyobject(py)?.into_any().unbind(),
    })
}

/// Per pass: `(pass, ops_before, ops_after, graph_text_after, seconds, changes)`.
type PassReport = Vec<(String, usize, usize, Option<String>, f64, usize)>;

/// Runs the cleanup pipeline's passes named in `enabled` (all when None) on `g`.
fn clean(mut g: Graph, enabled: Option<&[String]>, texts: bool) -> (PassReport, FxGraph) {
    let mut after = Vec::new();
    let reports = tpuc_passes::run_pipeline(
        &mut g,
        |name| enabled.is_none_or(|e| e.iter().any(|n| n == name)),
        |_, g| after.push(texts.then(|| g.to_string())),
    );
    let report = reports
        .into_iter()
        .zip(after)
        .map(|(r, text)| {
            (
                r.name.to_string(),
                r.ops_before,
                r.ops_after,
                text,
                r.seconds,
                r.changes,
            )
        })
        .collect();
    (report, FxGraph { graph: Arc::new(g) })
}

#[pymethods]
impl FxGraph {
    /// Imports an AOTAutograd FX graph module, read straight from its nodes. Returns the
    /// graph, the targets of its `get_attr` nodes (inputs after the placeholders, in order) and
    /// whether it takes the random seed input (last, after the size-derived floats).
    #[staticmethod]
    fn from_fx(py: Python<'_>, gm: &Bound<'_, PyAny>) -> PyResult<(FxGraph, Vec<String>, bool)> {
        let walked = fx_walk::walk(gm)?;
        let graph = crate::exit::detach(py, || tpuc_frontend_fx::import(&walked.graph))
            .map_err(|e| GraphImportError::new_err(e.to_string()))?;
        Ok((
            FxGraph {
                graph: Arc::new(graph),
            },
            walked.attr_targets,
            walked.uses_rng,
        ))
    }

    /// This graph with outputs at `positions` free to come back in their physical layout
    /// (`Graph::free_layout_outputs`; `Executable.output_perms` says which did).
    fn with_free_layout_outputs(&self, positions: Vec<usize>) -> FxGraph {
        let mut graph = (*self.graph).clone();
        graph.free_layout_outputs = positions.into_iter().collect();
        FxGraph {
            graph: Arc::new(graph),
        }
    }

    /// Imports the wire format as JSON (`tpuc_frontend_fx::wire`).
    #[staticmethod]
    fn from_json(py: Python<'_>, json: &str) -> PyResult<FxGraph> {
        let graph = crate::exit::detach(py, || tpuc_frontend_fx::import_json(json))
            .map_err(|e| GraphImportError::new_err(e.to_string()))?;
        Ok(FxGraph {
            graph: Arc::new(graph),
        })
    }

    /// The IR itself (CBOR; exact for every literal, NaN and infinities included), what
    /// `from_ir_bytes` reads: how a graph travels to compile worker processes, and how pickle
    /// copies it.
    fn to_ir_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let mut bytes = Vec::new();
        ciborium::into_writer(&*self.graph, &mut bytes)
            .map_err(|e| TpucError::new_err(format!("cannot serialize the IR: {e}")))?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Reads what `to_ir_bytes` wrote.
    #[staticmethod]
    fn from_ir_bytes(bytes: &[u8]) -> PyResult<FxGraph> {
        let graph = ciborium::from_reader(bytes)
            .map_err(|e| GraphImportError::new_err(format!("not a tpuc IR graph: {e}")))?;
        Ok(FxGraph {
            graph: Arc::new(graph),
        })
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let from = slf.get_type().getattr("from_ir_bytes")?;
        Ok((from, (slf.get().to_ir_bytes(slf.py())?,)))
    }

    /// Runs the passes of the pipeline (`tpuc_passes::PIPELINE`, in its fixed order) named in
    /// `enabled` (all when None); returns
    /// `[(pass, ops_before, ops_after, graph_text_after, seconds, changes)]` and the new graph.
    /// `graph_text_after` is None unless `texts` (printing the graph after every pass costs
    /// more than the passes; only dumps read it).
    #[pyo3(signature = (enabled=None, texts=false))]
    fn cleanup(
        &self,
        py: Python<'_>,
        enabled: Option<Vec<String>>,
        texts: bool,
    ) -> (PassReport, FxGraph) {
        crate::exit::detach(py, || {
            clean((*self.graph).clone(), enabled.as_deref(), texts)
        })
    }

    /// `from_fx`, then `cleanup` on the imported graph itself (no copy of it is kept): returns
    /// the imported graph's text (None unless `texts`), the pass report, the graph after the
    /// passes, the `get_attr` targets, whether it takes the random seed input, and its
    /// size-derived float nodes (`SymFloat`-valued: inputs after the `get_attr` ones, whose
    /// values the runtime computes from the sizes).
    #[staticmethod]
    #[pyo3(signature = (gm, enabled=None, texts=false))]
    #[allow(clippy::type_complexity)]
    fn from_fx_cleaned(
        py: Python<'_>,
        gm: &Bound<'_, PyAny>,
        enabled: Option<Vec<String>>,
        texts: bool,
    ) -> PyResult<(
        Option<String>,
        PassReport,
        FxGraph,
        Vec<String>,
        bool,
        Vec<Py<PyAny>>,
    )> {
        let walked = fx_walk::walk(gm)?;
        let (imported_text, report, graph) = crate::exit::detach(py, || {
            let g = tpuc_frontend_fx::import(&walked.graph)?;
            let text = texts.then(|| g.to_string());
            let (report, graph) = clean(g, enabled.as_deref(), texts);
            Ok::<_, tpuc_frontend_fx::ImportError>((text, report, graph))
        })
        .map_err(|e| GraphImportError::new_err(e.to_string()))?;
        Ok((
            imported_text,
            report,
            graph,
            walked.attr_targets,
            walked.uses_rng,
            walked.symfloats,
        ))
    }

    /// The passes of the pipeline in the order they run: `[(name, group, description)]`.
    #[staticmethod]
    fn passes() -> Vec<(&'static str, &'static str, &'static str)> {
        tpuc_passes::PIPELINE
            .iter()
            .map(|p| (p.name, p.group, p.doc))
            .collect()
    }

    /// The group names a `passes` option may use besides each pass's own name.
    #[staticmethod]
    fn pass_groups() -> Vec<&'static str> {
        tpuc_passes::GROUPS.to_vec()
    }

    fn __str__(&self) -> String {
        self.graph.to_string()
    }

    fn op_count(&self) -> usize {
        self.graph.op_count()
    }

    fn op_counts(&self) -> HashMap<String, usize> {
        self.graph.op_counts().into_iter().collect()
    }

    /// The graph as Graphviz DOT text (see `tpuc_frontend_fx::dot`).
    #[pyo3(signature = (title="", clusters=true, legend=true))]
    fn to_dot(&self, title: &str, clusters: bool, legend: bool) -> String {
        graph_dot(&self.graph, title, (clusters, legend), None)
    }

    /// Ops of this graph that have no lowering rule: `[(op, node name)]`.
    fn unsupported_ops(&self) -> Vec<(String, String)> {
        self.graph
            .topo_order()
            .into_iter()
            .map(|id| self.graph.node(id))
            .filter(|n| !n.is_input() && tpuc_compiler::lower::registry::rule(&n.op).is_none())
            .map(|n| (n.op.clone(), n.name.clone()))
            .collect()
    }

    /// One entry per graph input: `("tensor", shape, dtype)` with symbolic dims as strings, or
    /// `("symint", expr)`.
    fn inputs<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        self.graph
            .inputs
            .iter()
            .map(|i| match &i.kind {
                InputKind::Tensor(t) => {
                    let shape = t
                        .shape
                        .iter()
                        .map(|d| dim_to_py(py, d))
                        .collect::<PyResult<Vec<_>>>()?;
                    PyTuple::new(
                        py,
                        [
                            "tensor".into_pyobject(py)?.into_any(),
                            PyList::new(py, shape)?.into_any(),
                            t.dtype.name().into_pyobject(py)?.into_any(),
                        ],
                    )
                }
                InputKind::SymInt(e) => PyTuple::new(
                    py,
                    [
                        "symint".into_pyobject(py)?.into_any(),
                        e.to_string().into_pyobject(py)?.into_any(),
                    ],
                ),
            })
            .collect()
    }

    /// One entry per graph output (see [`output_plan`]).
    fn outputs(&self) -> Vec<(String, Option<String>)> {
        output_plan(&self.graph)
    }

    /// Symbol values read off concrete input shapes (`None` for SymInt inputs) and SymInt
    /// values (`None` for tensors).
    fn bindings(
        &self,
        shapes: Vec<Option<Vec<i64>>>,
        ints: Vec<Option<i64>>,
    ) -> PyResult<HashMap<String, i64>> {
        let shapes: Vec<Vec<i64>> = shapes.into_iter().map(Option::unwrap_or_default).collect();
        tpuc_passes::bindings_from_inputs(&self.graph, &shapes, &ints)
            .map_err(|e| TpucError::new_err(e.to_string()))
    }
}

/// `emitted`: the units lowering emitted as composites, where the graph was lowered; else the
/// units the `composites` pass found (when it ran). Grouped where `clusters`.
fn graph_dot(
    g: &Graph,
    title: &str,
    (clusters, legend): (bool, bool),
    emitted: Option<&[(String, Vec<tpuc_frontend_fx::NodeId>)]>,
) -> String {
    let composites = match emitted {
        _ if !clusters => Vec::new(),
        Some(units) => units.to_vec(),
        None if g.lowering.contains("composites") => tpuc_passes::fusion_groups(g)
            .into_iter()
            .map(|u| (u.name.to_string(), u.nodes))
            .collect(),
        None => Vec::new(),
    };
    let opts = tpuc_frontend_fx::dot::DotOptions {
        title: title.to_string(),
        clusters,
        legend,
        composites,
        ..Default::default()
    };
    tpuc_frontend_fx::dot::to_dot(g, &opts)
}

/// One entry per graph output: `("tensor", k)` (the k-th executable output), `("input", i)`
/// (graph input i returned unchanged: the caller's tensor itself), `("sym", expr)`, `("int", v)`
/// or `("none", None)`.
fn output_plan(g: &Graph) -> Vec<(String, Option<String>)> {
    let mut k = 0;
    g.outputs
        .iter()
        .map(|o| match o {
            Output::Value(_) => {
                k += 1;
                ("tensor".into(), Some((k - 1).to_string()))
            }
            Output::Input(i) => ("input".into(), Some(i.to_string())),
            Output::Sym(e) => ("sym".into(), Some(e.to_string())),
            Output::Int(i) => ("int".into(), Some(i.to_string())),
            Output::None => ("none".into(), None),
        })
        .collect()
}

/// A PJRT client for one plugin, with its in-memory executable cache.
#[pyclass(module = "tpuc._native", frozen)]
struct Runtime {
    engine: Arc<Engine>,
}

/// A buffer resident on the device (a parameter kept there between calls). On the CPU plugin it
/// aliases the host tensor, which the Python side keeps alive alongside it.
#[pyclass(module = "tpuc._native", frozen)]
struct DeviceBuffer {
    buffer: Buffer,
    /// Whether the buffer is the uploaded host memory itself (no copy was made).
    #[pyo3(get)]
    aliases_host: bool,
}

/// A Python value as a PJRT create option's value (bool before int: `True` is an int).
fn option_value(name: &Bound<'_, PyAny>, v: &Bound<'_, PyAny>) -> PyResult<OptionValue> {
    if v.is_instance_of::<PyBool>() {
        return Ok(OptionValue::Bool(v.extract()?));
    }
    if let Ok(i) = v.extract::<i64>() {
        return Ok(OptionValue::Int64(i));
    }
    if v.is_instance_of::<PyFloat>() {
        return Ok(OptionValue::Float(v.extract::<f64>()? as f32));
    }
    if let Ok(s) = v.extract::<String>() {
        return Ok(OptionValue::Str(s));
    }
    if let Ok(list) = v.extract::<Vec<i64>>() {
        return Ok(OptionValue::Int64List(list));
    }
    Err(PyValueError::new_err(format!(
        "tpuc: PJRT create option {name}: expected a bool, int, float, str or list of ints, got {}",
        v.repr()?
    )))
}

/// A `{name: value}` dict of PJRT create options (client or topology) as the runtime takes them.
fn create_options_of(d: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<(String, OptionValue)>> {
    let Some(d) = d else {
        return Ok(Vec::new());
    };
    d.iter()
        .map(|(k, v)| Ok((k.extract::<String>()?, option_value(&k, &v)?)))
        .collect()
}

fn host_array(t: &Bound<'_, PyTuple>) -> PyResult<HostArray> {
    let (ptr, nbytes, dt, shape): (usize, usize, String, Vec<i64>) = t.extract()?;
    Ok(HostArray {
        ptr,
        nbytes,
        dtype: dtype(&dt)?,
        shape,
    })
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
        let engine =
            crate::exit::detach(py, || Engine::new(&plugin_path, &options)).map_err(pjrt_err)?;
        let engine = match lower_for {
            Some(platform) => {
                engine.lower_for_device(tpuc_compiler::lower::Device::of_platform(&platform))
            }
            None => engine,
        };
        Ok(Runtime {
            engine: Arc::new(engine),
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
        self.engine.host_zero_copy()
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
        tpuc_compiler::pipeline::HOST_VIEW_ALIGN
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
        let devices = self.engine.client().addressable_device_count();
        if device >= devices {
            return Err(TpucError::new_err(format!(
                "device {device} does not exist (the plugin has {devices})"
            )));
        }
        // SAFETY: the Python caller passes a live, contiguous tensor's data pointer and keeps the
        // tensor alive as long as this DeviceBuffer.
        let buffer = unsafe { self.engine.upload_to(&a, device) }.map_err(pjrt_err)?;
        let aliases_host = a.nbytes > 0
            && self.engine.host_zero_copy()
            && buffer.device_pointer().is_ok_and(|p| p == a.ptr);
        Ok(DeviceBuffer {
            buffer,
            aliases_host,
        })
    }
}

impl Runtime {
    fn executable(&self, compiled: Compiled) -> Executable {
        Executable {
            engine: self.engine.clone(),
            compiled: Arc::new(compiled),
        }
    }
}

fn sharding_request(d: &Bound<'_, PyDict>) -> PyResult<ShardingRequest> {
    fn item<'py, X: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<X> {
        d.get_item(key)?
            .ok_or_else(|| PyValueError::new_err(format!("sharding request lacks `{key}`")))?
            .extract()
            .map_err(Into::into)
    }
    let slots = |key: &str| -> PyResult<Vec<Slot>> {
        type RawSlot = (String, String, Option<Vec<Vec<usize>>>);
        let raw: Vec<RawSlot> = item(d, key)?;
        raw.into_iter()
            .map(|(role, name, fixed)| {
                let role = match role.as_str() {
                    "parameter" => Role::Parameter,
                    "buffer" => Role::Buffer,
                    "data" => Role::Data,
                    "other" => Role::Other,
                    r => return Err(PyValueError::new_err(format!("unknown role {r:?}"))),
                };
                Ok(Slot {
                    role,
                    name,
                    fixed: fixed.map(Spec),
                })
            })
            .collect()
    };
    let strategy: String = item(d, "strategy")?;
    let mesh = Mesh::new(item(d, "mesh_shape")?, item(d, "mesh_axes")?)
        .map_err(|e| ShardingError::new_err(format!("tpuc: {e}")))?;
    Ok(ShardingRequest {
        mesh,
        strategy: Strategy::parse(&strategy)
            .ok_or_else(|| PyValueError::new_err(format!("unknown strategy {strategy:?}")))?,
        inputs: slots("inputs")?,
        outputs: slots("outputs")?,
        batch: item(d, "batch")?,
    })
}

/// `(mesh_shape, mesh_axes, input_specs, output_specs)`, as `Executable.sharding` returns it.
type ShardingLayout = (
    Vec<i64>,
    Vec<String>,
    Vec<Vec<Vec<usize>>>,
    Vec<Vec<Vec<usize>>>,
);

/// `(offsets, shape, first_copy)` of one device's piece of a sharded tensor.
type PieceTuple = (Vec<i64>, Vec<i64>, bool);
/// Per tensor, per device: its piece.
type TensorPieces = Vec<Vec<PieceTuple>>;

/// A run argument: a resident DeviceBuffer or a host array tuple.
enum PyArg {
    Host(HostArray),
    Device(Py<DeviceBuffer>),
}

impl PyArg {
    fn extract(a: &Bound<'_, PyAny>) -> PyResult<PyArg> {
        match a.cast::<DeviceBuffer>() {
            Ok(d) => Ok(PyArg::Device(d.clone().unbind())),
            Err(_) => Ok(PyArg::Host(host_array(a.cast::<PyTuple>()?)?)),
        }
    }

    fn as_run_arg(&self) -> RunArg<'_> {
        match self {
            PyArg::Host(h) => RunArg::Host(h.clone()),
            PyArg::Device(d) => RunArg::Device(&d.get().buffer),
        }
    }
}

/// A compiled graph for one static shape.
#[pyclass(module = "tpuc._native", frozen)]
struct Executable {
    engine: Arc<Engine>,
    compiled: Arc<Compiled>,
}

#[pymethods]
impl Executable {
    /// Runs with `args` (each `(ptr, nbytes, dtype, shape)` or a DeviceBuffer) and writes the
    /// outputs into `outs` (each `(ptr, nbytes, dtype, shape)`). GIL released while running.
    fn run(
        &self,
        py: Python<'_>,
        args: &Bound<'_, PyList>,
        outs: &Bound<'_, PyList>,
    ) -> PyResult<()> {
        let args: Vec<PyArg> = args
            .iter()
            .map(|a| PyArg::extract(&a))
            .collect::<PyResult<_>>()?;
        let outs: Vec<HostArray> = outs
            .iter()
            .map(|o| host_array(o.cast::<PyTuple>()?))
            .collect::<PyResult<_>>()?;
        let run_args: Vec<RunArg> = args.iter().map(PyArg::as_run_arg).collect();
        let engine = &self.engine;
        let compiled = &self.compiled;
        // SAFETY: the Python caller passes live, contiguous tensors' pointers (outputs freshly
        // allocated, so not aliasing inputs) and holds them for the duration of this call.
        crate::exit::detach(py, || unsafe { engine.run(compiled, &run_args, &outs) })
            .map_err(compile_err)
    }

    /// Runs a sharded executable: `args[d]` holds device `d`'s piece of each input (a host
    /// array tuple or a DeviceBuffer on device `d`), `outs[d]` a host array tuple per output to
    /// receive device `d`'s piece, or None to skip it. GIL released while running.
    fn run_sharded(
        &self,
        py: Python<'_>,
        args: Vec<Vec<Bound<'_, PyAny>>>,
        outs: Vec<Vec<Option<Bound<'_, PyTuple>>>>,
    ) -> PyResult<()> {
        let args: Vec<Vec<PyArg>> = args
            .iter()
            .map(|dev| dev.iter().map(PyArg::extract).collect())
            .collect::<PyResult<_>>()?;
        let outs: Vec<Vec<Option<HostArray>>> = outs
            .iter()
            .map(|dev| {
                dev.iter()
                    .map(|o| o.as_ref().map(host_array).transpose())
                    .collect()
            })
            .collect::<PyResult<_>>()?;
        let run_args: Vec<Vec<RunArg>> = args
            .iter()
            .map(|dev| dev.iter().map(PyArg::as_run_arg).collect())
            .collect();
        let engine = &self.engine;
        let compiled = &self.compiled;
        // SAFETY: the Python caller passes live, contiguous tensors' pointers (outputs freshly
        // allocated, so not aliasing inputs) and holds them for the duration of this call.
        crate::exit::detach(py, || unsafe {
            engine.run_sharded(compiled, &run_args, &outs)
        })
        .map_err(compile_err)
    }

    /// `None`, or `(mesh_shape, mesh_axes, input_specs, output_specs)`: the layouts the
    /// executable was partitioned with (a spec lists, per dim, the mesh axes it is split over).
    #[getter]
    fn sharding(&self) -> Option<ShardingLayout> {
        self.compiled.lowered.sharding.as_ref().map(|p| {
            (
                p.mesh.shape.clone(),
                p.mesh.axes.clone(),
                p.inputs.iter().map(|s| s.0.clone()).collect(),
                p.outputs.iter().map(|s| s.0.clone()).collect(),
            )
        })
    }

    /// `None`, or `(inputs, outputs)`: per tensor, per device, `(offsets, shape, first_copy)` of
    /// that device's piece (first_copy: the first device holding that piece, which outputs are
    /// read from).
    fn shard_pieces(&self) -> Option<(TensorPieces, TensorPieces)> {
        let sig = &self.compiled.lowered;
        let p = sig.sharding.as_ref()?;
        let pieces = |specs: &[Spec], types: &[(Vec<i64>, DType)]| -> TensorPieces {
            specs
                .iter()
                .zip(types)
                .map(|(spec, (shape, _))| {
                    spec.pieces(shape, &p.mesh)
                        .into_iter()
                        .map(|x| (x.offsets, x.shape, x.first_copy))
                        .collect()
                })
                .collect()
        };
        Some((
            pieces(&p.inputs, &sig.inputs),
            pieces(&p.outputs, &sig.outputs),
        ))
    }

    /// Times `n` bare PJRT executions on resident `args` (DeviceBuffers; outputs stay on the
    /// device and are dropped): the floor that `run` adds its per-call work to. Seconds per call.
    fn bare_execute_seconds(
        &self,
        py: Python<'_>,
        args: Vec<Py<DeviceBuffer>>,
        n: usize,
    ) -> PyResult<Vec<f64>> {
        let exe = self.compiled.exe.clone();
        crate::exit::detach(py, || {
            let bufs: Vec<&Buffer> = args.iter().map(|d| &d.get().buffer).collect();
            let mut times = Vec::with_capacity(n);
            for _ in 0..n {
                let t0 = std::time::Instant::now();
                drop(exe.execute(&bufs)?);
                times.push(t0.elapsed().as_secs_f64());
            }
            Ok(times)
        })
        .map_err(pjrt_err)
    }

    /// `[(shape, dtype)]` of the executable's outputs.
    #[getter]
    fn output_types(&self) -> Vec<(Vec<i64>, String)> {
        self.compiled
            .lowered
            .outputs
            .iter()
            .map(|(s, d)| (s.clone(), d.name().to_string()))
            .collect()
    }

    /// Per output: the permutation that gives the graph's value from the output as returned
    /// (`output.permute(perm)`), or None for an output returned as the graph's value.
    #[getter]
    fn output_perms(&self) -> Vec<Option<Vec<i64>>> {
        self.compiled.lowered.output_perms.clone()
    }

    #[getter]
    fn input_types(&self) -> Vec<(Vec<i64>, String)> {
        self.compiled
            .lowered
            .inputs
            .iter()
            .map(|(s, d)| (s.clone(), d.name().to_string()))
            .collect()
    }

    /// The StableHLO module as text (printed from the bytecode that was compiled).
    #[getter]
    fn mlir(&self) -> PyResult<String> {
        self.compiled.lowered.text().map_err(lower_err)
    }

    /// The StableHLO module as text with its ops' source locations (`#loc` aliases after the
    /// module): what dumps write.
    #[getter]
    fn mlir_with_locations(&self) -> PyResult<String> {
        self.compiled
            .lowered
            .text_with_locations()
            .map_err(lower_err)
    }

    #[getter]
    fn key(&self) -> String {
        self.compiled.key.hex()
    }

    /// `"miss"` (PJRT compiled it), `"memory"` (this process had it) or `"disk"` (loaded from
    /// the persistent cache).
    #[getter]
    fn cache(&self) -> &'static str {
        match self.compiled.outcome {
            CacheOutcome::Miss => "miss",
            CacheOutcome::Memory => "memory",
            CacheOutcome::Disk => "disk",
        }
    }

    #[getter]
    fn lower_seconds(&self) -> f64 {
        self.compiled.lower_seconds
    }

    #[getter]
    fn compile_seconds(&self) -> f64 {
        self.compiled.compile_seconds
    }

    /// Whether XLA compiled its loop fusions unpartitioned (CPU plugin: small graphs, and
    /// graphs without convolutions up to a bound; `set_unpartitioned_max`).
    #[getter]
    fn unpartitioned(&self) -> bool {
        self.compiled.unpartitioned
    }

    /// The specialized (static-shape) IR that was lowered.
    #[getter]
    fn graph_text(&self) -> String {
        self.compiled.specialized.to_string()
    }

    /// The specialized graph as Graphviz DOT text, and its node count (inputs included).
    #[pyo3(signature = (title="", clusters=true, legend=true))]
    fn graph_dot(&self, title: &str, clusters: bool, legend: bool) -> (String, usize) {
        let g = &self.compiled.specialized;
        let emitted = Some(self.compiled.lowered.composites.as_slice());
        (
            graph_dot(g, title, (clusters, legend), emitted),
            g.dag.node_count(),
        )
    }

    /// How to assemble the graph's outputs, with sizes of this specialization filled in.
    fn output_plan(&self) -> Vec<(String, Option<String>)> {
        output_plan(&self.compiled.specialized)
    }

    fn optimized_hlo(&self) -> PyResult<Option<String>> {
        self.compiled.exe.optimized_hlo_text().map_err(pjrt_err)
    }
}

fn parse_precision(p: &str) -> PyResult<Precision> {
    Precision::parse(p)
        .ok_or_else(|| pyo3::exceptions::PyValueError::new_err(format!("bad precision {p:?}")))
}

fn open_cache(dir: PathBuf) -> PyResult<DiskCache> {
    DiskCache::open(&dir, None).map_err(cache_err)
}

/// `[(key, size bytes, last used unix seconds)]`, most recently used first.
#[pyfunction]
fn cache_list(dir: PathBuf) -> PyResult<Vec<(String, u64, f64)>> {
    let c = open_cache(dir)?;
    Ok(c.list()
        .map_err(cache_err)?
        .into_iter()
        .map(|e| {
            let t = e
                .last_used
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            (e.key, e.size, t)
        })
        .collect())
}

/// Verified entry details: `{"key", "path", "meta_bytes", "payload_bytes"}`; raises if bad.
#[pyfunction]
fn cache_info(dir: PathBuf, key: &str) -> PyResult<HashMap<String, String>> {
    let c = open_cache(dir)?;
    let (k, entry) = c.read_raw(key).map_err(cache_err)?;
    let mut m = HashMap::new();
    m.insert("key".into(), k.hex());
    m.insert("path".into(), c.entry_path(&k).display().to_string());
    m.insert("meta_bytes".into(), entry.meta.len().to_string());
    m.insert("payload_bytes".into(), entry.payload.len().to_string());
    Ok(m)
}

/// Verifies every entry, removing bad ones: `(good, [(path, reason)])`.
#[pyfunction]
fn cache_verify(dir: PathBuf) -> PyResult<(usize, Vec<(String, String)>)> {
    let (good, bad) = open_cache(dir)?.verify().map_err(cache_err)?;
    Ok((
        good,
        bad.into_iter()
            .map(|(p, r)| (p.display().to_string(), r))
            .collect(),
    ))
}

/// Evicts least recently used entries down to `max_bytes`: `{"removed", "freed_bytes", "kept",
/// "kept_bytes", "stale_temp_files"}`.
#[pyfunction]
fn cache_gc(dir: PathBuf, max_bytes: u64) -> PyResult<HashMap<String, u64>> {
    let r = open_cache(dir)?.gc(max_bytes).map_err(cache_err)?;
    Ok(HashMap::from([
        ("removed".to_string(), r.removed as u64),
        ("freed_bytes".to_string(), r.freed_bytes),
        ("kept".to_string(), r.kept as u64),
        ("kept_bytes".to_string(), r.kept_bytes),
        ("stale_temp_files".to_string(), r.stale_temp_files as u64),
    ]))
}

#[pyfunction]
fn cache_clear(dir: PathBuf) -> PyResult<usize> {
    open_cache(dir)?.clear().map_err(cache_err)
}

/// `(major, minor)` PJRT C API version of the plugin at `path`, loading it (once per process;
/// plugins are never unloaded) without creating a client (GIL released).
#[pyfunction]
fn plugin_api_version(py: Python<'_>, path: PathBuf) -> PyResult<(i32, i32)> {
    let plugin = crate::exit::detach(py, || tpuc_runtime::load_plugin(&path)).map_err(pjrt_err)?;
    Ok(plugin.api_version())
}

/// Live PJRT objects of this process: `{"buffers", "events", "executables"}` (leak tests).
#[pyfunction]
fn live_objects() -> HashMap<&'static str, usize> {
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
fn execute_spin_us(us: Option<u64>) -> u64 {
    if let Some(us) = us {
        tpuc_runtime::set_execute_spin(std::time::Duration::from_micros(us));
    }
    u64::try_from(tpuc_runtime::execute_spin().as_micros()).unwrap_or(u64::MAX)
}

#[pyfunction]
fn supported_ops() -> Vec<&'static str> {
    tpuc_compiler::lower::supported_ops()
}

/// Routes Rust logs: to stderr through `tracing-subscriber` when `TPUC_LOG` is set (its value is
/// the filter), else into Python's `logging` (loggers named after the Rust modules).
fn init_logging() {
    if let Ok(filter) = std::env::var("TPUC_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init();
    } else {
        let _ = pyo3_log::try_init();
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    m.add_class::<FxGraph>()?;
    m.add_class::<Runtime>()?;
    m.add_class::<Executable>()?;
    m.add_class::<DeviceBuffer>()?;
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
    m.add_function(wrap_pyfunction!(supported_ops, m)?)?;
    m.add_function(wrap_pyfunction!(live_objects, m)?)?;
    m.add_function(wrap_pyfunction!(plugin_api_version, m)?)?;
    m.add_function(wrap_pyfunction!(execute_spin_us, m)?)?;
    env::register(m)?;
    m.add_function(wrap_pyfunction!(cache_list, m)?)?;
    m.add_function(wrap_pyfunction!(cache_info, m)?)?;
    m.add_function(wrap_pyfunction!(cache_verify, m)?)?;
    m.add_function(wrap_pyfunction!(cache_gc, m)?)?;
    m.add_function(wrap_pyfunction!(cache_clear, m)?)?;
    m.add_function(wrap_pyfunction!(target::cache_entry_target, m)?)?;
    m.add_function(wrap_pyfunction!(target::cache_entry_report, m)?)?;
    let py = m.py();
    m.add("TpucError", py.get_type::<TpucError>())?;
    m.add("UnsupportedOpError", py.get_type::<UnsupportedOpError>())?;
    m.add("PjrtError", py.get_type::<PjrtError_>())?;
    m.add("GraphImportError", py.get_type::<GraphImportError>())?;
    m.add("ShardingError", py.get_type::<ShardingError>())?;
    Ok(())
}
