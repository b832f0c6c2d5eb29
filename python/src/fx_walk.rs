//! AOTAutograd's FX graph -> the frontend's wire structs (`tpuc_frontend_fx::wire`), read
//! straight from the Python objects: no JSON in between, and no Python per node.
//!
//! The only place that knows both torch.fx and the wire format. `get_attr` nodes (lifted
//! constants) become inputs after the placeholders, then the size-derived floats, then the
//! random seed when a random op draws from it.

use crate::errors::GraphImportError;
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple, PyType};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::c_void;
use std::sync::{LazyLock, Mutex};
use tpuc_frontend_fx::wire::{FxArg, FxGraph, FxMeta, FxNode};
use tpuc_frontend_fx::{DType, Dim, SourceLoc, SymExpr};

/// Ops drawing random numbers: each gets the graph's seed input and its own stream index.
const RANDOM_OPS: &[&str] = &[
    "aten.native_dropout.default",
    "aten.rand.default",
    "aten.rand_like.default",
    "aten.randn.default",
    "aten.randn_like.default",
    "aten.bernoulli.p",
];
/// What PyTorch's activation-checkpointing pass appends to the name of a node it copies into the
/// backward (`remat_using_tags_for_fwd_loss_bwd_graph_pass.py`); FX may append `_1` on a clash.
const RECOMPUTED_SUFFIX: &str = "_recomputed";
/// The seed input's name (a 2-element int64 tensor, the last input).
pub const SEED_INPUT: &str = "tpuc_rng_seed";

/// `str()` of each op target seen so far, by the target object (kept alive here, so its
/// address stays its own): formatting an `OpOverload` anew costs microseconds per node.
static TARGET_NAMES: LazyLock<Mutex<TargetNames>> = LazyLock::new(Mutex::default);

/// Target address -> (the target, its name).
type TargetNames = HashMap<usize, (Py<PyAny>, String)>;

/// What the walk produced: the graph, the `get_attr` targets in input order, whether a random
/// op takes the seed input, and the size-derived float nodes (inputs after the `get_attr`
/// ones, in this order).
pub struct Walked {
    pub graph: FxGraph,
    pub attr_targets: Vec<String>,
    pub uses_rng: bool,
    pub symfloats: Vec<Py<PyAny>>,
}

/// The torch classes a walk tells values apart by, looked up once per process.
struct Torch {
    node: Py<PyType>,
    tensor: Py<PyType>,
    symint: Py<PyType>,
    symfloat: Py<PyType>,
    dtype: Py<PyAny>,
    device: Py<PyAny>,
    layout: Py<PyAny>,
    memory_format: Py<PyAny>,
    getitem: Py<PyAny>,
    /// `torch.fx.GraphModule`: a `get_attr` of one names a control-flow op's branch or body.
    graph_module: Py<PyType>,
    /// `torch._ops.HigherOrderOperator`: the control-flow ops' class.
    higher_order: Py<PyType>,
    /// `meta["tensor_meta"]`'s class, where this torch has it and it is the named tuple whose
    /// first fields are `shape, dtype` (read by index).
    tensor_metadata: Option<Py<PyAny>>,
    /// `torch._C.DisableTorchFunctionSubclass`.
    disable_torch_function: Py<PyAny>,
    /// torch's package folder (with a trailing separator): frames in it are PyTorch's, not
    /// the user's, in a node's `stack_trace`.
    torch_dir: String,
    /// The Node fields the walk reads.
    op: NodeField,
    name: NodeField,
    target: NodeField,
    args: NodeField,
    kwargs: NodeField,
    meta: NodeField,
}

/// A field of FX's `Node`, read through its member descriptor where torch's C base class
/// stores it: `getattr` first searches the class hierarchy for the name (through the type
/// cache, which a cold or busy interpreter has lost), for every field of every node.
struct NodeField {
    name: Py<PyString>,
    /// The descriptor and its `__get__`, when `name` is a member descriptor of `Node`.
    member: Option<(Py<PyAny>, ffi::descrgetfunc)>,
}

impl NodeField {
    /// `fast`, or `slow` where this torch's `Node` has no member named `fast`.
    fn look_up(node: &Bound<'_, PyType>, fast: &str, slow: &str) -> PyResult<NodeField> {
        let py = node.py();
        let members = py.import("types")?.getattr("MemberDescriptorType")?;
        let descr = node
            .getattr(fast)
            .ok()
            .filter(|d| d.get_type().is(&members));
        let Some(descr) = descr else {
            return Ok(NodeField {
                name: PyString::intern(py, slow).unbind(),
                member: None,
            });
        };
        // SAFETY: a live type object; the slot of a member descriptor's type is its `__get__`.
        let get = unsafe {
            let slot = ffi::PyType_GetSlot(descr.get_type().as_type_ptr(), ffi::Py_tp_descr_get);
            (!slot.is_null()).then(|| std::mem::transmute::<*mut c_void, ffi::descrgetfunc>(slot))
        };
        Ok(NodeField {
            name: PyString::intern(py, fast).unbind(),
            member: get.map(|get| (descr.unbind(), get)),
        })
    }

    /// The field of `n` (a `Node` of exactly `node`'s class takes the descriptor).
    fn get<'py>(&self, n: &Bound<'py, PyAny>, node: &Py<PyType>) -> PyResult<Bound<'py, PyAny>> {
        let py = n.py();
        match &self.member {
            Some((descr, get)) if n.get_type().is(node.bind(py)) => {
                // SAFETY: live objects; `get` returns a new reference, or null with an error set.
                unsafe {
                    let value = get(descr.as_ptr(), n.as_ptr(), node.as_ptr());
                    Bound::from_owned_ptr_or_err(py, value)
                }
            }
            _ => n.getattr(self.name.bind(py)),
        }
    }
}

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

impl Torch {
    fn look_up(py: Python<'_>) -> PyResult<Torch> {
        let torch = py.import("torch")?;
        let class = |name: &str| -> PyResult<Py<PyType>> {
            Ok(torch.getattr(name)?.cast_into::<PyType>()?.unbind())
        };
        let node = py
            .import("torch.fx")?
            .getattr("Node")?
            .cast_into::<PyType>()?;
        Ok(Torch {
            op: NodeField::look_up(&node, "op", "op")?,
            name: NodeField::look_up(&node, "name", "name")?,
            target: NodeField::look_up(&node, "target", "target")?,
            // `_args`/`_kwargs` are what the `args`/`kwargs` properties return, without a
            // Python call each.
            args: NodeField::look_up(&node, "_args", "args")?,
            kwargs: NodeField::look_up(&node, "_kwargs", "kwargs")?,
            meta: NodeField::look_up(&node, "meta", "meta")?,
            node: node.unbind(),
            tensor: class("Tensor")?,
            symint: class("SymInt")?,
            symfloat: class("SymFloat")?,
            dtype: torch.getattr("dtype")?.unbind(),
            device: torch.getattr("device")?.unbind(),
            layout: torch.getattr("layout")?.unbind(),
            memory_format: torch.getattr("memory_format")?.unbind(),
            getitem: py.import("operator")?.getattr("getitem")?.unbind(),
            graph_module: py
                .import("torch.fx")?
                .getattr("GraphModule")?
                .cast_into::<PyType>()?
                .unbind(),
            higher_order: py
                .import("torch._ops")?
                .getattr("HigherOrderOperator")?
                .cast_into::<PyType>()?
                .unbind(),
            tensor_metadata: py
                .import("torch.fx.passes.shape_prop")
                .and_then(|m| m.getattr("TensorMetadata"))
                .ok()
                .filter(|class| {
                    class
                        .getattr("_fields")
                        .and_then(|f| f.extract::<Vec<String>>())
                        .is_ok_and(|f| f.len() >= 2 && f[0] == "shape" && f[1] == "dtype")
                })
                .map(Bound::unbind),
            disable_torch_function: torch
                .getattr("_C")?
                .getattr("DisableTorchFunctionSubclass")?
                .unbind(),
            torch_dir: {
                let file: String = torch.getattr("__file__")?.extract()?;
                let path = std::path::Path::new(&file);
                path.parent()
                    .map(|d| format!("{}{}", d.display(), std::path::MAIN_SEPARATOR))
                    .unwrap_or_default()
            },
        })
    }
}

struct Walker<'py> {
    py: Python<'py>,
    torch: &'static Torch,
    /// dtype object address -> wire dtype (dtypes are interned torch objects).
    dtypes: HashMap<usize, DType>,
    /// Size-derived float nodes (by address): skipped as ops, passed as inputs.
    symfloats: HashSet<usize>,
    /// Source locations by the address of the `stack_trace` string they were read from (the
    /// nodes of one line share the string; the graph keeps them alive during the walk).
    locs: HashMap<usize, Option<SourceLoc>>,
}

fn import_err(msg: String) -> PyErr {
    GraphImportError::new_err(msg)
}

/// Walks `gm`'s nodes into the wire graph, finding its size-derived float nodes on the way
/// (call_function nodes whose value is a symbolic `SymFloat`).
pub fn walk<'py>(gm: &Bound<'py, PyAny>) -> PyResult<Walked> {
    let py = gm.py();
    let torch = TORCH.get_or_try_init(py, || Torch::look_up(py))?;
    // Reading a FakeTensor's shape or dtype asks torch whether its class overrides
    // `__torch_function__` (an attribute lookup by a freshly made string) unless that is off:
    // more than half of the read, for values whose metadata is all the walk wants.
    let _plain = TorchFunctionOff::enter(torch.disable_torch_function.bind(py))?;
    let mut symfloats: Vec<Bound<'py, PyAny>> = Vec::new();
    let mut w = Walker {
        py,
        torch,
        dtypes: HashMap::new(),
        symfloats: HashSet::new(),
        locs: HashMap::new(),
    };
    let (mut inputs, mut attrs, mut ops) = (Vec::new(), Vec::new(), Vec::new());
    let mut attr_targets = Vec::new();
    let mut subgraphs = BTreeMap::new();
    let mut streams = 0i64;
    let graph = gm.getattr(intern!(py, "graph"))?;
    for n in graph.getattr(intern!(py, "nodes"))?.try_iter()? {
        let n = n?;
        let op_obj = w.field(&w.torch.op, &n)?;
        let op = op_obj.cast::<PyString>()?.to_str()?;
        let name: String = w.field(&w.torch.name, &n)?.extract()?;
        match op {
            "placeholder" => {
                let val = w.node_val(&n)?.into_meta();
                inputs.push(placeholder(name.clone(), name, val));
            }
            "get_attr" => {
                let target: String = w.field(&w.torch.target, &n)?.extract()?;
                let val = gm.getattr(target.as_str())?;
                if is_a(&val, w.torch.graph_module.bind(py)) {
                    subgraphs.insert(name.clone(), walk_region(&val, &name)?);
                    ops.push(FxNode {
                        name,
                        op: op.to_string(),
                        target,
                        args: Vec::new(),
                        kwargs: BTreeMap::new(),
                        val: None,
                        loc: None,
                        recomputed: false,
                    });
                    continue;
                }
                if !is_a(&val, w.torch.tensor.bind(py)) {
                    return Err(import_err(format!(
                        "node `{name}`: get_attr of a {}",
                        val.get_type().name()?
                    )));
                }
                let meta = w.meta(&val, &n)?;
                attrs.push(placeholder(name, target.clone(), meta));
                attr_targets.push(target);
            }
            "call_function" | "output" => {
                let val = match w.node_val(&n)? {
                    NodeVal::SizeFloat if op == "call_function" => {
                        w.symfloats.insert(n.as_ptr() as usize);
                        symfloats.push(n);
                        continue;
                    }
                    v => v.into_meta(),
                };
                let node_args = w.field(&w.torch.args, &n)?;
                let node_args = node_args.cast::<PyTuple>()?;
                let mut args = node_args
                    .iter()
                    .map(|a| w.arg(&a, &n))
                    .collect::<PyResult<Vec<_>>>()?;
                let kwargs_obj = w.field(&w.torch.kwargs, &n)?;
                let kwargs_dict = kwargs_obj.cast::<PyDict>()?;
                let mut kwargs = BTreeMap::new();
                for (k, v) in kwargs_dict.iter() {
                    kwargs.insert(k.extract::<String>()?, w.arg(&v, &n)?);
                }
                let target = w.target(&n, node_args)?;
                if op == "call_function" && RANDOM_OPS.contains(&target.as_str()) {
                    // Positional args padded to the schema's length, then the seed and the stream.
                    let schema = n
                        .getattr(intern!(py, "target"))?
                        .getattr(intern!(py, "_schema"))?
                        .getattr(intern!(py, "arguments"))?;
                    let schema = schema.cast::<PyList>()?;
                    for a in schema.iter().skip(args.len()) {
                        let arg_name = a.getattr(intern!(py, "name"))?;
                        args.push(match kwargs_dict.get_item(&arg_name)? {
                            Some(v) => w.arg(&v, &n)?,
                            None => FxArg::Null,
                        });
                    }
                    args.truncate(schema.len());
                    args.push(FxArg::Node {
                        node: SEED_INPUT.into(),
                    });
                    args.push(FxArg::Int(streams));
                    streams += 1;
                }
                let (loc, recomputed) = if op == "call_function" {
                    (w.loc(&n)?, w.recomputed(&n, &name)?)
                } else {
                    (None, false)
                };
                ops.push(FxNode {
                    name,
                    op: op.to_string(),
                    target,
                    args,
                    kwargs,
                    val,
                    loc,
                    recomputed,
                });
            }
            other => {
                let target = n.getattr(intern!(py, "target"))?.str()?;
                return Err(import_err(format!(
                    "node `{name}`: {other} `{target}` (tpuc imports functional ATen graphs \
                     from AOTAutograd)"
                )));
            }
        }
    }
    // Size-derived floats are computed by the runtime from the real sizes, then the seed.
    let mut extra = Vec::new();
    for n in &symfloats {
        extra.push(scalar_input(
            n.getattr(intern!(py, "name"))?.extract()?,
            &[],
            DType::Float64,
        ));
    }
    if streams > 0 {
        extra.push(scalar_input(SEED_INPUT.into(), &[2], DType::Int64));
    }
    let nodes = inputs
        .into_iter()
        .chain(attrs)
        .chain(extra)
        .chain(ops)
        .collect();
    Ok(Walked {
        graph: FxGraph { nodes, subgraphs },
        attr_targets,
        uses_rng: streams > 0,
        symfloats: symfloats.into_iter().map(Bound::unbind).collect(),
    })
}

/// The wire graph of a control-flow op's branch or body (`name`: its `get_attr` node). Such a
/// graph is closed (PyTorch passes everything it reads as its inputs), so what the walk would
/// add as extra inputs (lifted constants, size-derived floats, the random seed) has no place
/// in it: each is an error naming the graph.
fn walk_region(gm: &Bound<'_, PyAny>, name: &str) -> PyResult<FxGraph> {
    let walked = walk(gm)?;
    let extra = if !walked.attr_targets.is_empty() {
        Some("a lifted constant")
    } else if walked.uses_rng {
        Some("a random op")
    } else if !walked.symfloats.is_empty() {
        Some("a float computed from sizes")
    } else {
        None
    };
    if let Some(what) = extra {
        return Err(import_err(format!(
            "node `{name}`: the control-flow graph it names reads {what}, which tpuc cannot \
             pass into a loop or branch yet"
        )));
    }
    Ok(walked.graph)
}

/// An input node of the wire graph.
fn placeholder(name: String, target: String, val: Option<FxMeta>) -> FxNode {
    FxNode {
        name,
        op: "placeholder".into(),
        target,
        args: Vec::new(),
        kwargs: BTreeMap::new(),
        val,
        loc: None,
        recomputed: false,
    }
}

/// An input the runtime computes (a size-derived float, the seed), named after itself.
fn scalar_input(name: String, shape: &[i64], dtype: DType) -> FxNode {
    let val = FxMeta::Tensor {
        shape: shape.iter().map(|&d| Dim::Static(d)).collect(),
        dtype,
    };
    placeholder(name.clone(), name, Some(val))
}

/// What a node's `meta` records.
enum NodeVal {
    /// The wire form of its value (None: nothing the frontend uses).
    Meta(Option<FxMeta>),
    /// A float computed from sizes (a `SymFloat` that is not a number): an input of the graph.
    SizeFloat,
}

impl NodeVal {
    fn into_meta(self) -> Option<FxMeta> {
        match self {
            NodeVal::Meta(m) => m,
            NodeVal::SizeFloat => None,
        }
    }
}

/// A size as the wire format wants it: an int, or the ShapeEnv expression.
enum Size {
    Int(i64),
    Expr(String),
}

impl<'py> Walker<'py> {
    fn field(&self, f: &NodeField, n: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        f.get(n, &self.torch.node)
    }

    /// Whether `n` recomputes a checkpointed forward value for the backward. PyTorch's
    /// activation-checkpointing pass for graphs with the backward traced in
    /// (`remat_using_tags_for_fwd_loss_bwd_graph`) copies each such forward node before its
    /// first backward use, named `<name>_recomputed`, with the forward's `recompute` policy
    /// (`MUST_`/`PREFER_RECOMPUTE`) and `autograd_backward` set. Either mark suffices: the name
    /// survives where the meta does not (a graph pickled into AOTAutograd's cache), and no
    /// other node of an AOTAutograd graph is named so (names come from ops and inputs).
    fn recomputed(&self, n: &Bound<'py, PyAny>, name: &str) -> PyResult<bool> {
        if name.contains(RECOMPUTED_SUFFIX) {
            return Ok(true);
        }
        let meta = self.field(&self.torch.meta, n)?;
        let meta = meta.cast::<PyDict>()?;
        let backward = meta
            .get_item(intern!(self.py, "autograd_backward"))?
            .is_some_and(|b| b.is_truthy().unwrap_or(false));
        if !backward {
            return Ok(false);
        }
        let Some(policy) = meta.get_item(intern!(self.py, "recompute"))? else {
            return Ok(false);
        };
        // A `CheckpointPolicy` member, read by name (`MUST_RECOMPUTE`, `PREFER_RECOMPUTE`).
        Ok(policy
            .getattr(intern!(self.py, "name"))
            .and_then(|p| p.extract::<String>())
            .is_ok_and(|p| p.ends_with("_RECOMPUTE")))
    }

    /// The user's source location of a node, from its `meta["stack_trace"]` (None without one).
    fn loc(&mut self, n: &Bound<'py, PyAny>) -> PyResult<Option<SourceLoc>> {
        let meta = self.field(&self.torch.meta, n)?;
        let meta = meta.cast::<PyDict>()?;
        let Some(trace) = meta.get_item(intern!(self.py, "stack_trace"))? else {
            return Ok(None);
        };
        let Ok(text) = trace.cast::<PyString>() else {
            return Ok(None);
        };
        let key = text.as_ptr() as usize;
        if let Some(loc) = self.locs.get(&key) {
            return Ok(loc.clone());
        }
        let loc = SourceLoc::from_stack_trace(text.to_str()?, &[self.torch.torch_dir.as_str()]);
        self.locs.insert(key, loc.clone());
        Ok(loc)
    }

    /// The wire form of the node's `meta["val"]`. A tensor's shape and dtype are read from
    /// `meta["tensor_meta"]` where recorded next to it (as traced): that skips a FakeTensor's
    /// dispatch and a new `torch.Size` per node.
    fn node_val(&mut self, n: &Bound<'py, PyAny>) -> PyResult<NodeVal> {
        let meta = self.field(&self.torch.meta, n)?;
        let meta = meta.cast::<PyDict>()?;
        if let Some(class) = &self.torch.tensor_metadata {
            let class = class.bind(self.py);
            if let Some(recorded) = meta.get_item(intern!(self.py, "tensor_meta"))? {
                if recorded.get_type().is(class) {
                    let fields = recorded.cast::<PyTuple>()?;
                    let (shape, dtype) = (fields.get_item(0)?, fields.get_item(1)?);
                    return Ok(NodeVal::Meta(Some(self.tensor_meta(&shape, &dtype, n)?)));
                }
            }
        }
        let Some(val) = meta.get_item(intern!(self.py, "val"))? else {
            return Ok(NodeVal::Meta(None));
        };
        if is_a(&val, self.torch.symfloat.bind(self.py)) && !self.sym_node_expr(&val)?.1 {
            return Ok(NodeVal::SizeFloat);
        }
        Ok(NodeVal::Meta(self.meta(&val, n)?))
    }

    /// A tensor's wire form from its shape (a tuple of sizes) and dtype.
    fn tensor_meta(
        &mut self,
        shape: &Bound<'py, PyAny>,
        dtype: &Bound<'py, PyAny>,
        n: &Bound<'py, PyAny>,
    ) -> PyResult<FxMeta> {
        let shape = shape.cast::<PyTuple>()?;
        let mut dims = Vec::with_capacity(shape.len());
        for d in shape.iter() {
            dims.push(match self.sym(&d)? {
                Size::Int(i) => Dim::Static(i),
                Size::Expr(e) => Dim::Sym(self.sym_expr(&e, n)?),
            });
        }
        let dtype = self.dtype(dtype, n)?;
        Ok(FxMeta::Tensor { shape: dims, dtype })
    }

    /// A `SymInt`/`SymFloat`'s ShapeEnv expression and whether it is a number (a size the
    /// trace fixed).
    fn sym_node_expr(&self, value: &Bound<'py, PyAny>) -> PyResult<(Bound<'py, PyAny>, bool)> {
        let expr = value
            .getattr(intern!(self.py, "node"))?
            .getattr(intern!(self.py, "expr"))?;
        let number = match expr.getattr(intern!(self.py, "is_number")) {
            Ok(b) => b.is_truthy()?,
            Err(_) => false,
        };
        Ok((expr, number))
    }

    fn sym(&self, value: &Bound<'py, PyAny>) -> PyResult<Size> {
        if value.is_exact_instance_of::<PyInt>() {
            return Ok(Size::Int(value.extract()?));
        }
        let (expr, is_number) = self.sym_node_expr(value)?;
        Ok(if is_number {
            Size::Int(expr.call_method0(intern!(self.py, "__int__"))?.extract()?)
        } else {
            Size::Expr(expr.str()?.to_string())
        })
    }

    fn sym_expr(&self, text: &str, n: &Bound<'py, PyAny>) -> PyResult<SymExpr> {
        SymExpr::parse(text).map_err(|e| import_err(format!("node `{}`: {e}", node_name(n))))
    }

    fn dtype(&mut self, dtype: &Bound<'py, PyAny>, n: &Bound<'py, PyAny>) -> PyResult<DType> {
        let key = dtype.as_ptr() as usize;
        if let Some(d) = self.dtypes.get(&key) {
            return Ok(*d);
        }
        let text = dtype.str()?;
        let text = text.to_str()?;
        let name = text.strip_prefix("torch.").unwrap_or(text);
        let d = DType::from_name(name).ok_or_else(|| {
            import_err(format!(
                "node `{}`: dtype {name} has no tpuc equivalent",
                node_name(n)
            ))
        })?;
        self.dtypes.insert(key, d);
        Ok(d)
    }

    /// The wire form of a node's `meta["val"]` (or a lifted constant): `None` for values the
    /// frontend has no use for.
    fn meta(&mut self, val: &Bound<'py, PyAny>, n: &Bound<'py, PyAny>) -> PyResult<Option<FxMeta>> {
        let py = self.py;
        if val.is_none() {
            return Ok(None);
        }
        if is_a(val, self.torch.tensor.bind(self.py)) {
            let shape = val.getattr(intern!(py, "shape"))?;
            let dtype = val.getattr(intern!(py, "dtype"))?;
            return self.tensor_meta(&shape, &dtype, n).map(Some);
        }
        if is_a(val, self.torch.symint.bind(self.py)) {
            return Ok(Some(match self.sym(val)? {
                Size::Int(i) => FxMeta::Int(i),
                Size::Expr(e) => FxMeta::Symint(self.sym_expr(&e, n)?),
            }));
        }
        if val.is_instance_of::<PyBool>() {
            return Ok(Some(FxMeta::Bool(val.extract()?)));
        }
        if val.is_instance_of::<PyInt>() {
            return Ok(Some(FxMeta::Int(val.extract()?)));
        }
        if val.is_instance_of::<PyFloat>() {
            return Ok(Some(FxMeta::Float(val.extract()?)));
        }
        if is_a(val, self.torch.symfloat.bind(self.py)) {
            let (expr, number) = self.sym_node_expr(val)?;
            return Ok(if number {
                Some(FxMeta::Float(
                    expr.call_method0(intern!(py, "__float__"))?.extract()?,
                ))
            } else {
                None
            });
        }
        if val.is_instance_of::<PyList>() || val.is_instance_of::<PyTuple>() {
            let items = val
                .try_iter()?
                .map(|v| self.meta(&v?, n))
                .collect::<PyResult<Vec<_>>>()?;
            return Ok(Some(FxMeta::Tuple(items)));
        }
        Ok(None)
    }

    fn arg(&mut self, a: &Bound<'py, PyAny>, n: &Bound<'py, PyAny>) -> PyResult<FxArg> {
        let py = self.py;
        // The common literals first, by exact type (subclasses take the checks below).
        if a.is_none() {
            return Ok(FxArg::Null);
        }
        if a.is_exact_instance_of::<PyInt>() {
            return Ok(match a.extract::<i64>() {
                Ok(i) => FxArg::Int(i),
                Err(_) => FxArg::Float(a.extract::<f64>()?),
            });
        }
        if is_a(a, self.torch.node.bind(self.py)) {
            return Ok(FxArg::Node {
                node: self.field(&self.torch.name, a)?.extract()?,
            });
        }
        if a.is_instance_of::<PyBool>() {
            return Ok(FxArg::Bool(a.extract()?));
        }
        if let Ok(s) = a.cast::<PyString>() {
            return Ok(FxArg::Str(s.to_str()?.to_string()));
        }
        if a.is_instance_of::<PyInt>() {
            return Ok(FxArg::Int(a.extract()?));
        }
        if a.is_instance_of::<PyFloat>() {
            let f: f64 = a.extract()?;
            return Ok(if f.is_finite() {
                FxArg::Float(f)
            } else {
                FxArg::SpecialFloat {
                    float: if f.is_nan() {
                        "nan"
                    } else if f > 0.0 {
                        "inf"
                    } else {
                        "-inf"
                    }
                    .into(),
                }
            });
        }
        if a.is_instance_of::<PyList>() || a.is_instance_of::<PyTuple>() {
            return a
                .try_iter()?
                .map(|x| self.arg(&x?, n))
                .collect::<PyResult<Vec<_>>>()
                .map(FxArg::List);
        }
        if a.is_instance(self.torch.dtype.bind(self.py))? {
            return Ok(FxArg::DType {
                dtype: self.dtype(a, n)?,
            });
        }
        if a.is_instance(self.torch.device.bind(self.py))? {
            return Ok(FxArg::Device {
                device: a.str()?.to_string(),
            });
        }
        if a.is_instance(self.torch.layout.bind(self.py))?
            || a.is_instance(self.torch.memory_format.bind(self.py))?
        {
            return Ok(FxArg::Other {
                other: a.str()?.to_string(),
            });
        }
        if is_a(a, self.torch.symint.bind(self.py)) {
            if let Size::Int(i) = self.sym(a)? {
                return Ok(FxArg::Int(i));
            }
        }
        let op = n.getattr(intern!(py, "target"))?.str()?;
        Err(import_err(format!(
            "node `{}` (op `{op}`): argument {} of type {} cannot be passed to tpuc",
            node_name(n),
            a.repr()?,
            a.get_type().name()?
        )))
    }

    /// The op's name. A `Scalar` overload fed a size-derived float (which becomes a 0-d tensor
    /// input) is swapped for the op's `Tensor` overload.
    fn target(&self, n: &Bound<'py, PyAny>, args: &Bound<'py, PyTuple>) -> PyResult<String> {
        let py = self.py;
        let mut target = self.field(&self.torch.target, n)?;
        if !self.symfloats.is_empty()
            && args
                .iter()
                .any(|a| self.symfloats.contains(&(a.as_ptr() as usize)))
            && target
                .getattr(intern!(py, "_overloadname"))
                .is_ok_and(|o| o.eq("Scalar").unwrap_or(false))
        {
            let packet = target.getattr(intern!(py, "overloadpacket"))?;
            if let Ok(tensor) = packet.getattr(intern!(py, "Tensor")) {
                target = tensor;
            }
        }
        self.target_name(&target)
    }

    fn target_name(&self, target: &Bound<'py, PyAny>) -> PyResult<String> {
        let key = target.as_ptr() as usize;
        let names = || TARGET_NAMES.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, name)) = names().get(&key) {
            return Ok(name.clone());
        }
        // Formatted with the lock released: `str()` runs Python, which may switch threads.
        let name = if target.is(self.torch.getitem.bind(self.py)) {
            "<built-in function getitem>".to_string()
        } else if is_a(target, self.torch.higher_order.bind(self.py)) {
            format!("{}{}", tpuc_frontend_fx::HIGHER_ORDER, target.str()?)
        } else {
            target.str()?.to_string()
        };
        names().insert(key, (target.clone().unbind(), name.clone()));
        Ok(name)
    }
}

/// `torch._C.DisableTorchFunctionSubclass()` entered until dropped.
struct TorchFunctionOff<'py>(Bound<'py, PyAny>);

impl<'py> TorchFunctionOff<'py> {
    fn enter(class: &Bound<'py, PyAny>) -> PyResult<Self> {
        let guard = class.call0()?;
        guard.call_method0("__enter__")?;
        Ok(TorchFunctionOff(guard))
    }
}

impl Drop for TorchFunctionOff<'_> {
    fn drop(&mut self) {
        let none = self.0.py().None();
        if let Err(e) = self.0.call_method1("__exit__", (&none, &none, &none)) {
            e.write_unraisable(self.0.py(), Some(&self.0));
        }
    }
}

/// `isinstance(v, class)` for a class without a custom `__instancecheck__` (torch's tensor,
/// FX's node, the symbolic scalars): a walk up `v`'s type's MRO, no attribute lookups.
fn is_a(v: &Bound<'_, PyAny>, class: &Bound<'_, PyType>) -> bool {
    // SAFETY: both are live type objects.
    unsafe { pyo3::ffi::PyType_IsSubtype(v.get_type().as_type_ptr(), class.as_type_ptr()) != 0 }
}

fn node_name(n: &Bound<'_, PyAny>) -> String {
    n.getattr("name")
        .and_then(|s| s.extract::<String>())
        .unwrap_or_else(|_| "?".into())
}
