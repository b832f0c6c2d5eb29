//! The persistent executable cache's commands (`tpuc cache ls/info/verify/gc/clear`): Python
//! functions over `tpuc_cache::DiskCache`.

use crate::errors::cache_err;
use pyo3::prelude::*;
use std::collections::HashMap;
use std::path::PathBuf;
use tpuc_cache::DiskCache;

pub(crate) fn open_cache(dir: PathBuf) -> PyResult<DiskCache> {
    DiskCache::open(&dir, None).map_err(cache_err)
}

/// `[(key, size bytes, last used unix seconds)]`, most recently used first.
#[pyfunction]
fn cache_list(dir: PathBuf) -> PyResult<Vec<(String, u64, f64)>> {
    let c = open_cache(dir)?;
    Ok(c.list()
        .map_err(cache_err)?
        .into_iter()
        .map(|e| {
            let t = e
                .last_used
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            (e.key, e.size, t)
        })
        .collect())
}

/// Verified entry details: `{"key", "path", "meta_bytes", "payload_bytes"}`; raises if bad.
#[pyfunction]
fn cache_info(dir: PathBuf, key: &str) -> PyResult<HashMap<String, String>> {
    let c = open_cache(dir)?;
    let (k, entry) = c.read_raw(key).map_err(cache_err)?;
    let mut m = HashMap::new();
    m.insert("key".into(), k.hex());
    m.insert("path".into(), c.entry_path(&k).display().to_string());
    m.insert("meta_bytes".into(), entry.meta.len().to_string());
    m.insert("payload_bytes".into(), entry.payload.len().to_string());
    Ok(m)
}

/// Verifies every entry, removing bad ones: `(good, [(path, reason)])`.
#[pyfunction]
fn cache_verify(dir: PathBuf) -> PyResult<(usize, Vec<(String, String)>)> {
    let (good, bad) = open_cache(dir)?.verify().map_err(cache_err)?;
    Ok((
        good,
        bad.into_iter()
            .map(|(p, r)| (p.display().to_string(), r))
            .collect(),
    ))
}

/// Evicts least recently used entries down to `max_bytes`: `{"removed", "freed_bytes", "kept",
/// "kept_bytes", "stale_temp_files"}`.
#[pyfunction]
fn cache_gc(dir: PathBuf, max_bytes: u64) -> PyResult<HashMap<String, u64>> {
    let r = open_cache(dir)?.gc(max_bytes).map_err(cache_err)?;
    Ok(HashMap::from([
        ("removed".to_string(), r.removed as u64),
        ("freed_bytes".to_string(), r.freed_bytes),
        ("kept".to_string(), r.kept as u64),
        ("kept_bytes".to_string(), r.kept_bytes),
        ("stale_temp_files".to_string(), r.stale_temp_files as u64),
    ]))
}

#[pyfunction]
fn cache_clear(dir: PathBuf) -> PyResult<usize> {
    open_cache(dir)?.clear().map_err(cache_err)
}

/// Adds the cache commands to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cache_list, m)?)?;
    m.add_function(wrap_pyfunction!(cache_info, m)?)?;
    m.add_function(wrap_pyfunction!(cache_verify, m)?)?;
    m.add_function(wrap_pyfunction!(cache_gc, m)?)?;
    m.add_function(wrap_pyfunction!(cache_clear, m)?)?;
    Ok(())
}
