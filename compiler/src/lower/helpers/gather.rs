//! Gathers along one dim, shared by indexing, embedding bags, sampling and pooling.

use crate::lower::emit::{array_i64, int_list, Emitter};
use crate::lower::{Scalar, R, T};
use tpuc_frontend_fx::DType;

/// Gathers whole slices of `x` along `dim` at `index` (1-D or N-D indices), like `x[index]`
/// along that dim. Out-of-range indices are clamped by the gather, so they never read outside
/// the tensor.
pub fn take_along<'c, 'b>(
    e: &Emitter<'c, 'b>,
    x: &T<'c, 'b>,
    dim: usize,
    index: &T<'c, 'b>,
    out_shape: &[i64],
) -> R<T<'c, 'b>> {
    let idx = e.convert(index, DType::Int64)?;
    // Index tensor gets a trailing vector dim of size 1.
    let mut idx_shape = idx.shape.clone();
    idx_shape.push(1);
    let idx = e.reshape(&idx, &idx_shape)?;
    let ib = index.rank() as i64;
    let offset_dims: Vec<i64> = (0..x.rank() as i64 - 1)
        .map(|k| if k < dim as i64 { k } else { k + ib })
        .collect();
    let mut slice_sizes = x.shape.clone();
    slice_sizes[dim] = 1;
    let dnums = format!(
        "#stablehlo.gather<offset_dims = [{}], collapsed_slice_dims = [{dim}], start_index_map = [{dim}], index_vector_dim = {ib}>",
        int_list(&offset_dims)
    );
    e.op(
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

/// Indices as int64 with negative values counted from the end of a dim of `size`, as PyTorch
/// reads them.
pub fn wrap_index<'c, 'b>(e: &Emitter<'c, 'b>, index: &T<'c, 'b>, size: i64) -> R<T<'c, 'b>> {
    let idx = e.convert(index, DType::Int64)?;
    let zero = e.splat(Scalar::Int(0), &[], DType::Int64)?;
    let neg = e.compare(&idx, &zero, "LT")?;
    let n = e.splat(Scalar::Int(size), &[], DType::Int64)?;
    let wrapped = e.binary("stablehlo.add", &idx, &n, DType::Int64)?;
    e.select(&neg, &wrapped, &idx, DType::Int64)
}

/// Index tensors (already int64, of one shape `b`) stacked along a new last dim: the
/// `start_indices` of a gather or scatter, with `index_vector_dim = b.len()`.
pub fn stack_indices<'c, 'b>(e: &Emitter<'c, 'b>, parts: &[T<'c, 'b>], b: &[i64]) -> R<T<'c, 'b>> {
    let mut col = b.to_vec();
    col.push(1);
    let cols: Vec<T> = parts
        .iter()
        .map(|p| e.reshape(&e.broadcast_to(p, b)?, &col))
        .collect::<R<_>>()?;
    if cols.len() == 1 {
        return Ok(cols.into_iter().next().expect("one part"));
    }
    let mut shape = b.to_vec();
    shape.push(cols.len() as i64);
    let refs: Vec<&T> = cols.iter().collect();
    e.op(
        "stablehlo.concatenate",
        &refs,
        &[("dimension", format!("{} : i64", b.len()))],
        &shape,
        DType::Int64,
    )
}

/// Full coordinates for an elementwise gather/scatter along `dim`: for each element of `index`,
/// (i_0, ..., index[i], ..., i_{r-1}), stacked along a new last dim.
pub fn along_dim_coords<'c, 'b>(
    e: &Emitter<'c, 'b>,
    index: &T<'c, 'b>,
    dim: usize,
    size: i64,
) -> R<T<'c, 'b>> {
    let idx = wrap_index(e, index, size)?;
    let parts: Vec<T> = (0..index.rank())
        .map(|k| {
            if k == dim {
                Ok(idx.clone())
            } else {
                e.iota(&index.shape, k as i64, DType::Int64)
            }
        })
        .collect::<R<_>>()?;
    stack_indices(e, &parts, &index.shape)
}
