//! tpuc's own expansions of StableHLO's math primitives (atan2, exp, log, ...) into arithmetic,
//! comparisons and bit operations only, evaluated in f64 and rounded once to the operand's dtype.
//!
//! Why: a plugin's code for a primitive can be wrong on one CPU while its HLO is right
//! (lammps-jax-pjrt-cpu 0.11.2 returns garbage for `atan2(x, 1)` from 64 elements on: LLVM turns
//! `atan2(y, 1.0)` into `atan(y)`, whose vector code in that build is broken). `atan` and `atan2`
//! always use these; the other primitives do inside an ATen op that the known-answer check
//! (`tpuc.conformance`) found wrong on the plugin (see [`LowerOptions::own_math`]).
//!
//! [`LowerOptions::own_math`]: crate::lower::LowerOptions

use super::{Emitter, Scalar};
use crate::lower::{R, T};
use std::f64::consts::{FRAC_PI_2, FRAC_PI_4, PI};
use tpuc_frontend_fx::DType;

const F64: DType = DType::Float64;
const I64: DType = DType::Int64;

/// The primitives with an expansion here.
pub const EXPANDED: &[&str] = &[
    "stablehlo.atan2",
    "stablehlo.exponential",
    "stablehlo.exponential_minus_one",
    "stablehlo.log",
    "stablehlo.log_plus_one",
    "stablehlo.logistic",
    "stablehlo.rsqrt",
    "stablehlo.tanh",
];

/// Whether `op` (a StableHLO op name) on operands of `dtype` has an expansion here (real floats
/// only: complex primitives stay the plugin's).
pub fn expands(op: &str, dtype: DType) -> bool {
    dtype.is_float() && EXPANDED.contains(&op)
}

/// `op(operands)` by tpuc's expansion, in the operands' dtype (computed in f64).
pub fn expand<'c, 'b>(e: &Emitter<'c, 'b>, op: &str, operands: &[&T<'c, 'b>]) -> R<T<'c, 'b>> {
    let dtype = operands[0].dtype;
    let wide: Vec<T<'c, 'b>> = operands
        .iter()
        .map(|t| e.convert(t, F64))
        .collect::<R<_>>()?;
    let x = &wide[0];
    let r = match op {
        "stablehlo.atan2" => atan2(e, x, &wide[1])?,
        "stablehlo.exponential" => exp(e, x)?,
        "stablehlo.exponential_minus_one" => expm1(e, x)?,
        "stablehlo.log" => log(e, x)?,
        "stablehlo.log_plus_one" => log1p(e, x)?,
        "stablehlo.logistic" => {
            let one = e.k(1.0, F64)?;
            let m = exp(e, &e.unary("stablehlo.negate", x)?)?;
            e.div(&one, &e.add(&one, &m)?)?
        }
        "stablehlo.rsqrt" => e.div(&e.k(1.0, F64)?, &e.unary("stablehlo.sqrt", x)?)?,
        "stablehlo.tanh" => tanh(e, x)?,
        other => {
            return Err(crate::lower::LowerError::internal(format!(
                "tpuc has no own expansion of {other}"
            )))
        }
    };
    e.convert(&r, dtype)
}

fn int<'c, 'b>(e: &Emitter<'c, 'b>, v: i64) -> R<T<'c, 'b>> {
    e.splat(Scalar::Int(v), &[], I64)
}

fn sign_bit<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
    e.compare(&e.bitcast(x, I64)?, &int(e, 0)?, "LT")
}

/// `a` where `neg`, else... : `select(neg, -a, a)`.
fn negate_where<'c, 'b>(e: &Emitter<'c, 'b>, neg: &T<'c, 'b>, a: &T<'c, 'b>) -> R<T<'c, 'b>> {
    e.select(neg, &e.unary("stablehlo.negate", a)?, a, F64)
}

/// Horner's rule: `c[0] x^n + ... + c[n]`.
fn poly<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>, c: &[f64]) -> R<T<'c, 'b>> {
    let mut p = e.broadcast_to(&e.k(c[0], F64)?, &x.shape)?;
    for &k in &c[1..] {
        p = e.add(&e.mul(&p, x)?, &e.k(k, F64)?)?;
    }
    Ok(p)
}

// Cephes' atan (double precision, relative error 1.8e-16 on [0, 0.66]): atan(u) = u + u z P(z)/Q(z)
// with z = u^2.
const ATAN_P: [f64; 5] = [
    -8.750_608_600_031_904e-1,
    -1.615_753_718_733_365e1,
    -7.500_855_792_314_705e1,
    -1.228_866_684_490_136e2,
    -6.485_021_904_942_025e1,
];
const ATAN_Q: [f64; 6] = [
    1.0,
    2.485_846_490_142_306_3e1,
    1.650_270_098_316_988_5e2,
    4.328_810_604_912_903e2,
    4.853_903_996_359_137e2,
    1.945_506_571_482_614e2,
];
/// pi/4 - its f64 value (the bits a sum with pi/4 loses).
const PIO4_LO: f64 = 3.061_616_997_868_383e-17;

/// atan(t) for t in [0, 1] (NaN passes through): t > 0.66 is reduced by atan(t) = pi/4 +
/// atan((t - 1) / (t + 1)).
fn atan_unit<'c, 'b>(e: &Emitter<'c, 'b>, t: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let one = e.k(1.0, F64)?;
    let big = e.compare(t, &e.k(0.66, F64)?, "GT")?;
    let reduced = e.div(&e.sub(t, &one)?, &e.add(t, &one)?)?;
    let u = e.select(&big, &reduced, t, F64)?;
    let z = e.mul(&u, &u)?;
    let ratio = e.div(&e.mul(&z, &poly(e, &z, &ATAN_P)?)?, &poly(e, &z, &ATAN_Q)?)?;
    let v = e.add(&e.mul(&u, &ratio)?, &u)?;
    let shifted = e.add(&e.add(&v, &e.k(PIO4_LO, F64)?)?, &e.k(FRAC_PI_4, F64)?)?;
    e.select(&big, &shifted, &v, F64)
}

/// atan2(y, x) with C99's signs and special values: the angle of the smaller over the larger
/// magnitude by [`atan_unit`], moved to its octant.
pub fn atan2<'c, 'b>(e: &Emitter<'c, 'b>, y: &T<'c, 'b>, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let (y, x) = e.coerce(y, x, F64)?;
    let ax = e.unary("stablehlo.abs", &x)?;
    let ay = e.unary("stablehlo.abs", &y)?;
    let swap = e.compare(&ay, &ax, "GT")?;
    let num = e.select(&swap, &ax, &ay, F64)?;
    let den = e.select(&swap, &ay, &ax, F64)?;
    let zero = e.k(0.0, F64)?;
    // Equal magnitudes (both infinite too) are 1; both zero are 0.
    let t = e.select(
        &e.compare(&num, &den, "EQ")?,
        &e.k(1.0, F64)?,
        &e.div(&num, &den)?,
        F64,
    )?;
    let t = e.select(&e.compare(&den, &zero, "EQ")?, &zero, &t, F64)?;
    let a = atan_unit(e, &t)?;
    let from =
        |hi: f64, lo: f64| -> R<T<'c, 'b>> { e.add(&e.sub(&e.k(hi, F64)?, &a)?, &e.k(lo, F64)?) };
    let a = e.select(&swap, &from(FRAC_PI_2, 2.0 * PIO4_LO)?, &a, F64)?;
    let back = e.add(&e.sub(&e.k(PI, F64)?, &a)?, &e.k(4.0 * PIO4_LO, F64)?)?;
    let a = e.select(&sign_bit(e, &x)?, &back, &a, F64)?;
    let r = negate_where(e, &sign_bit(e, &y)?, &a)?;
    let nan = e.or(&e.isnan(&x)?, &e.isnan(&y)?)?;
    e.select(&nan, &e.add(&x, &y)?, &r, F64)
}

// fdlibm's ln 2 split: LN2_HI has 32 trailing zero bits, so n * LN2_HI is exact for |n| < 2^20.
const LN2_HI: f64 = 6.931_471_803_691_238e-1;
const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;

/// 2^n for integral f64 `n` in [-1022, 1023], built from its bits.
fn pow2<'c, 'b>(e: &Emitter<'c, 'b>, n: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let biased = e.add(&e.convert(n, I64)?, &int(e, 1023)?)?;
    let bits = e.binary("stablehlo.shift_left", &biased, &int(e, 52)?, I64)?;
    e.bitcast(&bits, F64)
}

/// exp(x) = 2^n exp(r), r = x - n ln 2 in [-ln2/2, ln2/2] (Cody and Waite), exp(r) by its
/// Taylor series to r^13 (truncation below 1e-17); 2^n applied in two halves so that results
/// near overflow and in the subnormals round once.
pub fn exp<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
    // Beyond these, exp is inf or 0 in f64; the clamp keeps n's halves in range.
    let xc = e.op(
        "stablehlo.clamp",
        &[&e.k(-746.0, F64)?, x, &e.k(710.0, F64)?],
        &[],
        &x.shape,
        F64,
    )?;
    let n = e.unary(
        "stablehlo.round_nearest_even",
        &e.mul(&xc, &e.k(std::f64::consts::LOG2_E, F64)?)?,
    )?;
    let r = e.sub(
        &e.sub(&xc, &e.mul(&n, &e.k(LN2_HI, F64)?)?)?,
        &e.mul(&n, &e.k(LN2_LO, F64)?)?,
    )?;
    let mut coeffs = [0.0f64; 14];
    let mut fact = 1.0f64;
    for k in 0..14 {
        if k > 0 {
            fact *= k as f64;
        }
        coeffs[13 - k] = 1.0 / fact;
    }
    let p = poly(e, &r, &coeffs)?;
    let n1 = e.unary("stablehlo.floor", &e.mul(&n, &e.k(0.5, F64)?)?)?;
    let n2 = e.sub(&n, &n1)?;
    let v = e.mul(&e.mul(&p, &pow2(e, &n1)?)?, &pow2(e, &n2)?)?;
    e.select(&e.isnan(x)?, x, &v, F64)
}

// fdlibm's log: log(1 + f) = f - hfsq + s (hfsq + R(s^2)), s = f / (2 + f), on [sqrt(2)/2, sqrt(2)].
const LG: [f64; 7] = [
    1.479_819_860_511_658_6e-1,
    1.531_383_769_920_937_3e-1,
    1.818_357_216_161_805e-1,
    2.222_219_843_214_978_4e-1,
    2.857_142_874_366_239e-1,
    3.999_999_999_940_942e-1,
    6.666_666_666_666_735e-1,
];

/// log(x): x = 2^k m with m in [sqrt(2)/2, sqrt(2)) read off the bits (subnormals scaled by
/// 2^54 first), then fdlibm's polynomial; 0 -> -inf, negative -> NaN, inf -> inf.
pub fn log<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let tiny = e.compare(x, &e.k(f64::MIN_POSITIVE, F64)?, "LT")?;
    let xs = e.select(
        &tiny,
        &e.mul(x, &e.k(18_014_398_509_481_984.0, F64)?)?,
        x,
        F64,
    )?;
    let bits = e.bitcast(&xs, I64)?;
    let exponent = e.binary("stablehlo.shift_right_logical", &bits, &int(e, 52)?, I64)?;
    let mantissa_bits = e.binary(
        "stablehlo.or",
        &e.binary("stablehlo.and", &bits, &int(e, 0x000F_FFFF_FFFF_FFFF)?, I64)?,
        &int(e, 0x3FF0_0000_0000_0000)?,
        I64,
    )?;
    let m = e.bitcast(&mantissa_bits, F64)?;
    let k = e.sub(&e.convert(&exponent, F64)?, &e.k(1023.0, F64)?)?;
    let k = e.sub(
        &k,
        &e.select(&tiny, &e.k(54.0, F64)?, &e.k(0.0, F64)?, F64)?,
    )?;
    let high = e.compare(&m, &e.k(std::f64::consts::SQRT_2, F64)?, "GE")?;
    let m = e.select(&high, &e.mul(&m, &e.k(0.5, F64)?)?, &m, F64)?;
    let k = e.select(&high, &e.add(&k, &e.k(1.0, F64)?)?, &k, F64)?;
    let f = e.sub(&m, &e.k(1.0, F64)?)?;
    let v = log_core(e, &f, &k)?;
    let zero = e.k(0.0, F64)?;
    let inf = e.k(f64::INFINITY, F64)?;
    let v = e.select(&e.compare(x, &inf, "EQ")?, &inf, &v, F64)?;
    let v = e.select(
        &e.compare(x, &zero, "EQ")?,
        &e.k(f64::NEG_INFINITY, F64)?,
        &v,
        F64,
    )?;
    let bad = e.or(&e.compare(x, &zero, "LT")?, &e.isnan(x)?)?;
    e.select(&bad, &e.k(f64::NAN, F64)?, &v, F64)
}

/// k ln 2 + log(1 + f) for f in [sqrt(2)/2 - 1, sqrt(2) - 1] (fdlibm):
/// k ln2_hi - ((hfsq - (s (hfsq + R) + k ln2_lo)) - f).
fn log_core<'c, 'b>(e: &Emitter<'c, 'b>, f: &T<'c, 'b>, k: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let s = e.div(f, &e.add(f, &e.k(2.0, F64)?)?)?;
    let z = e.mul(&s, &s)?;
    let r = e.mul(&z, &poly(e, &z, &LG)?)?;
    let hfsq = e.mul(&e.mul(f, f)?, &e.k(0.5, F64)?)?;
    let inner = e.add(
        &e.mul(&s, &e.add(&hfsq, &r)?)?,
        &e.mul(k, &e.k(LN2_LO, F64)?)?,
    )?;
    e.sub(
        &e.mul(k, &e.k(LN2_HI, F64)?)?,
        &e.sub(&e.sub(&hfsq, &inner)?, f)?,
    )
}

/// log1p(x): fdlibm's core on x itself where 1 + x is in [sqrt(2)/2, sqrt(2)] (no rounding of
/// 1 + x; Kahan's `log(u) x / (u - 1)` is undone by XLA folding `(1 + x) - 1` to x), log(1 + x)
/// elsewhere (where that rounding is small against the result).
pub fn log1p<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let near = e.and(
        &e.compare(x, &e.k(std::f64::consts::FRAC_1_SQRT_2 - 1.0, F64)?, "GE")?,
        &e.compare(x, &e.k(std::f64::consts::SQRT_2 - 1.0, F64)?, "LT")?,
    )?;
    let core = log_core(e, x, &e.k(0.0, F64)?)?;
    let far = log(e, &e.add(&e.k(1.0, F64)?, x)?)?;
    let v = e.select(&near, &core, &far, F64)?;
    e.select(&e.compare(x, &e.k(0.0, F64)?, "EQ")?, x, &v, F64) // -0 stays -0
}

/// expm1(x) = (u - 1) x / log(u) with u = exp(x) (Kahan), x where u is 1, -1 where u - 1 is.
pub fn expm1<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let one = e.k(1.0, F64)?;
    let u = exp(e, x)?;
    let um1 = e.sub(&u, &one)?;
    let v = e.div(&e.mul(&um1, x)?, &log(e, &u)?)?;
    let v = e.select(&e.compare(&um1, &e.k(-1.0, F64)?, "EQ")?, &um1, &v, F64)?;
    let v = e.select(&e.compare(&u, &one, "EQ")?, x, &v, F64)?;
    let inf = e.k(f64::INFINITY, F64)?;
    e.select(&e.compare(&u, &inf, "EQ")?, &inf, &v, F64)
}

/// tanh(x) = -t / (2 + t) with t = expm1(-2|x|), with x's sign (exact near 0, 1 for large |x|).
fn tanh<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let a = e.unary("stablehlo.abs", x)?;
    let t = expm1(e, &e.mul(&a, &e.k(-2.0, F64)?)?)?;
    let v = e.div(
        &e.unary("stablehlo.negate", &t)?,
        &e.add(&t, &e.k(2.0, F64)?)?,
    )?;
    let v = negate_where(e, &sign_bit(e, x)?, &v)?;
    e.select(&e.isnan(x)?, x, &v, F64)
}
