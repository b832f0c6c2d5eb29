//! f32 2-D convolutions through oneDNN's C API (3.x as PyPI's `onednn-cpu-gomp` ships it, or
//! 2.x as Debian's `libdnnl2` does), registered with a CPU plugin as XLA FFI custom calls.
//!
//! XLA's CPU plugin runs convolutions through Eigen; oneDNN's JIT kernels (the ones PyTorch's
//! eager and Inductor call) run ResNet-50's convolutions about 1.4x faster on the same cores.
//! Unless `TPUC_HOST_KERNELS` turns `conv` off, the compiler emits
//! `stablehlo.custom_call @tpuc_conv2d_<kind>` (typed FFI, api_version 4) for 2-D f32
//! convolutions of the channels-last form; XLA's runtime calls the handlers below with the
//! operands' host memory. As for the host BLAS, the targets
//! must be registered in every process before a module naming them is compiled or loaded.
//!
//! Operands (activations channels-last, the kernel as PyTorch holds it):
//! - [`FORWARD`]: `x [N, H, W, C]`, `w [O, C/g, KH, KW]`, geometry -> `y [N, OH, OW, O]`
//! - [`INPUT_GRAD`]: `dy [N, OH, OW, O]`, `w [O, C/g, KH, KW]`, geometry -> `dx [N, H, W, C]`
//! - [`WEIGHT_GRAD`]: `x [N, H, W, C]`, `dy [N, OH, OW, O]`, geometry -> `dw [O, C/g, KH, KW]`
//!
//! The geometry is an s64 operand of [`GEOMETRY_LEN`] entries: stride (2), padding before (2),
//! padding after (2), dilation (2, PyTorch's: 1 = dense), groups.
//!
//! oneDNN's kernels want the kernel in a blocked layout of their own choosing: it is reordered
//! from (or, for the weight gradient, to) PyTorch's layout on every call, into a per-thread
//! buffer; nothing derived from a call's data is kept past the call. Primitives (JIT code for one
//! shape) are made once per shape and kept.
//!
//! The implementation of each shape is oneDNN's own first choice for it (see [`primitive`]): a
//! function of the shape, the oneDNN build and the CPU, so every process computes the same
//! numbers for the same program. It used to be picked by timing on the first call, which made
//! results differ between processes (issue 48).

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::xla_ffi::{arg, error, open_frame, register_targets, ret, CallFrame, FfiBuffer};
use super::xla_ffi::{Handler, DTYPE_F32, DTYPE_S64};
use tpuc_runtime::PjrtError;
use tpuc_runtime::Plugin;

pub const FORWARD: &str = "tpuc_conv2d_fwd";
pub const INPUT_GRAD: &str = "tpuc_conv2d_bwd_data";
pub const WEIGHT_GRAD: &str = "tpuc_conv2d_bwd_weights";

/// Entries of the geometry operand.
pub const GEOMETRY_LEN: usize = 9;

/// The three kinds of call.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Kind {
    Forward,
    InputGrad,
    WeightGrad,
}

impl Kind {
    fn target(self) -> &'static str {
        match self {
            Kind::Forward => FORWARD,
            Kind::InputGrad => INPUT_GRAD,
            Kind::WeightGrad => WEIGHT_GRAD,
        }
    }
}

// ------------------------------------------------------------------ oneDNN's C API (2.x and 3.x)

type Status = c_int;
type Handle = *mut c_void;

/// `dnnl_memory_desc_t` (696 bytes in 2.6) and `dnnl_convolution_desc_t` (5976), held in
/// larger aligned storage: only their addresses cross the API.
#[repr(C, align(64))]
struct MemoryDesc([u8; 1024]);
#[repr(C, align(64))]
struct OpDesc([u8; 8192]);

impl MemoryDesc {
    fn zeroed() -> Box<MemoryDesc> {
        Box::new(MemoryDesc([0; 1024]))
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct ExecArg {
    arg: c_int,
    memory: Handle,
}

#[repr(C)]
struct Version {
    major: c_int,
    minor: c_int,
    patch: c_int,
    hash: *const c_char,
    cpu_runtime: u32,
    gpu_runtime: u32,
}

const SUCCESS: Status = 0;
const ENGINE_CPU: c_int = 1;
const STREAM_DEFAULT: u32 = 1;
const F32: c_int = 3;
const TAG_ANY: c_int = 1;
const TAG_OIHW: c_int = 5;
const FORWARD_TRAINING: c_int = 64;
const FORWARD_INFERENCE: c_int = 96;
const CONVOLUTION_DIRECT: c_int = 1;
const ARG_SRC: c_int = 1;
const ARG_DST: c_int = 17;
const ARG_WEIGHTS: c_int = 33;
const ARG_DIFF_SRC: c_int = 129;
const ARG_DIFF_DST: c_int = 145;
const ARG_DIFF_WEIGHTS: c_int = 161;
const ARG_FROM: c_int = ARG_SRC;
const ARG_TO: c_int = ARG_DST;
const ARG_SCRATCHPAD: c_int = 80;
const SCRATCHPAD_MODE_USER: c_int = 1;
const QUERY_IMPL_INFO: c_int = 8;
const QUERY_SCRATCHPAD_MD: c_int = 136;
const QUERY_WEIGHTS_MD: c_int = 131;
const QUERY_DIFF_WEIGHTS_MD: c_int = 132;

type Dims = *const i64;

/// The entry points used, resolved once from the library.
struct Dnnl {
    engine: Handle,
    /// Primitive attributes asking for the scratchpad to be passed in (see [`Primitive`]).
    user_scratchpad: Handle,
    /// How descriptors are made: the calls 2.x and 3.x spell differently.
    api: Api,
    /// `(major, minor, patch)` of the library.
    version: (i32, i32, i32),
    primitive_desc_query: unsafe extern "C" fn(Handle, c_int, c_int, *mut c_void) -> Status,
    primitive_desc_query_md: unsafe extern "C" fn(Handle, c_int, c_int) -> *const MemoryDesc,
    reorder_primitive_desc_create: unsafe extern "C" fn(
        *mut Handle,
        *const MemoryDesc,
        Handle,
        *const MemoryDesc,
        Handle,
        Handle,
    ) -> Status,
    primitive_create: unsafe extern "C" fn(*mut Handle, Handle) -> Status,
    primitive_destroy: unsafe extern "C" fn(Handle) -> Status,
    primitive_desc_destroy: unsafe extern "C" fn(Handle) -> Status,
    memory_desc_equal: unsafe extern "C" fn(*const MemoryDesc, *const MemoryDesc) -> c_int,
    memory_desc_get_size: unsafe extern "C" fn(*const MemoryDesc) -> usize,
    memory_create:
        unsafe extern "C" fn(*mut Handle, *const MemoryDesc, Handle, *mut c_void) -> Status,
    memory_destroy: unsafe extern "C" fn(Handle) -> Status,
    primitive_execute: unsafe extern "C" fn(Handle, Handle, c_int, *const ExecArg) -> Status,
    stream_create: unsafe extern "C" fn(*mut Handle, Handle, u32) -> Status,
    stream_wait: unsafe extern "C" fn(Handle) -> Status,
}

// SAFETY: oneDNN's engine and entry points are thread-safe (a CPU engine is shared by design).
unsafe impl Send for Dnnl {}
// SAFETY: see Send.
unsafe impl Sync for Dnnl {}

/// The descriptor calls of oneDNN 2.x and 3.x. Everything else (querying, reordering, memory
/// objects, execution) is the same C API in both. 3.x is preferred where it is installed: its
/// brgemm input-gradient kernels (2.6 has direct JIT ones) took ResNet-50's 3x3, 7x7 input and
/// weight gradients from 127 + 140 to 119 + 134 ms per batch-8 training step.
enum Api {
    /// Descriptors are structs in storage of ours; an op descriptor makes the primitive's.
    V2 {
        memory_desc_init_by_tag:
            unsafe extern "C" fn(*mut MemoryDesc, c_int, Dims, c_int, c_int) -> Status,
        #[allow(clippy::type_complexity)]
        forward_desc_init: unsafe extern "C" fn(
            *mut OpDesc,
            c_int,
            c_int,
            *const MemoryDesc,
            *const MemoryDesc,
            *const MemoryDesc,
            *const MemoryDesc,
            Dims,
            Dims,
            Dims,
            Dims,
        ) -> Status,
        #[allow(clippy::type_complexity)]
        backward_data_desc_init: unsafe extern "C" fn(
            *mut OpDesc,
            c_int,
            *const MemoryDesc,
            *const MemoryDesc,
            *const MemoryDesc,
            Dims,
            Dims,
            Dims,
            Dims,
        ) -> Status,
        #[allow(clippy::type_complexity)]
        backward_weights_desc_init: unsafe extern "C" fn(
            *mut OpDesc,
            c_int,
            *const MemoryDesc,
            *const MemoryDesc,
            *const MemoryDesc,
            *const MemoryDesc,
            Dims,
            Dims,
            Dims,
            Dims,
        ) -> Status,
        primitive_desc_create:
            unsafe extern "C" fn(*mut Handle, *const OpDesc, Handle, Handle, Handle) -> Status,
    },
    /// Descriptors are oneDNN's objects; one call per kind makes the primitive's.
    V3 {
        memory_desc_create_with_tag:
            unsafe extern "C" fn(*mut *const MemoryDesc, c_int, Dims, c_int, c_int) -> Status,
        memory_desc_destroy: unsafe extern "C" fn(*const MemoryDesc) -> Status,
        #[allow(clippy::type_complexity)]
        forward: unsafe extern "C" fn(
            *mut Handle,
            Handle,
            c_int,
            c_int,
            *const MemoryDesc,
            *const MemoryDesc,
            *const MemoryDesc,
            *const MemoryDesc,
            Dims,
            Dims,
            Dims,
            Dims,
            Handle,
        ) -> Status,
        #[allow(clippy::type_complexity)]
        backward_data: unsafe extern "C" fn(
            *mut Handle,
            Handle,
            c_int,
            *const MemoryDesc,
            *const MemoryDesc,
            *const MemoryDesc,
            Dims,
            Dims,
            Dims,
            Dims,
            Handle,
            Handle,
        ) -> Status,
        #[allow(clippy::type_complexity)]
        backward_weights: unsafe extern "C" fn(
            *mut Handle,
            Handle,
            c_int,
            *const MemoryDesc,
            *const MemoryDesc,
            *const MemoryDesc,
            *const MemoryDesc,
            Dims,
            Dims,
            Dims,
            Dims,
            Handle,
            Handle,
        ) -> Status,
    },
}

impl Api {
    /// `(goihw, nhwc)`: format tags whose numbers moved between the versions.
    fn tags(&self) -> (c_int, c_int) {
        match self {
            Api::V2 { .. } => (7, 20),
            Api::V3 { .. } => (6, 22),
        }
    }
}

/// A memory descriptor: 2.x's struct in storage of ours, or a 3.x object (destroyed on drop; the
/// ones a primitive keeps live as long as the process).
enum Md {
    Inline(Box<MemoryDesc>),
    Object(
        *const MemoryDesc,
        unsafe extern "C" fn(*const MemoryDesc) -> Status,
    ),
}

// SAFETY: a descriptor is immutable once made, and oneDNN reads it from any thread.
unsafe impl Send for Md {}
// SAFETY: see Send.
unsafe impl Sync for Md {}

impl Md {
    fn ptr(&self) -> *const MemoryDesc {
        match self {
            Md::Inline(m) => &**m,
            Md::Object(m, _) => *m,
        }
    }
}

impl Drop for Md {
    fn drop(&mut self) {
        if let Md::Object(m, destroy) = *self {
            // SAFETY: created by `memory_desc_create_with_tag`, destroyed once.
            unsafe { destroy(m) };
        }
    }
}

static DNNL: OnceLock<Option<Dnnl>> = OnceLock::new();

/// Loads `library` (oneDNN 2.x or 3.x with the OpenMP runtime: PyTorch's wheels bundle the OpenMP
/// library by the same name, so oneDNN's threads are the ones PyTorch's own work uses) and makes
/// its CPU engine. None where it is missing or another build.
fn load(library: &str) -> Option<Dnnl> {
    // SAFETY: loading oneDNN runs its initializers, which only set up its own state; the
    // library stays loaded for the process (the handle is leaked below).
    let lib = unsafe { libloading::Library::new(library) }
        .map_err(|e| tracing::debug!("oneDNN not loaded ({library}): {e}"))
        .ok()?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the signature is the one `dnnl.h` of the loaded major version declares
            // for the name (the callers below ask each version only for its own names).
            match unsafe { lib.get(concat!($name, "\0").as_bytes()) } {
                Ok(s) => *s,
                Err(e) => {
                    tracing::debug!("oneDNN {library} lacks {}: {e}", $name);
                    return None;
                }
            }
        };
    }
    let version: unsafe extern "C" fn() -> *const Version = sym!("dnnl_version");
    // SAFETY: oneDNN's static version record.
    let v = unsafe { &*version() };
    // 2: the OpenMP CPU runtime (`DNNL_RUNTIME_OMP`).
    if !(v.major == 2 || v.major == 3) || v.cpu_runtime != 2 {
        tracing::debug!(
            "oneDNN {library} is {}.{} with CPU runtime {}: not used (2.x or 3.x with OpenMP expected)",
            v.major,
            v.minor,
            v.cpu_runtime
        );
        return None;
    }
    let engine_create: unsafe extern "C" fn(*mut Handle, c_int, usize) -> Status =
        sym!("dnnl_engine_create");
    let mut engine: Handle = std::ptr::null_mut();
    // SAFETY: the CPU engine 0 always exists.
    if unsafe { engine_create(&mut engine, ENGINE_CPU, 0) } != SUCCESS {
        return None;
    }
    let attr_create: unsafe extern "C" fn(*mut Handle) -> Status =
        sym!("dnnl_primitive_attr_create");
    let set_scratchpad_mode: unsafe extern "C" fn(Handle, c_int) -> Status =
        sym!("dnnl_primitive_attr_set_scratchpad_mode");
    let mut user_scratchpad: Handle = std::ptr::null_mut();
    // SAFETY: a new attribute object, kept for the process.
    if unsafe { attr_create(&mut user_scratchpad) } != SUCCESS
        // SAFETY: the attribute object just created.
        || unsafe { set_scratchpad_mode(user_scratchpad, SCRATCHPAD_MODE_USER) } != SUCCESS
    {
        return None;
    }
    let api = if v.major == 2 {
        Api::V2 {
            memory_desc_init_by_tag: sym!("dnnl_memory_desc_init_by_tag"),
            forward_desc_init: sym!("dnnl_dilated_convolution_forward_desc_init"),
            backward_data_desc_init: sym!("dnnl_dilated_convolution_backward_data_desc_init"),
            backward_weights_desc_init: sym!("dnnl_dilated_convolution_backward_weights_desc_init"),
            primitive_desc_create: sym!("dnnl_primitive_desc_create"),
        }
    } else {
        Api::V3 {
            memory_desc_create_with_tag: sym!("dnnl_memory_desc_create_with_tag"),
            memory_desc_destroy: sym!("dnnl_memory_desc_destroy"),
            forward: sym!("dnnl_convolution_forward_primitive_desc_create"),
            backward_data: sym!("dnnl_convolution_backward_data_primitive_desc_create"),
            backward_weights: sym!("dnnl_convolution_backward_weights_primitive_desc_create"),
        }
    };
    let d = Dnnl {
        engine,
        user_scratchpad,
        api,
        version: (v.major, v.minor, v.patch),
        primitive_desc_query: sym!("dnnl_primitive_desc_query"),
        primitive_desc_query_md: sym!("dnnl_primitive_desc_query_md"),
        reorder_primitive_desc_create: sym!("dnnl_reorder_primitive_desc_create"),
        primitive_create: sym!("dnnl_primitive_create"),
        primitive_destroy: sym!("dnnl_primitive_destroy"),
        primitive_desc_destroy: sym!("dnnl_primitive_desc_destroy"),
        memory_desc_equal: sym!("dnnl_memory_desc_equal"),
        memory_desc_get_size: sym!("dnnl_memory_desc_get_size"),
        memory_create: sym!("dnnl_memory_create"),
        memory_destroy: sym!("dnnl_memory_destroy"),
        primitive_execute: sym!("dnnl_primitive_execute"),
        stream_create: sym!("dnnl_stream_create"),
        stream_wait: sym!("dnnl_stream_wait"),
    };
    tracing::debug!(
        "oneDNN {}.{}.{} loaded from {library}",
        v.major,
        v.minor,
        v.patch
    );
    std::mem::forget(lib);
    Some(d)
}

/// Loads oneDNN from `library` (once per process) and registers the three targets with
/// `plugin`'s XLA. Idempotent per plugin. Returns whether the targets are usable: false where
/// oneDNN is missing or unsuitable, or the plugin has no FFI extension.
pub fn register(plugin: &Plugin, library: &str) -> Result<bool, PjrtError> {
    if DNNL.get_or_init(|| load(library)).is_none() {
        return Ok(false);
    }
    let targets = [
        (FORWARD, forward as Handler),
        (INPUT_GRAD, input_grad as Handler),
        (WEIGHT_GRAD, weight_grad as Handler),
    ];
    register_targets(plugin, &targets, "oneDNN convolutions")
}

/// Calls run in this process, by kind (forward, input gradient, weight gradient).
static CALLS: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

/// The oneDNN version convolutions run in, `(major, minor, patch)`; None before
/// [`register`] loaded one.
pub fn version() -> Option<(i32, i32, i32)> {
    DNNL.get().and_then(|d| d.as_ref().map(|d| d.version))
}

/// How many convolutions of each kind (forward, input gradient, weight gradient) ran here.
pub fn calls() -> (u64, u64, u64) {
    (
        CALLS[0].load(Ordering::Relaxed),
        CALLS[1].load(Ordering::Relaxed),
        CALLS[2].load(Ordering::Relaxed),
    )
}

// ------------------------------------------------------------------ primitives per shape

/// What decides a primitive: the kind, the input `[N, C, H, W]`, the kernel `[O, C/g, KH, KW]`,
/// the output's spatial size and the geometry.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct Shape {
    kind: Kind,
    input: [i64; 4],
    kernel: [i64; 4],
    out_hw: [i64; 2],
    geometry: [i64; GEOMETRY_LEN],
}

impl Shape {
    fn groups(&self) -> i64 {
        self.geometry[8]
    }
    fn output(&self) -> [i64; 4] {
        let [n, ..] = self.input;
        [n, self.kernel[0], self.out_hw[0], self.out_hw[1]]
    }
}

/// A shape's convolution primitive, with the kernel reorder between PyTorch's layout and the
/// primitive's (None where they are the same).
struct Primitive {
    /// oneDNN's name for the implementation.
    name: String,
    /// The primitive descriptor (owns `kernel` and `scratchpad`).
    pd: Handle,
    conv: Handle,
    reorder: Option<Handle>,
    /// The kernel in PyTorch's layout and in the primitive's (kept with the primitive
    /// descriptor, which is never destroyed).
    user_kernel: Arc<Md>,
    kernel: *const MemoryDesc,
    kernel_bytes: usize,
    activations: Arc<[Md; 2]>,
    /// The scratchpad oneDNN needs, which each call passes in from a per-thread buffer (left to
    /// oneDNN, it allocates and frees it on every call: training ResNet-50 took 16k page faults
    /// per step that way).
    scratchpad: *const MemoryDesc,
    scratchpad_bytes: usize,
}

// SAFETY: oneDNN primitives may be executed from several threads at once; the descriptors are
// immutable after creation.
unsafe impl Send for Primitive {}
// SAFETY: see Send.
unsafe impl Sync for Primitive {}

/// Kept primitives live for the process; one is dropped only where two threads made the same
/// shape's at once (the cache keeps one): its JIT code and descriptors go back.
impl Drop for Primitive {
    fn drop(&mut self) {
        let Some(Some(d)) = DNNL.get() else { return };
        // SAFETY: made for this primitive and used by nothing else once it is dropped.
        unsafe {
            (d.primitive_destroy)(self.conv);
            if let Some(r) = self.reorder {
                (d.primitive_destroy)(r);
            }
            (d.primitive_desc_destroy)(self.pd);
        }
    }
}

static PRIMITIVES: OnceLock<Mutex<HashMap<Shape, Arc<Primitive>>>> = OnceLock::new();

fn check(status: Status, what: &str) -> Result<(), String> {
    if status == SUCCESS {
        Ok(())
    } else {
        Err(format!("oneDNN {what} failed (status {status})"))
    }
}

/// `shape`'s primitive: made on the first call and kept. It is the implementation oneDNN ranks
/// first for the shape on this CPU (what any caller of this oneDNN gets; PyTorch's eager takes
/// its own oneDNN release's first choice the same way), never one chosen by timing: implementations sum in different orders, and a choice
/// that depends on the load of the moment made the same program's numbers differ from one
/// process to the next. That is within rounding for each convolution, but not for what follows
/// it: a ReLU whose input lies within rounding of 0 passes or blocks its whole gradient, and
/// ResNet-18's training gradient differed from eager's by 0.3 (relative) in the processes that
/// picked one forward kernel for one of its eight shapes (issue 48; docs/host-kernels.md).
fn primitive(d: &Dnnl, shape: &Shape) -> Result<Arc<Primitive>, String> {
    let cache = PRIMITIVES.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(p) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(shape) {
        return Ok(p.clone());
    }
    let p = Arc::new(first_ranked(d, shape)?);
    tracing::debug!("oneDNN {} for {shape:?}: {}", shape.kind.target(), p.name);
    cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(shape.clone(), p.clone());
    Ok(p)
}

impl Dnnl {
    /// An f32 memory descriptor of `dims` in the layout `tag`.
    fn memory_desc(&self, dims: &[i64], tag: c_int) -> Result<Md, String> {
        let rank = dims.len() as c_int;
        match &self.api {
            Api::V2 {
                memory_desc_init_by_tag,
                ..
            } => {
                let mut m = MemoryDesc::zeroed();
                // SAFETY: `dims` has `rank` entries; `m` is large enough for the descriptor.
                let s = unsafe { memory_desc_init_by_tag(&mut *m, rank, dims.as_ptr(), F32, tag) };
                check(s, "memory_desc_init_by_tag")?;
                Ok(Md::Inline(m))
            }
            Api::V3 {
                memory_desc_create_with_tag,
                memory_desc_destroy,
                ..
            } => {
                let mut m: *const MemoryDesc = std::ptr::null();
                // SAFETY: `dims` has `rank` entries; oneDNN writes a new descriptor's address.
                let s =
                    unsafe { memory_desc_create_with_tag(&mut m, rank, dims.as_ptr(), F32, tag) };
                check(s, "memory_desc_create_with_tag")?;
                Ok(Md::Object(m, *memory_desc_destroy))
            }
        }
    }
}

/// A convolution's window as oneDNN takes it (two spatial dims each).
struct Window {
    stride: [i64; 2],
    pad_l: [i64; 2],
    pad_r: [i64; 2],
    dilates: [i64; 2],
}

impl Window {
    /// `[strides, dilates, padding_l, padding_r]`, in the order both versions' calls take them.
    fn dims(&self) -> [Dims; 4] {
        [
            self.stride.as_ptr(),
            self.dilates.as_ptr(),
            self.pad_l.as_ptr(),
            self.pad_r.as_ptr(),
        ]
    }
}

/// The primitive descriptor of `kind` through oneDNN 2.x's op descriptors. `mds`: the
/// activations in, the kernel (any layout), the activations out, each the forward's name for it
/// (the backward kinds take them as their gradients).
fn primitive_desc_v2(d: &Dnnl, kind: Kind, mds: [&Md; 3], w: &Window) -> Result<Handle, String> {
    let Api::V2 {
        forward_desc_init,
        backward_data_desc_init,
        backward_weights_desc_init,
        primitive_desc_create,
        ..
    } = &d.api
    else {
        return Err("oneDNN 2.x entry points expected".into());
    };
    let [src, kernel, dst] = mds.map(Md::ptr);
    let [stride, dilates, pad_l, pad_r] = w.dims();
    let forward_desc = |prop: c_int| -> Result<Box<OpDesc>, String> {
        let mut op = Box::new(OpDesc([0; 8192]));
        // SAFETY: initialized descriptors; dims arrays of 2 entries (2 spatial dims).
        let s = unsafe {
            forward_desc_init(
                &mut *op,
                prop,
                CONVOLUTION_DIRECT,
                src,
                kernel,
                std::ptr::null(),
                dst,
                stride,
                dilates,
                pad_l,
                pad_r,
            )
        };
        check(s, "convolution_forward_desc_init")?;
        Ok(op)
    };
    let create_pd = |op: &OpDesc, hint: Handle| -> Result<Handle, String> {
        let mut pd: Handle = std::ptr::null_mut();
        // SAFETY: an initialized op descriptor, the process's attributes.
        let s = unsafe { primitive_desc_create(&mut pd, op, d.user_scratchpad, d.engine, hint) };
        check(s, "primitive_desc_create")?;
        Ok(pd)
    };
    if kind == Kind::Forward {
        return create_pd(&*forward_desc(FORWARD_INFERENCE)?, std::ptr::null_mut());
    }
    let hint = create_pd(&*forward_desc(FORWARD_TRAINING)?, std::ptr::null_mut())?;
    let mut op = Box::new(OpDesc([0; 8192]));
    // SAFETY: as for the forward descriptor.
    let s = unsafe {
        if kind == Kind::InputGrad {
            backward_data_desc_init(
                &mut *op,
                CONVOLUTION_DIRECT,
                src,
                kernel,
                dst,
                stride,
                dilates,
                pad_l,
                pad_r,
            )
        } else {
            backward_weights_desc_init(
                &mut *op,
                CONVOLUTION_DIRECT,
                src,
                kernel,
                std::ptr::null(),
                dst,
                stride,
                dilates,
                pad_l,
                pad_r,
            )
        }
    };
    check(s, "convolution_backward_desc_init")?;
    // The hint is kept alive with the backward one (never destroyed: a handful per shape, for
    // the process).
    create_pd(&op, hint)
}

/// [`primitive_desc_v2`] through oneDNN 3.x's primitive descriptor calls.
fn primitive_desc_v3(d: &Dnnl, kind: Kind, mds: [&Md; 3], w: &Window) -> Result<Handle, String> {
    let Api::V3 {
        forward,
        backward_data,
        backward_weights,
        ..
    } = &d.api
    else {
        return Err("oneDNN 3.x entry points expected".into());
    };
    let [src, kernel, dst] = mds.map(Md::ptr);
    let [stride, dilates, pad_l, pad_r] = w.dims();
    let forward_pd = |prop: c_int| -> Result<Handle, String> {
        let mut pd: Handle = std::ptr::null_mut();
        // SAFETY: live descriptors; dims arrays of 2 entries; the process's attributes.
        let s = unsafe {
            forward(
                &mut pd,
                d.engine,
                prop,
                CONVOLUTION_DIRECT,
                src,
                kernel,
                std::ptr::null(),
                dst,
                stride,
                dilates,
                pad_l,
                pad_r,
                d.user_scratchpad,
            )
        };
        check(s, "convolution_forward_primitive_desc_create")?;
        Ok(pd)
    };
    if kind == Kind::Forward {
        return forward_pd(FORWARD_INFERENCE);
    }
    // Kept alive with the backward one, as in 2.x.
    let hint = forward_pd(FORWARD_TRAINING)?;
    let mut pd: Handle = std::ptr::null_mut();
    // SAFETY: as for the forward descriptor; the hint is a live forward descriptor.
    let s = unsafe {
        if kind == Kind::InputGrad {
            backward_data(
                &mut pd,
                d.engine,
                CONVOLUTION_DIRECT,
                src,
                kernel,
                dst,
                stride,
                dilates,
                pad_l,
                pad_r,
                hint,
                d.user_scratchpad,
            )
        } else {
            backward_weights(
                &mut pd,
                d.engine,
                CONVOLUTION_DIRECT,
                src,
                kernel,
                std::ptr::null(),
                dst,
                stride,
                dilates,
                pad_l,
                pad_r,
                hint,
                d.user_scratchpad,
            )
        }
    };
    check(s, "convolution_backward_primitive_desc_create")?;
    Ok(pd)
}

/// The primitive of the implementation oneDNN ranks first for `shape` (its reference
/// implementations rank last, so one is used only where nothing else handles the shape).
fn first_ranked(d: &Dnnl, shape: &Shape) -> Result<Primitive, String> {
    let g = shape.groups();
    let [o, cg, kh, kw] = shape.kernel;
    let (tag_goihw, tag_nhwc) = d.api.tags();
    // The kernel with the groups split out where there are several.
    let (kernel_dims, user_tag): (Vec<i64>, c_int) = if g > 1 {
        (vec![g, o / g, cg, kh, kw], tag_goihw)
    } else {
        (vec![o, cg, kh, kw], TAG_OIHW)
    };
    let user_kernel = d.memory_desc(&kernel_dims, user_tag)?;
    let any_kernel = d.memory_desc(&kernel_dims, TAG_ANY)?;
    let src = d.memory_desc(&shape.input, tag_nhwc)?;
    let dst = d.memory_desc(&shape.output(), tag_nhwc)?;
    let geo = &shape.geometry;
    let window = Window {
        stride: [geo[0], geo[1]],
        pad_l: [geo[2], geo[3]],
        pad_r: [geo[4], geo[5]],
        // oneDNN counts dilation from 0 (dense).
        dilates: [geo[6] - 1, geo[7] - 1],
    };
    let mds = [&src, &any_kernel, &dst];
    let pd = match &d.api {
        Api::V2 { .. } => primitive_desc_v2(d, shape.kind, mds, &window)?,
        Api::V3 { .. } => primitive_desc_v3(d, shape.kind, mds, &window)?,
    };
    primitive_from(d, shape, pd, &Arc::new(user_kernel), &Arc::new([src, dst]))
}

/// The name of the implementation behind primitive descriptor `pd` (empty where not given).
fn impl_name(d: &Dnnl, pd: Handle) -> String {
    let mut info: *const c_char = std::ptr::null();
    // SAFETY: the query writes a pointer to a string the descriptor owns.
    if unsafe {
        (d.primitive_desc_query)(pd, QUERY_IMPL_INFO, 0, &mut info as *mut _ as *mut c_void)
    } == SUCCESS
        && !info.is_null()
    {
        // SAFETY: a NUL-terminated string owned by the descriptor.
        unsafe { CStr::from_ptr(info) }
            .to_string_lossy()
            .into_owned()
    } else {
        String::new()
    }
}

/// The primitive of primitive descriptor `pd` (kept for the process, with the descriptors it
/// reads), with the kernel reorder its layout needs.
fn primitive_from(
    d: &Dnnl,
    shape: &Shape,
    pd: Handle,
    user_kernel: &Arc<Md>,
    activations: &Arc<[Md; 2]>,
) -> Result<Primitive, String> {
    let which = if shape.kind == Kind::WeightGrad {
        QUERY_DIFF_WEIGHTS_MD
    } else {
        QUERY_WEIGHTS_MD
    };
    // SAFETY: a live primitive descriptor; the descriptor it returns lives as long.
    let kernel = unsafe { (d.primitive_desc_query_md)(pd, which, 0) };
    if kernel.is_null() {
        return Err("oneDNN gave no kernel layout".into());
    }
    // SAFETY: both are initialized descriptors.
    let same = unsafe { (d.memory_desc_equal)(kernel, user_kernel.ptr()) } != 0;
    let reorder = if same {
        None
    } else {
        let (from, to) = if shape.kind == Kind::WeightGrad {
            (kernel, user_kernel.ptr())
        } else {
            (user_kernel.ptr(), kernel)
        };
        let mut rpd: Handle = std::ptr::null_mut();
        check(
            // SAFETY: initialized descriptors, the same CPU engine both sides.
            unsafe {
                (d.reorder_primitive_desc_create)(
                    &mut rpd,
                    from,
                    d.engine,
                    to,
                    d.engine,
                    std::ptr::null_mut(),
                )
            },
            "reorder_primitive_desc_create",
        )?;
        let mut r: Handle = std::ptr::null_mut();
        // SAFETY: a live reorder descriptor.
        let created = unsafe { (d.primitive_create)(&mut r, rpd) };
        // SAFETY: the primitive keeps what it needs of its descriptor (nothing here reads the
        // reorder's descriptor again).
        unsafe { (d.primitive_desc_destroy)(rpd) };
        check(created, "reorder primitive_create")?;
        Some(r)
    };
    let mut conv: Handle = std::ptr::null_mut();
    check(
        // SAFETY: a live primitive descriptor.
        unsafe { (d.primitive_create)(&mut conv, pd) },
        "primitive_create",
    )?;
    // SAFETY: as above.
    let kernel_bytes = unsafe { (d.memory_desc_get_size)(kernel) };
    // SAFETY: as above; a zero-size descriptor where none is needed.
    let scratchpad = unsafe { (d.primitive_desc_query_md)(pd, QUERY_SCRATCHPAD_MD, 0) };
    let scratchpad_bytes = if scratchpad.is_null() {
        0
    } else {
        // SAFETY: as above.
        unsafe { (d.memory_desc_get_size)(scratchpad) }
    };
    Ok(Primitive {
        name: impl_name(d, pd),
        pd,
        conv,
        reorder,
        user_kernel: user_kernel.clone(),
        kernel,
        kernel_bytes,
        activations: activations.clone(),
        scratchpad,
        scratchpad_bytes,
    })
}

thread_local! {
    /// This thread's oneDNN stream (a CPU stream per thread: calls on several of XLA's threads
    /// never share one).
    static STREAM: std::cell::Cell<Handle> = const { std::cell::Cell::new(std::ptr::null_mut()) };
    /// This thread's buffers for a kernel in oneDNN's layout and for oneDNN's scratchpad
    /// (64-byte aligned on use).
    static BUFFERS: std::cell::RefCell<[Vec<u8>; 2]> =
        const { std::cell::RefCell::new([Vec::new(), Vec::new()]) };
}

fn stream(d: &Dnnl) -> Result<Handle, String> {
    STREAM.with(|s| {
        if s.get().is_null() {
            let mut h: Handle = std::ptr::null_mut();
            check(
                // SAFETY: the live CPU engine.
                unsafe { (d.stream_create)(&mut h, d.engine, STREAM_DEFAULT) },
                "stream_create",
            )?;
            s.set(h);
        }
        Ok(s.get())
    })
}

/// Memory objects over the call's buffers, destroyed when dropped.
struct Memories<'a> {
    d: &'a Dnnl,
    handles: Vec<Handle>,
}

impl<'a> Memories<'a> {
    fn wrap(&mut self, md: *const MemoryDesc, data: *mut c_void) -> Result<Handle, String> {
        let mut m: Handle = std::ptr::null_mut();
        check(
            // SAFETY: an initialized descriptor; `data` holds at least its size (checked shapes).
            unsafe { (self.d.memory_create)(&mut m, md, self.d.engine, data) },
            "memory_create",
        )?;
        self.handles.push(m);
        Ok(m)
    }
}

impl Drop for Memories<'_> {
    fn drop(&mut self) {
        for &m in &self.handles {
            // SAFETY: created above, destroyed once; the memory does not own the data.
            unsafe { (self.d.memory_destroy)(m) };
        }
    }
}

/// Runs `shape`'s convolution over the call's buffers: `a` and `b` the operands in the order of
/// the module docs, `out` the result.
fn run(
    d: &Dnnl,
    shape: &Shape,
    a: *mut c_void,
    b: *mut c_void,
    out: *mut c_void,
) -> Result<(), String> {
    let p = primitive(d, shape)?;
    execute(d, &p, shape.kind, (a, b, out))
}

/// A call's buffers: `a` and `b` the operands in the order of the module docs, the result.
type Buffers = (*mut c_void, *mut c_void, *mut c_void);

/// Runs primitive `p` (a convolution of `kind`) over the call's buffers.
fn execute(d: &Dnnl, p: &Primitive, kind: Kind, (a, b, out): Buffers) -> Result<(), String> {
    let stream = stream(d)?;
    let mut mems = Memories {
        d,
        handles: Vec::with_capacity(5),
    };
    BUFFERS.with(|buffers| -> Result<(), String> {
        let mut buffers = buffers.borrow_mut();
        let [kernel_buffer, scratch_buffer] = &mut *buffers;
        // The kernel in oneDNN's layout: the call's own buffer where the layouts agree, else
        // this thread's buffer, filled by the reorder (forward, input gradient) or read back by
        // it (weight gradient).
        let user_kernel_data = if kind == Kind::WeightGrad { out } else { b };
        let kernel_data = if p.reorder.is_some() {
            aligned(kernel_buffer, p.kernel_bytes)
        } else {
            user_kernel_data
        };
        let scratchpad = if p.scratchpad_bytes > 0 {
            Some(mems.wrap(p.scratchpad, aligned(scratch_buffer, p.scratchpad_bytes))?)
        } else {
            None
        };
        let user = mems.wrap(p.user_kernel.ptr(), user_kernel_data)?;
        let kernel = mems.wrap(p.kernel, kernel_data)?;
        let [src_md, dst_md] = &*p.activations;
        let execute = |prim: Handle, args: &[ExecArg]| -> Result<(), String> {
            // SAFETY: a live primitive, memories over the call's buffers of the checked shapes.
            check(
                unsafe { (d.primitive_execute)(prim, stream, args.len() as c_int, args.as_ptr()) },
                "primitive_execute",
            )
        };
        // The convolution's arguments, with the scratchpad where it has one.
        let conv = |args: [ExecArg; 3]| -> Result<(), String> {
            let mut all = args.to_vec();
            all.extend(scratchpad.map(|memory| ExecArg {
                arg: ARG_SCRATCHPAD,
                memory,
            }));
            execute(p.conv, &all)
        };
        let arg = |arg, memory| ExecArg { arg, memory };
        match kind {
            Kind::Forward | Kind::InputGrad => {
                if let Some(r) = p.reorder {
                    execute(r, &[arg(ARG_FROM, user), arg(ARG_TO, kernel)])?;
                }
                if kind == Kind::Forward {
                    let src = mems.wrap(src_md.ptr(), a)?;
                    let dst = mems.wrap(dst_md.ptr(), out)?;
                    conv([
                        arg(ARG_SRC, src),
                        arg(ARG_WEIGHTS, kernel),
                        arg(ARG_DST, dst),
                    ])?;
                } else {
                    let diff_dst = mems.wrap(dst_md.ptr(), a)?;
                    let diff_src = mems.wrap(src_md.ptr(), out)?;
                    conv([
                        arg(ARG_DIFF_DST, diff_dst),
                        arg(ARG_WEIGHTS, kernel),
                        arg(ARG_DIFF_SRC, diff_src),
                    ])?;
                }
            }
            Kind::WeightGrad => {
                let src = mems.wrap(src_md.ptr(), a)?;
                let diff_dst = mems.wrap(dst_md.ptr(), b)?;
                conv([
                    arg(ARG_SRC, src),
                    arg(ARG_DIFF_DST, diff_dst),
                    arg(ARG_DIFF_WEIGHTS, kernel),
                ])?;
                if let Some(r) = p.reorder {
                    execute(r, &[arg(ARG_FROM, kernel), arg(ARG_TO, user)])?;
                }
            }
        }
        // SAFETY: this thread's live stream.
        check(unsafe { (d.stream_wait)(stream) }, "stream_wait")
    })
}

/// `bytes` of `buffer`, grown as needed, from a 64-byte boundary.
fn aligned(buffer: &mut Vec<u8>, bytes: usize) -> *mut c_void {
    if buffer.len() < bytes + 64 {
        buffer.resize(bytes + 64, 0);
    }
    let offset = buffer.as_ptr().align_offset(64);
    // SAFETY: `offset + bytes` is inside the buffer.
    unsafe { buffer.as_mut_ptr().add(offset) as *mut c_void }
}

// ------------------------------------------------------------------ the handlers

unsafe extern "C" fn forward(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA passes a valid frame.
    unsafe { handle(frame, Kind::Forward) }
}

unsafe extern "C" fn input_grad(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA passes a valid frame.
    unsafe { handle(frame, Kind::InputGrad) }
}

unsafe extern "C" fn weight_grad(frame: *mut CallFrame) -> *mut c_void {
    // SAFETY: XLA passes a valid frame.
    unsafe { handle(frame, Kind::WeightGrad) }
}

/// An f32 buffer's `[d0, d1, d2, d3]`.
fn dims4(b: &FfiBuffer) -> Option<[i64; 4]> {
    (b.dtype == DTYPE_F32)
        .then(|| b.dims().try_into().ok())
        .flatten()
}

/// # Safety
/// `frame` must be a call frame XLA passed to a handler.
unsafe fn handle(frame: *mut CallFrame, kind: Kind) -> *mut c_void {
    let target = kind.target();
    // SAFETY: the pointer XLA passed.
    let frame = match unsafe { open_frame(frame, target) } {
        Ok(frame) => frame,
        Err(done) => return done,
    };
    // SAFETY: the frame XLA passed, its size checked by `open_frame`.
    match unsafe { call(frame, kind) } {
        Ok(()) => {
            CALLS[kind as usize].fetch_add(1, Ordering::Relaxed);
            std::ptr::null_mut()
        }
        Err(e) => error(frame, &format!("{target}: {e}")),
    }
}

/// # Safety
/// `frame` must be a live call frame whose size was checked.
unsafe fn call(frame: &CallFrame, kind: Kind) -> Result<(), String> {
    // SAFETY: the caller's frame; `arg`/`ret` check each index against the frame's counts.
    let (Some(a), Some(b), Some(geo), Some(out), None, None) = (unsafe {
        (
            arg(frame, 0),
            arg(frame, 1),
            arg(frame, 2),
            ret(frame, 0),
            arg(frame, 3),
            ret(frame, 1),
        )
    }) else {
        return Err("expects 3 operands and 1 result".into());
    };
    if geo.dtype != DTYPE_S64 || geo.dims() != [GEOMETRY_LEN as i64] {
        return Err(format!("the geometry must be s64[{GEOMETRY_LEN}]"));
    }
    // SAFETY: an s64 buffer of GEOMETRY_LEN entries (checked).
    let geometry: [i64; GEOMETRY_LEN] =
        unsafe { std::slice::from_raw_parts(geo.data as *const i64, GEOMETRY_LEN) }
            .try_into()
            .expect("length checked");
    let (Some(ad), Some(bd), Some(od)) = (dims4(a), dims4(b), dims4(out)) else {
        return Err("operands and result must be f32 of rank 4".into());
    };
    // [N, H, W, C] activations, the kernel [O, C/g, KH, KW].
    let (input, kernel, out_nhwc) = match kind {
        Kind::Forward => (ad, bd, od),
        Kind::InputGrad => (od, bd, ad),
        Kind::WeightGrad => (ad, od, bd),
    };
    let [n, h, w, c] = input;
    let [on, oh, ow, o] = out_nhwc;
    let [ko, kc, kh, kw] = kernel;
    let g = geometry[8];
    let [sh, sw, pt, pl, pb, pr, dh, dw, _] = geometry;
    let span = |size: i64, pad: (i64, i64), k: i64, d: i64, s: i64| {
        (size + pad.0 + pad.1 - d * (k - 1) - 1).div_euclid(s) + 1
    };
    if g < 1
        || sh < 1
        || sw < 1
        || dh < 1
        || dw < 1
        || [pt, pl, pb, pr].iter().any(|&p| p < 0)
        || on != n
        || ko != o
        || o % g != 0
        || c != kc * g
        || oh != span(h, (pt, pb), kh, dh, sh)
        || ow != span(w, (pl, pr), kw, dw, sw)
        || [n, h, w, c, o, kh, kw, oh, ow].iter().any(|&x| x < 1)
    {
        return Err(format!(
            "shapes do not make a convolution: input (NHWC) {input:?}, kernel {kernel:?}, \
             output (NHWC) {out_nhwc:?}, geometry {geometry:?}"
        ));
    }
    let Some(Some(d)) = DNNL.get() else {
        return Err("oneDNN is not loaded in this process".into());
    };
    let shape = Shape {
        kind,
        input: [n, c, h, w],
        kernel,
        out_hw: [oh, ow],
        geometry,
    };
    run(d, &shape, a.data, b.data, out.data)
}
