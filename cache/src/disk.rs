//! The on-disk store: one file per entry, `<key hex>.tpuc`, in a folder private to the user.
//!
//! File layout (little-endian):
//! `magic (8) | format version (u32) | key (32) | meta length (u64) | payload length (u64) |
//!  blake3(key, meta, payload) (32) | meta | payload`.
//!
//! Writes go to a temp file in the same folder and are renamed into place, so a reader sees a
//! whole entry or none, whatever happens to the writer. Readers check magic, version, key,
//! lengths and checksum before returning anything; a bad entry is deleted and reported, so the
//! caller recompiles. Only files named like entries are ever read, counted or evicted: foreign
//! or orphaned files cannot block writes or be mistaken for entries.

use crate::CacheKey;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

const MAGIC: &[u8; 8] = b"TPUCEXE\n";
/// Bump when the layout or the meaning of payloads changes: older entries are then ignored.
pub const FORMAT_VERSION: u32 = 1;
const HEADER_LEN: usize = 8 + 4 + 32 + 8 + 8 + 32;
const SUFFIX: &str = "tpuc";
const TMP_PREFIX: &str = ".tmp-";
/// Temp files older than this belong to a writer that died; gc removes them.
const STALE_TMP: Duration = Duration::from_secs(3600);

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("cache folder {dir}: {source}")]
    Io {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("refusing cache folder {dir}: it is writable by other users (mode {mode:o}); cache entries are native code. Use a folder only you can write (chmod 700), or another cache_dir")]
    Unsafe { dir: PathBuf, mode: u32 },
    #[error("refusing cache folder {dir}: it belongs to another user (uid {owner}), who could replace its entries (native code). Use a folder you own, or another cache_dir")]
    Foreign { dir: PathBuf, owner: u32 },
    #[error("corrupt cache entry {path}: {reason} (removed)")]
    Corrupt { path: PathBuf, reason: String },
}

/// One entry's bytes, verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub meta: Vec<u8>,
    pub payload: Vec<u8>,
}

/// What `ls` shows of an entry (without reading its payload).
#[derive(Debug, Clone)]
pub struct EntryInfo {
    pub key: String,
    pub path: PathBuf,
    pub size: u64,
    pub last_used: SystemTime,
}

#[derive(Debug, Default, Clone)]
pub struct GcReport {
    pub removed: usize,
    pub freed_bytes: u64,
    pub kept: usize,
    pub kept_bytes: u64,
    pub stale_temp_files: usize,
}

pub struct DiskCache {
    dir: PathBuf,
    read_only: bool,
    max_bytes: Option<u64>,
}

fn io_err(dir: &Path) -> impl FnOnce(io::Error) -> CacheError + '_ {
    move |source| CacheError::Io {
        dir: dir.to_path_buf(),
        source,
    }
}

fn checksum(key: &CacheKey, meta: &[u8], payload: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(&key.0);
    h.update(&(meta.len() as u64).to_le_bytes());
    h.update(meta);
    h.update(payload);
    *h.finalize().as_bytes()
}

fn parse_key(name: &str) -> Option<CacheKey> {
    let hex = name.strip_suffix(&format!(".{SUFFIX}"))?;
    if hex.len() != 64 {
        return None;
    }
    let mut k = [0u8; 32];
    for (i, byte) in k.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(CacheKey(k))
}

impl DiskCache {
    /// Opens (creating it private to the user if missing) the cache folder. A folder that other
    /// users can write is refused; a folder we cannot write is opened read-only.
    pub fn open(dir: &Path, max_bytes: Option<u64>) -> Result<DiskCache, CacheError> {
        if !dir.exists() {
            let mut b = fs::DirBuilder::new();
            b.recursive(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::DirBuilderExt;
                b.mode(0o700);
            }
            b.create(dir).map_err(io_err(dir))?;
        }
        let md = fs::metadata(dir).map_err(io_err(dir))?;
        if !md.is_dir() {
            return Err(CacheError::Io {
                dir: dir.to_path_buf(),
                source: io::Error::new(io::ErrorKind::NotADirectory, "not a directory"),
            });
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            use std::os::unix::fs::PermissionsExt;
            let mode = md.permissions().mode() & 0o7777;
            // Sticky world-writable folders (/tmp itself) are still writable by others.
            if mode & 0o022 != 0 {
                return Err(CacheError::Unsafe {
                    dir: dir.to_path_buf(),
                    mode,
                });
            }
            // The owner can always write (or chmod) the folder: it must be us or root.
            // SAFETY: geteuid has no preconditions and cannot fail.
            let me = unsafe { libc::geteuid() };
            if md.uid() != me && md.uid() != 0 {
                return Err(CacheError::Foreign {
                    dir: dir.to_path_buf(),
                    owner: md.uid(),
                });
            }
        }
        let read_only = !Self::probe_writable(dir);
        if read_only {
            tracing::warn!(dir = %dir.display(), "cache folder is not writable: using it read-only (new executables stay in memory)");
        }
        Ok(DiskCache {
            dir: dir.to_path_buf(),
            read_only,
            max_bytes,
        })
    }

    fn probe_writable(dir: &Path) -> bool {
        let probe = dir.join(format!("{TMP_PREFIX}probe-{}", std::process::id()));
        let ok = File::create(&probe).is_ok();
        let _ = fs::remove_file(&probe);
        ok
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    pub fn entry_path(&self, key: &CacheKey) -> PathBuf {
        self.dir.join(format!("{}.{SUFFIX}", key.hex()))
    }

    /// Reads and verifies the entry for `key`. `Ok(None)`: no entry. A corrupt entry is removed
    /// and returned as `Err(Corrupt)` so the caller can warn and recompile.
    pub fn get(&self, key: &CacheKey) -> Result<Option<Entry>, CacheError> {
        self.read(key, true)
    }

    /// [`DiskCache::get`] for inspecting an entry (what `tpuc cache ls` shows of each): the
    /// entry does not count as used, so the LRU order stays what the compiles made it.
    pub fn peek(&self, key: &CacheKey) -> Result<Option<Entry>, CacheError> {
        self.read(key, false)
    }

    /// Reads and verifies; `touch`: mark the entry as just used (for LRU eviction).
    fn read(&self, key: &CacheKey, touch: bool) -> Result<Option<Entry>, CacheError> {
        let path = self.entry_path(key);
        let mut file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(&self.dir)(e)),
        };
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(io_err(&self.dir))?;
        match Self::decode(key, &bytes) {
            Ok(entry) => {
                if touch {
                    // Recently used = recently modified, for LRU eviction.
                    let _ = file.set_modified(SystemTime::now());
                }
                Ok(Some(entry))
            }
            Err(reason) => {
                if !self.read_only {
                    let _ = fs::remove_file(&path);
                }
                Err(CacheError::Corrupt { path, reason })
            }
        }
    }

    fn decode(key: &CacheKey, bytes: &[u8]) -> Result<Entry, String> {
        if bytes.len() < HEADER_LEN {
            return Err(format!(
                "truncated: {} bytes, header needs {HEADER_LEN}",
                bytes.len()
            ));
        }
        if &bytes[..8] != MAGIC {
            return Err("not a tpuc cache entry (bad magic)".into());
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap());
        let version = u32_at(8);
        if version != FORMAT_VERSION {
            return Err(format!(
                "format version {version}, this tpuc reads {FORMAT_VERSION}"
            ));
        }
        if bytes[12..44] != key.0 {
            return Err("entry is stored under another key".into());
        }
        let meta_len = u64_at(44) as usize;
        let payload_len = u64_at(52) as usize;
        let expected = HEADER_LEN
            .checked_add(meta_len)
            .and_then(|n| n.checked_add(payload_len));
        if expected != Some(bytes.len()) {
            return Err(format!(
                "length mismatch: header says {meta_len} + {payload_len} bytes of body, file has {}",
                bytes.len().saturating_sub(HEADER_LEN)
            ));
        }
        let meta = &bytes[HEADER_LEN..HEADER_LEN + meta_len];
        let payload = &bytes[HEADER_LEN + meta_len..];
        if checksum(key, meta, payload)[..] != bytes[60..92] {
            return Err("checksum mismatch".into());
        }
        Ok(Entry {
            meta: meta.to_vec(),
            payload: payload.to_vec(),
        })
    }

    /// Writes an entry atomically (temp file, fsync, rename). On a read-only cache it does
    /// nothing. Evicts least recently used entries afterwards if a size cap is set.
    pub fn put(&self, key: &CacheKey, meta: &[u8], payload: &[u8]) -> Result<(), CacheError> {
        if self.read_only {
            return Ok(());
        }
        let mut header = Vec::with_capacity(HEADER_LEN);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        header.extend_from_slice(&key.0);
        header.extend_from_slice(&(meta.len() as u64).to_le_bytes());
        header.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        header.extend_from_slice(&checksum(key, meta, payload));
        let tmp = self.dir.join(format!(
            "{TMP_PREFIX}{}-{}-{}",
            std::process::id(),
            key.hex(),
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ));
        let result = (|| -> io::Result<()> {
            let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
            f.write_all(&header)?;
            f.write_all(meta)?;
            fault_injection_pause();
            f.write_all(payload)?;
            f.sync_all()?;
            fs::rename(&tmp, self.entry_path(key))
        })();
        if let Err(e) = result {
            let _ = fs::remove_file(&tmp);
            return Err(io_err(&self.dir)(e));
        }
        if let Some(cap) = self.max_bytes {
            self.gc(cap)?;
        }
        Ok(())
    }

    /// Every entry file (by name), without reading payloads.
    pub fn list(&self) -> Result<Vec<EntryInfo>, CacheError> {
        let mut out = Vec::new();
        for item in fs::read_dir(&self.dir).map_err(io_err(&self.dir))? {
            let Ok(item) = item else { continue };
            let name = item.file_name().to_string_lossy().into_owned();
            if parse_key(&name).is_none() {
                continue;
            }
            let Ok(md) = item.metadata() else { continue };
            if !md.is_file() {
                continue;
            }
            out.push(EntryInfo {
                key: name.trim_end_matches(&format!(".{SUFFIX}")).to_string(),
                path: item.path(),
                size: md.len(),
                last_used: md.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            });
        }
        out.sort_by_key(|e| std::cmp::Reverse(e.last_used));
        Ok(out)
    }

    /// Verifies every entry; removes the bad ones. Returns (good count, [(path, reason)]).
    pub fn verify(&self) -> Result<(usize, Vec<(PathBuf, String)>), CacheError> {
        let mut good = 0;
        let mut bad = Vec::new();
        for e in self.list()? {
            let key = parse_key(&format!("{}.{SUFFIX}", e.key)).expect("listed entries parse");
            match fs::read(&e.path) {
                Ok(bytes) => match Self::decode(&key, &bytes) {
                    Ok(_) => good += 1,
                    Err(reason) => {
                        if !self.read_only {
                            let _ = fs::remove_file(&e.path);
                        }
                        bad.push((e.path, reason));
                    }
                },
                Err(err) => bad.push((e.path, err.to_string())),
            }
        }
        Ok((good, bad))
    }

    /// Removes least recently used entries until the entries total at most `max_bytes`, and
    /// temp files left by dead writers. Foreign files are neither counted nor touched.
    pub fn gc(&self, max_bytes: u64) -> Result<GcReport, CacheError> {
        let mut report = GcReport::default();
        if self.read_only {
            return Ok(report);
        }
        for item in fs::read_dir(&self.dir)
            .map_err(io_err(&self.dir))?
            .flatten()
        {
            let name = item.file_name().to_string_lossy().into_owned();
            if !name.starts_with(TMP_PREFIX) {
                continue;
            }
            let stale = item
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > STALE_TMP);
            if stale && fs::remove_file(item.path()).is_ok() {
                report.stale_temp_files += 1;
            }
        }
        let entries = self.list()?; // most recently used first
        let mut total: u64 = 0;
        for e in entries {
            if total + e.size <= max_bytes {
                total += e.size;
                report.kept += 1;
                report.kept_bytes += e.size;
            } else if fs::remove_file(&e.path).is_ok() {
                report.removed += 1;
                report.freed_bytes += e.size;
            }
        }
        Ok(report)
    }

    /// Removes every entry (and stray temp files); returns how many entries were removed.
    pub fn clear(&self) -> Result<usize, CacheError> {
        let mut n = 0;
        for item in fs::read_dir(&self.dir)
            .map_err(io_err(&self.dir))?
            .flatten()
        {
            let name = item.file_name().to_string_lossy().into_owned();
            if parse_key(&name).is_some() {
                if fs::remove_file(item.path()).is_ok() {
                    n += 1;
                }
            } else if name.starts_with(TMP_PREFIX) {
                let _ = fs::remove_file(item.path());
            }
        }
        Ok(n)
    }

    pub fn read_raw(&self, key_hex: &str) -> Result<(CacheKey, Entry), CacheError> {
        self.read_hex(key_hex, true)
    }

    /// [`DiskCache::read_raw`] without counting the entry as used (see [`DiskCache::peek`]).
    pub fn peek_raw(&self, key_hex: &str) -> Result<(CacheKey, Entry), CacheError> {
        self.read_hex(key_hex, false)
    }

    fn read_hex(&self, key_hex: &str, touch: bool) -> Result<(CacheKey, Entry), CacheError> {
        let path = self.dir.join(format!("{key_hex}.{SUFFIX}"));
        let key = parse_key(&format!("{key_hex}.{SUFFIX}")).ok_or_else(|| CacheError::Corrupt {
            path: path.clone(),
            reason: "not a cache key (64 hex digits)".into(),
        })?;
        match self.read(&key, touch)? {
            Some(e) => Ok((key, e)),
            None => Err(io_err(&self.dir)(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no entry {key_hex}"),
            ))),
        }
    }
}

/// Tests of crash safety need a writer to die half-way through an entry: with a pause set
/// ([`set_write_pause`]), a writer sleeps after the header and metadata, before the payload.
static WRITE_PAUSE_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Test hook (`TPUC_DEBUG=cache_write_pause_ms=N`): every later write of this process sleeps
/// `pause` half-way through its entry. Not for production use.
pub fn set_write_pause(pause: Duration) {
    let ms = u64::try_from(pause.as_millis()).unwrap_or(u64::MAX);
    WRITE_PAUSE_MS.store(ms, std::sync::atomic::Ordering::Relaxed);
}

fn fault_injection_pause() {
    let ms = WRITE_PAUSE_MS.load(std::sync::atomic::Ordering::Relaxed);
    if ms > 0 {
        std::thread::sleep(Duration::from_millis(ms));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KeyBuilder;

    fn key(s: &str) -> CacheKey {
        KeyBuilder::new().part("t", s.as_bytes()).finish()
    }

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tpuc-cache-test-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "File::set_modified (futimens) is not supported by Miri"
    )]
    fn round_trip_and_private_folder() {
        let d = tmpdir("rt");
        let c = DiskCache::open(&d, None).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(
                fs::metadata(&d).unwrap().permissions().mode() & 0o777,
                0o700
            );
        }
        assert_eq!(c.get(&key("a")).unwrap(), None);
        c.put(&key("a"), b"meta", b"payload bytes").unwrap();
        let e = c.get(&key("a")).unwrap().unwrap();
        assert_eq!(
            (e.meta.as_slice(), e.payload.as_slice()),
            (&b"meta"[..], &b"payload bytes"[..])
        );
        assert_eq!(c.list().unwrap().len(), 1);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn corrupt_entries_are_detected_and_removed() {
        let d = tmpdir("corrupt");
        let c = DiskCache::open(&d, None).unwrap();
        let k = key("b");
        c.put(&k, b"m", &[7u8; 1000]).unwrap();
        let path = c.entry_path(&k);
        let good = fs::read(&path).unwrap();
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("truncated", good[..good.len() - 10].to_vec()),
            ("garbage", vec![0xAB; 500]),
            ("flipped", {
                let mut b = good.clone();
                let n = b.len();
                b[n - 1] ^= 1;
                b
            }),
            ("empty", vec![]),
        ];
        for (what, bytes) in cases {
            fs::write(&path, &bytes).unwrap();
            let err = c.get(&k).unwrap_err();
            assert!(matches!(err, CacheError::Corrupt { .. }), "{what}: {err}");
            assert!(!path.exists(), "{what}: bad entry must be removed");
        }
        // An entry copied under another key's name is refused too.
        c.put(&key("c"), b"m", b"x").unwrap();
        // read + write rather than fs::copy (copy_file_range), which Miri does not support.
        fs::write(&path, fs::read(c.entry_path(&key("c"))).unwrap()).unwrap();
        assert!(c.get(&k).is_err());
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "File::set_modified (futimens) is not supported by Miri"
    )]
    fn lru_eviction_ignores_foreign_files() {
        let d = tmpdir("lru");
        let c = DiskCache::open(&d, None).unwrap();
        fs::write(d.join("orphan.bin"), vec![0u8; 100_000]).unwrap();
        for (i, name) in ["x", "y", "z"].iter().enumerate() {
            c.put(&key(name), b"", &vec![i as u8; 1000]).unwrap();
            let t = SystemTime::now() - Duration::from_secs(100 - i as u64 * 10);
            File::options()
                .write(true)
                .open(c.entry_path(&key(name)))
                .unwrap()
                .set_modified(t)
                .unwrap();
        }
        // Inspecting y (tpuc cache ls) does not count as a use; reading x does.
        c.peek(&key("y")).unwrap().unwrap();
        c.get(&key("x")).unwrap().unwrap(); // x becomes most recently used
        let size = c.list().unwrap()[0].size;
        let r = c.gc(2 * size).unwrap();
        assert_eq!((r.removed, r.kept), (1, 2));
        assert!(
            c.get(&key("y")).unwrap().is_none(),
            "y was least recently used"
        );
        assert!(c.get(&key("x")).unwrap().is_some());
        assert!(
            d.join("orphan.bin").exists(),
            "foreign files are never touched"
        );
        // With a cap, writes still succeed while the orphan is there.
        let capped = DiskCache::open(&d, Some(2 * size)).unwrap();
        capped.put(&key("w"), b"", &[9u8; 1000]).unwrap();
        assert!(capped.get(&key("w")).unwrap().is_some());
        fs::remove_dir_all(&d).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn refuses_folders_owned_by_another_user() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return; // only root can give a folder away; CI runs as root
        }
        let d = tmpdir("foreign");
        fs::create_dir_all(&d).unwrap();
        let c_path = std::ffi::CString::new(d.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path; chown has no other preconditions.
        assert_eq!(unsafe { libc::chown(c_path.as_ptr(), 65534, 65534) }, 0);
        let err = DiskCache::open(&d, None).err().unwrap();
        assert!(err.to_string().contains("belongs to another user"), "{err}");
        fs::remove_dir_all(&d).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn refuses_folders_writable_by_others() {
        use std::os::unix::fs::PermissionsExt;
        let d = tmpdir("unsafe");
        fs::create_dir_all(&d).unwrap();
        fs::set_permissions(&d, fs::Permissions::from_mode(0o777)).unwrap();
        let err = DiskCache::open(&d, None).err().unwrap();
        assert!(err.to_string().contains("writable by other users"), "{err}");
        fs::remove_dir_all(&d).unwrap();
    }
}
