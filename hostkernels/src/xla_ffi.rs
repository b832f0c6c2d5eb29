//! The XLA FFI plumbing the host custom calls share (host BLAS products, host oneDNN
//! convolutions): registering typed handlers with a CPU plugin, once per plugin (through the
//! runtime's [`Plugin::register_ffi_handler`]), and the handler side of a call (call frame,
//! buffers, errors).
//!
//! Layouts: the structs below mirror `xla/ffi/api/c_api.h` field for field (each struct carries
//! its size, checked on read).

use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::Mutex;

use tpuc_runtime::{PjrtError, Plugin};

/// `(plugin path, what)` of the target sets registered in this process.
static REGISTERED: Mutex<Vec<(PathBuf, String)>> = Mutex::new(Vec::new());

/// Registers every `(name, handler)` of `targets` with `plugin` (see
/// [`Plugin::register_ffi_handler`]), once per plugin: `what` names the set (and in the log).
/// Ok(false) where the plugin has no PJRT FFI extension.
pub(crate) fn register_targets(
    plugin: &Plugin,
    targets: &[(&str, Handler)],
    what: &str,
) -> Result<bool, PjrtError> {
    let mut done = REGISTERED.lock().unwrap_or_else(|p| p.into_inner());
    if done.iter().any(|(p, w)| p == plugin.path() && w == what) {
        return Ok(true);
    }
    for &(name, handler) in targets {
        // SAFETY: every handler of the host kernels is an XLA FFI handler, a static function.
        if !unsafe { plugin.register_ffi_handler(name, handler as *mut c_void) }? {
            tracing::debug!("plugin has no PJRT FFI extension: {what} not registered");
            return Ok(false);
        }
    }
    tracing::debug!("{what} registered with {}", plugin.path().display());
    done.push((plugin.path().to_path_buf(), what.to_string()));
    Ok(true)
}

/// The call frame XLA passed to `target`'s handler, or what the handler returns at once:
/// success for XLA's metadata query (see [`answer_metadata`]), an error for a frame too small
/// to read.
///
/// # Safety
/// `frame` must be the pointer XLA passed to the handler.
pub(crate) unsafe fn open_frame<'a>(
    frame: *mut CallFrame,
    target: &str,
) -> Result<&'a CallFrame, *mut c_void> {
    // SAFETY: XLA passes a valid frame; its size is checked before any field past the header.
    let frame = unsafe { &*frame };
    // SAFETY: XLA's frame.
    if unsafe { answer_metadata(frame) } {
        return Err(std::ptr::null_mut());
    }
    if frame.struct_size < std::mem::size_of::<CallFrame>() {
        return Err(error(frame, &format!("{target}: call frame too small")));
    }
    Ok(frame)
}

/// [`open_frame`], then a check that the call has `args` operands and `rets` results (else
/// the error naming `target` is returned to XLA).
///
/// # Safety
/// As for [`open_frame`].
pub(crate) unsafe fn open_frame_of<'a>(
    frame: *mut CallFrame,
    target: &str,
    args: usize,
    rets: usize,
) -> Result<&'a CallFrame, *mut c_void> {
    // SAFETY: forwarded from the caller.
    let frame = unsafe { open_frame(frame, target) }?;
    if frame.args.size as usize != args || frame.rets.size as usize != rets {
        let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
        return Err(error(
            frame,
            &format!(
                "{target}: expects {} and {}",
                plural(args, "operand"),
                plural(rets, "result")
            ),
        ));
    }
    Ok(frame)
}

/// Whether `frame` is XLA's metadata query (made once per target, before any call), answered
/// here: API version 0.1, no traits. The handler then returns success at once.
///
/// # Safety
/// `frame` must be a call frame XLA passed to a handler.
unsafe fn answer_metadata(frame: &CallFrame) -> bool {
    if frame.extension_start.is_null() {
        return false;
    }
    // SAFETY: every extension starts with the base.
    let ext = unsafe { &*frame.extension_start };
    if ext.type_ != EXTENSION_METADATA {
        return false;
    }
    // SAFETY: type checked; the metadata struct is XLA's, its size checked below.
    let m = unsafe { &*(frame.extension_start as *const MetadataExtension) };
    if !m.metadata.is_null() {
        // SAFETY: XLA's metadata struct, non-null; its size is checked before any field past it.
        let md = unsafe { &mut *m.metadata };
        if md.struct_size >= std::mem::offset_of!(Metadata, traits) + std::mem::size_of::<u32>() {
            md.api_version.major = 0;
            md.api_version.minor = 1;
            md.traits = 0;
        }
    }
    true
}

/// Operand `i` of the call (None past the last), as XLA's buffer struct.
///
/// # Safety
/// `frame` must be a live call frame whose size was checked.
pub(crate) unsafe fn arg(frame: &CallFrame, i: usize) -> Option<&FfiBuffer> {
    // SAFETY: the frame lists `size` buffers.
    (i < frame.args.size as usize)
        .then(|| unsafe { &*(*frame.args.items.add(i) as *const FfiBuffer) })
}

/// Result `i` of the call (None past the last).
///
/// # Safety
/// As for [`arg`].
pub(crate) unsafe fn ret(frame: &CallFrame, i: usize) -> Option<&FfiBuffer> {
    // SAFETY: the frame lists `size` buffers.
    (i < frame.rets.size as usize)
        .then(|| unsafe { &*(*frame.rets.items.add(i) as *const FfiBuffer) })
}

impl FfiBuffer {
    /// The dims (`rank` entries).
    pub(crate) fn dims(&self) -> &[i64] {
        // SAFETY: XLA's buffer struct has `rank` dims.
        unsafe { std::slice::from_raw_parts(self.dims, self.rank.max(0) as usize) }
    }
}
// ------------------------------------------------------------------ XLA FFI (the handler side)

pub(crate) type Handler = unsafe extern "C" fn(*mut CallFrame) -> *mut c_void;

pub(crate) const EXTENSION_METADATA: c_int = 1;
pub(crate) const DTYPE_S64: c_int = 5;
pub(crate) const DTYPE_F32: c_int = 11;
pub(crate) const ERROR_INVALID_ARGUMENT: c_int = 3;

#[repr(C)]
pub(crate) struct FfiExtensionBase {
    pub(crate) struct_size: usize,
    pub(crate) type_: c_int,
    pub(crate) next: *mut FfiExtensionBase,
}

#[repr(C)]
pub(crate) struct ApiVersion {
    pub(crate) struct_size: usize,
    pub(crate) extension_start: *mut c_void,
    pub(crate) major: c_int,
    pub(crate) minor: c_int,
}

#[repr(C)]
pub(crate) struct Metadata {
    pub(crate) struct_size: usize,
    pub(crate) api_version: ApiVersion,
    pub(crate) traits: u32,
}

#[repr(C)]
pub(crate) struct MetadataExtension {
    pub(crate) base: FfiExtensionBase,
    pub(crate) metadata: *mut Metadata,
}

#[repr(C)]
pub(crate) struct FfiBuffer {
    pub(crate) struct_size: usize,
    pub(crate) extension_start: *mut c_void,
    pub(crate) dtype: c_int,
    pub(crate) data: *mut c_void,
    pub(crate) rank: i64,
    pub(crate) dims: *const i64,
}

#[repr(C)]
pub(crate) struct List {
    pub(crate) struct_size: usize,
    pub(crate) extension_start: *mut c_void,
    pub(crate) size: i64,
    pub(crate) types: *const c_int,
    pub(crate) items: *const *mut c_void,
}

#[repr(C)]
pub(crate) struct Attrs {
    pub(crate) struct_size: usize,
    pub(crate) extension_start: *mut c_void,
    pub(crate) size: i64,
    pub(crate) types: *const c_int,
    pub(crate) names: *const c_void,
    pub(crate) attrs: *const *mut c_void,
}

#[repr(C)]
pub(crate) struct CallFrame {
    pub(crate) struct_size: usize,
    pub(crate) extension_start: *mut FfiExtensionBase,
    pub(crate) api: *const FfiApi,
    pub(crate) ctx: *mut c_void,
    pub(crate) stage: c_int,
    pub(crate) args: List,
    pub(crate) rets: List,
    pub(crate) attrs: Attrs,
}

#[repr(C)]
pub(crate) struct ErrorCreateArgs {
    pub(crate) struct_size: usize,
    pub(crate) extension_start: *mut c_void,
    pub(crate) message: *const c_char,
    pub(crate) errc: c_int,
}

/// XLA's FFI function table, up to the thread-pool entries (both PyPI plugins have them; the
/// entry is checked to be what it should before use, see [`xla_pool`]).
#[repr(C)]
pub(crate) struct FfiApi {
    pub(crate) struct_size: usize,
    pub(crate) extension_start: *mut c_void,
    pub(crate) api_version: ApiVersion,
    pub(crate) internal_api: *mut c_void,
    pub(crate) error_create: unsafe extern "C" fn(*mut ErrorCreateArgs) -> *mut c_void,
    pub(crate) error_get_message: unsafe extern "C" fn(*mut ErrorGetMessageArgs),
    pub(crate) error_destroy: unsafe extern "C" fn(*mut ErrorDestroyArgs),
    /// Handler_Register, Stream_Get, TypeId_Register, ExecutionContext_Get, State_Set,
    /// State_Get, DeviceMemory_Allocate, DeviceMemory_Free.
    pub(crate) unused: [*const c_void; 8],
    pub(crate) thread_pool_schedule: *const c_void,
}

#[repr(C)]
pub(crate) struct ErrorGetMessageArgs {
    pub(crate) struct_size: usize,
    pub(crate) extension_start: *mut c_void,
    pub(crate) error: *mut c_void,
    pub(crate) message: *const c_char,
}

#[repr(C)]
pub(crate) struct ErrorDestroyArgs {
    pub(crate) struct_size: usize,
    pub(crate) extension_start: *mut c_void,
    pub(crate) error: *mut c_void,
}

pub(crate) fn destroy(api: *const FfiApi, err: *mut c_void) {
    let mut args = ErrorDestroyArgs {
        struct_size: std::mem::size_of::<ErrorDestroyArgs>(),
        extension_start: std::ptr::null_mut(),
        error: err,
    };
    // SAFETY: `err` came from this table's functions, and is destroyed once.
    unsafe { ((*api).error_destroy)(&mut args) };
}

/// An XLA FFI error with `message` (null if the API cannot make one, which XLA reads as success:
/// only for frames too malformed to have an API).
pub(crate) fn error(frame: &CallFrame, message: &str) -> *mut c_void {
    if frame.api.is_null() {
        return std::ptr::null_mut();
    }
    let text = std::ffi::CString::new(message).unwrap_or_default();
    let mut args = ErrorCreateArgs {
        struct_size: std::mem::offset_of!(ErrorCreateArgs, errc) + std::mem::size_of::<c_int>(),
        extension_start: std::ptr::null_mut(),
        message: text.as_ptr(),
        errc: ERROR_INVALID_ARGUMENT,
    };
    // SAFETY: `api` is XLA's FFI table, which has `XLA_FFI_Error_Create` first; it copies the
    // message.
    unsafe { ((*frame.api).error_create)(&mut args) }
}
