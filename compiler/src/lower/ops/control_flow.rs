//! PyTorch's control-flow operators (`torch.cond`, `while_loop`, `scan`, `map`) as StableHLO's
//! region ops: `stablehlo.if` for a branch, `stablehlo.while` for the loops. Their branches and
//! bodies are nested graphs ([`tpuc_frontend_fx::Graph::regions`]), lowered inside the region by
//! the ordinary rules ([`lower_body`]). See docs/control-flow.md.

use crate::lower::emit::{array_i64, Emitter, Scalar, T};
use crate::lower::{lower_body, NodeCx, Rule, R};
use melior::ir::{Value, ValueLike};
use tpuc_frontend_fx::{DType, Graph};
use tpuc_passes::STEPS_KWARG;

pub const RULES: &[(&str, Rule)] = &[
    ("higher_order.cond", cond),
    ("higher_order.while_loop", while_loop),
    ("higher_order.scan", scan),
    ("higher_order.map_impl", map_impl),
];

/// `t` for use inside a region of an op appended to `t`'s block: `stablehlo.if`'s branches read
/// the operands of the enclosing block directly (they take no arguments).
fn capture<'c, 'r>(t: &T<'c, '_>) -> T<'c, 'r> {
    T {
        // SAFETY: the value is defined in the enclosing block, which holds (and outlives) the
        // region being built; MLIR allows a region of `stablehlo.if` to read it.
        v: unsafe { Value::from_raw(t.v.to_raw()) },
        shape: t.shape.clone(),
        dtype: t.dtype,
    }
}

/// The node's recorded result types (every result of a control-flow op is a tensor).
fn result_types(cx: &NodeCx) -> R<Vec<(Vec<i64>, DType)>> {
    (0..cx.node.results.len()).map(|k| cx.out(k)).collect()
}

/// `torch.cond(pred, true_fn, false_fn, operands)` -> `stablehlo.if`: only the branch taken
/// runs. A constant predicate lowers its branch alone.
fn cond<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> R<Vec<T<'c, 'b>>> {
    let on_true = cx.region(1, "true_fn")?;
    let on_false = cx.region(2, "false_fn")?;
    let operands = cx.operands(3, "operands")?;
    if let Some(tpuc_frontend_fx::Arg::Bool(p)) = cx.arg(0, "pred") {
        return lower_body(cx.e, if *p { on_true } else { on_false }, &operands);
    }
    let pred = cx.tensor(0, "pred")?;
    if pred.numel() != 1 {
        return Err(cx.err(format!(
            "the predicate must have one element, got shape {:?}",
            pred.shape
        )));
    }
    let e = cx.e;
    let pred = e.reshape(&pred, &[])?;
    let pred = if pred.dtype == DType::Bool {
        pred
    } else {
        let zero = e.splat(Scalar::Int(0), &[], pred.dtype)?;
        e.compare(&pred, &zero, "NE")?
    };
    let types = result_types(cx)?;
    let branch = |g: &Graph| {
        e.region_of(&[], |inner, _| {
            let ins: Vec<Option<T>> = operands.iter().map(|o| o.as_ref().map(capture)).collect();
            let outs = lower_body(inner, g, &ins)?;
            check_types(cx, &outs, &types, "a branch")?;
            Ok(outs)
        })
    };
    let regions = vec![branch(on_true)?, branch(on_false)?];
    e.op_n("stablehlo.if", &[&pred], &[], &types, regions)
}

/// The values produced where `want` are expected (a branch's results, a loop's next carried
/// values) must have exactly those types: PyTorch checks this when it traces, so a difference
/// is a bug to report, never something to convert silently.
fn check_types(cx: &NodeCx, got: &[T], want: &[(Vec<i64>, DType)], what: &str) -> R<()> {
    let got: Vec<(Vec<i64>, DType)> = got.iter().map(|t| (t.shape.clone(), t.dtype)).collect();
    if got != want {
        return Err(cx.err(format!("{what} produced {got:?}, the op expects {want:?}")));
    }
    Ok(())
}

/// `while_loop(cond_fn, body_fn, carried_inputs, additional_inputs)` -> `stablehlo.while`
/// over the carried values, the additional inputs carried along unchanged.
fn while_loop<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> R<Vec<T<'c, 'b>>> {
    let cond_g = cx.region(0, "cond_fn")?;
    let body_g = cx.region(1, "body_fn")?;
    let carried = cx.operands(2, "carried_inputs")?;
    let extra = cx.operands(3, "additional_inputs")?;
    let carried: Vec<T> = carried
        .into_iter()
        .map(|t| t.ok_or_else(|| cx.err("a carried value that is not a tensor is not supported")))
        .collect::<R<_>>()?;
    let n = carried.len();
    let mut operands: Vec<T> = carried.clone();
    operands.extend(extra.iter().flatten().cloned());
    let types: Vec<(Vec<i64>, DType)> = operands
        .iter()
        .map(|t| (t.shape.clone(), t.dtype))
        .collect();
    let carried_types = types[..n].to_vec();
    check_types(cx, &carried, &result_types(cx)?, "the carried inputs")?;
    let e = cx.e;
    let cond_region = e.region_of(&types, |inner, a| {
        let out = lower_body(inner, cond_g, &with_sizes(&a, n, &extra))?;
        match out.as_slice() {
            [p] if p.numel() == 1 && p.dtype == DType::Bool => Ok(vec![inner.reshape(p, &[])?]),
            _ => Err(cx.err("cond_fn must return one boolean with one element")),
        }
    })?;
    let body_region = e.region_of(&types, |inner, a| {
        let mut next = lower_body(inner, body_g, &with_sizes(&a, n, &extra))?;
        check_types(cx, &next, &carried_types, "body_fn")?;
        next.extend(a[n..].iter().cloned());
        Ok(next)
    })?;
    let refs: Vec<&T> = operands.iter().collect();
    let mut out = e.op_n(
        "stablehlo.while",
        &refs,
        &[],
        &types,
        vec![cond_region, body_region],
    )?;
    out.truncate(n);
    Ok(out)
}

/// `scan(combine_fn, init, xs, additional_inputs)`: the carries, then the per-step outputs
/// stacked along a new leading dim.
fn scan<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> R<Vec<T<'c, 'b>>> {
    let body = cx.region(0, "combine_fn")?;
    let init = cx.operands(1, "init")?;
    let init: Vec<T> = init
        .into_iter()
        .map(|t| t.ok_or_else(|| cx.err("a carry that is not a tensor is not supported")))
        .collect::<R<_>>()?;
    let xs = cx.operands(2, "xs")?;
    let extra = cx.operands(3, "additional_inputs")?;
    stepped(cx, body, &init, &xs, &extra)
}

/// `map_impl(f, xs, args)`: `f` of each leading-dim slice of `xs`, stacked (a scan without
/// carries).
fn map_impl<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> R<Vec<T<'c, 'b>>> {
    let body = cx.region(0, "f")?;
    let xs = cx.operands(1, "xs")?;
    let extra = cx.operands(2, "args")?;
    stepped(cx, body, &[], &xs, &extra)
}

/// A `stablehlo.while` over the leading dim of `xs`: step `k` calls `body(carries, xs[k],
/// extra)`, which returns the next carries and this step's outputs; each output is written at
/// `k` of its stacked result (`dynamic_slice` in, `dynamic_update_slice` out). The scanned and
/// additional inputs ride along as loop-carried values, so the body reads only its arguments.
fn stepped<'c, 'b>(
    cx: &NodeCx<'_, 'c, 'b>,
    body: &Graph,
    init: &[T<'c, 'b>],
    xs: &[Option<T<'c, 'b>>],
    extra: &[Option<T<'c, 'b>>],
) -> R<Vec<T<'c, 'b>>> {
    let e = cx.e;
    let xs: Vec<T> = xs
        .iter()
        .map(|t| {
            t.clone()
                .ok_or_else(|| cx.err("a scanned input that is not a tensor"))
        })
        .collect::<R<_>>()?;
    let steps = match xs.first() {
        Some(x) if x.rank() > 0 => x.shape[0],
        _ => return Err(cx.err("expects at least one scanned tensor of rank >= 1")),
    };
    if xs.iter().any(|x| x.rank() == 0 || x.shape[0] != steps) {
        return Err(cx.err("the scanned tensors differ in their leading dim"));
    }
    let types = result_types(cx)?;
    let nc = init.len();
    check_types(cx, init, &types[..nc], "the initial carries")?;
    let stacked = &types[nc..];
    if stacked.iter().any(|(s, _)| s.first() != Some(&steps)) {
        return Err(cx.err(format!(
            "the stacked outputs {stacked:?} do not have the {steps} steps as leading dim"
        )));
    }
    if steps == 0 {
        let mut out = init.to_vec();
        for (s, d) in stacked {
            out.push(e.splat(Scalar::Int(0), s, *d)?);
        }
        return Ok(out);
    }
    let ny = stacked.len();
    let mut carried: Vec<T> = init.to_vec();
    for (s, d) in stacked {
        carried.push(e.splat(Scalar::Int(0), s, *d)?);
    }
    carried.extend(xs.iter().cloned());
    carried.extend(extra.iter().flatten().cloned());
    let nx = xs.len();
    let carry_types = types[..nc].to_vec();
    // Bucketing pads the scanned dim to its bucket and passes the real number of steps.
    let limit = match cx.node.kwargs.get(STEPS_KWARG) {
        Some(a @ tpuc_frontend_fx::Arg::Value(_)) => Some(cx.value(a, STEPS_KWARG)?),
        _ => None,
    };
    let out = e.fori_with(steps, limit.as_ref(), &carried, |inner, k, a| {
        let (carries, rest) = a.split_at(nc);
        let (bufs, rest) = rest.split_at(ny);
        let (xs_k, rest) = rest.split_at(nx);
        let mut step: Vec<T> = carries.to_vec();
        for x in xs_k {
            step.push(slice_at(inner, x, k)?);
        }
        step.extend(rest.iter().cloned());
        let ins = with_sizes(&step, nc + nx, extra);
        let outs = lower_body(inner, body, &ins)?;
        if outs.len() != nc + ny {
            return Err(cx.err(format!(
                "the body returned {} values, the op expects {} carries and {ny} outputs",
                outs.len(),
                nc
            )));
        }
        check_types(cx, &outs[..nc], &carry_types, "the body's carries")?;
        let mut next: Vec<T> = outs[..nc].to_vec();
        for (buf, y) in bufs.iter().zip(&outs[nc..]) {
            next.push(write_at(inner, buf, y, k).map_err(|err| cx.err(err.to_string()))?);
        }
        next.extend(a[nc + ny..].iter().cloned());
        Ok(next)
    })?;
    Ok(out[..nc + ny].to_vec())
}

/// A nested graph's inputs from a region's tensor arguments `a`: the first `n` as they are,
/// then one per item of `extra` (the additional inputs), `None` where that is a size (its
/// uses were replaced by the size at import; only tensors ride along in the loop).
fn with_sizes<'c, 'r>(
    a: &[T<'c, 'r>],
    n: usize,
    extra: &[Option<T<'c, '_>>],
) -> Vec<Option<T<'c, 'r>>> {
    let mut rest = a[n..].iter();
    let mut ins: Vec<Option<T<'c, 'r>>> = a[..n].iter().cloned().map(Some).collect();
    ins.extend(
        extra
            .iter()
            .map(|o| o.as_ref().and_then(|_| rest.next().cloned())),
    );
    ins
}

/// `x[k]`: the slice at `k` (0-d int64) of `x`'s leading dim.
fn slice_at<'c, 'r>(e: &Emitter<'c, 'r>, x: &T<'c, 'r>, k: &T<'c, 'r>) -> R<T<'c, 'r>> {
    let zero = e.splat(Scalar::Int(0), &[], DType::Int64)?;
    let mut starts = vec![k];
    starts.extend(std::iter::repeat_n(&zero, x.rank() - 1));
    let mut operands = vec![x];
    operands.extend(starts);
    let mut sizes = x.shape.clone();
    sizes[0] = 1;
    let s = e.op(
        "stablehlo.dynamic_slice",
        &operands,
        &[("slice_sizes", array_i64(&sizes))],
        &sizes,
        x.dtype,
    )?;
    e.reshape(&s, &x.shape[1..])
}

/// `buf` with `y` written at `k` of its leading dim.
fn write_at<'c, 'r>(
    e: &Emitter<'c, 'r>,
    buf: &T<'c, 'r>,
    y: &T<'c, 'r>,
    k: &T<'c, 'r>,
) -> R<T<'c, 'r>> {
    if buf.shape[1..] != y.shape[..] || buf.dtype != y.dtype {
        return Err(crate::lower::LowerError::internal(format!(
            "a step's output {}{:?} does not fit its stacked result {}{:?}",
            y.dtype, y.shape, buf.dtype, buf.shape
        )));
    }
    let mut shape = vec![1];
    shape.extend_from_slice(&y.shape);
    let y = e.reshape(y, &shape)?;
    let zero = e.splat(Scalar::Int(0), &[], DType::Int64)?;
    let mut operands = vec![buf, &y, k];
    operands.extend(std::iter::repeat_n(&zero, buf.rank() - 1));
    e.op(
        "stablehlo.dynamic_update_slice",
        &operands,
        &[],
        &buf.shape,
        buf.dtype,
    )
}
