//! Lowering helpers that several op files share. They build on the emitter and import no op
//! file (`ops/`), so op files never import each other.

pub mod formula;
pub mod gather;
pub mod matmul;
pub mod scan;
pub mod widen;
pub mod window;
