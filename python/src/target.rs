//! `_native.Target`: compiling for devices this machine lacks (see `tpuc_compiler::target`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use tpuc_compiler::pipeline::{CacheOutcome, DiskCacheOptions};
use tpuc_compiler::target::{entry_report, entry_target, TargetCompiled, TargetEngine};

use crate::cache_files::open_cache;
use crate::errors::{cache_err, compile_err, no_panic, pjrt_err};
use crate::graph::FxGraph;
use crate::options::{create_options_of, parse_precision, sharding_request};

/// A compile-only target: one plugin topology (e.g. libtpu's `v5e:2x2`).
#[pyclass(module = "tpuc._native", frozen)]
pub(crate) struct Target {
    engine: Arc<TargetEngine>,
}

#[pymethods]
impl Target {
    /// `plugin_path`: the plugin that compiles for the devices; `topology`: its name for them;
    /// `name`: tpuc's name of the target (in reports and errors); `create_options`: the
    /// topology's options, as for `Runtime` (GIL released while the plugin loads).
    #[new]
    #[pyo3(signature = (plugin_path, topology, name, create_options=None))]
    fn new(
        py: Python<'_>,
        plugin_path: PathBuf,
        topology: String,
        name: String,
        create_options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Target> {
        let options = create_options_of(create_options)?;
        let engine = crate::exit::detach(py, || {
            TargetEngine::new(&plugin_path, &topology, &name, &options)
        })
        .map_err(pjrt_err)?;
        Ok(Target {
            engine: Arc::new(engine),
        })
    }

    #[getter]
    fn name(&self) -> String {
        self.engine.name().to_string()
    }

    #[getter]
    fn platform(&self) -> String {
        self.engine.platform().to_string()
    }

    #[getter]
    fn platform_version(&self) -> PyResult<String> {
        self.engine.platform_version().map_err(pjrt_err)
    }

    #[getter]
    fn device_count(&self) -> usize {
        self.engine.devices().len()
    }

    /// The plugin's name of the devices' kind (e.g. "TPU v5 lite").
    #[getter]
    fn device_kind(&self) -> String {
        self.engine
            .devices()
            .first()
            .map(|d| d.kind.clone())
            .unwrap_or_default()
    }

    /// Compiles one graph for the target (GIL released) and returns its report: `key`,
    /// `cache` ("miss" or "disk"), `target`, `devices`, `hbm_bytes` (`arguments`, `outputs`,
    /// `aliased`, `temporaries`, `code`, `peak`: per device), `cost` (the compiler's analysis),
    /// `flops`, `compile_seconds` (the target compiler's, when the entry was made),
    /// `lower_seconds`, `inputs` / `outputs` ([(shape, dtype)]) and, with `text`, `mlir`.
    #[pyo3(signature = (graph, bindings, precision, cache_dir=None, cache_max_bytes=None, sharding=None, text=false))]
    #[allow(clippy::too_many_arguments)]
    fn compile<'py>(
        &self,
        py: Python<'py>,
        graph: &FxGraph,
        bindings: HashMap<String, i64>,
        precision: &str,
        cache_dir: Option<PathBuf>,
        cache_max_bytes: Option<u64>,
        sharding: Option<&Bound<'_, PyDict>>,
        text: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let precision = parse_precision(precision)?;
        let disk = DiskCacheOptions {
            dir: cache_dir,
            max_bytes: cache_max_bytes,
        };
        let request = sharding.map(sharding_request).transpose()?;
        let engine = self.engine.clone();
        let compiled = crate::exit::detach(py, || {
            no_panic(|| engine.compile(&graph.graph, &bindings, precision, &disk, request.as_ref()))
        })?
        .map_err(compile_err)?;
        report_dict(py, &compiled, text)
    }

    /// The StableHLO text of `graph` lowered for the target's devices, without compiling it
    /// (GIL released): a `LowerError` names the op that has no lowering here.
    fn lower(
        &self,
        py: Python<'_>,
        graph: &FxGraph,
        bindings: HashMap<String, i64>,
        precision: &str,
    ) -> PyResult<String> {
        let precision = parse_precision(precision)?;
        let engine = self.engine.clone();
        let lowered = crate::exit::detach(py, || {
            no_panic(|| engine.lower(&graph.graph, &bindings, precision))
        })?
        .map_err(compile_err)?;
        lowered.text().map_err(compile_err_lower)
    }
}

fn report_dict<'py>(
    py: Python<'py>,
    c: &TargetCompiled,
    text: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let r = &c.report;
    let m = r.memory();
    let hbm = PyDict::new(py);
    for (k, v) in [
        ("arguments", m.arguments),
        ("outputs", m.outputs),
        ("aliased", m.aliased),
        ("temporaries", m.temporaries),
        ("code", m.code),
        ("peak", m.peak),
    ] {
        hbm.set_item(k, v)?;
    }
    let cost = PyDict::new(py);
    for (k, v) in &r.cost {
        cost.set_item(k, v)?;
    }
    let dtype_names = |sig: &[(Vec<i64>, tpuc_frontend_fx::DType)]| {
        sig.iter()
            .map(|(s, t)| (s.clone(), t.name().to_string()))
            .collect::<Vec<_>>()
    };
    d.set_item("key", c.key.hex())?;
    d.set_item(
        "cache",
        match c.outcome {
            CacheOutcome::Miss => "miss",
            CacheOutcome::Memory => "memory",
            CacheOutcome::Disk => "disk",
        },
    )?;
    d.set_item("target", &r.target)?;
    d.set_item("devices", r.devices)?;
    d.set_item("footprint_bytes", m.footprint())?;
    d.set_item("hbm_bytes", hbm)?;
    d.set_item(
        "flops",
        r.cost.iter().find(|(k, _)| k == "flops").map(|c| c.1),
    )?;
    d.set_item("cost", cost)?;
    d.set_item("compile_seconds", r.compile_seconds)?;
    d.set_item("lower_seconds", c.lower_seconds)?;
    d.set_item("inputs", dtype_names(&c.lowered.inputs))?;
    d.set_item("outputs", dtype_names(&c.lowered.outputs))?;
    let sharding = c.lowered.sharding.as_ref().map(|p| {
        (
            p.mesh.shape.clone(),
            p.mesh.axes.clone(),
            p.inputs.iter().map(|s| s.0.clone()).collect::<Vec<_>>(),
            p.outputs.iter().map(|s| s.0.clone()).collect::<Vec<_>>(),
        )
    });
    d.set_item("sharding", sharding)?;
    if text {
        d.set_item("mlir", c.lowered.text().map_err(compile_err_lower)?)?;
    }
    Ok(d)
}

fn compile_err_lower(e: tpuc_compiler::lower::LowerError) -> PyErr {
    compile_err(e.into())
}

/// What the cache entry `key` in `dir` was compiled for (`tpu:v5e:2x2`, or the platform it
/// was compiled on, e.g. `cpu`), or None when its metadata is unreadable.
#[pyfunction]
pub(crate) fn cache_entry_target(dir: PathBuf, key: &str) -> PyResult<Option<String>> {
    let (_, entry) = open_cache(dir)?.peek_raw(key).map_err(cache_err)?;
    Ok(entry_target(&entry.meta))
}

/// The stored target report of cache entry `key` (`{"target", "devices", "hbm_bytes"...}` as
/// `Target.compile` returns them, without `key`/`cache`/`lower_seconds`), or None.
#[pyfunction]
pub(crate) fn cache_entry_report(
    py: Python<'_>,
    dir: PathBuf,
    key: &str,
) -> PyResult<Option<HashMap<String, Py<PyAny>>>> {
    let (_, entry) = open_cache(dir)?.peek_raw(key).map_err(cache_err)?;
    let Some(r) = entry_report(&entry.meta) else {
        return Ok(None);
    };
    let m = r.memory();
    let mut out: HashMap<String, Py<PyAny>> = HashMap::new();
    out.insert(
        "target".into(),
        r.target.clone().into_pyobject(py)?.into_any().unbind(),
    );
    out.insert(
        "devices".into(),
        r.devices.into_pyobject(py)?.into_any().unbind(),
    );
    out.insert(
        "footprint_bytes".into(),
        m.footprint().into_pyobject(py)?.into_any().unbind(),
    );
    out.insert(
        "compile_seconds".into(),
        r.compile_seconds.into_pyobject(py)?.into_any().unbind(),
    );
    Ok(Some(out))
}
