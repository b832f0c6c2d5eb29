//! Row kernels on the host, registered with a CPU plugin as XLA FFI custom calls: layer
//! normalization over the last dim of an f32 matrix, one pass over memory per row.
//!
//! Why: XLA's CPU lowering of a layer norm is five fusions (the mean's reduction, a subtract
//! written out, the variance's reduction, the reciprocal square root, the scaled result), each
//! a pass over the whole tensor: 1.65 ms for BERT-sized 1576x768 rows against 0.5-0.6 in eager
//! and Inductor, and a transformer has two per layer. Here each row is read from memory once
//! (its statistics come from the copy in L1), the rows are cut into units that this thread and
//! the spinning helpers ([`super::spin_helpers`]) share.
//!
//! The compiler emits `stablehlo.custom_call @tpuc_layer_norm` (typed FFI, api_version 4) where
//! the session enables it; [`register`] registers the targets once per plugin.

use std::ffi::c_void;

use super::spin_helpers::{cpus, run_units};
use super::xla_ffi::{
    arg, error, open_frame_of, register_targets, ret, CallFrame, FfiBuffer, Handler, DTYPE_F32,
};
use tpuc_runtime::PjrtError;
use tpuc_runtime::Plugin;

/// `tpuc_layer_norm(x [rows, n], weight [n], bias [n], eps [1]) -> (y [rows, n], mean [rows],
/// rstd [rows])`, all f32: `y = (x - mean) * rstd * weight + bias` per row, with
/// `rstd = 1 / sqrt(var + eps)` of the biased variance, as `aten.native_layer_norm` returns.
pub const LAYER_NORM: &str = "tpuc_layer_norm";

/// Registers the row kernels with `plugin`'s XLA, once per plugin. Ok(false) where the plugin
/// has no PJRT FFI extension.
pub fn register(plugin: &Plugin) -> Result<bool, PjrtError> {
    register_targets(
        plugin,
        &[(LAYER_NORM, layer_norm as Handler)],
        "host row kernels",
    )
}

/// Rows are shared out in units of about this many elements (a unit is a few microseconds:
/// small enough to balance two threads, large enough that claiming one costs nothing).
const UNIT_ELEMENTS: i64 = 16 * 1024;

/// A buffer's dims and data, after checking it is f32 of rank `rank`.
fn f32_buffer(b: Option<&FfiBuffer>, rank: i64) -> Option<(&[i64], *mut f32)> {
    let b = b?;
    (b.dtype == DTYPE_F32 && b.rank == rank).then(|| (b.dims(), b.data as *mut f32))
}

/// Pointers into XLA's buffers, shared with the threads that run the units.
#[derive(Clone, Copy)]
struct LayerNorm {
    x: *const f32,
    weight: *const f32,
    bias: *const f32,
    y: *mut f32,
    mean: *mut f32,
    rstd: *mut f32,
    rows: i64,
    n: i64,
    eps: f32,
}

// SAFETY: XLA's buffers for the duration of the call, which waits until every unit is done;
// each unit writes its own rows.
unsafe impl Send for LayerNorm {}
// SAFETY: see Send.
unsafe impl Sync for LayerNorm {}

/// The handler of [`LAYER_NORM`].
///
/// # Safety
/// Called by XLA with a valid call frame.
unsafe extern "C" fn layer_norm(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: the pointer XLA passed.
    let frame = match unsafe { open_frame_of(frame, LAYER_NORM, 4, 3) } {
        Ok(frame) => frame,
        Err(done) => return done,
    };
    // SAFETY: a checked frame of 4 operands and 3 results.
    let (x, w, b, eps, y, mean, rstd) = unsafe {
        (
            f32_buffer(arg(frame, 0), 2),
            f32_buffer(arg(frame, 1), 1),
            f32_buffer(arg(frame, 2), 1),
            f32_buffer(arg(frame, 3), 1),
            f32_buffer(ret(frame, 0), 2),
            f32_buffer(ret(frame, 1), 1),
            f32_buffer(ret(frame, 2), 1),
        )
    };
    let (
        Some((xd, xp)),
        Some((wd, wp)),
        Some((bd, bp)),
        Some((ed, ep)),
        Some((yd, yp)),
        Some((md, mp)),
        Some((rd, rp)),
    ) = (x, w, b, eps, y, mean, rstd)
    else {
        return error(
            frame,
            "tpuc_layer_norm: operands and results must be f32 of ranks 2, 1, 1, 1 -> 2, 1, 1",
        );
    };
    let (rows, n) = (xd[0], xd[1]);
    if wd != [n] || bd != [n] || ed != [1] || yd != xd || md != [rows] || rd != [rows] {
        return error(frame, "tpuc_layer_norm: shapes do not match x [rows, n]");
    }
    if rows == 0 {
        return std::ptr::null_mut();
    }
    let job = LayerNorm {
        x: xp,
        weight: wp,
        bias: bp,
        y: yp,
        mean: mp,
        rstd: rp,
        rows,
        n,
        // SAFETY: an f32 buffer of one element.
        eps: unsafe { *ep },
    };
    let per_unit = (UNIT_ELEMENTS / n.max(1)).max(1);
    let units = (rows + per_unit - 1) / per_unit;
    run_units(units, cpus() as usize, move |u| {
        let first = u * per_unit;
        // SAFETY: rows `first..` of the checked buffers, written by this unit alone.
        unsafe { job.rows(first, (first + per_unit).min(job.rows)) };
    });
    std::ptr::null_mut()
}

impl LayerNorm {
    /// Normalizes rows `first..end`.
    ///
    /// # Safety
    /// The pointers must be live buffers of the shapes in `self`, rows in range.
    unsafe fn rows(&self, first: i64, end: i64) {
        let n = self.n as usize;
        // SAFETY: the caller's buffers.
        let (w, b) = unsafe {
            (
                std::slice::from_raw_parts(self.weight, n),
                std::slice::from_raw_parts(self.bias, n),
            )
        };
        for r in first..end {
            let at = r as usize * n;
            // SAFETY: row `r` of x and y, and entry `r` of the statistics.
            unsafe {
                let x = std::slice::from_raw_parts(self.x.add(at), n);
                let y = std::slice::from_raw_parts_mut(self.y.add(at), n);
                let (m, s) = vector::layer_norm_row(x, w, b, y, self.eps);
                *self.mean.add(r as usize) = m;
                *self.rstd.add(r as usize) = s;
            }
        }
    }
}

/// The row arithmetic, written over independent lanes so that the compiler vectorizes it, in
/// the widest instructions the CPU has (checked once).
pub(crate) mod vector {
    /// `fn name(args) -> ret = body`: a function that runs `body(args)` compiled for the widest
    /// vectors the CPU has (AVX-512, else AVX2 with FMA: checked once, cached by std), else
    /// as portable code.
    macro_rules! widest {
        ($(#[$m:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),* $(,)?) -> $r:ty = $body:ident) => {
            $(#[$m])*
            $vis fn $name($($a: $t),*) -> $r {
                #[cfg(target_arch = "x86_64")]
                {
                    #[target_feature(enable = "avx512f")]
                    unsafe fn avx512($($a: $t),*) -> $r {
                        $body($($a),*)
                    }
                    #[target_feature(enable = "avx2,fma")]
                    unsafe fn avx2($($a: $t),*) -> $r {
                        $body($($a),*)
                    }
                    if std::arch::is_x86_feature_detected!("avx512f") {
                        // SAFETY: the CPU has the instructions.
                        return unsafe { avx512($($a),*) };
                    }
                    if std::arch::is_x86_feature_detected!("avx2")
                        && std::arch::is_x86_feature_detected!("fma")
                    {
                        // SAFETY: as above.
                        return unsafe { avx2($($a),*) };
                    }
                }
                $body($($a),*)
            }
        };
    }

    /// Lanes of the softmax's loops: one AVX-512 register.
    const LANES: usize = 16;
    /// Lanes of the layer norm's sums: two registers, so that two chains of additions overlap
    /// (2.3x faster on 768-long rows than one).
    const SUM_LANES: usize = 32;

    /// Sum of `x` in [`SUM_LANES`] partial sums (pairwise enough for rows of thousands), then the
    /// tail.
    #[inline(always)]
    fn sum_by(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
        let mut acc = [0f32; SUM_LANES];
        let chunks = x.chunks_exact(SUM_LANES);
        let tail: f32 = chunks.remainder().iter().map(|&v| f(v)).sum();
        for c in chunks {
            let c: &[f32; SUM_LANES] = c.try_into().expect("SUM_LANES long");
            for l in 0..SUM_LANES {
                acc[l] += f(c[l]);
            }
        }
        acc.iter().sum::<f32>() + tail
    }

    /// Sums of `f(x)` and of its squares, as [`sum_by`].
    #[inline(always)]
    fn sum2_by(x: &[f32], f: impl Fn(f32) -> f32) -> (f32, f32) {
        let (mut acc, mut acc2) = ([0f32; SUM_LANES], [0f32; SUM_LANES]);
        let chunks = x.chunks_exact(SUM_LANES);
        let (mut tail, mut tail2) = (0f32, 0f32);
        for &v in chunks.remainder() {
            let d = f(v);
            tail += d;
            tail2 += d * d;
        }
        for c in chunks {
            let c: &[f32; SUM_LANES] = c.try_into().expect("SUM_LANES long");
            for l in 0..SUM_LANES {
                let d = f(c[l]);
                acc[l] += d;
                acc2[l] += d * d;
            }
        }
        (
            acc.iter().sum::<f32>() + tail,
            acc2.iter().sum::<f32>() + tail2,
        )
    }

    #[inline(always)]
    fn layer_norm_body(x: &[f32], w: &[f32], b: &[f32], y: &mut [f32], eps: f32) -> (f32, f32) {
        let n = x.len() as f32;
        // The corrected two-pass algorithm: the second pass also sums the deviations from the
        // first mean, whose rounding error they measure (rows of large mean: 2x closer to f64).
        let rough = sum_by(x, |v| v) / n;
        let (dev, dev2) = sum2_by(x, |v| v - rough);
        let mean = rough + dev / n;
        let var = ((dev2 - dev * dev / n) / n).max(0.0);
        let rstd = 1.0 / (var + eps).sqrt();
        let n = x.len();
        let (x, w, b, y) = (&x[..n], &w[..n], &b[..n], &mut y[..n]);
        for i in 0..n {
            y[i] = (x[i] - mean) * rstd * w[i] + b[i];
        }
        (mean, rstd)
    }

    widest! {
        /// One row: writes `y`, returns `(mean, rstd)`. `x`, `w`, `b` and `y` have the same
        /// length.
        pub(super) fn layer_norm_row(
            x: &[f32],
            w: &[f32],
            b: &[f32],
            y: &mut [f32],
            eps: f32,
        ) -> (f32, f32) = layer_norm_body
    }

    /// `e^x` for `x <= 0` (NaN stays NaN): `2^n e^r` with `r = x - n ln 2` in `[-ln2/2, ln2/2]`
    /// and e^r to degree 7 (the next term is below 1e-8 of the result), about 1-2 ulp; 0
    /// below -87.3, where e^x is no longer a normal f32. No calls, no float-to-int conversion
    /// (the integer n is read from the bits of the rounded sum), and selects only: a loop over
    /// it vectorizes.
    #[inline(always)]
    fn exp_nonpositive(x: f32) -> f32 {
        const LOG2E: f32 = std::f32::consts::LOG2_E;
        const LN2_HI: f32 = 0.693_359_4;
        const LN2_LO: f32 = -2.121_944_4e-4;
        // Adding 1.5 * 2^23 rounds to an integer, which the low mantissa bits then hold.
        const ROUND: f32 = 12_582_912.0;
        let low = x < -87.3;
        let xc = if low { -87.3 } else { x };
        // Fused multiply-adds: one instruction each where the CPU has them (the callers'
        // target features), a library call in the portable fallback.
        let t = xc.mul_add(LOG2E, ROUND);
        let n = t - ROUND;
        let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, xc));
        let p = (1.0f32 / 5040.0).mul_add(r, 1.0 / 720.0);
        let p = p.mul_add(r, 1.0 / 120.0);
        let p = p.mul_add(r, 1.0 / 24.0);
        let p = p.mul_add(r, 1.0 / 6.0);
        let p = p.mul_add(r, 0.5);
        let p = p.mul_add(r, 1.0);
        let p = p.mul_add(r, 1.0);
        let n_bits = t.to_bits().wrapping_sub(ROUND.to_bits());
        let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
        if low {
            0.0
        } else {
            p * scale
        }
    }

    #[inline(always)]
    fn softmax_body(row: &mut [f32]) -> (f32, f32) {
        // The max skips NaN here (a NaN makes its exponential NaN below, and so the sum and
        // the whole row, as in PyTorch); only a row of nothing but -inf and NaN needs a look.
        let mut lanes = [f32::NEG_INFINITY; LANES];
        let mut chunks = row.chunks_exact(LANES);
        for c in &mut chunks {
            let c: &[f32; LANES] = c.try_into().expect("LANES long");
            for l in 0..LANES {
                lanes[l] = if c[l] > lanes[l] { c[l] } else { lanes[l] };
            }
        }
        let mut max = f32::NEG_INFINITY;
        for &m in lanes.iter().chain(chunks.remainder()) {
            max = if m > max { m } else { max };
        }
        if max == f32::NEG_INFINITY {
            if row.iter().any(|v| v.is_nan()) {
                row.fill(f32::NAN);
                return (f32::NAN, f32::NAN);
            }
            row.fill(0.0);
            return (max, 0.0);
        }
        let mut acc = [0f32; LANES];
        let mut chunks = row.chunks_exact_mut(LANES);
        for c in &mut chunks {
            let c: &mut [f32; LANES] = c.try_into().expect("LANES long");
            for l in 0..LANES {
                let p = exp_nonpositive(c[l] - max);
                c[l] = p;
                acc[l] += p;
            }
        }
        let mut tail = 0.0;
        for v in chunks.into_remainder() {
            *v = exp_nonpositive(*v - max);
            tail += *v;
        }
        let sum = acc.iter().sum::<f32>() + tail;
        let inv = 1.0 / sum;
        for v in row.iter_mut() {
            *v *= inv;
        }
        (max, sum)
    }

    widest! {
        /// Softmax of `row` in place; returns `(max, sum)` of the row and of its exponentials
        /// `e^(x - max)`, whose logsumexp is `max + ln(sum)`. A row of -inf (every key masked)
        /// becomes zeros, and `(-inf, 0)` is returned.
        pub(crate) fn softmax_row(row: &mut [f32]) -> (f32, f32) = softmax_body
    }

    /// `row += add`, elementwise (a float attention mask).
    pub(crate) fn add_in_place(row: &mut [f32], add: &[f32]) {
        for (v, &a) in row.iter_mut().zip(add) {
            *v += a;
        }
    }

    #[cfg(test)]
    mod tests {
        /// Against the two-pass formula in f64, for row lengths around the lane count.
        #[test]
        fn layer_norm_row_matches_f64() {
            for n in [1usize, 7, 16, 17, 100, 768, 1000] {
                let x: Vec<f32> = (0..n)
                    .map(|i| ((i * 37 % 101) as f32) * 0.1 - 3.0)
                    .collect();
                let w: Vec<f32> = (0..n).map(|i| 1.0 + (i % 5) as f32 * 0.25).collect();
                let b: Vec<f32> = (0..n).map(|i| (i % 3) as f32 - 1.0).collect();
                let mut y = vec![0f32; n];
                let (m, s) = super::layer_norm_row(&x, &w, &b, &mut y, 1e-5);
                let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
                let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n as f64;
                let rstd = 1.0 / (var + 1e-5).sqrt();
                assert!((m as f64 - mean).abs() < 1e-5, "n={n}: mean {m} vs {mean}");
                assert!(
                    (s as f64 - rstd).abs() < 1e-4 * rstd,
                    "n={n}: rstd {s} vs {rstd}"
                );
                for i in 0..n {
                    let want = (x[i] as f64 - mean) * rstd * w[i] as f64 + b[i] as f64;
                    assert!(
                        (y[i] as f64 - want).abs() < 1e-4,
                        "n={n} i={i}: {} vs {want}",
                        y[i]
                    );
                }
            }
        }

        /// Against f64's exp, over the whole range it is used on.
        #[test]
        fn exp_is_within_two_ulp() {
            let mut worst = 0f64;
            let mut x = -87.0f32;
            while x <= 0.0 {
                let got = super::exp_nonpositive(x) as f64;
                let want = (x as f64).exp();
                worst = worst.max((got - want).abs() / (want * f32::EPSILON as f64));
                x += 0.001_3;
            }
            assert!(worst < 2.0, "worst error {worst} ulp");
            assert_eq!(super::exp_nonpositive(-100.0), 0.0);
            assert_eq!(super::exp_nonpositive(f32::NEG_INFINITY), 0.0);
            assert!(super::exp_nonpositive(f32::NAN).is_nan());
            assert_eq!(super::exp_nonpositive(0.0), 1.0);
        }

        /// Against f64 softmax, with -inf entries, a NaN, and a row of -inf.
        #[test]
        fn softmax_row_matches_f64() {
            for n in [1usize, 5, 16, 33, 197, 1000] {
                let x: Vec<f32> = (0..n)
                    .map(|i| {
                        if i % 7 == 3 {
                            f32::NEG_INFINITY
                        } else {
                            ((i * 29 % 41) as f32) * 0.7 - 9.0
                        }
                    })
                    .collect();
                let mut row = x.clone();
                let (m, s) = super::softmax_row(&mut row);
                let mx = x.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v as f64));
                let e: Vec<f64> = x.iter().map(|&v| (v as f64 - mx).exp()).collect();
                let sum: f64 = e.iter().sum();
                assert_eq!(m as f64, mx);
                assert!(
                    (s as f64 - sum).abs() < 1e-5 * sum,
                    "n={n}: sum {s} vs {sum}"
                );
                for i in 0..n {
                    assert!((row[i] as f64 - e[i] / sum).abs() < 1e-6, "n={n} i={i}");
                }
            }
            let mut masked = vec![f32::NEG_INFINITY; 20];
            assert_eq!(super::softmax_row(&mut masked), (f32::NEG_INFINITY, 0.0));
            assert!(masked.iter().all(|&v| v == 0.0));
            for at in [0, 7, 19] {
                let mut nan = vec![0.5f32; 20];
                nan[at] = f32::NAN;
                let (_, sum) = super::softmax_row(&mut nan);
                assert!(
                    sum.is_nan() && nan.iter().all(|v| v.is_nan()),
                    "NaN at {at}"
                );
                let mut all_nan = vec![f32::NEG_INFINITY; 20];
                all_nan[at] = f32::NAN;
                let (_, sum) = super::softmax_row(&mut all_nan);
                assert!(sum.is_nan() && all_nan.iter().all(|v| v.is_nan()));
            }
        }
    }
}
