//! FX (wire format) -> IR. One pass over the nodes in FX order, which is topological.

use crate::graph::{Arg, Graph, Input, InputKind, Node, Output, TensorType, ValueRef};
use crate::wire::{FxArg, FxGraph, FxMeta, FxNode};
use crate::SymExpr;
use rustc_hash::FxHashMap as HashMap;
use std::collections::BTreeMap;

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("cannot read the FX graph: {0}")]
    Json(#[from] serde_json::Error),
    #[error("node `{node}` (op `{op}`): {reason}")]
    Node {
        node: String,
        op: String,
        reason: String,
    },
}

impl ImportError {
    fn at(n: &FxNode, reason: impl Into<String>) -> ImportError {
        ImportError::Node {
            node: n.name.clone(),
            op: if n.target.is_empty() {
                n.op.clone()
            } else {
                n.target.clone()
            },
            reason: reason.into(),
        }
    }
}

pub fn import_json(json: &str) -> Result<Graph, ImportError> {
    let fx: FxGraph = serde_json::from_str(json)?;
    import(&fx)
}

/// What an FX node name stands for once imported.
#[derive(Clone)]
enum Binding {
    /// A node with one or more results (tuple-valued nodes are read through getitem).
    Node(crate::NodeId),
    /// A getitem of a tuple-valued node, or a non-tensor value folded into an argument.
    Arg(Arg),
}

pub fn import(fx: &FxGraph) -> Result<Graph, ImportError> {
    let mut g = Graph::default();
    let mut env: HashMap<&str, Binding> = HashMap::default();
    let mut saw_output = false;

    for n in &fx.nodes {
        match n.op.as_str() {
            "placeholder" => {
                let (kind, binding) = match &n.val {
                    Some(FxMeta::Tensor { shape, dtype }) => {
                        let ty = TensorType {
                            shape: shape.clone(),
                            dtype: *dtype,
                        };
                        let id = g.add_node(Node {
                            name: n.name.clone(),
                            op: Node::INPUT.into(),
                            args: vec![],
                            kwargs: BTreeMap::new(),
                            results: vec![Some(ty.clone())],
                            loc: None,
                            recomputed: false,
                        });
                        (InputKind::Tensor(ty), Binding::Node(id))
                    }
                    Some(FxMeta::Symint(e)) => {
                        (InputKind::SymInt(e.clone()), Binding::Arg(Arg::Sym(e.clone())))
                    }
                    Some(FxMeta::Int(i)) => (
                        InputKind::SymInt(SymExpr::parse(&i.to_string()).expect("an integer parses")),
                        Binding::Arg(Arg::Int(*i)),
                    ),
                    other => {
                        return Err(ImportError::at(
                            n,
                            format!("graph input must be a tensor or a SymInt, got {other:?}"),
                        ))
                    }
                };
                let node = match binding {
                    Binding::Node(id) => Some(id),
                    Binding::Arg(_) => None,
                };
                g.inputs.push(Input {
                    name: n.name.clone(),
                    kind,
                    node,
                });
                env.insert(&n.name, binding);
            }
            "get_attr" => {
                // A nested graph (a control-flow op's branch or body): imported on its own,
                // named by the ops that run it.
                let sub = fx.subgraphs.get(&n.name).ok_or_else(|| {
                    ImportError::at(n, "get_attr of something that is not a graph")
                })?;
                let region = import(sub).map_err(|e| {
                    ImportError::at(n, format!("in the graph it names: {e}"))
                })?;
                g.regions.push(region);
                env.insert(&n.name, Binding::Arg(Arg::Region(g.regions.len() - 1)));
            }
            "call_function" => {
                let binding = import_call(&mut g, &env, n)?;
                env.insert(&n.name, binding);
            }
            "output" => {
                let items = match n.args.first() {
                    Some(FxArg::List(items)) => items.clone(),
                    Some(single) => vec![single.clone()],
                    None => vec![],
                };
                for item in &items {
                    let out = match convert_arg(&g, &env, n, item)? {
                        Arg::Value(v) => match g.inputs.iter().position(|i| i.node == Some(v.node)) {
                            Some(k) => Output::Input(k),
                            None => Output::Value(v),
                        },
                        Arg::Sym(s) => Output::Sym(s),
                        Arg::Int(i) => Output::Int(i),
                        Arg::None => Output::None,
                        other => {
                            return Err(ImportError::at(
                                n,
                                format!("unsupported graph output {other:?}"),
                            ))
                        }
                    };
                    g.outputs.push(out);
                }
                saw_output = true;
            }
            other => {
                return Err(ImportError::at(
                    n,
                    format!("FX node kind `{other}` is not supported (expected placeholder, get_attr, call_function or output)"),
                ))
            }
        }
    }
    if !saw_output {
        return Err(ImportError::Node {
            node: "<graph>".into(),
            op: "output".into(),
            reason: "the graph has no output node".into(),
        });
    }
    Ok(g)
}

/// The prefix of control-flow ops (`higher_order.cond`, `higher_order.scan` ...): PyTorch's
/// higher-order operators, whose graph arguments are [`Arg::Region`]s.
pub const HIGHER_ORDER: &str = "higher_order.";

fn is_getitem(target: &str) -> bool {
    target == "<built-in function getitem>" || target == "getitem" || target == "operator.getitem"
}

fn import_call<'a>(
    g: &mut Graph,
    env: &HashMap<&'a str, Binding>,
    n: &'a FxNode,
) -> Result<Binding, ImportError> {
    // Size arithmetic (sym_size, operator.mul, ...) folds into the arguments that use it.
    match &n.val {
        Some(FxMeta::Symint(e)) => return Ok(Binding::Arg(Arg::Sym(e.clone()))),
        Some(FxMeta::Int(i)) => return Ok(Binding::Arg(Arg::Int(*i))),
        Some(FxMeta::Float(x)) => return Ok(Binding::Arg(Arg::Float(*x))),
        _ => {}
    }
    if is_getitem(&n.target) {
        let (src, idx) = match n.args.as_slice() {
            [FxArg::Node { node }, FxArg::Int(i)] => (node, *i),
            _ => return Err(ImportError::at(n, "getitem expects (node, index)")),
        };
        let Some(Binding::Node(id)) = env.get(src.as_str()) else {
            return Err(ImportError::at(
                n,
                format!("getitem of `{src}`, which is not an op with results"),
            ));
        };
        let nres = g.node(*id).results.len();
        if idx < 0 || idx as usize >= nres {
            return Err(ImportError::at(
                n,
                format!("getitem index {idx} out of range for `{src}` with {nres} results"),
            ));
        }
        return Ok(Binding::Arg(Arg::Value(ValueRef {
            node: *id,
            result: idx as usize,
        })));
    }
    if !(n.target.starts_with("aten.")
        || n.target.starts_with("prims.")
        || n.target.starts_with(HIGHER_ORDER))
    {
        return Err(ImportError::at(
            n,
            "only core ATen / prims ops can be imported (is the graph from AOTAutograd with core ATen decompositions?)",
        ));
    }
    let results = match &n.val {
        Some(FxMeta::Tensor { shape, dtype }) => vec![Some(TensorType {
            shape: shape.clone(),
            dtype: *dtype,
        })],
        Some(FxMeta::Tuple(items)) => items
            .iter()
            .map(|m| match m {
                Some(FxMeta::Tensor { shape, dtype }) => Some(TensorType {
                    shape: shape.clone(),
                    dtype: *dtype,
                }),
                _ => None,
            })
            .collect(),
        other => {
            return Err(ImportError::at(
                n,
                format!("expected tensor metadata (meta['val']), got {other:?}"),
            ))
        }
    };
    let args = n
        .args
        .iter()
        .map(|a| convert_arg(g, env, n, a))
        .collect::<Result<Vec<_>, _>>()?;
    let kwargs = n
        .kwargs
        .iter()
        .map(|(k, a)| Ok((k.clone(), convert_arg(g, env, n, a)?)))
        .collect::<Result<BTreeMap<_, _>, ImportError>>()?;
    let id = g.add_node(Node {
        name: n.name.clone(),
        op: n.target.clone(),
        args,
        kwargs,
        results,
        loc: n.loc.clone().map(Box::new),
        recomputed: n.recomputed,
    });
    Ok(Binding::Node(id))
}

fn convert_arg(
    g: &Graph,
    env: &HashMap<&str, Binding>,
    n: &FxNode,
    a: &FxArg,
) -> Result<Arg, ImportError> {
    Ok(match a {
        FxArg::Null => Arg::None,
        FxArg::Bool(b) => Arg::Bool(*b),
        FxArg::Int(i) => Arg::Int(*i),
        FxArg::Float(x) => Arg::Float(*x),
        FxArg::Str(s) => Arg::Str(s.clone()),
        FxArg::DType { dtype } => Arg::DType(*dtype),
        FxArg::Device { device } => Arg::Device(device.clone()),
        FxArg::Other { other } => Arg::Str(other.clone()),
        FxArg::SpecialFloat { float } => Arg::Float(match float.as_str() {
            "inf" => f64::INFINITY,
            "-inf" => f64::NEG_INFINITY,
            "nan" => f64::NAN,
            s => return Err(ImportError::at(n, format!("bad float literal `{s}`"))),
        }),
        FxArg::List(items) => Arg::List(
            items
                .iter()
                .map(|i| convert_arg(g, env, n, i))
                .collect::<Result<_, _>>()?,
        ),
        FxArg::Node { node } => match env.get(node.as_str()) {
            Some(Binding::Arg(a)) => a.clone(),
            Some(Binding::Node(id)) => {
                if g.node(*id).results.len() != 1 {
                    return Err(ImportError::at(
                        n,
                        format!("uses tuple-valued `{node}` without getitem"),
                    ));
                }
                Arg::Value(ValueRef {
                    node: *id,
                    result: 0,
                })
            }
            None => {
                return Err(ImportError::at(
                    n,
                    format!("refers to `{node}`, which is not defined before it"),
                ))
            }
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MLP: &str = r#"{"nodes": [
      {"name": "x", "op": "placeholder", "target": "x", "val": {"tensor": {"shape": ["s0", 4], "dtype": "float32"}}},
      {"name": "w", "op": "placeholder", "target": "w", "val": {"tensor": {"shape": [4, 3], "dtype": "float32"}}},
      {"name": "s", "op": "placeholder", "target": "s", "val": {"symint": "s0"}},
      {"name": "mm", "op": "call_function", "target": "aten.mm.default", "args": [{"node": "x"}, {"node": "w"}], "val": {"tensor": {"shape": ["s0", 3], "dtype": "float32"}}},
      {"name": "ln", "op": "call_function", "target": "aten.native_layer_norm.default", "args": [{"node": "mm"}, [3], null, null, 1e-5],
       "val": {"tuple": [{"tensor": {"shape": ["s0", 3], "dtype": "float32"}}, {"tensor": {"shape": ["s0", 1], "dtype": "float32"}}, {"tensor": {"shape": ["s0", 1], "dtype": "float32"}}]}},
      {"name": "g0", "op": "call_function", "target": "<built-in function getitem>", "args": [{"node": "ln"}, 0], "val": {"tensor": {"shape": ["s0", 3], "dtype": "float32"}}},
      {"name": "m", "op": "call_function", "target": "<built-in function mul>", "args": [{"node": "s"}, 3], "val": {"symint": "3*s0"}},
      {"name": "v", "op": "call_function", "target": "aten.view.default", "args": [{"node": "g0"}, [{"node": "m"}]], "val": {"tensor": {"shape": ["3*s0"], "dtype": "float32"}}},
      {"name": "output", "op": "output", "target": "output", "args": [[{"node": "v"}, {"node": "s"}, null]]}
    ]}"#;

    #[test]
    fn imports_ops_getitem_and_symbolic_sizes() {
        let g = import_json(MLP).unwrap();
        assert_eq!(g.inputs.len(), 3);
        assert!(matches!(g.inputs[2].kind, InputKind::SymInt(_)));
        assert_eq!(g.op_count(), 3);
        let text = g.to_string();
        assert!(
            text.contains("aten.view.default(%ln#0, [sym(3*s0)])"),
            "{text}"
        );
        assert!(matches!(g.outputs[1], Output::Sym(_)));
        assert!(matches!(g.outputs[2], Output::None));
    }

    #[test]
    fn rejects_non_aten_targets_naming_the_node() {
        let json = r#"{"nodes": [
          {"name": "x", "op": "placeholder", "val": {"tensor": {"shape": [2], "dtype": "float32"}}},
          {"name": "weird", "op": "call_function", "target": "my_lib.op", "args": [{"node": "x"}], "val": {"tensor": {"shape": [2], "dtype": "float32"}}},
          {"name": "output", "op": "output", "args": [[{"node": "weird"}]]}]}"#;
        let err = import_json(json).unwrap_err().to_string();
        assert!(err.contains("weird") && err.contains("my_lib.op"), "{err}");
    }

    #[test]
    fn rejects_forward_references() {
        let json = r#"{"nodes": [
          {"name": "a", "op": "call_function", "target": "aten.neg.default", "args": [{"node": "b"}], "val": {"tensor": {"shape": [2], "dtype": "float32"}}},
          {"name": "output", "op": "output", "args": [[{"node": "a"}]]}]}"#;
        let err = import_json(json).unwrap_err().to_string();
        assert!(err.contains("not defined"), "{err}");
    }
}
