//! The attention caches of a sequence on the device (`crate::model::kv_cache` on the CPU: the same types and the
//! same row bytes), and the hot window that keeps long contexts out of VRAM.
//!
//! **Types.** K, V and the indexer's raw keys and pooled block keys hold rows of the model's
//! [`KvCacheType`] (`f32`, `f16`, `q8_0`, `q4_0`; the indexer keys in [`KvCacheType::index_key_type`]), written by
//! `kv_store_rows_*` and `qsa_pool_new_*` (kernels/cuda/attention.cu) with the CPU's quantizers bit for bit, and read
//! by the attention and QSA score kernels of the same type. A host image of the caches is their bytes, the
//! CPU's [`KvRows`] layout.
//!
//! **Hot window.** With a window of `W` tokens ([`crate::tuning::CudaTuning::kv_window`]) a QSA layer of a
//! sequence longer than `W` keeps only a ring of `W` rows of K, V and raw indexer keys in VRAM (row `j` in slot
//! `j % W`) and every row in pinned host memory mapped into the device's address space ([`MappedHost`]):
//! `kv_store_rows_*` writes each new row to both. The pooled block keys, which every query scores, stay in VRAM
//! (a quarter of the rows, an eighth of K's bytes at `q8_0`). A pass over `n` rows ending at `end` reads the keys
//! below `cold_end = ceil_r(end - W)` from a position-indexed staging buffer shared by all layers and sequences
//! ([`ColdStaging`], one layer's K and V for the longest windowed state): a decode-sized pass (up to
//! [`GATHER_MAX_ROWS`] rows) copies only the blocks its QSA selection picked below `cold_end` (`kv_cold_gather`,
//! right after `qsa_select`, reading the mapped host memory); a prefill chunk copies the whole cold prefix with
//! one DMA copy on a copy stream, started as soon as the layer before it has read the staging buffer, so it
//! overlaps that layer's MoE and the Gated DeltaNet layers in between. The keys read are the same bytes in the
//! same order as with every row in VRAM, so the tokens are the same bit for bit. A sequence cut back
//! ([`crate::backend::Backend::restore`], an MTP rollback) refills the slots later rows overwrote from the host
//! copy (`kv_ring_fill`).
//!
//! Dense attention (the MTP block) reads every key on every step and is never windowed.

use nebula_kernels::cudarc::driver::{CudaSlice, sys as driver_sys};

use super::CudaError;
use super::device::{Dev, check};
use crate::model::KvCacheType;

/// Decode-sized passes (a decode step, an MTP verify chain, a batch's rows of one sequence) gather the selected
/// cold blocks; longer passes copy the whole cold prefix.
pub(crate) const GATHER_MAX_ROWS: usize = 64;

/// The kernel-name suffix of a cache type (`kv_store_rows_q8_0`, `attention_part_f16`, ...).
pub(crate) fn kv_suffix(ty: KvCacheType) -> &'static str {
    ty.name()
}

/// Pinned host memory mapped into the device's address space (`cuMemHostAlloc` with
/// `CU_MEMHOSTALLOC_DEVICEMAP`): kernels read and write it over PCIe through [`MappedHost::device_addr`], the
/// host through [`MappedHost::slice`]. Not zeroed: only rows written before are ever read.
pub(crate) struct MappedHost {
    ptr: *mut u8,
    len: usize,
    dptr: u64,
}

// SAFETY: plain host memory owned by this value; the device writes it only through kernels ordered on the
// model's one stream, which the host synchronises with before reading it.
unsafe impl Send for MappedHost {}
unsafe impl Sync for MappedHost {}

impl MappedHost {
    /// `len` bytes (at least one).
    ///
    /// Errors: the driver cannot pin that much (reported as out of memory, naming the size).
    pub(crate) fn new(len: usize) -> Result<Self, CudaError> {
        let bytes = len.max(1);
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the driver writes the address of a fresh allocation of `bytes` into `p`.
        let r = unsafe { driver_sys::cuMemHostAlloc(&mut p, bytes, driver_sys::CU_MEMHOSTALLOC_DEVICEMAP) };
        if r != driver_sys::CUresult::CUDA_SUCCESS {
            return Err(CudaError::Gpu(nebula_kernels::GpuError::OutOfMemory {
                what: format!("the host copy of a KV cache ({} MiB of pinned memory)", bytes >> 20),
                needed_mib: (bytes >> 20) as u64,
                free_mib: 0,
                budget_mib: 0,
            }));
        }
        let mut dptr: driver_sys::CUdeviceptr = 0;
        // SAFETY: `p` is a live mapped allocation.
        let r = unsafe { driver_sys::cuMemHostGetDevicePointer_v2(&mut dptr, p, 0) };
        if let Err(e) = check(r, "mapping pinned host memory") {
            // SAFETY: allocated just above, freed once.
            unsafe { driver_sys::cuMemFreeHost(p) };
            return Err(e);
        }
        Ok(Self { ptr: p as *mut u8, len: bytes, dptr })
    }

    /// The device address of byte `offset`.
    pub(crate) fn device_addr(&self, offset: usize) -> u64 {
        self.dptr + offset as u64
    }

    /// The first `n` bytes (which the caller has written, or had a kernel write and synchronised since).
    pub(crate) fn slice(&self, n: usize) -> &[u8] {
        assert!(n <= self.len);
        // SAFETY: in bounds; u8 has no invalid bit patterns, and the callers read only rows written before.
        unsafe { std::slice::from_raw_parts(self.ptr, n) }
    }

    /// The first `n` bytes, for writing from the host.
    pub(crate) fn slice_mut(&mut self, n: usize) -> &mut [u8] {
        assert!(n <= self.len);
        // SAFETY: as above, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, n) }
    }

    /// Bytes allocated.
    pub(crate) fn size(&self) -> usize {
        self.len
    }

    /// The host address of byte `offset`.
    pub(crate) fn host_ptr(&self, offset: usize) -> *const u8 {
        assert!(offset <= self.len);
        // SAFETY: within the allocation.
        unsafe { self.ptr.add(offset) }
    }
}

impl Drop for MappedHost {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc and freed once. Kernels that used it were ordered before the last
        // synchronisation of its owner's stream (states are dropped between passes).
        unsafe { driver_sys::cuMemFreeHost(self.ptr as *mut std::ffi::c_void) };
    }
}

/// The host copies of one windowed layer's K, V and raw indexer keys, every row of the state's capacity.
pub(crate) struct HostKv {
    pub(crate) k: MappedHost,
    pub(crate) v: MappedHost,
    pub(crate) index_k: MappedHost,
}

/// The staging buffers of cold K and V rows (see the module docs): position-indexed, sized for the longest
/// windowed state made so far. Growing them moves them, so captured graphs that read the old ones are recaptured
/// (the arena's generation changes).
#[derive(Default)]
pub(crate) struct ColdStaging {
    pub(crate) k: Option<CudaSlice<u8>>,
    pub(crate) v: Option<CudaSlice<u8>>,
    pub(crate) bytes: usize,
    /// A copy stream and its events for prefill's bulk copies (made with the first windowed state).
    pub(crate) copy: Option<CopyLane>,
}

/// The copy stream of prefill's cold-prefix copies, with the events that order it against the model's stream:
/// `read` (the staging buffer's last reader has run) and `ready` (the copy is done).
pub(crate) struct CopyLane {
    pub(crate) stream: std::sync::Arc<nebula_kernels::cudarc::driver::CudaStream>,
    pub(crate) read: nebula_kernels::cudarc::driver::CudaEvent,
    pub(crate) ready: nebula_kernels::cudarc::driver::CudaEvent,
    /// What the copy in flight holds: (the host K buffer's device address, rows), so a layer finds its prefetch.
    pub(crate) pending: Option<(u64, usize)>,
}

impl ColdStaging {
    /// Makes room for `bytes` a buffer (K and V alike); true when the buffers moved.
    ///
    /// Errors: device memory.
    pub(crate) fn reserve(&mut self, dev: &Dev, bytes: usize) -> Result<bool, CudaError> {
        if self.copy.is_none() {
            let stream = dev.gpu.ctx.new_stream()?;
            let flags = Some(driver_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
            self.copy = Some(CopyLane {
                stream,
                read: dev.gpu.ctx.new_event(flags)?,
                ready: dev.gpu.ctx.new_event(flags)?,
                pending: None,
            });
        }
        if bytes <= self.bytes && self.k.is_some() {
            return Ok(false);
        }
        // Free first, then allocate: the old and new buffers never need to coexist.
        dev.stream().synchronize()?;
        self.k = None;
        self.v = None;
        self.k = Some(dev.stream().alloc_zeros::<u8>(bytes.max(16))?);
        self.v = Some(dev.stream().alloc_zeros::<u8>(bytes.max(16))?);
        self.bytes = bytes;
        Ok(true)
    }

    /// Device bytes held.
    pub(crate) fn held(&self) -> usize {
        2 * self.k.as_ref().map_or(0, |_| self.bytes.max(16))
    }
}

impl super::launch::Launch {
    /// Grows the shared staging buffers to `bytes` each (a windowed state's capacity times its K row); when they
    /// move, captured graphs are recaptured (the arena's generation changes). Called when a state is made, never
    /// inside a pass.
    ///
    /// Errors: device memory.
    pub(crate) fn reserve_cold_rows(&self, bytes: usize) -> Result<(), CudaError> {
        let moved = self.cold.lock().expect("staging lock").reserve(&self.dev, bytes)?;
        if moved {
            self.arena.lock().expect("arena lock").generation += 1;
        }
        Ok(())
    }

    /// The device addresses of the staging buffers of cold K and V rows (0 before any windowed state).
    pub(crate) fn cold_rows(&self) -> (u64, u64) {
        let c = self.cold.lock().expect("staging lock");
        match (&c.k, &c.v) {
            (Some(k), Some(v)) => (self.addr(k, 0), self.addr(v, 0)),
            _ => (0, 0),
        }
    }

    /// Makes the first `rows` rows of `st`'s K and V readable in the staging buffers for a prefill pass: the
    /// copy prefetched for it on the copy stream when there is one (the model's stream waits for it), else one
    /// DMA copy each on the model's stream. Any other prefetch in flight is waited for first (it writes the same
    /// buffers).
    ///
    /// Errors: a copy or a wait failed.
    pub(crate) fn copy_cold(
        &self,
        st: &super::self_attn::AttnState,
        rows: usize,
        kv_row: usize,
    ) -> Result<(), CudaError> {
        let Some(h) = st.host.as_ref() else { return Ok(()) };
        let mut c = self.cold.lock().expect("staging lock");
        let main = self.dev.stream();
        if let Some(lane) = c.copy.as_mut()
            && let Some(pending) = lane.pending.take()
        {
            main.wait(&lane.ready)?;
            if pending == (h.k.device_addr(0), rows) {
                return Ok(());
            }
        }
        if rows == 0 {
            return Ok(());
        }
        let (k, v) = match (&c.k, &c.v) {
            (Some(k), Some(v)) => (self.addr(k, 0), self.addr(v, 0)),
            _ => return Err(CudaError::Unsupported("a windowed KV cache without staging buffers".into())),
        };
        super::device::htod(main, k, h.k.host_ptr(0), rows * kv_row)?;
        super::device::htod(main, v, h.v.host_ptr(0), rows * kv_row)
    }

    /// Starts copying the cold prefix of `next` (the next windowed attention layer's cache of the one sequence of
    /// a prefill pass over `n` rows from `pos`, blocks of `ratio` keys) into the staging buffers on the copy
    /// stream, after everything enqueued so far on the model's stream (the layer that just read them), so the
    /// copy overlaps the layers in between; [`Self::copy_cold`] waits for it there.
    ///
    /// Errors: a copy or an event failed.
    pub(crate) fn prefetch_cold(
        &self,
        next: &super::self_attn::AttnState,
        pos: usize,
        n: usize,
        ratio: usize,
        kv_row: usize,
    ) -> Result<(), CudaError> {
        let Some(h) = next.host.as_ref() else { return Ok(()) };
        if n <= GATHER_MAX_ROWS {
            return Ok(());
        }
        let rows = super::self_attn::cold_end(pos + n, next.ring, ratio);
        if rows == 0 {
            return Ok(());
        }
        let mut c = self.cold.lock().expect("staging lock");
        let (k, v) = match (&c.k, &c.v) {
            (Some(k), Some(v)) => (self.addr(k, 0), self.addr(v, 0)),
            _ => return Ok(()),
        };
        let main = self.dev.stream();
        let Some(lane) = c.copy.as_mut() else { return Ok(()) };
        if lane.pending.take().is_some() {
            main.wait(&lane.ready)?;
        }
        lane.read.record(main)?;
        lane.stream.wait(&lane.read)?;
        super::device::htod(&lane.stream, k, h.k.host_ptr(0), rows * kv_row)?;
        super::device::htod(&lane.stream, v, h.v.host_ptr(0), rows * kv_row)?;
        lane.ready.record(&lane.stream)?;
        lane.pending = Some((h.k.device_addr(0), rows));
        Ok(())
    }

    /// Waits on the model's stream for a prefetch still in flight (a pass that failed before it used it), so
    /// nothing later races its writes into the staging buffers.
    ///
    /// Errors: the wait could not be enqueued.
    pub(crate) fn settle_cold(&self) -> Result<(), CudaError> {
        let mut c = self.cold.lock().expect("staging lock");
        if let Some(lane) = c.copy.as_mut()
            && lane.pending.take().is_some()
        {
            self.dev.stream().wait(&lane.ready)?;
        }
        Ok(())
    }
}
