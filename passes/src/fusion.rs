//! Fusion: two passes whose rewrite happens in lowering, analysed here on the IR.
//!
//! - `fold_transposes`: a `permute`/`t`/`transpose` read only as a matrix operand of
//!   `mm`/`addmm`/`bmm`/`baddbmm` (every Linear weight arrives as `permute(W, [1, 0])`, attention
//!   keys as `transpose(k)`) is not emitted; the product's `stablehlo.dot_general` contracts
//!   the un-permuted operand along the right dims instead ([`transpose_folds`]).
//! - `composites`: recognized units (attention, MLP, RMS norm, and the ATen ops whose lowering is
//!   long: layer norm, GELU, SiLU, softmax) are emitted as one `stablehlo.composite` each, whose
//!   `decomposition` is a private function holding the plain StableHLO; equal units (same ops,
//!   literals and types) share one function ([`fusion_groups`]).
//!
//! Why in lowering and not as IR rewrites: the fused forms need what only StableHLO has (dot
//! dimension numbers, functions), and keeping the IR in ATen terms means bucketing (which pads
//! `mm`/`addmm` operands) and the sharding pass (which finds Linear weights as
//! `addmm(b, x, permute(W))`) need no rules for new ops. Each pass records its name in
//! [`Graph::lowering`], which specialization and bucketing carry to the graph that is lowered;
//! lowering re-runs the analysis there (a bucketed graph can differ) and skips both rewrites on a
//! sharded module.

use crate::rewrite::output_nodes;
use std::collections::{BTreeSet, HashMap, HashSet};
use tpuc_frontend_fx::{Arg, Graph, Node, NodeId, ValueRef};

pub const FOLD_TRANSPOSES: &str = "fold_transposes";
pub const COMPOSITES: &str = "composites";

/// The `fold_transposes` pass: marks the graph for lowering; returns the number of transposes
/// folded (0 when it was already marked).
pub fn fold_transposes(g: &mut Graph) -> usize {
    if !g.lowering.insert(FOLD_TRANSPOSES.to_string()) {
        return 0;
    }
    transpose_folds(g).len()
}

/// The `composites` pass: marks the graph for lowering; returns the number of composite units
/// (0 when it was already marked).
pub fn composites(g: &mut Graph) -> usize {
    if !g.lowering.insert(COMPOSITES.to_string()) {
        return 0;
    }
    fusion_groups(g).len()
}

fn tensor_arg(n: &Node, i: usize) -> Option<ValueRef> {
    match n.args.get(i) {
        Some(Arg::Value(v)) => Some(*v),
        _ => None,
    }
}

/// The matrix operands (`[lhs, rhs]` argument positions) of a matmul op, None for other ops.
fn matrix_args(op: &str) -> Option<[usize; 2]> {
    match op {
        "aten.mm.default" | "aten.bmm.default" => Some([0, 1]),
        "aten.addmm.default" | "aten.baddbmm.default" => Some([1, 2]),
        _ => None,
    }
}

/// The permutation a `permute`/`t`/`transpose` node applies (result dim `i` is operand dim
/// `p[i]`), with negative dims normalized.
fn permutation(n: &Node) -> Option<Vec<i64>> {
    let rank = n.results.first()?.as_ref()?.rank() as i64;
    let norm = |d: i64| if d < 0 { d + rank } else { d };
    let p: Vec<i64> = match n.op.as_str() {
        "aten.permute.default" => match n.args.get(1)? {
            Arg::List(items) => items
                .iter()
                .map(|a| match a {
                    Arg::Int(d) => Some(norm(*d)),
                    _ => None,
                })
                .collect::<Option<_>>()?,
            _ => return None,
        },
        "aten.t.default" if rank == 2 => vec![1, 0],
        "aten.transpose.int" => {
            let (Some(Arg::Int(a)), Some(Arg::Int(b))) = (n.args.get(1), n.args.get(2)) else {
                return None;
            };
            let mut p: Vec<i64> = (0..rank).collect();
            p.swap(
                usize::try_from(norm(*a)).ok()?,
                usize::try_from(norm(*b)).ok()?,
            );
            p
        }
        _ => return None,
    };
    let mut seen = p.clone();
    seen.sort();
    (seen == (0..rank).collect::<Vec<_>>()).then_some(p)
}

/// Permute nodes to fold, with their permutation: rank 2 or 3, not a graph output, and read
/// only as a matrix operand of matmuls of that rank (never as `addmm`'s bias).
pub fn transpose_folds(g: &Graph) -> HashMap<NodeId, Vec<i64>> {
    let outputs = output_nodes(g);
    let mut folds = HashMap::new();
    for id in g.topo_order() {
        let n = g.node(id);
        let Some(p) = permutation(n) else { continue };
        if !(2..=3).contains(&p.len()) || outputs.contains(&id) || tensor_arg(n, 0).is_none() {
            continue;
        }
        let rank = p.len();
        let mut users = g.users(id).peekable();
        if users.peek().is_none() {
            continue;
        }
        let ok = users.all(|u| {
            let un = g.node(u);
            let Some(pos) = matrix_args(&un.op) else {
                return false;
            };
            let want_rank = if un.op.contains("bmm") { 3 } else { 2 };
            let operands: Vec<(usize, ValueRef)> = un
                .args
                .iter()
                .enumerate()
                .filter_map(|(i, a)| match a {
                    Arg::Value(v) => Some((i, *v)),
                    _ => None,
                })
                .collect();
            rank == want_rank
                && un.kwargs.values().all(|a| a.values().is_empty())
                && operands
                    .iter()
                    .all(|(i, v)| v.node != id || pos.contains(i))
        });
        if ok {
            folds.insert(id, p);
        }
    }
    folds
}

/// A unit lowered as one `stablehlo.composite`: `nodes` in topological order, the last one the
/// root. Every other member is read only inside the unit, so the root's results are the unit's
/// only results and every operand from outside is produced before the root.
#[derive(Clone, Debug, PartialEq)]
pub struct FusionGroup {
    /// The composite's name without the `tpuc.` prefix (`attention`, `mlp`, `rms_norm`, ...).
    pub name: &'static str,
    pub nodes: Vec<NodeId>,
}

const VIEWS: &[&str] = &[
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.reshape.default",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.squeeze.dims",
    "aten.expand.default",
    "aten.permute.default",
    "aten.transpose.int",
    "aten.t.default",
    "aten.clone.default",
];

/// What a softmax over attention scores is built of (PyTorch's safe softmax included: rows
/// that are all `-inf` give zeros).
const SOFTMAX: &[&str] = &[
    "aten._softmax.default",
    "aten._safe_softmax.default",
    "aten.eq.Scalar",
    "aten.logical_not.default",
    "aten.any.dim",
    "aten.full_like.default",
    "aten.where.self",
    "aten.amax.default",
    "aten.sub.Tensor",
    "aten.exp.default",
    "aten.sum.dim_IntList",
    "aten.div.Tensor",
];

/// Scaling and masking of the scores.
const SCORE_OPS: &[&str] = &[
    "aten.add.Tensor",
    "aten.mul.Scalar",
    "aten.div.Scalar",
    "aten.mul.Tensor",
    "aten.div.Tensor",
];

/// Elementwise ops an MLP's activation is built of (GELU's tanh form, SiLU, gating).
const ACTIVATION: &[&str] = &[
    "aten.gelu.default",
    "aten.silu.default",
    "aten.relu.default",
    "aten.tanh.default",
    "aten.sigmoid.default",
    "aten.erf.default",
];
const MLP_ELEMENTWISE: &[&str] = &[
    "aten.mul.Tensor",
    "aten.mul.Scalar",
    "aten.add.Tensor",
    "aten.add.Scalar",
    "aten.pow.Tensor_Scalar",
];

const RMS_OPS: &[&str] = &[
    "aten.mul.Tensor",
    "aten.pow.Tensor_Scalar",
    "aten.mean.dim",
    "aten.add.Tensor",
    "aten.add.Scalar",
    "aten.rsqrt.default",
    "aten._to_copy.default",
];

/// ATen ops whose own lowering is long enough to pay for a composite of one node.
const SINGLE: &[(&str, &str)] = &[
    ("aten.native_layer_norm.default", "layer_norm"),
    ("aten.gelu.default", "gelu"),
    ("aten.silu.default", "silu"),
    ("aten._softmax.default", "softmax"),
    ("aten._log_softmax.default", "log_softmax"),
];

struct Grower<'g> {
    g: &'g Graph,
    outputs: &'g HashSet<NodeId>,
    taken: &'g HashSet<NodeId>,
}

impl Grower<'_> {
    /// Adds to `group`, until nothing changes, producers of `start` (and of what it adds) that
    /// `allowed` accepts and that only members read; does not look past a node `stop` accepts.
    /// Returns the stopped nodes it added.
    fn absorb(
        &self,
        group: &mut BTreeSet<NodeId>,
        start: &[ValueRef],
        allowed: &dyn Fn(&Node) -> bool,
        stop: &dyn Fn(&Node) -> bool,
    ) -> Vec<NodeId> {
        let mut frontier: Vec<NodeId> = start.iter().map(|v| v.node).collect();
        let mut stopped = Vec::new();
        loop {
            let mut added = false;
            let mut next = Vec::new();
            for &p in &frontier {
                if group.contains(&p) {
                    continue;
                }
                let n = self.g.node(p);
                let inside = !n.is_input()
                    && !self.outputs.contains(&p)
                    && !self.taken.contains(&p)
                    && allowed(n)
                    && self.g.users(p).all(|u| group.contains(&u));
                if !inside {
                    next.push(p);
                    continue;
                }
                group.insert(p);
                added = true;
                if stop(n) {
                    stopped.push(p);
                } else {
                    next.extend(n.operands().iter().map(|v| v.node));
                }
            }
            next.sort();
            next.dedup();
            frontier = next;
            if !added {
                return stopped;
            }
        }
    }
}

fn is(n: &Node, ops: &[&str]) -> bool {
    ops.contains(&n.op.as_str())
}

/// Every unit to emit as a composite, found from the last node backwards (a unit never
/// overlaps another): attention (`bmm(softmax(bmm(q, k) ...), v)` with the views, scaling and
/// masking between, or PyTorch's fused CPU attention kernel), MLPs (two or three matmuls around
/// an activation), RMS norms, and single layer norm / GELU / SiLU / softmax nodes.
pub fn fusion_groups(g: &Graph) -> Vec<FusionGroup> {
    let mut taken: HashSet<NodeId> = HashSet::new();
    let mut groups = Vec::new();
    let order = g.topo_order();
    let outputs = output_nodes(g);
    for &id in order.iter().rev() {
        if taken.contains(&id) {
            continue;
        }
        let found = {
            let grower = Grower {
                g,
                outputs: &outputs,
                taken: &taken,
            };
            attention(&grower, id)
                .or_else(|| mlp(&grower, id))
                .or_else(|| rms_norm(&grower, id))
        };
        if let Some((name, nodes)) = found {
            taken.extend(nodes.iter().copied());
            groups.push(FusionGroup {
                name,
                nodes: nodes.into_iter().collect(),
            });
        }
    }
    for &id in &order {
        if taken.contains(&id) {
            continue;
        }
        if let Some((_, name)) = SINGLE.iter().find(|(op, _)| g.node(id).op == *op) {
            taken.insert(id);
            groups.push(FusionGroup {
                name,
                nodes: vec![id],
            });
        }
    }
    groups.sort_by_key(|gr| *gr.nodes.last().expect("groups are not empty"));
    groups
}

fn operand_values(n: &Node, positions: &[usize]) -> Vec<ValueRef> {
    positions.iter().filter_map(|&i| tensor_arg(n, i)).collect()
}

/// `bmm(P, v)` where P comes (through views) from a softmax of scores that come (through
/// views, scaling and an additive mask) from one `bmm(q, k)`; q, k and v bring the views and
/// scalings that feed them.
fn attention(gr: &Grower, root: NodeId) -> Option<(&'static str, BTreeSet<NodeId>)> {
    let n = gr.g.node(root);
    // Selects, slices and splits too: a host kernel reads the heads of q, k and v where they lie in
    // one projection's output (`tpuc_hostkernels::host_attention`), if the unit starts there.
    let layout = |n: &Node| {
        is(n, VIEWS)
            || is(
                n,
                &[
                    "aten.select.int",
                    "aten.slice.Tensor",
                    "aten.split.Tensor",
                    "aten.split_with_sizes.default",
                ],
            )
            || (is(n, &["aten.mul.Scalar", "aten.div.Scalar"])
                && tensor_arg(n, 0).is_some()
                && !matches!(n.args.get(1), Some(Arg::Value(_))))
    };
    if n.op == "aten._scaled_dot_product_flash_attention_for_cpu.default" {
        // Inference attention arrives as PyTorch's fused CPU kernel: one node is the unit.
        let mut group = BTreeSet::from([root]);
        gr.absorb(&mut group, &operand_values(n, &[0, 1, 2]), &layout, &|_| {
            false
        });
        return Some(("attention", group));
    }
    if n.op != "aten.bmm.default" {
        return None;
    }
    let mut group = BTreeSet::from([root]);
    let bmm = |n: &Node| n.op == "aten.bmm.default";
    let scores = gr.absorb(
        &mut group,
        &operand_values(n, &[0]),
        &|n| is(n, VIEWS) || is(n, SOFTMAX) || is(n, SCORE_OPS) || bmm(n),
        &bmm,
    );
    let softmaxes = group
        .iter()
        .filter(|&&m| {
            is(
                gr.g.node(m),
                &["aten._softmax.default", "aten._safe_softmax.default"],
            )
        })
        .count();
    if scores.len() != 1 || softmaxes != 1 {
        return None;
    }
    let qk = gr.g.node(scores[0]);
    let mut start = operand_values(qk, &[0, 1]);
    start.extend(operand_values(n, &[1]));
    gr.absorb(&mut group, &start, &layout, &|_| false);
    Some(("attention", group))
}

/// `mm/addmm(act(...), W2)` where the activation part (views, elementwise ops with at least one
/// activation) reads one or two matmuls (up, and gate for a gated MLP); the weights' permutes
/// come along.
fn mlp(gr: &Grower, root: NodeId) -> Option<(&'static str, BTreeSet<NodeId>)> {
    let n = gr.g.node(root);
    let [lhs, rhs] = matrix_args(&n.op)?;
    if n.op.contains("bmm") {
        return None;
    }
    let mut group = BTreeSet::from([root]);
    let mm = |n: &Node| is(n, &["aten.mm.default", "aten.addmm.default"]);
    let inner = gr.absorb(
        &mut group,
        &operand_values(n, &[lhs]),
        &|n| is(n, VIEWS) || is(n, ACTIVATION) || is(n, MLP_ELEMENTWISE) || mm(n),
        &mm,
    );
    let acts = group
        .iter()
        .filter(|&&m| is(gr.g.node(m), ACTIVATION))
        .count();
    if inner.is_empty() || inner.len() > 2 || acts == 0 {
        return None;
    }
    // The weights (and biases) of the matmuls: their transposes join, the tensors stay inputs.
    let mut weights = operand_values(n, &[rhs]);
    for &m in &inner {
        let mn = gr.g.node(m);
        let [_, r] = matrix_args(&mn.op)?;
        weights.extend(operand_values(mn, &[r]));
    }
    let transpose = |n: &Node| permutation(n).is_some_and(|p| p.len() == 2);
    gr.absorb(&mut group, &weights, &transpose, &|_| false);
    Some(("mlp", group))
}

/// `w * (x * rsqrt(mean(x * x, -1) + eps))` in any association, with optional dtype casts.
fn rms_norm(gr: &Grower, root: NodeId) -> Option<(&'static str, BTreeSet<NodeId>)> {
    let n = gr.g.node(root);
    if n.op != "aten.mul.Tensor" {
        return None;
    }
    let mut group = BTreeSet::from([root]);
    gr.absorb(&mut group, &n.operands(), &|n| is(n, RMS_OPS), &|_| false);
    let count = |op: &str| group.iter().filter(|&&m| gr.g.node(m).op == op).count();
    (count("aten.rsqrt.default") == 1 && count("aten.mean.dim") == 1 && group.len() <= 8)
        .then_some(("rms_norm", group))
}

/// The graph as Graphviz DOT text (`tpuc_frontend_fx::dot`), its fusion units drawn as
/// clusters where `clusters`: `emitted`, the units lowering emitted as composites, where the
/// graph was lowered; else the units [`fusion_groups`] finds, when the `composites` pass ran.
pub fn graph_dot(
    g: &Graph,
    title: &str,
    (clusters, legend): (bool, bool),
    emitted: Option<&[(String, Vec<NodeId>)]>,
) -> String {
    let composites = match emitted {
        _ if !clusters => Vec::new(),
        Some(units) => units.to_vec(),
        None if g.lowering.contains("composites") => fusion_groups(g)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::graph;

    fn listing(g: &Graph) -> String {
        let mut out = String::new();
        let mut folds: Vec<_> = transpose_folds(g).into_iter().collect();
        folds.sort();
        for (id, p) in folds {
            out.push_str(&format!("fold %{} {p:?}\n", g.node(id).name));
        }
        for gr in fusion_groups(g) {
            let names: Vec<&str> = gr.nodes.iter().map(|&i| g.node(i).name.as_str()).collect();
            out.push_str(&format!("composite {}: {}\n", gr.name, names.join(" ")));
        }
        out
    }

    #[test]
    fn linear_weights_and_key_transposes_fold() {
        let g = graph(
            &[
                ("x", "[6, 4]"),
                ("w", "[8, 4]"),
                ("b", "[8]"),
                ("k", "[2, 3, 5]"),
            ],
            &[
                (
                    "wt",
                    "aten.permute.default",
                    r#"[{"node": "w"}, [1, 0]]"#,
                    "[4, 8]",
                ),
                (
                    "y",
                    "aten.addmm.default",
                    r#"[{"node": "b"}, {"node": "x"}, {"node": "wt"}]"#,
                    "[6, 8]",
                ),
                (
                    "y2",
                    "aten.mm.default",
                    r#"[{"node": "x"}, {"node": "wt"}]"#,
                    "[6, 8]",
                ),
                (
                    "kt",
                    "aten.transpose.int",
                    r#"[{"node": "k"}, 1, 2]"#,
                    "[2, 5, 3]",
                ),
                (
                    "s",
                    "aten.bmm.default",
                    r#"[{"node": "k"}, {"node": "kt"}]"#,
                    "[2, 3, 3]",
                ),
                // read by something other than a matmul: stays
                ("xt", "aten.t.default", r#"[{"node": "x"}]"#, "[4, 6]"),
                (
                    "z",
                    "aten.mm.default",
                    r#"[{"node": "xt"}, {"node": "x"}]"#,
                    "[4, 4]",
                ),
                ("e", "aten.exp.default", r#"[{"node": "xt"}]"#, "[4, 6]"),
                // a graph output: stays
                ("bt", "aten.t.default", r#"[{"node": "x"}]"#, "[4, 6]"),
                (
                    "z2",
                    "aten.mm.default",
                    r#"[{"node": "bt"}, {"node": "x"}]"#,
                    "[4, 4]",
                ),
            ],
            &["y", "y2", "s", "z", "e", "bt", "z2"],
        );
        insta::assert_snapshot!(listing(&g));
    }

    #[test]
    fn pictures_draw_the_units_lowering_emits_or_the_pass_found() {
        let mut g = graph(
            &[("x", "[2, 8]")],
            &[(
                "p",
                "aten._softmax.default",
                r#"[{"node": "x"}, -1, false]"#,
                "[2, 8]",
            )],
            &["p"],
        );
        let drawn = |g: &Graph, clusters, emitted| graph_dot(g, "t", (clusters, true), emitted);
        // Before the `composites` pass ran, no units; after it, the ones it finds.
        assert!(!drawn(&g, true, None).contains("cluster_composite"));
        g.lowering.insert("composites".to_string());
        assert!(drawn(&g, true, None).contains("composite tpuc.softmax"));
        assert!(!drawn(&g, false, None).contains("cluster_composite"));
        // Where lowering said what it emitted, those.
        let p = g.output_nodes().next().unwrap();
        let emitted = [("mine".to_string(), vec![p])];
        let text = drawn(&g, true, Some(&emitted[..]));
        assert!(
            text.contains("composite tpuc.mine") && !text.contains("tpuc.softmax"),
            "{text}"
        );
    }

    #[test]
    fn graph_outputs_stay_outside_units() {
        // Training saves the softmax for the backward: the attention unit cannot hide it, so
        // only the softmax itself (a unit's root may be an output) becomes a composite.
        let g = graph(
            &[("q", "[2, 3, 4]"), ("k", "[2, 4, 3]"), ("v", "[2, 3, 4]")],
            &[
                (
                    "s",
                    "aten.bmm.default",
                    r#"[{"node": "q"}, {"node": "k"}]"#,
                    "[2, 3, 3]",
                ),
                (
                    "p",
                    "aten._softmax.default",
                    r#"[{"node": "s"}, -1, false]"#,
                    "[2, 3, 3]",
                ),
                (
                    "o",
                    "aten.bmm.default",
                    r#"[{"node": "p"}, {"node": "v"}]"#,
                    "[2, 3, 4]",
                ),
            ],
            &["o", "p"],
        );
        insta::assert_snapshot!(listing(&g));
    }

    #[test]
    fn attention_mlp_and_norms_become_composites() {
        let t = |s: &str| s.to_string();
        let nodes: Vec<(String, String, String, String)> = vec![
            // RMS norm
            (
                t("sq"),
                t("aten.mul.Tensor"),
                t(r#"[{"node": "x"}, {"node": "x"}]"#),
                t("[2, 3, 4]"),
            ),
            (
                t("ms"),
                t("aten.mean.dim"),
                t(r#"[{"node": "sq"}, [-1], true]"#),
                t("[2, 3, 1]"),
            ),
            (
                t("ep"),
                t("aten.add.Tensor"),
                t(r#"[{"node": "ms"}, 1e-6]"#),
                t("[2, 3, 1]"),
            ),
            (
                t("rs"),
                t("aten.rsqrt.default"),
                t(r#"[{"node": "ep"}]"#),
                t("[2, 3, 1]"),
            ),
            (
                t("nx"),
                t("aten.mul.Tensor"),
                t(r#"[{"node": "x"}, {"node": "rs"}]"#),
                t("[2, 3, 4]"),
            ),
            (
                t("h"),
                t("aten.mul.Tensor"),
                t(r#"[{"node": "g"}, {"node": "nx"}]"#),
                t("[2, 3, 4]"),
            ),
            // attention over [2 heads, 3, 4]
            (
                t("q"),
                t("aten.view.default"),
                t(r#"[{"node": "h"}, [6, 4]]"#),
                t("[6, 4]"),
            ),
            (
                t("q3"),
                t("aten.view.default"),
                t(r#"[{"node": "q"}, [2, 3, 4]]"#),
                t("[2, 3, 4]"),
            ),
            (
                t("qs"),
                t("aten.mul.Scalar"),
                t(r#"[{"node": "q3"}, 0.5]"#),
                t("[2, 3, 4]"),
            ),
            (
                t("kt"),
                t("aten.transpose.int"),
                t(r#"[{"node": "q3"}, 1, 2]"#),
                t("[2, 4, 3]"),
            ),
            (
                t("s"),
                t("aten.bmm.default"),
                t(r#"[{"node": "qs"}, {"node": "kt"}]"#),
                t("[2, 3, 3]"),
            ),
            (
                t("sm"),
                t("aten.add.Tensor"),
                t(r#"[{"node": "s"}, {"node": "mask"}]"#),
                t("[2, 3, 3]"),
            ),
            (
                t("p"),
                t("aten._softmax.default"),
                t(r#"[{"node": "sm"}, -1, false]"#),
                t("[2, 3, 3]"),
            ),
            (
                t("o"),
                t("aten.bmm.default"),
                t(r#"[{"node": "p"}, {"node": "q3"}]"#),
                t("[2, 3, 4]"),
            ),
            (
                t("o2"),
                t("aten.view.default"),
                t(r#"[{"node": "o"}, [6, 4]]"#),
                t("[6, 4]"),
            ),
            // gated MLP
            (
                t("wg"),
                t("aten.permute.default"),
                t(r#"[{"node": "w1"}, [1, 0]]"#),
                t("[4, 8]"),
            ),
            (
                t("a"),
                t("aten.mm.default"),
                t(r#"[{"node": "o2"}, {"node": "wg"}]"#),
                t("[6, 8]"),
            ),
            (
                t("act"),
                t("aten.silu.default"),
                t(r#"[{"node": "a"}]"#),
                t("[6, 8]"),
            ),
            (
                t("wu"),
                t("aten.permute.default"),
                t(r#"[{"node": "w2"}, [1, 0]]"#),
                t("[4, 8]"),
            ),
            (
                t("u"),
                t("aten.mm.default"),
                t(r#"[{"node": "o2"}, {"node": "wu"}]"#),
                t("[6, 8]"),
            ),
            (
                t("gu"),
                t("aten.mul.Tensor"),
                t(r#"[{"node": "act"}, {"node": "u"}]"#),
                t("[6, 8]"),
            ),
            (
                t("wd"),
                t("aten.permute.default"),
                t(r#"[{"node": "w3"}, [1, 0]]"#),
                t("[8, 4]"),
            ),
            (
                t("d"),
                t("aten.mm.default"),
                t(r#"[{"node": "gu"}, {"node": "wd"}]"#),
                t("[6, 4]"),
            ),
            // a single layer norm and a GELU outside any unit
            (
                t("ln"),
                t("aten.native_layer_norm.default"),
                t(r#"[{"node": "d"}, [4], null, null, 1e-5]"#),
                t(
                    r#"{"tuple": [{"tensor": {"shape": [6, 4], "dtype": "float32"}}, {"tensor": {"shape": [6, 1], "dtype": "float32"}}, {"tensor": {"shape": [6, 1], "dtype": "float32"}}]}"#,
                ),
            ),
            (
                t("ln0"),
                t("<built-in function getitem>"),
                t(r#"[{"node": "ln"}, 0]"#),
                t("[6, 4]"),
            ),
            (
                t("gl"),
                t("aten.gelu.default"),
                t(r#"[{"node": "ln0"}]"#),
                t("[6, 4]"),
            ),
        ];
        let nodes: Vec<(&str, &str, &str, &str)> = nodes
            .iter()
            .map(|(a, b, c, d)| (a.as_str(), b.as_str(), c.as_str(), d.as_str()))
            .collect();
        let g = graph(
            &[
                ("x", "[2, 3, 4]"),
                ("g", "[4]"),
                ("mask", "[2, 3, 3]"),
                ("w1", "[8, 4]"),
                ("w2", "[8, 4]"),
                ("w3", "[4, 8]"),
            ],
            &nodes,
            &["gl"],
        );
        insta::assert_snapshot!(listing(&g));
    }
}
