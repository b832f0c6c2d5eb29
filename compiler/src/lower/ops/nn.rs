//! Neural-network ops that core ATen keeps whole: normalizations and pooling.

use crate::lower::emit::{array_i64, Emitter};
use crate::lower::ops::reduce::acc_dtype;
use crate::lower::registry::Rule;
use crate::lower::{NodeCx, ReduceKind, Scalar, R, T};

pub static RULES: &[(&str, Rule)] = &[
    ("aten.native_layer_norm.default", native_layer_norm),
    (
        "aten._native_batch_norm_legit_no_training.default",
        batch_norm_no_training,
    ),
    (
        "aten.max_pool2d_with_indices.default",
        max_pool2d_with_indices,
    ),
    ("aten.avg_pool2d.default", avg_pool2d),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;

/// `native_layer_norm(x, normalized_shape, weight, bias, eps) -> (out, mean, rstd)`,
/// statistics in f32 for low-precision inputs.
fn native_layer_norm<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "input")?;
    let norm = cx.ints(1, "normalized_shape")?;
    let w = cx.opt_tensor(2, "weight")?;
    let b = cx.opt_tensor(3, "bias")?;
    let eps = cx.float_or(4, "eps", 1e-5)?;
    let (_, out) = cx.out(0)?;
    let acc = acc_dtype(out);
    let e = cx.e;
    let axis = x.rank() - norm.len();
    let dims: Vec<i64> = (axis as i64..x.rank() as i64).collect();
    let n: i64 = norm.iter().product();
    let xf = e.convert(&x, acc)?;
    let count = e.splat(Scalar::Int(n), &[], acc)?;
    let mean = e.binary(
        "stablehlo.divide",
        &e.reduce(&xf, &dims, ReduceKind::Sum, true)?,
        &count,
        acc,
    )?;
    let d = e.binary("stablehlo.subtract", &xf, &mean, acc)?;
    let var = e.binary(
        "stablehlo.divide",
        &e.reduce(
            &e.binary("stablehlo.multiply", &d, &d, acc)?,
            &dims,
            ReduceKind::Sum,
            true,
        )?,
        &count,
        acc,
    )?;
    let rstd = e.unary(
        "stablehlo.rsqrt",
        &e.binary(
            "stablehlo.add",
            &var,
            &e.splat(Scalar::Float(eps), &[], acc)?,
            acc,
        )?,
    )?;
    let mut y = e.binary("stablehlo.multiply", &d, &rstd, acc)?;
    if let Some(w) = w {
        y = e.binary("stablehlo.multiply", &y, &e.convert(&w, acc)?, acc)?;
    }
    if let Some(b) = b {
        y = e.binary("stablehlo.add", &y, &e.convert(&b, acc)?, acc)?;
    }
    let (_, mean_t) = cx.out(1)?;
    let (_, rstd_t) = cx.out(2)?;
    Ok(vec![
        e.convert(&y, out)?,
        e.convert(&mean, mean_t)?,
        e.convert(&rstd, rstd_t)?,
    ])
}

/// Broadcasts a per-channel vector along dim 1 of `shape`.
fn per_channel<'c, 'b>(e: &Emitter<'c, 'b>, v: &T<'c, 'b>, shape: &[i64]) -> R<T<'c, 'b>> {
    e.broadcast_in_dim(v, shape, &[1])
}

/// Eval-mode BatchNorm: `(x - running_mean) / sqrt(running_var + eps) * weight + bias`.
fn batch_norm_no_training<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "input")?;
    let w = cx.opt_tensor(1, "weight")?;
    let b = cx.opt_tensor(2, "bias")?;
    let mean = cx.tensor(3, "running_mean")?;
    let var = cx.tensor(4, "running_var")?;
    let eps = cx.float_or(6, "eps", 1e-5)?;
    let (_, out) = cx.out(0)?;
    let acc = acc_dtype(out);
    let e = cx.e;
    let xf = e.convert(&x, acc)?;
    let shape = x.shape.clone();
    let rstd = e.unary(
        "stablehlo.rsqrt",
        &e.binary(
            "stablehlo.add",
            &e.convert(&var, acc)?,
            &e.splat(Scalar::Float(eps), &[], acc)?,
            acc,
        )?,
    )?;
    let mut y = e.binary(
        "stablehlo.subtract",
        &xf,
        &per_channel(e, &e.convert(&mean, acc)?, &shape)?,
        acc,
    )?;
    y = e.binary(
        "stablehlo.multiply",
        &y,
        &per_channel(e, &rstd, &shape)?,
        acc,
    )?;
    if let Some(w) = w {
        y = e.binary(
            "stablehlo.multiply",
            &y,
            &per_channel(e, &e.convert(&w, acc)?, &shape)?,
            acc,
        )?;
    }
    if let Some(b) = b {
        y = e.binary(
            "stablehlo.add",
            &y,
            &per_channel(e, &e.convert(&b, acc)?, &shape)?,
            acc,
        )?;
    }
    Ok(vec![e.convert(&y, out)?, cx.unused(1)?, cx.unused(2)?])
}

/// Kernel, stride, padding and dilation of a 2-D pooling op, each per spatial dim.
struct Window {
    kernel: Vec<i64>,
    stride: Vec<i64>,
    padding: Vec<i64>,
    dilation: Vec<i64>,
}

fn window(cx: &NodeCx, dilation_arg: Option<usize>) -> R<Window> {
    let two = |v: Vec<i64>| if v.len() == 1 { vec![v[0], v[0]] } else { v };
    let kernel = two(cx.ints(1, "kernel_size")?);
    let stride = two(cx.ints_or(2, "stride", &kernel)?);
    let padding = two(cx.ints_or(3, "padding", &[0])?);
    let dilation = match dilation_arg {
        Some(i) => two(cx.ints_or(i, "dilation", &[1])?),
        None => vec![1, 1],
    };
    Ok(Window {
        kernel,
        stride,
        padding,
        dilation,
    })
}

/// reduce_window over the last two dims of `x`, padded so the output has `out_shape`
/// (extra high padding covers ceil_mode).
fn pool<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    x: &T<'c, 'b>,
    w: &Window,
    kind: ReduceKind,
    out_shape: &[i64],
) -> R<T<'c, 'b>> {
    let r = x.rank();
    let mut wd = vec![1; r];
    let mut ws = vec![1; r];
    let mut wdil = vec![1; r];
    let mut pads = vec![[0i64, 0]; r];
    for k in 0..2 {
        let d = r - 2 + k;
        wd[d] = w.kernel[k];
        ws[d] = w.stride[k];
        wdil[d] = w.dilation[k];
        let span = (w.kernel[k] - 1) * w.dilation[k] + 1;
        let needed = (out_shape[d] - 1) * w.stride[k] + span;
        let lo = w.padding[k];
        let hi = (needed - x.shape[d] - lo).max(w.padding[k].min(needed - x.shape[d] - lo).max(0));
        pads[d] = [lo, hi];
    }
    let pad_text: Vec<String> = pads
        .iter()
        .map(|p| format!("[{}, {}]", p[0], p[1]))
        .collect();
    let init =
        cx.e.splat(Emitter::reduce_init(kind, x.dtype), &[], x.dtype)?;
    let region = cx.e.scalar_region(kind, x.dtype)?;
    Ok(cx
        .e
        .op_n(
            "stablehlo.reduce_window",
            &[x, &init],
            &[
                ("window_dimensions", array_i64(&wd)),
                ("window_strides", array_i64(&ws)),
                ("window_dilations", array_i64(&wdil)),
                (
                    "padding",
                    format!("dense<[{}]> : tensor<{r}x2xi64>", pad_text.join(", ")),
                ),
            ],
            &[(out_shape.to_vec(), x.dtype)],
            vec![region],
        )?
        .remove(0))
}

fn max_pool2d_with_indices<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let w = window(cx, Some(4))?;
    let (shape, _) = cx.out(0)?;
    let y = pool(cx, &x, &w, ReduceKind::Max, &shape)?;
    Ok(vec![y, cx.unused(1)?])
}

/// `avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)`.
fn avg_pool2d<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let w = window(cx, None)?;
    let (shape, out) = cx.out(0)?;
    let count_include_pad = cx.bool_or(5, "count_include_pad", true)?;
    let ceil_mode = cx.bool_or(4, "ceil_mode", false)?;
    if cx.int_or(6, "divisor_override", 0)? != 0
        || ceil_mode
        || (!count_include_pad && w.padding.iter().any(|&p| p > 0))
    {
        return Err(cx.err("avg_pool2d with divisor_override, ceil_mode or count_include_pad=False and padding is not supported yet"));
    }
    let acc = acc_dtype(out);
    let xf = cx.e.convert(&x, acc)?;
    let s = pool(cx, &xf, &w, ReduceKind::Sum, &shape)?;
    let n =
        cx.e.splat(Scalar::Int(w.kernel.iter().product()), &[], acc)?;
    let r = cx.e.binary("stablehlo.divide", &s, &n, acc)?;
    Ok(vec![cx.e.convert(&r, out)?])
}
