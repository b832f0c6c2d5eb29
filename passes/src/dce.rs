use rustc_hash::FxHashSet;
use tpuc_frontend_fx::{Graph, NodeId};

/// Removes ops whose results nothing reads (graph inputs always stay: they are the signature).
/// Returns how many ops it removed.
pub fn dead_code_elimination(g: &mut Graph) -> usize {
    let mut live: FxHashSet<NodeId> = FxHashSet::default();
    let mut stack: Vec<NodeId> = g.output_nodes().collect();
    while let Some(id) = stack.pop() {
        if live.insert(id) {
            stack.extend(g.node(id).operands().iter().map(|v| v.node));
        }
    }
    let dead: Vec<NodeId> = g
        .dag
        .node_indices()
        .filter(|id| !live.contains(id) && !g.node(*id).is_input())
        .collect();
    for id in &dead {
        g.remove_node(*id);
    }
    tracing::debug!(removed = dead.len(), "dce");
    dead.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tpuc_frontend_fx::import_json;

    #[test]
    fn removes_unread_ops_and_keeps_inputs() {
        let g = r#"{"nodes": [
          {"name": "x", "op": "placeholder", "val": {"tensor": {"shape": [2], "dtype": "float32"}}},
          {"name": "unused_in", "op": "placeholder", "val": {"tensor": {"shape": [2], "dtype": "float32"}}},
          {"name": "a", "op": "call_function", "target": "aten.neg.default", "args": [{"node": "x"}], "val": {"tensor": {"shape": [2], "dtype": "float32"}}},
          {"name": "dead", "op": "call_function", "target": "aten.exp.default", "args": [{"node": "a"}], "val": {"tensor": {"shape": [2], "dtype": "float32"}}},
          {"name": "dead2", "op": "call_function", "target": "aten.exp.default", "args": [{"node": "dead"}], "val": {"tensor": {"shape": [2], "dtype": "float32"}}},
          {"name": "output", "op": "output", "args": [[{"node": "a"}]]}]}"#;
        let mut g = import_json(g).unwrap();
        assert_eq!(dead_code_elimination(&mut g), 2);
        assert_eq!(g.op_count(), 1);
        assert_eq!(g.inputs.len(), 2);
        assert_eq!(dead_code_elimination(&mut g), 0);
    }
}
