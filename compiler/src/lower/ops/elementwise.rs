//! Elementwise ops: arithmetic, comparisons, logic, activations, casts.

use crate::lower::emit::own_math;
use crate::lower::emit::Emitter;
use crate::lower::helpers::widen::{acc_dtype, unary_f64};
use crate::lower::Rule;
use crate::lower::{NodeCx, Scalar, R, T};
use tpuc_frontend_fx::{Arg, DType};

pub static RULES: &[(&str, Rule)] = &[
    ("aten.add.Tensor", add),
    ("aten.add.Scalar", add),
    ("aten.sub.Tensor", sub),
    ("aten.sub.Scalar", sub),
    ("aten.rsub.Scalar", rsub),
    ("aten.rsub.Tensor", rsub),
    ("aten.mul.Tensor", mul),
    ("aten.mul.Scalar", mul),
    ("aten.div.Tensor", div),
    ("aten.div.Scalar", div),
    ("aten.div.Tensor_mode", div),
    ("aten.div.Scalar_mode", div),
    ("aten.pow.Tensor_Scalar", pow),
    ("aten.pow.Tensor_Tensor", pow),
    ("aten.pow.Scalar", pow),
    ("aten.maximum.default", maximum),
    ("aten.minimum.default", minimum),
    ("aten.remainder.Tensor", remainder),
    ("aten.remainder.Scalar", remainder),
    ("aten.fmod.Tensor", fmod),
    ("aten.fmod.Scalar", fmod),
    ("aten.neg.default", neg),
    ("aten.abs.default", abs),
    ("aten.exp.default", exp),
    ("aten.expm1.default", expm1),
    ("aten.log.default", log),
    ("aten.log1p.default", log1p),
    ("aten.log2.default", log2),
    ("aten.sqrt.default", sqrt),
    ("aten.rsqrt.default", rsqrt),
    ("aten.reciprocal.default", reciprocal),
    ("aten.tanh.default", tanh),
    ("aten.sin.default", sin),
    ("aten.cos.default", cos),
    ("aten.sigmoid.default", sigmoid),
    ("aten.erf.default", erf),
    ("aten.sign.default", sign),
    ("aten.floor.default", floor),
    ("aten.ceil.default", ceil),
    ("aten.round.default", round),
    ("aten.trunc.default", trunc),
    ("aten.relu.default", relu),
    ("aten.gelu.default", gelu),
    ("aten.silu.default", silu),
    ("aten.clamp.default", clamp),
    ("aten.clamp.Tensor", clamp),
    ("aten.clamp_min.default", clamp_min),
    ("aten.hardtanh.default", hardtanh),
    ("aten.clamp_max.default", clamp_max),
    ("aten.eq.Tensor", eq),
    ("aten.eq.Scalar", eq),
    ("aten.ne.Tensor", ne),
    ("aten.ne.Scalar", ne),
    ("aten.lt.Tensor", lt),
    ("aten.lt.Scalar", lt),
    ("aten.le.Tensor", le),
    ("aten.le.Scalar", le),
    ("aten.gt.Tensor", gt),
    ("aten.gt.Scalar", gt),
    ("aten.ge.Tensor", ge),
    ("aten.ge.Scalar", ge),
    ("aten.logical_not.default", logical_not),
    ("aten.logical_and.default", logical_and),
    ("aten.logical_or.default", logical_or),
    ("aten.logical_xor.default", logical_xor),
    ("aten.bitwise_not.default", bitwise_not),
    ("aten.bitwise_and.Tensor", bitwise_and),
    ("aten.bitwise_or.Tensor", bitwise_or),
    ("aten.bitwise_xor.Tensor", bitwise_xor),
    ("aten.isnan.default", isnan),
    ("aten.isinf.default", isinf),
    ("aten.where.self", where_),
    ("aten._to_copy.default", to_copy),
    // A dtype conversion AOTAutograd leaves undecomposed (torchvision's remove_small_boxes).
    ("prims.convert_element_type.default", to_copy),
    ("aten.clone.default", identity),
    ("aten.alias.default", identity),
    ("aten.lift_fresh_copy.default", identity),
    ("aten.detach.default", identity),
    ("aten.detach_copy.default", identity),
    ("aten.alias_copy.default", identity),
    ("aten.contiguous.default", identity),
    ("aten.acos.default", acos),
    ("aten.asin.default", asin),
    ("aten.atan.default", atan),
    ("aten.atan2.default", atan2),
    ("aten.acosh.default", acosh),
    ("aten.asinh.default", asinh),
    ("aten.atanh.default", atanh),
    ("aten.cosh.default", cosh),
    ("aten.sinh.default", sinh),
    ("aten.tan.default", tan),
    ("aten.log10.default", log10),
    ("aten.exp2.default", exp2),
    ("aten.hypot.default", hypot),
    ("aten.ldexp.Tensor", ldexp),
    ("aten.signbit.default", signbit),
    ("aten.copysign.Tensor", copysign),
    ("aten.copysign.Scalar", copysign),
    ("aten.fmax.default", fmax),
    ("aten.fmin.default", fmin),
    ("aten.nextafter.default", nextafter),
    ("prims.fma.default", fma),
    ("aten.round.decimals", round_decimals),
    ("aten.angle.default", angle),
    ("aten.frexp.Tensor", frexp),
    ("aten.leaky_relu.default", leaky_relu),
    ("aten.elu.default", elu),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;

/// The dtype a Python scalar takes next to a tensor of `like`: it never widens the tensor's
/// category (int tensor + int scalar stays int), except a float scalar with an int tensor.
fn scalar_dtype(like: DType, s: Scalar) -> DType {
    match s {
        Scalar::Float(_) if !like.is_float() => DType::Float32,
        Scalar::Int(_) if like == DType::Bool => DType::Int64,
        _ => like,
    }
}

/// Operand `i`, a tensor or a Python scalar placed next to `like`.
fn operand<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, i: usize, name: &str, like: DType) -> R<T<'c, 'b>> {
    match cx.arg(i, name) {
        Some(Arg::Value(_)) => cx.tensor(i, name),
        _ => {
            let s = cx.scalar(i, name)?;
            cx.e.splat(s, &[], scalar_dtype(like, s))
        }
    }
}

/// Both operands of a binary op: (self, other) where either may be a Python scalar.
fn operands<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let a = match cx.arg(0, "self") {
        Some(Arg::Value(_)) => cx.tensor(0, "self")?,
        _ => {
            let b = cx.tensor(1, "other")?;
            let s = cx.scalar(0, "self")?;
            let a = cx.e.splat(s, &[], scalar_dtype(b.dtype, s))?;
            return Ok((a, b));
        }
    };
    let b = operand(cx, 1, "other", a.dtype)?;
    Ok((a, b))
}

fn binary_arith<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, name: &str) -> V<'c, 'b> {
    let (a, b) = operands(cx)?;
    let out = cx.out_dtype()?;
    Ok(vec![cx.e.binary(name, &a, &b, out)?])
}

fn scaled_by_alpha<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, b: T<'c, 'b>, out: DType) -> R<T<'c, 'b>> {
    match cx.arg(2, "alpha") {
        None | Some(Arg::None) => Ok(b),
        Some(_) => {
            let alpha = cx.scalar(2, "alpha")?;
            if alpha.as_f64() == 1.0 {
                return Ok(b);
            }
            let a = cx.e.splat(alpha, &[], out)?;
            cx.e.binary("stablehlo.multiply", &b, &a, out)
        }
    }
}

/// Whether operand `i` is a Python scalar +0 (or integer 0).
fn literal_plus_zero(cx: &NodeCx<'_, '_, '_>, i: usize, name: &str) -> bool {
    !matches!(cx.arg(i, name), Some(Arg::Value(_)) | None)
        && cx.scalar(i, name).is_ok_and(|s| match s {
            Scalar::Float(f) => f == 0.0 && f.is_sign_positive(),
            s => s.as_f64() == 0.0,
        })
}

fn add<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (a, b) = operands(cx)?;
    let out = cx.out_dtype()?;
    let b = scaled_by_alpha(cx, cx.e.convert(&b, out)?, out)?;
    let sum = cx.e.binary("stablehlo.add", &a, &b, out)?;
    if out.is_float() && (literal_plus_zero(cx, 0, "self") || literal_plus_zero(cx, 1, "other")) {
        // `x + 0` is +0 where x is -0, but XLA folds the add away and returns x: a sum that is
        // zero is made +0 (the only zero that adding +0 can give).
        let zero = cx.e.splat(Scalar::Int(0), &[], out)?;
        let is_zero = cx.e.compare(&sum, &zero, "EQ")?;
        return Ok(vec![cx.e.select(&is_zero, &zero, &sum, out)?]);
    }
    Ok(vec![sum])
}

fn sub<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (a, b) = operands(cx)?;
    let out = cx.out_dtype()?;
    let b = scaled_by_alpha(cx, cx.e.convert(&b, out)?, out)?;
    Ok(vec![cx.e.binary("stablehlo.subtract", &a, &b, out)?])
}

fn rsub<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (a, b) = operands(cx)?;
    let out = cx.out_dtype()?;
    let a = scaled_by_alpha(cx, cx.e.convert(&a, out)?, out)?;
    Ok(vec![cx.e.binary("stablehlo.subtract", &b, &a, out)?])
}

fn mul<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    if cx.out_dtype()? == DType::Bool {
        let (a, b) = operands(cx)?;
        return Ok(vec![cx.e.binary("stablehlo.and", &a, &b, DType::Bool)?]);
    }
    binary_arith(cx, "stablehlo.multiply")
}

fn div<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (a, b) = operands(cx)?;
    let out = cx.out_dtype()?;
    let mode = match cx.arg(2, "rounding_mode") {
        Some(Arg::Str(s)) => Some(s.as_str()),
        _ => None,
    };
    if mode.is_some() && !out.is_float() {
        return Ok(vec![int_div_rounded(
            cx,
            &a,
            &b,
            out,
            mode == Some("floor"),
        )?]);
    }
    // True division happens in floating point even for integer operands.
    let compute = if out.is_float() { out } else { DType::Float64 };
    let q = cx.e.binary("stablehlo.divide", &a, &b, compute)?;
    let q = match mode {
        None => q,
        Some("trunc") => {
            if !compute.is_float() {
                q
            } else {
                let s = cx.e.unary("stablehlo.sign", &q)?;
                let f =
                    cx.e.unary("stablehlo.floor", &cx.e.unary("stablehlo.abs", &q)?)?;
                cx.e.binary("stablehlo.multiply", &s, &f, compute)?
            }
        }
        Some("floor") => cx.e.unary("stablehlo.floor", &q)?,
        Some(m) => return Err(cx.err(format!("unknown rounding_mode {m:?}"))),
    };
    Ok(vec![cx.e.convert(&q, out)?])
}

/// Exact integer division: StableHLO's divide truncates; floor mode steps down by one when the
/// remainder is non-zero and the operands' signs differ.
fn int_div_rounded<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    a: &T<'c, 'b>,
    b: &T<'c, 'b>,
    out: DType,
    floor: bool,
) -> R<T<'c, 'b>> {
    let e = cx.e;
    let (a, b) = e.coerce(a, b, out)?;
    let shape = a.shape.clone();
    let q = e.op("stablehlo.divide", &[&a, &b], &[], &shape, out)?;
    if !floor {
        return Ok(q);
    }
    let r = e.op("stablehlo.remainder", &[&a, &b], &[], &shape, out)?;
    let zero = e.splat(Scalar::Int(0), &[], out)?;
    let inexact = e.compare(&r, &zero, "NE")?;
    let signs_differ = e.binary(
        "stablehlo.xor",
        &e.compare(&a, &zero, "LT")?,
        &e.compare(&b, &zero, "LT")?,
        DType::Bool,
    )?;
    let step = e.binary("stablehlo.and", &inexact, &signs_differ, DType::Bool)?;
    let one = e.splat(Scalar::Int(1), &[], out)?;
    let q1 = e.binary("stablehlo.subtract", &q, &one, out)?;
    e.select(&step, &q1, &q, out)
}

fn pow<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (a, b) = operands(cx)?;
    let out = cx.out_dtype()?;
    // Small integer exponents are multiplications, exact like PyTorch's fast paths.
    if let Some(Arg::Int(2)) | Some(Arg::Float(2.0)) = cx.arg(1, "exponent") {
        let a = cx.e.convert(&a, out)?;
        return Ok(vec![cx.e.binary("stablehlo.multiply", &a, &a, out)?]);
    }
    let c = acc_dtype(out);
    let r = cx.e.binary("stablehlo.power", &a, &b, c)?;
    Ok(vec![cx.e.convert(&r, out)?])
}

fn maximum<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    nan_propagating(cx, "stablehlo.maximum")
}

fn minimum<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    nan_propagating(cx, "stablehlo.minimum")
}

/// maximum/minimum with torch's NaN rule: a NaN in either operand wins (the CPU plugin's
/// max/min drops a NaN in the second operand).
fn nan_propagating<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, name: &str) -> V<'c, 'b> {
    let (a, b) = operands(cx)?;
    Ok(vec![nan_max_min(cx.e, name, &a, &b, cx.out_dtype()?)?])
}

/// `name` (stablehlo.maximum or stablehlo.minimum) of `a` and `b` in `out`, with broadcasting
/// and torch's NaN rule: a NaN in either operand wins. Integers need no select.
fn nan_max_min<'c, 'b>(
    e: &Emitter<'c, 'b>,
    name: &str,
    a: &T<'c, 'b>,
    b: &T<'c, 'b>,
    out: DType,
) -> R<T<'c, 'b>> {
    if !out.is_float() {
        return e.binary(name, a, b, out);
    }
    let (a, b) = e.coerce(a, b, out)?;
    let r = e.op(name, &[&a, &b], &[], &a.shape.clone(), out)?;
    let r = e.select(&e.isnan(&b)?, &b, &r, out)?;
    e.select(&e.isnan(&a)?, &a, &r, out)
}

/// Python-style remainder: the result takes the sign of the divisor.
fn remainder<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (a, b) = operands(cx)?;
    let out = cx.out_dtype()?;
    let (a, b) = cx.e.coerce(&a, &b, out)?;
    let r =
        cx.e.op("stablehlo.remainder", &[&a, &b], &[], &a.shape.clone(), out)?;
    let zero = cx.e.splat(Scalar::Int(0), &[], out)?;
    let r_nonzero = cx.e.compare(&r, &zero, "NE")?;
    let r_neg = cx.e.compare(&r, &zero, "LT")?;
    let b_neg = cx.e.compare(&b, &zero, "LT")?;
    let signs_differ = cx.e.binary("stablehlo.xor", &r_neg, &b_neg, DType::Bool)?;
    let fix =
        cx.e.binary("stablehlo.and", &r_nonzero, &signs_differ, DType::Bool)?;
    let shifted = cx.e.binary("stablehlo.add", &r, &b, out)?;
    Ok(vec![cx.e.select(&fix, &shifted, &r, out)?])
}

fn fmod<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    binary_arith(cx, "stablehlo.remainder")
}

/// A unary float function computed in f32 for low-precision inputs.
fn unary_float<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, name: &str) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let x = cx.e.convert(&x, acc_dtype(out))?;
    let r = cx.e.unary(name, &x)?;
    Ok(vec![cx.e.convert(&r, out)?])
}

fn unary_same<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, name: &str) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    Ok(vec![cx
        .e
        .unary(name, &cx.e.convert(&x, cx.out_dtype()?)?)?])
}

fn neg<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_same(cx, "stablehlo.negate")
}
fn abs<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    if matches!(cx.out_dtype()?, DType::Bool | DType::Uint8) {
        return identity(cx); // unsigned: StableHLO's abs takes signed types only
    }
    unary_same(cx, "stablehlo.abs")
}
fn sign<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    if matches!(x.dtype, DType::Bool | DType::Uint8) {
        // Unsigned: sign is 1 for non-zero, 0 for zero (StableHLO's sign takes signed types only).
        let nz = cx.e.convert(&x, DType::Bool)?;
        return Ok(vec![cx.e.convert(&nz, x.dtype)?]);
    }
    let out = cx.out_dtype()?;
    let r = cx.e.unary("stablehlo.sign", &cx.e.convert(&x, out)?)?;
    if !out.is_float() {
        return Ok(vec![r]);
    }
    // torch.sign(NaN) and torch.sign(-0.0) are +0; StableHLO's sign keeps the NaN and the -0.
    let zero = cx.e.splat(Scalar::Int(0), &[], out)?;
    let to_zero = cx.e.or(&cx.e.isnan(&r)?, &cx.e.compare(&r, &zero, "EQ")?)?;
    Ok(vec![cx.e.select(&to_zero, &zero, &r, out)?])
}
fn floor<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    if !cx.out_dtype()?.is_float() {
        return identity(cx);
    }
    unary_same(cx, "stablehlo.floor")
}
fn ceil<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    if !cx.out_dtype()?.is_float() {
        return identity(cx);
    }
    unary_same(cx, "stablehlo.ceil")
}
fn round<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    if !cx.out_dtype()?.is_float() {
        return identity(cx);
    }
    // torch.round rounds half to even.
    unary_same(cx, "stablehlo.round_nearest_even")
}
fn trunc<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    if !x.dtype.is_float() {
        return Ok(vec![x]);
    }
    let s = cx.e.unary("stablehlo.sign", &x)?;
    let f =
        cx.e.unary("stablehlo.floor", &cx.e.unary("stablehlo.abs", &x)?)?;
    Ok(vec![cx.e.binary("stablehlo.multiply", &s, &f, x.dtype)?])
}
fn exp<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_float(cx, "stablehlo.exponential")
}
fn expm1<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_float(cx, "stablehlo.exponential_minus_one")
}
fn log<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_float(cx, "stablehlo.log")
}
fn log1p<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_float(cx, "stablehlo.log_plus_one")
}
fn log2<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let c = acc_dtype(out);
    let l = cx.e.unary("stablehlo.log", &cx.e.convert(&x, c)?)?;
    let ln2 = cx.e.splat(Scalar::Float(std::f64::consts::LN_2), &[], c)?;
    let r = cx.e.binary("stablehlo.divide", &l, &ln2, c)?;
    Ok(vec![cx.e.convert(&r, out)?])
}
fn sqrt<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_float(cx, "stablehlo.sqrt")
}
fn rsqrt<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_float(cx, "stablehlo.rsqrt")
}
fn tanh<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_float(cx, "stablehlo.tanh")
}
fn sin<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_float(cx, "stablehlo.sine")
}
fn cos<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_float(cx, "stablehlo.cosine")
}
fn sigmoid<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_float(cx, "stablehlo.logistic")
}

fn reciprocal<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let one = cx.e.splat(Scalar::Int(1), &[], out)?;
    Ok(vec![cx.e.binary("stablehlo.divide", &one, &x, out)?])
}

/// erf in plain StableHLO (no CHLO, so every consumer accepts the module): the rational
/// approximation XLA and Eigen use for f32, `x P(x^2) / Q(x^2)` on x clamped to [-4, 4]
/// (max abs error 4.2e-7 against torch.erf, measured over [-6, 6]).
pub fn erf_of<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
    const P: [f64; 7] = [
        -2.72614225801306e-10,
        2.77068142495902e-08,
        -2.10102402082508e-06,
        -5.69250639462346e-05,
        -7.34990630326855e-04,
        -2.95459980854025e-03,
        -1.60960333262415e-02,
    ];
    const Q: [f64; 5] = [
        -1.45660718464996e-05,
        -2.13374055278905e-04,
        -1.68282697438203e-03,
        -7.37332916720468e-03,
        -1.42647390514189e-02,
    ];
    if x.dtype != DType::Float32 {
        return Err(cx.err(format!(
            "erf is implemented for float32 (and f16/bf16 through it), not {}",
            x.dtype
        )));
    }
    let e = cx.e;
    let k = |v: f64| e.splat(Scalar::Float(v), &[], DType::Float32);
    let xc = e.binary("stablehlo.maximum", x, &k(-4.0)?, DType::Float32)?;
    let xc = e.binary("stablehlo.minimum", &xc, &k(4.0)?, DType::Float32)?;
    let x2 = e.binary("stablehlo.multiply", &xc, &xc, DType::Float32)?;
    let horner = |coeffs: &[f64]| -> R<T<'c, 'b>> {
        let mut acc = k(coeffs[0])?;
        for &c in &coeffs[1..] {
            acc = e.binary("stablehlo.multiply", &acc, &x2, DType::Float32)?;
            acc = e.binary("stablehlo.add", &acc, &k(c)?, DType::Float32)?;
        }
        Ok(acc)
    };
    let p = e.binary("stablehlo.multiply", &xc, &horner(&P)?, DType::Float32)?;
    e.binary("stablehlo.divide", &p, &horner(&Q)?, DType::Float32)
}

fn erf<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let r = erf_of(cx, &cx.e.convert(&x, acc_dtype(out))?)?;
    Ok(vec![cx.e.convert(&r, out)?])
}

fn relu<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let zero = cx.e.splat(Scalar::Int(0), &[], x.dtype)?;
    Ok(vec![cx.e.binary(
        "stablehlo.maximum",
        &x,
        &zero,
        x.dtype,
    )?])
}

/// GELU, exact (`0.5 x (1 + erf(x / sqrt 2))`) or tanh-approximated, computed in f32 for
/// low-precision inputs.
fn gelu<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x0 = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let c = acc_dtype(out);
    let e = cx.e;
    let x = e.convert(&x0, c)?;
    let k = |v: f64| e.splat(Scalar::Float(v), &[], c);
    let approximate = match cx.arg(1, "approximate") {
        Some(Arg::Str(s)) => s.clone(),
        _ => "none".into(),
    };
    let inner = match approximate.as_str() {
        "none" => {
            let scaled = e.binary(
                "stablehlo.multiply",
                &x,
                &k(std::f64::consts::FRAC_1_SQRT_2)?,
                c,
            )?;
            erf_of(cx, &scaled)?
        }
        "tanh" => {
            let x3 = e.binary(
                "stablehlo.multiply",
                &e.binary("stablehlo.multiply", &x, &x, c)?,
                &x,
                c,
            )?;
            let poly = e.binary(
                "stablehlo.add",
                &x,
                &e.binary("stablehlo.multiply", &x3, &k(0.044715)?, c)?,
                c,
            )?;
            let arg = e.binary(
                "stablehlo.multiply",
                &poly,
                &k((2.0 / std::f64::consts::PI).sqrt())?,
                c,
            )?;
            e.unary("stablehlo.tanh", &arg)?
        }
        other => return Err(cx.err(format!("unknown approximate={other:?}"))),
    };
    let one_plus = e.binary("stablehlo.add", &inner, &k(1.0)?, c)?;
    let half_x = e.binary("stablehlo.multiply", &x, &k(0.5)?, c)?;
    let r = e.binary("stablehlo.multiply", &half_x, &one_plus, c)?;
    Ok(vec![e.convert(&r, out)?])
}

fn silu<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x0 = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let c = acc_dtype(out);
    let x = cx.e.convert(&x0, c)?;
    let s = cx.e.unary("stablehlo.logistic", &x)?;
    let r = cx.e.binary("stablehlo.multiply", &x, &s, c)?;
    Ok(vec![cx.e.convert(&r, out)?])
}

fn bound<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    i: usize,
    name: &str,
    like: DType,
) -> R<Option<T<'c, 'b>>> {
    match cx.arg(i, name) {
        None | Some(Arg::None) => Ok(None),
        Some(_) => operand(cx, i, name, like).map(Some),
    }
}

/// `clamp(self, min, max)` = min(max(self, min), max), NaN if self or a bound is NaN (as in
/// torch; the plugin's max/min would drop a NaN bound, the second operand).
fn clamp<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let mut r = cx.e.convert(&x, out)?;
    if let Some(lo) = bound(cx, 1, "min", x.dtype)? {
        r = nan_max_min(cx.e, "stablehlo.maximum", &r, &lo, out)?;
    }
    if let Some(hi) = bound(cx, 2, "max", x.dtype)? {
        r = nan_max_min(cx.e, "stablehlo.minimum", &r, &hi, out)?;
    }
    Ok(vec![r])
}

/// `hardtanh(self, min_val=-1, max_val=1)`: a clamp with default bounds.
fn hardtanh<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let lo = cx.float_or(1, "min_val", -1.0)?;
    let hi = cx.float_or(2, "max_val", 1.0)?;
    let bound = |v: f64| {
        let s = if out.is_float() {
            Scalar::Float(v)
        } else {
            Scalar::Int(v as i64)
        };
        cx.e.splat(s, &[], out)
    };
    let r = cx.e.binary("stablehlo.maximum", &x, &bound(lo)?, out)?;
    Ok(vec![cx.e.binary(
        "stablehlo.minimum",
        &r,
        &bound(hi)?,
        out,
    )?])
}

fn clamp_min<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    clamp_one(cx, "min", "stablehlo.maximum")
}

fn clamp_max<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    clamp_one(cx, "max", "stablehlo.minimum")
}

/// `clamp_min(self, min)` / `clamp_max(self, max)`: NaN-propagating like [`clamp`].
fn clamp_one<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, name: &str, op: &str) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let b = operand(cx, 1, name, x.dtype)?;
    Ok(vec![nan_max_min(cx.e, op, &x, &b, cx.out_dtype()?)?])
}

fn compare<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, dir: &str) -> V<'c, 'b> {
    let (a, b) = operands(cx)?;
    Ok(vec![cx.e.compare(&a, &b, dir)?])
}
fn eq<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    compare(cx, "EQ")
}
fn ne<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    compare(cx, "NE")
}
fn lt<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    compare(cx, "LT")
}
fn le<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    compare(cx, "LE")
}
fn gt<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    compare(cx, "GT")
}
fn ge<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    compare(cx, "GE")
}

fn logical<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, name: &str) -> V<'c, 'b> {
    let (a, b) = operands(cx)?;
    let a = cx.e.convert(&a, DType::Bool)?;
    let b = cx.e.convert(&b, DType::Bool)?;
    let r = cx.e.binary(name, &a, &b, DType::Bool)?;
    Ok(vec![cx.e.convert(&r, cx.out_dtype()?)?])
}
fn logical_and<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    logical(cx, "stablehlo.and")
}
fn logical_or<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    logical(cx, "stablehlo.or")
}
fn logical_xor<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    logical(cx, "stablehlo.xor")
}
fn logical_not<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.e.convert(&cx.tensor(0, "self")?, DType::Bool)?;
    let r = cx.e.unary("stablehlo.not", &x)?;
    Ok(vec![cx.e.convert(&r, cx.out_dtype()?)?])
}
fn bitwise_not<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_same(cx, "stablehlo.not")
}
fn bitwise_and<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    binary_arith(cx, "stablehlo.and")
}
fn bitwise_or<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    binary_arith(cx, "stablehlo.or")
}
fn bitwise_xor<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    binary_arith(cx, "stablehlo.xor")
}

fn isnan<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    Ok(vec![cx.e.compare(&x, &x, "NE")?])
}

fn isinf<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    if !x.dtype.is_float() {
        return Ok(vec![cx.e.splat(
            Scalar::Bool(false),
            &x.shape,
            DType::Bool,
        )?]);
    }
    let a = cx.e.unary("stablehlo.abs", &x)?;
    let inf = cx.e.splat(Scalar::Float(f64::INFINITY), &[], x.dtype)?;
    Ok(vec![cx.e.compare(&a, &inf, "EQ")?])
}

fn where_<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let cond = cx.tensor(0, "condition")?;
    let out = cx.out_dtype()?;
    let a = operand(cx, 1, "self", out)?;
    let b = operand(cx, 2, "other", out)?;
    Ok(vec![cx.e.select(&cond, &a, &b, out)?])
}

fn to_copy<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    Ok(vec![cx.e.convert(&x, out)?])
}

fn identity<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    Ok(vec![cx.e.convert(&x, cx.out_dtype()?)?])
}

// ---------------------------------------------------------------------------------------------
// Functions StableHLO lacks, as formulas evaluated in f64 and rounded once to the result dtype,
// so that float32 results are (nearly always) correctly rounded whatever the formula's
// cancellation. The formulas avoid the usual cancellations too, so float64 inputs stay close.
// ---------------------------------------------------------------------------------------------

const F64: DType = DType::Float64;

/// `f(self, other)` (either may be a Python scalar) evaluated in f64, rounded to the result dtype.
fn binary_f64<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    f: impl FnOnce(&Emitter<'c, 'b>, &T<'c, 'b>, &T<'c, 'b>) -> R<T<'c, 'b>>,
) -> V<'c, 'b> {
    let (a, b) = operands(cx)?;
    let out = cx.out_dtype()?;
    let (a, b) = cx.e.coerce(&a, &b, F64)?;
    let r = f(cx.e, &a, &b)?;
    Ok(vec![cx.e.convert(&r, out)?])
}

/// sqrt((1 - x)(1 + x)): 1 - x^2 without cancellation near |x| = 1 (NaN for |x| > 1).
fn sqrt_one_minus_sq<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let one = e.k(1.0, x.dtype)?;
    let p = e.mul(
        &e.binary("stablehlo.subtract", &one, x, x.dtype)?,
        &e.add(&one, x)?,
    )?;
    e.unary("stablehlo.sqrt", &p)
}

fn atan2_of<'c, 'b>(e: &Emitter<'c, 'b>, y: &T<'c, 'b>, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
    e.binary("stablehlo.atan2", y, x, y.dtype)
}

fn acos<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_f64(cx, |e, x| atan2_of(e, &sqrt_one_minus_sq(e, x)?, x))
}

fn asin<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_f64(cx, |e, x| atan2_of(e, x, &sqrt_one_minus_sq(e, x)?))
}

/// tpuc's own atan2 (see `own_math`), never the plugin's: on lammps-jax-pjrt-cpu 0.11.2, LLVM
/// turns `atan2(x, 1)` into a vector `atan` that returns garbage from 64 elements on.
fn atan<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_f64(cx, |e, x| own_math::atan2(e, x, &e.k(1.0, F64)?))
}

/// tpuc's own atan2, like `atan`: `atan2(y, ones)` is `atan(y)` to LLVM.
fn atan2<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    binary_f64(cx, |e, y, x| own_math::atan2(e, y, x))
}

/// asinh(|x|) = log1p(|x| + x^2 / (1 + sqrt(1 + x^2))) (exact near 0), log(|x|) + ln 2 where x^2
/// would overflow; odd.
fn asinh<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_f64(cx, |e, x| {
        let a = e.unary("stablehlo.abs", x)?;
        let one = e.k(1.0, F64)?;
        let a2 = e.mul(&a, &a)?;
        let q = e.div(
            &a2,
            &e.add(&one, &e.unary("stablehlo.sqrt", &e.add(&one, &a2)?)?)?,
        )?;
        let small = e.unary("stablehlo.log_plus_one", &e.add(&a, &q)?)?;
        let big = e.add(
            &e.unary("stablehlo.log", &a)?,
            &e.k(std::f64::consts::LN_2, F64)?,
        )?;
        let r = e.select(&e.compare(&a, &e.k(1e150, F64)?, "GT")?, &big, &small, F64)?;
        let neg = e.unary("stablehlo.negate", &r)?;
        e.select(&e.compare(x, &e.k(0.0, F64)?, "LT")?, &neg, &r, F64)
    })
}

/// acosh(x) = log1p(t + sqrt(t (x + 1))) with t = x - 1 (exact near 1), log(x) + ln 2 for huge x,
/// NaN below 1 (where the product of two negatives would give a number).
fn acosh<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_f64(cx, |e, x| {
        let one = e.k(1.0, F64)?;
        let t = e.sub(x, &one)?;
        let s = e.unary("stablehlo.sqrt", &e.mul(&t, &e.add(x, &one)?)?)?;
        let small = e.unary("stablehlo.log_plus_one", &e.add(&t, &s)?)?;
        let big = e.add(
            &e.unary("stablehlo.log", x)?,
            &e.k(std::f64::consts::LN_2, F64)?,
        )?;
        let r = e.select(&e.compare(x, &e.k(1e150, F64)?, "GT")?, &big, &small, F64)?;
        e.select(&e.compare(x, &one, "LT")?, &e.k(f64::NAN, F64)?, &r, F64)
    })
}

/// atanh(x) = log1p(2x / (1 - x)) / 2.
fn atanh<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_f64(cx, |e, x| {
        let one = e.k(1.0, F64)?;
        let q = e.div(
            &e.add(x, x)?,
            &e.binary("stablehlo.subtract", &one, x, F64)?,
        )?;
        e.mul(&e.unary("stablehlo.log_plus_one", &q)?, &e.k(0.5, F64)?)
    })
}

fn cosh<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_f64(cx, |e, x| {
        let p = e.unary("stablehlo.exponential", x)?;
        let m = e.unary("stablehlo.exponential", &e.unary("stablehlo.negate", x)?)?;
        e.mul(&e.add(&p, &m)?, &e.k(0.5, F64)?)
    })
}

/// sinh(x) = (expm1(x) - expm1(-x)) / 2, exact near 0.
fn sinh<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_f64(cx, |e, x| {
        let p = e.unary("stablehlo.exponential_minus_one", x)?;
        let m = e.unary(
            "stablehlo.exponential_minus_one",
            &e.unary("stablehlo.negate", x)?,
        )?;
        e.mul(&e.sub(&p, &m)?, &e.k(0.5, F64)?)
    })
}

fn tan<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_f64(cx, |e, x| {
        e.div(
            &e.unary("stablehlo.sine", x)?,
            &e.unary("stablehlo.cosine", x)?,
        )
    })
}

fn log10<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_f64(cx, |e, x| {
        e.div(
            &e.unary("stablehlo.log", x)?,
            &e.k(std::f64::consts::LN_10, F64)?,
        )
    })
}

fn exp2<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_f64(cx, |e, x| {
        e.binary("stablehlo.power", &e.k(2.0, F64)?, x, F64)
    })
}

/// sqrt(a^2 + b^2), and +inf when either is infinite (even with a NaN), as C's hypot.
/// hypot(a, b) = m sqrt((a/m)^2 + (b/m)^2) with m = max(|a|, |b|), so that squares of large or
/// tiny values neither overflow nor underflow; inf wins over NaN.
fn hypot<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    binary_f64(cx, |e, a, b| {
        let (a, b) = (e.unary("stablehlo.abs", a)?, e.unary("stablehlo.abs", b)?);
        let m = e.binary("stablehlo.maximum", &a, &b, F64)?;
        let zero = e.k(0.0, F64)?;
        let safe = e.select(&e.compare(&m, &zero, "EQ")?, &e.k(1.0, F64)?, &m, F64)?;
        let (p, q) = (e.div(&a, &safe)?, e.div(&b, &safe)?);
        let s = e.mul(
            &m,
            &e.unary("stablehlo.sqrt", &e.add(&e.mul(&p, &p)?, &e.mul(&q, &q)?)?)?,
        )?;
        let inf = e.k(f64::INFINITY, F64)?;
        let is_inf = |t: &T<'c, 'b>| e.compare(t, &inf, "EQ");
        e.select(&e.or(&is_inf(&a)?, &is_inf(&b)?)?, &inf, &s, F64)
    })
}

/// `ldexp(self, other)` = self * 2^other.
fn ldexp<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    binary_f64(cx, |e, x, n| {
        e.mul(x, &e.binary("stablehlo.power", &e.k(2.0, F64)?, n, F64)?)
    })
}

/// The signed integer type as wide as float `d`.
fn bits_dtype(d: DType) -> DType {
    match d {
        DType::Float64 => DType::Int64,
        DType::Float32 => DType::Int32,
        _ => DType::Int16,
    }
}

/// True where the sign bit is set (also for -0.0 and negative NaNs).
fn signbit_of<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
    match x.dtype {
        DType::Bool | DType::Uint8 => e.splat(Scalar::Bool(false), &x.shape, DType::Bool),
        d if d.is_float() => {
            let bits = e.bitcast(x, bits_dtype(d))?;
            e.compare(&bits, &e.splat(Scalar::Int(0), &[], bits.dtype)?, "LT")
        }
        d => e.compare(x, &e.splat(Scalar::Int(0), &[], d)?, "LT"),
    }
}

fn signbit<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    Ok(vec![signbit_of(cx.e, &cx.tensor(0, "self")?)?])
}

/// |self| with the sign bit of `other`.
fn copysign<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (a, b) = operands(cx)?;
    let out = cx.out_dtype()?;
    let e = cx.e;
    let a = e.unary("stablehlo.abs", &e.convert(&a, out)?)?;
    let neg = signbit_of(e, &e.convert(&b, out)?)?;
    Ok(vec![e.select(
        &neg,
        &e.unary("stablehlo.negate", &a)?,
        &a,
        out,
    )?])
}

/// fmax / fmin: like maximum / minimum, but a NaN loses to a number.
fn nan_ignoring<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, name: &str) -> V<'c, 'b> {
    let (a, b) = operands(cx)?;
    let out = cx.out_dtype()?;
    let e = cx.e;
    let (a, b) = e.coerce(&a, &b, out)?;
    let m = e.binary(name, &a, &b, out)?;
    if !out.is_float() {
        return Ok(vec![m]);
    }
    let m = e.select(&e.isnan(&b)?, &a, &m, out)?;
    Ok(vec![e.select(&e.isnan(&a)?, &b, &m, out)?])
}

fn fmax<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    nan_ignoring(cx, "stablehlo.maximum")
}

fn fmin<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    nan_ignoring(cx, "stablehlo.minimum")
}

/// The next float after `self` towards `other`, by stepping the bit pattern: away from zero is
/// +1 on the magnitude bits, towards zero -1; from zero, the smallest subnormal with the sign of
/// `other`.
fn nextafter<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (x, y) = operands(cx)?;
    let out = cx.out_dtype()?;
    if !out.is_float() {
        return Err(cx.err(format!("nextafter of {out} is not defined")));
    }
    let e = cx.e;
    let (x, y) = e.coerce(&x, &y, out)?;
    let bd = bits_dtype(out);
    let int = |v: i64| e.splat(Scalar::Int(v), &[], bd);
    let xb = e.bitcast(&x, bd)?;
    let yb = e.bitcast(&y, bd)?;
    let zero = e.splat(Scalar::Int(0), &[], out)?;
    let away = e.compare(
        &e.compare(&y, &x, "GT")?,
        &e.compare(&x, &zero, "GT")?,
        "EQ",
    )?;
    let stepped = e.select(&away, &e.add(&xb, &int(1)?)?, &e.sub(&xb, &int(1)?)?, bd)?;
    let sign_mask = int(match bd {
        DType::Int64 => i64::MIN,
        DType::Int32 => i32::MIN as i64,
        _ => i16::MIN as i64,
    })?;
    let tiny = e.binary(
        "stablehlo.or",
        &e.binary("stablehlo.and", &yb, &sign_mask, bd)?,
        &int(1)?,
        bd,
    )?;
    let from_zero = e.compare(&x, &zero, "EQ")?;
    let r = e.bitcast(&e.select(&from_zero, &tiny, &stepped, bd)?, out)?;
    let r = e.select(&e.compare(&x, &y, "EQ")?, &y, &r, out)?;
    let either_nan = e.or(&e.isnan(&x)?, &e.isnan(&y)?)?;
    let nan = e.splat(Scalar::Float(f64::NAN), &[], out)?;
    Ok(vec![e.select(&either_nan, &nan, &r, out)?])
}

/// `prims.fma(a, b, c)`: `a * b + c` rounded once, as Inductor computes it and as eager's
/// `add_(other, alpha=tensor)` does (Dynamo rewrites that, and `addcmul_` / `addcdiv_` with a
/// `value`, to this prim: AdamW's update). StableHLO has no fused multiply-add and XLA contracts
/// a multiply and an add only where its code generation chooses to, so the product is taken
/// exactly in a wider type (f32 and bf16 in f64, f16 in f32), the sum there is rounded to odd
/// (the last bit set when inexact) and the result rounded to the dtype: with two more bits than
/// twice the dtype's precision, round-to-odd makes that second rounding the correct one (Boldo
/// and Melquiond, "When double rounding is odd", 2005). float64 has no wider type: op_support.py
/// leaves its fma to PyTorch. On a TPU the product and the sum are taken in the dtype (within an
/// ulp of the once-rounded result, as JAX's optimizers compute it): XLA:TPU has no f64 and
/// emulates it, which made a GPT-2 AdamW step's update carry the f64 form over every parameter
/// (bench/tpu_twins, `compare.py --step`).
fn fma<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let out = cx.out_dtype()?;
    let shape = cx.out_shape()?;
    let operand = |i: usize, name: &str| -> R<T<'c, 'b>> {
        let t = cx.tensor_or_scalar(i, name, out)?;
        e.broadcast_to(&e.convert(&t, out)?, &shape)
    };
    let (a, b, c) = (operand(0, "a")?, operand(1, "b")?, operand(2, "c")?);
    if e.device == crate::lower::Device::Tpu && out.is_float() {
        return Ok(vec![e.add(&e.mul(&a, &b)?, &c)?]);
    }
    let wide = match out {
        DType::Float32 | DType::Bfloat16 => DType::Float64,
        DType::Float16 => DType::Float32,
        d if d.is_float() || d.is_complex() => {
            return Err(cx.err(format!(
                "fma of {d}: no wider type to round it exactly once"
            )))
        }
        // Integers: exact (wrapping) arithmetic, as in PyTorch.
        _ => return Ok(vec![e.add(&e.mul(&a, &b)?, &c)?]),
    };
    let (a, b, c) = (
        e.convert(&a, wide)?,
        e.convert(&b, wide)?,
        e.convert(&c, wide)?,
    );
    let product = e.mul(&a, &b)?; // exact: twice the precision fits, and the range too
    let mut sum = odd_sum(e, &product, &c)?;
    if out == DType::Bfloat16 {
        sum = odd_narrow(e, &sum, DType::Float32)?; // XLA may narrow f64 to bf16 through f32
    }
    Ok(vec![e.convert(&sum, out)?])
}

/// Whether `x` is finite (false for NaN).
fn finite<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let inf = e.k(f64::INFINITY, x.dtype)?;
    e.compare(&e.unary("stablehlo.abs", x)?, &inf, "LT")
}

/// `x` (a rounded result) rounded to odd where `inexact`: an even last bit is stepped one unit
/// towards the exact value, whose difference from `x` has the sign of `err`.
fn set_odd<'c, 'b>(
    e: &Emitter<'c, 'b>,
    x: &T<'c, 'b>,
    err: &T<'c, 'b>,
    inexact: &T<'c, 'b>,
) -> R<T<'c, 'b>> {
    let bd = bits_dtype(x.dtype);
    let int = |v: i64| e.splat(Scalar::Int(v), &[], bd);
    let bits = e.bitcast(x, bd)?;
    let even = e.compare(
        &e.binary("stablehlo.and", &bits, &int(1)?, bd)?,
        &int(0)?,
        "EQ",
    )?;
    // +1 on the bit pattern moves away from zero, -1 towards it.
    let x_negative = e.compare(&bits, &int(0)?, "LT")?;
    let err_negative = e.compare(err, &e.k(0.0, err.dtype)?, "LT")?;
    let away = e.compare(&x_negative, &err_negative, "EQ")?;
    let step = e.select(&away, &int(1)?, &int(-1)?, bd)?;
    let stepped = e.add(&bits, &step)?;
    let odd = e.select(&e.and(inexact, &even)?, &stepped, &bits, bd)?;
    e.bitcast(&odd, x.dtype)
}

/// `p + c` rounded to odd: the rounded sum, and its rounding error exactly (Knuth's TwoSum: no
/// products, so no contraction into fused multiply-adds can change it).
fn odd_sum<'c, 'b>(e: &Emitter<'c, 'b>, p: &T<'c, 'b>, c: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let s = e.add(p, c)?;
    let bb = e.sub(&s, p)?;
    let err = e.add(&e.sub(p, &e.sub(&s, &bb)?)?, &e.sub(c, &bb)?)?;
    let nonzero = e.compare(&err, &e.k(0.0, err.dtype)?, "NE")?;
    set_odd(e, &s, &err, &e.and(&nonzero, &finite(e, &s)?)?)
}

/// `x` rounded to odd in the narrower float type `to`. The round trip is read through a barrier:
/// XLA may drop a narrowing convert followed by a widening one (excess precision).
fn odd_narrow<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>, to: DType) -> R<T<'c, 'b>> {
    let t = e.convert(x, to)?;
    let back = e.convert(&e.barrier(&t)?, x.dtype)?;
    let err = e.sub(x, &back)?;
    let nonzero = e.compare(&err, &e.k(0.0, err.dtype)?, "NE")?;
    set_odd(e, &t, &err, &e.and(&nonzero, &finite(e, &t)?)?)
}

/// `round(self, decimals)` as PyTorch's kernel computes it, in the tensor's dtype:
/// `rint(x * 10^d) / 10^d`, or `rint(x / 10^-d) * 10^-d` for negative `d`.
fn round_decimals<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    if !out.is_float() {
        return identity(cx);
    }
    let d = cx.int_or(1, "decimals", 0)?;
    let e = cx.e;
    let x = e.convert(&x, out)?;
    let p = e.k(10f64.powi(d.unsigned_abs().min(400) as i32), out)?;
    let rint = |t: &T<'c, 'b>| e.unary("stablehlo.round_nearest_even", t);
    let r = if d >= 0 {
        e.div(&rint(&e.mul(&x, &p)?)?, &p)?
    } else {
        e.mul(&rint(&e.div(&x, &p)?)?, &p)?
    };
    Ok(vec![r])
}

/// The argument of a real number: pi for negatives, 0 otherwise, NaN for NaN.
fn angle<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let e = cx.e;
    let xf = e.convert(&x, out)?;
    let neg = e.compare(&xf, &e.k(0.0, out)?, "LT")?;
    let r = e.select(&neg, &e.k(std::f64::consts::PI, out)?, &e.k(0.0, out)?, out)?;
    if !out.is_float() {
        return Ok(vec![r]);
    }
    Ok(vec![e.select(&e.isnan(&xf)?, &xf, &r, out)?])
}

/// `frexp(self) -> (mantissa, exponent)` with |mantissa| in [0.5, 1) and self = m * 2^e, read off
/// the bits of the value in f64 (where every f32/f16/bf16 value, subnormals too, is normal);
/// zero, infinities and NaN give (self, 0).
fn frexp<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let (_, mt) = cx.out(0)?;
    let (_, et) = cx.out(1)?;
    let e = cx.e;
    let xf = e.convert(&x, F64)?;
    let int = |v: i64| e.splat(Scalar::Int(v), &[], DType::Int64);
    let bits = e.bitcast(&xf, DType::Int64)?;
    let field = e.binary(
        "stablehlo.and",
        &e.binary(
            "stablehlo.shift_right_logical",
            &bits,
            &int(52)?,
            DType::Int64,
        )?,
        &int(0x7ff)?,
        DType::Int64,
    )?;
    let exponent = e.sub(&field, &int(1022)?)?;
    let mant_bits = e.binary(
        "stablehlo.or",
        &e.binary(
            "stablehlo.and",
            &bits,
            &int(!(0x7ff_i64 << 52))?,
            DType::Int64,
        )?,
        &int(1022 << 52)?,
        DType::Int64,
    )?;
    let mant = e.bitcast(&mant_bits, F64)?;
    let zero = e.k(0.0, F64)?;
    let inf = e.k(f64::INFINITY, F64)?;
    let special = e.or(
        &e.compare(&xf, &zero, "EQ")?,
        &e.or(
            &e.isnan(&xf)?,
            &e.compare(&e.unary("stablehlo.abs", &xf)?, &inf, "EQ")?,
        )?,
    )?;
    let mant = e.select(&special, &xf, &mant, F64)?;
    let exponent = e.select(&special, &int(0)?, &exponent, DType::Int64)?;
    Ok(vec![e.convert(&mant, mt)?, e.convert(&exponent, et)?])
}

/// `leaky_relu(x, negative_slope=0.01)`: x where x > 0, else x * slope.
fn leaky_relu<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let slope = cx.float_or(1, "negative_slope", 0.01)?;
    let e = cx.e;
    let x = e.convert(&x, out)?;
    let pos = e.compare(&x, &e.k(0.0, out)?, "GT")?;
    let scaled = e.mul(&x, &e.k(slope, out)?)?;
    Ok(vec![e.select(&pos, &x, &scaled, out)?])
}

/// `elu(x, alpha=1, scale=1, input_scale=1)`: scale * x where x > 0, else
/// scale * alpha * expm1(x * input_scale) (SELU is ELU with fixed constants).
fn elu<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let alpha = cx.float_or(1, "alpha", 1.0)?;
    let scale = cx.float_or(2, "scale", 1.0)?;
    let input_scale = cx.float_or(3, "input_scale", 1.0)?;
    let c = acc_dtype(out);
    let e = cx.e;
    let x = e.convert(&x, c)?;
    let neg = e.unary(
        "stablehlo.exponential_minus_one",
        &e.mul(&x, &e.k(input_scale, c)?)?,
    )?;
    let neg = e.mul(&neg, &e.k(alpha * scale, c)?)?;
    let pos = e.mul(&x, &e.k(scale, c)?)?;
    let r = e.select(&e.compare(&x, &e.k(0.0, c)?, "GT")?, &pos, &neg, c)?;
    Ok(vec![e.convert(&r, out)?])
}
