//! Builders for small IR graphs in pass unit tests, through the same JSON import as real graphs.

use tpuc_frontend_fx::{import_json, Graph};

/// A tensor type as FX metadata: `"[2, 3]"` (float32), `"int64:[2, 3]"`, or raw JSON (`{...}`).
fn val(spec: &str) -> String {
    if spec.starts_with('{') {
        return spec.to_string();
    }
    let (dtype, shape) = spec.split_once(':').unwrap_or(("float32", spec));
    format!(r#"{{"tensor": {{"shape": {shape}, "dtype": "{dtype}"}}}}"#)
}

/// A graph with `inputs` (name, type), `nodes` (name, target, args, type) and `outputs`.
/// Args are a JSON array, or `{"args": [...], "kwargs": {...}}`. A node with target `sym` is a
/// SymInt node (its args are the expression, e.g. `"2*s0"`), folded into the args that use it.
pub fn graph(
    inputs: &[(&str, &str)],
    nodes: &[(&str, &str, &str, &str)],
    outputs: &[&str],
) -> Graph {
    let mut parts: Vec<String> = inputs
        .iter()
        .map(|(name, ty)| {
            format!(
                r#"{{"name": "{name}", "op": "placeholder", "val": {}}}"#,
                val(ty)
            )
        })
        .collect();
    for (name, target, args, ty) in nodes {
        if *target == "sym" {
            parts.push(format!(
                r#"{{"name": "{name}", "op": "call_function", "target": "<built-in function mul>", "args": [], "val": {{"symint": "{args}"}}}}"#
            ));
            continue;
        }
        let args = if args.starts_with('{') {
            args.trim()[1..args.len() - 1].to_string()
        } else {
            format!(r#""args": {args}"#)
        };
        parts.push(format!(
            r#"{{"name": "{name}", "op": "call_function", "target": "{target}", {args}, "val": {}}}"#,
            val(ty)
        ));
    }
    let outs: Vec<String> = outputs
        .iter()
        .map(|o| format!(r#"{{"node": "{o}"}}"#))
        .collect();
    parts.push(format!(
        r#"{{"name": "output", "op": "output", "args": [[{}]]}}"#,
        outs.join(", ")
    ));
    let json = format!(r#"{{"nodes": [{}]}}"#, parts.join(",\n"));
    import_json(&json).unwrap_or_else(|e| panic!("{e}\n{json}"))
}

/// Runs `pass` on `g` and returns the before/after listing that snapshots record. Also checks
/// that the pass kept every output's type, and that a second run finds nothing more to do.
pub fn run_snapshot(mut g: Graph, pass: fn(&mut Graph) -> usize) -> String {
    let before = g.to_string();
    let out_types = output_types(&g);
    let changes = pass(&mut g);
    assert_eq!(
        output_types(&g),
        out_types,
        "the pass changed an output type"
    );
    check_edges(&g);
    let after = g.to_string();
    let again = pass(&mut g);
    assert_eq!(again, 0, "a second run still changed the graph:\n{}", g);
    format!(
        "before ({} ops):\n{before}\nafter ({} ops, {changes} changes):\n{after}",
        count(&before),
        g.op_count()
    )
}

fn count(listing: &str) -> usize {
    listing
        .lines()
        .filter(|l| l.starts_with('%') && !l.contains("= input("))
        .count()
}

fn output_types(g: &Graph) -> Vec<String> {
    g.outputs
        .iter()
        .map(|o| match o {
            tpuc_frontend_fx::Output::Value(v) => format!("{:?}", g.value_type(*v)),
            other => format!("{other:?}"),
        })
        .collect()
}

/// The edges of every node equal its operands (what passes rely on to find users).
pub fn check_edges(g: &Graph) {
    use petgraph::visit::EdgeRef;
    for id in g.dag.node_indices() {
        let mut want: Vec<(usize, usize)> = g
            .node(id)
            .operands()
            .iter()
            .map(|v| (v.node.index(), v.result))
            .collect();
        let mut have: Vec<(usize, usize)> = g
            .dag
            .edges_directed(id, petgraph::Direction::Incoming)
            .map(|e| (e.source().index(), *e.weight()))
            .collect();
        want.sort();
        have.sort();
        assert_eq!(want, have, "edges of {}", g.node(id).name);
        for v in g.node(id).operands() {
            assert!(v.node < id, "{} reads a later node", g.node(id).name);
        }
    }
}
