//! Passes over the IR. Each pass rewrites a [`Graph`] in place, has a name and a group, and
//! reports how many rewrites it made, so the pipeline can report op counts and time per pass and
//! users can switch passes off (`options={"passes": {"cse": False}}` or a whole group,
//! `{"cleanup": False}`).
//!
//! The pipeline ([`PIPELINE`]) runs on the symbolic graph right after import, before
//! specialization to concrete sizes and before bucketing. Every pass therefore keeps symbolic
//! shapes symbolic, never changes the result type of a node it keeps, never removes a node whose
//! result is a graph output (two outputs must stay two tensors), and only rewrites nodes in
//! place or removes them (never adds one: the IR's topological order is its index order).
//! The fusion passes rewrite in lowering: they analyse the IR, record their name in
//! `Graph::lowering`, and lowering applies them (see `fusion.rs` for why).

mod bucket;
mod cse;
mod dce;
mod fold_constants;
mod fold_views;
pub mod fusion;
mod rewrite;
pub mod sharding;
mod specialize;

pub use bucket::{bucket, Atom, BucketError, Bucketed, DimLayout, Layout, STEPS_KWARG};
pub use cse::common_subexpression_elimination;
pub use dce::dead_code_elimination;
pub use fold_constants::fold_constants;
pub use fold_views::fold_views;
pub use fusion::{composites, fold_transposes, fusion_groups, transpose_folds, FusionGroup};
pub use specialize::{bindings_from_inputs, specialize, SpecializeError};

use std::time::Instant;
use tpuc_frontend_fx::Graph;

/// A pass that rewrites the graph in place and reports how many nodes it removed or rewrote.
pub struct Pass {
    /// The name users switch it by (`options["passes"][name]`) and dumps show.
    pub name: &'static str,
    /// The group it belongs to (`"cleanup"`, `"fusion"`): a group name switches all its passes.
    pub group: &'static str,
    /// One line for `tpuc` docs and error messages.
    pub doc: &'static str,
    pub run: fn(&mut Graph) -> usize,
}

/// Every pass, in the fixed order the pipeline runs them:
///
/// 1. `fold_constants`: algebraic identities with small constants (`x * 1`, `x - 0`, integer
///    `x + 0`, `x / 1`, `x ** 1`, `x ** 2 -> x * x`, `x & true`, `x | false`), where the constant
///    is a literal or a `full`/`scalar_tensor`/`ones`/`zeros` tensor. Only exact rewrites.
/// 2. `fold_views`: chains of view/reshape/unsqueeze/squeeze/flatten become one view, chains of
///    permutes one permute, chains of expands one expand; no-op views, permutes and expands and
///    value-semantics identities (`clone`, `alias`, `detach`, `lift_fresh_copy`) disappear.
/// 3. `cse`: common-subexpression elimination (same op, same operands and literals, same result
///    types); random ops and ops with side effects are never merged.
/// 4. `dce`: dead-code elimination, so it removes what the passes before it orphaned.
/// 5. `fold_transposes` (fusion): a permute/t/transpose read only as a matrix operand of
///    mm/addmm/bmm/baddbmm is not emitted; the `dot_general` contracts the un-permuted operand.
/// 6. `composites` (fusion): attention, MLPs, RMS norms and single layer norm / GELU / SiLU /
///    softmax nodes are emitted as `stablehlo.composite` ops; equal units share one private
///    decomposition function.
///
/// The fusion passes run after the cleanup so that they see the final graph; both rewrite in
/// lowering (`fusion.rs`).
pub const PIPELINE: &[Pass] = &[
    Pass {
        name: "fold_constants",
        group: "cleanup",
        doc: "algebraic identities with small constants (x*1, x-0, x**2 -> x*x, x&true)",
        run: fold_constants,
    },
    Pass {
        name: "fold_views",
        group: "cleanup",
        doc: "view/permute/expand chains folded, no-op views and identities removed",
        run: fold_views,
    },
    Pass {
        name: "cse",
        group: "cleanup",
        doc: "common-subexpression elimination (never random or side-effecting ops)",
        run: common_subexpression_elimination,
    },
    Pass {
        name: "dce",
        group: "cleanup",
        doc: "dead-code elimination",
        run: dead_code_elimination,
    },
    Pass {
        name: "fold_transposes",
        group: "fusion",
        doc: "transposes of matmul operands folded into dot_general dimension numbers",
        run: fold_transposes,
    },
    Pass {
        name: "composites",
        group: "fusion",
        doc: "attention, MLP, norms, GELU/SiLU/softmax as stablehlo.composite with shared decompositions",
        run: composites,
    },
];

/// The groups a `passes` option may name, besides each pass's own name.
pub const GROUPS: &[&str] = &["cleanup", "fusion"];

/// What one pass did in one run of the pipeline.
#[derive(Clone, Debug)]
pub struct PassReport {
    pub name: &'static str,
    pub ops_before: usize,
    pub ops_after: usize,
    /// Nodes the pass rewrote or removed (its own count; a rewrite need not remove an op).
    pub changes: usize,
    pub seconds: f64,
}

/// Runs the passes of [`PIPELINE`] for which `enabled(name)` holds, in order; `after` sees the
/// graph after each pass that ran (dumps print it).
pub fn run_pipeline(
    g: &mut Graph,
    enabled: impl Fn(&str) -> bool,
    mut after: impl FnMut(&PassReport, &Graph),
) -> Vec<PassReport> {
    let mut reports = Vec::new();
    for pass in PIPELINE {
        if !enabled(pass.name) {
            continue;
        }
        let ops_before = g.op_count();
        let t = Instant::now();
        let changes = (pass.run)(g);
        let seconds = t.elapsed().as_secs_f64();
        let report = PassReport {
            name: pass.name,
            ops_before,
            ops_after: g.op_count(),
            changes,
            seconds,
        };
        tracing::debug!(
            pass = pass.name,
            ops_before,
            ops_after = report.ops_after,
            changes,
            seconds,
            "pass"
        );
        after(&report, g);
        reports.push(report);
    }
    reports
}

/// Runs the passes of [`PIPELINE`] named in `enabled` (all when None), in order: each pass's
/// report, with the graph's text after it where `texts` (printing the graph after every pass
/// costs more than the passes; only dumps ask for it).
pub fn run_named(
    g: &mut Graph,
    enabled: Option<&[String]>,
    texts: bool,
) -> Vec<(PassReport, Option<String>)> {
    let mut after = Vec::new();
    let reports = run_pipeline(
        g,
        |name| enabled.is_none_or(|e| e.iter().any(|n| n == name)),
        |_, g| after.push(texts.then(|| g.to_string())),
    );
    reports.into_iter().zip(after).collect()
}

#[cfg(test)]
mod test_util;

#[cfg(test)]
mod pipeline_tests {
    use super::*;
    use crate::test_util::graph;

    /// `neg(neg(x))` twice over: CSE merges the copies, DCE drops nothing the output reads.
    fn doubled() -> Graph {
        graph(
            &[("x", "[4]")],
            &[
                ("a", "aten.neg.default", r#"[{"node": "x"}]"#, "[4]"),
                ("b", "aten.neg.default", r#"[{"node": "x"}]"#, "[4]"),
                (
                    "c",
                    "aten.add.Tensor",
                    r#"[{"node": "a"}, {"node": "b"}]"#,
                    "[4]",
                ),
                ("dead", "aten.exp.default", r#"[{"node": "c"}]"#, "[4]"),
            ],
            &["c"],
        )
    }

    #[test]
    fn run_named_runs_the_named_passes_in_pipeline_order() {
        let mut g = doubled();
        let all = run_named(&mut g.clone(), None, false);
        let names: Vec<&str> = all.iter().map(|(r, _)| r.name).collect();
        let order: Vec<&str> = PIPELINE.iter().map(|p| p.name).collect();
        assert_eq!(names, order);
        assert!(all.iter().all(|(_, text)| text.is_none()));

        // Named out of order, only those run, in the pipeline's order, each with its text.
        let (first, second) = (PIPELINE[0].name, PIPELINE[1].name);
        let wanted = [second.to_string(), first.to_string()];
        let some = run_named(&mut g, Some(&wanted), true);
        let names: Vec<&str> = some.iter().map(|(r, _)| r.name).collect();
        assert_eq!(names, [first, second]);
        let (last, text) = some.last().unwrap();
        assert_eq!(last.ops_after, g.op_count());
        assert_eq!(text.as_deref(), Some(g.to_string().as_str()));
        assert!(run_named(&mut g, Some(&[]), true).is_empty());
    }
}
