//! `FxGraph`: an imported FX graph in Python's hands: importing it (from the FX graph module,
//! JSON or the IR's bytes), the cleanup passes (`tpuc_passes::run_named`) with their report,
//! and what Python reads of it (inputs, outputs, op counts, pictures).

use crate::errors::{GraphImportError, TpucError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use std::collections::HashMap;
use std::sync::Arc;
use tpuc_frontend_fx::{Dim, Graph, InputKind, Output};

/// An imported FX graph (symbolic shapes kept), after the cleanup passes.
#[pyclass(module = "tpuc._native", frozen)]
pub(crate) struct FxGraph {
    /// Shared with the executables compiled from it (a static graph is lowered as it is).
    pub(crate) graph: Arc<Graph>,
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
    let report = tpuc_passes::run_named(&mut g, enabled, texts)
        .into_iter()
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
        let walked = crate::fx_walk::walk(gm)?;
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

    /// This graph with `pairs` (input position, output position) as its written inputs: the
    /// caller overwrites each input with that output after a call (`Graph::written_inputs`;
    /// lowering aliases them where it can).
    fn with_written_inputs(&self, pairs: Vec<(usize, usize)>) -> FxGraph {
        let mut graph = (*self.graph).clone();
        graph.written_inputs = pairs.into_iter().collect();
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
        let walked = crate::fx_walk::walk(gm)?;
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
        tpuc_passes::fusion::graph_dot(&self.graph, title, (clusters, legend), None)
    }

    /// Ops of this graph that have no lowering rule: `[(op, node name)]`.
    fn unsupported_ops(&self) -> Vec<(String, String)> {
        tpuc_compiler::lower::unsupported_ops(&self.graph)
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

/// One entry per graph output: `("tensor", k)` (the k-th executable output), `("input", i)`
/// (graph input i returned unchanged: the caller's tensor itself), `("sym", expr)`, `("int", v)`
/// or `("none", None)`.
pub(crate) fn output_plan(g: &Graph) -> Vec<(String, Option<String>)> {
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

#[pyfunction]
pub(crate) fn supported_ops() -> Vec<&'static str> {
    tpuc_compiler::lower::supported_ops()
}
