//! The regularized incomplete gamma functions P(a, x) (`igamma`, `special.gammainc`) and
//! Q(a, x) = 1 - P (`igammac`, `special.gammaincc`), in f64, rounded once to the result dtype.
//!
//! For a < 1e4: the power series of P when x < a + 1, else Lentz's continued fraction for Q
//! (Numerical Recipes' `gser` / `gcf`), in one `stablehlo.while` that stops when every element
//! has converged (at most 3000 steps; about 9 sqrt(a) are needed). For a >= 1e4: Temme's uniform
//! asymptotic expansion to its first correction term, whose truncation error there is below
//! 1e-9. PyTorch's edge values: NaN for a < 0, x < 0, a = x = 0 and a = x = inf; P = 1 at
//! a = 0 or x = inf, P = 0 at x = 0 or a = inf.

use crate::lower::helpers::formula::F;
use crate::lower::Rule;
use crate::lower::{NodeCx, ReduceKind, Scalar, R, T};
use tpuc_frontend_fx::DType;

pub static RULES: &[(&str, Rule)] = &[
    ("aten.igamma.default", igamma),
    ("aten.igammac.default", igammac),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;
const F64: DType = DType::Float64;
const I64: DType = DType::Int64;
const TEMME_MIN_A: f64 = 1e4;

/// ln Gamma(a) for a > 0: ln Gamma(a + 1) - ln a keeps the Lanczos argument >= 1.
fn lgamma_pos<'c, 'b>(f: &F<'_, 'c, 'b>, a: &T<'c, 'b>) -> R<T<'c, 'b>> {
    f.e.sub(&f.lanczos_lgamma1(a)?, &f.un("stablehlo.log", a)?)
}

/// (P, Q) by the series / continued fraction, for 0 < a, 0 < x, both finite.
fn pq_iterative<'c, 'b>(
    f: &F<'_, 'c, 'b>,
    a: &T<'c, 'b>,
    x: &T<'c, 'b>,
) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    const FPMIN: f64 = 1e-300;
    let e = f.e;
    let shape = a.shape.clone();
    let series = e.compare(x, &f.addk(a, 1.0)?, "LT")?;
    // Series state: term, sum (of x^n / ((a+1)...(a+n))), a + n.
    let one = e.broadcast_to(&f.k(1.0)?, &shape)?;
    // Continued-fraction state (Lentz): b, c, d, h.
    let b0 = e.sub(&f.addk(x, 1.0)?, a)?;
    let b0s = f.away_from_zero(&b0, FPMIN)?;
    let c0 = e.broadcast_to(&f.k(1.0 / FPMIN)?, &shape)?;
    let d0 = f.rdiv(1.0, &b0s)?;
    let err0 = f.k(1.0)?;
    let k0 = e.splat(Scalar::Int(0), &[], I64)?;
    let full = (shape.clone(), F64);
    let types = vec![
        (vec![], I64),
        full.clone(), // term
        full.clone(), // sum
        full.clone(), // a + n
        full.clone(), // b
        full.clone(), // c
        full.clone(), // d
        full.clone(), // h
        full.clone(), // a
        full.clone(), // x
        (shape.clone(), DType::Bool),
        (vec![], F64), // largest relative change in the last step
    ];
    let cond = e.region_of(&types, |e, s| {
        let f = F { e };
        let more = e.compare(&s[0], &e.splat(Scalar::Int(3000), &[], I64)?, "LT")?;
        e.and(&more, &f.cmpk(&s[11], 1e-16, "GT")?).map(|t| vec![t])
    })?;
    let body = e.region_of(&types, |e, s| {
        let f = F { e };
        let (k, term, sum, ap, b, c, d, h, a, x, series) = (
            &s[0], &s[1], &s[2], &s[3], &s[4], &s[5], &s[6], &s[7], &s[8], &s[9], &s[10],
        );
        let k1 = e.add(k, &e.splat(Scalar::Int(1), &[], I64)?)?;
        let i = e.convert(&k1, F64)?;
        // Series step.
        let ap = f.addk(ap, 1.0)?;
        let term = e.div(&e.mul(term, x)?, &ap)?;
        let sum = e.add(sum, &term)?;
        let serr = f.abs(&e.div(&term, &sum)?)?;
        // Continued-fraction step: an = -i (i - a), b += 2.
        let an = e.mul(
            &f.mulk(&e.broadcast_to(&i, &a.shape)?, -1.0)?,
            &e.sub(&i, a)?,
        )?;
        let b = f.addk(b, 2.0)?;
        let d = f.away_from_zero(&e.add(&e.mul(&an, d)?, &b)?, FPMIN)?;
        let c = f.away_from_zero(&e.add(&b, &e.div(&an, c)?)?, FPMIN)?;
        let d = f.rdiv(1.0, &d)?;
        let del = e.mul(&d, &c)?;
        let h = e.mul(h, &del)?;
        let cerr = f.abs(&f.addk(&del, -1.0)?)?;
        let err = f.sel(series, &serr, &cerr)?;
        let all: Vec<i64> = (0..err.rank() as i64).collect();
        let err = e.reduce(&err, &all, ReduceKind::Max, false)?;
        Ok(vec![
            k1,
            term,
            sum,
            ap,
            b,
            c,
            d,
            h,
            a.clone(),
            x.clone(),
            series.clone(),
            err,
        ])
    })?;
    let out = e.op_n(
        "stablehlo.while",
        &[&k0, &one, &one, a, &b0, &c0, &d0, &d0, a, x, &series, &err0],
        &[],
        &types,
        vec![cond, body],
    )?;
    let logpref = e.sub(
        &e.sub(&e.mul(a, &f.un("stablehlo.log", x)?)?, x)?,
        &lgamma_pos(f, a)?,
    )?;
    let pref = f.un("stablehlo.exponential", &logpref)?;
    let p_series = e.div(&e.mul(&pref, &out[2])?, a)?;
    let q_cf = e.mul(&pref, &out[7])?;
    let p = f.sel(&series, &p_series, &e.sub(&f.k(1.0)?, &q_cf)?)?;
    let q = f.sel(&series, &e.sub(&f.k(1.0)?, &p_series)?, &q_cf)?;
    Ok((p, q))
}

/// (P, Q) by Temme's uniform expansion (a large): Q = erfc(eta sqrt(a/2)) / 2 + R,
/// R = exp(-a eta^2 / 2) / sqrt(2 pi a) C0(eta).
fn pq_temme<'c, 'b>(f: &F<'_, 'c, 'b>, a: &T<'c, 'b>, x: &T<'c, 'b>) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let e = f.e;
    let lam = e.div(x, a)?;
    let lm1 = f.addk(&lam, -1.0)?;
    // lam - 1 - ln(lam) without cancellation near lam = 1.
    let g = e.sub(&lm1, &f.un("stablehlo.log_plus_one", &lm1)?)?;
    let g = f.sel(&f.cmpk(&g, 0.0, "LT")?, &f.mulk(&g, 0.0)?, &g)?;
    let eta_abs = f.un("stablehlo.sqrt", &f.mulk(&g, 2.0)?)?;
    let eta = f.sel(
        &f.cmpk(&lm1, 0.0, "LT")?,
        &f.mulk(&eta_abs, -1.0)?,
        &eta_abs,
    )?;
    // C0 = 1/(lam - 1) - 1/eta; its series near eta = 0.
    let small = f.cmpk(&eta_abs, 0.1, "LT")?;
    let safe_l = f.away_from_zero(&lm1, 1e-300)?;
    let safe_eta = f.away_from_zero(&eta, 1e-300)?;
    let c0_direct = e.sub(&f.rdiv(1.0, &safe_l)?, &f.rdiv(1.0, &safe_eta)?)?;
    let mut c0_series = e.broadcast_to(&f.k(1.0 / 2835.0)?, &eta.shape)?;
    for c in [1.0 / 864.0, -2.0 / 135.0, 1.0 / 12.0, -1.0 / 3.0] {
        c0_series = f.addk(&e.mul(&c0_series, &eta)?, c)?;
    }
    let c0 = f.sel(&small, &c0_series, &c0_direct)?;
    let ra = e.mul(
        &f.un(
            "stablehlo.exponential",
            &f.mulk(&e.mul(&e.mul(a, &eta)?, &eta)?, -0.5)?,
        )?,
        &f.un("stablehlo.rsqrt", &f.mulk(a, 2.0 * std::f64::consts::PI)?)?,
    )?;
    let r = e.mul(&ra, &c0)?;
    let arg = e.mul(&eta, &f.un("stablehlo.sqrt", &f.mulk(a, 0.5)?)?)?;
    let q = e.add(&f.mulk(&f.erfc(&arg)?, 0.5)?, &r)?;
    let p = e.sub(&f.mulk(&f.erfc(&f.mulk(&arg, -1.0)?)?, 0.5)?, &r)?;
    Ok((p, q))
}

/// (P, Q) with PyTorch's edge values.
fn pq<'c, 'b>(f: &F<'_, 'c, 'b>, a: &T<'c, 'b>, x: &T<'c, 'b>) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let e = f.e;
    let inf = f64::INFINITY;
    let regular = e.and(
        &e.and(&f.cmpk(a, 0.0, "GT")?, &f.cmpk(x, 0.0, "GT")?)?,
        &e.and(&f.cmpk(a, inf, "LT")?, &f.cmpk(x, inf, "LT")?)?,
    )?;
    let big = f.cmpk(a, TEMME_MIN_A, "GE")?;
    // Safe stand-ins where another branch applies, so no NaN reaches the loop's convergence test.
    let one = e.broadcast_to(&f.k(1.0)?, &a.shape)?;
    let it = e.and(&regular, &e.unary("stablehlo.not", &big)?)?;
    let ai = f.sel(&it, a, &one)?;
    let xi = f.sel(&it, x, &one)?;
    let (pi, qi) = pq_iterative(f, &ai, &xi)?;
    let tm = e.and(&regular, &big)?;
    let at = f.sel(&tm, a, &f.mulk(&one, TEMME_MIN_A)?)?;
    let xt = f.sel(&tm, x, &f.mulk(&one, TEMME_MIN_A)?)?;
    let (pt, qt) = pq_temme(f, &at, &xt)?;
    let p = f.sel(&big, &pt, &pi)?;
    let q = f.sel(&big, &qt, &qi)?;
    // Edge values (later selects win).
    let zero_p = e.or(&f.cmpk(x, 0.0, "EQ")?, &f.cmpk(a, inf, "EQ")?)?;
    let one_p = e.or(&f.cmpk(a, 0.0, "EQ")?, &f.cmpk(x, inf, "EQ")?)?;
    let p = f.selk(&zero_p, 0.0, &p)?;
    let q = f.selk(&zero_p, 1.0, &q)?;
    let p = f.selk(&one_p, 1.0, &p)?;
    let q = f.selk(&one_p, 0.0, &q)?;
    let nan = e.or(
        &e.or(&f.cmpk(a, 0.0, "LT")?, &f.cmpk(x, 0.0, "LT")?)?,
        &e.or(&e.isnan(a)?, &e.isnan(x)?)?,
    )?;
    let both0 = e.and(&f.cmpk(a, 0.0, "EQ")?, &f.cmpk(x, 0.0, "EQ")?)?;
    let both_inf = e.and(&f.cmpk(a, inf, "EQ")?, &f.cmpk(x, inf, "EQ")?)?;
    let nan = e.or(&e.or(&nan, &both0)?, &both_inf)?;
    Ok((f.selk(&nan, f64::NAN, &p)?, f.selk(&nan, f64::NAN, &q)?))
}

fn operands<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let a = cx.tensor_or_scalar(0, "self", F64)?;
    let x = cx.tensor_or_scalar(1, "other", F64)?;
    cx.e.coerce(&a, &x, F64)
}

fn igamma<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (a, x) = operands(cx)?;
    let (p, _) = pq(&F { e: cx.e }, &a, &x)?;
    Ok(vec![cx.e.convert(&p, cx.out_dtype()?)?])
}

fn igammac<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    let (a, x) = operands(cx)?;
    let (_, q) = pq(&F { e: cx.e }, &a, &x)?;
    Ok(vec![cx.e.convert(&q, cx.out_dtype()?)?])
}
