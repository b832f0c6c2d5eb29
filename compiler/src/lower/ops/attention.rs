//! Fused attention kernels that AOTAutograd keeps (their decomposition is not used: PyTorch's
//! CPU flash-attention decomposition returns the attention weights where the op's second result
//! is the logsumexp).

use crate::lower::ops::reduce::acc_dtype;
use crate::lower::registry::Rule;
use crate::lower::{NodeCx, ReduceKind, Scalar, R, T};
use tpuc_frontend_fx::{Arg, DType};

pub static RULES: &[(&str, Rule)] = &[(
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    flash_attention_cpu,
)];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;

/// `softmax(q k^T * scale + mask) v` and the logsumexp of each row of scores, in the
/// accumulation dtype (f32 for f16/bf16). Causal masking keeps key `j <= i` (top-left aligned).
fn flash_attention_cpu<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let q = cx.tensor(0, "query")?;
    let k = cx.tensor(1, "key")?;
    let v = cx.tensor(2, "value")?;
    if cx.float_or(3, "dropout_p", 0.0)? != 0.0 {
        return Err(cx.err("dropout_p > 0 is random: not supported in a compiled graph"));
    }
    let causal = cx.bool_or(4, "is_causal", false)?;
    let mask = cx.opt_tensor(5, "attn_mask")?;
    let r = q.rank();
    if r != 4 || k.rank() != 4 || v.rank() != 4 {
        return Err(cx.err("query, key and value must be 4-d (batch, heads, length, dim)"));
    }
    let (b, h, l, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let s = k.shape[2];
    let dv = v.shape[3];
    if k.shape[..2] != [b, h] || v.shape[..2] != [b, h] {
        return Err(cx.err("query, key and value must have the same batch and head counts"));
    }
    let scale = match cx.arg(6, "scale") {
        None | Some(Arg::None) => 1.0 / (d as f64).sqrt(),
        _ => cx.float_or(6, "scale", 1.0)?,
    };
    let (out_shape, out_dtype) = cx.out(0)?;
    let (lse_shape, lse_dtype) = cx.out(1)?;
    let acc = acc_dtype(out_dtype);
    let qa = e.convert(&q, acc)?;
    let ka = e.convert(&k, acc)?;
    let va = e.convert(&v, acc)?;
    let scores = e.dot_general(
        &qa,
        &ka,
        (&[0, 1], &[0, 1]),
        (&[3], &[3]),
        &[b, h, l, s],
        acc,
    )?;
    let scores = e.mul(&scores, &e.splat(Scalar::Float(scale), &[], acc)?)?;
    let ninf = e.splat(Scalar::Float(f64::NEG_INFINITY), &[], acc)?;
    let mut scores = scores;
    if causal {
        let i = e.iota(&[b, h, l, s], 2, DType::Int64)?;
        let j = e.iota(&[b, h, l, s], 3, DType::Int64)?;
        let keep = e.compare(&j, &i, "LE")?;
        scores = e.select(&keep, &scores, &ninf, acc)?;
    }
    if let Some(m) = mask {
        if m.dtype == DType::Bool {
            scores = e.select(&m, &scores, &ninf, acc)?;
        } else {
            let m = e.broadcast_to(&e.convert(&m, acc)?, &scores.shape)?;
            scores = e.add(&scores, &m)?;
        }
    }
    let mx = e.reduce(&scores, &[3], ReduceKind::Max, true)?;
    // A row with every key masked has max -inf: PyTorch's kernel returns zeros and a
    // logsumexp of 0 for it.
    let finite = e.compare(&mx, &ninf, "NE")?;
    let zero = e.splat(Scalar::Int(0), &[], acc)?;
    let shift = e.select(&finite, &mx, &zero, acc)?;
    let p = e.unary("stablehlo.exponential", &e.sub(&scores, &shift)?)?;
    let sum = e.reduce(&p, &[3], ReduceKind::Sum, true)?;
    let lse = e.add(&e.unary("stablehlo.log", &sum)?, &shift)?;
    let pv = e.dot_general(
        &p,
        &va,
        (&[0, 1], &[0, 1]),
        (&[3], &[2]),
        &[b, h, l, dv],
        acc,
    )?;
    let out = e.div(&pv, &sum)?;
    let out = e.select(&finite, &out, &zero, acc)?;
    let lse = e.select(&finite, &lse, &zero, acc)?;
    let out = e.convert(&e.broadcast_to(&out, &out_shape)?, out_dtype)?;
    let lse = e.reshape(&lse, &[b, h, l])?;
    let lse = e.convert(&e.reshape(&lse, &lse_shape)?, lse_dtype)?;
    Ok(vec![out, lse])
}
