//! Computing in a wider dtype than the result's: low-precision floats accumulate in f32, some
//! functions are evaluated in f64; either way the result is rounded once, as PyTorch does.

use crate::lower::emit::Emitter;
use crate::lower::{NodeCx, R, T};
use tpuc_frontend_fx::DType;

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;

/// The dtype to compute in for a result of dtype `d`: low-precision floats accumulate (sums,
/// products) and evaluate transcendental functions in f32, rounded once, as PyTorch's CPU
/// kernels do.
pub fn acc_dtype(d: DType) -> DType {
    match d {
        DType::Float16 | DType::Bfloat16 => DType::Float32,
        d => d,
    }
}

/// `f(self)` evaluated in f64 and rounded to the result dtype.
pub fn unary_f64<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    f: impl FnOnce(&Emitter<'c, 'b>, &T<'c, 'b>) -> R<T<'c, 'b>>,
) -> V<'c, 'b> {
    let x = cx.tensor(0, "self")?;
    let out = cx.out_dtype()?;
    let r = f(cx.e, &cx.e.convert(&x, DType::Float64)?)?;
    Ok(vec![cx.e.convert(&r, out)?])
}
