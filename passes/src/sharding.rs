//! Sharding over a device mesh (SPMD). The pass decides a layout ([`Spec`]) for every tensor input
//! and output of a static graph, and for the intermediates where the choice matters (the outputs
//! of column-parallel matmuls under tensor parallelism). Lowering writes them as `mhlo.sharding`
//! annotations and XLA's SPMD partitioner inserts the collectives.
//!
//! Any assignment is numerically correct: the runtime splits each input and reassembles each
//! output by the very specs chosen here, and XLA keeps the program's meaning. The strategies only
//! decide memory and speed, so a heuristic that misjudges a graph costs time, never correctness.

use std::collections::{HashMap, HashSet};
use tpuc_frontend_fx::{Arg, Graph, InputKind, NodeId, Output, ValueRef};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct ShardingError(pub String);

type R<X> = Result<X, ShardingError>;

fn err<X>(message: impl Into<String>) -> R<X> {
    Err(ShardingError(message.into()))
}

/// A logical grid of devices with named axes; device `d` sits at the row-major coordinates of `d`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    pub shape: Vec<i64>,
    pub axes: Vec<String>,
}

impl Mesh {
    pub fn new(shape: Vec<i64>, axes: Vec<String>) -> R<Mesh> {
        if shape.is_empty() || shape.len() != axes.len() || shape.iter().any(|&s| s < 1) {
            return err(format!(
                "mesh shape {shape:?} with axes {axes:?}: need one positive size per named axis"
            ));
        }
        let unique: HashSet<&String> = axes.iter().collect();
        if unique.len() != axes.len() {
            return err(format!("mesh axes {axes:?} repeat a name"));
        }
        Ok(Mesh { shape, axes })
    }

    /// Number of devices.
    pub fn size(&self) -> i64 {
        self.shape.iter().product()
    }

    pub fn axis(&self, name: &str) -> Option<usize> {
        self.axes.iter().position(|a| a == name)
    }

    /// The axis a strategy uses: the one called `name`, or the only axis of a one-axis mesh.
    pub fn axis_for(&self, name: &str, strategy: &str) -> R<usize> {
        if let Some(a) = self.axis(name) {
            return Ok(a);
        }
        if self.axes.len() == 1 {
            return Ok(0);
        }
        err(format!(
            "sharding {strategy:?} needs a mesh axis named {name:?}; the mesh has axes {:?}",
            self.axes
        ))
    }

    /// Row-major coordinates of `device`.
    pub fn coords(&self, device: i64) -> Vec<i64> {
        let mut rest = device;
        let mut c = vec![0; self.shape.len()];
        for (k, &s) in self.shape.iter().enumerate().rev() {
            c[k] = rest % s;
            rest /= s;
        }
        c
    }

    fn device(&self, coords: &[i64]) -> i64 {
        coords
            .iter()
            .zip(&self.shape)
            .fold(0, |acc, (&c, &s)| acc * s + c)
    }
}

/// The layout of one tensor: for each of its dims, the mesh axes it is split over (major first;
/// empty = not split). Mesh axes used by no dim hold copies (replication).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Spec(pub Vec<Vec<usize>>);

impl Spec {
    pub fn replicated(rank: usize) -> Spec {
        Spec(vec![vec![]; rank])
    }

    /// Split along `dim` over `axis`, whole along every other dim.
    pub fn on_dim(rank: usize, dim: usize, axis: usize) -> Spec {
        let mut s = Spec::replicated(rank);
        s.0[dim].push(axis);
        s
    }

    pub fn is_replicated(&self) -> bool {
        self.0.iter().all(Vec::is_empty)
    }

    /// Number of pieces along each dim.
    pub fn tiles(&self, mesh: &Mesh) -> Vec<i64> {
        self.0
            .iter()
            .map(|axes| axes.iter().map(|&a| mesh.shape[a]).product())
            .collect()
    }

    /// The shape each device holds.
    pub fn shard_shape(&self, shape: &[i64], mesh: &Mesh) -> Vec<i64> {
        shape
            .iter()
            .zip(self.tiles(mesh))
            .map(|(&n, t)| n / t)
            .collect()
    }

    /// Which piece along each dim `device` holds.
    pub fn tile_index(&self, mesh: &Mesh, device: i64) -> Vec<i64> {
        let c = mesh.coords(device);
        self.0
            .iter()
            .map(|axes| axes.iter().fold(0, |acc, &a| acc * mesh.shape[a] + c[a]))
            .collect()
    }

    /// Whether `device` holds the first copy of its piece (coordinate 0 on every unused axis):
    /// reading these devices' shards covers the tensor exactly once.
    pub fn is_first_copy(&self, mesh: &Mesh, device: i64) -> bool {
        let used: HashSet<usize> = self.0.iter().flatten().copied().collect();
        let c = mesh.coords(device);
        (0..mesh.shape.len()).all(|a| used.contains(&a) || c[a] == 0)
    }

    /// Each device's piece of a tensor of `shape`, in device order: where it starts, its shape,
    /// and whether it is the first copy of that piece (what the runtime splits and reassembles by).
    pub fn pieces(&self, shape: &[i64], mesh: &Mesh) -> Vec<Piece> {
        let size = self.shard_shape(shape, mesh);
        (0..mesh.size())
            .map(|d| Piece {
                offsets: self
                    .tile_index(mesh, d)
                    .iter()
                    .zip(&size)
                    .map(|(i, s)| i * s)
                    .collect(),
                shape: size.clone(),
                first_copy: self.is_first_copy(mesh, d),
            })
            .collect()
    }

    /// Checks the spec against a tensor of `shape` on `mesh`; `what` names the tensor.
    pub fn check(&self, shape: &[i64], mesh: &Mesh, what: &str) -> R<()> {
        if self.0.len() != shape.len() {
            return err(format!(
                "{what}: spec {} has {} entries for a tensor of rank {} (shape {shape:?})",
                self.describe(mesh),
                self.0.len(),
                shape.len()
            ));
        }
        let mut seen = HashSet::new();
        for axes in &self.0 {
            for &a in axes {
                if a >= mesh.shape.len() || !seen.insert(a) {
                    return err(format!(
                        "{what}: spec {} uses a mesh axis twice or one the mesh lacks",
                        self.describe(mesh)
                    ));
                }
            }
        }
        for (dim, (&n, t)) in shape.iter().zip(self.tiles(mesh)).enumerate() {
            if n % t != 0 {
                let names: Vec<&str> = self.0[dim].iter().map(|&a| &*mesh.axes[a]).collect();
                return err(format!(
                    "{what}: dim {dim} has size {n}, not divisible by mesh axis {} of size {t} \
                     (shapes split evenly; use a size divisible by {t} or another spec)",
                    names.join("*")
                ));
            }
        }
        Ok(())
    }

    /// Python-style text: `("data", None)`.
    pub fn describe(&self, mesh: &Mesh) -> String {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|axes| match axes.as_slice() {
                [] => "None".to_string(),
                [a] => format!("{:?}", mesh.axes[*a]),
                many => format!(
                    "({})",
                    many.iter()
                        .map(|&a| format!("{:?}", mesh.axes[a]))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })
            .collect();
        if parts.len() == 1 {
            format!("({},)", parts[0])
        } else {
            format!("({})", parts.join(", "))
        }
    }

    /// The HLO sharding text XLA reads from `mhlo.sharding`: tile counts per dim, then (when some
    /// mesh axes are unused) a last dim of copies, and the devices in row-major tile order.
    pub fn hlo(&self, mesh: &Mesh) -> String {
        let tiles = self.tiles(mesh);
        if tiles.iter().all(|&t| t == 1) {
            return "{replicated}".to_string();
        }
        let used: HashSet<usize> = self.0.iter().flatten().copied().collect();
        let unused: Vec<usize> = (0..mesh.shape.len())
            .filter(|a| !used.contains(a))
            .collect();
        let copies: i64 = unused.iter().map(|&a| mesh.shape[a]).product();
        let mut groups: Vec<Vec<usize>> = self.0.clone();
        let mut dims = tiles.clone();
        if copies > 1 {
            groups.push(unused);
            dims.push(copies);
        }
        let total: i64 = dims.iter().product();
        let mut devices = Vec::with_capacity(total as usize);
        for flat in 0..total {
            // Index along each tile dim (row-major), then each index into its axes' coordinates.
            let mut rest = flat;
            let mut idx = vec![0; dims.len()];
            for k in (0..dims.len()).rev() {
                idx[k] = rest % dims[k];
                rest /= dims[k];
            }
            let mut coords = vec![0; mesh.shape.len()];
            for (group, mut i) in groups.iter().zip(idx) {
                for &a in group.iter().rev() {
                    coords[a] = i % mesh.shape[a];
                    i /= mesh.shape[a];
                }
            }
            devices.push(mesh.device(&coords).to_string());
        }
        let dims: Vec<String> = dims.iter().map(i64::to_string).collect();
        format!(
            "{{devices=[{}]{}{}}}",
            dims.join(","),
            devices.join(","),
            if copies > 1 {
                " last_tile_dim_replicate"
            } else {
                ""
            }
        )
    }
}

/// One device's piece of a sharded tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub offsets: Vec<i64>,
    pub shape: Vec<i64>,
    pub first_copy: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    Replicated,
    DataParallel,
    Fsdp,
    TensorParallel,
}

impl Strategy {
    pub fn parse(s: &str) -> Option<Strategy> {
        Some(match s {
            "replicated" => Strategy::Replicated,
            "data_parallel" => Strategy::DataParallel,
            "fsdp" => Strategy::Fsdp,
            "tensor_parallel" => Strategy::TensorParallel,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Replicated => "replicated",
            Strategy::DataParallel => "data_parallel",
            Strategy::Fsdp => "fsdp",
            Strategy::TensorParallel => "tensor_parallel",
        }
    }
}

/// What a graph input is to the model (outputs: what the value they produce belongs to, e.g. the
/// gradient of a parameter).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Role {
    Parameter,
    Buffer,
    /// A model input (batch-major).
    Data,
    #[default]
    Other,
}

/// One tensor input or output: its role, a name for messages, and a spec that must be used as is
/// (explicit user specs, or a parameter's spec carried from the forward to the backward graph).
#[derive(Clone, Debug, Default)]
pub struct Slot {
    pub role: Role,
    pub name: String,
    pub fixed: Option<Spec>,
}

#[derive(Clone, Debug)]
pub struct ShardingRequest {
    pub mesh: Mesh,
    pub strategy: Strategy,
    /// One per tensor input of the graph, in order.
    pub inputs: Vec<Slot>,
    /// One per tensor output of the graph, in order.
    pub outputs: Vec<Slot>,
    /// The global batch size; by default dim 0 of the first `Data` input.
    pub batch: Option<i64>,
}

/// The pass's decision: a spec per tensor input and output, and annotations on intermediates.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardingPlan {
    pub mesh: Mesh,
    pub inputs: Vec<Spec>,
    pub outputs: Vec<Spec>,
    pub constraints: Vec<(ValueRef, Spec)>,
}

/// Chooses the layouts for a static graph. Errors name the tensor, dim and mesh axis at fault.
pub fn shard(graph: &Graph, req: &ShardingRequest) -> R<ShardingPlan> {
    let mesh = &req.mesh;
    let ins = tensor_inputs(graph)?;
    let outs = tensor_outputs(graph)?;
    if ins.len() != req.inputs.len() || outs.len() != req.outputs.len() {
        return err(format!(
            "sharding request describes {} inputs and {} outputs; the graph has {} and {}",
            req.inputs.len(),
            req.outputs.len(),
            ins.len(),
            outs.len()
        ));
    }
    let strategy = req.strategy;
    let name = strategy.name();
    let data_axis = match strategy {
        Strategy::DataParallel | Strategy::Fsdp => Some(mesh.axis_for("data", name)?),
        _ => None,
    };
    let batch = req.batch.or_else(|| {
        ins.iter()
            .zip(&req.inputs)
            .find(|((_, s), slot)| slot.role == Role::Data && !s.is_empty())
            .map(|((_, s), _)| s[0])
    });
    // Split dim 0 over the data axis when it is the batch, or batch-major rows (a [B, T, H]
    // activation viewed as [B*T, H]): then each device's rows are its own batch shard's.
    let batch_like = |shape: &[i64]| -> Spec {
        match (data_axis, batch) {
            (Some(a), Some(b))
                if !shape.is_empty()
                    && b > 0
                    && shape[0] % b == 0
                    && shape[0] > 0
                    && b % mesh.shape[a] == 0 =>
            {
                Spec::on_dim(shape.len(), 0, a)
            }
            _ => Spec::replicated(shape.len()),
        }
    };
    // FSDP: a parameter is split along its first dim that divides evenly.
    let fsdp = |shape: &[i64]| -> Spec {
        let a = data_axis.expect("fsdp has a data axis");
        let n = mesh.shape[a];
        match shape.iter().position(|&d| d >= n && d % n == 0) {
            Some(dim) => Spec::on_dim(shape.len(), dim, a),
            None => Spec::replicated(shape.len()),
        }
    };
    let (tp_params, constraints) = match strategy {
        Strategy::TensorParallel => {
            let model = mesh.axis_for("model", name)?;
            tensor_parallel(graph, &ins, &req.inputs, mesh, model)
        }
        _ => (HashMap::new(), Vec::new()),
    };

    let mut inputs = Vec::with_capacity(ins.len());
    for (k, ((node, shape), slot)) in ins.iter().zip(&req.inputs).enumerate() {
        let what = format!("input `{}` (graph input {k})", slot.name);
        let spec = if let Some(s) = &slot.fixed {
            s.clone()
        } else {
            match (strategy, slot.role) {
                (Strategy::DataParallel | Strategy::Fsdp, Role::Data) if !shape.is_empty() => {
                    Spec::on_dim(shape.len(), 0, data_axis.expect("set above"))
                }
                (Strategy::Fsdp, Role::Parameter) => fsdp(shape),
                (Strategy::DataParallel | Strategy::Fsdp, Role::Other) => batch_like(shape),
                (Strategy::TensorParallel, Role::Parameter) => tp_params
                    .get(node)
                    .cloned()
                    .unwrap_or_else(|| Spec::replicated(shape.len())),
                _ => Spec::replicated(shape.len()),
            }
        };
        spec.check(shape, mesh, &format!("{what}, sharded by {name}"))?;
        inputs.push(spec);
    }
    // Outputs computed from batch-split inputs are batch-major; the rest (a transposed weight
    // saved for the backward pass, say) stay whole, so XLA need not split and regather them.
    let from_batch = match data_axis {
        Some(a) => {
            let split: Vec<NodeId> = ins
                .iter()
                .zip(&inputs)
                .filter(|(_, s)| s.0.first().is_some_and(|d| d.contains(&a)))
                .map(|((id, _), _)| *id)
                .collect();
            reachable(graph, &split)
        }
        None => HashSet::new(),
    };
    let out_nodes: Vec<NodeId> = graph.output_nodes().collect();
    let mut outputs = Vec::with_capacity(outs.len());
    for (k, ((shape, slot), node)) in outs.iter().zip(&req.outputs).zip(&out_nodes).enumerate() {
        let spec = if let Some(s) = &slot.fixed {
            s.clone()
        } else {
            match (strategy, slot.role) {
                (Strategy::Fsdp, Role::Parameter) => fsdp(shape),
                (Strategy::DataParallel | Strategy::Fsdp, Role::Parameter | Role::Buffer) => {
                    Spec::replicated(shape.len())
                }
                (Strategy::DataParallel | Strategy::Fsdp, _) if from_batch.contains(node) => {
                    batch_like(shape)
                }
                _ => Spec::replicated(shape.len()),
            }
        };
        spec.check(
            shape,
            mesh,
            &format!("output `{}` (graph output {k})", slot.name),
        )?;
        outputs.push(spec);
    }
    // A written input's new value (a parameter or optimizer state updated in place) is laid
    // out as the input it replaces, so it can reuse the input's buffer and the next call reads
    // it where the last one wrote it.
    for (a, r) in graph.written_tensor_pairs() {
        if req.outputs[r].fixed.is_none() && ins[a].1 == outs[r] {
            outputs[r] = inputs[a].clone();
        }
    }
    Ok(ShardingPlan {
        mesh: mesh.clone(),
        inputs,
        outputs,
        constraints,
    })
}

/// Nodes that depend on any of `roots` (the roots included).
fn reachable(graph: &Graph, roots: &[NodeId]) -> HashSet<NodeId> {
    let mut seen: HashSet<NodeId> = roots.iter().copied().collect();
    for id in graph.topo_order() {
        if !seen.contains(&id)
            && graph
                .node(id)
                .operands()
                .iter()
                .any(|v| seen.contains(&v.node))
        {
            seen.insert(id);
        }
    }
    seen
}

fn tensor_inputs(graph: &Graph) -> R<Vec<(NodeId, Vec<i64>)>> {
    let mut out = Vec::new();
    for inp in &graph.inputs {
        if let (InputKind::Tensor(t), Some(node)) = (&inp.kind, inp.node) {
            let Some(shape) = t.static_shape() else {
                return err(format!(
                    "input `{}` has symbolic shape {t}; sharding needs static shapes",
                    inp.name
                ));
            };
            out.push((node, shape));
        }
    }
    Ok(out)
}

fn tensor_outputs(graph: &Graph) -> R<Vec<Vec<i64>>> {
    let mut out = Vec::new();
    for o in &graph.outputs {
        if let Output::Value(v) = o {
            let shape = graph.value_type(*v).and_then(|t| t.static_shape());
            match shape {
                Some(s) => out.push(s),
                None => return err("a graph output has a symbolic shape; sharding needs static"),
            }
        }
    }
    Ok(out)
}

/// Megatron-style tensor parallelism. A linear layer's weight `W` ([out, in], used as
/// `mm(x, permute(W, [1, 0]))` / `addmm(b, x, ...)`, or [in, out] used directly as in GPT-2's
/// Conv1D) is split by its output features (column-parallel) when its input is whole, and by its
/// input features (row-parallel, XLA all-reduces the partial sums) when its input is already split
/// by features. Feature-split values flow through every other op. So attention's q/k/v and an
/// MLP's up/gate projections become column-parallel (heads split), the output and down
/// projections row-parallel. Returns the parameter specs and the column-parallel outputs'
/// constraints (last dim split), which keep XLA from gathering them early.
fn tensor_parallel(
    graph: &Graph,
    ins: &[(NodeId, Vec<i64>)],
    slots: &[Slot],
    mesh: &Mesh,
    model: usize,
) -> (HashMap<NodeId, Spec>, Vec<(ValueRef, Spec)>) {
    let n = mesh.shape[model];
    let params: HashMap<NodeId, &Vec<i64>> = ins
        .iter()
        .zip(slots)
        .filter(|(_, s)| s.role == Role::Parameter && s.fixed.is_none())
        .map(|((id, shape), _)| (*id, shape))
        .collect();
    let mut specs: HashMap<NodeId, Spec> = HashMap::new();
    let mut split: HashSet<ValueRef> = HashSet::new();
    let mut constraints = Vec::new();
    let value_of = |a: Option<&Arg>| match a {
        Some(Arg::Value(v)) => Some(*v),
        _ => None,
    };
    for id in graph.topo_order() {
        let node = graph.node(id);
        if node.is_input() {
            continue;
        }
        let (bias, lhs, rhs) = match node.op.as_str() {
            "aten.addmm.default" => (node.args.first(), node.args.get(1), node.args.get(2)),
            "aten.mm.default" => (None, node.args.first(), node.args.get(1)),
            _ => (None, None, None),
        };
        // The weight behind the rhs: (param node, whether it is transposed, i.e. [out, in]).
        let weight = value_of(rhs).and_then(|v| {
            let n = graph.node(v.node);
            if params.contains_key(&v.node) {
                return Some((v.node, false));
            }
            let transposed = match n.op.as_str() {
                "aten.t.default" => true,
                "aten.permute.default" => matches!(n.args.get(1), Some(Arg::List(p))
                    if matches!(p.as_slice(), [Arg::Int(1), Arg::Int(0)])),
                _ => false,
            };
            match value_of(n.args.first()) {
                Some(w) if transposed && params.contains_key(&w.node) => Some((w.node, true)),
                _ => None,
            }
        });
        let out = ValueRef {
            node: id,
            result: 0,
        };
        if let Some((w, transposed)) = weight {
            let shape = params[&w];
            let (out_dim, in_dim) = if transposed { (0, 1) } else { (1, 0) };
            let input_split = value_of(lhs).is_some_and(|v| split.contains(&v));
            let existing = specs.get(&w).cloned();
            let column = match &existing {
                Some(s) => !s.0[out_dim].is_empty(),
                None if input_split => {
                    if shape[in_dim] % n == 0 {
                        specs.insert(w, Spec::on_dim(2, in_dim, model));
                    }
                    false
                }
                None => {
                    let ok = shape[out_dim] % n == 0;
                    if ok {
                        specs.insert(w, Spec::on_dim(2, out_dim, model));
                    }
                    ok
                }
            };
            if column {
                if let Some(b) = value_of(bias) {
                    if params.get(&b.node).is_some_and(|s| s.len() == 1) {
                        specs
                            .entry(b.node)
                            .or_insert_with(|| Spec::on_dim(1, 0, model));
                    }
                }
                split.insert(out);
                if let Some(Some(t)) = node.results.first() {
                    let rank = t.rank();
                    if rank >= 1 {
                        constraints.push((out, Spec::on_dim(rank, rank - 1, model)));
                    }
                }
            }
            continue;
        }
        if node.operands().iter().any(|v| split.contains(v)) {
            for k in 0..node.results.len() {
                split.insert(ValueRef {
                    node: id,
                    result: k,
                });
            }
        }
    }
    (specs, constraints)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mesh(shape: &[i64], axes: &[&str]) -> Mesh {
        Mesh::new(shape.to_vec(), axes.iter().map(|s| s.to_string()).collect()).unwrap()
    }

    #[test]
    fn hlo_text_for_split_and_replicated_axes() {
        let m = mesh(&[2, 2], &["data", "model"]);
        assert_eq!(Spec::replicated(2).hlo(&m), "{replicated}");
        // Batch split over `data`, copies over `model`.
        assert_eq!(
            Spec::on_dim(2, 0, 0).hlo(&m),
            "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}"
        );
        // Split over `model` only: copies go along `data`, so the device list is transposed.
        assert_eq!(
            Spec::on_dim(2, 1, 1).hlo(&m),
            "{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}"
        );
        // Both axes, swapped relative to the mesh.
        assert_eq!(
            Spec(vec![vec![1], vec![0]]).hlo(&m),
            "{devices=[2,2]0,2,1,3}"
        );
        // Both axes on one dim.
        assert_eq!(
            Spec(vec![vec![0, 1], vec![]]).hlo(&m),
            "{devices=[4,1]0,1,2,3}"
        );
        let m4 = mesh(&[4], &["data"]);
        assert_eq!(Spec::on_dim(1, 0, 0).hlo(&m4), "{devices=[4]0,1,2,3}");
    }

    #[test]
    fn tile_index_and_first_copies_agree_with_the_hlo_device_order() {
        let m = mesh(&[2, 2], &["data", "model"]);
        let s = Spec::on_dim(2, 1, 1);
        let idx: Vec<Vec<i64>> = (0..4).map(|d| s.tile_index(&m, d)).collect();
        assert_eq!(idx, [[0, 0], [0, 1], [0, 0], [0, 1]]);
        let first: Vec<bool> = (0..4).map(|d| s.is_first_copy(&m, d)).collect();
        assert_eq!(first, [true, true, false, false]);
        assert_eq!(s.shard_shape(&[6, 8], &m), [6, 4]);
        let p = s.pieces(&[6, 8], &m);
        assert_eq!(p[3].offsets, [0, 4]);
        assert_eq!(p[3].shape, [6, 4]);
        assert!(p[1].first_copy && !p[3].first_copy);
    }

    #[test]
    fn check_names_the_dim_and_axis() {
        let m = mesh(&[4], &["data"]);
        let e = Spec::on_dim(2, 0, 0)
            .check(&[6, 3], &m, "input 0 (`x`)")
            .unwrap_err();
        assert!(e.0.contains("input 0 (`x`): dim 0 has size 6"), "{e}");
        assert!(e.0.contains("mesh axis data of size 4"), "{e}");
        let e = Spec::replicated(1).check(&[6, 3], &m, "x").unwrap_err();
        assert!(e.0.contains("rank 2"), "{e}");
    }

    #[test]
    fn mesh_validation() {
        assert!(Mesh::new(vec![2, 0], vec!["a".into(), "b".into()]).is_err());
        assert!(Mesh::new(vec![2, 2], vec!["a".into(), "a".into()]).is_err());
        assert!(Mesh::new(vec![2], vec![]).is_err());
        let m = mesh(&[2, 3], &["data", "model"]);
        assert_eq!(m.size(), 6);
        assert_eq!(m.coords(5), [1, 2]);
        assert!(m.axis_for("model", "tensor_parallel").is_ok());
        assert!(mesh(&[2, 3], &["x", "y"]).axis_for("data", "fsdp").is_err());
        assert_eq!(mesh(&[4], &["x"]).axis_for("data", "fsdp"), Ok(0));
    }

    #[test]
    fn describe_is_python_like() {
        let m = mesh(&[2, 2], &["data", "model"]);
        assert_eq!(Spec::on_dim(2, 0, 0).describe(&m), "(\"data\", None)");
        assert_eq!(Spec::on_dim(1, 0, 1).describe(&m), "(\"model\",)");
    }

    fn slot(role: Role, name: &str) -> Slot {
        Slot {
            role,
            name: name.into(),
            fixed: None,
        }
    }

    /// x[8, 16] -> Linear(16, 32) -> gelu -> Linear(32, 16): the first layer column-parallel, the
    /// second row-parallel.
    fn mlp() -> Graph {
        crate::test_util::graph(
            &[
                ("w1", "[32, 16]"),
                ("b1", "[32]"),
                ("x", "[8, 16]"),
                ("w2", "[16, 32]"),
                ("b2", "[16]"),
            ],
            &[
                (
                    "t1",
                    "aten.permute.default",
                    r#"[{"node": "w1"}, [1, 0]]"#,
                    "[16, 32]",
                ),
                (
                    "h",
                    "aten.addmm.default",
                    r#"[{"node": "b1"}, {"node": "x"}, {"node": "t1"}]"#,
                    "[8, 32]",
                ),
                ("g", "aten.gelu.default", r#"[{"node": "h"}]"#, "[8, 32]"),
                (
                    "t2",
                    "aten.permute.default",
                    r#"[{"node": "w2"}, [1, 0]]"#,
                    "[32, 16]",
                ),
                (
                    "y",
                    "aten.addmm.default",
                    r#"[{"node": "b2"}, {"node": "g"}, {"node": "t2"}]"#,
                    "[8, 16]",
                ),
            ],
            &["y"],
        )
    }

    fn request(strategy: Strategy, m: Mesh) -> ShardingRequest {
        use Role::*;
        ShardingRequest {
            mesh: m,
            strategy,
            inputs: vec![
                slot(Parameter, "w1"),
                slot(Parameter, "b1"),
                slot(Data, "x"),
                slot(Parameter, "w2"),
                slot(Parameter, "b2"),
            ],
            outputs: vec![slot(Other, "y")],
            batch: None,
        }
    }

    #[test]
    fn tensor_parallel_splits_column_then_row() {
        let m = mesh(&[2, 2], &["data", "model"]);
        let plan = shard(&mlp(), &request(Strategy::TensorParallel, m.clone())).unwrap();
        let got: Vec<String> = plan.inputs.iter().map(|s| s.describe(&m)).collect();
        assert_eq!(
            got,
            [
                "(\"model\", None)", // w1: output features
                "(\"model\",)",      // b1
                "(None, None)",      // x
                "(None, \"model\")", // w2: input features
                "(None,)",           // b2 is added after the all-reduce
            ]
        );
        assert_eq!(plan.outputs, [Spec::replicated(2)]);
        // The column-parallel output stays split by features.
        assert_eq!(plan.constraints.len(), 1);
        assert_eq!(plan.constraints[0].1, Spec::on_dim(2, 1, 1));
    }

    #[test]
    fn data_parallel_and_fsdp_split_the_batch_and_fsdp_the_parameters() {
        let m = mesh(&[4], &["data"]);
        let plan = shard(&mlp(), &request(Strategy::DataParallel, m.clone())).unwrap();
        let split: Vec<bool> = plan.inputs.iter().map(|s| !s.is_replicated()).collect();
        assert_eq!(split, [false, false, true, false, false]);
        assert_eq!(plan.outputs, [Spec::on_dim(2, 0, 0)], "batch-major output");
        let plan = shard(&mlp(), &request(Strategy::Fsdp, m.clone())).unwrap();
        let split: Vec<bool> = plan.inputs.iter().map(|s| !s.is_replicated()).collect();
        assert_eq!(split, [true; 5]);
        // An indivisible batch is an error naming the input.
        let mut req = request(Strategy::DataParallel, mesh(&[3], &["data"]));
        req.inputs[2].name = "tokens".into();
        let e = shard(&mlp(), &req).unwrap_err();
        assert!(
            e.0.contains("input `tokens` (graph input 2)") && e.0.contains("size 8"),
            "{e}"
        );
    }

    #[test]
    fn a_written_input_s_new_value_is_laid_out_as_the_input() {
        // The MLP returns w1's "new value" (a gelu of w1 here) as it would after an optimizer
        // step; w1 is split by its second dim (a fixed spec): the output takes that split, not
        // the batch-major one an output computed from split inputs gets.
        let mut g = mlp();
        let w1 = g.inputs[0].node.unwrap();
        let t = g
            .value_type(ValueRef {
                node: w1,
                result: 0,
            })
            .cloned();
        let new = g.add_node(tpuc_frontend_fx::Node {
            name: "w1_new".into(),
            op: "aten.gelu.default".into(),
            args: vec![Arg::Value(ValueRef {
                node: w1,
                result: 0,
            })],
            kwargs: Default::default(),
            results: vec![t],
            loc: None,
            recomputed: false,
        });
        g.outputs.push(Output::Value(ValueRef {
            node: new,
            result: 0,
        }));
        g.written_inputs.insert(0, 1);
        let m = mesh(&[4], &["data"]);
        let mut req = request(Strategy::Fsdp, m.clone());
        req.inputs[0].fixed = Some(Spec::on_dim(2, 1, 0));
        req.outputs.push(slot(Role::Other, "w1_new"));
        let plan = shard(&g, &req).unwrap();
        assert_eq!(plan.outputs[1], Spec::on_dim(2, 1, 0));
    }
}
