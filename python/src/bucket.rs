//! Python face of the bucketing pass (`tpuc_passes::bucket`): the static graph for one bucket,
//! and per call the real sizes the caller pads inputs to, passes as scalars and slices outputs by.

use crate::errors::{no_panic, TpucError, UnsupportedOpError};
use crate::graph::FxGraph;
use pyo3::prelude::*;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use tpuc_frontend_fx::SymExpr;
use tpuc_passes::{Bucketed, Layout};

/// Per dim, per atom: `(padded size, real size)` at the given real symbol values.
type Sizes = Vec<Vec<(i64, i64)>>;

#[pyclass(module = "tpuc._native", frozen)]
pub struct BucketedGraph {
    b: Bucketed,
}

fn eval(e: &SymExpr, bindings: &HashMap<String, i64>) -> PyResult<i64> {
    e.eval(bindings)
        .map_err(|err| TpucError::new_err(err.to_string()))
}

fn sizes(l: &Layout, bindings: &HashMap<String, i64>) -> PyResult<Sizes> {
    l.iter()
        .map(|d| {
            d.iter()
                .map(|a| {
                    let real = match &a.real {
                        None => a.size,
                        Some(r) => eval(r, bindings)?,
                    };
                    Ok((a.size, real))
                })
                .collect()
        })
        .collect()
}

#[pymethods]
impl BucketedGraph {
    /// The static graph to compile (no bindings needed).
    #[getter]
    fn graph(&self) -> FxGraph {
        FxGraph {
            graph: Arc::new(self.b.graph.clone()),
        }
    }

    /// The runtime scalar inputs, as expressions over the symbols.
    fn scalar_exprs(&self) -> Vec<String> {
        self.b.scalars.iter().map(|e| e.to_string()).collect()
    }

    /// Values of the scalar inputs for the real sizes in `bindings`.
    fn scalar_values(&self, bindings: HashMap<String, i64>) -> PyResult<Vec<i64>> {
        self.b.scalars.iter().map(|e| eval(e, &bindings)).collect()
    }

    /// Per graph input: None (SymInt input) or its atoms as `(padded, real)` per dim.
    fn input_sizes(&self, bindings: HashMap<String, i64>) -> PyResult<Vec<Option<Sizes>>> {
        self.b
            .input_layouts
            .iter()
            .map(|l| l.as_ref().map(|l| sizes(l, &bindings)).transpose())
            .collect()
    }

    /// Per tensor output of the executable: its atoms as `(padded, real)` per dim.
    fn output_sizes(&self, bindings: HashMap<String, i64>) -> PyResult<Vec<Sizes>> {
        self.b
            .output_layouts
            .iter()
            .map(|l| sizes(l, &bindings))
            .collect()
    }
}

/// Pads `graph` to a bucket: `dynamic` names the padded symbols, `sizes` binds them to their
/// bucket sizes and every other symbol to its real value. Raises UnsupportedOpError (with `op`
/// and `node`) for an op the pass cannot make exact.
#[pyfunction]
pub fn bucket_graph(
    py: Python<'_>,
    graph: &FxGraph,
    dynamic: Vec<String>,
    sizes: HashMap<String, i64>,
) -> PyResult<BucketedGraph> {
    let dynamic: HashSet<String> = dynamic.into_iter().collect();
    match crate::exit::detach(py, || {
        no_panic(|| tpuc_passes::bucket(&graph.graph, &dynamic, &sizes))
    })? {
        Ok(b) => Ok(BucketedGraph { b }),
        Err(e) => {
            let err = UnsupportedOpError::new_err(e.to_string());
            let value = err.value(py);
            value.setattr("op", e.op.clone())?;
            value.setattr("node", e.node.clone())?;
            Err(err)
        }
    }
}

/// Evaluates a symbolic size expression (a graph's `("sym", expr)` output) at `bindings`.
#[pyfunction]
pub fn eval_sym(expr: &str, bindings: HashMap<String, i64>) -> PyResult<i64> {
    let e = SymExpr::parse(expr).map_err(|err| TpucError::new_err(err.to_string()))?;
    eval(&e, &bindings)
}
