//! `hash_tensor` (mode 0): the xor of the elements' bits after widening floats to float64 and
//! integers to int64, reduced over `dim` (all dims when empty; `keepdim` is
//! the recorded result shape); the result is uint64.

use crate::lower::emit::array_i64;
use crate::lower::Rule;
use crate::lower::{NodeCx, Scalar, R, T};
use tpuc_frontend_fx::DType;

pub static RULES: &[(&str, Rule)] = &[("aten.hash_tensor.default", hash_tensor)];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;

fn hash_tensor<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let e = cx.e;
    let x = cx.tensor(0, "self")?;
    let dims = cx.ints_or(1, "dim", &[])?;
    if cx.int_or(3, "mode", 0)? != 0 {
        return Err(cx.err("only mode 0 (xor reduction) exists"));
    }
    let (out_shape, out_dtype) = cx.out(0)?;
    if x.dtype.is_complex() {
        return Err(cx.err("hash_tensor of a complex tensor is not supported"));
    }
    let wide = if x.dtype.is_float() {
        e.bitcast(&e.convert(&x, DType::Float64)?, DType::Int64)?
    } else {
        e.convert(&x, DType::Int64)?
    };
    let bits = e.bitcast(&wide, DType::Uint64)?;
    let mut dims: Vec<i64> = if dims.is_empty() {
        (0..x.rank() as i64).collect()
    } else {
        dims.iter()
            .map(|&d| cx.dim(d, x.rank()))
            .collect::<R<Vec<_>>>()?
    };
    dims.sort();
    dims.dedup();
    if x.rank() == 0 {
        return Ok(vec![e.reshape(&bits, &out_shape)?]);
    }
    let kept: Vec<i64> = (0..x.rank() as i64)
        .filter(|d| !dims.contains(d))
        .map(|d| x.shape[d as usize])
        .collect();
    let init = e.splat(Scalar::Int(0), &[], DType::Uint64)?;
    let region = e.region(&[DType::Uint64, DType::Uint64], |e, a| {
        Ok(vec![e.op(
            "stablehlo.xor",
            &[&a[0], &a[1]],
            &[],
            &[],
            DType::Uint64,
        )?])
    })?;
    let r = e
        .op_n(
            "stablehlo.reduce",
            &[&bits, &init],
            &[("dimensions", array_i64(&dims))],
            &[(kept, DType::Uint64)],
            vec![region],
        )?
        .remove(0);
    Ok(vec![e.convert(&e.reshape(&r, &out_shape)?, out_dtype)?])
}
