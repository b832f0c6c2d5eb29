//! `PJRT_Client`: devices, compilation, host-to-device transfers.

use std::ffi::c_char;
use std::ptr;
use std::sync::Arc;

use super::api::{copy_str, mlir_program, pjrt_call, Args, Event};
use super::buffer::Buffer;
use super::client_handle::ClientInner;
use super::executable::{CompileOptions, LoadedExecutable};
use super::named_values::{named_values, OptionValue};
use super::plugin::Plugin;
use super::topology::{describe, DeviceInfo};
use super::{sys, ElementType, HostBufferSemantics, PjrtError};

/// A PJRT client. Cloning is cheap and shares the client; the PJRT client is
/// destroyed when the last clone, executable and buffer made from it is gone.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<ClientInner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("plugin", &self.inner.plugin.path())
            .field("devices", &self.inner.devices.len())
            .finish()
    }
}

impl Client {
    /// Creates a client with `options` passed to `PJRT_Client_Create` as they are.
    pub fn new(
        plugin: &'static Plugin,
        options: &[(String, OptionValue)],
    ) -> Result<Client, PjrtError> {
        let api = &plugin.api;
        let options = named_values(options);
        let mut args = sys::PJRT_Client_Create_Args::new();
        args.create_options = options.as_ptr();
        args.num_options = options.len();
        // SAFETY: `options` and the strings and lists they point into outlive
        // the call; no key-value store callbacks are given.
        unsafe { pjrt_call!(api, PJRT_Client_Create, &mut args) }?;
        if args.client.is_null() {
            return Err(PjrtError::Other(
                "PJRT_Client_Create returned no client".into(),
            ));
        }
        // Wrap first so the client is destroyed if the device query fails.
        let mut inner = ClientInner {
            plugin,
            raw: args.client,
            devices: Vec::new(),
        };
        let mut args = sys::PJRT_Client_AddressableDevices_Args::new();
        args.client = inner.raw;
        // SAFETY: the client is live.
        unsafe { pjrt_call!(api, PJRT_Client_AddressableDevices, &mut args) }?;
        if args.num_addressable_devices > 0 {
            // SAFETY: the plugin returns an array of that many device handles,
            // owned by the client.
            inner.devices = unsafe {
                std::slice::from_raw_parts(args.addressable_devices, args.num_addressable_devices)
            }
            .to_vec();
        }
        Ok(Client {
            inner: Arc::new(inner),
        })
    }

    pub fn plugin(&self) -> &'static Plugin {
        self.inner.plugin
    }

    /// Platform name, e.g. "cpu".
    pub fn platform_name(&self) -> Result<String, PjrtError> {
        let mut args = sys::PJRT_Client_PlatformName_Args::new();
        args.client = self.inner.raw;
        // SAFETY: the client is live; the returned string is owned by it and
        // copied before `self` can go away.
        unsafe {
            pjrt_call!(self.inner.api(), PJRT_Client_PlatformName, &mut args)?;
            Ok(copy_str(args.platform_name, args.platform_name_size))
        }
    }

    /// Platform version string of the plugin.
    pub fn platform_version(&self) -> Result<String, PjrtError> {
        let mut args = sys::PJRT_Client_PlatformVersion_Args::new();
        args.client = self.inner.raw;
        // SAFETY: as in `platform_name`.
        unsafe {
            pjrt_call!(self.inner.api(), PJRT_Client_PlatformVersion, &mut args)?;
            Ok(copy_str(args.platform_version, args.platform_version_size))
        }
    }

    pub fn addressable_device_count(&self) -> usize {
        self.inner.devices.len()
    }

    /// Every device of the client (on a multi-host slice, the other hosts' too), ordered by id,
    /// with its kind: what a [`crate::Topology`] of the same devices reports.
    pub fn devices(&self) -> Result<Vec<DeviceInfo>, PjrtError> {
        let api = self.inner.api();
        let mut args = sys::PJRT_Client_Devices_Args::new();
        args.client = self.inner.raw;
        // SAFETY: the client is live; the device handles it returns are owned by it.
        unsafe { pjrt_call!(api, PJRT_Client_Devices, &mut args) }?;
        let handles = if args.devices.is_null() {
            &[][..]
        } else {
            // SAFETY: the plugin returned that many device handles, owned by the client.
            unsafe { std::slice::from_raw_parts(args.devices, args.num_devices) }
        };
        let mut devices = Vec::with_capacity(handles.len());
        for &device in handles {
            let mut d = sys::PJRT_Device_GetDescription_Args::new();
            d.device = device;
            // SAFETY: the device is owned by the live client; so is its description.
            unsafe { pjrt_call!(api, PJRT_Device_GetDescription, &mut d) }?;
            // SAFETY: the description is live while the client is.
            devices.push(unsafe { describe(api, d.device_description) }?);
        }
        devices.sort_by_key(|d| d.id);
        Ok(devices)
    }

    /// Compiles a StableHLO module given as MLIR text (or bytecode: the
    /// format "mlir" accepts both). Parse and verification errors come back
    /// as `PjrtError::Call` with the plugin's diagnostics.
    pub fn compile(
        &self,
        stablehlo_mlir_text: &str,
        options: &CompileOptions,
    ) -> Result<LoadedExecutable, PjrtError> {
        self.compile_bytes(stablehlo_mlir_text.as_bytes(), options)
    }

    /// Like [`Client::compile`], for MLIR bytecode or text as bytes.
    pub fn compile_bytes(
        &self,
        stablehlo_mlir: &[u8],
        options: &CompileOptions,
    ) -> Result<LoadedExecutable, PjrtError> {
        let _span = tracing::debug_span!("pjrt_compile", bytes = stablehlo_mlir.len()).entered();
        let program = mlir_program(stablehlo_mlir);
        // Never empty: empty options abort the process inside the CPU plugin.
        let encoded = options.encode();
        let mut args = sys::PJRT_Client_Compile_Args::new();
        args.client = self.inner.raw;
        args.program = &program;
        args.compile_options = encoded.as_ptr().cast::<c_char>();
        args.compile_options_size = encoded.len();
        // SAFETY: the client is live; `program`, the code and `encoded`
        // outlive the call, which only reads them.
        unsafe { pjrt_call!(self.inner.api(), PJRT_Client_Compile, &mut args) }?;
        LoadedExecutable::from_raw(self.inner.clone(), args.executable, false)
    }

    /// [`Client::compile_bytes`] with the calling thread allowed onto one CPU while the plugin
    /// compiles. XLA's CPU compiler sizes its intra-op partitions of loop fusions by the CPUs
    /// the compiling thread may run on, so the executable runs every loop fusion on the calling
    /// thread: for a small graph the thread-pool hand-offs cost more than the second core gives
    /// (a 7x7 depthwise convolution over 2x32x16x16: 150 us partitioned, 90 not). GEMMs and
    /// convolutions keep their library's own threads. The affinity is restored after.
    pub fn compile_bytes_unpartitioned(
        &self,
        stablehlo_mlir: &[u8],
        options: &CompileOptions,
    ) -> Result<LoadedExecutable, PjrtError> {
        let _pinned = OneCpu::pin();
        self.compile_bytes(stablehlo_mlir, options)
    }

    /// Loads an executable serialized by [`LoadedExecutable::serialize`].
    /// Only load blobs made by the same plugin build (see
    /// [`Plugin::identity`]): another build may accept them and compute
    /// wrong results.
    pub fn deserialize(&self, bytes: &[u8]) -> Result<LoadedExecutable, PjrtError> {
        let _span = tracing::debug_span!("pjrt_deserialize", bytes = bytes.len()).entered();
        let mut args = sys::PJRT_Executable_DeserializeAndLoad_Args::new();
        args.client = self.inner.raw;
        args.serialized_executable = bytes.as_ptr().cast::<c_char>();
        args.serialized_executable_size = bytes.len();
        // SAFETY: the client is live and `bytes` outlives the call.
        unsafe {
            pjrt_call!(
                self.inner.api(),
                PJRT_Executable_DeserializeAndLoad,
                &mut args
            )
        }?;
        LoadedExecutable::from_raw(self.inner.clone(), args.loaded_executable, true)
    }

    /// Creates a device buffer from dense, row-major host data of type `ty`
    /// and shape `dims` on addressable device `device_index`.
    ///
    /// # Safety
    /// `data` must point to `len_bytes` readable bytes. With
    /// [`HostBufferSemantics::ImmutableOnlyDuringCall`] they are copied before
    /// this returns. With the other semantics the memory must stay valid and
    /// unmodified until the returned [`Buffer`] is dropped (its drop waits
    /// until the runtime has released the memory).
    pub unsafe fn buffer_from_host(
        &self,
        data: *const u8,
        len_bytes: usize,
        ty: ElementType,
        dims: &[i64],
        semantics: HostBufferSemantics,
        device_index: usize,
    ) -> Result<Buffer, PjrtError> {
        let expected = dense_size(ty, dims)?;
        if expected != len_bytes {
            return Err(PjrtError::Other(format!(
                "host buffer has {len_bytes} bytes, but {ty:?}{dims:?} needs {expected}"
            )));
        }
        if data.is_null() && len_bytes > 0 {
            return Err(PjrtError::Other("host buffer pointer is null".into()));
        }
        let device = *self.inner.devices.get(device_index).ok_or_else(|| {
            PjrtError::Other(format!(
                "device index {device_index} out of range ({} addressable devices)",
                self.inner.devices.len()
            ))
        })?;
        let mut args = sys::PJRT_Client_BufferFromHostBuffer_Args::new();
        args.client = self.inner.raw;
        args.data = data.cast();
        args.type_ = ty.to_raw();
        args.dims = dims.as_ptr();
        args.num_dims = dims.len();
        args.byte_strides = ptr::null(); // dense, major-to-minor
        args.host_buffer_semantics = semantics.to_raw();
        args.device = device;
        let api = self.inner.api();
        // SAFETY: the client and device are live; `dims` outlives the call;
        // the caller vouches for `data` per this function's contract.
        unsafe { pjrt_call!(api, PJRT_Client_BufferFromHostBuffer, &mut args) }?;
        let done = Event::from_raw(api, args.done_with_host_buffer);
        let mut buffer = Buffer::from_raw(self.inner.clone(), args.buffer)?;
        match semantics {
            HostBufferSemantics::ImmutableOnlyDuringCall => {
                if let Some(done) = done {
                    done.wait("PJRT_Client_BufferFromHostBuffer (host copy)")?;
                }
            }
            // Awaited when the buffer drops, after the buffer is destroyed:
            // for zero-copy the runtime releases the memory only then.
            _ => buffer.host_done = done,
        }
        Ok(buffer)
    }
}

impl Client {
    /// A buffer that is a non-owned view of `data` on addressable device `device_index`
    /// (`PJRT_Client_CreateViewOfDeviceBuffer`): no copy, no event. On the CPU plugin device
    /// memory is host memory, so this wraps a host array for one execution more cheaply than
    /// [`Client::buffer_from_host`]. The plugin rejects data below its alignment (64 bytes on
    /// CPU) with an error.
    ///
    /// # Safety
    /// `data` must point to the dense bytes of `ty` and `dims`, device memory of that device
    /// (host memory on the CPU plugin), valid and unmodified until the buffer is dropped; the
    /// buffer must not be donated.
    pub unsafe fn view_of_device_memory(
        &self,
        data: *mut u8,
        ty: ElementType,
        dims: &[i64],
        device_index: usize,
    ) -> Result<Buffer, PjrtError> {
        let device = *self.inner.devices.get(device_index).ok_or_else(|| {
            PjrtError::Other(format!(
                "device index {device_index} out of range ({} addressable devices)",
                self.inner.devices.len()
            ))
        })?;
        let mut args = sys::PJRT_Client_CreateViewOfDeviceBuffer_Args::new();
        args.client = self.inner.raw;
        args.device_buffer_ptr = data.cast();
        args.dims = dims.as_ptr();
        args.num_dims = dims.len();
        args.element_type = ty.to_raw();
        args.layout = ptr::null_mut(); // dense, major-to-minor
        args.device = device;
        // The CPU plugin calls this unconditionally when the view is destroyed (a null one
        // terminates the process); the memory is the caller's, so there is nothing to do.
        args.on_delete_callback = Some(view_released);
        args.on_delete_callback_arg = ptr::null_mut();
        // SAFETY: the client and device are live; `dims` outlives the call; the caller vouches
        // for `data`.
        unsafe {
            pjrt_call!(
                self.inner.api(),
                PJRT_Client_CreateViewOfDeviceBuffer,
                &mut args
            )
        }?;
        Buffer::from_raw(self.inner.clone(), args.buffer)
    }
}

/// `on_delete_callback` of host-memory views: the memory belongs to the caller.
unsafe extern "C" fn view_released(
    _device_buffer_ptr: *mut std::ffi::c_void,
    _user_arg: *mut std::ffi::c_void,
) {
}

/// Bytes of a dense array of `ty` with shape `dims` (errors on negative dims
/// and overflow).
pub(crate) fn dense_size(ty: ElementType, dims: &[i64]) -> Result<usize, PjrtError> {
    dims.iter()
        .try_fold(ty.byte_size(), |acc, &d| {
            usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
        })
        .ok_or_else(|| PjrtError::Other(format!("invalid shape {dims:?}")))
}

/// The calling thread held to the first CPU it may run on, until dropped (then its affinity is
/// restored); nothing where the affinity cannot be read or set. Threads the plugin starts
/// meanwhile inherit the one CPU (XLA starts some of its own pools lazily, in the first
/// compile), so on drop every thread of the process that was not there at `pin` gets the
/// calling thread's old affinity too.
struct OneCpu {
    old: libc::cpu_set_t,
    threads_before: std::collections::HashSet<libc::pid_t>,
}

impl OneCpu {
    fn pin() -> Option<OneCpu> {
        let size = std::mem::size_of::<libc::cpu_set_t>();
        let threads_before = process_threads();
        // SAFETY: libc calls on zeroed cpu_set_t values for the calling thread (pid 0).
        unsafe {
            let mut old: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, size, &mut old) != 0 {
                return None;
            }
            let first = (0..libc::CPU_SETSIZE as usize).find(|&c| libc::CPU_ISSET(c, &old))?;
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(first, &mut one);
            (libc::sched_setaffinity(0, size, &one) == 0).then_some(OneCpu {
                old,
                threads_before,
            })
        }
    }
}

/// The thread ids of this process (`/proc/self/task`); empty where it cannot be read.
fn process_threads() -> std::collections::HashSet<libc::pid_t> {
    std::fs::read_dir("/proc/self/task")
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

impl Drop for OneCpu {
    fn drop(&mut self) {
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: restores, on the same thread, the affinity `pin` read; then gives it to the
        // threads started while pinned (ids of this process's threads; one that has exited
        // meanwhile makes the call fail, which is harmless).
        unsafe {
            libc::sched_setaffinity(0, size, &self.old);
            for tid in process_threads().difference(&self.threads_before) {
                libc::sched_setaffinity(*tid, size, &self.old);
            }
        }
    }
}
