//! Shape and layout ops: views, permutations, slicing, concatenation, padding, indexing.

use crate::lower::emit::{array_i64, broadcast_shapes, int_list, Emitter, NCHW_OF_NHWC};
use crate::lower::helpers::gather::{along_dim_coords, stack_indices, take_along, wrap_index};
use crate::lower::Rule;
use crate::lower::{NodeCx, ReduceKind, Scalar, R, T};
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
    ("aten.index.Tensor", index),
    ("aten._unsafe_index.Tensor", index),
    ("aten.gather.default", gather),
    ("aten.as_strided.default", as_strided),
    ("aten.as_strided_scatter.default", as_strided_scatter),
    ("aten.copy.default", copy),
    ("aten.scatter.src", scatter),
    ("aten.scatter.value", scatter),
    ("aten.scatter_add.default", scatter),
    ("aten.index_put.default", index_put),
    ("aten._unsafe_index_put.default", index_put),
    ("aten.slice_scatter.default", slice_scatter),
    ("aten.select_scatter.default", select_scatter),
    // The view ops' functional twins, which functionalization writes inside the graphs of
    // control-flow ops (a scan's backward body): the same values.
    ("aten.view_copy.default", reshape),
    ("aten.unsqueeze_copy.default", reshape),
    ("aten.squeeze_copy.dim", reshape),
    ("aten.squeeze_copy.dims", reshape),
    ("aten.squeeze_copy.default", reshape),
    ("aten.transpose_copy.int", transpose),
    ("aten.t_copy.default", t),
    ("aten.expand_copy.default", expand),
    ("aten.select_copy.int", select),
    ("aten.slice_copy.Tensor", slice),
    ("aten.split_copy.Tensor", split),
    ("aten.split_with_sizes_copy.default", split_with_sizes),
    ("aten.unfold_copy.default", unfold),
    ("aten.permute_copy.default", permute),
    ("aten.as_strided_copy.default", as_strided),
    ("aten.narrow_copy.default", narrow),
    ("aten.unbind_copy.int", unbind),
    ("aten.unbind.int", unbind),
    ("aten.flip.default", flip),
    ("aten.diagonal.default", diagonal),
    ("aten.diagonal_copy.default", diagonal),
    ("aten.diagonal_scatter.default", diagonal_scatter),
    ("aten.repeat.default", repeat),
    ("aten.unfold.default", unfold),
    ("aten.scatter_reduce.two", scatter_reduce),
    ("aten.scatter.reduce", scatter_reduce),
    ("aten.scatter.value_reduce", scatter_reduce),
    ("aten.index_reduce.default", index_reduce),
    ("aten.put.default", put),
    ("aten.masked_scatter.default", masked_scatter),
    (
        "aten.masked_scatter_backward.default",
        masked_scatter_backward,
    ),
    ("aten.nonzero_static.default", nonzero_static),
    ("aten.segment_reduce.default", segment_reduce),
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
    if perm == NCHW_OF_NHWC {
        // NHWC data seen as NCHW (a channels-last input): kept as its physical form, which
        // convolutions and the ops that follow layouts read without a transpose.
        return Ok(vec![cx.e.layout_transpose(&x, &perm)?]);
    }
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
    Ok(vec![cx.e.concatenate(
        &parts.iter().collect::<Vec<_>>(),
        d as usize,
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

fn index_select<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let d = cx.dim(cx.int(1, "dim")?, x.rank())? as usize;
    let index = cx.tensor(2, "index")?;
    if x.rank() == 0 {
        // A 0-d tensor indexed along "dim 0": every (valid) index selects the one element.
        let (shape, _) = cx.out(0)?;
        return Ok(vec![cx.e.broadcast_to(&x, &shape)?]);
    }
    let g = take_along(
        cx.e,
        &x,
        d,
        &index,
        &out_shape_for(&x.shape, d, &index.shape),
    )?;
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
    Ok(vec![take_along(cx.e, &w, 0, &index, &shape)?])
}

/// Where `x[indices]` puts things: the broadcast shape of the index tensors, the indexed dims,
/// and for each dim of `x` that is not indexed, its position in the result. PyTorch places the
/// broadcast dims where the first indexed dim was when the indexed dims are adjacent, else first.
pub struct AdvancedIndex<'c, 'b> {
    pub batch: Vec<i64>,
    pub dims: Vec<i64>,
    pub indices: T<'c, 'b>,
    pub offset_dims: Vec<i64>,
    pub out_shape: Vec<i64>,
}

pub fn advanced_index<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    shape: &[i64],
    indices: &[Option<T<'c, 'b>>],
) -> R<AdvancedIndex<'c, 'b>> {
    let e = cx.e;
    let mut batch: Vec<i64> = Vec::new();
    let mut dims = Vec::new();
    let mut parts = Vec::new();
    if indices.len() > shape.len() {
        return Err(cx.err(format!(
            "{} indices for a tensor of rank {}",
            indices.len(),
            shape.len()
        )));
    }
    for (d, t) in indices.iter().enumerate() {
        let Some(t) = t else { continue };
        if matches!(t.dtype, DType::Bool | DType::Uint8) {
            return Err(cx.err(
                "indexing with a boolean mask has a data-dependent result shape; tpuc needs integer indices",
            ));
        }
        batch = broadcast_shapes(&batch, &t.shape)
            .ok_or_else(|| cx.err("index tensors do not broadcast"))?;
        dims.push(d as i64);
        parts.push(wrap_index(e, t, shape[d])?);
    }
    let stacked = stack_indices(e, &parts, &batch)?;
    let adjacent = dims.windows(2).all(|w| w[1] == w[0] + 1);
    let first = dims[0];
    let mut offset_dims = Vec::new();
    let mut out_shape = Vec::new();
    if !adjacent {
        out_shape.extend_from_slice(&batch);
    }
    for d in 0..shape.len() as i64 {
        if dims.contains(&d) {
            if adjacent && d == first {
                out_shape.extend_from_slice(&batch);
            }
            continue;
        }
        offset_dims.push(out_shape.len() as i64);
        out_shape.push(shape[d as usize]);
    }
    Ok(AdvancedIndex {
        batch,
        dims,
        indices: stacked,
        offset_dims,
        out_shape,
    })
}

/// `x[indices]` with a list of optional index tensors (`None` keeps a dim whole).
fn index<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let indices = cx.opt_tensors(1, "indices")?;
    if indices.iter().all(|t| t.is_none()) {
        return Ok(vec![x]);
    }
    let ix = advanced_index(cx, &x.shape, &indices)?;
    let mut slice_sizes = x.shape.clone();
    for &d in &ix.dims {
        slice_sizes[d as usize] = 1;
    }
    let dnums = format!(
        "#stablehlo.gather<offset_dims = [{}], collapsed_slice_dims = [{}], start_index_map = [{}], index_vector_dim = {}>",
        int_list(&ix.offset_dims),
        int_list(&ix.dims),
        int_list(&ix.dims),
        ix.batch.len()
    );
    Ok(vec![cx.e.op(
        "stablehlo.gather",
        &[&x, &ix.indices],
        &[
            ("dimension_numbers", dnums),
            ("slice_sizes", array_i64(&slice_sizes)),
            ("indices_are_sorted", "false".into()),
        ],
        &ix.out_shape,
        x.dtype,
    )?])
}

/// `gather(self, dim, index)`: `out[i][j] = self[i][index[i][j]]` (for dim 1).
fn gather<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let index = cx.tensor(2, "index")?;
    if x.rank() == 0 {
        return Ok(vec![cx.e.reshape(&x, &cx.out_shape()?)?]);
    }
    let d = cx.dim(cx.int(1, "dim")?, x.rank())? as usize;
    let r = x.rank() as i64;
    let coords = along_dim_coords(cx.e, &index, d, x.shape[d])?;
    let all: Vec<i64> = (0..r).collect();
    let dnums = format!(
        "#stablehlo.gather<collapsed_slice_dims = [{}], start_index_map = [{}], index_vector_dim = {r}>",
        int_list(&all),
        int_list(&all)
    );
    Ok(vec![cx.e.op(
        "stablehlo.gather",
        &[&x, &coords],
        &[
            ("dimension_numbers", dnums),
            ("slice_sizes", array_i64(&vec![1; x.rank()])),
            ("indices_are_sorted", "false".into()),
        ],
        &index.shape,
        x.dtype,
    )?])
}

/// The `size`, `stride` and `storage_offset` arguments of `as_strided` (at `i`, `i + 1`, `i + 2`),
/// checked against a buffer of `numel` elements.
fn strided_args(cx: &NodeCx, i: usize, numel: i64) -> R<(Vec<i64>, Vec<i64>, i64)> {
    let size = cx.ints(i, "size")?;
    let stride = cx.ints(i + 1, "stride")?;
    let offset = cx.int_or(i + 2, "storage_offset", 0)?;
    if size.len() != stride.len() {
        return Err(cx.err("as_strided: size and stride differ in length"));
    }
    let last = offset
        + size
            .iter()
            .zip(&stride)
            .map(|(&n, &s)| (n - 1).max(0) * s)
            .sum::<i64>();
    if size.iter().product::<i64>() > 0 && (last >= numel || offset < 0) {
        return Err(cx.err(format!(
            "as_strided reaches element {last} of a tensor of {numel} elements"
        )));
    }
    Ok((size, stride, offset))
}

/// Whether `(size, stride, offset)` walks a row-major buffer of `numel` elements in order, all of
/// it (dims of size 1 may carry any stride): then as_strided is a reshape.
fn walks_in_order(size: &[i64], stride: &[i64], offset: i64, numel: i64) -> bool {
    let mut expect = 1;
    for k in (0..size.len()).rev() {
        if size[k] != 1 && stride[k] != expect {
            return false;
        }
        expect *= size[k];
    }
    offset == 0 && size.iter().product::<i64>() == numel
}

/// For each element of an as_strided view, its position in the flat buffer, as the
/// `[size..., 1]` start indices of a gather or scatter.
fn strided_positions<'c, 'b>(
    e: &Emitter<'c, 'b>,
    size: &[i64],
    stride: &[i64],
    offset: i64,
) -> R<T<'c, 'b>> {
    let mut lin = e.splat(Scalar::Int(offset), size, DType::Int64)?;
    for k in 0..size.len() {
        if size[k] > 1 && stride[k] != 0 {
            let i = e.iota(size, k as i64, DType::Int64)?;
            let s = e.splat(Scalar::Int(stride[k]), &[], DType::Int64)?;
            let term = e.binary("stablehlo.multiply", &i, &s, DType::Int64)?;
            lin = e.binary("stablehlo.add", &lin, &term, DType::Int64)?;
        }
    }
    stack_indices(e, &[lin], size)
}

/// `as_strided(self, size, stride, storage_offset)`, reading `self` as a row-major (contiguous)
/// buffer, which is how tpuc holds every tensor: a reshape when the strides walk that buffer in
/// order, else a gather of the addressed elements.
fn as_strided<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let (size, stride, offset) = strided_args(cx, 1, x.numel())?;
    if walks_in_order(&size, &stride, offset, x.numel()) {
        return Ok(vec![cx.e.reshape(&x, &size)?]);
    }
    let e = cx.e;
    let flat = e.reshape(&x, &[x.numel()])?;
    let coords = strided_positions(e, &size, &stride, offset)?;
    let dnums = format!(
        "#stablehlo.gather<collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = {}>",
        size.len()
    );
    Ok(vec![e.op(
        "stablehlo.gather",
        &[&flat, &coords],
        &[
            ("dimension_numbers", dnums),
            ("slice_sizes", "array<i64: 1>".into()),
            ("indices_are_sorted", "false".into()),
        ],
        &size,
        x.dtype,
    )?])
}

/// `as_strided_scatter(self, src, size, stride, storage_offset)`: `self` (a row-major buffer)
/// with the elements of the as_strided view replaced by `src`.
fn as_strided_scatter<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let src = cx.tensor(1, "src")?;
    let (size, stride, offset) = strided_args(cx, 2, x.numel())?;
    let e = cx.e;
    let src = e.reshape(&e.convert(&src, x.dtype)?, &size)?;
    if walks_in_order(&size, &stride, offset, x.numel()) {
        return Ok(vec![e.reshape(&src, &x.shape)?]);
    }
    let flat = e.reshape(&x, &[x.numel()])?;
    let coords = strided_positions(e, &size, &stride, offset)?;
    let s = e.scatter(&flat, &coords, &src, &[], &[0], &[0], false)?;
    Ok(vec![e.reshape(&s, &x.shape)?])
}

/// `copy(self, src)`: the values of `src`, broadcast to the shape and cast to the dtype of `self`.
fn copy<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let src = cx.tensor(1, "src")?;
    let v = cx.e.convert(&src, x.dtype)?;
    Ok(vec![cx.e.broadcast_to(&v, &x.shape)?])
}

/// `index_put(self, indices, values, accumulate)`: `self[indices] = values` (or `+=` with
/// `accumulate`, which adds every duplicate index's value, as the embedding gradient needs).
fn index_put<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let indices = cx.opt_tensors(1, "indices")?;
    let values = cx.tensor(2, "values")?;
    let accumulate = cx.bool_or(3, "accumulate", false)?;
    if indices.iter().all(|t| t.is_none()) {
        let v =
            cx.e.broadcast_to(&cx.e.convert(&values, x.dtype)?, &x.shape)?;
        if accumulate {
            return Ok(vec![cx.e.binary("stablehlo.add", &x, &v, x.dtype)?]);
        }
        return Ok(vec![v]);
    }
    if !accumulate {
        if let Some(out) = put_one_into_input(cx, &x, &indices, &values)? {
            return Ok(vec![out]);
        }
    }
    let ix = advanced_index(cx, &x.shape, &indices)?;
    let upd =
        cx.e.broadcast_to(&cx.e.convert(&values, x.dtype)?, &ix.out_shape)?;
    Ok(vec![cx.e.scatter(
        &x,
        &ix.indices,
        &upd,
        &ix.offset_dims,
        &ix.dims,
        &ix.dims,
        accumulate,
    )?])
}

/// `x[..., i, ...] = values` for a single index `i` along one dim of a graph input (a static KV
/// cache's `index_copy_` at a decode step), as one select over `x` instead of a scatter, or
/// `None` where that does not apply. XLA never updates an input in place (inputs are PyTorch's
/// memory, never donated), so a scatter into one starts with a copy that waits for nothing and
/// delays what runs beside it (bench/results/lowering-choices.md). The select reads and writes `x`
/// once, as the copy did,
/// and waits for the values. An index out of range matches no position and leaves `x` as it
/// is, as the scatter does.
fn put_one_into_input<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    x: &T<'c, 'b>,
    indices: &[Option<T<'c, 'b>>],
    values: &T<'c, 'b>,
) -> R<Option<T<'c, 'b>>> {
    let e = cx.e;
    let given: Vec<(usize, &T)> = indices
        .iter()
        .enumerate()
        .filter_map(|(d, t)| t.as_ref().map(|t| (d, t)))
        .collect();
    let [(d, index)] = given[..] else {
        return Ok(None);
    };
    if index.numel() != 1
        || matches!(index.dtype, DType::Bool | DType::Uint8)
        || x.numel() == 0
        || !e.is_input(x)
    {
        return Ok(None);
    }
    // `values` broadcasts to x's shape with the index's dims in place of dim d (one element).
    let mut indexed = x.shape[..d].to_vec();
    indexed.extend_from_slice(&index.shape);
    indexed.extend_from_slice(&x.shape[d + 1..]);
    let mut one_row = x.shape.clone();
    one_row[d] = 1;
    let row = e.reshape(
        &e.broadcast_to(&e.convert(values, x.dtype)?, &indexed)?,
        &one_row,
    )?;
    let i = e.reshape(&wrap_index(e, index, x.shape[d])?, &[])?;
    let hit = e.compare(
        &e.iota(&x.shape, d as i64, DType::Int64)?,
        &e.broadcast_to(&i, &x.shape)?,
        "EQ",
    )?;
    // The row broadcasts along dim d. Materialized once: XLA would otherwise fuse the select into
    // every reader (attention reads a KV cache once per query head of a group) and compute it
    // again in each.
    let out = e.select(&hit, &row, x, x.dtype)?;
    e.barrier(&out).map(Some)
}

/// Writes `src` into `x` at positions `start, start + step, ...` of dim `d`.
fn scatter_along<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    x: &T<'c, 'b>,
    src: &T<'c, 'b>,
    d: usize,
    start: i64,
    step: i64,
) -> R<T<'c, 'b>> {
    let e = cx.e;
    let m = src.shape[d];
    if m == 0 {
        return Ok(x.clone());
    }
    if start == 0 && step == 1 && src.shape == x.shape {
        return e.convert(src, x.dtype);
    }
    let i = e.iota(&[m], 0, DType::Int64)?;
    let k = e.splat(Scalar::Int(step), &[], DType::Int64)?;
    let s0 = e.splat(Scalar::Int(start), &[], DType::Int64)?;
    let pos = e.binary(
        "stablehlo.add",
        &e.binary("stablehlo.multiply", &i, &k, DType::Int64)?,
        &s0,
        DType::Int64,
    )?;
    let pos = e.reshape(&pos, &[m, 1])?;
    let window: Vec<i64> = (0..x.rank() as i64).filter(|&k| k != d as i64).collect();
    e.scatter(x, &pos, src, &window, &[d as i64], &[d as i64], false)
}

/// `slice_scatter(self, src, dim, start, end, step)`: `self` with `self[start:end:step]` along
/// `dim` replaced by `src`.
fn slice_scatter<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let src = cx.tensor(1, "src")?;
    let d = cx.dim(cx.int_or(2, "dim", 0)?, x.rank())? as usize;
    let start = clamp_index(cx.int_or(3, "start", 0)?, x.shape[d]);
    let step = cx.int_or(5, "step", 1)?;
    if step <= 0 {
        return Err(cx.err("slice_scatter step must be positive"));
    }
    Ok(vec![scatter_along(cx, &x, &src, d, start, step)?])
}

/// `select_scatter(self, src, dim, index)`: `self` with `self.select(dim, index)` replaced.
fn select_scatter<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let src = cx.tensor(1, "src")?;
    let d = cx.dim(cx.int(2, "dim")?, x.rank())? as usize;
    let mut i = cx.int(3, "index")?;
    if i < 0 {
        i += x.shape[d];
    }
    if i < 0 || i >= x.shape[d] {
        return Err(cx.err(format!(
            "index {} out of range for dim {d} of size {}",
            cx.int(3, "index")?,
            x.shape[d]
        )));
    }
    let mut shape = x.shape.clone();
    shape[d] = 1;
    let src = cx.e.reshape(&src, &shape)?;
    Ok(vec![scatter_along(cx, &x, &src, d, i, 1)?])
}

/// `scatter(self, dim, index, src | value)` and `scatter_add(self, dim, index, src)`: for each
/// element of `index`, `self[i][index[i][j]] = src[i][j]` (for dim 1), or `+=` for scatter_add.
/// `src` may be larger than `index`; only its leading part is read.
fn scatter<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let index = cx.tensor(2, "index")?;
    let e = cx.e;
    if x.rank() == 0 || index.numel() == 0 {
        let src = match cx.arg(3, "src") {
            Some(Arg::Value(_)) => cx.tensor(3, "src")?,
            _ => e.splat(cx.scalar(3, "value")?, &[], x.dtype)?,
        };
        if index.numel() == 0 {
            return Ok(vec![x]);
        }
        return Ok(vec![e.reshape(&e.convert(&src, x.dtype)?, &x.shape)?]);
    }
    let d = cx.dim(cx.int(1, "dim")?, x.rank())? as usize;
    let updates = match cx.arg(3, "src") {
        Some(Arg::Value(_)) => {
            let src = cx.tensor(3, "src")?;
            let src = if src.shape == index.shape {
                src
            } else {
                e.slice(
                    &src,
                    &vec![0; src.rank()],
                    &index.shape,
                    &vec![1; src.rank()],
                )?
            };
            e.convert(&src, x.dtype)?
        }
        _ => e.splat(cx.scalar(3, "value")?, &index.shape, x.dtype)?,
    };
    let coords = along_dim_coords(e, &index, d, x.shape[d])?;
    let all: Vec<i64> = (0..x.rank() as i64).collect();
    let add = cx.node.op == "aten.scatter_add.default";
    Ok(vec![e.scatter(
        &x,
        &coords,
        &updates,
        &[],
        &all,
        &all,
        add,
    )?])
}

/// `narrow(self, dim, start, length)`: `self[start:start + length]` along `dim`.
fn narrow<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let d = cx.dim(cx.int(1, "dim")?, x.rank())? as usize;
    let size = x.shape[d];
    let mut start = cx.int(2, "start")?;
    if start < 0 {
        start += size;
    }
    let len = cx.int(3, "length")?;
    if start < 0 || len < 0 || start + len > size {
        return Err(cx.err(format!(
            "narrow({start}, {len}) out of range for dim {d} of size {size}"
        )));
    }
    let mut st = vec![0; x.rank()];
    let mut lim = x.shape.clone();
    st[d] = start;
    lim[d] = start + len;
    Ok(vec![cx.e.slice(&x, &st, &lim, &vec![1; x.rank()])?])
}

/// `unbind(self, dim)`: every index of `dim`, each without that dim.
fn unbind<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let d = cx.dim(cx.int_or(1, "dim", 0)?, x.rank())? as usize;
    let mut shape = x.shape.clone();
    shape.remove(d);
    (0..x.shape[d])
        .map(|i| {
            let mut st = vec![0; x.rank()];
            let mut lim = x.shape.clone();
            st[d] = i;
            lim[d] = i + 1;
            let s = cx.e.slice(&x, &st, &lim, &vec![1; x.rank()])?;
            cx.e.reshape(&s, &shape)
        })
        .collect()
}

fn flip<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    if x.rank() == 0 {
        return Ok(vec![x]);
    }
    let mut dims = cx
        .ints(1, "dims")?
        .iter()
        .map(|&d| cx.dim(d, x.rank()))
        .collect::<R<Vec<_>>>()?;
    dims.sort();
    dims.dedup();
    if dims.is_empty() {
        return Ok(vec![x]);
    }
    Ok(vec![cx.e.op(
        "stablehlo.reverse",
        &[&x],
        &[("dimensions", array_i64(&dims))],
        &x.shape.clone(),
        x.dtype,
    )?])
}

/// Where a diagonal lives: `x` with `dim1`, `dim2` moved last and flattened together, and the
/// diagonal's first flat position, stride and length there.
struct Diagonal<'c, 'b> {
    flat: T<'c, 'b>,
    perm: Vec<i64>,
    start: i64,
    step: i64,
    len: i64,
}

fn diagonal_of<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    x: &T<'c, 'b>,
    first: usize,
) -> R<Diagonal<'c, 'b>> {
    let offset = cx.int_or(first, "offset", 0)?;
    let d1 = cx.dim(cx.int_or(first + 1, "dim1", 0)?, x.rank())?;
    let d2 = cx.dim(cx.int_or(first + 2, "dim2", 1)?, x.rank())?;
    if d1 == d2 {
        return Err(cx.err("diagonal dims must differ"));
    }
    let mut perm: Vec<i64> = (0..x.rank() as i64)
        .filter(|&d| d != d1 && d != d2)
        .collect();
    perm.push(d1);
    perm.push(d2);
    let t = cx.e.transpose(x, &perm)?;
    let (n, m) = (x.shape[d1 as usize], x.shape[d2 as usize]);
    let mut flat_shape = t.shape[..t.rank() - 2].to_vec();
    flat_shape.push(n * m);
    let flat = cx.e.reshape(&t, &flat_shape)?;
    let (start, len) = if offset >= 0 {
        (offset, n.min(m - offset).max(0))
    } else {
        (-offset * m, (n + offset).min(m).max(0))
    };
    Ok(Diagonal {
        flat,
        perm,
        start,
        step: m + 1,
        len,
    })
}

/// `diagonal(self, offset, dim1, dim2)`: the other dims in order, then the diagonal.
fn diagonal<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let dg = diagonal_of(cx, &x, 1)?;
    let r = dg.flat.rank();
    let mut start = vec![0; r];
    let mut limit = dg.flat.shape.clone();
    let mut strides = vec![1; r];
    if dg.len > 0 {
        start[r - 1] = dg.start;
        limit[r - 1] = dg.start + (dg.len - 1) * dg.step + 1;
        strides[r - 1] = dg.step;
    } else {
        limit[r - 1] = 0;
    }
    Ok(vec![cx.e.slice(&dg.flat, &start, &limit, &strides)?])
}

/// `diagonal_scatter(self, src, offset, dim1, dim2)`: `self` with that diagonal replaced.
fn diagonal_scatter<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let src = cx.tensor(1, "src")?;
    let dg = diagonal_of(cx, &x, 2)?;
    let r = dg.flat.rank();
    let s = scatter_along(cx, &dg.flat, &src, r - 1, dg.start, dg.step)?;
    let t_shape: Vec<i64> = dg.perm.iter().map(|&p| x.shape[p as usize]).collect();
    let s = cx.e.reshape(&s, &t_shape)?;
    let mut inverse = vec![0; dg.perm.len()];
    for (i, &p) in dg.perm.iter().enumerate() {
        inverse[p as usize] = i as i64;
    }
    Ok(vec![cx.e.transpose(&s, &inverse)?])
}

/// `repeat(self, repeats)`: tiles `self` (with leading 1s up to `len(repeats)` dims): each dim
/// `s` repeated `r` times is a broadcast to `[r, s]` then a reshape to `[r * s]`.
fn repeat<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let reps = cx.ints(1, "repeats")?;
    if reps.len() < x.rank() {
        return Err(cx.err("repeat: fewer repeats than dims"));
    }
    let mut shape = vec![1; reps.len() - x.rank()];
    shape.extend_from_slice(&x.shape);
    let x = cx.e.reshape(&x, &shape)?;
    let mut wide = Vec::new();
    let mut dims = Vec::new();
    for (k, (&r, &s)) in reps.iter().zip(&shape).enumerate() {
        wide.push(r);
        wide.push(s);
        dims.push(2 * k as i64 + 1);
    }
    let b = cx.e.broadcast_in_dim(&x, &wide, &dims)?;
    Ok(vec![cx.e.reshape(&b, &cx.out_shape()?)?])
}

/// `unfold(self, dimension, size, step)`: windows of `size` elements every `step` along `dim`,
/// the window index in place of `dim` and the window's elements as a new last dim (a gather).
fn unfold<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let size = cx.int(2, "size")?;
    let step = cx.int(3, "step")?;
    if x.rank() == 0 {
        return Ok(vec![cx.e.reshape(&x, &cx.out_shape()?)?]);
    }
    let d = cx.dim(cx.int(1, "dimension")?, x.rank())? as usize;
    if step <= 0 || size < 0 || size > x.shape[d] {
        return Err(cx.err(format!(
            "unfold(size={size}, step={step}) of a dim of size {}",
            x.shape[d]
        )));
    }
    let windows = (x.shape[d] - size) / step + 1;
    let e = cx.e;
    let idx = e.add(
        &e.mul(
            &e.iota(&[windows, size], 0, DType::Int64)?,
            &e.splat(Scalar::Int(step), &[], DType::Int64)?,
        )?,
        &e.iota(&[windows, size], 1, DType::Int64)?,
    )?;
    let g = take_along(
        cx.e,
        &x,
        d,
        &idx,
        &out_shape_for(&x.shape, d, &[windows, size]),
    )?;
    // Move the window-element dim (right after the window dim) last.
    let r = g.rank() as i64;
    let mut perm: Vec<i64> = (0..r).filter(|&k| k != d as i64 + 1).collect();
    perm.push(d as i64 + 1);
    Ok(vec![e.transpose(&g, &perm)?])
}

/// `self` with every element `src[j]` combined into `self[coords[j]]` by `reduce` (`sum`, `prod`,
/// `mean`, `amax`, `amin`); without `include_self`, the targets start from the reduction's
/// identity (`mean`: from nothing) instead of their own value. `coords` are full coordinates
/// (`along_dim_coords`), one per element of `src`.
fn reduce_into<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    x: &T<'c, 'b>,
    coords: &T<'c, 'b>,
    src: &T<'c, 'b>,
    reduce: &str,
    include_self: bool,
) -> R<T<'c, 'b>> {
    let e = cx.e;
    let dt = x.dtype;
    let all: Vec<i64> = (0..x.rank() as i64).collect();
    let kind = match reduce {
        "sum" | "add" | "mean" => ReduceKind::Sum,
        "prod" | "multiply" => ReduceKind::Prod,
        "amax" => ReduceKind::Max,
        "amin" => ReduceKind::Min,
        other => return Err(cx.err(format!("unknown reduce {other:?}"))),
    };
    let kind = match (kind, dt) {
        (ReduceKind::Sum, DType::Bool) => ReduceKind::Or,
        (ReduceKind::Prod, DType::Bool) => ReduceKind::And,
        (k, _) => k,
    };
    let scatter = |base: &T<'c, 'b>, upd: &T<'c, 'b>, kind: ReduceKind| {
        let region = e.scalar_region(kind, base.dtype)?;
        e.scatter_with(base, coords, upd, &[], &all, &all, region)
    };
    let base = if include_self {
        x.clone()
    } else {
        let none = e.splat(Scalar::Bool(false), &x.shape, DType::Bool)?;
        let hit = e.splat(Scalar::Bool(true), &src.shape, DType::Bool)?;
        let touched = scatter(&none, &hit, ReduceKind::Or)?;
        let identity = e.splat(Emitter::reduce_init(kind, dt), &[], dt)?;
        e.select(&touched, &identity, x, dt)?
    };
    let r = scatter(&base, src, kind)?;
    if matches!(kind, ReduceKind::Max | ReduceKind::Min) && dt.is_float() {
        // The plugin's max/min inside reductions skip NaNs; PyTorch's amax/amin keep them.
        let none = e.splat(Scalar::Bool(false), &x.shape, DType::Bool)?;
        let got_nan = scatter(&none, &e.isnan(src)?, ReduceKind::Or)?;
        let nan = e.splat(Scalar::Float(f64::NAN), &[], dt)?;
        return e.select(&got_nan, &nan, &r, dt);
    }
    if reduce != "mean" {
        return Ok(r);
    }
    let ones = e.splat(Scalar::Int(1), &src.shape, DType::Int64)?;
    let zeros = e.splat(
        Scalar::Int(if include_self { 1 } else { 0 }),
        &x.shape,
        DType::Int64,
    )?;
    let count = scatter(&zeros, &ones, ReduceKind::Sum)?;
    let count = e.binary(
        "stablehlo.maximum",
        &count,
        &e.splat(Scalar::Int(1), &[], DType::Int64)?,
        DType::Int64,
    )?;
    if dt.is_float() {
        e.div(&r, &e.convert(&count, dt)?)
    } else {
        // PyTorch floor-divides integer means.
        let q = e.convert(
            &e.unary(
                "stablehlo.floor",
                &e.div(
                    &e.convert(&r, DType::Float64)?,
                    &e.convert(&count, DType::Float64)?,
                )?,
            )?,
            dt,
        )?;
        Ok(q)
    }
}

/// `scatter_reduce(self, dim, index, src, reduce, include_self=True)` and the older
/// `scatter(self, dim, index, src | value, reduce="add" | "multiply")`.
fn scatter_reduce<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let index = cx.tensor(2, "index")?;
    let e = cx.e;
    let reduce = match cx.arg(4, "reduce") {
        Some(Arg::Str(s)) => s.clone(),
        other => return Err(cx.err(format!("`reduce`: expected a string, got {other:?}"))),
    };
    let include_self = cx.bool_or(5, "include_self", true)?;
    let src = match cx.arg(3, "src") {
        Some(Arg::Value(_)) => cx.tensor(3, "src")?,
        _ => e.splat(cx.scalar(3, "value")?, &index.shape, x.dtype)?,
    };
    if index.numel() == 0 {
        return Ok(vec![x]);
    }
    if x.rank() == 0 {
        let src = e.reshape(&e.convert(&src, x.dtype)?, &[1])?;
        let flat = e.reshape(&x, &[1])?;
        let coords = e.splat(Scalar::Int(0), &[1, 1], DType::Int64)?;
        let r = reduce_into(cx, &flat, &coords, &src, &reduce, include_self)?;
        return Ok(vec![e.reshape(&r, &[])?]);
    }
    let d = cx.dim(cx.int(1, "dim")?, x.rank())? as usize;
    let src = if src.shape == index.shape {
        src
    } else {
        e.slice(
            &src,
            &vec![0; src.rank()],
            &index.shape,
            &vec![1; src.rank()],
        )?
    };
    let src = e.convert(&src, x.dtype)?;
    let coords = along_dim_coords(e, &index, d, x.shape[d])?;
    Ok(vec![reduce_into(
        cx,
        &x,
        &coords,
        &src,
        &reduce,
        include_self,
    )?])
}

/// `index_reduce(self, dim, index, source, reduce, include_self=True)`: slice `i` of `source`
/// along `dim` reduced into slice `index[i]` of `self`.
fn index_reduce<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let index = cx.tensor(2, "index")?;
    let src = cx.tensor(3, "source")?;
    let reduce = match cx.arg(4, "reduce") {
        Some(Arg::Str(s)) => s.clone(),
        other => return Err(cx.err(format!("`reduce`: expected a string, got {other:?}"))),
    };
    let include_self = cx.bool_or(5, "include_self", true)?;
    let e = cx.e;
    if index.numel() == 0 || src.numel() == 0 {
        return Ok(vec![x]);
    }
    if x.rank() == 0 {
        let src = e.reshape(&e.convert(&src, x.dtype)?, &[1])?;
        let flat = e.reshape(&x, &[1])?;
        let coords = e.splat(Scalar::Int(0), &[1, 1], DType::Int64)?;
        let r = reduce_into(cx, &flat, &coords, &src, &reduce, include_self)?;
        return Ok(vec![e.reshape(&r, &[])?]);
    }
    let d = cx.dim(cx.int(1, "dim")?, x.rank())? as usize;
    let index = e.reshape(&index, &[index.numel()])?;
    let full = e.broadcast_in_dim(&index, &src.shape, &[d as i64])?;
    let coords = along_dim_coords(e, &full, d, x.shape[d])?;
    let src = e.convert(&src, x.dtype)?;
    Ok(vec![reduce_into(
        cx,
        &x,
        &coords,
        &src,
        &reduce,
        include_self,
    )?])
}

/// `put(self, index, source, accumulate=False)`: `self` as a flat buffer, `source` written (or
/// added) at the flat positions `index` (negative ones count from the end).
fn put<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let index = cx.tensor(1, "index")?;
    let src = cx.tensor(2, "source")?;
    let accumulate = cx.bool_or(3, "accumulate", false)?;
    let e = cx.e;
    let k = index.numel();
    if k == 0 {
        return Ok(vec![x]);
    }
    let flat = e.reshape(&x, &[x.numel()])?;
    let idx = wrap_index(e, &e.reshape(&index, &[k])?, x.numel())?;
    let idx = e.reshape(&idx, &[k, 1])?;
    let upd = e.reshape(&e.convert(&src, x.dtype)?, &[k])?;
    let s = e.scatter(&flat, &idx, &upd, &[], &[0], &[0], accumulate)?;
    Ok(vec![e.reshape(&s, &x.shape)?])
}

/// For a flat bool mask: each true element's rank among the true ones (0, 1, ...), int64.
fn true_ranks<'c, 'b>(e: &Emitter<'c, 'b>, mask: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let ones = e.convert(mask, DType::Int64)?;
    let c = crate::lower::helpers::scan::running_sum(e, &ones, 0)?;
    e.sub(&c, &e.splat(Scalar::Int(1), &[], DType::Int64)?)
}

/// `masked_scatter(self, mask, source)`: where `mask` (broadcast) is true, the next element of
/// `source` (flattened), in row-major order.
fn masked_scatter<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let mask = cx.tensor(1, "mask")?;
    let src = cx.tensor(2, "source")?;
    let e = cx.e;
    let n = x.numel();
    if n == 0 || src.numel() == 0 {
        return Ok(vec![x]);
    }
    let m = e.reshape(
        &e.broadcast_to(&e.convert(&mask, DType::Bool)?, &x.shape)?,
        &[n],
    )?;
    let rank = true_ranks(e, &m)?;
    let last = e.splat(Scalar::Int(src.numel() - 1), &[], DType::Int64)?;
    let zero = e.splat(Scalar::Int(0), &[], DType::Int64)?;
    let pos = e.binary("stablehlo.minimum", &rank, &last, DType::Int64)?;
    let pos = e.binary("stablehlo.maximum", &pos, &zero, DType::Int64)?;
    let flat_src = e.reshape(&e.convert(&src, x.dtype)?, &[src.numel()])?;
    let taken = take_along(cx.e, &flat_src, 0, &pos, &[n])?;
    let flat = e.reshape(&x, &[n])?;
    let r = e.select(&m, &taken, &flat, x.dtype)?;
    Ok(vec![e.reshape(&r, &x.shape)?])
}

/// `masked_scatter_backward(grad_output, mask, sizes)`: the source's gradient, `grad_output`'s
/// elements where `mask` (broadcast) is true in row-major order, then zeros, shaped `sizes`
/// (PyTorch's `masked_select`, zero-filled to the source's size).
fn masked_scatter_backward<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let g = cx.tensor(0, "grad_output")?;
    let mask = cx.tensor(1, "mask")?;
    let (shape, out) = cx.out(0)?;
    let e = cx.e;
    let k: i64 = shape.iter().product();
    let b = broadcast_shapes(&g.shape, &mask.shape)
        .ok_or_else(|| cx.err("grad_output and mask do not broadcast"))?;
    let n: i64 = b.iter().product();
    if k == 0 || n == 0 {
        return Ok(vec![e.splat(Scalar::Int(0), &shape, out)?]);
    }
    let m = e.reshape(&e.broadcast_to(&e.convert(&mask, DType::Bool)?, &b)?, &[n])?;
    let flat = e.reshape(&e.broadcast_to(&e.convert(&g, out)?, &b)?, &[n])?;
    // Selected elements go to their rank; the rest (and any rank past the source's size) to an
    // extra last slot, sliced off below.
    let rank = true_ranks(e, &m)?;
    let spill = e.splat(Scalar::Int(k), &[], DType::Int64)?;
    let keep = e.and(&m, &e.compare(&rank, &spill, "LT")?)?;
    let at = e.select(&keep, &rank, &spill, DType::Int64)?;
    let s = e.scatter(
        &e.splat(Scalar::Int(0), &[k + 1], out)?,
        &e.reshape(&at, &[n, 1])?,
        &flat,
        &[],
        &[0],
        &[0],
        false,
    )?;
    let s = e.slice(&s, &[0], &[k], &[1])?;
    Ok(vec![e.reshape(&s, &shape)?])
}

/// `nonzero_static(self, size, fill_value=-1) -> [size, ndim]`: the coordinates of the first
/// `size` non-zero elements in row-major order, the remaining rows `fill_value`.
fn nonzero_static<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let size = cx.int(1, "size")?;
    let fill = cx.int_or(2, "fill_value", -1)?;
    let (shape, out) = cx.out(0)?;
    let e = cx.e;
    let n = x.numel();
    let nd = x.rank() as i64;
    if n == 0 || size == 0 || nd == 0 {
        return Ok(vec![e.splat(Scalar::Int(fill), &shape, out)?]);
    }
    let nz = e.reshape(
        &e.compare(&x, &e.splat(Scalar::Int(0), &[], x.dtype)?, "NE")?,
        &[n],
    )?;
    let rank = true_ranks(e, &nz)?;
    let i64k = |v: i64| e.splat(Scalar::Int(v), &[], DType::Int64);
    // Rows past `size` and zeros go to an extra last row, sliced off below.
    let keep = e.and(&nz, &e.compare(&rank, &i64k(size)?, "LT")?)?;
    let row = e.select(&keep, &rank, &i64k(size)?, DType::Int64)?;
    let flat = e.iota(&[n], 0, DType::Int64)?;
    let mut cols = Vec::new();
    let mut stride = n;
    for d in 0..x.rank() {
        stride /= x.shape[d].max(1);
        let c = e.binary(
            "stablehlo.remainder",
            &e.div(&flat, &i64k(stride.max(1))?)?,
            &i64k(x.shape[d])?,
            DType::Int64,
        )?;
        cols.push(e.reshape(&c, &[n, 1])?);
    }
    let refs: Vec<&T> = cols.iter().collect();
    let coords = if refs.len() == 1 {
        cols[0].clone()
    } else {
        e.op(
            "stablehlo.concatenate",
            &refs,
            &[("dimension", "1 : i64".into())],
            &[n, nd],
            DType::Int64,
        )?
    };
    let base = e.splat(Scalar::Int(fill), &[size + 1, nd], DType::Int64)?;
    let idx = e.reshape(&row, &[n, 1])?;
    let s = e.scatter(&base, &idx, &coords, &[1], &[0], &[0], false)?;
    let s = e.slice(&s, &[0, 0], &[size, nd], &[1, 1])?;
    Ok(vec![e.convert(&s, out)?])
}

/// `segment_reduce(data, reduce, *, lengths | offsets, axis=0, unsafe, initial)` with 1-D
/// `lengths` / `offsets`: consecutive segments of `data` along `axis` reduced (`sum`, `prod`,
/// `mean`, `max`, `min`), each starting from `initial` (else the identity); an empty segment
/// gives `initial`, or for `mean` without it NaN. Segment ids come from comparing positions with
/// the segment ends, so lengths may be runtime values.
fn segment_reduce<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let data = cx.tensor(0, "data")?;
    let reduce = match cx.arg(1, "reduce") {
        Some(Arg::Str(s)) => s.clone(),
        other => return Err(cx.err(format!("`reduce`: expected a string, got {other:?}"))),
    };
    let (shape, out) = cx.out(0)?;
    let e = cx.e;
    let axis = cx.dim(cx.int_or(5, "axis", 0)?, data.rank())? as usize;
    let initial = match cx.arg(7, "initial") {
        None | Some(Arg::None) => None,
        _ => Some(cx.scalar(7, "initial")?),
    };
    // Segment boundaries [S + 1] (int64).
    let offsets = match (cx.opt_tensor(2, "lengths")?, cx.opt_tensor(4, "offsets")?) {
        (Some(l), _) => {
            if l.rank() != 1 {
                return Err(cx.err("segment_reduce: only 1-D lengths are supported"));
            }
            let l = e.convert(&l, DType::Int64)?;
            let ends = crate::lower::helpers::scan::running_sum(e, &l, 0)?;
            let zero = e.splat(Scalar::Int(0), &[1], DType::Int64)?;
            e.op(
                "stablehlo.concatenate",
                &[&zero, &ends],
                &[("dimension", "0 : i64".into())],
                &[l.shape[0] + 1],
                DType::Int64,
            )?
        }
        (None, Some(o)) => {
            if o.rank() != 1 {
                return Err(cx.err("segment_reduce: only 1-D offsets are supported"));
            }
            e.convert(&o, DType::Int64)?
        }
        (None, None) => return Err(cx.err("segment_reduce needs lengths or offsets")),
    };
    let segs = offsets.shape[0] - 1;
    let n = data.shape[axis];
    let dt = acc_dtype_of(out);
    let x = e.convert(&data, dt)?;
    // Segment of position j: how many segment ends are <= j (S for positions past the end).
    let ends = e.slice(&offsets, &[1], &[segs + 1], &[1])?;
    let grid = [n, segs];
    let before = e.compare(
        &e.broadcast_in_dim(&ends, &grid, &[1])?,
        &e.iota(&grid, 0, DType::Int64)?,
        "LE",
    )?;
    let seg = e.reduce(
        &e.convert(&before, DType::Int64)?,
        &[1],
        ReduceKind::Sum,
        false,
    )?;
    let full = e.broadcast_in_dim(&seg, &data.shape, &[axis as i64])?;
    let coords = along_dim_coords(e, &full, axis, segs + 1)?;
    let mut base_shape = data.shape.clone();
    base_shape[axis] = segs + 1;
    let (kind_name, identity) = match reduce.as_str() {
        "sum" | "mean" => ("sum", Scalar::Int(0)),
        "prod" => ("prod", Scalar::Int(1)),
        "max" => ("amax", Scalar::Float(f64::NEG_INFINITY)),
        "min" => ("amin", Scalar::Float(f64::INFINITY)),
        other => return Err(cx.err(format!("unknown reduce {other:?}"))),
    };
    let base = e.splat(initial.unwrap_or(identity), &base_shape, dt)?;
    let r = reduce_into(cx, &base, &coords, &x, kind_name, true)?;
    let mut limit = base_shape.clone();
    limit[axis] = segs;
    let r = e.slice(&r, &vec![0; r.rank()], &limit, &vec![1; r.rank()])?;
    if reduce != "mean" {
        return Ok(vec![e.convert(&e.reshape(&r, &shape)?, out)?]);
    }
    let starts = e.slice(&offsets, &[0], &[segs], &[1])?;
    let len = e.broadcast_in_dim(&e.sub(&ends, &starts)?, &r.shape, &[axis as i64])?;
    let zero = e.splat(Scalar::Int(0), &[], DType::Int64)?;
    let empty = e.compare(&len, &zero, "EQ")?;
    let mean = e.div(&r, &e.convert(&len, dt)?)?;
    let when_empty = match initial {
        Some(_) => r.clone(),
        None => e.splat(Scalar::Float(f64::NAN), &r.shape, dt)?,
    };
    let m = e.select(&empty, &when_empty, &mean, dt)?;
    Ok(vec![e.convert(&e.reshape(&m, &shape)?, out)?])
}

/// Float accumulation for low-precision floats; other dtypes as they are.
fn acc_dtype_of(d: DType) -> DType {
    crate::lower::helpers::widen::acc_dtype(d)
}
