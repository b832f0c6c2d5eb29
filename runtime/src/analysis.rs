//! What a compiled program will cost, as the plugin's compiler reports it: memory per device
//! (`PJRT_Executable_GetCompiledMemoryStats`) and cost analysis (`GetCostAnalysis`). Read from
//! any `PJRT_Executable`: a loaded one's view, or one compiled for a topology.

use super::api::{pjrt_call, Api, Args};
use super::named_values::{read_named_values, OptionValue};
use super::{sys, PjrtError};

/// Device memory one program needs on each device it runs on, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub arguments: i64,
    pub outputs: i64,
    /// Bytes of arguments that outputs reuse (donated buffers): counted in both above.
    pub aliased: i64,
    pub temporaries: i64,
    pub code: i64,
    /// The compiler's peak estimate, where it gives one (0 otherwise).
    pub peak: i64,
}

impl MemoryStats {
    /// What the program holds on a device while it runs: its arguments, outputs not aliasing
    /// an argument, temporaries and code.
    pub fn footprint(&self) -> i64 {
        self.arguments + self.outputs - self.aliased + self.temporaries + self.code
    }
}

/// Memory statistics of `raw`.
///
/// # Safety
/// `raw` must be a live `PJRT_Executable` of the plugin whose table `api` is.
pub(crate) unsafe fn memory_stats(
    api: &Api,
    raw: *mut sys::PJRT_Executable,
) -> Result<MemoryStats, PjrtError> {
    let mut args = sys::PJRT_Executable_GetCompiledMemoryStats_Args::new();
    args.executable = raw;
    // SAFETY: `raw` is live (the caller's contract); the outputs are plain integers.
    unsafe { pjrt_call!(api, PJRT_Executable_GetCompiledMemoryStats, &mut args) }?;
    Ok(MemoryStats {
        arguments: args.argument_size_in_bytes,
        outputs: args.output_size_in_bytes,
        aliased: args.alias_size_in_bytes,
        temporaries: args.temp_size_in_bytes,
        code: args.generated_code_size_in_bytes,
        peak: args.peak_memory_in_bytes,
    })
}

/// The cost properties of `raw` as numbers (`flops`, `bytes accessed`, `transcendentals`,
/// `optimal_seconds`, ... whatever the compiler reports; non-numeric ones are left out).
///
/// # Safety
/// `raw` must be a live `PJRT_Executable` of the plugin whose table `api` is.
pub(crate) unsafe fn cost_analysis(
    api: &Api,
    raw: *mut sys::PJRT_Executable,
) -> Result<Vec<(String, f64)>, PjrtError> {
    let mut args = sys::PJRT_Executable_GetCostAnalysis_Args::new();
    args.executable = raw;
    // SAFETY: `raw` is live (the caller's contract).
    unsafe { pjrt_call!(api, PJRT_Executable_GetCostAnalysis, &mut args) }?;
    // SAFETY: the properties are owned by `raw`, alive for this call; they are copied.
    let values = unsafe { read_named_values(args.properties, args.num_properties) };
    Ok(values
        .into_iter()
        .filter_map(|(name, v)| match v {
            OptionValue::Float(f) => Some((name, f64::from(f))),
            OptionValue::Int64(i) => Some((name, i as f64)),
            _ => None,
        })
        .collect())
}
