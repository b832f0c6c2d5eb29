//! Matrix products and convolution. Both honour the session precision (`precision_config`);
//! low-precision operands accumulate in f32 and round once, as PyTorch's CPU kernels do.

use crate::lower::emit::array_i64;
use crate::lower::ops::reduce::acc_dtype;
use crate::lower::registry::Rule;
use crate::lower::{NodeCx, R, T};
use tpuc_frontend_fx::Arg;

pub static RULES: &[(&str, Rule)] = &[
    ("aten.mm.default", mm),
    ("aten.addmm.default", addmm),
    ("aten.bmm.default", bmm),
    ("aten.baddbmm.default", baddbmm),
    ("aten.convolution.default", convolution),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;

/// `a @ b` over the given batch/contracting dims, in the accumulation dtype (f32 for f16/bf16;
/// the caller rounds to the output dtype once, after any bias is added).
fn dot_acc<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    a: &T<'c, 'b>,
    b: &T<'c, 'b>,
    batch: (&[i64], &[i64]),
    contract: (&[i64], &[i64]),
) -> R<T<'c, 'b>> {
    let (shape, out) = cx.out(0)?;
    let acc = acc_dtype(out);
    let a = cx.e.convert(a, out)?;
    let b = cx.e.convert(b, out)?;
    cx.e.dot_general(&a, &b, batch, contract, &shape, acc)
}

fn dot<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    a: &T<'c, 'b>,
    b: &T<'c, 'b>,
    batch: (&[i64], &[i64]),
    contract: (&[i64], &[i64]),
) -> R<T<'c, 'b>> {
    let r = dot_acc(cx, a, b, batch, contract)?;
    cx.e.convert(&r, cx.out_dtype()?)
}

fn mm<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let a = cx.tensor(0, "self")?;
    let b = cx.tensor(1, "mat2")?;
    Ok(vec![dot(cx, &a, &b, (&[], &[]), (&[1], &[0]))?])
}

fn bmm<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let a = cx.tensor(0, "self")?;
    let b = cx.tensor(1, "mat2")?;
    Ok(vec![dot(cx, &a, &b, (&[0], &[0]), (&[2], &[1]))?])
}

/// `beta * input + alpha * product` in the accumulation dtype, rounded once to the output
/// dtype (as PyTorch's fused CPU kernels do), skipping multiplications by 1.
fn scaled_sum<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, input: &T<'c, 'b>, prod: T<'c, 'b>) -> R<T<'c, 'b>> {
    let final_dtype = cx.out_dtype()?;
    let out = prod.dtype;
    let scale = |t: T<'c, 'b>, i: usize, name: &str| -> R<T<'c, 'b>> {
        match cx.arg(i, name) {
            None | Some(Arg::None) => Ok(t),
            _ => {
                let s = cx.scalar(i, name)?;
                if s.as_f64() == 1.0 {
                    return Ok(t);
                }
                let k = cx.e.splat(s, &[], out)?;
                cx.e.binary("stablehlo.multiply", &t, &k, out)
            }
        }
    };
    let beta_is_zero = matches!(cx.arg(3, "beta"), Some(Arg::Int(0)) | Some(Arg::Float(0.0)));
    let prod = scale(prod, 4, "alpha")?;
    if beta_is_zero {
        // beta = 0 ignores `input` entirely, NaNs included.
        return cx.e.convert(&prod, final_dtype);
    }
    let input = scale(cx.e.convert(input, out)?, 3, "beta")?;
    let sum = cx.e.binary("stablehlo.add", &input, &prod, out)?;
    cx.e.convert(&sum, final_dtype)
}

fn addmm<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let input = cx.tensor(0, "self")?;
    let a = cx.tensor(1, "mat1")?;
    let b = cx.tensor(2, "mat2")?;
    let p = dot_acc(cx, &a, &b, (&[], &[]), (&[1], &[0]))?;
    Ok(vec![scaled_sum(cx, &input, p)?])
}

fn baddbmm<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let input = cx.tensor(0, "self")?;
    let a = cx.tensor(1, "batch1")?;
    let b = cx.tensor(2, "batch2")?;
    let p = dot_acc(cx, &a, &b, (&[0], &[0]), (&[2], &[1]))?;
    Ok(vec![scaled_sum(cx, &input, p)?])
}

/// `convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding,
/// groups)` for 1-3 spatial dims, NCHW layout.
fn convolution<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let x = cx.tensor(0, "input")?;
    let w = cx.tensor(1, "weight")?;
    let bias = cx.opt_tensor(2, "bias")?;
    let (shape, out) = cx.out(0)?;
    let nsp = x.rank() - 2;
    let per_dim = |v: Vec<i64>| -> Vec<i64> {
        if v.len() == 1 {
            vec![v[0]; nsp]
        } else {
            v
        }
    };
    let stride = per_dim(cx.ints(3, "stride")?);
    let padding = per_dim(cx.ints(4, "padding")?);
    let dilation = per_dim(cx.ints(5, "dilation")?);
    if cx.bool_or(6, "transposed", false)? {
        return Err(cx.err("transposed convolution is not supported yet"));
    }
    let groups = cx.int_or(8, "groups", 1)?;
    let spatial: Vec<String> = (0..nsp).map(|i| i.to_string()).collect();
    let sp = spatial.join(", ");
    let dnums = format!("#stablehlo.conv<[b, f, {sp}]x[o, i, {sp}]->[b, f, {sp}]>");
    let pads: Vec<String> = padding.iter().map(|p| format!("[{p}, {p}]")).collect();
    let acc = acc_dtype(out);
    let xc = cx.e.convert(&x, out)?;
    let wc = cx.e.convert(&w, out)?;
    let r = cx.e.op(
        "stablehlo.convolution",
        &[&xc, &wc],
        &[
            ("dimension_numbers", dnums),
            ("window_strides", array_i64(&stride)),
            (
                "padding",
                format!("dense<[{}]> : tensor<{nsp}x2xi64>", pads.join(", ")),
            ),
            ("lhs_dilation", array_i64(&vec![1; nsp])),
            ("rhs_dilation", array_i64(&dilation)),
            ("feature_group_count", format!("{groups} : i64")),
            ("batch_group_count", "1 : i64".into()),
            ("precision_config", cx.e.precision_config()),
        ],
        &shape,
        acc,
    )?;
    let r = match bias {
        Some(b) => {
            let b =
                cx.e.broadcast_in_dim(&cx.e.convert(&b, acc)?, &shape, &[1])?;
            cx.e.binary("stablehlo.add", &r, &b, acc)?
        }
        None => r,
    };
    Ok(vec![cx.e.convert(&r, out)?])
}
