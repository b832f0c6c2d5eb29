//! Ops that create tensors from sizes and values: full, arange, *_like.

use crate::lower::Rule;
use crate::lower::{NodeCx, Scalar, R, T};
use tpuc_frontend_fx::DType;

pub static RULES: &[(&str, Rule)] = &[
    ("aten.full.default", full),
    ("aten.full_like.default", full),
    ("aten.scalar_tensor.default", scalar_tensor),
    ("aten.zeros.default", zeros),
    ("aten.zeros_like.default", zeros),
    ("aten.empty.memory_format", zeros),
    ("aten.empty_like.default", zeros),
    ("aten.new_zeros.default", zeros),
    // A zero tensor that PyTorch never materializes (sgn's backward of a real input).
    ("aten._efficientzerotensor.default", zeros),
    ("aten.new_empty.default", zeros),
    ("aten.empty_permuted.default", zeros),
    ("aten.empty_strided.default", zeros),
    // EfficientNet's backward: a buffer `copy` then fills (strides are layout, not values).
    ("aten.new_empty_strided.default", zeros),
    ("aten.ones.default", ones),
    ("aten.ones_like.default", ones),
    ("aten.new_ones.default", ones),
    ("aten.arange.default", arange),
    ("aten.arange.start", arange),
    ("aten.arange.start_step", arange),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;

fn filled<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, value: Scalar) -> V<'c, 'b> {
    let (shape, dtype) = cx.out(0)?;
    Ok(vec![cx.e.splat(value, &shape, dtype)?])
}

fn full<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    filled(cx, cx.scalar(1, "fill_value")?)
}

fn scalar_tensor<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    filled(cx, cx.scalar(0, "s")?)
}

/// `empty` is filled with zeros: the values are unspecified, zeros make runs reproducible.
fn zeros<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    filled(cx, Scalar::Int(0))
}

fn ones<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    filled(cx, Scalar::Int(1))
}

/// `arange(start, end, step)`: `start + i * step`, computed in f64 / i64 and cast once.
fn arange<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (shape, out) = cx.out(0)?;
    let (start, step) = if cx.node.op.ends_with(".default") {
        (Scalar::Int(0), Scalar::Int(1))
    } else if cx.node.op.ends_with(".start") {
        (cx.scalar(0, "start")?, Scalar::Int(1))
    } else {
        let step = match cx.arg(2, "step") {
            None | Some(tpuc_frontend_fx::Arg::None) => Scalar::Int(1),
            _ => cx.scalar(2, "step")?,
        };
        (cx.scalar(0, "start")?, step)
    };
    let compute = if out.is_float() {
        DType::Float64
    } else {
        DType::Int64
    };
    let i = cx.e.iota(&shape, 0, compute)?;
    let k = cx.e.splat(step, &[], compute)?;
    let s = cx.e.splat(start, &[], compute)?;
    let r = cx.e.binary("stablehlo.multiply", &i, &k, compute)?;
    let r = cx.e.binary("stablehlo.add", &r, &s, compute)?;
    Ok(vec![cx.e.convert(&r, out)?])
}
