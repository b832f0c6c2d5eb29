//! Matrix products through the host BLAS (`tpuc_hostkernels::host_blas`) where the session
//! enables it and the product qualifies, shared by the product ops and attention.

use crate::lower::emit::Emitter;
use crate::lower::{R, T};
use tpuc_frontend_fx::DType;

/// Products with at most this many rows are vector-matrix products, whose time is reading the
/// weights: the host BLAS takes them from an eighth of the usual size (a decoding step's
/// 768 -> 256 key and value projections; XLA's dot reads the weights more slowly).
const VECTOR_ROWS: i64 = 16;

/// `a x b` (f32, `[batch,] m, n` = `shape`) through the host BLAS, operands stored as given or
/// (`true`) transposed in their last two dims, where the session enables it and the product
/// qualifies: f32 operands and result, each matrix product of at least `host_gemm_min_macs`
/// multiply-adds (an eighth of that with at most [`VECTOR_ROWS`] rows), each matrix within the
/// BLAS's 32-bit sizes: MKL is faster than XLA's dot there whatever the row count
/// (bench/results/lowering-choices.md). None where XLA's dot should compute it.
pub(crate) fn host_matmul<'c, 'b>(
    e: &Emitter<'c, 'b>,
    (a, ta): (&T<'c, 'b>, bool),
    (b, tb): (&T<'c, 'b>, bool),
    shape: &[i64],
) -> R<Option<T<'c, 'b>>> {
    let Some(min_macs) = e.host_gemm_min_macs else {
        return Ok(None);
    };
    let r = shape.len();
    if a.dtype != DType::Float32 || b.dtype != DType::Float32 || a.rank() != r || b.rank() != r {
        return Ok(None);
    }
    let k = if ta { a.shape[r - 2] } else { a.shape[r - 1] };
    let (m, n) = (shape[r - 2], shape[r - 1]);
    if (m.max(0) as u64) * (n.max(0) as u64) * (k.max(0) as u64)
        < if m <= VECTOR_ROWS {
            min_macs / 8
        } else {
            min_macs
        }
        || [m * k, k * n, m * n]
            .iter()
            .any(|&x| x > i64::from(i32::MAX))
    {
        return Ok(None);
    }
    let target = tpuc_hostkernels::host_blas::target(ta, tb);
    e.ffi_call_f32(target, &[a, b], shape).map(Some)
}

/// The 2-D product `a x b` (`[m, n]` = `shape`, operands transposed where `ta`/`tb`), through
/// the host BLAS where it qualifies, else XLA's dot, in `a`'s dtype.
pub fn matmul_2d<'c, 'b>(
    e: &Emitter<'c, 'b>,
    (a, ta): (&T<'c, 'b>, bool),
    (b, tb): (&T<'c, 'b>, bool),
    shape: &[i64],
) -> R<T<'c, 'b>> {
    if let Some(r) = host_matmul(e, (a, ta), (b, tb), shape)? {
        return Ok(r);
    }
    let ca: &[i64] = if ta { &[0] } else { &[1] };
    let cb: &[i64] = if tb { &[1] } else { &[0] };
    e.dot_general(a, b, (&[], &[]), (ca, cb), shape, a.dtype)
}
