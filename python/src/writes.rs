//! One-row writes into PyTorch tensors, for the input mutations a graph keeps (see
//! `python/tpuc/mutations.py`): a static KV cache's `index_copy_` of one position at a decode
//! step writes that row into the cache's own memory instead of copying the whole updated cache
//! back.

use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;

/// One write: `dst[..., index, ...] = values` along `dim` of a dense row-major `dst` of `shape`
/// (elements of `elem` bytes), `values` dense of `shape` with `dim` of size 1, `index` one
/// integer (int64 where `index_i64`, else int32). Addresses are the tensors' data pointers.
type Row = (usize, usize, usize, bool, Vec<i64>, usize, usize);

/// Performs `rows` in order, after checking every index (a negative one counts from the end, as
/// in `index_put_`; out of range raises IndexError and writes nothing).
///
/// The caller (Python, holding the tensors) vouches that each address holds the dense bytes its
/// role describes and that `values` does not overlap `dst`.
#[pyfunction]
pub fn write_rows(rows: Vec<Row>) -> PyResult<()> {
    let mut planned = Vec::with_capacity(rows.len());
    for (dst, values, index, index_i64, shape, dim, elem) in rows {
        let size = *shape
            .get(dim)
            .ok_or_else(|| PyValueError::new_err(format!("dim {dim} of a {shape:?} tensor")))?;
        if shape.iter().any(|&d| d < 0) || dst == 0 || values == 0 || index == 0 {
            return Err(PyValueError::new_err("write_rows: bad tensor"));
        }
        // SAFETY: `index` holds one integer of the given width (the caller's contract).
        let i = unsafe {
            if index_i64 {
                (index as *const i64).read_unaligned()
            } else {
                i64::from((index as *const i32).read_unaligned())
            }
        };
        let row = if i < 0 { i + size } else { i };
        if !(0..size).contains(&row) {
            return Err(PyIndexError::new_err(format!(
                "index {i} is out of bounds for dimension {dim} with size {size}"
            )));
        }
        let outer: i64 = shape[..dim].iter().product();
        let inner = shape[dim + 1..].iter().product::<i64>() as usize * elem;
        planned.push((
            dst,
            values,
            outer as usize,
            size as usize,
            row as usize,
            inner,
        ));
    }
    for (dst, values, outer, size, row, inner) in planned {
        for o in 0..outer {
            // SAFETY: within `dst` (o < outer, row < size, `inner` bytes per row) and `values`
            // (outer rows of `inner` bytes), which do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (values + o * inner) as *const u8,
                    (dst + (o * size + row) * inner) as *mut u8,
                    inner,
                );
            }
        }
    }
    Ok(())
}
