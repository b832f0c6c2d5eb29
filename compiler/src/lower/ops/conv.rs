//! Convolutions (1-3 spatial dims) and their gradients: XLA's convolution, oneDNN's through the
//! host kernels, or matrix products over taps, patches or pointwise kernels, whichever is faster
//! for the shape. They honour the session precision (`precision_config`); low-precision
//! operands accumulate in f32 and round once, as PyTorch's CPU kernels do.

use crate::lower::emit::{array_i64, int_list, Emitter, NCHW_OF_NHWC};
use crate::lower::helpers::matmul::matmul_2d;
use crate::lower::helpers::widen::acc_dtype;
use crate::lower::helpers::window::{taps as window_taps, Window};
use crate::lower::Rule;
use crate::lower::{NodeCx, ReduceKind, Scalar, R, T};
use tpuc_frontend_fx::{Arg, DType};
use tpuc_hostkernels::host_conv;

pub static RULES: &[(&str, Rule)] = &[
    ("aten.convolution.default", convolution),
    ("aten.convolution_backward.default", convolution_backward),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;

/// `convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding,
/// groups)` for 1-3 spatial dims. The result is NCHW; forward 2-D convolutions lowered as
/// XLA's convolution or as pointwise products compute it channels-last (NHWC) and return it
/// through [`Emitter::layout_transpose`], and read an input that is such a transpose in its
/// NHWC form (see [`channels_last`]).
fn convolution<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "input")?;
    let w = cx.tensor(1, "weight")?;
    let bias = cx.opt_tensor(2, "bias")?;
    let (shape, out) = cx.out(0)?;
    let ConvWindow {
        nsp,
        stride,
        padding,
        dilation,
        groups,
        transposed,
        output_padding,
    } = ConvWindow::parse(cx, x.rank(), 3)?;
    let sp = spatial_list(nsp);
    let acc = acc_dtype(out);
    let xc = cx.e.convert(&x, out)?;
    let wc = cx.e.convert(&w, out)?;
    // Every form below but XLA's convolution is for XLA's CPU compiler: on a GPU or TPU each
    // convolution is one `stablehlo.convolution` in NCHW terms, whose layout XLA assigns
    // (as JAX emits them; see docs/tpu-lowering.md).
    let cpu = !cx.e.accelerator();
    let pointwise = cpu && is_pointwise(&w.shape, &padding, groups);
    // Depthwise convolutions are tap sums (channels-last for 2-D ones): XLA's CPU plugin runs
    // a grouped convolution through Eigen, group by group (about 4x slower:
    // bench/results/lowering-choices.md).
    let depthwise = cpu && is_depthwise(&x.shape, &w.shape, groups);
    // Every other 2-D one goes to oneDNN where the session enables it (measured faster than
    // each of the XLA lowerings here, at every size: see [`host_conv`]). Without it, small 2-D
    // ones are their NHWC patches times the kernel (below); small 1-D and 3-D ones the
    // NCHW-like patch products of the tap rules.
    let onednn = !transposed
        && !depthwise
        && !pointwise
        && channels_last(nsp)
        && onednn_conv(cx.e, &[&x, &w], (&shape, out));
    let taps = depthwise
        || (cpu
            && groups == 1
            && !onednn
            && (few_positions(&shape)
                || (!channels_last(nsp) && small_patches(&x.shape, &w.shape, &shape))));
    // The window of the tap and patch lowerings (the other rules read its parts).
    let geometry = Window {
        kernel: w.shape[2..].to_vec(),
        stride: stride.clone(),
        padding: padding.clone(),
        dilation: dilation.clone(),
    };
    if cpu && !transposed && (pointwise || depthwise || !taps) && channels_last(nsp) {
        let e = cx.e;
        let xl = nhwc(e, &xc)?;
        let nhwc_shape = [shape[0], shape[2], shape[3], shape[1]];
        let r = if depthwise {
            let xa = e.convert(&xl, acc)?;
            let window = TapWindow::channels_last(&xa, geometry, &nhwc_shape);
            depthwise_taps(cx, &window, &e.convert(&wc, acc)?)?
        } else if pointwise {
            pointwise_dot_nhwc(
                cx,
                &e.convert(&xl, acc)?,
                &e.convert(&wc, acc)?,
                &stride,
                &nhwc_shape,
            )?
        } else if onednn {
            host_conv(
                e,
                host_conv::FORWARD,
                &xl,
                &wc,
                &geometry,
                groups,
                &nhwc_shape,
            )?
        } else if groups == 1 && small_patches(&x.shape, &w.shape, &shape) {
            // XLA's CPU convolution (Eigen's) of a few channels costs several times the work
            // (bench/results/lowering-choices.md).
            nhwc_patch_product(
                e,
                &e.convert(&xl, acc)?,
                &e.convert(&wc, acc)?,
                &geometry,
                &nhwc_shape,
            )?
        } else {
            let pads: Vec<(i64, i64)> = padding.iter().map(|&p| (p, p)).collect();
            conv_general(
                cx,
                &xl,
                &wc,
                "#stablehlo.conv<[b, 0, 1, f]x[o, i, 0, 1]->[b, 0, 1, f]>".to_string(),
                &stride,
                &pads,
                &[1, 1],
                &dilation,
                groups,
                1,
                &nhwc_shape,
                acc,
            )?
        };
        let r = match bias {
            Some(b) => {
                let b = e.broadcast_in_dim(&e.convert(&b, acc)?, &nhwc_shape, &[3])?;
                e.binary("stablehlo.add", &r, &b, acc)?
            }
            None => r,
        };
        let r = e.convert(&r, out)?;
        // A depthwise convolution's result (bias included) through a barrier, one buffer: its
        // readers (ConvNeXt's layer norm: mean, variance, normalize) would otherwise each
        // recompute every tap (bench/results/lowering-choices.md).
        let r = if depthwise { e.barrier(&r)? } else { r };
        return Ok(vec![e.layout_transpose(&r, &NCHW_OF_NHWC)?]);
    }
    let r = if transposed {
        // The gradient of a convolution: the flipped kernel over the stride-dilated input,
        // padded by its span less the padding (plus output_padding at the end).
        let e = cx.e;
        let kernel: Vec<i64> = w.shape[2..].to_vec();
        // [I, O/g, k..] -> [I/g, O, k..] with the group index leading the output features.
        let k = flipped_group_swapped(e, &wc, groups)?;
        let pads: Vec<(i64, i64)> = (0..nsp)
            .map(|d| {
                let span = dilation[d] * (kernel[d] - 1);
                (span - padding[d], span - padding[d] + output_padding[d])
            })
            .collect();
        conv_general(
            cx,
            &xc,
            &k,
            format!("#stablehlo.conv<[b, f, {sp}]x[i, o, {sp}]->[b, f, {sp}]>"),
            &vec![1; nsp],
            &pads,
            &stride,
            &dilation,
            groups,
            1,
            &shape,
            acc,
        )?
    } else if pointwise {
        pointwise_dot(
            cx,
            &cx.e.convert(&xc, acc)?,
            &cx.e.convert(&wc, acc)?,
            &stride,
            &shape,
        )?
    } else if taps {
        let (xa, wa) = (cx.e.convert(&xc, acc)?, cx.e.convert(&wc, acc)?);
        let window = TapWindow::new(&xa, geometry, &shape);
        if groups > 1 {
            depthwise_taps(cx, &window, &wa)?
        } else {
            tap_dots(cx, &window, &wa)?
        }
    } else {
        let pads: Vec<(i64, i64)> = padding.iter().map(|&p| (p, p)).collect();
        conv_general(
            cx,
            &xc,
            &wc,
            format!("#stablehlo.conv<[b, f, {sp}]x[o, i, {sp}]->[b, f, {sp}]>"),
            &stride,
            &pads,
            &vec![1; nsp],
            &dilation,
            groups,
            1,
            &shape,
            acc,
        )?
    };
    let r = match bias {
        Some(b) => {
            let b =
                cx.e.broadcast_in_dim(&cx.e.convert(&b, acc)?, &shape, &[1])?;
            cx.e.binary("stablehlo.add", &r, &b, acc)?
        }
        None => r,
    };
    let r = cx.e.convert(&r, out)?;
    // Depthwise tap sums materialized, as in the channels-last branch above.
    Ok(vec![if depthwise && !transposed {
        cx.e.barrier(&r)?
    } else {
        r
    }])
}

/// Whether forward convolutions with `nsp` spatial dims are computed channels-last: 2-D ones,
/// unless `TPUC_HOST_KERNELS` turns `channels_last` off (read once per process). XLA's CPU
/// backend runs a convolution in NHWC, so an NCHW one is transposed in and out; channels-last
/// convolutions chained through batch norm, ReLU, residual adds and pooling (whose lowerings
/// follow the layout, see [`Emitter::layout_transpose`]) need no transposes between them. ResNet-50 on the CPU
/// plugin (2 cores): 205 ms at batch 8 vs 222-229 NCHW, 33-37 at batch 1 vs 40.
fn channels_last(nsp: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    nsp == 2
        && *ON.get_or_init(|| {
            tpuc_runtime::env::host_kernel(tpuc_runtime::env::HostKernel::ChannelsLast)
        })
}

/// Whether oneDNN computes a 2-D convolution, or its gradients, of `operands` giving `out`
/// (shape, dtype): the session enables it (`tpuc_hostkernels::host_conv`), everything is f32 and no
/// dim is empty.
fn onednn_conv(
    e: &Emitter<'_, '_>,
    operands: &[&T<'_, '_>],
    (shape, dtype): (&[i64], DType),
) -> bool {
    e.host_conv
        && !e.accelerator()
        && dtype == DType::Float32
        && shape.len() == 4
        && shape.iter().all(|&d| d > 0)
        && operands
            .iter()
            .all(|t| t.dtype == DType::Float32 && t.rank() == 4 && t.shape.iter().all(|&d| d > 0))
}

/// A 2-D f32 convolution through oneDNN (see [`onednn_conv`]). XLA's CPU convolutions are
/// Eigen's; oneDNN's JIT kernels (PyTorch's) are faster at every size measured
/// (bench/results/lowering-choices.md). `target` names the kind, which decides what `a`, `b`
/// and the result `out` are (see that module): channels-last activations, the kernel as
/// PyTorch holds it.
fn host_conv<'c, 'b>(
    e: &Emitter<'c, 'b>,
    target: &str,
    a: &T<'c, 'b>,
    b: &T<'c, 'b>,
    window: &Window,
    groups: i64,
    out: &[i64],
) -> R<T<'c, 'b>> {
    let Window {
        stride,
        padding,
        dilation,
        ..
    } = window;
    let geometry: Vec<i64> = [&stride[..], padding, padding, dilation, &[groups]].concat();
    debug_assert_eq!(geometry.len(), host_conv::GEOMETRY_LEN);
    let g = e.constant_i64(&geometry, &[geometry.len() as i64], DType::Int64)?;
    e.ffi_call_f32(target, &[a, b, &g], out)
}

/// An NCHW value as NHWC: the physical form of a channels-last layout transpose, else a
/// transpose. The physical form is read through an optimization barrier
/// ([`Emitter::materialize_physical`]): the buffer the convolution reads is then also what the
/// value's other readers (a residual add) read. Without it XLA fuses the elementwise chain that
/// made the value into each reader, and along a ResNet stage each block's fusion recomputes
/// every earlier block's batch norms and adds (bench/results/lowering-choices.md).
fn nhwc<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
    match e.physical(x) {
        Some((_, perm)) if perm == NCHW_OF_NHWC => e.materialize_physical(x),
        _ => e.transpose(x, &[0, 2, 3, 1]),
    }
}

/// A pointwise convolution channels-last: the NHWC input (strided slice first) as
/// `[N x positions, C]` times the `[O, C]` weights (the kernel as it lies, contracted along its
/// second dim), which is the NHWC output `out` with no transpose. Operands in the accumulation
/// dtype.
fn pointwise_dot_nhwc<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    x: &T<'c, 'b>,
    w: &T<'c, 'b>,
    stride: &[i64],
    out: &[i64],
) -> R<T<'c, 'b>> {
    let e = cx.e;
    let (c, o) = (x.shape[3], w.shape[0]);
    let rows = out[0] * out[1] * out[2];
    let limit = [
        x.shape[0],
        (out[1] - 1) * stride[0] + 1,
        (out[2] - 1) * stride[1] + 1,
        c,
    ];
    let strided = e.slice(x, &[0; 4], &limit, &[1, stride[0], stride[1], 1])?;
    let flat_x = e.reshape(&strided, &[rows, c])?;
    let flat_w = e.reshape(w, &[o, c])?;
    let product = e.dot_general(
        &flat_x,
        &flat_w,
        (&[], &[]),
        (&[1], &[1]),
        &[rows, o],
        w.dtype,
    )?;
    e.reshape(&product, out)
}

/// The kernel of a convolution's transpose (the transposed convolution, the input gradient):
/// `[A, B/g, k..] -> [A/g, B, k..]` with the group index moved from the first dim to lead the
/// second, and its spatial dims reversed.
fn flipped_group_swapped<'c, 'b>(e: &Emitter<'c, 'b>, w: &T<'c, 'b>, groups: i64) -> R<T<'c, 'b>> {
    let nsp = w.rank() - 2;
    let kernel = &w.shape[2..];
    let (a, bg) = (w.shape[0], w.shape[1]);
    let k = if groups > 1 {
        let mut s5 = vec![groups, a / groups, bg];
        s5.extend_from_slice(kernel);
        let mut perm: Vec<i64> = vec![1, 0, 2];
        perm.extend(3..3 + nsp as i64);
        let t = e.transpose(&e.reshape(w, &s5)?, &perm)?;
        let mut s4 = vec![a / groups, groups * bg];
        s4.extend_from_slice(kernel);
        e.reshape(&t, &s4)?
    } else {
        w.clone()
    };
    let rev: Vec<i64> = (2..2 + nsp as i64).collect();
    e.op(
        "stablehlo.reverse",
        &[&k],
        &[("dimensions", array_i64(&rev))],
        &k.shape.clone(),
        k.dtype,
    )
}

/// Whether a forward convolution is pointwise: a 1x1 kernel without padding or groups
/// (ResNet's bottleneck projections: 36 of ResNet-50's 53 convolutions).
fn is_pointwise(w: &[i64], padding: &[i64], groups: i64) -> bool {
    groups == 1 && w[2..].iter().all(|&k| k == 1) && padding.iter().all(|&p| p == 0)
}

/// A pointwise convolution as one matrix product of the `[O, C]` weights (the kernel as it
/// lies, a reshape) with the `[N, C, positions]` input (strided slice first), in NCHW
/// throughout. XLA's CPU backend runs a convolution in NHWC with an HWIO kernel, so it
/// transposes the input, the output and the whole kernel on every call (ResNet-50 a quarter
/// faster as this product: bench/results/lowering-choices.md). Operands in the accumulation dtype.
fn pointwise_dot<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    x: &T<'c, 'b>,
    w: &T<'c, 'b>,
    stride: &[i64],
    out: &[i64],
) -> R<T<'c, 'b>> {
    let e = cx.e;
    let (n, c, o) = (x.shape[0], x.shape[1], w.shape[0]);
    let positions: i64 = out[2..].iter().product();
    let flat_x = e.reshape(
        &strided_positions(cx, x, stride, &out[2..])?,
        &[n, c, positions],
    )?;
    let flat_w = e.reshape(w, &[o, c])?;
    // [O, N, positions] (dot_general puts the weights' free dim first), then NCHW.
    let product = e.dot_general(
        &flat_w,
        &flat_x,
        (&[], &[]),
        (&[1], &[1]),
        &[o, n, positions],
        w.dtype,
    )?;
    swap_leading_into(e, &product, out)
}

/// `t` (rank 3) with its two leading dims swapped, reshaped to `shape`: one reshape when either
/// of them is 1 (no data moves), else a transpose first. Moves the batch between the front and
/// the channels of the matrix products that convolutions are lowered to.
fn swap_leading_into<'c, 'b>(e: &Emitter<'c, 'b>, t: &T<'c, 'b>, shape: &[i64]) -> R<T<'c, 'b>> {
    if t.shape[0] == 1 || t.shape[1] == 1 {
        e.reshape(t, shape)
    } else {
        e.reshape(&e.transpose(t, &[1, 0, 2])?, shape)
    }
}

/// The input positions a pointwise convolution with `stride` reads for output spatial size
/// `out_sp`: a strided slice of `x` (all of it at stride 1).
fn strided_positions<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    x: &T<'c, 'b>,
    stride: &[i64],
    out_sp: &[i64],
) -> R<T<'c, 'b>> {
    let rank = x.rank();
    let mut steps = vec![1, 1];
    steps.extend_from_slice(stride);
    let mut limit = x.shape.clone();
    for k in 2..rank {
        // The last input position the strided window reads, plus one.
        limit[k] = (out_sp[k - 2] - 1) * steps[k] + 1;
    }
    cx.e.slice(x, &vec![0; rank], &limit, &steps)
}

/// The input gradient of a pointwise convolution: the weights transposed times the output
/// gradient (`[C, O] x [N, O, positions]`), NCHW throughout, then spread back to the strided
/// input positions with zeros between (an interior pad). Operands in the accumulation dtype;
/// `in_shape` is the input's shape. Like the forward (`pointwise_dot`), this keeps XLA's CPU
/// backend from copying the kernel and both activations to NHWC/HWIO on every step.
fn pointwise_input_grad<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    g: &T<'c, 'b>,
    w: &T<'c, 'b>,
    stride: &[i64],
    in_shape: &[i64],
) -> R<T<'c, 'b>> {
    let e = cx.e;
    let (n, o, c) = (g.shape[0], g.shape[1], w.shape[1]);
    let positions: i64 = g.shape[2..].iter().product();
    let flat_g = e.reshape(g, &[n, o, positions])?;
    let flat_w = e.reshape(w, &[o, c])?;
    let product = e.dot_general(
        &flat_w,
        &flat_g,
        (&[], &[]),
        (&[0], &[1]),
        &[c, n, positions],
        g.dtype,
    )?;
    let mut strided_shape = vec![n, c];
    strided_shape.extend_from_slice(&g.shape[2..]);
    let strided = swap_leading_into(e, &product, &strided_shape)?;
    if stride.iter().all(|&s| s == 1) && strided_shape == in_shape {
        return Ok(strided);
    }
    let rank = in_shape.len();
    let (mut interior, mut high) = (vec![0; rank], vec![0; rank]);
    for k in 2..rank {
        interior[k] = stride[k - 2] - 1;
        high[k] = in_shape[k] - ((strided_shape[k] - 1) * stride[k - 2] + 1);
    }
    let zero = e.splat(Scalar::Float(0.0), &[], g.dtype)?;
    e.op(
        "stablehlo.pad",
        &[&strided, &zero],
        &[
            ("edge_padding_low", array_i64(&vec![0; rank])),
            ("edge_padding_high", array_i64(&high)),
            ("interior_padding", array_i64(&interior)),
        ],
        in_shape,
        g.dtype,
    )
}

/// The weight gradient of a pointwise convolution: the output gradient times the strided
/// input, contracting batch and positions (`[N, O, P] x [N, C, P] -> [O, C]`). Operands in the
/// accumulation dtype; `w_shape` is the weight's shape.
fn pointwise_weight_grad<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    g: &T<'c, 'b>,
    x: &T<'c, 'b>,
    stride: &[i64],
    w_shape: &[i64],
) -> R<T<'c, 'b>> {
    let e = cx.e;
    let (n, o, c) = (g.shape[0], g.shape[1], x.shape[1]);
    let positions: i64 = g.shape[2..].iter().product();
    let flat_g = e.reshape(g, &[n, o, positions])?;
    let flat_x = e.reshape(
        &strided_positions(cx, x, stride, &g.shape[2..])?,
        &[n, c, positions],
    )?;
    let product = e.dot_general(
        &flat_g,
        &flat_x,
        (&[], &[]),
        (&[0, 2], &[0, 2]),
        &[o, c],
        g.dtype,
    )?;
    e.reshape(&product, w_shape)
}

/// Most kernel taps for which a depthwise convolution is lowered as a sum over its taps.
const DEPTHWISE_MAX_TAPS: i64 = 81;

/// Whether a forward convolution is depthwise: one filter of one input channel per output
/// channel (`groups == C_in == C_out`, MobileNet's and ConvNeXt's spatial convolutions), with at
/// most [`DEPTHWISE_MAX_TAPS`] taps.
fn is_depthwise(x: &[i64], w: &[i64], groups: i64) -> bool {
    groups > 1
        && x.get(1) == Some(&groups)
        && w.first() == Some(&groups)
        && w.get(1) == Some(&1)
        && w[2..].iter().product::<i64>() <= DEPTHWISE_MAX_TAPS
}

/// Most output positions (the product of the output's spatial dims) for which a convolution is
/// lowered as a sum of one matrix product per kernel tap, whatever its channels.
const TAP_DOTS_MAX_POSITIONS: i64 = 4;

/// Whether a convolution with output `shape` (NC + spatial) has few enough output positions to
/// be lowered as matrix products over its taps ([`tap_dots`]): at most
/// [`TAP_DOTS_MAX_POSITIONS`], or at most twice as many positions over the batch as output
/// channels. Then the window slices side by side (the patches) are no bigger than about twice
/// the kernel, which XLA's CPU convolution would copy to HWIO on every call (the bound is
/// where products stop winning: bench/results/lowering-choices.md).
fn few_positions(shape: &[i64]) -> bool {
    let positions: i64 = shape[2..].iter().product();
    positions <= TAP_DOTS_MAX_POSITIONS || shape[0] * positions <= 2 * shape[1]
}

/// Most elements of a convolution's patches (input channels x taps x batch x positions) for
/// which it is lowered as the kernel times its patches whatever its output channels (NHWC
/// patches for 2-D ones, NCHW-like for 1-D and 3-D): small convolutions, where XLA's CPU
/// convolution costs several times the work.
const SMALL_PATCHES: i64 = 1 << 18;

fn small_patches(x: &[i64], w: &[i64], out: &[i64]) -> bool {
    x[1] * w[2..].iter().product::<i64>() * out[0] * out[2..].iter().product::<i64>()
        <= SMALL_PATCHES
}

/// A convolution's input and the window's geometry, for the lowerings that go tap by tap. Each
/// tap's (or output position's) window is a strided slice of the input zero-padded by the
/// window's padding; a window that lies inside the input is sliced from it, so the padded input
/// is only made when some window reaches into the padding. Input and output are
/// `[batch, channels, spatial...]`, or `[batch, spatial..., channels]` when made by
/// [`TapWindow::channels_last`].
struct TapWindow<'c, 'b> {
    x: T<'c, 'b>,
    /// `x` padded (see [`Window::pad`]), made on first use.
    padded: std::cell::OnceCell<T<'c, 'b>>,
    geometry: Window,
    out_shape: Vec<i64>,
    /// The first spatial dim of `x` and `out_shape`.
    first: usize,
}

impl<'c, 'b> TapWindow<'c, 'b> {
    fn new(x: &T<'c, 'b>, geometry: Window, out_shape: &[i64]) -> TapWindow<'c, 'b> {
        TapWindow {
            x: x.clone(),
            padded: std::cell::OnceCell::new(),
            geometry,
            out_shape: out_shape.to_vec(),
            first: 2,
        }
    }

    fn channels_last(x: &T<'c, 'b>, geometry: Window, out_shape: &[i64]) -> TapWindow<'c, 'b> {
        TapWindow {
            first: 1,
            ..TapWindow::new(x, geometry, out_shape)
        }
    }

    /// The channel dim of the input and output.
    fn channel_dim(&self) -> usize {
        if self.first == 1 {
            self.x.rank() - 1
        } else {
            1
        }
    }

    /// The output's spatial dims.
    fn out_spatial(&self) -> &[i64] {
        &self.out_shape[self.first..self.first + self.geometry.kernel.len()]
    }

    /// The unpadded input's size along spatial dim `k`.
    fn input(&self, k: usize) -> i64 {
        self.x.shape[k + self.first]
    }

    /// The slice of the padded input at `start` (padded coordinates, per spatial dim), `count`
    /// elements `step` apart per spatial dim, all batches and channels.
    fn padded_slice(
        &self,
        cx: &NodeCx<'_, 'c, 'b>,
        start: &[i64],
        count: &[i64],
        step: &[i64],
    ) -> R<T<'c, 'b>> {
        let pad = &self.geometry.padding;
        let last = |k: usize| start[k] + (count[k] - 1) * step[k];
        let inside =
            (0..start.len()).all(|k| start[k] >= pad[k] && last(k) < pad[k] + self.input(k));
        let (source, shift) = if inside {
            (&self.x, pad.as_slice())
        } else {
            if self.padded.get().is_none() {
                let p = self.geometry.pad_from(
                    cx.e,
                    &self.x,
                    &self.out_shape,
                    Scalar::Float(0.0),
                    self.first,
                )?;
                let _ = self.padded.set(p);
            }
            (self.padded.get().expect("set above"), &[][..])
        };
        let rank = source.rank();
        let (mut lo, mut hi, mut steps) = (vec![0; rank], source.shape.clone(), vec![1; rank]);
        for k in 0..start.len() {
            let off = shift.get(k).copied().unwrap_or(0);
            lo[k + self.first] = start[k] - off;
            hi[k + self.first] = last(k) - off + 1;
            steps[k + self.first] = step[k];
        }
        cx.e.slice(source, &lo, &hi, &steps)
    }

    /// Whether some output position reads real input (not padding) through `tap`.
    fn reads_input(&self, tap: &[i64]) -> bool {
        tap.iter().enumerate().all(|(k, &t)| self.live_along(k, t))
    }

    /// Whether some output position reads real input through tap index `t` of kernel dim `k`.
    fn live_along(&self, k: usize, t: i64) -> bool {
        let g = &self.geometry;
        (0..self.out_spatial()[k]).any(|o| {
            let i = o * g.stride[k] + t * g.dilation[k] - g.padding[k];
            (0..self.input(k)).contains(&i)
        })
    }

    /// The input under `tap` at every output position, in the output's layout.
    fn slice(&self, cx: &NodeCx<'_, 'c, 'b>, tap: &[i64]) -> R<T<'c, 'b>> {
        let g = &self.geometry;
        let start: Vec<i64> = tap.iter().zip(&g.dilation).map(|(t, d)| t * d).collect();
        self.padded_slice(cx, &start, self.out_spatial(), &g.stride)
    }

    /// What output `position` (its spatial index) reads through the taps in `taps` (a range
    /// per kernel dim): `[batch, channels, taps...]`.
    fn position_slice(
        &self,
        cx: &NodeCx<'_, 'c, 'b>,
        position: &[i64],
        taps: &[std::ops::Range<i64>],
    ) -> R<T<'c, 'b>> {
        let g = &self.geometry;
        let start: Vec<i64> = (0..position.len())
            .map(|k| position[k] * g.stride[k] + taps[k].start * g.dilation[k])
            .collect();
        let count: Vec<i64> = taps.iter().map(|r| r.end - r.start).collect();
        self.padded_slice(cx, &start, &count, &g.dilation)
    }

    /// The taps that read input, as one range per kernel dim, where they form such a box (a
    /// tap is live when it is live along every dim, so the live taps are a product of per-dim
    /// sets: a box unless one of those has gaps).
    fn live_box(&self) -> Option<Vec<std::ops::Range<i64>>> {
        let g = &self.geometry;
        (0..g.kernel.len())
            .map(|k| {
                let live: Vec<i64> = (0..g.kernel[k])
                    .filter(|&t| self.live_along(k, t))
                    .collect();
                let (&first, &last) = (live.first()?, live.last()?);
                (last - first + 1 == live.len() as i64).then_some(first..last + 1)
            })
            .collect()
    }
}

/// `sum + term`, or `term` for the first term.
fn accumulate<'c, 'b>(
    e: &Emitter<'c, 'b>,
    sum: Option<T<'c, 'b>>,
    term: T<'c, 'b>,
) -> R<Option<T<'c, 'b>>> {
    Ok(Some(match sum {
        Some(s) => e.add(&s, &term)?,
        None => term,
    }))
}

/// The weights `w[:, :, tap]`: `[out channels, in channels per group]`.
fn tap_weights<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, w: &T<'c, 'b>, tap: &[i64]) -> R<T<'c, 'b>> {
    let rank = w.rank();
    let mut start = vec![0; rank];
    start[2..].copy_from_slice(tap);
    let mut limit: Vec<i64> = start.iter().map(|s| s + 1).collect();
    limit[0] = w.shape[0];
    limit[1] = w.shape[1];
    let e = cx.e;
    e.reshape(
        &e.slice(w, &start, &limit, &vec![1; rank])?,
        &[w.shape[0], w.shape[1]],
    )
}

/// A depthwise convolution as the sum over the kernel's taps of the window slice times each
/// channel's weight for that tap: one elementwise loop fusion in XLA. Its CPU backend runs
/// `feature_group_count = C` convolutions group by group: a 7x7 depthwise convolution over 32
/// channels of 16x16 took milliseconds where eager PyTorch takes a tenth of one. `w` in the
/// window's dtype.
fn depthwise_taps<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    window: &TapWindow<'c, 'b>,
    w: &T<'c, 'b>,
) -> R<T<'c, 'b>> {
    let e = cx.e;
    let c = w.shape[0];
    let taps = window.geometry.taps();
    // Channels-last, each tap's weights are read as a vector along the channels: taps-major
    // weights, materialized, make it a contiguous row (else LLVM gathers each lane).
    let by_tap = if window.channel_dim() == 1 {
        None
    } else {
        let n = taps.len() as i64;
        let flat = e.transpose(&e.reshape(w, &[c, n])?, &[1, 0])?;
        Some(e.barrier(&e.reshape(&flat, &[n * c])?)?)
    };
    let mut sum: Option<T<'c, 'b>> = None;
    for (i, tap) in taps.iter().enumerate() {
        let w_tap = match &by_tap {
            Some(rows) => {
                let i = i as i64;
                e.slice(rows, &[i * c], &[(i + 1) * c], &[1])?
            }
            None => e.reshape(&tap_weights(cx, w, tap)?, &[c])?,
        };
        let term = e.mul(
            &window.slice(cx, tap)?,
            &e.broadcast_in_dim(&w_tap, &window.out_shape, &[window.channel_dim() as i64])?,
        )?;
        sum = accumulate(e, sum, term)?;
    }
    sum.ok_or_else(|| cx.err("depthwise convolution with an empty kernel"))
}

/// A convolution with few output positions (ResNet's last stages on small images) as matrix
/// products contracting the input channels and the kernel's taps; taps that read only padding
/// are skipped. Fewest ops first: one product over one window slice per output position (when
/// there are fewer positions than live taps), one over one slice per tap (every tap live), or
/// the sum of one product per live tap. XLA's CPU backend
/// swaps the operands of such convolutions and runs them through its naive loop emitter, after
/// copying the whole kernel each call (bench/results/lowering-choices.md). `w` in the window's
/// dtype.
fn tap_dots<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    window: &TapWindow<'c, 'b>,
    w: &T<'c, 'b>,
) -> R<T<'c, 'b>> {
    let e = cx.e;
    let out = &window.out_shape;
    let nsp = out.len() - 2;
    // [batch, out spatial..., out channels], transposed to the result's layout at the end.
    let mut product_shape = vec![out[0]];
    product_shape.extend_from_slice(&out[2..]);
    product_shape.push(out[1]);
    let taps = window.geometry.taps();
    let live: Vec<&Vec<i64>> = taps.iter().filter(|t| window.reads_input(t)).collect();
    // Output positions, row-major.
    let positions = window_taps(&out[2..]);
    let box_taps = |b: &[std::ops::Range<i64>]| b.iter().map(|r| r.end - r.start).product::<i64>();
    let fewer_positions = window
        .live_box()
        .filter(|b| (positions.len() as i64) < box_taps(b));
    let product = if let Some(live_box) = fewer_positions {
        // Fewer output positions than live taps, which span a box of the kernel: one slice per
        // position (its window over the box: channels, then taps row-major) and one product
        // with the weights over the box, `[batch, position, channel x tap]`.
        let (b, c, t) = (out[0], w.shape[1], box_taps(&live_box));
        let mut start = vec![0, 0];
        let mut limit = vec![w.shape[0], w.shape[1]];
        start.extend(live_box.iter().map(|r| r.start));
        limit.extend(live_box.iter().map(|r| r.end));
        // The whole kernel when every tap is live (`slice` then emits nothing).
        let boxed_w = e.slice(w, &start, &limit, &vec![1; w.rank()])?;
        let flat_w = e.reshape(&boxed_w, &[w.shape[0], c * t])?;
        // The windows side by side along the channels (`[batch, position x channel, taps...]`),
        // then one reshape: row-major, that is `[batch, position, channel x tap]`.
        let windows: Vec<T<'c, 'b>> = positions
            .iter()
            .map(|p| window.position_slice(cx, p, &live_box))
            .collect::<R<_>>()?;
        let n = positions.len() as i64;
        let side_by_side = match windows.as_slice() {
            [one] => one.clone(),
            _ => e.concatenate(&windows.iter().collect::<Vec<_>>(), 1)?,
        };
        let stacked = e.reshape(&side_by_side, &[b, n, c * t])?;
        let product = e.dot_general(
            &stacked,
            &flat_w,
            (&[], &[]),
            (&[2], &[1]),
            &[b, n, w.shape[0]],
            w.dtype,
        )?;
        e.reshape(&product, &product_shape)?
    } else if live.len() == taps.len() && taps.len() > 1 {
        // Every tap reads input: the weights `[O, C x tap]` (their own row-major order, a
        // reshape) times the patches `[C x tap, batch x positions]`, both with the contracted
        // dim where XLA's CPU matmul wants it. The patches are sliced from the input with its
        // channels first, so they come out in that order with no transpose of their own
        // (9x the input for a 3x3 kernel); the fastest order measured
        // (bench/results/lowering-choices.md).
        let (b, c, t) = (out[0], w.shape[1], taps.len() as i64);
        let (o, p) = (w.shape[0], out[2..].iter().product::<i64>());
        let patches = channels_first_patches(cx, window, &taps)?;
        let flat_w = e.reshape(w, &[o, c * t])?;
        let product = e.dot_general(
            &flat_w,
            &patches,
            (&[], &[]),
            (&[1], &[0]),
            &[o, b * p],
            w.dtype,
        )?;
        return swap_leading_into(e, &e.reshape(&product, &[o, b, p])?, out);
    } else {
        let mut sum: Option<T<'c, 'b>> = None;
        for tap in live {
            let term = e.dot_general(
                &window.slice(cx, tap)?,
                &tap_weights(cx, w, tap)?,
                (&[], &[]),
                (&[1], &[1]),
                &product_shape,
                w.dtype,
            )?;
            sum = accumulate(e, sum, term)?;
        }
        match sum {
            Some(s) => s,
            None => e.splat(Scalar::Float(0.0), &product_shape, w.dtype)?,
        }
    };
    let mut perm = vec![0, nsp as i64 + 1];
    perm.extend(1..=nsp as i64);
    e.transpose(&product, &perm)
}

/// The patches of a convolution's input, `[C x tap, batch x positions]` (taps row-major, each
/// tap's strided slice of the zero-padded input): sliced from the input with its channels
/// first, so that they come out in this order without a transpose of their own.
fn channels_first_patches<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    window: &TapWindow<'c, 'b>,
    taps: &[Vec<i64>],
) -> R<T<'c, 'b>> {
    let e = cx.e;
    let out = &window.out_shape;
    let (b, c, t) = (out[0], window.x.shape[1], taps.len() as i64);
    let p: i64 = out[2..].iter().product();
    let mut perm = vec![1, 0];
    perm.extend(2..window.x.rank() as i64);
    let channels_first = TapWindow::new(
        &e.transpose(&window.x, &perm)?,
        window.geometry.clone(),
        out,
    );
    let slices: Vec<T<'c, 'b>> = taps
        .iter()
        .map(|tap| e.reshape(&channels_first.slice(cx, tap)?, &[c, 1, b * p]))
        .collect::<R<_>>()?;
    let patches = e.concatenate(&slices.iter().collect::<Vec<_>>(), 1)?;
    e.reshape(&patches, &[c * t, b * p])
}

/// Whether a convolution's weight gradient is computed as the output gradient times the
/// input's patches ([`patch_weight_grad`]): no groups, and batch x output positions at most 8x
/// the output channels: where it beats XLA's convolution (bench/results/lowering-choices.md).
fn weight_grad_by_patches(g_shape: &[i64], groups: i64) -> bool {
    groups == 1 && g_shape[0] * g_shape[2..].iter().product::<i64>() <= 8 * g_shape[1]
}

/// Whether a TPU's weight gradient is a patch product ([`tpu_patch_weight_grad`]) rather than
/// a convolution: 2-D (the measured and tested case), float32 at HIGHEST precision, ungrouped,
/// over more than [`TPU_CONV_WEIGHT_GRAD_MAX_POSITIONS`] output positions. XLA:TPU compiles such a
/// convolution (its window the whole output gradient, each operand split into bf16 parts) in
/// a time that grows with that window: 55 s for a 3->16 3x3 kernel over 8x32x32 (3.7 s as the
/// patch product, 1.6 s at DEFAULT precision), 16-20 s at 32x32 with 8-16 channels, 5-8 s at
/// 16x16, under 1 s at 8x8 (bench/results/backward_compile.md).
fn tpu_weight_grad_by_patches(
    e: &crate::lower::emit::Emitter,
    g_shape: &[i64],
    dtype: DType,
    groups: i64,
) -> bool {
    e.device == crate::lower::Device::Tpu
        && e.precision == crate::lower::emit::Precision::Highest
        && dtype == DType::Float32
        && groups == 1
        && g_shape.len() == 4
        && g_shape[2..].iter().product::<i64>() > TPU_CONV_WEIGHT_GRAD_MAX_POSITIONS
}

/// Output positions (per image) up to which a TPU's HIGHEST weight gradient stays a
/// convolution: there it compiles in seconds and reads its operands once, where the patch
/// product reads the input once per kernel tap (5x the bytes accessed at 16x16, 64 channels).
const TPU_CONV_WEIGHT_GRAD_MAX_POSITIONS: i64 = 16 * 16;

/// A convolution's weight gradient as the output gradient `[O, batch x positions]` times the
/// input's patches (contracting batch and positions), which is the kernel's own layout
/// `[O, C x tap]`. Operands in the accumulation dtype.
fn patch_weight_grad<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    g: &T<'c, 'b>,
    x: &T<'c, 'b>,
    geometry: Window,
    w_shape: &[i64],
) -> R<T<'c, 'b>> {
    let e = cx.e;
    let (n, o) = (g.shape[0], g.shape[1]);
    let p: i64 = g.shape[2..].iter().product();
    let taps = geometry.taps();
    let window = TapWindow::new(x, geometry, &g.shape);
    let patches = channels_first_patches(cx, &window, &taps)?;
    let flat_g = swap_leading_into(e, &e.reshape(g, &[n, o, p])?, &[o, n * p])?;
    let ct = patches.shape[0];
    // Positions-major patches: XLA's CPU matmul runs `[O, NP] x [C x tap, NP]^T` at half the
    // speed of `[O, NP] x [NP, C x tap]` (bench/results/lowering-choices.md).
    let patches = e.transpose(&patches, &[1, 0])?;
    let product = e.dot_general(
        &flat_g,
        &patches,
        (&[], &[]),
        (&[1], &[0]),
        &[o, ct],
        g.dtype,
    )?;
    e.reshape(&product, w_shape)
}

/// [`patch_weight_grad`] for a TPU: the output gradient `[N, O, P]` times the input's tap
/// slices `[N, tap x C, P]`, contracting batch and positions, with no transpose of either (the
/// CPU form's `[C x tap, N x P]` patches come from `[C, 1, N x P]` pieces, whose unit dim XLA:TPU
/// pads to a tile of 8: 1.5x the backward's bytes accessed).
fn tpu_patch_weight_grad<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    g: &T<'c, 'b>,
    x: &T<'c, 'b>,
    geometry: Window,
    w_shape: &[i64],
) -> R<T<'c, 'b>> {
    let e = cx.e;
    let (n, o, c) = (g.shape[0], g.shape[1], x.shape[1]);
    let p: i64 = g.shape[2..].iter().product();
    let taps = geometry.taps();
    let t = taps.len() as i64;
    let window = TapWindow::new(x, geometry, &g.shape);
    let slices: Vec<T<'c, 'b>> = taps
        .iter()
        .map(|tap| e.reshape(&window.slice(cx, tap)?, &[n, c, p]))
        .collect::<R<_>>()?;
    let patches = e.concatenate(&slices.iter().collect::<Vec<_>>(), 1)?;
    let product = e.dot_general(
        &e.reshape(g, &[n, o, p])?,
        &patches,
        (&[], &[]),
        (&[0, 2], &[0, 2]),
        &[o, t * c],
        g.dtype,
    )?;
    let per_channel = e.transpose(&e.reshape(&product, &[o, t, c])?, &[0, 2, 1])?;
    e.reshape(&per_channel, w_shape)
}

/// The window arguments shared by `convolution` and `convolution_backward`: `stride, padding,
/// dilation, transposed, output_padding, groups` from argument `first` on, one value per spatial
/// dim (a single value applies to all).
struct ConvWindow {
    nsp: usize,
    stride: Vec<i64>,
    padding: Vec<i64>,
    dilation: Vec<i64>,
    groups: i64,
    transposed: bool,
    output_padding: Vec<i64>,
}

impl ConvWindow {
    fn parse(cx: &NodeCx, rank: usize, first: usize) -> R<ConvWindow> {
        let nsp = rank - 2;
        let per_dim = |v: Vec<i64>| if v.len() == 1 { vec![v[0]; nsp] } else { v };
        Ok(ConvWindow {
            nsp,
            stride: per_dim(cx.ints(first, "stride")?),
            padding: per_dim(cx.ints(first + 1, "padding")?),
            dilation: per_dim(cx.ints(first + 2, "dilation")?),
            groups: cx.int_or(first + 5, "groups", 1)?,
            transposed: cx.bool_or(first + 3, "transposed", false)?,
            output_padding: per_dim(cx.ints_or(first + 4, "output_padding", &[0])?),
        })
    }
}

/// `0, 1, ..., n-1` as the spatial dims of a `#stablehlo.conv` layout.
fn spatial_list(nsp: usize) -> String {
    int_list(&(0..nsp as i64).collect::<Vec<_>>())
}

/// `stablehlo.convolution` with explicit dimension numbers and window settings, accumulating in
/// `acc`.
#[allow(clippy::too_many_arguments)]
fn conv_general<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    lhs: &T<'c, 'b>,
    rhs: &T<'c, 'b>,
    dnums: String,
    window_strides: &[i64],
    padding: &[(i64, i64)],
    lhs_dilation: &[i64],
    rhs_dilation: &[i64],
    feature_groups: i64,
    batch_groups: i64,
    shape: &[i64],
    acc: DType,
) -> R<T<'c, 'b>> {
    let nsp = padding.len();
    let pads: Vec<String> = padding
        .iter()
        .map(|(lo, hi)| format!("[{lo}, {hi}]"))
        .collect();
    cx.e.op(
        "stablehlo.convolution",
        &[lhs, rhs],
        &[
            ("dimension_numbers", dnums),
            ("window_strides", array_i64(window_strides)),
            (
                "padding",
                format!("dense<[{}]> : tensor<{nsp}x2xi64>", pads.join(", ")),
            ),
            ("lhs_dilation", array_i64(lhs_dilation)),
            ("rhs_dilation", array_i64(rhs_dilation)),
            ("feature_group_count", format!("{feature_groups} : i64")),
            ("batch_group_count", format!("{batch_groups} : i64")),
            ("precision_config", cx.e.precision_config()),
        ],
        shape,
        acc,
    )
}

/// `convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation,
/// transposed, output_padding, groups, output_mask) -> (grad_input, grad_weight, grad_bias)`,
/// as the two transposed convolutions XLA uses (input gradient: the flipped kernel over the
/// stride-dilated gradient; weight gradient: input and gradient with batch and feature dims
/// swapped, one batch group per feature group).
fn convolution_backward<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let g = cx.tensor(0, "grad_output")?;
    let x = cx.tensor(1, "input")?;
    let w = cx.tensor(2, "weight")?;
    let ConvWindow {
        nsp,
        stride,
        padding,
        dilation,
        groups,
        transposed,
        ..
    } = ConvWindow::parse(cx, x.rank(), 4)?;
    let mask: Vec<bool> = match cx.arg(10, "output_mask") {
        Some(Arg::List(items)) => items
            .iter()
            .map(|a| matches!(a, Arg::Bool(true) | Arg::Int(1)))
            .collect(),
        _ => vec![true; 3],
    };
    if transposed {
        let window = Window {
            kernel: w.shape[2..].to_vec(),
            stride,
            padding,
            dilation,
        };
        return transposed_convolution_backward(cx, &g, &x, &w, &window, groups, &mask);
    }
    let e = cx.e;
    // On a GPU or TPU both gradients are `stablehlo.convolution`s (as the forward, see
    // [`convolution`]): the 1x1 products and patch products below are for XLA's CPU compiler.
    let cpu = !e.accelerator();
    let nhwc_form = |t: &T<'c, 'b>| e.physical(t).is_some_and(|(_, p)| p == NCHW_OF_NHWC);
    // Channels-last where the operands already are, or where oneDNN computes the gradients
    // (it takes channels-last activations).
    let onednn = channels_last(nsp) && onednn_conv(e, &[&g, &x, &w], (&x.shape, g.dtype));
    if cpu && (onednn || (channels_last(nsp) && (nhwc_form(&g) || nhwc_form(&x)))) {
        let window = Window {
            kernel: w.shape[2..].to_vec(),
            stride,
            padding,
            dilation,
        };
        return convolution_backward_nhwc(cx, &g, &x, &w, &window, groups, &mask, onednn);
    }
    let dtype = g.dtype;
    let acc = acc_dtype(dtype);
    let gc = e.convert(&g, dtype)?;
    let sp = spatial_list(nsp);
    let kernel: Vec<i64> = w.shape[2..].to_vec();
    let in_sp: Vec<i64> = x.shape[2..].to_vec();
    let out_sp: Vec<i64> = g.shape[2..].to_vec();
    // A stand-in for a gradient that output_mask says nobody wants (FX records no tensor).
    let placeholder = || e.splat(Scalar::Int(0), &[], DType::Float32);
    let mut results = Vec::new();

    if mask.first().copied().unwrap_or(true) {
        let (shape, out) = cx.out(0)?;
        if cpu && is_pointwise(&w.shape, &padding, groups) {
            let r = pointwise_input_grad(
                cx,
                &e.convert(&g, acc)?,
                &e.convert(&w, acc)?,
                &stride,
                &shape,
            )?;
            results.push(e.convert(&r, out)?);
        } else {
            let wc = e.convert(&w, dtype)?;
            // [O, I/g, k..] -> [O/g, I, k..] with the group index leading the input features.
            let k = flipped_group_swapped(e, &wc, groups)?;
            let pads = input_grad_pads(&kernel, &stride, &padding, &dilation, &in_sp, &out_sp);
            let r = conv_general(
                cx,
                &gc,
                &k,
                format!("#stablehlo.conv<[b, f, {sp}]x[i, o, {sp}]->[b, f, {sp}]>"),
                &vec![1; nsp],
                &pads,
                &stride,
                &dilation,
                groups,
                1,
                &shape,
                acc,
            )?;
            results.push(e.convert(&r, out)?);
        }
    } else {
        results.push(placeholder()?);
    }

    if mask.get(1).copied().unwrap_or(true) {
        let (shape, out) = cx.out(1)?;
        let pointwise = cpu && is_pointwise(&w.shape, &padding, groups);
        let patches = if cpu {
            !pointwise && weight_grad_by_patches(&g.shape, groups)
        } else {
            tpu_weight_grad_by_patches(e, &g.shape, g.dtype, groups)
        };
        if patches {
            let geometry = Window {
                kernel: kernel.clone(),
                stride: stride.clone(),
                padding: padding.clone(),
                dilation: dilation.clone(),
            };
            let (ga, xa) = (e.convert(&g, acc)?, e.convert(&x, acc)?);
            let r = if cpu {
                patch_weight_grad(cx, &ga, &xa, geometry, &shape)?
            } else {
                tpu_patch_weight_grad(cx, &ga, &xa, geometry, &shape)?
            };
            results.push(e.convert(&r, out)?);
        } else if pointwise {
            let r = pointwise_weight_grad(
                cx,
                &e.convert(&g, acc)?,
                &e.convert(&x, acc)?,
                &stride,
                &shape,
            )?;
            results.push(e.convert(&r, out)?);
        } else {
            let xc = e.convert(&x, dtype)?;
            let pads = weight_grad_pads(&kernel, &stride, &padding, &dilation, &in_sp, &out_sp);
            let r = conv_general(
                cx,
                &xc,
                &gc,
                format!("#stablehlo.conv<[f, b, {sp}]x[i, o, {sp}]->[f, b, {sp}]>"),
                &dilation,
                &pads,
                &vec![1; nsp],
                &stride,
                1,
                groups,
                &shape,
                acc,
            )?;
            results.push(e.convert(&r, out)?);
        }
    } else {
        results.push(placeholder()?);
    }

    if mask.get(2).copied().unwrap_or(true) {
        results.push(bias_grad(cx, &g, acc)?);
    } else {
        results.push(placeholder()?);
    }
    Ok(results)
}

/// The bias gradient of a channels-first convolution backward (output 2): the output
/// gradient `g` summed in `acc` over every dim but the channels (dim 1).
fn bias_grad<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, g: &T<'c, 'b>, acc: DType) -> R<T<'c, 'b>> {
    let e = cx.e;
    let (_, out) = cx.out(2)?;
    let dims: Vec<i64> = (0..g.rank() as i64).filter(|&d| d != 1).collect();
    let s = e.reduce(&e.convert(g, acc)?, &dims, ReduceKind::Sum, false)?;
    e.convert(&s, out)
}

/// The gradients of a transposed convolution `y = conv_transpose(x, w)` (`w` is
/// `[C_in, C_out / groups, k..]`), which is the input gradient of the convolution from `y`'s
/// channels to `x`'s by `w`. So `x`'s gradient is that forward convolution of `g` (same stride,
/// padding, dilation and groups; `output_padding` only adds trailing rows it never reads), and
/// `w`'s is that convolution's weight gradient with the roles of input and output gradient
/// swapped (input `g`, output gradient `x`), which comes out as `[C_in, C_out / groups, k..]`.
fn transposed_convolution_backward<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    g: &T<'c, 'b>,
    x: &T<'c, 'b>,
    w: &T<'c, 'b>,
    window: &Window,
    groups: i64,
    mask: &[bool],
) -> V<'c, 'b> {
    let e = cx.e;
    let nsp = window.kernel.len();
    let sp = spatial_list(nsp);
    let acc = acc_dtype(g.dtype);
    let ones = vec![1; nsp];
    let placeholder = || e.splat(Scalar::Int(0), &[], DType::Float32);
    let mut results = Vec::new();
    if mask.first().copied().unwrap_or(true) {
        let (shape, out) = cx.out(0)?;
        let pads: Vec<(i64, i64)> = window.padding.iter().map(|&p| (p, p)).collect();
        let r = conv_general(
            cx,
            g,
            &e.convert(w, g.dtype)?,
            format!("#stablehlo.conv<[b, f, {sp}]x[o, i, {sp}]->[b, f, {sp}]>"),
            &window.stride,
            &pads,
            &ones,
            &window.dilation,
            groups,
            1,
            &shape,
            acc,
        )?;
        results.push(e.convert(&r, out)?);
    } else {
        results.push(placeholder()?);
    }
    if mask.get(1).copied().unwrap_or(true) {
        let (shape, out) = cx.out(1)?;
        let pads = weight_grad_pads(
            &window.kernel,
            &window.stride,
            &window.padding,
            &window.dilation,
            &g.shape[2..],
            &x.shape[2..],
        );
        let r = conv_general(
            cx,
            g,
            &e.convert(x, g.dtype)?,
            format!("#stablehlo.conv<[f, b, {sp}]x[i, o, {sp}]->[f, b, {sp}]>"),
            &window.dilation,
            &pads,
            &ones,
            &window.stride,
            1,
            groups,
            &shape,
            acc,
        )?;
        results.push(e.convert(&r, out)?);
    } else {
        results.push(placeholder()?);
    }
    if mask.get(2).copied().unwrap_or(true) {
        results.push(bias_grad(cx, g, acc)?);
    } else {
        results.push(placeholder()?);
    }
    Ok(results)
}

/// The padding of the input gradient's convolution (the flipped kernel over the stride-dilated
/// output gradient): the kernel's span less the padding before, and whatever reaches the input's
/// last positions after (a stride can leave trailing input rows unused by the forward).
fn input_grad_pads(
    kernel: &[i64],
    stride: &[i64],
    padding: &[i64],
    dilation: &[i64],
    in_sp: &[i64],
    out_sp: &[i64],
) -> Vec<(i64, i64)> {
    (0..in_sp.len())
        .map(|i| {
            let span = dilation[i] * (kernel[i] - 1);
            (
                span - padding[i],
                in_sp[i] - (out_sp[i] - 1) * stride[i] - 1 + padding[i],
            )
        })
        .collect()
}

/// The padding of the weight gradient's convolution (the input convolved with the output
/// gradient, whose positions are dilated by the stride).
fn weight_grad_pads(
    kernel: &[i64],
    stride: &[i64],
    padding: &[i64],
    dilation: &[i64],
    in_sp: &[i64],
    out_sp: &[i64],
) -> Vec<(i64, i64)> {
    (0..in_sp.len())
        .map(|i| {
            let from_lhs = (out_sp[i] - 1) * stride[i] + 1 - in_sp[i];
            let from_rhs = dilation[i] * (kernel[i] - 1) - padding[i];
            (padding[i], from_lhs + from_rhs)
        })
        .collect()
}

/// A 2-D convolution of NHWC input `x` by OIHW weight `w` as its patches times the kernel:
/// `[N x positions, taps x C] x [taps x C, O]`, the NHWC output `out` with no transpose.
fn nhwc_patch_product<'c, 'b>(
    e: &Emitter<'c, 'b>,
    x: &T<'c, 'b>,
    w: &T<'c, 'b>,
    window: &Window,
    out: &[i64],
) -> R<T<'c, 'b>> {
    let (o, c) = (w.shape[0], w.shape[1]);
    let taps: i64 = w.shape[2..].iter().product();
    let patches = nhwc_patches(e, x, window, [out[1], out[2]])?;
    // [O, C, kh, kw] -> [O, kh, kw, C] -> [O, taps x C], the patches' column order.
    let kernel = e.reshape(&e.transpose(w, &[0, 2, 3, 1])?, &[o, taps * c])?;
    let rows = out[0] * out[1] * out[2];
    let r = matmul_2d(e, (&patches, false), (&kernel, true), &[rows, o])?;
    e.reshape(&r, out)
}

/// The patches of NHWC input `xp` for a 2-D convolution with `window` and output spatial size
/// `out_hw`: `[N x positions, tap x C]`, one strided slice of the zero-padded input per tap
/// (row-major taps), side by side.
fn nhwc_patches<'c, 'b>(
    e: &Emitter<'c, 'b>,
    xp: &T<'c, 'b>,
    window: &Window,
    out_hw: [i64; 2],
) -> R<T<'c, 'b>> {
    let (n, c) = (xp.shape[0], xp.shape[3]);
    let (p, k, s, d) = (
        &window.padding,
        &window.kernel,
        &window.stride,
        &window.dilation,
    );
    let padded = if p.iter().all(|&v| v == 0) {
        xp.clone()
    } else {
        let pads = [0, p[0], p[1], 0];
        let zero = e.splat(Scalar::Float(0.0), &[], xp.dtype)?;
        e.pad(xp, &zero, &pads, &pads, &[0; 4])?
    };
    let mut slices = Vec::new();
    for i in 0..k[0] {
        for j in 0..k[1] {
            let start = [0, i * d[0], j * d[1], 0];
            let limit = [
                n,
                start[1] + (out_hw[0] - 1) * s[0] + 1,
                start[2] + (out_hw[1] - 1) * s[1] + 1,
                c,
            ];
            slices.push(e.slice(&padded, &start, &limit, &[1, s[0], s[1], 1])?);
        }
    }
    let taps = slices.len() as i64;
    let patches = match slices.as_slice() {
        [one] => one.clone(),
        _ => e.concatenate(&slices.iter().collect::<Vec<_>>(), 3)?,
    };
    e.reshape(&patches, &[n * out_hw[0] * out_hw[1], taps * c])
}

/// `convolution_backward` of a 2-D convolution whose output gradient or input is channels-last
/// (a layout transpose of NHWC data: the forward ran channels-last and handed its activations
/// over as they were, see python/tpuc/handoff.py): each gradient computed on the NHWC forms, the
/// input gradient returned as a layout transpose again. XLA's CPU convolutions run NHWC, so the
/// NCHW formulation would transpose both activations in and the gradient out. Also every f32
/// one where `onednn` (see [`onednn_conv`]): oneDNN computes the input and weight gradients of
/// all but 1x1 convolutions, on channels-last activations.
#[allow(clippy::too_many_arguments)]
fn convolution_backward_nhwc<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    g: &T<'c, 'b>,
    x: &T<'c, 'b>,
    w: &T<'c, 'b>,
    window: &Window,
    groups: i64,
    mask: &[bool],
    onednn: bool,
) -> V<'c, 'b> {
    let e = cx.e;
    let acc = acc_dtype(g.dtype);
    let gp = e.convert(&nhwc(e, g)?, acc)?;
    let (n, oh, ow, o) = (gp.shape[0], gp.shape[1], gp.shape[2], gp.shape[3]);
    let (c, h, wd) = (x.shape[1], x.shape[2], x.shape[3]);
    let Window {
        kernel,
        stride,
        padding,
        dilation,
    } = window;
    let pointwise = is_pointwise(&w.shape, padding, groups);
    let wanted = |k: usize| mask.get(k).copied().unwrap_or(true);
    let placeholder = || e.splat(Scalar::Int(0), &[], DType::Float32);
    let mut results = Vec::new();

    if wanted(0) {
        let (shape, out) = cx.out(0)?;
        let in_nhwc = [n, h, wd, c];
        let r = if pointwise {
            // [N x positions, O] x [O, C], spread back to the strided positions.
            let flat_g = e.reshape(&gp, &[n * oh * ow, o])?;
            let flat_w = e.reshape(&e.convert(w, acc)?, &[o, c])?;
            // XLA's dot: MKL is slower for these short products
            // (bench/results/lowering-choices.md).
            let product = e.dot_general(
                &flat_g,
                &flat_w,
                (&[], &[]),
                (&[1], &[0]),
                &[n * oh * ow, c],
                acc,
            )?;
            let strided = e.reshape(&product, &[n, oh, ow, c])?;
            if stride.iter().all(|&s| s == 1) && strided.shape == in_nhwc {
                strided
            } else {
                let interior = [0, stride[0] - 1, stride[1] - 1, 0];
                let high = [
                    0,
                    h - ((oh - 1) * stride[0] + 1),
                    wd - ((ow - 1) * stride[1] + 1),
                    0,
                ];
                let zero = e.splat(Scalar::Float(0.0), &[], acc)?;
                e.pad(&strided, &zero, &[0; 4], &high, &interior)?
            }
        } else if onednn {
            host_conv(
                e,
                host_conv::INPUT_GRAD,
                &gp,
                &e.convert(w, acc)?,
                window,
                groups,
                &in_nhwc,
            )?
        } else {
            // The flipped kernel over the stride-dilated gradient, as in the NCHW form.
            let k = flipped_group_swapped(e, &e.convert(w, acc)?, groups)?;
            let pads = input_grad_pads(kernel, stride, padding, dilation, &[h, wd], &[oh, ow]);
            conv_general(
                cx,
                &gp,
                &k,
                "#stablehlo.conv<[b, 0, 1, f]x[i, o, 0, 1]->[b, 0, 1, f]>".to_string(),
                &[1, 1],
                &pads,
                stride,
                dilation,
                groups,
                1,
                &in_nhwc,
                acc,
            )?
        };
        debug_assert_eq!(shape, [n, c, h, wd]);
        let r = e.convert(&r, out)?;
        results.push(e.layout_transpose(&r, &NCHW_OF_NHWC)?);
    } else {
        results.push(placeholder()?);
    }

    if wanted(1) {
        let (shape, out) = cx.out(1)?;
        let xp = e.convert(&nhwc(e, x)?, acc)?;
        let r = if pointwise {
            // [N x positions, O]^T x [N x positions, C] over the strided input positions.
            let strided = e.slice(
                &xp,
                &[0; 4],
                &[n, (oh - 1) * stride[0] + 1, (ow - 1) * stride[1] + 1, c],
                &[1, stride[0], stride[1], 1],
            )?;
            let flat_x = e.reshape(&strided, &[n * oh * ow, c])?;
            let flat_g = e.reshape(&gp, &[n * oh * ow, o])?;
            let product = matmul_2d(e, (&flat_g, true), (&flat_x, false), &[o, c])?;
            e.reshape(&product, &shape)?
        } else if onednn {
            host_conv(e, host_conv::WEIGHT_GRAD, &xp, &gp, window, groups, &shape)?
        } else if groups == 1 {
            // The input's patches contracted with the gradient: `[tap x C, O]`, which is the
            // kernel as HWIO.
            let flat_p = nhwc_patches(e, &xp, window, [oh, ow])?;
            let taps = kernel[0] * kernel[1];
            let flat_g = e.reshape(&gp, &[n * oh * ow, o])?;
            let product = matmul_2d(e, (&flat_p, true), (&flat_g, false), &[taps * c, o])?;
            let hwio = e.reshape(&product, &[kernel[0], kernel[1], c, o])?;
            e.transpose(&hwio, &[3, 2, 0, 1])?
        } else {
            // Batch and feature swapped, one batch group per feature group (NCHW form's).
            let pads = weight_grad_pads(kernel, stride, padding, dilation, &[h, wd], &[oh, ow]);
            conv_general(
                cx,
                &xp,
                &gp,
                "#stablehlo.conv<[f, 0, 1, b]x[i, 0, 1, o]->[f, b, 0, 1]>".to_string(),
                dilation,
                &pads,
                &[1, 1],
                stride,
                1,
                groups,
                &shape,
                acc,
            )?
        };
        results.push(e.convert(&r, out)?);
    } else {
        results.push(placeholder()?);
    }

    if wanted(2) {
        let (_, out) = cx.out(2)?;
        let s = e.reduce(&gp, &[0, 1, 2], ReduceKind::Sum, false)?;
        results.push(e.convert(&s, out)?);
    } else {
        results.push(placeholder()?);
    }
    Ok(results)
}
