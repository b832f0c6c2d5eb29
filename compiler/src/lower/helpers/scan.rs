//! Scans (running reductions) along one dim: cumulative ops, embedding bags, searches.

use crate::lower::emit::{array_i64, Emitter};
use crate::lower::{ReduceKind, Scalar, R, T};
use melior::ir::Region;
use tpuc_frontend_fx::DType;

/// An inclusive scan of `operands` along `d` (all of one shape): a reduce_window whose window
/// covers everything up to each element (the window's length of low padding, filled with
/// `inits`), combined by `region`.
pub fn scan<'c, 'b>(
    e: &Emitter<'c, 'b>,
    operands: &[&T<'c, 'b>],
    inits: &[&T<'c, 'b>],
    d: usize,
    region: Region<'c>,
) -> R<Vec<T<'c, 'b>>> {
    let n = operands[0].shape[d];
    if operands.len() > 1 && n > 16 && !(n as u64).is_power_of_two() {
        // XLA's CPU plugin miscompiles a scan over several operands whose length is not a power
        // of two ("The shape doesn't match when replacing 'reduce-window'", a compile error):
        // scan a power-of-two length instead. Elements after the n-th cannot change the first
        // n results of a prefix scan, so the padding only needs the right types.
        let full = (n as u64).next_power_of_two() as i64;
        let padded: Vec<T<'c, 'b>> = operands
            .iter()
            .zip(inits)
            .map(|(t, init)| e.pad_end(t, init, d, full))
            .collect::<R<_>>()?;
        let refs: Vec<&T<'c, 'b>> = padded.iter().collect();
        let scanned = scan_window(e, &refs, inits, d, region)?;
        let start = vec![0; operands[0].rank()];
        let strides = vec![1; operands[0].rank()];
        return scanned
            .iter()
            .zip(operands)
            .map(|(t, o)| e.slice(t, &start, &o.shape, &strides))
            .collect();
    }
    scan_window(e, operands, inits, d, region)
}

/// [`scan`] as one `reduce_window` whose window spans the whole dim.
fn scan_window<'c, 'b>(
    e: &Emitter<'c, 'b>,
    operands: &[&T<'c, 'b>],
    inits: &[&T<'c, 'b>],
    d: usize,
    region: Region<'c>,
) -> R<Vec<T<'c, 'b>>> {
    let x = operands[0];
    let r = x.rank();
    let n = x.shape[d];
    let mut window = vec![1; r];
    window[d] = n.max(1);
    let pads: Vec<String> = (0..r)
        .map(|k| {
            if k == d {
                format!("[{}, 0]", (n - 1).max(0))
            } else {
                "[0, 0]".into()
            }
        })
        .collect();
    let all: Vec<&T> = operands.iter().chain(inits).copied().collect();
    let results: Vec<(Vec<i64>, DType)> = operands
        .iter()
        .map(|t| (t.shape.clone(), t.dtype))
        .collect();
    e.op_n(
        "stablehlo.reduce_window",
        &all,
        &[
            ("window_dimensions", array_i64(&window)),
            ("window_strides", array_i64(&vec![1; r])),
            (
                "padding",
                format!("dense<[{}]> : tensor<{r}x2xi64>", pads.join(", ")),
            ),
        ],
        &results,
        vec![region],
    )
}

/// Inclusive running sum of an int64 tensor along `d`.
pub fn running_sum<'c, 'b>(e: &Emitter<'c, 'b>, t: &T<'c, 'b>, d: usize) -> R<T<'c, 'b>> {
    let init = e.splat(Scalar::Int(0), &[], t.dtype)?;
    let region = e.scalar_region(ReduceKind::Sum, t.dtype)?;
    Ok(scan(e, &[t], &[&init], d, region)?.remove(0))
}
