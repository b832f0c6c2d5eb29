//! The one table from ATen op name to lowering rule. A new op = one entry here + its rule in
//! `ops/` + a test.

use super::ops::{
    attention, bag, bessel, complex, control_flow, conv, creation, elementwise, gamma, hash,
    histogram, matrix, nn, products, random, reduce, sample, shape, special,
};
use super::Rule;
use rustc_hash::FxHashMap as HashMap;
use std::sync::OnceLock;

fn table() -> &'static HashMap<&'static str, Rule> {
    static TABLE: OnceLock<HashMap<&'static str, Rule>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut m: HashMap<&'static str, Rule> = HashMap::default();
        for (name, rule) in elementwise::RULES
            .iter()
            .chain(shape::RULES)
            .chain(reduce::RULES)
            .chain(products::RULES)
            .chain(conv::RULES)
            .chain(matrix::RULES)
            .chain(nn::RULES)
            .chain(creation::RULES)
            .chain(special::RULES)
            .chain(complex::RULES)
            .chain(attention::RULES)
            .chain(bessel::RULES)
            .chain(sample::RULES)
            .chain(bag::RULES)
            .chain(gamma::RULES)
            .chain(histogram::RULES)
            .chain(hash::RULES)
            .chain(random::RULES)
            .chain(control_flow::RULES)
        {
            let prev = m.insert(name, *rule);
            assert!(prev.is_none(), "two lowering rules for {name}");
        }
        m
    })
}

pub fn rule(op: &str) -> Option<Rule> {
    table().get(op).copied()
}

pub fn names() -> Vec<&'static str> {
    let mut v: Vec<&'static str> = table().keys().copied().collect();
    v.sort();
    v
}
