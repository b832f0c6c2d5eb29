//! Activation checkpointing in lowering: keeps the backward's recomputation a recomputation.
//!
//! PyTorch's checkpointing pass copies each checkpointed forward node that the backward reads
//! into the backward (`Node::recomputed`), and tpuc's passes keep the copies apart from their
//! originals. XLA would merge them again (its CSE sees equal ops on equal operands) and keep the
//! forward's activations alive until the backward. So, as `jax.checkpoint` does with
//! `prevent_cse`, each connected group of recomputed nodes reads its inputs through one
//! `stablehlo.optimization_barrier`: values XLA cannot see through, so nothing in the group
//! equals a forward op. The barrier also takes the values the group's first backward readers
//! wait for (the incoming gradient, as torch_xla's checkpoint does with its grad outputs), so
//! the recomputation cannot be scheduled before the backward needs it.

use petgraph::unionfind::UnionFind;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use tpuc_frontend_fx::{Graph, NodeId, ValueRef};

/// One connected group of recomputed nodes (one checkpointed region's recomputation, or the
/// part of it a selective policy did not save).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Group {
    /// Its first node in topological order: the barrier is emitted just before it.
    pub first: NodeId,
    /// Tensor values from outside the group that its nodes read: they go through the barrier,
    /// and the group reads the barrier's results in their place.
    pub inputs: Vec<ValueRef>,
    /// Values the group's readers also take that exist before the group (the backward's
    /// gradient at that point): they go through the barrier only to order it after them.
    pub after: Vec<ValueRef>,
}

/// The groups of a graph, and which group each recomputed node is in.
#[derive(Debug, Default)]
pub(crate) struct Remat {
    pub groups: Vec<Group>,
    group_of: HashMap<NodeId, usize>,
    first_of: HashMap<NodeId, usize>,
}

impl Remat {
    pub fn new(graph: &Graph) -> Remat {
        let order = graph.topo_order();
        let members: Vec<NodeId> = order
            .iter()
            .copied()
            .filter(|&id| graph.node(id).recomputed)
            .collect();
        if members.is_empty() {
            return Remat::default();
        }
        // The connected groups: union-find over the edges between recomputed nodes.
        let index: HashMap<NodeId, usize> =
            members.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        let mut sets = UnionFind::<usize>::new(members.len());
        for (i, &id) in members.iter().enumerate() {
            for v in graph.node(id).operands() {
                if let Some(&j) = index.get(&v.node) {
                    sets.union(i, j);
                }
            }
        }
        // Groups in the order of their first node.
        let mut slot: HashMap<usize, usize> = HashMap::default();
        let mut remat = Remat::default();
        for (i, &id) in members.iter().enumerate() {
            let g = *slot.entry(sets.find_mut(i)).or_insert_with(|| {
                remat.groups.push(Group {
                    first: id,
                    inputs: Vec::new(),
                    after: Vec::new(),
                });
                remat.first_of.insert(id, remat.groups.len() - 1);
                remat.groups.len() - 1
            });
            remat.group_of.insert(id, g);
        }
        let is_tensor = |v: &ValueRef| graph.value_type(*v).is_some();
        let mut seen: Vec<HashSet<ValueRef>> = vec![HashSet::default(); remat.groups.len()];
        for &id in &members {
            let g = remat.group_of[&id];
            for v in graph.node(id).operands() {
                if !graph.node(v.node).recomputed && is_tensor(&v) && seen[g].insert(v) {
                    remat.groups[g].inputs.push(v);
                }
            }
        }
        // The node just before each group (in the order PyTorch's pass placed the group, right
        // before the backward node that first needs it): the recomputation waits for it. The
        // readers' own operands alone may all be made later (a transpose of a recomputed
        // weight reads nothing else) or be inputs.
        let mut previous: Option<ValueRef> = None;
        let mut starts = remat.groups.iter().map(|g| g.first).peekable();
        let mut before: Vec<Option<ValueRef>> = Vec::new();
        for &id in &order {
            if starts.peek() == Some(&id) {
                before.push(previous);
                starts.next();
            }
            let n = graph.node(id);
            if !n.recomputed && !n.is_input() && n.results.first().is_some_and(Option::is_some) {
                previous = Some(ValueRef {
                    node: id,
                    result: 0,
                });
            }
        }
        for (g, v) in before.into_iter().enumerate() {
            if let Some(v) = v.filter(|v| seen[g].insert(*v)) {
                remat.groups[g].after.push(v);
            }
        }
        // Positions in topological order (node ids need not follow it after passes).
        let position: HashMap<NodeId, usize> =
            order.iter().enumerate().map(|(i, &id)| (id, i)).collect();
        for &id in &members {
            let g = remat.group_of[&id];
            let first = position[&remat.groups[g].first];
            for user in graph.users(id) {
                if graph.node(user).recomputed {
                    continue;
                }
                for v in graph.node(user).operands() {
                    // Only values made before the group: a later one may depend on it.
                    if position[&v.node] < first
                        && !graph.node(v.node).recomputed
                        && is_tensor(&v)
                        && seen[g].insert(v)
                    {
                        remat.groups[g].after.push(v);
                    }
                }
            }
        }
        remat
    }

    /// The group of a recomputed node.
    pub fn group_of(&self, id: NodeId) -> Option<usize> {
        self.group_of.get(&id).copied()
    }

    /// The group whose barrier goes just before `id`.
    pub fn index_starting_at(&self, id: NodeId) -> Option<usize> {
        self.first_of.get(&id).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tpuc_frontend_fx::import_json;

    /// x -> mm -> gelu (forward) and its recomputation for the backward, plus a second
    /// checkpointed block whose recomputation reads the first block's (saved) output.
    #[test]
    fn groups_inputs_and_the_values_the_barrier_waits_for() {
        let node = |name: &str, target: &str, args: &str, recomputed: bool| {
            format!(
                r#"{{"name": "{name}", "op": "call_function", "target": "{target}", "args": {args}, "recomputed": {recomputed}, "val": {{"tensor": {{"shape": [4, 4], "dtype": "float32"}}}}}}"#
            )
        };
        let input = |name: &str| {
            format!(
                r#"{{"name": "{name}", "op": "placeholder", "val": {{"tensor": {{"shape": [4, 4], "dtype": "float32"}}}}}}"#
            )
        };
        let nodes = [
            input("x"),
            input("w"),
            input("dy"),
            node(
                "a",
                "aten.mm.default",
                r#"[{"node": "x"}, {"node": "w"}]"#,
                false,
            ),
            node("b", "aten.gelu.default", r#"[{"node": "a"}]"#, false),
            node(
                "c",
                "aten.mm.default",
                r#"[{"node": "b"}, {"node": "w"}]"#,
                false,
            ),
            node("d", "aten.gelu.default", r#"[{"node": "c"}]"#, false),
            // block 2's recomputation, before its backward
            node(
                "c_r",
                "aten.mm.default",
                r#"[{"node": "b"}, {"node": "w"}]"#,
                true,
            ),
            node(
                "g2",
                "aten.gelu_backward.default",
                r#"[{"node": "dy"}, {"node": "c_r"}]"#,
                false,
            ),
            // block 1's recomputation, after block 2's backward
            node(
                "a_r",
                "aten.mm.default",
                r#"[{"node": "x"}, {"node": "w"}]"#,
                true,
            ),
            node("b_r", "aten.gelu.default", r#"[{"node": "a_r"}]"#, true),
            node(
                "g1",
                "aten.gelu_backward.default",
                r#"[{"node": "g2"}, {"node": "a_r"}]"#,
                false,
            ),
            node(
                "h",
                "aten.mul.Tensor",
                r#"[{"node": "g1"}, {"node": "b_r"}]"#,
                false,
            ),
            r#"{"name": "output", "op": "output", "args": [[{"node": "d"}, {"node": "h"}]]}"#
                .into(),
        ];
        let g = import_json(&format!(r#"{{"nodes": [{}]}}"#, nodes.join(","))).unwrap();
        let by_name = |n: &str| {
            g.topo_order()
                .into_iter()
                .find(|&id| g.node(id).name == n)
                .unwrap()
        };
        let v = |n: &str| ValueRef {
            node: by_name(n),
            result: 0,
        };
        let r = Remat::new(&g);
        assert_eq!(
            r.groups,
            vec![
                Group {
                    first: by_name("c_r"),
                    inputs: vec![v("b"), v("w")],
                    after: vec![v("d"), v("dy")],
                },
                Group {
                    first: by_name("a_r"),
                    inputs: vec![v("x"), v("w")],
                    after: vec![v("g2")],
                },
            ]
        );
        assert_eq!(r.group_of(by_name("b_r")), Some(1));
        assert_eq!(r.index_starting_at(by_name("a_r")), Some(1));
        assert_eq!(r.index_starting_at(by_name("b_r")), None);
    }
}
