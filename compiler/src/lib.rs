//! tpuc's compiler: lowering of the IR to StableHLO (melior) and the compile pipeline (lower,
//! cache lookup, compile and run through the PJRT runtime, crate `tpuc_runtime`).

pub mod lower;
pub mod pipeline;
pub mod target;
