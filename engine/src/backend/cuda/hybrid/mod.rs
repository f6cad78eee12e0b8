//! The hybrid GPU + CPU backend: the dense trunk and each layer's GPU-tier experts (the expert cache, from the
//! placement) live on the GPU; every other routed expert stays in host RAM (or on SSD) with the CPU model.
//! Which experts run where, and when, is decided by [`policy`]; this module carries it out.
//!
//! - **Decode and short batches** ([`policy::ExpertPath::CpuSplit`]): per layer the GPU runs the token mixer, the
//!   router, the shared expert and the resident experts; `hybrid_split` (kernels/cuda/moe.cu) applies the policy's
//!   per-token rule (expert handoff below the coverage fraction, optional marginal-expert omission) and packs the
//!   MoE input, expert ids and CPU weights into one buffer. One copy goes to the host ([`Hybrid::send_cpu_share`]),
//!   the CPU computes its experts (RAM tier, SSD tier with prefetch) while the GPU computes the shared and
//!   resident experts, and one copy of the weighted CPU sum comes back into `moe_combine`
//!   ([`Hybrid::run_cpu_share`]).
//! - **Prefill** ([`policy::ExpertPath::Streamed`]): the experts the GPU does not hold are streamed over PCIe from
//!   the RAM tier (registered with the driver, so the copies are DMA at full speed) into staging buffers of
//!   [`HybridParams::stage_experts`] experts (a ring of [`HybridParams::stages`]) on a copy stream, while the
//!   compute stream runs the grouped expert kernels on the filled ones ([`Hybrid::stream_experts`]); the host
//!   never waits, so transfers overlap the previous groups' experts and the next layer's token mixer.
//!
//! Decode is pipelined: a CPU thread ([`cpu::CpuThread`]) computes a layer's CPU experts while the host thread
//! enqueues the rest of the step, the GPU stream waiting on a host flag (`cuStreamWaitValue32`) before it copies
//! the result in, so kernel launches overlap the CPU's work.
//!
//! The staging buffers and pinned host buffers are allocated at load, inside the VRAM budget check.

mod cpu;
mod expert_cache;
pub mod policy;
mod staging;

pub use policy::{CPU_PATH_MAX_TOKENS, HybridParams, crossover_tokens};

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use nebula_kernels::cudarc::driver::{CudaEvent, CudaSlice, CudaStream, sys as driver_sys};

use super::CudaError;
use super::device::{Arg, Dev, dtoh, htod, ptr};
use super::launch::Launch;
use crate::model::Qwen4Exp;
use crate::placement::{PlacementStats, Tier};
use crate::tuning::{CudaProfile, CudaTuning};
use cpu::{CpuThread, Pinned};
use expert_cache::DeviceExpertCache;
use policy::HybridPolicy;
use staging::{GroupTiming, Stage, max_expert_bytes, stage_group, stage_ptr, upload_bandwidth};

pub(crate) use staging::copy_report;

/// One layer's expert cache map: which expert each GPU slot holds, on the device (what the kernels read) and on
/// the host ([`SlotMap`], changed only together with the device copies, on the compute stream).
pub(crate) struct HybridLayer {
    /// `[n_expert]`: slot in the layer's resident stacks, or -1.
    pub(crate) slot_of: CudaSlice<i32>,
    /// `[max(slots, 1)]`: slot -> expert id, -1 for a slot being filled.
    pub(crate) resident_dev: CudaSlice<i32>,
    /// `[max(n_expert, 1)]`: the experts the GPU cannot use now, ascending (the first `map.streamed.len()`).
    pub(crate) streamed_dev: CudaSlice<i32>,
    /// Slots of the layer's resident stacks.
    pub(crate) slots: usize,
    /// The host mirror.
    pub(crate) map: Mutex<SlotMap>,
}

/// The host mirror of a [`HybridLayer`]'s device maps.
pub(crate) struct SlotMap {
    /// Expert -> slot or -1.
    pub(crate) slot_of: Vec<i32>,
    /// Slot -> expert or -1.
    pub(crate) resident: Vec<i32>,
    /// Experts not usable on the GPU, ascending.
    pub(crate) streamed: Vec<usize>,
}

impl SlotMap {
    /// `n_expert` experts, slot `s` holding `resident[s]`.
    fn new(n_expert: usize, resident: &[usize]) -> Self {
        let mut slot_of = vec![-1i32; n_expert];
        for (s, &e) in resident.iter().enumerate() {
            slot_of[e] = s as i32;
        }
        let streamed = (0..n_expert).filter(|&e| slot_of[e] < 0).collect();
        Self { slot_of, resident: resident.iter().map(|&e| e as i32).collect(), streamed }
    }

    /// Slot `slot` (holding `e`) goes out of use.
    pub(crate) fn evict(&mut self, slot: usize, e: usize) {
        self.slot_of[e] = -1;
        self.resident[slot] = -1;
        if let Err(at) = self.streamed.binary_search(&e) {
            self.streamed.insert(at, e);
        }
    }

    /// Slot `slot` now holds `e`, usable.
    pub(crate) fn install(&mut self, slot: usize, e: usize) {
        self.slot_of[e] = slot as i32;
        self.resident[slot] = e as i32;
        if let Ok(at) = self.streamed.binary_search(&e) {
            self.streamed.remove(at);
        }
    }

    /// Whether expert `e` is usable on the GPU.
    pub(crate) fn on_gpu(&self, e: usize) -> bool {
        self.slot_of.get(e).is_some_and(|&s| s >= 0)
    }

    /// Writes the mirror into `hl`'s device maps on `stream` (ordered before every later kernel there; the
    /// pageable source is staged by the driver before this returns).
    pub(crate) fn upload(&self, stream: &CudaStream, hl: &HybridLayer) -> Result<(), CudaError> {
        let write = |dst: &CudaSlice<i32>, v: &[i32]| -> Result<(), CudaError> {
            if v.is_empty() { Ok(()) } else { htod(stream, ptr(dst, stream, 0), v.as_ptr() as *const u8, v.len() * 4) }
        };
        write(&hl.slot_of, &self.slot_of)?;
        write(&hl.resident_dev, &self.resident)?;
        let streamed: Vec<i32> = self.streamed.iter().map(|&e| e as i32).collect();
        write(&hl.streamed_dev, &streamed)
    }
}

/// Host buffers of the per-layer round trip.
pub(crate) struct HostBufs {
    pub(crate) pack: Pinned,
    pub(crate) upload: Pinned,
}

/// The host half of the hybrid backend.
pub(crate) struct Hybrid {
    /// The CPU model (placed), for the experts the GPU does not hold.
    pub(crate) host: Arc<Qwen4Exp>,
    pub(crate) layers: Vec<HybridLayer>,
    /// Every decision of the split ([`policy`]).
    pub(crate) policy: HybridPolicy,
    pub(crate) bufs: Mutex<HostBufs>,
    /// Recorded after the device-to-host copy of a layer's pack (timing enabled).
    pub(crate) packed: CudaEvent,
    /// Recorded where the GPU's serial work resumes (the step's start, or after the wait for a layer's CPU
    /// experts); `packed - resumed` is the GPU's share of the step's critical path (timing enabled).
    pub(crate) resumed: CudaEvent,
    /// `resumed` was recorded in this step.
    pub(crate) resumed_live: AtomicBool,
    /// Nanoseconds of GPU critical-path work measured by the two events.
    pub(crate) gpu_ns: AtomicU64,
    /// The copy stream of streamed prefill.
    pub(crate) copy: Arc<CudaStream>,
    pub(crate) stages: Vec<Stage>,
    /// Staging buffers used so far (the next one is `count % stages`).
    pub(crate) stage_turn: AtomicUsize,
    /// Host ranges registered with the driver (unregistered on drop).
    registered: Vec<usize>,
    /// Bytes of the RAM tier registered with the driver (uploads from there are DMA at full speed).
    pub(crate) registered_bytes: usize,
    pub(crate) stats: Arc<PlacementStats>,
    /// The CPU thread of pipelined decode; `None` where the driver refuses stream waits on host memory or the
    /// pipeline is turned off (then the host thread computes the CPU experts itself, between two
    /// synchronisations).
    pub(crate) cpu: Option<CpuThread>,
    /// Nanoseconds the CPU spent on its experts, the host spent waiting for the GPU's pack, and round trips.
    pub(crate) cpu_ns: Arc<AtomicU64>,
    pub(crate) wait_ns: AtomicU64,
    /// Streamed prefill's timeline when profiling copies ([`CudaProfile::Copies`]): per expert group, events at
    /// the start and end of its copies (copy stream) and of its kernels (compute stream), with the bytes copied.
    pub(crate) copy_log: Option<Mutex<Vec<GroupTiming>>>,
    pub(crate) trips: AtomicU64,
    /// The adaptive GPU expert cache (`None`: the placement's static GPU tier).
    pub(crate) cache: Option<DeviceExpertCache>,
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

/// A layer's CPU share in flight ([`Hybrid::send_cpu_share`]): the split's device outputs and the host buffers,
/// held until [`Hybrid::run_cpu_share`] has read them.
pub(crate) struct CpuShare<'a> {
    bufs: MutexGuard<'a, HostBufs>,
    /// `[n * k]`: each slot's expert-cache slot for the GPU's share (-1: not on the GPU).
    pub(crate) gpu_slot: u64,
    /// `[n * k]`: each slot's router weight on the GPU (0 when the CPU or nobody computes it).
    pub(crate) w_gpu: u64,
    pack_len: usize,
}

impl Hybrid {
    /// VRAM of the staging buffers, bytes.
    pub(crate) fn stage_bytes(model: &Qwen4Exp, params: &HybridParams) -> usize {
        params.stages.max(2) * params.stage_experts * max_expert_bytes(model).iter().sum::<usize>()
    }

    /// Sets up the host half for `model` (its resident experts, the policy's, already uploaded as the slot stacks
    /// of `dev`'s model), registering the RAM tier with the driver (a failure only costs copy speed: logged), and
    /// lets the policy choose the crossover from bandwidths measured here.
    ///
    /// `stacks` are the trunk layers' expert stacks on the device, `(address of slot 0, bytes per expert)` of the
    /// gate, up and down matrices: where an adaptive GPU expert cache uploads its newcomers.
    pub(crate) fn new(
        dev: &Dev,
        model: Arc<Qwen4Exp>,
        mut policy: HybridPolicy,
        tuning: &CudaTuning,
        stacks: Vec<[(u64, usize); 3]>,
    ) -> Result<Self, CudaError> {
        let stream = dev.stream();
        let n_expert = model.config.n_expert;
        let params = policy.params();
        let mut layers = Vec::with_capacity(policy.resident_lists().len());
        for res in policy.resident_lists() {
            let map = SlotMap::new(n_expert, res);
            let padded = |v: &[i32], len: usize| -> Vec<i32> {
                let mut p = v.to_vec();
                p.resize(len.max(1), -1);
                p
            };
            let streamed: Vec<i32> = map.streamed.iter().map(|&e| e as i32).collect();
            layers.push(HybridLayer {
                slot_of: stream.clone_htod(&padded(&map.slot_of, n_expert))?,
                resident_dev: stream.clone_htod(&padded(&map.resident, res.len()))?,
                streamed_dev: stream.clone_htod(&padded(&streamed, n_expert))?,
                slots: res.len(),
                map: Mutex::new(map),
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
                "hybrid: could not register part of the RAM tier with the GPU driver ({}): expert uploads use staged \
                 copies",
                nebula_kernels::driver_result_words(r)
            );
        }
        let d_model = model.config.hidden;
        let k = model.config.n_expert_used;
        let streamed: Vec<Vec<usize>> = (0..layers.len()).map(|li| policy.streamed(li)).collect();
        let measured = policy.choose_crossover(model.layers.len(), k, |li| -> Result<(f64, f64), CudaError> {
            let pcie = upload_bandwidth(dev, &model, li, &streamed[li], &stages[0], params.stage_experts)?;
            let dram = crate::bench::dram_read_bandwidth(rayon::current_num_threads(), 1 << 30, 0.2)
                .map_err(|e| CudaError::Unsupported(format!("measuring DRAM bandwidth: {e}")))?;
            Ok((pcie, dram))
        })?;
        if let Some((pcie, dram)) = measured {
            tracing::info!(
                "hybrid: PCIe upload {:.1} GB/s, DRAM read {:.1} GB/s: batches up to {} tokens run their \
                 non-resident experts on the CPU, longer ones stream them to the GPU",
                pcie / 1e9,
                dram / 1e9,
                policy.params().cpu_max_tokens
            );
        }
        if failed.is_some() && policy.gpu_cache().policy != crate::placement::GpuCachePolicy::Static {
            // Uploads from unregistered memory are staged by the driver on the calling thread: they would block.
            tracing::warn!(
                "hybrid: the GPU expert cache stays static (the RAM tier is not registered with the driver)"
            );
            policy.keep_static();
        }
        let trunk = model.layers.len();
        let cache = policy
            .expert_caches(trunk, |l, e| {
                model.ram_expert(l, e).is_some_and(|x| {
                    let sizes = [x.gate_proj.bytes().len(), x.up_proj.bytes().len(), x.down_proj.bytes().len()];
                    stacks.get(l).is_some_and(|st| st.iter().zip(sizes).all(|(s, b)| s.1 == b))
                })
            })
            .map(|caches| -> Result<DeviceExpertCache, CudaError> {
                let opts = policy.gpu_cache();
                tracing::info!(
                    "hybrid: GPU expert cache {} (a refresh every {} steps, up to {} uploads per layer)",
                    opts.policy.name(),
                    opts.interval,
                    opts.uploads
                );
                Ok(DeviceExpertCache::new(opts, caches, stacks.clone(), dev.gpu.ctx.new_stream()?))
            })
            .transpose()?;
        let t = policy.cpu_path_rows();
        let bufs = HostBufs { pack: Pinned::new(t * d_model + 3 * t * k + t)?, upload: Pinned::new(t * d_model)? };
        let stats = model.placement_stats();
        let cpu_ns: Arc<AtomicU64> = Arc::default();
        let cpu = if !tuning.hybrid.pipeline {
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
            policy,
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
            copy_log: (tuning.profile == CudaProfile::Copies).then(Default::default),
            cache,
        })
    }

    /// The start of a pass: installs the GPU expert cache's finished uploads (before the pass's kernels) and
    /// marks the start of the GPU's critical path of a step.
    pub(crate) fn step_started(&self, stream: &CudaStream) -> Result<(), CudaError> {
        if let Some(c) = &self.cache {
            c.begin_pass(stream, &self.layers)?;
        }
        self.resumed.record(stream)?;
        self.resumed_live.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// The GPU expert cache's settings in effect (static when it does not adapt).
    pub(crate) fn gpu_cache(&self) -> crate::placement::GpuCacheOptions {
        self.cache.as_ref().map_or_else(Default::default, DeviceExpertCache::options)
    }

    /// The CPU path's first half for layer `li`: `hybrid_split` applies the policy's rule to the `n` tokens' routed
    /// experts (`ids`, weights `w`, `[n * k]`) and packs the MoE input `m` (`[n, d]`), ids and CPU weights; one
    /// copy sends the pack to the host. Returns the GPU's share (slots, weights) for the resident experts' launch
    /// the caller queues next, while the copy is in flight.
    pub(crate) fn send_cpu_share(
        &self,
        ctx: &Launch,
        li: usize,
        m: u64,
        n: usize,
        ids: u64,
        w: u64,
    ) -> Result<CpuShare<'_>, CudaError> {
        let dev = &ctx.dev;
        let (d, k) = (ctx.cfg.hidden, ctx.cfg.n_expert_used);
        let stream = dev.stream();
        let hl = &self.layers[li];
        let slots = n * k;
        let gpu_slot = ctx.tmp(slots)?;
        let w_gpu = ctx.tmp(slots)?;
        let pack_len = n * d + 3 * slots + n;
        let pack = ctx.tmp(pack_len)?;
        let rule = self.policy.split();
        dev.launch_1d(
            "hybrid_split",
            (n * d).max(n),
            &[
                Arg::Ptr(m),
                Arg::Ptr(ids),
                Arg::Ptr(w),
                Arg::Ptr(ptr(&hl.slot_of, stream, 0)),
                Arg::I32(n as i32),
                Arg::I32(k as i32),
                Arg::I32(d as i32),
                Arg::F32(rule.handoff),
                Arg::F32(rule.omit),
                Arg::Ptr(gpu_slot),
                Arg::Ptr(w_gpu),
                Arg::Ptr(pack),
                Arg::Ptr(ctx.coverage_out.load(Ordering::Relaxed)),
            ],
        )?;
        let bufs = self.bufs.lock().expect("hybrid buffers lock");
        dtoh(stream, bufs.pack.addr(), pack, pack_len * 4)?;
        self.packed.record(stream)?;
        Ok(CpuShare { bufs, gpu_slot, w_gpu, pack_len })
    }

    /// The CPU path's second half for layer `li` (after the GPU's share is queued): waits for the pack, counts
    /// where each expert use ran, has the CPU compute its experts (on the CPU thread when pipelined) and queues
    /// the copy of their weighted sum back. Returns the device address of that sum (`[n, d]`), or 0 when the CPU
    /// had nothing to compute.
    pub(crate) fn run_cpu_share(
        &self,
        ctx: &Launch,
        li: usize,
        share: CpuShare<'_>,
        n: usize,
    ) -> Result<u64, CudaError> {
        let (d, k) = (ctx.cfg.hidden, ctx.cfg.n_expert_used);
        let stream = ctx.dev.stream();
        let hl = &self.layers[li];
        let slots = n * k;
        let CpuShare { mut bufs, pack_len, .. } = share;
        let t_wait = std::time::Instant::now();
        self.packed.synchronize()?;
        let waited = t_wait.elapsed();
        if self.resumed_live.swap(false, Ordering::Relaxed)
            && let Ok(ms) = self.resumed.elapsed_ms(&self.packed)
        {
            self.gpu_ns.fetch_add((ms as f64 * 1e6) as u64, Ordering::Relaxed);
        }
        let host = bufs.pack.slice(pack_len).to_vec();
        let (x, rest) = host.split_at(n * d);
        let (ids_h, rest) = rest.split_at(slots);
        let (w_cpu, rest) = rest.split_at(slots);
        let (flags, w_all) = rest.split_at(n);
        if let Some(log) = self.host.routing_log() {
            let used: Vec<crate::model::moe::Routing> = (0..n)
                .map(|t| crate::model::moe::Routing {
                    experts: ids_h[t * k..(t + 1) * k].iter().map(|e| e.to_bits() as usize).collect(),
                    weights: w_all[t * k..(t + 1) * k].to_vec(),
                })
                .collect();
            log.record(li, &used);
        }
        let mut routing = Vec::with_capacity(n);
        let (mut on_gpu, mut omitted, mut handoffs) = (0u64, 0u64, 0u64);
        let map = hl.map.lock().expect("slot map lock");
        for (t, flag) in flags.iter().enumerate() {
            // 1: handed off; 2: a verify row below the handoff threshold (not trusted, no CPU experts).
            let untrusted = flag.to_bits() == 2;
            let handoff = flag.to_bits() == 1;
            handoffs += u64::from(handoff);
            let mut r = crate::model::moe::Routing { experts: Vec::new(), weights: Vec::new() };
            for j in t * k..(t + 1) * k {
                let e = ids_h[j].to_bits() as usize;
                if w_cpu[j] > 0.0 {
                    r.experts.push(e);
                    r.weights.push(w_cpu[j]);
                } else if !handoff && map.on_gpu(e) {
                    on_gpu += 1;
                } else if !untrusted {
                    omitted += 1;
                }
            }
            routing.push(r);
        }
        drop(map);
        if let Some(c) = &self.cache {
            // What this layer's tokens used, wherever it ran: the cache's recency, and on a refresh its swaps.
            let rows: Vec<Vec<usize>> =
                (0..n).map(|t| ids_h[t * k..(t + 1) * k].iter().map(|e| e.to_bits() as usize).collect()).collect();
            c.observe(stream, li, hl, &rows, &self.host, &self.stats)?;
        }
        use Ordering::Relaxed;
        self.wait_ns.fetch_add(waited.as_nanos() as u64, Relaxed);
        self.trips.fetch_add(1, Relaxed);
        self.stats.hit(Tier::Gpu, on_gpu);
        // Experts the CPU computes count by where their weights are read from (a GPU-tier expert from its RAM copy).
        if let Some(tiers) = self.host.expert_tiers().and_then(|t| t.get(li)) {
            for r in &routing {
                for &e in &r.experts {
                    let t = tiers[e];
                    self.stats.hit(if t == Tier::Gpu { Tier::Ram } else { t }, 1);
                }
            }
        }
        self.stats.omitted.fetch_add(omitted, Relaxed);
        self.stats.handoffs.fetch_add(handoffs, Relaxed);
        let mut extra = 0;
        if routing.iter().any(|r| !r.experts.is_empty()) {
            extra = ctx.tmp(n * d)?;
            match &self.cpu {
                Some(cpu) => {
                    // Pipelined: the CPU thread computes while this thread enqueues the rest of the step; the
                    // stream waits for its flag before copying the result.
                    cpu.submit(stream, li, x.to_vec(), n, routing)?;
                    htod(stream, extra, cpu.upload.addr() as *const u8, n * d * 4)?;
                }
                None => {
                    let t_cpu = std::time::Instant::now();
                    let y = self.host.cpu_routed(li, x, n, &routing)?;
                    self.cpu_ns.fetch_add(t_cpu.elapsed().as_nanos() as u64, Relaxed);
                    bufs.upload.slice_mut(n * d).copy_from_slice(&y);
                    htod(stream, extra, bufs.upload.addr() as *const u8, n * d * 4)?;
                }
            }
            self.stats.pcie_bytes.fetch_add((n * d * 4) as u64, Relaxed);
        }
        self.stats.pcie_bytes.fetch_add((pack_len * 4) as u64, Relaxed);
        self.resumed.record(stream)?;
        self.resumed_live.store(true, Relaxed);
        Ok(extra)
    }

    /// Streams layer `li`'s non-resident experts from host RAM to the GPU in groups of
    /// [`HybridParams::stage_experts`] through the ring of staging buffers, on the copy stream, and calls
    /// `compute(weights, count, slot_expert)` for each group once its copy is awaited on the compute stream:
    /// `weights` are the device addresses of the group's gate, up and down stacks (expert `j` of the group at
    /// `j` matrices from the start), `count` its experts, `slot_expert` the device list of their ids. The host
    /// never waits.
    pub(crate) fn stream_experts(
        &self,
        ctx: &Launch,
        li: usize,
        mut compute: impl FnMut([u64; 3], usize, u64) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let dev = &ctx.dev;
        let stream = dev.stream();
        let hl = &self.layers[li];
        let group = self.policy.params().stage_experts;
        let copy = &self.copy;
        let streamed = hl.map.lock().expect("slot map lock").streamed.clone();
        let groups: Vec<&[usize]> = streamed.chunks(group).collect();
        if let Some(first) = groups.first() {
            self.host.request_experts(li, first);
        }
        for (gi, experts) in groups.iter().enumerate() {
            // SSD-tier experts of the next group are read while this one is copied and computed.
            if let Some(next) = groups.get(gi + 1) {
                self.host.request_experts(li, next);
            }
            let stage = &self.stages[self.stage_turn.fetch_add(1, Ordering::Relaxed) % self.stages.len()];
            // The copy waits until the kernels that last read this buffer have run.
            copy.wait(&stage.free)?;
            let timing = self.copy_log.as_ref().map(|_| -> Result<[CudaEvent; 4], CudaError> {
                let ev = || dev.gpu.ctx.new_event(Some(driver_sys::CUevent_flags::CU_EVENT_DEFAULT));
                Ok([ev()?, ev()?, ev()?, ev()?])
            });
            let timing = timing.transpose()?;
            if let Some(t) = &timing {
                t[0].record(copy)?;
            }
            let copied = stage_group(copy, &self.host, li, experts, stage)?;
            stage.ready.record(copy)?;
            stream.wait(&stage.ready)?;
            if let Some(t) = &timing {
                t[1].record(copy)?;
                t[2].record(stream)?;
            }
            let weights =
                [stage_ptr(&stage.gate, stream, 0), stage_ptr(&stage.up, stream, 0), stage_ptr(&stage.down, stream, 0)];
            let se = ptr(&hl.streamed_dev, stream, gi * group);
            compute(weights, experts.len(), se)?;
            stage.free.record(stream)?;
            if let (Some(t), Some(log)) = (timing, &self.copy_log) {
                t[3].record(stream)?;
                log.lock().expect("copy log lock").push((t, copied));
            }
            self.stats.pcie_bytes.fetch_add(copied as u64, Ordering::Relaxed);
        }
        Ok(())
    }
}
