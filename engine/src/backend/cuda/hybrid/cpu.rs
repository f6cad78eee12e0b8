//! The host side of hybrid decode's CPU experts: page-locked host buffers ([`Pinned`]) and the CPU thread that
//! computes a layer's CPU experts while the host enqueues the rest of the step ([`CpuThread`]).

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use nebula_kernels::cudarc::driver::{CudaStream, sys as driver_sys};

use super::super::CudaError;
use super::super::device::check;
use crate::model::Qwen4Exp;
use crate::model::moe::Routing;

/// Page-locked host memory (`cuMemHostAlloc`), the end points of the per-layer copies.
pub(crate) struct Pinned {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: plain host memory owned by this value; access is serialised by the `Mutex` around it.
unsafe impl Send for Pinned {}
unsafe impl Sync for Pinned {}

impl Pinned {
    pub(crate) fn new(len: usize) -> Result<Self, CudaError> {
        Self::with_flags(len, 0)
    }

    /// Pinned memory the GPU can address (`CU_MEMHOSTALLOC_DEVICEMAP`): (the buffer, its device address).
    fn mapped(len: usize) -> Result<(Self, u64), CudaError> {
        let p = Self::with_flags(len, driver_sys::CU_MEMHOSTALLOC_DEVICEMAP)?;
        let mut dptr: driver_sys::CUdeviceptr = 0;
        // SAFETY: `p` is a live mapped allocation.
        let r = unsafe { driver_sys::cuMemHostGetDevicePointer_v2(&mut dptr, p.addr(), 0) };
        check(r, "mapping pinned host memory")?;
        Ok((p, dptr))
    }

    fn with_flags(len: usize, flags: u32) -> Result<Self, CudaError> {
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        let bytes = len.max(1) * 4;
        // SAFETY: the driver writes the address of a fresh allocation of `bytes` into `p`.
        let r = unsafe { driver_sys::cuMemHostAlloc(&mut p, bytes, flags) };
        check(r, "allocating pinned host memory")?;
        // SAFETY: fresh allocation of `bytes`: zero it so every read is of initialised memory.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, bytes) };
        Ok(Self { ptr: p as *mut f32, len })
    }

    pub(crate) fn slice(&self, n: usize) -> &[f32] {
        // SAFETY: `n <= len` is checked; the memory is initialised by the copies that fill it before reading
        // (and f32 has no invalid bit patterns).
        assert!(n <= self.len);
        unsafe { std::slice::from_raw_parts(self.ptr, n) }
    }

    pub(crate) fn slice_mut(&mut self, n: usize) -> &mut [f32] {
        assert!(n <= self.len);
        // SAFETY: as above, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, n) }
    }

    pub(crate) fn addr(&self) -> *mut std::ffi::c_void {
        self.ptr as *mut std::ffi::c_void
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc and freed once.
        unsafe { driver_sys::cuMemFreeHost(self.ptr as *mut std::ffi::c_void) };
    }
}

/// How long the hybrid CPU thread and its MoE workers keep polling for the next layer's job before they sleep
/// (microseconds; [`crate::tuning::CpuTuning::spin_us`] overrides, 0 = block at once and use rayon's pool). Decode
/// hands the CPU one job per layer (~0.7-0.9 ms apart on a 12-layer model, ~0.2 ms of GPU work between one job's
/// end and the next one's start), so the threads never sleep during a request and start a job within microseconds;
/// waking sleeping threads cost 30 us for the hand-off and up to 150 us until the 14th MoE worker ran, a layer
/// (H200 machine, NEBULA_CPU_MOE_TRACE). Between requests they sleep after this long.
const CPU_SPIN_US: u64 = 2000;

/// One layer's CPU experts, handed to the CPU thread.
struct Job {
    layer: usize,
    x: Vec<f32>,
    n: usize,
    routing: Vec<Routing>,
    seq: u32,
    /// When the host thread sent it (for `NEBULA_CPU_MOE_TRACE`).
    sent: std::time::Instant,
}

/// The CPU thread of pipelined hybrid decode: it computes a layer's CPU experts, writes their weighted sum into
/// the pinned upload buffer and then the job's sequence number into a pinned flag the GPU stream waits on
/// (`cuStreamWaitValue32`), so the host thread enqueues the next layer's kernels while the CPU computes, and no
/// thread waits for the other but through the GPU's event and the flag.
pub(crate) struct CpuThread {
    tx: Option<std::sync::mpsc::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Device address of the flag.
    pub(crate) flag_dev: u64,
    _flag: Pinned,
    /// Where the thread writes each job's result (`[n, d]` f32).
    pub(crate) upload: Pinned,
    /// The first error of a job since the last [`CpuThread::take_error`] (the flag is written anyway).
    error: Arc<Mutex<Option<crate::model::ModelError>>>,
    seq: std::sync::atomic::AtomicU32,
}

impl CpuThread {
    pub(crate) fn start(model: Arc<Qwen4Exp>, max_values: usize, cpu_ns: Arc<AtomicU64>) -> Result<Self, CudaError> {
        let (flag, flag_dev) = Pinned::mapped(1)?;
        let upload = Pinned::new(max_values)?;
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let error: Arc<Mutex<Option<crate::model::ModelError>>> = Arc::default();
        let (flag_addr, upload_addr) = (flag.ptr as usize, upload.ptr as usize);
        let err = error.clone();
        let thread = std::thread::Builder::new()
            .name("nebula-hybrid-cpu".into())
            .spawn(move || {
                // An earlier attempt kept rayon's whole pool spinning between layers and measured slower (75-77
                // against 79-81 tok/s on the H200's 16 cores: the spinning threads took the cores the host and
                // driver need); the spinning pool has one participant fewer (this thread is one of them) and
                // sleeps between requests (12 GB profile at 4K: 95.9 -> 118.9 tok/s in one run).
                crate::quant::spin_pool::set_spin(CPU_SPIN_US);
                let spin = std::time::Duration::from_micros(crate::quant::spin_pool::spin_us());
                loop {
                    // The next layer's job arrives ~0.2 ms after the last one during decode: poll that long
                    // before blocking, so the hand-off costs no thread wake-up.
                    let since = std::time::Instant::now();
                    let job = loop {
                        match rx.try_recv() {
                            Ok(job) => break Some(job),
                            Err(std::sync::mpsc::TryRecvError::Disconnected) => break None,
                            Err(std::sync::mpsc::TryRecvError::Empty) if since.elapsed() < spin => {
                                std::hint::spin_loop()
                            }
                            Err(std::sync::mpsc::TryRecvError::Empty) => break rx.recv().ok(),
                        }
                    };
                    let Some(job) = job else { break };
                    let t = std::time::Instant::now();
                    if crate::quant::moe::trace::enabled() {
                        crate::quant::moe::trace::handoff((t - job.sent).as_nanos() as u64);
                    }
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        model.cpu_routed(job.layer, &job.x, job.n, &job.routing)
                    }));
                    let took = t.elapsed().as_nanos() as u64;
                    cpu_ns.fetch_add(took, std::sync::atomic::Ordering::Relaxed);
                    if crate::quant::moe::trace::enabled() {
                        crate::quant::moe::trace::job(took);
                    }
                    let failure = match result {
                        Ok(Ok(y)) if y.len() <= max_values => {
                            // SAFETY: the upload buffer holds `max_values` f32 and outlives this thread (joined
                            // before it is freed); the GPU reads it only after the flag below.
                            unsafe { std::ptr::copy_nonoverlapping(y.as_ptr(), upload_addr as *mut f32, y.len()) };
                            None
                        }
                        Ok(Ok(_)) => Some(crate::model::ModelError::WeightRead {
                            what: format!("layer {}", job.layer),
                            detail: "hybrid: the CPU result is larger than its buffer (internal error)".into(),
                        }),
                        Ok(Err(e)) => Some(e),
                        Err(_) => Some(crate::model::ModelError::WeightRead {
                            what: format!("layer {}", job.layer),
                            detail: "hybrid: the CPU expert computation panicked (internal error)".into(),
                        }),
                    };
                    if let Some(e) = failure {
                        let mut slot = err.lock().unwrap_or_else(|p| p.into_inner());
                        slot.get_or_insert(e);
                    }
                    // The result is written before the flag; the GPU stream waits for the flag.
                    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
                    // SAFETY: the flag is a live pinned u32 owned by the CpuThread, which joins this thread first.
                    unsafe { std::ptr::write_volatile(flag_addr as *mut u32, job.seq) };
                }
            })
            .map_err(|e| CudaError::Unsupported(format!("starting the hybrid CPU thread: {e}")))?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            flag_dev,
            _flag: flag,
            upload,
            error,
            seq: std::sync::atomic::AtomicU32::new(0),
        })
    }

    /// Hands layer `layer`'s CPU experts to the thread and makes `stream` wait until their sum is in
    /// [`CpuThread::upload`] (stream order: what is enqueued after this runs after the CPU finished).
    pub(crate) fn submit(
        &self,
        stream: &CudaStream,
        layer: usize,
        x: Vec<f32>,
        n: usize,
        routing: Vec<Routing>,
    ) -> Result<(), CudaError> {
        let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed).wrapping_add(1);
        let tx = self.tx.as_ref().ok_or_else(|| CudaError::Unsupported("the hybrid CPU thread stopped".into()))?;
        tx.send(Job { layer, x, n, routing, seq, sent: std::time::Instant::now() })
            .map_err(|_| CudaError::Unsupported("the hybrid CPU thread stopped".into()))?;
        // SAFETY: the flag's device address is live while `self` is; EQ on a value the thread writes exactly once
        // for this job (the next job is only submitted after the GPU passed this wait).
        let r = unsafe {
            driver_sys::cuStreamWaitValue32_v2(
                stream.cu_stream(),
                self.flag_dev,
                seq,
                driver_sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32,
            )
        };
        check(r, "making the GPU wait for the CPU experts")
    }

    /// The first error of a job since the last call.
    pub(crate) fn take_error(&self) -> Option<crate::model::ModelError> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

impl Drop for CpuThread {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
