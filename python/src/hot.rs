//! The per-call hot path of a compiled graph: one Rust call from the graph's `__call__` that
//! checks the caller's tensors against the executable's signature, runs it with the GIL
//! released, and hands its outputs to torch. On the CPU plugin an output's device memory is
//! host memory, so torch gets it in place through DLPack (no allocation, no copy); elsewhere the
//! output is copied into a fresh torch tensor.
//!
//! Everything that does not change between calls is computed once, in `CallPlan::new`, from
//! what Python's `call_plan._call_plan` passes; the tensors' metadata, once checked one by one, is
//! checked on later calls by one Dynamo `TensorGuards` call for all inputs. A call that does not
//! fit the plan (a tensor of another shape, dtype or device, non-contiguous, lazily negated) goes
//! to the graph's general path (`try_call` returns None instead).

use crate::errors::{pjrt_err, run_err};
use crate::executable::{DeviceBuffer, Executable};
use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyTuple};
use pyo3::{PyTraverseError, PyVisit};
use smallvec::SmallVec;
use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tpuc_compiler::pipeline::{dense_bytes, Compiled};
use tpuc_frontend_fx::DType;
use tpuc_runtime::{Buffer, PtrArg, RunTimings, Runner};

// DLPack's C ABI (dlpack.h, v0.8 layout, the one `torch._C._from_dlpack` reads).
#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64, // null: dense row-major
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

const DL_CPU: i32 = 1;
const DLTENSOR_NAME: &CStr = c"dltensor";

/// An output buffer lent to torch: the DLPack record first (its address is the record's),
/// then what it points into, freed together by `delete_lent` when torch lets go of the tensor.
#[repr(C)]
struct Lent {
    managed: DLManagedTensor,
    /// Inline for the usual ranks: one allocation per output, the box.
    shape: SmallVec<[i64; 4]>,
    buffer: Buffer,
}

unsafe extern "C" fn delete_lent(m: *mut DLManagedTensor) {
    // SAFETY: `m` is the first field of a `Lent` made by `Box::into_raw` in `lend`, and DLPack
    // calls the deleter once. Dropping a PJRT buffer needs no GIL.
    drop(unsafe { Box::from_raw(m.cast::<Lent>()) });
}

/// The capsule's destructor: frees the record only if torch never took it (a consumer renames
/// the capsule to "used_dltensor" and owns the record from then on).
unsafe extern "C" fn drop_capsule(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the capsule being destroyed; IsValid sets no error.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, DLTENSOR_NAME.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(capsule, DLTENSOR_NAME.as_ptr())
                .cast::<DLManagedTensor>();
            if let Some(delete) = (*m).deleter {
                delete(m);
            }
        }
    }
}

/// `tensor` (an output as the executable returned it) as the graph's value: a permuted view
/// for an output returned in its physical layout.
fn permuted<'py>(
    py: Python<'py>,
    tensor: Bound<'py, PyAny>,
    out: &PlanOutput,
) -> PyResult<Bound<'py, PyAny>> {
    match &out.perm {
        Some(perm) => tensor.call_method1(intern!(py, "permute"), (perm.bind(py),)),
        None => Ok(tensor),
    }
}

/// A "dltensor" capsule over `buffer`'s memory at `data` (dense, row-major `shape`).
fn lend<'py>(
    py: Python<'py>,
    buffer: Buffer,
    data: usize,
    shape: &[i64],
    dtype: DLDataType,
) -> PyResult<Bound<'py, PyAny>> {
    let mut lent = Box::new(Lent {
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data: data as *mut c_void,
                device: DLDevice {
                    device_type: DL_CPU,
                    device_id: 0,
                },
                ndim: i32::try_from(shape.len()).map_err(|_| PyValueError::new_err("rank"))?,
                dtype,
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_lent),
        },
        shape: SmallVec::from_slice(shape),
        buffer,
    });
    lent.managed.dl_tensor.shape = lent.shape.as_mut_ptr();
    let raw = Box::into_raw(lent);
    // SAFETY: `raw` stays valid until its deleter runs (from the capsule's destructor, or from
    // torch once it has taken the record).
    unsafe {
        let capsule = ffi::PyCapsule_New(raw.cast(), DLTENSOR_NAME.as_ptr(), Some(drop_capsule));
        if capsule.is_null() {
            delete_lent(raw.cast());
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, capsule))
    }
}

/// DLPack's name for `dtype`, where torch reads it back as the same dtype.
fn dl_dtype(dtype: DType) -> Option<DLDataType> {
    let (code, bits) = match dtype {
        DType::Float64 => (2, 64),
        DType::Float32 => (2, 32),
        DType::Float16 => (2, 16),
        DType::Bfloat16 => (4, 16),
        DType::Int64 => (0, 64),
        DType::Int32 => (0, 32),
        DType::Int16 => (0, 16),
        DType::Int8 => (0, 8),
        DType::Uint8 => (1, 8),
        DType::Bool => (6, 8),
        DType::Complex64 => (5, 64),
        DType::Complex128 => (5, 128),
        DType::Uint64 => return None,
    };
    Some(DLDataType {
        code,
        bits,
        lanes: 1,
    })
}

/// The device buffer of one input position, reused while the same tensor comes back with the
/// same memory and `_version`: parameters and buffers are uploaded once. A tensor is only made
/// resident the second time its storage is seen here (`ref` remembers the first), so per-call
/// activations are never pinned. What is resident is keyed on the tensor's memory, not only on
/// the tensor object: `.data =`, dtype round trips (`module.double().float()`), `swap_tensors`
/// and FSDP's storage resizes give the same object new memory without bumping `_version`, and
/// a buffer over the old memory would read freed or stale bytes. `call_plan._residency` fills
/// it; call plans read it without attribute lookups.
#[pyclass(module = "tpuc._native")]
pub struct Slot {
    /// A weak reference to the storage of the last tensor seen here that is not resident, or
    /// None (a weak reference to the tensor itself would stop `torch.utils.swap_tensors`).
    #[pyo3(get, set, name = "ref")]
    seen: Option<Py<PyAny>>,
    /// The resident tensor, or None.
    #[pyo3(get, set)]
    tensor: Option<Py<PyAny>>,
    /// Its `_version` when uploaded.
    #[pyo3(get, set)]
    version: i64,
    /// Its `data_ptr()` when uploaded.
    #[pyo3(get, set)]
    ptr: usize,
    /// Its storage when uploaded (held: its memory cannot be reused for another storage while
    /// a buffer may point at it).
    #[pyo3(get, set)]
    storage: Option<Py<PyAny>>,
    /// Whether the buffer is the host memory itself (the CPU plugin): it then reads the
    /// tensor's current bytes whatever wrote them; a copy is only current while nothing wrote
    /// the memory, which the version, address and storage checks stand for.
    #[pyo3(get, set)]
    aliased: bool,
    /// The address of the last tensor the call plan saw here, resident or not (0: none yet).
    /// A tensor at another address than last time is not the same storage coming back, so the
    /// plan passes it without asking `call_plan._residency` (a fresh token tensor every step).
    seen_ptr: AtomicUsize,
    /// Its device buffer.
    #[pyo3(get, set)]
    buffer: Option<Py<DeviceBuffer>>,
}

#[pymethods]
impl Slot {
    #[new]
    fn new() -> Self {
        Slot {
            seen: None,
            tensor: None,
            version: -1,
            ptr: 0,
            storage: None,
            aliased: false,
            buffer: None,
            seen_ptr: AtomicUsize::new(0),
        }
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.seen)?;
        visit.call(&self.tensor)?;
        visit.call(&self.storage)?;
        visit.call(&self.buffer)?;
        Ok(())
    }

    fn __clear__(&mut self) {
        (self.seen, self.tensor, self.storage, self.buffer) = (None, None, None, None);
    }
}

struct PlanInput {
    /// Index into the caller's args followed by `extra` (then the seed).
    position: usize,
    shape: Py<PyTuple>,
    dtype: Py<PyAny>,
    /// The position's resident buffer.
    slot: Py<Slot>,
    /// Whether the dtype can carry torch's lazy conjugation bit.
    complex: bool,
}

struct PlanOutput {
    shape: Vec<i64>,
    nbytes: usize,
    dl: Option<DLDataType>,
    /// `(shape, strides, dtype)` for the allocator, when the output is copied out.
    alloc_args: Py<PyTuple>,
    /// The permutation that makes the graph's value of an output returned in its physical
    /// layout (`Executable.output_perms`): torch gets a permuted view.
    perm: Option<Py<PyTuple>>,
    /// Whether torch can read this output's device memory in place ([`LEND_UNKNOWN`] until the
    /// first call asks the plugin: the answer is the same for every call of one executable).
    lend: AtomicU8,
}

/// Outputs of at most this many bytes are copied into a fresh tensor even where torch could read
/// them in place (see [`CallPlan::hand_out`]).
const COPY_OUT_BELOW: usize = 4096;

const LEND_UNKNOWN: u8 = 0;
const LEND_IN_PLACE: u8 = 1;
const LEND_COPY: u8 = 2;

enum ResultItem {
    Output(usize),
    /// A graph input returned unchanged: the caller's tensor itself (index into the args, then
    /// `extra`), never copied.
    Input(usize),
    Value(Py<PyAny>),
}

/// One executable's call plan (see the module docs). Called with the graph's boxed args list,
/// it returns the graph's outputs; args that do not fit go to `fallback` (the graph's general
/// path). A static graph's plan is what AOTAutograd calls, with nothing in between.
#[pyclass(module = "tpuc._native", frozen)]
pub struct CallPlan {
    runner: Arc<Runner>,
    compiled: Arc<Compiled>,
    inputs: Vec<PlanInput>,
    outputs: Vec<PlanOutput>,
    result: Vec<ResultItem>,
    identity: bool,
    extra: Vec<Py<PyAny>>,
    /// Draws the per-call random seed tensor (graphs with random ops).
    seed: Option<Py<PyAny>>,
    /// `(slot, tensor) -> DeviceBuffer | None`: residency of a tensor not resident yet.
    device_arg: Py<PyAny>,
    /// `device_arg.align`: tensors at addresses off this alignment are never made resident, so
    /// at a position with nothing resident they go as host pointers without the call (a step
    /// counter of a few bytes, every call); 0: nothing is ever resident; 1: any address.
    resident_align: usize,
    /// `(shape, strides, dtype) -> tensor` for outputs copied out.
    alloc: Py<PyAny>,
    from_dlpack: Py<PyAny>,
    /// `(args) -> outputs` for args that do not fit (holds the graph, which holds this plan: the
    /// cycle is visible to Python's GC through `__traverse__`).
    fallback: Option<Py<PyAny>>,
    /// Dynamo's C++ tensor check (`TensorGuards`) built from the first call's inputs once each
    /// passed the per-tensor checks: while it accepts a call's inputs (same dtype, device,
    /// dispatch keys, sizes and strides as then), those checks hold and are skipped (about 1 us
    /// of attribute calls per tensor, 130 us per step of a 100-parameter decoder; the guard
    /// checks them all in about 4).
    guard: std::sync::OnceLock<Option<Py<PyAny>>>,
}

/// `t.data_ptr()`, called through the method's descriptor and read with `PyLong_AsSize_t`: half
/// the cost of a bound-method call plus pyo3's integer extraction (which goes through
/// `_PyLong_AsByteArray` for an address). Twice per call of a one-input, one-output graph.
fn data_ptr(py: Python<'_>, t: &Bound<'_, PyAny>) -> PyResult<usize> {
    static DATA_PTR: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let method = DATA_PTR.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        Ok(py
            .import(intern!(py, "torch"))?
            .getattr(intern!(py, "Tensor"))?
            .getattr(intern!(py, "data_ptr"))?
            .unbind())
    })?;
    let address = method.bind(py).call1((t,))?;
    // SAFETY: a live object; the call sets an exception where it is not an int in range.
    let ptr = unsafe { ffi::PyLong_AsSize_t(address.as_ptr()) };
    if ptr == usize::MAX {
        if let Some(e) = PyErr::take(py) {
            return Err(e);
        }
    }
    Ok(ptr)
}

/// Dynamo's C++ tensor guard over `tensors` as they are now: dtype, device, dispatch keys (lazy
/// negation and conjugation among them), requires_grad, and these exact sizes and strides.
fn tensor_guard(py: Python<'_>, tensors: &[Bound<'_, PyAny>]) -> PyResult<Py<PyAny>> {
    let class = py
        .import(intern!(py, "torch._C._dynamo.guards"))?
        .getattr(intern!(py, "TensorGuards"))?;
    let per_tensor = |method: &str| -> PyResult<Vec<Vec<i64>>> {
        tensors
            .iter()
            .map(|t| t.call_method0(method)?.extract::<Vec<i64>>())
            .collect()
    };
    let (sizes, strides) = (per_tensor("size")?, per_tensor("stride")?);
    let kwargs = pyo3::types::PyDict::new(py);
    // Every dim given (none left dynamic): the guard compares these exact values.
    kwargs.set_item("dynamic_dims_sizes", &sizes)?;
    kwargs.set_item("dynamic_dims_strides", &strides)?;
    let guard = class.call(PyTuple::new(py, tensors)?, Some(&kwargs))?;
    let accepts = |with: Vec<Bound<'_, PyAny>>| -> PyResult<bool> {
        guard
            .call_method1(intern!(py, "check"), PyTuple::new(py, with)?)?
            .is_truthy()
    };
    // It must accept what it was built from, and refuse one of them (the smallest with a dim, so
    // that the probes are small) in another dtype or with other strides, what this torch's guard
    // is relied on to compare, or it is not used.
    if !accepts(tensors.to_vec())? {
        return Err(PyValueError::new_err(
            "TensorGuards rejects its own tensors",
        ));
    }
    let at = (0..tensors.len())
        .filter(|&i| !sizes[i].is_empty())
        .min_by_key(|&i| sizes[i].iter().product::<i64>())
        .unwrap_or(0);
    if let Some(probed) = tensors.get(at) {
        let torch = py.import(intern!(py, "torch"))?;
        let dtype = probed.getattr(intern!(py, "dtype"))?;
        let other = if dtype.is(torch.getattr("float64")?) {
            torch.getattr("float32")?
        } else {
            torch.getattr("float64")?
        };
        let (size, stride) = (&sizes[at], &strides[at]);
        let wider: Vec<i64> = stride.iter().map(|s| s * 2 + 1).collect();
        let like = |strides: &[i64], dtype: &Bound<'_, PyAny>| -> PyResult<Bound<'_, PyAny>> {
            let kw = pyo3::types::PyDict::new(py);
            kw.set_item("dtype", dtype)?;
            torch.call_method(
                intern!(py, "empty_strided"),
                (size.clone(), strides.to_vec()),
                Some(&kw),
            )
        };
        let mut probes = vec![("dtype", like(stride, &other)?)];
        if !size.is_empty() {
            probes.push(("strides", like(&wider, &dtype)?));
        }
        for (what, probe) in probes {
            let mut with = tensors.to_vec();
            with[at] = probe;
            if accepts(with)? {
                return Err(PyValueError::new_err(format!(
                    "TensorGuards ignores {what}"
                )));
            }
        }
    }
    Ok(guard.unbind())
}

/// Executions that took less than this last time keep the GIL: releasing and re-acquiring it
/// costs more than the execution frees for other threads, and re-acquiring it from a busy
/// thread can wait its whole switch interval (5 ms), a thousand times the execution.
const HOLD_GIL_BELOW: Duration = Duration::from_micros(10);

/// Executions through call plans since the process started (`tpuc.stats()["executions"]` adds
/// them to the general path's count).
static EXECUTIONS: AtomicU64 = AtomicU64::new(0);

#[pyfunction]
pub fn plan_executions() -> u64 {
    EXECUTIONS.load(Ordering::Relaxed)
}

/// `(position, shape, dtype, slot, complex)` of one tensor input, as Python passes it.
type InputTuple = (usize, Py<PyTuple>, Py<PyAny>, Py<Slot>, bool);

/// Seconds of one timed call: `(checking inputs, wrapping host inputs, executing, handing
/// outputs to torch)`.
type CallTimes = (f64, f64, f64, f64);

#[pymethods]
impl CallPlan {
    /// `inputs`: per tensor input `(position, shape, dtype, slot, complex)`; `outputs`: per
    /// output `(shape, strides, dtype)` (torch values, in the executable's order); `result`:
    /// the graph's outputs, each an int index into the outputs, `("input", i)` (the caller's
    /// arg i itself, or `extra`'s after the args) or `("value", v)`.
    #[new]
    #[pyo3(signature = (exe, inputs, outputs, result, extra, seed, device_arg, alloc, from_dlpack, fallback=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        exe: &Bound<'_, Executable>,
        inputs: Vec<InputTuple>,
        outputs: Vec<Py<PyTuple>>,
        result: Vec<Bound<'_, PyAny>>,
        extra: Vec<Py<PyAny>>,
        seed: Option<Py<PyAny>>,
        device_arg: Py<PyAny>,
        alloc: Py<PyAny>,
        from_dlpack: Py<PyAny>,
        fallback: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let py = exe.py();
        let exe = exe.get();
        let sig = &exe.compiled.lowered;
        if inputs.len() != sig.inputs.len() || outputs.len() != sig.outputs.len() {
            return Err(PyValueError::new_err(format!(
                "call plan: {} inputs and {} outputs for an executable of {} and {}",
                inputs.len(),
                outputs.len(),
                sig.inputs.len(),
                sig.outputs.len()
            )));
        }
        let outputs = outputs
            .into_iter()
            .zip(sig.outputs.iter().zip(&sig.output_perms))
            .map(|(alloc_args, ((shape, dtype), perm))| {
                Ok(PlanOutput {
                    shape: shape.clone(),
                    nbytes: dense_bytes(shape, *dtype),
                    dl: dl_dtype(*dtype),
                    alloc_args,
                    perm: perm
                        .as_ref()
                        .map(|p| PyTuple::new(py, p).map(Bound::unbind))
                        .transpose()?,
                    lend: AtomicU8::new(LEND_UNKNOWN),
                })
            })
            .collect::<PyResult<_>>()?;
        let result: Vec<ResultItem> = result
            .into_iter()
            .map(|r| match r.extract::<usize>() {
                Ok(k) => Ok(ResultItem::Output(k)),
                Err(_) => {
                    let (kind, v): (String, Bound<'_, PyAny>) = r.extract()?;
                    Ok(match kind.as_str() {
                        "input" => ResultItem::Input(v.extract()?),
                        _ => ResultItem::Value(v.unbind()),
                    })
                }
            })
            .collect::<PyResult<_>>()?;
        let identity = result.len() == sig.outputs.len()
            && result
                .iter()
                .enumerate()
                .all(|(i, r)| matches!(r, ResultItem::Output(k) if *k == i));
        Ok(CallPlan {
            runner: exe.runner.clone(),
            compiled: exe.compiled.clone(),
            inputs: inputs
                .into_iter()
                .map(|(position, shape, dtype, slot, complex)| PlanInput {
                    position,
                    shape,
                    dtype,
                    slot,
                    complex,
                })
                .collect(),
            outputs,
            result,
            identity,
            extra,
            seed,
            resident_align: device_arg
                .bind(py)
                .getattr("align")
                .and_then(|a| a.extract())
                .unwrap_or(1),
            device_arg,
            alloc,
            from_dlpack,
            fallback,
            guard: std::sync::OnceLock::new(),
        })
    }

    /// AOTAutograd calls compiled graphs with one list of args.
    #[classattr]
    fn _boxed_call() -> bool {
        true
    }

    fn __call__(&self, py: Python<'_>, args: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        if let Ok(list) = args.cast::<PyList>() {
            if let Some(out) = self.call(py, list, None)? {
                return Ok(out);
            }
        }
        self.general(py, args)
    }

    /// The plan as Dynamo calls a compiled graph that skips AOTAutograd's wrapper: with the
    /// args themselves, not boxed in a list (`backend._Direct`, without its Python frame).
    fn unboxed(slf: Py<Self>) -> Unboxed {
        Unboxed { plan: slf }
    }

    /// The outputs, or None when the args do not fit the plan.
    fn try_call(&self, py: Python<'_>, args: &Bound<'_, PyList>) -> PyResult<Option<Py<PyAny>>> {
        self.call(py, args, None)
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(Some(guard)) = self.guard.get() {
            visit.call(guard)?;
        }
        for input in &self.inputs {
            visit.call(&input.shape)?;
            visit.call(&input.dtype)?;
            visit.call(&input.slot)?;
        }
        for out in &self.outputs {
            visit.call(&out.alloc_args)?;
        }
        for r in &self.result {
            if let ResultItem::Value(v) = r {
                visit.call(v)?;
            }
        }
        for e in &self.extra {
            visit.call(e)?;
        }
        visit.call(&self.seed)?;
        visit.call(&self.device_arg)?;
        visit.call(&self.alloc)?;
        visit.call(&self.from_dlpack)?;
        visit.call(&self.fallback)?;
        Ok(())
    }

    /// `__call__`, also returning where the time went: `(result or None, (inputs, upload,
    /// execute, outputs))` in seconds (`TPUC_LOG=debug`'s per-call profile).
    fn call_timed(
        &self,
        py: Python<'_>,
        args: &Bound<'_, PyList>,
    ) -> PyResult<(Option<Py<PyAny>>, CallTimes)> {
        let mut t = PlanTimings::default();
        let out = self.call(py, args, Some(&mut t))?;
        Ok((
            out,
            (
                t.inputs,
                t.run.stage.as_secs_f64(),
                t.run.execute.as_secs_f64(),
                t.outputs,
            ),
        ))
    }
}

/// A call plan called with the graph's args unboxed (see [`CallPlan::unboxed`]).
#[pyclass(module = "tpuc._native", frozen)]
pub struct Unboxed {
    plan: Py<CallPlan>,
}

#[pymethods]
impl Unboxed {
    #[pyo3(signature = (*args))]
    fn __call__(&self, py: Python<'_>, args: &Bound<'_, PyTuple>) -> PyResult<Py<PyAny>> {
        let list = PyList::new(py, args)?;
        let plan = self.plan.get();
        match plan.call(py, &list, None)? {
            Some(out) => Ok(out),
            None => plan.general(py, list.as_any()),
        }
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.plan)
    }
}

#[derive(Default)]
struct PlanTimings {
    inputs: f64,
    run: RunTimings,
    outputs: f64,
}

/// An input as `execute_ptrs` takes it: a resident buffer or a host tensor's data pointer.
enum Arg<'py> {
    Device(Bound<'py, DeviceBuffer>),
    Host(usize),
}

impl CallPlan {
    /// The graph's general path for args that do not fit the plan.
    fn general(&self, py: Python<'_>, args: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        match &self.fallback {
            Some(general) => Ok(general.bind(py).call1((args,))?.unbind()),
            None => Err(PyValueError::new_err(
                "tpuc: the arguments do not fit this call plan (use try_call)",
            )),
        }
    }

    fn call(
        &self,
        py: Python<'_>,
        args: &Bound<'_, PyList>,
        mut timings: Option<&mut PlanTimings>,
    ) -> PyResult<Option<Py<PyAny>>> {
        let t0 = timings.as_ref().map(|_| Instant::now());
        // Held until the run ends: the tensors behind the host pointers (the seed among them).
        let seed = match &self.seed {
            Some(draw) => Some(draw.bind(py).call0()?),
            None => None,
        };
        let n_args = args.len();
        // On the stack for a few inputs: every call builds these lists.
        let mut run_args: SmallVec<[Arg<'_>; 4]> = SmallVec::with_capacity(self.inputs.len());
        let mut held: SmallVec<[Bound<'_, PyAny>; 4]> = SmallVec::with_capacity(self.inputs.len());
        for input in &self.inputs {
            let t = if input.position < n_args {
                args.get_item(input.position)?
            } else if let Some(e) = self.extra.get(input.position - n_args) {
                e.bind(py).clone()
            } else if let Some(s) = &seed {
                s.clone()
            } else {
                return Ok(None);
            };
            held.push(t);
        }
        let guard = self.guard.get();
        // Anything but a plain yes (an error for an input that is not a tensor) checks one by one.
        let checked = match guard {
            Some(Some(g)) => g
                .bind(py)
                .call_method1(intern!(py, "check"), PyTuple::new(py, &held)?)
                .and_then(|r| r.is_truthy())
                .unwrap_or(false),
            _ => false,
        };
        for (input, t) in self.inputs.iter().zip(&held) {
            match self.check_input(py, input, t, checked)? {
                Some(arg) => run_args.push(arg),
                None => return Ok(None),
            }
        }
        if guard.is_none() {
            // Every input passed the per-tensor checks: they are the guard's reference.
            let _ = self.guard.set(tensor_guard(py, &held).ok());
        }
        let ptr_args: SmallVec<[PtrArg<'_>; 4]> = run_args
            .iter()
            .map(|a| match a {
                Arg::Device(d) => PtrArg::Device(&d.get().buffer),
                Arg::Host(p) => PtrArg::Host(*p),
            })
            .collect();
        if let (Some(t), Some(t0)) = (timings.as_mut(), t0) {
            t.inputs += t0.elapsed().as_secs_f64();
        }
        let (runner, compiled) = (&self.runner, &self.compiled);
        let mut run_t = timings.as_ref().map(|_| RunTimings::default());
        // SAFETY: each host pointer is the data of a live (held), CPU, contiguous tensor whose
        // shape and dtype were just checked against the signature.
        let mut run = || unsafe {
            runner.execute_ptrs(
                &compiled.exe,
                &compiled.signature,
                &ptr_args,
                run_t.as_mut(),
            )
        };
        let buffers = if compiled.exe.last_run().is_some_and(|d| d < HOLD_GIL_BELOW) {
            run()
        } else {
            crate::exit::detach(py, run)
        }
        .map_err(run_err)?;
        drop(ptr_args);
        drop(held);
        let t2 = timings.as_ref().map(|_| Instant::now());
        let outs = self.hand_out(py, buffers)?;
        EXECUTIONS.fetch_add(1, Ordering::Relaxed);
        let result = if self.identity {
            PyList::new(py, outs)?
        } else {
            let items = self
                .result
                .iter()
                .map(|r| match r {
                    ResultItem::Output(k) => Ok(outs[*k].clone()),
                    ResultItem::Input(i) if *i < n_args => args.get_item(*i),
                    ResultItem::Input(i) => self
                        .extra
                        .get(i - n_args)
                        .map(|e| e.bind(py).clone())
                        .ok_or_else(|| PyValueError::new_err(format!("call plan: no input {i}"))),
                    ResultItem::Value(v) => Ok(v.bind(py).clone()),
                })
                .collect::<PyResult<SmallVec<[_; 8]>>>()?;
            PyList::new(py, items)?
        };
        if let (Some(t), Some(t2), Some(run)) = (timings, t2, run_t) {
            t.run = run;
            t.outputs += t2.elapsed().as_secs_f64();
        }
        Ok(Some(result.into_any().unbind()))
    }

    /// How `t` goes to the executable at `input`, or None when it does not fit the plan.
    /// `checked`: the plan's guard accepted this call's inputs, so the tensor's dtype, shape,
    /// device and layout fit (they are what they were when they passed the checks below).
    fn check_input<'py>(
        &self,
        py: Python<'py>,
        input: &PlanInput,
        t: &Bound<'py, PyAny>,
        checked: bool,
    ) -> PyResult<Option<Arg<'py>>> {
        if !checked {
            let Ok(dtype) = t.getattr(intern!(py, "dtype")) else {
                return Ok(None); // not a tensor
            };
            // Checked for resident tensors too: `.data =` can give the same object (same
            // version, even the same address) another shape, dtype or layout.
            let fits = dtype.is(input.dtype.bind(py))
                && t.getattr(intern!(py, "shape"))?.eq(input.shape.bind(py))?
                && t.getattr(intern!(py, "is_cpu"))?.is_truthy()?
                && t.call_method0(intern!(py, "is_contiguous"))?.is_truthy()?
                // Lazy negation/conjugation: the memory holds other values.
                && !t.call_method0(intern!(py, "is_neg"))?.is_truthy()?
                && !(input.complex && t.call_method0(intern!(py, "is_conj"))?.is_truthy()?);
            if !fits {
                return Ok(None);
            }
        }
        let ptr = data_ptr(py, t)?;
        let slot = input.slot.bind(py);
        if let Ok(slot) = slot.try_borrow() {
            let nothing_resident = slot.tensor.is_none() && slot.buffer.is_none();
            let last = slot.seen_ptr.swap(ptr, Ordering::Relaxed);
            if self.resident_align == 0
                || (nothing_resident
                    && (!ptr.is_multiple_of(self.resident_align) || (last != 0 && last != ptr)))
            {
                return Ok(Some(Arg::Host(ptr)));
            }
            if let (Some(resident), Some(buffer)) = (&slot.tensor, &slot.buffer) {
                // A buffer that is the tensor's memory reads its current bytes, so in-place
                // writes (a KV cache's every step) keep it; a copy needs the same version and
                // storage (see `residency.still_resident`).
                if resident.is(t)
                    && slot.ptr == ptr
                    && (slot.aliased
                        || (t.getattr(intern!(py, "_version"))?.extract::<i64>()? == slot.version
                            && slot.storage.as_ref().is_some_and(|s| {
                                t.call_method0(intern!(py, "untyped_storage"))
                                    .is_ok_and(|now| now.is(s))
                            })))
                {
                    return Ok(Some(Arg::Device(buffer.bind(py).clone())));
                }
            }
        } // released: `device_arg` below updates the slot
        let resident = self.device_arg.bind(py).call1((slot, t))?;
        if resident.is_none() {
            return Ok(Some(Arg::Host(ptr)));
        }
        Ok(Some(Arg::Device(resident.cast_into::<DeviceBuffer>()?)))
    }

    /// The executable's outputs as torch tensors: lent in place where the host can read the
    /// device memory, else copied into fresh tensors.
    fn hand_out<'py>(
        &self,
        py: Python<'py>,
        buffers: Vec<Buffer>,
    ) -> PyResult<SmallVec<[Bound<'py, PyAny>; 2]>> {
        let mut outs = SmallVec::with_capacity(buffers.len());
        for (buffer, out) in buffers.into_iter().zip(&self.outputs) {
            // Where torch can read the output's memory in place (None: it goes through the plugin).
            let readable = match (out.dl, out.lend.load(Ordering::Relaxed)) {
                (None, _) | (_, LEND_COPY) => None,
                (_, LEND_IN_PLACE) => Some(buffer.device_pointer().map_err(pjrt_err)?),
                _ => {
                    let view = self
                        .runner
                        .host_view(&buffer, out.nbytes)
                        .map_err(pjrt_err)?;
                    let lend = if view.is_some() {
                        LEND_IN_PLACE
                    } else {
                        LEND_COPY
                    };
                    out.lend.store(lend, Ordering::Relaxed);
                    view
                }
            };
            // Small outputs are copied even where they could be lent: a fresh tensor and a copy
            // cost less than a capsule, DLPack's import, and later the buffer's release from
            // torch's deleter.
            if let (Some(data), Some(dl), true) = (readable, out.dl, out.nbytes > COPY_OUT_BELOW) {
                let capsule = lend(py, buffer, data, &out.shape, dl)?;
                let tensor = self.from_dlpack.bind(py).call1((capsule,))?;
                outs.push(permuted(py, tensor, out)?);
                continue;
            }
            let tensor = self.alloc.bind(py).call1(out.alloc_args.bind(py))?;
            if out.nbytes > 0 {
                let ptr = data_ptr(py, &tensor)?;
                match readable {
                    // SAFETY: the executable finished: `data` holds the output's `nbytes`, and
                    // the fresh tensor as many; they do not overlap.
                    Some(data) => unsafe {
                        std::ptr::copy_nonoverlapping(data as *const u8, ptr as *mut u8, out.nbytes)
                    },
                    None => {
                        let runner = &self.runner;
                        // SAFETY: a fresh contiguous tensor of the output's type, held across
                        // the copy.
                        crate::exit::detach(py, || unsafe {
                            runner.fetch(&buffer, ptr, out.nbytes)
                        })
                        .map_err(pjrt_err)?;
                    }
                }
            }
            drop(buffer);
            outs.push(permuted(py, tensor, out)?);
        }
        Ok(outs)
    }
}
