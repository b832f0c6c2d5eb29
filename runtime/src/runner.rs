//! Running compiled executables with host memory in and out: uploading host arrays (aliased on
//! the CPU plugin, whose device memory is host memory), executing, and fetching the outputs
//! into host memory. What the compiler made is run here; nothing here compiles.

use crate::{Buffer, Client, ElementType, HostBufferSemantics, LoadedExecutable, PjrtError};
use smallvec::SmallVec;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// The alignment the CPU plugin requires of memory it computes on in place (XLA's minimum
/// buffer alignment).
pub const HOST_VIEW_ALIGN: usize = 64;

/// The shape and element type of one array of an executable's signature.
pub type ArrayType = (Vec<i64>, ElementType);

/// The arrays an executable takes and returns, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Signature {
    pub inputs: Vec<ArrayType>,
    pub outputs: Vec<ArrayType>,
    /// The inputs the module aliases to an output (`tf.aliasing_output`): donated when they are
    /// a private copy made for this call (`Runner::execute_with_donations`).
    pub aliased_inputs: Vec<usize>,
}

/// A host array handed to [`Runner::run`]: pointer, byte length, element type and shape.
#[derive(Clone, Debug)]
pub struct HostArray {
    pub ptr: usize,
    pub nbytes: usize,
    pub element: ElementType,
    pub shape: Vec<i64>,
}

/// An argument of a run: host memory (uploaded, or aliased on the CPU plugin) or a buffer
/// already on the device (parameters kept resident).
pub enum RunArg<'a> {
    Host(HostArray),
    Device(&'a Buffer),
}

/// An argument of [`Runner::execute_ptrs`]: the address of a dense host array of exactly the
/// executable's input type, or a buffer already on the device.
pub enum PtrArg<'a> {
    Host(usize),
    Device(&'a Buffer),
}

/// Where [`Runner::execute_ptrs`] spent its time: wrapping host arguments as buffers, and
/// executing (until the outputs are ready).
#[derive(Clone, Copy, Debug, Default)]
pub struct RunTimings {
    pub stage: std::time::Duration,
    pub execute: std::time::Duration,
}

/// Errors of a run: the plugin's, or a call that does not fit the executable (arity, types).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Pjrt(#[from] PjrtError),
    #[error("{0}")]
    Call(String),
}

/// Whether `TPUC_DEBUG=discrete_device` asks to treat every plugin as a discrete device.
pub fn discrete_device_forced() -> bool {
    crate::env::debug_flag("discrete_device")
}

/// Bytes of a dense array of `shape` and `element` (shapes of signatures are valid).
pub fn dense_bytes(shape: &[i64], element: ElementType) -> usize {
    shape
        .iter()
        .map(|&d| usize::try_from(d).unwrap_or(0))
        .product::<usize>()
        * element.byte_size()
}

/// Times `n` bare executions of `exe` on resident `args` (outputs stay on the device and are
/// dropped): the floor a run's per-call work adds to. Seconds per execution.
pub fn bare_execute_seconds(
    exe: &LoadedExecutable,
    args: &[&Buffer],
    n: usize,
) -> Result<Vec<f64>, PjrtError> {
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        drop(exe.execute(args)?);
        times.push(t0.elapsed().as_secs_f64());
    }
    Ok(times)
}

/// Runs executables of one client with host memory in and out.
pub struct Runner {
    client: Client,
    /// Whether buffers may alias host memory (the CPU plugin): inputs are then never copied.
    host_zero_copy: bool,
    /// Whether the plugin makes views of host memory (`CreateViewOfDeviceBuffer`); cleared at
    /// the first refusal.
    host_views: AtomicBool,
}

/// The buffers to execute with: device arguments as given, host ones as `stage` uploaded them.
fn arg_refs<'a>(args: &'a [RunArg<'a>], staged: &'a [Option<Buffer>]) -> Vec<&'a Buffer> {
    args.iter()
        .zip(staged)
        .map(|(a, s)| match (a, s) {
            (RunArg::Device(b), _) => *b,
            (RunArg::Host(_), Some(b)) => b,
            (RunArg::Host(_), None) => unreachable!("every host arg was uploaded"),
        })
        .collect()
}

/// The error for a call with another number of inputs or outputs than the executable has.
fn check_arity(sig: &Signature, inputs: usize, outputs: usize) -> Result<(), RunError> {
    if inputs != sig.inputs.len() || outputs != sig.outputs.len() {
        return Err(RunError::Call(format!(
            "executable takes {} inputs and {} outputs, got {inputs} and {outputs}",
            sig.inputs.len(),
            sig.outputs.len(),
        )));
    }
    Ok(())
}

impl Runner {
    /// A runner on `client`. On the CPU plugin host memory is used in place (inputs aliased,
    /// outputs read where they are), unless `TPUC_DEBUG=discrete_device` asks for the path of
    /// GPUs and TPUs (inputs uploaded, outputs copied back, resident buffers as copies), tested
    /// where there are none; `TPUC_DEBUG=no_host_views` uploads instead of making views.
    pub fn new(client: Client) -> Result<Runner, PjrtError> {
        let platform = client.platform_name()?.to_lowercase();
        Ok(Runner {
            host_zero_copy: platform == "cpu" && !discrete_device_forced(),
            host_views: AtomicBool::new(!crate::env::debug_flag("no_host_views")),
            client,
        })
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Whether device memory is host memory (the CPU plugin): host arrays can be computed on
    /// in place.
    pub fn host_zero_copy(&self) -> bool {
        self.host_zero_copy
    }

    /// Uploads host memory to device `device` (an index into the client's addressable
    /// devices). On the CPU plugin the buffer aliases the memory, which must then stay alive and
    /// unchanged while the buffer lives.
    ///
    /// # Safety
    /// `a.ptr` must point to `a.nbytes` readable bytes, alive as long as the buffer on the CPU
    /// plugin.
    pub unsafe fn upload_to(&self, a: &HostArray, device: usize) -> Result<Buffer, PjrtError> {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.client.buffer_from_host(
                a.ptr as *const u8,
                a.nbytes,
                a.element,
                &a.shape,
                self.host_semantics(),
                device,
            )
        }
    }

    /// [`Runner::upload_to`] for a buffer kept on the device between calls, after checking that
    /// `device` exists; also says whether the buffer is the host memory itself (no copy made).
    ///
    /// # Safety
    /// As for [`Runner::upload_to`].
    pub unsafe fn upload_resident(
        &self,
        a: &HostArray,
        device: usize,
    ) -> Result<(Buffer, bool), RunError> {
        let devices = self.client.addressable_device_count();
        if device >= devices {
            return Err(RunError::Call(format!(
                "device {device} does not exist (the plugin has {devices})"
            )));
        }
        // SAFETY: forwarded from the caller.
        let buffer = unsafe { self.upload_to(a, device)? };
        let aliases_host = a.nbytes > 0
            && self.host_zero_copy
            && buffer.device_pointer().is_ok_and(|p| p == a.ptr);
        Ok((buffer, aliases_host))
    }

    /// Runs `exe` (of signature `sig`) and writes each output into the host memory given in
    /// `outputs`.
    ///
    /// # Safety
    /// Every host pointer must be valid for its byte length for the whole call; outputs must be
    /// writable and not alias inputs.
    pub unsafe fn run(
        &self,
        exe: &LoadedExecutable,
        sig: &Signature,
        args: &[RunArg],
        outputs: &[HostArray],
    ) -> Result<(), RunError> {
        check_arity(sig, args.len(), outputs.len())?;
        // SAFETY: forwarded from the caller; the buffers are dropped before return.
        let staged = unsafe {
            self.stage(args, &sig.inputs, 0, |i, (shape, element), h| {
                format!(
                    "input {i}: executable expects {element}{shape:?}, got {}{:?}",
                    h.element, h.shape
                )
            })?
        };
        let refs = arg_refs(args, &staged);
        let host = |i: usize| matches!(args.get(i), Some(RunArg::Host(_)));
        let results = self.execute_with_donations(exe, sig, &refs, host)?;
        if results.len() != outputs.len() {
            return Err(RunError::Call(format!(
                "executable returned {} outputs, expected {}",
                results.len(),
                outputs.len()
            )));
        }
        for (buf, out) in results.iter().zip(outputs) {
            // SAFETY: forwarded from the caller.
            unsafe { self.fetch(buf, out.ptr, out.nbytes)? };
        }
        Ok(())
    }

    /// [`Runner::run`] for a caller that already knows its arguments have the executable's
    /// types (a call plan checked them): host arguments are bare addresses, read with the
    /// signature's shapes and element types; nothing per call but the PJRT work. Returns the
    /// output buffers, ready to read: a caller that can use device memory in place (see
    /// [`Runner::host_view`]) takes them as they are, others copy them out with
    /// [`Runner::fetch`].
    ///
    /// # Safety
    /// Every host address must be valid for the dense size of its signature type for the whole
    /// call.
    pub unsafe fn execute_ptrs(
        &self,
        exe: &LoadedExecutable,
        sig: &Signature,
        args: &[PtrArg],
        timings: Option<&mut RunTimings>,
    ) -> Result<Vec<Buffer>, RunError> {
        let t0 = timings.as_ref().map(|_| Instant::now());
        if args.len() != sig.inputs.len() {
            return Err(RunError::Call(format!(
                "executable takes {} inputs, got {}",
                sig.inputs.len(),
                args.len()
            )));
        }
        let mut staged: Vec<Buffer> = Vec::new();
        for (a, (shape, element)) in args.iter().zip(&sig.inputs) {
            if let PtrArg::Host(ptr) = a {
                // SAFETY: forwarded from the caller; the buffer is dropped before return.
                staged.push(unsafe { self.wrap_host(*ptr, shape, *element)? });
            }
        }
        let mut next = staged.iter();
        let refs: SmallVec<[&Buffer; 4]> = args
            .iter()
            .map(|a| match a {
                PtrArg::Device(b) => *b,
                PtrArg::Host(_) => next.next().expect("one staged buffer per host argument"),
            })
            .collect();
        let t1 = t0.map(|_| Instant::now());
        let host = |i: usize| matches!(args.get(i), Some(PtrArg::Host(_)));
        let results = self.execute_with_donations(exe, sig, &refs, host)?;
        drop(refs);
        drop(staged);
        if let (Some(t), Some(t0), Some(t1)) = (timings, t0, t1) {
            t.stage += t1 - t0;
            t.execute += t1.elapsed();
        }
        if results.len() != sig.outputs.len() {
            return Err(RunError::Call(format!(
                "executable returned {} outputs, expected {}",
                results.len(),
                sig.outputs.len()
            )));
        }
        Ok(results)
    }

    /// Runs `exe` on `refs`, donating the aliased inputs that were uploaded for this call
    /// (`host(i)`: argument `i` came from host memory): on a discrete device such an upload is
    /// a private copy that nothing reads after the call, so the output reuses its memory
    /// instead of needing a second buffer. Never donated: a resident buffer (a `RunArg::Device`,
    /// which other calls read again) and, on the CPU plugin, a host argument, which is a view
    /// of the caller's tensor (the plugin copies such an argument rather than writing into it,
    /// `tests::aliased_arguments_donated_or_kept`).
    fn execute_with_donations(
        &self,
        exe: &LoadedExecutable,
        sig: &Signature,
        refs: &[&Buffer],
        host: impl Fn(usize) -> bool,
    ) -> Result<Vec<Buffer>, PjrtError> {
        // Asked only of the aliased inputs: nothing is built per call where there are none.
        let donated = || sig.aliased_inputs.iter().filter(|&&i| host(i));
        if self.host_zero_copy || donated().next().is_none() {
            return exe.execute(refs);
        }
        let mut donate: SmallVec<[bool; 8]> = smallvec::smallvec![false; refs.len()];
        for &i in donated() {
            donate[i] = true;
        }
        exe.execute_donating(refs, &donate)
    }

    /// The address of `buf`'s memory when the host can read it in place as a dense row-major
    /// array of `nbytes` (the CPU plugin: device memory is host memory), else None. Valid while
    /// `buf` lives; the buffer must be ready (as [`Runner::execute_ptrs`] returns them).
    pub fn host_view(&self, buf: &Buffer, nbytes: usize) -> Result<Option<usize>, PjrtError> {
        if !self.host_zero_copy || nbytes == 0 || buf.on_device_size()? != nbytes {
            return Ok(None);
        }
        buf.device_pointer().map(Some)
    }

    /// A buffer over host memory for one execution: on the CPU plugin a view of the memory
    /// itself (`CreateViewOfDeviceBuffer`: no copy, no event) when it is aligned as the plugin
    /// requires, else `BufferFromHostBuffer` (zero-copy on the CPU plugin where it can).
    ///
    /// # Safety
    /// `ptr` must point to the dense bytes of `shape` and `element`, valid and unmodified while
    /// the buffer lives.
    unsafe fn wrap_host(
        &self,
        ptr: usize,
        shape: &[i64],
        element: ElementType,
    ) -> Result<Buffer, PjrtError> {
        let nbytes = dense_bytes(shape, element);
        if self.host_zero_copy
            && nbytes > 0
            && ptr.is_multiple_of(HOST_VIEW_ALIGN)
            && self.host_views.load(Ordering::Relaxed)
        {
            // SAFETY: forwarded from the caller; a view is never donated (execute_with_donations).
            match unsafe {
                self.client
                    .view_of_device_memory(ptr as *mut u8, element, shape, 0)
            } {
                Ok(b) => return Ok(b),
                Err(e) => {
                    tracing::debug!("host views unavailable, uploading instead: {e}");
                    self.host_views.store(false, Ordering::Relaxed);
                }
            }
        }
        // SAFETY: forwarded from the caller.
        unsafe {
            self.client.buffer_from_host(
                ptr as *const u8,
                nbytes,
                element,
                shape,
                self.host_semantics(),
                0,
            )
        }
    }

    fn host_semantics(&self) -> HostBufferSemantics {
        if self.host_zero_copy {
            HostBufferSemantics::ImmutableZeroCopy
        } else {
            HostBufferSemantics::ImmutableOnlyDuringCall
        }
    }

    /// Uploads each host argument to `device` after checking it against `expected` (`mismatch`
    /// words the error); device arguments are left as they are (`None`).
    ///
    /// # Safety
    /// As for [`Runner::upload_to`], for every host argument.
    unsafe fn stage(
        &self,
        args: &[RunArg],
        expected: &[ArrayType],
        device: usize,
        mismatch: impl Fn(usize, &ArrayType, &HostArray) -> String,
    ) -> Result<Vec<Option<Buffer>>, RunError> {
        let mut staged = Vec::with_capacity(args.len());
        for (i, a) in args.iter().enumerate() {
            let RunArg::Host(h) = a else {
                staged.push(None);
                continue;
            };
            let want = &expected[i];
            if h.shape != want.0 || h.element != want.1 {
                return Err(RunError::Call(mismatch(i, want, h)));
            }
            // SAFETY: forwarded from the caller.
            staged.push(Some(unsafe { self.upload_to(h, device)? }));
        }
        Ok(staged)
    }

    /// Copies a finished output buffer into `nbytes` of host memory at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be writable for `nbytes` bytes and not alias the buffer.
    pub unsafe fn fetch(&self, buf: &Buffer, ptr: usize, nbytes: usize) -> Result<(), PjrtError> {
        if nbytes == 0 {
            return Ok(()); // an empty tensor's data pointer may be null
        }
        match self.host_view(buf, nbytes)? {
            // CPU plugin: execute has finished, so a plain copy avoids ToHostBuffer's async
            // round trip (about half of the per-call cost of a small graph).
            // SAFETY: `src` is valid for `nbytes` while `buf` lives; `ptr` is the caller's
            // writable, non-aliasing host memory of that length.
            Some(src) => unsafe {
                std::ptr::copy_nonoverlapping(src as *const u8, ptr as *mut u8, nbytes);
                Ok(())
            },
            // SAFETY: forwarded from the caller.
            None => unsafe { buf.to_host(ptr as *mut u8, nbytes) },
        }
    }

    /// Runs a sharded executable of signature `sig` on `devices` devices: `shards` is each
    /// input's per-device piece type; `args[d]` are device `d`'s pieces of every input, and
    /// each `Some` entry of `outputs[d]` receives device `d`'s piece of that output (`None`: not
    /// read, e.g. a second copy of a replicated piece).
    ///
    /// # Safety
    /// As for [`Runner::run`], for every host array of every device.
    pub unsafe fn run_sharded(
        &self,
        exe: &LoadedExecutable,
        sig: &Signature,
        devices: usize,
        shards: &[ArrayType],
        args: &[Vec<RunArg>],
        outputs: &[Vec<Option<HostArray>>],
    ) -> Result<(), RunError> {
        let n = devices;
        if args.len() != n || outputs.len() != n {
            return Err(RunError::Call(format!(
                "sharded executable runs on {n} devices, got {} argument and {} output lists",
                args.len(),
                outputs.len()
            )));
        }
        let mut staged: Vec<Vec<Option<Buffer>>> = Vec::with_capacity(n);
        for (d, (dev_args, dev_outs)) in args.iter().zip(outputs).enumerate() {
            if dev_args.len() != sig.inputs.len() || dev_outs.len() != sig.outputs.len() {
                return Err(RunError::Call(format!(
                    "device {d}: executable takes {} inputs and {} outputs, got {} and {}",
                    sig.inputs.len(),
                    sig.outputs.len(),
                    dev_args.len(),
                    dev_outs.len()
                )));
            }
            // SAFETY: forwarded from the caller; the buffers are dropped before return.
            staged.push(unsafe {
                self.stage(dev_args, shards, d, |i, (want, element), h| {
                    format!(
                        "device {d}, input {i}: expects a {element}{want:?} shard, got {}{:?}",
                        h.element, h.shape
                    )
                })?
            });
        }
        let lists: Vec<Vec<&Buffer>> = args
            .iter()
            .zip(&staged)
            .map(|(dev_args, bufs)| arg_refs(dev_args, bufs))
            .collect();
        let results = exe.execute_sharded(&lists)?;
        for (d, (bufs, outs)) in results.iter().zip(outputs).enumerate() {
            if bufs.len() != outs.len() {
                return Err(RunError::Call(format!(
                    "device {d} returned {} outputs, expected {}",
                    bufs.len(),
                    outs.len()
                )));
            }
            for (buf, out) in bufs.iter().zip(outs) {
                if let Some(out) = out {
                    // SAFETY: forwarded from the caller.
                    unsafe { self.fetch(buf, out.ptr, out.nbytes)? };
                }
            }
        }
        Ok(())
    }
}
