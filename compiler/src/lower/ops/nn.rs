//! Neural-network ops that core ATen keeps whole: normalizations and pooling.

use crate::lower::emit::{array_i64, to_physical, Emitter};
use crate::lower::helpers::gather::{along_dim_coords, take_along};
use crate::lower::helpers::widen::acc_dtype;
use crate::lower::helpers::window::{taps as window_taps, Window};
use crate::lower::Rule;
use crate::lower::{LowerError, NodeCx, ReduceKind, Scalar, R, T};
use tpuc_frontend_fx::DType;

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
    ("aten.avg_pool2d.default", avg_pool),
    ("aten.avg_pool3d.default", avg_pool),
    ("aten.avg_pool2d_backward.default", avg_pool_backward),
    ("aten.avg_pool3d_backward.default", avg_pool_backward),
    ("aten.native_group_norm.default", native_group_norm),
    (
        "aten._batch_norm_with_update_functional.default",
        batch_norm_with_update,
    ),
    (
        "aten.max_pool3d_with_indices.default",
        max_pool2d_with_indices,
    ),
    ("aten._adaptive_avg_pool2d.default", adaptive_avg_pool),
    ("aten._adaptive_avg_pool3d.default", adaptive_avg_pool),
    (
        "aten._adaptive_avg_pool2d_backward.default",
        adaptive_avg_pool_backward,
    ),
    (
        "aten._adaptive_avg_pool3d_backward.default",
        adaptive_avg_pool_backward,
    ),
    ("aten.adaptive_max_pool2d.default", adaptive_max_pool),
    ("aten.adaptive_max_pool3d.default", adaptive_max_pool),
    (
        "aten._native_batch_norm_legit_functional.default",
        batch_norm_functional,
    ),
    (
        "aten._native_batch_norm_legit.no_stats",
        batch_norm_no_stats,
    ),
    (
        "aten.max_pool2d_with_indices_backward.default",
        max_pool2d_with_indices_backward,
    ),
    (
        "aten.max_pool3d_with_indices_backward.default",
        max_pool2d_with_indices_backward,
    ),
    (
        "aten.adaptive_max_pool2d_backward.default",
        adaptive_max_pool_backward,
    ),
    (
        "aten.adaptive_max_pool3d_backward.default",
        adaptive_max_pool_backward,
    ),
    (
        "aten.replication_pad1d_backward.default",
        replication_pad_backward,
    ),
    (
        "aten.replication_pad2d_backward.default",
        replication_pad_backward,
    ),
    (
        "aten.replication_pad3d_backward.default",
        replication_pad_backward,
    ),
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
    if let Some(r) = host_layer_norm(cx, &x, (w.as_ref(), b.as_ref()), n, eps)? {
        return Ok(r);
    }
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

/// Layer norms of at least this many elements, over rows of at least [`HOST_LAYER_NORM_MIN_N`],
/// go to the host row kernel where the session enables it (`tpuc_hostkernels::host_rows`): one
/// pass against XLA's five (bench/results/lowering-choices.md).
const HOST_LAYER_NORM_MIN_ELEMENTS: i64 = 1 << 15;
const HOST_LAYER_NORM_MIN_N: i64 = 64;

/// `native_layer_norm`'s three results through the host row kernel (`tpuc_layer_norm`), where
/// the session enables it and everything is f32: `x` as `[rows, n]` rows, a missing weight as
/// ones and a missing bias as zeros. None where XLA should compute it.
fn host_layer_norm<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    x: &T<'c, 'b>,
    (w, b): (Option<&T<'c, 'b>>, Option<&T<'c, 'b>>),
    n: i64,
    eps: f64,
) -> R<Option<Vec<T<'c, 'b>>>> {
    let e = cx.e;
    let f32 = DType::Float32;
    let elements: i64 = x.shape.iter().product();
    if !e.host_rows
        || x.dtype != f32
        || cx.out(0)?.1 != f32
        || w.is_some_and(|w| w.dtype != f32)
        || b.is_some_and(|b| b.dtype != f32)
        || n < HOST_LAYER_NORM_MIN_N
        || elements < HOST_LAYER_NORM_MIN_ELEMENTS
    {
        return Ok(None);
    }
    let rows = elements / n;
    let vector = |t: Option<&T<'c, 'b>>, fill: f64| match t {
        Some(t) => e.reshape(t, &[n]),
        None => e.splat(Scalar::Float(fill), &[n], f32),
    };
    let operands = [
        e.reshape(x, &[rows, n])?,
        vector(w, 1.0)?,
        vector(b, 0.0)?,
        e.splat(Scalar::Float(eps), &[1], f32)?,
    ];
    let r = e.ffi_call(
        tpuc_hostkernels::host_rows::LAYER_NORM,
        &operands.iter().collect::<Vec<_>>(),
        &[(vec![rows, n], f32), (vec![rows], f32), (vec![rows], f32)],
    )?;
    let mut shaped = Vec::with_capacity(3);
    shaped.push(e.reshape(&r[0], &x.shape)?);
    for (i, t) in r[1..].iter().enumerate() {
        let (shape, dtype) = cx.out(i + 1)?;
        shaped.push(e.convert(&e.reshape(t, &shape)?, dtype)?);
    }
    Ok(Some(shaped))
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
    let channels = [x.shape.get(1).copied().unwrap_or(1)];
    let per_channel_or = |t: Option<T<'c, 'b>>, fill: f64| match t {
        Some(t) => e.convert(&t, acc),
        None => e.splat(Scalar::Float(fill), &channels, acc),
    };
    // One op where its epsilon (an f32 attribute) is exact enough: f32 math. XLA expands it to
    // the same arithmetic as below; a module a tenth the size lowers and compiles faster.
    let y = if acc == DType::Float32 && eps.is_finite() && x.shape.len() >= 2 {
        // A channels-last layout transpose is normalized in its physical form, along the
        // channels' physical dim (see `Emitter::layout_transpose`).
        let layout = e.physical(&xf).filter(|(_, p)| p.len() == x.rank());
        let (operand, feature) = match &layout {
            Some((src, perm)) => (src, perm[1]),
            None => (&xf, 1),
        };
        let y = e.op(
            "stablehlo.batch_norm_inference",
            &[
                operand,
                &per_channel_or(w, 1.0)?,
                &per_channel_or(b, 0.0)?,
                &e.convert(&mean, acc)?,
                &e.convert(&var, acc)?,
            ],
            &[
                ("epsilon", format!("{eps:.17e} : f32")),
                ("feature_index", format!("{feature} : i64")),
            ],
            &operand.shape.clone(),
            acc,
        )?;
        match &layout {
            Some((_, perm)) => e.layout_transpose(&y, perm)?,
            None => y,
        }
    } else {
        batch_norm_arithmetic(e, &xf, w, b, &mean, &var, eps, acc)?
    };
    Ok(vec![
        e.convert(&y, out)?,
        empty_or_unused(cx, 1)?,
        empty_or_unused(cx, 2)?,
    ])
}

/// Eval-mode BatchNorm spelled out in elementwise ops, computed in `acc`.
#[allow(clippy::too_many_arguments)]
fn batch_norm_arithmetic<'c, 'b>(
    e: &Emitter<'c, 'b>,
    xf: &T<'c, 'b>,
    w: Option<T<'c, 'b>>,
    b: Option<T<'c, 'b>>,
    mean: &T<'c, 'b>,
    var: &T<'c, 'b>,
    eps: f64,
    acc: DType,
) -> R<T<'c, 'b>> {
    let shape = xf.shape.clone();
    let rstd = e.unary(
        "stablehlo.rsqrt",
        &e.binary(
            "stablehlo.add",
            &e.convert(var, acc)?,
            &e.splat(Scalar::Float(eps), &[], acc)?,
            acc,
        )?,
    )?;
    let mut y = e.binary(
        "stablehlo.subtract",
        xf,
        &per_channel(e, &e.convert(mean, acc)?, &shape)?,
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
    Ok(y)
}

/// Results PyTorch returns empty (the batch statistics of eval-mode BatchNorm, shape [0]), or
/// a stand-in for one nobody reads.
fn empty_or_unused<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, k: usize) -> R<T<'c, 'b>> {
    let (shape, dtype) = cx.out(k)?;
    if shape.iter().product::<i64>() == 0 {
        return cx.e.splat(Scalar::Int(0), &shape, dtype);
    }
    cx.unused(k)
}

/// `native_group_norm(x, weight, bias, N, C, HxW, group, eps) -> (out, mean, rstd)`: statistics
/// over each group of C / group channels and all spatial positions, `[N, group]`.
fn native_group_norm<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "input")?;
    let w = cx.opt_tensor(1, "weight")?;
    let b = cx.opt_tensor(2, "bias")?;
    let n = cx.int(3, "N")?;
    let groups = cx.int(6, "group")?;
    let eps = cx.float_or(7, "eps", 1e-5)?;
    let (_, out) = cx.out(0)?;
    let acc = acc_dtype(out);
    let e = cx.e;
    if groups <= 0 || x.numel() % (n * groups).max(1) != 0 {
        return Err(cx.err(format!(
            "group_norm: {groups} groups for input {:?}",
            x.shape
        )));
    }
    let per = x.numel() / (n * groups).max(1);
    let xg = e.reshape(&e.convert(&x, acc)?, &[n, groups, per])?;
    let count = e.splat(Scalar::Int(per), &[], acc)?;
    let mean = e.div(&e.reduce(&xg, &[2], ReduceKind::Sum, true)?, &count)?;
    let d = e.sub(&xg, &mean)?;
    let var = e.div(
        &e.reduce(&e.mul(&d, &d)?, &[2], ReduceKind::Sum, true)?,
        &count,
    )?;
    let rstd = rsqrt_eps(e, &var, eps)?;
    let mut y = e.reshape(&e.mul(&d, &rstd)?, &x.shape)?;
    if let Some(w) = w {
        y = e.mul(&y, &per_channel(e, &e.convert(&w, acc)?, &x.shape)?)?;
    }
    if let Some(b) = b {
        y = e.add(&y, &per_channel(e, &e.convert(&b, acc)?, &x.shape)?)?;
    }
    Ok(vec![
        e.convert(&y, out)?,
        e.convert(&e.reshape(&mean, &[n, groups])?, cx.out(1)?.1)?,
        e.convert(&e.reshape(&rstd, &[n, groups])?, cx.out(2)?.1)?,
    ])
}

/// The window of a pooling op over `nsp` spatial dims (a single value applies to all).
fn window(cx: &NodeCx, dilation_arg: Option<usize>, nsp: usize) -> R<Window> {
    window_at(cx, 1, dilation_arg, nsp)
}

/// [`window`] with `kernel_size`, `stride` and `padding` at arguments `first`, `first + 1`,
/// `first + 2`.
fn window_at(cx: &NodeCx, first: usize, dilation_arg: Option<usize>, nsp: usize) -> R<Window> {
    let all = |v: Vec<i64>| if v.len() == 1 { vec![v[0]; nsp] } else { v };
    let kernel = all(cx.ints(first, "kernel_size")?);
    let stride = all(cx.ints_or(first + 1, "stride", &kernel)?);
    let padding = all(cx.ints_or(first + 2, "padding", &[0])?);
    let dilation = match dilation_arg {
        Some(i) => all(cx.ints_or(i, "dilation", &[1])?),
        None => vec![1; nsp],
    };
    if [&kernel, &stride, &padding, &dilation]
        .iter()
        .any(|v| v.len() != nsp)
    {
        return Err(cx.err(format!(
            "pooling window arguments for {nsp} spatial dims expected"
        )));
    }
    Ok(Window {
        kernel,
        stride,
        padding,
        dilation,
    })
}

/// reduce_window over the last spatial dims of `x` (as many as the window has), padded so the
/// output has `out_shape` (extra high padding covers ceil_mode).
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
    let nsp = w.kernel.len();
    for k in 0..nsp {
        let d = r - nsp + k;
        wd[d] = w.kernel[k];
        ws[d] = w.stride[k];
        wdil[d] = w.dilation[k];
        let span = (w.kernel[k] - 1) * w.dilation[k] + 1;
        let needed = (out_shape[d] - 1) * w.stride[k] + span;
        let lo = w.padding[k];
        let hi = (needed - x.shape[d] - lo).max(w.padding[k].min(needed - x.shape[d] - lo).max(0));
        pads[d] = [lo, hi];
    }
    // A channels-last layout transpose is pooled in its physical form, with the window's
    // dims permuted to match (see `Emitter::layout_transpose`).
    let layout = cx.e.physical(x).filter(|(_, p)| p.len() == r);
    let (operand, out_shape) = match &layout {
        Some((src, perm)) => {
            wd = to_physical(&wd, perm);
            ws = to_physical(&ws, perm);
            wdil = to_physical(&wdil, perm);
            pads = to_physical(&pads, perm);
            (src, to_physical(out_shape, perm))
        }
        None => (x, out_shape.to_vec()),
    };
    let pad_text: Vec<String> = pads
        .iter()
        .map(|p| format!("[{}, {}]", p[0], p[1]))
        .collect();
    let init =
        cx.e.splat(Emitter::reduce_init(kind, x.dtype), &[], x.dtype)?;
    let region = cx.e.scalar_region(kind, x.dtype)?;
    let y =
        cx.e.op_n(
            "stablehlo.reduce_window",
            &[operand, &init],
            &[
                ("window_dimensions", array_i64(&wd)),
                ("window_strides", array_i64(&ws)),
                ("window_dilations", array_i64(&wdil)),
                (
                    "padding",
                    format!("dense<[{}]> : tensor<{r}x2xi64>", pad_text.join(", ")),
                ),
            ],
            &[(out_shape, x.dtype)],
            vec![region],
        )?
        .remove(0);
    match &layout {
        Some((_, perm)) => cx.e.layout_transpose(&y, perm),
        None => Ok(y),
    }
}

fn max_pool2d_with_indices<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let nsp = if cx.node.op.contains("3d") { 3 } else { 2 };
    let x = cx.tensor(0, "self")?;
    let w = window(cx, Some(4), nsp)?;
    let (shape, _) = cx.out(0)?;
    if cx.result_used(1) {
        let (v, i) = max_pool_with_indices(cx, &x, &w, &shape)?;
        return Ok(vec![v, i]);
    }
    let y = pool(cx, &x, &w, ReduceKind::Max, &shape)?;
    // The plugin's max reductions skip NaNs; PyTorch's max pooling returns NaN for a window
    // holding one.
    let y = if x.dtype.is_float() {
        let isnan = cx.e.compare(&x, &x, "NE")?;
        let any = pool(cx, &isnan, &w, ReduceKind::Or, &shape)?;
        let nan = cx.e.splat(Scalar::Float(f64::NAN), &[], x.dtype)?;
        cx.e.select(&any, &nan, &y, x.dtype)?
    } else {
        y
    };
    Ok(vec![y, cx.unused(1)?])
}

/// `avg_pool2d` / `avg_pool3d(x, kernel, stride, padding, ceil_mode, count_include_pad,
/// divisor_override)`: a windowed sum over zero padding divided, per output, by what PyTorch's
/// kernel divides by: the override, else the window clipped to the padded input
/// (`count_include_pad`) or to the input itself.
fn avg_pool<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let nsp = if cx.node.op.contains("3d") { 3 } else { 2 };
    let x = cx.tensor(0, "self")?;
    let w = window(cx, None, nsp)?;
    let (shape, out) = cx.out(0)?;
    let count_include_pad = cx.bool_or(5, "count_include_pad", true)?;
    let divisor = cx.int_or(6, "divisor_override", 0)?;
    let e = cx.e;
    let acc = acc_dtype(out);
    let xf = e.convert(&x, acc)?;
    let s = pool(cx, &xf, &w, ReduceKind::Sum, &shape)?;
    let div = avg_divisor(e, &x.shape, &w, &shape, count_include_pad, divisor, acc)?;
    let r = e.div(&s, &div)?;
    Ok(vec![e.convert(&r, out)?])
}

/// What average pooling divides each output (of `out_shape`, from an input of `x_shape`) by:
/// `divisor` when not 0, else the window clipped to the padded input (`count_include_pad`) or
/// to the input itself, as PyTorch's kernel counts it.
fn avg_divisor<'c, 'b>(
    e: &Emitter<'c, 'b>,
    x_shape: &[i64],
    w: &Window,
    out_shape: &[i64],
    count_include_pad: bool,
    divisor: i64,
    acc: DType,
) -> R<T<'c, 'b>> {
    if divisor != 0 {
        return e.splat(Scalar::Int(divisor), &[], acc);
    }
    let r = x_shape.len();
    let nsp = w.kernel.len();
    // Separable: the divisor is the product of per-dim window lengths.
    let mut div = e.splat(Scalar::Int(1), out_shape, acc)?;
    for k in 0..nsp {
        let d = r - nsp + k;
        let (n, p) = (x_shape[d], w.padding[k]);
        let counts: Vec<i64> = (0..out_shape[d])
            .map(|o| {
                let start = o * w.stride[k] - p;
                let end = (start + w.kernel[k]).min(n + p);
                if count_include_pad {
                    end - start
                } else {
                    end.min(n) - start.max(0)
                }
            })
            .collect();
        let c = e.convert(
            &e.constant_i64(&counts, &[out_shape[d]], DType::Int64)?,
            acc,
        )?;
        div = e.mul(&div, &e.broadcast_in_dim(&c, out_shape, &[d as i64])?)?;
    }
    Ok(div)
}

/// `avg_pool2d_backward` / `avg_pool3d_backward(grad_output, self, kernel, stride, padding,
/// ceil_mode, count_include_pad, divisor_override)`: each input element gets the sum of
/// `grad / divisor` over the windows that cover it. The scaled gradient is spread onto the
/// input grid (interior padding `stride - 1`, shifted by `kernel - 1 - padding`) and summed
/// over a `kernel` window at stride 1: one pad and one reduce_window, the transpose of the
/// forward's windowed sum (what XLA's own reduce_window gradient is).
fn avg_pool_backward<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let nsp = if cx.node.op.contains("3d") { 3 } else { 2 };
    let g = cx.tensor(0, "grad_output")?;
    let x = cx.tensor(1, "self")?;
    let w = window_at(cx, 2, None, nsp)?;
    let count_include_pad = cx.bool_or(6, "count_include_pad", true)?;
    let divisor = cx.int_or(7, "divisor_override", 0)?;
    let (shape, out) = cx.out(0)?;
    let e = cx.e;
    let acc = acc_dtype(out);
    let div = avg_divisor(e, &x.shape, &w, &g.shape, count_include_pad, divisor, acc)?;
    let scaled = e.div(&e.convert(&g, acc)?, &div)?;
    let r = g.rank();
    let (mut lo, mut hi, mut interior) = (vec![0; r], vec![0; r], vec![0; r]);
    for k in 0..nsp {
        let d = r - nsp + k;
        let spread = (g.shape[d] - 1) * w.stride[k] + 1;
        lo[d] = w.kernel[k] - 1 - w.padding[k];
        // Negative where ceil_mode's last windows reach past the input: cropped.
        hi[d] = shape[d] + w.kernel[k] - 1 - lo[d] - spread;
        interior[d] = w.stride[k] - 1;
    }
    let zero = e.splat(Scalar::Int(0), &[], acc)?;
    let spread = e.pad(&scaled, &zero, &lo, &hi, &interior)?;
    let sum_window = Window {
        kernel: w.kernel.clone(),
        stride: vec![1; nsp],
        padding: vec![0; nsp],
        dilation: vec![1; nsp],
    };
    let grad = pool(cx, &spread, &sum_window, ReduceKind::Sum, &shape)?;
    Ok(vec![e.convert(&grad, out)?])
}

/// The windows of adaptive pooling from `n` inputs to `o` outputs: output i reads
/// [floor(i n / o), ceil((i + 1) n / o)).
fn adaptive_windows(n: i64, o: i64) -> Vec<(i64, i64)> {
    (0..o)
        .map(|i| ((i * n) / o, ((i + 1) * n + o - 1) / o))
        .collect()
}

/// Averaging matrix of adaptive pooling along one dim, `[o, n]` (or `[n, o]` when
/// `transposed`): row i holds 1 / len over window i.
fn adaptive_matrix<'c, 'b>(
    e: &Emitter<'c, 'b>,
    n: i64,
    o: i64,
    transposed: bool,
    dtype: DType,
) -> R<T<'c, 'b>> {
    let win = adaptive_windows(n, o);
    let starts: Vec<i64> = win.iter().map(|w| w.0).collect();
    let ends: Vec<i64> = win.iter().map(|w| w.1).collect();
    let (shape, od, nd) = if transposed {
        (vec![n, o], 1, 0)
    } else {
        (vec![o, n], 0, 1)
    };
    let st = e.broadcast_in_dim(&e.constant_i64(&starts, &[o], DType::Int64)?, &shape, &[od])?;
    let en = e.broadcast_in_dim(&e.constant_i64(&ends, &[o], DType::Int64)?, &shape, &[od])?;
    let j = e.iota(&shape, nd, DType::Int64)?;
    let inside = e.and(&e.compare(&j, &st, "GE")?, &e.compare(&j, &en, "LT")?)?;
    let len = e.convert(&e.sub(&en, &st)?, dtype)?;
    let w = e.div(&e.splat(Scalar::Int(1), &[], dtype)?, &len)?;
    e.select(&inside, &w, &e.splat(Scalar::Int(0), &[], dtype)?, dtype)
}

/// Applies one matrix per spatial dim (the last `mats.len()` dims of `x`), each `[new, old]`:
/// contracting the first spatial dim appends the new one last, so after all of them the order
/// is back.
fn per_dim_matmul<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>, mats: &[T<'c, 'b>]) -> R<T<'c, 'b>> {
    let lead = x.rank() - mats.len();
    let mut t = x.clone();
    for m in mats {
        let mut shape: Vec<i64> = t.shape.clone();
        shape.remove(lead);
        shape.push(m.shape[0]);
        t = e.dot_general(&t, m, (&[], &[]), (&[lead as i64], &[1]), &shape, t.dtype)?;
    }
    Ok(t)
}

/// `_adaptive_avg_pool2d/3d(x, output_size)`: averaging matrices along each spatial dim.
fn adaptive_avg_pool<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let (shape, out) = cx.out(0)?;
    let nsp = if cx.node.op.contains("3d") { 3 } else { 2 };
    let acc = acc_dtype(out);
    let e = cx.e;
    let r = x.rank();
    let mats = (0..nsp)
        .map(|k| adaptive_matrix(e, x.shape[r - nsp + k], shape[r - nsp + k], false, acc))
        .collect::<R<Vec<_>>>()?;
    let y = per_dim_matmul(e, &e.convert(&x, acc)?, &mats)?;
    Ok(vec![e.convert(&y, out)?])
}

/// `_adaptive_avg_pool2d_backward(grad_output, self)`: the transposed averaging matrices.
fn adaptive_avg_pool_backward<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let g = cx.tensor(0, "grad_output")?;
    let (shape, out) = cx.out(0)?;
    let nsp = if cx.node.op.contains("3d") { 3 } else { 2 };
    let acc = acc_dtype(out);
    let e = cx.e;
    let r = g.rank();
    let mats = (0..nsp)
        .map(|k| adaptive_matrix(e, shape[r - nsp + k], g.shape[r - nsp + k], true, acc))
        .collect::<R<Vec<_>>>()?;
    let y = per_dim_matmul(e, &e.convert(&g, acc)?, &mats)?;
    Ok(vec![e.convert(&y, out)?])
}

/// `adaptive_max_pool2d/3d(x, output_size) -> (values, indices)`: every tap of the largest
/// window, gathered per output; a later tap wins when it is greater or NaN (PyTorch's CPU
/// kernel), the index is flat within the spatial plane/volume.
fn adaptive_max_pool<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let (shape, _) = cx.out(0)?;
    let nsp = if cx.node.op.contains("3d") { 3 } else { 2 };
    let e = cx.e;
    let r = x.rank();
    let lead = r - nsp;
    let wins: Vec<Vec<(i64, i64)>> = (0..nsp)
        .map(|k| adaptive_windows(x.shape[lead + k], shape[lead + k]))
        .collect();
    let kmax: Vec<i64> = wins
        .iter()
        .map(|w| w.iter().map(|(a, b)| b - a).max().unwrap_or(1))
        .collect();
    let taps = window_taps(&kmax);
    let mut best: Option<(T, T)> = None;
    for tap in &taps {
        let mut v = x.clone();
        let mut valid: Option<T> = None;
        let mut flat = e.splat(Scalar::Int(0), &shape, DType::Int64)?;
        for k in 0..nsp {
            let d = lead + k;
            let n = x.shape[d];
            let pos: Vec<i64> = wins[k].iter().map(|w| (w.0 + tap[k]).min(n - 1)).collect();
            let ok: Vec<i64> = wins[k]
                .iter()
                .map(|w| (w.0 + tap[k] < w.1) as i64)
                .collect();
            let o = shape[d];
            let idx = e.constant_i64(&pos, &[o], DType::Int64)?;
            let mut vshape = v.shape.clone();
            vshape[d] = o;
            v = take_along(cx.e, &v, d, &idx, &vshape)?;
            let okd = e.broadcast_in_dim(
                &e.convert(&e.constant_i64(&ok, &[o], DType::Int64)?, DType::Bool)?,
                &shape,
                &[d as i64],
            )?;
            valid = Some(match valid {
                None => okd,
                Some(p) => e.and(&p, &okd)?,
            });
            let stride: i64 = x.shape[d + 1..].iter().product();
            let pd = e.broadcast_in_dim(&idx, &shape, &[d as i64])?;
            flat = e.add(
                &flat,
                &e.mul(&pd, &e.splat(Scalar::Int(stride), &[], DType::Int64)?)?,
            )?;
        }
        let valid = valid.ok_or_else(|| cx.err("adaptive pooling without spatial dims"))?;
        best = Some(match best {
            None => (v, flat),
            Some((bv, bi)) => {
                let better = e.or(&e.compare(&v, &bv, "GT")?, &e.isnan(&v)?)?;
                let take = e.and(&better, &valid)?;
                (
                    e.select(&take, &v, &bv, x.dtype)?,
                    e.select(&take, &flat, &bi, DType::Int64)?,
                )
            }
        });
    }
    let (v, i) = best.ok_or_else(|| cx.err("adaptive pooling with an empty window"))?;
    Ok(vec![v, i])
}

/// Max pooling that also returns, for each output, the flat index (`h * W + w`; in 3-D `(d * H + h) * W + w`) of the chosen
/// input element in its plane (volume), chosen as PyTorch's CPU kernel does: windows are scanned in order,
/// the first valid element starts, a later one wins when it is greater or NaN.
fn max_pool_with_indices<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    x: &T<'c, 'b>,
    w: &Window,
    out_shape: &[i64],
) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let e = cx.e;
    let r = x.rank();
    let nsp = w.kernel.len();
    let sp: Vec<usize> = (r - nsp..r).collect();
    // Pad with -inf so every window slice stays inside the padded tensor.
    let xp = w.pad(e, x, out_shape, Scalar::Float(f64::NEG_INFINITY))?;
    let padded_shape = xp.shape.clone();
    let i64k = |v: i64| e.splat(Scalar::Int(v), &[], DType::Int64);
    let outs: Vec<T> = sp
        .iter()
        .map(|&d| e.iota(out_shape, d as i64, DType::Int64))
        .collect::<R<_>>()?;
    let taps = w.taps();
    let mut best: Option<(T, T)> = None;
    for (n_tap, tap) in taps.iter().enumerate() {
        let mut start = vec![0; r];
        let mut limit = padded_shape.clone();
        let mut strides = vec![1; r];
        for (k, &d) in sp.iter().enumerate() {
            start[d] = tap[k] * w.dilation[k];
            limit[d] = start[d] + (out_shape[d] - 1) * w.stride[k] + 1;
            strides[d] = w.stride[k];
        }
        let cand = e.slice(&xp, &start, &limit, &strides)?;
        // Input coordinates of this tap: o * stride + k * dilation - padding; valid inside the
        // input; the flat index within the spatial volume.
        let mut valid: Option<T> = None;
        let mut flat: Option<T> = None;
        for (k, &d) in sp.iter().enumerate() {
            let c = e.add(
                &e.mul(&outs[k], &i64k(w.stride[k])?)?,
                &i64k(tap[k] * w.dilation[k] - w.padding[k])?,
            )?;
            let ok = e.and(
                &e.compare(&c, &i64k(0)?, "GE")?,
                &e.compare(&c, &i64k(x.shape[d])?, "LT")?,
            )?;
            valid = Some(match valid {
                None => ok,
                Some(v) => e.and(&v, &ok)?,
            });
            flat = Some(match flat {
                None => c,
                Some(f) => e.add(&e.mul(&f, &i64k(x.shape[d])?)?, &c)?,
            });
        }
        let (valid, flat) = match (valid, flat) {
            (Some(v), Some(f)) => (v, f),
            _ => return Err(cx.err("max pooling without spatial dims")),
        };
        best = Some(match best {
            None => (cand, flat),
            Some((bv, bi)) => {
                let greater = e.compare(&cand, &bv, "GT")?;
                let better = e.or(&greater, &e.isnan(&cand)?)?;
                // A tap is taken when it is better, or when nothing valid was taken yet.
                let none_yet = e.compare(&bi, &i64k(0)?, "LT")?;
                let take = e.and(&e.or(&better, &none_yet)?, &valid)?;
                (
                    e.select(&take, &cand, &bv, x.dtype)?,
                    e.select(&take, &flat, &bi, DType::Int64)?,
                )
            }
        });
        // The first tap may fall into padding: mark its index invalid (-1).
        if n_tap == 0 {
            let (bv, bi) = best.take().expect("set above");
            let bi = e.select(&valid, &bi, &i64k(-1)?, DType::Int64)?;
            best = Some((bv, bi));
        }
    }
    best.ok_or_else(|| cx.err("max pooling with an empty window"))
}

/// Gradient of max pooling: each output gradient goes to the input element its index names
/// (summed where windows overlap on the same maximum).
fn max_pool2d_with_indices_backward<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let nsp = if cx.node.op.contains("3d") { 3 } else { 2 };
    let g = cx.tensor(0, "grad_output")?;
    let x = cx.tensor(1, "self")?;
    let indices = cx.tensor(7, "indices")?;
    let (shape, out) = cx.out(0)?;
    let e = cx.e;
    let acc = acc_dtype(out);
    let ga = e.convert(&g, acc)?;
    let w = window_at(cx, 2, Some(5), nsp)?;
    if nsp == 2 && w.taps().len() <= MAX_POOL_GRAD_TAPS {
        let grad = max_pool_grad_by_taps(e, &ga, &indices, &w, &x.shape)?;
        return Ok(vec![e.convert(&grad, out)?]);
    }
    let grad = scatter_by_flat_indices(e, &ga, &indices, &shape, nsp)?;
    Ok(vec![e.convert(&grad, out)?])
}

/// `adaptive_max_pool2d_backward` / `adaptive_max_pool3d_backward(grad_output, self,
/// indices)`: each output gradient added at the input element its index names.
fn adaptive_max_pool_backward<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let nsp = if cx.node.op.contains("3d") { 3 } else { 2 };
    let g = cx.tensor(0, "grad_output")?;
    let indices = cx.tensor(2, "indices")?;
    let (shape, out) = cx.out(0)?;
    let e = cx.e;
    let ga = e.convert(&g, acc_dtype(out))?;
    let grad = scatter_by_flat_indices(e, &ga, &indices, &shape, nsp)?;
    Ok(vec![e.convert(&grad, out)?])
}

/// `replication_pad{1,2,3}d_backward(grad_output, self, padding)`: per padded dim (the last
/// first, as `padding` pairs them), the gradient of the kept positions, plus the sums over
/// each edge's padding added to that edge's element. A negative pad cropped the input: the
/// cropped elements' gradient is zero.
fn replication_pad_backward<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let g = cx.tensor(0, "grad_output")?;
    let pad = cx.ints(2, "padding")?;
    let (shape, out) = cx.out(0)?;
    let e = cx.e;
    let acc = acc_dtype(out);
    let r = g.rank();
    if pad.len() % 2 != 0 || pad.len() / 2 > r {
        return Err(cx.err("padding must hold a (before, after) pair per padded dim"));
    }
    let zero = e.splat(Scalar::Int(0), &[], acc)?;
    let mut t = e.convert(&g, acc)?;
    for (k, pair) in pad.chunks(2).enumerate() {
        let d = r - 1 - k;
        let n = shape[d];
        let (mut before, mut after) = (pair[0], pair[1]);
        if before < 0 || after < 0 {
            let (mut lo, mut hi) = (vec![0; r], vec![0; r]);
            lo[d] = (-before).max(0);
            hi[d] = (-after).max(0);
            t = e.pad(&t, &zero, &lo, &hi, &vec![0; r])?;
            before = before.max(0);
            after = after.max(0);
        }
        let along = |from: i64, to: i64| {
            let (mut start, mut limit) = (vec![0; r], t.shape.clone());
            start[d] = from;
            limit[d] = to;
            e.slice(&t, &start, &limit, &vec![1; r])
        };
        let mut kept = along(before, before + n)?;
        // Each edge's padding summed onto the edge element (a 1-long sum padded out to n).
        for (from, to, at) in [(0, before, 0), (before + n, before + n + after, n - 1)] {
            if to > from {
                let sum = e.reduce(&along(from, to)?, &[d as i64], ReduceKind::Sum, true)?;
                let (mut lo, mut hi) = (vec![0; r], vec![0; r]);
                lo[d] = at;
                hi[d] = n - 1 - at;
                kept = e.add(&kept, &e.pad(&sum, &zero, &lo, &hi, &vec![0; r])?)?;
            }
        }
        t = kept;
    }
    Ok(vec![e.convert(&t, out)?])
}

/// A pooling gradient by its indices: `g`'s values added (overlapping windows sum) into zeros
/// of `x_shape` at `indices`, each flat within the last `nsp` dims (the plane or volume).
fn scatter_by_flat_indices<'c, 'b>(
    e: &Emitter<'c, 'b>,
    g: &T<'c, 'b>,
    indices: &T<'c, 'b>,
    x_shape: &[i64],
    nsp: usize,
) -> R<T<'c, 'b>> {
    let r = x_shape.len();
    let plane: i64 = x_shape[r - nsp..].iter().product();
    let lead: Vec<i64> = x_shape[..r - nsp].to_vec();
    let mut flat_x = lead.clone();
    flat_x.push(plane);
    let mut flat_g = lead;
    flat_g.push(g.shape[r - nsp..].iter().product());
    let gf = e.reshape(g, &flat_g)?;
    let idx = e.reshape(indices, &flat_g)?;
    let coords = along_dim_coords(e, &idx, r - nsp, plane)?;
    let zeros = e.splat(Scalar::Int(0), &flat_x, g.dtype)?;
    let all: Vec<i64> = (0..flat_x.len() as i64).collect();
    let s = e.scatter(&zeros, &coords, &gf, &[], &all, &all, true)?;
    e.reshape(&s, x_shape)
}

/// Windows up to this many taps take their gradient tap by tap (ResNet's 3x3 stem pooling);
/// a larger one keeps the scatter.
const MAX_POOL_GRAD_TAPS: usize = 16;

/// Max-pooling gradient as a sum over the window's taps: at each tap, the output gradients whose
/// index names that tap's input element, spread onto the input grid by a strided pad. XLA fuses
/// the pads and sums into one pass over the input, where the scatter of every output gradient
/// is a serial loop (bench/results/lowering-choices.md).
fn max_pool_grad_by_taps<'c, 'b>(
    e: &Emitter<'c, 'b>,
    g: &T<'c, 'b>,
    indices: &T<'c, 'b>,
    w: &Window,
    x_shape: &[i64],
) -> R<T<'c, 'b>> {
    let r = g.rank();
    let (oh, ow) = (g.shape[r - 2], g.shape[r - 1]);
    let (h, wd) = (x_shape[r - 2], x_shape[r - 1]);
    let i64k = |v: i64| e.splat(Scalar::Int(v), &[], DType::Int64);
    let rows = e.iota(&g.shape, (r - 2) as i64, DType::Int64)?;
    let cols = e.iota(&g.shape, (r - 1) as i64, DType::Int64)?;
    // Flat index of each output's window corner (before padding); a tap adds a constant to it.
    let corner = e.add(
        &e.mul(&rows, &i64k(w.stride[0] * wd)?)?,
        &e.mul(&cols, &i64k(w.stride[1])?)?,
    )?;
    let zero = e.splat(Scalar::Int(0), &[], g.dtype)?;
    let mut interior = vec![0; r];
    interior[r - 2] = w.stride[0] - 1;
    interior[r - 1] = w.stride[1] - 1;
    let mut sum: Option<T> = None;
    for tap in w.taps() {
        let off = [
            tap[0] * w.dilation[0] - w.padding[0],
            tap[1] * w.dilation[1] - w.padding[1],
        ];
        // The input element this tap reads for each output; an out-of-range coordinate may
        // alias another element's flat index, but the pad below crops that position away.
        let flat = e.add(&corner, &i64k(off[0] * wd + off[1])?)?;
        let hit = e.compare(indices, &flat, "EQ")?;
        let picked = e.select(&hit, g, &zero, g.dtype)?;
        let (mut lo, mut hi) = (vec![0; r], vec![0; r]);
        lo[r - 2] = off[0];
        lo[r - 1] = off[1];
        hi[r - 2] = h - off[0] - (oh - 1) * w.stride[0] - 1;
        hi[r - 1] = wd - off[1] - (ow - 1) * w.stride[1] - 1;
        let placed = e.pad(&picked, &zero, &lo, &hi, &interior)?;
        sum = Some(match sum {
            None => placed,
            Some(s) => e.add(&s, &placed)?,
        });
    }
    sum.ok_or_else(|| LowerError::internal("max pooling gradient with an empty window"))
}

/// Batch statistics over every dim but the channel dim (1): (mean, biased variance), in `acc`.
fn batch_stats<'c, 'b>(e: &Emitter<'c, 'b>, xf: &T<'c, 'b>) -> R<(T<'c, 'b>, T<'c, 'b>, i64)> {
    let dims: Vec<i64> = (0..xf.rank() as i64).filter(|&d| d != 1).collect();
    let n: i64 = dims.iter().map(|&d| xf.shape[d as usize]).product();
    let acc = xf.dtype;
    let count = e.splat(Scalar::Int(n), &[], acc)?;
    let mean = e.binary(
        "stablehlo.divide",
        &e.reduce(xf, &dims, ReduceKind::Sum, false)?,
        &count,
        acc,
    )?;
    let d = e.binary(
        "stablehlo.subtract",
        xf,
        &per_channel(e, &mean, &xf.shape)?,
        acc,
    )?;
    let var = e.binary(
        "stablehlo.divide",
        &e.reduce(
            &e.binary("stablehlo.multiply", &d, &d, acc)?,
            &dims,
            ReduceKind::Sum,
            false,
        )?,
        &count,
        acc,
    )?;
    Ok((mean, var, n))
}

/// `(x - mean) * rstd * weight + bias` with per-channel vectors, in the dtype of `xf`.
fn normalize<'c, 'b>(
    e: &Emitter<'c, 'b>,
    xf: &T<'c, 'b>,
    mean: &T<'c, 'b>,
    rstd: &T<'c, 'b>,
    w: Option<&T<'c, 'b>>,
    b: Option<&T<'c, 'b>>,
) -> R<T<'c, 'b>> {
    let acc = xf.dtype;
    let shape = xf.shape.clone();
    let mut y = e.binary(
        "stablehlo.subtract",
        xf,
        &per_channel(e, mean, &shape)?,
        acc,
    )?;
    y = e.binary(
        "stablehlo.multiply",
        &y,
        &per_channel(e, rstd, &shape)?,
        acc,
    )?;
    if let Some(w) = w {
        y = e.binary(
            "stablehlo.multiply",
            &y,
            &per_channel(e, &e.convert(w, acc)?, &shape)?,
            acc,
        )?;
    }
    if let Some(b) = b {
        y = e.binary(
            "stablehlo.add",
            &y,
            &per_channel(e, &e.convert(b, acc)?, &shape)?,
            acc,
        )?;
    }
    Ok(y)
}

fn rsqrt_eps<'c, 'b>(e: &Emitter<'c, 'b>, var: &T<'c, 'b>, eps: f64) -> R<T<'c, 'b>> {
    let acc = var.dtype;
    e.unary(
        "stablehlo.rsqrt",
        &e.binary(
            "stablehlo.add",
            var,
            &e.splat(Scalar::Float(eps), &[], acc)?,
            acc,
        )?,
    )
}

/// Training-mode BatchNorm without side effects:
/// `_native_batch_norm_legit_functional(x, weight, bias, running_mean, running_var, training,
/// momentum, eps) -> (out, save_mean, save_rstd, new_running_mean, new_running_var)`. The new
/// running variance uses the unbiased batch variance, as PyTorch does.
fn batch_norm_functional<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let training = cx.bool_or(5, "training", true)?;
    let momentum = cx.float_or(6, "momentum", 0.1)?;
    let eps = cx.float_or(7, "eps", 1e-5)?;
    batch_norm_update(cx, training, momentum, eps, &[0, 1, 2, 3, 4])
}

/// `_batch_norm_with_update_functional(x, weight, bias, running_mean, running_var, momentum,
/// eps) -> (out, save_mean, save_rstd, reserve, new_running_mean, new_running_var)`: training
/// BatchNorm, `reserve` empty.
fn batch_norm_with_update<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let momentum = cx.float_or(5, "momentum", 0.1)?;
    let eps = cx.float_or(6, "eps", 1e-5)?;
    let mut r = batch_norm_update(cx, true, momentum, eps, &[0, 1, 2, 4, 5])?;
    r.insert(3, empty_or_unused(cx, 3)?);
    Ok(r)
}

/// BatchNorm with running statistics: (out, save_mean, save_rstd, new_running_mean,
/// new_running_var), typed like results `outs` of the node.
fn batch_norm_update<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    training: bool,
    momentum: f64,
    eps: f64,
    outs: &[usize],
) -> V<'c, 'b> {
    let x = cx.tensor(0, "input")?;
    let w = cx.opt_tensor(1, "weight")?;
    let b = cx.opt_tensor(2, "bias")?;
    let rm = cx.tensor(3, "running_mean")?;
    let rv = cx.tensor(4, "running_var")?;
    let (_, out) = cx.out(0)?;
    let acc = acc_dtype(out);
    let e = cx.e;
    let xf = e.convert(&x, acc)?;
    if !training {
        let mean = e.convert(&rm, acc)?;
        let rstd = rsqrt_eps(e, &e.convert(&rv, acc)?, eps)?;
        let y = normalize(e, &xf, &mean, &rstd, w.as_ref(), b.as_ref())?;
        return Ok(vec![
            e.convert(&y, out)?,
            empty_or_unused(cx, outs[1])?,
            empty_or_unused(cx, outs[2])?,
            e.convert(&rm, cx.out(outs[3])?.1)?,
            e.convert(&rv, cx.out(outs[4])?.1)?,
        ]);
    }
    let (mean, var, n) = batch_stats(e, &xf)?;
    let rstd = rsqrt_eps(e, &var, eps)?;
    let y = normalize(e, &xf, &mean, &rstd, w.as_ref(), b.as_ref())?;
    let k = |v: f64| e.splat(Scalar::Float(v), &[], acc);
    let blend = |old: &T<'c, 'b>, new: &T<'c, 'b>, dtype: DType| -> R<T<'c, 'b>> {
        let kept = e.binary(
            "stablehlo.multiply",
            &e.convert(old, acc)?,
            &k(1.0 - momentum)?,
            acc,
        )?;
        let added = e.binary("stablehlo.multiply", new, &k(momentum)?, acc)?;
        e.convert(&e.binary("stablehlo.add", &kept, &added, acc)?, dtype)
    };
    let unbiased = e.binary(
        "stablehlo.multiply",
        &var,
        &k(n as f64 / (n as f64 - 1.0))?,
        acc,
    )?;
    Ok(vec![
        e.convert(&y, out)?,
        e.convert(&mean, cx.out(outs[1])?.1)?,
        e.convert(&rstd, cx.out(outs[2])?.1)?,
        blend(&rm, &mean, cx.out(outs[3])?.1)?,
        blend(&rv, &unbiased, cx.out(outs[4])?.1)?,
    ])
}

/// `_native_batch_norm_legit.no_stats(x, weight, bias, training, momentum, eps)`: batch
/// statistics, no running statistics -> (out, save_mean, save_rstd).
fn batch_norm_no_stats<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "input")?;
    let w = cx.opt_tensor(1, "weight")?;
    let b = cx.opt_tensor(2, "bias")?;
    let eps = cx.float_or(5, "eps", 1e-5)?;
    let (_, out) = cx.out(0)?;
    let acc = acc_dtype(out);
    let e = cx.e;
    let xf = e.convert(&x, acc)?;
    let (mean, var, _) = batch_stats(e, &xf)?;
    let rstd = rsqrt_eps(e, &var, eps)?;
    let y = normalize(e, &xf, &mean, &rstd, w.as_ref(), b.as_ref())?;
    Ok(vec![
        e.convert(&y, out)?,
        e.convert(&mean, cx.out(1)?.1)?,
        e.convert(&rstd, cx.out(2)?.1)?,
    ])
}
