//! Content-addressed store of compiled executables.
//!
//! A [`CacheKey`] is the blake3 hash of everything that changes the compiled binary: the module
//! text, the compile options, the plugin's identity and the host CPU. [`ExecutableCache`] maps keys
//! to shared executables in memory; callers decide what a value is (the compiler stores PJRT
//! executables).

mod disk;

pub use disk::{
    set_write_pause, CacheError, DiskCache, Entry, EntryInfo, GcReport, FORMAT_VERSION,
};

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

/// A blake3 digest naming one compiled executable.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CacheKey(pub [u8; 32]);

impl CacheKey {
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Debug for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CacheKey({})", &self.hex()[..16])
    }
}

impl fmt::Display for CacheKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

/// Builds a key from named parts. Each part is length-prefixed so that ("ab", "c") and
/// ("a", "bc") never collide, and the format version is mixed in so a change of key layout
/// never reuses old entries.
pub struct KeyBuilder(blake3::Hasher);

impl KeyBuilder {
    const DOMAIN: &'static str = "tpuc executable cache key v1";

    /// A builder whose key also covers the on-disk format version.
    pub fn new() -> KeyBuilder {
        KeyBuilder(blake3::Hasher::new_derive_key(Self::DOMAIN))
            .part("format", &FORMAT_VERSION.to_le_bytes())
    }

    pub fn part(mut self, name: &str, bytes: &[u8]) -> KeyBuilder {
        for chunk in [name.as_bytes(), bytes] {
            self.0.update(&(chunk.len() as u64).to_le_bytes());
            self.0.update(chunk);
        }
        self
    }

    pub fn finish(self) -> CacheKey {
        CacheKey(*self.0.finalize().as_bytes())
    }
}

impl Default for KeyBuilder {
    fn default() -> Self {
        Self::new()
    }
}

/// The host CPU's identity as far as generated code cares: architecture and the features the
/// compiler may use. Executables for one CPU can crash or be wrong on another.
pub fn host_cpu_fingerprint() -> String {
    let mut s = String::from(std::env::consts::ARCH);
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! feats {
            ($($f:tt),*) => {$(
                if std::arch::is_x86_feature_detected!($f) { s.push('+'); s.push_str($f); }
            )*};
        }
        feats!(
            "sse4.2",
            "avx",
            "avx2",
            "fma",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512dq",
            "avx512bf16",
            "avx512fp16"
        );
    }
    s
}

/// In-memory executable map. Thread-safe; values are shared (`Arc`).
pub struct ExecutableCache<V> {
    map: Mutex<HashMap<CacheKey, Arc<V>>>,
}

impl<V> Default for ExecutableCache<V> {
    fn default() -> Self {
        ExecutableCache {
            map: Mutex::new(HashMap::new()),
        }
    }
}

impl<V> ExecutableCache<V> {
    pub fn get(&self, key: &CacheKey) -> Option<Arc<V>> {
        self.map.lock().unwrap().get(key).cloned()
    }

    /// Inserts `value` unless another thread got there first; returns the value that is cached.
    pub fn insert(&self, key: CacheKey, value: V) -> Arc<V> {
        self.map
            .lock()
            .unwrap()
            .entry(key)
            .or_insert_with(|| Arc::new(value))
            .clone()
    }

    pub fn len(&self) -> usize {
        self.map.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn clear(&self) {
        self.map.lock().unwrap().clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_separate_parts_and_depend_on_every_part() {
        let k = |a: &str, b: &str| {
            KeyBuilder::new()
                .part("x", a.as_bytes())
                .part("y", b.as_bytes())
                .finish()
        };
        assert_ne!(k("ab", "c"), k("a", "bc"));
        assert_eq!(k("a", "b"), k("a", "b"));
        assert_ne!(k("a", "b"), k("a", "B"));
        assert_eq!(k("a", "b").hex().len(), 64);
    }

    #[test]
    fn first_insert_wins_and_is_shared() {
        let c: ExecutableCache<String> = ExecutableCache::default();
        let key = KeyBuilder::new().part("m", b"module").finish();
        assert!(c.get(&key).is_none());
        let a = c.insert(key, "first".into());
        let b = c.insert(key, "second".into());
        assert_eq!(*a, "first");
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn cpu_fingerprint_names_the_architecture() {
        assert!(host_cpu_fingerprint().starts_with(std::env::consts::ARCH));
    }
}
