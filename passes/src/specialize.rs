//! Specialization: substitute concrete sizes for the symbols of a symbolic graph, giving the
//! static graph that lowering needs. The symbolic graph is kept; each concrete shape gets its own
//! specialized copy (and executable) without a new trace.

use std::borrow::Cow;
use std::collections::HashMap;
use tpuc_frontend_fx::{Arg, Dim, Graph, InputKind, Output, SymbolError, TensorType};

#[derive(Debug, thiserror::Error)]
pub enum SpecializeError {
    #[error("{0}")]
    Symbol(#[from] SymbolError),
    #[error("input `{input}` dim {dim}: the graph was traced with `{expected}` = {bound}, the call passes {actual}")]
    Mismatch {
        input: String,
        dim: usize,
        expected: String,
        bound: i64,
        actual: i64,
    },
    #[error("input `{input}`: expected rank {expected}, got {actual}")]
    Rank {
        input: String,
        expected: usize,
        actual: usize,
    },
}

/// The value of every symbol, read off the concrete input shapes (for tensor inputs) and the
/// SymInt inputs. `shapes[i]` is the shape of input `i` (ignored for SymInt inputs);
/// `ints[i]` the value of SymInt input `i`.
pub fn bindings_from_inputs(
    g: &Graph,
    shapes: &[Vec<i64>],
    ints: &[Option<i64>],
) -> Result<HashMap<String, i64>, SpecializeError> {
    let mut b = HashMap::new();
    for (i, inp) in g.inputs.iter().enumerate() {
        match &inp.kind {
            InputKind::Tensor(t) => {
                let Some(shape) = shapes.get(i) else { continue };
                if shape.len() != t.rank() {
                    return Err(SpecializeError::Rank {
                        input: inp.name.clone(),
                        expected: t.rank(),
                        actual: shape.len(),
                    });
                }
                for (dim, (d, &n)) in t.shape.iter().zip(shape).enumerate() {
                    if let Dim::Sym(e) = d {
                        if let Some(s) = e.as_symbol() {
                            b.insert(s.to_string(), n);
                        }
                    } else if d.as_static() != Some(n) {
                        return Err(SpecializeError::Mismatch {
                            input: inp.name.clone(),
                            dim,
                            expected: d.to_string(),
                            bound: d.as_static().unwrap_or(-1),
                            actual: n,
                        });
                    }
                }
            }
            InputKind::SymInt(e) => {
                if let (Some(s), Some(Some(v))) = (e.as_symbol(), ints.get(i)) {
                    b.insert(s.to_string(), *v);
                }
            }
        }
    }
    Ok(b)
}

/// Replaces `t`'s symbolic dims by their values, in place (static dims stay as they are).
fn ty(t: &mut TensorType, b: &HashMap<String, i64>) -> Result<(), SymbolError> {
    for d in t.shape.iter_mut() {
        if let Dim::Sym(e) = d {
            *d = Dim::Static(e.eval(b)?);
        }
    }
    Ok(())
}

/// Replaces the symbolic sizes in `a` by their values, in place.
fn arg(a: &mut Arg, b: &HashMap<String, i64>) -> Result<(), SymbolError> {
    match a {
        Arg::Sym(e) => *a = Arg::Int(e.eval(b)?),
        Arg::List(items) => items.iter_mut().try_for_each(|i| arg(i, b))?,
        _ => {}
    }
    Ok(())
}

/// `g` with every symbolic dim and size argument replaced by its value: a copy where it has
/// any, else `g` itself (a static graph, most of them: no copy to make and drop).
pub fn specialize<'g>(
    g: &'g Graph,
    b: &HashMap<String, i64>,
) -> Result<Cow<'g, Graph>, SpecializeError> {
    if !is_symbolic(g) {
        return Ok(Cow::Borrowed(g));
    }
    let mut out = g.clone();
    specialize_in_place(&mut out, b)?;
    Ok(Cow::Owned(out))
}

/// [`specialize`] on `out` itself, its control-flow regions included (they share the graph's
/// symbols: PyTorch traced them with the same shape environment).
fn specialize_in_place(out: &mut Graph, b: &HashMap<String, i64>) -> Result<(), SpecializeError> {
    for r in out.regions.iter_mut() {
        specialize_in_place(r, b)?;
    }
    for n in out.dag.node_weights_mut() {
        for r in n.results.iter_mut().flatten() {
            ty(r, b)?;
        }
        for a in n.args.iter_mut().chain(n.kwargs.values_mut()) {
            arg(a, b)?;
        }
    }
    for inp in out.inputs.iter_mut() {
        if let InputKind::Tensor(t) = &mut inp.kind {
            ty(t, b)?;
        }
    }
    for o in out.outputs.iter_mut() {
        if let Output::Sym(e) = o {
            *o = Output::Int(e.eval(b)?);
        }
    }
    Ok(())
}

/// Whether any dim, size argument, tensor input or output of `g` is symbolic (what
/// [`specialize`] rewrites; SymInt inputs stay).
fn is_symbolic(g: &Graph) -> bool {
    fn sym_ty(t: &TensorType) -> bool {
        t.shape.iter().any(|d| matches!(d, Dim::Sym(_)))
    }
    fn sym_arg(a: &Arg) -> bool {
        match a {
            Arg::Sym(_) => true,
            Arg::List(items) => items.iter().any(sym_arg),
            _ => false,
        }
    }
    g.dag.node_weights().any(|n| {
        n.results.iter().flatten().any(sym_ty)
            || n.args.iter().chain(n.kwargs.values()).any(sym_arg)
    }) || g
        .inputs
        .iter()
        .any(|i| matches!(&i.kind, InputKind::Tensor(t) if sym_ty(t)))
        || g.outputs.iter().any(|o| matches!(o, Output::Sym(_)))
        || g.regions.iter().any(is_symbolic)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tpuc_frontend_fx::import_json;

    const G: &str = r#"{"nodes": [
      {"name": "x", "op": "placeholder", "val": {"tensor": {"shape": ["s0", 4], "dtype": "float32"}}},
      {"name": "v", "op": "call_function", "target": "aten.view.default", "args": [{"node": "x"}, [{"node": "m"}]], "val": {"tensor": {"shape": ["4*s0"], "dtype": "float32"}}},
      {"name": "output", "op": "output", "args": [[{"node": "v"}]]}]}"#;

    #[test]
    fn binds_and_substitutes_sizes() {
        let g = G.replace(r#"[{"node": "m"}]"#, r#"[-1]"#);
        let g = import_json(&g).unwrap();
        let b = bindings_from_inputs(&g, &[vec![3, 4]], &[None]).unwrap();
        assert_eq!(b["s0"], 3);
        let s = specialize(&g, &b).unwrap();
        assert!(
            s.to_string().contains("f32[12]") || s.to_string().contains("float32[12]"),
            "{s}"
        );
    }

    #[test]
    fn rejects_static_dim_mismatch() {
        let g = G.replace(r#"[{"node": "m"}]"#, r#"[-1]"#);
        let g = import_json(&g).unwrap();
        let e = bindings_from_inputs(&g, &[vec![3, 5]], &[None]).unwrap_err();
        assert!(e.to_string().contains("dim 1"), "{e}");
    }

    #[test]
    fn substitutes_sizes_inside_control_flow_graphs() {
        let g = r#"{"nodes": [
          {"name": "x", "op": "placeholder", "val": {"tensor": {"shape": ["s0", 4], "dtype": "float32"}}},
          {"name": "n", "op": "placeholder", "val": {"symint": "s0"}},
          {"name": "body", "op": "get_attr", "target": "body"},
          {"name": "m", "op": "call_function", "target": "higher_order.map_impl", "args": [{"node": "body"}, [{"node": "x"}], [{"node": "n"}]], "val": {"tuple": [{"tensor": {"shape": ["s0", 4], "dtype": "float32"}}]}},
          {"name": "r", "op": "call_function", "target": "<built-in function getitem>", "args": [{"node": "m"}, 0], "val": {"tensor": {"shape": ["s0", 4], "dtype": "float32"}}},
          {"name": "output", "op": "output", "args": [[{"node": "r"}]]}],
         "subgraphs": {"body": {"nodes": [
          {"name": "a", "op": "placeholder", "val": {"tensor": {"shape": [4], "dtype": "float32"}}},
          {"name": "k", "op": "placeholder", "val": {"symint": "s0"}},
          {"name": "v", "op": "call_function", "target": "aten.view.default", "args": [{"node": "a"}, [2, 2]], "val": {"tensor": {"shape": [2, 2], "dtype": "float32"}}},
          {"name": "e", "op": "call_function", "target": "aten.expand.default", "args": [{"node": "v"}, [{"node": "k"}, 2, 2]], "val": {"tensor": {"shape": ["s0", 2, 2], "dtype": "float32"}}},
          {"name": "s", "op": "call_function", "target": "aten.sum.dim_IntList", "args": [{"node": "e"}, [0, 1]], "val": {"tensor": {"shape": [2], "dtype": "float32"}}},
          {"name": "output", "op": "output", "args": [[{"node": "a"}]]}]}}}"#;
        let g = import_json(g).unwrap();
        assert_eq!(g.regions.len(), 1);
        let b = bindings_from_inputs(&g, &[vec![3, 4]], &[None, None]).unwrap();
        let s = specialize(&g, &b).unwrap();
        let text = s.regions[0].to_string();
        assert!(text.contains("[3, 2, 2]") && !text.contains("s0"), "{text}");
        assert!(s.to_string().contains("region 0(%a, %k)"), "{s}");
    }
}
