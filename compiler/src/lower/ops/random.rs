//! Random ops. The export gives each random node the graph's seed input (two int64 words, drawn
//! from torch's default generator at every call, so `torch.manual_seed` makes runs repeatable and
//! every step gets fresh numbers) and the node's own stream index; bits come from StableHLO's
//! counter-based `rng_bit_generator` (Threefry), keyed by seed and stream.

use crate::lower::Rule;
use crate::lower::{NodeCx, Scalar, R, T};
use tpuc_frontend_fx::DType;

pub static RULES: &[(&str, Rule)] = &[("aten.native_dropout.default", native_dropout)];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;

/// Uniform floats in [0, 1) of `shape`: the top 24 bits of Threefry's 64-bit words, exact in f32.
fn uniform<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, shape: &[i64]) -> R<T<'c, 'b>> {
    let e = cx.e;
    let seed = cx.tensor(3, "tpuc_seed").map_err(|_| {
        cx.err("random op without the seed input the export adds (graph not exported by tpuc)")
    })?;
    if seed.shape != [2] || seed.dtype != DType::Int64 {
        return Err(cx.err(format!(
            "seed input must be int64[2], got {}{:?}",
            seed.dtype, seed.shape
        )));
    }
    let stream = cx.int(4, "tpuc_stream")?;
    let offset = e.constant_i64(&[0, stream], &[2], DType::Int64)?;
    let state = e.bitcast(&e.add(&seed, &offset)?, DType::Uint64)?;
    let mut out = e.op_n(
        "stablehlo.rng_bit_generator",
        &[&state],
        &[(
            "rng_algorithm",
            "#stablehlo<rng_algorithm THREE_FRY>".to_string(),
        )],
        &[(vec![2], DType::Uint64), (shape.to_vec(), DType::Uint64)],
        vec![],
    )?;
    let bits = out.remove(1);
    let forty = e.splat(Scalar::Int(40), shape, DType::Uint64)?;
    let top = e.op(
        "stablehlo.shift_right_logical",
        &[&bits, &forty],
        &[],
        shape,
        DType::Uint64,
    )?;
    let scale = e.splat(
        Scalar::Float(1.0 / (1u64 << 24) as f64),
        shape,
        DType::Float32,
    )?;
    e.mul(&e.convert(&top, DType::Float32)?, &scale)
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
