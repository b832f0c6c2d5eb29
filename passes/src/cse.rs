//! Common-subexpression elimination: a node with the same op, the same operands (after earlier
//! merges), the same literal args and kwargs and the same result types as an earlier node is
//! replaced by that node. Random ops, ops with side effects or in-place semantics, and
//! uninitialized allocations are never merged; neither is a node whose result is a graph output
//! (two outputs stay two tensors), nor a recomputed node (activation checkpointing's copy of a
//! forward node for the backward, `Node::recomputed`) with one that is not: merging them would
//! keep the forward's value alive until the backward, which checkpointing asked not to.

use crate::rewrite::{output_nodes, prune, replace_uses};
use rustc_hash::{FxBuildHasher, FxHashMap};
use std::hash::{BuildHasher, Hash, Hasher};
use tpuc_frontend_fx::{Arg, Graph, Node, NodeId, ValueRef};

/// Substrings of op names that mark an op as random, side-effecting or stateful.
const NEVER: &[&str] = &[
    "rand",
    "dropout",
    "bernoulli",
    "normal",
    "uniform",
    "multinomial",
    "poisson",
    "exponential",
    "geometric",
    "cauchy",
    "log_normal",
    "seed",
    "rng",
    "assert",
    "print",
    "empty",
    "_local_scalar_dense",
    "sym_constrain",
    "record_stream",
    "profiler",
    "collective",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "wait_tensor",
];

/// Whether merging two equal calls of `op` is safe: a pure, deterministic ATen op (calls
/// with an `out=` kwarg aside).
fn mergeable_op(op: &str) -> bool {
    if op == Node::INPUT || !op.starts_with("aten.") {
        return false;
    }
    let base = op.split('.').nth(1).unwrap_or("");
    // In-place ops (`add_`) and `out=` variants mutate.
    if base.ends_with('_') || op.ends_with(".out") {
        return false;
    }
    !NEVER.iter().any(|w| op.contains(w))
}

/// A node's identity for merging (its name left out), hashed and compared without building
/// text. Floats compare by their bits, which tells `0.0` from `-0.0` and a NaN from itself.
struct Key<'g>(&'g Node);

fn hash_arg<H: Hasher>(a: &Arg, h: &mut H) {
    std::mem::discriminant(a).hash(h);
    match a {
        Arg::Value(v) => v.hash(h),
        Arg::Int(i) => i.hash(h),
        Arg::Float(f) => f.to_bits().hash(h),
        Arg::Bool(b) => b.hash(h),
        Arg::None => {}
        Arg::Str(s) | Arg::Device(s) => s.hash(h),
        Arg::DType(d) => d.hash(h),
        // Two control-flow ops merge only when they run the same nested graph.
        Arg::Region(k) => k.hash(h),
        Arg::Sym(e) => e.hash(h),
        Arg::List(items) => {
            items.len().hash(h);
            items.iter().for_each(|x| hash_arg(x, h));
        }
    }
}

fn same_arg(a: &Arg, b: &Arg) -> bool {
    match (a, b) {
        (Arg::Float(x), Arg::Float(y)) => x.to_bits() == y.to_bits(),
        (Arg::List(x), Arg::List(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same_arg(p, q))
        }
        _ => a == b,
    }
}

impl Hash for Key<'_> {
    fn hash<H: Hasher>(&self, h: &mut H) {
        let n = self.0;
        n.op.hash(h);
        n.args.len().hash(h);
        n.args.iter().for_each(|a| hash_arg(a, h));
        for (k, v) in &n.kwargs {
            k.hash(h);
            hash_arg(v, h);
        }
        n.results.hash(h);
        n.recomputed.hash(h);
    }
}

impl PartialEq for Key<'_> {
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (self.0, other.0);
        a.op == b.op
            && a.recomputed == b.recomputed
            && a.results == b.results
            && a.args.len() == b.args.len()
            && a.args.iter().zip(&b.args).all(|(x, y)| same_arg(x, y))
            && a.kwargs.len() == b.kwargs.len()
            && a.kwargs
                .iter()
                .zip(&b.kwargs)
                .all(|((k, x), (l, y))| k == l && same_arg(x, y))
    }
}

fn hash_of(n: &Node) -> u64 {
    FxBuildHasher.hash_one(Key(n))
}

/// Merges equal nodes; returns how many it removed.
pub fn common_subexpression_elimination(g: &mut Graph) -> usize {
    let outputs = output_nodes(g);
    // Hash -> earlier nodes with that hash. A kept node's operands come before it, so later
    // merges never change its identity.
    let mut seen: FxHashMap<u64, Vec<NodeId>> = FxHashMap::default();
    let mut removed = 0;
    // Whether an op is mergeable, by name: the scan of NEVER is most of this pass otherwise.
    let mut pure: FxHashMap<String, bool> = FxHashMap::default();
    for id in g.topo_order() {
        if !g.dag.contains_node(id) {
            continue;
        }
        let n = g.node(id);
        let ok = match pure.get(&n.op) {
            Some(&ok) => ok,
            None => *pure.entry(n.op.clone()).or_insert(mergeable_op(&n.op)),
        };
        if !ok || n.kwargs.contains_key("out") {
            continue;
        }
        let h = hash_of(n);
        let earlier = seen.get(&h).and_then(|ids| {
            ids.iter()
                .copied()
                .find(|&e| Key(g.node(e)) == Key(g.node(id)))
        });
        match earlier {
            Some(first) if !outputs.contains(&id) => {
                for r in 0..g.node(id).results.len() {
                    replace_uses(
                        g,
                        ValueRef {
                            node: id,
                            result: r,
                        },
                        ValueRef {
                            node: first,
                            result: r,
                        },
                    );
                }
                prune(g, vec![id]);
                removed += 1;
            }
            Some(_) => {}
            None => seen.entry(h).or_default().push(id),
        }
    }
    tracing::debug!(removed, "cse");
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{graph, run_snapshot};

    #[test]
    fn merges_equal_ops_transitively() {
        let g = graph(
            &[("x", "[2, 12, 64]")],
            &[
                (
                    "a",
                    "aten.arange.start_step",
                    r#"{"args": [0, 12], "kwargs": {"device": {"device": "cpu"}}}"#,
                    "int64:[12]",
                ),
                (
                    "b",
                    "aten.arange.start_step",
                    r#"{"args": [0, 12], "kwargs": {"device": {"device": "cpu"}}}"#,
                    "int64:[12]",
                ),
                (
                    "ua",
                    "aten.unsqueeze.default",
                    r#"[{"node": "a"}, 0]"#,
                    "int64:[1, 12]",
                ),
                (
                    "ub",
                    "aten.unsqueeze.default",
                    r#"[{"node": "b"}, 0]"#,
                    "int64:[1, 12]",
                ),
                (
                    "s",
                    "aten.add.Tensor",
                    r#"[{"node": "ua"}, {"node": "ub"}]"#,
                    "int64:[1, 12]",
                ),
                (
                    "v1",
                    "aten.view.default",
                    r#"[{"node": "x"}, [24, 64]]"#,
                    "[24, 64]",
                ),
                (
                    "v2",
                    "aten.view.default",
                    r#"[{"node": "x"}, [24, 64]]"#,
                    "[24, 64]",
                ),
                // a different literal: not merged
                (
                    "v3",
                    "aten.view.default",
                    r#"[{"node": "x"}, [-1, 64]]"#,
                    "[24, 64]",
                ),
                (
                    "m",
                    "aten.mm.default",
                    r#"[{"node": "v1"}, {"node": "v2"}]"#,
                    "[24, 24]",
                ),
                (
                    "n",
                    "aten.mm.default",
                    r#"[{"node": "v3"}, {"node": "v2"}]"#,
                    "[24, 24]",
                ),
            ],
            &["s", "m", "n"],
        );
        insta::assert_snapshot!(run_snapshot(g, common_subexpression_elimination));
    }

    #[test]
    fn random_ops_outputs_and_signed_zeros_are_kept_apart() {
        let g = graph(
            &[("x", "[4]")],
            &[
                ("r1", "aten.rand.default", r#"[[4]]"#, "[4]"),
                ("r2", "aten.rand.default", r#"[[4]]"#, "[4]"),
                (
                    "d1",
                    "aten.native_dropout.default",
                    r#"[{"node": "x"}, 0.5, true]"#,
                    r#"{"tuple": [{"tensor": {"shape": [4], "dtype": "float32"}}, {"tensor": {"shape": [4], "dtype": "bool"}}]}"#,
                ),
                (
                    "d2",
                    "aten.native_dropout.default",
                    r#"[{"node": "x"}, 0.5, true]"#,
                    r#"{"tuple": [{"tensor": {"shape": [4], "dtype": "float32"}}, {"tensor": {"shape": [4], "dtype": "bool"}}]}"#,
                ),
                (
                    "g1",
                    "<built-in function getitem>",
                    r#"[{"node": "d1"}, 0]"#,
                    "[4]",
                ),
                (
                    "g2",
                    "<built-in function getitem>",
                    r#"[{"node": "d2"}, 0]"#,
                    "[4]",
                ),
                ("p", "aten.add.Tensor", r#"[{"node": "x"}, 0.0]"#, "[4]"),
                ("q", "aten.add.Tensor", r#"[{"node": "x"}, -0.0]"#, "[4]"),
                ("e1", "aten.exp.default", r#"[{"node": "x"}]"#, "[4]"),
                ("e2", "aten.exp.default", r#"[{"node": "x"}]"#, "[4]"),
                (
                    "s",
                    "aten.add.Tensor",
                    r#"[{"node": "r1"}, {"node": "r2"}]"#,
                    "[4]",
                ),
                (
                    "t",
                    "aten.add.Tensor",
                    r#"[{"node": "g1"}, {"node": "g2"}]"#,
                    "[4]",
                ),
                (
                    "u",
                    "aten.add.Tensor",
                    r#"[{"node": "p"}, {"node": "q"}]"#,
                    "[4]",
                ),
            ],
            &["s", "t", "u", "e1", "e2"],
        );
        insta::assert_snapshot!(run_snapshot(g, common_subexpression_elimination));
    }

    #[test]
    fn multi_result_ops_merge_per_result() {
        let g = graph(
            &[("x", "[2, 6]")],
            &[
                (
                    "s1",
                    "aten.split_with_sizes.default",
                    r#"[{"node": "x"}, [3, 3], 1]"#,
                    r#"{"tuple": [{"tensor": {"shape": [2, 3], "dtype": "float32"}}, {"tensor": {"shape": [2, 3], "dtype": "float32"}}]}"#,
                ),
                (
                    "a1",
                    "<built-in function getitem>",
                    r#"[{"node": "s1"}, 1]"#,
                    "[2, 3]",
                ),
                (
                    "s2",
                    "aten.split_with_sizes.default",
                    r#"[{"node": "x"}, [3, 3], 1]"#,
                    r#"{"tuple": [{"tensor": {"shape": [2, 3], "dtype": "float32"}}, {"tensor": {"shape": [2, 3], "dtype": "float32"}}]}"#,
                ),
                (
                    "b0",
                    "<built-in function getitem>",
                    r#"[{"node": "s2"}, 0]"#,
                    "[2, 3]",
                ),
                (
                    "b1",
                    "<built-in function getitem>",
                    r#"[{"node": "s2"}, 1]"#,
                    "[2, 3]",
                ),
                (
                    "m",
                    "aten.mul.Tensor",
                    r#"[{"node": "a1"}, {"node": "b0"}]"#,
                    "[2, 3]",
                ),
                (
                    "n",
                    "aten.mul.Tensor",
                    r#"[{"node": "m"}, {"node": "b1"}]"#,
                    "[2, 3]",
                ),
            ],
            &["n"],
        );
        insta::assert_snapshot!(run_snapshot(g, common_subexpression_elimination));
    }
    /// Activation checkpointing: the backward's recomputed copy of a forward chain stays apart
    /// from the forward's (merged, the forward's values would live until the backward), while
    /// two recomputed copies of one node still merge with each other.
    #[test]
    fn recomputed_nodes_stay_apart_from_the_forward() {
        let recomputed = |args: &str| format!(r#"{{"args": {args}, "recomputed": true}}"#);
        let (ra, rb, ra2) = (
            recomputed(r#"[{"node": "x"}, {"node": "w"}]"#),
            recomputed(r#"[{"node": "ra"}]"#),
            recomputed(r#"[{"node": "x"}, {"node": "w"}]"#),
        );
        let g = graph(
            &[("x", "[4, 8]"), ("w", "[8, 8]"), ("dy", "[4, 8]")],
            &[
                (
                    "a",
                    "aten.mm.default",
                    r#"[{"node": "x"}, {"node": "w"}]"#,
                    "[4, 8]",
                ),
                ("b", "aten.gelu.default", r#"[{"node": "a"}]"#, "[4, 8]"),
                ("ra", "aten.mm.default", &ra, "[4, 8]"),
                ("rb", "aten.gelu.default", &rb, "[4, 8]"),
                ("ra2", "aten.mm.default", &ra2, "[4, 8]"),
                (
                    "g",
                    "aten.gelu_backward.default",
                    r#"[{"node": "dy"}, {"node": "ra2"}]"#,
                    "[4, 8]",
                ),
                (
                    "h",
                    "aten.mul.Tensor",
                    r#"[{"node": "g"}, {"node": "rb"}]"#,
                    "[4, 8]",
                ),
            ],
            &["b", "h"],
        );
        insta::assert_snapshot!(run_snapshot(g, common_subexpression_elimination));
    }
}
