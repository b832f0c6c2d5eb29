//! `embedding_bag` (`_embedding_bag` / `_embedding_bag_forward_only`): sums, means or maxima of
//! embedding rows over bags given by runtime offsets. A position's bag is the number of offsets
//! at or before it, minus one (empty bags give zeros); rows at `padding_idx` are left out. Rows
//! are combined per bag by scatters (memory linear in the indices).
//! The bookkeeping results are PyTorch's CPU kernel's (what its backward reads): offset2bag
//! (each position's bag), bag_size (a bag's positions less its padding ones; zeros for sums) and
//! max_indices (the row each maximum came from; bag_size's copy for sums and means).
//! And their backward: `_embedding_bag_backward` (dense) and
//! `_embedding_bag_per_sample_weights_backward`.

use crate::lower::emit::Emitter;
use crate::lower::helpers::gather::{stack_indices, take_along};
use crate::lower::helpers::scan::running_sum;
use crate::lower::Rule;
use crate::lower::{NodeCx, ReduceKind, Scalar, R, T};
use tpuc_frontend_fx::{Arg, DType};

pub static RULES: &[(&str, Rule)] = &[
    ("aten._embedding_bag_forward_only.default", embedding_bag),
    ("aten._embedding_bag.default", embedding_bag),
    (
        "aten._embedding_bag_backward.default",
        embedding_bag_backward,
    ),
    (
        "aten._embedding_bag_per_sample_weights_backward.default",
        per_sample_weights_backward,
    ),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;
const I64: DType = DType::Int64;

/// PyTorch's `make_offset2bag`: for each of `n` positions, the number of offsets (all of them,
/// the closing one of `include_last_offset` too) at or before it, minus one.
fn offset2bag<'c, 'b>(e: &Emitter<'c, 'b>, offsets: &T<'c, 'b>, n: i64) -> R<T<'c, 'b>> {
    let offs = e.convert(offsets, I64)?;
    let l = offs.shape[0];
    let zero_i = e.splat(Scalar::Int(0), &[], I64)?;
    let n_k = e.splat(Scalar::Int(n), &[], I64)?;
    // Offsets past the end mark the extra slot n, which is sliced off.
    let at = e.op("stablehlo.clamp", &[&zero_i, &offs, &n_k], &[], &[l], I64)?;
    let marks = e.scatter(
        &e.splat(Scalar::Int(0), &[n + 1], I64)?,
        &e.reshape(&at, &[l, 1])?,
        &e.splat(Scalar::Int(1), &[l], I64)?,
        &[],
        &[0],
        &[0],
        true,
    )?;
    let marks = e.slice(&marks, &[0], &[n], &[1])?;
    e.sub(
        &running_sum(e, &marks, 0)?,
        &e.splat(Scalar::Int(1), &[], I64)?,
    )
}

/// `padding_idx` (argument `i`): None when absent or negative.
fn padding_index(cx: &NodeCx<'_, '_, '_>, i: usize) -> R<Option<i64>> {
    match cx.arg(i, "padding_idx") {
        None | Some(Arg::None) => Ok(None),
        Some(Arg::Int(p)) if *p < 0 => Ok(None),
        Some(Arg::Int(p)) => Ok(Some(*p)),
        other => Err(cx.err(format!("`padding_idx`: expected an int, got {other:?}"))),
    }
}

fn embedding_bag<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let weight = cx.tensor(0, "weight")?;
    let indices = cx.tensor(1, "indices")?;
    let offsets = cx.tensor(2, "offsets")?;
    let mode = cx.int_or(4, "mode", 0)?;
    let psw = cx.opt_tensor(6, "per_sample_weights")?;
    let include_last = cx.bool_or(7, "include_last_offset", false)?;
    let padding_idx = padding_index(cx, 8)?;
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
    if d == 0 && (1..4).any(|k| cx.result_used(k)) {
        return Err(
            cx.err("embeddings of size 0: offset2bag, bag_size and max_indices are not computed")
        );
    }
    if nb == 0 || d == 0 || n == 0 {
        let mut r = vec![e.splat(Scalar::Int(0), &out_shape, out_dtype)?];
        for k in 1..4 {
            let (shape, dtype) = cx.out(k)?;
            r.push(e.splat(Scalar::Int(0), &shape, dtype)?);
        }
        return Ok(r);
    }
    let idx = e.convert(&indices, I64)?;
    let offs = e.convert(&offsets, I64)?;
    let zero_i = e.splat(Scalar::Int(0), &[], I64)?;
    let o2b = offset2bag(e, &offs, n)?;
    let pos = e.iota(&[n], 0, I64)?;
    let mut member = e.and(
        &e.compare(&o2b, &zero_i, "GE")?,
        &e.compare(&o2b, &e.splat(Scalar::Int(nb), &[], I64)?, "LT")?,
    )?;
    let in_a_bag = member.clone();
    if include_last {
        let end = e.reshape(&e.slice(&offs, &[nb], &[nb + 1], &[1])?, &[])?;
        member = e.and(&member, &e.compare(&pos, &end, "LT")?)?;
    }
    if let Some(p) = padding_idx {
        let keep = e.compare(&idx, &e.splat(Scalar::Int(p), &[], I64)?, "NE")?;
        member = e.and(&member, &keep)?;
    }
    let bag = e.select(&member, &o2b, &zero_i, I64)?;
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
    let (out, max_indices) = match mode {
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
                (e.div(&s, &e.broadcast_in_dim(&div, &[nb, d], &[0])?)?, None)
            } else {
                (s, None)
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
            let has = e.broadcast_in_dim(&e.compare(&count, &zero_i, "GT")?, &[nb, d], &[0])?;
            let out = e.select(&has, &m, &zero, weight.dtype)?;
            let max_indices = if cx.result_used(3) {
                // The row each maximum came from: the bag's first row where that is NaN, else
                // the first row holding the maximum (later equal ones do not replace it).
                let at_max = e.compare(&rows, &take_along(cx.e, &m, 0, &bag, &[n, d])?, "EQ")?;
                let hit = e.and(&mb, &at_max)?;
                let posb = e.broadcast_in_dim(&pos, &[n, d], &[0])?;
                let first_hit = e.scatter_with(
                    &e.splat(Scalar::Int(n), &[nb, d], I64)?,
                    &bag_idx,
                    &e.select(&hit, &posb, &big, I64)?,
                    &[1],
                    &[0],
                    &[0],
                    e.scalar_region(ReduceKind::Min, I64)?,
                )?;
                let first_b = e.broadcast_in_dim(&at, &[nb, d], &[0])?;
                let src = e.select(&e.isnan(&first)?, &first_b, &first_hit, I64)?;
                let src = e.op(
                    "stablehlo.clamp",
                    &[&zero_i, &src, &last],
                    &[],
                    &[nb, d],
                    I64,
                )?;
                let word = take_along(cx.e, &idx, 0, &src, &[nb, d])?;
                Some(e.select(&has, &word, &zero_i, I64)?)
            } else {
                None
            };
            (out, max_indices)
        }
    };
    let mut r = vec![e.convert(&out, out_dtype)?];
    // offset2bag: recorded empty where PyTorch's fast path for sums skips it.
    let (shape, dtype) = cx.out(1)?;
    r.push(if shape == [n] {
        e.convert(&o2b, dtype)?
    } else {
        e.splat(Scalar::Int(0), &shape, dtype)?
    });
    // bag_size: zeros for sums; else each bag's extent (the last one's to the end of the
    // indices) less its padding positions.
    let (shape, dtype) = cx.out(2)?;
    let bag_size = if mode == 0 || !(cx.result_used(2) || (mode == 1 && cx.result_used(3))) {
        e.splat(Scalar::Int(0), &shape, dtype)?
    } else {
        let starts = e.slice(&offs, &[0], &[nb], &[1])?;
        let next = e.concatenate(
            &[
                &e.slice(&offs, &[1], &[nb], &[1])?,
                &e.splat(Scalar::Int(n), &[1], I64)?,
            ],
            0,
        )?;
        let mut size = e.sub(&next, &starts)?;
        if let Some(p) = padding_idx {
            let padded = e.and(
                &in_a_bag,
                &e.compare(&idx, &e.splat(Scalar::Int(p), &[], I64)?, "EQ")?,
            )?;
            let at = e.select(&in_a_bag, &o2b, &zero_i, I64)?;
            let pads = e.scatter(
                &e.splat(Scalar::Int(0), &[nb], I64)?,
                &e.reshape(&at, &[n, 1])?,
                &e.convert(&padded, I64)?,
                &[],
                &[0],
                &[0],
                true,
            )?;
            size = e.sub(&size, &pads)?;
        }
        e.reshape(&e.convert(&size, dtype)?, &shape)?
    };
    // max_indices: the rows of the maxima, else a copy of bag_size.
    let (shape, dtype) = cx.out(3)?;
    r.push(bag_size.clone());
    r.push(match max_indices {
        Some(m) => e.reshape(&e.convert(&m, dtype)?, &shape)?,
        None if mode == 2 => cx.unused(3)?,
        None => e.reshape(&e.convert(&bag_size, dtype)?, &shape)?,
    });
    Ok(r)
}

/// `offset2bag` as the backward gets it, or recomputed from the offsets where the forward's
/// fast path for sums left it empty (as PyTorch's backward does).
fn saved_offset2bag<'c, 'b>(
    e: &Emitter<'c, 'b>,
    saved: &T<'c, 'b>,
    offsets: &T<'c, 'b>,
    n: i64,
) -> R<T<'c, 'b>> {
    if saved.numel() == n {
        e.reshape(&e.convert(saved, I64)?, &[n])
    } else {
        offset2bag(e, offsets, n)
    }
}

/// `_embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, max_indices,
/// num_weights, scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx)`, dense:
/// sums and means scatter each position's bag gradient (times its per-sample weight, over the
/// bag's size for means, over its row's count among the indices for `scale_grad_by_freq`) to
/// its row, padding rows left out; maxima scatter each non-empty bag's
/// gradient to the rows its maxima came from.
fn embedding_bag_backward<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let grad = cx.tensor(0, "grad")?;
    let indices = cx.tensor(1, "indices")?;
    let offsets = cx.tensor(2, "offsets")?;
    let saved_o2b = cx.tensor(3, "offset2bag")?;
    let bag_size = cx.tensor(4, "bag_size")?;
    let max_indices = cx.tensor(5, "maximum_indices")?;
    let by_freq = cx.bool_or(7, "scale_grad_by_freq", false)?;
    let mode = cx.int(8, "mode")?;
    let sparse = cx.bool_or(9, "sparse", false)?;
    let psw = cx.opt_tensor(10, "per_sample_weights")?;
    let padding_idx = padding_index(cx, 11)?;
    let (shape, dtype) = cx.out(0)?;
    if sparse {
        return Err(cx.err("sparse gradients (sparse=True) are not supported"));
    }
    if !(0..=2).contains(&mode) || (psw.is_some() && mode != 0) {
        return Err(cx.err(format!("unsupported mode {mode}")));
    }
    if indices.rank() != 1 || grad.rank() != 2 || shape.len() != 2 {
        return Err(cx.err("expected 1-d indices and a 2-d grad"));
    }
    let n = indices.shape[0];
    let (nb, d) = (grad.shape[0], grad.shape[1]);
    let num_weights = shape[0];
    let zero_i = e.splat(Scalar::Int(0), &[], I64)?;
    if n == 0 || nb == 0 || d == 0 || num_weights == 0 {
        return Ok(vec![e.splat(Scalar::Int(0), &shape, dtype)?]);
    }
    let acc = crate::lower::helpers::widen::acc_dtype(dtype);
    let g = e.convert(&grad, acc)?;
    let zero = e.splat(Scalar::Int(0), &[], acc)?;
    let table = e.splat(Scalar::Int(0), &[num_weights, d], acc)?;
    if mode == 2 {
        // Bags left empty (or all padding) have bag_size 0 and contribute nothing.
        if max_indices.shape != [nb, d] || bag_size.numel() < nb {
            return Err(cx.err(format!(
                "max mode: expected max_indices of shape [{nb}, {d}] and a bag_size per bag"
            )));
        }
        let sizes = e.slice(&e.convert(&bag_size, I64)?, &[0], &[nb], &[1])?;
        let nonempty = e.compare(&sizes, &zero_i, "NE")?;
        let nonempty = e.broadcast_in_dim(&nonempty, &[nb, d], &[0])?;
        let upd = e.select(&nonempty, &g, &zero, acc)?;
        let rows = e.convert(&max_indices, I64)?;
        let cols = e.iota(&[nb, d], 1, I64)?;
        let at = stack_indices(e, &[rows, cols], &[nb, d])?;
        let r = e.scatter(&table, &at, &upd, &[], &[0, 1], &[0, 1], true)?;
        return Ok(vec![e.convert(&r, dtype)?]);
    }
    let o2b = saved_offset2bag(e, &saved_o2b, &offsets, n)?;
    let last = e.splat(Scalar::Int(nb - 1), &[], I64)?;
    let o2b = e.op("stablehlo.clamp", &[&zero_i, &o2b, &last], &[], &[n], I64)?;
    let mut rows = take_along(e, &g, 0, &o2b, &[n, d])?;
    let mut scale: Option<T> = None;
    if let Some(w) = &psw {
        scale = Some(e.convert(w, acc)?);
    }
    if mode == 1 {
        // Over the bag's size, where that is not 0.
        let sizes = e.convert(&e.reshape(&bag_size, &[bag_size.numel()])?, I64)?;
        let size = take_along(e, &sizes, 0, &o2b, &[n])?;
        let one = e.splat(Scalar::Int(1), &[], acc)?;
        let sizef = e.convert(&size, acc)?;
        let nz = e.compare(&size, &zero_i, "NE")?;
        let inv = e.select(&nz, &e.div(&one, &sizef)?, &one, acc)?;
        scale = Some(match scale {
            None => inv,
            Some(s) => e.mul(&s, &inv)?,
        });
    }
    let idx = e.convert(&indices, I64)?;
    if by_freq {
        // Over how often the position's row occurs among all the indices.
        let counts = e.scatter(
            &e.splat(Scalar::Int(0), &[num_weights], I64)?,
            &e.reshape(&idx, &[n, 1])?,
            &e.splat(Scalar::Int(1), &[n], I64)?,
            &[],
            &[0],
            &[0],
            true,
        )?;
        let count = e.convert(&take_along(e, &counts, 0, &idx, &[n])?, acc)?;
        let inv = e.div(&e.splat(Scalar::Int(1), &[n], acc)?, &count)?;
        scale = Some(match scale {
            None => inv,
            Some(s) => e.mul(&s, &inv)?,
        });
    }
    if let Some(s) = scale {
        rows = e.mul(&rows, &e.broadcast_in_dim(&s, &[n, d], &[0])?)?;
    }
    if let Some(p) = padding_idx {
        let keep = e.compare(&idx, &e.splat(Scalar::Int(p), &[], I64)?, "NE")?;
        let keep = e.broadcast_in_dim(&keep, &[n, d], &[0])?;
        rows = e.select(&keep, &rows, &zero, acc)?;
    }
    let r = e.scatter(
        &table,
        &e.reshape(&idx, &[n, 1])?,
        &rows,
        &[1],
        &[0],
        &[0],
        true,
    )?;
    Ok(vec![e.convert(&r, dtype)?])
}

/// `_embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode,
/// padding_idx)`: each position's weight row dotted with its bag's gradient (0 at padding).
fn per_sample_weights_backward<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let grad = cx.tensor(0, "grad")?;
    let weight = cx.tensor(1, "weight")?;
    let indices = cx.tensor(2, "indices")?;
    let offsets = cx.tensor(3, "offsets")?;
    let saved_o2b = cx.tensor(4, "offset2bag")?;
    let mode = cx.int(5, "mode")?;
    let padding_idx = padding_index(cx, 6)?;
    let (shape, dtype) = cx.out(0)?;
    if mode != 0 {
        return Err(cx.err("per_sample_weights are only defined for mode='sum'"));
    }
    if indices.rank() != 1 || grad.rank() != 2 || weight.rank() != 2 {
        return Err(cx.err("expected 1-d indices and a 2-d grad and weight"));
    }
    let n = indices.shape[0];
    let (nb, d) = (grad.shape[0], grad.shape[1]);
    if n == 0 || nb == 0 || d == 0 || weight.shape[0] == 0 {
        return Ok(vec![e.splat(Scalar::Int(0), &shape, dtype)?]);
    }
    let acc = crate::lower::helpers::widen::acc_dtype(dtype);
    let zero_i = e.splat(Scalar::Int(0), &[], I64)?;
    let o2b = saved_offset2bag(e, &saved_o2b, &offsets, n)?;
    let last = e.splat(Scalar::Int(nb - 1), &[], I64)?;
    let o2b = e.op("stablehlo.clamp", &[&zero_i, &o2b, &last], &[], &[n], I64)?;
    let idx = e.convert(&indices, I64)?;
    let g = take_along(e, &e.convert(&grad, acc)?, 0, &o2b, &[n, d])?;
    let w = take_along(e, &e.convert(&weight, acc)?, 0, &idx, &[n, d])?;
    let mut r = e.reduce(&e.mul(&g, &w)?, &[1], ReduceKind::Sum, false)?;
    if let Some(p) = padding_idx {
        let keep = e.compare(&idx, &e.splat(Scalar::Int(p), &[], I64)?, "NE")?;
        r = e.select(&keep, &r, &e.splat(Scalar::Int(0), &[], acc)?, acc)?;
    }
    Ok(vec![e.reshape(&e.convert(&r, dtype)?, &shape)?])
}
