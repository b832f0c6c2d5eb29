//! The plugin's PJRT FFI extension (`pjrt_c_api_ffi_extension.h`): registering a typed XLA FFI
//! handler as a custom-call target of the CPU platform. What the handlers compute, and the XLA
//! FFI call frames they read, are the host kernels' (crate `tpuc_hostkernels`).

use std::ffi::{c_char, c_void};

use super::plugin::Plugin;
use super::{sys, PjrtError};

/// XLA's name for the CPU platform.
const PLATFORM: &str = "Host";

fn ffi_extension(plugin: &Plugin) -> Option<&'static FfiExtension> {
    let mut ext = plugin.api.extension_start();
    while !ext.is_null() {
        // SAFETY: the chain is the plugin's static data; every entry starts with the base.
        let base = unsafe { &*ext };
        if base.type_ == sys::PJRT_Extension_Type_FFI {
            if base.struct_size < std::mem::size_of::<FfiExtension>() {
                return None;
            }
            // SAFETY: type and size checked just above.
            return Some(unsafe { &*(ext as *const FfiExtension) });
        }
        ext = base.next;
    }
    None
}

#[repr(C)]
struct FfiExtension {
    base: sys::PJRT_Extension_Base,
    type_id_register: *const c_void,
    user_data_add: *const c_void,
    register_handler: unsafe extern "C" fn(*mut RegisterHandlerArgs) -> *mut sys::PJRT_Error,
}

/// As both plugins from PyPI read it (PJRT API 0.81 and 0.115: typed FFI handlers only). An older
/// layout had an `int api_version` before `handler` and a larger size, which such a plugin's
/// size check refuses with an error rather than misreading.
#[repr(C)]
struct RegisterHandlerArgs {
    struct_size: usize,
    target_name: *const c_char,
    target_name_size: usize,
    handler: *mut c_void,
    platform_name: *const c_char,
    platform_name_size: usize,
    traits: u32,
}

impl Plugin {
    /// Registers `handler` as the typed FFI custom-call target `name` for the CPU platform with
    /// this plugin's XLA. Ok(false) where the plugin has no PJRT FFI extension.
    ///
    /// # Safety
    /// `handler` must be an XLA FFI handler: an `extern "C" fn(*mut XLA_FFI_CallFrame) ->
    /// *mut XLA_FFI_Error` that stays valid for the rest of the process.
    pub unsafe fn register_ffi_handler(
        &self,
        name: &str,
        handler: *mut c_void,
    ) -> Result<bool, PjrtError> {
        let Some(ext) = ffi_extension(self) else {
            return Ok(false);
        };
        let mut args = RegisterHandlerArgs {
            struct_size: std::mem::offset_of!(RegisterHandlerArgs, traits)
                + std::mem::size_of::<u32>(),
            target_name: name.as_ptr() as *const c_char,
            target_name_size: name.len(),
            handler,
            platform_name: PLATFORM.as_ptr() as *const c_char,
            platform_name_size: PLATFORM.len(),
            traits: 0,
        };
        // SAFETY: `ext` is the plugin's FFI extension (type checked, size checked), and `args`
        // outlives the call; the plugin copies the names; the handler is the caller's contract.
        let err = unsafe { (ext.register_handler)(&mut args) };
        self.api.check(err, "PJRT_FFI_Register_Handler")?;
        Ok(true)
    }
}
