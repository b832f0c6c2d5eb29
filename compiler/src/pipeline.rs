//! The compile pipeline: symbolic IR -> specialize -> lower -> cache lookup -> PJRT compile.
//! Running the result (uploads, execution, fetching outputs) is the runtime's
//! ([`tpuc_runtime::Runner`]), on the signature each [`Compiled`] carries.

use crate::executable_store::ExecutableStore;
pub use crate::executable_store::{CacheOutcome, DiskCacheOptions};
use crate::host_kernels::HostKernels;
use crate::lower::{self, LowerError, LowerOptions, Lowered, Precision};
use rayon::prelude::*;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tpuc_cache::{host_cpu_fingerprint, CacheError, CacheKey, DiskCache, KeyBuilder};
use tpuc_frontend_fx::{DType, Graph};
use tpuc_passes::sharding::{ShardingError, ShardingRequest};
use tpuc_passes::SpecializeError;
use tpuc_runtime::runner::ArrayType;
use tpuc_runtime::{
    self as pjrt, Client, CompileOptions, ElementType, LoadedExecutable, PjrtError, Plugin,
    Signature, XlaOption,
};

#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error(transparent)]
    Lower(#[from] LowerError),
    #[error(transparent)]
    Pjrt(#[from] PjrtError),
    #[error(transparent)]
    Specialize(#[from] SpecializeError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("sharding: {0}")]
    Sharding(#[from] ShardingError),
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
        DType::Uint64 => ElementType::U64,
        DType::Bool => ElementType::Pred,
        DType::Complex64 => ElementType::C64,
        DType::Complex128 => ElementType::C128,
    }
}

/// One PJRT client with its executable cache. One engine per plugin (and device count) per
/// process.
pub struct Engine {
    client: Client,
    /// Executables by cache key, in memory and in the disk caches.
    executables: ExecutableStore,
    platform: String,
    /// Whether modules go to the plugin as MLIR text instead of bytecode (see
    /// [`Engine::compile_module`]).
    text_modules: std::sync::atomic::AtomicBool,
    /// The StableHLO versions the plugin reports (`[major, minor, patch]`), if it does.
    stablehlo_versions: Option<(Vec<i64>, Vec<i64>)>,
    /// What its executables are specific to besides the plugin (see [`machine_key_part`]).
    machine: (&'static str, String),
    /// Ids of every device of the client, in order.
    device_ids: Vec<i64>,
    /// `XLA_FLAGS` when the plugin was loaded: XLA reads them once per process, and they change
    /// the code it emits (fast math, library fusions), so they are part of every cache key.
    xla_flags: String,
    /// Which ops go to the CPU host kernels (see [`Engine::enable_host_gemm`],
    /// [`Engine::enable_host_conv`], [`Engine::enable_host_rows`]).
    host_kernels: HostKernels,
    /// The device kind modules are lowered for: the platform's, unless
    /// [`Engine::lower_for_device`] chose another.
    lowering_device: lower::Device,
    /// ATen ops lowered with tpuc's own math (see [`LowerOptions::own_math`]), once
    /// [`Engine::set_own_math`] named them.
    own_math: Mutex<Arc<std::collections::BTreeSet<String>>>,
}

/// The oldest StableHLO (as a plugin reports its current version) that tpuc's bytecode was
/// verified against: xla-cpu-pjrt 0.0.1 (1.13.3). Older plugins get text, which MLIR reads
/// across versions where bytecode is versioned.
const BYTECODE_TESTED_FROM: [i64; 3] = [1, 13, 0];

/// What executables compiled here are specific to besides the plugin build: the host CPU's
/// features for the CPU plugin (its code uses them), the devices' kind and count for any other
/// (a TPU program is for one chip generation and slice, whatever CPU compiled it). A target's
/// compile ([`crate::target`]) and a client on those devices compute the same value, so that a
/// host with the devices finds what was compiled for it elsewhere.
pub(crate) fn machine_key_part(
    platform: &str,
    devices: &[pjrt::DeviceInfo],
) -> (&'static str, String) {
    if platform == "cpu" {
        return ("cpu", host_cpu_fingerprint());
    }
    let kind = devices.first().map_or("", |d| d.kind.as_str());
    ("devices", format!("{platform}|{kind}|{}", devices.len()))
}

/// The cache key of one executable: the module, how it was compiled, by which plugin build,
/// for which machine (see [`machine_key_part`]), under which `XLA_FLAGS`.
pub(crate) fn executable_key(
    lowered: &Lowered,
    options: &CompileOptions,
    unpartitioned: bool,
    plugin: &Plugin,
    machine: &(&'static str, String),
    xla_flags: &str,
) -> CacheKey {
    KeyBuilder::new()
        .part("module", lowered.key_module())
        .part("compile_options", &options.encode())
        .part("unpartitioned", &[u8::from(unpartitioned)])
        .part("plugin", &plugin.identity())
        .part(machine.0, machine.1.as_bytes())
        .part("xla_flags", xla_flags.as_bytes())
        .finish()
}

/// A graph made ready to compile: specialized to static sizes, laid out over a mesh when
/// asked, and lowered.
pub(crate) struct Prepared {
    pub(crate) specialized: Arc<Graph>,
    pub(crate) lowered: Lowered,
    pub(crate) options: CompileOptions,
    pub(crate) lower_seconds: f64,
}

/// What an engine and a target's compile share before the compiler: `lower_options` is given
/// the sharding plan (if any) and returns the options to lower with; `devices` is how many
/// devices a mesh may use, `platform` names them in errors. On a TPU the partitions go to the
/// first of `device_ids` (every device's id, in order), spelled out in the compile options: a
/// target's compile has no client to pick them, and an engine on the TPUs spells them the same
/// way, so that both compute one cache key.
pub(crate) fn prepare(
    graph: &Arc<Graph>,
    bindings: &HashMap<String, i64>,
    sharding: Option<&ShardingRequest>,
    devices: usize,
    device_ids: &[i64],
    platform: &str,
    lower_options: impl FnOnce(Option<tpuc_passes::sharding::ShardingPlan>) -> LowerOptions,
) -> Result<Prepared, CompileError> {
    let t0 = Instant::now();
    let specialized = match tpuc_passes::specialize(graph, bindings)? {
        Cow::Borrowed(_) => graph.clone(),
        Cow::Owned(g) => Arc::new(g),
    };
    let plan = match sharding {
        Some(req) => {
            if req.mesh.size() as usize > devices {
                return Err(ShardingError(format!(
                    "mesh {:?} ({:?}) needs {} devices; the {platform} plugin has {devices} \
                     (on the CPU plugin set TPUC_CPU_DEVICES)",
                    req.mesh.shape,
                    req.mesh.axes,
                    req.mesh.size(),
                ))
                .into());
            }
            Some(tpuc_passes::sharding::shard(&specialized, req)?)
        }
        None => None,
    };
    let mut options = CompileOptions::default();
    if let Some(p) = &plan {
        options.num_partitions = p.mesh.size();
        options.use_spmd_partitioning = true;
    }
    if platform == "tpu" {
        options.partition_devices = device_ids[..options.num_partitions as usize].to_vec();
    }
    if platform == "cpu" {
        options.xla_options = cpu_xla_options();
    }
    let lowered = lower::lower(&specialized, &lower_options(plan))?;
    Ok(Prepared {
        specialized,
        lowered,
        options,
        lower_seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Which kinds of XLA:CPU's YNNPACK fusions (`ynn_fusion`: dots and reductions by default) the
/// CPU plugin's compiles make: None keeps XLA's default, else the value of
/// [`YNN_FUSION_TYPES`] ("" for none, or `xla.DebugOptions.LibraryFusionType` names joined by
/// commas); [`set_cpu_ynn_fusion_types`] changes it. Without reduction fusions a reduction
/// takes its producer into a loop fusion instead of reading a broadcast XLA wrote out for it;
/// measured side by side (bench/results/cpu-options.md) that was slower on most cases, ResNet-50's
/// training step included, so XLA's default stays.
const CPU_YNN_FUSION_TYPES: Option<&str> = None;

/// The `xla.DebugOptions` field that lists the kinds of YNNPACK fusions.
const YNN_FUSION_TYPES: &str = "xla_cpu_experimental_ynn_fusion_type";

static CPU_YNN_FUSION_TYPES_NOW: std::sync::LazyLock<Mutex<Option<String>>> =
    std::sync::LazyLock::new(|| Mutex::new(CPU_YNN_FUSION_TYPES.map(str::to_string)));

/// Test and benchmark hook: [`CPU_YNN_FUSION_TYPES`] for later compiles in this process
/// (None: XLA's default); returns the previous value. Part of each executable's compile
/// options, so of its cache key.
pub fn set_cpu_ynn_fusion_types(types: Option<String>) -> Option<String> {
    std::mem::replace(&mut CPU_YNN_FUSION_TYPES_NOW.lock().unwrap(), types)
}

/// The XLA debug options of a compile for the CPU plugin (see [`CompileOptions::xla_options`]),
/// read at each compile so that one process can compare settings.
fn cpu_xla_options() -> BTreeMap<String, XlaOption> {
    let types = CPU_YNN_FUSION_TYPES_NOW.lock().unwrap().clone();
    types
        .map(|t| (YNN_FUSION_TYPES.to_string(), XlaOption::Str(t)))
        .into_iter()
        .collect()
}

/// A compiled, ready-to-run graph for one static shape.
pub struct Compiled {
    pub exe: Arc<LoadedExecutable>,
    pub lowered: Lowered,
    pub key: CacheKey,
    pub outcome: CacheOutcome,
    pub lower_seconds: f64,
    pub compile_seconds: f64,
    /// Whether its loop fusions were compiled unpartitioned (see [`runs_unpartitioned`]).
    pub unpartitioned: bool,
    /// The graph as lowered: the caller's own where it was static already.
    pub specialized: Arc<Graph>,
    /// What the executable takes and returns, as the runtime runs it.
    pub signature: Signature,
}

impl Compiled {
    /// How many devices a sharded executable runs on, and per input the type of one device's
    /// piece; None where it is not sharded.
    pub fn shards(&self) -> Option<(usize, Vec<ArrayType>)> {
        let plan = self.lowered.sharding.as_ref()?;
        let pieces = self
            .lowered
            .inputs
            .iter()
            .zip(&plan.inputs)
            .map(|((shape, dtype), spec)| {
                (spec.shard_shape(shape, &plan.mesh), element_type(*dtype))
            })
            .collect();
        Some((plan.mesh.size() as usize, pieces))
    }
}

/// The runtime's signature of a lowered module.
fn signature(lowered: &Lowered) -> Signature {
    let types = |ts: &[(Vec<i64>, DType)]| {
        ts.iter()
            .map(|(shape, dtype)| (shape.clone(), element_type(*dtype)))
            .collect()
    };
    Signature {
        inputs: types(&lowered.inputs),
        outputs: types(&lowered.outputs),
        aliased_inputs: lowered.aliases.iter().map(|(arg, _)| *arg).collect(),
    }
}

/// Whether a compile error says the plugin could not read the module's bytecode (rather than
/// rejecting what it says).
fn reads_as_bytecode_rejection(message: &str) -> bool {
    let m = message.to_lowercase();
    m.contains("bytecode") && (m.contains("version") || m.contains("parse") || m.contains("read"))
}

/// Largest tensor (elements) of a graph with convolutions compiled for the CPU plugin with its
/// loop fusions run on the calling thread, unpartitioned ([`set_unpartitioned_max`] changes it;
/// 0: none). Below it XLA's partitions of a fusion each take microseconds, which the hand-offs to
/// its thread pool (and that pool spinning after) cost more than the second core gives; above
/// it, as in ResNet-50 (800k-element activations at batch 1), partitions win or tie.
const UNPARTITIONED_MAX_ELEMENTS: i64 = 1 << 18;

/// A graph without convolutions runs unpartitioned while its largest loop result (a tensor XLA
/// may compute in a partitioned loop fusion: not an input, a view or a product) has at most this
/// many times [`UNPARTITIONED_MAX_ELEMENTS`] elements. There the products (host BLAS, on tpuc's
/// own threads) take most of the time, and each partitioned fusion between them costs a wake of
/// XLA's pool and leaves that pool spinning on the core the next product's pieces need.
/// Measured in one process against the partitioned build (tpuc/Inductor, 6-20 shuffled
/// rounds): GPT-2 1x128 1.096 -> 1.044x, BERT 8x128 1.083 -> 1.041x (with eager in the rounds
/// 1.123 -> 1.080x), GPT-2 8x128 1.061 -> 1.042x, GPT-2 training step 0.975 -> 0.926x, Llama
/// generation 0.988 -> 0.972x. Graphs with convolutions keep the bound above: ResNet-50 b8,
/// whose batch-norm and ReLU loops cover 6.4M elements each, got slower unpartitioned (0.972 ->
/// 1.038x, training 1.028 -> 1.121x), and ViT-B/16 (one patch convolution) measured both ways
/// from run to run (batch 1: 0.952 -> 0.886x in 12 rounds, 0.929 -> 1.009x in 30; in
/// `bench_real.py` 0.88x partitioned, 1.03-1.05x unpartitioned).
const UNPARTITIONED_CONV_FREE_FACTOR: i64 = 32;

static UNPARTITIONED_MAX: std::sync::atomic::AtomicI64 =
    std::sync::atomic::AtomicI64::new(UNPARTITIONED_MAX_ELEMENTS);

/// Test and benchmark hook: the bound of [`UNPARTITIONED_MAX_ELEMENTS`] for later compiles in
/// this process (0: every graph keeps XLA's partitions); returns the previous one.
pub fn set_unpartitioned_max(elements: i64) -> i64 {
    UNPARTITIONED_MAX.swap(elements, std::sync::atomic::Ordering::Relaxed)
}

/// Whether XLA's CPU compiler should see one CPU while it compiles `g` (see the two bounds
/// above).
fn runs_unpartitioned(g: &Graph) -> bool {
    // Read at each compile, so one process can compare both ways.
    let max = UNPARTITIONED_MAX.load(std::sync::atomic::Ordering::Relaxed);
    if max <= 0 {
        return false;
    }
    let largest = |nodes: &mut dyn Iterator<Item = &tpuc_frontend_fx::Node>| {
        nodes
            .flat_map(|n| n.results.iter().flatten())
            .map(|t| t.static_shape().map_or(i64::MAX, |s| s.iter().product()))
            .max()
            .unwrap_or(0)
    };
    if largest(&mut g.dag.node_weights()) <= max {
        return true;
    }
    let has_convolution = g
        .dag
        .node_weights()
        .any(|n| n.op.starts_with("aten.convolution"));
    !has_convolution
        && largest(&mut g.dag.node_weights().filter(|n| is_loop_op(&n.op)))
            <= max.saturating_mul(UNPARTITIONED_CONV_FREE_FACTOR)
}

/// Whether XLA may compute `op`'s results in a loop fusion: not a graph input, a view (a
/// bitcast, or fused into its reader) or a product (threaded by its library).
fn is_loop_op(op: &str) -> bool {
    const NOT_LOOPS: [&str; 23] = [
        "input",
        "aten.view.",
        "aten._unsafe_view.",
        "aten.reshape.",
        "aten.alias.",
        "aten.t.",
        "aten.transpose.",
        "aten.permute.",
        "aten.expand.",
        "aten.slice.",
        "aten.select.",
        "aten.squeeze.",
        "aten.unsqueeze.",
        "aten.split",
        "aten.unbind.",
        "aten.detach.",
        "aten.mm.",
        "aten.addmm.",
        "aten.bmm.",
        "aten.baddbmm.",
        "aten._scaled_dot_product",
        "aten.convolution",
        "aten.as_strided.",
    ];
    !NOT_LOOPS.iter().any(|p| op.starts_with(p))
}

/// Bytes of a dense array of `shape` and `dtype` (shapes of lowered signatures are valid).
pub fn dense_bytes(shape: &[i64], dtype: DType) -> usize {
    shape
        .iter()
        .map(|&d| usize::try_from(d).unwrap_or(0))
        .product::<usize>()
        * dtype.byte_size()
}

impl Engine {
    /// Loads the plugin (once per process) and creates a client with `options` (see
    /// [`pjrt::OptionValue`]: each plugin family takes its own).
    pub fn new(
        plugin_path: &Path,
        options: &[(String, pjrt::OptionValue)],
    ) -> Result<Engine, PjrtError> {
        let plugin: &'static Plugin = pjrt::load_plugin(plugin_path)?;
        let client = Client::new(plugin, options)?;
        let platform = client.platform_name()?.to_lowercase();
        let stablehlo_versions = plugin.stablehlo_versions();
        let devices = if platform == "cpu" {
            Vec::new()
        } else {
            client.devices()?
        };
        let machine = machine_key_part(&platform, &devices);
        if let Some(ms) = tpuc_runtime::env::debug_count("cache_write_pause_ms") {
            tpuc_cache::set_write_pause(std::time::Duration::from_millis(ms));
        }
        let text = match tpuc_runtime::env::debug_choice("module_format") {
            Some("text") => true,
            Some("bytecode") => false,
            _ => stablehlo_versions
                .as_ref()
                .is_some_and(|(current, _)| current.as_slice() < BYTECODE_TESTED_FROM.as_slice()),
        };
        Ok(Engine {
            text_modules: std::sync::atomic::AtomicBool::new(text),
            stablehlo_versions,
            client,
            executables: ExecutableStore::default(),
            machine,
            device_ids: devices.iter().map(|d| i64::from(d.id)).collect(),
            xla_flags: std::env::var("XLA_FLAGS").unwrap_or_default(),
            host_kernels: HostKernels::new(plugin, platform == "cpu"),
            lowering_device: lower::Device::of_platform(&platform),
            platform,
            own_math: Mutex::default(),
        })
    }

    /// Lowers modules for `device` instead of this engine's platform: what a GPU or TPU is
    /// given, run on this plugin (the CPU plugin compiles the accelerators' forms too), so that
    /// those forms are checked numerically on a machine without the device.
    pub fn lower_for_device(mut self, device: lower::Device) -> Engine {
        self.lowering_device = device;
        self
    }

    /// Lowers f32 products of at least `min_macs` multiply-adds to calls of the `sgemm_` in
    /// `library` (a BLAS the process has already loaded: PyTorch's) from now on, registering it
    /// with the plugin first; 0 turns it off. Only on the CPU plugin, whose buffers are host
    /// memory. Returns whether products can go there (false: no such symbol, or a plugin
    /// without the PJRT FFI extension).
    pub fn enable_host_gemm(&self, library: &Path, min_macs: u64) -> Result<bool, PjrtError> {
        self.host_kernels.enable_gemm(library, min_macs)
    }

    /// The fewest multiply-adds an f32 product has to go to the host BLAS; None when products
    /// stay in XLA (see [`Engine::enable_host_gemm`]).
    pub fn host_gemm_min_macs(&self) -> Option<u64> {
        self.host_kernels.gemm_min_macs()
    }

    /// Lowers 2-D f32 convolutions to calls of oneDNN (`library`, loaded once per process) from
    /// now on, registering them with the plugin first; `library` None turns it off. Only on the
    /// CPU plugin. Returns whether convolutions go there (false: no usable oneDNN, or a plugin
    /// without the PJRT FFI extension).
    pub fn enable_host_conv(&self, library: Option<&str>) -> Result<bool, PjrtError> {
        self.host_kernels.enable_conv(library)
    }

    /// Whether 2-D f32 convolutions go to oneDNN (see [`Engine::enable_host_conv`]).
    pub fn host_conv(&self) -> bool {
        self.host_kernels.conv()
    }

    /// Lowers large f32 layer norms to the host row kernels (`tpuc_hostkernels::host_rows`)
    /// from now on, registering them with the plugin first; false turns it off. Only on the CPU
    /// plugin. Returns whether they go there (false: a plugin without the PJRT FFI extension).
    pub fn enable_host_rows(&self, on: bool) -> Result<bool, PjrtError> {
        self.host_kernels.enable_rows(on)
    }

    /// Whether large f32 layer norms go to the host row kernels (see
    /// [`Engine::enable_host_rows`]).
    pub fn host_rows(&self) -> bool {
        self.host_kernels.rows()
    }

    /// What a compiled program's numbers depend on besides the module: the plugin's identity
    /// (hash of the library), the host CPU's features and `XLA_FLAGS`, as the cache key has them.
    /// The known-answer check's result is kept under this.
    pub fn numerics_identity(&self) -> (String, String, String) {
        let id: String = self
            .client
            .plugin()
            .identity()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        (id, self.machine.1.clone(), self.xla_flags.clone())
    }

    /// From now on, lowers the math primitives of these ATen ops (`aten.exp.default`) to tpuc's
    /// own expansions (the ops the known-answer check found wrong on this plugin).
    pub fn set_own_math(&self, ops: impl IntoIterator<Item = String>) {
        *self.own_math.lock().unwrap_or_else(|e| e.into_inner()) =
            Arc::new(ops.into_iter().collect());
    }

    /// The ATen ops lowered with tpuc's own math (see [`Engine::set_own_math`]).
    pub fn own_math(&self) -> Arc<std::collections::BTreeSet<String>> {
        self.own_math
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether the fused CPU attention of an unsharded graph goes to the host kernel (the rule
    /// of [`LowerOptions::host_attention`], on this engine's settings).
    pub fn host_attention(&self) -> bool {
        self.lower_options(Precision::default(), None)
            .host_attention()
    }

    /// Lowering options: `precision` and `sharding` as given, the host kernels as enabled here.
    fn lower_options(
        &self,
        precision: Precision,
        sharding: Option<tpuc_passes::sharding::ShardingPlan>,
    ) -> LowerOptions {
        LowerOptions {
            precision,
            device: self.lowering_device,
            sharding,
            host_gemm_min_macs: self.host_gemm_min_macs(),
            host_conv: self.host_conv(),
            host_rows: self.host_rows(),
            own_math: self.own_math(),
        }
    }

    /// `(current, minimum)` StableHLO versions the plugin accepts, as it reports them.
    pub fn stablehlo_versions(&self) -> Option<&(Vec<i64>, Vec<i64>)> {
        self.stablehlo_versions.as_ref()
    }

    /// Whether modules are sent as MLIR text rather than bytecode.
    pub fn sends_text(&self) -> bool {
        self.text_modules.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Compiles `lowered` with the plugin: as MLIR bytecode, or as text for a plugin older than
    /// the bytecode was tested with (`TPUC_DEBUG=module_format=text|bytecode` decides instead). A
    /// plugin that cannot read the bytecode gets the text, from then on.
    /// `unpartitioned`: see [`runs_unpartitioned`].
    fn compile_module(
        &self,
        lowered: &Lowered,
        options: &CompileOptions,
        unpartitioned: bool,
    ) -> Result<LoadedExecutable, CompileError> {
        use std::sync::atomic::Ordering::Relaxed;
        let compile = |module: &[u8]| {
            if unpartitioned {
                self.client.compile_bytes_unpartitioned(module, options)
            } else {
                self.client.compile_bytes(module, options)
            }
        };
        if !self.text_modules.load(Relaxed) {
            match compile(&lowered.bytecode) {
                Err(e) if reads_as_bytecode_rejection(&e.to_string()) => {
                    tracing::warn!(
                        "the plugin cannot read tpuc's MLIR bytecode, sending text: {e}"
                    );
                    self.text_modules.store(true, Relaxed);
                }
                other => return Ok(other?),
            }
        }
        Ok(compile(lowered.text_with_locations()?.as_bytes())?)
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn platform(&self) -> &str {
        &self.platform
    }

    pub fn cached_executables(&self) -> usize {
        self.executables.len()
    }

    /// The disk cache for `opts`, opened on first use.
    pub fn disk_cache(
        &self,
        opts: &DiskCacheOptions,
    ) -> Result<Option<Arc<DiskCache>>, CacheError> {
        self.executables.disk(opts)
    }

    /// Specializes `graph` to the sizes in `bindings`, lowers it and compiles it, or finds the
    /// executable in memory or in the disk cache.
    pub fn compile(
        &self,
        graph: &Arc<Graph>,
        bindings: &HashMap<String, i64>,
        precision: Precision,
        disk: &DiskCacheOptions,
    ) -> Result<Compiled, CompileError> {
        self.compile_sharded(graph, bindings, precision, disk, None)
    }

    /// Like [`Engine::compile`]; with a sharding request, the sharding pass lays the graph out
    /// over the request's mesh and XLA partitions it into one program per device (SPMD).
    pub fn compile_sharded(
        &self,
        graph: &Arc<Graph>,
        bindings: &HashMap<String, i64>,
        precision: Precision,
        disk: &DiskCacheOptions,
        sharding: Option<&ShardingRequest>,
    ) -> Result<Compiled, CompileError> {
        let Prepared {
            specialized,
            lowered,
            options,
            lower_seconds,
        } = prepare(
            graph,
            bindings,
            sharding,
            self.client.addressable_device_count(),
            &self.device_ids,
            &self.platform,
            |plan| self.lower_options(precision, plan),
        )?;
        let unpartitioned = self.platform == "cpu" && runs_unpartitioned(&specialized);
        let key = executable_key(
            &lowered,
            &options,
            unpartitioned,
            self.client.plugin(),
            &self.machine,
            &self.xla_flags,
        );
        let t1 = Instant::now();
        let (exe, outcome) = self.executables.get_or_compile(
            &self.client,
            &self.platform,
            key,
            &lowered,
            disk,
            || self.compile_module(&lowered, &options, unpartitioned),
        )?;
        let compile_seconds = t1.elapsed().as_secs_f64();
        tracing::debug!(key = %key, ?outcome, lower_seconds, compile_seconds, unpartitioned, "compiled graph");
        Ok(Compiled {
            exe,
            signature: signature(&lowered),
            lowered,
            key,
            outcome,
            lower_seconds,
            compile_seconds,
            unpartitioned,
            specialized,
        })
    }

    /// Compiles one specialization per entry of `all_bindings`, in parallel (rayon), with an
    /// optional progress bar on stderr. Results come back in order.
    pub fn compile_many(
        &self,
        graph: &Arc<Graph>,
        all_bindings: &[HashMap<String, i64>],
        precision: Precision,
        disk: &DiskCacheOptions,
        progress: bool,
    ) -> Vec<Result<Compiled, CompileError>> {
        let jobs: Vec<(&Arc<Graph>, &HashMap<String, i64>)> =
            all_bindings.iter().map(|b| (graph, b)).collect();
        self.compile_jobs(&jobs, precision, disk, progress)
    }

    /// Compiles each `(graph, bindings)` job in parallel (rayon), with a progress bar on stderr
    /// when `progress`; results in job order.
    pub fn compile_jobs(
        &self,
        jobs: &[(&Arc<Graph>, &HashMap<String, i64>)],
        precision: Precision,
        disk: &DiskCacheOptions,
        progress: bool,
    ) -> Vec<Result<Compiled, CompileError>> {
        let bar = if progress {
            let bar = indicatif::ProgressBar::new(jobs.len() as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{prefix} [{bar:30}] {pos}/{len} {elapsed_precise} {msg}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar.set_prefix("tpuc: compiling");
            bar
        } else {
            indicatif::ProgressBar::hidden()
        };
        let out: Vec<_> = jobs
            .par_iter()
            .map(|(graph, b)| {
                let r = self.compile(graph, b, precision, disk);
                bar.inc(1);
                r
            })
            .collect();
        bar.finish();
        out
    }
}
