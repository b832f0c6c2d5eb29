//! Checked access to the plugin's `PJRT_Api` function table, error conversion
//! and events.

use std::ffi::c_char;
use std::ptr;

use super::sys;
use super::PjrtError;

/// The plugin's function table. The table is static data inside the plugin,
/// which is never unloaded, so the pointer stays valid for the whole process.
pub(crate) struct Api {
    raw: *const sys::PJRT_Api,
    /// `PJRT_Api.struct_size` as reported by the plugin: fields at or past
    /// this offset do not exist in an older plugin's table.
    struct_size: usize,
    version: (i32, i32),
}

// SAFETY: the table is immutable after `GetPjrtApi` returns and the PJRT C API
// functions are thread-safe; the pointer is only read.
unsafe impl Send for Api {}
// SAFETY: see `Send`.
unsafe impl Sync for Api {}

impl Api {
    /// # Safety
    /// `raw` must be the non-null result of a plugin's `GetPjrtApi`, and the
    /// plugin must stay loaded forever.
    pub(crate) unsafe fn new(raw: *const sys::PJRT_Api) -> Result<Api, String> {
        // SAFETY: `struct_size` is the first field of every PJRT_Api version.
        let struct_size = unsafe { ptr::addr_of!((*raw).struct_size).read() };
        let version_end = std::mem::offset_of!(sys::PJRT_Api, pjrt_api_version)
            + std::mem::size_of::<sys::PJRT_Api_Version>();
        if struct_size < version_end {
            return Err(format!(
                "PJRT_Api.struct_size {struct_size} is too small to hold a version"
            ));
        }
        // SAFETY: checked just above that the version field lies inside the table.
        let v = unsafe { ptr::addr_of!((*raw).pjrt_api_version).read() };
        Ok(Api {
            raw,
            struct_size,
            version: (v.major_version, v.minor_version),
        })
    }

    pub(crate) fn version(&self) -> (i32, i32) {
        self.version
    }

    /// The head of the plugin's extension chain (null if it has none).
    pub(crate) fn extension_start(&self) -> *const sys::PJRT_Extension_Base {
        // SAFETY: `extension_start` is the second field of every PJRT_Api version.
        unsafe { ptr::addr_of!((*self.raw).extension_start).read() }
    }

    /// Reads one function pointer of the table after checking that the
    /// plugin's table is long enough to contain it. Use through [`pjrt_fn!`].
    pub(crate) fn function<F>(
        &self,
        offset: usize,
        name: &'static str,
        read: impl FnOnce(*const sys::PJRT_Api) -> Option<F>,
    ) -> Result<F, PjrtError> {
        if offset + std::mem::size_of::<Option<F>>() > self.struct_size {
            return Err(PjrtError::Missing {
                function: name,
                version: self.version,
            });
        }
        read(self.raw).ok_or(PjrtError::Missing {
            function: name,
            version: self.version,
        })
    }

    /// Turns a `PJRT_Error*` returned by `function` into a value (and frees it).
    pub(crate) fn check(
        &self,
        err: *mut sys::PJRT_Error,
        function: &'static str,
    ) -> Result<(), PjrtError> {
        if err.is_null() {
            Ok(())
        } else {
            Err(self.take_error(err, function))
        }
    }

    fn take_error(&self, err: *mut sys::PJRT_Error, function: &'static str) -> PjrtError {
        let mut message = String::from("<no message: PJRT_Error_Message unavailable>");
        if let Ok(f) = pjrt_fn!(self, PJRT_Error_Message) {
            let mut args = sys::PJRT_Error_Message_Args::new();
            args.error = err;
            // SAFETY: `err` is a live error object from this plugin.
            unsafe { f(&mut args) };
            // SAFETY: the message is owned by `err`, which is alive until
            // destroyed below; it is copied out first.
            message = unsafe { copy_str(args.message, args.message_size) };
        }
        let mut code = sys::PJRT_Error_Code_UNKNOWN as i32;
        if let Ok(f) = pjrt_fn!(self, PJRT_Error_GetCode) {
            let mut args = sys::PJRT_Error_GetCode_Args::new();
            args.error = err;
            // SAFETY: `err` is a live error object from this plugin.
            let e2 = unsafe { f(&mut args) };
            if e2.is_null() {
                code = args.code as i32;
            } else {
                self.destroy_error(e2);
            }
        }
        self.destroy_error(err);
        PjrtError::Call {
            function,
            code,
            message,
        }
    }

    fn destroy_error(&self, err: *mut sys::PJRT_Error) {
        if let Ok(f) = pjrt_fn!(self, PJRT_Error_Destroy) {
            let mut args = sys::PJRT_Error_Destroy_Args::new();
            args.error = err;
            // SAFETY: `err` is live and not used again.
            unsafe { f(&mut args) };
        }
    }
}

/// Looks up a function of the PJRT_Api table by field name:
/// `pjrt_fn!(api, PJRT_Client_Create) -> Result<unsafe extern "C" fn(..), PjrtError>`.
macro_rules! pjrt_fn {
    ($api:expr, $name:ident) => {{
        // Nested in the caller's `unsafe` block when used via `pjrt_call!`.
        #[allow(unused_unsafe)]
        // SAFETY: `Api::function` only calls this after checking that the
        // field lies within the plugin's (immutable, never freed) table.
        let read = |raw: *const $crate::sys::PJRT_Api| unsafe {
            ::std::ptr::addr_of!((*raw).$name).read()
        };
        $crate::api::Api::function(
            $api,
            ::std::mem::offset_of!($crate::sys::PJRT_Api, $name),
            stringify!($name),
            read,
        )
    }};
}
pub(crate) use pjrt_fn;

/// Calls a PJRT function that returns `PJRT_Error*`, converting the error:
/// `pjrt_call!(api, PJRT_Client_Create, &mut args) -> Result<(), PjrtError>`.
/// The caller's SAFETY comment must justify the pointers stored in `args`.
macro_rules! pjrt_call {
    ($api:expr, $name:ident, $args:expr) => {{
        let api: &$crate::api::Api = $api;
        match $crate::api::pjrt_fn!(api, $name) {
            Ok(f) => {
                let err = f($args);
                api.check(err, stringify!($name))
            }
            Err(e) => Err(e),
        }
    }};
}
pub(crate) use pjrt_call;

/// PJRT argument structs: `new()` zero-fills and sets `struct_size` from the
/// header's `*_STRUCT_SIZE` (not `size_of`, which includes tail padding).
pub(crate) trait Args: Sized {
    fn new() -> Self;
}

macro_rules! impl_args {
    ($($ty:ident => $size:ident),* $(,)?) => {$(
        impl Args for sys::$ty {
            fn new() -> Self {
                sys::$ty {
                    struct_size: sys::$size as usize,
                    ..Default::default()
                }
            }
        }
    )*};
}

impl_args! {
    PJRT_Error_Destroy_Args => PJRT_Error_Destroy_Args_STRUCT_SIZE,
    PJRT_Error_Message_Args => PJRT_Error_Message_Args_STRUCT_SIZE,
    PJRT_Error_GetCode_Args => PJRT_Error_GetCode_Args_STRUCT_SIZE,
    PJRT_NamedValue => PJRT_NamedValue_STRUCT_SIZE,
    PJRT_Plugin_Initialize_Args => PJRT_Plugin_Initialize_Args_STRUCT_SIZE,
    PJRT_Plugin_Attributes_Args => PJRT_Plugin_Attributes_Args_STRUCT_SIZE,
    PJRT_Event_Destroy_Args => PJRT_Event_Destroy_Args_STRUCT_SIZE,
    PJRT_Event_Await_Args => PJRT_Event_Await_Args_STRUCT_SIZE,
    PJRT_Event_Error_Args => PJRT_Event_Error_Args_STRUCT_SIZE,
    PJRT_Event_IsReady_Args => PJRT_Event_IsReady_Args_STRUCT_SIZE,
    PJRT_Client_Create_Args => PJRT_Client_Create_Args_STRUCT_SIZE,
    PJRT_Client_Destroy_Args => PJRT_Client_Destroy_Args_STRUCT_SIZE,
    PJRT_Client_PlatformName_Args => PJRT_Client_PlatformName_Args_STRUCT_SIZE,
    PJRT_Client_PlatformVersion_Args => PJRT_Client_PlatformVersion_Args_STRUCT_SIZE,
    PJRT_Client_AddressableDevices_Args => PJRT_Client_AddressableDevices_Args_STRUCT_SIZE,
    PJRT_Program => PJRT_Program_STRUCT_SIZE,
    PJRT_Client_Compile_Args => PJRT_Client_Compile_Args_STRUCT_SIZE,
    PJRT_Client_BufferFromHostBuffer_Args => PJRT_Client_BufferFromHostBuffer_Args_STRUCT_SIZE,
    PJRT_Client_CreateViewOfDeviceBuffer_Args => PJRT_Client_CreateViewOfDeviceBuffer_Args_STRUCT_SIZE,
    PJRT_Executable_DeserializeAndLoad_Args => PJRT_Executable_DeserializeAndLoad_Args_STRUCT_SIZE,
    PJRT_LoadedExecutable_Destroy_Args => PJRT_LoadedExecutable_Destroy_Args_STRUCT_SIZE,
    PJRT_LoadedExecutable_GetExecutable_Args => PJRT_LoadedExecutable_GetExecutable_Args_STRUCT_SIZE,
    PJRT_LoadedExecutable_AddressableDevices_Args => PJRT_LoadedExecutable_AddressableDevices_Args_STRUCT_SIZE,
    PJRT_ExecuteOptions => PJRT_ExecuteOptions_STRUCT_SIZE,
    PJRT_LoadedExecutable_Execute_Args => PJRT_LoadedExecutable_Execute_Args_STRUCT_SIZE,
    PJRT_Executable_Destroy_Args => PJRT_Executable_Destroy_Args_STRUCT_SIZE,
    PJRT_Executable_NumOutputs_Args => PJRT_Executable_NumOutputs_Args_STRUCT_SIZE,
    PJRT_Executable_Serialize_Args => PJRT_Executable_Serialize_Args_STRUCT_SIZE,
    PJRT_Executable_OptimizedProgram_Args => PJRT_Executable_OptimizedProgram_Args_STRUCT_SIZE,
    PJRT_Executable_Fingerprint_Args => PJRT_Executable_Fingerprint_Args_STRUCT_SIZE,
    PJRT_Buffer_Destroy_Args => PJRT_Buffer_Destroy_Args_STRUCT_SIZE,
    PJRT_Buffer_ElementType_Args => PJRT_Buffer_ElementType_Args_STRUCT_SIZE,
    PJRT_Buffer_Dimensions_Args => PJRT_Buffer_Dimensions_Args_STRUCT_SIZE,
    PJRT_Buffer_OnDeviceSizeInBytes_Args => PJRT_Buffer_OnDeviceSizeInBytes_Args_STRUCT_SIZE,
    PJRT_Buffer_ToHostBuffer_Args => PJRT_Buffer_ToHostBuffer_Args_STRUCT_SIZE,
    PJRT_Buffer_UnsafePointer_Args => PJRT_Buffer_UnsafePointer_Args_STRUCT_SIZE,
    PJRT_Executable_GetCostAnalysis_Args => PJRT_Executable_GetCostAnalysis_Args_STRUCT_SIZE,
    PJRT_Executable_GetCompiledMemoryStats_Args => PJRT_Executable_GetCompiledMemoryStats_Args_STRUCT_SIZE,
    PJRT_TopologyDescription_Create_Args => PJRT_TopologyDescription_Create_Args_STRUCT_SIZE,
    PJRT_TopologyDescription_Destroy_Args => PJRT_TopologyDescription_Destroy_Args_STRUCT_SIZE,
    PJRT_TopologyDescription_PlatformName_Args => PJRT_TopologyDescription_PlatformName_Args_STRUCT_SIZE,
    PJRT_TopologyDescription_PlatformVersion_Args => PJRT_TopologyDescription_PlatformVersion_Args_STRUCT_SIZE,
    PJRT_TopologyDescription_GetDeviceDescriptions_Args => PJRT_TopologyDescription_GetDeviceDescriptions_Args_STRUCT_SIZE,
    PJRT_DeviceDescription_Kind_Args => PJRT_DeviceDescription_Kind_Args_STRUCT_SIZE,
    PJRT_DeviceDescription_Id_Args => PJRT_DeviceDescription_Id_Args_STRUCT_SIZE,
    PJRT_Device_GetDescription_Args => PJRT_Device_GetDescription_Args_STRUCT_SIZE,
    PJRT_Client_Devices_Args => PJRT_Client_Devices_Args_STRUCT_SIZE,
    PJRT_Compile_Args => PJRT_Compile_Args_STRUCT_SIZE,
}

/// Copies a (pointer, length) string owned by the plugin.
///
/// # Safety
/// `ptr` must be null or point to `len` readable bytes.
pub(crate) unsafe fn copy_str(ptr: *const c_char, len: usize) -> String {
    if ptr.is_null() || len == 0 {
        return String::new();
    }
    // SAFETY: guaranteed by the caller.
    let bytes = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) };
    String::from_utf8_lossy(bytes).into_owned()
}

/// A `PJRT_Program` of format "mlir" (StableHLO as bytecode or text) pointing into `module`,
/// which must outlive every use of the program. The plugin only reads `code` when compiling (the
/// field is `char*` because `OptimizedProgram` writes through it).
pub(crate) fn mlir_program(module: &[u8]) -> sys::PJRT_Program {
    const FORMAT: &str = "mlir";
    let mut program = sys::PJRT_Program::new();
    program.code = module.as_ptr().cast::<c_char>().cast_mut();
    program.code_size = module.len();
    program.format = FORMAT.as_ptr().cast::<c_char>();
    program.format_size = FORMAT.len();
    program
}

/// An owned `PJRT_Event`; destroyed on drop.
pub(crate) struct Event {
    api: &'static Api,
    raw: *mut sys::PJRT_Event,
}

impl Event {
    /// Takes ownership of `raw` (None when null: the plugin gave no event).
    pub(crate) fn from_raw(api: &'static Api, raw: *mut sys::PJRT_Event) -> Option<Event> {
        if raw.is_null() {
            return None;
        }
        super::LIVE_EVENTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(Event { api, raw })
    }

    /// Whether the event has completed (with or without an error); never blocks.
    pub(crate) fn is_ready(&self) -> Result<bool, PjrtError> {
        let mut args = sys::PJRT_Event_IsReady_Args::new();
        args.event = self.raw;
        // SAFETY: the event is live until `self` drops.
        unsafe { pjrt_call!(self.api, PJRT_Event_IsReady, &mut args) }?;
        Ok(args.is_ready)
    }

    /// Like [`Event::wait`], but polls the event for up to `spin` first instead of sleeping on
    /// it at once. For short work on another thread (an execution the CPU plugin hands to its
    /// worker pool), being woken from a blocking wait costs more than the work itself.
    pub(crate) fn wait_spinning(
        self,
        what: &'static str,
        spin: std::time::Duration,
    ) -> Result<(), PjrtError> {
        if !spin.is_zero() {
            let start = std::time::Instant::now();
            let mut polls = 0u32;
            while !self.is_ready().map_err(|e| e.in_context(what))? {
                polls = polls.wrapping_add(1);
                // Read the clock only every few polls: it costs about as much as a poll.
                if polls.is_multiple_of(16) && start.elapsed() >= spin {
                    break;
                }
                std::hint::spin_loop();
            }
        }
        self.wait(what)
    }

    /// Blocks until the event is ready, then reports its error, if any.
    /// `what` names the operation the event belongs to, for the message.
    pub(crate) fn wait(self, what: &'static str) -> Result<(), PjrtError> {
        let mut args = sys::PJRT_Event_Await_Args::new();
        args.event = self.raw;
        // SAFETY: the event is live until `self` drops. Await returns the event's own error
        // status (the same one PJRT_Event_Error would give), so one call does both.
        unsafe { pjrt_call!(self.api, PJRT_Event_Await, &mut args) }.map_err(|e| e.in_context(what))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        super::LIVE_EVENTS.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        let mut args = sys::PJRT_Event_Destroy_Args::new();
        args.event = self.raw;
        // SAFETY: the event is live and not used after this.
        if let Err(e) = unsafe { pjrt_call!(self.api, PJRT_Event_Destroy, &mut args) } {
            tracing::warn!("{e}");
        }
    }
}
