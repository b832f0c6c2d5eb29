//! Folding of view chains: `view(view(x))` -> `view(x)` (also through unsqueeze, squeeze,
//! flatten, unflatten, reshape, `_unsafe_view`), `permute(permute(x))` -> `permute(x)`,
//! `expand(expand(x))` -> `expand(x)`, and removal of no-ops: a view, permute or expand whose
//! result has its operand's type and order, and the value-semantics identities `clone`, `alias`,
//! `detach`, `lift_fresh_copy` (in the functional IR they only copy).
//!
//! Also `index(x, [i0, i1, ...])` where each `ik` is a full `arange(0, x.shape[k])` viewed so its
//! one non-unit dim sits at increasing positions (how masks index `x[batch, pos]` by broadcast
//! aranges) is `view(x, result shape)`: the gather reads x in its own order.
//!
//! A folded view is written as `aten.view.default(x, shape)` with the shape read off its own
//! result type, so symbolic sizes stay symbolic; lowering reads only the result type of a view.

use crate::rewrite::{
    as_value, output_nodes, replace_node, set_arg, set_op, shape_arg, single_type,
};
use tpuc_frontend_fx::{Arg, DType, Dim, Graph, NodeId, ValueRef};

/// Ops that reshape without moving elements (all lower to one `stablehlo.reshape` of the
/// operand to the result type).
const VIEWS: &[&str] = &[
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.reshape.default",
    "aten.view_copy.default",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.squeeze.dims",
    "aten.squeeze.default",
    "aten.flatten.using_ints",
    "aten.unflatten.int",
];

/// Ops that return their (first) operand unchanged in value semantics.
const IDENTITIES: &[&str] = &[
    "aten.clone.default",
    "aten.alias.default",
    "aten.detach.default",
    "aten.lift_fresh_copy.default",
];

const PERMUTES: &[&str] = &["aten.permute.default", "aten.permute_copy.default"];

fn ints(a: Option<&Arg>) -> Option<Vec<i64>> {
    match a {
        Some(Arg::List(items)) => items
            .iter()
            .map(|i| match i {
                Arg::Int(n) => Some(*n),
                _ => None,
            })
            .collect(),
        _ => None,
    }
}

/// A permutation with negative dims normalized, or None when it is not one.
fn perm_of(g: &Graph, id: NodeId) -> Option<Vec<usize>> {
    let n = g.node(id);
    let rank = single_type(g, id)?.rank() as i64;
    let p: Vec<usize> = ints(n.args.get(1))?
        .into_iter()
        .map(|d| if d < 0 { d + rank } else { d })
        .map(|d| usize::try_from(d).ok().filter(|&d| (d as i64) < rank))
        .collect::<Option<_>>()?;
    let mut seen = vec![false; p.len()];
    for &d in &p {
        if std::mem::replace(&mut seen[d], true) {
            return None;
        }
    }
    (p.len() as i64 == rank).then_some(p)
}

/// `n` when `v` holds `0, 1, ..., n-1`: an integer `arange` from 0 with step 1.
fn full_arange(g: &Graph, v: ValueRef) -> Option<Dim> {
    let n = g.node(v.node);
    let ty = single_type(g, v.node)?;
    if ty.dtype.is_float() || ty.dtype == DType::Bool || ty.rank() != 1 {
        return None;
    }
    let arg = |i: usize, name: &str| n.args.get(i).or(n.kwargs.get(name));
    let ok = match n.op.as_str() {
        "aten.arange.default" => true,
        "aten.arange.start" => matches!(arg(0, "start"), Some(Arg::Int(0))),
        "aten.arange.start_step" => {
            matches!(arg(0, "start"), Some(Arg::Int(0)))
                && matches!(arg(2, "step"), None | Some(Arg::None) | Some(Arg::Int(1)))
        }
        _ => false,
    };
    ok.then(|| ty.shape[0].clone())
}

/// `index(x, [i0, i1, ...])` as a view of `x`, when every `ik` is a (viewed) full arange over
/// `x`'s dim k whose non-unit dim comes after the previous index's: then
/// `result[b] = x[b[p0], b[p1], ...]` reads x in its own order and the result is x reshaped.
fn index_is_view(g: &Graph, id: NodeId) -> Option<ValueRef> {
    let n = g.node(id);
    if !matches!(
        n.op.as_str(),
        "aten.index.Tensor" | "aten._unsafe_index.Tensor"
    ) {
        return None;
    }
    let x = as_value(n.args.first())?;
    let tx = g.value_type(x)?;
    let ty = single_type(g, id)?;
    let Some(Arg::List(indices)) = n.args.get(1) else {
        return None;
    };
    if ty.dtype != tx.dtype || indices.is_empty() || indices.len() > tx.rank() {
        return None;
    }
    let mut last: Option<usize> = None;
    for (k, a) in indices.iter().enumerate() {
        let i = as_value(Some(a))?;
        let ti = g.value_type(i)?;
        // Look through views to the arange.
        let mut src = i;
        while VIEWS.contains(&g.node(src.node).op.as_str()) {
            src = as_value(g.node(src.node).args.first())?;
        }
        let len = full_arange(g, src)?;
        if len != tx.shape[k] {
            return None;
        }
        if len == Dim::Static(1) {
            continue;
        }
        // Exactly one non-unit dim, holding the whole arange.
        let mut pos = ti
            .shape
            .iter()
            .enumerate()
            .filter(|(_, d)| **d != Dim::Static(1));
        let (p, d) = pos.next()?;
        if pos.next().is_some() || *d != len || last.is_some_and(|l| p <= l) {
            return None;
        }
        last = Some(p);
    }
    Some(x)
}

/// The single tensor operand `x` of a one-result node with `x` in arg 0, and `x`'s type equal in
/// dtype to the result's.
fn unary_operand(g: &Graph, id: NodeId) -> Option<ValueRef> {
    let x = as_value(g.node(id).args.first())?;
    let tx = g.value_type(x)?;
    (single_type(g, id)?.dtype == tx.dtype).then_some(x)
}

/// Folds view/permute/expand chains and removes no-op views; returns the nodes it rewrote or
/// removed.
pub fn fold_views(g: &mut Graph) -> usize {
    let outputs = output_nodes(g);
    let mut changes = 0;
    for id in g.topo_order() {
        if !g.dag.contains_node(id) {
            continue;
        }
        if let Some(x) = index_is_view(g, id) {
            let ty = single_type(g, id)
                .cloned()
                .expect("checked by index_is_view");
            set_op(
                g,
                id,
                "aten.view.default",
                vec![Arg::Value(x), shape_arg(&ty)],
            );
            changes += 1;
        }
        let op = g.node(id).op.clone();
        let op = op.as_str();
        let is_view = VIEWS.contains(&op);
        let is_perm = PERMUTES.contains(&op);
        let is_expand = op == "aten.expand.default";
        let is_identity = IDENTITIES.contains(&op);
        if !(is_view || is_perm || is_expand || is_identity) {
            continue;
        }
        let Some(mut x) = unary_operand(g, id) else {
            continue;
        };
        let ty = single_type(g, id)
            .cloned()
            .expect("checked by unary_operand");

        // Skip identities between `id` and the op it would fold with.
        let producer_op = |g: &Graph, x: ValueRef| g.node(x.node).op.clone();
        while IDENTITIES.contains(&producer_op(g, x).as_str()) {
            match unary_operand(g, x.node) {
                Some(y) if g.value_type(y) == g.value_type(x) => x = y,
                _ => break,
            }
        }
        let px = producer_op(g, x);
        let mut rewritten = false;
        if is_view && VIEWS.contains(&px.as_str()) {
            // view(view(y)) -> view(y)
            if let Some(y) = unary_operand(g, x.node) {
                x = y;
                rewritten = true;
            }
        } else if is_perm && PERMUTES.contains(&px.as_str()) {
            // permute(permute(y, p1), p2) -> permute(y, p1[p2])
            if let (Some(y), Some(p1), Some(p2)) =
                (unary_operand(g, x.node), perm_of(g, x.node), perm_of(g, id))
            {
                let p: Vec<i64> = p2.iter().map(|&i| p1[i] as i64).collect();
                set_op(
                    g,
                    id,
                    "aten.permute.default",
                    vec![
                        Arg::Value(y),
                        Arg::List(p.into_iter().map(Arg::Int).collect()),
                    ],
                );
                x = y;
                changes += 1;
            }
        } else if is_expand && px == "aten.expand.default" {
            // expand(expand(y)) -> expand(y, result shape)
            if let Some(y) = unary_operand(g, x.node) {
                x = y;
                rewritten = true;
            }
        }
        let identity = g.value_type(x) == Some(&ty)
            && (is_view
                || is_expand
                || is_identity
                || (is_perm
                    && perm_of(g, id).is_some_and(|p| p.iter().enumerate().all(|(i, &d)| i == d))));
        if identity && !outputs.contains(&id) {
            replace_node(g, id, x);
            changes += 1;
            continue;
        }
        if rewritten {
            let new_op = if is_view {
                "aten.view.default"
            } else {
                "aten.expand.default"
            };
            set_op(g, id, new_op, vec![Arg::Value(x), shape_arg(&ty)]);
            changes += 1;
        } else if as_value(g.node(id).args.first()) != Some(x) {
            // Only identities were skipped: read through them.
            set_arg(g, id, 0, Arg::Value(x));
            changes += 1;
        }
    }
    tracing::debug!(changes, "fold_views");
    changes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{graph, run_snapshot};

    #[test]
    fn view_chains_fold_to_one_view() {
        let g = graph(
            &[("x", "[2, 12, 64]")],
            &[
                (
                    "a",
                    "aten.view.default",
                    r#"[{"node": "x"}, [24, 64]]"#,
                    "[24, 64]",
                ),
                (
                    "b",
                    "aten.view.default",
                    r#"[{"node": "a"}, [2, 12, 4, 16]]"#,
                    "[2, 12, 4, 16]",
                ),
                (
                    "c",
                    "aten.unsqueeze.default",
                    r#"[{"node": "b"}, 0]"#,
                    "[1, 2, 12, 4, 16]",
                ),
                (
                    "d",
                    "aten.neg.default",
                    r#"[{"node": "c"}]"#,
                    "[1, 2, 12, 4, 16]",
                ),
            ],
            &["d"],
        );
        insta::assert_snapshot!(run_snapshot(g, fold_views));
    }

    #[test]
    fn no_op_views_permutes_expands_and_clones_disappear() {
        let g = graph(
            &[("x", "[2, 3]")],
            &[
                (
                    "a",
                    "aten.view.default",
                    r#"[{"node": "x"}, [2, -1]]"#,
                    "[2, 3]",
                ),
                (
                    "b",
                    "aten.expand.default",
                    r#"[{"node": "a"}, [2, 3]]"#,
                    "[2, 3]",
                ),
                (
                    "c",
                    "aten.permute.default",
                    r#"[{"node": "b"}, [0, 1]]"#,
                    "[2, 3]",
                ),
                ("d", "aten.clone.default", r#"[{"node": "c"}]"#, "[2, 3]"),
                ("e", "aten.exp.default", r#"[{"node": "d"}]"#, "[2, 3]"),
            ],
            &["e"],
        );
        insta::assert_snapshot!(run_snapshot(g, fold_views));
    }

    #[test]
    fn permute_of_permute_and_expand_of_expand() {
        let g = graph(
            &[("x", "[2, 3, 4]"), ("y", "[4]")],
            &[
                (
                    "p",
                    "aten.permute.default",
                    r#"[{"node": "x"}, [0, 2, 1]]"#,
                    "[2, 4, 3]",
                ),
                (
                    "q",
                    "aten.permute.default",
                    r#"[{"node": "p"}, [2, 0, 1]]"#,
                    "[3, 2, 4]",
                ),
                (
                    "back",
                    "aten.permute.default",
                    r#"[{"node": "q"}, [1, 0, 2]]"#,
                    "[2, 3, 4]",
                ),
                (
                    "s",
                    "aten.add.Tensor",
                    r#"[{"node": "back"}, {"node": "q"}]"#,
                    "[2, 3, 4]",
                ),
                (
                    "e1",
                    "aten.expand.default",
                    r#"[{"node": "y"}, [3, 4]]"#,
                    "[3, 4]",
                ),
                (
                    "e2",
                    "aten.expand.default",
                    r#"[{"node": "e1"}, [2, -1, -1]]"#,
                    "[2, 3, 4]",
                ),
                (
                    "t",
                    "aten.mul.Tensor",
                    r#"[{"node": "s"}, {"node": "e2"}]"#,
                    "[2, 3, 4]",
                ),
            ],
            &["t"],
        );
        insta::assert_snapshot!(run_snapshot(g, fold_views));
    }

    #[test]
    fn outputs_and_symbolic_shapes_are_kept() {
        // The no-op view is an output: it stays. The chain keeps its symbolic sizes.
        let g = graph(
            &[("x", r#"["s0", 4]"#)],
            &[
                (
                    "a",
                    "aten.view.default",
                    r#"[{"node": "x"}, [-1]]"#,
                    r#"["4*s0"]"#,
                ),
                (
                    "b",
                    "aten.unsqueeze.default",
                    r#"[{"node": "a"}, 0]"#,
                    r#"[1, "4*s0"]"#,
                ),
                ("n", "sym", "s0", ""),
                (
                    "c",
                    "aten.view.default",
                    r#"[{"node": "x"}, [{"node": "n"}, 4]]"#,
                    r#"["s0", 4]"#,
                ),
            ],
            &["b", "c"],
        );
        insta::assert_snapshot!(run_snapshot(g, fold_views));
    }

    #[test]
    fn index_by_broadcast_aranges_is_a_view() {
        // x[b, p] with b = arange(2) at dim 0 and p = arange(12) at dim 2 or 3 (HF mask style).
        let ar = |n: i64| {
            format!(r#"{{"args": [0, {n}], "kwargs": {{"dtype": {{"dtype": "int64"}}}}}}"#)
        };
        let (a2, a12) = (ar(2), ar(12));
        let g = graph(
            &[("x", "int64:[2, 12]")],
            &[
                ("b", "aten.arange.start_step", &a2, "int64:[2]"),
                ("p", "aten.arange.start_step", &a12, "int64:[12]"),
                (
                    "bi",
                    "aten.view.default",
                    r#"[{"node": "b"}, [2, 1, 1, 1]]"#,
                    "int64:[2, 1, 1, 1]",
                ),
                (
                    "u",
                    "aten.unsqueeze.default",
                    r#"[{"node": "p"}, 0]"#,
                    "int64:[1, 12]",
                ),
                (
                    "pi",
                    "aten.unsqueeze.default",
                    r#"[{"node": "u"}, 1]"#,
                    "int64:[1, 1, 12]",
                ),
                (
                    "qi",
                    "aten.unsqueeze.default",
                    r#"[{"node": "pi"}, 3]"#,
                    "int64:[1, 1, 12, 1]",
                ),
                (
                    "i1",
                    "aten.index.Tensor",
                    r#"[{"node": "x"}, [{"node": "bi"}, {"node": "qi"}]]"#,
                    "int64:[2, 1, 12, 1]",
                ),
                // indices in the wrong order (a transpose): not a view
                (
                    "ri",
                    "aten.view.default",
                    r#"[{"node": "p"}, [12, 1]]"#,
                    "int64:[12, 1]",
                ),
                (
                    "ci",
                    "aten.view.default",
                    r#"[{"node": "b"}, [1, 2]]"#,
                    "int64:[1, 2]",
                ),
                (
                    "i2",
                    "aten.index.Tensor",
                    r#"[{"node": "x"}, [{"node": "ci"}, {"node": "ri"}]]"#,
                    "int64:[12, 2]",
                ),
                // an arange that does not cover the dim: a gather
                ("h", "aten.arange.start_step", r#"[0, 12, 2]"#, "int64:[6]"),
                (
                    "i3",
                    "aten.index.Tensor",
                    r#"[{"node": "x"}, [{"node": "bi"}, {"node": "h"}]]"#,
                    "int64:[2, 1, 1, 6]",
                ),
            ],
            &["i1", "i2", "i3"],
        );
        insta::assert_snapshot!(run_snapshot(g, fold_views));
    }

    #[test]
    fn clone_between_views_is_read_through() {
        let g = graph(
            &[("x", "[2, 6]")],
            &[
                ("a", "aten.view.default", r#"[{"node": "x"}, [12]]"#, "[12]"),
                ("c", "aten.clone.default", r#"[{"node": "a"}]"#, "[12]"),
                (
                    "b",
                    "aten.view.default",
                    r#"[{"node": "c"}, [3, 4]]"#,
                    "[3, 4]",
                ),
                ("o", "aten.relu.default", r#"[{"node": "c"}]"#, "[12]"),
            ],
            &["b", "o"],
        );
        insta::assert_snapshot!(run_snapshot(g, fold_views));
    }
}
