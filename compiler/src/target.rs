//! Compiling for a target: devices this machine does not have (a TPU slice, `tpu:v5e:2x2`),
//! through the plugin's compile-only topology. Graphs are lowered as for those devices (no CPU
//! host kernels), compiled with no client, and stored in the disk cache under the key that an
//! [`Engine`](crate::pipeline::Engine) on the devices computes, so that a host with them loads
//! the executable instead of compiling it. What the compiler planned (memory per device, cost)
//! is kept beside each entry: known before the devices are.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tpuc_cache::{CacheKey, DiskCache};
use tpuc_frontend_fx::Graph;
use tpuc_passes::sharding::ShardingRequest;
use tpuc_runtime::{self as pjrt, DeviceInfo, MemoryStats, PjrtError, Topology};

use crate::executable_store::{DiskCaches, EntryMeta};
use crate::lower::{self, LowerOptions, Lowered, Precision};
use crate::pipeline::{
    executable_key, machine_key_part, prepare, CacheOutcome, CompileError, DiskCacheOptions,
    Prepared,
};

/// One graph compiled for a target.
pub struct TargetCompiled {
    pub lowered: Lowered,
    pub key: CacheKey,
    /// `Miss` (compiled now) or `Disk` (found with its statistics; nothing compiled).
    pub outcome: CacheOutcome,
    pub report: TargetReport,
    pub lower_seconds: f64,
    pub compile_seconds: f64,
}

/// What the target's compiler planned for one executable, stored beside it in the cache.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TargetReport {
    /// The target's name (`tpu:v5e:2x2`).
    pub target: String,
    /// Devices the program runs on (its partitions).
    pub devices: i64,
    /// Memory per device: arguments, outputs, aliased, temporaries, code, peak (bytes).
    pub memory: [i64; 6],
    /// The compiler's cost analysis (`flops`, `bytes accessed`, `transcendentals`,
    /// `optimal_seconds`, ...), summed over what it reports per operand.
    pub cost: Vec<(String, f64)>,
    /// Seconds the target's compiler took when the entry was made.
    pub compile_seconds: f64,
}

impl TargetReport {
    pub fn memory(&self) -> MemoryStats {
        let [arguments, outputs, aliased, temporaries, code, peak] = self.memory;
        MemoryStats {
            arguments,
            outputs,
            aliased,
            temporaries,
            code,
            peak,
        }
    }
}

/// The compile-only side of one plugin's topology.
pub struct TargetEngine {
    name: String,
    topology: Topology,
    platform: String,
    devices: Vec<DeviceInfo>,
    machine: (&'static str, String),
    xla_flags: String,
    disks: DiskCaches,
}

impl TargetEngine {
    /// Loads the plugin at `plugin_path` (once per process) and describes `topology` (the
    /// plugin's own name for it, e.g. `v5e:2x2`); `name` is what tpuc calls the target.
    pub fn new(
        plugin_path: &Path,
        topology: &str,
        name: &str,
        options: &[(String, pjrt::OptionValue)],
    ) -> Result<TargetEngine, PjrtError> {
        let plugin = pjrt::load_plugin(plugin_path)?;
        let topology = Topology::new(plugin, topology, options)?;
        let platform = topology.platform_name()?.to_lowercase();
        let devices = topology.devices()?;
        Ok(TargetEngine {
            name: name.to_string(),
            machine: machine_key_part(&platform, &devices),
            platform,
            devices,
            topology,
            xla_flags: std::env::var("XLA_FLAGS").unwrap_or_default(),
            disks: DiskCaches::default(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn platform(&self) -> &str {
        &self.platform
    }

    pub fn platform_version(&self) -> Result<String, PjrtError> {
        self.topology.platform_version()
    }

    pub fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }

    /// Specializes `graph` to `bindings` and lowers it for the target's devices, without the
    /// target's compiler: what checks that every op of a graph lowers for the target in
    /// milliseconds (bench/backward_sweep.py), where XLA:TPU takes seconds per graph.
    pub fn lower(
        &self,
        graph: &Arc<Graph>,
        bindings: &HashMap<String, i64>,
        precision: Precision,
    ) -> Result<Lowered, CompileError> {
        Ok(self.prepare(graph, bindings, precision, None)?.lowered)
    }

    fn prepare(
        &self,
        graph: &Arc<Graph>,
        bindings: &HashMap<String, i64>,
        precision: Precision,
        sharding: Option<&ShardingRequest>,
    ) -> Result<Prepared, CompileError> {
        let device = lower::Device::of_platform(&self.platform);
        let device_ids: Vec<i64> = self.devices.iter().map(|d| i64::from(d.id)).collect();
        prepare(
            graph,
            bindings,
            sharding,
            self.devices.len(),
            &device_ids,
            &self.platform,
            |sharding| LowerOptions {
                precision,
                device,
                sharding,
                ..LowerOptions::default()
            },
        )
    }

    /// Specializes `graph` to `bindings`, lowers it for the target's devices and compiles it
    /// for them (over a mesh with `sharding`), or finds it in the disk cache.
    pub fn compile(
        &self,
        graph: &Arc<Graph>,
        bindings: &HashMap<String, i64>,
        precision: Precision,
        disk: &DiskCacheOptions,
        sharding: Option<&ShardingRequest>,
    ) -> Result<TargetCompiled, CompileError> {
        let Prepared {
            lowered,
            options,
            lower_seconds,
            ..
        } = self.prepare(graph, bindings, precision, sharding)?;
        let plugin = self.topology.plugin();
        let key = executable_key(
            &lowered,
            &options,
            false,
            plugin,
            &self.machine,
            &self.xla_flags,
        );
        let meta = EntryMeta::new(plugin, &self.platform, &lowered);
        let disk = self.disks.open(disk)?;
        let t = Instant::now();
        if let Some(report) = disk.as_ref().and_then(|d| load(d, &key, &meta)) {
            return Ok(TargetCompiled {
                lowered,
                key,
                outcome: CacheOutcome::Disk,
                report,
                lower_seconds,
                compile_seconds: t.elapsed().as_secs_f64(),
            });
        }
        let exe = self.topology.compile(&lowered.bytecode, &options)?;
        let compile_seconds = t.elapsed().as_secs_f64();
        let m = exe.memory_stats()?;
        let report = TargetReport {
            target: self.name.clone(),
            devices: options.num_partitions,
            memory: [
                m.arguments,
                m.outputs,
                m.aliased,
                m.temporaries,
                m.code,
                m.peak,
            ],
            cost: total_cost(exe.cost_analysis().unwrap_or_default()),
            compile_seconds,
        };
        if let Some(d) = &disk {
            let stored = exe
                .serialize()
                .map_err(|e| e.to_string())
                .and_then(|bytes| {
                    let mut stored_meta = bincode::serialize(&meta).map_err(|e| e.to_string())?;
                    // After the entry's own metadata, which an engine on the devices reads alone.
                    stored_meta.extend(bincode::serialize(&report).map_err(|e| e.to_string())?);
                    d.put(&key, &stored_meta, &bytes).map_err(|e| e.to_string())
                });
            if let Err(e) = stored {
                return Err(CompileError::Run(format!(
                    "cannot write the {} executable to the cache {}: {e}",
                    self.name,
                    d.dir().display()
                )));
            }
        }
        tracing::debug!(key = %key, target = %self.name, compile_seconds, "compiled for target");
        Ok(TargetCompiled {
            lowered,
            key,
            outcome: CacheOutcome::Miss,
            report,
            lower_seconds,
            compile_seconds,
        })
    }
}

/// The report of a verified entry for `key`, or None (absent, or made by another plugin build
/// (`expected`'s identity) or from another module: then it is recompiled and overwritten).
fn load(disk: &DiskCache, key: &CacheKey, expected: &EntryMeta) -> Option<TargetReport> {
    let entry = disk.get(key).ok()??;
    let (meta, report) = read_target_meta(&entry.meta)?;
    (meta.plugin_identity == expected.plugin_identity && meta.module_hash == expected.module_hash)
        .then_some(report?)
}

/// An entry's metadata, and the target report after it where the entry was compiled for a
/// target (None for one compiled on its devices).
pub(crate) fn read_target_meta(bytes: &[u8]) -> Option<(EntryMeta, Option<TargetReport>)> {
    let mut rest = bytes;
    let meta: EntryMeta = bincode::deserialize_from(&mut rest).ok()?;
    let report = (!rest.is_empty())
        .then(|| bincode::deserialize(rest).ok())
        .flatten();
    Some((meta, report))
}

/// What a cache entry was compiled for, from its metadata: the target's name (`tpu:v5e:2x2`)
/// or the platform it was compiled on (`cpu`); None when unreadable.
pub fn entry_target(meta: &[u8]) -> Option<String> {
    let (meta, report) = read_target_meta(meta)?;
    Some(report.map_or(meta.platform, |r| r.target))
}

/// The report stored with a cache entry compiled for a target.
pub fn entry_report(meta: &[u8]) -> Option<TargetReport> {
    read_target_meta(meta)?.1
}

/// XLA:TPU reports bytes accessed both in total and per operand (`bytes accessed0{}`,
/// `bytes accessedout{}`, ...); keep the totals.
fn total_cost(cost: Vec<(String, f64)>) -> Vec<(String, f64)> {
    cost.into_iter().filter(|(k, _)| !k.contains('{')).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executable_store::EntryMeta;

    fn meta() -> EntryMeta {
        EntryMeta {
            plugin_identity: [7; 32],
            module_hash: [9; 32],
            platform: "tpu".into(),
            tpuc_version: "0".into(),
            inputs: vec![(vec![2, 3], tpuc_frontend_fx::DType::Float32)],
            outputs: vec![],
        }
    }

    #[test]
    fn an_engine_on_the_devices_reads_a_target_entry_as_its_own() {
        // The engine's `load` reads the entry's metadata with `bincode::deserialize`, which
        // must accept the target report written after it.
        let report = TargetReport {
            target: "tpu:v5e:2x2".into(),
            devices: 4,
            memory: [10, 20, 3, 40, 50, 60],
            cost: vec![("flops".into(), 8.0)],
            compile_seconds: 1.5,
        };
        let mut bytes = bincode::serialize(&meta()).unwrap();
        bytes.extend(bincode::serialize(&report).unwrap());
        let read: EntryMeta = bincode::deserialize(&bytes).unwrap();
        assert_eq!(read.module_hash, [9; 32]);
        assert_eq!(read.platform, "tpu");
        let (_, back) = read_target_meta(&bytes).unwrap();
        let back = back.unwrap();
        assert_eq!((back.target.as_str(), back.devices), ("tpu:v5e:2x2", 4));
        // arguments + outputs - aliased + temporaries + code
        assert_eq!(back.memory().footprint(), 117);
        assert_eq!(entry_target(&bytes).as_deref(), Some("tpu:v5e:2x2"));
        // An entry compiled on its devices has no report.
        let plain = bincode::serialize(&meta()).unwrap();
        assert_eq!(entry_target(&plain).as_deref(), Some("tpu"));
        assert!(entry_report(&plain).is_none());
    }

    #[test]
    fn the_devices_not_the_host_cpu_key_a_non_cpu_executable() {
        let devices = |kind: &str, n: i32| {
            (0..n)
                .map(|id| DeviceInfo {
                    id,
                    kind: kind.into(),
                })
                .collect::<Vec<_>>()
        };
        let a = machine_key_part("tpu", &devices("TPU v5 lite", 4));
        assert_eq!(a, ("devices", "tpu|TPU v5 lite|4".to_string()));
        assert_ne!(a, machine_key_part("tpu", &devices("TPU v5 lite", 8)));
        assert_ne!(a, machine_key_part("tpu", &devices("TPU v4", 4)));
        assert_eq!(machine_key_part("cpu", &[]).0, "cpu");
    }
}
