//! f32 matrix products through the host's BLAS (the `sgemm_` PyTorch itself calls: MKL in
//! torch's x86 wheels), registered with a CPU plugin as XLA FFI custom calls.
//!
//! When the session enables it (`TPUC_HOST_GEMM=1`), the compiler emits
//! `stablehlo.custom_call @tpuc_sgemm_<ta><tb>` (typed FFI, api_version 4) for large f32
//! products; XLA's CPU runtime calls [`gemm`] with the operands' host memory. The targets must be registered in
//! every process before a module naming them is compiled or deserialized: [`register`] does it
//! once per plugin, through the plugin's PJRT FFI extension.
//!
//! Layouts: the XLA FFI and PJRT FFI-extension structs below mirror `xla/ffi/api/c_api.h` and
//! `pjrt_c_api_ffi_extension.h` field for field (each struct carries its size, checked on read).

use std::ffi::{c_char, c_int, c_void};
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use super::plugin::Plugin;
use super::{sys, PjrtError};

/// The custom-call targets, by whether A and B are stored transposed (`t`) or not (`n`):
/// A is `[.., M, K]` (`n`) or `[.., K, M]` (`t`), B is `[.., K, N]` or `[.., N, K]`; the result
/// is `[.., M, N]` row-major. A leading batch dim, if any, is the same on all three.
pub const TARGETS: [(&str, bool, bool); 4] = [
    ("tpuc_sgemm_nn", false, false),
    ("tpuc_sgemm_nt", false, true),
    ("tpuc_sgemm_tn", true, false),
    ("tpuc_sgemm_tt", true, true),
];

/// The target name for operands stored as given.
pub fn target(a_transposed: bool, b_transposed: bool) -> &'static str {
    TARGETS
        .iter()
        .find(|(_, ta, tb)| *ta == a_transposed && *tb == b_transposed)
        .map(|(name, _, _)| *name)
        .expect("all four combinations are listed")
}

/// Fortran `sgemm_` (LP64: 32-bit integers, every argument by reference).
type Sgemm = unsafe extern "C" fn(
    transa: *const c_char,
    transb: *const c_char,
    m: *const c_int,
    n: *const c_int,
    k: *const c_int,
    alpha: *const f32,
    a: *const f32,
    lda: *const c_int,
    b: *const f32,
    ldb: *const c_int,
    beta: *const f32,
    c: *mut f32,
    ldc: *const c_int,
) -> ();

struct Blas {
    sgemm: Sgemm,
}

static BLAS: OnceLock<Blas> = OnceLock::new();

/// Plugins (by path) whose XLA has the targets registered.
static REGISTERED: Mutex<Vec<std::path::PathBuf>> = Mutex::new(Vec::new());

/// Finds `sgemm_` in `library` (already loaded by the process: PyTorch's own `libtorch_cpu.so`)
/// and registers the targets with `plugin`'s XLA. Idempotent per plugin. Returns whether the
/// targets are usable: false where the library has no `sgemm_` or the plugin no FFI extension.
pub fn register(plugin: &Plugin, library: &Path) -> Result<bool, PjrtError> {
    let mut done = REGISTERED.lock().unwrap_or_else(|p| p.into_inner());
    if done.iter().any(|p| p == plugin.path()) {
        return Ok(true);
    }
    if BLAS.get().is_none() {
        let Some(b) = find_blas(library) else {
            return Ok(false);
        };
        let _ = BLAS.set(b);
    }
    let Some(ext) = ffi_extension(plugin) else {
        tracing::debug!("plugin has no PJRT FFI extension: host BLAS not registered");
        return Ok(false);
    };
    for (name, ta, tb) in TARGETS {
        let handler: Handler = match (ta, tb) {
            (false, false) => gemm::<false, false>,
            (false, true) => gemm::<false, true>,
            (true, false) => gemm::<true, false>,
            (true, true) => gemm::<true, true>,
        };
        let mut args = RegisterHandlerArgs {
            struct_size: std::mem::size_of::<RegisterHandlerArgs>() - 4,
            target_name: name.as_ptr() as *const c_char,
            target_name_size: name.len(),
            handler: handler as *mut c_void,
            platform_name: PLATFORM.as_ptr() as *const c_char,
            platform_name_size: PLATFORM.len(),
            traits: 0,
        };
        // SAFETY: `ext` is the plugin's FFI extension (type checked, size checked), and `args`
        // outlives the call; the plugin copies the names.
        let err = unsafe { (ext.register_handler)(&mut args) };
        plugin.api.check(err, "PJRT_FFI_Register_Handler")?;
    }
    tracing::debug!(
        "host BLAS sgemm registered with {}",
        plugin.path().display()
    );
    done.push(plugin.path().to_path_buf());
    Ok(true)
}

/// XLA's name for the CPU platform.
const PLATFORM: &str = "Host";

/// MKL's `sgemm_` in `library`, if it is loaded and is MKL.
fn find_blas(library: &Path) -> Option<Blas> {
    // RTLD_NOLOAD: only a library the process has already loaded (PyTorch's), never a new one.
    // SAFETY: opening an already-loaded library runs no initializers.
    let lib = unsafe {
        libloading::os::unix::Library::open(Some(library), libc::RTLD_NOW | libc::RTLD_NOLOAD)
    }
    .ok()?;
    // SAFETY: `sgemm_` has this signature in MKL's LP64 interface, which `mkl_get_max_threads`
    // identifies; the library stays loaded (the handle is leaked, and PyTorch holds it anyway).
    let blas = unsafe {
        lib.get::<unsafe extern "C" fn() -> c_int>(b"mkl_get_max_threads\0")
            .ok()?;
        lib.get::<Sgemm>(b"sgemm_\0")
            .ok()
            .map(|s| Blas { sgemm: *s })
    };
    std::mem::forget(lib);
    blas
}

fn ffi_extension(plugin: &Plugin) -> Option<&'static FfiExtension> {
    let mut ext = plugin.api.extension_start() as *const ExtensionBase;
    while !ext.is_null() {
        // SAFETY: the chain is the plugin's static data; every entry starts with the base.
        let base = unsafe { &*ext };
        if base.type_ == sys::PJRT_Extension_Type_FFI as c_int {
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
struct ExtensionBase {
    struct_size: usize,
    type_: c_int,
    next: *const ExtensionBase,
}

#[repr(C)]
struct FfiExtension {
    base: ExtensionBase,
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

// ------------------------------------------------------------------ XLA FFI (the handler side)

type Handler = unsafe extern "C" fn(*mut CallFrame) -> *mut c_void;

const EXTENSION_METADATA: c_int = 1;
const DTYPE_F32: c_int = 11;
const ERROR_INVALID_ARGUMENT: c_int = 3;

#[repr(C)]
struct FfiExtensionBase {
    struct_size: usize,
    type_: c_int,
    next: *mut FfiExtensionBase,
}

#[repr(C)]
struct ApiVersion {
    struct_size: usize,
    extension_start: *mut c_void,
    major: c_int,
    minor: c_int,
}

#[repr(C)]
struct Metadata {
    struct_size: usize,
    api_version: ApiVersion,
    traits: u32,
}

#[repr(C)]
struct MetadataExtension {
    base: FfiExtensionBase,
    metadata: *mut Metadata,
}

#[repr(C)]
struct FfiBuffer {
    struct_size: usize,
    extension_start: *mut c_void,
    dtype: c_int,
    data: *mut c_void,
    rank: i64,
    dims: *const i64,
}

#[repr(C)]
struct List {
    struct_size: usize,
    extension_start: *mut c_void,
    size: i64,
    types: *const c_int,
    items: *const *mut c_void,
}

#[repr(C)]
struct Attrs {
    struct_size: usize,
    extension_start: *mut c_void,
    size: i64,
    types: *const c_int,
    names: *const c_void,
    attrs: *const *mut c_void,
}

#[repr(C)]
struct CallFrame {
    struct_size: usize,
    extension_start: *mut FfiExtensionBase,
    api: *const FfiApi,
    ctx: *mut c_void,
    stage: c_int,
    args: List,
    rets: List,
    attrs: Attrs,
}

#[repr(C)]
struct ErrorCreateArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    message: *const c_char,
    errc: c_int,
}

#[repr(C)]
struct FfiApi {
    struct_size: usize,
    extension_start: *mut c_void,
    api_version: ApiVersion,
    internal_api: *mut c_void,
    error_create: unsafe extern "C" fn(*mut ErrorCreateArgs) -> *mut c_void,
}

/// An XLA FFI error with `message` (null if the API cannot make one, which XLA reads as success:
/// only for frames too malformed to have an API).
fn error(frame: &CallFrame, message: &str) -> *mut c_void {
    if frame.api.is_null() {
        return std::ptr::null_mut();
    }
    let text = std::ffi::CString::new(message).unwrap_or_default();
    let mut args = ErrorCreateArgs {
        struct_size: std::mem::size_of::<ErrorCreateArgs>() - 4,
        extension_start: std::ptr::null_mut(),
        message: text.as_ptr(),
        errc: ERROR_INVALID_ARGUMENT,
    };
    // SAFETY: `api` is XLA's FFI table, which has `XLA_FFI_Error_Create` first; it copies the
    // message.
    unsafe { ((*frame.api).error_create)(&mut args) }
}

/// A buffer's dims, after checking it is an f32 buffer of rank 2 or 3.
///
/// # Safety
/// `p` must be an `XLA_FFI_Buffer` of a live call frame.
unsafe fn dims<'a>(p: *mut c_void) -> Option<(&'a [i64], *mut f32)> {
    // SAFETY: the caller's contract; the dims array has `rank` entries.
    let b = unsafe { &*(p as *const FfiBuffer) };
    if b.dtype != DTYPE_F32 || !(2..=3).contains(&b.rank) {
        return None;
    }
    Some((
        unsafe { std::slice::from_raw_parts(b.dims, b.rank as usize) },
        b.data as *mut f32,
    ))
}

/// The handler: `C = op(A) @ op(B)` for row-major operands, each batch entry by one `sgemm_`.
///
/// # Safety
/// Called by XLA with a valid call frame.
unsafe extern "C" fn gemm<const TA: bool, const TB: bool>(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA passes a valid frame; its size is checked before any field past the header.
    let frame = unsafe { &mut *frame };
    if !frame.extension_start.is_null() {
        // SAFETY: every extension starts with the base.
        let ext = unsafe { &*frame.extension_start };
        if ext.type_ == EXTENSION_METADATA {
            // SAFETY: type checked; the metadata struct is XLA's, its size checked below.
            let m = unsafe { &*(frame.extension_start as *const MetadataExtension) };
            if !m.metadata.is_null() {
                let md = unsafe { &mut *m.metadata };
                if md.struct_size >= std::mem::size_of::<Metadata>() - 4 {
                    md.api_version.major = 0;
                    md.api_version.minor = 1;
                    md.traits = 0;
                }
            }
            return std::ptr::null_mut();
        }
    }
    if frame.struct_size < std::mem::size_of::<CallFrame>() {
        return error(frame, "tpuc_sgemm: call frame too small");
    }
    if frame.args.size != 2 || frame.rets.size != 1 {
        return error(frame, "tpuc_sgemm: expects 2 operands and 1 result");
    }
    // SAFETY: the frame lists `size` buffers.
    let (a, b, c) = unsafe {
        (
            dims(*frame.args.items),
            dims(*frame.args.items.add(1)),
            dims(*frame.rets.items),
        )
    };
    let (Some((ad, ap)), Some((bd, bp)), Some((cd, cp))) = (a, b, c) else {
        return error(frame, "tpuc_sgemm: operands must be f32 of rank 2 or 3");
    };
    let r = ad.len();
    if bd.len() != r || cd.len() != r || (r == 3 && (ad[0] != bd[0] || ad[0] != cd[0])) {
        return error(frame, "tpuc_sgemm: operand ranks or batch sizes differ");
    }
    let (a0, a1, b0, b1) = (ad[r - 2], ad[r - 1], bd[r - 2], bd[r - 1]);
    let (m, ka) = if TA { (a1, a0) } else { (a0, a1) };
    let (kb, n) = if TB { (b1, b0) } else { (b0, b1) };
    if ka != kb || cd[r - 2] != m || cd[r - 1] != n {
        return error(
            frame,
            "tpuc_sgemm: operand shapes do not multiply to the result's",
        );
    }
    let batch = if r == 3 { ad[0] } else { 1 };
    let fits = |x: i64| i32::try_from(x).is_ok();
    if ![m, n, ka, a0 * a1, b0 * b1].iter().all(|&x| fits(x)) {
        return error(frame, "tpuc_sgemm: dims exceed 32-bit BLAS");
    }
    let Some(blas) = BLAS.get() else {
        return error(frame, "tpuc_sgemm: no host BLAS in this process");
    };
    if m == 0 || n == 0 {
        return std::ptr::null_mut();
    }
    let product = Product {
        ta: TA,
        tb: TB,
        m,
        n,
        k: ka,
        a: ap,
        b: bp,
        c: cp,
    };
    // The BLAS's own threading (MKL: an OpenMP team started from this thread, one of XLA's).
    // SAFETY: the buffers hold `batch` products of the checked shapes.
    unsafe { product.run(blas, batch) };
    std::ptr::null_mut()
}

/// One call's products: row-major `C = op(A) op(B)` for each batch entry.
#[derive(Clone, Copy)]
struct Product {
    ta: bool,
    tb: bool,
    m: i64,
    n: i64,
    k: i64,
    a: *mut f32,
    b: *mut f32,
    c: *mut f32,
}

// SAFETY: the pointers are XLA's buffers for the duration of the call, which waits until the
// products are done, whichever thread runs them.
unsafe impl Send for Product {}
// SAFETY: see Send.
unsafe impl Sync for Product {}

impl Product {
    /// The `batch` products, one `sgemm_` each.
    ///
    /// # Safety
    /// The pointers must hold the call's checked shapes, alive until this returns.
    unsafe fn run(&self, blas: &Blas, batch: i64) {
        let Product { m, n, k, .. } = *self;
        // Row-major C = A B is column-major C^T = B^T A^T: BLAS's first operand is B, its
        // second A. A leading dimension is at least 1 even for an empty dim (k = 0 writes zeros).
        let ldb = if self.tb { k.max(1) } else { n };
        let lda = if self.ta { m } else { k.max(1) };
        let (tb, ta) = (
            if self.tb { b'T' } else { b'N' } as c_char,
            if self.ta { b'T' } else { b'N' } as c_char,
        );
        let (mi, ni, ki) = (m as c_int, n as c_int, k as c_int);
        let (ldb, lda) = (ldb as c_int, lda as c_int);
        let (alpha, beta) = (1.0f32, 0.0f32);
        for entry in 0..batch {
            // SAFETY: entry `entry` of each operand and of the result lies inside its buffer.
            unsafe {
                (blas.sgemm)(
                    &tb,
                    &ta,
                    &ni,
                    &mi,
                    &ki,
                    &alpha,
                    self.b.add((entry * k * n) as usize),
                    &ldb,
                    self.a.add((entry * m * k) as usize),
                    &lda,
                    &beta,
                    self.c.add((entry * m * n) as usize),
                    &ni,
                )
            };
        }
    }
}
