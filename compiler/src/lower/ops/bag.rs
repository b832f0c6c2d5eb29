//! `embedding_bag` (`_embedding_bag` / `_embedding_bag_forward_only`): sums, means or maxima of
//! embedding rows over bags given by runtime offsets. A position's bag is the number of offsets
//! at or before it, minus one (empty bags give zeros); rows at `padding_idx` are left out.
//! Only the result is computed: the bookkeeping results (offset2bag, bag_size, max_indices)
//! raise an error when something reads them.

use super::shape::take_along;
use crate::lower::registry::Rule;
use crate::lower::{NodeCx, ReduceKind, Scalar, R, T};
use tpuc_frontend_fx::{Arg, DType};

pub static RULES: &[(&str, Rule)] = &[
    ("aten._embedding_bag_forward_only.default", embedding_bag),
    ("aten._embedding_bag.default", embedding_bag),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;
const I64: DType = DType::Int64;

fn embedding_bag<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let weight = cx.tensor(0, "weight")?;
    let indices = cx.tensor(1, "indices")?;
    let offsets = cx.tensor(2, "offsets")?;
    let mode = cx.int_or(4, "mode", 0)?;
    let psw = cx.opt_tensor(6, "per_sample_weights")?;
    let include_last = cx.bool_or(7, "include_last_offset", false)?;
    let padding_idx = match cx.arg(8, "padding_idx") {
        None | Some(Arg::None) => None,
        Some(Arg::Int(p)) if *p < 0 => None,
        Some(Arg::Int(p)) => Some(*p),
        other => return Err(cx.err(format!("`padding_idx`: expected an int, got {other:?}"))),
    };
    if indices.rank() != 1 || offsets.rank() != 1 || weight.rank() != 2 {
        return Err(cx.err("expected 1-d indices and offsets and a 2-d weight"));
    }
    if !(0..=2).contains(&mode) || (psw.is_some() && mode != 0) {
        return Err(cx.err(format!("unsupported mode {mode}")));
    }
    let (out_shape, out_dtype) = cx.out(0)?;
    let nb = out_shape[0];
    let d = weight.shape[1];
    let n = indices.shape[0];
    let rest = vec![cx.unused(1)?, cx.unused(2)?, cx.unused(3)?];
    if nb == 0 || d == 0 {
        let mut r = vec![e.splat(Scalar::Int(0), &out_shape, out_dtype)?];
        r.extend(rest);
        return Ok(r);
    }
    let idx = e.convert(&indices, I64)?;
    let offs = e.convert(&offsets, I64)?;
    // The offsets that open bags (all but the last with include_last_offset).
    let opening = e.slice(&offs, &[0], &[nb], &[1])?;
    // bag[i] = #(opening offsets <= i) - 1, as a (nb, n) one-hot: member[b, i].
    let pos = e.iota(&[nb, n], 1, I64)?;
    let ob = e.broadcast_in_dim(&opening, &[nb, n], &[0])?;
    let le = e.convert(&e.compare(&ob, &pos, "LE")?, I64)?;
    let count = e.reduce(&le, &[0], ReduceKind::Sum, false)?; // (n)
    let bag = e.sub(&count, &e.splat(Scalar::Int(1), &[], I64)?)?;
    let bi = e.iota(&[nb, n], 0, I64)?;
    let mut member = e.compare(&bi, &e.broadcast_in_dim(&bag, &[nb, n], &[1])?, "EQ")?;
    if include_last {
        let end = e.slice(&offs, &[nb], &[nb + 1], &[1])?;
        let end = e.broadcast_in_dim(&e.reshape(&end, &[])?, &[nb, n], &[])?;
        member = e.and(&member, &e.compare(&pos, &end, "LT")?)?;
    }
    if let Some(p) = padding_idx {
        let keep = e.compare(&idx, &e.splat(Scalar::Int(p), &[], I64)?, "NE")?;
        member = e.and(&member, &e.broadcast_in_dim(&keep, &[nb, n], &[1])?)?;
    }
    let rows = take_along(cx, &weight, 0, &idx, &[n, d])?; // (n, d)
    let rows = match &psw {
        Some(w) => {
            let w = e.broadcast_in_dim(&e.convert(w, weight.dtype)?, &[n, d], &[0])?;
            e.mul(&rows, &w)?
        }
        None => rows,
    };
    let big = [nb, n, d];
    let rb = e.broadcast_in_dim(&rows, &big, &[1, 2])?;
    let mb = e.broadcast_in_dim(&member, &big, &[0, 1])?;
    let zero = e.splat(Scalar::Int(0), &[], weight.dtype)?;
    let out = match mode {
        0 | 1 => {
            let s = e.reduce(
                &e.select(&mb, &rb, &zero, weight.dtype)?,
                &[1],
                ReduceKind::Sum,
                false,
            )?;
            if mode == 1 {
                let cnt = e.reduce(&e.convert(&member, I64)?, &[1], ReduceKind::Sum, false)?;
                let cnt = e.convert(&cnt, weight.dtype)?;
                let one = e.splat(Scalar::Int(1), &[], weight.dtype)?;
                let has = e.compare(&cnt, &zero, "GT")?;
                let div = e.select(&has, &cnt, &one, weight.dtype)?;
                e.div(&s, &e.broadcast_in_dim(&div, &[nb, d], &[0])?)?
            } else {
                s
            }
        }
        _ => {
            let ninf = e.splat(Scalar::Float(f64::NEG_INFINITY), &[], weight.dtype)?;
            let m = e.reduce_nan(
                &e.select(&mb, &rb, &ninf, weight.dtype)?,
                &[1],
                ReduceKind::Max,
                false,
            )?;
            let any = e.reduce(&member, &[1], ReduceKind::Or, false)?;
            e.select(
                &e.broadcast_in_dim(&any, &[nb, d], &[0])?,
                &m,
                &zero,
                weight.dtype,
            )?
        }
    };
    let mut r = vec![e.convert(&out, out_dtype)?];
    r.extend(rest);
    Ok(r)
}
