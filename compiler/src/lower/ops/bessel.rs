//! Bessel functions of the first and second kind (J0, J1, Y0, Y1) and modified Bessel functions
//! of the second kind (K0, K1, and their exp(x)-scaled forms), evaluated in f64 and rounded once
//! to the result dtype, with PyTorch's values at 0, at negative arguments and at infinity.
//!
//! - J and Y: the power series (A&S 9.1.10, 9.1.11; 60 terms) for |x| <= 20, where their
//!   cancellation costs at most e^20 / (2 pi 20) ulps of f64 (~5e-10 absolute); Hankel's
//!   asymptotic expansion (A&S 9.2.5-9.2.10; 24 terms, relative error ~1e-15) beyond.
//! - K: the integral K_n(x) = int_0^inf exp(-x cosh t) cosh(n t) dt by the trapezoidal rule
//!   (120 points, step min(1/4, 0.7/sqrt(x)), exponentially convergent: error ~1e-17 relative),
//!   scaled by exp(x) inside so nothing underflows; leading terms of the series below x = 1e-9.

use crate::lower::helpers::formula::F;
use crate::lower::helpers::widen::unary_f64;
use crate::lower::Rule;
use crate::lower::{NodeCx, R, T};
use tpuc_frontend_fx::DType;

pub static RULES: &[(&str, Rule)] = &[
    ("aten.special_bessel_j0.default", j0),
    ("aten.special_bessel_j1.default", j1),
    ("aten.special_bessel_y0.default", y0),
    ("aten.special_bessel_y1.default", y1),
    ("aten.special_modified_bessel_k0.default", k0),
    ("aten.special_modified_bessel_k1.default", k1),
    ("aten.special_scaled_modified_bessel_k0.default", k0e),
    ("aten.special_scaled_modified_bessel_k1.default", k1e),
    ("aten.special_airy_ai.default", airy_ai),
];

type V<'c, 'b> = R<Vec<T<'c, 'b>>>;
const F64: DType = DType::Float64;
const EULER: f64 = 0.577_215_664_901_532_9;
const PI: f64 = std::f64::consts::PI;
const SERIES_MAX: f64 = 20.0;

/// Power-series parts at `a = |x|` (clamped to the series range): (J_n, S_n) where
/// J_n = sum t_k and S_n = sum w_k t_k with the weights the Y_n series needs
/// (n = 0: H_k; n = 1: H_k + H_{k+1}), t_k = (a/2)^(2k+n) (-1)^k / (k! (k+n)!).
fn series<'c, 'b>(f: &F<'_, 'c, 'b>, a: &T<'c, 'b>, n: u32) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let e = f.e;
    let z = f.mulk(&e.mul(a, a)?, -0.25)?;
    let t = if n == 0 {
        e.broadcast_to(&f.k(1.0)?, &a.shape)?
    } else {
        f.mulk(a, 0.5)?
    };
    // k = 0 weight: 0 for n = 0, H_1 = 1 for n = 1.
    let s0 = if n == 0 { f.mulk(&t, 0.0)? } else { t.clone() };
    let h0 = e.k(0.0, F64)?; // H_k
    let nf = n as f64;
    let out = e.fori(60, &[t.clone(), t, s0, h0, z], move |e, k, c| {
        let f = F { e };
        let (t, j, s, h, z) = (&c[0], &c[1], &c[2], &c[3], &c[4]);
        let kf = f.addk(&e.convert(k, F64)?, 1.0)?;
        let t = e.div(&e.mul(t, z)?, &e.mul(&kf, &f.addk(&kf, nf)?)?)?;
        let h = e.add(h, &e.div(&f.k(1.0)?, &kf)?)?;
        let w = if n == 0 {
            h.clone()
        } else {
            let next = e.div(&f.k(1.0)?, &f.addk(&kf, 1.0)?)?;
            e.add(&f.mulk(&h, 2.0)?, &next)?
        };
        let j = e.add(j, &t)?;
        let s = e.add(s, &e.mul(&t, &w)?)?;
        Ok(vec![t, j, s, h, z.clone()])
    })?;
    let (j, s) = (out[1].clone(), out[2].clone());
    Ok((j, s))
}

/// Hankel's expansion at `a >= 20`: (J_nu, Y_nu).
fn hankel<'c, 'b>(f: &F<'_, 'c, 'b>, a: &T<'c, 'b>, nu: f64) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let e = f.e;
    let mu = 4.0 * nu * nu;
    // a_k = prod_{i=1..k} (mu - (2i-1)^2) / (k! 8^k)
    let mut coef = vec![1.0f64];
    for k in 1..24 {
        let i = k as f64;
        let prev = coef[k - 1];
        coef.push(prev * (mu - (2.0 * i - 1.0).powi(2)) / (i * 8.0));
    }
    let inv = e.div(&f.k(1.0)?, a)?;
    // P = sum_j (-1)^j a_2j / x^2j, Q = sum_j (-1)^j a_{2j+1} / x^{2j+1}, by Horner in 1/x^2.
    let inv2 = e.mul(&inv, &inv)?;
    let horner = |cs: &[f64]| -> R<T<'c, 'b>> {
        let mut acc = e.broadcast_to(&f.k(*cs.last().unwrap())?, &a.shape)?;
        for &c in cs.iter().rev().skip(1) {
            acc = f.addk(&e.mul(&acc, &inv2)?, c)?;
        }
        Ok(acc)
    };
    let pc: Vec<f64> = (0..12)
        .map(|j| coef[2 * j] * if j % 2 == 0 { 1.0 } else { -1.0 })
        .collect();
    let qc: Vec<f64> = (0..12)
        .map(|j| coef[2 * j + 1] * if j % 2 == 0 { 1.0 } else { -1.0 })
        .collect();
    let p = horner(&pc)?;
    let q = e.mul(&horner(&qc)?, &inv)?;
    // chi = x - (n/2 + 1/4) pi: cos/sin of x combined with the exact phase.
    let phase = (nu / 2.0 + 0.25) * PI;
    let (cp, sp) = (phase.cos(), phase.sin());
    let c = f.un("stablehlo.cosine", a)?;
    let s = f.un("stablehlo.sine", a)?;
    let cos_chi = e.add(&f.mulk(&c, cp)?, &f.mulk(&s, sp)?)?;
    let sin_chi = e.sub(&f.mulk(&s, cp)?, &f.mulk(&c, sp)?)?;
    let amp = f.un("stablehlo.sqrt", &f.mulk(&inv, 2.0 / PI)?)?;
    let jn = e.mul(&amp, &e.sub(&e.mul(&p, &cos_chi)?, &e.mul(&q, &sin_chi)?)?)?;
    let yn = e.mul(&amp, &e.add(&e.mul(&p, &sin_chi)?, &e.mul(&q, &cos_chi)?)?)?;
    Ok((jn, yn))
}

/// (J_n(|x|), Y_n(|x|)) for n = 0, 1.
fn bessel<'c, 'b>(f: &F<'_, 'c, 'b>, x: &T<'c, 'b>, n: u32) -> R<(T<'c, 'b>, T<'c, 'b>)> {
    let e = f.e;
    let a = f.un("stablehlo.abs", x)?;
    let small = f.cmpk(&a, SERIES_MAX, "LE")?;
    let (js, ss) = series(f, &f.min(&a, SERIES_MAX)?, n)?;
    // Y from the series: (2/pi)(ln(a/2) + gamma) J_n - [n = 1: 2/(pi a)] - c S_n.
    let lg = f.addk(&f.un("stablehlo.log", &f.mulk(&a, 0.5)?)?, EULER)?;
    let ys = f.mulk(&e.mul(&lg, &js)?, 2.0 / PI)?;
    let ys = if n == 0 {
        e.sub(&ys, &f.mulk(&ss, 2.0 / PI)?)?
    } else {
        let r = e.div(&f.k(2.0 / PI)?, &a)?;
        e.sub(&e.sub(&ys, &r)?, &f.mulk(&ss, 1.0 / PI)?)?
    };
    let (jh, yh) = hankel(f, &f.max(&a, SERIES_MAX)?, n as f64)?;
    Ok((f.sel(&small, &js, &jh)?, f.sel(&small, &ys, &yh)?))
}

fn j0<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_f64(cx, |e, x| Ok(bessel(&F { e }, x, 0)?.0))
}

fn j1<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    unary_f64(cx, |e, x| {
        let f = F { e };
        let j = bessel(&f, x, 1)?.0;
        // Odd: J1(-x) = -J1(x) (and -0 at -0).
        let neg = f.cmpk(x, 0.0, "LT")?;
        let j = f.sel(&neg, &f.un("stablehlo.negate", &j)?, &j)?;
        f.sel(&f.cmpk(x, 0.0, "EQ")?, x, &j)
    })
}

/// Y_n with PyTorch's edge values: -inf at 0, NaN below 0.
fn y_n<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, n: u32) -> V<'c, 'b> {
    unary_f64(cx, |e, x| {
        let f = F { e };
        let y = bessel(&f, x, n)?.1;
        let y = f.selk(&f.cmpk(x, 0.0, "EQ")?, f64::NEG_INFINITY, &y)?;
        f.selk(&f.cmpk(x, 0.0, "LT")?, f64::NAN, &y)
    })
}

fn y0<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    y_n(cx, 0)
}

fn y1<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    y_n(cx, 1)
}

/// exp(x) K_nu(x) for x > 0 (any value elsewhere; the callers replace those).
fn k_scaled<'c, 'b>(f: &F<'_, 'c, 'b>, x: &T<'c, 'b>, nu: f64) -> R<T<'c, 'b>> {
    let e = f.e;
    // Evaluate the quadrature at a safe x (the tiny, zero, negative, inf and NaN cases are
    // selected away by the callers).
    let xs = f.min(&f.max(x, 1e-9)?, 1e300)?;
    let h = f.min(&e.div(&f.k(0.7)?, &f.un("stablehlo.sqrt", &xs)?)?, 0.25)?;
    // Trapezoid: h (f(0)/2 + sum_{j>=1} f(j h)), f(t) = exp(-x (cosh t - 1)) cosh(n t); f(0) = 1.
    let sum0 = e.broadcast_to(&f.k(0.5)?, &x.shape)?;
    let out = e.fori(120, &[sum0, h.clone(), xs], move |e, j, c| {
        let f = F { e };
        let (sum, h, xs) = (&c[0], &c[1], &c[2]);
        let jf = f.addk(&e.convert(j, F64)?, 1.0)?;
        let t = e.mul(h, &jf)?;
        // cosh t - 1 = (e^(t/2) - e^(-t/2))^2 / 2, without cancellation.
        let eh = f.un("stablehlo.exponential", &f.mulk(&t, 0.5)?)?;
        let d = e.sub(&eh, &e.div(&f.k(1.0)?, &eh)?)?;
        let cm1 = f.mulk(&e.mul(&d, &d)?, 0.5)?;
        let mut term = f.un("stablehlo.exponential", &f.mulk(&e.mul(xs, &cm1)?, -1.0)?)?;
        if nu == 1.0 {
            // cosh t = 1 + (cosh t - 1)
            term = e.mul(&term, &f.addk(&cm1, 1.0)?)?;
        } else if nu != 0.0 {
            let p = f.un("stablehlo.exponential", &f.mulk(&t, nu)?)?;
            let cosh = f.mulk(&e.add(&p, &e.div(&f.k(1.0)?, &p)?)?, 0.5)?;
            term = e.mul(&term, &cosh)?;
        }
        Ok(vec![e.add(sum, &term)?, h.clone(), xs.clone()])
    })?;
    e.mul(&out[0], &h)
}

/// K_n (scaled by exp(x) when `scaled`) with PyTorch's edge values: inf at 0, NaN below 0,
/// 0 at inf; the series' leading terms below x = 1e-9.
fn k_n<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>, n: u32, scaled: bool) -> V<'c, 'b> {
    unary_f64(cx, |e, x| {
        let f = F { e };
        let ks = k_scaled(&f, x, n as f64)?;
        let xs = f.max(x, 1e-300)?;
        let lg = f.addk(&f.un("stablehlo.log", &f.mulk(&xs, 0.5)?)?, EULER)?;
        // K0 ~ -(ln(x/2) + gamma); K1 ~ 1/x + (x/2)(ln(x/2) + gamma - 1/2).
        let tiny_k = if n == 0 {
            f.un("stablehlo.negate", &lg)?
        } else {
            let half = f.mulk(&xs, 0.5)?;
            e.add(
                &e.div(&f.k(1.0)?, &xs)?,
                &e.mul(&half, &f.addk(&lg, -0.5)?)?,
            )?
        };
        let ex = f.un("stablehlo.exponential", &f.mulk(x, -1.0)?)?;
        let (big, tiny) = if scaled {
            (ks, e.mul(&tiny_k, &f.un("stablehlo.exponential", &xs)?)?)
        } else {
            (e.mul(&ks, &ex)?, tiny_k)
        };
        let r = f.sel(&f.cmpk(x, 1e-9, "LT")?, &tiny, &big)?;
        let r = f.selk(&f.cmpk(x, f64::INFINITY, "EQ")?, 0.0, &r)?;
        let r = f.selk(&f.cmpk(x, 0.0, "EQ")?, f64::INFINITY, &r)?;
        let r = f.selk(&f.cmpk(x, 0.0, "LT")?, f64::NAN, &r)?;
        // NaN stays NaN.
        f.sel(&e.isnan(x)?, x, &r)
    })
}

fn k0<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    k_n(cx, 0, false)
}

fn k1<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    k_n(cx, 1, false)
}

fn k0e<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    k_n(cx, 0, true)
}

fn k1e<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    k_n(cx, 1, true)
}

/// J_nu(a) by its power series (60 terms; a <= 20), `gamma1` = Gamma(nu + 1).
fn j_series<'c, 'b>(f: &F<'_, 'c, 'b>, a: &T<'c, 'b>, nu: f64, gamma1: f64) -> R<T<'c, 'b>> {
    let e = f.e;
    let half = f.mulk(a, 0.5)?;
    let t0 = f.mulk(
        &f.un(
            "stablehlo.exponential",
            &f.mulk(&f.un("stablehlo.log", &half)?, nu)?,
        )?,
        1.0 / gamma1,
    )?;
    let z = f.mulk(&e.mul(a, a)?, -0.25)?;
    let out = e.fori(60, &[t0.clone(), t0, z], move |e, k, c| {
        let f = F { e };
        let (t, j, z) = (&c[0], &c[1], &c[2]);
        let kf = f.addk(&e.convert(k, F64)?, 1.0)?;
        let t = e.div(&e.mul(t, z)?, &e.mul(&kf, &f.addk(&kf, nu)?)?)?;
        Ok(vec![t.clone(), e.add(j, &t)?, z.clone()])
    })?;
    Ok(out[1].clone())
}

/// Airy Ai: its Maclaurin series for |x| <= 5; (1/pi) sqrt(x/3) K_{1/3}(zeta) above and
/// (sqrt(-x)/3) (J_{1/3}(zeta) + J_{-1/3}(zeta)) below, zeta = (2/3)|x|^(3/2); NaN at +-inf
/// as in PyTorch.
fn airy_ai<'c, 'b>(cx: &NodeCx<'_, 'c, 'b>) -> V<'c, 'b> {
    const AI0: f64 = 0.355_028_053_887_817_2;
    const AIP0: f64 = 0.258_819_403_792_806_8;
    const GAMMA_4_3: f64 = 0.892_979_511_569_249_2;
    const GAMMA_2_3: f64 = 1.354_117_939_426_400_4;
    unary_f64(cx, |e, x| {
        let f = F { e };
        // Maclaurin: Ai = AI0 f(x) - AIP0 g(x).
        let xc = f.max(&f.min(x, 5.0)?, -5.0)?;
        let x3 = e.mul(&e.mul(&xc, &xc)?, &xc)?;
        let one = e.broadcast_to(&f.k(1.0)?, &x.shape)?;
        let out = e.fori(
            25,
            &[one.clone(), one, xc.clone(), xc.clone(), x3],
            |e, k, c| {
                let f = F { e };
                let (ft, fs, gt, gs, x3) = (&c[0], &c[1], &c[2], &c[3], &c[4]);
                let k3 = f.mulk(&f.addk(&e.convert(k, F64)?, 1.0)?, 3.0)?;
                let ft = e.div(&e.mul(ft, x3)?, &e.mul(&k3, &f.addk(&k3, -1.0)?)?)?;
                let gt = e.div(&e.mul(gt, x3)?, &e.mul(&k3, &f.addk(&k3, 1.0)?)?)?;
                Ok(vec![
                    ft.clone(),
                    e.add(fs, &ft)?,
                    gt.clone(),
                    e.add(gs, &gt)?,
                    x3.clone(),
                ])
            },
        )?;
        let mid = e.sub(&f.mulk(&out[1], AI0)?, &f.mulk(&out[3], AIP0)?)?;
        // |x| > 5: zeta = (2/3) |x|^(3/2).
        let a = f.max(&f.un("stablehlo.abs", x)?, 5.0)?;
        let zeta = f.mulk(&e.mul(&a, &f.un("stablehlo.sqrt", &a)?)?, 2.0 / 3.0)?;
        let kz = e.mul(
            &k_scaled(&f, &zeta, 1.0 / 3.0)?,
            &f.un("stablehlo.exponential", &f.mulk(&zeta, -1.0)?)?,
        )?;
        let pos = f.mulk(
            &e.mul(&f.un("stablehlo.sqrt", &f.mulk(&a, 1.0 / 3.0)?)?, &kz)?,
            1.0 / PI,
        )?;
        let zs = f.min(&zeta, SERIES_MAX)?;
        let js = e.add(
            &j_series(&f, &zs, 1.0 / 3.0, GAMMA_4_3)?,
            &j_series(&f, &zs, -1.0 / 3.0, GAMMA_2_3)?,
        )?;
        let zh = f.max(&zeta, SERIES_MAX)?;
        let jh = e.add(
            &hankel(&f, &zh, 1.0 / 3.0)?.0,
            &hankel(&f, &zh, -1.0 / 3.0)?.0,
        )?;
        let jsum = f.sel(&f.cmpk(&zeta, SERIES_MAX, "LE")?, &js, &jh)?;
        let neg = f.mulk(&e.mul(&f.un("stablehlo.sqrt", &a)?, &jsum)?, 1.0 / 3.0)?;
        let r = f.sel(&f.cmpk(x, 5.0, "GT")?, &pos, &mid)?;
        let r = f.sel(&f.cmpk(x, -5.0, "LT")?, &neg, &r)?;
        let inf = f.cmpk(&f.un("stablehlo.abs", x)?, f64::INFINITY, "EQ")?;
        let r = f.selk(&inf, f64::NAN, &r)?;
        f.sel(&e.isnan(x)?, x, &r)
    })
}
