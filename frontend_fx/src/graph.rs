use crate::{DType, Dim, SourceLoc, SymExpr};
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

pub type NodeId = NodeIndex<u32>;

/// Shape and element type of one tensor value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    pub shape: Vec<Dim>,
    pub dtype: DType,
}

impl TensorType {
    pub fn new_static(shape: &[i64], dtype: DType) -> TensorType {
        TensorType {
            shape: shape.iter().map(|&d| Dim::Static(d)).collect(),
            dtype,
        }
    }

    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// The static sizes, or None when a dim is still symbolic.
    pub fn static_shape(&self) -> Option<Vec<i64>> {
        self.shape.iter().map(Dim::as_static).collect()
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self.shape.iter().map(|d| d.to_string()).collect();
        write!(f, "{}[{}]", self.dtype, dims.join(", "))
    }
}

/// One result of one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ValueRef {
    pub node: NodeId,
    pub result: usize,
}

/// An operand of an op: a tensor value from another node or a literal.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Arg {
    Value(ValueRef),
    Int(i64),
    Float(f64),
    Bool(bool),
    None,
    Str(String),
    DType(DType),
    Device(String),
    /// A symbolic integer (a size that depends on input shapes).
    Sym(SymExpr),
    List(Vec<Arg>),
    /// A nested graph: index `k` into the owning graph's [`Graph::regions`] (a branch or body
    /// of a control-flow op).
    Region(usize),
}

impl Arg {
    /// Every tensor value this argument refers to, in order.
    pub fn values(&self) -> Vec<ValueRef> {
        match self {
            Arg::Value(v) => vec![*v],
            Arg::List(items) => items.iter().flat_map(Arg::values).collect(),
            _ => Vec::new(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum InputKind {
    Tensor(TensorType),
    /// A SymInt input (Dynamo passes the size as a Python int).
    SymInt(SymExpr),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Input {
    pub name: String,
    pub kind: InputKind,
    /// The graph node that stands for a tensor input; None for SymInt inputs.
    pub node: Option<NodeId>,
}

/// One op of the graph.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// The FX node name, kept for error messages and dumps.
    pub name: String,
    /// The ATen overload (`aten.addmm.default`), or `input` for a graph input.
    pub op: String,
    pub args: Vec<Arg>,
    pub kwargs: BTreeMap<String, Arg>,
    /// Result types; `None` for a result that is not a tensor.
    pub results: Vec<Option<TensorType>>,
    /// The user's source location (from FX's `stack_trace`), when known. A node a pass makes
    /// in place of another takes that one's location.
    #[serde(default)]
    pub loc: Option<Box<SourceLoc>>,
    /// Whether the node recomputes, for the backward, a value the forward computed too
    /// (activation checkpointing): passes never merge it with a node that is not recomputed,
    /// and lowering puts the recomputation's inputs behind an optimization barrier so that XLA
    /// does not merge it back either (docs/training.md, "Activation checkpointing").
    #[serde(default)]
    pub recomputed: bool,
}

impl Node {
    pub const INPUT: &'static str = "input";

    pub fn is_input(&self) -> bool {
        self.op == Self::INPUT
    }

    /// The tensor values this node reads, in operand order.
    pub fn operands(&self) -> Vec<ValueRef> {
        self.args
            .iter()
            .chain(self.kwargs.values())
            .flat_map(Arg::values)
            .collect()
    }
}

/// What one output slot of the FX graph holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Output {
    Value(ValueRef),
    /// The graph input at this position in `inputs`, returned unchanged (an FX placeholder
    /// that is itself an output, as AOTAutograd's forward returns the parameters its backward
    /// needs). Not an output of the executable: the caller's own tensor is the result, as
    /// Inductor returns it, so nothing copies it and autograd's version checks see it.
    Input(usize),
    Sym(SymExpr),
    Int(i64),
    None,
}

/// The IR: a DAG of ops (edges point from producer to consumer), plus the ordered graph inputs
/// and outputs.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Graph {
    pub dag: StableDiGraph<Node, usize>,
    pub inputs: Vec<Input>,
    pub outputs: Vec<Output>,
    /// Lowering-time rewrites that IR passes switched on (`fold_transposes`, `composites`):
    /// they act where StableHLO has the means (dot dimension numbers, functions), so the IR
    /// itself stays in ATen terms for bucketing and sharding. Graphs derived from this one
    /// (specialized, bucketed) keep the set.
    #[serde(default)]
    pub lowering: std::collections::BTreeSet<String>,
    /// Positions in `outputs` that lowering may return in their physical layout (a
    /// channels-last value as NHWC, see `Lowered::output_perms`) instead of row-major: only
    /// outputs whose caller takes a permuted view, as the saved activations that only tpuc's
    /// own backward graph reads. Derived graphs (bucketed) drop it.
    #[serde(default)]
    pub free_layout_outputs: std::collections::BTreeSet<usize>,
    /// {position in `inputs`: position in `outputs`}: inputs the caller overwrites with that
    /// output's value after each call (a training step's parameters and optimizer state).
    /// Lowering lets the output reuse the input's buffer (`tf.aliasing_output`) where both have
    /// one type and layout. Derived graphs (bucketed) drop it.
    #[serde(default)]
    pub written_inputs: std::collections::BTreeMap<usize, usize>,
    /// The nested graphs of control-flow ops (`higher_order.cond`'s branches, a loop's
    /// condition and body), each closed: it reads only its own inputs, which the op passes
    /// (see docs/control-flow.md). A node names one by [`Arg::Region`]. The passes leave them
    /// as imported; specialization substitutes sizes in them too.
    #[serde(default)]
    pub regions: Vec<Graph>,
}

impl Graph {
    /// [`Graph::written_inputs`] as positions among the module's arguments (tensor inputs that
    /// have a node) and results (`Output::Value` outputs), in input order.
    pub fn written_tensor_pairs(&self) -> Vec<(usize, usize)> {
        fn positions(is_tensor: impl Iterator<Item = bool>) -> Vec<Option<usize>> {
            let mut k = 0;
            is_tensor
                .map(|t| {
                    t.then(|| {
                        k += 1;
                        k - 1
                    })
                })
                .collect()
        }
        let args = positions(
            self.inputs
                .iter()
                .map(|i| matches!((&i.kind, i.node), (InputKind::Tensor(_), Some(_)))),
        );
        let results = positions(self.outputs.iter().map(|o| matches!(o, Output::Value(_))));
        self.written_inputs
            .iter()
            .filter_map(|(i, o)| Some(((*args.get(*i)?)?, (*results.get(*o)?)?)))
            .collect()
    }

    /// The nodes whose results the graph returns as tensors, in output order.
    pub fn output_nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.outputs.iter().filter_map(|o| match o {
            Output::Value(v) => Some(v.node),
            _ => None,
        })
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.dag[id]
    }

    /// Adds a node and one edge per tensor operand.
    pub fn add_node(&mut self, node: Node) -> NodeId {
        let operands = node.operands();
        let id = self.dag.add_node(node);
        for v in operands {
            self.dag.add_edge(v.node, id, v.result);
        }
        id
    }

    /// Removes a node that nothing reads any more.
    pub fn remove_node(&mut self, id: NodeId) -> Option<Node> {
        self.dag.remove_node(id)
    }

    pub fn value_type(&self, v: ValueRef) -> Option<&TensorType> {
        self.dag[v.node].results.get(v.result)?.as_ref()
    }

    /// Nodes in an order where every producer comes before its consumers
    /// (the order they were added in, which import keeps topological).
    pub fn topo_order(&self) -> Vec<NodeId> {
        let mut ids: Vec<NodeId> = self.dag.node_indices().collect();
        ids.sort();
        ids
    }

    pub fn users(&self, id: NodeId) -> impl Iterator<Item = NodeId> + '_ {
        self.dag
            .edges_directed(id, petgraph::Direction::Outgoing)
            .map(|e| e.target())
    }

    /// Number of ops (inputs excluded), grouped by op name: what dumps and pass reports show.
    pub fn op_counts(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for n in self.dag.node_weights().filter(|n| !n.is_input()) {
            *counts.entry(n.op.clone()).or_default() += 1;
        }
        counts
    }

    pub fn op_count(&self) -> usize {
        self.dag.node_weights().filter(|n| !n.is_input()).count()
    }
}

impl fmt::Display for Graph {
    /// A readable listing, one line per node: `%name: f32[2, 3] = aten.add.Tensor(%x, %y)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let arg_str = |a: &Arg| -> String { fmt_arg(self, a) };
        for id in self.topo_order() {
            let n = &self.dag[id];
            let types: Vec<String> = n
                .results
                .iter()
                .map(|t| t.as_ref().map_or("_".into(), |t| t.to_string()))
                .collect();
            let mut args: Vec<String> = n.args.iter().map(arg_str).collect();
            args.extend(n.kwargs.iter().map(|(k, v)| format!("{k}={}", arg_str(v))));
            writeln!(
                f,
                "%{}: {} = {}({}){}",
                n.name,
                types.join(", "),
                n.op,
                args.join(", "),
                if n.recomputed { "  # recomputed" } else { "" }
            )?;
        }
        let outs: Vec<String> = self
            .outputs
            .iter()
            .map(|o| match o {
                Output::Value(v) => fmt_value(self, *v),
                Output::Input(k) => format!("%{}", self.inputs[*k].name),
                Output::Sym(s) => s.to_string(),
                Output::Int(i) => i.to_string(),
                Output::None => "None".into(),
            })
            .collect();
        writeln!(f, "return ({})", outs.join(", "))?;
        if !self.lowering.is_empty() {
            let names: Vec<&str> = self.lowering.iter().map(String::as_str).collect();
            writeln!(f, "lowering: {}", names.join(", "))?;
        }
        for (k, r) in self.regions.iter().enumerate() {
            let ins: Vec<String> = r.inputs.iter().map(|i| format!("%{}", i.name)).collect();
            writeln!(f, "region {k}({}) {{", ins.join(", "))?;
            for line in r.to_string().lines() {
                writeln!(f, "  {line}")?;
            }
            writeln!(f, "}}")?;
        }
        Ok(())
    }
}

fn fmt_value(g: &Graph, v: ValueRef) -> String {
    let name = g.dag.node_weight(v.node).map_or("?", |n| n.name.as_str());
    if g.dag
        .node_weight(v.node)
        .is_some_and(|n| n.results.len() > 1)
    {
        format!("%{name}#{}", v.result)
    } else {
        format!("%{name}")
    }
}

fn fmt_arg(g: &Graph, a: &Arg) -> String {
    match a {
        Arg::Value(v) => fmt_value(g, *v),
        Arg::Int(i) => i.to_string(),
        Arg::Float(x) => format!("{x:?}"),
        Arg::Bool(b) => b.to_string(),
        Arg::None => "None".into(),
        Arg::Str(s) => format!("{s:?}"),
        Arg::DType(d) => d.to_string(),
        Arg::Device(d) => format!("device({d})"),
        Arg::Sym(s) => format!("sym({s})"),
        Arg::Region(k) => format!("region({k})"),
        Arg::List(items) => {
            let parts: Vec<String> = items.iter().map(|i| fmt_arg(g, i)).collect();
            format!("[{}]", parts.join(", "))
        }
    }
}
