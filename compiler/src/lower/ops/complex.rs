//! Complex numbers (complex64 / complex128) and the FFT family (`stablehlo.fft`).
//!
//! PyTorch's FFT ops take a list of dims and a normalization mode (0: none, 1: 1/sqrt(n),
//! 2: 1/n); `stablehlo.fft` transforms the trailing dims (up to 3) and its inverse transforms
//! always divide by n. The rules move the transformed dims last, undo XLA's 1/n and apply
//! PyTorch's own scaling.

use crate::lower::emit::{array_i64, Emitter};
use crate::lower::Rule;
use crate::lower::{NodeCx, Scalar, R, T};
use tpuc_frontend_fx::{Arg, DType};

pub static RULES: &[(&str, Rule)] = &[
    ("aten._conj.default", conj),
    ("aten._conj_physical.default", conj),
    ("aten.conj_physical.default", conj),
    ("aten.view_as_real.default", view_as_real),
    ("aten.view_as_complex.default", view_as_complex),
    ("aten.complex.default", complex),
    ("aten.polar.default", polar),
    ("aten.real.default", real),
    ("aten.imag.default", imag),
    ("aten._fft_r2c.default", fft_r2c),
    ("aten._fft_c2c.default", fft_c2c),
    ("aten._fft_c2r.default", fft_c2r),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;

fn conj<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    if !x.dtype.is_complex() {
        return Ok(vec![x]);
    }
    let e = cx.e;
    let re = e.part(&x, "stablehlo.real")?;
    let im = e.unary("stablehlo.negate", &e.part(&x, "stablehlo.imag")?)?;
    Ok(vec![e.complex(&re, &im)?])
}

fn real<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    if !x.dtype.is_complex() {
        return Ok(vec![x]);
    }
    Ok(vec![cx.e.part(&x, "stablehlo.real")?])
}

fn imag<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    if !x.dtype.is_complex() {
        return Err(cx.err("imag is only defined for complex tensors"));
    }
    Ok(vec![cx.e.part(&x, "stablehlo.imag")?])
}

fn view_as_real<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let x = cx.tensor(0, "self")?;
    if !x.dtype.is_complex() {
        return Err(cx.err("view_as_real needs a complex tensor"));
    }
    let mut s = x.shape.clone();
    s.push(1);
    let re = e.reshape(&e.part(&x, "stablehlo.real")?, &s)?;
    let im = e.reshape(&e.part(&x, "stablehlo.imag")?, &s)?;
    Ok(vec![e.concatenate(&[&re, &im], x.rank())?])
}

fn view_as_complex<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let x = cx.tensor(0, "self")?;
    let r = x.rank();
    if r == 0 || x.shape[r - 1] != 2 || !x.dtype.is_float() {
        return Err(cx.err("view_as_complex needs a float tensor whose last dim has size 2"));
    }
    let mut lim = x.shape.clone();
    lim[r - 1] = 1;
    let re = e.slice(&x, &vec![0; r], &lim, &vec![1; r])?;
    let mut start = vec![0; r];
    start[r - 1] = 1;
    let im = e.slice(&x, &start, &x.shape, &vec![1; r])?;
    let shape = x.shape[..r - 1].to_vec();
    let c = e.complex(&e.reshape(&re, &shape)?, &e.reshape(&im, &shape)?)?;
    Ok(vec![e.convert(&c, cx.out_dtype()?)?])
}

fn complex<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let re = cx.tensor(0, "real")?;
    let im = cx.tensor(1, "imag")?;
    let c = cx.e.complex(&re, &im)?;
    Ok(vec![cx.e.convert(&c, cx.out_dtype()?)?])
}

fn polar<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let r = cx.tensor(0, "abs")?;
    let th = cx.tensor(1, "angle")?;
    let re = e.mul(&r, &e.unary("stablehlo.cosine", &th)?)?;
    let im = e.mul(&r, &e.unary("stablehlo.sine", &th)?)?;
    Ok(vec![e.convert(&e.complex(&re, &im)?, cx.out_dtype()?)?])
}

/// Moves `dims` (in order) to the end; returns the permuted tensor and the inverse permutation.
fn dims_last<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>, dims: &[i64]) -> R<(T<'c, 'b>, Vec<i64>)> {
    let r = x.rank() as i64;
    let mut perm: Vec<i64> = (0..r).filter(|d| !dims.contains(d)).collect();
    perm.extend_from_slice(dims);
    let mut inv = vec![0; r as usize];
    for (i, &p) in perm.iter().enumerate() {
        inv[p as usize] = i as i64;
    }
    Ok((e.transpose(x, &perm)?, inv))
}

fn fft_dims(cx: &NodeCx, rank: usize) -> R<Vec<i64>> {
    let dims = cx.ints(1, "dim")?;
    let dims = dims
        .iter()
        .map(|&d| cx.dim(d, rank))
        .collect::<R<Vec<_>>>()?;
    if dims.is_empty() || dims.len() > 3 {
        return Err(cx.err(format!(
            "stablehlo.fft transforms 1 to 3 dims, not {}",
            dims.len()
        )));
    }
    Ok(dims)
}

/// Multiplies by `k` (a real factor), skipping 1.
fn scale<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>, k: f64) -> R<T<'c, 'b>> {
    if k == 1.0 {
        return Ok(x.clone());
    }
    let f = e.splat(Scalar::Float(k), &[], x.dtype)?;
    e.mul(x, &f)
}

/// PyTorch's normalization factor for a transform of `n` points.
fn norm_factor(cx: &NodeCx, i: usize, n: i64) -> R<f64> {
    Ok(match cx.int(i, "normalization")? {
        0 => 1.0,
        1 => 1.0 / (n as f64).sqrt(),
        2 => 1.0 / n as f64,
        other => return Err(cx.err(format!("unknown normalization mode {other}"))),
    })
}

fn fft_op<'c, 'b>(
    e: &Emitter<'c, 'b>,
    x: &T<'c, 'b>,
    kind: &str,
    lengths: &[i64],
    shape: &[i64],
    dtype: DType,
) -> R<T<'c, 'b>> {
    e.op(
        "stablehlo.fft",
        &[x],
        &[
            ("fft_type", format!("#stablehlo<fft_type {kind}>")),
            ("fft_length", array_i64(lengths)),
        ],
        shape,
        dtype,
    )
}

fn fft_r2c<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let x = cx.tensor(0, "self")?;
    let dims = fft_dims(cx, x.rank())?;
    let onesided = cx.bool_or(3, "onesided", true)?;
    let (out_shape, out) = cx.out(0)?;
    if out_shape.contains(&0) || x.shape.contains(&0) {
        return Ok(vec![e.splat(Scalar::Int(0), &out_shape, out)?]);
    }
    let x = e.convert(&x, out.real_part())?;
    let (xt, inv) = dims_last(e, &x, &dims)?;
    let lengths: Vec<i64> = dims.iter().map(|&d| x.shape[d as usize]).collect();
    let n: i64 = lengths.iter().product();
    let y = if onesided {
        let mut s = xt.shape.clone();
        let l = s.len();
        s[l - 1] = s[l - 1] / 2 + 1;
        fft_op(e, &xt, "RFFT", &lengths, &s, out)?
    } else {
        let c = e.convert(&xt, out)?;
        fft_op(e, &c, "FFT", &lengths, &xt.shape, out)?
    };
    let y = scale(e, &y, norm_factor(cx, 2, n)?)?;
    Ok(vec![e.transpose(&y, &inv)?])
}

fn fft_c2c<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let x = cx.tensor(0, "self")?;
    let dims = fft_dims(cx, x.rank())?;
    let forward = cx.bool_or(3, "forward", true)?;
    let (out_shape, out) = cx.out(0)?;
    if out_shape.contains(&0) {
        return Ok(vec![e.splat(Scalar::Int(0), &out_shape, out)?]);
    }
    let x = e.convert(&x, out)?;
    let (xt, inv) = dims_last(e, &x, &dims)?;
    let lengths: Vec<i64> = dims.iter().map(|&d| x.shape[d as usize]).collect();
    let n: i64 = lengths.iter().product();
    let kind = if forward { "FFT" } else { "IFFT" };
    let y = fft_op(e, &xt, kind, &lengths, &xt.shape, out)?;
    // XLA's inverse divides by n; PyTorch's unnormalized inverse does not.
    let undo = if forward { 1.0 } else { n as f64 };
    let y = scale(e, &y, undo * norm_factor(cx, 2, n)?)?;
    Ok(vec![e.transpose(&y, &inv)?])
}

fn fft_c2r<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let x = cx.tensor(0, "self")?;
    let dims = fft_dims(cx, x.rank())?;
    let last_size = match cx.arg(3, "last_dim_size") {
        Some(Arg::Int(v)) => *v,
        other => return Err(cx.err(format!("`last_dim_size`: expected an int, got {other:?}"))),
    };
    let (out_shape, out) = cx.out(0)?;
    if out_shape.contains(&0) {
        return Ok(vec![e.splat(Scalar::Int(0), &out_shape, out)?]);
    }
    let x = e.convert(&x, out.to_complex())?;
    let (xt, inv) = dims_last(e, &x, &dims)?;
    let mut lengths: Vec<i64> = dims.iter().map(|&d| x.shape[d as usize]).collect();
    let l = lengths.len();
    lengths[l - 1] = last_size;
    // The input's last transformed dim must hold last_size / 2 + 1 values.
    let need = last_size / 2 + 1;
    let r = xt.rank();
    let have = xt.shape[r - 1];
    let xt = if have > need {
        let mut lim = xt.shape.clone();
        lim[r - 1] = need;
        e.slice(&xt, &vec![0; r], &lim, &vec![1; r])?
    } else if have < need {
        let zero = e.splat(Scalar::Int(0), &[], xt.dtype)?;
        e.pad_end(&xt, &zero, r - 1, need)?
    } else {
        xt
    };
    let mut s = xt.shape.clone();
    s[r - 1] = last_size;
    let n: i64 = lengths.iter().product();
    let y = fft_op(e, &xt, "IRFFT", &lengths, &s, out)?;
    let y = scale(e, &y, n as f64 * norm_factor(cx, 2, n)?)?;
    Ok(vec![e.transpose(&y, &inv)?])
}
