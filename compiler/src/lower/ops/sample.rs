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
        "aten.grid_sampler_2d_backward.default",
        grid_sampler_backward,
    ),
    (
        "aten.grid_sampler_3d_backward.default",
        grid_sampler_backward,
    ),
    (
        "aten._upsample_bilinear2d_aa.default",
        upsample_bilinear2d_aa,
    ),
    ("aten._upsample_bicubic2d_aa.default", upsample_bicubic2d_aa),
    (
        "aten._upsample_bilinear2d_aa_backward.default",
        upsample_bilinear2d_aa_backward,
    ),
    (
        "aten._upsample_bicubic2d_aa_backward.default",
        upsample_bicubic2d_aa_backward,
    ),
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

/// The gather/scatter coordinates (N, *out, 1 + nd) of integer positions `idx[k]` (N, *out)
/// per spatial dim, clamped into the input (callers mask what was out of range).
fn tap_indices<'c, 'b>(e: &Emitter<'c, 'b>, idx: &[T<'c, 'b>], sizes: &[i64]) -> R<T<'c, 'b>> {
    let out = idx[0].shape.clone(); // (N, *out)
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
    ishape.push(sizes.len() as i64 + 1);
    let refs: Vec<&T> = parts.iter().collect();
    e.op(
        "stablehlo.concatenate",
        &refs,
        &[("dimension", format!("{} : i64", out.len()))],
        &ishape,
        I64,
    )
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
    let indices = tap_indices(e, idx, sizes)?;
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

/// One tap of an interpolation: integer positions (as floats, (N, *out)) per spatial dim,
/// whether they fall inside the input, the tap's weight and (for the backward) the weight's
/// derivative along each dim's sampling coordinate.
struct Tap<'c, 'b> {
    pos: Vec<T<'c, 'b>>,
    inside: T<'c, 'b>,
    w: T<'c, 'b>,
    dw: Vec<T<'c, 'b>>,
}

/// The operands and settings of a grid sampler (forward or backward) and its unnormalized
/// coordinates per spatial dim (input dim 2 + k).
struct Sampling<'c, 'b> {
    mode: i64,
    padding: i64,
    align: bool,
    /// (D,) H, W.
    sizes: Vec<i64>,
    /// (N, *out).
    pos_shape: Vec<i64>,
    coords: Vec<T<'c, 'b>>,
}

impl<'c, 'b> G<'_, 'c, 'b> {
    /// Reads `interpolation_mode`, `padding_mode` and `align_corners` (args `at`..`at + 2`) and
    /// unnormalizes `grid`'s coordinates; refuses what PyTorch's kernels do not define.
    fn sampling(
        &self,
        cx: &NodeCx<'_, 'c, 'b>,
        input: &T<'c, 'b>,
        grid: &T<'c, 'b>,
        at: usize,
    ) -> R<Sampling<'c, 'b>> {
        let e = self.e;
        let mode = cx.int(at, "interpolation_mode")?;
        let padding = cx.int(at + 1, "padding_mode")?;
        let align = cx.bool_or(at + 2, "align_corners", false)?;
        let nd = input.rank() - 2;
        if !(0..=2).contains(&mode) || !(0..=2).contains(&padding) || (mode == 2 && nd != 2) {
            return Err(cx.err(format!(
                "unsupported interpolation mode {mode} / padding mode {padding} for a {nd}-d input \
                 (modes: 0 bilinear, 1 nearest, 2 bicubic (2-d only); padding: 0 zeros, 1 border, \
                 2 reflection)"
            )));
        }
        let sizes: Vec<i64> = input.shape[2..].to_vec();
        let mut pos_shape = vec![input.shape[0]];
        pos_shape.extend(&grid.shape[1..grid.rank() - 1]);
        // The grid's last dim lists x (W) first.
        let grid = e.convert(grid, self.d)?;
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
            let u = if align {
                self.mulk(&self.addk(&s, 1.0)?, (size - 1.0) / 2.0)?
            } else {
                self.mulk(
                    &self.addk(&self.mulk(&self.addk(&s, 1.0)?, size)?, -1.0)?,
                    0.5,
                )?
            };
            coords.push(u);
        }
        Ok(Sampling {
            mode,
            padding,
            align,
            sizes,
            pos_shape,
            coords,
        })
    }

    /// The derivative of `pad_coord` (PyTorch's `*_set_grad`): border and reflection clip, and
    /// a clipped coordinate (at or past either border) has none; reflection flips its sign on
    /// every other reflection.
    fn pad_coord_grad(&self, x: &T<'c, 'b>, size: i64, padding: i64, align: bool) -> R<T<'c, 'b>> {
        let e = self.e;
        let hi = (size - 1) as f64;
        let one = e.broadcast_to(&self.k(1.0)?, &x.shape)?;
        let zero = e.broadcast_to(&self.k(0.0)?, &x.shape)?;
        let clip_grad = |v: &T<'c, 'b>| -> R<T<'c, 'b>> {
            let inside = e.and(
                &e.compare(v, &self.k(0.0)?, "GT")?,
                &e.compare(v, &self.k(hi)?, "LT")?,
            )?;
            e.select(&inside, &one, &zero, self.d)
        };
        match padding {
            1 => clip_grad(x),
            2 => {
                let (twice_low, twice_high) = if align {
                    (0, 2 * (size - 1))
                } else {
                    (-1, 2 * size - 1)
                };
                if twice_low == twice_high {
                    return Ok(zero);
                }
                let min = twice_low as f64 / 2.0;
                let span = (twice_high - twice_low) as f64 / 2.0;
                let shifted = self.addk(x, -min)?;
                let neg = e.compare(&shifted, &self.k(0.0)?, "LT")?;
                let a = e.unary("stablehlo.abs", &shifted)?;
                let flips = self.floor(&self.mulk(&a, 1.0 / span)?)?;
                let half = self.floor(&self.mulk(&flips, 0.5)?)?;
                let even = e.compare(&self.mulk(&half, 2.0)?, &flips, "EQ")?;
                // +1 when (even flips) == (non-negative), else -1.
                let minus = self.mulk(&one, -1.0)?;
                let up = e.select(&neg, &minus, &one, self.d)?;
                let down = e.select(&neg, &one, &minus, self.d)?;
                let refl = e.select(&even, &up, &down, self.d)?;
                let reflected = self.reflect(x, twice_low, twice_high)?;
                e.mul(&refl, &clip_grad(&reflected)?)
            }
            _ => Ok(one),
        }
    }

    /// Keys' cubic convolution coefficients (a = -0.75) for offsets -1, 0, 1, 2 at fraction
    /// `t`, and (when `grad`) their derivatives along `t`.
    fn cubic(&self, t: &T<'c, 'b>, grad: bool) -> R<(Vec<T<'c, 'b>>, Vec<T<'c, 'b>>)> {
        const A: f64 = -0.75;
        let e = self.e;
        // Far taps (|x| in [1, 2]): ((A x - 5A) x + 8A) x - 4A; its derivative 3A x^2 - 10A x + 8A.
        let far = |x: &T<'c, 'b>| -> R<T<'c, 'b>> {
            let a = self.addk(&self.mulk(x, A)?, -5.0 * A)?;
            let a = self.addk(&e.mul(&a, x)?, 8.0 * A)?;
            self.addk(&e.mul(&a, x)?, -4.0 * A)
        };
        let far_d = |x: &T<'c, 'b>| -> R<T<'c, 'b>> {
            let a = self.addk(&self.mulk(x, 3.0 * A)?, -10.0 * A)?;
            self.addk(&e.mul(&a, x)?, 8.0 * A)
        };
        // Near taps (|x| < 1): ((A + 2) x - (A + 3)) x x + 1; its derivative
        // 3(A + 2) x^2 - 2(A + 3) x.
        let near = |x: &T<'c, 'b>| -> R<T<'c, 'b>> {
            let a = self.addk(&self.mulk(x, A + 2.0)?, -(A + 3.0))?;
            self.addk(&e.mul(&e.mul(&a, x)?, x)?, 1.0)
        };
        let near_d = |x: &T<'c, 'b>| -> R<T<'c, 'b>> {
            let a = self.addk(&self.mulk(x, 3.0 * (A + 2.0))?, -2.0 * (A + 3.0))?;
            e.mul(&a, x)
        };
        let x0 = self.addk(t, 1.0)?;
        let x2 = self.addk(&self.mulk(t, -1.0)?, 1.0)?;
        let x3 = self.addk(&self.mulk(t, -1.0)?, 2.0)?;
        let c = vec![far(&x0)?, near(t)?, near(&x2)?, far(&x3)?];
        let d = if grad {
            vec![
                far_d(&x0)?,
                near_d(t)?,
                self.mulk(&near_d(&x2)?, -1.0)?,
                self.mulk(&far_d(&x3)?, -1.0)?,
            ]
        } else {
            Vec::new()
        };
        Ok((c, d))
    }

    /// The taps of `s`'s interpolation and, per spatial dim, the derivative of the coordinate
    /// the taps' weights are functions of along the grid's value (`grad` only: the
    /// unnormalization's scale, times padding's derivative for bilinear).
    fn taps(&self, s: &Sampling<'c, 'b>, grad: bool) -> R<(Vec<Tap<'c, 'b>>, Vec<T<'c, 'b>>)> {
        let e = self.e;
        let nd = s.sizes.len();
        let inside_of = |ip: &[T<'c, 'b>]| -> R<T<'c, 'b>> {
            let mut inside: Option<T> = None;
            for (k, p) in ip.iter().enumerate() {
                let ok = e.and(
                    &e.compare(p, &self.k(0.0)?, "GE")?,
                    &e.compare(p, &self.k((s.sizes[k] - 1) as f64)?, "LE")?,
                )?;
                inside = Some(match inside {
                    None => ok,
                    Some(i) => e.and(&i, &ok)?,
                });
            }
            Ok(inside.expect("at least one spatial dim"))
        };
        let scale = |k: usize| {
            let size = s.sizes[k] as f64;
            if s.align {
                (size - 1.0) / 2.0
            } else {
                size / 2.0
            }
        };
        let mut taps = Vec::new();
        let mut mult = Vec::new();
        match s.mode {
            0 | 1 => {
                let pc: Vec<T> = s
                    .coords
                    .iter()
                    .enumerate()
                    .map(|(k, u)| self.pad_coord(u, s.sizes[k], s.padding, s.align))
                    .collect::<R<_>>()?;
                if grad {
                    for (k, u) in s.coords.iter().enumerate() {
                        let pg = self.pad_coord_grad(u, s.sizes[k], s.padding, s.align)?;
                        mult.push(self.mulk(&pg, scale(k))?);
                    }
                }
                if s.mode == 1 {
                    // Nearest: round half to even; no gradient along the grid.
                    let ip: Vec<T> = pc
                        .iter()
                        .map(|u| e.unary("stablehlo.round_nearest_even", u))
                        .collect::<R<_>>()?;
                    let one = e.broadcast_to(&self.k(1.0)?, &s.pos_shape)?;
                    let zero = e.broadcast_to(&self.k(0.0)?, &s.pos_shape)?;
                    taps.push(Tap {
                        inside: inside_of(&ip)?,
                        pos: ip,
                        w: one,
                        dw: if grad { vec![zero; nd] } else { Vec::new() },
                    });
                } else {
                    let lo: Vec<T> = pc.iter().map(|u| self.floor(u)).collect::<R<_>>()?;
                    // Weights: (hi - u) for the low corner, (u - lo) for the high one; their
                    // derivatives -1 and +1.
                    for corner in 0..(1usize << nd) {
                        let mut ip = Vec::new();
                        let mut wk = Vec::new();
                        let mut sign = Vec::new();
                        for k in 0..nd {
                            let high = corner >> (nd - 1 - k) & 1 == 1;
                            if high {
                                ip.push(self.addk(&lo[k], 1.0)?);
                                wk.push(e.sub(&pc[k], &lo[k])?);
                                sign.push(1.0);
                            } else {
                                ip.push(lo[k].clone());
                                wk.push(e.sub(&self.addk(&lo[k], 1.0)?, &pc[k])?);
                                sign.push(-1.0);
                            }
                        }
                        let product = |skip: Option<usize>| -> R<Option<T<'c, 'b>>> {
                            let mut w: Option<T> = None;
                            for (k, x) in wk.iter().enumerate() {
                                if Some(k) == skip {
                                    continue;
                                }
                                w = Some(match w {
                                    None => x.clone(),
                                    Some(w) => e.mul(&w, x)?,
                                });
                            }
                            Ok(w)
                        };
                        let w = product(None)?.expect("at least one spatial dim");
                        let mut dw = Vec::new();
                        if grad {
                            for (j, &sg) in sign.iter().enumerate() {
                                dw.push(match product(Some(j))? {
                                    Some(p) => self.mulk(&p, sg)?,
                                    None => e.broadcast_to(&self.k(sg)?, &s.pos_shape)?,
                                });
                            }
                        }
                        taps.push(Tap {
                            inside: inside_of(&ip)?,
                            pos: ip,
                            w,
                            dw,
                        });
                    }
                }
            }
            _ => {
                // Bicubic (2-D): 4x4 taps around floor(u), each tap's position padded on its
                // own (no gradient through the padding: positions are integers).
                if grad {
                    for k in 0..nd {
                        mult.push(e.broadcast_to(&self.k(scale(k))?, &s.pos_shape)?);
                    }
                }
                let (uy, ux) = (&s.coords[0], &s.coords[1]);
                let fy = self.floor(uy)?;
                let fx = self.floor(ux)?;
                let (wy, dwy) = self.cubic(&e.sub(uy, &fy)?, grad)?;
                let (wx, dwx) = self.cubic(&e.sub(ux, &fx)?, grad)?;
                for (i, wyi) in wy.iter().enumerate() {
                    let py = self.pad_coord(
                        &self.addk(&fy, i as f64 - 1.0)?,
                        s.sizes[0],
                        s.padding,
                        s.align,
                    )?;
                    for (j, wxj) in wx.iter().enumerate() {
                        let px = self.pad_coord(
                            &self.addk(&fx, j as f64 - 1.0)?,
                            s.sizes[1],
                            s.padding,
                            s.align,
                        )?;
                        let ip = vec![py.clone(), px];
                        let dw = if grad {
                            vec![e.mul(&dwy[i], wxj)?, e.mul(wyi, &dwx[j])?]
                        } else {
                            Vec::new()
                        };
                        taps.push(Tap {
                            inside: inside_of(&ip)?,
                            pos: ip,
                            w: e.mul(wyi, wxj)?,
                            dw,
                        });
                    }
                }
            }
        }
        Ok((taps, mult))
    }
}

/// (N, C, *sp) -> (N, *sp, C).
fn channels_last<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let mut perm = vec![0i64];
    perm.extend(2..x.rank() as i64);
    perm.push(1);
    e.transpose(x, &perm)
}

/// (N, *sp, C) -> (N, C, *sp).
fn channels_first<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let r = x.rank() as i64;
    let mut back = vec![0i64, r - 1];
    back.extend(1..r - 1);
    e.transpose(x, &back)
}

fn grid_sampler<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let input = cx.tensor(0, "input")?;
    let grid = cx.tensor(1, "grid")?;
    let (out_shape, out_dtype) = cx.out(0)?;
    let d = crate::lower::helpers::widen::acc_dtype(out_dtype);
    let g = G { e, d };
    let s = g.sampling(cx, &input, &grid, 2)?;
    if out_shape.contains(&0) || input.shape.contains(&0) {
        return Ok(vec![e.splat(Scalar::Int(0), &out_shape, out_dtype)?]);
    }
    let c = input.shape[1];
    // Channels last, in the compute dtype: (N, *spatial, C).
    let input_cl = channels_last(e, &e.convert(&input, d)?)?;
    let mut acc_shape = s.pos_shape.clone();
    acc_shape.push(c);
    let mut ws = s.pos_shape.clone();
    ws.push(1);
    let zero = e.splat(Scalar::Int(0), &[], d)?;
    let (taps, _) = g.taps(&s, false)?;
    let mut acc = e.splat(Scalar::Int(0), &acc_shape, d)?;
    // Each tap: the input at its positions, weighted, zero outside.
    for t in &taps {
        let idx: Vec<T> = t.pos.iter().map(|p| e.convert(p, I64)).collect::<R<_>>()?;
        let v = gather(e, &input_cl, &idx, &s.sizes)?;
        let w = e.select(&t.inside, &t.w, &zero, d)?;
        acc = e.add(&acc, &e.mul(&v, &e.reshape(&w, &ws)?)?)?;
    }
    let out = channels_first(e, &acc)?;
    Ok(vec![e.convert(&out, out_dtype)?])
}

/// `grid_sampler_2d/3d_backward(grad_output, input, grid, interpolation_mode, padding_mode,
/// align_corners, output_mask) -> (grad_input, grad_grid)`, from the forward's taps: the input's
/// gradient scatters each tap's weighted output gradient to its position (one scatter for all
/// taps); the grid's sums, per tap, the channels of input times output gradient, times the
/// weight's derivative, times the coordinate's (PyTorch's CPU kernels; nearest has none).
fn grid_sampler_backward<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let gout = cx.tensor(0, "grad_output")?;
    let input = cx.tensor(1, "input")?;
    let grid = cx.tensor(2, "grid")?;
    let mask: Vec<bool> = match cx.arg(6, "output_mask") {
        Some(Arg::List(items)) => items
            .iter()
            .map(|a| matches!(a, Arg::Bool(true) | Arg::Int(1)))
            .collect(),
        _ => vec![true; 2],
    };
    // A gradient output_mask leaves out may still be recorded (PyTorch's CPU kernel always
    // computes the grid's): computed when read, zeros when not.
    let want =
        |k: usize| cx.out(k).is_ok() && (mask.get(k).copied().unwrap_or(true) || cx.result_used(k));
    let d = crate::lower::helpers::widen::acc_dtype(input.dtype);
    let g = G { e, d };
    let s = g.sampling(cx, &input, &grid, 3)?;
    // A stand-in for a gradient that output_mask says nobody wants (FX records no tensor).
    let placeholder = || e.splat(Scalar::Int(0), &[], DType::Float32);
    let zeros_of = |k: usize| -> R<T<'c, 'b>> {
        match cx.out(k) {
            Ok((shape, dtype)) => e.splat(Scalar::Int(0), &shape, dtype),
            Err(_) => placeholder(),
        }
    };
    if input.shape.contains(&0) || gout.shape.contains(&0) {
        return Ok(vec![zeros_of(0)?, zeros_of(1)?]);
    }
    let nd = s.sizes.len();
    let c = input.shape[1];
    let m: i64 = s.pos_shape.iter().product();
    let input_cl = channels_last(e, &e.convert(&input, d)?)?;
    let gout_cl = channels_last(e, &e.convert(&gout, d)?)?; // (N, *out, C)
    let (taps, mult) = g.taps(&s, want(1) && s.mode != 1)?;
    let zero = e.splat(Scalar::Int(0), &[], d)?;
    let mut ws = s.pos_shape.clone();
    ws.push(1);
    let mut idx_rows = Vec::new();
    let mut upd_rows = Vec::new();
    let mut gcoord: Vec<Option<T>> = vec![None; nd];
    for t in &taps {
        let idx: Vec<T> = t.pos.iter().map(|p| e.convert(p, I64)).collect::<R<_>>()?;
        if want(0) {
            let u = e.mul(&gout_cl, &e.reshape(&t.w, &ws)?)?;
            let inside = e.broadcast_in_dim(&t.inside, &gout_cl.shape, &int_range(nd + 1))?;
            let u = e.select(&inside, &u, &zero, d)?;
            idx_rows.push(e.reshape(&tap_indices(e, &idx, &s.sizes)?, &[m, nd as i64 + 1])?);
            upd_rows.push(e.reshape(&u, &[m, c])?);
        }
        if want(1) && s.mode != 1 {
            let v = gather(e, &input_cl, &idx, &s.sizes)?;
            let dot = e.reduce(
                &e.mul(&v, &gout_cl)?,
                &[nd as i64 + 1],
                crate::lower::ReduceKind::Sum,
                false,
            )?;
            let dot = e.select(&t.inside, &dot, &zero, d)?;
            for (k, acc) in gcoord.iter_mut().enumerate() {
                let term = e.mul(&dot, &t.dw[k])?;
                *acc = Some(match acc.take() {
                    None => term,
                    Some(a) => e.add(&a, &term)?,
                });
            }
        }
    }
    let grad_input = if want(0) {
        let (shape, dtype) = cx.out(0)?;
        let irefs: Vec<&T> = idx_rows.iter().collect();
        let urefs: Vec<&T> = upd_rows.iter().collect();
        let indices = e.concatenate(&irefs, 0)?;
        let updates = e.concatenate(&urefs, 0)?;
        let mut acc_shape = vec![input.shape[0]];
        acc_shape.extend(&s.sizes);
        acc_shape.push(c);
        let spatial: Vec<i64> = (0..=nd as i64).collect();
        let gi = e.scatter(
            &e.splat(Scalar::Int(0), &acc_shape, d)?,
            &indices,
            &updates,
            &[1],
            &spatial,
            &spatial,
            true,
        )?;
        e.reshape(&e.convert(&channels_first(e, &gi)?, dtype)?, &shape)?
    } else {
        zeros_of(0)?
    };
    let grad_grid = if want(1) {
        let (shape, dtype) = cx.out(1)?;
        // The grid's last dim lists x (W) first: dim k's component is nd - 1 - k.
        let parts: Vec<T> = (0..nd)
            .rev()
            .map(|k| {
                let gk = match &gcoord[k] {
                    Some(gk) => e.mul(gk, &mult[k])?,
                    None => e.broadcast_to(&zero, &s.pos_shape)?,
                };
                e.reshape(&gk, &ws)
            })
            .collect::<R<_>>()?;
        let refs: Vec<&T> = parts.iter().collect();
        let gg = e.concatenate(&refs, nd + 1)?;
        e.reshape(&e.convert(&gg, dtype)?, &shape)?
    } else {
        zeros_of(1)?
    };
    Ok(vec![grad_input, grad_grid])
}

fn int_range(n: usize) -> Vec<i64> {
    (0..n as i64).collect()
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

/// The taps of the transposed resampling: per input position, the (output position, weight)
/// pairs whose taps read it.
fn transposed_taps(taps: &[Vec<(i64, f32)>], input: i64) -> Vec<Vec<(i64, f32)>> {
    let mut t = vec![Vec::new(); input as usize];
    for (o, row) in taps.iter().enumerate() {
        for &(i, w) in row {
            t[i as usize].push((o as i64, w));
        }
    }
    t
}

/// `_upsample_bilinear2d_aa_backward(grad_output, output_size, input_size, align_corners,
/// scales_h, scales_w)`: the forward is linear with fixed taps, so its gradient is the
/// transposed resampling (height, then width).
fn upsample_bilinear2d_aa_backward<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    upsample_2d_aa_backward(cx, AaFilter::Linear)
}

fn upsample_bicubic2d_aa_backward<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    upsample_2d_aa_backward(cx, AaFilter::Cubic)
}

fn upsample_2d_aa_backward<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, filter: AaFilter) -> V<'c, 'b> {
    let e = cx.e;
    let g = cx.tensor(0, "grad_output")?;
    let size = cx.ints(1, "output_size")?;
    let input_size = cx.ints(2, "input_size")?;
    let align = cx.bool_or(3, "align_corners", false)?;
    let (sh, sw) = (cx.opt_float(4, "scales_h")?, cx.opt_float(5, "scales_w")?);
    let (out_shape, out_dtype) = cx.out(0)?;
    if g.rank() != 4 || size.len() != 2 || input_size.len() != 4 {
        return Err(cx.err(
            "expected a 4-d grad_output, a 2-element output_size and a 4-element input_size",
        ));
    }
    if out_shape.contains(&0) || g.shape.contains(&0) {
        return Ok(vec![e.splat(Scalar::Int(0), &out_shape, out_dtype)?]);
    }
    let d = crate::lower::helpers::widen::acc_dtype(out_dtype);
    let (h, w) = (input_size[2], input_size[3]);
    let tw = aa_taps(w, size[1], area_scale(align, w, size[1], sw), filter);
    let th = aa_taps(h, size[0], area_scale(align, h, size[0], sh), filter);
    let y = resample_dim(e, &e.convert(&g, d)?, 2, &transposed_taps(&th, h))?;
    let y = resample_dim(e, &y, 3, &transposed_taps(&tw, w))?;
    Ok(vec![e.convert(&y, out_dtype)?])
}

fn upsample_2d_aa<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, filter: AaFilter) -> V<'c, 'b> {
    let e = cx.e;
    let x = cx.tensor(0, "self")?;
    let size = cx.ints(1, "output_size")?;
    let align = cx.bool_or(2, "align_corners", false)?;
    let (sh, sw) = (cx.opt_float(3, "scales_h")?, cx.opt_float(4, "scales_w")?);
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
