//! Matrix products (`mm`, `bmm`, `addmm`, `baddbmm`, `addmv`, `addbmm`, `_trilinear`) and the
//! distances built on them (`dist`, `cdist`, `pdist`, and the latter two's backward). They honour the session precision
//! (`precision_config`); low-precision operands accumulate in f32 and round once, as PyTorch's
//! CPU kernels do.

use crate::lower::emit::Emitter;
use crate::lower::helpers::matmul::host_matmul;
use crate::lower::helpers::widen::acc_dtype;
use crate::lower::Rule;
use crate::lower::{NodeCx, ReduceKind, Scalar, R, T};
use tpuc_frontend_fx::{Arg, DType};

pub static RULES: &[(&str, Rule)] = &[
    ("aten.mm.default", mm),
    ("aten.addmm.default", addmm),
    ("aten.bmm.default", bmm),
    ("aten.baddbmm.default", baddbmm),
    ("aten.addmv.default", addmv),
    ("aten.addbmm.default", addbmm),
    ("aten.dist.default", dist),
    ("aten._cdist_forward.default", cdist),
    ("aten._pdist_forward.default", pdist),
    ("aten._cdist_backward.default", cdist_backward),
    ("aten._pdist_backward.default", pdist_backward),
    ("aten._trilinear.default", trilinear),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;

/// `a @ b` over the given batch/contracting dims, in the accumulation dtype (f32 for f16/bf16;
/// the caller rounds to the output dtype once, after any bias is added).
fn dot_acc<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    a: &T<'c, 'b>,
    b: &T<'c, 'b>,
    batch: (&[i64], &[i64]),
    contract: (&[i64], &[i64]),
) -> R<T<'c, 'b>> {
    let (shape, out) = cx.out(0)?;
    let acc = acc_dtype(out);
    let a = cx.e.convert(a, out)?;
    let b = cx.e.convert(b, out)?;
    cx.e.dot_general(&a, &b, batch, contract, &shape, acc)
}

/// `a @ b` for `mm`/`bmm` operands read through their (folded) permutations `pa`, `pb`: the
/// logical `[batch,] m, k` and `[batch,] k, n` dims are dims `pa[..]`, `pb[..]` of the tensors,
/// so `dot_general` contracts those and no transpose is emitted. Its result dims (batch, the
/// lhs's free dim, the rhs's free dim) are `[batch,] m, n` whatever the permutations.
fn matmul_acc<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    (a, pa): &(T<'c, 'b>, Vec<i64>),
    (b, pb): &(T<'c, 'b>, Vec<i64>),
) -> R<T<'c, 'b>> {
    if let Some(r) = host_gemm(cx, (a, pa), (b, pb))? {
        return Ok(r);
    }
    if pa.len() == 3 {
        dot_acc(cx, a, b, (&pa[..1], &pb[..1]), (&pa[2..], &pb[1..2]))
    } else {
        dot_acc(cx, a, b, (&[], &[]), (&pa[1..], &pb[..1]))
    }
}

/// The product through the host BLAS (`tpuc_sgemm_<a><b>`, see `tpuc_hostkernels::host_blas`) where
/// the session enables it and [`host_matmul`] takes it, operands stored as given or transposed
/// in their last two dims (a batch dim first). None where XLA's dot computes it.
fn host_gemm<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    (a, pa): (&T<'c, 'b>, &[i64]),
    (b, pb): (&T<'c, 'b>, &[i64]),
) -> R<Option<T<'c, 'b>>> {
    if cx.e.host_gemm_min_macs.is_none() {
        return Ok(None);
    }
    // Operand dtypes are checked by host_matmul.
    let (shape, out) = cx.out(0)?;
    if out != DType::Float32 {
        return Ok(None);
    }
    let r = pa.len();
    if !(2..=3).contains(&r) || pb.len() != r {
        return Ok(None);
    }
    let lead: Vec<i64> = (0..r as i64 - 2).collect();
    // Stored as given ([.., rows, cols] = logical) or with the last two dims swapped.
    let transposed = |p: &[i64]| -> Option<bool> {
        if p[..r - 2] != lead[..] {
            return None;
        }
        match (p[r - 2] - lead.len() as i64, p[r - 1] - lead.len() as i64) {
            (0, 1) => Some(false),
            (1, 0) => Some(true),
            _ => None,
        }
    };
    let (Some(ta), Some(tb)) = (transposed(pa), transposed(pb)) else {
        return Ok(None);
    };
    host_matmul(cx.e, (a, ta), (b, tb), &shape)
}

fn mm<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let a = cx.matrix(0, "self")?;
    let b = cx.matrix(1, "mat2")?;
    let r = matmul_acc(cx, &a, &b)?;
    Ok(vec![cx.e.convert(&r, cx.out_dtype()?)?])
}

fn bmm<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    mm(cx)
}

/// `beta * input + alpha * product` in the accumulation dtype, rounded once to the output
/// dtype (as PyTorch's fused CPU kernels do), skipping multiplications by 1.
fn scaled_sum<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, input: &T<'c, 'b>, prod: T<'c, 'b>) -> R<T<'c, 'b>> {
    let final_dtype = cx.out_dtype()?;
    let out = prod.dtype;
    let scale = |t: T<'c, 'b>, i: usize, name: &str| -> R<T<'c, 'b>> {
        match cx.arg(i, name) {
            None | Some(Arg::None) => Ok(t),
            _ => {
                let s = cx.scalar(i, name)?;
                if s.as_f64() == 1.0 {
                    return Ok(t);
                }
                let k = cx.e.splat(s, &[], out)?;
                cx.e.binary("stablehlo.multiply", &t, &k, out)
            }
        }
    };
    let beta_is_zero = matches!(cx.arg(3, "beta"), Some(Arg::Int(0)) | Some(Arg::Float(0.0)));
    let prod = scale(prod, 4, "alpha")?;
    if beta_is_zero {
        // beta = 0 ignores `input` entirely, NaNs included.
        return cx.e.convert(&prod, final_dtype);
    }
    let input = scale(cx.e.convert(input, out)?, 3, "beta")?;
    let sum = cx.e.binary("stablehlo.add", &input, &prod, out)?;
    cx.e.convert(&sum, final_dtype)
}

fn addmm<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let input = cx.tensor(0, "self")?;
    let a = cx.matrix(1, "mat1")?;
    let b = cx.matrix(2, "mat2")?;
    let p = matmul_acc(cx, &a, &b)?;
    Ok(vec![scaled_sum(cx, &input, p)?])
}

fn baddbmm<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let input = cx.tensor(0, "self")?;
    let a = cx.matrix(1, "batch1")?;
    let b = cx.matrix(2, "batch2")?;
    let p = matmul_acc(cx, &a, &b)?;
    Ok(vec![scaled_sum(cx, &input, p)?])
}

/// `addmv(self, mat, vec, beta=1, alpha=1)`.
fn addmv<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let input = cx.tensor(0, "self")?;
    let a = cx.tensor(1, "mat")?;
    let v = cx.tensor(2, "vec")?;
    let p = dot_acc(cx, &a, &v, (&[], &[]), (&[1], &[0]))?;
    Ok(vec![scaled_sum(cx, &input, p)?])
}

/// `addbmm(self, batch1, batch2, beta=1, alpha=1)`: the batched products summed over the batch.
fn addbmm<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let input = cx.tensor(0, "self")?;
    let a = cx.tensor(1, "batch1")?;
    let b = cx.tensor(2, "batch2")?;
    let p = dot_acc(cx, &a, &b, (&[], &[]), (&[0, 2], &[0, 1]))?;
    Ok(vec![scaled_sum(cx, &input, p)?])
}

/// The p-norm of `d` over `dim` (p = 0 counts non-zeros, p = inf is the largest magnitude).
fn pnorm<'c, 'b>(e: &Emitter<'c, 'b>, d: &T<'c, 'b>, dim: i64, p: f64) -> R<T<'c, 'b>> {
    let dt = d.dtype;
    let a = e.unary("stablehlo.abs", d)?;
    if p == 0.0 {
        let nz = e.convert(&e.compare(&a, &e.k(0.0, dt)?, "NE")?, dt)?;
        return e.reduce(&nz, &[dim], ReduceKind::Sum, false);
    }
    if p.is_infinite() {
        let kind = if p > 0.0 {
            ReduceKind::Max
        } else {
            ReduceKind::Min
        };
        return e.reduce_nan(&a, &[dim], kind, false);
    }
    if p == 1.0 {
        return e.reduce(&a, &[dim], ReduceKind::Sum, false);
    }
    if p == 2.0 {
        let s = e.reduce(&e.mul(d, d)?, &[dim], ReduceKind::Sum, false)?;
        return e.unary("stablehlo.sqrt", &s);
    }
    let pw = e.binary("stablehlo.power", &a, &e.k(p, dt)?, dt)?;
    let s = e.reduce(&pw, &[dim], ReduceKind::Sum, false)?;
    e.binary("stablehlo.power", &s, &e.k(1.0 / p, dt)?, dt)
}

/// `dist(self, other, p=2)`: the p-norm of the (broadcast) difference.
fn dist<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let a = cx.tensor(0, "self")?;
    let b = cx.tensor(1, "other")?;
    let p = cx.float_or(2, "p", 2.0)?;
    let out = cx.out_dtype()?;
    let acc = acc_dtype(out);
    let e = cx.e;
    let d = e.binary("stablehlo.subtract", &a, &b, acc)?;
    let flat = e.reshape(&d, &[d.numel()])?;
    Ok(vec![e.convert(&pnorm(e, &flat, 0, p)?, out)?])
}

/// `_cdist_forward(x1 [.., P, M], x2 [.., R, M], p, compute_mode) -> [.., P, R]`: every pairwise
/// difference, then its p-norm (exact, not the matmul expansion).
fn cdist<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x1 = cx.tensor(0, "x1")?;
    let x2 = cx.tensor(1, "x2")?;
    let p = cx.float_or(2, "p", 2.0)?;
    let (shape, out) = cx.out(0)?;
    let acc = acc_dtype(out);
    let e = cx.e;
    let m = *x1.shape.last().unwrap_or(&1);
    let nb = shape.len() - 2;
    let mut full = shape.clone();
    full.push(m);
    let place = |t: &T<'c, 'b>, row_dim: i64| -> R<T<'c, 'b>> {
        let tb = t.rank() - 2;
        let mut dims: Vec<i64> = (0..tb as i64).map(|k| k + (nb - tb) as i64).collect();
        dims.push(row_dim);
        dims.push(nb as i64 + 2);
        e.broadcast_in_dim(&e.convert(t, acc)?, &full, &dims)
    };
    let a = place(&x1, nb as i64)?;
    let b = place(&x2, nb as i64 + 1)?;
    let d = e.sub(&a, &b)?;
    Ok(vec![e.convert(&pnorm(e, &d, nb as i64 + 2, p)?, out)?])
}

/// `_pdist_forward(self [N, M], p)`: the p-norm distances of rows i < j, in row-major order.
fn pdist<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let p = cx.float_or(1, "p", 2.0)?;
    let (shape, out) = cx.out(0)?;
    let acc = acc_dtype(out);
    let e = cx.e;
    let n = x.shape[0];
    let m = x.shape[1];
    let (mut is, mut js) = (Vec::new(), Vec::new());
    for i in 0..n {
        for j in i + 1..n {
            is.push(i);
            js.push(j);
        }
    }
    let k = is.len() as i64;
    if k == 0 || m == 0 {
        return Ok(vec![e.splat(Scalar::Int(0), &shape, out)?]);
    }
    let xf = e.convert(&x, acc)?;
    let rows = |idx: &[i64]| -> R<T<'c, 'b>> {
        let ix = e.constant_i64(idx, &[k], DType::Int64)?;
        crate::lower::helpers::gather::take_along(cx.e, &xf, 0, &ix, &[k, m])
    };
    let d = e.sub(&rows(&is)?, &rows(&js)?)?;
    Ok(vec![e.convert(&pnorm(e, &d, 1, p)?, out)?])
}

/// The gradient of a p-norm distance along one pair's difference `diff`, given that pair's
/// output gradient `g` and distance `dist` (both broadcast to `diff`'s shape), as PyTorch's CPU
/// kernels compute it: 0 for p = 0 and wherever the distance is 0 (p > 1, p != 2: also where the
/// difference is 0 for p < 1); p = inf's goes to the components whose magnitude equals the
/// distance.
fn pnorm_grad<'c, 'b>(
    e: &Emitter<'c, 'b>,
    diff: &T<'c, 'b>,
    g: &T<'c, 'b>,
    dist: &T<'c, 'b>,
    p: f64,
) -> R<T<'c, 'b>> {
    let dt = diff.dtype;
    let zero = e.broadcast_to(&e.k(0.0, dt)?, &diff.shape)?;
    if p == 0.0 {
        return Ok(zero);
    }
    let sign = e.unary("stablehlo.sign", diff)?;
    let a = e.unary("stablehlo.abs", diff)?;
    if p == 1.0 {
        return e.mul(g, &sign);
    }
    if p.is_infinite() {
        let at_max = e.compare(&a, dist, "EQ")?;
        return e.select(&at_max, &e.mul(g, &sign)?, &zero, dt);
    }
    let pw = |x: &T<'c, 'b>, y: f64| e.binary("stablehlo.power", x, &e.k(y, dt)?, dt);
    let r = if p == 2.0 {
        e.div(&e.mul(g, diff)?, dist)?
    } else if p < 2.0 {
        e.div(
            &e.mul(&e.mul(&sign, &pw(&a, p - 1.0)?)?, g)?,
            &pw(dist, p - 1.0)?,
        )?
    } else {
        e.div(
            &e.mul(&e.mul(diff, &pw(&a, p - 2.0)?)?, g)?,
            &pw(dist, p - 1.0)?,
        )?
    };
    let at_zero = e.compare(dist, &e.k(0.0, dt)?, "EQ")?;
    let r = e.select(&at_zero, &zero, &r, dt)?;
    if p < 1.0 {
        let same = e.compare(diff, &e.k(0.0, dt)?, "EQ")?;
        return e.select(&same, &zero, &r, dt);
    }
    Ok(r)
}

/// `_cdist_backward(grad [.., P, R], x1 [.., P, M], x2 [.., R, M], p, cdist) -> [.., P, M]`:
/// per row of x1, [`pnorm_grad`] summed over the rows of x2 (batch dims broadcast, as the
/// forward's).
fn cdist_backward<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let g = cx.tensor(0, "grad")?;
    let x1 = cx.tensor(1, "x1")?;
    let x2 = cx.tensor(2, "x2")?;
    let p = cx.float_or(3, "p", 2.0)?;
    let dist = cx.tensor(4, "cdist")?;
    let (shape, out) = cx.out(0)?;
    let acc = acc_dtype(out);
    let e = cx.e;
    if shape.contains(&0) || g.shape.contains(&0) || x2.shape.contains(&0) {
        return Ok(vec![e.splat(Scalar::Int(0), &shape, out)?]);
    }
    if p.is_nan() || p < 0.0 {
        return Err(cx.err(format!("p = {p}: cdist is defined for p >= 0")));
    }
    let nb = g.rank() - 2;
    let m = *x1.shape.last().unwrap_or(&1);
    let mut full = g.shape.clone();
    full.push(m);
    let place = |t: &T<'c, 'b>, row_dim: i64| -> R<T<'c, 'b>> {
        let tb = t.rank() - 2;
        let mut dims: Vec<i64> = (0..tb as i64).map(|k| k + (nb - tb) as i64).collect();
        dims.push(row_dim);
        dims.push(nb as i64 + 2);
        e.broadcast_in_dim(&e.convert(t, acc)?, &full, &dims)
    };
    let pair_dims: Vec<i64> = (0..nb as i64 + 2).collect();
    let pairs = |t: &T<'c, 'b>| -> R<T<'c, 'b>> {
        let t = e.broadcast_to(&e.convert(t, acc)?, &g.shape)?;
        e.broadcast_in_dim(&t, &full, &pair_dims)
    };
    let diff = e.sub(&place(&x1, nb as i64)?, &place(&x2, nb as i64 + 1)?)?;
    let r = pnorm_grad(e, &diff, &pairs(&g)?, &pairs(&dist)?, p)?;
    let r = e.reduce(&r, &[nb as i64 + 1], ReduceKind::Sum, false)?;
    Ok(vec![e.reshape(&e.convert(&r, out)?, &shape)?])
}

/// `_pdist_backward(grad [K], self [N, M], p, pdist [K])`: the pairs' gradients and distances
/// laid out as symmetric N x N matrices (zero on the diagonal), then as `cdist`'s backward of
/// `self` against itself ([`pnorm_grad`] is odd in the difference: row j of pair (i, j) gets
/// minus row i's term).
fn pdist_backward<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let g = cx.tensor(0, "grad")?;
    let x = cx.tensor(1, "self")?;
    let p = cx.float_or(2, "p", 2.0)?;
    let dist = cx.tensor(3, "pdist")?;
    let (shape, out) = cx.out(0)?;
    let acc = acc_dtype(out);
    let e = cx.e;
    let n = x.shape[0];
    let m = x.shape[1];
    let k = n * (n - 1) / 2;
    if k == 0 || m == 0 {
        return Ok(vec![e.splat(Scalar::Int(0), &shape, out)?]);
    }
    if p.is_nan() || p < 0.0 {
        return Err(cx.err(format!("p = {p}: pdist is defined for p >= 0")));
    }
    // Pair (lo, hi), lo < hi, is entry lo*n - lo*(lo+1)/2 + hi - lo - 1; the diagonal reads an
    // appended zero (entry k).
    let i64k = |v: i64| e.splat(Scalar::Int(v), &[], DType::Int64);
    let i = e.iota(&[n, n], 0, DType::Int64)?;
    let j = e.iota(&[n, n], 1, DType::Int64)?;
    let lo = e.binary("stablehlo.minimum", &i, &j, DType::Int64)?;
    let hi = e.binary("stablehlo.maximum", &i, &j, DType::Int64)?;
    let tri = e.div(&e.mul(&lo, &e.add(&lo, &i64k(1)?)?)?, &i64k(2)?)?;
    let entry = e.sub(
        &e.add(&e.sub(&e.mul(&lo, &i64k(n)?)?, &tri)?, &hi)?,
        &e.add(&lo, &i64k(1)?)?,
    )?;
    let diag = e.compare(&i, &j, "EQ")?;
    let entry = e.select(
        &diag,
        &e.broadcast_to(&i64k(k)?, &[n, n])?,
        &entry,
        DType::Int64,
    )?;
    let square = |t: &T<'c, 'b>| -> R<T<'c, 'b>> {
        let t = e.reshape(&e.convert(t, acc)?, &[k])?;
        let padded = e.concatenate(&[&t, &e.splat(Scalar::Int(0), &[1], acc)?], 0)?;
        let sq = crate::lower::helpers::gather::take_along(e, &padded, 0, &entry, &[n, n])?;
        e.broadcast_in_dim(&sq, &[n, n, m], &[0, 1])
    };
    let xf = e.convert(&x, acc)?;
    let diff = e.sub(
        &e.broadcast_in_dim(&xf, &[n, n, m], &[0, 2])?,
        &e.broadcast_in_dim(&xf, &[n, n, m], &[1, 2])?,
    )?;
    let r = pnorm_grad(e, &diff, &square(&g)?, &square(&dist)?, p)?;
    let r = e.reduce(&r, &[1], ReduceKind::Sum, false)?;
    Ok(vec![e.reshape(&e.convert(&r, out)?, &shape)?])
}

/// `_trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim)` (what `bilinear`
/// becomes): each input with size-1 dims inserted at its `expand` positions, multiplied with
/// broadcasting, summed over `sumdim`.
fn trilinear<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (shape, out) = cx.out(0)?;
    let acc = acc_dtype(out);
    let e = cx.e;
    let mut prod: Option<T> = None;
    for k in 0..3 {
        let t = cx.tensor(k, &format!("i{}", k + 1))?;
        let mut expand = cx.ints_or(k + 3, &format!("expand{}", k + 1), &[])?;
        expand.sort();
        let mut s = t.shape.clone();
        for &d in &expand {
            let d = d as usize;
            if d > s.len() {
                return Err(cx.err("_trilinear: expand dim out of range"));
            }
            s.insert(d, 1);
        }
        let t = e.reshape(&e.convert(&t, acc)?, &s)?;
        prod = Some(match prod {
            None => t,
            Some(p) => {
                let full = crate::lower::emit::broadcast_shapes(&p.shape, &t.shape)
                    .ok_or_else(|| cx.err("_trilinear operands do not broadcast"))?;
                e.mul(&e.broadcast_to(&p, &full)?, &e.broadcast_to(&t, &full)?)?
            }
        });
    }
    let prod = prod.ok_or_else(|| cx.err("_trilinear without operands"))?;
    let sumdim = cx.ints_or(6, "sumdim", &[])?;
    let dims = sumdim
        .iter()
        .map(|&d| cx.dim(d, prod.rank()))
        .collect::<R<Vec<_>>>()?;
    let r = if dims.is_empty() {
        prod
    } else {
        e.reduce(&prod, &dims, ReduceKind::Sum, false)?
    };
    Ok(vec![e.convert(&e.reshape(&r, &shape)?, out)?])
}
