//! `grid_sampler_2d` / `grid_sampler_3d` (`F.grid_sample`): bilinear, nearest and (2-D) bicubic
//! interpolation with zeros, border and reflection padding, following PyTorch's CPU kernel
//! (`GridSampler.h`): each tap is a gather of all channels at one integer position, weighted
//! and masked when it falls outside the input.

use crate::lower::emit::{array_i64, int_list, Emitter};
use crate::lower::helpers::gather::take_along;
use crate::lower::Rule;
use crate::lower::{NodeCx, Scalar, R, T};
use tpuc_frontend_fx::{Arg, DType};

pub static RULES: &[(&str, Rule)] = &[
    ("aten.grid_sampler_2d.default", grid_sampler),
    ("aten.grid_sampler_3d.default", grid_sampler),
    (
        "aten._upsample_bilinear2d_aa.default",
        upsample_bilinear2d_aa,
    ),
    ("aten._upsample_bicubic2d_aa.default", upsample_bicubic2d_aa),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;
const I64: DType = DType::Int64;

struct G<'x, 'c, 'b> {
    e: &'x Emitter<'c, 'b>,
    /// Compute dtype of coordinates and weights (f32 for f16/bf16 inputs).
    d: DType,
}

impl<'c, 'b> G<'_, 'c, 'b> {
    fn k(&self, v: f64) -> R<T<'c, 'b>> {
        self.e.k(v, self.d)
    }
    fn mulk(&self, x: &T<'c, 'b>, v: f64) -> R<T<'c, 'b>> {
        self.e.mul(x, &self.k(v)?)
    }
    fn addk(&self, x: &T<'c, 'b>, v: f64) -> R<T<'c, 'b>> {
        self.e.add(x, &self.k(v)?)
    }
    fn clamp(&self, x: &T<'c, 'b>, lo: f64, hi: f64) -> R<T<'c, 'b>> {
        self.e.op(
            "stablehlo.clamp",
            &[&self.k(lo)?, x, &self.k(hi)?],
            &[],
            &x.shape,
            x.dtype,
        )
    }
    fn floor(&self, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.e.unary("stablehlo.floor", x)
    }

    /// PyTorch's `reflect_coordinates`.
    fn reflect(&self, x: &T<'c, 'b>, twice_low: i64, twice_high: i64) -> R<T<'c, 'b>> {
        let e = self.e;
        if twice_low == twice_high {
            return e.broadcast_to(&self.k(0.0)?, &x.shape);
        }
        let min = twice_low as f64 / 2.0;
        let span = (twice_high - twice_low) as f64 / 2.0;
        let a = e.unary("stablehlo.abs", &self.addk(x, -min)?)?;
        let extra = e.op(
            "stablehlo.remainder",
            &[&a, &e.broadcast_to(&self.k(span)?, &a.shape)?],
            &[],
            &a.shape,
            a.dtype,
        )?;
        let flips = self.floor(&self.mulk(&a, 1.0 / span)?)?;
        let half = self.floor(&self.mulk(&flips, 0.5)?)?;
        let even = e.compare(&self.mulk(&half, 2.0)?, &flips, "EQ")?;
        let up = self.addk(&extra, min)?;
        let down = self.addk(&self.mulk(&extra, -1.0)?, span + min)?;
        e.select(&even, &up, &down, self.d)
    }

    /// Padding applied to an unnormalized coordinate (border: clip; reflection: reflect, clip).
    fn pad_coord(&self, x: &T<'c, 'b>, size: i64, padding: i64, align: bool) -> R<T<'c, 'b>> {
        let hi = (size - 1) as f64;
        match padding {
            1 => self.clamp(x, 0.0, hi),
            2 => {
                let r = if align {
                    self.reflect(x, 0, 2 * (size - 1))?
                } else {
                    self.reflect(x, -1, 2 * size - 1)?
                };
                self.clamp(&r, 0.0, hi)
            }
            _ => Ok(x.clone()),
        }
    }
}

/// Gathers `input_cl` (N, *spatial, C) at integer positions `idx[k]` (N, *out) per spatial dim,
/// giving (N, *out, C); positions are clamped (the caller masks what was out of range).
fn gather<'c, 'b>(
    e: &Emitter<'c, 'b>,
    input_cl: &T<'c, 'b>,
    idx: &[T<'c, 'b>],
    sizes: &[i64],
) -> R<T<'c, 'b>> {
    let out = idx[0].shape.clone(); // (N, *out)
    let nd = sizes.len();
    let mut col = out.clone();
    col.push(1);
    let mut parts = vec![e.reshape(&e.iota(&out, 0, I64)?, &col)?];
    for (k, t) in idx.iter().enumerate() {
        let hi = e.splat(Scalar::Int(sizes[k] - 1), &[], I64)?;
        let lo = e.splat(Scalar::Int(0), &[], I64)?;
        let c = e.op("stablehlo.clamp", &[&lo, t, &hi], &[], &t.shape, I64)?;
        parts.push(e.reshape(&c, &col)?);
    }
    let mut ishape = out.clone();
    ishape.push(nd as i64 + 1);
    let refs: Vec<&T> = parts.iter().collect();
    let indices = e.op(
        "stablehlo.concatenate",
        &refs,
        &[("dimension", format!("{} : i64", out.len()))],
        &ishape,
        I64,
    )?;
    let c = input_cl.shape[input_cl.rank() - 1];
    let mut res = out.clone();
    res.push(c);
    let collapsed: Vec<i64> = (0..=nd as i64).collect();
    let dnums = format!(
        "#stablehlo.gather<offset_dims = [{}], collapsed_slice_dims = [{}], start_index_map = [{}], index_vector_dim = {}>",
        out.len(),
        int_list(&collapsed),
        int_list(&collapsed),
        out.len()
    );
    let mut slice = vec![1; nd + 1];
    slice.push(c);
    e.op(
        "stablehlo.gather",
        &[input_cl, &indices],
        &[
            ("dimension_numbers", dnums),
            ("slice_sizes", array_i64(&slice)),
            ("indices_are_sorted", "false".into()),
        ],
        &res,
        input_cl.dtype,
    )
}

fn grid_sampler<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let input = cx.tensor(0, "input")?;
    let grid = cx.tensor(1, "grid")?;
    let mode = cx.int(2, "interpolation_mode")?;
    let padding = cx.int(3, "padding_mode")?;
    let align = cx.bool_or(4, "align_corners", false)?;
    let (out_shape, out_dtype) = cx.out(0)?;
    let nd = input.rank() - 2;
    if out_shape.contains(&0) || input.shape.contains(&0) {
        return Ok(vec![e.splat(Scalar::Int(0), &out_shape, out_dtype)?]);
    }
    if !(0..=2).contains(&mode) || !(0..=2).contains(&padding) || (mode == 2 && nd != 2) {
        return Err(cx.err(format!(
            "unsupported interpolation mode {mode} / padding mode {padding}"
        )));
    }
    let d = crate::lower::helpers::widen::acc_dtype(out_dtype);
    let g = G { e, d };
    let n = input.shape[0];
    let c = input.shape[1];
    let sizes: Vec<i64> = input.shape[2..].to_vec(); // (D,) H, W
    let out_sp: Vec<i64> = grid.shape[1..grid.rank() - 1].to_vec();
    let mut pos_shape = vec![n];
    pos_shape.extend(&out_sp);
    // Coordinates per spatial dim k (input dim 2 + k); the grid's last dim lists x (W) first.
    let grid = e.convert(&grid, d)?;
    let gr = grid.rank();
    let mut coords = Vec::new();
    for (k, &size) in sizes.iter().enumerate() {
        let comp = (nd - 1 - k) as i64;
        let mut start = vec![0; gr];
        start[gr - 1] = comp;
        let mut lim = grid.shape.clone();
        lim[gr - 1] = comp + 1;
        let s = e.slice(&grid, &start, &lim, &vec![1; gr])?;
        let s = e.reshape(&s, &pos_shape)?;
        let size = size as f64;
        // unnormalize
        let u = if align {
            g.mulk(&g.addk(&s, 1.0)?, (size - 1.0) / 2.0)?
        } else {
            g.mulk(&g.addk(&g.mulk(&g.addk(&s, 1.0)?, size)?, -1.0)?, 0.5)?
        };
        coords.push(u);
    }
    // Channels last, in the compute dtype: (N, *spatial, C).
    let mut perm = vec![0i64];
    perm.extend((2..input.rank() as i64).collect::<Vec<_>>());
    perm.push(1);
    let input_cl = e.transpose(&e.convert(&input, d)?, &perm)?;
    let mut acc_shape = pos_shape.clone();
    acc_shape.push(c);
    let zero = e.splat(Scalar::Int(0), &[], d)?;
    // One tap: the input at integer positions `ip` (as floats), weighted, zero outside.
    let tap = |ip: &[T<'c, 'b>], w: &T<'c, 'b>| -> R<T<'c, 'b>> {
        let mut inside: Option<T> = None;
        let mut idx = Vec::new();
        for (k, p) in ip.iter().enumerate() {
            let ok = e.and(
                &e.compare(p, &g.k(0.0)?, "GE")?,
                &e.compare(p, &g.k((sizes[k] - 1) as f64)?, "LE")?,
            )?;
            inside = Some(match inside {
                None => ok,
                Some(i) => e.and(&i, &ok)?,
            });
            idx.push(e.convert(p, I64)?);
        }
        let v = gather(e, &input_cl, &idx, &sizes)?;
        let w = e.select(&inside.unwrap(), w, &zero, d)?;
        let mut ws = pos_shape.clone();
        ws.push(1);
        e.mul(&v, &e.reshape(&w, &ws)?)
    };
    let mut acc = e.splat(Scalar::Int(0), &acc_shape, d)?;
    match mode {
        0 | 1 => {
            let pc: Vec<T> = coords
                .iter()
                .enumerate()
                .map(|(k, u)| g.pad_coord(u, sizes[k], padding, align))
                .collect::<R<_>>()?;
            if mode == 1 {
                // Nearest: round half to even.
                let ip: Vec<T> = pc
                    .iter()
                    .map(|u| e.unary("stablehlo.round_nearest_even", u))
                    .collect::<R<_>>()?;
                let one = e.broadcast_to(&g.k(1.0)?, &pos_shape)?;
                acc = tap(&ip, &one)?;
            } else {
                let lo: Vec<T> = pc.iter().map(|u| g.floor(u)).collect::<R<_>>()?;
                // Weights: (hi - u) for the low corner, (u - lo) for the high one.
                for corner in 0..(1usize << nd) {
                    let mut ip = Vec::new();
                    let mut w: Option<T> = None;
                    for k in 0..nd {
                        let high = corner >> (nd - 1 - k) & 1 == 1;
                        let (p, wk) = if high {
                            (g.addk(&lo[k], 1.0)?, e.sub(&pc[k], &lo[k])?)
                        } else {
                            (lo[k].clone(), e.sub(&g.addk(&lo[k], 1.0)?, &pc[k])?)
                        };
                        ip.push(p);
                        w = Some(match w {
                            None => wk,
                            Some(w) => e.mul(&w, &wk)?,
                        });
                    }
                    acc = e.add(&acc, &tap(&ip, &w.unwrap())?)?;
                }
            }
        }
        _ => {
            // Bicubic (2-D): 4x4 taps around floor(u), each tap's position padded on its own.
            const A: f64 = -0.75;
            let cubic = |t: &T<'c, 'b>| -> R<Vec<T<'c, 'b>>> {
                // Coefficients for offsets -1, 0, 1, 2 at fraction t.
                let x1 = g.addk(t, 1.0)?;
                let c0 = {
                    // ((A (x+1) - 5A)(x+1) + 8A)(x+1) - 4A
                    let a = g.addk(&g.mulk(&x1, A)?, -5.0 * A)?;
                    let a = g.addk(&e.mul(&a, &x1)?, 8.0 * A)?;
                    g.addk(&e.mul(&a, &x1)?, -4.0 * A)?
                };
                let conv1 = |x: &T<'c, 'b>| -> R<T<'c, 'b>> {
                    // ((A + 2) x - (A + 3)) x x + 1
                    let a = g.addk(&g.mulk(x, A + 2.0)?, -(A + 3.0))?;
                    g.addk(&e.mul(&e.mul(&a, x)?, x)?, 1.0)
                };
                let c1 = conv1(t)?;
                let x2 = g.addk(&g.mulk(t, -1.0)?, 1.0)?;
                let c2 = conv1(&x2)?;
                let x3 = g.addk(&g.mulk(t, -1.0)?, 2.0)?;
                let c3 = {
                    let a = g.addk(&g.mulk(&x3, A)?, -5.0 * A)?;
                    let a = g.addk(&e.mul(&a, &x3)?, 8.0 * A)?;
                    g.addk(&e.mul(&a, &x3)?, -4.0 * A)?
                };
                Ok(vec![c0, c1, c2, c3])
            };
            let (uy, ux) = (&coords[0], &coords[1]);
            let fy = g.floor(uy)?;
            let fx = g.floor(ux)?;
            let wy = cubic(&e.sub(uy, &fy)?)?;
            let wx = cubic(&e.sub(ux, &fx)?)?;
            for (i, wyi) in wy.iter().enumerate() {
                let py = g.pad_coord(&g.addk(&fy, i as f64 - 1.0)?, sizes[0], padding, align)?;
                for (j, wxj) in wx.iter().enumerate() {
                    let px =
                        g.pad_coord(&g.addk(&fx, j as f64 - 1.0)?, sizes[1], padding, align)?;
                    let w = e.mul(wyi, wxj)?;
                    acc = e.add(&acc, &tap(&[py.clone(), px], &w)?)?;
                }
            }
        }
    }
    // Back to (N, C, *out).
    let r = acc.rank() as i64;
    let mut back = vec![0i64, r - 1];
    back.extend(1..r - 1);
    let out = e.transpose(&acc, &back)?;
    Ok(vec![e.convert(&out, out_dtype)?])
}

/// PyTorch's `area_pixel_compute_scale` (in float, as its kernel computes it for float32).
fn area_scale(align: bool, input: i64, output: i64, scale: Option<f64>) -> f32 {
    if align {
        if output > 1 {
            (input - 1) as f32 / (output - 1) as f32
        } else {
            0.0
        }
    } else {
        match scale {
            Some(s) if s > 0.0 => (1.0 / s) as f32,
            _ => input as f32 / output as f32,
        }
    }
}

/// The filters of antialiased resampling (PyTorch's `UpSampleKernel.cpp`): linear (the triangle,
/// support 1) and cubic (Keys' cubic convolution with a = -0.5, support 2).
#[derive(Clone, Copy)]
enum AaFilter {
    Linear,
    Cubic,
}

impl AaFilter {
    /// Half the filter's width in input pixels at scale 1 (`interp_size / 2`).
    fn half_size(self) -> f32 {
        match self {
            AaFilter::Linear => 1.0,
            AaFilter::Cubic => 2.0,
        }
    }

    fn weight(self, x: f32) -> f32 {
        let x = x.abs();
        match self {
            AaFilter::Linear => {
                if x < 1.0 {
                    1.0 - x
                } else {
                    0.0
                }
            }
            AaFilter::Cubic => {
                const A: f32 = -0.5;
                if x < 1.0 {
                    ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A
                } else {
                    0.0
                }
            }
        }
    }
}

/// The taps (input index, weight) of each output position of antialiased resampling:
/// PyTorch's `_compute_indices_min_size_weights_aa` with `filter`.
fn aa_taps(input: i64, output: i64, scale: f32, filter: AaFilter) -> Vec<Vec<(i64, f32)>> {
    let half = filter.half_size();
    let support: f32 = if scale >= 1.0 { half * scale } else { half };
    let invscale: f32 = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
    (0..output)
        .map(|i| {
            let center = scale * (i as f32 + 0.5);
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xsize = ((center + support + 0.5) as i64).min(input) - xmin;
            let mut taps: Vec<(i64, f32)> = (0..xsize.max(0))
                .map(|j| {
                    let x = ((j + xmin) as f32 - center + 0.5) * invscale;
                    (xmin + j, filter.weight(x))
                })
                .collect();
            let total: f32 = taps.iter().map(|t| t.1).sum();
            if total != 0.0 {
                for t in &mut taps {
                    t.1 /= total;
                }
            }
            taps
        })
        .collect()
}

/// Resamples `x` along `dim` with per-output taps: sum_j w_j x[idx_j] (padding taps masked).
fn resample_dim<'c, 'b>(
    e: &Emitter<'c, 'b>,
    x: &T<'c, 'b>,
    dim: usize,
    taps: &[Vec<(i64, f32)>],
) -> R<T<'c, 'b>> {
    let out = taps.len() as i64;
    let width = taps.iter().map(|t| t.len()).max().unwrap_or(0).max(1) as i64;
    let mut idx = Vec::new();
    let mut w = Vec::new();
    let mut valid = Vec::new();
    for t in taps {
        for k in 0..width as usize {
            match t.get(k) {
                Some(&(i, wk)) => {
                    idx.push(i);
                    w.push(wk as f64);
                    valid.push(1);
                }
                None => {
                    idx.push(0);
                    w.push(0.0);
                    valid.push(0);
                }
            }
        }
    }
    let n = out * width;
    let idx = e.reshape(&e.constant_i64(&idx, &[n], I64)?, &[out, width])?;
    let valid = e.reshape(&e.constant_i64(&valid, &[n], I64)?, &[out, width])?;
    let valid = e.compare(&valid, &e.splat(Scalar::Int(0), &[], I64)?, "NE")?;
    let vals: Vec<String> = w.iter().map(|v| format!("{v:.17e}")).collect();
    let wt = e.op(
        "stablehlo.constant",
        &[],
        &[(
            "value",
            format!(
                "dense<[{}]> : {}",
                vals.join(", "),
                crate::lower::emit::tensor_type_text(&[n], x.dtype)
            ),
        )],
        &[n],
        x.dtype,
    )?;
    let wt = e.reshape(&wt, &[out, width])?;
    // Gather: x with `dim` replaced by (out, width).
    let mut gshape = x.shape[..dim].to_vec();
    gshape.extend([out, width]);
    gshape.extend_from_slice(&x.shape[dim + 1..]);
    let g = take_along(e, x, dim, &idx, &gshape)?;
    let bdims = [dim as i64, dim as i64 + 1];
    let wb = e.broadcast_in_dim(&wt, &gshape, &bdims)?;
    let vb = e.broadcast_in_dim(&valid, &gshape, &bdims)?;
    let zero = e.splat(Scalar::Int(0), &[], x.dtype)?;
    let prod = e.select(&vb, &e.mul(&g, &wb)?, &zero, x.dtype)?;
    e.reduce(
        &prod,
        &[dim as i64 + 1],
        crate::lower::ReduceKind::Sum,
        false,
    )
}

/// `_upsample_bilinear2d_aa`: antialiased bilinear resizing, width first, then height.
fn upsample_bilinear2d_aa<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    upsample_2d_aa(cx, AaFilter::Linear)
}

/// `_upsample_bicubic2d_aa` (`F.interpolate(mode="bicubic", antialias=True)`): the same
/// separable resampling with the cubic filter.
fn upsample_bicubic2d_aa<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    upsample_2d_aa(cx, AaFilter::Cubic)
}

fn upsample_2d_aa<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, filter: AaFilter) -> V<'c, 'b> {
    let e = cx.e;
    let x = cx.tensor(0, "self")?;
    let size = cx.ints(1, "output_size")?;
    let align = cx.bool_or(2, "align_corners", false)?;
    let sh = match cx.arg(3, "scales_h") {
        None | Some(Arg::None) => None,
        _ => Some(cx.float_or(3, "scales_h", 0.0)?),
    };
    let sw = match cx.arg(4, "scales_w") {
        None | Some(Arg::None) => None,
        _ => Some(cx.float_or(4, "scales_w", 0.0)?),
    };
    let (out_shape, out_dtype) = cx.out(0)?;
    if x.rank() != 4 || size.len() != 2 {
        return Err(cx.err("expected a 4-d input and a 2-element output_size"));
    }
    if out_shape.contains(&0) || x.shape.contains(&0) {
        return Ok(vec![e.splat(Scalar::Int(0), &out_shape, out_dtype)?]);
    }
    let d = crate::lower::helpers::widen::acc_dtype(out_dtype);
    let xd = e.convert(&x, d)?;
    let (h, w) = (x.shape[2], x.shape[3]);
    let tw = aa_taps(w, size[1], area_scale(align, w, size[1], sw), filter);
    let th = aa_taps(h, size[0], area_scale(align, h, size[0], sh), filter);
    let y = resample_dim(e, &xd, 3, &tw)?;
    let y = resample_dim(e, &y, 2, &th)?;
    Ok(vec![e.convert(&y, out_dtype)?])
}
