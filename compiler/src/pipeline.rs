//! The compile pipeline: symbolic IR -> specialize -> lower -> cache lookup -> PJRT compile, and
//! running the result with host memory in and out.

use crate::lower::{self, LowerError, LowerOptions, Lowered, Precision};
use crate::pjrt::{
    self, Buffer, Client, CompileOptions, ElementType, HostBufferSemantics, LoadedExecutable,
    PjrtError, Plugin,
};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;
use tpuc_cache::{host_cpu_fingerprint, CacheKey, ExecutableCache, KeyBuilder};
use tpuc_frontend_fx::{DType, Graph};
use tpuc_passes::SpecializeError;

#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error(transparent)]
    Lower(#[from] LowerError),
    #[error(transparent)]
    Pjrt(#[from] PjrtError),
    #[error(transparent)]
    Specialize(#[from] SpecializeError),
    #[error("{0}")]
    Run(String),
}

pub fn element_type(d: DType) -> ElementType {
    match d {
        DType::Float64 => ElementType::F64,
        DType::Float32 => ElementType::F32,
        DType::Float16 => ElementType::F16,
        DType::Bfloat16 => ElementType::BF16,
        DType::Int64 => ElementType::S64,
        DType::Int32 => ElementType::S32,
        DType::Int16 => ElementType::S16,
        DType::Int8 => ElementType::S8,
        DType::Uint8 => ElementType::U8,
        DType::Bool => ElementType::Pred,
    }
}

/// One PJRT client with its executable cache. One engine per plugin (and device count) per
/// process.
pub struct Engine {
    client: Client,
    cache: ExecutableCache<LoadedExecutable>,
    platform: String,
    /// Whether buffers may alias host memory (the CPU plugin): inputs are then never copied.
    host_zero_copy: bool,
    cpu: String,
}

/// Where a compile's executable came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    Miss,
    Memory,
}

/// A compiled, ready-to-run graph for one static shape.
pub struct Compiled {
    pub exe: Arc<LoadedExecutable>,
    pub lowered: Lowered,
    pub key: CacheKey,
    pub outcome: CacheOutcome,
    pub lower_seconds: f64,
    pub compile_seconds: f64,
    pub specialized: Graph,
}

/// A host array handed to [`Engine::run`]: pointer, byte length, type and shape.
#[derive(Clone, Debug)]
pub struct HostArray {
    pub ptr: usize,
    pub nbytes: usize,
    pub dtype: DType,
    pub shape: Vec<i64>,
}

/// An argument of a run: host memory (uploaded, or aliased on the CPU plugin) or a buffer
/// already on the device (parameters kept resident).
pub enum RunArg<'a> {
    Host(HostArray),
    Device(&'a Buffer),
}

impl Engine {
    pub fn new(plugin_path: &Path, cpu_devices: Option<i64>) -> Result<Engine, PjrtError> {
        let plugin: &'static Plugin = pjrt::load_plugin(plugin_path)?;
        let client = Client::new(plugin, cpu_devices)?;
        let platform = client.platform_name()?.to_lowercase();
        Ok(Engine {
            host_zero_copy: platform == "cpu",
            client,
            cache: ExecutableCache::default(),
            platform,
            cpu: host_cpu_fingerprint(),
        })
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn platform(&self) -> &str {
        &self.platform
    }

    pub fn cached_executables(&self) -> usize {
        self.cache.len()
    }

    /// Specializes `graph` to the sizes in `bindings`, lowers it and compiles it (or finds it in
    /// the cache).
    pub fn compile(
        &self,
        graph: &Graph,
        bindings: &HashMap<String, i64>,
        precision: Precision,
    ) -> Result<Compiled, CompileError> {
        let t0 = Instant::now();
        let specialized = tpuc_passes::specialize(graph, bindings)?;
        let lowered = lower::lower(&specialized, &LowerOptions { precision })?;
        let lower_seconds = t0.elapsed().as_secs_f64();
        let options = CompileOptions::default();
        let key = KeyBuilder::new()
            .part("module", lowered.mlir.as_bytes())
            .part("compile_options", &options.encode())
            .part("plugin", &self.client.plugin().identity())
            .part("cpu", self.cpu.as_bytes())
            .finish();
        let t1 = Instant::now();
        let (exe, outcome) = match self.cache.get(&key) {
            Some(exe) => (exe, CacheOutcome::Memory),
            None => {
                let exe = self.client.compile(&lowered.mlir, &options)?;
                (self.cache.insert(key, exe), CacheOutcome::Miss)
            }
        };
        let compile_seconds = t1.elapsed().as_secs_f64();
        tracing::debug!(key = %key, ?outcome, lower_seconds, compile_seconds, "compiled graph");
        Ok(Compiled {
            exe,
            lowered,
            key,
            outcome,
            lower_seconds,
            compile_seconds,
            specialized,
        })
    }

    /// Uploads host memory to device 0. On the CPU plugin the buffer aliases the memory, which
    /// must then stay alive and unchanged while the buffer lives.
    ///
    /// # Safety
    /// `a.ptr` must point to `a.nbytes` readable bytes, alive as long as the buffer on the CPU
    /// plugin.
    pub unsafe fn upload(&self, a: &HostArray) -> Result<Buffer, PjrtError> {
        let semantics = if self.host_zero_copy {
            HostBufferSemantics::ImmutableZeroCopy
        } else {
            HostBufferSemantics::ImmutableOnlyDuringCall
        };
        // SAFETY: forwarded from the caller.
        unsafe {
            self.client.buffer_from_host(
                a.ptr as *const u8,
                a.nbytes,
                element_type(a.dtype),
                &a.shape,
                semantics,
                0,
            )
        }
    }

    /// Runs `compiled` and writes each output into the host memory given in `outputs`.
    ///
    /// # Safety
    /// Every host pointer must be valid for its byte length for the whole call; outputs must be
    /// writable and not alias inputs.
    pub unsafe fn run(
        &self,
        compiled: &Compiled,
        args: &[RunArg],
        outputs: &[HostArray],
    ) -> Result<(), CompileError> {
        let sig = &compiled.lowered;
        if args.len() != sig.inputs.len() || outputs.len() != sig.outputs.len() {
            return Err(CompileError::Run(format!(
                "executable takes {} inputs and {} outputs, got {} and {}",
                sig.inputs.len(),
                sig.outputs.len(),
                args.len(),
                outputs.len()
            )));
        }
        let mut owned: Vec<Buffer> = Vec::new();
        let mut order: Vec<Option<usize>> = Vec::with_capacity(args.len());
        for (i, a) in args.iter().enumerate() {
            match a {
                RunArg::Host(h) => {
                    let (shape, dtype) = &sig.inputs[i];
                    if &h.shape != shape || h.dtype != *dtype {
                        return Err(CompileError::Run(format!(
                            "input {i}: executable expects {dtype}{shape:?}, got {}{:?}",
                            h.dtype, h.shape
                        )));
                    }
                    // SAFETY: forwarded from the caller; the buffer is dropped before return.
                    owned.push(unsafe { self.upload(h)? });
                    order.push(Some(owned.len() - 1));
                }
                RunArg::Device(_) => order.push(None),
            }
        }
        let refs: Vec<&Buffer> = args
            .iter()
            .zip(&order)
            .map(|(a, o)| match (a, o) {
                (RunArg::Device(b), _) => *b,
                (RunArg::Host(_), Some(k)) => &owned[*k],
                (RunArg::Host(_), None) => unreachable!("every host arg was uploaded"),
            })
            .collect();
        let results = compiled.exe.execute(&refs)?;
        if results.len() != outputs.len() {
            return Err(CompileError::Run(format!(
                "executable returned {} outputs, expected {}",
                results.len(),
                outputs.len()
            )));
        }
        for (buf, out) in results.iter().zip(outputs) {
            // SAFETY: forwarded from the caller.
            unsafe { buf.to_host(out.ptr as *mut u8, out.nbytes)? };
        }
        Ok(())
    }
}
