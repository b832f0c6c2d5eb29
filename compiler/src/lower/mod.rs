//! IR -> StableHLO. One lowering rule per ATen op, all registered in [`registry`]; this module
//! walks the (static-shaped) graph, calls the rule of each node and checks what it produced
//! against the types FX recorded, so a wrong rule fails loudly instead of returning wrong numbers.

mod emit;
mod helpers;
mod ops;
pub mod registry;
mod remat;
mod strided;
#[cfg(test)]
mod tests;

pub use emit::own_math;
pub use emit::{Emitter, Precision, ReduceKind, Scalar, T};

use melior::ir::attribute::{StringAttribute, TypeAttribute};
use melior::ir::block::BlockLike;
use melior::ir::operation::{OperationLike, OperationMutLike};
use melior::ir::r#type::FunctionType;
use melior::ir::{Block, Identifier, Location, Module, Region, RegionLike, Value};
use melior::Context;
use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use tpuc_frontend_fx::{Arg, DType, Graph, InputKind, Node, NodeId, Output, ValueRef};
use tpuc_passes::sharding::ShardingPlan;
use tpuc_passes::FusionGroup;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LowerError {
    #[error("unsupported op `{op}` (node `{node}`): tpuc has no lowering rule for it")]
    Unsupported { op: String, node: String },
    #[error("cannot lower node `{node}` (op `{op}`): {message}")]
    Node {
        op: String,
        node: String,
        message: String,
    },
    #[error("{0}")]
    Internal(String),
}

impl LowerError {
    pub fn internal(message: impl Into<String>) -> LowerError {
        LowerError::Internal(message.into())
    }

    /// Attaches the node to an error raised by a helper that did not know it.
    fn at(self, node: &Node) -> LowerError {
        match self {
            LowerError::Internal(message) => LowerError::Node {
                op: node.op.clone(),
                node: node.name.clone(),
                message,
            },
            other => other,
        }
    }
}

/// The kind of device a module is lowered for: a rule may choose its form by it (what XLA's
/// compiler for that device handles best); the CPU host kernels exist only on `Cpu`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Device {
    #[default]
    Cpu,
    Gpu,
    Tpu,
}

impl Device {
    /// The device kind of a PJRT platform name ("cpu", "cuda", "rocm", "tpu", ...).
    pub fn of_platform(platform: &str) -> Device {
        match platform.to_ascii_lowercase().as_str() {
            "cpu" | "host" => Device::Cpu,
            "tpu" => Device::Tpu,
            _ => Device::Gpu,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct LowerOptions {
    pub precision: Precision,
    /// What the module is for (see [`Device`]).
    pub device: Device,
    /// SPMD layouts: written as `mhlo.sharding` on `main`'s arguments and results and on
    /// `Sharding` custom calls after the constrained intermediates.
    pub sharding: Option<ShardingPlan>,
    /// f32 matrix products of at least this many multiply-adds are lowered to a call of the
    /// host's BLAS (`tpuc_sgemm_*` custom calls, which the runtime registered with the CPU
    /// plugin: `tpuc_hostkernels::host_blas`); `None` keeps every product in XLA.
    pub host_gemm_min_macs: Option<u64>,
    /// 2-D f32 convolutions (channels-last) are lowered to oneDNN calls (`tpuc_conv2d_*`
    /// custom calls, registered with the CPU plugin by `tpuc_hostkernels::host_conv`).
    pub host_conv: bool,
    /// Large f32 layer norms are lowered to the runtime's row kernels (`tpuc_layer_norm`
    /// custom calls, registered with the CPU plugin by `tpuc_hostkernels::host_rows`).
    pub host_rows: bool,
    /// ATen ops (`aten.exp.default`) whose math primitives (exp, log, atan2, tanh ...) are lowered
    /// to tpuc's own expansions ([`own_math`]) instead of the plugin's: the ones the known-answer
    /// check found wrong on this plugin and CPU.
    pub own_math: std::sync::Arc<std::collections::BTreeSet<String>>,
}

impl LowerOptions {
    /// Whether the fused CPU attention goes to the host kernel (`tpuc_attention`): the row
    /// kernels and the host BLAS (its products) on, and no sharding.
    pub fn host_attention(&self) -> bool {
        self.sharding.is_none() && self.host_rows && self.host_gemm_min_macs.is_some()
    }
}

/// What lowering produced: the module and the signature of `main`.
#[derive(Clone, Debug)]
pub struct Lowered {
    /// The module as MLIR bytecode, with the source locations of its ops: what the plugin
    /// compiles.
    pub bytecode: Vec<u8>,
    /// The same module with every location stripped (all `loc(unknown)`): what the cache key
    /// and a disk entry's module hash read, so that the same graph from another file or line
    /// is the same executable ([`Lowered::key_module`]).
    key_bytecode: Vec<u8>,
    /// Global (unsharded) shapes.
    pub inputs: Vec<(Vec<i64>, DType)>,
    pub outputs: Vec<(Vec<i64>, DType)>,
    /// Per output in `outputs`: `Some(perm)` when it is returned in its physical layout (see
    /// `Graph::free_layout_outputs`), shaped as in `outputs`; the graph's value is then
    /// `output.permute(perm)`.
    pub output_perms: Vec<Option<Vec<i64>>>,
    /// The layouts the module was annotated with, which the runtime splits and reassembles by.
    pub sharding: Option<ShardingPlan>,
    /// The units emitted as `stablehlo.composite`s: (name without `tpuc.`, member nodes), in
    /// node order (what the dump's graph picture groups).
    pub composites: Vec<(String, Vec<NodeId>)>,
    /// (argument, result) of `main` for each written input whose result reuses its buffer
    /// (`tf.aliasing_output`, from `Graph::written_inputs`).
    pub aliases: Vec<(usize, usize)>,
}

impl Lowered {
    /// The module without locations, as bytecode: what identifies the executable.
    pub fn key_module(&self) -> &[u8] {
        &self.key_bytecode
    }

    /// The module as text in MLIR's generic form with its ops' locations
    /// (`loc("node"("file.py":12:0))`, as `#loc` aliases listed after the module): what dumps
    /// write and what a plugin that takes text gets.
    pub fn text_with_locations(&self) -> R<String> {
        self.print(true)
    }

    /// The module as text, in MLIR's generic form, without locations (what tests read).
    pub fn text(&self) -> R<String> {
        self.print(false)
    }

    fn print(&self, locations: bool) -> R<String> {
        let ctx = module_context();
        let source = mlir_sys::MlirStringRef {
            data: self.bytecode.as_ptr().cast(),
            length: self.bytecode.len(),
        };
        // SAFETY: the context is live and the source outlives the call, which copies what it keeps.
        let module = unsafe {
            Module::from_option_raw(mlir_sys::mlirModuleCreateParse(ctx.to_raw(), source))
        }
        .ok_or_else(|| LowerError::internal("the module's bytecode does not parse back"))?;
        let flags = melior::ir::operation::OperationPrintingFlags::new()
            .print_generic_operation_form()
            .enable_debug_info(locations, false);
        module
            .as_operation()
            .to_string_with_flags(flags)
            .map_err(|e| LowerError::internal(format!("printing the module: {e}")))
    }
}

/// (argument, result) of `main` for each of `graph.written_inputs` whose new value may be
/// written into the input's buffer (`tf.aliasing_output`): the same static type, the result in
/// row-major layout (not a free-layout output returned permuted) and, under a mesh, the same
/// sharding. At most one argument per result. `inputs`/`outputs`: `main`'s types.
///
/// On a TPU a 64-bit scalar (BatchNorm's `num_batches_tracked`) is not aliased: XLA:TPU
/// emulates 64-bit types as pairs of 32-bit words, and aliasing such a counter made it keep
/// 8.5-16.8 MB of temporaries in a ResNet-18 step (measured with libtpu 0.0.42 and 0.0.51;
/// none with the counters copied), where a copy costs one 8-byte buffer.
fn aliased_arguments(
    graph: &Graph,
    inputs: &[(Vec<i64>, DType)],
    outputs: &[(Vec<i64>, DType)],
    output_perms: &[Option<Vec<i64>>],
    plan: Option<&ShardingPlan>,
    device: Device,
) -> Vec<(usize, usize)> {
    let emulated_scalar = |(shape, dtype): &(Vec<i64>, DType)| {
        device == Device::Tpu && dtype.byte_size() == 8 && shape.iter().product::<i64>() == 1
    };
    let mut taken = std::collections::BTreeSet::new();
    let mut pairs = Vec::new();
    for (a, r) in graph.written_tensor_pairs() {
        let same_sharding = plan.is_none_or(|p| p.inputs[a] == p.outputs[r]);
        if inputs[a] == outputs[r]
            && output_perms[r].is_none()
            && same_sharding
            && !emulated_scalar(&inputs[a])
            && taken.insert(r)
        {
            pairs.push((a, r));
        }
    }
    pairs
}

/// A context for StableHLO modules. Only `func` is registered: StableHLO ops are built
/// generically (unregistered), which keeps context creation cheap.
fn module_context() -> Context {
    let ctx = Context::new();
    // Used by one thread at a time: no locks in MLIR's uniquers, no thread pool.
    ctx.enable_multi_threading(false);
    ctx.set_allow_unregistered_dialects(true);
    let registry = melior::dialect::DialectRegistry::new();
    melior::dialect::DialectHandle::func().insert_dialect(&registry);
    ctx.append_dialect_registry(&registry);
    ctx.load_all_available_dialects();
    ctx
}

/// The view of one node a lowering rule works with: typed access to its arguments (positional or
/// by keyword) and result types, and the emitter to build ops with.
pub struct NodeCx<'x, 'c, 'b> {
    pub e: &'x Emitter<'c, 'b>,
    pub node: &'x Node,
    values: &'x HashMap<ValueRef, T<'c, 'b>>,
    used: &'x [bool],
    /// The nested graphs of the graph this node is in (what [`Arg::Region`] indexes).
    regions: &'x [Graph],
    /// Folded transposes (`fold_transposes`): permute value -> (its operand, permutation).
    folds: &'x Folds,
}

/// Transposes that lowering does not emit: permute value -> (its operand, permutation).
type Folds = HashMap<ValueRef, (ValueRef, Vec<i64>)>;

pub type R<X> = Result<X, LowerError>;

/// A lowering rule: one ATen op's node to its results (the table is [`registry`]'s).
pub type Rule = for<'x, 'c, 'b> fn(&NodeCx<'x, 'c, 'b>) -> R<Vec<T<'c, 'b>>>;

impl<'x, 'c, 'b> NodeCx<'x, 'c, 'b> {
    pub fn err(&self, message: impl Into<String>) -> LowerError {
        LowerError::Node {
            op: self.node.op.clone(),
            node: self.node.name.clone(),
            message: message.into(),
        }
    }

    /// Argument `i`, or the keyword argument `name` when it was passed by keyword.
    pub fn arg(&self, i: usize, name: &str) -> Option<&Arg> {
        self.node.args.get(i).or_else(|| self.node.kwargs.get(name))
    }

    fn value(&self, a: &Arg, what: &str) -> R<T<'c, 'b>> {
        match a {
            Arg::Value(v) => self
                .values
                .get(v)
                .cloned()
                .ok_or_else(|| self.err(format!("{what}: operand not lowered yet"))),
            other => Err(self.err(format!("{what}: expected a tensor, got {other:?}"))),
        }
    }

    /// A matrix operand of a product and the permutation to read it through: a transpose that
    /// `fold_transposes` folded comes back as its un-permuted operand and the permutation
    /// (result dim `i` is operand dim `p[i]`), anything else as itself and the identity.
    pub fn matrix(&self, i: usize, name: &str) -> R<(T<'c, 'b>, Vec<i64>)> {
        if let Some(Arg::Value(v)) = self.arg(i, name) {
            if let Some((src, p)) = self.folds.get(v) {
                return Ok((self.value(&Arg::Value(*src), name)?, p.clone()));
            }
        }
        let t = self.tensor(i, name)?;
        let p = (0..t.rank() as i64).collect();
        Ok((t, p))
    }

    /// Argument `i` as a nested graph (a control-flow op's branch or body).
    pub fn region(&self, i: usize, name: &str) -> R<&'x Graph> {
        match self.arg(i, name) {
            Some(Arg::Region(k)) => self
                .regions
                .get(*k)
                .ok_or_else(|| self.err(format!("`{name}`: region {k} does not exist"))),
            other => Err(self.err(format!("`{name}`: expected a graph, got {other:?}"))),
        }
    }

    /// A list argument whose items are tensors or sizes (a control-flow op's operands, which
    /// may pass symbolic sizes to its graphs): `Some` per tensor, `None` per size.
    pub fn operands(&self, i: usize, name: &str) -> R<Vec<Option<T<'c, 'b>>>> {
        match self.arg(i, name) {
            Some(Arg::List(items)) => items
                .iter()
                .map(|a| match a {
                    Arg::Value(_) => self.value(a, name).map(Some),
                    Arg::Int(_) | Arg::Sym(_) | Arg::Bool(_) => Ok(None),
                    other => Err(self.err(format!(
                        "`{name}`: expected tensors or sizes, got {other:?}"
                    ))),
                })
                .collect(),
            other => Err(self.err(format!(
                "`{name}`: expected a list of operands, got {other:?}"
            ))),
        }
    }

    pub fn tensor(&self, i: usize, name: &str) -> R<T<'c, 'b>> {
        let a = self
            .arg(i, name)
            .ok_or_else(|| self.err(format!("missing tensor argument `{name}`")))?;
        self.value(a, name)
    }

    pub fn opt_tensor(&self, i: usize, name: &str) -> R<Option<T<'c, 'b>>> {
        match self.arg(i, name) {
            None | Some(Arg::None) => Ok(None),
            Some(a) => self.value(a, name).map(Some),
        }
    }

    pub fn tensors(&self, i: usize, name: &str) -> R<Vec<T<'c, 'b>>> {
        match self.arg(i, name) {
            Some(Arg::List(items)) => items.iter().map(|a| self.value(a, name)).collect(),
            other => Err(self.err(format!(
                "`{name}`: expected a list of tensors, got {other:?}"
            ))),
        }
    }

    /// A list of optional tensors (`Tensor?[]`, like the indices of `aten.index.Tensor`).
    pub fn opt_tensors(&self, i: usize, name: &str) -> R<Vec<Option<T<'c, 'b>>>> {
        match self.arg(i, name) {
            Some(Arg::List(items)) => items
                .iter()
                .map(|a| match a {
                    Arg::None => Ok(None),
                    a => self.value(a, name).map(Some),
                })
                .collect(),
            other => Err(self.err(format!(
                "`{name}`: expected a list of optional tensors, got {other:?}"
            ))),
        }
    }

    pub fn int(&self, i: usize, name: &str) -> R<i64> {
        match self.arg(i, name) {
            Some(Arg::Int(v)) => Ok(*v),
            Some(Arg::Bool(b)) => Ok(*b as i64),
            other => Err(self.err(format!("`{name}`: expected an int, got {other:?}"))),
        }
    }

    pub fn int_or(&self, i: usize, name: &str, default: i64) -> R<i64> {
        match self.arg(i, name) {
            None | Some(Arg::None) => Ok(default),
            _ => self.int(i, name),
        }
    }

    pub fn ints(&self, i: usize, name: &str) -> R<Vec<i64>> {
        match self.arg(i, name) {
            Some(Arg::List(items)) => items
                .iter()
                .map(|a| match a {
                    Arg::Int(v) => Ok(*v),
                    other => Err(self.err(format!("`{name}`: expected ints, got {other:?}"))),
                })
                .collect(),
            Some(Arg::Int(v)) => Ok(vec![*v]),
            other => Err(self.err(format!("`{name}`: expected a list of ints, got {other:?}"))),
        }
    }

    pub fn ints_or(&self, i: usize, name: &str, default: &[i64]) -> R<Vec<i64>> {
        match self.arg(i, name) {
            None | Some(Arg::None) => Ok(default.to_vec()),
            Some(Arg::List(l)) if l.is_empty() => Ok(default.to_vec()),
            _ => self.ints(i, name),
        }
    }

    pub fn float_or(&self, i: usize, name: &str, default: f64) -> R<f64> {
        match self.arg(i, name) {
            None | Some(Arg::None) => Ok(default),
            Some(Arg::Float(x)) => Ok(*x),
            Some(Arg::Int(v)) => Ok(*v as f64),
            other => Err(self.err(format!("`{name}`: expected a float, got {other:?}"))),
        }
    }

    /// A float argument that may be absent or None (`scales_h`), as `opt_tensor` for tensors.
    pub fn opt_float(&self, i: usize, name: &str) -> R<Option<f64>> {
        match self.arg(i, name) {
            None | Some(Arg::None) => Ok(None),
            _ => self.float_or(i, name, 0.0).map(Some),
        }
    }

    pub fn bool_or(&self, i: usize, name: &str, default: bool) -> R<bool> {
        match self.arg(i, name) {
            None | Some(Arg::None) => Ok(default),
            Some(Arg::Bool(b)) => Ok(*b),
            Some(Arg::Int(v)) => Ok(*v != 0),
            other => Err(self.err(format!("`{name}`: expected a bool, got {other:?}"))),
        }
    }

    pub fn scalar(&self, i: usize, name: &str) -> R<Scalar> {
        match self.arg(i, name) {
            Some(Arg::Float(x)) => Ok(Scalar::Float(*x)),
            Some(Arg::Int(v)) => Ok(Scalar::Int(*v)),
            Some(Arg::Bool(b)) => Ok(Scalar::Bool(*b)),
            other => Err(self.err(format!("`{name}`: expected a number, got {other:?}"))),
        }
    }

    /// Argument `i` as a tensor: a tensor operand as is, a Python number as a scalar tensor of
    /// `scalar_dtype`.
    pub fn tensor_or_scalar(&self, i: usize, name: &str, scalar_dtype: DType) -> R<T<'c, 'b>> {
        match self.arg(i, name) {
            Some(Arg::Value(_)) => self.tensor(i, name),
            _ => {
                let s = self.scalar(i, name)?;
                self.e.splat(s, &[], scalar_dtype)
            }
        }
    }

    /// Static shape and dtype of result `k`, as FX recorded it.
    pub fn out(&self, k: usize) -> R<(Vec<i64>, DType)> {
        let t = self
            .node
            .results
            .get(k)
            .and_then(|t| t.as_ref())
            .ok_or_else(|| self.err(format!("result {k} is not a tensor")))?;
        let shape = t.static_shape().ok_or_else(|| {
            self.err(format!(
                "result {k} has symbolic shape {t}; specialize first"
            ))
        })?;
        Ok((shape, t.dtype))
    }

    pub fn out_shape(&self) -> R<Vec<i64>> {
        Ok(self.out(0)?.0)
    }

    pub fn out_dtype(&self) -> R<DType> {
        Ok(self.out(0)?.1)
    }

    /// Whether any op or output reads result `k`; rules may skip computing unread results.
    pub fn result_used(&self, k: usize) -> bool {
        self.used.get(k).copied().unwrap_or(false)
    }

    /// A stand-in for a result nobody reads (zeros of the recorded type).
    pub fn unused(&self, k: usize) -> R<T<'c, 'b>> {
        if self.result_used(k) {
            return Err(self.err(format!(
                "result {k} is read but this rule cannot compute it yet"
            )));
        }
        let (shape, dtype) = self.out(k)?;
        self.e.splat(Scalar::Int(0), &shape, dtype)
    }

    /// Normalizes a possibly negative dim against `rank`.
    pub fn dim(&self, d: i64, rank: usize) -> R<i64> {
        let r = rank.max(1) as i64;
        let n = if d < 0 { d + r } else { d };
        if n < 0 || n >= r {
            return Err(self.err(format!("dim {d} out of range for rank {rank}")));
        }
        Ok(n)
    }
}

/// Lowers a graph whose shapes are all static to a StableHLO module with one function, `main`.
pub fn lower(graph: &Graph, options: &LowerOptions) -> R<Lowered> {
    // Check every op up front so the error names the first unsupported one, not a later symptom.
    check_rules(graph)?;
    with_context(|ctx, diagnostics, attrs| lower_in(ctx, diagnostics, attrs, graph, options))
}

/// Every op of `graph` and of its nested graphs has a rule (the first one without is the error).
fn check_rules(graph: &Graph) -> R<()> {
    for id in graph.topo_order() {
        let n = graph.node(id);
        if !n.is_input() && registry::rule(&n.op).is_none() {
            return Err(LowerError::Unsupported {
                op: n.op.clone(),
                node: n.name.clone(),
            });
        }
    }
    graph.regions.iter().try_for_each(check_rules)
}

/// Lowers a control-flow op's nested graph into the block `e` appends to (a loop's body, a
/// branch) and returns the values of its outputs. `inputs` follow `graph.inputs`: a value per
/// tensor input, `None` per size input (whose uses import already replaced by the size). No
/// fusion inside: the nested graph's ops are lowered by their plain rules.
pub(crate) fn lower_body<'c, 'r>(
    e: &Emitter<'c, 'r>,
    graph: &Graph,
    inputs: &[Option<T<'c, 'r>>],
) -> R<Vec<T<'c, 'r>>> {
    if inputs.len() != graph.inputs.len() {
        return Err(LowerError::internal(format!(
            "a control-flow graph with {} inputs is passed {} operands",
            graph.inputs.len(),
            inputs.len()
        )));
    }
    let mut values: HashMap<ValueRef, T<'c, 'r>> = HashMap::default();
    for (inp, t) in graph.inputs.iter().zip(inputs) {
        match (&inp.kind, inp.node, t) {
            (InputKind::Tensor(_), Some(node), Some(t)) => {
                values.insert(ValueRef { node, result: 0 }, t.clone());
            }
            (InputKind::SymInt(_), _, _) => {}
            _ => {
                return Err(LowerError::internal(format!(
                    "control-flow graph input `{}` is a tensor, its operand is not",
                    inp.name
                )))
            }
        }
    }
    let used = used_results(graph);
    let folds = Folds::default();
    for id in graph.topo_order() {
        if graph.node(id).is_input() {
            continue;
        }
        for (k, t) in lower_node(e, graph, id, &values, &used, &folds)?
            .into_iter()
            .enumerate()
        {
            values.insert(
                ValueRef {
                    node: id,
                    result: k,
                },
                t,
            );
        }
    }
    graph
        .outputs
        .iter()
        .map(|o| match o {
            Output::Value(v) => values
                .get(v)
                .cloned()
                .ok_or_else(|| LowerError::internal("control-flow graph output not lowered")),
            Output::Input(k) => inputs.get(*k).cloned().flatten().ok_or_else(|| {
                LowerError::internal("control-flow graph returns an input that is not a tensor")
            }),
            other => Err(LowerError::internal(format!(
                "a control-flow graph returning {other:?} (not a tensor) is not supported"
            ))),
        })
        .collect()
}

/// Modules lowered in one context before it is replaced: a context keeps every attribute and
/// type it ever uniqued.
const MODULES_PER_CONTEXT: usize = 64;

/// A thread's MLIR context, reused across lowerings (creating one costs about 5% of lowering a
/// small model), with the diagnostics its handler collects.
struct Reused {
    ctx: Context,
    diagnostics: emit::Diagnostics,
    /// Attributes built in `ctx`, by text: handles valid as long as it (renewed with it).
    attrs: emit::AttrCache,
    modules: usize,
}

thread_local! {
    static REUSED: std::cell::RefCell<Option<Reused>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` with this thread's context: taken out while in use (a nested call gets a fresh one),
/// put back after, replaced after [`MODULES_PER_CONTEXT`] modules. A panic drops it.
fn with_context<X>(f: impl FnOnce(&Context, emit::Diagnostics, emit::AttrCache) -> X) -> X {
    let mut reused = match REUSED.with(|r| r.borrow_mut().take()) {
        Some(r) if r.modules < MODULES_PER_CONTEXT => r,
        _ => {
            let ctx = module_context();
            let diagnostics = emit::Diagnostics::default();
            let sink = diagnostics.clone();
            ctx.attach_diagnostic_handler(move |d| {
                sink.borrow_mut().push(d.to_string());
                true
            });
            Reused {
                ctx,
                diagnostics,
                attrs: emit::AttrCache::default(),
                modules: 0,
            }
        }
    };
    reused.diagnostics.borrow_mut().clear();
    reused.modules += 1;
    let out = f(
        &reused.ctx,
        reused.diagnostics.clone(),
        reused.attrs.clone(),
    );
    REUSED.with(|r| *r.borrow_mut() = Some(reused));
    out
}

fn lower_in(
    ctx: &Context,
    diagnostics: emit::Diagnostics,
    attrs: emit::AttrCache,
    graph: &Graph,
    options: &LowerOptions,
) -> R<Lowered> {
    let loc = Location::unknown(ctx);

    let static_type = |name: &str, t: &tpuc_frontend_fx::TensorType| -> R<(Vec<i64>, DType)> {
        let s = t.static_shape().ok_or_else(|| {
            LowerError::internal(format!(
                "`{name}` has symbolic shape {t}; specialize the graph first"
            ))
        })?;
        Ok((s, t.dtype))
    };
    let mut inputs = Vec::new();
    let mut input_nodes: Vec<NodeId> = Vec::new();
    for inp in &graph.inputs {
        if let (InputKind::Tensor(t), Some(node)) = (&inp.kind, inp.node) {
            inputs.push(static_type(&inp.name, t)?);
            input_nodes.push(node);
        }
    }
    let mut outputs = Vec::new();
    for o in &graph.outputs {
        if let Output::Value(v) = o {
            let t = graph
                .value_type(*v)
                .ok_or_else(|| LowerError::internal("graph output is not a tensor"))?;
            outputs.push(static_type(&graph.node(v.node).name, t)?);
        }
    }

    let mut output_perms = vec![None; outputs.len()];

    let arg_types: Vec<_> = inputs
        .iter()
        .map(|(s, d)| (emit::tensor_type(ctx, s, *d), loc))
        .collect();
    let block = Block::new(&arg_types);
    let used = used_results(graph);
    let plan = options.sharding.as_ref();
    // The fusion passes act here (see tpuc_passes::fusion); not on sharded modules, whose
    // layout constraints name IR values.
    // With the host attention kernel, the fused CPU attention is lowered in the main function:
    // the kernel reads q, k and v where they lie, which it can trace back only within one
    // function (a composite's operands are its arguments; GPT-2's keys and values are also
    // graph outputs, so the unit stops at their views, and the heads were copied out).
    let fused = Fused::new(
        graph,
        plan.is_none(),
        options.host_attention(),
        options.device,
    );
    let mut functions: Vec<melior::ir::Operation> = Vec::new();
    let constraints: HashMap<ValueRef, String> = plan
        .map(|p| {
            p.constraints
                .iter()
                .map(|(v, s)| (*v, s.hlo(&p.mesh)))
                .collect()
        })
        .unwrap_or_default();
    {
        let mut e = Emitter::new(
            ctx,
            &block,
            loc,
            options.precision,
            diagnostics.clone(),
            attrs,
        );
        e.host_gemm_min_macs = options.host_gemm_min_macs.filter(|_| plan.is_none());
        e.host_conv = options.host_conv && plan.is_none();
        e.host_rows = options.host_rows && plan.is_none();
        e.host_attention = options.host_attention();
        e.device = options.device;
        e.own_math_ops = options.own_math.clone();
        let mut values: HashMap<ValueRef, T> = HashMap::default();
        for (i, node) in input_nodes.iter().enumerate() {
            let v: Value = block
                .argument(i)
                .map_err(|e| LowerError::internal(e.to_string()))?
                .into();
            let (shape, dtype) = inputs[i].clone();
            values.insert(
                ValueRef {
                    node: *node,
                    result: 0,
                },
                T { v, shape, dtype },
            );
        }
        // Activation checkpointing's recomputation, each group behind its barrier (remat.rs):
        // what each group reads in place of its inputs.
        let remat = remat::Remat::new(graph);
        let mut barriered: Vec<Vec<(ValueRef, T)>> = vec![Vec::new(); remat.groups.len()];
        for id in graph.topo_order() {
            let node = graph.node(id);
            if let Some(k) = remat.index_starting_at(id) {
                e.set_loc(node_location(ctx, node));
                barriered[k] = remat_barrier(&e, &remat.groups[k], &values, &fused.folds)
                    .map_err(|err| err.at(node))?;
            }
            if node.is_input() || fused.skip(id) {
                continue;
            }
            // A recomputed node reads its group's inputs through the barrier.
            let saved: Vec<(ValueRef, Option<T>)> = remat
                .group_of(id)
                .map(|k| {
                    barriered[k]
                        .iter()
                        .map(|(v, t)| (*v, values.insert(*v, t.clone())))
                        .collect()
                })
                .unwrap_or_default();
            let results = if let Some(group) = fused.root_of(id) {
                // The composite itself is the root's; its members keep their own inside.
                e.set_loc(node_location(ctx, node));
                fused.emit(&e, graph, group, &values, &used, &mut functions)
            } else {
                lower_node(&e, graph, id, &values, &used, &fused.folds)
            };
            for (v, old) in saved {
                match old {
                    Some(t) => values.insert(v, t),
                    None => values.remove(&v),
                };
            }
            let results = results?;
            for (k, mut t) in results.into_iter().enumerate() {
                let here = ValueRef {
                    node: id,
                    result: k,
                };
                if let Some(hlo) = constraints.get(&here) {
                    t = e
                        .op(
                            "stablehlo.custom_call",
                            &[&t],
                            &[
                                ("call_target_name", "\"Sharding\"".to_string()),
                                ("mhlo.sharding", format!("\"{hlo}\"")),
                            ],
                            &t.shape.clone(),
                            t.dtype,
                        )
                        .map_err(|err| err.at(node))?;
                }
                values.insert(
                    ValueRef {
                        node: id,
                        result: k,
                    },
                    t,
                );
            }
        }
        let mut outs: Vec<Value> = Vec::new();
        for (position, o) in graph.outputs.iter().enumerate() {
            if let Output::Value(v) = o {
                let t = &values[v];
                let physical = e.physical(t).filter(|(_, perm)| {
                    plan.is_none()
                        && graph.free_layout_outputs.contains(&position)
                        && *perm == emit::NCHW_OF_NHWC
                });
                match physical {
                    Some((p, perm)) => {
                        let k = outs.len();
                        outputs[k].0 = p.shape.clone();
                        output_perms[k] = Some(perm);
                        outs.push(p.v);
                    }
                    None => outs.push(t.v),
                }
            }
        }
        block.append_operation(melior::dialect::func::r#return(&outs, loc));
    }

    let region = Region::new();
    region.append_block(block);
    let in_types: Vec<_> = arg_types.iter().map(|(t, _)| *t).collect();
    let out_types: Vec<_> = outputs
        .iter()
        .map(|(s, d)| emit::tensor_type(ctx, s, *d))
        .collect();
    let fn_type = FunctionType::new(ctx, &in_types, &out_types);
    let mut func_attrs = Vec::new();
    let mut module_attrs = Vec::new();
    let parse = |text: &str| emit::parse_attr(ctx, &diagnostics, text);
    // Per argument and per result: the entries of its attribute dictionary.
    let mut arg_entries: Vec<Vec<String>> = vec![Vec::new(); inputs.len()];
    let mut res_entries: Vec<Vec<String>> = vec![Vec::new(); outputs.len()];
    if let Some(p) = plan {
        if p.inputs.len() != inputs.len() || p.outputs.len() != outputs.len() {
            return Err(LowerError::internal(format!(
                "sharding plan has {} inputs and {} outputs; the graph has {} and {}",
                p.inputs.len(),
                p.outputs.len(),
                inputs.len(),
                outputs.len()
            )));
        }
        for (entries, s) in arg_entries.iter_mut().zip(&p.inputs) {
            entries.push(format!("mhlo.sharding = \"{}\"", s.hlo(&p.mesh)));
        }
        for (entries, s) in res_entries.iter_mut().zip(&p.outputs) {
            entries.push(format!("mhlo.sharding = \"{}\"", s.hlo(&p.mesh)));
        }
        let partitions = format!("{} : i32", p.mesh.size());
        module_attrs.push(("mhlo.num_partitions", parse(&partitions)?));
        module_attrs.push(("mhlo.num_replicas", parse("1 : i32")?));
    }
    let aliases = aliased_arguments(
        graph,
        &inputs,
        &outputs,
        &output_perms,
        plan,
        options.device,
    );
    for (arg, result) in &aliases {
        arg_entries[*arg].push(format!("tf.aliasing_output = {result} : i32"));
    }
    let dicts = |entries: &[Vec<String>]| -> String {
        let items: Vec<String> = entries
            .iter()
            .map(|e| format!("{{{}}}", e.join(", ")))
            .collect();
        format!("[{}]", items.join(", "))
    };
    if arg_entries.iter().any(|e| !e.is_empty()) {
        func_attrs.push((
            Identifier::new(ctx, "arg_attrs"),
            parse(&dicts(&arg_entries))?,
        ));
    }
    if res_entries.iter().any(|e| !e.is_empty()) {
        func_attrs.push((
            Identifier::new(ctx, "res_attrs"),
            parse(&dicts(&res_entries))?,
        ));
    }
    let func = melior::dialect::func::func(
        ctx,
        StringAttribute::new(ctx, "main"),
        TypeAttribute::new(fn_type.into()),
        region,
        &func_attrs,
        loc,
    );
    let mut module = Module::new(loc);
    for (name, attr) in module_attrs {
        module.as_operation_mut().set_attribute(name, attr);
    }
    module.body().append_operation(func);
    for f in functions {
        module.body().append_operation(f);
    }
    // Bytecode, not text: a third of the printing time, and what the plugin parses fastest.
    // `Lowered::text` prints it for dumps and tests.
    let bytecode = module.as_operation().write_bytecode();
    let key_bytecode = strip_locations(ctx, &mut module)?;
    let mut composites: Vec<(String, Vec<NodeId>)> = fused
        .roots
        .values()
        .map(|g| (g.name.to_string(), g.nodes.clone()))
        .collect();
    composites.sort_by_key(|(_, nodes)| nodes.last().copied());
    Ok(Lowered {
        bytecode,
        key_bytecode,
        inputs,
        outputs,
        output_perms,
        sharding: options.sharding.clone(),
        composites,
        aliases,
    })
}

/// `module` with every location made unknown (MLIR's `strip-debuginfo`), as bytecode: the
/// bytes of the same module lowered without locations.
fn strip_locations(ctx: &Context, module: &mut Module) -> R<Vec<u8>> {
    let pm = melior::pass::PassManager::new(ctx);
    pm.enable_verifier(false);
    pm.add_pass(melior::pass::transform::create_strip_debug_info());
    pm.run(module)
        .map_err(|e| LowerError::internal(format!("stripping locations: {e}")))?;
    Ok(module.as_operation().write_bytecode())
}

/// The `stablehlo.optimization_barrier` before a group of recomputed nodes (remat.rs): its
/// inputs and the values it waits for go through it; returns, per input, the barrier's result
/// the group reads instead. A value the barrier only waits for may be a folded transpose (not
/// emitted): its source stands in. A value with no lowered form of its own otherwise (none is
/// expected: folds and composites never span the group's edge) is left out.
fn remat_barrier<'c, 'b>(
    e: &Emitter<'c, 'b>,
    group: &remat::Group,
    values: &HashMap<ValueRef, T<'c, 'b>>,
    folds: &Folds,
) -> R<Vec<(ValueRef, T<'c, 'b>)>> {
    let waited = group.after.iter().filter_map(|v| {
        let t = values
            .get(v)
            .or_else(|| folds.get(v).and_then(|(src, _)| values.get(src)))?;
        Some((*v, t))
    });
    let through: Vec<(ValueRef, &T<'c, 'b>)> = group
        .inputs
        .iter()
        .filter_map(|v| values.get(v).map(|t| (*v, t)))
        .chain(waited)
        .collect();
    if through.is_empty() {
        return Ok(Vec::new());
    }
    let operands: Vec<&T> = through.iter().map(|(_, t)| *t).collect();
    let types: Vec<(Vec<i64>, DType)> = operands
        .iter()
        .map(|t| (t.shape.clone(), t.dtype))
        .collect();
    let results = e.op_n(
        "stablehlo.optimization_barrier",
        &operands,
        &[],
        &types,
        Vec::new(),
    )?;
    let inputs: HashSet<&ValueRef> = group.inputs.iter().collect();
    Ok(through
        .into_iter()
        .zip(results)
        .filter(|((v, _), _)| inputs.contains(v))
        .map(|((v, _), t)| (v, t))
        .collect())
}

/// Lowers one node by its rule and checks its results against the types FX recorded.
fn lower_node<'c, 'b>(
    e: &Emitter<'c, 'b>,
    graph: &Graph,
    id: NodeId,
    values: &HashMap<ValueRef, T<'c, 'b>>,
    used: &HashMap<NodeId, Vec<bool>>,
    folds: &Folds,
) -> R<Vec<T<'c, 'b>>> {
    let node = graph.node(id);
    e.set_loc(node_location(e.ctx, node));
    let rule = registry::rule(&node.op).expect("checked above");
    let no_use = Vec::new();
    let cx = NodeCx {
        e,
        node,
        values,
        used: used.get(&id).unwrap_or(&no_use),
        regions: &graph.regions,
        folds,
    };
    let own = e.own_math_ops.contains(&node.op);
    let was = e.own_math.replace(own);
    let results = match empty_results(&cx) {
        Ok(Some(empty)) => Ok(empty),
        Ok(None) => rule(&cx).map_err(|err| err.at(node)),
        Err(err) => Err(err),
    };
    e.own_math.set(was);
    let results = results?;
    check_results(&cx, &results)?;
    Ok(results)
}

/// The location of the ops a node becomes: the FX node's name around its innermost user frame,
/// `loc("name"("file.py":line:col))`; with outer user frames, the call stack as call sites of
/// frames named by their functions, innermost first:
/// `loc("name"(callsite("forward"("model.py":12:0) at "step"("train.py":40:0))))`, the form
/// XLA's stack frame index reads. XLA keeps it as the HLO ops' metadata (`op_name`,
/// `source_file`, `source_line`, `stack_frame_id`). `loc("name")` for a node without a stack
/// trace. Never part of a cache key ([`Lowered::key_module`]).
pub(crate) fn node_location<'c>(ctx: &'c Context, node: &Node) -> Location<'c> {
    let frames = node.loc.as_deref().map_or(&[][..], |l| &l.frames[..]);
    let file_line =
        |f: &tpuc_frontend_fx::Frame| Location::new(ctx, &f.file, f.line as usize, f.col as usize);
    let child = match frames {
        [] => Location::unknown(ctx),
        [only] => file_line(only),
        _ => {
            let named = |f: &tpuc_frontend_fx::Frame| Location::name(ctx, &f.func, file_line(f));
            let mut stack = named(&frames[frames.len() - 1]);
            for f in frames[..frames.len() - 1].iter().rev() {
                stack = Location::call_site(named(f), stack);
            }
            stack
        }
    };
    Location::name(ctx, &node.name, child)
}

/// Whether the `composites` pass's units become `stablehlo.composite`s on `device`: on the CPU
/// (what its measurements chose); on a GPU or TPU they are inlined. XLA:TPU inlines a
/// composite's decomposition anyway and nothing in it reads the unit names, so they only add
/// calls for it to inline (GPT-2 124M at 1x128 on v5e: the same cost analysis either way, and
/// no compile time gained; see docs/tpu-lowering.md).
fn composites_for(device: Device) -> bool {
    device == Device::Cpu
}

/// What the fusion passes (`fold_transposes`, `composites`) ask lowering to do for one graph.
struct Fused {
    folds: Folds,
    /// Members of a composite other than its root: lowered inside its decomposition.
    inner: HashSet<NodeId>,
    /// Composite root -> its group.
    roots: HashMap<NodeId, FusionGroup>,
    /// Decompositions made so far: signature -> function name.
    made: std::cell::RefCell<HashMap<String, String>>,
    /// How many functions each composite name has, for unique function names.
    counts: std::cell::RefCell<HashMap<&'static str, usize>>,
}

impl Fused {
    fn new(graph: &Graph, allowed: bool, host_attention: bool, device: Device) -> Fused {
        let on = |pass: &str| allowed && graph.lowering.contains(pass);
        let mut folds = Folds::default();
        if on(tpuc_passes::fusion::FOLD_TRANSPOSES) {
            for (id, p) in tpuc_passes::transpose_folds(graph) {
                // Not across a recomputation's edge: its barrier needs the transpose's value.
                let flag = graph.node(id).recomputed;
                if graph.users(id).any(|u| graph.node(u).recomputed != flag) {
                    continue;
                }
                if let Some(Arg::Value(src)) = graph.node(id).args.first() {
                    folds.insert(
                        ValueRef {
                            node: id,
                            result: 0,
                        },
                        (*src, p),
                    );
                }
            }
        }
        let mut inner = HashSet::default();
        let mut roots = HashMap::default();
        if on(tpuc_passes::fusion::COMPOSITES) && composites_for(device) {
            for group in tpuc_passes::fusion_groups(graph) {
                let root = *group.nodes.last().expect("groups are not empty");
                // A unit is all recomputation or none of it (its barrier goes before it).
                let mixed = group
                    .nodes
                    .iter()
                    .any(|&n| graph.node(n).recomputed != graph.node(root).recomputed);
                if mixed
                    || graph.node(root).results.iter().any(Option::is_none)
                    || (host_attention
                        && graph.node(root).op
                            == "aten._scaled_dot_product_flash_attention_for_cpu.default")
                {
                    continue;
                }
                inner.extend(group.nodes[..group.nodes.len() - 1].iter().copied());
                roots.insert(root, group);
            }
        }
        Fused {
            folds,
            inner,
            roots,
            made: Default::default(),
            counts: Default::default(),
        }
    }

    /// Whether the main function skips `id`: a folded transpose, or a composite's inner member.
    fn skip(&self, id: NodeId) -> bool {
        self.inner.contains(&id)
            || self.folds.contains_key(&ValueRef {
                node: id,
                result: 0,
            })
    }

    fn root_of(&self, id: NodeId) -> Option<&FusionGroup> {
        self.roots.get(&id)
    }

    /// Emits `group` as one `stablehlo.composite` whose decomposition lowers its members by
    /// their rules; a group with the signature of an earlier one reuses its function.
    fn emit<'c, 'b>(
        &self,
        e: &Emitter<'c, 'b>,
        graph: &Graph,
        group: &FusionGroup,
        values: &HashMap<ValueRef, T<'c, 'b>>,
        used: &HashMap<NodeId, Vec<bool>>,
        functions: &mut Vec<melior::ir::Operation<'c>>,
    ) -> R<Vec<T<'c, 'b>>> {
        let members: HashMap<NodeId, usize> = group
            .nodes
            .iter()
            .enumerate()
            .map(|(i, &n)| (n, i))
            .collect();
        let root = *group.nodes.last().expect("groups are not empty");
        // Operands from outside, in order of first use (a folded transpose outside the group
        // enters as its operand).
        let mut inputs: Vec<ValueRef> = Vec::new();
        for &m in &group.nodes {
            for v in graph.node(m).operands() {
                if members.contains_key(&v.node) {
                    continue;
                }
                let v = self.folds.get(&v).map_or(v, |(src, _)| *src);
                if !inputs.contains(&v) {
                    inputs.push(v);
                }
            }
        }
        let arg_types = inputs
            .iter()
            .map(|v| {
                values
                    .get(v)
                    .map(|t| (t.shape.clone(), t.dtype))
                    .ok_or_else(|| LowerError::internal("composite operand not lowered yet"))
            })
            .collect::<R<Vec<_>>>()?;
        let root_node = graph.node(root);
        let result_types = root_node
            .results
            .iter()
            .map(|t| {
                let t = t.as_ref().expect("checked in Fused::new");
                let s = t.static_shape().ok_or_else(|| {
                    LowerError::internal(format!("`{}` has a symbolic shape", root_node.name))
                })?;
                Ok((s, t.dtype))
            })
            .collect::<R<Vec<_>>>()?;
        let sig = self.signature(graph, group, &members, &inputs, &arg_types, used);
        let existing = self.made.borrow().get(&sig).cloned();
        let fname = match existing {
            Some(f) => f,
            None => {
                let k = {
                    let mut counts = self.counts.borrow_mut();
                    let c = counts.entry(group.name).or_default();
                    *c += 1;
                    *c - 1
                };
                let fname = format!("tpuc.{}.{k}", group.name);
                let f = e.function(&fname, &arg_types, &result_types, |inner, params| {
                    let mut local: HashMap<ValueRef, T> =
                        inputs.iter().copied().zip(params).collect();
                    for &m in &group.nodes {
                        if self.skip_inside(m) {
                            continue;
                        }
                        let out = lower_node(inner, graph, m, &local, used, &self.folds)?;
                        for (k, t) in out.into_iter().enumerate() {
                            local.insert(ValueRef { node: m, result: k }, t);
                        }
                    }
                    (0..result_types.len())
                        .map(|k| {
                            local
                                .remove(&ValueRef {
                                    node: root,
                                    result: k,
                                })
                                .ok_or_else(|| LowerError::internal("composite result missing"))
                        })
                        .collect()
                })?;
                functions.push(f);
                self.made.borrow_mut().insert(sig, fname.clone());
                fname
            }
        };
        let operands: Vec<&T> = inputs.iter().map(|v| &values[v]).collect();
        e.op_n(
            "stablehlo.composite",
            &operands,
            &[
                ("name", format!("\"tpuc.{}\"", group.name)),
                ("composite_attributes", "{}".into()),
                ("decomposition", format!("@{fname}")),
                ("version", "0 : i32".into()),
            ],
            &result_types,
            vec![],
        )
        .map_err(|err| err.at(root_node))
    }

    /// Inside a decomposition only folded transposes are skipped.
    fn skip_inside(&self, id: NodeId) -> bool {
        self.folds.contains_key(&ValueRef {
            node: id,
            result: 0,
        })
    }

    /// Everything the decomposition depends on: members' ops, literals, wiring and result
    /// types, which results are read, folded transposes, and the operand types.
    fn signature(
        &self,
        graph: &Graph,
        group: &FusionGroup,
        members: &HashMap<NodeId, usize>,
        inputs: &[ValueRef],
        arg_types: &[(Vec<i64>, DType)],
        used: &HashMap<NodeId, Vec<bool>>,
    ) -> String {
        use std::fmt::Write;
        // Written into one string as it goes: this runs for every composite of every module.
        fn arg(sig: &mut String, a: &Arg, local: &dyn Fn(&mut String, &ValueRef)) {
            match a {
                Arg::Value(v) => local(sig, v),
                Arg::List(items) => {
                    sig.push('[');
                    for i in items {
                        arg(sig, i, local);
                        sig.push(',');
                    }
                    sig.push(']');
                }
                other => {
                    let _ = write!(sig, "{other:?}");
                }
            }
        }
        let local = |sig: &mut String, v: &ValueRef| {
            let _ = match members.get(&v.node) {
                Some(i) => write!(sig, "m{i}#{}", v.result),
                None => {
                    let v = self.folds.get(v).map_or(*v, |(src, _)| *src);
                    let k = inputs.iter().position(|x| *x == v).unwrap_or(usize::MAX);
                    write!(sig, "in{k}")
                }
            };
        };
        let mut sig = String::with_capacity(64 * (group.nodes.len() + 1));
        let _ = writeln!(sig, "{} {arg_types:?}", group.name);
        for &m in &group.nodes {
            let n = graph.node(m);
            sig.push_str(&n.op);
            sig.push_str(" (");
            for a in &n.args {
                arg(&mut sig, a, &local);
                sig.push(',');
            }
            sig.push_str(") {");
            for (k, a) in &n.kwargs {
                sig.push_str(k);
                sig.push('=');
                arg(&mut sig, a, &local);
                sig.push(',');
            }
            let fold = self
                .folds
                .get(&ValueRef { node: m, result: 0 })
                .map(|(_, p)| p);
            let _ = writeln!(sig, "}} {:?} {:?} {fold:?}", n.results, used.get(&m));
        }
        sig
    }
}

/// For every node, which of its results something reads.
fn used_results(graph: &Graph) -> HashMap<NodeId, Vec<bool>> {
    let mut used: HashMap<NodeId, Vec<bool>> = HashMap::default();
    let mut mark = |v: ValueRef| {
        let n = graph.node(v.node).results.len();
        let e = used.entry(v.node).or_insert_with(|| vec![false; n]);
        if v.result < e.len() {
            e[v.result] = true;
        }
    };
    for id in graph.topo_order() {
        for v in graph.node(id).operands() {
            mark(v);
        }
    }
    for o in &graph.outputs {
        if let Output::Value(v) = o {
            mark(*v);
        }
    }
    used
}

/// Empty constants for a node whose results all have no elements: there is nothing to compute,
/// and rules need not handle zero-size results, which some StableHLO ops reject (a gather of
/// slices of size 1 from a dim of size 0 does not verify). None if any result has elements or
/// is not a tensor.
fn empty_results<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> R<Option<Vec<T<'c, 'b>>>> {
    if cx.node.results.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(cx.node.results.len());
    for t in &cx.node.results {
        match t.as_ref().map(|t| (t.static_shape(), t.dtype)) {
            Some((Some(shape), dtype)) if shape.contains(&0) => {
                out.push(cx.e.splat(Scalar::Int(0), &shape, dtype)?)
            }
            _ => return Ok(None),
        }
    }
    Ok(Some(out))
}

/// A rule must produce exactly the types FX recorded: anything else is a bug in the rule.
fn check_results(cx: &NodeCx, results: &[T]) -> R<()> {
    if results.len() != cx.node.results.len() {
        return Err(cx.err(format!(
            "lowering rule produced {} results, FX recorded {}",
            results.len(),
            cx.node.results.len()
        )));
    }
    for (k, t) in results.iter().enumerate() {
        if cx.node.results[k].is_none() {
            continue;
        }
        let (shape, dtype) = cx.out(k)?;
        if t.shape != shape || t.dtype != dtype {
            return Err(cx.err(format!(
                "lowering rule produced {}{:?} for result {k}, FX recorded {}{:?}",
                t.dtype, t.shape, dtype, shape
            )));
        }
    }
    Ok(())
}

/// Ops with a lowering rule, sorted: what Python asks before deciding what to run eagerly.
pub fn supported_ops() -> Vec<&'static str> {
    registry::names()
}

/// The ops of `g` that have no lowering rule, in topological order: `[(op, node name)]`.
pub fn unsupported_ops(g: &Graph) -> Vec<(String, String)> {
    g.topo_order()
        .into_iter()
        .map(|id| g.node(id))
        .filter(|n| !n.is_input() && registry::rule(&n.op).is_none())
        .map(|n| (n.op.clone(), n.name.clone()))
        .collect()
}
