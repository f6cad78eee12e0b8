//! The hybrid GPU + CPU backend (SPEC 3.1-3.4): the dense trunk and each layer's GPU-tier experts (the expert
//! cache, X per layer, from the placement) live on the GPU; every other routed expert stays in host RAM (or on
//! SSD) with the CPU model.
//!
//! - **Decode and short batches** (up to [`HybridParams::cpu_max_tokens`] tokens, chosen at load by measured
//!   cost, [`crossover_tokens`]): per layer the GPU runs the
//!   token mixer, the router, the shared expert and the resident experts; `hybrid_split` (kernels/cuda/moe.cu)
//!   decides per token which experts the CPU runs (expert handoff below the coverage fraction, optional
//!   marginal-expert omission) and packs the MoE input, expert ids and CPU weights into one buffer. One copy
//!   goes to the host, the CPU computes its experts (RAM tier, SSD tier with prefetch) while the GPU computes the
//!   shared and resident experts, and one copy of the weighted CPU sum comes back into `moe_combine`.
//! - **Prefill** (longer batches): the experts the GPU does not hold are streamed over PCIe from the RAM tier
//!   (registered with the driver, so the copies are DMA at full speed) into two staging buffers of
//!   [`HybridParams::stage_experts`] experts (a ring of [`HybridParams::stages`]) on a copy stream, while the
//!   compute stream runs the grouped expert kernels on the filled ones; the host never waits, so transfers
//!   overlap the previous groups' experts and the next layer's token mixer.
//!
//! Decode is pipelined: a CPU thread ([`CpuThread`]) computes a layer's CPU experts while the host thread
//! enqueues the rest of the step, the GPU stream waiting on a host flag (`cuStreamWaitValue32`) before it copies
//! the result in, so kernel launches overlap the CPU's work.
//!
//! The staging buffers and pinned host buffers are allocated at load, inside the VRAM budget check.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use nebula_kernels::cudarc::driver::{CudaEvent, CudaSlice, CudaStream, sys as driver_sys};

use super::CudaError;
use super::ops::{Dev, ptr};
use crate::model::Qwen4Exp;
use crate::model::moe::Routing;
use crate::placement::{PlacementStats, Tier};

/// Settings of the hybrid backend.
#[derive(Debug, Clone, Copy)]
pub struct HybridParams {
    /// Expert handoff: below this coverage of a token's router weight by GPU-resident experts, the token's
    /// routed MoE for the layer runs on the CPU (SPEC 3.3; 0.9).
    pub handoff: f32,
    /// Marginal omission: the lightest CPU experts of a token are dropped while their summed weight stays within
    /// this fraction (0 = strict).
    pub omit: f32,
    /// Batches up to this many tokens run their non-resident experts on the CPU; longer ones stream the experts
    /// to the GPU. 0 (the default; `NEBULA_HYBRID_CPU_MAX_TOKENS` fixes it) chooses at load by measured cost
    /// ([`crossover_tokens`]): PCIe upload bandwidth and DRAM read bandwidth measured on this machine.
    pub cpu_max_tokens: usize,
    /// Experts per staging buffer for streamed prefill (`NEBULA_HYBRID_STAGE_EXPERTS`, default 32).
    pub stage_experts: usize,
    /// Staging buffers in the ring (at least 2; `NEBULA_HYBRID_STAGES`, default 6: about 0.5 GiB of 2.6 MiB
    /// experts, inside the ~1 GB the 12 GB profile leaves free). The copy stream runs up to this many groups
    /// minus one ahead of the experts' kernels, across layer boundaries, so transfers overlap the next layer's
    /// token mixer too.
    pub stages: usize,
    /// MTP verify passes hand a low-coverage row's experts to the CPU like a decode step (every row exact,
    /// coverage 1) instead of verifying it with the resident experts only and reporting it for case B (SPEC §4,
    /// the default). `NEBULA_MTP_VERIFY_HANDOFF=1`.
    pub verify_handoff: bool,
}

impl HybridParams {
    /// From the model's placement, with the environment overrides of the two tuning knobs.
    pub fn for_model(model: &Qwen4Exp) -> Self {
        let (handoff, omit) = model.hybrid_fractions();
        let env =
            |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).filter(|&v| v > 0).unwrap_or(d);
        Self {
            handoff,
            omit,
            cpu_max_tokens: env("NEBULA_HYBRID_CPU_MAX_TOKENS", 0),
            stage_experts: env("NEBULA_HYBRID_STAGE_EXPERTS", 32),
            stages: env("NEBULA_HYBRID_STAGES", 6).max(2),
            verify_handoff: std::env::var("NEBULA_MTP_VERIFY_HANDOFF").is_ok_and(|v| v == "1"),
        }
    }
}

/// The CPU MoE kernel's share of the DRAM read bandwidth on batch-1 decode (measured on the H200 machine's 14
/// threads, with the spinning pool of `quant::spin_pool`: 57 of 90 GB/s; 40 of 81-104 before it), used to predict
/// the CPU path's cost from the measured bandwidth.
const CPU_EXPERT_EFFICIENCY: f64 = 0.6;

/// Largest batch the CPU path takes (the pinned buffers are sized for it).
const CPU_PATH_MAX_TOKENS: usize = 512;

/// The batch size up to which a layer's non-resident experts cost less on the CPU than streamed to the GPU, from
/// measured bandwidths (bytes/s): streaming moves the `streamed` non-resident experts of a layer over PCIe
/// whatever the batch; the CPU reads each expert the batch uses, `E (1 - (1 - k/E)^n)` of them for `n` tokens
/// routed uniformly (more skewed routing uses fewer, so this errs towards streaming), at `cpu_bw`. Clamped to
/// `[1, 512]`.
pub fn crossover_tokens(n_expert: usize, top_k: usize, streamed: usize, pcie_bw: f64, cpu_bw: f64) -> usize {
    let e = n_expert as f64;
    let affordable = streamed as f64 * cpu_bw / pcie_bw.max(1.0); // experts the CPU reads while PCIe moves all
    if affordable >= e * 0.999 {
        return CPU_PATH_MAX_TOKENS;
    }
    let n = (1.0 - affordable / e).ln() / (1.0 - top_k as f64 / e).ln();
    (n.floor() as usize).clamp(1, CPU_PATH_MAX_TOKENS)
}

/// Page-locked host memory (`cuMemHostAlloc`), the end points of the per-layer copies.
pub(crate) struct Pinned {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: plain host memory owned by this value; access is serialised by the `Mutex` around it.
unsafe impl Send for Pinned {}
unsafe impl Sync for Pinned {}

impl Pinned {
    fn new(len: usize) -> Result<Self, CudaError> {
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

pub(crate) fn check(r: driver_sys::CUresult, what: &str) -> Result<(), CudaError> {
    if r == driver_sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Gpu(nebula_kernels::GpuError::Driver(format!("{what}: {r:?}"))))
    }
}

/// One layer's expert cache map.
pub(crate) struct HybridLayer {
    /// `[n_expert]`: slot in the layer's resident stacks, or -1.
    pub(crate) slot_of: CudaSlice<i32>,
    /// Slot -> expert id.
    pub(crate) resident: Vec<usize>,
    /// The same on the device (at least one entry).
    pub(crate) resident_dev: CudaSlice<i32>,
    /// Experts not on the GPU, ascending.
    pub(crate) streamed: Vec<usize>,
    /// The same on the device (at least one entry).
    pub(crate) streamed_dev: CudaSlice<i32>,
}

/// A staging buffer of streamed prefill: `stage_experts` experts' gate, up and down matrices.
pub(crate) struct Stage {
    pub(crate) gate: CudaSlice<u8>,
    pub(crate) up: CudaSlice<u8>,
    pub(crate) down: CudaSlice<u8>,
    /// Recorded on the copy stream when the buffer is filled.
    pub(crate) ready: CudaEvent,
    /// Recorded on the compute stream when the kernels reading the buffer are queued.
    pub(crate) free: CudaEvent,
}

/// Host buffers of the per-layer round trip.
pub(crate) struct HostBufs {
    pub(crate) pack: Pinned,
    pub(crate) upload: Pinned,
}

/// How long the hybrid CPU thread and its MoE workers keep polling for the next layer's job before they sleep
/// (microseconds; `NEBULA_CPU_SPIN_US` overrides, 0 = block at once and use rayon's pool). Decode hands the CPU
/// one job per layer (~0.7-0.9 ms apart on a 12-layer model, ~0.2 ms of GPU work between one job's end and the
/// next one's start), so the threads never sleep during a request and start a job within microseconds; waking
/// sleeping threads cost 30 us for the hand-off and up to 150 us until the 14th MoE worker ran, a layer (H200
/// machine, NEBULA_CPU_MOE_TRACE). Between requests they sleep after this long.
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
    fn start(model: Arc<Qwen4Exp>, max_values: usize, cpu_ns: Arc<AtomicU64>) -> Result<Self, CudaError> {
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

/// One streamed expert group's events (copies start, copies end, kernels start, kernels end) and bytes copied.
pub(crate) type GroupTiming = ([CudaEvent; 4], usize);

/// Sums a streamed-prefill timeline ([`Hybrid::copy_log`]): copy-stream busy time and rate, kernel time of the
/// streamed groups, the time the copy stream waited for a free staging buffer and the compute stream for a
/// group's weights, and the span from the first copy to the last kernel. `None` when empty. Synchronises on
/// the events.
pub(crate) fn copy_report(log: &[GroupTiming]) -> Result<Option<String>, CudaError> {
    let (Some(first), Some(last)) = (log.first(), log.last()) else { return Ok(None) };
    let ms = |a: &CudaEvent, b: &CudaEvent| -> Result<f64, CudaError> { Ok(a.elapsed_ms(b)? as f64) };
    let (mut copy, mut kernels, mut copy_idle, mut compute_idle, mut bytes) = (0.0, 0.0, 0.0, 0.0, 0usize);
    for (i, (ev, b)) in log.iter().enumerate() {
        copy += ms(&ev[0], &ev[1])?;
        kernels += ms(&ev[2], &ev[3])?;
        bytes += b;
        if i > 0 {
            let prev = &log[i - 1].0;
            copy_idle += ms(&prev[1], &ev[0])?.max(0.0);
            compute_idle += ms(&prev[3], &ev[2])?.max(0.0);
        }
    }
    let span = ms(&first.0[0], &last.0[3])?;
    Ok(Some(format!(
        "streamed prefill, {} expert groups: span {span:.1} ms; copies {copy:.1} ms busy ({:.1} GB/s), {copy_idle:.1} ms \
         between groups; streamed expert kernels {kernels:.1} ms, {compute_idle:.1} ms between groups (the rest of \
         the layers and the waits for weights)",
        log.len(),
        bytes as f64 / (copy.max(1e-6) * 1e6)
    )))
}

/// The host half of the hybrid backend.
pub(crate) struct Hybrid {
    /// The CPU model (placed), for the experts the GPU does not hold.
    pub(crate) host: Arc<Qwen4Exp>,
    pub(crate) layers: Vec<HybridLayer>,
    pub(crate) params: HybridParams,
    pub(crate) bufs: Mutex<HostBufs>,
    /// Recorded after the device-to-host copy of a layer's pack (timing enabled).
    pub(crate) packed: CudaEvent,
    /// Recorded where the GPU's serial work resumes (the step's start, or after the wait for a layer's CPU
    /// experts); `packed - resumed` is the GPU's share of the step's critical path (timing enabled).
    pub(crate) resumed: CudaEvent,
    /// `resumed` was recorded in this step.
    pub(crate) resumed_live: std::sync::atomic::AtomicBool,
    /// Nanoseconds of GPU critical-path work measured by the two events.
    pub(crate) gpu_ns: AtomicU64,
    /// The copy stream of streamed prefill.
    pub(crate) copy: Arc<CudaStream>,
    pub(crate) stages: Vec<Stage>,
    /// Staging buffers used so far (the next one is `count % stages`).
    pub(crate) stage_turn: std::sync::atomic::AtomicUsize,
    /// Host ranges registered with the driver (unregistered on drop).
    registered: Vec<usize>,
    /// Bytes of the RAM tier registered with the driver (uploads from there are DMA at full speed).
    pub(crate) registered_bytes: usize,
    pub(crate) stats: Arc<PlacementStats>,
    /// The CPU thread of pipelined decode; `None` where the driver refuses stream waits on host memory (then the
    /// host thread computes the CPU experts itself, between two synchronisations).
    pub(crate) cpu: Option<CpuThread>,
    /// Nanoseconds the CPU spent on its experts, the host spent waiting for the GPU's pack, and round trips.
    pub(crate) cpu_ns: Arc<AtomicU64>,
    pub(crate) wait_ns: AtomicU64,
    /// Streamed prefill's timeline when `NEBULA_CUDA_PROFILE=copies`: per expert group, events at the start and
    /// end of its copies (copy stream) and of its kernels (compute stream), with the bytes copied.
    pub(crate) copy_log: Option<Mutex<Vec<GroupTiming>>>,
    pub(crate) trips: AtomicU64,
}

/// Where the time of hybrid steps went (since the last [`super::CudaModel::take_hybrid_times`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct HybridTimes {
    /// Seconds the CPU computed routed experts.
    pub cpu_s: f64,
    /// Seconds the host waited for the GPU (its layer work before the split and the copy; when pipelined, also
    /// the CPU's work on the previous layer).
    pub wait_s: f64,
    /// Seconds of GPU work on the step's critical path (CUDA events: from the step's start or the end of the
    /// wait for a layer's CPU experts to the next layer's pack; the head after the last layer is not counted).
    pub gpu_s: f64,
    /// Per-layer round trips (one copy each way).
    pub trips: u64,
}

impl Drop for Hybrid {
    fn drop(&mut self) {
        // The driver calls here and in the fields' drops (pinned memory) need this context current.
        let _ = self.copy.context().bind_to_thread();
        for &p in &self.registered {
            // SAFETY: registered by `Hybrid::new`, still alive (the model is dropped after this).
            unsafe { driver_sys::cuMemHostUnregister(p as *mut std::ffi::c_void) };
        }
    }
}

/// Bytes of one expert's three matrices (gate, up, down) in layer `li` (types may differ between layers).
pub(crate) fn expert_bytes(model: &Qwen4Exp, li: usize) -> [usize; 3] {
    let e = &model.routed_moe(li).experts[0];
    [e.gate_proj.bytes().len(), e.up_proj.bytes().len(), e.down_proj.bytes().len()]
}

/// The largest [`expert_bytes`] of any layer, matrix by matrix: the size of a staging slot.
pub(crate) fn max_expert_bytes(model: &Qwen4Exp) -> [usize; 3] {
    (0..model.layers.len() + usize::from(model.mtp().is_some()))
        .map(|li| expert_bytes(model, li))
        .fold([0; 3], |m, b| std::array::from_fn(|i| m[i].max(b[i])))
}

impl Hybrid {
    /// The resident expert ids of each layer: the placement's GPU tier.
    pub(crate) fn resident_lists(model: &Qwen4Exp) -> Option<Vec<Vec<usize>>> {
        model
            .expert_tiers()
            .map(|tiers| tiers.iter().map(|t| (0..t.len()).filter(|&e| t[e] == Tier::Gpu).collect()).collect())
    }

    /// VRAM of the staging buffers, bytes.
    pub(crate) fn stage_bytes(model: &Qwen4Exp, params: &HybridParams) -> usize {
        params.stages.max(2) * params.stage_experts * max_expert_bytes(model).iter().sum::<usize>()
    }

    /// Sets up the host half for `model` (its GPU-tier experts already uploaded as the slot stacks of `dev`'s
    /// model), registering the RAM tier with the driver (a failure only costs copy speed: logged).
    pub(crate) fn new(
        dev: &Dev,
        model: Arc<Qwen4Exp>,
        resident: Vec<Vec<usize>>,
        mut params: HybridParams,
    ) -> Result<Self, CudaError> {
        let stream = dev.stream();
        let n_expert = model.config.n_expert;
        let mut layers = Vec::with_capacity(resident.len() + 1);
        let mut resident = resident;
        if model.mtp().is_some() {
            // The MTP block (layer index n_layer): none of its experts on the GPU, all computed on the host.
            resident.push(Vec::new());
        }
        for res in resident {
            let mut slot_of = vec![-1i32; n_expert];
            for (s, &e) in res.iter().enumerate() {
                slot_of[e] = s as i32;
            }
            let streamed: Vec<usize> = (0..n_expert).filter(|&e| slot_of[e] < 0).collect();
            let ids = |v: &[usize]| -> Vec<i32> {
                if v.is_empty() { vec![-1] } else { v.iter().map(|&e| e as i32).collect() }
            };
            layers.push(HybridLayer {
                slot_of: stream.clone_htod(&slot_of)?,
                resident_dev: stream.clone_htod(&ids(&res))?,
                resident: res,
                streamed_dev: stream.clone_htod(&ids(&streamed))?,
                streamed,
            });
        }
        let [g, u, d] = max_expert_bytes(&model);
        let stage = || -> Result<Stage, CudaError> {
            Ok(Stage {
                gate: stream.alloc_zeros::<u8>(params.stage_experts * g)?,
                up: stream.alloc_zeros::<u8>(params.stage_experts * u)?,
                down: stream.alloc_zeros::<u8>(params.stage_experts * d)?,
                ready: dev.gpu.ctx.new_event(None)?,
                free: dev.gpu.ctx.new_event(None)?,
            })
        };
        let stages = (0..params.stages.max(2)).map(|_| stage()).collect::<Result<Vec<_>, _>>()?;
        let mut registered = Vec::new();
        let mut registered_bytes = 0usize;
        let mut failed = None;
        for (start, len) in model.resident_ranges() {
            // SAFETY: the range lies inside the RAM tier's allocations, which live as long as `model` (owned by
            // this value, unregistered in Drop before it is freed).
            let r = unsafe { driver_sys::cuMemHostRegister_v2(start as *mut std::ffi::c_void, len, 0) };
            if r == driver_sys::CUresult::CUDA_SUCCESS {
                registered.push(start);
                registered_bytes += len;
            } else {
                failed = Some(r);
            }
        }
        if let Some(r) = failed {
            tracing::warn!(
                "hybrid: could not register part of the RAM tier with the GPU driver ({r:?}): expert uploads use staged copies"
            );
        }
        let d_model = model.config.hidden;
        let k = model.config.n_expert_used;
        if params.cpu_max_tokens == 0 {
            params.cpu_max_tokens = match layers[..model.layers.len()].iter().position(|l| !l.streamed.is_empty()) {
                Some(li) => {
                    let pcie =
                        upload_bandwidth(dev, &model, li, &layers[li].streamed, &stages[0], params.stage_experts)?;
                    let dram = crate::bench::dram_read_bandwidth(rayon::current_num_threads(), 1 << 30, 0.2)
                        .map_err(|e| CudaError::Unsupported(format!("measuring DRAM bandwidth: {e}")))?;
                    let trunk = &layers[..model.layers.len()];
                    let streamed = trunk.iter().map(|l| l.streamed.len()).sum::<usize>() / trunk.len().max(1);
                    let t = crossover_tokens(n_expert, k, streamed, pcie, dram * CPU_EXPERT_EFFICIENCY);
                    tracing::info!(
                        "hybrid: PCIe upload {:.1} GB/s, DRAM read {:.1} GB/s: batches up to {t} tokens run their \
                         non-resident experts on the CPU, longer ones stream them to the GPU",
                        pcie / 1e9,
                        dram / 1e9
                    );
                    t
                }
                None => 96,
            };
        }
        params.cpu_max_tokens = params.cpu_max_tokens.min(CPU_PATH_MAX_TOKENS);
        // MTP verify passes take the CPU path whatever the crossover (their rows must be decode steps' rows).
        let t = params.cpu_max_tokens.max(super::MAX_CHAIN_ROWS);
        let bufs = HostBufs { pack: Pinned::new(t * d_model + 2 * t * k + t)?, upload: Pinned::new(t * d_model)? };
        let stats = model.placement_stats();
        let cpu_ns: Arc<AtomicU64> = Arc::default();
        let cpu = if std::env::var("NEBULA_HYBRID_PIPELINE").is_ok_and(|v| v == "0") {
            None
        } else {
            let c = CpuThread::start(model.clone(), t * d_model, cpu_ns.clone())?;
            // Probe: a wait on the flag's current value (0) passes at once where stream memory operations work.
            // SAFETY: as in `CpuThread::submit`.
            let r = unsafe {
                driver_sys::cuStreamWaitValue32_v2(
                    stream.cu_stream(),
                    c.flag_dev,
                    0,
                    driver_sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32,
                )
            };
            if r == driver_sys::CUresult::CUDA_SUCCESS && stream.synchronize().is_ok() {
                Some(c)
            } else {
                tracing::warn!("hybrid: the GPU cannot wait on host memory ({r:?}); CPU experts run between syncs");
                None
            }
        };
        Ok(Self {
            host: model,
            layers,
            params,
            bufs: Mutex::new(bufs),
            packed: dev.gpu.ctx.new_event(Some(driver_sys::CUevent_flags::CU_EVENT_DEFAULT))?,
            resumed: dev.gpu.ctx.new_event(Some(driver_sys::CUevent_flags::CU_EVENT_DEFAULT))?,
            resumed_live: Default::default(),
            gpu_ns: AtomicU64::new(0),
            copy: dev.gpu.ctx.new_stream()?,
            stages,
            stage_turn: Default::default(),
            registered,
            registered_bytes,
            stats,
            cpu,
            cpu_ns,
            wait_ns: AtomicU64::new(0),
            trips: AtomicU64::new(0),
            copy_log: std::env::var("NEBULA_CUDA_PROFILE").is_ok_and(|v| v == "copies").then(Default::default),
        })
    }
}

/// Bytes/s of uploading layer `li`'s first `streamed` experts (up to `count`, a staging buffer's worth) into
/// `stage`, best of three timed runs.
fn upload_bandwidth(
    dev: &Dev,
    model: &Qwen4Exp,
    li: usize,
    streamed: &[usize],
    stage: &Stage,
    count: usize,
) -> Result<f64, CudaError> {
    let stream = dev.stream();
    let experts: Vec<usize> = streamed.iter().copied().take(count).collect();
    let mut best = f64::MAX;
    let mut bytes = 0usize;
    for _ in 0..3 {
        stream.synchronize()?;
        let t = std::time::Instant::now();
        bytes = 0;
        for (j, &e) in experts.iter().enumerate() {
            bytes += stage_expert(stream, model, li, e, stage, j)?;
        }
        stream.synchronize()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(bytes as f64 / best.max(1e-9))
}

/// Queues the upload of expert `e` of layer `li` (its host weights: RAM tier, SSD tier read now, or the file)
/// into slot `j` of `stage` on `stream`; returns the bytes copied.
///
/// Errors: an SSD read fails; the expert's matrices differ in size from the layer's first expert (the slots of
/// one layer are that size apart, as the grouped kernels read them).
pub(crate) fn stage_expert(
    stream: &CudaStream,
    model: &Qwen4Exp,
    li: usize,
    e: usize,
    stage: &Stage,
    j: usize,
) -> Result<usize, CudaError> {
    let x = model.host_expert(li, e)?;
    let sizes = expert_bytes(model, li);
    let mut copied = 0;
    for ((buf, mat), bytes) in
        [(&stage.gate, &x.gate_proj), (&stage.up, &x.up_proj), (&stage.down, &x.down_proj)].into_iter().zip(sizes)
    {
        let src = mat.bytes();
        if src.len() != bytes {
            return Err(CudaError::Unsupported(format!(
                "expert {e} of layer {li}: {} bytes where the layer's experts have {bytes}",
                src.len()
            )));
        }
        htod(stream, stage_ptr(buf, stream, j * bytes), src.as_ptr(), bytes)?;
        copied += bytes;
    }
    Ok(copied)
}

/// Queues the upload of the experts `experts` of layer `li` into slots `0..` of `stage` on `stream`, as
/// [`stage_expert`] does one by one, but with one strided copy per matrix for every run of RAM-tier experts that
/// lie at a constant stride in host memory (the RAM tier stores a layer's experts back to back, so a group of
/// consecutive expert ids is one run): 3 copy commands instead of 3 per expert. On the H200 machine (12 GB
/// profile, 2048-token chunks) the copy stream went from 47.5 to 53.6 GB/s; the prefill rate did not change (the
/// grouped expert kernels set it, `NEBULA_CUDA_PROFILE=copies`). Returns the bytes copied.
///
/// Errors: as [`stage_expert`].
pub(crate) fn stage_group(
    stream: &CudaStream,
    model: &Qwen4Exp,
    li: usize,
    experts: &[usize],
    stage: &Stage,
) -> Result<usize, CudaError> {
    let sizes = expert_bytes(model, li);
    let bufs = [&stage.gate, &stage.up, &stage.down];
    // Host addresses of an expert's three matrices when it is in RAM and its sizes are the layer's (an SSD-tier
    // expert goes through `stage_expert`, which reads it once).
    let addrs = |e: usize| -> Option<[usize; 3]> {
        let x = model.ram_expert(li, e)?;
        let m = [&x.gate_proj, &x.up_proj, &x.down_proj];
        m.iter().zip(sizes).all(|(m, b)| m.bytes().len() == b).then(|| m.map(|m| m.bytes().as_ptr() as usize))
    };
    let mut copied = 0;
    let mut j = 0;
    while j < experts.len() {
        let Some(first) = addrs(experts[j]) else {
            copied += stage_expert(stream, model, li, experts[j], stage, j)?;
            j += 1;
            continue;
        };
        // Extend the run while the next expert sits one more stride further, for all three matrices.
        let mut len = 1;
        let mut stride = 0usize;
        while j + len < experts.len() {
            let Some(next) = addrs(experts[j + len]) else { break };
            let step = next[0].wrapping_sub(first[0]);
            if len == 1 {
                if step == 0 || step > isize::MAX as usize {
                    break;
                }
                stride = step;
            }
            if (0..3).any(|m| next[m] != first[m] + len * stride) {
                break;
            }
            len += 1;
        }
        for ((buf, &src), bytes) in bufs.iter().zip(&first).zip(sizes) {
            let dst = stage_ptr(buf, stream, j * bytes);
            if len == 1 {
                htod(stream, dst, src as *const u8, bytes)?;
            } else {
                htod_strided(stream, dst, src as *const u8, stride, bytes, len)?;
            }
        }
        copied += len * sizes.iter().sum::<usize>();
        j += len;
    }
    Ok(copied)
}

/// Copies `count` host blocks of `bytes` bytes, `stride` bytes apart from `src` on, to `count` consecutive blocks
/// at device address `dst` on `stream` (one `cuMemcpy2DAsync`).
fn htod_strided(
    stream: &CudaStream,
    dst: u64,
    src: *const u8,
    stride: usize,
    bytes: usize,
    count: usize,
) -> Result<(), CudaError> {
    let c = driver_sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: driver_sys::CUmemorytype::CU_MEMORYTYPE_HOST,
        srcHost: src as *const std::ffi::c_void,
        srcDevice: 0,
        srcArray: std::ptr::null_mut(),
        srcPitch: stride,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: driver_sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: bytes,
        WidthInBytes: bytes,
        Height: count,
    };
    // SAFETY: the host blocks are readable and outlive the copy (the RAM tier), the device range holds `count`
    // blocks (a staging buffer of the group's size).
    let r = unsafe { driver_sys::cuMemcpy2DAsync_v2(&c, stream.cu_stream()) };
    check(r, "copying experts to the GPU")
}

/// Copies `bytes` host bytes at `src` to device address `dst` on `stream` (asynchronous for registered memory).
pub(crate) fn htod(stream: &CudaStream, dst: u64, src: *const u8, bytes: usize) -> Result<(), CudaError> {
    // SAFETY: `src` points at `bytes` readable host bytes that outlive the copy (the RAM tier, or pageable memory
    // the driver stages before returning); `dst` is a device allocation of at least `bytes`.
    let r = unsafe { driver_sys::cuMemcpyHtoDAsync_v2(dst, src as *const std::ffi::c_void, bytes, stream.cu_stream()) };
    check(r, "copying to the GPU")
}

/// Copies `bytes` from device address `src` to pinned host memory `dst` on `stream`.
pub(crate) fn dtoh(stream: &CudaStream, dst: *mut std::ffi::c_void, src: u64, bytes: usize) -> Result<(), CudaError> {
    // SAFETY: `dst` is pinned host memory of at least `bytes` that is not read until the stream passes an event
    // recorded after this copy.
    let r = unsafe { driver_sys::cuMemcpyDtoHAsync_v2(dst, src, bytes, stream.cu_stream()) };
    check(r, "copying from the GPU")
}

/// The device address of a staging matrix slot.
pub(crate) fn stage_ptr(buf: &CudaSlice<u8>, stream: &CudaStream, offset: usize) -> u64 {
    ptr(buf, stream, offset)
}

#[cfg(test)]
mod tests {
    use super::crossover_tokens;

    #[test]
    fn the_crossover_follows_the_bandwidths() {
        // 512 experts, top-10, 485 streamed (the 12 GB profile), PCIe 55 GB/s, CPU 40 GB/s: the CPU reads about
        // 352.7 experts while PCIe moves 485, which 10-of-512 routing reaches after ln(1 - 352.7/512) /
        // ln(1 - 10/512) = 59.2 tokens.
        assert_eq!(crossover_tokens(512, 10, 485, 55e9, 40e9), 59);
        // A faster CPU moves the crossover up, a faster link down; never below 1 or above the CPU path's cap.
        assert!(crossover_tokens(512, 10, 485, 55e9, 50e9) > 59);
        assert!(crossover_tokens(512, 10, 485, 110e9, 40e9) < 59);
        assert_eq!(crossover_tokens(512, 10, 485, 1e9, 40e9), 512);
        assert_eq!(crossover_tokens(512, 10, 485, 1e15, 1e6), 1);
    }
}
