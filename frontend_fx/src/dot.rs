//! The graph as a Graphviz DOT picture, for dumps (`graph.dot` / `graph.svg`).
//!
//! Nodes show the op and the result types; inputs and outputs have their own shapes and colours.
//! Every op is put in a [`Kind`] (matmul/conv, elementwise, reduction, shape, indexing, creation,
//! fused, other) that sets its colour, and a connected run of two or more ops of the same kind is
//! drawn as one cluster (a "region": an elementwise chain is what a fusion would merge). A legend
//! lists the kinds present with their op counts.

use crate::{Arg, DType, Dim, Graph, Node, NodeId, Output, TensorType, ValueRef};
use petgraph::unionfind::UnionFind;
use petgraph::visit::{EdgeRef, IntoEdgeReferences, NodeIndexable};
use std::collections::BTreeMap;
use std::fmt::Write;

/// What an op does, for colouring and grouping.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Input,
    Matmul,
    Elementwise,
    Reduction,
    Shape,
    Indexing,
    Creation,
    /// A fused or composite op made by tpuc (`tpuc.*`, or an op named `fused`/`fusion`/`composite`).
    Fused,
    Other,
}

impl Kind {
    pub const ALL: [Kind; 9] = [
        Kind::Input,
        Kind::Matmul,
        Kind::Elementwise,
        Kind::Reduction,
        Kind::Shape,
        Kind::Indexing,
        Kind::Creation,
        Kind::Fused,
        Kind::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Input => "input",
            Kind::Matmul => "matmul/conv",
            Kind::Elementwise => "elementwise",
            Kind::Reduction => "reduction/normalization",
            Kind::Shape => "shape/layout",
            Kind::Indexing => "indexing/gather/scatter",
            Kind::Creation => "constant/creation",
            Kind::Fused => "fused/composite",
            Kind::Other => "other",
        }
    }

    /// Node fill colour.
    fn color(self) -> &'static str {
        match self {
            Kind::Input => "#c8ecc8",
            Kind::Matmul => "#f4a3a3",
            Kind::Elementwise => "#bcd6fb",
            Kind::Reduction => "#dcc0f2",
            Kind::Shape => "#e2e2e2",
            Kind::Indexing => "#fbeb9c",
            Kind::Creation => "#ffffff",
            Kind::Fused => "#ffb0dc",
            Kind::Other => "#ffcc99",
        }
    }

    /// Cluster background: a paler shade of the node colour.
    fn region_color(self) -> &'static str {
        match self {
            Kind::Input => "#eefaee",
            Kind::Matmul => "#fdecec",
            Kind::Elementwise => "#eef4fe",
            Kind::Reduction => "#f6effc",
            Kind::Shape => "#f6f6f6",
            Kind::Indexing => "#fefae6",
            Kind::Creation => "#fbfbfb",
            Kind::Fused => "#ffeaf6",
            Kind::Other => "#fff2e6",
        }
    }
}

/// The op's name without the `aten.` namespace and overload: `aten.add.Tensor` -> `add`.
fn base_name(op: &str) -> &str {
    let op = op.strip_prefix("aten.").unwrap_or(op);
    op.split('.').next().unwrap_or(op)
}

/// The kind of an IR op (by its ATen name).
pub fn kind_of(op: &str) -> Kind {
    if op == Node::INPUT {
        return Kind::Input;
    }
    let lower = op.to_ascii_lowercase();
    if op.starts_with("tpuc.")
        || ["fused", "fusion", "composite"]
            .iter()
            .any(|w| lower.contains(w))
    {
        return Kind::Fused;
    }
    let base = base_name(op);
    match base {
        "mm"
        | "bmm"
        | "addmm"
        | "baddbmm"
        | "matmul"
        | "dot"
        | "linear"
        | "convolution"
        | "convolution_backward"
        | "conv2d"
        | "conv1d"
        | "conv3d"
        | "einsum" => Kind::Matmul,
        b if b.starts_with("_scaled_dot_product") => Kind::Matmul,
        "sum"
        | "mean"
        | "amax"
        | "amin"
        | "max"
        | "min"
        | "argmax"
        | "argmin"
        | "prod"
        | "var"
        | "std"
        | "var_mean"
        | "any"
        | "all"
        | "cumsum"
        | "cumprod"
        | "logsumexp"
        | "norm"
        | "_softmax"
        | "_log_softmax"
        | "softmax"
        | "log_softmax"
        | "native_layer_norm"
        | "native_group_norm"
        | "avg_pool2d"
        | "max_pool2d_with_indices"
        | "max_pool2d_with_indices_backward"
        | "_native_batch_norm_legit"
        | "_native_batch_norm_legit_functional"
        | "_native_batch_norm_legit_no_training"
        | "native_batch_norm" => Kind::Reduction,
        "view" | "reshape" | "_unsafe_view" | "permute" | "transpose" | "t" | "expand"
        | "squeeze" | "unsqueeze" | "flatten" | "unflatten" | "slice" | "select" | "cat"
        | "split" | "split_with_sizes" | "as_strided" | "clone" | "contiguous" | "alias"
        | "detach" | "copy" | "lift_fresh_copy" | "constant_pad_nd" | "stack" | "flip" | "roll"
        | "repeat" | "unfold" => Kind::Shape,
        "index" | "_unsafe_index" | "index_select" | "gather" | "embedding" | "scatter"
        | "scatter_add" | "index_put" | "_unsafe_index_put" | "slice_scatter"
        | "select_scatter" | "as_strided_scatter" => Kind::Indexing,
        "arange" | "full" | "full_like" | "zeros" | "zeros_like" | "ones" | "ones_like"
        | "empty" | "empty_like" | "new_empty" | "new_ones" | "new_zeros" | "new_full"
        | "scalar_tensor" | "_tensor_constant" => Kind::Creation,
        "add" | "sub" | "rsub" | "mul" | "div" | "neg" | "abs" | "exp" | "exp2" | "expm1"
        | "log" | "log1p" | "log2" | "log10" | "sqrt" | "rsqrt" | "reciprocal" | "pow" | "sin"
        | "cos" | "tan" | "tanh" | "sigmoid" | "silu" | "gelu" | "relu" | "erf" | "sign"
        | "floor" | "ceil" | "round" | "trunc" | "fmod" | "remainder" | "clamp" | "clamp_min"
        | "clamp_max" | "hardtanh" | "maximum" | "minimum" | "where" | "eq" | "ne" | "lt"
        | "le" | "gt" | "ge" | "isinf" | "isnan" | "_to_copy" | "logical_and" | "logical_or"
        | "logical_xor" | "logical_not" | "bitwise_and" | "bitwise_or" | "bitwise_xor"
        | "bitwise_not" | "atan2" | "asin" | "acos" | "atan" | "sinh" | "cosh" | "asinh"
        | "acosh" | "atanh" | "erfinv" | "lerp" | "masked_fill" | "leaky_relu" | "elu"
        | "softplus" | "hardsigmoid" | "hardswish" | "mish" | "threshold_backward"
        | "gelu_backward" | "sigmoid_backward" | "tanh_backward" => Kind::Elementwise,
        _ => Kind::Other,
    }
}

/// Short dtype names for labels (`f32`, `bf16`, `i64`).
fn short_dtype(d: DType) -> &'static str {
    match d {
        DType::Float64 => "f64",
        DType::Float32 => "f32",
        DType::Float16 => "f16",
        DType::Bfloat16 => "bf16",
        DType::Int64 => "i64",
        DType::Int32 => "i32",
        DType::Int16 => "i16",
        DType::Int8 => "i8",
        DType::Uint8 => "u8",
        DType::Uint64 => "u64",
        DType::Bool => "bool",
        DType::Complex64 => "c64",
        DType::Complex128 => "c128",
    }
}

/// `f32[2,16]`; symbolic dims as their expression.
pub fn short_type(t: &TensorType) -> String {
    let dims: Vec<String> = t
        .shape
        .iter()
        .map(|d| match d {
            Dim::Static(n) => n.to_string(),
            Dim::Sym(e) => e.to_string(),
        })
        .collect();
    format!("{}[{}]", short_dtype(t.dtype), dims.join(","))
}

/// Text inside a DOT double-quoted string: quotes and backslashes escaped, newlines as `\n`.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => {}
            c => out.push(c),
        }
    }
    out
}

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(max).collect();
        t.push('…');
        t
    }
}

/// How to draw the graph.
#[derive(Clone, Debug)]
pub struct DotOptions {
    /// Shown at the top of the picture.
    pub title: String,
    /// Draw same-kind regions as clusters (clusters slow `dot` down on very large graphs).
    pub clusters: bool,
    /// Add a legend of the kinds present.
    pub legend: bool,
    /// An edge that spans more than this many ops (in topological order) is drawn as a short
    /// dashed stub that names the producer, next to the consumer, and an input whose uses are
    /// that far apart is drawn once per use. Long edges are what makes `dot` slow on big
    /// graphs (each is a chain of virtual nodes through every rank). 0: draw every edge.
    pub long_edge: usize,
    /// Units the fusion pass emits as one `stablehlo.composite`: `(name, members)`, each drawn
    /// as its own labelled cluster instead of joining same-kind regions.
    pub composites: Vec<(String, Vec<NodeId>)>,
}

impl Default for DotOptions {
    fn default() -> Self {
        DotOptions {
            title: String::new(),
            clusters: true,
            legend: true,
            long_edge: 60,
            composites: Vec::new(),
        }
    }
}

fn node_id(id: NodeId) -> String {
    format!("n{}", id.index())
}

fn result_types(n: &Node) -> String {
    n.results
        .iter()
        .map(|t| t.as_ref().map_or("_".to_string(), short_type))
        .collect::<Vec<_>>()
        .join(", ")
}

fn literal(a: &Arg, g: &Graph) -> String {
    match a {
        Arg::Value(v) => format!(
            "%{}",
            g.dag.node_weight(v.node).map_or("?", |n| n.name.as_str())
        ),
        Arg::Int(i) => i.to_string(),
        Arg::Float(x) => format!("{x:?}"),
        Arg::Bool(b) => b.to_string(),
        Arg::None => "None".into(),
        Arg::Str(s) => format!("{s:?}"),
        Arg::DType(d) => d.to_string(),
        Arg::Device(d) => d.clone(),
        Arg::Sym(s) => s.to_string(),
        Arg::Region(k) => format!("region {k}"),
        Arg::List(items) => format!(
            "[{}]",
            items
                .iter()
                .map(|i| literal(i, g))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// The picture of `g` as DOT text.
pub fn to_dot(g: &Graph, opts: &DotOptions) -> String {
    let order = g.topo_order();
    let kinds: BTreeMap<NodeId, Kind> = order
        .iter()
        .map(|&id| (id, kind_of(&g.node(id).op)))
        .collect();

    // Composite units first; then regions: connected components of same-kind ops outside
    // them (inputs are never grouped).
    let in_composite: BTreeMap<NodeId, usize> = opts
        .composites
        .iter()
        .enumerate()
        .flat_map(|(k, (_, members))| members.iter().map(move |&id| (id, k)))
        .collect();
    let mut uf = UnionFind::<usize>::new(g.dag.node_bound());
    for e in g.dag.edge_references() {
        let (a, b) = (e.source(), e.target());
        let free = !in_composite.contains_key(&a) && !in_composite.contains_key(&b);
        if free && kinds[&a] == kinds[&b] && kinds[&a] != Kind::Input {
            uf.union(a.index(), b.index());
        }
    }
    let mut regions: BTreeMap<usize, Vec<NodeId>> = BTreeMap::new();
    for &id in &order {
        if kinds[&id] != Kind::Input && !in_composite.contains_key(&id) {
            regions.entry(uf.find(id.index())).or_default().push(id);
        }
    }

    // Position of each op in topological order (inputs have none), for edge lengths.
    let pos: BTreeMap<NodeId, usize> = order
        .iter()
        .filter(|id| kinds[id] != Kind::Input)
        .enumerate()
        .map(|(i, &id)| (id, i))
        .collect();
    let long = |a: NodeId, b: NodeId| -> bool {
        opts.long_edge > 0
            && matches!((pos.get(&a), pos.get(&b)), (Some(x), Some(y)) if y.abs_diff(*x) > opts.long_edge)
    };
    // Inputs drawn once per use: their users lie far apart.
    let split_inputs: std::collections::BTreeSet<NodeId> = order
        .iter()
        .copied()
        .filter(|id| kinds[id] == Kind::Input && opts.long_edge > 0)
        .filter(|&id| {
            let p: Vec<usize> = g.users(id).filter_map(|u| pos.get(&u).copied()).collect();
            match (p.iter().min(), p.iter().max()) {
                (Some(lo), Some(hi)) => hi - lo > opts.long_edge,
                _ => false,
            }
        })
        .collect();
    let output_nodes: std::collections::BTreeSet<NodeId> = g.output_nodes().collect();

    let mut s = String::new();
    let _ = writeln!(s, "digraph tpuc {{");
    let _ = writeln!(
        s,
        "  graph [rankdir=TB, fontname=\"Helvetica\", fontsize=12, labelloc=t, label=\"{}\", \
         nodesep=0.25, ranksep=0.35];",
        esc(&opts.title)
    );
    let _ = writeln!(
        s,
        "  node [shape=box, style=\"rounded,filled\", fontname=\"Helvetica\", fontsize=10, \
         margin=\"0.08,0.03\", height=0.3];"
    );
    let _ = writeln!(
        s,
        "  edge [fontname=\"Helvetica\", fontsize=8, color=\"#555555\", arrowsize=0.6];"
    );

    let write_node = |s: &mut String, id: NodeId, indent: &str| {
        let n = g.node(id);
        let kind = kinds[&id];
        if kind == Kind::Input {
            let _ = writeln!(
                s,
                "{indent}{} [shape=invhouse, style=filled, fillcolor=\"{}\", label=\"{}\\n{}\", \
                 tooltip=\"input %{}: {}\", class=\"input\"];",
                node_id(id),
                kind.color(),
                esc(&n.name),
                esc(&result_types(n)),
                esc(&n.name),
                esc(&result_types(n)),
            );
        } else {
            let op = n.op.strip_prefix("aten.").unwrap_or(&n.op);
            let mut args: Vec<String> = n.args.iter().map(|a| literal(a, g)).collect();
            args.extend(
                n.kwargs
                    .iter()
                    .map(|(k, v)| format!("{k}={}", literal(v, g))),
            );
            let tooltip = truncate(
                &format!(
                    "%{}: {} = {}({})",
                    n.name,
                    result_types(n),
                    n.op,
                    args.join(", ")
                ),
                400,
            );
            let extra = if kind == Kind::Fused {
                ", penwidth=2"
            } else {
                ""
            };
            let _ = writeln!(
                s,
                "{indent}{} [fillcolor=\"{}\", label=\"{}\\n{}\", tooltip=\"{}\", class=\"{}\"{extra}];",
                node_id(id),
                kind.color(),
                esc(op),
                esc(&truncate(&result_types(n), 60)),
                esc(&tooltip),
                kind_class(kind),
            );
        }
    };

    // Inputs are not pinned to the top rank: dot places each just above its first use, which
    // keeps edges short (pinning weights used deep in a big graph makes layout take minutes).
    for &id in order.iter().filter(|id| kinds[id] == Kind::Input) {
        if !split_inputs.contains(&id) || output_nodes.contains(&id) {
            write_node(&mut s, id, "  ");
        }
    }

    for (k, (name, members)) in opts.composites.iter().enumerate() {
        let _ = writeln!(
            s,
            "  subgraph cluster_composite_{k} {{\n    label=\"composite tpuc.{} ({} ops)\"; \
             style=\"rounded,filled,bold\"; fillcolor=\"{}\"; color=\"{}\"; fontsize=10; \
             fontcolor=\"#333333\";",
            esc(name),
            members.len(),
            Kind::Fused.region_color(),
            Kind::Fused.color(),
        );
        for &id in members {
            write_node(&mut s, id, "    ");
        }
        let _ = writeln!(s, "  }}");
    }

    for (i, members) in regions.values().enumerate() {
        let kind = kinds[&members[0]];
        if opts.clusters && members.len() >= 2 {
            let _ = writeln!(
                s,
                "  subgraph cluster_{i} {{\n    label=\"{} region ({} ops)\"; style=\"rounded,filled\"; \
                 fillcolor=\"{}\"; color=\"#999999\"; fontsize=9; fontcolor=\"#555555\";",
                kind.name(),
                members.len(),
                kind.region_color()
            );
            for &id in members {
                write_node(&mut s, id, "    ");
            }
            let _ = writeln!(s, "  }}");
        } else {
            for &id in members {
                write_node(&mut s, id, "  ");
            }
        }
    }

    // Outputs on the bottom rank.
    let mut outs = Vec::new();
    for (k, o) in g.outputs.iter().enumerate() {
        let label = match o {
            Output::Value(v) => {
                let t = g.value_type(*v).map_or("_".into(), short_type);
                outs.push((k, Some(*v)));
                format!("output {k}\\n{}", esc(&t))
            }
            Output::Input(i) => {
                let node = g.inputs[*i].node;
                outs.push((k, node.map(|node| ValueRef { node, result: 0 })));
                format!("output {k}\\ninput {i}, unchanged")
            }
            Output::Sym(e) => {
                outs.push((k, None));
                format!("output {k}\\nsym {}", esc(&e.to_string()))
            }
            Output::Int(i) => {
                outs.push((k, None));
                format!("output {k}\\nint {i}")
            }
            Output::None => continue,
        };
        let _ = writeln!(
            s,
            "  out{k} [shape=house, style=filled, fillcolor=\"#ffd27f\", label=\"{label}\", class=\"output\"];"
        );
    }

    for e in g.dag.edge_references() {
        let (src, dst) = (e.source(), e.target());
        let n = g.node(src);
        let label = if n.results.len() > 1 {
            format!(" [label=\"#{}\"]", e.weight())
        } else {
            String::new()
        };
        let from = if split_inputs.contains(&src) || long(src, dst) {
            // A copy of the producer next to the consumer, dashed; its tooltip says why.
            let copy = format!("c{}", e.id().index());
            let t = n
                .results
                .get(*e.weight())
                .and_then(|t| t.as_ref())
                .map_or("_".into(), short_type);
            let (shape, why) = if kinds[&src] == Kind::Input {
                ("invhouse", "input drawn once per use")
            } else {
                ("box", "produced far above: edge drawn as a stub")
            };
            let _ = writeln!(
                s,
                "  {copy} [shape={shape}, style=\"rounded,dashed,filled\", fillcolor=\"{}\", \
                 label=\"%{}\\n{}\", tooltip=\"%{}: {why}\", class=\"stub\"];",
                kinds[&src].color(),
                esc(&n.name),
                esc(&t),
                esc(&n.name),
            );
            copy
        } else {
            node_id(src)
        };
        let _ = writeln!(s, "  {from} -> {}{label};", node_id(dst));
    }
    for (k, v) in &outs {
        if let Some(v) = v {
            if g.dag.contains_node(v.node) {
                let lbl = if g.node(v.node).results.len() > 1 {
                    format!(" [label=\"#{}\"]", v.result)
                } else {
                    String::new()
                };
                let _ = writeln!(s, "  {} -> out{k}{lbl};", node_id(v.node));
            }
        }
    }

    if opts.legend {
        let mut counts: BTreeMap<Kind, usize> = BTreeMap::new();
        for k in kinds.values() {
            *counts.entry(*k).or_default() += 1;
        }
        let rows: String = Kind::ALL
            .iter()
            .filter_map(|k| {
                counts.get(k).map(|c| {
                    format!(
                        "<TR><TD BGCOLOR=\"{}\" WIDTH=\"14\"></TD><TD ALIGN=\"LEFT\">{} ({c})</TD></TR>",
                        k.color(),
                        k.name()
                    )
                })
            })
            .collect();
        let _ = writeln!(
            s,
            "  legend [shape=plaintext, style=\"\", fontsize=9, label=<<TABLE BORDER=\"0\" \
             CELLBORDER=\"1\" CELLSPACING=\"0\" CELLPADDING=\"3\"><TR><TD COLSPAN=\"2\"><B>kinds \
             (nodes)</B></TD></TR>{rows}<TR><TD BGCOLOR=\"#ffd27f\"></TD><TD ALIGN=\"LEFT\">output \
             ({})</TD></TR></TABLE>>];",
            outs.len()
        );
    }
    let _ = writeln!(s, "}}");
    s
}

/// A CSS-friendly class name per kind (SVG `class` attribute).
fn kind_class(k: Kind) -> &'static str {
    match k {
        Kind::Input => "input",
        Kind::Matmul => "matmul",
        Kind::Elementwise => "elementwise",
        Kind::Reduction => "reduction",
        Kind::Shape => "shape",
        Kind::Indexing => "indexing",
        Kind::Creation => "creation",
        Kind::Fused => "fused",
        Kind::Other => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::import_json;

    const G: &str = r#"{"nodes": [
      {"name": "x", "op": "placeholder", "target": "x", "val": {"tensor": {"shape": [2, 4], "dtype": "float32"}}},
      {"name": "w", "op": "placeholder", "target": "w", "val": {"tensor": {"shape": [4, 3], "dtype": "float32"}}},
      {"name": "mm", "op": "call_function", "target": "aten.mm.default", "args": [{"node": "x"}, {"node": "w"}], "val": {"tensor": {"shape": [2, 3], "dtype": "float32"}}},
      {"name": "relu", "op": "call_function", "target": "aten.relu.default", "args": [{"node": "mm"}], "val": {"tensor": {"shape": [2, 3], "dtype": "float32"}}},
      {"name": "mul", "op": "call_function", "target": "aten.mul.Tensor", "args": [{"node": "relu"}, 2.0], "val": {"tensor": {"shape": [2, 3], "dtype": "float32"}}},
      {"name": "sum", "op": "call_function", "target": "aten.sum.dim_IntList", "args": [{"node": "mul"}, [1]], "val": {"tensor": {"shape": [2], "dtype": "float32"}}},
      {"name": "ln", "op": "call_function", "target": "aten.native_layer_norm.default", "args": [{"node": "mul"}, [3], null, null, 1e-5],
       "val": {"tuple": [{"tensor": {"shape": [2, 3], "dtype": "float32"}}, {"tensor": {"shape": [2, 1], "dtype": "float32"}}, {"tensor": {"shape": [2, 1], "dtype": "float32"}}]}},
      {"name": "g1", "op": "call_function", "target": "<built-in function getitem>", "args": [{"node": "ln"}, 1], "val": {"tensor": {"shape": [2, 1], "dtype": "float32"}}},
      {"name": "output", "op": "output", "target": "output", "args": [[{"node": "sum"}, {"node": "g1"}, null]]}
    ]}"#;

    #[test]
    fn kinds() {
        assert_eq!(kind_of("aten.addmm.default"), Kind::Matmul);
        assert_eq!(kind_of("aten.convolution.default"), Kind::Matmul);
        assert_eq!(kind_of("aten.add.Tensor"), Kind::Elementwise);
        assert_eq!(kind_of("aten._softmax.default"), Kind::Reduction);
        assert_eq!(kind_of("aten.view.default"), Kind::Shape);
        assert_eq!(kind_of("aten.embedding.default"), Kind::Indexing);
        assert_eq!(kind_of("aten.full.default"), Kind::Creation);
        assert_eq!(kind_of("tpuc.fused_gelu"), Kind::Fused);
        assert_eq!(kind_of("aten.frobnicate.default"), Kind::Other);
        assert_eq!(kind_of("input"), Kind::Input);
    }

    #[test]
    fn dot_has_nodes_types_regions_and_outputs() {
        let g = import_json(G).unwrap();
        let dot = to_dot(
            &g,
            &DotOptions {
                title: "g \"0\"".into(),
                ..DotOptions::default()
            },
        );
        assert!(dot.starts_with("digraph tpuc {"), "{dot}");
        assert!(dot.contains(r#"label="g \"0\"""#), "{dot}");
        // inputs: their own shape and type
        assert!(dot.contains("shape=invhouse"), "{dot}");
        assert!(dot.contains(r#"label="x\nf32[2,4]""#), "{dot}");
        // ops with short names and result types
        assert!(dot.contains(r#"label="mm.default\nf32[2,3]""#), "{dot}");
        assert!(
            dot.contains(r#"label="native_layer_norm.default\nf32[2,3], f32[2,1], f32[2,1]""#),
            "{dot}"
        );
        // relu -> mul is an elementwise region of 2; sum + layer norm are separate (no edge)
        assert!(dot.contains("elementwise region (2 ops)"), "{dot}");
        assert!(!dot.contains("reduction/normalization region"), "{dot}");
        // outputs, and the multi-result edge names its result
        assert!(dot.contains("out0 [shape=house"), "{dot}");
        assert!(dot.contains("out1 [shape=house"), "{dot}");
        assert!(!dot.contains("out2"), "{dot}");
        assert!(dot.contains(r##"-> out1 [label="#1"]"##), "{dot}");
        assert!(dot.contains("legend"), "{dot}");
        assert_eq!(dot.matches('{').count(), dot.matches('}').count());
        let plain = to_dot(
            &g,
            &DotOptions {
                clusters: false,
                legend: false,
                ..DotOptions::default()
            },
        );
        assert!(!plain.contains("subgraph cluster"), "{plain}");
        assert!(!plain.contains("legend"), "{plain}");
    }

    /// x -> relu_0 -> ... -> relu_69, add(relu_69, relu_0), mul(add, x): the edge from relu_0
    /// and the late use of x span more than `long_edge` ops.
    #[test]
    fn long_edges_become_stubs() {
        let t = r#"{"tensor": {"shape": [2], "dtype": "float32"}}"#;
        let mut nodes = vec![format!(
            r#"{{"name": "x", "op": "placeholder", "target": "x", "val": {t}}}"#
        )];
        let mut prev = "x".to_string();
        for i in 0..70 {
            nodes.push(format!(
                r#"{{"name": "relu_{i}", "op": "call_function", "target": "aten.relu.default", "args": [{{"node": "{prev}"}}], "val": {t}}}"#
            ));
            prev = format!("relu_{i}");
        }
        nodes.push(format!(r#"{{"name": "add", "op": "call_function", "target": "aten.add.Tensor", "args": [{{"node": "relu_69"}}, {{"node": "relu_0"}}], "val": {t}}}"#));
        nodes.push(format!(r#"{{"name": "mul", "op": "call_function", "target": "aten.mul.Tensor", "args": [{{"node": "add"}}, {{"node": "x"}}], "val": {t}}}"#));
        nodes.push(r#"{"name": "output", "op": "output", "target": "output", "args": [[{"node": "mul"}]]}"#.into());
        let g = import_json(&format!(r#"{{"nodes": [{}]}}"#, nodes.join(","))).unwrap();
        let dot = to_dot(&g, &DotOptions::default());
        // relu_0 -> add is a stub next to add; x is drawn once per use (two dashed copies)
        assert!(
            dot.contains(r#"label="%relu_0\nf32[2]", tooltip="%relu_0: produced far above"#),
            "{dot}"
        );
        assert_eq!(dot.matches(r#"label="%x\nf32[2]""#).count(), 2, "{dot}");
        assert!(!dot.contains(r#"label="x\nf32[2]""#), "{dot}");
        let all = to_dot(
            &g,
            &DotOptions {
                long_edge: 0,
                ..DotOptions::default()
            },
        );
        assert!(!all.contains("class=\"stub\""), "{all}");
        assert_eq!(all.matches(" -> ").count(), g.dag.edge_count() + 1);
    }

    #[test]
    fn escapes() {
        assert_eq!(esc("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
