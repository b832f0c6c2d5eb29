//! Compiling for devices this machine does not have: a plugin's `PJRT_TopologyDescription`
//! (libtpu: a TPU slice such as `v5e:2x2`) and `PJRT_Compile` against it, with no client.
//! The result is a [`TopologyExecutable`]: it cannot run here, but it serializes (for a host
//! with the devices to load) and reports its memory per device and cost.

use std::ffi::c_char;
use std::ptr;

use super::analysis::{self, MemoryStats};
use super::api::{copy_str, mlir_program, pjrt_call, Api, Args};
use super::executable::{serialize_raw, CompileOptions};
use super::named_values::{named_values, OptionValue};
use super::plugin::Plugin;
use super::{sys, PjrtError};

/// One device of a topology, as its description gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub id: i32,
    /// The plugin's name for the device, e.g. "TPU v5 lite".
    pub kind: String,
}

/// A plugin's description of a set of devices, made without the devices.
pub struct Topology {
    plugin: &'static Plugin,
    raw: *mut sys::PJRT_TopologyDescription,
    name: String,
}

// SAFETY: a topology description is immutable after creation and the PJRT C API is
// thread-safe; the handle is only passed to PJRT.
unsafe impl Send for Topology {}
// SAFETY: see `Send`.
unsafe impl Sync for Topology {}

impl Drop for Topology {
    fn drop(&mut self) {
        let mut args = sys::PJRT_TopologyDescription_Destroy_Args::new();
        args.topology = self.raw;
        // SAFETY: the topology is live and not used after this.
        let destroyed =
            unsafe { pjrt_call!(self.api(), PJRT_TopologyDescription_Destroy, &mut args) };
        if let Err(e) = destroyed {
            tracing::warn!("{e}");
        }
    }
}

impl std::fmt::Debug for Topology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Topology")
            .field("plugin", &self.plugin.path())
            .field("name", &self.name)
            .finish()
    }
}

impl Topology {
    /// `PJRT_TopologyDescription_Create` of `plugin` for `name` (libtpu: `v5e:2x2`, `v4:2x2x1`,
    /// ...), with the plugin's own `options`.
    pub fn new(
        plugin: &'static Plugin,
        name: &str,
        options: &[(String, OptionValue)],
    ) -> Result<Topology, PjrtError> {
        let _span = tracing::debug_span!("pjrt_topology", name).entered();
        let values = named_values(options);
        let mut args = sys::PJRT_TopologyDescription_Create_Args::new();
        args.topology_name = name.as_ptr().cast::<c_char>();
        args.topology_name_size = name.len();
        args.create_options = values.as_ptr();
        args.num_options = values.len();
        // SAFETY: the name, `values` and the strings and lists they point into outlive the call,
        // which only reads them.
        unsafe { pjrt_call!(&plugin.api, PJRT_TopologyDescription_Create, &mut args) }?;
        if args.topology.is_null() {
            return Err(PjrtError::Other(format!(
                "PJRT_TopologyDescription_Create returned no topology for {name:?}"
            )));
        }
        Ok(Topology {
            plugin,
            raw: args.topology,
            name: name.to_string(),
        })
    }

    fn api(&self) -> &'static Api {
        &self.plugin.api
    }

    pub fn plugin(&self) -> &'static Plugin {
        self.plugin
    }

    /// The name it was created for.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Platform name, e.g. "tpu".
    pub fn platform_name(&self) -> Result<String, PjrtError> {
        let mut args = sys::PJRT_TopologyDescription_PlatformName_Args::new();
        args.topology = self.raw;
        // SAFETY: the topology is live; the name it owns is copied before `self` can go away.
        unsafe {
            pjrt_call!(self.api(), PJRT_TopologyDescription_PlatformName, &mut args)?;
            Ok(copy_str(args.platform_name, args.platform_name_size))
        }
    }

    /// Platform version (libtpu's build).
    pub fn platform_version(&self) -> Result<String, PjrtError> {
        let mut args = sys::PJRT_TopologyDescription_PlatformVersion_Args::new();
        args.topology = self.raw;
        // SAFETY: as in `platform_name`.
        unsafe {
            pjrt_call!(
                self.api(),
                PJRT_TopologyDescription_PlatformVersion,
                &mut args
            )?;
            Ok(copy_str(args.platform_version, args.platform_version_size))
        }
    }

    /// Every device of the topology, ordered by id.
    pub fn devices(&self) -> Result<Vec<DeviceInfo>, PjrtError> {
        let mut args = sys::PJRT_TopologyDescription_GetDeviceDescriptions_Args::new();
        args.topology = self.raw;
        // SAFETY: the topology is live; the descriptions it owns live as long as it does.
        unsafe {
            pjrt_call!(
                self.api(),
                PJRT_TopologyDescription_GetDeviceDescriptions,
                &mut args
            )
        }?;
        let descriptions = if args.descriptions.is_null() {
            &[][..]
        } else {
            // SAFETY: the plugin returned that many description handles, owned by the topology.
            unsafe { std::slice::from_raw_parts(args.descriptions, args.num_descriptions) }
        };
        let mut devices = descriptions
            .iter()
            // SAFETY: each handle is a live description of this topology.
            .map(|&d| unsafe { describe(self.api(), d) })
            .collect::<Result<Vec<_>, _>>()?;
        devices.sort_by_key(|d| d.id);
        Ok(devices)
    }

    /// Compiles a StableHLO module (bytecode or text) for this topology's devices: the
    /// partitions of an SPMD module go to `options.partition_devices` (set them: there is no
    /// client to pick).
    pub fn compile(
        &self,
        module: &[u8],
        options: &CompileOptions,
    ) -> Result<TopologyExecutable, PjrtError> {
        let _span =
            tracing::debug_span!("pjrt_compile_for_topology", bytes = module.len()).entered();
        let program = mlir_program(module);
        let encoded = options.encode();
        let mut args = sys::PJRT_Compile_Args::new();
        args.topology = self.raw;
        args.program = &program;
        args.compile_options = encoded.as_ptr().cast::<c_char>();
        args.compile_options_size = encoded.len();
        args.client = ptr::null_mut();
        // SAFETY: the topology is live; `program`, the module and `encoded` outlive the call,
        // which only reads them.
        unsafe { pjrt_call!(self.api(), PJRT_Compile, &mut args) }?;
        if args.executable.is_null() {
            return Err(PjrtError::Other(
                "PJRT_Compile returned no executable".into(),
            ));
        }
        Ok(TopologyExecutable {
            api: self.api(),
            raw: args.executable,
        })
    }
}

/// Id and kind of a device description.
///
/// # Safety
/// `d` must be a live `PJRT_DeviceDescription` of the plugin whose table `api` is.
pub(crate) unsafe fn describe(
    api: &Api,
    d: *mut sys::PJRT_DeviceDescription,
) -> Result<DeviceInfo, PjrtError> {
    let mut id = sys::PJRT_DeviceDescription_Id_Args::new();
    id.device_description = d;
    // SAFETY: `d` is live (the caller's contract).
    unsafe { pjrt_call!(api, PJRT_DeviceDescription_Id, &mut id) }?;
    let mut kind = sys::PJRT_DeviceDescription_Kind_Args::new();
    kind.device_description = d;
    // SAFETY: as above; the kind string is owned by `d` and copied at once.
    unsafe { pjrt_call!(api, PJRT_DeviceDescription_Kind, &mut kind) }?;
    Ok(DeviceInfo {
        id: id.id,
        // SAFETY: `device_kind` points to `device_kind_size` bytes owned by `d`.
        kind: unsafe { copy_str(kind.device_kind, kind.device_kind_size) },
    })
}

/// A program compiled for a [`Topology`]: not loaded on any device. Destroyed on drop.
pub struct TopologyExecutable {
    api: &'static Api,
    raw: *mut sys::PJRT_Executable,
}

// SAFETY: an unloaded executable is immutable and the PJRT C API is thread-safe; the handle is
// only passed to PJRT.
unsafe impl Send for TopologyExecutable {}
// SAFETY: see `Send`.
unsafe impl Sync for TopologyExecutable {}

impl Drop for TopologyExecutable {
    fn drop(&mut self) {
        let mut args = sys::PJRT_Executable_Destroy_Args::new();
        args.executable = self.raw;
        // SAFETY: the executable is live and not used after this.
        if let Err(e) = unsafe { pjrt_call!(self.api, PJRT_Executable_Destroy, &mut args) } {
            tracing::warn!("{e}");
        }
    }
}

impl TopologyExecutable {
    /// The bytes a host with the devices loads (`PJRT_Executable_DeserializeAndLoad`, through
    /// [`crate::Client::deserialize`]) with the same plugin build.
    pub fn serialize(&self) -> Result<Vec<u8>, PjrtError> {
        // SAFETY: the executable is live and belongs to `api`'s plugin.
        unsafe { serialize_raw(self.api, self.raw) }
    }

    /// Memory per device, as the compiler planned it.
    pub fn memory_stats(&self) -> Result<MemoryStats, PjrtError> {
        // SAFETY: as in `serialize`.
        unsafe { analysis::memory_stats(self.api, self.raw) }
    }

    /// The compiler's cost analysis (flops, bytes accessed, ...).
    pub fn cost_analysis(&self) -> Result<Vec<(String, f64)>, PjrtError> {
        // SAFETY: as in `serialize`.
        unsafe { analysis::cost_analysis(self.api, self.raw) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// libtpu from the workspace venv (`scripts/setup.sh` installs it), if present.
    pub(crate) fn libtpu() -> Option<&'static Plugin> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent()?;
        let lib = std::fs::read_dir(root.join(".venv/lib"))
            .ok()?
            .flatten()
            .map(|e| e.path().join("site-packages/libtpu/libtpu.so"))
            .find(|p| p.is_file());
        let Some(lib) = lib else {
            eprintln!("skipped: libtpu is not installed (scripts/setup.sh installs it)");
            return None;
        };
        // Without it libtpu waits minutes for a cloud metadata server.
        std::env::set_var("TPU_SKIP_MDS_QUERY", "1");
        Some(crate::load_plugin(&lib).expect("load libtpu"))
    }

    const SCALE: &str = r#"
module {
  func.func @main(%a: tensor<128x256xf32>, %b: tensor<256x64xf32>) -> tensor<128x64xf32> {
    %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<128x256xf32>, tensor<256x64xf32>) -> tensor<128x64xf32>
    return %0 : tensor<128x64xf32>
  }
}
"#;

    #[test]
    fn a_tpu_slice_compiles_without_a_tpu() {
        let Some(plugin) = libtpu() else { return };
        let topo = Topology::new(plugin, "v5e:2x2", &[]).expect("topology");
        assert_eq!(topo.platform_name().unwrap(), "tpu");
        let devices = topo.devices().unwrap();
        assert_eq!(devices.len(), 4, "{devices:?}");
        assert!(devices[0].kind.to_lowercase().contains("v5"), "{devices:?}");
        let options = CompileOptions {
            partition_devices: vec![devices[0].id as i64],
            ..CompileOptions::default()
        };
        let exe = topo.compile(SCALE.as_bytes(), &options).expect("compile");
        let mem = exe.memory_stats().unwrap();
        // Two f32 arguments of 128x256 and 256x64, one 128x64 output.
        assert_eq!(mem.arguments, 4 * (128 * 256 + 256 * 64), "{mem:?}");
        assert_eq!(mem.outputs, 4 * 128 * 64, "{mem:?}");
        let cost = exe.cost_analysis().unwrap();
        let flops = cost.iter().find(|(k, _)| k == "flops").map(|c| c.1);
        assert_eq!(flops, Some(2.0 * 128.0 * 256.0 * 64.0), "{cost:?}");
        let bytes = exe.serialize().unwrap();
        assert!(bytes.len() > 1000, "{}", bytes.len());
        eprintln!(
            "version {:?} devices {devices:?} mem {mem:?} cost {cost:?}",
            topo.platform_version()
        );
    }
}
