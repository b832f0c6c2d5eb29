//! Reductions and the normalizations built on them (softmax).

use crate::lower::emit::{array_i64, Emitter};
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
    ("aten.max.default", max_all),
    ("aten.min.default", min_all),
    ("aten.max.dim", max_dim),
    ("aten.min.dim", min_dim),
    ("aten.argmax.default", argmax),
    ("aten.argmin.default", argmin),
    ("aten.any.dim", any),
    ("aten.any.dims", any),
    ("aten.any.default", any),
    ("aten.all.dim", all),
    ("aten.all.dims", all),
    ("aten.all.default", all),
    ("aten.var.correction", var),
    ("aten._softmax.default", softmax),
    ("aten._log_softmax.default", log_softmax),
    ("aten.cumsum.default", cumsum),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;

/// How many elements each output of a reduction over `dims` combines (1 for a 0-d tensor, whose
/// only "dim" PyTorch accepts is the tensor itself).
fn reduced_count(x: &T, dims: &[i64]) -> i64 {
    dims.iter()
        .filter_map(|&d| x.shape.get(d as usize))
        .product()
}

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
    let count = reduced_count(&x, &dims);
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
    Ok(vec![cx.e.reduce_nan(&x, &dims, kind, keep)?])
}

/// `max(self)` / `min(self)`: the extreme of all elements, NaN if any is NaN.
fn extreme_all<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, kind: ReduceKind) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let dims: Vec<i64> = (0..x.rank() as i64).collect();
    Ok(vec![cx.e.reduce_nan(&x, &dims, kind, false)?])
}

fn max_all<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    extreme_all(cx, ReduceKind::Max)
}

fn min_all<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    extreme_all(cx, ReduceKind::Min)
}

/// The extreme along `dim` (NaN-propagating) and the first index where it occurs (a NaN's
/// index when there is one), as `max.dim` / `argmax` return them.
fn extreme_with_index<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    x: &T<'c, 'b>,
    d: usize,
    kind: ReduceKind,
    keep: bool,
) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let e = cx.e;
    let v = e.reduce_nan(x, &[d as i64], kind, true)?;
    let mut hit = e.compare(x, &v, "EQ")?;
    if x.dtype.is_float() {
        let both_nan = e.binary(
            "stablehlo.and",
            &e.compare(x, x, "NE")?,
            &e.compare(&v, &v, "NE")?,
            DType::Bool,
        )?;
        hit = e.binary("stablehlo.or", &hit, &both_nan, DType::Bool)?;
    }
    let iota = e.iota(&x.shape, d as i64, DType::Int64)?;
    let past_end = e.splat(Scalar::Int(x.shape[d]), &[], DType::Int64)?;
    let idx = e.select(&hit, &iota, &past_end, DType::Int64)?;
    let i = e.reduce(&idx, &[d as i64], ReduceKind::Min, keep)?;
    let v = if keep {
        v
    } else {
        let mut s = x.shape.clone();
        s.remove(d);
        e.reshape(&v, &s)?
    };
    Ok((v, i))
}

fn extreme_dim<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, kind: ReduceKind) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let keep = cx.bool_or(2, "keepdim", false)?;
    if x.rank() == 0 {
        let zero = cx.e.splat(Scalar::Int(0), &[], DType::Int64)?;
        return Ok(vec![x, zero]);
    }
    let d = cx.dim(cx.int(1, "dim")?, x.rank())? as usize;
    let (v, i) = extreme_with_index(cx, &x, d, kind, keep)?;
    Ok(vec![v, i])
}

fn max_dim<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    extreme_dim(cx, ReduceKind::Max)
}

fn min_dim<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    extreme_dim(cx, ReduceKind::Min)
}

/// `argmax(self, dim=None, keepdim=False)`; without `dim`, over the flattened tensor.
fn arg_extreme<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, kind: ReduceKind) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let keep = cx.bool_or(2, "keepdim", false)?;
    let out_shape = cx.out_shape()?;
    let (x, d) = match cx.arg(1, "dim") {
        None | Some(Arg::None) => (cx.e.reshape(&x, &[x.numel()])?, 0),
        _ if x.rank() == 0 => (cx.e.reshape(&x, &[1])?, 0),
        _ => {
            let d = cx.dim(cx.int(1, "dim")?, x.rank())? as usize;
            (x, d)
        }
    };
    let (_, i) = extreme_with_index(cx, &x, d, kind, keep)?;
    Ok(vec![cx.e.reshape(&i, &out_shape)?])
}

fn argmax<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    arg_extreme(cx, ReduceKind::Max)
}

fn argmin<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    arg_extreme(cx, ReduceKind::Min)
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
    let count = reduced_count(&x, &dims);
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

/// `cumsum(self, dim, dtype)`: a sum over a window that covers everything up to each element
/// (reduce_window with the window's length of low padding), in the accumulation dtype.
fn cumsum<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let acc = acc_dtype(out);
    let xs = cx.e.convert(&x, acc)?;
    if x.rank() == 0 {
        return Ok(vec![cx.e.convert(&xs, out)?]);
    }
    let d = cx.dim(cx.int(1, "dim")?, x.rank())? as usize;
    let r = x.rank();
    let n = x.shape[d];
    let mut window = vec![1; r];
    window[d] = n.max(1);
    let pads: Vec<String> = (0..r)
        .map(|k| {
            if k == d {
                format!("[{}, 0]", (n - 1).max(0))
            } else {
                "[0, 0]".into()
            }
        })
        .collect();
    let init =
        cx.e.splat(Emitter::reduce_init(ReduceKind::Sum, acc), &[], acc)?;
    let region = cx.e.scalar_region(ReduceKind::Sum, acc)?;
    let s =
        cx.e.op_n(
            "stablehlo.reduce_window",
            &[&xs, &init],
            &[
                ("window_dimensions", array_i64(&window)),
                ("window_strides", array_i64(&vec![1; r])),
                (
                    "padding",
                    format!("dense<[{}]> : tensor<{r}x2xi64>", pads.join(", ")),
                ),
            ],
            &[(x.shape.clone(), acc)],
            vec![region],
        )?
        .remove(0);
    Ok(vec![cx.e.convert(&s, out)?])
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
