//! Fused attention kernels that AOTAutograd keeps (their decomposition is not used: PyTorch's
//! CPU flash-attention decomposition returns the attention weights where the op's second result
//! is the logsumexp).

use crate::lower::emit::Emitter;
use crate::lower::helpers::matmul::host_matmul;
use crate::lower::helpers::widen::acc_dtype;
use crate::lower::Rule;
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
    let hk = k.shape[1];
    if k.shape[0] != b || v.shape[..2] != [b, hk] || hk == 0 || h % hk != 0 {
        return Err(cx.err(format!(
            "query, key and value must have the same batch, and key/value heads must divide \
             the query's {h} heads (got key {:?}, value {:?})",
            k.shape, v.shape
        )));
    }
    let scale = match cx.arg(6, "scale") {
        None | Some(Arg::None) => 1.0 / (d as f64).sqrt(),
        _ => cx.float_or(6, "scale", 1.0)?,
    };
    let (out_shape, out_dtype) = cx.out(0)?;
    let (lse_shape, lse_dtype) = cx.out(1)?;
    if let Some(r) = host_attention(cx, [&q, &k, &v], mask.as_ref(), causal, scale)? {
        return Ok(r);
    }
    let acc = acc_dtype(out_dtype);
    let qa = e.convert(&q, acc)?;
    // Grouped-query attention: query head i reads key/value head i / (h / hk).
    let ka = repeat_heads(e, &e.convert(&k, acc)?, h)?;
    let va = repeat_heads(e, &e.convert(&v, acc)?, h)?;
    // The mask as 4-d (broadcasting aligns on the right), so that query blocks can slice it.
    let mask = match mask {
        Some(m) if m.rank() > 4 => return Err(cx.err("attn_mask has more than 4 dims")),
        Some(m) => {
            let mut shape = vec![1; 4 - m.rank()];
            shape.extend_from_slice(&m.shape);
            Some(e.reshape(&m, &shape)?)
        }
        None => None,
    };
    let block = query_block(b * h, l, s);
    // Query blocks one after another: a block's scores fit the cache, where all b*h*l*s of
    // them would be written, read twice by the softmax and once more by the second dot.
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for row0 in (0..l).step_by(block as usize) {
        let qb = e.slice(&qa, &[0, 0, row0, 0], &[b, h, row0 + block, d], &[1; 4])?;
        let mb = match &mask {
            Some(m) if m.shape[2] == l => {
                let mut end = m.shape.clone();
                end[2] = row0 + block;
                Some(e.slice(m, &[0, 0, row0, 0], &end, &[1; 4])?)
            }
            other => other.clone(),
        };
        let (ob, lb) = attend(e, &qb, &ka, &va, mb.as_ref(), causal, row0, scale)?;
        outs.push(ob);
        lses.push(lb);
    }
    let out = e.concatenate(&outs.iter().collect::<Vec<_>>(), 2)?;
    let lse = e.concatenate(&lses.iter().collect::<Vec<_>>(), 2)?;
    let out = e.convert(&e.broadcast_to(&out, &out_shape)?, out_dtype)?;
    let lse = e.reshape(&lse, &[b, h, l])?;
    let lse = e.convert(&e.reshape(&lse, &lse_shape)?, lse_dtype)?;
    Ok(vec![out, lse])
}

/// Attentions of at least this many scores go to the host kernel where the session enables it.
const HOST_MIN_SCORES: i64 = 1 << 12;

/// The op's two results through the host kernel (`tpuc_attention`, see
/// `tpuc_hostkernels::host_attention`), where the session enables it and everything is f32: q, k
/// and v as they lie, the output written `[b, l, h, dv]` (the layout the heads are merged from)
/// and returned as its transpose. None where XLA should compute it.
fn host_attention<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    [q, k, v]: [&T<'c, 'b>; 3],
    mask: Option<&T<'c, 'b>>,
    causal: bool,
    scale: f64,
) -> R<Option<Vec<T<'c, 'b>>>> {
    let e = cx.e;
    let f32 = DType::Float32;
    let (b, h, l, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let (hk, s, dv) = (k.shape[1], k.shape[2], v.shape[3]);
    let (out_shape, out_dtype) = cx.out(0)?;
    let (lse_shape, lse_dtype) = cx.out(1)?;
    if !e.host_attention
        || [q, k, v].iter().any(|t| t.dtype != f32)
        || out_dtype != f32
        || lse_dtype != f32
        || mask.is_some_and(|m| m.rank() > 4 || !matches!(m.dtype, DType::Float32 | DType::Bool))
        || b * h * l * s < HOST_MIN_SCORES
    {
        return Ok(None);
    }
    // Each operand read where it lies: in the buffer it was reshaped, transposed or sliced
    // from (the projection's output, without the copies that split the heads out of it), where
    // its rows are contiguous there; else as it is.
    let mut geometry = vec![b, h, hk, l, s, d, dv, i64::from(causal)];
    let mut operands = Vec::with_capacity(6);
    for t in [q, k, v] {
        let view = e.strided_view(t);
        let (base, offset, strides) = if view.strides[3] == 1 || t.shape[3] <= 1 {
            (view.base, view.offset, view.strides)
        } else {
            (t.clone(), 0, crate::lower::strided::row_major(&t.shape))
        };
        operands.push(base);
        geometry.extend([offset, strides[0], strides[1], strides[2]]);
    }
    let mask = match mask {
        Some(m) => {
            // 4-d, keys along the last dim, additive: a bool mask keeps where true.
            let mut shape = vec![1; 4 - m.rank()];
            shape.extend_from_slice(&m.shape);
            let mut m = e.reshape(m, &shape)?;
            if m.shape[3] != s {
                shape[3] = s;
                m = e.broadcast_to(&m, &shape)?;
            }
            if m.dtype == DType::Bool {
                let zero = e.splat(Scalar::Float(0.0), &shape, f32)?;
                let ninf = e.splat(Scalar::Float(f64::NEG_INFINITY), &shape, f32)?;
                m = e.select(&m, &zero, &ninf, f32)?;
            }
            let [mb, mh, ml, _] = [shape[0], shape[1], shape[2], shape[3]];
            let stride = |n: i64, step: i64| if n == 1 { 0 } else { step };
            geometry.extend([stride(mb, mh * ml * s), stride(mh, ml * s), stride(ml, s)]);
            Some(m)
        }
        None => {
            geometry.extend([0, 0, 0]);
            None
        }
    };
    // The output as [b, l, h, dv].
    geometry.extend([l * h * dv, dv, h * dv]);
    debug_assert_eq!(
        geometry.len(),
        tpuc_hostkernels::host_attention::GEOMETRY_LEN
    );
    operands.push(e.constant_i64(&geometry, &[geometry.len() as i64], DType::Int64)?);
    operands.push(e.splat(Scalar::Float(scale), &[1], f32)?);
    operands.extend(mask);
    let r = e.ffi_call(
        tpuc_hostkernels::host_attention::ATTENTION,
        &operands.iter().collect::<Vec<_>>(),
        &[(vec![b, l, h, dv], f32), (vec![b, h, l], f32)],
    )?;
    let out = e.transpose(&r[0], &[0, 2, 1, 3])?;
    Ok(Some(vec![
        e.broadcast_to(&out, &out_shape)?,
        e.reshape(&r[1], &lse_shape)?,
    ]))
}

/// `t` (b, hk, s, d) with each head repeated to `h` heads, consecutive copies side by side.
fn repeat_heads<'c, 'b>(e: &Emitter<'c, 'b>, t: &T<'c, 'b>, h: i64) -> R<T<'c, 'b>> {
    let (b, hk, s, d) = (t.shape[0], t.shape[1], t.shape[2], t.shape[3]);
    if hk == h {
        return Ok(t.clone());
    }
    let wide = e.broadcast_in_dim(t, &[b, hk, h / hk, s, d], &[0, 1, 3, 4])?;
    e.reshape(&wide, &[b, h, s, d])
}

/// Scores per query block (16 MiB of f32): the fastest block size measured
/// (bench/results/lowering-choices.md).
const BLOCK_SCORES: i64 = 1 << 22;

/// Query rows per block: all `l` when the whole score matrix fits [`BLOCK_SCORES`], else the
/// largest divisor of `l` whose block does (at least 8 rows; no such divisor: all `l`).
fn query_block(heads: i64, l: i64, s: i64) -> i64 {
    if heads * l * s <= BLOCK_SCORES {
        return l;
    }
    let most = (BLOCK_SCORES / (heads * s).max(1)).max(8);
    (8..=most.min(l / 2))
        .rev()
        .find(|c| l % c == 0)
        .unwrap_or(l)
}

/// Attention of the query rows `q` (b, h, c, d) over all keys: the output (b, h, c, dv) and
/// the logsumexp of each row (b, h, c, 1). `row0` is the index of q's first row among all
/// queries, for the causal mask.
#[allow(clippy::too_many_arguments)]
fn attend<'c, 'b>(
    e: &Emitter<'c, 'b>,
    q: &T<'c, 'b>,
    k: &T<'c, 'b>,
    v: &T<'c, 'b>,
    mask: Option<&T<'c, 'b>>,
    causal: bool,
    row0: i64,
    scale: f64,
) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let acc = q.dtype;
    let (b, h, l) = (q.shape[0], q.shape[1], q.shape[2]);
    let (s, dv) = (k.shape[2], v.shape[3]);
    // The scale applied to the queries (l x d), not to the scores (l x s): XLA fuses it into
    // neither the product nor the max, so on the scores it is one more pass over them
    // (bench/results/lowering-choices.md).
    let q = e.mul(q, &e.splat(Scalar::Float(scale), &[], acc)?)?;
    let mut scores = batched_product(e, (&q, false), (k, true), [b, h, l, s])?;
    let ninf = e.splat(Scalar::Float(f64::NEG_INFINITY), &[], acc)?;
    if causal {
        let mut i = e.iota(&[b, h, l, s], 2, DType::Int64)?;
        if row0 != 0 {
            i = e.add(&i, &e.splat(Scalar::Int(row0), &i.shape, DType::Int64)?)?;
        }
        let j = e.iota(&[b, h, l, s], 3, DType::Int64)?;
        let keep = e.compare(&j, &i, "LE")?;
        scores = e.select(&keep, &scores, &ninf, acc)?;
    }
    if let Some(m) = mask {
        if m.dtype == DType::Bool {
            let m = e.broadcast_to(m, &scores.shape)?;
            scores = e.select(&m, &scores, &ninf, acc)?;
        } else {
            let m = e.broadcast_to(&e.convert(m, acc)?, &scores.shape)?;
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
    let pv = batched_product(e, (&p, false), (v, false), [b, h, l, dv])?;
    let out = e.div(&pv, &sum)?;
    // XLA's max skips NaN: a row of NaN scores has max -inf too, but its sum is NaN, and its
    // results stay NaN, as in PyTorch.
    let masked = e.binary(
        "stablehlo.and",
        &e.compare(&mx, &ninf, "EQ")?,
        &e.compare(&sum, &sum, "EQ")?,
        DType::Bool,
    )?;
    Ok((
        e.select(&masked, &zero, &out, acc)?,
        e.select(&masked, &zero, &lse, acc)?,
    ))
}

/// `x y` over the batch dims (b, h) of 4-d operands, `y` stored transposed in its last two dims
/// where `ty`: through the host BLAS where the products qualify (each (b, h) entry one product
/// of a 3-d call, spread over the threads), else XLA's dot. `out` is `[b, h, rows, cols]`.
fn batched_product<'c, 'b>(
    e: &Emitter<'c, 'b>,
    (x, tx): (&T<'c, 'b>, bool),
    (y, ty): (&T<'c, 'b>, bool),
    out: [i64; 4],
) -> R<T<'c, 'b>> {
    let [b, h, rows, cols] = out;
    let flat = |t: &T<'c, 'b>| e.reshape(t, &[b * h, t.shape[2], t.shape[3]]);
    if let Some(p) = host_matmul(e, (&flat(x)?, tx), (&flat(y)?, ty), &[b * h, rows, cols])? {
        return e.reshape(&p, &out);
    }
    let cx: &[i64] = if tx { &[2] } else { &[3] };
    let cy: &[i64] = if ty { &[3] } else { &[2] };
    e.dot_general(x, y, (&[0, 1], &[0, 1]), (cx, cy), &out, x.dtype)
}
