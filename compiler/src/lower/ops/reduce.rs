//! Reductions and the normalizations built on them (softmax).

use crate::lower::registry::Rule;
use crate::lower::{NodeCx, ReduceKind, Scalar, R, T};
use tpuc_frontend_fx::{Arg, DType};

pub static RULES: &[(&str, Rule)] = &[
    ("aten.sum.dim_IntList", sum),
    ("aten.sum.default", sum),
    ("aten.mean.dim", mean),
    ("aten.mean.default", mean),
    ("aten.prod.dim_int", prod),
    ("aten.prod.default", prod),
    ("aten.amax.default", amax),
    ("aten.amin.default", amin),
    ("aten.any.dim", any),
    ("aten.any.dims", any),
    ("aten.any.default", any),
    ("aten.all.dim", all),
    ("aten.all.dims", all),
    ("aten.all.default", all),
    ("aten.var.correction", var),
    ("aten._softmax.default", softmax),
    ("aten._log_softmax.default", log_softmax),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;

/// Accumulation dtype: low-precision floats accumulate in f32, as PyTorch does.
pub fn acc_dtype(d: DType) -> DType {
    match d {
        DType::Float16 | DType::Bfloat16 => DType::Float32,
        d => d,
    }
}

/// The reduced dims: the `dim` argument (a list, one int, or absent = all dims).
fn reduce_dims(cx: &NodeCx, i: usize, name: &str, rank: usize) -> R<Vec<i64>> {
    let dims = match cx.arg(i, name) {
        None | Some(Arg::None) => vec![],
        Some(Arg::Int(d)) => vec![*d],
        _ => cx.ints(i, name)?,
    };
    if dims.is_empty() {
        return Ok((0..rank as i64).collect());
    }
    dims.iter().map(|&d| cx.dim(d, rank)).collect()
}

/// `(dims, keepdim)` for ops shaped like `sum(self, dim, keepdim, dtype)`; `.default`
/// overloads reduce everything.
fn dims_keep(cx: &NodeCx, x: &T) -> R<(Vec<i64>, bool)> {
    if cx.node.op.ends_with(".default") {
        return Ok(((0..x.rank() as i64).collect(), false));
    }
    Ok((
        reduce_dims(cx, 1, "dim", x.rank())?,
        cx.bool_or(2, "keepdim", false)?,
    ))
}

fn sum<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let (dims, keep) = dims_keep(cx, &x)?;
    let xs = cx.e.convert(&x, acc_dtype(out))?;
    let r = cx.e.reduce(&xs, &dims, ReduceKind::Sum, keep)?;
    Ok(vec![cx.e.convert(&r, out)?])
}

fn mean<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let (dims, keep) = dims_keep(cx, &x)?;
    let acc = acc_dtype(out);
    let r =
        cx.e.reduce(&cx.e.convert(&x, acc)?, &dims, ReduceKind::Sum, keep)?;
    let count: i64 = dims.iter().map(|&d| x.shape[d as usize]).product();
    let n = cx.e.splat(Scalar::Int(count), &[], acc)?;
    let r = cx.e.binary("stablehlo.divide", &r, &n, acc)?;
    Ok(vec![cx.e.convert(&r, out)?])
}

fn prod<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let (dims, keep) = dims_keep(cx, &x)?;
    let r = cx.e.reduce(
        &cx.e.convert(&x, acc_dtype(out))?,
        &dims,
        ReduceKind::Prod,
        keep,
    )?;
    Ok(vec![cx.e.convert(&r, out)?])
}

fn minmax<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, kind: ReduceKind) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let dims = reduce_dims(cx, 1, "dim", x.rank())?;
    let keep = cx.bool_or(2, "keepdim", false)?;
    Ok(vec![cx.e.reduce(&x, &dims, kind, keep)?])
}

fn amax<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    minmax(cx, ReduceKind::Max)
}

fn amin<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    minmax(cx, ReduceKind::Min)
}

fn boolean<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, kind: ReduceKind) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let (dims, keep) = dims_keep(cx, &x)?;
    let r =
        cx.e.reduce(&cx.e.convert(&x, DType::Bool)?, &dims, kind, keep)?;
    Ok(vec![cx.e.convert(&r, cx.out_dtype()?)?])
}

fn any<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    boolean(cx, ReduceKind::Or)
}

fn all<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    boolean(cx, ReduceKind::And)
}

/// `var(self, dim, correction, keepdim)`: two-pass (mean, then squared deviations).
fn var<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let acc = acc_dtype(out);
    let dims = reduce_dims(cx, 1, "dim", x.rank())?;
    let correction = match cx.node.kwargs.get("correction") {
        Some(Arg::Int(c)) => *c as f64,
        Some(Arg::Float(c)) => *c,
        _ => 1.0,
    };
    let keep = match cx.node.kwargs.get("keepdim") {
        Some(Arg::Bool(b)) => *b,
        _ => false,
    };
    let xf = cx.e.convert(&x, acc)?;
    let count: i64 = dims.iter().map(|&d| x.shape[d as usize]).product();
    let n = cx.e.splat(Scalar::Int(count), &[], acc)?;
    let m = cx.e.binary(
        "stablehlo.divide",
        &cx.e.reduce(&xf, &dims, ReduceKind::Sum, true)?,
        &n,
        acc,
    )?;
    let d = cx.e.binary("stablehlo.subtract", &xf, &m, acc)?;
    let sq = cx.e.binary("stablehlo.multiply", &d, &d, acc)?;
    let s = cx.e.reduce(&sq, &dims, ReduceKind::Sum, keep)?;
    let denom = cx.e.splat(
        Scalar::Float((count as f64 - correction).max(0.0)),
        &[],
        acc,
    )?;
    let r = cx.e.binary("stablehlo.divide", &s, &denom, acc)?;
    Ok(vec![cx.e.convert(&r, out)?])
}

/// `x - max(x)` along `dim`, in the accumulation dtype: the stable start of (log-)softmax.
fn shifted<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> R<(T<'c, 'b>, i64)> {
    let x = cx.tensor(0, "self")?;
    let d = cx.dim(cx.int(1, "dim")?, x.rank())?;
    let acc = acc_dtype(cx.out_dtype()?.max_float(x.dtype));
    let xf = cx.e.convert(&x, acc)?;
    let m = cx.e.reduce(&xf, &[d], ReduceKind::Max, true)?;
    Ok((cx.e.binary("stablehlo.subtract", &xf, &m, acc)?, d))
}

fn softmax<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (s, d) = shifted(cx)?;
    let e = cx.e.unary("stablehlo.exponential", &s)?;
    let z = cx.e.reduce(&e, &[d], ReduceKind::Sum, true)?;
    let r = cx.e.binary("stablehlo.divide", &e, &z, s.dtype)?;
    Ok(vec![cx.e.convert(&r, cx.out_dtype()?)?])
}

fn log_softmax<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (s, d) = shifted(cx)?;
    let e = cx.e.unary("stablehlo.exponential", &s)?;
    let z = cx.e.unary(
        "stablehlo.log",
        &cx.e.reduce(&e, &[d], ReduceKind::Sum, true)?,
    )?;
    let r = cx.e.binary("stablehlo.subtract", &s, &z, s.dtype)?;
    Ok(vec![cx.e.convert(&r, cx.out_dtype()?)?])
}

trait MaxFloat {
    fn max_float(self, other: DType) -> DType;
}

impl MaxFloat for DType {
    /// The wider of two float dtypes (softmax with `half_to_float` outputs f32 from f16).
    fn max_float(self, other: DType) -> DType {
        if self.byte_size() >= other.byte_size() {
            self
        } else {
            other
        }
    }
}
