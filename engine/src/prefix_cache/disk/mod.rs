//! The on-disk prefix cache: finished sequences (tokens, [`SequenceState`], [`Checkpoint`]s) kept as files in a
//! directory, so a prompt can resume from a sequence of an earlier run of the server, or one the in-memory
//! [`super::PrefixCache`] has evicted.
//!
//! One file per sequence, `<32 hex digits>.nbpc` (a hash of the model identity and the tokens; the format is in
//! [`codec`]). A file is written under a unique temporary name in the same directory (`*.nbpc-tmp`, locked while
//! written), synced, then renamed into place: a crash never leaves a half entry under an entry's name, and the
//! temporaries it leaves are removed by the next [`DiskCache::open`]. Nothing read back is trusted: every load
//! checks the format, both checksums, the model identity and the state's shapes ([`codec::decode`]); an entry
//! that fails is logged, removed and not returned.
//!
//! Least recently used entries are deleted first to keep the directory within its byte bound; use is the file's
//! modification time (set on every load), so the order survives restarts and is shared by every process using the
//! directory. Several threads and processes may use one directory at once: names are unique, renames atomic, and
//! the index in memory is a cache of the directory that tolerates files appearing and disappearing (a lookup
//! rescans it when the directory changed). Entries of other models (another identity) may share the directory:
//! they are never returned, but count toward the bound and age like the others.

pub mod codec;
pub mod identity;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use xxhash_rust::xxh3::Xxh3;

pub use codec::{CheckpointInfo, CodecError, EntryHeader};
pub use identity::ModelIdentity;

use crate::model::{SequenceState, Snapshot};

/// A checkpoint in host memory: a CPU snapshot, or a GPU snapshot spilled as an image.
pub type Checkpoint = super::Checkpoint<Snapshot>;

/// A finished sequence in host memory, as the disk cache stores it: its tokens, its state (a CPU state, or a GPU
/// state's host image; the model identity's tag says which) and its checkpoints.
#[derive(Debug, Clone)]
pub struct HostEntry {
    /// Tokens the state consumed.
    pub tokens: Vec<u32>,
    /// The state after all of `tokens`.
    pub state: SequenceState,
    /// Resumable points, by position.
    pub checkpoints: Vec<Checkpoint>,
}

/// File name suffix of an entry.
const ENTRY_SUFFIX: &str = ".nbpc";
/// File name suffix of an entry being written.
const TEMP_SUFFIX: &str = ".nbpc-tmp";
/// Read and write buffer, bytes.
const IO_BUFFER: usize = 1 << 20;

/// Why the disk cache could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum DiskCacheError {
    /// A file-system operation failed.
    #[error("prefix cache: cannot {op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The entry given to [`DiskCache::store`] is inconsistent (its state does not match its tokens or is shaped
    /// unlike the model's).
    #[error("prefix cache: refusing to store an entry: {0}")]
    Entry(#[source] CodecError),
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> DiskCacheError + 'a {
    move |source| DiskCacheError::Io { op, path: path.to_path_buf(), source }
}

/// What [`DiskCache::store`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// The entry is on disk: `bytes` long.
    Written {
        /// Size of its file.
        bytes: u64,
    },
    /// The entry alone would exceed the directory's bound: nothing was written.
    TooLarge {
        /// Size its file would have had.
        bytes: u64,
    },
    /// The entry has no checkpoint, so nothing could resume from it: nothing was written.
    NoCheckpoint,
}

/// Where a prompt can resume from disk ([`DiskCache::lookup`]); [`DiskCache::load`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskHit {
    /// The entry's file name in the directory.
    pub name: String,
    /// Prompt tokens the checkpoint covers: the first `pos` need no prefill.
    pub pos: usize,
    /// Whether the checkpoint keeps its logits (it covers the whole prompt then, and needs no forward).
    pub has_logits: bool,
    /// Size of the entry's file: what loading it reads.
    pub bytes: u64,
}

/// An entry read back from disk ([`DiskCache::load`]).
#[derive(Debug)]
pub struct LoadedEntry {
    /// The sequence, as [`super::PrefixCache::insert`] takes it.
    pub entry: HostEntry,
    /// Index in `entry.checkpoints` of the hit's checkpoint.
    pub checkpoint: usize,
}

/// An indexed file.
#[derive(Debug)]
struct Indexed {
    /// `None` for a file of another format version (never used, only aged and evicted).
    header: Option<EntryHeader>,
    bytes: u64,
    modified: SystemTime,
}

#[derive(Debug, Default)]
struct Index {
    files: HashMap<String, Indexed>,
    /// The directory's modification time at the last scan.
    dir_modified: Option<SystemTime>,
}

/// The on-disk prefix cache of one model in one directory (see the module docs). `Send + Sync`: all methods
/// take `&self` (an internal lock guards the index; file I/O runs outside it), so `store` can run on a
/// background thread while the worker looks up and loads.
#[derive(Debug)]
pub struct DiskCache {
    dir: PathBuf,
    max_bytes: u64,
    identity: ModelIdentity,
    index: Mutex<Index>,
}

/// Temporaries written by this process so far (part of their unique names).
static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

fn is_entry_name(name: &str) -> bool {
    name.strip_suffix(ENTRY_SUFFIX).is_some_and(|h| h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// How many leading tokens `a` and `b` share.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl DiskCache {
    /// Opens (creating it if needed) the cache directory `dir`, keeping at most `max_bytes` bytes of entries in
    /// it, for the model `identity` names.
    ///
    /// Removes the temporaries of writers that are gone (a temporary still locked by its writer stays), reads
    /// every entry's header into the index (removing, with a warning, those that are damaged), then deletes the
    /// least recently used entries until the directory is within `max_bytes`.
    ///
    /// # Errors
    /// [`DiskCacheError::Io`] when the directory cannot be created or listed. Unreadable single files are
    /// skipped with a warning instead.
    pub fn open(dir: impl Into<PathBuf>, max_bytes: u64, identity: ModelIdentity) -> Result<Self, DiskCacheError> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(io_err("create the directory", &dir))?;
        let cache = Self { dir, max_bytes, identity, index: Mutex::default() };
        cache.remove_abandoned_temporaries()?;
        let mut index = cache.lock();
        cache.rescan(&mut index)?;
        let (foreign, foreign_bytes) = index
            .files
            .values()
            .filter(|f| f.header.as_ref().is_none_or(|h| h.identity != cache.identity.digest()))
            .fold((0, 0), |(n, b), f| (n + 1, b + f.bytes));
        if foreign > 0 {
            tracing::warn!(
                dir = %cache.dir.display(),
                "prefix cache: {foreign} entries ({foreign_bytes} bytes) were written for another model file, \
                 engine version or format; they are never used, and are deleted as they age"
            );
        }
        let victims = cache.evict(&mut index, None);
        drop(index);
        cache.remove_files(victims);
        Ok(cache)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The bound on the bytes of all entries in the directory.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// The identity entries are written under and must have to be loaded.
    pub fn identity(&self) -> &ModelIdentity {
        &self.identity
    }

    /// Entries of this model in the index.
    pub fn len(&self) -> usize {
        self.lock().files.values().filter(|f| self.is_ours(f)).count()
    }

    /// Whether the index holds no entry of this model.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of all entries in the index (every model's: they share the bound).
    pub fn bytes(&self) -> u64 {
        self.lock().files.values().map(|f| f.bytes).sum()
    }

    /// The checkpoint on disk that covers the most of `prompt`, by the rules of [`super::PrefixCache::lookup`]:
    /// at a position `pos > 0` where the entry's tokens equal the prompt's, and either `pos < prompt.len()` or
    /// the checkpoint keeps its logits. Among equal positions the smallest file wins (the quickest to load).
    /// Reads no file (only the directory listing, when the directory changed since the last scan).
    pub fn lookup(&self, prompt: &[u32]) -> Option<DiskHit> {
        let mut index = self.lock();
        if self.dir_modified() != index.dir_modified
            && let Err(e) = self.rescan(&mut index)
        {
            tracing::warn!("{e}");
        }
        let mut best: Option<DiskHit> = None;
        for (name, f) in &index.files {
            let Some(h) = f.header.as_ref().filter(|h| h.identity == self.identity.digest()) else {
                continue;
            };
            let common = common_prefix(&h.tokens, prompt);
            for cp in &h.checkpoints {
                let usable = cp.pos > 0 && cp.pos <= common && (cp.pos < prompt.len() || cp.has_logits);
                let better = best.as_ref().is_none_or(|b| cp.pos > b.pos || (cp.pos == b.pos && f.bytes < b.bytes));
                if usable && better {
                    best = Some(DiskHit { name: name.clone(), pos: cp.pos, has_logits: cp.has_logits, bytes: f.bytes });
                }
            }
        }
        best
    }

    /// Reads the entry of `hit` back, fully checked ([`codec::decode`]), and marks it as just used. `None` when
    /// the file is gone (another process evicted it), was replaced without the hit's checkpoint, or fails a check
    /// (logged as a warning; a damaged file is deleted); the index forgets it then.
    pub fn load(&self, hit: &DiskHit) -> Option<LoadedEntry> {
        let path = self.dir.join(&hit.name);
        let decoded = match self.read_entry(&path) {
            Ok(d) => d,
            Err(ReadError::Gone) => {
                tracing::debug!(path = %path.display(), "prefix cache: entry gone before it was loaded");
                self.lock().files.remove(&hit.name);
                return None;
            }
            Err(ReadError::Io(e)) => {
                tracing::warn!(path = %path.display(), "prefix cache: cannot read an entry: {e}");
                self.lock().files.remove(&hit.name);
                return None;
            }
            Err(ReadError::Codec(e @ CodecError::Identity { .. })) => {
                // Valid for the model it names (a hit handed to the wrong cache): left for its owner.
                tracing::warn!(path = %path.display(), "prefix cache: not loading an entry: {e}");
                self.lock().files.remove(&hit.name);
                return None;
            }
            Err(ReadError::Codec(e)) => {
                tracing::warn!(path = %path.display(), "prefix cache: deleting an unusable entry: {e}");
                self.lock().files.remove(&hit.name);
                remove_quietly(&path);
                return None;
            }
        };
        let codec::DecodedEntry { header, state, checkpoints } = decoded;
        let found =
            checkpoints.iter().position(|c| c.snapshot.pos() == hit.pos && (c.logits.is_some() || !hit.has_logits));
        let mut index = self.lock();
        let modified = self.mark_used(&index, &path);
        index
            .files
            .insert(hit.name.clone(), Indexed { bytes: header.file_bytes, header: Some(header.clone()), modified });
        let Some(checkpoint) = found else {
            tracing::debug!(path = %path.display(), "prefix cache: entry replaced without the checkpoint looked up");
            return None;
        };
        Some(LoadedEntry { entry: HostEntry { tokens: header.tokens, state, checkpoints }, checkpoint })
    }

    /// Writes a finished sequence (`tokens` consumed by `state`, with the `checkpoints` taken on the way), then
    /// deletes the entries of this model whose tokens are a prefix of `tokens` (this one covers them) and the
    /// least recently used entries until the directory is within its bound. The same tokens stored again
    /// replace the earlier entry. An entry larger than the whole bound, or without checkpoints, is not written.
    ///
    /// Takes as long as writing the entry's bytes (about `state.bytes()` plus the checkpoints) and syncing them;
    /// call it off the hot path.
    ///
    /// # Errors
    /// [`DiskCacheError::Entry`] when the entry is inconsistent (nothing is written), [`DiskCacheError::Io`] when
    /// writing fails (the temporary is removed; nothing under an entry's name changes).
    pub fn store(
        &self,
        tokens: &[u32],
        state: &SequenceState,
        checkpoints: &[Checkpoint],
    ) -> Result<Stored, DiskCacheError> {
        if checkpoints.is_empty() {
            return Ok(Stored::NoCheckpoint);
        }
        let bytes = codec::encoded_bytes(tokens, state, checkpoints);
        if bytes > self.max_bytes {
            return Ok(Stored::TooLarge { bytes });
        }
        let name = self.entry_name(tokens);
        let temp = self.dir.join(format!(
            "{}-{}-{}-{:016x}{TEMP_SUFFIX}",
            &name[..32],
            std::process::id(),
            TEMP_SEQ.fetch_add(1, Ordering::Relaxed),
            rand::random::<u64>()
        ));
        let written = self.write_temporary(&temp, tokens, state, checkpoints);
        let (header, locked) = match written {
            Ok(h) => h,
            Err(e) => {
                remove_quietly(&temp);
                return Err(e);
            }
        };
        let path = self.dir.join(&name);
        let mut index = self.lock();
        let renamed = fs::rename(&temp, &path);
        // Closing the file releases its lock: the temporary is gone (renamed) or about to be removed.
        drop(locked);
        if let Err(e) = renamed {
            drop(index);
            remove_quietly(&temp);
            return Err(io_err("rename into place", &path)(e));
        }
        let modified = self.mark_used(&index, &path);
        // Files written by other processes since the last scan count toward the bound too.
        if let Err(e) = self.rescan(&mut index) {
            tracing::warn!("{e}");
        }
        index.files.insert(name.clone(), Indexed { header: Some(header), bytes, modified });
        let mut victims: Vec<String> = index
            .files
            .iter()
            .filter(|(n, f)| {
                **n != name
                    && f.header
                        .as_ref()
                        .is_some_and(|h| h.identity == self.identity.digest() && tokens.starts_with(&h.tokens))
            })
            .map(|(n, _)| n.clone())
            .collect();
        for v in &victims {
            index.files.remove(v);
        }
        victims.extend(self.evict(&mut index, Some(&name)));
        drop(index);
        self.remove_files(victims);
        Ok(Stored::Written { bytes })
    }

    /// Rereads the directory into the index now (a lookup does it by itself when the directory changed).
    ///
    /// # Errors
    /// [`DiskCacheError::Io`] when the directory cannot be listed.
    pub fn refresh(&self) -> Result<(), DiskCacheError> {
        self.rescan(&mut self.lock())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        // The index is a cache of the directory: after a panic elsewhere it is still usable.
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn is_ours(&self, f: &Indexed) -> bool {
        f.header.as_ref().is_some_and(|h| h.identity == self.identity.digest())
    }

    fn entry_name(&self, tokens: &[u32]) -> String {
        let mut h = Xxh3::new();
        h.update(&self.identity.digest().to_le_bytes());
        h.update(bytemuck::cast_slice(tokens));
        format!("{:032x}{ENTRY_SUFFIX}", h.digest128())
    }

    /// Sets the modification time of the entry at `path` to a use time later than every one in the index (now,
    /// or 1 µs past the newest), so recency is a strict order even on a coarse clock; returns it.
    fn mark_used(&self, index: &Index, path: &Path) -> SystemTime {
        let now = SystemTime::now();
        let t = match index.files.values().map(|f| f.modified).max() {
            Some(newest) if newest >= now => newest + Duration::from_micros(1),
            _ => now,
        };
        if let Err(e) = File::options().write(true).open(path).and_then(|f| f.set_modified(t)) {
            tracing::debug!(path = %path.display(), "prefix cache: cannot mark an entry used: {e}");
        }
        t
    }

    fn dir_modified(&self) -> Option<SystemTime> {
        fs::metadata(&self.dir).and_then(|m| m.modified()).ok()
    }

    /// Encodes into `temp` (created, locked, synced); returns the header written and the open, locked file, to
    /// be closed only once the temporary has been renamed into place (so that no `open` takes it for abandoned
    /// in between).
    fn write_temporary(
        &self,
        temp: &Path,
        tokens: &[u32],
        state: &SequenceState,
        checkpoints: &[Checkpoint],
    ) -> Result<(EntryHeader, File), DiskCacheError> {
        let file = File::options().write(true).create_new(true).open(temp).map_err(io_err("create", temp))?;
        // Held until the file is closed: tells `open` in another process that this temporary is in progress.
        file.lock().map_err(io_err("lock", temp))?;
        let bytes =
            codec::encode(BufWriter::with_capacity(IO_BUFFER, &file), &self.identity, tokens, state, checkpoints)
                .map_err(|e| match e {
                    CodecError::Io(source) => DiskCacheError::Io { op: "write", path: temp.to_path_buf(), source },
                    other => DiskCacheError::Entry(other),
                })?;
        file.sync_data().map_err(io_err("sync", temp))?;
        let checkpoints = checkpoints
            .iter()
            .map(|c| CheckpointInfo { pos: c.snapshot.pos(), has_logits: c.logits.is_some() })
            .collect();
        let header =
            EntryHeader { identity: self.identity.digest(), tokens: tokens.to_vec(), checkpoints, file_bytes: bytes };
        Ok((header, file))
    }

    fn read_entry(&self, path: &Path) -> Result<codec::DecodedEntry, ReadError> {
        let file = File::open(path).map_err(ReadError::from_io)?;
        let len = file.metadata().map_err(ReadError::Io)?.len();
        codec::decode(BufReader::with_capacity(IO_BUFFER, file), len, &self.identity).map_err(|e| match e {
            CodecError::Io(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                // The file shrank while being read: not a valid entry either way.
                ReadError::Codec(CodecError::Io(e))
            }
            CodecError::Io(e) => ReadError::Io(e),
            other => ReadError::Codec(other),
        })
    }

    /// Removes `*.nbpc-tmp` files no writer holds locked.
    fn remove_abandoned_temporaries(&self) -> Result<(), DiskCacheError> {
        for entry in fs::read_dir(&self.dir).map_err(io_err("list", &self.dir))? {
            let Ok(entry) = entry else { continue };
            let name = entry.file_name();
            if !name.to_str().is_some_and(|n| n.ends_with(TEMP_SUFFIX)) {
                continue;
            }
            let path = entry.path();
            let Ok(file) = File::open(&path) else { continue };
            match file.try_lock() {
                Ok(()) => {
                    tracing::info!(path = %path.display(), "prefix cache: removing an abandoned temporary");
                    remove_quietly(&path);
                }
                Err(fs::TryLockError::WouldBlock) => {}
                Err(fs::TryLockError::Error(e)) => {
                    tracing::warn!(path = %path.display(), "prefix cache: cannot check a temporary: {e}");
                }
            }
        }
        Ok(())
    }

    /// Brings the index in line with the directory: new or changed files get their header read (damaged ones are
    /// deleted with a warning), files gone are dropped.
    fn rescan(&self, index: &mut Index) -> Result<(), DiskCacheError> {
        let dir_modified = self.dir_modified();
        let mut seen: HashMap<String, Indexed> = HashMap::with_capacity(index.files.len());
        for entry in fs::read_dir(&self.dir).map_err(io_err("list", &self.dir))? {
            let Ok(entry) = entry else { continue };
            let Some(name) = entry.file_name().to_str().filter(|n| is_entry_name(n)).map(str::to_owned) else {
                continue;
            };
            let Ok(meta) = entry.metadata() else { continue }; // gone meanwhile
            let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            if let Some(old) = index.files.remove(&name)
                && old.bytes == meta.len()
            {
                seen.insert(name, Indexed { modified, ..old });
                continue;
            }
            let path = entry.path();
            let read = File::open(&path)
                .map_err(CodecError::Io)
                .and_then(|f| codec::read_header(BufReader::new(f), meta.len()));
            match read {
                Ok(h) => {
                    seen.insert(name, Indexed { bytes: meta.len(), header: Some(h), modified });
                }
                Err(CodecError::Version { found }) => {
                    tracing::debug!(path = %path.display(), "prefix cache: an entry of format version {found}");
                    seen.insert(name, Indexed { bytes: meta.len(), header: None, modified });
                }
                Err(CodecError::Io(e)) if e.kind() == io::ErrorKind::NotFound => {}
                Err(CodecError::Io(e)) => {
                    tracing::warn!(path = %path.display(), "prefix cache: skipping an unreadable entry: {e}");
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), "prefix cache: deleting a damaged entry: {e}");
                    remove_quietly(&path);
                }
            }
        }
        index.files = seen;
        index.dir_modified = dir_modified;
        Ok(())
    }

    /// Takes the least recently used entries (never `keep`) out of the index until the rest fit the bound;
    /// returns their names (the caller deletes them after releasing the lock).
    fn evict(&self, index: &mut Index, keep: Option<&str>) -> Vec<String> {
        let mut total: u64 = index.files.values().map(|f| f.bytes).sum();
        if total <= self.max_bytes {
            return Vec::new();
        }
        let mut order: Vec<(SystemTime, String, u64)> = index
            .files
            .iter()
            .filter(|(n, _)| Some(n.as_str()) != keep)
            .map(|(n, f)| (f.modified, n.clone(), f.bytes))
            .collect();
        order.sort();
        let mut victims = Vec::new();
        for (_, name, bytes) in order {
            if total <= self.max_bytes {
                break;
            }
            index.files.remove(&name);
            total -= bytes;
            victims.push(name);
        }
        victims
    }

    fn remove_files(&self, names: Vec<String>) {
        for n in names {
            remove_quietly(&self.dir.join(n));
        }
    }
}

/// Why an entry could not be read.
enum ReadError {
    /// The file is not there (any more).
    Gone,
    /// The file could not be read: it may be fine.
    Io(io::Error),
    /// The bytes are not a usable entry.
    Codec(CodecError),
}

impl ReadError {
    fn from_io(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::NotFound { Self::Gone } else { Self::Io(e) }
    }
}

/// Deletes a file; one already gone is fine, other failures are logged.
fn remove_quietly(path: &Path) {
    if let Err(e) = fs::remove_file(path)
        && e.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(path = %path.display(), "prefix cache: cannot delete: {e}");
    }
}
