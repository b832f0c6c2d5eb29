//! `Executable` (one compiled graph, run with host arrays or resident buffers) and
//! `DeviceBuffer` (a buffer kept on the device between calls). The per-call hot path is
//! `hot.rs`'s `CallPlan`; these are the general calls.

use crate::errors::{dtype, lower_err, pjrt_err, run_err, TpucError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use std::sync::Arc;
use tpuc_compiler::pipeline::{element_type, CacheOutcome, Compiled};
use tpuc_frontend_fx::DType;
use tpuc_passes::sharding::Spec;
use tpuc_runtime::{Buffer, HostArray, RunArg, Runner};

/// A buffer resident on the device (a parameter kept there between calls). On the CPU plugin it
/// aliases the host tensor, which the Python side keeps alive alongside it.
#[pyclass(module = "tpuc._native", frozen)]
pub(crate) struct DeviceBuffer {
    pub(crate) buffer: Buffer,
    /// Whether the buffer is the uploaded host memory itself (no copy was made).
    #[pyo3(get)]
    pub(crate) aliases_host: bool,
}

/// A `(ptr, nbytes, dtype, shape)` tuple as a host array.
pub(crate) fn host_array(t: &Bound<'_, PyTuple>) -> PyResult<HostArray> {
    let (ptr, nbytes, dt, shape): (usize, usize, String, Vec<i64>) = t.extract()?;
    Ok(HostArray {
        ptr,
        nbytes,
        element: element_type(dtype(&dt)?),
        shape,
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

/// A compiled graph for one static shape, with the runner that runs it.
#[pyclass(module = "tpuc._native", frozen)]
pub(crate) struct Executable {
    pub(crate) runner: Arc<Runner>,
    pub(crate) compiled: Arc<Compiled>,
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
        let runner = &self.runner;
        let compiled = &self.compiled;
        // SAFETY: the Python caller passes live, contiguous tensors' pointers (outputs freshly
        // allocated, so not aliasing inputs) and holds them for the duration of this call.
        crate::exit::detach(py, || unsafe {
            runner.run(&compiled.exe, &compiled.signature, &run_args, &outs)
        })
        .map_err(run_err)
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
        let (runner, compiled) = (&self.runner, &self.compiled);
        let (devices, shards) = compiled
            .shards()
            .ok_or_else(|| TpucError::new_err("executable is not sharded"))?;
        // SAFETY: the Python caller passes live, contiguous tensors' pointers (outputs freshly
        // allocated, so not aliasing inputs) and holds them for the duration of this call.
        crate::exit::detach(py, || unsafe {
            runner.run_sharded(
                &compiled.exe,
                &compiled.signature,
                devices,
                &shards,
                &run_args,
                &outs,
            )
        })
        .map_err(run_err)
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
            tpuc_runtime::runner::bare_execute_seconds(&exe, &bufs, n)
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

    /// (argument, result) of the module's `main` for each written input whose result reuses
    /// its buffer (`tf.aliasing_output`).
    #[getter]
    fn aliases(&self) -> Vec<(usize, usize)> {
        self.compiled.lowered.aliases.clone()
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
            tpuc_passes::fusion::graph_dot(g, title, (clusters, legend), emitted),
            g.dag.node_count(),
        )
    }

    /// How to assemble the graph's outputs, with sizes of this specialization filled in.
    fn output_plan(&self) -> Vec<(String, Option<String>)> {
        crate::graph::output_plan(&self.compiled.specialized)
    }

    fn optimized_hlo(&self) -> PyResult<Option<String>> {
        self.compiled.exe.optimized_hlo_text().map_err(pjrt_err)
    }
}
