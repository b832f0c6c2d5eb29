//! Loading PJRT plugins (shared libraries exporting `GetPjrtApi`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use super::api::{pjrt_call, Api, Args};
use super::named_values::{read_named_values, OptionValue};
use super::{sys, PjrtError};

/// A loaded PJRT plugin. Lives for the rest of the process: see [`load_plugin`].
pub struct Plugin {
    path: PathBuf,
    pub(crate) api: Api,
    identity: OnceLock<[u8; 32]>,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("path", &self.path)
            .field("api_version", &self.api_version())
            .finish()
    }
}

static PLUGINS: Mutex<BTreeMap<PathBuf, &'static Plugin>> = Mutex::new(BTreeMap::new());

/// Loads the PJRT plugin at `path` (once per canonical path; later calls
/// return the same plugin) and initializes it.
///
/// The library is never unloaded: PJRT plugins crash in their exit handlers
/// after `dlclose`. A failed load is not remembered, so it can be retried.
pub fn load_plugin(path: &Path) -> Result<&'static Plugin, PjrtError> {
    let load_err = |reason: String| PjrtError::Load {
        path: path.display().to_string(),
        reason,
    };
    let canonical = path.canonicalize().map_err(|e| load_err(e.to_string()))?;
    // Held across the load so that two threads never load the same plugin.
    let mut plugins = PLUGINS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = plugins.get(&canonical) {
        return Ok(p);
    }
    let plugin = Plugin::load(&canonical).map_err(load_err)?;
    let plugin: &'static Plugin = Box::leak(Box::new(plugin));
    plugins.insert(canonical, plugin);
    Ok(plugin)
}

impl Plugin {
    fn load(path: &Path) -> Result<Plugin, String> {
        let _span = tracing::debug_span!("pjrt_load_plugin", path = %path.display()).entered();
        // SAFETY: loading runs the library's initializers; the caller names the
        // file as a PJRT plugin, which is exactly what must be trusted here.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())?;
        // Never dlclose, not even a library that turns out not to be a plugin:
        // unloading arbitrary code that may have registered exit handlers is
        // what crashes. The handle is never dropped (ManuallyDrop rather than
        // a leaked Box, which Valgrind would report as a definite leak).
        let lib = std::mem::ManuallyDrop::new(lib);
        type GetPjrtApi = unsafe extern "C" fn() -> *const sys::PJRT_Api;
        // SAFETY: `GetPjrtApi` has this signature in every PJRT plugin; the
        // function pointer stays valid because the library is never unloaded.
        let get_api: GetPjrtApi = *unsafe { lib.get::<GetPjrtApi>(b"GetPjrtApi\0") }
            .map_err(|_| "not a PJRT plugin: no GetPjrtApi symbol".to_string())?;
        // SAFETY: calling the plugin's entry point, which takes no arguments.
        let raw = unsafe { get_api() };
        if raw.is_null() {
            return Err("GetPjrtApi returned null".into());
        }
        // SAFETY: `raw` is non-null, from GetPjrtApi, and the library is leaked.
        let api = unsafe { Api::new(raw) }?;
        let (major, minor) = api.version();
        if major != sys::PJRT_API_MAJOR as i32 {
            return Err(format!(
                "PJRT API major version {major} (plugin) != {} (header)",
                sys::PJRT_API_MAJOR
            ));
        }
        // Within a major version, compatibility is per struct: every call
        // checks that the function exists and passes our struct sizes.
        if minor != sys::PJRT_API_MINOR as i32 {
            tracing::debug!(
                "PJRT API {major}.{minor} (plugin) vs 0.{} (header)",
                sys::PJRT_API_MINOR
            );
        }
        let mut args = sys::PJRT_Plugin_Initialize_Args::new();
        // SAFETY: `args` is initialised and has no pointers.
        match unsafe { pjrt_call!(&api, PJRT_Plugin_Initialize, &mut args) } {
            Ok(()) => {}
            // Older plugins have no Initialize and need none.
            Err(PjrtError::Missing { .. }) => {}
            Err(e) => return Err(e.to_string()),
        }
        tracing::debug!("loaded PJRT plugin, API {major}.{minor}");
        Ok(Plugin {
            path: path.to_path_buf(),
            api,
            identity: OnceLock::new(),
        })
    }

    /// `(major, minor)` version of the PJRT C API the plugin implements.
    pub fn api_version(&self) -> (i32, i32) {
        self.api.version()
    }

    /// The canonical path the plugin was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The plugin's attributes (`PJRT_Plugin_Attributes`): `xla_version`,
    /// `stablehlo_current_version` and `stablehlo_minimum_version` (each `[major, minor, patch]`)
    /// and whatever else it reports. Empty for plugins without the call.
    pub fn attributes(&self) -> Result<Vec<(String, OptionValue)>, PjrtError> {
        let mut args = sys::PJRT_Plugin_Attributes_Args::new();
        // SAFETY: `args` is initialised; the plugin fills in a pointer to its own array.
        match unsafe { pjrt_call!(&self.api, PJRT_Plugin_Attributes, &mut args) } {
            Ok(()) => {}
            Err(PjrtError::Missing { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(e),
        }
        if args.attributes.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: the plugin owns `num_attributes` named values there for its lifetime (the
        // plugin is never unloaded).
        Ok(unsafe { read_named_values(args.attributes, args.num_attributes) })
    }

    /// `(current, minimum)` StableHLO versions (`[major, minor, patch]`) the plugin accepts, if
    /// it reports both (one `PJRT_Plugin_Attributes` call).
    pub fn stablehlo_versions(&self) -> Option<(Vec<i64>, Vec<i64>)> {
        let attributes = self.attributes().ok()?;
        let version = |name: &str| {
            attributes.iter().find_map(|(n, v)| match v {
                OptionValue::Int64List(list) if n == name => Some(list.clone()),
                _ => None,
            })
        };
        version("stablehlo_current_version").zip(version("stablehlo_minimum_version"))
    }

    /// BLAKE3 hash of the plugin file, for cache keys: an executable serialized
    /// by one plugin build can load in another and compute wrong numbers.
    /// Computed on first use (the CPU plugin is about 260 MB).
    pub fn identity(&self) -> [u8; 32] {
        *self.identity.get_or_init(|| {
            let mut hasher = blake3::Hasher::new();
            let hashed =
                std::fs::File::open(&self.path).and_then(|f| hasher.update_reader(f).map(|_| ()));
            if let Err(e) = hashed {
                // Unique to this path and marked as unreadable, so it does
                // not alias the identity of a readable plugin file.
                tracing::warn!("cannot hash PJRT plugin {}: {e}", self.path.display());
                let mut h = blake3::Hasher::new();
                h.update(b"tpuc-unreadable-pjrt-plugin\0");
                h.update(self.path.as_os_str().as_encoded_bytes());
                return *h.finalize().as_bytes();
            }
            *hasher.finalize().as_bytes()
        })
    }
}
