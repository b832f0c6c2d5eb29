//! `histogram` and `histogramdd` with a bin count or explicit bin edges. The edges follow
//! PyTorch: the range is the data's min/max (widened by 0.5 each way when they are equal;
//! [0, 1] for no data) and `linspace` spaces them (`start + i step` in the first half,
//! `end - (n - 1 - i) step` in the second). An element falls in bin `#{edges <= x} - 1` (the
//! last bin includes its right edge), elements outside the edges are dropped; counts (or
//! weights) are added with a scatter. Memory stays linear in the number of values.

use crate::lower::emit::Emitter;
use crate::lower::helpers::gather::take_along;
use crate::lower::Rule;
use crate::lower::{NodeCx, ReduceKind, Scalar, R, T};
use tpuc_frontend_fx::{Arg, DType};

pub static RULES: &[(&str, Rule)] = &[
    ("aten.histogram.bin_ct", histogram_bin_ct),
    ("aten.histogram.bins_tensor", histogram_bins_tensor),
    ("aten._histogramdd_bin_edges.default", histogramdd_bin_edges),
    (
        "aten._histogramdd_from_bin_cts.default",
        histogramdd_from_bin_cts,
    ),
    (
        "aten._histogramdd_from_bin_tensors.default",
        histogramdd_from_bin_tensors,
    ),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;
const I64: DType = DType::Int64;

fn range_arg(cx: &NodeCx, i: usize) -> R<Option<Vec<f64>>> {
    match cx.arg(i, "range") {
        None | Some(Arg::None) => Ok(None),
        Some(Arg::List(items)) => items
            .iter()
            .map(|a| match a {
                Arg::Float(v) => Ok(*v),
                Arg::Int(v) => Ok(*v as f64),
                other => Err(cx.err(format!("`range`: expected floats, got {other:?}"))),
            })
            .collect::<R<Vec<_>>>()
            .map(Some),
        other => Err(cx.err(format!("`range`: expected a list, got {other:?}"))),
    }
}

/// Column `d` of the (N, D) samples.
fn column<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>, d: i64) -> R<T<'c, 'b>> {
    let n = x.shape[0];
    let c = e.slice(x, &[0, d], &[n, d + 1], &[1, 1])?;
    e.reshape(&c, &[n])
}

/// `bins + 1` edges from the range or the data's min/max.
fn linear_edges<'c, 'b>(
    e: &Emitter<'c, 'b>,
    col: &T<'c, 'b>,
    bins: i64,
    range: Option<(f64, f64)>,
) -> R<T<'c, 'b>> {
    let dt = col.dtype;
    let (lo, hi) = match range {
        Some((a, b)) => (e.k(a, dt)?, e.k(b, dt)?),
        None if col.shape[0] == 0 => (e.k(0.0, dt)?, e.k(1.0, dt)?),
        None => (
            e.reduce(col, &[0], ReduceKind::Min, false)?,
            e.reduce(col, &[0], ReduceKind::Max, false)?,
        ),
    };
    let same = e.compare(&lo, &hi, "EQ")?;
    let lo = e.select(&same, &e.sub(&lo, &e.k(0.5, dt)?)?, &lo, dt)?;
    let hi = e.select(&same, &e.add(&hi, &e.k(0.5, dt)?)?, &hi, dt)?;
    let steps = bins + 1;
    let step = e.div(&e.sub(&hi, &lo)?, &e.k(bins as f64, dt)?)?;
    let i = e.iota(&[steps], 0, dt)?;
    let first = e.add(&lo, &e.mul(&step, &i)?)?;
    let back = e.sub(&e.k((steps - 1) as f64, dt)?, &i)?;
    let second = e.sub(&hi, &e.mul(&step, &back)?)?;
    let ii = e.iota(&[steps], 0, I64)?;
    let low_half = e.compare(&ii, &e.splat(Scalar::Int(steps / 2), &[], I64)?, "LT")?;
    e.select(&low_half, &first, &second, dt)
}

/// Bin index of each value and whether it is inside the edges: `upper_bound(edges, x) - 1`
/// (the last bin includes its right edge), by the steps of `std::upper_bound` (what PyTorch's
/// kernel uses), unrolled: memory linear in the values.
fn bin_of<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    col: &T<'c, 'b>,
    edges: &T<'c, 'b>,
) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let e = cx.e;
    let n = col.shape[0];
    let ne = edges.shape[0];
    let edges = e.convert(edges, col.dtype)?;
    let first_e = e.reshape(&e.slice(&edges, &[0], &[1], &[1])?, &[])?;
    let last_e = e.reshape(&e.slice(&edges, &[ne - 1], &[ne], &[1])?, &[])?;
    let inside = e.and(
        &e.compare(col, &first_e, "GE")?,
        &e.compare(col, &last_e, "LE")?,
    )?;
    let k = |v: i64| e.splat(Scalar::Int(v), &[], I64);
    let mut first = e.splat(Scalar::Int(0), &[n], I64)?;
    let mut len = e.splat(Scalar::Int(ne), &[n], I64)?;
    let steps = 64 - (ne as u64).leading_zeros();
    for _ in 0..steps {
        let active = e.compare(&len, &k(0)?, "GT")?;
        let half = e.op(
            "stablehlo.shift_right_logical",
            &[&len, &e.broadcast_to(&k(1)?, &[n])?],
            &[],
            &[n],
            I64,
        )?;
        let middle = e.add(&first, &half)?;
        let at = e.op(
            "stablehlo.clamp",
            &[&k(0)?, &middle, &k(ne - 1)?],
            &[],
            &[n],
            I64,
        )?;
        let em = take_along(cx.e, &edges, 0, &at, &[n])?;
        // !(x < e[middle]): go right.
        let right = e.unary("stablehlo.not", &e.compare(col, &em, "LT")?)?;
        let go_right = e.and(&active, &right)?;
        let go_left = e.and(&active, &e.unary("stablehlo.not", &right)?)?;
        let f2 = e.add(&middle, &k(1)?)?;
        let l2 = e.sub(&e.sub(&len, &half)?, &k(1)?)?;
        first = e.select(&go_right, &f2, &first, I64)?;
        len = e.select(&go_right, &l2, &e.select(&go_left, &half, &len, I64)?, I64)?;
    }
    let pos = e.sub(&first, &k(1)?)?;
    // The right edge itself belongs to the last bin.
    let last_bin = k((ne - 2).max(0))?;
    let pos = e.op(
        "stablehlo.clamp",
        &[&k(0)?, &pos, &last_bin],
        &[],
        &[n],
        I64,
    )?;
    Ok((pos, inside))
}

/// The histogram over bins `sizes` of samples with per-dim bin indices, weighted, optionally
/// a density over the edges.
fn accumulate<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    bins: &[(T<'c, 'b>, T<'c, 'b>)],
    sizes: &[i64],
    edges: &[T<'c, 'b>],
    weight: Option<T<'c, 'b>>,
    density: bool,
    dtype: DType,
) -> R<T<'c, 'b>> {
    let e = cx.e;
    let total: i64 = sizes.iter().product();
    let n = bins[0].0.shape[0];
    if n == 0 || total == 0 {
        return e.splat(Scalar::Int(0), sizes, dtype);
    }
    let mut flat = e.splat(Scalar::Int(0), &[n], I64)?;
    let mut inside = e.splat(Scalar::Bool(true), &[n], DType::Bool)?;
    for (k, (idx, ok)) in bins.iter().enumerate() {
        let stride: i64 = sizes[k + 1..].iter().product();
        let s = e.splat(Scalar::Int(stride), &[], I64)?;
        flat = e.add(&flat, &e.mul(idx, &s)?)?;
        inside = e.and(&inside, ok)?;
    }
    let zero_i = e.splat(Scalar::Int(0), &[], I64)?;
    let flat = e.select(&inside, &flat, &zero_i, I64)?;
    let w = match weight {
        Some(w) => e.convert(&e.reshape(&w, &[n])?, dtype)?,
        None => e.splat(Scalar::Int(1), &[n], dtype)?,
    };
    let w = e.select(&inside, &w, &e.splat(Scalar::Int(0), &[], dtype)?, dtype)?;
    let zeros = e.splat(Scalar::Int(0), &[total], dtype)?;
    let idx = e.reshape(&flat, &[n, 1])?;
    let hist = e.scatter(&zeros, &idx, &w, &[], &[0], &[0], true)?;
    let mut hist = e.reshape(&hist, sizes)?;
    if density {
        let all: Vec<i64> = (0..sizes.len() as i64).collect();
        let sum = e.reduce(&hist, &all, ReduceKind::Sum, false)?;
        hist = e.div(&hist, &sum)?;
        for (k, ed) in edges.iter().enumerate() {
            let ne = ed.shape[0];
            let ed = e.convert(ed, dtype)?;
            let len = e.sub(
                &e.slice(&ed, &[1], &[ne], &[1])?,
                &e.slice(&ed, &[0], &[ne - 1], &[1])?,
            )?;
            let lb = e.broadcast_in_dim(&len, sizes, &[k as i64])?;
            hist = e.div(&hist, &lb)?;
        }
    }
    Ok(hist)
}

fn samples<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, dims: Option<usize>) -> R<T<'c, 'b>> {
    let x = cx.tensor(0, "self")?;
    let d = match dims {
        Some(d) => d as i64,
        None => 1,
    };
    let n = if d == 0 { 0 } else { x.numel() / d };
    cx.e.reshape(&x, &[n, d])
}

fn histogram_bin_ct<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let x = samples(cx, None)?;
    let bins = cx.int_or(1, "bins", 100)?;
    let range = range_arg(cx, 2)?.map(|r| (r[0], r[1]));
    let weight = cx.opt_tensor(3, "weight")?;
    let density = cx.bool_or(4, "density", false)?;
    let col = column(e, &x, 0)?;
    let edges = linear_edges(e, &col, bins, range)?;
    let b = bin_of(cx, &col, &edges)?;
    let h = accumulate(
        cx,
        &[b],
        &[bins],
        std::slice::from_ref(&edges),
        weight,
        density,
        cx.out_dtype()?,
    )?;
    Ok(vec![h, edges])
}

fn histogram_bins_tensor<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let x = samples(cx, None)?;
    let edges = cx.tensor(1, "bins")?;
    let weight = cx.opt_tensor(2, "weight")?;
    let density = cx.bool_or(3, "density", false)?;
    let col = column(e, &x, 0)?;
    let nb = edges.shape[0] - 1;
    let b = bin_of(cx, &col, &edges)?;
    let h = accumulate(
        cx,
        &[b],
        &[nb],
        std::slice::from_ref(&edges),
        weight,
        density,
        cx.out_dtype()?,
    )?;
    let (es, ed) = cx.out(1)?;
    Ok(vec![h, e.convert(&e.reshape(&edges, &es)?, ed)?])
}

fn dd_edges<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> R<(T<'c, 'b>, Vec<i64>, Vec<T<'c, 'b>>)> {
    let bins = cx.ints(1, "bins")?;
    let x = samples(cx, Some(bins.len()))?;
    let range = range_arg(cx, 2)?;
    let edges = (0..bins.len())
        .map(|d| {
            let col = column(cx.e, &x, d as i64)?;
            let r = range.as_ref().map(|r| (r[2 * d], r[2 * d + 1]));
            linear_edges(cx.e, &col, bins[d], r)
        })
        .collect::<R<Vec<_>>>()?;
    Ok((x, bins, edges))
}

fn histogramdd_bin_edges<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    Ok(dd_edges(cx)?.2)
}

fn histogramdd_from_bin_cts<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (x, bins, edges) = dd_edges(cx)?;
    let weight = cx.opt_tensor(3, "weight")?;
    let density = cx.bool_or(4, "density", false)?;
    Ok(vec![dd_counts(cx, &x, &bins, &edges, weight, density)?])
}

fn histogramdd_from_bin_tensors<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let edges = cx.tensors(1, "bins")?;
    let x = samples(cx, Some(edges.len()))?;
    let weight = cx.opt_tensor(2, "weight")?;
    let density = cx.bool_or(3, "density", false)?;
    let sizes: Vec<i64> = edges.iter().map(|t| t.shape[0] - 1).collect();
    Ok(vec![dd_counts(cx, &x, &sizes, &edges, weight, density)?])
}

/// The histogramdd counts of the (n, D) samples `x` over per-dim `edges` (`sizes` bins each).
fn dd_counts<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    x: &T<'c, 'b>,
    sizes: &[i64],
    edges: &[T<'c, 'b>],
    weight: Option<T<'c, 'b>>,
    density: bool,
) -> R<T<'c, 'b>> {
    let b = edges
        .iter()
        .enumerate()
        .map(|(d, ed)| bin_of(cx, &column(cx.e, x, d as i64)?, ed))
        .collect::<R<Vec<_>>>()?;
    accumulate(cx, &b, sizes, edges, weight, density, cx.out_dtype()?)
}
