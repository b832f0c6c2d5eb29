//! Compiled executables: compile options, execution, serialization.

use std::collections::BTreeMap;
use std::ffi::c_char;
use std::ptr;
use std::sync::Arc;

use smallvec::SmallVec;

use super::api::{copy_str, pjrt_call, Api, Args, Event};
use super::buffer::Buffer;
use super::client_handle::ClientInner;
use super::{sys, PjrtError};

/// XLA compile options: the few fields of `xla.CompileOptionsProto` we set.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CompileOptions {
    pub num_replicas: i64,
    pub num_partitions: i64,
    pub use_spmd_partitioning: bool,
    /// The device id of each partition (one replica). Empty: the plugin's client picks them;
    /// a compile without a client (a [`crate::Topology`]) needs them spelled out.
    pub partition_devices: Vec<i64>,
    /// XLA debug options for this compile only, by `xla.DebugOptions` field name (what
    /// `XLA_FLAGS` sets process-wide as `--name=value`): sent as the proto's
    /// `env_option_overrides`, which the plugin applies over its defaults and `XLA_FLAGS`.
    pub xla_options: BTreeMap<String, XlaOption>,
}

/// The value of one XLA debug option (`xla.OptionOverrideProto`). A string is parsed as
/// `XLA_FLAGS` would parse it (a repeated enum: comma-separated names, "" for none).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum XlaOption {
    Str(String),
    Bool(bool),
    Int(i64),
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            num_replicas: 1,
            num_partitions: 1,
            use_spmd_partitioning: false,
            partition_devices: Vec::new(),
            xla_options: BTreeMap::new(),
        }
    }
}

/// `xla.CompileOptionsProto` (xla/pjrt/proto/compile_options.proto), only the
/// fields we use; unknown fields keep their defaults on the plugin side.
#[derive(Clone, PartialEq, prost::Message)]
struct CompileOptionsProto {
    #[prost(message, optional, tag = "3")]
    executable_build_options: Option<ExecutableBuildOptionsProto>,
    /// Sorted by name (a BTreeMap), so equal options encode to equal bytes: the cache key
    /// hashes the encoding.
    #[prost(btree_map = "string, message", tag = "7")]
    env_option_overrides: BTreeMap<String, OptionOverrideProto>,
}

/// `xla.OptionOverrideProto`: one debug option's value.
#[derive(Clone, PartialEq, prost::Message)]
struct OptionOverrideProto {
    #[prost(oneof = "OptionOverrideValue", tags = "1, 2, 3")]
    value: Option<OptionOverrideValue>,
}

/// Its oneof `value`: string_field = 1, bool_field = 2, int_field = 3 (double_field = 4 unused).
#[derive(Clone, PartialEq, prost::Oneof)]
enum OptionOverrideValue {
    #[prost(string, tag = "1")]
    Str(String),
    #[prost(bool, tag = "2")]
    Bool(bool),
    #[prost(int64, tag = "3")]
    Int(i64),
}

/// `xla.ExecutableBuildOptionsProto`, likewise partial.
#[derive(Clone, PartialEq, prost::Message)]
struct ExecutableBuildOptionsProto {
    #[prost(int64, tag = "4")]
    num_replicas: i64,
    #[prost(int64, tag = "5")]
    num_partitions: i64,
    #[prost(bool, tag = "6")]
    use_spmd_partitioning: bool,
    #[prost(message, optional, tag = "9")]
    device_assignment: Option<DeviceAssignmentProto>,
}

/// `xla.DeviceAssignmentProto`: for each computation (partition), its device per replica.
#[derive(Clone, PartialEq, prost::Message)]
struct DeviceAssignmentProto {
    #[prost(int32, tag = "1")]
    replica_count: i32,
    #[prost(int32, tag = "2")]
    computation_count: i32,
    #[prost(message, repeated, tag = "3")]
    computation_devices: Vec<ComputationDevice>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ComputationDevice {
    #[prost(int64, repeated, tag = "1")]
    replica_device_ids: Vec<i64>,
}

impl CompileOptions {
    /// Serialized `CompileOptionsProto`. Always contains the build options:
    /// empty bytes make the CPU plugin abort the process.
    pub fn encode(&self) -> Vec<u8> {
        prost::Message::encode_to_vec(&CompileOptionsProto {
            executable_build_options: Some(ExecutableBuildOptionsProto {
                num_replicas: self.num_replicas,
                num_partitions: self.num_partitions,
                use_spmd_partitioning: self.use_spmd_partitioning,
                device_assignment: (!self.partition_devices.is_empty()).then(|| {
                    DeviceAssignmentProto {
                        replica_count: 1,
                        computation_count: self.partition_devices.len() as i32,
                        computation_devices: self
                            .partition_devices
                            .iter()
                            .map(|&id| ComputationDevice {
                                replica_device_ids: vec![id],
                            })
                            .collect(),
                    }
                }),
            }),
            env_option_overrides: self
                .xla_options
                .iter()
                .map(|(name, value)| {
                    let value = match value {
                        XlaOption::Str(s) => OptionOverrideValue::Str(s.clone()),
                        XlaOption::Bool(b) => OptionOverrideValue::Bool(*b),
                        XlaOption::Int(i) => OptionOverrideValue::Int(*i),
                    };
                    (name.clone(), OptionOverrideProto { value: Some(value) })
                })
                .collect(),
        })
    }
}

/// A compiled program loaded on the client's devices.
pub struct LoadedExecutable {
    client: Arc<ClientInner>,
    raw: *mut sys::PJRT_LoadedExecutable,
    num_outputs: usize,
    /// Devices it runs on: one argument list per device in `execute_sharded`.
    num_devices: usize,
    deserialized: bool,
    /// Nanoseconds the last execution took until its outputs were ready: a wait polls the
    /// completion event only for programs that finish within the poll time (see
    /// [`super::execute_spin`]); polling through a longer one would only take a core from it.
    last_run_nanos: std::sync::atomic::AtomicU64,
}

// SAFETY: PJRT loaded executables are thread-safe (concurrent Execute calls are
// allowed by PjRtLoadedExecutable's contract); the handle is only passed to
// PJRT.
unsafe impl Send for LoadedExecutable {}
// SAFETY: see `Send`.
unsafe impl Sync for LoadedExecutable {}

impl Drop for LoadedExecutable {
    fn drop(&mut self) {
        super::LIVE_EXECUTABLES.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        let mut args = sys::PJRT_LoadedExecutable_Destroy_Args::new();
        args.executable = self.raw;
        // SAFETY: the executable is live and not used after this.
        let destroyed =
            unsafe { pjrt_call!(self.client.api(), PJRT_LoadedExecutable_Destroy, &mut args) };
        if let Err(e) = destroyed {
            tracing::warn!("{e}");
        }
    }
}

impl std::fmt::Debug for LoadedExecutable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedExecutable")
            .field("num_outputs", &self.num_outputs)
            .field("num_devices", &self.num_devices)
            .finish()
    }
}

/// The `PJRT_Executable` view of a loaded executable (from GetExecutable),
/// destroyed on drop.
struct ExecutableView<'a> {
    exe: &'a LoadedExecutable,
    raw: *mut sys::PJRT_Executable,
}

impl Drop for ExecutableView<'_> {
    fn drop(&mut self) {
        let mut args = sys::PJRT_Executable_Destroy_Args::new();
        args.executable = self.raw;
        // SAFETY: the view is live and not used after this.
        let destroyed =
            unsafe { pjrt_call!(self.exe.client.api(), PJRT_Executable_Destroy, &mut args) };
        if let Err(e) = destroyed {
            tracing::warn!("{e}");
        }
    }
}

impl LoadedExecutable {
    /// Wraps a fresh executable (owning it even on error) and caches its
    /// output and device counts, needed on every execute.
    pub(crate) fn from_raw(
        client: Arc<ClientInner>,
        raw: *mut sys::PJRT_LoadedExecutable,
        deserialized: bool,
    ) -> Result<LoadedExecutable, PjrtError> {
        if raw.is_null() {
            return Err(PjrtError::Other("PJRT returned no executable".into()));
        }
        super::LIVE_EXECUTABLES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut exe = LoadedExecutable {
            client,
            raw,
            num_outputs: 0,
            num_devices: 0,
            deserialized,
            last_run_nanos: std::sync::atomic::AtomicU64::new(0),
        };
        exe.num_outputs = {
            let view = exe.view()?;
            let mut args = sys::PJRT_Executable_NumOutputs_Args::new();
            args.executable = view.raw;
            // SAFETY: the view is live.
            unsafe { pjrt_call!(exe.client.api(), PJRT_Executable_NumOutputs, &mut args) }?;
            args.num_outputs
        };
        let mut args = sys::PJRT_LoadedExecutable_AddressableDevices_Args::new();
        args.executable = exe.raw;
        // SAFETY: the executable is live.
        unsafe {
            pjrt_call!(
                exe.client.api(),
                PJRT_LoadedExecutable_AddressableDevices,
                &mut args
            )
        }?;
        exe.num_devices = args.num_addressable_devices;
        Ok(exe)
    }

    fn view(&self) -> Result<ExecutableView<'_>, PjrtError> {
        let mut args = sys::PJRT_LoadedExecutable_GetExecutable_Args::new();
        args.loaded_executable = self.raw;
        // SAFETY: the executable is live.
        unsafe {
            pjrt_call!(
                self.client.api(),
                PJRT_LoadedExecutable_GetExecutable,
                &mut args
            )
        }?;
        if args.executable.is_null() {
            return Err(PjrtError::Other(
                "PJRT_LoadedExecutable_GetExecutable returned null".into(),
            ));
        }
        Ok(ExecutableView {
            exe: self,
            raw: args.executable,
        })
    }

    /// Outputs per device; tuple results come back as separate buffers.
    pub fn num_outputs(&self) -> Result<usize, PjrtError> {
        Ok(self.num_outputs)
    }

    /// Number of devices the executable runs on (replicas x partitions).
    pub fn num_devices(&self) -> usize {
        self.num_devices
    }

    /// Whether this executable came from [`crate::Client::deserialize`].
    pub fn is_deserialized(&self) -> bool {
        self.deserialized
    }

    /// Runs a single-device executable and waits for it to finish. No argument is donated:
    /// each stays usable (an argument the module aliases to an output is copied by the plugin).
    pub fn execute(&self, args: &[&Buffer]) -> Result<Vec<Buffer>, PjrtError> {
        let mut outputs = self.run(&[args], None)?;
        Ok(outputs.pop().unwrap_or_default())
    }

    /// As [`LoadedExecutable::execute`], but the arguments whose `donate` entry is true give
    /// their memory to the output the module aliases them to (`tf.aliasing_output`): such an
    /// argument's buffer must not be read after the call, and a host view donated this way has
    /// the output written into the viewed memory.
    pub fn execute_donating(
        &self,
        args: &[&Buffer],
        donate: &[bool],
    ) -> Result<Vec<Buffer>, PjrtError> {
        if donate.len() != args.len() {
            return Err(PjrtError::Other(format!(
                "{} donation flags for {} arguments",
                donate.len(),
                args.len()
            )));
        }
        let mut outputs = self.run(&[args], Some(donate))?;
        Ok(outputs.pop().unwrap_or_default())
    }

    /// Runs on all devices of the executable, one argument list per device
    /// (replica-major, as in the device assignment), and waits for all.
    pub fn execute_sharded(
        &self,
        per_device_args: &[Vec<&Buffer>],
    ) -> Result<Vec<Vec<Buffer>>, PjrtError> {
        let lists: Vec<&[&Buffer]> = per_device_args.iter().map(Vec::as_slice).collect();
        self.run(&lists, None)
    }

    /// `donate`: per argument, whether it may be donated (None: none is).
    fn run(
        &self,
        lists: &[&[&Buffer]],
        donate: Option<&[bool]>,
    ) -> Result<Vec<Vec<Buffer>>, PjrtError> {
        if lists.len() != self.num_devices {
            return Err(PjrtError::Other(format!(
                "executable runs on {} devices, got {} argument lists",
                self.num_devices,
                lists.len()
            )));
        }
        let num_args = lists.first().map_or(0, |l| l.len());
        if lists.iter().any(|l| l.len() != num_args) {
            return Err(PjrtError::Other("argument lists differ in length".into()));
        }
        // A buffer of another client would be undefined behaviour in PJRT.
        if lists
            .iter()
            .flat_map(|l| l.iter())
            .any(|b| !Arc::ptr_eq(&b.client, &self.client))
        {
            return Err(PjrtError::Other(
                "argument buffer belongs to another client".into(),
            ));
        }
        // On the stack for one device and a few arguments (every call builds these arrays); the
        // pointers below point into them, so none of them moves before the call.
        let raw_args: SmallVec<[SmallVec<[*mut sys::PJRT_Buffer; 8]>; 1]> = lists
            .iter()
            .map(|l| l.iter().map(|b| b.raw).collect())
            .collect();
        let arg_ptrs: SmallVec<[*const *mut sys::PJRT_Buffer; 1]> =
            raw_args.iter().map(|l| l.as_ptr()).collect();
        let mut raw_outs: SmallVec<[SmallVec<[*mut sys::PJRT_Buffer; 4]>; 1]> = (0..lists.len())
            .map(|_| smallvec::smallvec![ptr::null_mut(); self.num_outputs])
            .collect();
        let out_ptrs: SmallVec<[*mut *mut sys::PJRT_Buffer; 1]> =
            raw_outs.iter_mut().map(|l| l.as_mut_ptr()).collect();
        let mut events: SmallVec<[*mut sys::PJRT_Event; 1]> =
            smallvec::smallvec![ptr::null_mut(); lists.len()];

        // PJRT donates every argument the module aliases to an output unless it is listed here.
        let kept: SmallVec<[i64; 8]> = (0..num_args)
            .filter(|&i| !donate.is_some_and(|d| d[i]))
            .map(|i| i as i64)
            .collect();
        let mut options = sys::PJRT_ExecuteOptions::new();
        options.non_donatable_input_indices = kept.as_ptr();
        options.num_non_donatable_input_indices = kept.len();
        let mut args = sys::PJRT_LoadedExecutable_Execute_Args::new();
        args.executable = self.raw;
        args.options = &mut options;
        args.argument_lists = arg_ptrs.as_ptr();
        args.num_devices = lists.len();
        args.num_args = num_args;
        args.output_lists = out_ptrs.as_ptr();
        args.device_complete_events = events.as_mut_ptr();
        let api = self.client.api();
        let started = std::time::Instant::now();
        let executing = Executing::enter();
        // SAFETY: all arrays have the sizes PJRT expects ([num_devices][num_args]
        // inputs of this client, [num_devices][num_outputs] outputs,
        // [num_devices] events) and outlive the call.
        let launched = unsafe { pjrt_call!(api, PJRT_LoadedExecutable_Execute, &mut args) };
        drop(executing);
        launched?;

        // Take ownership of everything before waiting, so an error below
        // still frees all outputs and events.
        let events: SmallVec<[Event; 1]> = events
            .into_iter()
            .filter_map(|e| Event::from_raw(api, e))
            .collect();
        let mut first_err = None;
        let outputs: Vec<Vec<Buffer>> = raw_outs
            .into_iter()
            .map(|l| {
                l.into_iter()
                    .filter_map(|b| match Buffer::from_raw(self.client.clone(), b) {
                        Ok(b) => Some(b),
                        Err(e) => {
                            first_err.get_or_insert(e);
                            None
                        }
                    })
                    .collect()
            })
            .collect();
        let mut spin = super::execute_spin();
        let last = self
            .last_run_nanos
            .load(std::sync::atomic::Ordering::Relaxed);
        if u128::from(last) > spin.as_nanos() {
            spin = std::time::Duration::ZERO;
        }
        for e in events {
            if let Err(err) =
                e.wait_spinning("PJRT_LoadedExecutable_Execute (device completion)", spin)
            {
                first_err.get_or_insert(err);
            }
        }
        let took = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last_run_nanos
            .store(took, std::sync::atomic::Ordering::Relaxed);
        match first_err {
            Some(e) => Err(e),
            None => Ok(outputs),
        }
    }

    /// How long the last execution took, from execute to completion (None before the first).
    pub fn last_run(&self) -> Option<std::time::Duration> {
        match self
            .last_run_nanos
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            0 => None,
            n => Some(std::time::Duration::from_nanos(n)),
        }
    }

    /// Serializes the executable for [`crate::Client::deserialize`].
    ///
    /// Refused for an executable that was itself deserialized: the CPU
    /// plugin then returns a truncated blob that loads but fails in Execute.
    /// Keep the bytes of the fresh compile instead.
    pub fn serialize(&self) -> Result<Vec<u8>, PjrtError> {
        if self.deserialized {
            return Err(PjrtError::Other(
                "cannot serialize a deserialized executable (the plugin would return a broken \
                 blob); keep the bytes it was loaded from"
                    .into(),
            ));
        }
        let view = self.view()?;
        // SAFETY: the view is a live executable of this client's plugin.
        unsafe { serialize_raw(self.client.api(), view.raw) }
    }

    /// The optimized program, as `(format, bytes)`; the CPU plugin gives
    /// format "hlo": a serialized `xla.HloModuleProto`.
    pub fn optimized_program(&self) -> Result<(String, Vec<u8>), PjrtError> {
        let view = self.view()?;
        let api = self.client.api();
        let mut program = sys::PJRT_Program::new();
        let mut args = sys::PJRT_Executable_OptimizedProgram_Args::new();
        args.executable = view.raw;
        args.program = &mut program;
        // First call with `code == null` asks for the size.
        // SAFETY: the view and `program` are live.
        unsafe { pjrt_call!(api, PJRT_Executable_OptimizedProgram, &mut args) }?;
        let mut code = vec![0u8; program.code_size];
        program.code = code.as_mut_ptr().cast::<c_char>();
        // SAFETY: `code` has the `code_size` bytes the plugin asked for.
        unsafe { pjrt_call!(api, PJRT_Executable_OptimizedProgram, &mut args) }?;
        code.truncate(program.code_size);
        // SAFETY: `format` is owned by the plugin and is copied while the
        // view is alive.
        let format = unsafe { copy_str(program.format, program.format_size) };
        Ok((format, code))
    }

    /// Optimized HLO as text: the plugin's own text when it offers a text
    /// format, else printed by tpuc from the serialized HloModuleProto (the CPU
    /// plugin's `hlo_with_config`; see `hlo_text`). `None` for other formats.
    pub fn optimized_hlo_text(&self) -> Result<Option<String>, PjrtError> {
        let (format, code) = self.optimized_program()?;
        Ok(match format.as_str() {
            "hlo_text" | "text" | "mlir_text" => Some(String::from_utf8_lossy(&code).into_owned()),
            "hlo_with_config" | "hlo" => {
                super::hlo_text::hlo_text_from_proto(&code, format == "hlo_with_config").ok()
            }
            _ => None,
        })
    }

    /// Memory per device, as the compiler planned it.
    pub fn memory_stats(&self) -> Result<super::MemoryStats, PjrtError> {
        let view = self.view()?;
        // SAFETY: the view is a live executable of this client's plugin.
        unsafe { super::analysis::memory_stats(self.client.api(), view.raw) }
    }

    /// The compiler's cost analysis (flops, bytes accessed, ...).
    pub fn cost_analysis(&self) -> Result<Vec<(String, f64)>, PjrtError> {
        let view = self.view()?;
        // SAFETY: as in `memory_stats`.
        unsafe { super::analysis::cost_analysis(self.client.api(), view.raw) }
    }

    /// Fingerprint of the compiled program, if the plugin provides one.
    pub fn fingerprint(&self) -> Option<String> {
        let view = self.view().ok()?;
        let mut args = sys::PJRT_Executable_Fingerprint_Args::new();
        args.executable = view.raw;
        // SAFETY: the view is live.
        unsafe { pjrt_call!(self.client.api(), PJRT_Executable_Fingerprint, &mut args) }.ok()?;
        // SAFETY: owned by the view, copied before it is destroyed.
        let s = unsafe {
            copy_str(
                args.executable_fingerprint,
                args.executable_fingerprint_size,
            )
        };
        (!s.is_empty()).then_some(s)
    }
}

/// `PJRT_Executable_Serialize` of `raw`.
///
/// # Safety
/// `raw` must be a live `PJRT_Executable` of the plugin whose table `api` is.
pub(crate) unsafe fn serialize_raw(
    api: &Api,
    raw: *mut sys::PJRT_Executable,
) -> Result<Vec<u8>, PjrtError> {
    let mut args = sys::PJRT_Executable_Serialize_Args::new();
    args.executable = raw;
    // SAFETY: `raw` is live (the caller's contract).
    unsafe { pjrt_call!(api, PJRT_Executable_Serialize, &mut args) }?;
    let bytes = if args.serialized_bytes.is_null() {
        Vec::new()
    } else {
        // SAFETY: the bytes are backed by `serialized_executable`, freed just below, after the
        // copy.
        unsafe {
            std::slice::from_raw_parts(
                args.serialized_bytes.cast::<u8>(),
                args.serialized_bytes_size,
            )
        }
        .to_vec()
    };
    if let Some(deleter) = args.serialized_executable_deleter {
        // SAFETY: the plugin's deleter for the object it handed out.
        unsafe { deleter(args.serialized_executable) };
    }
    if bytes.is_empty() {
        return Err(PjrtError::Other(
            "PJRT_Executable_Serialize returned no bytes".into(),
        ));
    }
    Ok(bytes)
}

thread_local! {
    /// Set while this thread is inside `PJRT_LoadedExecutable_Execute` (see [`Executing`]).
    static EXECUTING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is inside [`LoadedExecutable::execute`]'s call into the plugin: the CPU
/// plugin may run a program on the calling thread, so a host kernel called here runs on a
/// thread of the caller's (PyTorch's products on it use MKL's own threads), not one of XLA's.
pub fn executing_on_this_thread() -> bool {
    EXECUTING.with(|e| e.get())
}

/// Marks this thread as calling execute while it lives (see [`executing_on_this_thread`]).
struct Executing(bool);

impl Executing {
    fn enter() -> Executing {
        Executing(EXECUTING.with(|e| e.replace(true)))
    }
}

impl Drop for Executing {
    fn drop(&mut self) {
        EXECUTING.with(|e| e.set(self.0));
    }
}
