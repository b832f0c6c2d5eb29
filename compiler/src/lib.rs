//! tpuc's compiler: lowering of the IR to StableHLO (melior) and the compile pipeline (lower,
//! cache lookup, compile and run through the PJRT runtime, crate `tpuc_runtime`).

mod executable_store;
mod host_kernels;
pub mod lower;
pub mod pipeline;
pub mod target;
