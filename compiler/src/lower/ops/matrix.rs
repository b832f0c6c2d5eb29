//! Matrix decompositions and solvers (`torch.linalg`): Cholesky and triangular solves map to
//! `stablehlo.cholesky` / `stablehlo.triangular_solve`; LU with partial pivoting is a
//! `stablehlo.while` loop over the columns (same pivot choice as LAPACK's `getrf`: the first row
//! of largest magnitude); QR and symmetric eigenvalues use XLA's `Qr`,
//! `ProductOfElementaryHouseholderReflectors` and `Eigh` custom calls, which XLA expands into
//! plain HLO (Householder QR with LAPACK's conventions, Jacobi eigenvalues).
//!
//! Results that are unique (solutions, inverses, determinants, singular values, eigenvalues,
//! pseudo-inverses, matrix functions) are computed; eigenvectors and singular vectors are not
//! (their signs follow LAPACK's internal choices, which no other algorithm reproduces), and a
//! rule whose such result is read raises a clear error instead. Singular values come from the
//! eigenvalues of the Gram matrix computed in float64, so their error stays far below float32's.

use crate::lower::emit::{array_i64, Emitter};
use crate::lower::Rule;
use crate::lower::{NodeCx, ReduceKind, Scalar, R, T};
use tpuc_frontend_fx::{Arg, DType};

pub static RULES: &[(&str, Rule)] = &[
    ("aten.linalg_cholesky_ex.default", cholesky_ex),
    ("aten.cholesky_solve.default", cholesky_solve),
    ("aten.cholesky_inverse.default", cholesky_inverse),
    ("aten.triangular_solve.default", triangular_solve),
    ("aten.linalg_solve_triangular.default", solve_triangular),
    ("aten.linalg_lu_factor_ex.default", lu_factor_ex),
    ("aten.linalg_lu.default", linalg_lu),
    ("aten.lu_unpack.default", lu_unpack),
    ("aten.linalg_lu_solve.default", lu_solve),
    ("aten.linalg_inv_ex.default", inv_ex),
    ("aten._linalg_solve_ex.default", solve_ex),
    ("aten._linalg_det.default", det),
    ("aten._linalg_slogdet.default", slogdet),
    ("aten.geqrf.default", geqrf),
    ("aten.linalg_qr.default", qr),
    (
        "aten.linalg_householder_product.default",
        householder_product,
    ),
    ("aten.ormqr.default", ormqr),
    ("aten._linalg_eigh.default", eigh_rule),
    ("aten._linalg_svd.default", svd),
    ("aten.linalg_pinv.atol_rtol_tensor", pinv),
    ("aten.linalg_matrix_sqrth.default", matrix_sqrth),
    ("aten.linalg_polar.default", polar),
    ("aten.linalg_matrix_exp.default", matrix_exp),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;
const F64: DType = DType::Float64;
const I64: DType = DType::Int64;

// ---------------------------------------------------------------------------------------------
// Helpers

fn batch(t: &T) -> Vec<i64> {
    t.shape[..t.rank() - 2].to_vec()
}

fn rows(t: &T) -> i64 {
    t.shape[t.rank() - 2]
}

fn cols(t: &T) -> i64 {
    t.shape[t.rank() - 1]
}

fn with_last2(b: &[i64], m: i64, n: i64) -> Vec<i64> {
    let mut s = b.to_vec();
    s.push(m);
    s.push(n);
    s
}

/// Swaps the last two dims.
fn mt<'c, 'b>(e: &Emitter<'c, 'b>, t: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let r = t.rank() as i64;
    let mut perm: Vec<i64> = (0..r).collect();
    perm.swap((r - 1) as usize, (r - 2) as usize);
    e.transpose(t, &perm)
}

/// Batched `a @ b` (equal batch dims) in the dtype of `a`.
fn bmm<'c, 'b>(e: &Emitter<'c, 'b>, a: &T<'c, 'b>, b: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let nb = a.rank() as i64 - 2;
    let bd: Vec<i64> = (0..nb).collect();
    let shape = with_last2(&batch(a), rows(a), cols(b));
    let b = e.convert(b, a.dtype)?;
    e.dot_general(a, &b, (&bd, &bd), (&[nb + 1], &[nb]), &shape, a.dtype)
}

/// Broadcasts the batch dims of two matrices (or stacks of matrices) to a common shape.
fn common_batch<'c, 'b>(
    e: &Emitter<'c, 'b>,
    a: &T<'c, 'b>,
    b: &T<'c, 'b>,
) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let bb = crate::lower::emit::broadcast_shapes(&batch(a), &batch(b))
        .ok_or_else(|| crate::lower::LowerError::internal("batch dims do not broadcast"))?;
    let a2 = e.broadcast_to(a, &with_last2(&bb, rows(a), cols(a)))?;
    let b2 = e.broadcast_to(b, &with_last2(&bb, rows(b), cols(b)))?;
    Ok((a2, b2))
}

/// Row index and column index of every element of a `shape` tensor (its last two dims).
fn row_col<'c, 'b>(e: &Emitter<'c, 'b>, shape: &[i64]) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let r = shape.len() as i64;
    Ok((e.iota(shape, r - 2, I64)?, e.iota(shape, r - 1, I64)?))
}

/// Keeps the elements with `col - row <op> offset` (tril: `<=`, triu: `>=`), zeroes the rest.
fn tri<'c, 'b>(e: &Emitter<'c, 'b>, t: &T<'c, 'b>, lower: bool, offset: i64) -> R<T<'c, 'b>> {
    let (i, j) = row_col(e, &t.shape)?;
    let d = e.sub(&j, &i)?;
    let k = e.splat(Scalar::Int(offset), &[], I64)?;
    let keep = e.compare(&d, &k, if lower { "LE" } else { "GE" })?;
    let zero = e.splat(Scalar::Int(0), &[], t.dtype)?;
    e.select(&keep, t, &zero, t.dtype)
}

/// `eye(m, n)` broadcast over `batch`.
fn eye<'c, 'b>(e: &Emitter<'c, 'b>, b: &[i64], m: i64, n: i64, dtype: DType) -> R<T<'c, 'b>> {
    let shape = with_last2(b, m, n);
    let (i, j) = row_col(e, &shape)?;
    let on = e.compare(&i, &j, "EQ")?;
    e.convert(&on, dtype)
}

/// The diagonal (`min(m, n)` long) of a stack of matrices.
fn diagonal<'c, 'b>(e: &Emitter<'c, 'b>, t: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let k = rows(t).min(cols(t));
    let sq = e.slice(
        t,
        &vec![0; t.rank()],
        &with_last2(&batch(t), k, k),
        &vec![1; t.rank()],
    )?;
    let (i, j) = row_col(e, &sq.shape)?;
    let on = e.compare(&i, &j, "EQ")?;
    let zero = e.splat(Scalar::Int(0), &[], t.dtype)?;
    let masked = e.select(&on, &sq, &zero, t.dtype)?;
    e.reduce(&masked, &[t.rank() as i64 - 1], ReduceKind::Sum, false)
}

fn reverse<'c, 'b>(e: &Emitter<'c, 'b>, t: &T<'c, 'b>, dim: i64) -> R<T<'c, 'b>> {
    e.op(
        "stablehlo.reverse",
        &[t],
        &[("dimensions", array_i64(&[dim]))],
        &t.shape,
        t.dtype,
    )
}

fn custom_call<'c, 'b>(
    e: &Emitter<'c, 'b>,
    target: &str,
    operands: &[&T<'c, 'b>],
    backend_config: &str,
    results: &[(Vec<i64>, DType)],
) -> R<Vec<T<'c, 'b>>> {
    e.op_n(
        "stablehlo.custom_call",
        operands,
        &[
            ("call_target_name", format!("\"{target}\"")),
            ("backend_config", format!("\"{backend_config}\"")),
            ("api_version", "1 : i32".into()),
        ],
        results,
        vec![],
    )
}

/// Zeros of result `k`'s recorded type (for empty results).
fn zeros_of<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, k: usize) -> R<T<'c, 'b>> {
    let (shape, dtype) = cx.out(k)?;
    cx.e.splat(Scalar::Int(0), &shape, dtype)
}

fn is_empty(t: &T) -> bool {
    t.shape.contains(&0)
}

/// Results `from..` that no op reads, as zeros; a read one is an error naming `why`.
fn not_computed<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, k: usize, why: &str) -> R<T<'c, 'b>> {
    if cx.result_used(k) && cx.out(k).map(|(s, _)| !s.contains(&0)).unwrap_or(true) {
        return Err(cx.err(format!("result {k} is not supported: {why}")));
    }
    zeros_of(cx, k)
}

/// Sum over `dim` of `t` where `mask`, else zero: picks one row/column/element exactly.
fn pick<'c, 'b>(e: &Emitter<'c, 'b>, t: &T<'c, 'b>, mask: &T<'c, 'b>, dim: i64) -> R<T<'c, 'b>> {
    let zero = e.splat(Scalar::Int(0), &[], t.dtype)?;
    let m = e.select(mask, t, &zero, t.dtype)?;
    e.reduce(&m, &[dim], ReduceKind::Sum, false)
}

/// Inserts a size-1 dim at `dim` (counted on the result).
fn unsqueeze<'c, 'b>(e: &Emitter<'c, 'b>, t: &T<'c, 'b>, dim: usize) -> R<T<'c, 'b>> {
    let mut s = t.shape.clone();
    s.insert(dim, 1);
    e.reshape(t, &s)
}

// ---------------------------------------------------------------------------------------------
// LU with partial pivoting

struct Lu<'c, 'b> {
    lu: T<'c, 'b>,
    /// 1-based row swaps, as LAPACK returns them (int32).
    pivots: T<'c, 'b>,
    /// LAPACK's `info`: the 1-based index of the first zero on U's diagonal, else 0 (int32).
    info: T<'c, 'b>,
}

/// LU factorization of `a` (..., m, n) with partial pivoting, like LAPACK's `getrf`.
fn lu_factor<'c, 'b>(e: &Emitter<'c, 'b>, a: &T<'c, 'b>) -> R<Lu<'c, 'b>> {
    let (m, n) = (rows(a), cols(a));
    let k = m.min(n);
    let b = batch(a);
    let r = a.rank() as i64;
    let mut pshape = b.clone();
    pshape.push(k);
    let piv0 = e.splat(Scalar::Int(0), &pshape, DType::Int32)?;
    let out = e.fori(k, &[a.clone(), piv0], |e, kk, c| {
        let (x, piv) = (&c[0], &c[1]);
        let (i, j) = row_col(e, &x.shape)?;
        let is_col = e.compare(&j, kk, "EQ")?;
        let col = pick(e, x, &is_col, r - 1)?; // (..., m)
                                               // Pivot: first row >= k of largest magnitude.
        let ri = e.iota(&col.shape, r - 2, I64)?;
        let below = e.compare(&ri, kk, "GE")?;
        let mag = e.unary("stablehlo.abs", &col)?;
        let neg = e.splat(Scalar::Float(-1.0), &[], col.dtype)?;
        let mag = e.select(&below, &mag, &neg, col.dtype)?;
        let best = e.reduce(&mag, &[r - 2], ReduceKind::Max, true)?;
        let is_best = e.compare(&mag, &best, "EQ")?;
        let big = e.splat(Scalar::Int(m), &[], I64)?;
        let cand = e.select(&is_best, &ri, &big, I64)?;
        let p = e.reduce(&cand, &[r - 2], ReduceKind::Min, false)?; // (...)
        let p = e.select(&e.compare(&p, &big, "GE")?, kk, &p, I64)?;
        // Swap rows k and p.
        let pb = unsqueeze(e, &unsqueeze(e, &p, b.len())?, b.len() + 1)?;
        let is_k = e.compare(&i, kk, "EQ")?;
        let is_p = e.compare(&i, &pb, "EQ")?;
        let row_k = unsqueeze(e, &pick(e, x, &is_k, r - 2)?, b.len())?;
        let row_p = unsqueeze(e, &pick(e, x, &is_p, r - 2)?, b.len())?;
        let x = e.select(&is_p, &row_k, x, x.dtype)?;
        let x = e.select(&is_k, &row_p, &x, x.dtype)?;
        // Eliminate below the pivot (LAPACK scales by the reciprocal of a nonzero pivot).
        let col = unsqueeze(e, &pick(e, &x, &is_col, r - 1)?, b.len() + 1)?; // (..., m, 1)
        let jr = e.iota(&row_p.shape, r - 1, I64)?;
        let pv = pick(e, &row_p, &e.compare(&jr, kk, "EQ")?, r - 1)?; // (..., 1)
        let pv = unsqueeze(e, &pv, b.len() + 1)?;
        let zero = e.splat(Scalar::Int(0), &[], x.dtype)?;
        let one = e.splat(Scalar::Int(1), &[], x.dtype)?;
        let l = e.mul(&col, &e.div(&one, &pv)?)?;
        let l = e.select(&e.compare(&pv, &zero, "EQ")?, &col, &l, x.dtype)?;
        let below_i = e.compare(&i, kk, "GT")?;
        let right_j = e.compare(&j, kk, "GT")?;
        let upd = e.sub(&x, &e.mul(&l, &row_p)?)?;
        let x = e.select(&e.and(&below_i, &right_j)?, &upd, &x, x.dtype)?;
        let l_full = e.broadcast_to(&l, &x.shape)?;
        let x = e.select(&e.and(&below_i, &is_col)?, &l_full, &x, x.dtype)?;
        // Record the 1-based pivot.
        let pi = e.iota(&piv.shape, piv.rank() as i64 - 1, I64)?;
        let p1 = e.convert(
            &e.add(&p, &e.splat(Scalar::Int(1), &[], I64)?)?,
            DType::Int32,
        )?;
        let p1 = unsqueeze(e, &p1, b.len())?;
        let piv = e.select(&e.compare(&pi, kk, "EQ")?, &p1, piv, DType::Int32)?;
        Ok(vec![x, piv])
    })?;
    let lu = out[0].clone();
    let pivots = out[1].clone();
    let d = diagonal(e, &lu)?;
    let zero = e.splat(Scalar::Int(0), &[], d.dtype)?;
    let di = e.iota(&d.shape, d.rank() as i64 - 1, I64)?;
    let di = e.add(&di, &e.splat(Scalar::Int(1), &[], I64)?)?;
    let big = e.splat(Scalar::Int(i64::MAX), &[], I64)?;
    let at = e.select(&e.compare(&d, &zero, "EQ")?, &di, &big, I64)?;
    let first = e.reduce(&at, &[d.rank() as i64 - 1], ReduceKind::Min, false)?;
    let zero_i = e.splat(Scalar::Int(0), &[], I64)?;
    let info = e.select(&e.compare(&first, &big, "EQ")?, &zero_i, &first, I64)?;
    let info = e.convert(&info, DType::Int32)?;
    Ok(Lu { lu, pivots, info })
}

/// The permutation the 1-based row swaps `pivots` (..., k) make of `0..m`: row `i` of `L U` is
/// row `perm[i]` of `A` (int64, (..., m)).
fn permutation<'c, 'b>(e: &Emitter<'c, 'b>, pivots: &T<'c, 'b>, m: i64) -> R<T<'c, 'b>> {
    let k = pivots.shape[pivots.rank() - 1];
    let b = pivots.shape[..pivots.rank() - 1].to_vec();
    let mut shape = b.clone();
    shape.push(m);
    let nd = shape.len() as i64 - 1;
    let perm0 = e.iota(&shape, nd, I64)?;
    let piv = e.convert(pivots, I64)?;
    let out = e.fori(k, &[perm0, piv], |e, kk, c| {
        let (perm, piv) = (&c[0], &c[1]);
        let ki = e.iota(&piv.shape, nd, I64)?;
        let p = pick(e, piv, &e.compare(&ki, kk, "EQ")?, nd)?;
        let p = e.sub(&p, &e.splat(Scalar::Int(1), &[], I64)?)?;
        let p = unsqueeze(e, &p, b.len())?;
        let ii = e.iota(&perm.shape, nd, I64)?;
        let is_k = e.compare(&ii, kk, "EQ")?;
        let is_p = e.compare(&ii, &p, "EQ")?;
        let at_k = unsqueeze(e, &pick(e, perm, &is_k, nd)?, b.len())?;
        let at_p = unsqueeze(e, &pick(e, perm, &is_p, nd)?, b.len())?;
        let perm = e.select(&is_p, &at_k, perm, I64)?;
        let perm = e.select(&is_k, &at_p, &perm, I64)?;
        Ok(vec![perm, piv.clone()])
    })?;
    Ok(out[0].clone())
}

/// Rows of `x` (..., m, n) reordered: row `i` of the result is row `perm[i]` of `x` (a gather;
/// `perm` is (..., m) int64 with values in range).
fn gather_rows<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>, perm: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let (m, n) = (rows(x), cols(x));
    let b = batch(x);
    let nb: i64 = b.iter().product();
    let x3 = e.reshape(x, &[nb, m, n])?;
    let p = e.reshape(perm, &[nb, m, 1])?;
    let bi = e.iota(&[nb, m, 1], 0, I64)?;
    let idx = e.concatenate(&[&bi, &p], 2)?;
    let g = e.op(
        "stablehlo.gather",
        &[&x3, &idx],
        &[
            (
                "dimension_numbers",
                "#stablehlo.gather<offset_dims = [2], collapsed_slice_dims = [0, 1], start_index_map = [0, 1], index_vector_dim = 2>".into(),
            ),
            ("slice_sizes", array_i64(&[1, 1, n])),
            ("indices_are_sorted", "false".into()),
        ],
        &[nb, m, n],
        x.dtype,
    )?;
    e.reshape(&g, &x.shape)
}

/// Rows of `x` placed back: row `perm[i]` of the result is row `i` of `x` (a gather with the
/// inverse permutation, built from `perm` by a one-hot sum of integers).
fn scatter_rows<'c, 'b>(e: &Emitter<'c, 'b>, x: &T<'c, 'b>, perm: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let m = rows(x);
    let nb = perm.rank();
    // inv[r] = sum_i i [perm[i] == r], over a (..., r, i) grid.
    let mut grid = perm.shape[..nb - 1].to_vec();
    grid.extend([m, m]);
    let r_idx = e.iota(&grid, nb as i64 - 1, I64)?;
    let i_idx = e.iota(&grid, nb as i64, I64)?;
    let mut pdims: Vec<i64> = (0..nb as i64 - 1).collect();
    pdims.push(nb as i64);
    let pb = e.broadcast_in_dim(perm, &grid, &pdims)?;
    let inv = pick(e, &i_idx, &e.compare(&pb, &r_idx, "EQ")?, nb as i64)?;
    gather_rows(e, x, &inv)
}

/// Which system [`tri_solve`] solves with its triangular `a`.
#[derive(Clone, Copy)]
struct Triangular {
    /// `op(a) X = b` (else `X op(a) = b`).
    left: bool,
    /// `a`'s lower triangle is read (else its upper one).
    lower: bool,
    /// `a`'s diagonal is taken as ones.
    unit_diagonal: bool,
    /// `op(a)` is `a` transposed.
    transpose: bool,
}

/// `op(a) X = b` (left) or `X op(a) = b` with `a` triangular; batch dims must match.
fn tri_solve<'c, 'b>(
    e: &Emitter<'c, 'b>,
    a: &T<'c, 'b>,
    b: &T<'c, 'b>,
    Triangular {
        left,
        lower,
        unit_diagonal,
        transpose,
    }: Triangular,
) -> R<T<'c, 'b>> {
    if is_empty(a) || is_empty(b) {
        return e.splat(Scalar::Int(0), &b.shape, b.dtype);
    }
    let ta = if transpose {
        "TRANSPOSE"
    } else {
        "NO_TRANSPOSE"
    };
    e.op(
        "stablehlo.triangular_solve",
        &[a, b],
        &[
            ("left_side", left.to_string()),
            ("lower", lower.to_string()),
            ("unit_diagonal", unit_diagonal.to_string()),
            ("transpose_a", format!("#stablehlo<transpose {ta}>")),
        ],
        &b.shape,
        b.dtype,
    )
}

/// Solves `A X = B` (or `A^T X = B` when `adjoint`) from `A = P L U`; `perm` from
/// [`permutation`].
fn lu_solve_with<'c, 'b>(
    e: &Emitter<'c, 'b>,
    lu: &T<'c, 'b>,
    perm: &T<'c, 'b>,
    rhs: &T<'c, 'b>,
    adjoint: bool,
) -> R<T<'c, 'b>> {
    if !adjoint {
        let y = gather_rows(e, rhs, perm)?;
        let y = tri_solve(
            e,
            lu,
            &y,
            Triangular {
                left: true,
                lower: true,
                unit_diagonal: true,
                transpose: false,
            },
        )?;
        tri_solve(
            e,
            lu,
            &y,
            Triangular {
                left: true,
                lower: false,
                unit_diagonal: false,
                transpose: false,
            },
        )
    } else {
        let y = tri_solve(
            e,
            lu,
            rhs,
            Triangular {
                left: true,
                lower: false,
                unit_diagonal: false,
                transpose: true,
            },
        )?;
        let y = tri_solve(
            e,
            lu,
            &y,
            Triangular {
                left: true,
                lower: true,
                unit_diagonal: true,
                transpose: true,
            },
        )?;
        scatter_rows(e, &y, perm)
    }
}

fn lu_factor_ex<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let a = cx.tensor(0, "A")?;
    if !cx.bool_or(1, "pivot", true)? {
        return Err(cx.err("LU without pivoting is not supported (nor on PyTorch's CPU)"));
    }
    let f = lu_factor(cx.e, &a)?;
    Ok(vec![f.lu, f.pivots, f.info])
}

/// P, L, U from a packed LU and its pivots.
fn unpack<'c, 'b>(
    e: &Emitter<'c, 'b>,
    lu: &T<'c, 'b>,
    pivots: &T<'c, 'b>,
) -> R<(T<'c, 'b>, T<'c, 'b>, T<'c, 'b>)> {
    let (m, n) = (rows(lu), cols(lu));
    let k = m.min(n);
    let b = batch(lu);
    let r = lu.rank();
    let perm = permutation(e, pivots, m)?;
    // P[r, i] = (r == perm[i]).
    let pshape = with_last2(&b, m, m);
    let ri = e.iota(&pshape, r as i64 - 2, I64)?;
    let pb = unsqueeze(e, &perm, b.len())?;
    let p = e.convert(&e.compare(&ri, &pb, "EQ")?, lu.dtype)?;
    let lpart = e.slice(lu, &vec![0; r], &with_last2(&b, m, k), &vec![1; r])?;
    let l = e.add(&tri(e, &lpart, true, -1)?, &eye(e, &b, m, k, lu.dtype)?)?;
    let upart = e.slice(lu, &vec![0; r], &with_last2(&b, k, n), &vec![1; r])?;
    let u = tri(e, &upart, false, 0)?;
    Ok((p, l, u))
}

fn lu_unpack<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let lu = cx.tensor(0, "LU_data")?;
    let piv = cx.tensor(1, "LU_pivots")?;
    let (p, l, u) = unpack(cx.e, &lu, &piv)?;
    let data = cx.bool_or(2, "unpack_data", true)?;
    let pivs = cx.bool_or(3, "unpack_pivots", true)?;
    Ok(vec![
        if pivs { p } else { zeros_of(cx, 0)? },
        if data { l } else { zeros_of(cx, 1)? },
        if data { u } else { zeros_of(cx, 2)? },
    ])
}

fn linalg_lu<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let a = cx.tensor(0, "A")?;
    if !cx.bool_or(1, "pivot", true)? {
        return Err(cx.err("LU without pivoting is not supported (nor on PyTorch's CPU)"));
    }
    let f = lu_factor(cx.e, &a)?;
    let (p, l, u) = unpack(cx.e, &f.lu, &f.pivots)?;
    Ok(vec![p, l, u])
}

fn lu_solve<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let lu = cx.tensor(0, "LU")?;
    let piv = cx.tensor(1, "pivots")?;
    let rhs = cx.tensor(2, "B")?;
    let left = cx.bool_or(3, "left", true)?;
    let adjoint = cx.bool_or(4, "adjoint", false)?;
    let (shape, dtype) = cx.out(0)?;
    if shape.contains(&0) {
        return Ok(vec![zeros_of(cx, 0)?]);
    }
    let (rhs, adjoint) = if left {
        (rhs, adjoint)
    } else {
        (mt(e, &rhs)?, !adjoint)
    };
    let (lu, rhs) = common_batch(e, &lu, &rhs)?;
    let b = batch(&lu);
    let mut ps = b.clone();
    ps.push(piv.shape[piv.rank() - 1]);
    let piv = e.broadcast_to(&piv, &ps)?;
    let perm = permutation(e, &piv, rows(&lu))?;
    let x = lu_solve_with(e, &lu, &perm, &e.convert(&rhs, lu.dtype)?, adjoint)?;
    let x = if left { x } else { mt(e, &x)? };
    Ok(vec![e.convert(&e.broadcast_to(&x, &shape)?, dtype)?])
}

/// `A X = B` through the LU of `A^T` (as PyTorch does for contiguous inputs: its `info` comes
/// from that factorization).
fn solve_lu<'c, 'b>(
    e: &Emitter<'c, 'b>,
    a: &T<'c, 'b>,
    rhs: &T<'c, 'b>,
) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let at = mt(e, a)?;
    let f = lu_factor(e, &at)?;
    let perm = permutation(e, &f.pivots, rows(a))?;
    let x = lu_solve_with(e, &f.lu, &perm, rhs, true)?;
    Ok((x, f.info))
}

fn inv_ex<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let a = cx.tensor(0, "A")?;
    if is_empty(&a) {
        return Ok(vec![zeros_of(cx, 0)?, zeros_of(cx, 1)?]);
    }
    let id = eye(cx.e, &batch(&a), rows(&a), rows(&a), a.dtype)?;
    let (x, info) = solve_lu(cx.e, &a, &id)?;
    Ok(vec![x, info])
}

fn solve_ex<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let a = cx.tensor(0, "A")?;
    let rhs = cx.tensor(1, "B")?;
    let left = cx.bool_or(2, "left", true)?;
    let (shape, dtype) = cx.out(0)?;
    let lu_out = not_computed(cx, 1, LU_LAYOUT)?;
    let piv_out = not_computed(cx, 2, LU_LAYOUT)?;
    if shape.contains(&0) || is_empty(&a) {
        return Ok(vec![zeros_of(cx, 0)?, lu_out, piv_out, zeros_of(cx, 3)?]);
    }
    // B is a (batch of) vector(s) when the result has one dim less than A.
    let vector = shape.len() + 1 == a.rank();
    let rhs = if vector {
        unsqueeze(e, &rhs, rhs.rank())?
    } else {
        rhs
    };
    let (a, rhs) = if left {
        (a, rhs)
    } else {
        // X A = B  <=>  A^T X^T = B^T.
        (mt(e, &a)?, mt(e, &rhs)?)
    };
    let (a, rhs) = common_batch(e, &a, &e.convert(&rhs, a.dtype)?)?;
    let (x, info) = solve_lu(e, &a, &rhs)?;
    let x = if left { x } else { mt(e, &x)? };
    let x = e.reshape(&x, &shape)?;
    let (ishape, _) = cx.out(3)?;
    Ok(vec![
        e.convert(&x, dtype)?,
        lu_out,
        piv_out,
        e.broadcast_to(&info, &ishape)?,
    ])
}

/// The LU of `a`, U's diagonal and the sign of the row permutation (-1 per moved row).
fn det_parts<'c, 'b>(e: &Emitter<'c, 'b>, a: &T<'c, 'b>) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let f = lu_factor(e, a)?;
    let d = diagonal(e, &f.lu)?;
    let last = d.rank() as i64 - 1;
    let ki = e.iota(&f.pivots.shape, last, I64)?;
    let ki = e.add(&ki, &e.splat(Scalar::Int(1), &[], I64)?)?;
    let moved = e.compare(&e.convert(&f.pivots, I64)?, &ki, "NE")?;
    let m1 = e.splat(Scalar::Float(-1.0), &[], d.dtype)?;
    let p1 = e.splat(Scalar::Float(1.0), &[], d.dtype)?;
    let flips = e.select(&moved, &m1, &p1, d.dtype)?;
    let sign = e.reduce(&flips, &[last], ReduceKind::Prod, false)?;
    Ok((d, sign))
}

const LU_LAYOUT: &str = "the LU factors PyTorch returns here depend on the input's memory layout";

fn det<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let a = cx.tensor(0, "A")?;
    let (d, sign) = det_parts(e, &a)?;
    let prod = e.reduce(&d, &[d.rank() as i64 - 1], ReduceKind::Prod, false)?;
    Ok(vec![
        e.mul(&prod, &sign)?,
        not_computed(cx, 1, LU_LAYOUT)?,
        not_computed(cx, 2, LU_LAYOUT)?,
    ])
}

fn slogdet<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let a = cx.tensor(0, "A")?;
    let (d, sign) = det_parts(e, &a)?;
    let last = d.rank() as i64 - 1;
    let sd = e.reduce(
        &e.unary("stablehlo.sign", &d)?,
        &[last],
        ReduceKind::Prod,
        false,
    )?;
    let logabs = e.unary("stablehlo.log", &e.unary("stablehlo.abs", &d)?)?;
    let logabs = e.reduce(&logabs, &[last], ReduceKind::Sum, false)?;
    Ok(vec![
        e.mul(&sd, &sign)?,
        logabs,
        not_computed(cx, 2, LU_LAYOUT)?,
        not_computed(cx, 3, LU_LAYOUT)?,
    ])
}

// ---------------------------------------------------------------------------------------------
// Cholesky and triangular solves

/// Lower Cholesky factor of `a`, reading its lower triangle; NaNs from the first failing column
/// on when `a` is not positive definite.
fn cholesky<'c, 'b>(e: &Emitter<'c, 'b>, a: &T<'c, 'b>) -> R<T<'c, 'b>> {
    if is_empty(a) {
        return Ok(a.clone());
    }
    let l = e.op(
        "stablehlo.cholesky",
        &[a],
        &[("lower", "true".into())],
        &a.shape,
        a.dtype,
    )?;
    tri(e, &l, true, 0)
}

fn cholesky_ex<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let a = cx.tensor(0, "self")?;
    let upper = cx.bool_or(1, "upper", false)?;
    // The upper factor reads A's upper triangle: it is the transposed lower factor of A^T.
    let l = cholesky(e, &if upper { mt(e, &a)? } else { a.clone() })?;
    // info: 1 + the first column whose diagonal failed (NaN), 0 when none did.
    let d = diagonal(e, &l)?;
    let last = d.rank() as i64 - 1;
    let di = e.add(
        &e.iota(&d.shape, last, I64)?,
        &e.splat(Scalar::Int(1), &[], I64)?,
    )?;
    let big = e.splat(Scalar::Int(i64::MAX), &[], I64)?;
    let at = e.select(&e.isnan(&d)?, &di, &big, I64)?;
    let first = e.reduce(&at, &[last], ReduceKind::Min, false)?;
    let zero = e.splat(Scalar::Int(0), &[], I64)?;
    let info = e.select(&e.compare(&first, &big, "EQ")?, &zero, &first, I64)?;
    let l = if upper { mt(e, &l)? } else { l };
    Ok(vec![l, e.convert(&info, DType::Int32)?])
}

fn cholesky_solve<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let rhs = cx.tensor(0, "self")?;
    let f = cx.tensor(1, "input2")?;
    let upper = cx.bool_or(2, "upper", false)?;
    let (f, rhs) = common_batch(e, &f, &rhs)?;
    // A = L L^T: X = L^-T L^-1 B; A = U^T U: X = U^-1 U^-T B.
    let y = tri_solve(
        e,
        &f,
        &rhs,
        Triangular {
            left: true,
            lower: !upper,
            unit_diagonal: false,
            transpose: upper,
        },
    )?;
    let x = tri_solve(
        e,
        &f,
        &y,
        Triangular {
            left: true,
            lower: !upper,
            unit_diagonal: false,
            transpose: !upper,
        },
    )?;
    Ok(vec![e.convert(&x, cx.out_dtype()?)?])
}

fn cholesky_inverse<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let f = cx.tensor(0, "self")?;
    let upper = cx.bool_or(1, "upper", false)?;
    let n = rows(&f);
    let id = eye(e, &batch(&f), n, n, f.dtype)?;
    let y = tri_solve(
        e,
        &f,
        &id,
        Triangular {
            left: true,
            lower: !upper,
            unit_diagonal: false,
            transpose: upper,
        },
    )?;
    let x = tri_solve(
        e,
        &f,
        &y,
        Triangular {
            left: true,
            lower: !upper,
            unit_diagonal: false,
            transpose: !upper,
        },
    )?;
    Ok(vec![x])
}

fn triangular_solve<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let rhs = cx.tensor(0, "self")?;
    let a = cx.tensor(1, "A")?;
    let upper = cx.bool_or(2, "upper", true)?;
    let transpose = cx.bool_or(3, "transpose", false)?;
    let unit = cx.bool_or(4, "unitriangular", false)?;
    let (a, rhs) = common_batch(e, &a, &rhs)?;
    let x = tri_solve(
        e,
        &a,
        &rhs,
        Triangular {
            left: true,
            lower: !upper,
            unit_diagonal: unit,
            transpose,
        },
    )?;
    let (cshape, _) = cx.out(1)?;
    Ok(vec![x, e.broadcast_to(&a, &cshape)?])
}

fn solve_triangular<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let a = cx.tensor(0, "self")?;
    let rhs = cx.tensor(1, "B")?;
    let upper = match cx.arg(2, "upper") {
        Some(Arg::Bool(b)) => *b,
        _ => return Err(cx.err("`upper` must be given")),
    };
    let left = cx.bool_or(3, "left", true)?;
    let unit = cx.bool_or(4, "unitriangular", false)?;
    let (a, rhs) = common_batch(e, &a, &rhs)?;
    Ok(vec![tri_solve(
        e,
        &a,
        &rhs,
        Triangular {
            left,
            lower: !upper,
            unit_diagonal: unit,
            transpose: false,
        },
    )?])
}

// ---------------------------------------------------------------------------------------------
// QR (XLA's Householder expanders)

fn geqrf_of<'c, 'b>(e: &Emitter<'c, 'b>, a: &T<'c, 'b>) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let k = rows(a).min(cols(a));
    let mut ts = batch(a);
    ts.push(k);
    if is_empty(a) {
        return Ok((a.clone(), e.splat(Scalar::Int(0), &ts, a.dtype)?));
    }
    let r = custom_call(
        e,
        "Qr",
        &[a],
        "",
        &[(a.shape.clone(), a.dtype), (ts, a.dtype)],
    )?;
    Ok((r[0].clone(), r[1].clone()))
}

/// `H_1 ... H_k` applied to the first `n` columns of the identity (LAPACK's `orgqr`).
fn householder<'c, 'b>(e: &Emitter<'c, 'b>, a: &T<'c, 'b>, tau: &T<'c, 'b>) -> R<T<'c, 'b>> {
    if is_empty(a) {
        return Ok(a.clone());
    }
    if tau.shape[tau.rank() - 1] == 0 {
        return eye(e, &batch(a), rows(a), cols(a), a.dtype);
    }
    Ok(custom_call(
        e,
        "ProductOfElementaryHouseholderReflectors",
        &[a, tau],
        "",
        &[(a.shape.clone(), a.dtype)],
    )?
    .remove(0))
}

/// The full m x m orthogonal factor from reflectors `a` (..., m, k) and `tau` (..., k).
fn full_q<'c, 'b>(e: &Emitter<'c, 'b>, a: &T<'c, 'b>, tau: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let (m, k) = (rows(a), cols(a));
    let nb = batch(a).len();
    let zero = e.splat(Scalar::Int(0), &[], a.dtype)?;
    let pad = |t: &T<'c, 'b>, dim: usize, to: i64| e.pad_end(t, &zero, dim, to);
    let (a2, t2) = if k < m {
        (pad(a, nb + 1, m)?, pad(tau, nb, m)?)
    } else if k > m {
        let r = a.rank();
        let mut hi = a.shape.clone();
        hi[nb + 1] = m;
        let mut th = tau.shape.clone();
        th[nb] = m;
        (
            e.slice(a, &vec![0; r], &hi, &vec![1; r])?,
            e.slice(tau, &vec![0; tau.rank()], &th, &vec![1; tau.rank()])?,
        )
    } else {
        (a.clone(), tau.clone())
    };
    householder(e, &a2, &t2)
}

fn geqrf<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let a = cx.tensor(0, "self")?;
    let (r, tau) = geqrf_of(cx.e, &a)?;
    Ok(vec![r, tau])
}

fn qr<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let a = cx.tensor(0, "A")?;
    let mode = match cx.arg(1, "mode") {
        None | Some(Arg::None) => "reduced".to_string(),
        Some(Arg::Str(s)) => s.clone(),
        other => return Err(cx.err(format!("`mode`: expected a string, got {other:?}"))),
    };
    let (m, n) = (rows(&a), cols(&a));
    let k = m.min(n);
    let b = batch(&a);
    let r = a.rank();
    let (h, tau) = geqrf_of(e, &a)?;
    let (q, rr) = match mode.as_str() {
        "reduced" => {
            let hk = e.slice(&h, &vec![0; r], &with_last2(&b, m, k), &vec![1; r])?;
            let rk = e.slice(&h, &vec![0; r], &with_last2(&b, k, n), &vec![1; r])?;
            (householder(e, &hk, &tau)?, tri(e, &rk, false, 0)?)
        }
        "complete" => {
            let hk = e.slice(&h, &vec![0; r], &with_last2(&b, m, k), &vec![1; r])?;
            (full_q(e, &hk, &tau)?, tri(e, &h, false, 0)?)
        }
        "r" => {
            let rk = e.slice(&h, &vec![0; r], &with_last2(&b, k, n), &vec![1; r])?;
            (zeros_of(cx, 0)?, tri(e, &rk, false, 0)?)
        }
        other => return Err(cx.err(format!("unknown mode `{other}`"))),
    };
    Ok(vec![q, rr])
}

fn householder_product<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let a = cx.tensor(0, "self")?;
    let tau = cx.tensor(1, "tau")?;
    Ok(vec![householder(cx.e, &a, &tau)?])
}

fn ormqr<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let a = cx.tensor(0, "self")?;
    let tau = cx.tensor(1, "input2")?;
    let c = cx.tensor(2, "input3")?;
    let left = cx.bool_or(3, "left", true)?;
    let transpose = cx.bool_or(4, "transpose", false)?;
    if is_empty(&c) {
        return Ok(vec![zeros_of(cx, 0)?]);
    }
    let q = full_q(e, &a, &tau)?;
    let q = if transpose { mt(e, &q)? } else { q };
    let (q, c) = common_batch(e, &q, &c)?;
    let r = if left {
        bmm(e, &q, &c)?
    } else {
        bmm(e, &c, &q)?
    };
    Ok(vec![r])
}

// ---------------------------------------------------------------------------------------------
// Symmetric eigenvalues, singular values and functions of them (float64 inside)

/// Eigenvalues (ascending) and eigenvectors (columns) of the symmetric float64 `a`, reading
/// its lower triangle (mirrored first, so nothing depends on what the expander reads).
fn eigh<'c, 'b>(e: &Emitter<'c, 'b>, a: &T<'c, 'b>) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let n = rows(a);
    let mut ws = batch(a);
    ws.push(n);
    if is_empty(a) {
        return Ok((e.splat(Scalar::Int(0), &ws, a.dtype)?, a.clone()));
    }
    let (i, j) = row_col(e, &a.shape)?;
    let low = e.compare(&i, &j, "GE")?;
    let sym = e.select(&low, a, &mt(e, a)?, a.dtype)?;
    let tol = if a.dtype == F64 { "1e-15" } else { "1e-6" };
    let r = custom_call(
        e,
        "Eigh",
        &[&sym],
        &format!("1,1,100,{tol}"),
        &[(a.shape.clone(), a.dtype), (ws, a.dtype)],
    )?;
    Ok((r[1].clone(), r[0].clone()))
}

const VECTORS: &str = "eigenvectors and singular vectors are not supported (their signs follow \
                       LAPACK's internal choices); only values and functions of them are";

fn eigh_rule<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let a = cx.tensor(0, "A")?;
    let upper = matches!(cx.arg(1, "UPLO"), Some(Arg::Str(s)) if s == "U");
    let a = if upper { mt(e, &a)? } else { a };
    let vectors = not_computed(cx, 1, VECTORS)?;
    let (w, _) = eigh(e, &e.convert(&a, F64)?)?;
    Ok(vec![e.convert(&w, cx.out_dtype()?)?, vectors])
}

/// Gram matrix of `a` (float64) over its shorter side: `A^T A` when m >= n, else `A A^T`.
fn gram<'c, 'b>(e: &Emitter<'c, 'b>, a: &T<'c, 'b>) -> R<T<'c, 'b>> {
    if rows(a) >= cols(a) {
        bmm(e, &mt(e, a)?, a)
    } else {
        bmm(e, a, &mt(e, a)?)
    }
}

/// Singular values (descending, float64) and the Gram eigenvectors of `a` (float64).
fn singular<'c, 'b>(e: &Emitter<'c, 'b>, a: &T<'c, 'b>) -> R<(T<'c, 'b>, T<'c, 'b>, T<'c, 'b>)> {
    let (w, v) = eigh(e, &gram(e, a)?)?;
    let zero = e.splat(Scalar::Int(0), &[], F64)?;
    let w = e.op(
        "stablehlo.maximum",
        &[&w, &e.broadcast_to(&zero, &w.shape)?],
        &[],
        &w.shape,
        F64,
    )?;
    let s = e.unary("stablehlo.sqrt", &w)?;
    Ok((reverse(e, &s, s.rank() as i64 - 1)?, w, v))
}

fn svd<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let a = cx.tensor(0, "A")?;
    let u = not_computed(cx, 0, VECTORS)?;
    let vh = not_computed(cx, 2, VECTORS)?;
    let (sshape, dtype) = cx.out(1)?;
    if sshape.contains(&0) {
        return Ok(vec![u, zeros_of(cx, 1)?, vh]);
    }
    let (s, _, _) = singular(e, &e.convert(&a, F64)?)?;
    Ok(vec![u, e.convert(&s, dtype)?, vh])
}

/// `V diag(f) V^T` for eigenvectors `v` (columns) and values `f` (..., n).
fn v_diag_vt<'c, 'b>(e: &Emitter<'c, 'b>, v: &T<'c, 'b>, f: &T<'c, 'b>) -> R<T<'c, 'b>> {
    let fb = unsqueeze(e, f, f.rank() - 1)?;
    let vf = e.mul(v, &e.broadcast_to(&fb, &v.shape)?)?;
    bmm(e, &vf, &mt(e, v)?)
}

fn opt_f64<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, i: usize, name: &str) -> R<Option<T<'c, 'b>>> {
    match cx.arg(i, name) {
        None | Some(Arg::None) => Ok(None),
        Some(Arg::Value(_)) => Ok(Some(cx.e.convert(&cx.tensor(i, name)?, F64)?)),
        Some(_) => {
            let s = cx.scalar(i, name)?;
            Ok(Some(cx.e.splat(s, &[], F64)?))
        }
    }
}

fn pinv<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let a = cx.tensor(0, "self")?;
    let hermitian = cx.bool_or(3, "hermitian", false)?;
    let (shape, dtype) = cx.out(0)?;
    if shape.contains(&0) || is_empty(&a) {
        return Ok(vec![zeros_of(cx, 0)?]);
    }
    let (m, n) = (rows(&a), cols(&a));
    // PyTorch's defaults: atol 0; rtol eps * max(m, n), or 0 when only a positive atol is given.
    let eps = match a.dtype {
        DType::Float64 => f64::EPSILON,
        _ => f32::EPSILON as f64,
    };
    let atol = opt_f64(cx, 1, "atol")?;
    let rtol = opt_f64(cx, 2, "rtol")?;
    let default_rtol = e.k(eps * m.max(n) as f64, F64)?;
    let zero = e.k(0.0, F64)?;
    let rtol = match (rtol, &atol) {
        (Some(r), _) => r,
        (None, Some(at)) => e.select(&e.compare(at, &zero, "GT")?, &zero, &default_rtol, F64)?,
        (None, None) => default_rtol,
    };
    let atol = atol.unwrap_or(zero.clone());
    let a64 = e.convert(&a, F64)?;
    let last = a.rank() - 2; // the values' last dim
    let tol_for = |smax: &T<'c, 'b>| -> R<T<'c, 'b>> {
        let at = unsqueeze(e, &atol, atol.rank())?;
        let rt = unsqueeze(e, &rtol, rtol.rank())?;
        let t = e.mul(&rt, smax)?;
        let at = e.broadcast_to(&at, &t.shape)?;
        e.op("stablehlo.maximum", &[&at, &t], &[], &t.shape.clone(), F64)
    };
    let one = e.k(1.0, F64)?;
    let r = if hermitian {
        let (w, v) = eigh(e, &a64)?;
        let absw = e.unary("stablehlo.abs", &w)?;
        let smax = e.reduce(&absw, &[last as i64], ReduceKind::Max, true)?;
        let tol = tol_for(&smax)?;
        let (absw, tol) = e.coerce(&absw, &tol, F64)?;
        let keep = e.compare(&absw, &tol, "GT")?;
        let inv = e.select(&keep, &e.div(&one, &w)?, &zero, F64)?;
        v_diag_vt(e, &v, &inv)?
    } else {
        let (s, w, v) = singular(e, &a64)?;
        let smax = e.slice(
            &s,
            &vec![0; s.rank()],
            &{
                let mut l = s.shape.clone();
                l[last] = 1;
                l
            },
            &vec![1; s.rank()],
        )?;
        let tol = tol_for(&smax)?;
        // Same threshold on the ascending sqrt(w) as on the descending s.
        let sw = e.unary("stablehlo.sqrt", &w)?;
        let (sw, tol) = e.coerce(&sw, &tol, F64)?;
        let keep = e.compare(&sw, &tol, "GT")?;
        let inv2 = e.select(&keep, &e.div(&one, &w)?, &zero, F64)?;
        let g = v_diag_vt(e, &v, &inv2)?;
        if m >= n {
            bmm(e, &g, &mt(e, &a64)?)?
        } else {
            bmm(e, &mt(e, &a64)?, &g)?
        }
    };
    let r = e.broadcast_to(&r, &shape)?;
    Ok(vec![e.convert(&r, dtype)?])
}

fn matrix_sqrth<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let a = cx.tensor(0, "A")?;
    if is_empty(&a) {
        return Ok(vec![zeros_of(cx, 0)?]);
    }
    let (w, v) = eigh(e, &e.convert(&a, F64)?)?;
    let r = v_diag_vt(e, &v, &e.unary("stablehlo.sqrt", &w)?)?;
    Ok(vec![e.convert(&r, cx.out_dtype()?)?])
}

/// Polar decomposition A = U H (m >= n): H = (A^T A)^(1/2), U = A H^-1.
fn polar<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let a = cx.tensor(0, "A")?;
    if is_empty(&a) {
        return Ok(vec![zeros_of(cx, 0)?, zeros_of(cx, 1)?]);
    }
    if rows(&a) < cols(&a) {
        return Err(cx.err("the polar decomposition of a wide matrix (m < n) is not supported"));
    }
    let a64 = e.convert(&a, F64)?;
    let (w, v) = eigh(e, &bmm(e, &mt(e, &a64)?, &a64)?)?;
    let zero = e.k(0.0, F64)?;
    let w = e.op(
        "stablehlo.maximum",
        &[&w, &e.broadcast_to(&zero, &w.shape)?],
        &[],
        &w.shape,
        F64,
    )?;
    let s = e.unary("stablehlo.sqrt", &w)?;
    let h = v_diag_vt(e, &v, &s)?;
    let one = e.k(1.0, F64)?;
    let hinv = v_diag_vt(e, &v, &e.div(&one, &s)?)?;
    let u = bmm(e, &a64, &hinv)?;
    let dtype = cx.out_dtype()?;
    Ok(vec![e.convert(&u, dtype)?, e.convert(&h, dtype)?])
}

/// exp(A) by scaling and squaring in float64: A / 2^s with its 1-norm <= 1/2, a degree-18
/// Taylor polynomial (truncation error below 1e-22), then s squarings (per matrix).
fn matrix_exp<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let a = cx.tensor(0, "self")?;
    let dtype = cx.out_dtype()?;
    if is_empty(&a) {
        return Ok(vec![zeros_of(cx, 0)?]);
    }
    let a64 = e.convert(&a, F64)?;
    let r = a.rank() as i64;
    let n = rows(&a);
    let b = batch(&a);
    // 1-norm: max column sum of |A|.
    let colsum = e.reduce(
        &e.unary("stablehlo.abs", &a64)?,
        &[r - 2],
        ReduceKind::Sum,
        false,
    )?;
    let norm = e.reduce(&colsum, &[r - 2], ReduceKind::Max, false)?; // (...)
    let ratio = e.div(&norm, &e.k(0.5, F64)?)?;
    let s = e.div(
        &e.unary("stablehlo.log", &ratio)?,
        &e.k(std::f64::consts::LN_2, F64)?,
    )?;
    let s = e.unary("stablehlo.ceil", &s)?;
    let s = e.op(
        "stablehlo.clamp",
        &[&e.k(0.0, F64)?, &s, &e.k(64.0, F64)?],
        &[],
        &s.shape,
        F64,
    )?;
    // A NaN norm gives NaN results anyway: no squarings for it.
    let s = e.select(&e.isnan(&s)?, &e.k(0.0, F64)?, &s, F64)?;
    let two = e.broadcast_to(&e.k(2.0, F64)?, &s.shape)?;
    let scale = e.op("stablehlo.power", &[&two, &s], &[], &s.shape, F64)?;
    let sb = unsqueeze(e, &unsqueeze(e, &scale, b.len())?, b.len() + 1)?;
    let x = e.div(&a64, &e.broadcast_to(&sb, &a64.shape)?)?;
    // Horner: I + X (I + X/2 (I + X/3 (...))).
    let id = eye(e, &b, n, n, F64)?;
    let mut p = id.clone();
    for k in (1..=18).rev() {
        let xk = e.mul(&x, &e.k(1.0 / k as f64, F64)?)?;
        p = e.add(&id, &bmm(e, &xk, &p)?)?;
    }
    let steps = e.convert(&s, I64)?;
    let max_steps = e.reduce(
        &steps,
        &(0..steps.rank() as i64).collect::<Vec<_>>(),
        ReduceKind::Max,
        false,
    )?;
    // Square while k < s (per matrix), up to the largest s.
    let out = {
        let mut types = vec![(vec![], I64)];
        types.push((p.shape.clone(), F64));
        types.push((steps.shape.clone(), I64));
        types.push((vec![], I64));
        let nb = b.len();
        let cond = e.region_of(&types, |e, a| Ok(vec![e.compare(&a[0], &a[3], "LT")?]))?;
        let body = e.region_of(&types, move |e, a| {
            let (k, p, steps, mx) = (&a[0], &a[1], &a[2], &a[3]);
            let sq = bmm(e, p, p)?;
            let go = e.compare(steps, k, "GT")?;
            let go = unsqueeze(e, &unsqueeze(e, &go, nb)?, nb + 1)?;
            let p = e.select(&go, &sq, p, F64)?;
            let one = e.splat(Scalar::Int(1), &[], I64)?;
            Ok(vec![e.add(k, &one)?, p, steps.clone(), mx.clone()])
        })?;
        let k0 = e.splat(Scalar::Int(0), &[], I64)?;
        e.op_n(
            "stablehlo.while",
            &[&k0, &p, &steps, &max_steps],
            &[],
            &types,
            vec![cond, body],
        )?
    };
    Ok(vec![e.convert(&out[1], dtype)?])
}
