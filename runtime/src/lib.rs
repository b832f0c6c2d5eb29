//! PJRT runtime: a safe wrapper over the PJRT C API (`pjrt_c_api.h`) of an
//! OpenXLA plugin (CPU, GPU, TPU) loaded at run time.
//!
//! Chain: [`load_plugin`] -> [`Client::new`] -> [`Client::compile`] (StableHLO
//! text) or [`Client::deserialize`] -> [`Client::buffer_from_host`] ->
//! [`LoadedExecutable::execute`] -> [`Buffer::to_host`].
//!
//! Ownership: plugins live for the whole process (unloading one crashes at
//! exit). Executables and buffers keep their client alive, so no PJRT object
//! outlives the client that made it. Every handle is `Send + Sync`: the PJRT C
//! API is thread-safe. All failures, including those of the plugin, come back
//! as [`PjrtError`] values that carry the plugin's own message.

mod analysis;
mod api;
mod buffer;
mod client;
mod client_handle;
pub mod env;
mod executable;
mod ffi_extension;
mod hlo_text;
mod named_values;
mod plugin;
pub mod runner;
mod sys;
#[cfg(test)]
mod tests;
mod topology;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

pub use analysis::MemoryStats;
pub use buffer::Buffer;
pub use client::Client;
pub use executable::{executing_on_this_thread, CompileOptions, LoadedExecutable, XlaOption};
pub use named_values::{cpu_device_options, CreateOptions, OptionValue};
pub use plugin::{load_plugin, Plugin};
pub use runner::{HostArray, PtrArg, RunArg, RunError, RunTimings, Runner, Signature};
pub use topology::{DeviceInfo, Topology, TopologyExecutable};

/// Live PJRT objects held by this process (for leak tests): incremented where a wrapper takes
/// ownership of a handle, decremented where it destroys it.
pub(crate) static LIVE_BUFFERS: AtomicUsize = AtomicUsize::new(0);
pub(crate) static LIVE_EVENTS: AtomicUsize = AtomicUsize::new(0);
pub(crate) static LIVE_EXECUTABLES: AtomicUsize = AtomicUsize::new(0);

/// Counts of live PJRT objects owned by wrappers in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveObjects {
    pub buffers: usize,
    pub events: usize,
    pub executables: usize,
}

/// How many buffers, events and loaded executables are alive right now.
pub fn live_objects() -> LiveObjects {
    LiveObjects {
        buffers: LIVE_BUFFERS.load(Ordering::Relaxed),
        events: LIVE_EVENTS.load(Ordering::Relaxed),
        executables: LIVE_EXECUTABLES.load(Ordering::Relaxed),
    }
}

/// How long a thread that waits for an execution polls its completion event before it sleeps
/// on it, unless [`set_execute_spin`] changed it (0 never polls). The CPU plugin runs any
/// program above a tiny cost on its worker pool; a blocking wait then adds a wake-up of the
/// waiting thread, tens of microseconds on a busy machine. Only programs whose last run
/// finished within this time are polled for (longer ones would lose a core to it).
// 100 us: above the wake-up measured with it (commit 2366577: mlp 17 us a call, ~30 us more after a pause).
pub const EXECUTE_SPIN: std::time::Duration = std::time::Duration::from_micros(100);

static EXECUTE_SPIN_NANOS: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(EXECUTE_SPIN.as_nanos() as u64);

/// The current poll time before a blocking wait on an execution (see [`EXECUTE_SPIN`]).
pub fn execute_spin() -> std::time::Duration {
    std::time::Duration::from_nanos(EXECUTE_SPIN_NANOS.load(Ordering::Relaxed))
}

/// Sets the poll time before a blocking wait on an execution, for this process.
pub fn set_execute_spin(spin: std::time::Duration) {
    let nanos = u64::try_from(spin.as_nanos()).unwrap_or(u64::MAX);
    EXECUTE_SPIN_NANOS.store(nanos, Ordering::Relaxed);
}

/// Errors of the PJRT runtime.
#[derive(Debug, thiserror::Error)]
pub enum PjrtError {
    #[error("cannot load PJRT plugin {path}: {reason}")]
    Load { path: String, reason: String },
    /// A PJRT function returned an error; `message` is the plugin's text.
    #[error("{function} failed ({}): {message}", error_code_name(*.code))]
    Call {
        function: &'static str,
        /// `PJRT_Error_Code` (absl status code numbering).
        code: i32,
        message: String,
    },
    /// The plugin's function table lacks (or has a null) `function`,
    /// typically because the plugin is older than our header.
    #[error("PJRT plugin (API {}.{}) does not provide {function}", .version.0, .version.1)]
    Missing {
        function: &'static str,
        version: (i32, i32),
    },
    #[error("PJRT: {0}")]
    Other(String),
}

impl PjrtError {
    /// Renames the failing function of a `Call` error (events report through
    /// `PJRT_Event_Await`, which says nothing about what was awaited).
    fn in_context(self, what: &'static str) -> PjrtError {
        match self {
            PjrtError::Call { code, message, .. } => PjrtError::Call {
                function: what,
                code,
                message,
            },
            e => e,
        }
    }
}

/// Name of a `PJRT_Error_Code`.
pub fn error_code_name(code: i32) -> &'static str {
    const NAMES: [&str; 17] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    usize::try_from(code)
        .ok()
        .and_then(|i| NAMES.get(i).copied())
        .unwrap_or("UNKNOWN_CODE")
}

/// Element types of buffers (the subset of `PJRT_Buffer_Type` torch uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementType {
    Pred,
    S8,
    S16,
    S32,
    S64,
    U8,
    U16,
    U32,
    U64,
    F16,
    BF16,
    F32,
    F64,
    C64,
    C128,
}

impl ElementType {
    /// Bytes per element (`Pred` is one byte, as in XLA's dense layout).
    pub fn byte_size(self) -> usize {
        use ElementType::*;
        match self {
            Pred | S8 | U8 => 1,
            S16 | U16 | F16 | BF16 => 2,
            S32 | U32 | F32 => 4,
            S64 | U64 | F64 | C64 => 8,
            C128 => 16,
        }
    }

    /// The name torch gives the type (`float32`, `bool`), as errors word it.
    pub fn name(self) -> &'static str {
        use ElementType::*;
        match self {
            Pred => "bool",
            S8 => "int8",
            S16 => "int16",
            S32 => "int32",
            S64 => "int64",
            U8 => "uint8",
            U16 => "uint16",
            U32 => "uint32",
            U64 => "uint64",
            F16 => "float16",
            BF16 => "bfloat16",
            F32 => "float32",
            F64 => "float64",
            C64 => "complex64",
            C128 => "complex128",
        }
    }

    fn to_raw(self) -> sys::PJRT_Buffer_Type {
        use ElementType::*;
        match self {
            Pred => sys::PJRT_Buffer_Type_PRED,
            S8 => sys::PJRT_Buffer_Type_S8,
            S16 => sys::PJRT_Buffer_Type_S16,
            S32 => sys::PJRT_Buffer_Type_S32,
            S64 => sys::PJRT_Buffer_Type_S64,
            U8 => sys::PJRT_Buffer_Type_U8,
            U16 => sys::PJRT_Buffer_Type_U16,
            U32 => sys::PJRT_Buffer_Type_U32,
            U64 => sys::PJRT_Buffer_Type_U64,
            F16 => sys::PJRT_Buffer_Type_F16,
            BF16 => sys::PJRT_Buffer_Type_BF16,
            F32 => sys::PJRT_Buffer_Type_F32,
            F64 => sys::PJRT_Buffer_Type_F64,
            C64 => sys::PJRT_Buffer_Type_C64,
            C128 => sys::PJRT_Buffer_Type_C128,
        }
    }

    fn from_raw(raw: sys::PJRT_Buffer_Type) -> Option<ElementType> {
        use ElementType::*;
        Some(match raw {
            sys::PJRT_Buffer_Type_PRED => Pred,
            sys::PJRT_Buffer_Type_S8 => S8,
            sys::PJRT_Buffer_Type_S16 => S16,
            sys::PJRT_Buffer_Type_S32 => S32,
            sys::PJRT_Buffer_Type_S64 => S64,
            sys::PJRT_Buffer_Type_U8 => U8,
            sys::PJRT_Buffer_Type_U16 => U16,
            sys::PJRT_Buffer_Type_U32 => U32,
            sys::PJRT_Buffer_Type_U64 => U64,
            sys::PJRT_Buffer_Type_F16 => F16,
            sys::PJRT_Buffer_Type_BF16 => BF16,
            sys::PJRT_Buffer_Type_F32 => F32,
            sys::PJRT_Buffer_Type_F64 => F64,
            sys::PJRT_Buffer_Type_C64 => C64,
            sys::PJRT_Buffer_Type_C128 => C128,
            _ => return None,
        })
    }
}

impl std::fmt::Display for ElementType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What the runtime may do with host memory handed to
/// [`Client::buffer_from_host`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostBufferSemantics {
    /// The data is copied before the call returns.
    ImmutableOnlyDuringCall,
    /// The data is read after the call returns, until the transfer completes.
    ImmutableUntilTransferCompletes,
    /// The buffer may alias the host memory for its whole life (no copy).
    ImmutableZeroCopy,
}

impl HostBufferSemantics {
    fn to_raw(self) -> sys::PJRT_HostBufferSemantics {
        match self {
            HostBufferSemantics::ImmutableOnlyDuringCall => {
                sys::PJRT_HostBufferSemantics_kImmutableOnlyDuringCall
            }
            HostBufferSemantics::ImmutableUntilTransferCompletes => {
                sys::PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes
            }
            HostBufferSemantics::ImmutableZeroCopy => {
                sys::PJRT_HostBufferSemantics_kImmutableZeroCopy
            }
        }
    }
}

/// Environment variable naming the CPU PJRT plugin (.so) to use.
pub const PLUGIN_PATH_ENV: &str = "TPUC_PJRT_PLUGIN";

const CPU_PLUGIN_IN_WHEEL: &str = "xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so";

/// Finds the CPU PJRT plugin: `$TPUC_PJRT_PLUGIN` if set, else the wheel
/// `xla-cpu-pjrt` installed in the workspace venv
/// (`<workspace>/.venv/lib/python3*/site-packages/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so`).
/// Meant for tests and tools run from the source tree.
pub fn default_cpu_plugin_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(PLUGIN_PATH_ENV) {
        return Some(PathBuf::from(p));
    }
    let workspace_root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent()?;
    let mut found: Vec<PathBuf> = std::fs::read_dir(workspace_root.join(".venv/lib"))
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path().join("site-packages").join(CPU_PLUGIN_IN_WHEEL))
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found.pop()
}
