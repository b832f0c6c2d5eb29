//! The emitter: typed helpers that append StableHLO ops to the function body being built.
//!
//! Ops are built generically (`OperationBuilder::new("stablehlo.add")`) with explicit result
//! types: StableHLO is not registered in our MLIR context, so nothing would infer them.

pub mod own_math;

use super::{Device, LowerError};
use melior::ir::attribute::{Attribute, AttributeLike, DenseI64ArrayAttribute};
use melior::ir::block::BlockLike;
use melior::ir::operation::{OperationBuilder, OperationRef};
use melior::ir::r#type::{IntegerType, RankedTensorType};
use melior::ir::{Block, Identifier, Location, Region, RegionLike, Type, Value, ValueLike};
use melior::Context;
use rustc_hash::FxHashMap as HashMap;
use smallvec::SmallVec;
use std::fmt::Write;
use tpuc_frontend_fx::DType;

/// A tensor value being built, with its static type.
#[derive(Clone, Debug)]
pub struct T<'c, 'b> {
    pub v: Value<'c, 'b>,
    pub shape: Vec<i64>,
    pub dtype: DType,
}

impl T<'_, '_> {
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }
}

/// A Python scalar argument (`alpha=2`, `mul.Scalar(x, 0.5)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    Float(f64),
    Int(i64),
    Bool(bool),
}

impl Scalar {
    /// The variant and its bits: equal keys, equal scalars (NaNs included).
    fn key(self) -> (u8, u64) {
        match self {
            Scalar::Float(x) => (0, x.to_bits()),
            Scalar::Int(i) => (1, i as u64),
            Scalar::Bool(b) => (2, b as u64),
        }
    }

    pub fn as_f64(self) -> f64 {
        match self {
            Scalar::Float(x) => x,
            Scalar::Int(i) => i as f64,
            Scalar::Bool(b) => b as i64 as f64,
        }
    }
}

/// Matmul / convolution precision (`precision_config`), from `torch.get_float32_matmul_precision()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    #[default]
    Highest,
    High,
    Default,
}

impl Precision {
    pub fn parse(s: &str) -> Option<Precision> {
        Some(match s {
            "highest" => Precision::Highest,
            "high" => Precision::High,
            "default" | "medium" => Precision::Default,
            _ => return None,
        })
    }
    pub fn mlir(self) -> &'static str {
        match self {
            Precision::Highest => "HIGHEST",
            Precision::High => "HIGH",
            Precision::Default => "DEFAULT",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceKind {
    Sum,
    Max,
    Min,
    Prod,
    And,
    Or,
}

pub struct Emitter<'c, 'b> {
    pub ctx: &'c Context,
    block: &'b Block<'c>,
    /// The location new ops get: the node being lowered (see [`Emitter::set_loc`]).
    loc: std::cell::Cell<Location<'c>>,
    pub precision: Precision,
    /// MLIR's diagnostics (captured instead of printed), reported with the error they explain.
    diagnostics: Diagnostics,
    /// Attributes built so far in this context, by their text (see [`AttrCache`]).
    parsed: AttrCache,
    /// Constants already in this block, by their value text: one op per distinct value (zeros
    /// for ReLU, empty statistics), each defined before every later op of the block.
    constants: std::cell::RefCell<HashMap<String, T<'c, 'b>>>,
    /// The splats among them, by value, dtype and shape.
    splats: std::cell::RefCell<HashMap<SplatKey, T<'c, 'b>>>,
    /// Broadcasts already in this block, by (operand, shape, dims): the same constant or
    /// per-channel vector is broadcast to one activation shape again and again.
    broadcasts: std::cell::RefCell<HashMap<BroadcastKey, T<'c, 'b>>>,
    /// Values emitted as a transpose of a value in another physical layout (channels-last
    /// convolutions), by the address of the transpose's result: `(physical value, permutation)`,
    /// the logical value being `transpose(physical, permutation)`. See [`Emitter::layout_transpose`].
    layouts: std::cell::RefCell<HashMap<usize, Layout<'c, 'b>>>,
    /// Splats by the address of their value: `(value, dtype)`.
    splat_of: std::cell::RefCell<HashMap<usize, (Scalar, DType)>>,
    /// Broadcasts by the address of their result: `(operand, broadcast_dimensions)`.
    broadcast_of: std::cell::RefCell<HashMap<usize, (T<'c, 'b>, Vec<i64>)>>,
    /// Physical forms made by [`Emitter::materialize_physical`], by address.
    materialized: std::cell::RefCell<rustc_hash::FxHashSet<usize>>,
    /// f32 products of at least this many multiply-adds go to the host BLAS (see
    /// [`LowerOptions::host_gemm_min_macs`](crate::lower::LowerOptions)).
    pub host_gemm_min_macs: Option<u64>,
    /// 2-D f32 convolutions go to oneDNN (see
    /// [`LowerOptions::host_conv`](crate::lower::LowerOptions)).
    pub host_conv: bool,
    /// Large f32 layer norms go to the host row kernels (see
    /// [`LowerOptions::host_rows`](crate::lower::LowerOptions)).
    pub host_rows: bool,
    /// The fused CPU attention goes to the host kernel (see
    /// [`LowerOptions::host_attention`](crate::lower::LowerOptions::host_attention)).
    pub host_attention: bool,
    /// What the module is for (see [`Device`]): rules whose best form differs between XLA's
    /// CPU compiler and the accelerators' choose by it ([`Emitter::accelerator`]).
    pub device: Device,
    /// ATen ops whose math primitives are lowered to tpuc's own expansions (see
    /// [`LowerOptions::own_math`](crate::lower::LowerOptions)).
    pub own_math_ops: std::sync::Arc<std::collections::BTreeSet<String>>,
    /// Set while such an op is lowered: [`Emitter::op`] then expands the primitives itself.
    pub own_math: std::cell::Cell<bool>,
    /// Per value (by address) made by elementwise ops, reshapes and transposes only: how many
    /// reshapes and transposes lie on its longest path back to a value XLA must materialize
    /// (see [`RESHAPE_CHAIN_LIMIT`]).
    reshape_depth: std::cell::RefCell<HashMap<usize, u32>>,
    /// Values cut there: address -> the barrier's result.
    cut: std::cell::RefCell<HashMap<usize, T<'c, 'b>>>,
}

/// The most reshapes and transposes an elementwise op's operand may have behind it within what
/// XLA would fuse; deeper operands are materialized first ([`Emitter::barrier`]). XLA's CPU
/// fusion duplicates elementwise chains into every consumer, and its tiled emitter's indexing
/// analysis grows explosively with each reshape between different factorizations of a shape:
/// Swin-V2's residual stream (adds between `[B, H, W, C]` and `[B, H*W, C]` views, with the layer
/// norms in the host kernel) took the code generation of one fusion past 20 minutes.
const RESHAPE_CHAIN_LIMIT: u32 = 3;

/// Transposes of this rank or more are emitted with runs of adjacent dims merged (see
/// [`Emitter::transpose`]); lower ranks as written, which XLA handles well.
const MERGE_TRANSPOSE_MIN_RANK: usize = 5;

/// Ops that XLA fuses like elementwise ones but that read their operand at other indices: each
/// adds one to a value's reshape depth (see [`RESHAPE_CHAIN_LIMIT`]).
const REINDEXING: &[&str] = &[
    "stablehlo.reshape",
    "stablehlo.transpose",
    "stablehlo.broadcast_in_dim",
    "stablehlo.slice",
    "stablehlo.dynamic_slice",
    "stablehlo.concatenate",
    "stablehlo.pad",
    "stablehlo.reverse",
    "stablehlo.gather",
];

/// A value's physical form: the logical value is `transpose(physical, permutation)` (logical dim
/// `i` is physical dim `permutation[i]`).
pub type Layout<'c, 'b> = (T<'c, 'b>, Vec<i64>);

/// NCHW from NHWC: the permutation of a channels-last value's [`Emitter::layout_transpose`]
/// (convolutions, and graph inputs that arrive channels-last).
pub const NCHW_OF_NHWC: [i64; 4] = [0, 3, 1, 2];

/// `logical` (one entry per dim of a layout transpose's logical value) in the order of its
/// physical form: logical dim `i` is physical dim `perm[i]`.
pub fn to_physical<X: Copy>(logical: &[X], perm: &[i64]) -> Vec<X> {
    let mut out = logical.to_vec();
    for (i, &p) in perm.iter().enumerate() {
        out[p as usize] = logical[i];
    }
    out
}

/// `(shape, perm)` of the transpose `perm` of `shape` with each run of input dims that stays
/// adjacent and in order in the output merged into one dim (size-1 dims dropped); None when
/// nothing merges.
fn merged_transpose(shape: &[i64], perm: &[i64]) -> Option<(Vec<i64>, Vec<i64>)> {
    // Output positions of the input dims that are not 1, in output order.
    let kept: Vec<usize> = perm
        .iter()
        .map(|&p| p as usize)
        .filter(|&p| shape[p] != 1)
        .collect();
    // Runs: consecutive output entries whose input dims are consecutive (ignoring size-1 dims).
    let mut runs: Vec<Vec<usize>> = Vec::new();
    for &d in &kept {
        let next_input = |last: usize| (last + 1..shape.len()).find(|&k| shape[k] != 1);
        match runs.last_mut() {
            Some(run) if next_input(*run.last().expect("runs are not empty")) == Some(d) => {
                run.push(d)
            }
            _ => runs.push(vec![d]),
        }
    }
    if runs.len() == perm.len() || runs.is_empty() {
        return None;
    }
    // The merged input: runs in input order; the merged perm: their output order.
    let mut by_input: Vec<usize> = (0..runs.len()).collect();
    by_input.sort_by_key(|&r| runs[r][0]);
    let merged: Vec<i64> = by_input
        .iter()
        .map(|&r| runs[r].iter().map(|&d| shape[d]).product())
        .collect();
    let mut merged_perm = vec![0i64; runs.len()];
    for (position, &r) in by_input.iter().enumerate() {
        merged_perm[r] = position as i64;
    }
    Some((merged, merged_perm))
}

/// The address of a value, the key of the emitter's side tables.
fn addr(t: &T) -> usize {
    t.v.to_raw().ptr as usize
}

/// Elementwise ops a layout transpose sinks through (see [`Emitter::layout_transpose`]): their
/// operands have the result's shape (or are 0-d, `clamp`'s bounds), their attributes name no
/// dims, and each result element depends only on the operands' elements at its own index.
const ELEMENTWISE: &[&str] = &[
    "stablehlo.abs",
    "stablehlo.add",
    "stablehlo.and",
    "stablehlo.atan2",
    "stablehlo.cbrt",
    "stablehlo.ceil",
    "stablehlo.clamp",
    "stablehlo.compare",
    "stablehlo.convert",
    "stablehlo.cosine",
    "stablehlo.divide",
    "stablehlo.exponential",
    "stablehlo.exponential_minus_one",
    "stablehlo.floor",
    "stablehlo.is_finite",
    "stablehlo.log",
    "stablehlo.log_plus_one",
    "stablehlo.logistic",
    "stablehlo.maximum",
    "stablehlo.minimum",
    "stablehlo.multiply",
    "stablehlo.negate",
    "stablehlo.not",
    "stablehlo.or",
    "stablehlo.power",
    "stablehlo.remainder",
    "stablehlo.round_nearest_afz",
    "stablehlo.round_nearest_even",
    "stablehlo.rsqrt",
    "stablehlo.select",
    "stablehlo.sign",
    "stablehlo.sine",
    "stablehlo.sqrt",
    "stablehlo.subtract",
    "stablehlo.tan",
    "stablehlo.tanh",
    "stablehlo.xor",
];

/// Attributes built in one MLIR context, by their text: modules repeat the same few (dimension
/// lists, comparison directions, constants), and parsing is most of what building an op costs.
/// Raw handles: they live as long as the context (uniqued there), which owns the cache.
pub type AttrCache = std::rc::Rc<std::cell::RefCell<HashMap<String, mlir_sys::MlirAttribute>>>;

/// A splat's value (see [`Scalar::key`]), dtype and shape.
type SplatKey = ((u8, u64), DType, SmallVec<[i64; 4]>);

/// A broadcast's operand (its MLIR value's address), result shape and dims.
type BroadcastKey = (usize, Vec<i64>, Vec<i64>);

/// Messages MLIR emitted through the context's diagnostic handler.
pub type Diagnostics = std::rc::Rc<std::cell::RefCell<Vec<String>>>;

pub type R<T> = Result<T, LowerError>;

pub fn elem_type<'c>(ctx: &'c Context, dtype: DType) -> Type<'c> {
    match dtype {
        DType::Float64 => Type::float64(ctx),
        DType::Float32 => Type::float32(ctx),
        DType::Float16 => Type::float16(ctx),
        DType::Bfloat16 => Type::bfloat16(ctx),
        DType::Int64 => IntegerType::new(ctx, 64).into(),
        DType::Int32 => IntegerType::new(ctx, 32).into(),
        DType::Int16 => IntegerType::new(ctx, 16).into(),
        DType::Int8 => IntegerType::new(ctx, 8).into(),
        DType::Uint8 => IntegerType::unsigned(ctx, 8).into(),
        DType::Uint64 => IntegerType::unsigned(ctx, 64).into(),
        DType::Bool => IntegerType::new(ctx, 1).into(),
        DType::Complex64 | DType::Complex128 => {
            Type::parse(ctx, elem_name(dtype)).expect("complex element type")
        }
    }
}

pub fn tensor_type<'c>(ctx: &'c Context, shape: &[i64], dtype: DType) -> Type<'c> {
    let dims: SmallVec<[u64; 6]> = shape.iter().map(|&d| d as u64).collect();
    RankedTensorType::new(&dims, elem_type(ctx, dtype), None).into()
}

/// The element type as StableHLO spells it in textual types (`f32`, `i1`, `ui8`).
pub fn elem_name(dtype: DType) -> &'static str {
    match dtype {
        DType::Float64 => "f64",
        DType::Float32 => "f32",
        DType::Float16 => "f16",
        DType::Bfloat16 => "bf16",
        DType::Int64 => "i64",
        DType::Int32 => "i32",
        DType::Int16 => "i16",
        DType::Int8 => "i8",
        DType::Uint8 => "ui8",
        DType::Uint64 => "ui64",
        DType::Bool => "i1",
        DType::Complex64 => "complex<f32>",
        DType::Complex128 => "complex<f64>",
    }
}

pub fn tensor_type_text(shape: &[i64], dtype: DType) -> String {
    let mut s = String::from("tensor<");
    for d in shape {
        let _ = write!(s, "{d}x");
    }
    s.push_str(elem_name(dtype));
    s.push('>');
    s
}

/// A scalar as an MLIR dense-elements literal of the given element type. Non-finite floats are
/// written as bit patterns, which is the only way MLIR accepts them.
fn literal(value: Scalar, dtype: DType) -> String {
    if dtype.is_complex() {
        let re = literal(value, dtype.real_part());
        let im = literal(Scalar::Float(0.0), dtype.real_part());
        return format!("({re}, {im})");
    }
    if dtype == DType::Bool {
        return (value.as_f64() != 0.0).to_string();
    }
    if !dtype.is_float() {
        if dtype == DType::Uint64 {
            // Unsigned literal: the i64's bits (-1 is all ones).
            return match value {
                Scalar::Float(x) => (x.trunc() as u64).to_string(),
                Scalar::Int(i) => (i as u64).to_string(),
                Scalar::Bool(b) => (b as u64).to_string(),
            };
        }
        return match value {
            Scalar::Float(x) => (x.trunc() as i64).to_string(),
            Scalar::Int(i) => i.to_string(),
            Scalar::Bool(b) => (b as i64).to_string(),
        };
    }
    let x = value.as_f64();
    if x.is_finite() {
        return format!("{x:.17e}");
    }
    let (inf, nan) = match dtype {
        DType::Float64 => ("0x7FF0000000000000", "0x7FF8000000000000"),
        DType::Float32 => ("0x7F800000", "0x7FC00000"),
        DType::Float16 => ("0x7C00", "0x7E00"),
        _ => ("0x7F80", "0x7FC0"),
    };
    match (x.is_nan(), x > 0.0, dtype) {
        (true, _, _) => nan.to_string(),
        (false, true, _) => inf.to_string(),
        (false, false, DType::Float64) => "0xFFF0000000000000".into(),
        (false, false, DType::Float32) => "0xFF800000".into(),
        (false, false, DType::Float16) => "0xFC00".into(),
        (false, false, _) => "0xFF80".into(),
    }
}

/// `1, 2, 3`: the inside of a StableHLO attribute's integer list.
pub fn int_list(values: &[i64]) -> String {
    let mut s = String::with_capacity(4 * values.len());
    push_ints(&mut s, values);
    s
}

/// Appends `values` to `s` as `1, 2, 3`, without a string per value: attribute texts are built
/// for every op, and their allocations show in lowering time.
fn push_ints(s: &mut String, values: &[i64]) {
    for (i, x) in values.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{x}");
    }
}

pub fn array_i64(values: &[i64]) -> String {
    if values.is_empty() {
        return "array<i64>".into();
    }
    let mut s = String::with_capacity(12 + 4 * values.len());
    s.push_str("array<i64: ");
    push_ints(&mut s, values);
    s.push('>');
    s
}

/// The usual PyTorch type promotion between two operand dtypes (category first, then width).
pub fn promote(a: DType, b: DType) -> DType {
    use DType::*;
    if a == b {
        return a;
    }
    if a.is_complex() || b.is_complex() {
        let wide = a == Complex128 || b == Complex128 || a == Float64 || b == Float64;
        return if wide { Complex128 } else { Complex64 };
    }
    let cat = |d: DType| {
        if d.is_float() {
            2
        } else if d == Bool {
            0
        } else {
            1
        }
    };
    match cat(a).cmp(&cat(b)) {
        std::cmp::Ordering::Greater => a,
        std::cmp::Ordering::Less => b,
        std::cmp::Ordering::Equal => {
            if matches!((a, b), (Float16, Bfloat16) | (Bfloat16, Float16)) {
                Float32
            } else if a == Uint8 || b == Uint8 {
                // uint8 with a signed int needs a signed type wider than 8 bits.
                let other = if a == Uint8 { b } else { a };
                if other.byte_size() > 1 {
                    other
                } else {
                    Int16
                }
            } else if a.byte_size() >= b.byte_size() {
                a
            } else {
                b
            }
        }
    }
}

/// Broadcast shape of two shapes, numpy rules.
pub fn broadcast_shapes(a: &[i64], b: &[i64]) -> Option<Vec<i64>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

/// The values of an [`array_i64`] text, read without MLIR's parser (dimension lists, slice
/// bounds and permutations are most of a module's attributes). `None` for any other text.
fn i64_array(text: &str) -> Option<Vec<i64>> {
    if text == "array<i64>" {
        return Some(Vec::new());
    }
    let body = text.strip_prefix("array<i64: ")?.strip_suffix('>')?;
    body.split(", ").map(|v| v.parse().ok()).collect()
}

/// Result `i` of `op` (named `name`, for the error).
fn result<'c, 'b>(op: OperationRef<'c, 'b>, name: &str, i: usize) -> R<Value<'c, 'b>> {
    op.result(i)
        .map(Into::into)
        .map_err(|e| LowerError::internal(format!("{name} result {i}: {e}")))
}

/// Parses MLIR attribute text; an error carries MLIR's diagnostics.
pub fn parse_attr<'c>(ctx: &'c Context, diagnostics: &Diagnostics, text: &str) -> R<Attribute<'c>> {
    Attribute::parse(ctx, text).ok_or_else(|| {
        let why = diagnostics.borrow_mut().drain(..).collect::<Vec<_>>();
        LowerError::internal(format!(
            "MLIR rejected attribute `{text}`: {}",
            why.join("; ")
        ))
    })
}

impl<'c, 'b> Emitter<'c, 'b> {
    pub fn new(
        ctx: &'c Context,
        block: &'b Block<'c>,
        loc: Location<'c>,
        precision: Precision,
        diagnostics: Diagnostics,
        parsed: AttrCache,
    ) -> Self {
        Emitter {
            ctx,
            block,
            loc: std::cell::Cell::new(loc),
            precision,
            diagnostics,
            parsed,
            constants: Default::default(),
            splats: Default::default(),
            broadcasts: Default::default(),
            layouts: Default::default(),
            splat_of: Default::default(),
            broadcast_of: Default::default(),
            materialized: Default::default(),
            host_gemm_min_macs: None,
            host_conv: false,
            host_rows: false,
            host_attention: false,
            device: Device::Cpu,
            own_math_ops: Default::default(),
            own_math: Default::default(),
            reshape_depth: Default::default(),
            cut: Default::default(),
        }
    }

    /// Sets the location of the ops emitted from now on (the node being lowered).
    pub fn set_loc(&self, loc: Location<'c>) {
        self.loc.set(loc);
    }

    /// The location new ops get.
    pub fn loc(&self) -> Location<'c> {
        self.loc.get()
    }

    /// An emitter appending to another block (a region's body), sharing this one's caches.
    fn for_block<'r>(&self, block: &'r Block<'c>) -> Emitter<'c, 'r> {
        Emitter {
            ctx: self.ctx,
            block,
            loc: std::cell::Cell::new(self.loc.get()),
            precision: self.precision,
            diagnostics: self.diagnostics.clone(),
            parsed: self.parsed.clone(),
            constants: Default::default(),
            splats: Default::default(),
            broadcasts: Default::default(),
            layouts: Default::default(),
            splat_of: Default::default(),
            broadcast_of: Default::default(),
            materialized: Default::default(),
            host_gemm_min_macs: self.host_gemm_min_macs,
            host_conv: self.host_conv,
            host_rows: self.host_rows,
            host_attention: self.host_attention,
            device: self.device,
            own_math_ops: self.own_math_ops.clone(),
            own_math: std::cell::Cell::new(self.own_math.get()),
            reshape_depth: Default::default(),
            cut: Default::default(),
        }
    }

    /// Whether the module is for a GPU or a TPU: XLA's compilers there fuse, lay out and tile
    /// convolutions themselves, so rules emit the plain StableHLO form (no CPU taps, patches,
    /// channels-last transposes or fusion barriers; see docs/tpu-lowering.md).
    pub fn accelerator(&self) -> bool {
        self.device != Device::Cpu
    }

    pub fn attr(&self, text: &str) -> R<Attribute<'c>> {
        if let Some(raw) = self.parsed.borrow().get(text) {
            // SAFETY: built in `self.ctx` (the cache belongs to it) and uniqued there for the
            // context's lifetime.
            return Ok(unsafe { Attribute::from_raw(*raw) });
        }
        let a: Attribute<'c> = match i64_array(text) {
            Some(values) => DenseI64ArrayAttribute::new(self.ctx, &values).into(),
            None => parse_attr(self.ctx, &self.diagnostics, text)?,
        };
        self.parsed
            .borrow_mut()
            .insert(text.to_string(), a.to_raw());
        Ok(a)
    }

    /// Appends one op with the given operands, attributes (name, MLIR text) and result types.
    pub fn op_n(
        &self,
        name: &str,
        operands: &[&T<'c, 'b>],
        attrs: &[(&str, String)],
        results: &[(Vec<i64>, DType)],
        regions: Vec<Region<'c>>,
    ) -> R<Vec<T<'c, 'b>>> {
        let types: SmallVec<[(&[i64], DType); 2]> =
            results.iter().map(|(s, d)| (s.as_slice(), *d)).collect();
        let op = self.append(name, operands, attrs, &types, regions)?;
        results
            .iter()
            .enumerate()
            .map(|(i, (shape, dtype))| {
                Ok(T {
                    v: result(op, name, i)?,
                    shape: shape.clone(),
                    dtype: *dtype,
                })
            })
            .collect()
    }

    /// A typed XLA FFI custom call (api_version 4) of a host handler the runtime registered with
    /// the CPU plugin (`tpuc_hostkernels::host_blas`, `host_conv`, `host_rows`).
    pub fn ffi_call(
        &self,
        target: &str,
        operands: &[&T<'c, 'b>],
        results: &[(Vec<i64>, DType)],
    ) -> R<Vec<T<'c, 'b>>> {
        self.op_n(
            "stablehlo.custom_call",
            operands,
            &[
                ("call_target_name", format!("\"{target}\"")),
                ("api_version", "4 : i32".into()),
                ("backend_config", "{}".into()),
            ],
            results,
            vec![],
        )
    }

    /// [`Emitter::ffi_call`] with one f32 result of shape `out`.
    pub fn ffi_call_f32(&self, target: &str, operands: &[&T<'c, 'b>], out: &[i64]) -> R<T<'c, 'b>> {
        let r = self.ffi_call(target, operands, &[(out.to_vec(), DType::Float32)])?;
        Ok(r.into_iter().next().expect("one result"))
    }

    /// [`Emitter::op_n`] for an op with one result and no regions.
    pub fn op(
        &self,
        name: &str,
        operands: &[&T<'c, 'b>],
        attrs: &[(&str, String)],
        shape: &[i64],
        dtype: DType,
    ) -> R<T<'c, 'b>> {
        if self.own_math.get()
            && operands
                .first()
                .is_some_and(|t| own_math::expands(name, t.dtype))
        {
            return own_math::expand(self, name, operands);
        }
        let reshaping = REINDEXING.contains(&name);
        let elementwise = !reshaping && ELEMENTWISE.contains(&name);
        if !reshaping && !elementwise {
            return self.plain_op(name, operands, attrs, shape, dtype);
        }
        let depth_of = |t: &T<'c, 'b>| self.reshape_depth.borrow().get(&addr(t)).copied();
        let mut cut: SmallVec<[T<'c, 'b>; 4]> = SmallVec::new();
        let mut depth = 0;
        for &t in operands {
            match depth_of(t) {
                Some(d) if elementwise && d >= RESHAPE_CHAIN_LIMIT => cut.push(self.cut_chain(t)?),
                d => {
                    depth = depth.max(d.unwrap_or(0));
                    cut.push(t.clone());
                }
            }
        }
        let operands: SmallVec<[&T<'c, 'b>; 4]> = cut.iter().collect();
        let r = match self.sink(name, &operands, attrs, shape, dtype)? {
            Some(t) => t,
            None => self.plain_op(name, &operands, attrs, shape, dtype)?,
        };
        self.reshape_depth
            .borrow_mut()
            .insert(addr(&r), depth + u32::from(reshaping));
        Ok(r)
    }

    /// `t` materialized (one barrier per value), ending its reshape chain.
    fn cut_chain(&self, t: &T<'c, 'b>) -> R<T<'c, 'b>> {
        if let Some(b) = self.cut.borrow().get(&addr(t)) {
            return Ok(b.clone());
        }
        let b = self.barrier(t)?;
        self.cut.borrow_mut().insert(addr(t), b.clone());
        Ok(b)
    }

    /// [`Emitter::op`] as given, with no layout sinking.
    fn plain_op(
        &self,
        name: &str,
        operands: &[&T<'c, 'b>],
        attrs: &[(&str, String)],
        shape: &[i64],
        dtype: DType,
    ) -> R<T<'c, 'b>> {
        let op = self.append(name, operands, attrs, &[(shape, dtype)], Vec::new())?;
        Ok(T {
            v: result(op, name, 0)?,
            shape: shape.to_vec(),
            dtype,
        })
    }

    fn append(
        &self,
        name: &str,
        operands: &[&T<'c, 'b>],
        attrs: &[(&str, String)],
        results: &[(&[i64], DType)],
        regions: Vec<Region<'c>>,
    ) -> R<OperationRef<'c, 'b>> {
        // On the stack: an op has a few of each, and a heap allocation per list per op shows in
        // lowering time when the caches are cold.
        let attrs = attrs
            .iter()
            .map(|(k, v)| Ok((Identifier::new(self.ctx, k), self.attr(v)?)))
            .collect::<R<SmallVec<[_; 8]>>>()?;
        let vals: SmallVec<[Value<'c, 'b>; 4]> = operands.iter().map(|t| t.v).collect();
        let types: SmallVec<[Type<'c>; 2]> = results
            .iter()
            .map(|(s, d)| tensor_type(self.ctx, s, *d))
            .collect();
        let op = OperationBuilder::new(name, self.loc.get())
            .add_operands(&vals)
            .add_attributes(&attrs)
            .add_results(&types)
            .add_regions_vec(regions)
            .build()
            .map_err(|e| LowerError::internal(format!("building {name}: {e}")))?;
        Ok(self.block.append_operation(op))
    }

    /// A tensor filled with one value.
    pub fn splat(&self, value: Scalar, shape: &[i64], dtype: DType) -> R<T<'c, 'b>> {
        // Looked up before the value's text is formatted: most splats repeat (zeros, ones).
        let key = (value.key(), dtype, SmallVec::from_slice(shape));
        if let Some(t) = self.splats.borrow().get(&key) {
            return Ok(t.clone());
        }
        let value_attr = format!(
            "dense<{}> : {}",
            literal(value, dtype),
            tensor_type_text(shape, dtype)
        );
        let t = self.constant(value_attr, shape, dtype)?;
        self.splats.borrow_mut().insert(key, t.clone());
        self.splat_of.borrow_mut().insert(addr(&t), (value, dtype));
        Ok(t)
    }

    /// A constant from explicit values (row-major).
    pub fn constant_i64(&self, values: &[i64], shape: &[i64], dtype: DType) -> R<T<'c, 'b>> {
        let value_attr = format!(
            "dense<[{}]> : {}",
            int_list(values),
            tensor_type_text(shape, dtype)
        );
        self.constant(value_attr, shape, dtype)
    }

    /// A `stablehlo.constant` of `value_attr` (its `dense<...> : tensor<...>` text), or the one
    /// this block already has.
    fn constant(&self, value_attr: String, shape: &[i64], dtype: DType) -> R<T<'c, 'b>> {
        if let Some(t) = self.constants.borrow().get(&value_attr) {
            return Ok(t.clone());
        }
        let t = self.op(
            "stablehlo.constant",
            &[],
            &[("value", value_attr.clone())],
            shape,
            dtype,
        )?;
        self.constants.borrow_mut().insert(value_attr, t.clone());
        Ok(t)
    }

    pub fn convert(&self, t: &T<'c, 'b>, dtype: DType) -> R<T<'c, 'b>> {
        if t.dtype == dtype {
            return Ok(t.clone());
        }
        if t.dtype.is_complex() && !dtype.is_complex() {
            // PyTorch drops the imaginary part (XLA has no complex-to-real convert).
            let re = self.part(t, "stablehlo.real")?;
            return self.convert(&re, dtype);
        }
        if dtype.is_complex() && !t.dtype.is_complex() {
            let re = self.convert(t, dtype.real_part())?;
            let im = self.splat(Scalar::Int(0), &t.shape, dtype.real_part())?;
            return self.complex(&re, &im);
        }
        if dtype == DType::Bool {
            // convert to i1 would truncate; PyTorch means "!= 0".
            let zero = self.splat(Scalar::Int(0), &t.shape, t.dtype)?;
            return self.compare(t, &zero, "NE");
        }
        self.op("stablehlo.convert", &[t], &[], &t.shape, dtype)
    }

    /// `stablehlo.real` / `stablehlo.imag` of a complex tensor.
    pub fn part(&self, t: &T<'c, 'b>, op: &str) -> R<T<'c, 'b>> {
        self.op(op, &[t], &[], &t.shape, t.dtype.real_part())
    }

    /// A complex tensor from real and imaginary parts of one float dtype.
    pub fn complex(&self, re: &T<'c, 'b>, im: &T<'c, 'b>) -> R<T<'c, 'b>> {
        let d = promote(re.dtype, im.dtype);
        let (re, im) = self.coerce(re, im, d)?;
        self.op(
            "stablehlo.complex",
            &[&re, &im],
            &[],
            &re.shape.clone(),
            d.to_complex(),
        )
    }

    pub fn reshape(&self, t: &T<'c, 'b>, shape: &[i64]) -> R<T<'c, 'b>> {
        if t.shape == shape {
            return Ok(t.clone());
        }
        let n: i64 = shape.iter().product();
        if n != t.numel() {
            return Err(LowerError::internal(format!(
                "reshape of {:?} to {shape:?} changes the element count",
                t.shape
            )));
        }
        self.op("stablehlo.reshape", &[t], &[], shape, t.dtype)
    }

    pub fn broadcast_in_dim(&self, t: &T<'c, 'b>, shape: &[i64], dims: &[i64]) -> R<T<'c, 'b>> {
        if t.shape == shape && dims.iter().enumerate().all(|(i, &d)| d == i as i64) {
            return Ok(t.clone());
        }
        let key = (t.v.to_raw().ptr as usize, shape.to_vec(), dims.to_vec());
        if let Some(b) = self.broadcasts.borrow().get(&key) {
            return Ok(b.clone());
        }
        let b = self.op(
            "stablehlo.broadcast_in_dim",
            &[t],
            &[("broadcast_dimensions", array_i64(dims))],
            shape,
            t.dtype,
        )?;
        self.broadcasts.borrow_mut().insert(key, b.clone());
        self.broadcast_of
            .borrow_mut()
            .insert(addr(&b), (t.clone(), dims.to_vec()));
        Ok(b)
    }

    /// Numpy-style broadcast (trailing dims aligned) to `shape`.
    pub fn broadcast_to(&self, t: &T<'c, 'b>, shape: &[i64]) -> R<T<'c, 'b>> {
        if t.shape == shape {
            return Ok(t.clone());
        }
        if t.rank() > shape.len() {
            return Err(LowerError::internal(format!(
                "cannot broadcast {:?} to {shape:?}",
                t.shape
            )));
        }
        let off = (shape.len() - t.rank()) as i64;
        let dims: Vec<i64> = (0..t.rank() as i64).map(|i| i + off).collect();
        self.broadcast_in_dim(t, shape, &dims)
    }

    pub fn transpose(&self, t: &T<'c, 'b>, perm: &[i64]) -> R<T<'c, 'b>> {
        if perm.iter().enumerate().all(|(i, &p)| p == i as i64) {
            return Ok(t.clone());
        }
        let shape: Vec<i64> = perm.iter().map(|&p| t.shape[p as usize]).collect();
        let merged = (perm.len() >= MERGE_TRANSPOSE_MIN_RANK)
            .then(|| merged_transpose(&t.shape, perm))
            .flatten();
        if let Some((merged, merged_perm)) = merged {
            // Runs of dims that stay adjacent are one dim: XLA's tiled CPU emitter analyses a
            // fusion's indexing per dim, and a 6-D transpose behind reshapes of other
            // factorizations (Swin's patch merging after its residual adds) took it minutes.
            if merged.len() == 1 {
                return self.reshape(t, &shape); // only size-1 dims moved
            }
            let r = self.reshape(t, &merged)?;
            let out: Vec<i64> = merged_perm.iter().map(|&p| merged[p as usize]).collect();
            let x = self.op(
                "stablehlo.transpose",
                &[&r],
                &[("permutation", array_i64(&merged_perm))],
                &out,
                t.dtype,
            )?;
            let y = self.reshape(&x, &shape)?;
            // One transpose, whatever the reshapes around it.
            let depth = self
                .reshape_depth
                .borrow()
                .get(&addr(t))
                .copied()
                .unwrap_or(0);
            self.reshape_depth.borrow_mut().insert(addr(&y), depth + 1);
            return Ok(y);
        }
        self.op(
            "stablehlo.transpose",
            &[t],
            &[("permutation", array_i64(perm))],
            &shape,
            t.dtype,
        )
    }

    /// `transpose(physical, perm)`, remembered as a value whose physical form is `physical`:
    /// elementwise ops ([`ELEMENTWISE`]) whose operands are such transposes with one
    /// permutation (the others splats or broadcasts, which are re-emitted in the physical
    /// layout) are emitted on the physical operands and transposed after, and rules that know
    /// layouts ([`Emitter::physical`]: convolution, batch norm, pooling, reductions) read the
    /// physical form. So a chain of such ops between two channels-last convolutions carries no
    /// transpose; a transpose nobody reads is dead code that XLA drops. Exact: each rewrite
    /// computes the same elements with the same ops.
    pub fn layout_transpose(&self, physical: &T<'c, 'b>, perm: &[i64]) -> R<T<'c, 'b>> {
        let t = self.transpose(physical, perm)?;
        if addr(&t) != addr(physical) {
            self.layouts
                .borrow_mut()
                .insert(addr(&t), (physical.clone(), perm.to_vec()));
        }
        Ok(t)
    }

    /// The physical form of layout transpose `t` through a `stablehlo.optimization_barrier`,
    /// which becomes its physical form from now on: every later reader of the physical form
    /// reads one materialized buffer, and XLA cannot fuse (and so recompute) what made it into
    /// each reader. A physical form that is already such a barrier is returned as it is.
    pub fn materialize_physical(&self, t: &T<'c, 'b>) -> R<T<'c, 'b>> {
        let (p, perm) = self
            .physical(t)
            .ok_or_else(|| LowerError::internal("materialize_physical of a plain value"))?;
        if self.materialized.borrow().contains(&addr(&p)) {
            return Ok(p);
        }
        let b = self.barrier(&p)?;
        self.materialized.borrow_mut().insert(addr(&b));
        self.layouts.borrow_mut().insert(addr(t), (b.clone(), perm));
        Ok(b)
    }

    /// `t` through a `stablehlo.optimization_barrier`: one buffer that every reader reads, so
    /// XLA cannot fuse (and so recompute) what made `t` into each of them. For values that are
    /// costly per element and read by several fusions: XLA's CPU fusion duplicates elementwise
    /// producers into every consumer whatever their cost. On a GPU or TPU, `t` itself: their
    /// fusion weighs recomputation against memory traffic, and a barrier would only keep it
    /// from fusing (an extra round trip through HBM per barrier).
    pub fn barrier(&self, t: &T<'c, 'b>) -> R<T<'c, 'b>> {
        if self.accelerator() {
            return Ok(t.clone());
        }
        Ok(self
            .op_n(
                "stablehlo.optimization_barrier",
                &[t],
                &[],
                &[(t.shape.clone(), t.dtype)],
                Vec::new(),
            )?
            .remove(0))
    }

    /// The physical form of a value made by [`Emitter::layout_transpose`] (or sunk through one).
    pub fn physical(&self, t: &T<'c, 'b>) -> Option<Layout<'c, 'b>> {
        self.layouts.borrow().get(&addr(t)).cloned()
    }

    /// An elementwise op on layout transposes, emitted on their physical forms and transposed
    /// after (see [`Emitter::layout_transpose`]); None when it does not apply.
    fn sink(
        &self,
        name: &str,
        operands: &[&T<'c, 'b>],
        attrs: &[(&str, String)],
        shape: &[i64],
        dtype: DType,
    ) -> R<Option<T<'c, 'b>>> {
        if self.layouts.borrow().is_empty() || shape.is_empty() || !ELEMENTWISE.contains(&name) {
            return Ok(None);
        }
        let perm = {
            let layouts = self.layouts.borrow();
            let mut perm: Option<&Vec<i64>> = None;
            for t in operands {
                if let Some((_, p)) = layouts.get(&addr(t)) {
                    if perm.is_some_and(|q| q != p) {
                        return Ok(None);
                    }
                    perm = Some(p);
                }
            }
            match perm {
                Some(p) if p.len() == shape.len() => p.clone(),
                _ => return Ok(None),
            }
        };
        let physical_shape = to_physical(shape, &perm);
        // What each operand is in the physical layout, looked up before anything is emitted.
        enum Form<'c, 'b> {
            Same(T<'c, 'b>),
            Splat(Scalar, DType),
            Broadcast(T<'c, 'b>, Vec<i64>),
        }
        let mut forms = Vec::with_capacity(operands.len());
        for t in operands {
            let form = if t.rank() == 0 {
                Form::Same((*t).clone())
            } else if t.shape != shape {
                return Ok(None);
            } else if let Some((src, _)) = self.layouts.borrow().get(&addr(t)) {
                Form::Same(src.clone())
            } else if let Some(&(value, d)) = self.splat_of.borrow().get(&addr(t)) {
                Form::Splat(value, d)
            } else if let Some((src, dims)) = self.broadcast_of.borrow().get(&addr(t)) {
                Form::Broadcast(
                    src.clone(),
                    dims.iter().map(|&d| perm[d as usize]).collect(),
                )
            } else {
                return Ok(None);
            };
            forms.push(form);
        }
        let physical = forms
            .into_iter()
            .map(|f| match f {
                Form::Same(t) => Ok(t),
                Form::Splat(value, d) => self.splat(value, &physical_shape, d),
                Form::Broadcast(src, dims) => self.broadcast_in_dim(&src, &physical_shape, &dims),
            })
            .collect::<R<Vec<_>>>()?;
        let refs: Vec<&T<'c, 'b>> = physical.iter().collect();
        let r = self.plain_op(name, &refs, attrs, &physical_shape, dtype)?;
        self.layout_transpose(&r, &perm).map(Some)
    }

    /// Broadcasts two operands to their common shape and converts them to `dtype`.
    pub fn coerce(&self, a: &T<'c, 'b>, b: &T<'c, 'b>, dtype: DType) -> R<(T<'c, 'b>, T<'c, 'b>)> {
        let shape = broadcast_shapes(&a.shape, &b.shape).ok_or_else(|| {
            LowerError::internal(format!(
                "shapes {:?} and {:?} do not broadcast",
                a.shape, b.shape
            ))
        })?;
        let a = self.broadcast_to(&self.convert(a, dtype)?, &shape)?;
        let b = self.broadcast_to(&self.convert(b, dtype)?, &shape)?;
        Ok((a, b))
    }

    /// An elementwise binary op computed in `dtype`, with broadcasting.
    pub fn binary(&self, name: &str, a: &T<'c, 'b>, b: &T<'c, 'b>, dtype: DType) -> R<T<'c, 'b>> {
        let (a, b) = self.coerce(a, b, dtype)?;
        self.op(name, &[&a, &b], &[], &a.shape.clone(), dtype)
    }

    pub fn unary(&self, name: &str, a: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.op(name, &[a], &[], &a.shape, a.dtype)
    }

    // Arithmetic shorthands for formulas: computed in the dtype of the first operand, with
    // broadcasting (a 0-d operand, like a constant from `k`, broadcasts to the other's shape).

    /// A 0-d float constant of `dtype`.
    pub fn k(&self, v: f64, dtype: DType) -> R<T<'c, 'b>> {
        self.splat(Scalar::Float(v), &[], dtype)
    }
    pub fn add(&self, a: &T<'c, 'b>, b: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.binary("stablehlo.add", a, b, a.dtype)
    }
    pub fn sub(&self, a: &T<'c, 'b>, b: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.binary("stablehlo.subtract", a, b, a.dtype)
    }
    pub fn mul(&self, a: &T<'c, 'b>, b: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.binary("stablehlo.multiply", a, b, a.dtype)
    }
    pub fn div(&self, a: &T<'c, 'b>, b: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.binary("stablehlo.divide", a, b, a.dtype)
    }
    pub fn and(&self, a: &T<'c, 'b>, b: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.binary("stablehlo.and", a, b, DType::Bool)
    }
    pub fn or(&self, a: &T<'c, 'b>, b: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.binary("stablehlo.or", a, b, DType::Bool)
    }
    /// `x != x`: true where a float is NaN.
    pub fn isnan(&self, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.compare(x, x, "NE")
    }

    /// Reinterprets the bits of `t` as `dtype` (same width).
    pub fn bitcast(&self, t: &T<'c, 'b>, dtype: DType) -> R<T<'c, 'b>> {
        if t.dtype.byte_size() != dtype.byte_size() {
            return Err(LowerError::internal(format!(
                "bitcast of {} to {dtype} changes the width",
                t.dtype
            )));
        }
        self.op("stablehlo.bitcast_convert", &[t], &[], &t.shape, dtype)
    }

    /// `a <dir> b` (EQ, NE, LT, LE, GT, GE) computed in the promoted type; result is bool.
    pub fn compare(&self, a: &T<'c, 'b>, b: &T<'c, 'b>, dir: &str) -> R<T<'c, 'b>> {
        let dtype = promote(a.dtype, b.dtype);
        let (a, b) = self.coerce(a, b, dtype)?;
        let cmp_type = if dtype.is_float() || dtype.is_complex() {
            "FLOAT"
        } else if matches!(dtype, DType::Uint8 | DType::Uint64 | DType::Bool) {
            "UNSIGNED"
        } else {
            "SIGNED"
        };
        self.op(
            "stablehlo.compare",
            &[&a, &b],
            &[
                (
                    "comparison_direction",
                    format!("#stablehlo<comparison_direction {dir}>"),
                ),
                (
                    "compare_type",
                    format!("#stablehlo<comparison_type {cmp_type}>"),
                ),
            ],
            &a.shape.clone(),
            DType::Bool,
        )
    }

    /// `pred ? a : b`, broadcasting all three; a and b converted to `dtype`.
    pub fn select(
        &self,
        pred: &T<'c, 'b>,
        a: &T<'c, 'b>,
        b: &T<'c, 'b>,
        dtype: DType,
    ) -> R<T<'c, 'b>> {
        let shape = broadcast_shapes(&pred.shape, &a.shape)
            .and_then(|s| broadcast_shapes(&s, &b.shape))
            .ok_or_else(|| LowerError::internal("select operands do not broadcast"))?;
        let p = self.broadcast_to(&self.convert(pred, DType::Bool)?, &shape)?;
        let a = self.broadcast_to(&self.convert(a, dtype)?, &shape)?;
        let b = self.broadcast_to(&self.convert(b, dtype)?, &shape)?;
        self.op("stablehlo.select", &[&p, &a, &b], &[], &shape, dtype)
    }

    /// A region `(x, y) -> x <op> y` over scalars of `dtype`, as reduce / reduce_window need.
    pub fn scalar_region(&self, kind: ReduceKind, dtype: DType) -> R<Region<'c>> {
        let name = match kind {
            ReduceKind::Sum => "stablehlo.add",
            ReduceKind::Max => "stablehlo.maximum",
            ReduceKind::Min => "stablehlo.minimum",
            ReduceKind::Prod => "stablehlo.multiply",
            ReduceKind::And => "stablehlo.and",
            ReduceKind::Or => "stablehlo.or",
        };
        self.two_scalar_region(dtype, Some(name))
    }

    /// A region over 0-d tensors of `args` whose body `body` builds with an emitter of its own
    /// (any helper works inside) and returns the values the region yields: the comparator of a
    /// sort, or the combiner of a reduce / reduce_window / scatter that no single op expresses.
    pub fn region(
        &self,
        args: &[DType],
        body: impl for<'r> FnOnce(&Emitter<'c, 'r>, Vec<T<'c, 'r>>) -> R<Vec<T<'c, 'r>>>,
    ) -> R<Region<'c>> {
        let typed: Vec<(Vec<i64>, DType)> = args.iter().map(|&d| (vec![], d)).collect();
        self.region_of(&typed, body)
    }

    /// Like [`Emitter::region`], with arguments of any shape (the loop-carried values of a
    /// `stablehlo.while`).
    pub fn region_of(
        &self,
        args: &[(Vec<i64>, DType)],
        body: impl for<'r> FnOnce(&Emitter<'c, 'r>, Vec<T<'c, 'r>>) -> R<Vec<T<'c, 'r>>>,
    ) -> R<Region<'c>> {
        self.body_region(args, body, "stablehlo.return")
    }

    /// A private `func.func @name(args) -> results` whose body `body` builds with an emitter of
    /// its own (the decomposition of a `stablehlo.composite`). The caller puts it in the module.
    pub fn function(
        &self,
        name: &str,
        args: &[(Vec<i64>, DType)],
        results: &[(Vec<i64>, DType)],
        body: impl for<'r> FnOnce(&Emitter<'c, 'r>, Vec<T<'c, 'r>>) -> R<Vec<T<'c, 'r>>>,
    ) -> R<melior::ir::Operation<'c>> {
        let region = self.body_region(args, body, "func.return")?;
        let in_types: Vec<Type<'c>> = args
            .iter()
            .map(|(s, d)| tensor_type(self.ctx, s, *d))
            .collect();
        let out_types: Vec<Type<'c>> = results
            .iter()
            .map(|(s, d)| tensor_type(self.ctx, s, *d))
            .collect();
        let fn_type = melior::ir::r#type::FunctionType::new(self.ctx, &in_types, &out_types);
        Ok(melior::dialect::func::func(
            self.ctx,
            melior::ir::attribute::StringAttribute::new(self.ctx, name),
            melior::ir::attribute::TypeAttribute::new(fn_type.into()),
            region,
            &[(
                Identifier::new(self.ctx, "sym_visibility"),
                self.attr("\"private\"")?,
            )],
            self.loc.get(),
        ))
    }

    /// A one-block region with arguments `args`, built by `body` with an emitter of its own and
    /// ended by the `terminator` op over `body`'s results.
    fn body_region(
        &self,
        args: &[(Vec<i64>, DType)],
        body: impl for<'r> FnOnce(&Emitter<'c, 'r>, Vec<T<'c, 'r>>) -> R<Vec<T<'c, 'r>>>,
        terminator: &str,
    ) -> R<Region<'c>> {
        let err = |e: melior::Error| LowerError::internal(e.to_string());
        let types: Vec<(Type<'c>, Location<'c>)> = args
            .iter()
            .map(|(s, d)| (tensor_type(self.ctx, s, *d), self.loc.get()))
            .collect();
        let block = Block::new(&types);
        {
            let inner = self.for_block(&block);
            let params = args
                .iter()
                .enumerate()
                .map(|(i, (s, d))| {
                    Ok(T {
                        v: block.argument(i).map_err(err)?.into(),
                        shape: s.clone(),
                        dtype: *d,
                    })
                })
                .collect::<R<Vec<_>>>()?;
            let results = body(&inner, params)?;
            let vals: Vec<Value> = results.iter().map(|t| t.v).collect();
            let ret = OperationBuilder::new(terminator, self.loc.get())
                .add_operands(&vals)
                .build()
                .map_err(err)?;
            block.append_operation(ret);
        }
        let region = Region::new();
        region.append_block(block);
        Ok(region)
    }

    /// A region `(x, y) -> y`: the update rule of a scatter that overwrites.
    pub fn replace_region(&self, dtype: DType) -> R<Region<'c>> {
        self.two_scalar_region(dtype, None)
    }

    /// A region over two scalars `(x, y)` returning `op(x, y)`, or `y` when `op` is None.
    fn two_scalar_region(&self, dtype: DType, op: Option<&str>) -> R<Region<'c>> {
        let err = |e: melior::Error| LowerError::internal(e.to_string());
        let scalar = tensor_type(self.ctx, &[], dtype);
        let block = Block::new(&[(scalar, self.loc.get()), (scalar, self.loc.get())]);
        {
            let x: Value = block.argument(0).map_err(err)?.into();
            let y: Value = block.argument(1).map_err(err)?.into();
            let result: Value = match op {
                Some(name) => {
                    let op = OperationBuilder::new(name, self.loc.get())
                        .add_operands(&[x, y])
                        .add_results(&[scalar])
                        .build()
                        .map_err(err)?;
                    block.append_operation(op).result(0).map_err(err)?.into()
                }
                None => y,
            };
            let ret = OperationBuilder::new("stablehlo.return", self.loc.get())
                .add_operands(&[result])
                .build()
                .map_err(err)?;
            block.append_operation(ret);
        }
        let region = Region::new();
        region.append_block(block);
        Ok(region)
    }

    /// `stablehlo.scatter` of `updates` into `operand` at `indices` (index vector in the last
    /// dim of `indices`), adding when `add`, else overwriting.
    #[allow(clippy::too_many_arguments)]
    pub fn scatter(
        &self,
        operand: &T<'c, 'b>,
        indices: &T<'c, 'b>,
        updates: &T<'c, 'b>,
        update_window_dims: &[i64],
        inserted_window_dims: &[i64],
        scatter_dims_to_operand_dims: &[i64],
        add: bool,
    ) -> R<T<'c, 'b>> {
        let region = if add {
            if operand.dtype == DType::Bool {
                self.scalar_region(ReduceKind::Or, operand.dtype)?
            } else {
                self.scalar_region(ReduceKind::Sum, operand.dtype)?
            }
        } else {
            self.replace_region(operand.dtype)?
        };
        self.scatter_with(
            operand,
            indices,
            updates,
            update_window_dims,
            inserted_window_dims,
            scatter_dims_to_operand_dims,
            region,
        )
    }

    /// `stablehlo.scatter` combining each update with what is there by `region`.
    #[allow(clippy::too_many_arguments)]
    pub fn scatter_with(
        &self,
        operand: &T<'c, 'b>,
        indices: &T<'c, 'b>,
        updates: &T<'c, 'b>,
        update_window_dims: &[i64],
        inserted_window_dims: &[i64],
        scatter_dims_to_operand_dims: &[i64],
        region: Region<'c>,
    ) -> R<T<'c, 'b>> {
        let dnums = format!(
            "#stablehlo.scatter<update_window_dims = [{}], inserted_window_dims = [{}], scatter_dims_to_operand_dims = [{}], index_vector_dim = {}>",
            int_list(update_window_dims),
            int_list(inserted_window_dims),
            int_list(scatter_dims_to_operand_dims),
            indices.rank() - 1
        );
        let updates = self.convert(updates, operand.dtype)?;
        Ok(self
            .op_n(
                "stablehlo.scatter",
                &[operand, indices, &updates],
                &[
                    ("scatter_dimension_numbers", dnums),
                    ("indices_are_sorted", "false".into()),
                    ("unique_indices", "false".into()),
                ],
                &[(operand.shape.clone(), operand.dtype)],
                vec![region],
            )?
            .remove(0))
    }

    /// The identity element of a reduction, for `dtype`.
    pub fn reduce_init(kind: ReduceKind, dtype: DType) -> Scalar {
        match kind {
            ReduceKind::Sum | ReduceKind::Or => Scalar::Int(0),
            ReduceKind::Prod | ReduceKind::And => Scalar::Int(1),
            ReduceKind::Max if dtype.is_float() => Scalar::Float(f64::NEG_INFINITY),
            ReduceKind::Min if dtype.is_float() => Scalar::Float(f64::INFINITY),
            ReduceKind::Max => Scalar::Int(match dtype {
                DType::Bool | DType::Uint8 | DType::Uint64 => 0,
                DType::Int8 => i8::MIN as i64,
                DType::Int16 => i16::MIN as i64,
                DType::Int32 => i32::MIN as i64,
                _ => i64::MIN,
            }),
            ReduceKind::Min => Scalar::Int(match dtype {
                DType::Bool => 1,
                DType::Uint8 => u8::MAX as i64,
                DType::Uint64 => -1, // all ones
                DType::Int8 => i8::MAX as i64,
                DType::Int16 => i16::MAX as i64,
                DType::Int32 => i32::MAX as i64,
                _ => i64::MAX,
            }),
        }
    }

    /// Reduces `dims` of `t`; with `keepdim` the reduced dims stay as size 1.
    pub fn reduce(
        &self,
        t: &T<'c, 'b>,
        dims: &[i64],
        kind: ReduceKind,
        keepdim: bool,
    ) -> R<T<'c, 'b>> {
        if t.rank() == 0 {
            // PyTorch treats dim 0 / -1 of a 0-d tensor as the tensor itself.
            return Ok(t.clone());
        }
        let mut dims: Vec<i64> = dims.to_vec();
        dims.sort();
        dims.dedup();
        let layout = self
            .physical(t)
            .filter(|(_, p)| p.len() == t.rank() && dims.len() < t.rank());
        let r = if let Some((src, perm)) = layout {
            // A layout transpose: reduce its physical form along the same dims there; the kept
            // dims come out in physical order, transposed back to logical order when they differ.
            // (A reduction to a scalar has no layout to keep: it reads the logical value, in the
            // order it always did.)
            let physical_dims: Vec<i64> = dims.iter().map(|&d| perm[d as usize]).collect();
            let r = self.reduce(&src, &physical_dims, kind, false)?;
            let mut kept: Vec<i64> = (0..t.rank() as i64)
                .filter(|d| !dims.contains(d))
                .map(|d| perm[d as usize])
                .collect();
            let logical_order = kept.clone();
            kept.sort();
            let q: Vec<i64> = logical_order
                .iter()
                .map(|p| kept.iter().position(|k| k == p).expect("kept") as i64)
                .collect();
            self.layout_transpose(&r, &q)?
        } else {
            let init = self.splat(Self::reduce_init(kind, t.dtype), &[], t.dtype)?;
            let kept: Vec<i64> = (0..t.rank() as i64)
                .filter(|d| !dims.contains(d))
                .map(|d| t.shape[d as usize])
                .collect();
            let region = self.scalar_region(kind, t.dtype)?;
            self.op_n(
                "stablehlo.reduce",
                &[t, &init],
                &[("dimensions", array_i64(&dims))],
                &[(kept, t.dtype)],
                vec![region],
            )?
            .remove(0)
        };
        if keepdim {
            let shape: Vec<i64> = (0..t.rank() as i64)
                .map(|d| {
                    if dims.contains(&d) {
                        1
                    } else {
                        t.shape[d as usize]
                    }
                })
                .collect();
            self.reshape(&r, &shape)
        } else {
            Ok(r)
        }
    }

    /// Like [`Emitter::reduce`], but a max/min over floats is NaN when any reduced element is NaN,
    /// as in PyTorch. (The CPU plugin's max/min reductions skip NaNs, although its elementwise
    /// maximum/minimum propagate them.)
    pub fn reduce_nan(
        &self,
        t: &T<'c, 'b>,
        dims: &[i64],
        kind: ReduceKind,
        keepdim: bool,
    ) -> R<T<'c, 'b>> {
        let r = self.reduce(t, dims, kind, keepdim)?;
        if !t.dtype.is_float()
            || !matches!(kind, ReduceKind::Max | ReduceKind::Min)
            || t.rank() == 0
        {
            return Ok(r);
        }
        let isnan = self.compare(t, t, "NE")?;
        let any = self.reduce(&isnan, dims, ReduceKind::Or, keepdim)?;
        let nan = self.splat(Scalar::Float(f64::NAN), &[], t.dtype)?;
        self.select(&any, &nan, &r, t.dtype)
    }

    /// `stablehlo.dot_general` with the session's precision.
    #[allow(clippy::too_many_arguments)]
    pub fn dot_general(
        &self,
        a: &T<'c, 'b>,
        b: &T<'c, 'b>,
        batch: (&[i64], &[i64]),
        contract: (&[i64], &[i64]),
        out_shape: &[i64],
        out_dtype: DType,
    ) -> R<T<'c, 'b>> {
        let dims = format!(
            "#stablehlo.dot<lhs_batching_dimensions = [{}], rhs_batching_dimensions = [{}], lhs_contracting_dimensions = [{}], rhs_contracting_dimensions = [{}]>",
            int_list(batch.0), int_list(batch.1), int_list(contract.0), int_list(contract.1)
        );
        self.op(
            "stablehlo.dot_general",
            &[a, b],
            &[
                ("dot_dimension_numbers", dims),
                ("precision_config", self.precision_config()),
            ],
            out_shape,
            out_dtype,
        )
    }

    pub fn precision_config(&self) -> String {
        let p = self.precision.mlir();
        format!("[#stablehlo<precision {p}>, #stablehlo<precision {p}>]")
    }

    /// Whether `t` is one of the function's arguments: a graph input, which lives in PyTorch's
    /// memory and is never donated, so XLA copies it before updating it in place.
    pub fn is_input(&self, t: &T<'c, 'b>) -> bool {
        melior::ir::block::BlockArgument::try_from(t.v)
            .is_ok_and(|a| a.owner().to_raw().ptr == self.block.to_raw().ptr)
    }

    /// `stablehlo.iota` along `dim`.
    pub fn iota(&self, shape: &[i64], dim: i64, dtype: DType) -> R<T<'c, 'b>> {
        self.op(
            "stablehlo.iota",
            &[],
            &[("iota_dimension", format!("{dim} : i64"))],
            shape,
            dtype,
        )
    }

    /// `t` padded with `fill` (a 0-d tensor) at the high end of dim `dim` up to size `to`.
    pub fn pad_end(&self, t: &T<'c, 'b>, fill: &T<'c, 'b>, dim: usize, to: i64) -> R<T<'c, 'b>> {
        let mut hi = vec![0; t.rank()];
        hi[dim] = to - t.shape[dim];
        let zeros = vec![0; t.rank()];
        self.pad(t, fill, &zeros, &hi, &zeros)
    }

    /// `stablehlo.pad`: `lo`/`hi` elements of `fill` before/after each dim (negative: cropped)
    /// and `interior` between neighbours.
    pub fn pad(
        &self,
        t: &T<'c, 'b>,
        fill: &T<'c, 'b>,
        lo: &[i64],
        hi: &[i64],
        interior: &[i64],
    ) -> R<T<'c, 'b>> {
        let shape: Vec<i64> = (0..t.rank())
            .map(|d| lo[d] + hi[d] + t.shape[d] + (t.shape[d] - 1).max(0) * interior[d])
            .collect();
        self.op(
            "stablehlo.pad",
            &[t, fill],
            &[
                ("edge_padding_low", array_i64(lo)),
                ("edge_padding_high", array_i64(hi)),
                ("interior_padding", array_i64(interior)),
            ],
            &shape,
            t.dtype,
        )
    }

    /// A `stablehlo.while` counting `k` from 0 to `n` (exclusive) over the carried values; `body`
    /// gets `k` (0-d int64) and the carried values and returns their next values.
    pub fn fori(
        &self,
        n: i64,
        init: &[T<'c, 'b>],
        body: impl for<'r> Fn(&Emitter<'c, 'r>, &T<'c, 'r>, &[T<'c, 'r>]) -> R<Vec<T<'c, 'r>>>,
    ) -> R<Vec<T<'c, 'b>>> {
        self.fori_with(n, None, init, body)
    }

    /// [`Emitter::fori`], stopping at `limit` (0-d integer, at most `n`) when given: a runtime
    /// trip count, carried along as the loop's last value.
    pub fn fori_with(
        &self,
        n: i64,
        limit: Option<&T<'c, 'b>>,
        init: &[T<'c, 'b>],
        body: impl for<'r> Fn(&Emitter<'c, 'r>, &T<'c, 'r>, &[T<'c, 'r>]) -> R<Vec<T<'c, 'r>>>,
    ) -> R<Vec<T<'c, 'b>>> {
        const I64: DType = DType::Int64;
        let mut types = vec![(vec![], I64)];
        types.extend(init.iter().map(|t| (t.shape.clone(), t.dtype)));
        let carried_limit = limit.is_some();
        if carried_limit {
            types.push((vec![], I64));
        }
        let last = types.len() - 1;
        let cond = self.region_of(&types, move |e, a| {
            let limit = if carried_limit {
                a[last].clone()
            } else {
                e.splat(Scalar::Int(n), &[], I64)?
            };
            Ok(vec![e.compare(&a[0], &limit, "LT")?])
        })?;
        let body = self.region_of(&types, move |e, a| {
            let end = if carried_limit { last } else { a.len() };
            let mut next = body(e, &a[0], &a[1..end])?;
            let one = e.splat(Scalar::Int(1), &[], I64)?;
            next.insert(0, e.add(&a[0], &one)?);
            if carried_limit {
                next.push(a[last].clone());
            }
            Ok(next)
        })?;
        let k0 = self.splat(Scalar::Int(0), &[], I64)?;
        let limit = match limit {
            Some(l) => Some(self.convert(&self.reshape(l, &[])?, I64)?),
            None => None,
        };
        let mut operands = vec![&k0];
        operands.extend(init.iter());
        operands.extend(limit.as_ref());
        let mut out = self.op_n("stablehlo.while", &operands, &[], &types, vec![cond, body])?;
        if carried_limit {
            out.pop();
        }
        out.remove(0);
        Ok(out)
    }

    /// `parts` joined along `dim` (they agree on every other dim and on the dtype).
    pub fn concatenate(&self, parts: &[&T<'c, 'b>], dim: usize) -> R<T<'c, 'b>> {
        let first = parts
            .first()
            .ok_or_else(|| LowerError::internal("concatenate of no tensors"))?;
        if parts.len() == 1 {
            return Ok((*first).clone());
        }
        let mut shape = first.shape.clone();
        shape[dim] = parts.iter().map(|t| t.shape[dim]).sum();
        self.op(
            "stablehlo.concatenate",
            parts,
            &[("dimension", format!("{dim} : i64"))],
            &shape,
            first.dtype,
        )
    }

    pub fn slice(
        &self,
        t: &T<'c, 'b>,
        start: &[i64],
        limit: &[i64],
        strides: &[i64],
    ) -> R<T<'c, 'b>> {
        let shape: Vec<i64> = (0..t.rank())
            .map(|i| ((limit[i] - start[i]).max(0) + strides[i] - 1) / strides[i])
            .collect();
        if shape == t.shape && start.iter().all(|&s| s == 0) && strides.iter().all(|&s| s == 1) {
            return Ok(t.clone()); // the whole tensor
        }
        self.op(
            "stablehlo.slice",
            &[t],
            &[
                ("start_indices", array_i64(start)),
                ("limit_indices", array_i64(limit)),
                ("strides", array_i64(strides)),
            ],
            &shape,
            t.dtype,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn i64_arrays_are_read_back_without_the_parser() {
        for v in [vec![], vec![0], vec![-3, 7, i64::MAX, i64::MIN]] {
            assert_eq!(i64_array(&array_i64(&v)), Some(v));
        }
        for other in [
            "array<i32: 1>",
            "dense<1> : tensor<i64>",
            "array<i64: 1,2>",
            "#x",
        ] {
            assert_eq!(i64_array(other), None, "{other}");
        }
    }

    #[test]
    fn transposes_merge_runs_of_adjacent_dims() {
        // Swin's patch merging: (B, H/2, 2, W/2, 2, C) -> (B, H/2, W/2, 2, 2, C).
        assert_eq!(
            merged_transpose(&[2, 28, 2, 28, 2, 96], &[0, 1, 3, 4, 2, 5]),
            Some((vec![56, 2, 56, 96], vec![0, 2, 1, 3]))
        );
        // Size-1 dims drop out; what is left may be a plain reshape.
        assert_eq!(
            merged_transpose(&[4, 1, 5], &[1, 0, 2]),
            Some((vec![20], vec![0]))
        );
        assert_eq!(
            merged_transpose(&[3, 1, 5], &[2, 1, 0]),
            Some((vec![3, 5], vec![1, 0]))
        );
        assert_eq!(
            merged_transpose(&[3, 4, 5], &[2, 0, 1]),
            Some((vec![12, 5], vec![1, 0]))
        );
        // Nothing to merge.
        assert_eq!(merged_transpose(&[3, 4, 5], &[2, 1, 0]), None);
        assert_eq!(merged_transpose(&[3, 4], &[1, 0]), None);
    }
}
