//! Shorthands for formulas over f64 tensors, shared by the special-function lowerings
//! (special.rs, gamma.rs, bessel.rs): constants are 0-d and broadcast to the other operand.

use crate::lower::emit::Emitter;
use crate::lower::{R, T};
use tpuc_frontend_fx::DType;

const F64: DType = DType::Float64;

pub struct F<'e, 'c, 'b> {
    pub e: &'e Emitter<'c, 'b>,
}

impl<'c, 'b> F<'_, 'c, 'b> {
    pub(crate) fn k(&self, v: f64) -> R<T<'c, 'b>> {
        self.e.k(v, F64)
    }
    pub(crate) fn un(&self, name: &str, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.e.unary(name, x)
    }
    pub(crate) fn abs(&self, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.un("stablehlo.abs", x)
    }
    /// `v - x` for a constant `v`.
    pub(crate) fn rsub(&self, v: f64, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.e.binary("stablehlo.subtract", &self.k(v)?, x, F64)
    }
    /// `v / x` for a constant `v`.
    pub(crate) fn rdiv(&self, v: f64, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.e.binary("stablehlo.divide", &self.k(v)?, x, F64)
    }
    pub(crate) fn addk(&self, x: &T<'c, 'b>, v: f64) -> R<T<'c, 'b>> {
        self.e.add(x, &self.k(v)?)
    }
    pub(crate) fn mulk(&self, x: &T<'c, 'b>, v: f64) -> R<T<'c, 'b>> {
        self.e.mul(x, &self.k(v)?)
    }
    pub(crate) fn cmpk(&self, x: &T<'c, 'b>, v: f64, dir: &str) -> R<T<'c, 'b>> {
        self.e.compare(x, &self.k(v)?, dir)
    }
    pub(crate) fn sel(&self, p: &T<'c, 'b>, a: &T<'c, 'b>, b: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.e.select(p, a, b, F64)
    }
    /// `p ? v : b` for a constant `v`.
    pub(crate) fn selk(&self, p: &T<'c, 'b>, v: f64, b: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.e.select(p, &self.k(v)?, b, F64)
    }
    /// `max(x, v)` for a constant `v`.
    pub(crate) fn max(&self, x: &T<'c, 'b>, v: f64) -> R<T<'c, 'b>> {
        self.e.binary("stablehlo.maximum", x, &self.k(v)?, F64)
    }
    /// `min(x, v)` for a constant `v`.
    pub(crate) fn min(&self, x: &T<'c, 'b>, v: f64) -> R<T<'c, 'b>> {
        self.e.binary("stablehlo.minimum", x, &self.k(v)?, F64)
    }
    /// Keeps |x| >= tiny (sign kept; zero becomes +tiny).
    pub(crate) fn away_from_zero(&self, x: &T<'c, 'b>, tiny: f64) -> R<T<'c, 'b>> {
        let small = self.cmpk(&self.abs(x)?, tiny, "LT")?;
        self.selk(&small, tiny, x)
    }
    /// `c[0] x^(n-1) + ... + c[n-1]` by Horner's rule.
    pub(crate) fn poly(&self, x: &T<'c, 'b>, c: &[f64]) -> R<T<'c, 'b>> {
        let mut acc = self.k(c[0])?;
        for &ci in &c[1..] {
            acc = self.addk(&self.e.mul(&acc, x)?, ci)?;
        }
        Ok(acc)
    }
    /// `x^n` by repeated multiplication (exact sign for negative x).
    pub(crate) fn powi(&self, x: &T<'c, 'b>, n: u32) -> R<T<'c, 'b>> {
        let mut acc = x.clone();
        for _ in 1..n {
            acc = self.e.mul(&acc, x)?;
        }
        Ok(acc)
    }
    pub(crate) fn is_inf(&self, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.cmpk(&self.abs(x)?, f64::INFINITY, "EQ")
    }
    /// `x - round(x)`, in [-0.5, 0.5]: the argument reduction for sin(pi x) and tan(pi x).
    pub(crate) fn frac(&self, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
        self.e.sub(x, &self.un("stablehlo.round_nearest_even", x)?)
    }

    /// ln Gamma(z + 1) for z >= -1/2: the Lanczos approximation (g = 7, 9 terms; relative
    /// error ~1e-15 on Gamma).
    pub(crate) fn lanczos_lgamma1(&self, z: &T<'c, 'b>) -> R<T<'c, 'b>> {
        const G: f64 = 7.0;
        const C: [f64; 9] = [
            0.999_999_999_999_809_9,
            676.520_368_121_885_1,
            -1_259.139_216_722_402_8,
            771.323_428_777_653_1,
            -176.615_029_162_140_6,
            12.507_343_278_686_905,
            -0.138_571_095_265_720_12,
            9.984_369_578_019_572e-6,
            1.505_632_735_149_311_6e-7,
        ];
        let e = self.e;
        let mut a = self.k(C[0])?;
        for (i, &c) in C.iter().enumerate().skip(1) {
            a = e.add(&a, &self.rdiv(c, &self.addk(z, i as f64)?)?)?;
        }
        let t = self.addk(z, G + 0.5)?;
        e.add(
            &e.sub(
                &e.mul(&self.addk(z, 0.5)?, &self.un("stablehlo.log", &t)?)?,
                &t,
            )?,
            &self.addk(
                &self.un("stablehlo.log", &a)?,
                0.5 * (2.0 * std::f64::consts::PI).ln(),
            )?,
        )
    }
    /// For z >= 0: (t, p) with erfc(z) = t exp(p - z^2), erfcx(z) = t exp(p), t = 1 / (1 + z/2):
    /// the Chebyshev fit of Numerical Recipes' `erfcc` (relative error below 1.2e-7 for every
    /// z >= 0).
    pub(crate) fn erfc_parts(&self, z: &T<'c, 'b>) -> R<(T<'c, 'b>, T<'c, 'b>)> {
        const C: [f64; 10] = [
            0.17087277,
            -0.82215223,
            1.48851587,
            -1.13520398,
            0.27886807,
            -0.18628806,
            0.09678418,
            0.37409196,
            1.00002368,
            -1.26551223,
        ];
        let t = self.rdiv(1.0, &self.addk(&self.mulk(z, 0.5)?, 1.0)?)?;
        let p = self.poly(&t, &C)?;
        Ok((t, p))
    }
    /// erfc(x) for any real x (`erfc_parts`; 2 - erfc(-x) below 0).
    pub(crate) fn erfc(&self, x: &T<'c, 'b>) -> R<T<'c, 'b>> {
        let e = self.e;
        let z = self.abs(x)?;
        let (t, p) = self.erfc_parts(&z)?;
        let pos = e.mul(
            &t,
            &self.un("stablehlo.exponential", &e.sub(&p, &e.mul(&z, &z)?)?)?,
        )?;
        self.sel(&self.cmpk(x, 0.0, "GE")?, &pos, &self.rsub(2.0, &pos)?)
    }
}
