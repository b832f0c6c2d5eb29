//! Small in-place rewriting helpers shared by the cleanup passes. None of them adds a node: the
//! IR's topological order is the order of node indices, and a new node could reuse a freed
//! (lower) index.

use std::collections::HashSet;
use tpuc_frontend_fx::{Arg, Dim, Graph, NodeId, Output, TensorType, ValueRef};

/// Nodes whose results the graph returns. They are never removed or replaced: two outputs must
/// stay two distinct tensors, and the caller maps outputs by node.
pub fn output_nodes(g: &Graph) -> HashSet<NodeId> {
    g.output_nodes().collect()
}

/// `v` (or nothing) when `a` is exactly one tensor value.
pub fn as_value(a: Option<&Arg>) -> Option<ValueRef> {
    match a {
        Some(Arg::Value(v)) => Some(*v),
        _ => None,
    }
}

/// The result type of a single-result node.
pub fn single_type(g: &Graph, id: NodeId) -> Option<&TensorType> {
    let n = g.node(id);
    match n.results.as_slice() {
        [Some(t)] => Some(t),
        _ => None,
    }
}

/// A shape as an op argument: static sizes as ints, symbolic ones as symbolic ints.
pub fn shape_arg(t: &TensorType) -> Arg {
    Arg::List(
        t.shape
            .iter()
            .map(|d| match d {
                Dim::Static(n) => Arg::Int(*n),
                Dim::Sym(e) => Arg::Sym(e.clone()),
            })
            .collect(),
    )
}

fn map_arg(a: &mut Arg, f: &impl Fn(ValueRef) -> ValueRef) {
    match a {
        Arg::Value(v) => *v = f(*v),
        Arg::List(items) => items.iter_mut().for_each(|i| map_arg(i, f)),
        _ => {}
    }
}

fn is_output(g: &Graph, id: NodeId) -> bool {
    g.outputs
        .iter()
        .any(|o| matches!(o, Output::Value(v) if v.node == id))
}

/// Removes the nodes in `ids` that nothing reads any more (not inputs, not outputs), and then
/// those of their producers that this leaves unread, so a pass's own op count shows what it
/// orphaned.
pub fn prune(g: &mut Graph, ids: Vec<NodeId>) {
    let mut stack = ids;
    while let Some(id) = stack.pop() {
        if !g.dag.contains_node(id)
            || g.node(id).is_input()
            || g.users(id).next().is_some()
            || is_output(g, id)
        {
            continue;
        }
        stack.extend(g.node(id).operands().iter().map(|v| v.node));
        g.remove_node(id);
    }
}

/// Re-creates the incoming edges of `id` from its operands (after its args changed) and prunes
/// producers it no longer reads.
fn rebuild_edges(g: &mut Graph, id: NodeId) {
    use petgraph::visit::EdgeRef;
    let old: Vec<_> = g
        .dag
        .edges_directed(id, petgraph::Direction::Incoming)
        .map(|e| (e.id(), e.source()))
        .collect();
    for (e, _) in &old {
        g.dag.remove_edge(*e);
    }
    for v in g.node(id).operands() {
        g.dag.add_edge(v.node, id, v.result);
    }
    prune(g, old.into_iter().map(|(_, s)| s).collect());
}

/// Replaces the op and args of `id` in place (kwargs cleared); its results stay as they are.
pub fn set_op(g: &mut Graph, id: NodeId, op: &str, args: Vec<Arg>) {
    let n = &mut g.dag[id];
    n.op = op.to_string();
    n.args = args;
    n.kwargs.clear();
    rebuild_edges(g, id);
}

/// Sets argument `i` of `id` (its results stay as they are).
pub fn set_arg(g: &mut Graph, id: NodeId, i: usize, a: Arg) {
    g.dag[id].args[i] = a;
    rebuild_edges(g, id);
}

/// Makes every reader of `from` read `to` instead. Graph outputs are left alone (callers never
/// replace an output node). Returns how many nodes it rewrote.
pub fn replace_uses(g: &mut Graph, from: ValueRef, to: ValueRef) -> usize {
    let users: HashSet<NodeId> = g.users(from.node).collect();
    let mut n = 0;
    for u in users {
        let node = &mut g.dag[u];
        if !node.operands().contains(&from) {
            continue;
        }
        let f = |v: ValueRef| if v == from { to } else { v };
        node.args.iter_mut().for_each(|a| map_arg(a, &f));
        node.kwargs.values_mut().for_each(|a| map_arg(a, &f));
        rebuild_edges(g, u);
        n += 1;
    }
    n
}

/// Replaces the single-result node `id` by `to` everywhere and removes it (and what that
/// orphans).
pub fn replace_node(g: &mut Graph, id: NodeId, to: ValueRef) {
    replace_uses(
        g,
        ValueRef {
            node: id,
            result: 0,
        },
        to,
    );
    prune(g, vec![id]);
}
