//! `embedding_bag` (`_embedding_bag` / `_embedding_bag_forward_only`): sums, means or maxima of
//! embedding rows over bags given by runtime offsets. A position's bag is the number of offsets
//! at or before it, minus one (empty bags give zeros); rows at `padding_idx` are left out. Rows
//! are combined per bag by scatters (memory linear in the indices).
//! Only the result is computed: the bookkeeping results (offset2bag, bag_size, max_indices)
//! raise an error when something reads them.

use crate::lower::helpers::gather::take_along;
use crate::lower::helpers::scan::running_sum;
use crate::lower::Rule;
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
    let one_i = e.splat(Scalar::Int(1), &[], I64)?;
    let zero_i = e.splat(Scalar::Int(0), &[], I64)?;
    // bag[i] = #(opening offsets <= i) - 1: a running sum of marks at the opening offsets
    // (offsets past the end mark nothing).
    let opening = e.slice(&offs, &[0], &[nb], &[1])?;
    let n_k = e.splat(Scalar::Int(n), &[], I64)?;
    let at = e.op(
        "stablehlo.clamp",
        &[&zero_i, &opening, &n_k],
        &[],
        &opening.shape,
        I64,
    )?;
    let marks = e.scatter(
        &e.splat(Scalar::Int(0), &[n + 1], I64)?,
        &e.reshape(&at, &[nb, 1])?,
        &e.splat(Scalar::Int(1), &[nb], I64)?,
        &[],
        &[0],
        &[0],
        true,
    )?;
    let marks = e.slice(&marks, &[0], &[n], &[1])?;
    let bag = e.sub(&running_sum(e, &marks, 0)?, &one_i)?;
    let pos = e.iota(&[n], 0, I64)?;
    let mut member = e.and(
        &e.compare(&bag, &zero_i, "GE")?,
        &e.compare(&bag, &e.splat(Scalar::Int(nb), &[], I64)?, "LT")?,
    )?;
    if include_last {
        let end = e.reshape(&e.slice(&offs, &[nb], &[nb + 1], &[1])?, &[])?;
        member = e.and(&member, &e.compare(&pos, &end, "LT")?)?;
    }
    if let Some(p) = padding_idx {
        let keep = e.compare(&idx, &e.splat(Scalar::Int(p), &[], I64)?, "NE")?;
        member = e.and(&member, &keep)?;
    }
    let bag = e.select(&member, &bag, &zero_i, I64)?;
    let bag_idx = e.reshape(&bag, &[n, 1])?;
    let rows = take_along(cx.e, &weight, 0, &idx, &[n, d])?; // (n, d)
    let rows = match &psw {
        Some(w) => {
            let w = e.broadcast_in_dim(&e.convert(w, weight.dtype)?, &[n, d], &[0])?;
            e.mul(&rows, &w)?
        }
        None => rows,
    };
    let mb = e.broadcast_in_dim(&member, &[n, d], &[0])?;
    let zero = e.splat(Scalar::Int(0), &[], weight.dtype)?;
    let count = e.scatter(
        &e.splat(Scalar::Int(0), &[nb], I64)?,
        &bag_idx,
        &e.convert(&member, I64)?,
        &[],
        &[0],
        &[0],
        true,
    )?;
    let out = match mode {
        0 | 1 => {
            let upd = e.select(&mb, &rows, &zero, weight.dtype)?;
            let s = e.scatter(
                &e.splat(Scalar::Int(0), &[nb, d], weight.dtype)?,
                &bag_idx,
                &upd,
                &[1],
                &[0],
                &[0],
                true,
            )?;
            if mode == 1 {
                let cnt = e.convert(&count, weight.dtype)?;
                let one = e.splat(Scalar::Int(1), &[], weight.dtype)?;
                let has = e.compare(&count, &zero_i, "GT")?;
                let div = e.select(&has, &cnt, &one, weight.dtype)?;
                e.div(&s, &e.broadcast_in_dim(&div, &[nb, d], &[0])?)?
            } else {
                s
            }
        }
        _ => {
            // PyTorch's kernel keeps a bag's first row and replaces it by any greater one: the
            // max of the non-NaN values, or NaN where the bag's first row holds NaN.
            let ninf = e.splat(Scalar::Float(f64::NEG_INFINITY), &[], weight.dtype)?;
            let keep = e.and(&mb, &e.unary("stablehlo.not", &e.isnan(&rows)?)?)?;
            let upd = e.select(&keep, &rows, &ninf, weight.dtype)?;
            let m = e.scatter_with(
                &e.splat(Scalar::Float(f64::NEG_INFINITY), &[nb, d], weight.dtype)?,
                &bag_idx,
                &upd,
                &[1],
                &[0],
                &[0],
                e.scalar_region(ReduceKind::Max, weight.dtype)?,
            )?;
            let big = e.splat(Scalar::Int(n), &[], I64)?;
            let first_pos = e.scatter_with(
                &e.splat(Scalar::Int(n), &[nb], I64)?,
                &bag_idx,
                &e.select(&member, &pos, &big, I64)?,
                &[],
                &[0],
                &[0],
                e.scalar_region(ReduceKind::Min, I64)?,
            )?;
            let last = e.splat(Scalar::Int(n - 1), &[], I64)?;
            let at = e.op(
                "stablehlo.clamp",
                &[&zero_i, &first_pos, &last],
                &[],
                &[nb],
                I64,
            )?;
            let first = take_along(cx.e, &rows, 0, &at, &[nb, d])?;
            let nan = e.splat(Scalar::Float(f64::NAN), &[], weight.dtype)?;
            let m = e.select(&e.isnan(&first)?, &nan, &m, weight.dtype)?;
            let has = e.compare(&count, &zero_i, "GT")?;
            e.select(
                &e.broadcast_in_dim(&has, &[nb, d], &[0])?,
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
