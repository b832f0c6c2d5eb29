//! Shape and layout ops: views, permutations, slicing, concatenation, padding, indexing.

use crate::lower::emit::array_i64;
use crate::lower::registry::Rule;
use crate::lower::{NodeCx, Scalar, R, T};
use tpuc_frontend_fx::{Arg, DType};

pub static RULES: &[(&str, Rule)] = &[
    ("aten.view.default", reshape),
    ("aten._unsafe_view.default", reshape),
    ("aten.reshape.default", reshape),
    ("aten.unsqueeze.default", reshape),
    ("aten.squeeze.dim", reshape),
    ("aten.squeeze.dims", reshape),
    ("aten.squeeze.default", reshape),
    ("aten.flatten.using_ints", reshape),
    ("aten.unflatten.int", reshape),
    ("aten.permute.default", permute),
    ("aten.transpose.int", transpose),
    ("aten.t.default", t),
    ("aten.expand.default", expand),
    ("aten.select.int", select),
    ("aten.slice.Tensor", slice),
    ("aten.split_with_sizes.default", split_with_sizes),
    ("aten.split.Tensor", split),
    ("aten.cat.default", cat),
    ("aten.constant_pad_nd.default", constant_pad_nd),
    ("aten.index_select.default", index_select),
    ("aten.embedding.default", embedding),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;

fn reshape<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    Ok(vec![cx.e.reshape(&x, &cx.out_shape()?)?])
}

fn permute<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let perm = cx
        .ints(1, "dims")?
        .iter()
        .map(|&d| cx.dim(d, x.rank()))
        .collect::<R<Vec<_>>>()?;
    Ok(vec![cx.e.transpose(&x, &perm)?])
}

fn transpose<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let a = cx.dim(cx.int(1, "dim0")?, x.rank())?;
    let b = cx.dim(cx.int(2, "dim1")?, x.rank())?;
    let mut perm: Vec<i64> = (0..x.rank() as i64).collect();
    perm.swap(a as usize, b as usize);
    Ok(vec![cx.e.transpose(&x, &perm)?])
}

fn t<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    if x.rank() < 2 {
        return Ok(vec![x]);
    }
    Ok(vec![cx.e.transpose(&x, &[1, 0])?])
}

fn expand<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    Ok(vec![cx.e.broadcast_to(&x, &cx.out_shape()?)?])
}

/// Python slice bounds, clamped like `x[start:end]`.
fn clamp_index(i: i64, size: i64) -> i64 {
    let i = if i < 0 { i + size } else { i };
    i.clamp(0, size)
}

fn select<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let d = cx.dim(cx.int(1, "dim")?, x.rank())? as usize;
    let size = x.shape[d];
    let mut i = cx.int(2, "index")?;
    if i < 0 {
        i += size;
    }
    if i < 0 || i >= size {
        return Err(cx.err(format!(
            "index {} out of range for dim {d} of size {size}",
            cx.int(2, "index")?
        )));
    }
    let mut start = vec![0; x.rank()];
    let mut limit = x.shape.clone();
    start[d] = i;
    limit[d] = i + 1;
    let s = cx.e.slice(&x, &start, &limit, &vec![1; x.rank()])?;
    Ok(vec![cx.e.reshape(&s, &cx.out_shape()?)?])
}

fn slice<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let d = cx.dim(cx.int_or(1, "dim", 0)?, x.rank())? as usize;
    let size = x.shape[d];
    let start = clamp_index(cx.int_or(2, "start", 0)?, size);
    let end = clamp_index(cx.int_or(3, "end", size)?.min(size), size).max(start);
    let step = cx.int_or(4, "step", 1)?;
    if step <= 0 {
        return Err(cx.err("slice step must be positive"));
    }
    let mut st = vec![0; x.rank()];
    let mut lim = x.shape.clone();
    let mut strides = vec![1; x.rank()];
    st[d] = start;
    lim[d] = end;
    strides[d] = step;
    Ok(vec![cx.e.slice(&x, &st, &lim, &strides)?])
}

fn split_at<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, x: &T<'c, 'b>, d: usize, sizes: &[i64]) -> V<'c, 'b> {
    let mut out = Vec::new();
    let mut offset = 0;
    for &s in sizes {
        let mut st = vec![0; x.rank()];
        let mut lim = x.shape.clone();
        st[d] = offset;
        lim[d] = offset + s;
        out.push(cx.e.slice(x, &st, &lim, &vec![1; x.rank()])?);
        offset += s;
    }
    if offset != x.shape[d] {
        return Err(cx.err(format!(
            "split sizes {sizes:?} do not add up to {}",
            x.shape[d]
        )));
    }
    Ok(out)
}

fn split_with_sizes<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let d = cx.dim(cx.int_or(2, "dim", 0)?, x.rank())? as usize;
    split_at(cx, &x, d, &cx.ints(1, "split_sizes")?)
}

fn split<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let d = cx.dim(cx.int_or(2, "dim", 0)?, x.rank())? as usize;
    let chunk = cx.int(1, "split_size")?.max(1);
    let size = x.shape[d];
    let mut sizes = Vec::new();
    let mut left = size;
    while left > 0 {
        sizes.push(chunk.min(left));
        left -= chunk;
    }
    if sizes.is_empty() {
        sizes.push(0);
    }
    split_at(cx, &x, d, &sizes)
}

fn cat<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (shape, out) = cx.out(0)?;
    // PyTorch skips legacy empty 1-D tensors in cat.
    let parts: Vec<T> = cx
        .tensors(0, "tensors")?
        .into_iter()
        .filter(|t| !(t.rank() == 1 && t.shape[0] == 0 && shape.len() != 1))
        .map(|t| cx.e.convert(&t, out))
        .collect::<R<_>>()?;
    let d = cx.dim(cx.int_or(1, "dim", 0)?, shape.len())?;
    if parts.len() == 1 {
        return Ok(parts);
    }
    let refs: Vec<&T> = parts.iter().collect();
    Ok(vec![cx.e.op(
        "stablehlo.concatenate",
        &refs,
        &[("dimension", format!("{d} : i64"))],
        &shape,
        out,
    )?])
}

fn constant_pad_nd<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let pad = cx.ints(1, "pad")?;
    let value = match cx.arg(2, "value") {
        None | Some(Arg::None) => Scalar::Int(0),
        _ => cx.scalar(2, "value")?,
    };
    let r = x.rank();
    let mut lo = vec![0; r];
    let mut hi = vec![0; r];
    // `pad` lists (low, high) pairs starting from the last dim.
    for (k, pair) in pad.chunks(2).enumerate() {
        let d = r - 1 - k;
        lo[d] = pair[0];
        hi[d] = *pair.get(1).unwrap_or(&0);
    }
    let pv = cx.e.splat(value, &[], x.dtype)?;
    Ok(vec![cx.e.op(
        "stablehlo.pad",
        &[&x, &pv],
        &[
            ("edge_padding_low", array_i64(&lo)),
            ("edge_padding_high", array_i64(&hi)),
            ("interior_padding", array_i64(&vec![0; r])),
        ],
        &cx.out_shape()?,
        x.dtype,
    )?])
}

/// Gathers whole slices of `x` along `dim` at `index` (1-D or N-D indices), like `x[index]`
/// along that dim. Out-of-range indices are clamped by the gather, so they never read outside
/// the tensor.
pub fn take_along<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    x: &T<'c, 'b>,
    dim: usize,
    index: &T<'c, 'b>,
    out_shape: &[i64],
) -> R<T<'c, 'b>> {
    let idx = cx.e.convert(index, DType::Int64)?;
    // Index tensor gets a trailing vector dim of size 1.
    let mut idx_shape = idx.shape.clone();
    idx_shape.push(1);
    let idx = cx.e.reshape(&idx, &idx_shape)?;
    let ib = index.rank() as i64;
    let offset_dims: Vec<i64> = (0..x.rank() as i64 - 1)
        .map(|k| if k < dim as i64 { k } else { k + ib })
        .collect();
    let mut slice_sizes = x.shape.clone();
    slice_sizes[dim] = 1;
    let list = |v: &[i64]| {
        v.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let dnums = format!(
        "#stablehlo.gather<offset_dims = [{}], collapsed_slice_dims = [{dim}], start_index_map = [{dim}], index_vector_dim = {ib}>",
        list(&offset_dims)
    );
    cx.e.op(
        "stablehlo.gather",
        &[x, &idx],
        &[
            ("dimension_numbers", dnums),
            ("slice_sizes", array_i64(&slice_sizes)),
            ("indices_are_sorted", "false".into()),
        ],
        out_shape,
        x.dtype,
    )
}

fn index_select<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let d = cx.dim(cx.int(1, "dim")?, x.rank())? as usize;
    let index = cx.tensor(2, "index")?;
    let g = take_along(cx, &x, d, &index, &out_shape_for(&x.shape, d, &index.shape))?;
    // A 0-d index keeps the dim as size 1 in index_select.
    Ok(vec![cx.e.reshape(&g, &cx.out_shape()?)?])
}

/// Result shape of `take_along`: x's shape with `dim` replaced by the index shape.
fn out_shape_for(x: &[i64], dim: usize, index: &[i64]) -> Vec<i64> {
    let mut s = x[..dim].to_vec();
    s.extend_from_slice(index);
    s.extend_from_slice(&x[dim + 1..]);
    s
}

fn embedding<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let w = cx.tensor(0, "weight")?;
    let index = cx.tensor(1, "indices")?;
    let shape = out_shape_for(&w.shape, 0, &index.shape);
    Ok(vec![take_along(cx, &w, 0, &index, &shape)?])
}
