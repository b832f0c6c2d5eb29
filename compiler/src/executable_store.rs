//! Where an engine keeps its executables: in memory by cache key, and in disk caches (one per
//! folder, opened once per process) as entries whose metadata is checked again on load.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tpuc_cache::{CacheError, CacheKey, DiskCache, ExecutableCache};
use tpuc_frontend_fx::DType;
use tpuc_runtime::{Client, LoadedExecutable, Plugin};

use crate::lower::Lowered;

/// Where a compile's executable came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    Miss,
    Memory,
    Disk,
}

/// Where and how compiled executables persist.
#[derive(Clone, Debug, Default)]
pub struct DiskCacheOptions {
    pub dir: Option<PathBuf>,
    pub max_bytes: Option<u64>,
}

/// Open disk caches by folder, each opened once per process.
#[derive(Default)]
pub(crate) struct DiskCaches(Mutex<HashMap<PathBuf, Arc<DiskCache>>>);

impl DiskCaches {
    /// The disk cache for `opts` (None without a folder), opened on first use.
    pub(crate) fn open(
        &self,
        opts: &DiskCacheOptions,
    ) -> Result<Option<Arc<DiskCache>>, CacheError> {
        let Some(dir) = &opts.dir else {
            return Ok(None);
        };
        let mut disks = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = disks.get(dir) {
            return Ok(Some(d.clone()));
        }
        let d = Arc::new(DiskCache::open(dir, opts.max_bytes)?);
        disks.insert(dir.clone(), d.clone());
        Ok(Some(d))
    }
}

/// What a disk entry records beside the executable, checked again when it is loaded.
#[derive(Serialize, Deserialize, Debug)]
pub(crate) struct EntryMeta {
    pub(crate) plugin_identity: [u8; 32],
    /// blake3 of the StableHLO module: a well-formed entry for another module is refused.
    pub(crate) module_hash: [u8; 32],
    pub(crate) platform: String,
    pub(crate) tpuc_version: String,
    pub(crate) inputs: Vec<(Vec<i64>, DType)>,
    pub(crate) outputs: Vec<(Vec<i64>, DType)>,
}

impl EntryMeta {
    pub(crate) fn new(plugin: &Plugin, platform: &str, lowered: &Lowered) -> EntryMeta {
        EntryMeta {
            plugin_identity: plugin.identity(),
            module_hash: *blake3::hash(lowered.key_module()).as_bytes(),
            platform: platform.to_string(),
            tpuc_version: env!("CARGO_PKG_VERSION").to_string(),
            inputs: lowered.inputs.clone(),
            outputs: lowered.outputs.clone(),
        }
    }
}

/// An engine's executables: compiled in this process (memory) or found in a disk cache.
#[derive(Default)]
pub(crate) struct ExecutableStore {
    memory: ExecutableCache<LoadedExecutable>,
    disks: DiskCaches,
}

impl ExecutableStore {
    /// Executables held in memory.
    pub(crate) fn len(&self) -> usize {
        self.memory.len()
    }

    /// The disk cache for `opts` (None without a folder), opened on first use.
    pub(crate) fn disk(
        &self,
        opts: &DiskCacheOptions,
    ) -> Result<Option<Arc<DiskCache>>, CacheError> {
        self.disks.open(opts)
    }

    /// The executable of `key` (the module `lowered`, compiled by `client`): from memory, else
    /// from the disk cache of `disk`, else made by `compile`, and written to that disk cache
    /// where it is missing there.
    pub(crate) fn get_or_compile<E: From<CacheError>>(
        &self,
        client: &Client,
        platform: &str,
        key: CacheKey,
        lowered: &Lowered,
        disk: &DiskCacheOptions,
        compile: impl FnOnce() -> Result<LoadedExecutable, E>,
    ) -> Result<(Arc<LoadedExecutable>, CacheOutcome), E> {
        Ok(match self.memory.get(&key) {
            Some(exe) => {
                // Compiled earlier in this process, perhaps with no disk cache or another one:
                // written to this one too, so that a process that reads it (a saved model's
                // loader, a precompiled deployment) finds it.
                if let Some(d) = self.disk(disk)? {
                    if !d.is_read_only() && !d.entry_path(&key).exists() {
                        store((client, platform), &d, &key, &exe, lowered);
                    }
                }
                (exe, CacheOutcome::Memory)
            }
            None => {
                let disk = self.disk(disk)?;
                let module_hash = *blake3::hash(lowered.key_module()).as_bytes();
                match disk
                    .as_ref()
                    .and_then(|d| load(client, d, &key, &module_hash))
                {
                    Some(exe) => (self.memory.insert(key, exe), CacheOutcome::Disk),
                    None => {
                        let exe = compile()?;
                        if let Some(d) = &disk {
                            store((client, platform), d, &key, &exe, lowered);
                        }
                        (self.memory.insert(key, exe), CacheOutcome::Miss)
                    }
                }
            }
        })
    }
}

/// A verified executable from the disk cache, or None (absent, or bad: then it is removed,
/// and a warning says why).
fn load(
    client: &Client,
    disk: &DiskCache,
    key: &CacheKey,
    module_hash: &[u8; 32],
) -> Option<LoadedExecutable> {
    let entry = match disk.get(key) {
        Ok(Some(e)) => e,
        Ok(None) => return None,
        Err(e) => {
            tracing::warn!("{e}; recompiling");
            return None;
        }
    };
    let meta: EntryMeta = match bincode::deserialize(&entry.meta) {
        Ok(m) => m,
        Err(e) => {
            reject(disk, key, &format!("unreadable metadata: {e}"));
            return None;
        }
    };
    // The key covers the plugin already; this catches a file placed under the wrong name.
    if meta.plugin_identity != client.plugin().identity() {
        reject(disk, key, "made by another PJRT plugin build");
        return None;
    }
    if &meta.module_hash != module_hash {
        reject(disk, key, "compiled from another module");
        return None;
    }
    match client.deserialize(&entry.payload) {
        Ok(exe) => Some(exe),
        Err(e) => {
            reject(disk, key, &format!("the plugin cannot load it: {e}"));
            None
        }
    }
}

fn reject(disk: &DiskCache, key: &CacheKey, why: &str) {
    let path = disk.entry_path(key);
    tracing::warn!(
        "cache entry {} rejected: {why}; recompiling",
        path.display()
    );
    if !disk.is_read_only() {
        let _ = std::fs::remove_file(path);
    }
}

/// Writes a freshly compiled executable to the disk cache; failures only warn (the
/// executable still works from memory).
fn store(
    (client, platform): (&Client, &str),
    disk: &DiskCache,
    key: &CacheKey,
    exe: &LoadedExecutable,
    lowered: &Lowered,
) {
    let meta = EntryMeta::new(client.plugin(), platform, lowered);
    let result = exe
        .serialize()
        .map_err(|e| e.to_string())
        .and_then(|bytes| {
            let meta = bincode::serialize(&meta).map_err(|e| e.to_string())?;
            disk.put(key, &meta, &bytes).map_err(|e| e.to_string())
        });
    if let Err(e) = result {
        tracing::warn!(
            "could not write cache entry {}: {e}{}",
            key.hex(),
            serialize_hint(&e)
        );
    }
}

/// What to do about a serialization failure whose cause is the user's XLA_FLAGS: XLA's CPU
/// executables serialize only with one temporary allocation, and
/// `--xla_multiheap_size_constraint_per_heap` splits temporaries above its size into several.
fn serialize_hint(error: &str) -> &'static str {
    let split = std::env::var("XLA_FLAGS")
        .is_ok_and(|flags| flags.contains("xla_multiheap_size_constraint_per_heap"));
    if split && error.contains("Multiple temp buffer allocations") {
        " (XLA_FLAGS sets --xla_multiheap_size_constraint_per_heap, which splits this \
         executable's temporaries; XLA serializes only unsplit ones: remove the flag to cache it)"
    } else {
        ""
    }
}
