//! Memory for the RAM tier and the SSD buffer pool: page-aligned anonymous allocations, locked with `mlock` when
//! the process may (RLIMIT_MEMLOCK, CAP_IPC_LOCK), and the headroom check against `/proc/meminfo`.
//!
//! The RAM tier is locked anonymous memory: unlike the page cache of a memory-mapped
//! file, the kernel never evicts it, so a RAM-tier expert never turns into an SSD read under memory pressure.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

/// Alignment of every buffer: a page, which is also what direct I/O asks of buffers.
pub const BUFFER_ALIGN: usize = 4096;

/// A zeroed, page-aligned heap buffer, optionally locked in RAM. Freed (and unlocked) on drop.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    locked: bool,
}

// SAFETY: the buffer is plain memory owned by this value; `&AlignedBuf` only reads it.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` zeroed bytes aligned to [`BUFFER_ALIGN`] (`len` is rounded up to a whole page; 0 becomes one page).
    ///
    /// Errors: the allocation fails (out of memory), as an `io::Error` of kind `OutOfMemory`.
    pub fn new(len: usize) -> std::io::Result<Self> {
        let len = len.max(1).div_ceil(BUFFER_ALIGN) * BUFFER_ALIGN;
        let layout = Layout::from_size_align(len, BUFFER_ALIGN)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::OutOfMemory, e.to_string()))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::OutOfMemory, format!("cannot allocate {len} bytes"))
        })?;
        Ok(Self { ptr, len, locked: false })
    }

    /// Locks the buffer in RAM (`mlock`). Errors: the kernel's refusal (`EPERM`, `ENOMEM` past RLIMIT_MEMLOCK).
    pub fn lock(&mut self) -> std::io::Result<()> {
        if self.locked {
            return Ok(());
        }
        // SAFETY: the range is this buffer's own allocation.
        if unsafe { libc::mlock(self.ptr.as_ptr().cast(), self.len) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        self.locked = true;
        Ok(())
    }

    /// Whether [`AlignedBuf::lock`] succeeded.
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// Length in bytes (a multiple of [`BUFFER_ALIGN`]).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (a buffer has at least one page); for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes, initialised (zeroed) at allocation.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: same pointer, length and layout as the allocation; munlock of a locked range cannot fail.
        unsafe {
            if self.locked {
                libc::munlock(self.ptr.as_ptr().cast(), self.len);
            }
            dealloc(self.ptr.as_ptr(), Layout::from_size_align_unchecked(self.len, BUFFER_ALIGN));
        }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes{})", self.len, if self.locked { ", locked" } else { "" })
    }
}

/// Whether buffers are locked, shared by every allocation of one placement: the first refusal turns locking off
/// (with one warning) so a large RAM tier does not try and fail for every layer.
#[derive(Debug)]
pub struct LockPolicy {
    wanted: bool,
    refused: AtomicBool,
    locked_bytes: std::sync::atomic::AtomicU64,
}

impl LockPolicy {
    /// Lock when `wanted`.
    pub fn new(wanted: bool) -> Self {
        Self { wanted, refused: AtomicBool::new(false), locked_bytes: Default::default() }
    }

    /// Allocates `len` bytes and locks them if wanted and still permitted; a refusal is logged once (with the
    /// fix) and the buffer is kept, unlocked.
    ///
    /// Errors: the allocation fails.
    pub fn alloc(&self, len: usize, what: &str) -> std::io::Result<AlignedBuf> {
        let mut buf = AlignedBuf::new(len)?;
        if self.wanted && !self.refused.load(Ordering::Relaxed) {
            match buf.lock() {
                Ok(()) => {
                    self.locked_bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    if !self.refused.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            "mlock of {:.1} MiB for {what} refused ({e}; RLIMIT_MEMLOCK {}): the RAM tier stays in \
                             unlocked anonymous memory, which the kernel may swap out. Raise the limit (`ulimit -l \
                             unlimited`, Docker `--ulimit memlock=-1`, or CAP_IPC_LOCK) to lock it",
                            buf.len() as f64 / (1 << 20) as f64,
                            memlock_limit().map_or("unknown".into(), |l| format!("{} KiB", l / 1024))
                        );
                    }
                }
            }
        }
        Ok(buf)
    }

    /// True while every buffer asked for so far was locked (false when locking was not wanted or refused).
    pub fn all_locked(&self) -> bool {
        self.wanted && !self.refused.load(Ordering::Relaxed)
    }

    /// Bytes locked so far.
    pub fn locked_bytes(&self) -> u64 {
        self.locked_bytes.load(Ordering::Relaxed)
    }
}

/// The soft RLIMIT_MEMLOCK, bytes (`None`: unlimited or unknown).
pub fn memlock_limit() -> Option<u64> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 || r.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(r.rlim_cur)
}

/// `MemAvailable` of `/proc/meminfo` in bytes, or `None` when the file or the line is missing.
pub fn mem_available() -> Option<u64> {
    parse_mem_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

/// `MemAvailable` of a meminfo text, bytes.
pub fn parse_mem_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line["MemAvailable:".len()..].trim().strip_suffix("kB")?.trim().parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_writable() {
        let mut b = AlignedBuf::new(5000).unwrap();
        assert_eq!(b.len(), 8192);
        assert_eq!(b.as_slice().as_ptr() as usize % BUFFER_ALIGN, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[4999] = 7;
        assert_eq!(b.as_slice()[4999], 7);
        // Locking one page is within any RLIMIT_MEMLOCK; if it is refused, the policy must say so.
        let p = LockPolicy::new(true);
        let l = p.alloc(4096, "test").unwrap();
        assert_eq!(l.is_locked(), p.all_locked());
    }

    #[test]
    fn meminfo_available_line_is_read() {
        let text = "MemTotal:       32612000 kB\nMemFree: 1 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(parse_mem_available(text), Some(20_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
    }
}
