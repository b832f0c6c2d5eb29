//! Random ops. The export gives each random node the graph's seed input (two int64 words, drawn
//! from torch's default generator at every call, so `torch.manual_seed` makes runs repeatable and
//! every step gets fresh numbers) and the node's own stream index; bits come from StableHLO's
//! counter-based `rng_bit_generator` (Threefry), with a key per seed and stream.

use crate::lower::emit::Emitter;
use crate::lower::Rule;
use crate::lower::{NodeCx, Scalar, R, T};
use tpuc_frontend_fx::DType;

pub static RULES: &[(&str, Rule)] = &[
    ("aten.native_dropout.default", native_dropout),
    ("aten.rand.default", rand),
    ("aten.rand_like.default", rand),
    ("aten.randn.default", randn),
    ("aten.randn_like.default", randn),
    ("aten.bernoulli.p", bernoulli_p),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;

/// `n` random 64-bit words per element of `shape` (`[n, *shape]`), keyed by the graph's seed and
/// this node's stream: the export appends both after the op's own arguments.
fn bits<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, n: i64, shape: &[i64]) -> R<T<'c, 'b>> {
    let e = cx.e;
    let k = cx.node.args.len();
    let seed = k
        .checked_sub(2)
        .and_then(|i| cx.tensor(i, "tpuc_seed").ok())
        .ok_or_else(|| {
            cx.err("random op without the seed input the export adds (graph not exported by tpuc)")
        })?;
    if seed.shape != [2] || seed.dtype != DType::Int64 {
        return Err(cx.err(format!(
            "seed input must be int64[2], got {}{:?}",
            seed.dtype, seed.shape
        )));
    }
    let stream = cx.int(k - 1, "tpuc_stream")?;
    // Threefry's state is (key, counter), and the counter advances by one per block of words:
    // streams told apart by the counter overlap (two dropouts drew the same mask shifted by one
    // element). Each stream gets its own key instead: the seed's first word plus the stream
    // times an odd constant (2^64 / golden ratio), so keys of nearby streams differ in many bits.
    let key_step = stream.wrapping_mul(0x9E37_79B9_7F4A_7C15_u64 as i64);
    let offset = e.constant_i64(&[key_step, 0], &[2], DType::Int64)?;
    let state = e.bitcast(&e.add(&seed, &offset)?, DType::Uint64)?;
    let mut full = vec![n];
    full.extend_from_slice(shape);
    let mut out = e.op_n(
        "stablehlo.rng_bit_generator",
        &[&state],
        &[(
            "rng_algorithm",
            "#stablehlo<rng_algorithm THREE_FRY>".to_string(),
        )],
        &[(vec![2], DType::Uint64), (full, DType::Uint64)],
        vec![],
    )?;
    Ok(out.remove(1))
}

/// Uniform floats in [0, 1) of `shape` and float `dtype`, each from one 64-bit word `w` of
/// `words` (`[n, *shape]`, word `i`): the top `digits` bits of the word over 2^digits, exact in
/// the dtype (24 bits for f32, 53 for f64, 11 for f16, 8 for bf16), so 1.0 is never drawn.
fn uniform_of<'c, 'b>(
    e: &Emitter<'c, 'b>,
    words: &T<'c, 'b>,
    i: i64,
    shape: &[i64],
    dtype: DType,
) -> R<T<'c, 'b>> {
    let (digits, compute) = match dtype {
        DType::Float64 => (53, DType::Float64),
        DType::Float16 => (11, DType::Float32),
        DType::Bfloat16 => (8, DType::Float32),
        _ => (24, DType::Float32),
    };
    let mut start = vec![i];
    let mut limit = vec![i + 1];
    start.extend(shape.iter().map(|_| 0));
    limit.extend_from_slice(shape);
    let word = e.slice(words, &start, &limit, &vec![1; shape.len() + 1])?;
    let word = e.reshape(&word, shape)?;
    let shift = e.splat(Scalar::Int(64 - digits), shape, DType::Uint64)?;
    let top = e.op(
        "stablehlo.shift_right_logical",
        &[&word, &shift],
        &[],
        shape,
        DType::Uint64,
    )?;
    let scale = e.splat(Scalar::Float(1.0 / (1u64 << digits) as f64), shape, compute)?;
    e.convert(&e.mul(&e.convert(&top, compute)?, &scale)?, dtype)
}

/// Uniform floats in [0, 1) of `shape` (f32), as dropout draws them.
fn uniform<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, shape: &[i64]) -> R<T<'c, 'b>> {
    let words = bits(cx, 1, shape)?;
    uniform_of(cx.e, &words, 0, shape, DType::Float32)
}

/// The result's shape and float dtype; random ops of other dtypes are not lowered.
fn float_out(cx: &NodeCx<'_, '_, '_>) -> R<(Vec<i64>, DType)> {
    let (shape, dtype) = cx.out(0)?;
    if !dtype.is_float() {
        return Err(cx.err(format!("random floats of dtype {dtype}")));
    }
    Ok((shape, dtype))
}

/// `rand(size)` / `rand_like(x)`: uniform in [0, 1), as `torch.rand`.
fn rand<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (shape, dtype) = float_out(cx)?;
    let words = bits(cx, 1, &shape)?;
    Ok(vec![uniform_of(cx.e, &words, 0, &shape, dtype)?])
}

/// `randn(size)` / `randn_like(x)`: standard normal by Box-Muller from two uniforms (computed in
/// f32, f64 for a float64 result): `sqrt(-2 ln(1 - u1)) cos(2 pi u2)`, with `1 - u1` in (0, 1].
fn randn<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let (shape, dtype) = float_out(cx)?;
    let compute = if dtype == DType::Float64 {
        DType::Float64
    } else {
        DType::Float32
    };
    let words = bits(cx, 2, &shape)?;
    let u1 = uniform_of(e, &words, 0, &shape, compute)?;
    let u2 = uniform_of(e, &words, 1, &shape, compute)?;
    let one_minus = e.sub(&e.k(1.0, compute)?, &u1)?;
    let radius = e.unary(
        "stablehlo.sqrt",
        &e.mul(&e.k(-2.0, compute)?, &e.unary("stablehlo.log", &one_minus)?)?,
    )?;
    let angle = e.mul(&e.k(2.0 * std::f64::consts::PI, compute)?, &u2)?;
    let z = e.mul(&radius, &e.unary("stablehlo.cosine", &angle)?)?;
    Ok(vec![e.convert(&z, dtype)?])
}

/// `bernoulli(self, p)` (functional `bernoulli_` on a fresh tensor: stochastic depth in timm and
/// torchvision): ones with probability p, else zeros, in `self`'s shape and dtype.
fn bernoulli_p<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let (shape, dtype) = cx.out(0)?;
    let p = cx.float_or(1, "p", 0.5)?;
    if !(0.0..=1.0).contains(&p) {
        return Err(cx.err(format!("bernoulli expects p to be in [0, 1], got {p}")));
    }
    if !matches!(
        cx.arg(2, "generator"),
        None | Some(tpuc_frontend_fx::Arg::None)
    ) {
        return Err(cx.err("bernoulli with an explicit generator"));
    }
    let words = bits(cx, 1, &shape)?;
    // f64 uniforms: p is a double, and 53 bits draw it exactly enough for any p.
    let u = uniform_of(e, &words, 0, &shape, DType::Float64)?;
    let hit = e.compare(&u, &e.k(p, DType::Float64)?, "LT")?;
    Ok(vec![e.convert(&hit, dtype)?])
}

/// `native_dropout(x, p, train)` -> (x * mask / (1 - p), mask), mask ~ Bernoulli(1 - p), as
/// PyTorch; with `train` false (or p = 0) the identity and an all-true mask.
fn native_dropout<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let x = cx.tensor(0, "input")?;
    let p = cx.float_or(1, "p", 0.5)?;
    let train = match cx.arg(2, "train") {
        None | Some(tpuc_frontend_fx::Arg::None) => true,
        _ => cx.bool_or(2, "train", true)?,
    };
    if !x.dtype.is_float() {
        return Err(cx.err(format!("dropout of a {} tensor", x.dtype)));
    }
    if !(0.0..=1.0).contains(&p) {
        return Err(cx.err(format!(
            "dropout probability has to be between 0 and 1, got {p}"
        )));
    }
    if !train || p == 0.0 {
        let ones = e.splat(Scalar::Bool(true), &x.shape, DType::Bool)?;
        return Ok(vec![x, ones]);
    }
    let u = uniform(cx, &x.shape)?;
    let keep_p = e.splat(Scalar::Float(1.0 - p), &x.shape, DType::Float32)?;
    let mask = e.compare(&u, &keep_p, "LT")?;
    let zero = e.splat(Scalar::Float(0.0), &x.shape, x.dtype)?;
    let scale = if p == 1.0 { 0.0 } else { 1.0 / (1.0 - p) };
    let scaled = e.mul(&x, &e.splat(Scalar::Float(scale), &x.shape, x.dtype)?)?;
    let out = e.select(&mask, &scaled, &zero, x.dtype)?;
    Ok(vec![out, mask])
}
