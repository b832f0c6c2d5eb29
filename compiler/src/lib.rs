//! tpuc's compiler: lowering of the IR to StableHLO (melior) and the PJRT runtime that
//! compiles and runs it.

pub mod lower;
pub mod pipeline;
pub mod pjrt;
