//! Passes over the IR. Each pass is a function `Graph -> Graph` (or in place) with a name, so the
//! pipeline can report op counts before and after each one and users can switch them off.

mod bucket;
mod dce;
mod specialize;

pub use bucket::{bucket, Atom, BucketError, Bucketed, DimLayout, Layout};
pub use dce::dead_code_elimination;
pub use specialize::{bindings_from_inputs, specialize, SpecializeError};

use tpuc_frontend_fx::Graph;

/// A pass that rewrites the graph in place and reports how many nodes it removed or changed.
pub struct Pass {
    pub name: &'static str,
    pub run: fn(&mut Graph) -> usize,
}

/// The cleanup passes, in the order they run.
pub const CLEANUP: &[Pass] = &[Pass {
    name: "dce",
    run: dead_code_elimination,
}];
