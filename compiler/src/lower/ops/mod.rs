//! Lowering rules, grouped by kind. Each file exports `RULES: &[(op name, rule)]`.

pub mod attention;
pub mod bag;
pub mod bessel;
pub mod complex;
pub mod control_flow;
pub mod conv;
pub mod creation;
pub mod elementwise;
pub mod gamma;
pub mod hash;
pub mod histogram;
pub mod matrix;
pub mod nn;
pub mod products;
pub mod random;
pub mod reduce;
pub mod sample;
pub mod shape;
pub mod special;
