//! Bucketing: a graph with dynamic dims becomes a static graph at bucket sizes whose results are
//! exact for every real size up to the bucket.
//!
//! Inputs are padded at the end of each dynamic dim; the padded elements hold arbitrary values
//! and flow through the graph untouched by elementwise ops. Every op that mixes elements along a
//! padded dim (reductions, contractions, softmax, cumulative ops, scatters) first replaces the
//! padded elements of its operands with the op's neutral value (`where(mask, x, neutral)`), and
//! every value that depends on a size (a mean's divisor, a `numel` in a backward formula) reads
//! the real size from a runtime scalar input. Outputs are sliced back to their real shapes by the
//! caller, following the layout this pass reports.
//!
//! The pass tracks, for every value and dim, its *layout*: a list of atoms (outer to inner), each
//! a run of `size` elements of which the first `real` are real. A dim that merges a static dim
//! with a padded one (`view(x, [2*s, h])` of `x: [2, s, h]`) has two atoms, so masks stay exact
//! through reshapes. An op without a rule here that touches a padded dim is reported by name:
//! the caller then compiles that graph per real shape instead.
//!
//! Why masking here rather than StableHLO's bounded dynamic types: masks are ordinary ops that
//! every PJRT plugin compiles, XLA fuses them into the consumer, and one executable serves the
//! whole bucket with no per-shape padding module (see docs/dynamic-shapes.md).

use std::collections::{BTreeMap, HashMap, HashSet};
use tpuc_frontend_fx::{
    Arg, DType, Dim, Graph, Input, InputKind, Node, NodeId, Output, SymExpr, TensorType, ValueRef,
};

/// A run of `size` elements of one dim whose first `real` are real (`None`: all are real).
#[derive(Clone, Debug, PartialEq)]
pub struct Atom {
    pub size: i64,
    pub real: Option<SymExpr>,
}

impl Atom {
    fn full(size: i64) -> Atom {
        Atom { size, real: None }
    }
    fn padded(&self) -> bool {
        self.real.is_some()
    }
}

/// The atoms of one dim, outer to inner.
pub type DimLayout = Vec<Atom>;
/// One DimLayout per dim of a tensor.
pub type Layout = Vec<DimLayout>;

fn dim_padded(d: &DimLayout) -> bool {
    d.iter().any(Atom::padded)
}

fn layout_padded(l: &Layout) -> bool {
    l.iter().any(dim_padded)
}

/// Static atoms merged and size-1 static atoms dropped: two dims with the same normal form hold
/// their real elements at the same positions.
fn normal(d: &DimLayout) -> Vec<Atom> {
    let mut out: Vec<Atom> = Vec::new();
    for a in d {
        if !a.padded() && a.size == 1 {
            continue;
        }
        match (out.last_mut(), a.padded()) {
            (Some(last), false) if !last.padded() => last.size *= a.size,
            _ => out.push(a.clone()),
        }
    }
    out
}

fn same_dim(a: &DimLayout, b: &DimLayout) -> bool {
    normal(a) == normal(b)
}

fn clean(size: i64) -> DimLayout {
    vec![Atom::full(size)]
}

/// An op the pass cannot make exact, with where it is.
#[derive(Debug, Clone, thiserror::Error)]
#[error("bucketing cannot make `{op}` (node `{node}`) exact: {reason}")]
pub struct BucketError {
    pub op: String,
    pub node: String,
    pub reason: String,
}

/// The static graph for one bucket, plus what the caller needs to run it.
#[derive(Debug, Clone)]
pub struct Bucketed {
    pub graph: Graph,
    /// Values of these expressions, evaluated with the real sizes, are passed as 0-d int64
    /// tensors after the original inputs, in this order.
    pub scalars: Vec<SymExpr>,
    /// Per graph input: its layout (how to pad the real tensor), None for SymInt inputs.
    pub input_layouts: Vec<Option<Layout>>,
    /// Per tensor output of the executable, in order: its layout (how to slice it back).
    pub output_layouts: Vec<Layout>,
}

type R<T> = Result<T, BucketError>;

/// Pads `g` to the bucket sizes in `sizes` for the symbols in `dynamic`; every other symbol
/// must be bound in `sizes` to its real value.
pub fn bucket(g: &Graph, dynamic: &HashSet<String>, sizes: &HashMap<String, i64>) -> R<Bucketed> {
    let (mut b, input_layouts, mut new_inputs) = Bucketer::walk(g, dynamic, sizes, None)?;
    let outputs: Vec<Output> = g
        .outputs
        .iter()
        .map(|o| match o {
            Output::Value(v) => Output::Value(b.map[v]),
            other => other.clone(),
        })
        .collect();
    let output_layouts = g
        .outputs
        .iter()
        .filter_map(|o| match o {
            Output::Value(v) => Some(b.layouts[v].clone()),
            _ => None,
        })
        .collect();
    // Scalar inputs were added as nodes along the way; list them after the original inputs.
    new_inputs.extend(b.scalar_inputs());
    let mut out = std::mem::take(&mut b.out);
    out.inputs = new_inputs;
    out.outputs = outputs;
    let out = crate::specialize(&out, sizes)
        .map_err(|e| BucketError {
            op: "<graph>".into(),
            node: "<graph>".into(),
            reason: e.to_string(),
        })?
        .into_owned();
    Ok(Bucketed {
        graph: out,
        scalars: b.scalars,
        input_layouts,
        output_layouts,
    })
}

#[derive(Clone, Copy)]
enum Fill {
    Zero,
    One,
    Lowest,
    Highest,
}

struct Bucketer<'a> {
    g: &'a Graph,
    dynamic: &'a HashSet<String>,
    sizes: &'a HashMap<String, i64>,
    out: Graph,
    /// Old value -> new value.
    map: HashMap<ValueRef, ValueRef>,
    /// Layout of every old tensor value.
    layouts: HashMap<ValueRef, Layout>,
    scalars: Vec<SymExpr>,
    scalar_ids: HashMap<String, NodeId>,
    masks: HashMap<String, ValueRef>,
    cur: String,
    cur_op: String,
    /// The current node's source location: what the nodes made in its place take.
    cur_loc: Option<Box<tpuc_frontend_fx::SourceLoc>>,
    fresh: usize,
}

const ELEMENTWISE: &[&str] = &[
    "abs",
    "acos",
    "acosh",
    "add",
    "alias",
    "asin",
    "asinh",
    "atan",
    "atan2",
    "atanh",
    "bitwise_and",
    "bitwise_not",
    "bitwise_or",
    "bitwise_xor",
    "ceil",
    "clamp",
    "clamp_max",
    "clamp_min",
    "clone",
    "contiguous",
    "copy",
    "cos",
    "cosh",
    "detach",
    "div",
    "elu",
    "elu_backward",
    "empty_like",
    "eq",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "exp2",
    "expm1",
    "fill",
    "floor",
    "floor_divide",
    "fmod",
    "full_like",
    "ge",
    "gelu",
    "gelu_backward",
    "gt",
    "hardsigmoid",
    "hardsigmoid_backward",
    "hardswish",
    "hardswish_backward",
    "hardtanh",
    "hardtanh_backward",
    "isinf",
    "isnan",
    "le",
    "leaky_relu",
    "leaky_relu_backward",
    "lift_fresh_copy",
    "log",
    "log10",
    "log1p",
    "log2",
    "logical_and",
    "logical_not",
    "logical_or",
    "logical_xor",
    "lt",
    "masked_fill",
    "maximum",
    "minimum",
    "mish",
    "mul",
    "ne",
    "neg",
    "ones_like",
    "pow",
    "reciprocal",
    "relu",
    "remainder",
    "round",
    "rsqrt",
    "rsub",
    "sigmoid",
    "sigmoid_backward",
    "sign",
    "silu",
    "silu_backward",
    "sin",
    "sinh",
    "softplus",
    "softplus_backward",
    "sqrt",
    "square",
    "sub",
    "tan",
    "tanh",
    "tanh_backward",
    "threshold_backward",
    "trunc",
    "where",
    "zeros_like",
    "_to_copy",
    "_conj",
    "xlogy",
];

/// The keyword argument that gives a `scan`/`map_impl` its real number of steps when its
/// scanned dim is padded (a 0-d int64 value; the lowering's loop stops there).
pub const STEPS_KWARG: &str = "tpuc_steps";

/// View ops whose functional `_copy` twins share their bucketing rules.
const VIEW_TWINS: &[&str] = &[
    "alias",
    "detach",
    "expand",
    "permute",
    "select",
    "slice",
    "split",
    "split_with_sizes",
    "squeeze",
    "t",
    "transpose",
    "unsqueeze",
    "view",
    "_unsafe_view",
];

const CREATION: &[&str] = &[
    "arange",
    "empty",
    "full",
    "new_empty",
    "new_full",
    "new_ones",
    "new_zeros",
    "ones",
    "scalar_tensor",
    "zeros",
    "empty_strided",
    "empty_permuted",
];

/// `aten.add.Tensor` -> ("add", "Tensor").
fn split_op(op: &str) -> (&str, &str) {
    let rest = op.strip_prefix("aten.").unwrap_or(op);
    rest.split_once('.').unwrap_or((rest, "default"))
}

fn broadcast_shape(a: &[i64], b: &[i64]) -> Vec<i64> {
    let r = a.len().max(b.len());
    (0..r)
        .map(|i| {
            let x = if i + a.len() >= r {
                a[i + a.len() - r]
            } else {
                1
            };
            let y = if i + b.len() >= r {
                b[i + b.len() - r]
            } else {
                1
            };
            x.max(y)
        })
        .collect()
}

impl<'a> Bucketer<'a> {
    /// Walks `g` in topological order into a new graph at bucket sizes. An input's layout is
    /// `given` (a control-flow body's operands, as the op passes them) or read off its type.
    #[allow(clippy::type_complexity)]
    fn walk(
        g: &'a Graph,
        dynamic: &'a HashSet<String>,
        sizes: &'a HashMap<String, i64>,
        given: Option<&[Option<Layout>]>,
    ) -> R<(Bucketer<'a>, Vec<Option<Layout>>, Vec<Input>)> {
        let mut b = Bucketer {
            g,
            dynamic,
            sizes,
            out: Graph {
                lowering: g.lowering.clone(),
                // Control-flow nodes keep their graphs' indices; a body that bucketing
                // rewrites is added after them.
                regions: g.regions.clone(),
                ..Graph::default()
            },
            map: HashMap::new(),
            layouts: HashMap::new(),
            scalars: Vec::new(),
            scalar_ids: HashMap::new(),
            masks: HashMap::new(),
            cur: String::new(),
            cur_op: String::new(),
            cur_loc: None,
            fresh: 0,
        };
        let mut input_layouts = vec![None; g.inputs.len()];
        let mut new_inputs: Vec<Input> = g
            .inputs
            .iter()
            .map(|i| Input {
                node: None,
                ..i.clone()
            })
            .collect();
        for id in g.topo_order() {
            let n = g.node(id);
            b.cur = n.name.clone();
            b.cur_op = n.op.clone();
            b.cur_loc = n.loc.clone();
            if n.is_input() {
                let new = b.out.add_node(n.clone());
                let ty = n.results[0].clone().expect("inputs are tensors");
                let pos = g
                    .inputs
                    .iter()
                    .position(|i| i.node == Some(id))
                    .expect("input node listed");
                let layout = match given.and_then(|l| l.get(pos).cloned().flatten()) {
                    Some(l) => {
                        b.check(&l, &ty)?;
                        l
                    }
                    None => b.input_layout(&ty)?,
                };
                input_layouts[pos] = Some(layout.clone());
                new_inputs[pos].node = Some(new);
                let v = ValueRef {
                    node: id,
                    result: 0,
                };
                b.map.insert(
                    v,
                    ValueRef {
                        node: new,
                        result: 0,
                    },
                );
                b.layouts.insert(v, layout);
                continue;
            }
            b.node(id, n)?;
        }
        Ok((b, input_layouts, new_inputs))
    }

    fn err(&self, reason: impl Into<String>) -> BucketError {
        BucketError {
            op: self.cur_op.clone(),
            node: self.cur.clone(),
            reason: reason.into(),
        }
    }

    fn is_dynamic(&self, e: &SymExpr) -> bool {
        e.symbols().iter().any(|s| self.dynamic.contains(s))
    }

    fn eval(&self, e: &SymExpr) -> R<i64> {
        e.eval(self.sizes).map_err(|err| self.err(err.to_string()))
    }

    fn dim_size(&self, d: &Dim) -> R<i64> {
        match d {
            Dim::Static(n) => Ok(*n),
            Dim::Sym(e) => self.eval(e),
        }
    }

    fn static_shape(&self, t: &TensorType) -> R<Vec<i64>> {
        t.shape.iter().map(|d| self.dim_size(d)).collect()
    }

    /// The layout of a dim as its expression reads: a product `c*s0*s1` becomes one atom per
    /// factor (how the caller pads inputs, and how `view` merges dims); any other expression
    /// over dynamic symbols is one atom whose first `expr` elements are real.
    fn expr_layout(&self, d: &Dim) -> R<DimLayout> {
        let e = match d {
            Dim::Static(n) => return Ok(clean(*n)),
            Dim::Sym(e) if !self.is_dynamic(e) => return Ok(clean(self.eval(e)?)),
            Dim::Sym(e) => e,
        };
        if let Some((c, syms)) = e.as_product() {
            let mut atoms = Vec::new();
            if c != 1 {
                atoms.push(Atom::full(c));
            }
            let mut syms = syms;
            syms.sort();
            for s in syms {
                let size = *self
                    .sizes
                    .get(&s)
                    .ok_or_else(|| self.err(format!("unbound symbol {s}")))?;
                if self.dynamic.contains(&s) {
                    atoms.push(Atom {
                        size,
                        real: Some(SymExpr::parse(&s).map_err(|e| self.err(e.to_string()))?),
                    });
                } else {
                    atoms.push(Atom::full(size));
                }
            }
            return Ok(atoms);
        }
        Ok(vec![Atom {
            size: self.eval(e)?,
            real: Some(e.clone()),
        }])
    }

    fn input_layout(&self, t: &TensorType) -> R<Layout> {
        t.shape.iter().map(|d| self.expr_layout(d)).collect()
    }

    fn layout_of(&self, v: ValueRef) -> R<Layout> {
        self.layouts
            .get(&v)
            .cloned()
            .ok_or_else(|| self.err("operand has no tensor layout"))
    }

    fn value_type(&self, v: ValueRef) -> R<TensorType> {
        self.g
            .value_type(v)
            .cloned()
            .ok_or_else(|| self.err("operand is not a tensor"))
    }

    fn name(&mut self, what: &str) -> String {
        self.fresh += 1;
        format!("{}_{what}{}", self.cur, self.fresh)
    }

    fn emit(
        &mut self,
        what: &str,
        op: &str,
        args: Vec<Arg>,
        kwargs: Vec<(&str, Arg)>,
        ty: TensorType,
    ) -> ValueRef {
        let name = self.name(what);
        let id = self.out.add_node(Node {
            name,
            op: op.into(),
            args,
            kwargs: kwargs
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            results: vec![Some(ty)],
            loc: self.cur_loc.clone(),
            recomputed: false,
        });
        ValueRef {
            node: id,
            result: 0,
        }
    }

    /// A 0-d int64 input that holds `e` evaluated with the real sizes.
    fn scalar(&mut self, e: &SymExpr) -> ValueRef {
        let key = e.to_string();
        if let Some(id) = self.scalar_ids.get(&key) {
            return ValueRef {
                node: *id,
                result: 0,
            };
        }
        let id = self.out.add_node(Node {
            name: format!("tpuc_size{}", self.scalars.len()),
            op: Node::INPUT.into(),
            args: vec![],
            kwargs: BTreeMap::new(),
            results: vec![Some(TensorType::new_static(&[], DType::Int64))],
            loc: None,
            recomputed: false,
        });
        self.scalars.push(e.clone());
        self.scalar_ids.insert(key, id);
        ValueRef {
            node: id,
            result: 0,
        }
    }

    fn scalar_inputs(&self) -> Vec<Input> {
        self.scalars
            .iter()
            .map(|e| {
                let id = self.scalar_ids[&e.to_string()];
                Input {
                    name: self.out.node(id).name.clone(),
                    kind: InputKind::Tensor(TensorType::new_static(&[], DType::Int64)),
                    node: Some(id),
                }
            })
            .collect()
    }

    /// bool[size]: true where the atoms of one dim are all real.
    fn dim_mask(&mut self, atoms: &DimLayout) -> R<ValueRef> {
        let key = format!("{atoms:?}");
        if let Some(v) = self.masks.get(&key) {
            return Ok(*v);
        }
        let sizes: Vec<i64> = atoms.iter().map(|a| a.size).collect();
        let total: i64 = sizes.iter().product();
        let mut acc: Option<(ValueRef, Vec<i64>)> = None;
        for (k, a) in atoms.iter().enumerate() {
            let Some(real) = &a.real else { continue };
            let iota = self.emit(
                "iota",
                "aten.arange.start_step",
                vec![Arg::Int(0), Arg::Int(a.size), Arg::Int(1)],
                vec![("dtype", Arg::DType(DType::Int64))],
                TensorType::new_static(&[a.size], DType::Int64),
            );
            let n = self.scalar(real);
            let lt = self.emit(
                "valid",
                "aten.lt.Tensor",
                vec![Arg::Value(iota), Arg::Value(n)],
                vec![],
                TensorType::new_static(&[a.size], DType::Bool),
            );
            let mut shape = vec![1; sizes.len()];
            shape[k] = a.size;
            let m = if sizes.len() == 1 {
                lt
            } else {
                self.view(lt, &shape, DType::Bool)
            };
            acc = Some(self.and_masks(acc, (m, shape)));
        }
        let (mut m, shape) = acc.ok_or_else(|| self.err("internal: mask of an unpadded dim"))?;
        if sizes.len() > 1 {
            if shape != sizes {
                m = self.emit(
                    "expand",
                    "aten.expand.default",
                    vec![Arg::Value(m), int_list(&sizes)],
                    vec![],
                    TensorType::new_static(&sizes, DType::Bool),
                );
            }
            m = self.view(m, &[total], DType::Bool);
        }
        self.masks.insert(key, m);
        Ok(m)
    }

    /// `acc && m`, broadcasting; `m` alone when there is no `acc` yet.
    fn and_masks(
        &mut self,
        acc: Option<(ValueRef, Vec<i64>)>,
        m: (ValueRef, Vec<i64>),
    ) -> (ValueRef, Vec<i64>) {
        let Some((prev, pshape)) = acc else { return m };
        let bshape = broadcast_shape(&pshape, &m.1);
        let v = self.emit(
            "and",
            "aten.logical_and.default",
            vec![Arg::Value(prev), Arg::Value(m.0)],
            vec![],
            TensorType::new_static(&bshape, DType::Bool),
        );
        (v, bshape)
    }

    fn view(&mut self, v: ValueRef, shape: &[i64], dtype: DType) -> ValueRef {
        self.emit(
            "view",
            "aten.view.default",
            vec![Arg::Value(v), int_list(shape)],
            vec![],
            TensorType::new_static(shape, dtype),
        )
    }

    /// A bool mask, broadcastable to `layout`'s shape, true where every dim in `dims` is real;
    /// None when none of them is padded.
    fn mask(&mut self, layout: &Layout, dims: &[usize]) -> R<Option<(ValueRef, Vec<i64>)>> {
        let rank = layout.len();
        let mut acc: Option<(ValueRef, Vec<i64>)> = None;
        for &d in dims {
            if !dim_padded(&layout[d]) {
                continue;
            }
            let size: i64 = layout[d].iter().map(|a| a.size).product();
            let dm = self.dim_mask(&layout[d].clone())?;
            let mut shape = vec![1; rank];
            shape[d] = size;
            let m = if rank == 1 {
                dm
            } else {
                self.view(dm, &shape, DType::Bool)
            };
            acc = Some(self.and_masks(acc, (m, shape)));
        }
        Ok(acc)
    }

    /// `old`'s new value with its padded elements along `dims` replaced by `fill`.
    fn masked(&mut self, old: ValueRef, dims: &[usize], fill: Fill) -> R<ValueRef> {
        let new = self.map[&old];
        let layout = self.layout_of(old)?;
        let Some((m, _)) = self.mask(&layout, dims)? else {
            return Ok(new);
        };
        let ty = self.value_type(old)?;
        let shape = self.static_shape(&ty)?;
        let dt = ty.dtype;
        let value = match (fill, dt) {
            (Fill::Zero, DType::Bool) => Arg::Bool(false),
            (Fill::One, DType::Bool) | (Fill::Highest, DType::Bool) => Arg::Bool(true),
            (Fill::Lowest, DType::Bool) => Arg::Bool(false),
            (Fill::Zero, d) if d.is_float() => Arg::Float(0.0),
            (Fill::One, d) if d.is_float() => Arg::Float(1.0),
            (Fill::Lowest, d) if d.is_float() => Arg::Float(f64::NEG_INFINITY),
            (Fill::Highest, d) if d.is_float() => Arg::Float(f64::INFINITY),
            (Fill::Zero, _) => Arg::Int(0),
            (Fill::One, _) => Arg::Int(1),
            (Fill::Lowest, d) => Arg::Int(int_min(d)),
            (Fill::Highest, d) => Arg::Int(int_max(d)),
        };
        let fill = self.emit(
            "fill",
            "aten.scalar_tensor.default",
            vec![value],
            vec![("dtype", Arg::DType(dt))],
            TensorType::new_static(&[], dt),
        );
        Ok(self.emit(
            "masked",
            "aten.where.self",
            vec![Arg::Value(m), Arg::Value(new), Arg::Value(fill)],
            vec![],
            TensorType::new_static(&shape, dt),
        ))
    }

    /// Copies `n` with its operands replaced by `replace` (old value -> new value) or their
    /// mapped values, and dynamic size arguments (`Arg::Sym`) replaced by scalar inputs when
    /// `sym_data` (they are data, like a divisor) or kept for specialization (they are shapes).
    fn copy_node(
        &mut self,
        n: &Node,
        replace: &HashMap<ValueRef, ValueRef>,
        sym_data: bool,
    ) -> R<NodeId> {
        let mut op = n.op.clone();
        let mut had_data_sym = false;
        let mut args = Vec::with_capacity(n.args.len());
        for a in &n.args {
            args.push(self.remap(a, replace, sym_data, &mut had_data_sym)?);
        }
        let mut kwargs = BTreeMap::new();
        for (k, a) in &n.kwargs {
            kwargs.insert(
                k.clone(),
                self.remap(a, replace, sym_data, &mut had_data_sym)?,
            );
        }
        if had_data_sym {
            // A size became a 0-d tensor: use the Tensor overload of the op.
            let (base, overload) = split_op(&op);
            let tensor_overload = match overload {
                "Scalar" | "Tensor" => "Tensor",
                "Tensor_Scalar" | "Tensor_Tensor" => "Tensor_Tensor",
                "Scalar_mode" | "Tensor_mode" => "Tensor_mode",
                _ => return Err(self.err("a size used as data in an op without a tensor overload")),
            };
            op = format!("aten.{base}.{tensor_overload}");
        }
        Ok(self.out.add_node(Node {
            name: n.name.clone(),
            op,
            args,
            kwargs,
            results: n.results.clone(),
            loc: n.loc.clone(),
            recomputed: n.recomputed,
        }))
    }

    fn remap(
        &mut self,
        a: &Arg,
        replace: &HashMap<ValueRef, ValueRef>,
        sym_data: bool,
        had: &mut bool,
    ) -> R<Arg> {
        Ok(match a {
            Arg::Value(v) => Arg::Value(*replace.get(v).unwrap_or(&self.map[v])),
            Arg::Sym(e) if sym_data && self.is_dynamic(e) => {
                *had = true;
                Arg::Value(self.scalar(&e.clone()))
            }
            Arg::List(items) => Arg::List(
                items
                    .iter()
                    .map(|i| self.remap(i, replace, sym_data, had))
                    .collect::<R<Vec<_>>>()?,
            ),
            other => other.clone(),
        })
    }

    fn finish(&mut self, old: NodeId, new: NodeId, layouts: Vec<Option<Layout>>) -> R<()> {
        let n = self.g.node(old);
        for (r, l) in layouts.into_iter().enumerate() {
            let ov = ValueRef {
                node: old,
                result: r,
            };
            self.map.insert(
                ov,
                ValueRef {
                    node: new,
                    result: r,
                },
            );
            if let (Some(l), Some(ty)) = (l, n.results.get(r).cloned().flatten()) {
                self.check(&l, &ty)?;
                self.layouts.insert(ov, l);
            }
        }
        Ok(())
    }

    /// The layout must agree with FX's recorded type: same padded sizes, and a dim is padded
    /// exactly when its size depends on a dynamic symbol, with the same number of real elements
    /// (checked at a few real sizes).
    fn check(&self, l: &Layout, ty: &TensorType) -> R<()> {
        if l.len() != ty.rank() {
            return Err(self.err(format!(
                "layout rank {} for a rank-{} result",
                l.len(),
                ty.rank()
            )));
        }
        for (i, (d, fx)) in l.iter().zip(&ty.shape).enumerate() {
            let size: i64 = d.iter().map(|a| a.size).product();
            let expected = self.dim_size(fx)?;
            let dyn_expr = matches!(fx, Dim::Sym(e) if self.is_dynamic(e));
            if size != expected || dyn_expr != dim_padded(d) {
                return Err(self.err(format!(
                    "dim {i} ({fx}) would be laid out as {} (internal rule error)",
                    fmt_dim(d)
                )));
            }
            if let Dim::Sym(e) = fx {
                if dyn_expr {
                    for probe in self.probes() {
                        let want = e.eval(&probe).ok();
                        let got: Option<i64> = d
                            .iter()
                            .map(|a| match &a.real {
                                None => Some(a.size),
                                Some(r) => r.eval(&probe).ok(),
                            })
                            .product();
                        if want.is_some() && got.is_some() && want != got {
                            return Err(self.err(format!(
                                "dim {i} ({fx}): real elements {} do not match (rule error)",
                                fmt_dim(d)
                            )));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Real sizes to check layouts at: each dynamic symbol at 1, 2, its bucket - 1 and bucket.
    fn probes(&self) -> Vec<HashMap<String, i64>> {
        (0..4)
            .map(|k| {
                let mut m = self.sizes.clone();
                for s in self.dynamic {
                    if let Some(&b) = self.sizes.get(s) {
                        let v = [1, 2, b - 1, b][k].clamp(1, b.max(1));
                        m.insert(s.clone(), v);
                    }
                }
                m
            })
            .collect()
    }

    fn dims_arg(&self, a: Option<&Arg>, rank: usize) -> R<Vec<usize>> {
        let norm = |d: i64| -> R<usize> {
            let r = rank as i64;
            let d = if d < 0 { d + r } else { d };
            if d < 0 || (d >= r && !(r == 0 && d == 0)) {
                return Err(self.err(format!("dim {d} out of range for rank {rank}")));
            }
            Ok(d as usize)
        };
        match a {
            None | Some(Arg::None) => Ok((0..rank).collect()),
            Some(Arg::Int(d)) => Ok(if rank == 0 { vec![] } else { vec![norm(*d)?] }),
            Some(Arg::List(items)) if items.is_empty() => Ok((0..rank).collect()),
            Some(Arg::List(items)) => items
                .iter()
                .map(|i| match i {
                    Arg::Int(d) => norm(*d),
                    _ => Err(self.err("non-constant dim")),
                })
                .collect(),
            Some(_) => Err(self.err("non-constant dim")),
        }
    }

    fn bool_arg(&self, n: &Node, pos: usize, kw: &str, default: bool) -> bool {
        match n.args.get(pos).or_else(|| n.kwargs.get(kw)) {
            Some(Arg::Bool(b)) => *b,
            _ => default,
        }
    }

    fn operand(&self, n: &Node, pos: usize) -> R<ValueRef> {
        match n.args.get(pos) {
            Some(Arg::Value(v)) => Ok(*v),
            _ => Err(self.err(format!("argument {pos} is not a tensor"))),
        }
    }

    /// The layout of a result computed from its FX type alone (creation ops: every element is
    /// determined by its index, so the real ones are a prefix of each dim).
    fn fx_layout(&self, ty: &TensorType) -> R<Layout> {
        ty.shape
            .iter()
            .map(|d| match d {
                Dim::Sym(e) if self.is_dynamic(e) => Ok(vec![Atom {
                    size: self.eval(e)?,
                    real: Some(e.clone()),
                }]),
                d => Ok(clean(self.dim_size(d)?)),
            })
            .collect()
    }

    fn result_type(&self, n: &Node, r: usize) -> R<TensorType> {
        n.results
            .get(r)
            .cloned()
            .flatten()
            .ok_or_else(|| self.err(format!("result {r} is not a tensor")))
    }

    /// Layout of an elementwise op with broadcasting: per result dim, the common layout of the
    /// operands that are not broadcast along it.
    fn broadcast_layout(&self, n: &Node, ty: &TensorType) -> R<Layout> {
        let rank = ty.rank();
        let mut out: Layout = self.fx_layout(ty)?;
        let mut from_operand = vec![false; rank];
        for v in n.operands() {
            let (Some(l), Some(t)) = (self.layouts.get(&v), self.g.value_type(v)) else {
                continue;
            };
            let off = rank - l.len().min(rank);
            for (i, d) in l.iter().enumerate() {
                let j = off + i;
                if j >= rank || matches!(t.shape[i], Dim::Static(1)) {
                    continue;
                }
                if from_operand[j] {
                    if !same_dim(&out[j], d) {
                        return Err(self.err(format!(
                            "operands disagree on the padding of dim {j}: {} vs {}",
                            fmt_dim(&out[j]),
                            fmt_dim(d)
                        )));
                    }
                } else {
                    out[j] = d.clone();
                    from_operand[j] = true;
                }
            }
        }
        Ok(out)
    }

    fn node(&mut self, id: NodeId, n: &Node) -> R<()> {
        let (base, overload) = split_op(&n.op);
        // Functionalization writes the view ops' functional twins inside control-flow bodies
        // (`t_copy`, `detach_copy`): the same values as the views, so the same rules.
        let base = base
            .strip_suffix("_copy")
            .filter(|b| VIEW_TWINS.contains(b))
            .unwrap_or(base);
        let any_padded = n
            .operands()
            .iter()
            .any(|v| self.layouts.get(v).is_some_and(layout_padded));
        let none = HashMap::new();

        if ELEMENTWISE.contains(&base) {
            let ty = self.result_type(n, 0)?;
            let l = self.broadcast_layout(n, &ty)?;
            let new = self.copy_node(n, &none, true)?;
            return self.finish(id, new, vec![Some(l)]);
        }
        if CREATION.contains(&base) {
            let ty = self.result_type(n, 0)?;
            // arange's start and step, and a fill value, are values: they must not depend on
            // a padded size.
            let data_args: &[usize] = match (base, overload) {
                ("arange", "start_step") | ("arange", "start") => &[0, 2],
                ("full", _) | ("new_full", _) => &[1],
                ("scalar_tensor", _) => &[0],
                _ => &[],
            };
            for &i in data_args {
                if let Some(Arg::Sym(e)) = n.args.get(i) {
                    if self.is_dynamic(e) {
                        return Err(self.err("a value depends on a dynamic size"));
                    }
                }
            }
            let l = self.fx_layout(&ty)?;
            let new = self.copy_node(n, &none, false)?;
            return self.finish(id, new, vec![Some(l)]);
        }
        let has_dyn_sym = n
            .args
            .iter()
            .chain(n.kwargs.values())
            .any(|a| self.arg_has_dyn(a));
        if !any_padded && !has_dyn_sym {
            // Nothing padded flows in: the op computes the same values as for any real size.
            let layouts = n
                .results
                .iter()
                .map(|t| t.as_ref().map(|t| self.fx_layout(t)).transpose())
                .collect::<R<Vec<_>>>()?;
            let new = self.copy_node(n, &none, false)?;
            return self.finish(id, new, layouts);
        }
        match base {
            "view" | "reshape" | "_unsafe_view" => self.reshape(id, n),
            "permute" | "t" | "transpose" => self.permute(id, n, base),
            "unsqueeze" | "squeeze" => self.squeeze(id, n),
            "expand" => self.expand(id, n),
            "slice" => self.slice(id, n),
            "select" => self.select(id, n),
            "split_with_sizes" | "split" | "cat" => self.split_cat(id, n, base),
            "sum" | "amax" | "amin" | "max" | "min" | "prod" | "any" | "all" | "argmax"
            | "argmin" | "logsumexp" => self.reduce(id, n, base),
            "mean" => self.mean(id, n),
            "var" | "var_mean" => self.var(id, n, base),
            "cumsum" | "cumprod" | "_softmax" | "_log_softmax" => self.along_dim(id, n, base),
            "_softmax_backward_data" | "_log_softmax_backward_data" => {
                self.softmax_backward(id, n, base)
            }
            "mm" | "bmm" | "addmm" | "baddbmm" => self.contraction(id, n, base),
            "native_layer_norm" => self.layer_norm(id, n),
            "convolution"
            | "max_pool2d_with_indices"
            | "avg_pool2d"
            | "_adaptive_avg_pool2d"
            | "native_group_norm"
            | "_native_batch_norm_legit_no_training"
            | "max_pool2d_with_indices_backward"
            | "avg_pool2d_backward"
            | "_adaptive_avg_pool2d_backward" => self.batch_leading(id, n, base),
            "convolution_backward" => self.convolution_backward(id, n),
            "embedding" => self.embedding(id, n),
            "embedding_dense_backward" => self.embedding_backward(id, n),
            "index_put" | "_unsafe_index_put" => self.index_put(id, n),
            "index_select" | "gather" | "scatter" | "scatter_add" => self.gather(id, n, base),
            "index" => self.index(id, n),
            "constant_pad_nd" => self.constant_pad(id, n),
            "flip" => self.flip(id, n),
            "slice_scatter" | "select_scatter" => self.slice_scatter(id, n),
            "higher_order" => self.control_flow(id, n, overload),
            _ => Err(self.err("no bucketing rule for this op, and it reads a padded dim")),
        }
    }

    /// A control-flow op whose operands are padded: each graph it runs is bucketed with its
    /// inputs laid out as the op passes them (a scan's step reads `xs[k]`: the layout of `xs`
    /// without its leading dim), by the same rules as the outer graph. The real sizes its masks
    /// read become extra operands of the op (after its last operand list), which every graph of
    /// the op takes as its last inputs. A loop's carried values must come out of the body laid
    /// out as they went in, both branches of a `cond` must agree, and a scan's scanned dim must
    /// be real (else the graph is compiled per shape).
    fn control_flow(&mut self, id: NodeId, n: &Node, op: &str) -> R<()> {
        let lists = |i: usize| -> Vec<Arg> {
            match n.args.get(i) {
                Some(Arg::List(items)) => items.clone(),
                _ => Vec::new(),
            }
        };
        // Where the op's arguments are: its graphs; the list of values a loop carries around;
        // the list it scans (its graphs read one step of each); the last list (a cond's
        // operands, the additional inputs), read as they are. Every graph of the op takes the
        // carried values, then the steps, then the last list.
        let (graphs, carried_at, xs_at, last): (&[usize], Option<usize>, Option<usize>, usize) =
            match op {
                "cond" => (&[1, 2], None, None, 3),
                "while_loop" => (&[0, 1], Some(2), None, 3),
                "scan" => (&[0], Some(1), Some(2), 3),
                "map_impl" => (&[0], None, Some(1), 2),
                _ => return Err(self.err("no bucketing rule for this control-flow op")),
            };
        // The padded leading dim of xs (one run), when bucketing pads the number of steps.
        let mut steps: Option<DimLayout> = None;
        let layout = |b: &Self, a: &Arg| -> R<Option<Layout>> {
            match a {
                Arg::Value(v) => b.layout_of(*v).map(Some),
                _ => Ok(None),
            }
        };
        let carried: Vec<Option<Layout>> = carried_at
            .map(lists)
            .unwrap_or_default()
            .iter()
            .map(|a| layout(self, a))
            .collect::<R<_>>()?;
        let mut operands: Vec<Option<Layout>> = carried.clone();
        for a in xs_at.map(lists).unwrap_or_default() {
            operands.push(match layout(self, &a)? {
                Some(l) if l.is_empty() => return Err(self.err("a scanned 0-d tensor")),
                Some(l) => {
                    // A bucketed scanned dim: the loop stops at the real number of steps.
                    if dim_padded(&l[0]) {
                        let one_run = matches!(l[0].as_slice(), [a] if a.padded());
                        if !one_run || steps.as_ref().is_some_and(|s| !same_dim(s, &l[0])) {
                            return Err(self
                                .err("the scanned (leading) dims of xs are bucketed differently"));
                        }
                        steps = Some(l[0].clone());
                    }
                    Some(l[1..].to_vec())
                }
                None => None,
            });
        }
        for a in lists(last) {
            operands.push(layout(self, &a)?);
        }
        let mut outs: Vec<Vec<Layout>> = Vec::new();
        let mut bucketed = Vec::new();
        for &pos in graphs {
            let Some(Arg::Region(k)) = n.args.get(pos) else {
                return Err(self.err(format!("argument {pos} is not a graph")));
            };
            let body = &self.g.regions[*k];
            let (sub, in_layouts, new_inputs) =
                Bucketer::walk(body, self.dynamic, self.sizes, Some(&operands)).map_err(|e| {
                    self.err(format!(
                        "in its graph, `{}` (node `{}`): {}",
                        e.op, e.node, e.reason
                    ))
                })?;
            let layouts: Vec<Layout> = body
                .outputs
                .iter()
                .filter_map(|o| match o {
                    Output::Value(v) => Some(sub.layouts[v].clone()),
                    Output::Input(k) => in_layouts[*k].clone(),
                    _ => None,
                })
                .collect();
            let outputs: Vec<Output> = body
                .outputs
                .iter()
                .map(|o| match o {
                    Output::Value(v) => Output::Value(sub.map[v]),
                    other => other.clone(),
                })
                .collect();
            bucketed.push((pos, sub, new_inputs, outputs));
            outs.push(layouts);
        }
        // The real sizes the graphs' masks read: extra operands after the op's last list,
        // the same for every graph of the op (a while_loop's cond_fn and body_fn, both
        // branches of a cond take the same inputs).
        let mut sizes: Vec<SymExpr> = Vec::new();
        for (_, sub, _, _) in &bucketed {
            for e in &sub.scalars {
                if !sizes.contains(e) {
                    sizes.push(e.clone());
                }
            }
        }
        let mut graphs_out: Vec<(usize, Graph)> = Vec::new();
        for (pos, mut sub, mut inputs, outputs) in bucketed {
            for e in &sizes {
                let v = sub.scalar(e);
                inputs.push(Input {
                    name: sub.out.node(v.node).name.clone(),
                    kind: InputKind::Tensor(TensorType::new_static(&[], DType::Int64)),
                    node: Some(v.node),
                });
            }
            let mut g = std::mem::take(&mut sub.out);
            g.inputs = inputs;
            g.outputs = outputs;
            graphs_out.push((pos, g));
        }
        let same = |a: &[Layout], b: &[Layout]| {
            a.len() == b.len()
                && a.iter().zip(b).all(|(x, y)| {
                    x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same_dim(p, q))
                })
        };
        let results: Vec<Option<Layout>> = match op {
            "cond" => {
                if !same(&outs[0], &outs[1]) {
                    return Err(self.err("its branches lay out their results differently"));
                }
                outs[0].iter().cloned().map(Some).collect()
            }
            _ => {
                // The body (the last graph) returns the next carries first.
                let body = outs.last().expect("a loop has a body");
                let carried: Vec<Layout> = carried.iter().flatten().cloned().collect();
                if body.len() < carried.len() || !same(&body[..carried.len()], &carried) {
                    return Err(self.err(
                        "a carried value comes out of the body padded differently than it went in",
                    ));
                }
                let mut r: Vec<Option<Layout>> = carried.into_iter().map(Some).collect();
                if op != "while_loop" {
                    let first_y = r.len();
                    for (k, y) in body[first_y..].iter().enumerate() {
                        let ty = self.result_type(n, first_y + k)?;
                        let lead = match &steps {
                            Some(d) => d.clone(),
                            None => clean(self.dim_size(&ty.shape[0])?),
                        };
                        let mut l = vec![lead];
                        l.extend(y.iter().cloned());
                        r.push(Some(l));
                    }
                }
                r
            }
        };
        let new = self.copy_node(n, &HashMap::new(), false)?;
        for (pos, g) in graphs_out {
            self.out.regions.push(g);
            self.out.dag[new].args[pos] = Arg::Region(self.out.regions.len() - 1);
        }
        if let Some(real) = steps.as_ref().and_then(|d| d[0].real.clone()) {
            let v = self.scalar(&real);
            self.out.dag[new]
                .kwargs
                .insert(STEPS_KWARG.into(), Arg::Value(v));
        }
        if !sizes.is_empty() {
            let extra: Vec<Arg> = sizes.iter().map(|e| Arg::Value(self.scalar(e))).collect();
            match self.out.dag[new].args.get_mut(last) {
                Some(Arg::List(items)) => items.extend(extra),
                _ => return Err(self.err(format!("argument {last} is not an operand list"))),
            }
        }
        self.finish(id, new, results)
    }

    fn arg_has_dyn(&self, a: &Arg) -> bool {
        match a {
            Arg::Sym(e) => self.is_dynamic(e),
            Arg::List(items) => items.iter().any(|i| self.arg_has_dyn(i)),
            _ => false,
        }
    }

    fn copy_with(&mut self, id: NodeId, n: &Node, layouts: Vec<Option<Layout>>) -> R<()> {
        let new = self.copy_node(n, &HashMap::new(), false)?;
        self.finish(id, new, layouts)
    }

    fn reshape(&mut self, id: NodeId, n: &Node) -> R<()> {
        let x = self.operand(n, 0)?;
        let lx = self.layout_of(x)?;
        let ty = self.result_type(n, 0)?;
        let out_sizes = self.static_shape(&ty)?;
        let mut atoms: std::collections::VecDeque<Atom> = lx
            .iter()
            .flatten()
            .filter(|a| a.padded() || a.size != 1)
            .cloned()
            .collect();
        let mut out = Vec::with_capacity(out_sizes.len());
        for &size in &out_sizes {
            let mut dim: DimLayout = Vec::new();
            let mut prod = 1i64;
            while prod < size || (size == 1 && atoms.front().is_some_and(|a| a.size == 1)) {
                let Some(a) = atoms.pop_front() else { break };
                if prod * a.size <= size {
                    prod *= a.size;
                    dim.push(a);
                } else if !a.padded() && size % prod == 0 && a.size % (size / prod) == 0 {
                    let take = size / prod;
                    dim.push(Atom::full(take));
                    atoms.push_front(Atom::full(a.size / take));
                    prod = size;
                } else {
                    return Err(self.err(format!(
                        "reshape splits the padded dim {} (from {})",
                        fmt_dim(&vec![a]),
                        fmt_layout(&lx)
                    )));
                }
            }
            if prod != size {
                return Err(self.err("reshape does not regroup whole dims"));
            }
            if dim.is_empty() {
                dim.push(Atom::full(1));
            }
            out.push(dim);
        }
        if atoms.iter().any(Atom::padded) {
            return Err(self.err("reshape drops a padded dim"));
        }
        self.copy_with(id, n, vec![Some(out)])
    }

    fn permute(&mut self, id: NodeId, n: &Node, base: &str) -> R<()> {
        let x = self.operand(n, 0)?;
        let lx = self.layout_of(x)?;
        let rank = lx.len();
        let perm: Vec<usize> = match base {
            "permute" => self.dims_arg(n.args.get(1), rank)?,
            "t" => (0..rank).rev().collect(),
            _ => {
                let a = self.dims_arg(n.args.get(1), rank)?[0];
                let b = self.dims_arg(n.args.get(2), rank)?[0];
                let mut p: Vec<usize> = (0..rank).collect();
                p.swap(a, b);
                p
            }
        };
        let out = perm.iter().map(|&p| lx[p].clone()).collect();
        self.copy_with(id, n, vec![Some(out)])
    }

    fn squeeze(&mut self, id: NodeId, n: &Node) -> R<()> {
        let x = self.operand(n, 0)?;
        let lx = self.layout_of(x)?;
        let tx = self.value_type(x)?;
        let ty = self.result_type(n, 0)?;
        let out: Layout = if ty.rank() > tx.rank() {
            let d = self.dims_arg(n.args.get(1), ty.rank())?[0];
            let mut l = lx.clone();
            l.insert(d, clean(1));
            l
        } else {
            let dims = self.dims_arg(n.args.get(1), tx.rank())?;
            lx.iter()
                .enumerate()
                .filter(|(i, _)| !(dims.contains(i) && matches!(tx.shape[*i], Dim::Static(1))))
                .map(|(_, d)| d.clone())
                .collect()
        };
        self.copy_with(id, n, vec![Some(out)])
    }

    fn expand(&mut self, id: NodeId, n: &Node) -> R<()> {
        let x = self.operand(n, 0)?;
        let lx = self.layout_of(x)?;
        let tx = self.value_type(x)?;
        let ty = self.result_type(n, 0)?;
        let fx = self.fx_layout(&ty)?;
        let off = ty.rank() - tx.rank();
        let out = (0..ty.rank())
            .map(|j| {
                if j >= off && !matches!(tx.shape[j - off], Dim::Static(1)) {
                    lx[j - off].clone()
                } else {
                    fx[j].clone()
                }
            })
            .collect();
        self.copy_with(id, n, vec![Some(out)])
    }

    fn slice(&mut self, id: NodeId, n: &Node) -> R<()> {
        let x = self.operand(n, 0)?;
        let mut l = self.layout_of(x)?;
        let rank = l.len();
        let dim = self.dims_arg(Some(n.args.get(1).unwrap_or(&Arg::Int(0))), rank)?[0];
        let ty = self.result_type(n, 0)?;
        if dim_padded(&l[dim]) {
            // Padding sits at the end, so a slice from a constant start keeps the real elements
            // first (a negative end counts from the padded end, which drops only padding first).
            let start_ok = matches!(n.args.get(2), None | Some(Arg::None) | Some(Arg::Int(0..)));
            let step_ok = matches!(n.args.get(4), None | Some(Arg::Int(1)));
            if !start_ok || !step_ok || l[dim].len() != 1 {
                return Err(self.err("slice of a padded dim with a size-dependent start or a step"));
            }
        }
        l[dim] = self.fx_layout(&ty)?.swap_remove(dim);
        self.copy_with(id, n, vec![Some(l)])
    }

    fn select(&mut self, id: NodeId, n: &Node) -> R<()> {
        let x = self.operand(n, 0)?;
        let mut l = self.layout_of(x)?;
        let dim = self.dims_arg(n.args.get(1), l.len())?[0];
        if dim_padded(&l[dim]) {
            let index = match n.args.get(2) {
                Some(Arg::Int(i)) if l[dim].len() == 1 => *i,
                _ => {
                    return Err(
                        self.err("select from a merged padded dim or at a size-dependent index")
                    )
                }
            };
            if index < 0 {
                // Counted from the real end: index_select at (real size + index), then drop the dim.
                let real = l[dim][0].real.clone().expect("padded");
                let at = SymExpr::parse(&format!("({real}) + ({index})"))
                    .map_err(|e| self.err(e.to_string()))?;
                let at = self.scalar(&at);
                let at = self.view(at, &[1], DType::Int64);
                let tx = self.value_type(x)?;
                let mut shape = self.static_shape(&tx)?;
                shape[dim] = 1;
                let picked = self.emit(
                    "pick",
                    "aten.index_select.default",
                    vec![
                        Arg::Value(self.map[&x]),
                        Arg::Int(dim as i64),
                        Arg::Value(at),
                    ],
                    vec![],
                    TensorType::new_static(&shape, tx.dtype),
                );
                shape.remove(dim);
                let out = self.emit(
                    "select",
                    "aten.squeeze.dim",
                    vec![Arg::Value(picked), Arg::Int(dim as i64)],
                    vec![],
                    TensorType::new_static(&shape, tx.dtype),
                );
                l.remove(dim);
                return self.finish(id, out.node, vec![Some(l)]);
            }
        }
        l.remove(dim);
        self.copy_with(id, n, vec![Some(l)])
    }

    fn split_cat(&mut self, id: NodeId, n: &Node, base: &str) -> R<()> {
        if base == "cat" {
            let ins: Vec<ValueRef> = n.operands();
            let ty = self.result_type(n, 0)?;
            let dim = self.dims_arg(Some(n.args.get(1).unwrap_or(&Arg::Int(0))), ty.rank())?[0];
            let mut l = self.broadcast_layout_skip(&ins, &ty, dim)?;
            let padded_along: Vec<bool> = ins
                .iter()
                .map(|v| {
                    self.layouts
                        .get(v)
                        .is_some_and(|lv| lv.len() == ty.rank() && dim_padded(&lv[dim]))
                })
                .collect();
            // Padding stays at the end only when the last operand alone is padded (one atom).
            let last_only = padded_along[..padded_along.len().saturating_sub(1)]
                .iter()
                .all(|p| !p)
                && ins.last().is_none_or(|v| {
                    self.layouts.get(v).is_none_or(|lv| {
                        lv.len() != ty.rank() || lv[dim].len() == 1 || !dim_padded(&lv[dim])
                    })
                });
            if !last_only {
                return Err(self.err("cat along a padded dim, padded before its last operand"));
            }
            l[dim] = self.fx_layout(&ty)?.swap_remove(dim);
            return self.copy_with(id, n, vec![Some(l)]);
        }
        let x = self.operand(n, 0)?;
        let lx = self.layout_of(x)?;
        let dim = self.dims_arg(Some(n.args.get(2).unwrap_or(&Arg::Int(0))), lx.len())?[0];
        if dim_padded(&lx[dim]) {
            return Err(self.err("split along a padded dim"));
        }
        let mut layouts = Vec::new();
        for r in 0..n.results.len() {
            let ty = self.result_type(n, r)?;
            let mut l = lx.clone();
            l[dim] = clean(self.dim_size(&ty.shape[dim])?);
            layouts.push(Some(l));
        }
        self.copy_with(id, n, layouts)
    }

    /// Common layout of same-rank operands, ignoring dim `skip`.
    fn broadcast_layout_skip(&self, ins: &[ValueRef], ty: &TensorType, skip: usize) -> R<Layout> {
        let mut out = self.fx_layout(ty)?;
        let mut seen = vec![false; ty.rank()];
        for v in ins {
            let Some(l) = self.layouts.get(v) else {
                continue;
            };
            if l.len() != ty.rank() {
                continue; // a legacy empty tensor in cat
            }
            for (j, d) in l.iter().enumerate() {
                if j == skip {
                    continue;
                }
                if seen[j] && !same_dim(&out[j], d) {
                    return Err(self.err(format!("operands disagree on the padding of dim {j}")));
                }
                out[j] = d.clone();
                seen[j] = true;
            }
        }
        Ok(out)
    }

    fn reduce(&mut self, id: NodeId, n: &Node, base: &str) -> R<()> {
        let x = self.operand(n, 0)?;
        let lx = self.layout_of(x)?;
        let rank = lx.len();
        let (dims, keepdim) = match (base, split_op(&n.op).1) {
            ("sum" | "prod" | "any" | "all" | "max" | "min", "default") => {
                ((0..rank).collect(), false)
            }
            _ => (
                self.dims_arg(n.args.get(1).or(n.kwargs.get("dim")), rank)?,
                self.bool_arg(n, 2, "keepdim", false),
            ),
        };
        let fill = match base {
            "logsumexp" | "amax" | "max" | "argmax" => Fill::Lowest,
            "amin" | "min" | "argmin" => Fill::Highest,
            "prod" | "all" => Fill::One,
            _ => Fill::Zero,
        };
        // Results that are positions (argmax, max.dim's indices) need one run per reduced dim.
        let positional = matches!(base, "argmax" | "argmin")
            || matches!(base, "max" | "min") && n.results.len() > 1;
        if positional
            && dims
                .iter()
                .any(|&d| dim_padded(&lx[d]) && (lx[d].len() != 1 || dims.len() != 1 || rank == 0))
        {
            return Err(self.err("index of an extremum over a merged padded dim"));
        }
        let mut replace = HashMap::new();
        let masked = self.masked(x, &dims, fill)?;
        replace.insert(x, masked);
        let out = reduced_layout(&lx, &dims, keepdim);
        let layouts = n
            .results
            .iter()
            .map(|t| t.as_ref().map(|_| out.clone()))
            .collect();
        let new = self.copy_node(n, &replace, false)?;
        self.finish(id, new, layouts)
    }

    /// The number of real elements over `dims` of a value laid out as `l`, as an expression.
    fn count_expr(&self, l: &Layout, dims: &[usize]) -> R<SymExpr> {
        let mut factors = Vec::new();
        let mut c = 1i64;
        for &d in dims {
            for a in &l[d] {
                match &a.real {
                    None => c *= a.size,
                    Some(r) => factors.push(format!("({r})")),
                }
            }
        }
        factors.insert(0, c.to_string());
        SymExpr::parse(&factors.join("*")).map_err(|e| self.err(e.to_string()))
    }

    fn mean(&mut self, id: NodeId, n: &Node) -> R<()> {
        let x = self.operand(n, 0)?;
        let lx = self.layout_of(x)?;
        let rank = lx.len();
        let default = split_op(&n.op).1 == "default";
        let dims = if default {
            (0..rank).collect()
        } else {
            self.dims_arg(n.args.get(1), rank)?
        };
        let keepdim = !default && self.bool_arg(n, 2, "keepdim", false);
        let ty = self.result_type(n, 0)?;
        let out = reduced_layout(&lx, &dims, keepdim);
        if !dims.iter().any(|&d| dim_padded(&lx[d])) {
            return self.copy_with(id, n, vec![Some(out)]);
        }
        // mean = sum(where(real, x, 0)) / (number of real elements)
        let masked = self.masked(x, &dims, Fill::Zero)?;
        let shape = self.static_shape(&ty)?;
        let mut kwargs = vec![];
        if let Some(d) = n.kwargs.get("dtype") {
            kwargs.push(("dtype", d.clone()));
        }
        let sum = self.emit(
            "sum",
            "aten.sum.dim_IntList",
            vec![
                Arg::Value(masked),
                int_list(&dims.iter().map(|&d| d as i64).collect::<Vec<_>>()),
                Arg::Bool(keepdim),
            ],
            kwargs,
            TensorType::new_static(&shape, ty.dtype),
        );
        let count = self.count_expr(&lx, &dims)?;
        let count = self.scalar(&count);
        let div = self.emit(
            "mean",
            "aten.div.Tensor",
            vec![Arg::Value(sum), Arg::Value(count)],
            vec![],
            TensorType::new_static(&shape, ty.dtype),
        );
        self.finish(id, div.node, vec![Some(out)])
    }

    fn var(&mut self, id: NodeId, n: &Node, base: &str) -> R<()> {
        let x = self.operand(n, 0)?;
        let lx = self.layout_of(x)?;
        let rank = lx.len();
        let dims = self.dims_arg(n.args.get(1).or(n.kwargs.get("dim")), rank)?;
        let keepdim = self.bool_arg(n, 99, "keepdim", false);
        let correction = match n.kwargs.get("correction").or(n.args.get(2)) {
            None | Some(Arg::None) => 1,
            Some(Arg::Int(c)) => *c,
            Some(Arg::Float(c)) if c.fract() == 0.0 => *c as i64,
            _ => return Err(self.err("non-integer correction")),
        };
        let out = reduced_layout(&lx, &dims, keepdim);
        if !dims.iter().any(|&d| dim_padded(&lx[d])) {
            let layouts = n.results.iter().map(|_| Some(out.clone())).collect();
            return self.copy_with(id, n, layouts);
        }
        let tx = self.value_type(x)?;
        let dt = tx.dtype;
        let xshape = self.static_shape(&tx)?;
        let kshape: Vec<i64> = xshape
            .iter()
            .enumerate()
            .map(|(i, &s)| if dims.contains(&i) { 1 } else { s })
            .collect();
        let oshape = self.static_shape(&self.result_type(n, 0)?)?;
        let dl = int_list(&dims.iter().map(|&d| d as i64).collect::<Vec<_>>());
        let masked = self.masked(x, &dims, Fill::Zero)?;
        let count = self.count_expr(&lx, &dims)?;
        let count_v = self.scalar(&count);
        let sum = self.emit(
            "sum",
            "aten.sum.dim_IntList",
            vec![Arg::Value(masked), dl.clone(), Arg::Bool(true)],
            vec![],
            TensorType::new_static(&kshape, dt),
        );
        let mean = self.emit(
            "mean",
            "aten.div.Tensor",
            vec![Arg::Value(sum), Arg::Value(count_v)],
            vec![],
            TensorType::new_static(&kshape, dt),
        );
        let xn = self.map[&x];
        let diff = self.emit(
            "diff",
            "aten.sub.Tensor",
            vec![Arg::Value(xn), Arg::Value(mean)],
            vec![],
            TensorType::new_static(&xshape, dt),
        );
        // Mask the deviations too: padded elements minus the mean are not zero.
        let (m, _) = self.mask(&lx, &dims)?.expect("a padded dim is reduced");
        let zero = self.emit(
            "zero",
            "aten.scalar_tensor.default",
            vec![Arg::Float(0.0)],
            vec![("dtype", Arg::DType(dt))],
            TensorType::new_static(&[], dt),
        );
        let dm = self.emit(
            "dev",
            "aten.where.self",
            vec![Arg::Value(m), Arg::Value(diff), Arg::Value(zero)],
            vec![],
            TensorType::new_static(&xshape, dt),
        );
        let sq = self.emit(
            "sq",
            "aten.mul.Tensor",
            vec![Arg::Value(dm), Arg::Value(dm)],
            vec![],
            TensorType::new_static(&xshape, dt),
        );
        let ssq = self.emit(
            "ssq",
            "aten.sum.dim_IntList",
            vec![Arg::Value(sq), dl, Arg::Bool(keepdim)],
            vec![],
            TensorType::new_static(&oshape, dt),
        );
        let denom = SymExpr::parse(&format!("Max(0, ({count}) - {correction})"))
            .map_err(|e| self.err(e.to_string()))?;
        let denom = self.scalar(&denom);
        let var = self.emit(
            "var",
            "aten.div.Tensor",
            vec![Arg::Value(ssq), Arg::Value(denom)],
            vec![],
            TensorType::new_static(&oshape, dt),
        );
        if base == "var" {
            return self.finish(id, var.node, vec![Some(out)]);
        }
        let mean_out = if keepdim {
            mean
        } else {
            self.view(mean, &oshape, dt)
        };
        // var_mean has two results: bundle them as a node the lowering knows is a pass-through.
        self.map.insert(
            ValueRef {
                node: id,
                result: 0,
            },
            var,
        );
        self.map.insert(
            ValueRef {
                node: id,
                result: 1,
            },
            mean_out,
        );
        let ty0 = self.result_type(n, 0)?;
        self.check(&out, &ty0)?;
        self.layouts.insert(
            ValueRef {
                node: id,
                result: 0,
            },
            out.clone(),
        );
        self.layouts.insert(
            ValueRef {
                node: id,
                result: 1,
            },
            out,
        );
        Ok(())
    }

    fn along_dim(&mut self, id: NodeId, n: &Node, base: &str) -> R<()> {
        let x = self.operand(n, 0)?;
        let lx = self.layout_of(x)?;
        let dim = self.dims_arg(n.args.get(1).or(n.kwargs.get("dim")), lx.len())?;
        let fill = match base {
            "cumsum" => Fill::Zero,
            "cumprod" => Fill::One,
            _ => Fill::Lowest,
        };
        let masked = self.masked(x, &dim, fill)?;
        let replace = HashMap::from([(x, masked)]);
        let new = self.copy_node(n, &replace, false)?;
        self.finish(id, new, vec![Some(lx)])
    }

    /// `flip` along real dims moves no padding; along a padded dim (one run of which the first
    /// `r` are real) it reverses the real prefix in place: `x[r-1-i]` for `i < r`.
    fn flip(&mut self, id: NodeId, n: &Node) -> R<()> {
        let x = self.operand(n, 0)?;
        let lx = self.layout_of(x)?;
        let dims = self.dims_arg(n.args.get(1).or(n.kwargs.get("dims")), lx.len())?;
        let (padded, real): (Vec<usize>, Vec<usize>) =
            dims.iter().partition(|&&d| dim_padded(&lx[d]));
        if padded.is_empty() {
            return self.copy_with(id, n, vec![Some(lx)]);
        }
        let ty = self.value_type(x)?;
        let shape = self.static_shape(&ty)?;
        let mut v = self.map[&x];
        for d in padded {
            let [Atom {
                size,
                real: Some(r),
            }] = lx[d].as_slice()
            else {
                return Err(self.err("flip along a dim bucketed as several runs"));
            };
            let (size, r) = (*size, r.clone());
            let i64t = |s: &[i64]| TensorType::new_static(s, DType::Int64);
            let iota = self.emit(
                "iota",
                "aten.arange.start_step",
                vec![Arg::Int(0), Arg::Int(size), Arg::Int(1)],
                vec![("dtype", Arg::DType(DType::Int64))],
                i64t(&[size]),
            );
            let real = self.scalar(&r);
            let from_end = self.emit(
                "from_end",
                "aten.sub.Tensor",
                vec![Arg::Value(real), Arg::Value(iota)],
                vec![],
                i64t(&[size]),
            );
            let rev = self.emit(
                "rev",
                "aten.sub.Tensor",
                vec![Arg::Value(from_end), Arg::Int(1)],
                vec![],
                i64t(&[size]),
            );
            let inside = self.dim_mask(&lx[d])?;
            let idx = self.emit(
                "idx",
                "aten.where.self",
                vec![Arg::Value(inside), Arg::Value(rev), Arg::Value(iota)],
                vec![],
                i64t(&[size]),
            );
            v = self.emit(
                "flipped",
                "aten.index_select.default",
                vec![Arg::Value(v), Arg::Int(d as i64), Arg::Value(idx)],
                vec![],
                TensorType::new_static(&shape, ty.dtype),
            );
        }
        if !real.is_empty() {
            let dims: Vec<i64> = real.iter().map(|&d| d as i64).collect();
            v = self.emit(
                "flipped",
                "aten.flip.default",
                vec![Arg::Value(v), int_list(&dims)],
                vec![],
                TensorType::new_static(&shape, ty.dtype),
            );
        }
        self.finish(id, v.node, vec![Some(lx)])
    }

    fn softmax_backward(&mut self, id: NodeId, n: &Node, base: &str) -> R<()> {
        let g = self.operand(n, 0)?;
        let y = self.operand(n, 1)?;
        let lg = self.layout_of(g)?;
        let ly = self.layout_of(y)?;
        let dim = self.dims_arg(n.args.get(2), lg.len())?;
        if lg.len() != ly.len() || lg.iter().zip(&ly).any(|(a, b)| !same_dim(a, b)) {
            return Err(self.err("gradient and output are padded differently"));
        }
        let mut replace = HashMap::new();
        replace.insert(g, self.masked(g, &dim, Fill::Zero)?);
        if base == "_softmax_backward_data" {
            replace.insert(y, self.masked(y, &dim, Fill::Zero)?);
        }
        let new = self.copy_node(n, &replace, false)?;
        self.finish(id, new, vec![Some(lg)])
    }

    fn contraction(&mut self, id: NodeId, n: &Node, base: &str) -> R<()> {
        let (ai, bi) = if matches!(base, "addmm" | "baddbmm") {
            (1, 2)
        } else {
            (0, 1)
        };
        let a = self.operand(n, ai)?;
        let b = self.operand(n, bi)?;
        let la = self.layout_of(a)?;
        let lb = self.layout_of(b)?;
        let ra = la.len();
        let (ka, kb) = (ra - 1, lb.len() - 2);
        if !same_dim(&la[ka], &lb[kb]) {
            return Err(self.err("operands padded differently along the contracted dim"));
        }
        if ra == 3 && !same_dim(&la[0], &lb[0]) {
            return Err(self.err("operands padded differently along the batch dim"));
        }
        let mut replace = HashMap::new();
        if dim_padded(&la[ka]) {
            replace.insert(a, self.masked(a, &[ka], Fill::Zero)?);
            replace.insert(b, self.masked(b, &[kb], Fill::Zero)?);
        }
        let mut out: Layout = la[..ra - 1].to_vec();
        out.push(lb[lb.len() - 1].clone());
        if matches!(base, "addmm" | "baddbmm") {
            let c = self.operand(n, 0)?;
            let lc = self.layout_of(c)?;
            let off = out.len() - lc.len();
            for (i, d) in lc.iter().enumerate() {
                let j = off + i;
                let size: i64 = d.iter().map(|a| a.size).product();
                if size != 1 && !same_dim(d, &out[j]) {
                    return Err(self.err("bias padded differently from the product"));
                }
            }
        }
        let new = self.copy_node(n, &replace, false)?;
        self.finish(id, new, vec![Some(out)])
    }

    fn layer_norm(&mut self, id: NodeId, n: &Node) -> R<()> {
        let x = self.operand(n, 0)?;
        let lx = self.layout_of(x)?;
        let k = match n.args.get(1) {
            Some(Arg::List(items)) => items.len(),
            _ => return Err(self.err("normalized_shape is not a list")),
        };
        let lead = lx.len() - k;
        if lx[lead..].iter().any(dim_padded) {
            return Err(self.err("layer norm over a padded dim"));
        }
        for w in [2, 3] {
            if let Some(Arg::Value(v)) = n.args.get(w) {
                if self.layouts.get(v).is_some_and(layout_padded) {
                    return Err(self.err("padded weight"));
                }
            }
        }
        let mut stats = lx.clone();
        for d in stats.iter_mut().skip(lead) {
            *d = clean(1);
        }
        self.copy_with(id, n, vec![Some(lx), Some(stats.clone()), Some(stats)])
    }

    /// Ops over `[N, C, spatial...]` that treat each sample (and channel) separately: any
    /// padding of N is fine, spatial dims must not be padded.
    fn batch_leading(&mut self, id: NodeId, n: &Node, base: &str) -> R<()> {
        let x = self.operand(n, if base.ends_with("_backward") { 1 } else { 0 })?;
        let lx = self.layout_of(x)?;
        let lead = match base {
            "convolution" | "native_group_norm" => 1,
            _ => 2.min(lx.len()),
        };
        if lx[lead..].iter().any(dim_padded) {
            return Err(self.err("a padded channel or spatial dim"));
        }
        for v in n.operands() {
            if v != x
                && self.layouts.get(&v).is_some_and(|l| {
                    base.ends_with("_backward") && l.len() == lx.len() && !same_dim(&l[0], &lx[0])
                        || !base.ends_with("_backward") && layout_padded(l)
                })
            {
                return Err(self.err("padded weights or a gradient padded unlike its input"));
            }
        }
        let mut layouts = Vec::new();
        for r in 0..n.results.len() {
            let Some(ty) = n.results[r].as_ref() else {
                layouts.push(None);
                continue;
            };
            let mut l = self.fx_layout(ty)?;
            for (i, d) in lx.iter().enumerate().take(lead) {
                if i < l.len() && same_size(d, &l[i]) {
                    l[i] = d.clone();
                }
            }
            layouts.push(Some(l));
        }
        self.copy_with(id, n, layouts)
    }

    fn convolution_backward(&mut self, id: NodeId, n: &Node) -> R<()> {
        let g = self.operand(n, 0)?;
        let x = self.operand(n, 1)?;
        let lg = self.layout_of(g)?;
        let lx = self.layout_of(x)?;
        if lx[1..].iter().any(dim_padded)
            || lg[1..].iter().any(dim_padded)
            || !same_dim(&lx[0], &lg[0])
        {
            return Err(self.err("a padded channel or spatial dim"));
        }
        let mut replace = HashMap::new();
        replace.insert(g, self.masked(g, &[0], Fill::Zero)?);
        replace.insert(x, self.masked(x, &[0], Fill::Zero)?);
        let mut layouts = Vec::new();
        for (r, t) in n.results.iter().enumerate() {
            layouts.push(match t {
                None => None,
                Some(t) if r == 0 => {
                    let mut l = self.fx_layout(t)?;
                    l[0] = lx[0].clone();
                    Some(l)
                }
                Some(t) => Some(self.fx_layout(t)?),
            });
        }
        let new = self.copy_node(n, &replace, false)?;
        self.finish(id, new, layouts)
    }

    fn embedding(&mut self, id: NodeId, n: &Node) -> R<()> {
        let w = self.operand(n, 0)?;
        let ids = self.operand(n, 1)?;
        if layout_padded(&self.layout_of(w)?) {
            return Err(self.err("padded embedding table"));
        }
        let mut l = self.layout_of(ids)?;
        let ty = self.result_type(n, 0)?;
        l.push(clean(self.dim_size(&ty.shape[ty.rank() - 1])?));
        self.copy_with(id, n, vec![Some(l)])
    }

    fn embedding_backward(&mut self, id: NodeId, n: &Node) -> R<()> {
        let g = self.operand(n, 0)?;
        let lg = self.layout_of(g)?;
        if self.bool_arg(n, 4, "scale_grad_by_freq", false) {
            return Err(self.err("scale_grad_by_freq counts padded indices"));
        }
        let dims: Vec<usize> = (0..lg.len().saturating_sub(1)).collect();
        let masked = self.masked(g, &dims, Fill::Zero)?;
        let replace = HashMap::from([(g, masked)]);
        let ty = self.result_type(n, 0)?;
        let l = self.fx_layout(&ty)?;
        let new = self.copy_node(n, &replace, false)?;
        self.finish(id, new, vec![Some(l)])
    }

    fn index_put(&mut self, id: NodeId, n: &Node) -> R<()> {
        let target = self.operand(n, 0)?;
        let values = self.operand(n, 2)?;
        let lt = self.layout_of(target)?;
        let accumulate = self.bool_arg(n, 3, "accumulate", false);
        if layout_padded(&lt) || !accumulate {
            return Err(self.err("indexed writes into or from a padded tensor without accumulate"));
        }
        // Padded indices point at real rows; their values are zeroed so they add nothing.
        let lv = self.layout_of(values)?;
        let dims: Vec<usize> = (0..lv.len()).collect();
        let masked = self.masked(values, &dims, Fill::Zero)?;
        let replace = HashMap::from([(values, masked)]);
        let new = self.copy_node(n, &replace, false)?;
        self.finish(id, new, vec![Some(lt)])
    }

    fn gather(&mut self, id: NodeId, n: &Node, base: &str) -> R<()> {
        let x = self.operand(n, 0)?;
        let idx = self.operand(n, 2)?;
        let lx = self.layout_of(x)?;
        let li = self.layout_of(idx)?;
        let dim = self.dims_arg(n.args.get(1), lx.len())?[0];
        let mut replace = HashMap::new();
        if dim_padded(&lx[dim]) {
            if base.starts_with("scatter") || lx[dim].len() != 1 {
                return Err(
                    self.err("indexed writes along a padded dim, or reads along a merged one")
                );
            }
            let fixed = self.wrap_negative(idx, &lx[dim][0].clone())?;
            replace.insert(idx, fixed);
        }
        let out = if base == "index_select" {
            let mut l = lx.clone();
            l[dim] = li[0].clone();
            l
        } else if base.starts_with("scatter") {
            // Each row along the other dims writes only into itself: padded rows into padded rows.
            for v in n.operands().into_iter().skip(1) {
                let lv = self.layout_of(v)?;
                for (i, (a, b)) in lx.iter().zip(&lv).enumerate() {
                    if i == dim && dim_padded(b)
                        || i != dim && !same_dim(a, b) && (dim_padded(a) || dim_padded(b))
                    {
                        return Err(
                            self.err("scatter with index or source padded unlike the input")
                        );
                    }
                }
            }
            lx
        } else {
            for (i, (a, b)) in lx.iter().zip(&li).enumerate() {
                if i != dim && (dim_padded(a) || dim_padded(b)) && !same_dim(a, b) {
                    return Err(self.err("gather with index and input padded differently"));
                }
            }
            li
        };
        let new = self.copy_node(n, &replace, false)?;
        self.finish(id, new, vec![Some(out)])
    }

    /// `where(idx < 0, idx + real, idx)`: a negative index counts from the real end of a padded
    /// dim, not from the padded one.
    fn wrap_negative(&mut self, idx: ValueRef, atom: &Atom) -> R<ValueRef> {
        let ty = self.value_type(idx)?;
        let shape = self.static_shape(&ty)?;
        let real = self.scalar(atom.real.as_ref().expect("padded"));
        let new = self.map[&idx];
        let zero = self.emit(
            "zero",
            "aten.scalar_tensor.default",
            vec![Arg::Int(0)],
            vec![("dtype", Arg::DType(ty.dtype))],
            TensorType::new_static(&[], ty.dtype),
        );
        let neg = self.emit(
            "neg",
            "aten.lt.Tensor",
            vec![Arg::Value(new), Arg::Value(zero)],
            vec![],
            TensorType::new_static(&shape, DType::Bool),
        );
        let wrapped = self.emit(
            "wrapped",
            "aten.add.Tensor",
            vec![Arg::Value(new), Arg::Value(real)],
            vec![],
            TensorType::new_static(&shape, ty.dtype),
        );
        Ok(self.emit(
            "index",
            "aten.where.self",
            vec![Arg::Value(neg), Arg::Value(wrapped), Arg::Value(new)],
            vec![],
            TensorType::new_static(&shape, ty.dtype),
        ))
    }

    /// Advanced indexing `x[i0, i1, ...]`: the result takes the broadcast layout of the index
    /// tensors where they sit; indexed padded dims read real positions (negative indices wrap
    /// at the real size).
    fn index(&mut self, id: NodeId, n: &Node) -> R<()> {
        let x = self.operand(n, 0)?;
        let lx = self.layout_of(x)?;
        let Some(Arg::List(items)) = n.args.get(1) else {
            return Err(self.err("indices are not a list"));
        };
        let mut replace = HashMap::new();
        let mut indexed = Vec::new();
        let mut idx_layouts: Vec<Layout> = Vec::new();
        for (k, item) in items.iter().enumerate() {
            let Arg::Value(v) = item else { continue };
            let tv = self.value_type(*v)?;
            if tv.dtype == DType::Bool || tv.dtype == DType::Uint8 {
                return Err(self.err("boolean mask indexing"));
            }
            indexed.push(k);
            if k < lx.len() && dim_padded(&lx[k]) {
                if lx[k].len() != 1 {
                    return Err(self.err("indexing a merged padded dim"));
                }
                let fixed = self.wrap_negative(*v, &lx[k][0].clone())?;
                replace.insert(*v, fixed);
            }
            idx_layouts.push(self.layout_of(*v)?);
        }
        // Broadcast the index layouts (right-aligned, size-1 dims broadcast).
        let rank = idx_layouts.iter().map(Vec::len).max().unwrap_or(0);
        let mut bl: Layout = vec![clean(1); rank];
        for l in &idx_layouts {
            let off = rank - l.len();
            for (i, d) in l.iter().enumerate() {
                let size: i64 = d.iter().map(|a| a.size).product();
                if size == 1 && !dim_padded(d) {
                    continue;
                }
                let cur: i64 = bl[off + i].iter().map(|a| a.size).product();
                if cur != 1 || dim_padded(&bl[off + i]) {
                    if !same_dim(&bl[off + i], d) {
                        return Err(self.err("index tensors padded differently"));
                    }
                } else {
                    bl[off + i] = d.clone();
                }
            }
        }
        let adjacent = indexed.windows(2).all(|w| w[1] == w[0] + 1);
        let rest: Vec<DimLayout> = lx
            .iter()
            .enumerate()
            .filter(|(i, _)| !indexed.contains(i))
            .map(|(_, d)| d.clone())
            .collect();
        let out: Layout = if adjacent && !indexed.is_empty() {
            let k0 = indexed[0];
            let mut o: Layout = lx[..k0].to_vec();
            o.extend(bl);
            o.extend(lx[indexed[indexed.len() - 1] + 1..].iter().cloned());
            o
        } else {
            let mut o = bl;
            o.extend(rest);
            o
        };
        let new = self.copy_node(n, &replace, false)?;
        self.finish(id, new, vec![Some(out)])
    }

    /// `base` with `src` written into a slice (or index) of a dim that is not padded: every
    /// other dim lines up element for element, so padding stays where it was.
    fn slice_scatter(&mut self, id: NodeId, n: &Node) -> R<()> {
        let base = self.operand(n, 0)?;
        let src = self.operand(n, 1)?;
        let lb = self.layout_of(base)?;
        let ls = self.layout_of(src)?;
        let dim = self.dims_arg(Some(n.args.get(2).unwrap_or(&Arg::Int(0))), lb.len())?[0];
        if dim_padded(&lb[dim]) {
            return Err(self.err("a scatter into a padded dim"));
        }
        let others: Vec<&DimLayout> = lb
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != dim)
            .map(|(_, d)| d)
            .collect();
        let src_others: Vec<&DimLayout> = if ls.len() == lb.len() {
            ls.iter()
                .enumerate()
                .filter(|(i, _)| *i != dim)
                .map(|(_, d)| d)
                .collect()
        } else {
            ls.iter().collect() // select_scatter: src lacks the dim
        };
        if others.len() != src_others.len()
            || others.iter().zip(&src_others).any(|(a, b)| !same_dim(a, b))
        {
            return Err(self.err("source padded unlike the base"));
        }
        self.copy_with(id, n, vec![Some(lb)])
    }

    fn constant_pad(&mut self, id: NodeId, n: &Node) -> R<()> {
        let x = self.operand(n, 0)?;
        let mut l = self.layout_of(x)?;
        let pads: Vec<i64> = match n.args.get(1) {
            Some(Arg::List(items)) => items
                .iter()
                .map(|a| if let Arg::Int(i) = a { *i } else { 1 })
                .collect(),
            _ => return Err(self.err("non-constant padding")),
        };
        let rank = l.len();
        for (k, pair) in pads.chunks(2).enumerate() {
            let d = rank - 1 - k;
            if pair.iter().any(|&p| p != 0) {
                if dim_padded(&l[d]) {
                    return Err(self.err("constant padding of a padded dim"));
                }
                let ty = self.result_type(n, 0)?;
                l[d] = clean(self.dim_size(&ty.shape[d])?);
            }
        }
        self.copy_with(id, n, vec![Some(l)])
    }
}

/// The layout after reducing `dims`: dropped, or size 1 with `keepdim`.
fn reduced_layout(l: &Layout, dims: &[usize], keepdim: bool) -> Layout {
    l.iter()
        .enumerate()
        .filter_map(|(i, d)| match (dims.contains(&i), keepdim) {
            (false, _) => Some(d.clone()),
            (true, true) => Some(clean(1)),
            (true, false) => None,
        })
        .collect()
}

fn same_size(a: &DimLayout, b: &DimLayout) -> bool {
    a.iter().map(|x| x.size).product::<i64>() == b.iter().map(|x| x.size).product::<i64>()
}

fn int_list(v: &[i64]) -> Arg {
    Arg::List(v.iter().map(|&i| Arg::Int(i)).collect())
}

fn int_min(d: DType) -> i64 {
    match d {
        DType::Int8 => i8::MIN as i64,
        DType::Int16 => i16::MIN as i64,
        DType::Int32 => i32::MIN as i64,
        DType::Uint8 => 0,
        _ => i64::MIN,
    }
}

fn int_max(d: DType) -> i64 {
    match d {
        DType::Int8 => i8::MAX as i64,
        DType::Int16 => i16::MAX as i64,
        DType::Int32 => i32::MAX as i64,
        DType::Uint8 => u8::MAX as i64,
        _ => i64::MAX,
    }
}

fn fmt_dim(d: &DimLayout) -> String {
    let parts: Vec<String> = d
        .iter()
        .map(|a| match &a.real {
            None => a.size.to_string(),
            Some(r) => format!("{r}<={}", a.size),
        })
        .collect();
    format!("[{}]", parts.join(" x "))
}

fn fmt_layout(l: &Layout) -> String {
    let parts: Vec<String> = l.iter().map(fmt_dim).collect();
    format!("({})", parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tpuc_frontend_fx::import_json;

    fn t(shape: &str, dtype: &str) -> String {
        format!(r#"{{"tensor": {{"shape": {shape}, "dtype": "{dtype}"}}}}"#)
    }

    fn graph(nodes: &[String], out: &str) -> Graph {
        let json = format!(
            r#"{{"nodes": [{}, {{"name": "output", "op": "output", "args": [[{{"node": "{out}"}}]]}}]}}"#,
            nodes.join(", ")
        );
        import_json(&json).unwrap()
    }

    fn input(name: &str, shape: &str) -> String {
        format!(
            r#"{{"name": "{name}", "op": "placeholder", "val": {}}}"#,
            t(shape, "float32")
        )
    }

    fn call(name: &str, target: &str, args: &str, shape: &str) -> String {
        format!(
            r#"{{"name": "{name}", "op": "call_function", "target": "{target}", "args": {args}, "val": {}}}"#,
            t(shape, "float32")
        )
    }

    /// A SymInt-valued node (folded into the arguments that use it).
    fn sym(name: &str, expr: &str) -> String {
        format!(
            r#"{{"name": "{name}", "op": "call_function", "target": "<built-in function mul>", "args": [], "val": {{"symint": "{expr}"}}}}"#
        )
    }

    fn run(g: &Graph, bucket_size: i64) -> R<Bucketed> {
        let dynamic = HashSet::from(["s0".to_string()]);
        let sizes = HashMap::from([("s0".to_string(), bucket_size)]);
        bucket(g, &dynamic, &sizes)
    }

    #[test]
    fn reduction_over_a_padded_dim_is_masked() {
        let g = graph(
            &[
                input("x", r#"["s0", 4]"#),
                call(
                    "s",
                    "aten.sum.dim_IntList",
                    r#"[{"node": "x"}, [0]]"#,
                    "[4]",
                ),
            ],
            "s",
        );
        let b = run(&g, 8).unwrap();
        let text = b.graph.to_string();
        assert!(text.contains("%x: float32[8, 4] = input()"), "{text}");
        assert!(text.contains("aten.where.self"), "{text}");
        assert!(text.contains("aten.lt.Tensor"), "{text}");
        assert_eq!(
            b.scalars.iter().map(|e| e.to_string()).collect::<Vec<_>>(),
            ["s0"]
        );
        assert_eq!(b.output_layouts, vec![vec![clean(4)]]);
        assert_eq!(b.graph.inputs.len(), 2, "x and the real size");
    }

    #[test]
    fn elementwise_ops_pass_padding_through_unmasked() {
        let g = graph(
            &[
                input("x", r#"["s0", 4]"#),
                call(
                    "e",
                    "aten.exp.default",
                    r#"[{"node": "x"}]"#,
                    r#"["s0", 4]"#,
                ),
            ],
            "e",
        );
        let b = run(&g, 8).unwrap();
        assert!(!b.graph.to_string().contains("where"), "{}", b.graph);
        assert!(b.scalars.is_empty());
        let l = &b.output_layouts[0];
        assert_eq!(l[0][0].size, 8);
        assert_eq!(l[0][0].real.as_ref().unwrap().to_string(), "s0");
    }

    #[test]
    fn mean_divides_by_the_real_count() {
        let g = graph(
            &[
                input("x", r#"[3, "s0"]"#),
                call("m", "aten.mean.dim", r#"[{"node": "x"}, [0, 1]]"#, "[]"),
            ],
            "m",
        );
        let b = run(&g, 4).unwrap();
        let scalars: Vec<String> = b.scalars.iter().map(|e| e.to_string()).collect();
        assert!(scalars.contains(&"3*(s0)".to_string()), "{scalars:?}");
        let probe = HashMap::from([("s0".to_string(), 3)]);
        let count = b
            .scalars
            .iter()
            .find(|e| e.to_string() == "3*(s0)")
            .unwrap();
        assert_eq!(count.eval(&probe).unwrap(), 9);
        assert!(b.graph.to_string().contains("aten.div.Tensor"));
    }

    #[test]
    fn merged_dims_keep_one_atom_per_factor() {
        // [2, s0, 3] -> [2*s0, 3] -> sum over the merged dim: the mask covers 2 x s0.
        let g = graph(
            &[
                input("x", r#"[2, "s0", 3]"#),
                sym("n", "2*s0"),
                call(
                    "v",
                    "aten.view.default",
                    r#"[{"node": "x"}, [{"node": "n"}, 3]]"#,
                    r#"["2*s0", 3]"#,
                ),
                call(
                    "s",
                    "aten.sum.dim_IntList",
                    r#"[{"node": "v"}, [0]]"#,
                    "[3]",
                ),
            ],
            "s",
        );
        let b = run(&g, 4).unwrap();
        let text = b.graph.to_string();
        assert!(text.contains("bool[2, 4] = aten.expand.default"), "{text}");
        assert!(text.contains("bool[8] = aten.view.default"), "{text}");
    }

    #[test]
    fn a_reshape_that_splits_a_padded_dim_is_reported() {
        let g = graph(
            &[
                input("x", r#"["2*s0"]"#),
                sym("n", "s0"),
                call(
                    "v",
                    "aten.view.default",
                    r#"[{"node": "x"}, [{"node": "n"}, 2]]"#,
                    r#"["s0", 2]"#,
                ),
            ],
            "v",
        );
        let e = run(&g, 4).unwrap_err();
        assert_eq!(e.op, "aten.view.default");
        assert_eq!(e.node, "v");
        assert!(e.to_string().contains("splits the padded dim"), "{e}");
    }

    #[test]
    fn an_op_without_a_rule_on_a_padded_dim_is_reported_by_name() {
        let g = graph(
            &[
                input("x", r#"["s0", 4]"#),
                call(
                    "f",
                    "aten.roll.default",
                    r#"[{"node": "x"}, [1], [0]]"#,
                    r#"["s0", 4]"#,
                ),
            ],
            "f",
        );
        let e = run(&g, 8).unwrap_err();
        assert_eq!((e.op.as_str(), e.node.as_str()), ("aten.roll.default", "f"));
    }

    #[test]
    fn flip_along_a_padded_dim_reverses_the_real_prefix() {
        let g = graph(
            &[
                input("x", r#"["s0", 4]"#),
                call(
                    "f",
                    "aten.flip.default",
                    r#"[{"node": "x"}, [0, 1]]"#,
                    r#"["s0", 4]"#,
                ),
            ],
            "f",
        );
        let text = run(&g, 8).unwrap().graph.to_string();
        // x[s0-1-i] for i < s0 (an index_select by the real size), then a plain flip of dim 1.
        assert!(text.contains("aten.index_select.default"), "{text}");
        assert!(
            text.contains("aten.flip.default") && text.contains("[1]"),
            "{text}"
        );
    }

    #[test]
    fn softmax_over_a_padded_dim_masks_with_minus_infinity() {
        let g = graph(
            &[
                input("x", r#"[2, "s0"]"#),
                call(
                    "p",
                    "aten._softmax.default",
                    r#"[{"node": "x"}, -1, false]"#,
                    r#"[2, "s0"]"#,
                ),
            ],
            "p",
        );
        let b = run(&g, 8).unwrap();
        assert!(
            b.graph
                .to_string()
                .contains("aten.scalar_tensor.default(-inf"),
            "{}",
            b.graph
        );
    }
    #[test]
    fn a_loop_body_that_reduces_a_padded_dim_takes_the_real_size() {
        // map over xs[3, s0, 4]: each step sums its [s0, 4] slice over the padded rows.
        let g = import_json(
            r#"{"nodes": [
          {"name": "xs", "op": "placeholder", "val": {"tensor": {"shape": [3, "s0", 4], "dtype": "float32"}}},
          {"name": "body", "op": "get_attr", "target": "body"},
          {"name": "m", "op": "call_function", "target": "higher_order.map_impl", "args": [{"node": "body"}, [{"node": "xs"}], []], "val": {"tuple": [{"tensor": {"shape": [3, 4], "dtype": "float32"}}]}},
          {"name": "r", "op": "call_function", "target": "<built-in function getitem>", "args": [{"node": "m"}, 0], "val": {"tensor": {"shape": [3, 4], "dtype": "float32"}}},
          {"name": "output", "op": "output", "args": [[{"node": "r"}]]}],
         "subgraphs": {"body": {"nodes": [
          {"name": "x", "op": "placeholder", "val": {"tensor": {"shape": ["s0", 4], "dtype": "float32"}}},
          {"name": "s", "op": "call_function", "target": "aten.sum.dim_IntList", "args": [{"node": "x"}, [0]], "val": {"tensor": {"shape": [4], "dtype": "float32"}}},
          {"name": "output", "op": "output", "args": [[{"node": "s"}]]}]}}}"#,
        )
        .unwrap();
        let b = run(&g, 8).unwrap();
        let outer = b.graph.to_string();
        let body = b.graph.regions.last().unwrap().to_string();
        // The body masks its padded rows with the real size, an extra operand of the op.
        assert!(body.contains("aten.where.self"), "{body}");
        assert_eq!(b.graph.regions.last().unwrap().inputs.len(), 2, "{body}");
        assert!(outer.contains("[%tpuc_size0]"), "{outer}");
        assert_eq!(b.output_layouts, vec![vec![clean(3), clean(4)]]);
    }

    #[test]
    fn a_scan_over_a_padded_dim_stops_at_the_real_number_of_steps() {
        let g = import_json(
            r#"{"nodes": [
          {"name": "xs", "op": "placeholder", "val": {"tensor": {"shape": ["s0", 4], "dtype": "float32"}}},
          {"name": "body", "op": "get_attr", "target": "body"},
          {"name": "m", "op": "call_function", "target": "higher_order.map_impl", "args": [{"node": "body"}, [{"node": "xs"}], []], "val": {"tuple": [{"tensor": {"shape": ["s0", 4], "dtype": "float32"}}]}},
          {"name": "r", "op": "call_function", "target": "<built-in function getitem>", "args": [{"node": "m"}, 0], "val": {"tensor": {"shape": ["s0", 4], "dtype": "float32"}}},
          {"name": "output", "op": "output", "args": [[{"node": "r"}]]}],
         "subgraphs": {"body": {"nodes": [
          {"name": "x", "op": "placeholder", "val": {"tensor": {"shape": [4], "dtype": "float32"}}},
          {"name": "output", "op": "output", "args": [[{"node": "x"}]]}]}}}"#,
        )
        .unwrap();
        let b = run(&g, 8).unwrap();
        let text = b.graph.to_string();
        assert!(text.contains("tpuc_steps=%tpuc_size0"), "{text}");
        let padded = vec![Atom {
            size: 8,
            real: Some(SymExpr::parse("s0").unwrap()),
        }];
        assert_eq!(b.output_layouts, vec![vec![padded, clean(4)]]);
    }
}
