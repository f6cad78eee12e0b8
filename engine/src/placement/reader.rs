//! Reading weight bytes from the model's files for the RAM and SSD tiers: direct I/O (`O_DIRECT`, aligned
//! buffers, no page cache) on the GGUF parts, a copy from memory for models held in memory (the embedded demo
//! model), and a fault-injecting wrapper for tests.
//!
//! A read names a part of the (possibly split) GGUF and an absolute byte range in it. [`read_span`] widens the
//! range to the reader's alignment, reads it into an aligned buffer and says where the wanted bytes landed; a
//! read that ends early (a truncated or replaced file) is an error naming the file, the offset and the length.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::gguf::GgufFile;

/// Where some bytes of the model live: part `part` (0-based) of the GGUF, bytes `offset..offset + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Part of a split model (0 for one file).
    pub part: usize,
    /// Absolute byte offset in that part.
    pub offset: u64,
    /// Length in bytes.
    pub len: usize,
}

impl Span {
    /// Bytes a buffer needs to read this span with `align`-aligned reads.
    pub fn padded_len(&self, align: usize) -> usize {
        let a = align.max(1) as u64;
        let start = self.offset / a * a;
        let end = (self.offset + self.len as u64).div_ceil(a) * a;
        (end - start) as usize
    }
}

/// A source of model bytes for the RAM and SSD tiers. Implementations must be usable from several I/O threads
/// at once.
pub trait WeightReader: Send + Sync {
    /// Reads part `part` from byte `offset` into `buf`, returning the bytes read (fewer only at the end of the
    /// file). `offset`, `buf.len()` and `buf`'s address are multiples of [`WeightReader::alignment`].
    ///
    /// Errors: the operating system's read error, or an unknown part.
    fn read_at(&self, part: usize, offset: u64, buf: &mut [u8]) -> std::io::Result<usize>;

    /// The alignment reads need (4096 for direct I/O, 1 for memory).
    fn alignment(&self) -> usize;

    /// The file behind `part`, for messages.
    fn part_name(&self, part: usize) -> String;

    /// One line for logs and the placement report, e.g. `direct I/O on 1 file`.
    fn describe(&self) -> String;

    /// True when reads bypass the page cache.
    fn direct(&self) -> bool;
}

/// A failed read of model bytes, with where it was reading.
#[derive(Debug, Clone, thiserror::Error)]
#[error("reading {len} bytes of {file} at byte {offset}: {detail}")]
pub struct ReadError {
    /// The file.
    pub file: String,
    /// Absolute offset of the wanted bytes.
    pub offset: u64,
    /// Wanted length.
    pub len: usize,
    /// The operating system's error, or what was short.
    pub detail: String,
}

/// Reads `span` into `buf` (whose address is aligned to the reader's alignment and which is at least
/// [`Span::padded_len`] long) and returns the range of `buf` holding the span's bytes.
///
/// Errors: [`ReadError`] for an I/O error or a file that ends before the span does.
pub fn read_span(reader: &dyn WeightReader, span: Span, buf: &mut [u8]) -> Result<std::ops::Range<usize>, ReadError> {
    let a = reader.alignment().max(1) as u64;
    let start = span.offset / a * a;
    let padded = span.padded_len(a as usize);
    let fail =
        |detail: String| ReadError { file: reader.part_name(span.part), offset: span.offset, len: span.len, detail };
    if buf.len() < padded || !(buf.as_ptr() as usize).is_multiple_of(a as usize) {
        return Err(fail(format!("internal: a buffer of {} bytes at a misaligned or short address", buf.len())));
    }
    let need = (span.offset - start) as usize + span.len;
    let mut done = 0usize;
    while done < need {
        let n =
            reader.read_at(span.part, start + done as u64, &mut buf[done..padded]).map_err(|e| fail(e.to_string()))?;
        if n == 0 {
            return Err(fail(format!(
                "the file ends at byte {} (truncated or replaced while serving?)",
                start + done as u64
            )));
        }
        done += n;
        // Direct I/O reads whole blocks: a short read off a block boundary is the end of the file.
        if done < need && a > 1 && !(done as u64).is_multiple_of(a) {
            return Err(fail(format!("the file ends at byte {}", start + done as u64)));
        }
    }
    let first = (span.offset - start) as usize;
    Ok(first..first + span.len)
}

/// Reads the GGUF's part files with `pread`, through direct I/O (`O_DIRECT`) when the file system allows it.
pub struct FileReader {
    files: Vec<(PathBuf, File)>,
    direct: bool,
}

/// Alignment of direct I/O: the largest logical block size in common use.
pub const DIRECT_IO_ALIGN: usize = 4096;

impl FileReader {
    /// Opens `paths` (the GGUF's parts, in order). With `direct`, each is opened with `O_DIRECT`; if a file system
    /// refuses it (tmpfs, some overlay setups), every part is opened normally and a warning says reads go through
    /// the page cache.
    ///
    /// Errors: a part cannot be opened (missing shard, permissions), naming the file.
    pub fn open(paths: &[&Path], direct: bool) -> Result<Self, ReadError> {
        let open = |p: &Path, flags: i32| {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new().read(true).custom_flags(flags).open(p)
        };
        let fail = |p: &Path, e: std::io::Error| ReadError {
            file: p.display().to_string(),
            offset: 0,
            len: 0,
            detail: format!("cannot open the model file: {e}"),
        };
        if direct {
            let mut files = Vec::new();
            let mut refused = None;
            for p in paths {
                match open(p, libc::O_DIRECT) {
                    Ok(f) => files.push((p.to_path_buf(), f)),
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        refused = Some((p.to_path_buf(), e));
                        break;
                    }
                    Err(e) => return Err(fail(p, e)),
                }
            }
            match refused {
                None => return Ok(Self { files, direct: true }),
                Some((p, e)) => tracing::warn!(
                    file = %p.display(),
                    "direct I/O is not available here ({e}); SSD-tier reads go through the page cache"
                ),
            }
        }
        let files = paths
            .iter()
            .map(|p| open(p, 0).map(|f| (p.to_path_buf(), f)).map_err(|e| fail(p, e)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { files, direct: false })
    }
}

impl WeightReader for FileReader {
    fn read_at(&self, part: usize, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        let (_, f) = self
            .files
            .get(part)
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("no part {part}")))?;
        loop {
            match f.read_at(buf, offset) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                other => return other,
            }
        }
    }
    fn alignment(&self) -> usize {
        if self.direct { DIRECT_IO_ALIGN } else { 1 }
    }
    fn part_name(&self, part: usize) -> String {
        self.files.get(part).map_or_else(|| format!("<part {part}>"), |(p, _)| p.display().to_string())
    }
    fn describe(&self) -> String {
        let n = self.files.len();
        let files = if n == 1 { "1 file".to_string() } else { format!("{n} files") };
        if self.direct { format!("direct I/O on {files}") } else { format!("buffered reads on {files}") }
    }
    fn direct(&self) -> bool {
        self.direct
    }
}

/// Copies from a GGUF held in memory ([`GgufFile::from_bytes`], the embedded demo model): the "SSD" of a model
/// that has no file. Also reads memory-mapped files (through the page cache) when direct I/O is not wanted.
pub struct MemoryReader {
    file: Arc<GgufFile>,
}

impl MemoryReader {
    /// Reads from `file`'s bytes.
    pub fn new(file: Arc<GgufFile>) -> Self {
        Self { file }
    }
}

impl WeightReader for MemoryReader {
    fn read_at(&self, part: usize, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        let bytes = self
            .file
            .part_bytes(part)
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("no part {part}")))?;
        let start = (offset as usize).min(bytes.len());
        let n = buf.len().min(bytes.len() - start);
        buf[..n].copy_from_slice(&bytes[start..start + n]);
        Ok(n)
    }
    fn alignment(&self) -> usize {
        1
    }
    fn part_name(&self, part: usize) -> String {
        self.file.part_paths().nth(part).map_or_else(|| format!("<part {part}>"), |p| p.display().to_string())
    }
    fn describe(&self) -> String {
        "copies from the model held in memory".into()
    }
    fn direct(&self) -> bool {
        false
    }
}

/// Wraps a reader and fails reads on demand (tests of the fault path; also usable to rehearse a failing disk).
pub struct FaultyReader {
    inner: Arc<dyn WeightReader>,
    fail_next: AtomicUsize,
    failed: AtomicUsize,
}

impl FaultyReader {
    /// Passes every read to `inner` until [`FaultyReader::fail_next`] is called.
    pub fn new(inner: Arc<dyn WeightReader>) -> Self {
        Self { inner, fail_next: AtomicUsize::new(0), failed: AtomicUsize::new(0) }
    }

    /// Makes the next `n` reads fail with an I/O error (`EIO`).
    pub fn fail_next(&self, n: usize) {
        self.fail_next.store(n, Ordering::SeqCst);
    }

    /// Reads failed so far.
    pub fn failed(&self) -> usize {
        self.failed.load(Ordering::SeqCst)
    }
}

impl WeightReader for FaultyReader {
    fn read_at(&self, part: usize, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        let take = self.fail_next.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
        if take {
            self.failed.fetch_add(1, Ordering::SeqCst);
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        self.inner.read_at(part, offset, buf)
    }
    fn alignment(&self) -> usize {
        self.inner.alignment()
    }
    fn part_name(&self, part: usize) -> String {
        self.inner.part_name(part)
    }
    fn describe(&self) -> String {
        format!("{} (fault injection)", self.inner.describe())
    }
    fn direct(&self) -> bool {
        self.inner.direct()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::memory::AlignedBuf;

    #[test]
    fn spans_read_through_direct_io_land_where_said_and_truncation_is_an_error() {
        let dir = tempdir();
        let path = dir.join("data.bin");
        let data: Vec<u8> = (0..20_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let r = FileReader::open(&[&path], true).unwrap();
        let span = Span { part: 0, offset: 4100, len: 9000 };
        let mut buf = AlignedBuf::new(span.padded_len(r.alignment())).unwrap();
        let at = read_span(&r, span, buf.as_mut_slice()).unwrap();
        assert_eq!(&buf.as_slice()[at], &data[4100..13100]);
        // The tail of the file, unaligned end.
        let tail = Span { part: 0, offset: 19_990, len: 10 };
        let at = read_span(&r, tail, buf.as_mut_slice()).unwrap();
        assert_eq!(&buf.as_slice()[at], &data[19_990..]);
        // Cut the file: the same read now fails, naming the file and where it ends.
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(10_000).unwrap();
        let e = read_span(&r, span, buf.as_mut_slice()).unwrap_err().to_string();
        assert!(e.contains("data.bin") && e.contains("at byte 4100") && e.contains("ends at byte"), "{e}");
        let faulty = FaultyReader::new(Arc::new(r));
        faulty.fail_next(1);
        let e = read_span(&faulty, tail, buf.as_mut_slice()).unwrap_err();
        assert!(e.detail.contains("os error 5"), "{e}");
        assert_eq!(faulty.failed(), 1);
        let missing = FileReader::open(&[&dir.join("nope.bin")], true).err().expect("a missing part is an error");
        assert!(missing.to_string().contains("nope.bin"), "{missing}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "nebula-reader-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
