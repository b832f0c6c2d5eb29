//! Reductions and the normalizations built on them (softmax).

use crate::lower::emit::{array_i64, int_list, Emitter};
use crate::lower::helpers::gather::along_dim_coords;
use crate::lower::helpers::scan::scan;
use crate::lower::helpers::widen::acc_dtype;
use crate::lower::Rule;
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
    ("aten.var_mean.correction", var_mean),
    ("aten.cumprod.default", cumprod),
    ("aten.logcumsumexp.default", logcumsumexp),
    ("aten.cummax.default", cummax),
    ("aten.cummin.default", cummin),
    ("aten.sort.default", sort),
    ("aten.sort.stable", sort),
    ("aten.topk.default", topk),
    ("aten.kthvalue.default", kthvalue),
    ("aten.mode.default", mode),
    ("aten.median.default", median_all),
    ("aten.nanmedian.default", median_all),
    ("aten.median.dim", median_dim),
    ("aten.nanmedian.dim", median_dim),
    ("aten.searchsorted.Tensor", searchsorted),
    ("aten.bucketize.Tensor", bucketize),
    ("aten.histc.default", histc),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;

/// How many elements each output of a reduction over `dims` combines (1 for a 0-d tensor, whose
/// only "dim" PyTorch accepts is the tensor itself).
fn reduced_count(x: &T, dims: &[i64]) -> i64 {
    dims.iter()
        .filter_map(|&d| x.shape.get(d as usize))
        .product()
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

/// `(var, mean)` of `var(self, dim, correction, keepdim)`: two-pass (mean, then squared
/// deviations), in the accumulation dtype.
fn var_and_mean<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> R<(T<'c, 'b>, T<'c, 'b>)> {
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
    let mean_shape = if keep {
        m.shape.clone()
    } else {
        r.shape.clone()
    };
    Ok((r, cx.e.reshape(&m, &mean_shape)?))
}

fn var<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (v, _) = var_and_mean(cx)?;
    Ok(vec![cx.e.convert(&v, cx.out_dtype()?)?])
}

/// `var_mean(self, dim, correction, keepdim) -> (var, mean)`.
fn var_mean<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (v, m) = var_and_mean(cx)?;
    Ok(vec![
        cx.e.convert(&v, cx.out(0)?.1)?,
        cx.e.convert(&m, cx.out(1)?.1)?,
    ])
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

/// `cumsum(self, dim, dtype)` / `cumprod`: a scan in the accumulation dtype.
fn cumulative<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, kind: ReduceKind) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let acc = acc_dtype(out);
    let xs = cx.e.convert(&x, acc)?;
    if x.rank() == 0 {
        return Ok(vec![cx.e.convert(&xs, out)?]);
    }
    let d = cx.dim(cx.int(1, "dim")?, x.rank())? as usize;
    let init = cx.e.splat(Emitter::reduce_init(kind, acc), &[], acc)?;
    let region = cx.e.scalar_region(kind, acc)?;
    let s = scan(cx.e, &[&xs], &[&init], d, region)?.remove(0);
    Ok(vec![cx.e.convert(&s, out)?])
}

fn cumsum<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    cumulative(cx, ReduceKind::Sum)
}

fn cumprod<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    cumulative(cx, ReduceKind::Prod)
}

/// `logcumsumexp(self, dim)`: a scan combining by log(e^a + e^b) = max + log1p(e^(min - max)),
/// exact for -inf (nothing yet) and +inf; NaN from the first NaN on.
fn logcumsumexp<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let acc = acc_dtype(out);
    let xs = cx.e.convert(&x, acc)?;
    if x.rank() == 0 {
        return Ok(vec![cx.e.convert(&xs, out)?]);
    }
    let d = cx.dim(cx.int(1, "dim")?, x.rank())? as usize;
    let init = cx.e.k(f64::NEG_INFINITY, acc)?;
    let region = cx.e.region(&[acc, acc], |e, a| {
        let mx = e.binary("stablehlo.maximum", &a[0], &a[1], acc)?;
        let mn = e.binary("stablehlo.minimum", &a[0], &a[1], acc)?;
        let r = e.add(
            &mx,
            &e.unary(
                "stablehlo.log_plus_one",
                &e.unary("stablehlo.exponential", &e.sub(&mn, &mx)?)?,
            )?,
        )?;
        let edge = e.or(
            &e.compare(&mn, &e.k(f64::NEG_INFINITY, acc)?, "EQ")?,
            &e.compare(&mx, &e.k(f64::INFINITY, acc)?, "EQ")?,
        )?;
        let r = e.select(&edge, &mx, &r, acc)?;
        // The plugin's maximum inside reductions skips NaNs: propagate them explicitly.
        let nan = e.or(&e.isnan(&a[0])?, &e.isnan(&a[1])?)?;
        Ok(vec![e.select(&nan, &e.add(&a[0], &a[1])?, &r, acc)?])
    })?;
    let s = scan(cx.e, &[&xs], &[&init], d, region)?.remove(0);
    Ok(vec![cx.e.convert(&s, out)?])
}

/// `cummax` / `cummin(self, dim) -> (values, indices)`: a scan over (value, index) pairs keeping
/// the greatest under PyTorch's order: a NaN beats any number, then the larger (smaller) value,
/// then on ties the later index (PyTorch's kernels update on `>=` / `<=`).
fn cumulative_extreme<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, kind: ReduceKind) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let e = cx.e;
    if x.rank() == 0 {
        return Ok(vec![x, e.splat(Scalar::Int(0), &[], DType::Int64)?]);
    }
    let d = cx.dim(cx.int(1, "dim")?, x.rank())? as usize;
    let dt = x.dtype;
    let idx = e.iota(&x.shape, d as i64, DType::Int64)?;
    let init_v = e.splat(Emitter::reduce_init(kind, dt), &[], dt)?;
    let init_i = e.splat(Scalar::Int(-1), &[], DType::Int64)?;
    let dir = if kind == ReduceKind::Max { "GT" } else { "LT" };
    let region = e.region(&[dt, DType::Int64, dt, DType::Int64], |e, a| {
        let (va, ia, vb, ib) = (&a[0], &a[1], &a[2], &a[3]);
        let a_nan = e.isnan(va)?;
        let b_nan = e.isnan(vb)?;
        let later = e.compare(ib, ia, "GT")?;
        let if_a_nan = e.and(&b_nan, &later)?;
        let better = e.or(
            &e.compare(vb, va, dir)?,
            &e.and(&e.compare(vb, va, "EQ")?, &later)?,
        )?;
        let if_a_num = e.or(&b_nan, &better)?;
        let take_b = e.select(&a_nan, &if_a_nan, &if_a_num, DType::Bool)?;
        Ok(vec![
            e.select(&take_b, vb, va, dt)?,
            e.select(&take_b, ib, ia, DType::Int64)?,
        ])
    })?;
    scan(e, &[&x, &idx], &[&init_v, &init_i], d, region)
}

fn cummax<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    cumulative_extreme(cx, ReduceKind::Max)
}

fn cummin<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    cumulative_extreme(cx, ReduceKind::Min)
}

/// Stable sort of `x` along `d` -> (values, original indices), PyTorch's order: NaN after every
/// number ascending, before every number descending.
pub fn sort_along<'c, 'b>(
    e: &Emitter<'c, 'b>,
    x: &T<'c, 'b>,
    d: usize,
    descending: bool,
) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let dt = x.dtype;
    let idx = e.iota(&x.shape, d as i64, DType::Int64)?;
    let region = e.region(&[dt, dt, DType::Int64, DType::Int64], |e, a| {
        let (p, q) = (&a[0], &a[1]);
        let p_nan = e.isnan(p)?;
        let q_nan = e.isnan(q)?;
        let before = if descending {
            e.or(
                &e.compare(p, q, "GT")?,
                &e.and(&p_nan, &e.unary("stablehlo.not", &q_nan)?)?,
            )?
        } else {
            e.or(
                &e.compare(p, q, "LT")?,
                &e.and(&e.unary("stablehlo.not", &p_nan)?, &q_nan)?,
            )?
        };
        Ok(vec![before])
    })?;
    let mut r = e.op_n(
        "stablehlo.sort",
        &[x, &idx],
        &[
            ("dimension", format!("{d} : i64")),
            ("is_stable", "true".into()),
        ],
        &[(x.shape.clone(), dt), (x.shape.clone(), DType::Int64)],
        vec![region],
    )?;
    let i = r.remove(1);
    Ok((r.remove(0), i))
}

/// `sort(self, dim=-1, descending=False)` and `sort.stable(self, *, stable, dim, descending)`.
fn sort<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let (dim, descending) = if cx.node.op.ends_with(".stable") {
        (
            cx.int_or(2, "dim", -1)?,
            cx.bool_or(3, "descending", false)?,
        )
    } else {
        (
            cx.int_or(1, "dim", -1)?,
            cx.bool_or(2, "descending", false)?,
        )
    };
    if x.rank() == 0 {
        return Ok(vec![x, cx.e.splat(Scalar::Int(0), &[], DType::Int64)?]);
    }
    let d = cx.dim(dim, x.rank())? as usize;
    let (v, i) = sort_along(cx.e, &x, d, descending)?;
    Ok(vec![v, i])
}

/// The first `k` entries of `t` along `d`.
fn leading<'c, 'b>(e: &Emitter<'c, 'b>, t: &T<'c, 'b>, d: usize, k: i64) -> R<T<'c, 'b>> {
    let mut limit = t.shape.clone();
    limit[d] = k;
    e.slice(t, &vec![0; t.rank()], &limit, &vec![1; t.rank()])
}

/// `topk(self, k, dim=-1, largest=True, sorted=True)`: the first k of a stable sort (NaN counts
/// as the largest).
fn topk<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let k = cx.int(1, "k")?;
    let largest = cx.bool_or(3, "largest", true)?;
    if x.rank() == 0 {
        return Ok(vec![x, cx.e.splat(Scalar::Int(0), &[], DType::Int64)?]);
    }
    let d = cx.dim(cx.int_or(2, "dim", -1)?, x.rank())? as usize;
    if k < 0 || k > x.shape[d] {
        return Err(cx.err(format!("topk: k={k} out of range for size {}", x.shape[d])));
    }
    let (v, i) = sort_along(cx.e, &x, d, largest)?;
    Ok(vec![leading(cx.e, &v, d, k)?, leading(cx.e, &i, d, k)?])
}

/// Entries of `t` at position `pos` (int64, `t`'s shape with `d` of size 1) along `d`.
fn take_at<'c, 'b>(e: &Emitter<'c, 'b>, t: &T<'c, 'b>, d: usize, pos: &T<'c, 'b>) -> R<T<'c, 'b>> {
    if t.numel() == 0 || pos.numel() == 0 {
        // Nothing to read (a gather cannot slice an empty operand).
        return e.splat(Scalar::Int(0), &pos.shape, t.dtype);
    }
    let coords = along_dim_coords(e, pos, d, t.shape[d])?;
    let r = t.rank() as i64;
    let all: Vec<i64> = (0..r).collect();
    let dnums = format!(
        "#stablehlo.gather<collapsed_slice_dims = [{}], start_index_map = [{}], index_vector_dim = {r}>",
        int_list(&all),
        int_list(&all)
    );
    e.op(
        "stablehlo.gather",
        &[t, &coords],
        &[
            ("dimension_numbers", dnums),
            ("slice_sizes", array_i64(&vec![1; t.rank()])),
            ("indices_are_sorted", "false".into()),
        ],
        &pos.shape,
        t.dtype,
    )
}

/// Drops dim `d` (of size 1) unless `keep`.
fn squeeze_unless<'c, 'b>(
    e: &Emitter<'c, 'b>,
    t: &T<'c, 'b>,
    d: usize,
    keep: bool,
) -> R<T<'c, 'b>> {
    if keep {
        return Ok(t.clone());
    }
    let mut s = t.shape.clone();
    s.remove(d);
    e.reshape(t, &s)
}

/// `kthvalue(self, k, dim=-1, keepdim=False)`: the k-th smallest (1-based) and its index.
fn kthvalue<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let k = cx.int(1, "k")?;
    let keep = cx.bool_or(3, "keepdim", false)?;
    if x.rank() == 0 {
        return Ok(vec![x, cx.e.splat(Scalar::Int(0), &[], DType::Int64)?]);
    }
    let d = cx.dim(cx.int_or(2, "dim", -1)?, x.rank())? as usize;
    if k < 1 || k > x.shape[d] {
        return Err(cx.err(format!(
            "kthvalue: k={k} out of range for size {}",
            x.shape[d]
        )));
    }
    let (v, i) = sort_along(cx.e, &x, d, false)?;
    let mut start = vec![0; x.rank()];
    let mut limit = x.shape.clone();
    start[d] = k - 1;
    limit[d] = k;
    let ones = vec![1; x.rank()];
    let v = cx.e.slice(&v, &start, &limit, &ones)?;
    let i = cx.e.slice(&i, &start, &limit, &ones)?;
    Ok(vec![
        squeeze_unless(cx.e, &v, d, keep)?,
        squeeze_unless(cx.e, &i, d, keep)?,
    ])
}

/// The most elements `mode` reduces over: PyTorch's CPU kernel sorts each row with `std::sort`,
/// which insertion-sorts (stably) up to 16 elements and reorders equal ones unpredictably beyond.
const MODE_MAX_SIZE: i64 = 16;

/// `mode(self, dim=-1, keepdim=False)` -> (values, indices), as PyTorch's CPU kernel computes
/// it: each row's (value, index) pairs insertion-sorted by value (libstdc++'s
/// `__insertion_sort`, unrolled: at most 16 elements), then the first longest run of equal
/// values (`!=` ends a run, so every NaN is a run of its own) gives the value and the index of
/// its last element. NaNs, which compare false, land where that sort leaves them, as in eager.
fn mode<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let x = cx.tensor(0, "self")?;
    let (vshape, vdtype) = cx.out(0)?;
    let (ishape, idtype) = cx.out(1)?;
    let (x, d) = if x.rank() == 0 {
        (e.reshape(&x, &[1])?, 0)
    } else {
        let d = cx.dim(cx.int_or(1, "dim", -1)?, x.rank())? as usize;
        (x, d)
    };
    let n = x.shape[d];
    if n == 0 {
        return Err(cx.err("mode over a dim of size 0"));
    }
    if n > MODE_MAX_SIZE {
        return Err(cx.err(format!(
            "mode over {n} > {MODE_MAX_SIZE} elements: PyTorch's index among equal values \
             (and its handling of NaN) follows std::sort's unstable order, which tpuc does not \
             reproduce"
        )));
    }
    // Columns along `d`, each of the batch shape.
    let mut batch = x.shape.clone();
    batch.remove(d);
    let ones = vec![1; x.rank()];
    let mut a = Vec::new();
    for k in 0..n {
        let mut start = vec![0; x.rank()];
        let mut limit = x.shape.clone();
        start[d] = k;
        limit[d] = k + 1;
        a.push(e.reshape(&e.slice(&x, &start, &limit, &ones)?, &batch)?);
    }
    let mut ix: Vec<T> = (0..n)
        .map(|k| e.splat(Scalar::Int(k), &batch, DType::Int64))
        .collect::<R<_>>()?;
    let key = |t: &T<'c, 'b>| -> R<T<'c, 'b>> {
        if t.dtype == DType::Bool {
            e.convert(t, DType::Int64)
        } else {
            Ok(t.clone())
        }
    };
    let less = |p: &T<'c, 'b>, q: &T<'c, 'b>| e.compare(&key(p)?, &key(q)?, "LT");
    let pick = |c: &T<'c, 'b>, p: &T<'c, 'b>, q: &T<'c, 'b>| e.select(c, p, q, p.dtype);
    for i in 1..n as usize {
        let (v, vi) = (a[i].clone(), ix[i].clone());
        // Smaller than the first: the prefix shifts right and v goes first. Else v moves left
        // while smaller than its left neighbour (`shift[j]`: a[j - 1] moves to j).
        let front = less(&v, &a[0])?;
        let mut shift = vec![None; i + 2];
        let mut run: Option<T> = None;
        for j in (1..=i).rev() {
            let c = less(&v, &a[j - 1])?;
            let s = match run {
                None => c,
                Some(r) => e.and(&r, &c)?,
            };
            shift[j] = Some(s.clone());
            run = Some(s);
        }
        let (old_a, old_ix) = (a.clone(), ix.clone());
        for j in 0..=i {
            let (na, ni) = if j == 0 {
                (old_a[0].clone(), old_ix[0].clone())
            } else {
                let s = shift[j].as_ref().expect("set for j >= 1");
                let here = match &shift[j + 1] {
                    Some(next) => e.and(next, &e.unary("stablehlo.not", s)?)?,
                    None => e.unary("stablehlo.not", s)?, // j == i: v stays unless it moves
                };
                let na = pick(s, &old_a[j - 1], &pick(&here, &v, &old_a[j])?)?;
                let ni = pick(s, &old_ix[j - 1], &pick(&here, &vi, &old_ix[j])?)?;
                (na, ni)
            };
            // The front case: v first, everything before i one to the right.
            let (fa, fi) = if j == 0 {
                (v.clone(), vi.clone())
            } else {
                (old_a[j - 1].clone(), old_ix[j - 1].clone())
            };
            a[j] = pick(&front, &fa, &na)?;
            ix[j] = pick(&front, &fi, &ni)?;
        }
    }
    // The first longest run of equal neighbours.
    let i64k = |v: i64| e.splat(Scalar::Int(v), &batch, DType::Int64);
    let mut best_v = e.splat(Scalar::Int(0), &batch, x.dtype)?;
    let mut best_i = i64k(0)?;
    let mut best_f = i64k(0)?;
    let mut run = i64k(0)?;
    for i in 0..n as usize {
        run = e.add(&run, &i64k(1)?)?;
        let ends = if i + 1 == n as usize {
            e.compare(&i64k(0)?, &i64k(0)?, "EQ")?
        } else {
            e.compare(&key(&a[i])?, &key(&a[i + 1])?, "NE")?
        };
        let better = e.and(&ends, &e.compare(&run, &best_f, "GT")?)?;
        best_v = pick(&better, &a[i], &best_v)?;
        best_i = pick(&better, &ix[i], &best_i)?;
        best_f = pick(&better, &run, &best_f)?;
        run = pick(&ends, &i64k(0)?, &run)?;
    }
    Ok(vec![
        e.reshape(&e.convert(&best_v, vdtype)?, &vshape)?,
        e.reshape(&e.convert(&best_i, idtype)?, &ishape)?,
    ])
}

/// Median along `d` (kept as size 1) -> (value, index). `median`: the lower median, NaN (and the
/// first NaN's index) when the row has one; `nanmedian`: the lower median of the numbers, NaN
/// for a row of NaNs.
fn median_along<'c, 'b>(
    e: &Emitter<'c, 'b>,
    x: &T<'c, 'b>,
    d: usize,
    ignore_nan: bool,
) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let (v, i) = sort_along(e, x, d, false)?;
    let n = x.shape[d];
    let i64k = |v: i64| e.splat(Scalar::Int(v), &[], DType::Int64);
    let numbers = e.convert(&e.unary("stablehlo.not", &e.isnan(x)?)?, DType::Int64)?;
    let valid = e.reduce(&numbers, &[d as i64], ReduceKind::Sum, true)?;
    let pos = if ignore_nan {
        let p = e.div(&e.sub(&valid, &i64k(1)?)?, &i64k(2)?)?;
        e.binary("stablehlo.maximum", &p, &i64k(0)?, DType::Int64)?
    } else {
        let has_nan = e.compare(&valid, &i64k(n)?, "LT")?;
        e.select(&has_nan, &valid, &i64k((n - 1) / 2)?, DType::Int64)?
    };
    Ok((take_at(e, &v, d, &pos)?, take_at(e, &i, d, &pos)?))
}

fn median_all<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    if x.numel() == 0 {
        return Err(cx.err("median of an empty tensor"));
    }
    let flat = cx.e.reshape(&x, &[x.numel()])?;
    let (v, _) = median_along(cx.e, &flat, 0, cx.node.op.starts_with("aten.nanmedian"))?;
    Ok(vec![cx.e.reshape(&v, &[])?])
}

fn median_dim<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let keep = cx.bool_or(2, "keepdim", false)?;
    if x.rank() == 0 {
        return Ok(vec![x, cx.e.splat(Scalar::Int(0), &[], DType::Int64)?]);
    }
    let d = cx.dim(cx.int_or(1, "dim", -1)?, x.rank())? as usize;
    let (v, i) = median_along(cx.e, &x, d, cx.node.op.starts_with("aten.nanmedian"))?;
    Ok(vec![
        squeeze_unless(cx.e, &v, d, keep)?,
        squeeze_unless(cx.e, &i, d, keep)?,
    ])
}

/// Insertion points of `values` in the rows of `seq` (sorted along its last dim; 1-D or with the
/// leading dims of `values`), counted instead of binary-searched: `left` counts the entries with
/// `!(entry >= v)`, right those with `!(entry > v)`, the comparisons PyTorch's binary search
/// makes (so a NaN value lands after everything).
fn insertion_points<'c, 'b>(
    e: &Emitter<'c, 'b>,
    seq: &T<'c, 'b>,
    values: &T<'c, 'b>,
    right: bool,
    out: DType,
) -> R<T<'c, 'b>> {
    let n = *seq.shape.last().unwrap_or(&1);
    let dt = crate::lower::emit::promote(seq.dtype, values.dtype);
    let mut shape = values.shape.clone();
    shape.push(n);
    let v = e.broadcast_in_dim(
        &e.convert(values, dt)?,
        &shape,
        &(0..values.rank() as i64).collect::<Vec<_>>(),
    )?;
    let s = e.convert(seq, dt)?;
    let s = if s.rank() == 1 {
        e.broadcast_in_dim(&s, &shape, &[shape.len() as i64 - 1])?
    } else {
        let mut dims: Vec<i64> = (0..s.rank() as i64 - 1).collect();
        dims.push(shape.len() as i64 - 1);
        e.broadcast_in_dim(&s, &shape, &dims)?
    };
    let dir = if right { "GT" } else { "GE" };
    let before = e.unary("stablehlo.not", &e.compare(&s, &v, dir)?)?;
    let count = e.reduce(
        &e.convert(&before, DType::Int64)?,
        &[shape.len() as i64 - 1],
        ReduceKind::Sum,
        false,
    )?;
    e.convert(&count, out)
}

/// `searchsorted(sorted_sequence, self, *, out_int32, right, side, sorter)`.
fn searchsorted<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let seq = cx.tensor(0, "sorted_sequence")?;
    let values = cx.tensor(1, "self")?;
    let mut right = cx.bool_or(3, "right", false)?;
    if let Some(Arg::Str(side)) = cx.arg(4, "side") {
        right = side == "right";
    }
    let seq = match cx.opt_tensor(5, "sorter")? {
        None => seq,
        Some(sorter) => {
            let d = seq.rank() - 1;
            take_at(cx.e, &seq, d, &sorter)?
        }
    };
    Ok(vec![insertion_points(
        cx.e,
        &seq,
        &values,
        right,
        cx.out_dtype()?,
    )?])
}

/// `bucketize(self, boundaries, *, out_int32, right)`: searchsorted with the arguments swapped.
fn bucketize<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let values = cx.tensor(0, "self")?;
    let seq = cx.tensor(1, "boundaries")?;
    let right = cx.bool_or(3, "right", false)?;
    Ok(vec![insertion_points(
        cx.e,
        &seq,
        &values,
        right,
        cx.out_dtype()?,
    )?])
}

/// `histc(self, bins=100, min=0, max=0)`: counts in `bins` equal bins over [min, max] (the data's
/// range when min == max, widened by 1 each way if that is empty too); elements outside and NaNs
/// are not counted, `max` itself goes to the last bin. The bin of x is
/// `floor((x - min) * bins / (max - min))`, computed in the input dtype as PyTorch's kernel does.
fn histc<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let bins = cx.int_or(1, "bins", 100)?;
    let lo = cx.float_or(2, "min", 0.0)?;
    let hi = cx.float_or(3, "max", 0.0)?;
    let (shape, out) = cx.out(0)?;
    let e = cx.e;
    let dt = if x.dtype.is_float() {
        x.dtype
    } else {
        DType::Float32
    };
    let flat = e.convert(&e.reshape(&x, &[x.numel()])?, dt)?;
    let (lo, hi) = if lo == hi {
        if x.numel() == 0 {
            (e.k(lo - 1.0, dt)?, e.k(hi + 1.0, dt)?)
        } else {
            let mn = e.reduce(&flat, &[0], ReduceKind::Min, false)?;
            let mx = e.reduce(&flat, &[0], ReduceKind::Max, false)?;
            let same = e.compare(&mn, &mx, "EQ")?;
            (
                e.select(&same, &e.sub(&mn, &e.k(1.0, dt)?)?, &mn, dt)?,
                e.select(&same, &e.add(&mx, &e.k(1.0, dt)?)?, &mx, dt)?,
            )
        }
    } else {
        (e.k(lo, dt)?, e.k(hi, dt)?)
    };
    let pos = e.div(
        &e.mul(&e.sub(&flat, &lo)?, &e.k(bins as f64, dt)?)?,
        &e.sub(&hi, &lo)?,
    )?;
    let pos = e.convert(&e.unary("stablehlo.floor", &pos)?, DType::Int64)?;
    let last = e.splat(Scalar::Int(bins - 1), &[], DType::Int64)?;
    let pos = e.binary("stablehlo.minimum", &pos, &last, DType::Int64)?;
    let inside = e.and(&e.compare(&flat, &lo, "GE")?, &e.compare(&flat, &hi, "LE")?)?;
    let n = x.numel();
    let grid = [n, bins];
    let hit = e.and(
        &e.compare(
            &e.broadcast_in_dim(&pos, &grid, &[0])?,
            &e.iota(&grid, 1, DType::Int64)?,
            "EQ",
        )?,
        &e.broadcast_in_dim(&inside, &grid, &[0])?,
    )?;
    let counts = e.reduce(&e.convert(&hit, out)?, &[0], ReduceKind::Sum, false)?;
    Ok(vec![e.reshape(&counts, &shape)?])
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
