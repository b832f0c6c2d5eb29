//! Folding of small constants: algebraic identities whose constant operand is a literal or a
//! tensor filled with one value (`full`, `scalar_tensor`, `full_like`, `ones`, `zeros`, ...).
//! Each rewrite is exact in IEEE arithmetic and keeps the result type, and applies only when the
//! kept operand already has the result's type (so the constant did not broadcast or promote):
//!
//! | pattern | becomes | when |
//! |---|---|---|
//! | `x * 1`, `1 * x`, `x / 1` | `x` | any dtype |
//! | `x - 0` | `x` | `+0` or integer 0, no `alpha` other than 1 |
//! | `x + 0`, `0 + x` | `x` | integer or bool `x` (for floats `-0.0 + 0 = +0.0`) |
//! | `x ** 1` | `x` | |
//! | `x ** 2` | `x * x` | not bool (PyTorch and XLA both compute it as `x * x`) |
//! | `x & true`, `x and true`, `x \| false`, `x or false` | `x` | bool |
//! | `where(true, a, b)`, `where(false, a, b)` | `a`, `b` | |

use crate::rewrite::{output_nodes, replace_node, set_op, single_type};
use tpuc_frontend_fx::{Arg, DType, Graph, NodeId, ValueRef};

#[derive(Clone, Copy, Debug, PartialEq)]
enum K {
    Int(i64),
    Float(f64),
    Bool(bool),
}

impl K {
    fn of(a: &Arg) -> Option<K> {
        match a {
            Arg::Int(n) => Some(K::Int(*n)),
            Arg::Float(x) => Some(K::Float(*x)),
            Arg::Bool(b) => Some(K::Bool(*b)),
            _ => None,
        }
    }
    fn is_one(self) -> bool {
        matches!(self, K::Int(1) | K::Bool(true)) || self == K::Float(1.0)
    }
    /// Integer 0, false, or +0.0 (not -0.0).
    fn is_pos_zero(self) -> bool {
        match self {
            K::Int(n) => n == 0,
            K::Bool(b) => !b,
            K::Float(x) => x == 0.0 && x.is_sign_positive(),
        }
    }
    fn is_zero(self) -> bool {
        match self {
            K::Float(x) => x == 0.0,
            _ => self.is_pos_zero(),
        }
    }
    fn truth(self) -> Option<bool> {
        match self {
            K::Bool(b) => Some(b),
            _ => None,
        }
    }
}

/// The value of a constant operand: a literal, or a tensor every element of which is `K`.
fn constant(g: &Graph, a: Option<&Arg>) -> Option<K> {
    let a = a?;
    if let Some(k) = K::of(a) {
        return Some(k);
    }
    let Arg::Value(v) = a else { return None };
    let n = g.node(v.node);
    if n.results.len() != 1 {
        return None;
    }
    let base = n.op.strip_prefix("aten.")?.split('.').next()?;
    match base {
        "full" | "full_like" | "new_full" => K::of(n.args.get(1).or(n.kwargs.get("fill_value"))?),
        "scalar_tensor" => K::of(n.args.first()?),
        "ones" | "ones_like" | "new_ones" => Some(K::Int(1)),
        "zeros" | "zeros_like" | "new_zeros" => Some(K::Int(0)),
        _ => None,
    }
}

fn value(a: Option<&Arg>) -> Option<ValueRef> {
    match a {
        Some(Arg::Value(v)) => Some(*v),
        _ => None,
    }
}

fn is_int_or_bool(d: DType) -> bool {
    !d.is_float()
}

/// What a node folds to: the operand that replaces it, or the in-place rewrite `x ** 2 -> x * x`.
enum Fold {
    Replace(ValueRef),
    Square(ValueRef),
}

fn fold_of(g: &Graph, id: NodeId) -> Option<Fold> {
    let n = g.node(id);
    let ty = single_type(g, id)?;
    let arg = |i: usize, name: &str| n.args.get(i).or(n.kwargs.get(name));
    // `x` when it is a tensor value whose type is the result's type.
    let keep = |a: Option<&Arg>| value(a).filter(|v| g.value_type(*v) == Some(ty));
    let (base, overload) = n.op.strip_prefix("aten.")?.split_once('.')?;
    let alpha_one = || arg(2, "alpha").is_none_or(|a| K::of(a).is_some_and(K::is_one));
    let x = arg(0, "self");
    let y = arg(1, "other");
    let found = match (base, overload) {
        ("mul", "Tensor" | "Scalar") => {
            if constant(g, y).is_some_and(K::is_one) {
                keep(x)
            } else if constant(g, x).is_some_and(K::is_one) {
                keep(y)
            } else {
                None
            }
        }
        ("div", "Tensor" | "Scalar") if constant(g, y).is_some_and(K::is_one) => keep(x),
        ("sub", "Tensor" | "Scalar")
            if alpha_one() && constant(g, y).is_some_and(K::is_pos_zero) =>
        {
            keep(x)
        }
        ("add", "Tensor" | "Scalar") if is_int_or_bool(ty.dtype) => {
            if constant(g, y).is_some_and(K::is_zero) {
                keep(x)
            } else if alpha_one() && constant(g, x).is_some_and(K::is_zero) {
                keep(y)
            } else {
                None
            }
        }
        ("pow", "Tensor_Scalar") => match K::of(arg(1, "exponent")?)? {
            k if k.is_one() => keep(x),
            K::Int(2) | K::Float(2.0) if ty.dtype != DType::Bool => {
                return keep(x).map(Fold::Square);
            }
            _ => None,
        },
        ("bitwise_and" | "logical_and", _) if ty.dtype == DType::Bool => {
            if constant(g, y).and_then(K::truth) == Some(true) {
                keep(x)
            } else if constant(g, x).and_then(K::truth) == Some(true) {
                keep(y)
            } else {
                None
            }
        }
        ("bitwise_or" | "logical_or", _) if ty.dtype == DType::Bool => {
            if constant(g, y).and_then(K::truth) == Some(false) {
                keep(x)
            } else if constant(g, x).and_then(K::truth) == Some(false) {
                keep(y)
            } else {
                None
            }
        }
        ("where", "self") => match constant(g, arg(0, "condition")).and_then(K::truth) {
            Some(true) => keep(arg(1, "self")),
            Some(false) => keep(arg(2, "other")),
            None => None,
        },
        _ => None,
    };
    found.map(Fold::Replace)
}

/// Applies the identities above; returns the nodes it removed or rewrote.
pub fn fold_constants(g: &mut Graph) -> usize {
    let outputs = output_nodes(g);
    let mut changes = 0;
    for id in g.topo_order() {
        if !g.dag.contains_node(id) || g.node(id).is_input() {
            continue;
        }
        match fold_of(g, id) {
            Some(Fold::Replace(x)) if !outputs.contains(&id) => {
                replace_node(g, id, x);
                changes += 1;
            }
            Some(Fold::Square(x)) => {
                set_op(g, id, "aten.mul.Tensor", vec![Arg::Value(x), Arg::Value(x)]);
                changes += 1;
            }
            _ => {}
        }
    }
    tracing::debug!(changes, "fold_constants");
    changes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{graph, run_snapshot};

    #[test]
    fn exact_identities_fold() {
        let g = graph(
            &[("x", "[2, 3]"), ("i", "int64:[3]"), ("m", "bool:[2, 3]")],
            &[
                ("a", "aten.mul.Tensor", r#"[{"node": "x"}, 1.0]"#, "[2, 3]"),
                ("b", "aten.div.Tensor", r#"[{"node": "a"}, 1]"#, "[2, 3]"),
                ("c", "aten.sub.Tensor", r#"[{"node": "b"}, 0]"#, "[2, 3]"),
                (
                    "p",
                    "aten.pow.Tensor_Scalar",
                    r#"[{"node": "c"}, 2]"#,
                    "[2, 3]",
                ),
                (
                    "one",
                    "aten.pow.Tensor_Scalar",
                    r#"[{"node": "p"}, 1.0]"#,
                    "[2, 3]",
                ),
                ("j", "aten.add.Tensor", r#"[{"node": "i"}, 0]"#, "int64:[3]"),
                (
                    "t",
                    "aten.full.default",
                    r#"{"args": [[], true], "kwargs": {"dtype": {"dtype": "bool"}}}"#,
                    "bool:[]",
                ),
                (
                    "n",
                    "aten.bitwise_and.Tensor",
                    r#"[{"node": "t"}, {"node": "m"}]"#,
                    "bool:[2, 3]",
                ),
                (
                    "w",
                    "aten.where.self",
                    r#"[{"node": "n"}, {"node": "one"}, 0.0]"#,
                    "[2, 3]",
                ),
                (
                    "k",
                    "aten.mul.Tensor",
                    r#"[{"node": "j"}, {"node": "j"}]"#,
                    "int64:[3]",
                ),
            ],
            &["w", "k"],
        );
        insta::assert_snapshot!(run_snapshot(g, fold_constants));
    }

    #[test]
    fn inexact_or_type_changing_forms_stay() {
        let g = graph(
            &[("x", "[2, 3]"), ("i", "int64:[3]"), ("s", "[]")],
            &[
                // float x + 0.0 turns -0.0 into +0.0
                ("a", "aten.add.Tensor", r#"[{"node": "x"}, 0.0]"#, "[2, 3]"),
                // x - (-0.0) is x + 0.0
                ("b", "aten.sub.Tensor", r#"[{"node": "a"}, -0.0]"#, "[2, 3]"),
                // int * 1.0 promotes to float
                ("c", "aten.mul.Tensor", r#"[{"node": "i"}, 1.0]"#, "[3]"),
                // the ones tensor broadcasts the scalar up: the result is not s's type
                ("o", "aten.ones.default", r#"[[2, 3]]"#, "[2, 3]"),
                (
                    "d",
                    "aten.mul.Tensor",
                    r#"[{"node": "s"}, {"node": "o"}]"#,
                    "[2, 3]",
                ),
                ("e", "aten.mul.Tensor", r#"[{"node": "b"}, 2.0]"#, "[2, 3]"),
                // an output is never replaced
                ("f", "aten.mul.Tensor", r#"[{"node": "e"}, 1]"#, "[2, 3]"),
            ],
            &["c", "d", "f"],
        );
        insta::assert_snapshot!(run_snapshot(g, fold_constants));
    }
}
