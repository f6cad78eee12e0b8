//! The adaptive GPU expert cache on the device: carries out the swaps [`crate::placement::expert_cache`] decides
//! (through the policy, [`super::policy::HybridPolicy::expert_caches`]) without ever blocking a step.
//!
//! - After a layer's CPU share of a pass is read ([`DeviceExpertCache::observe`]), its tokens' experts are
//!   reported to the layer's [`ExpertCache`]; on a refresh pass the planned swaps are applied at once: the
//!   evicted experts leave the layer's slot maps (host mirror and device copies, the latter written on the compute
//!   stream, so every later kernel of the layer sees them gone), an event recorded on the compute stream after the
//!   layer's GPU share (the last kernels that may read the evicted slots) gates the uploads, and the newcomers'
//!   weights are copied from the RAM tier (registered with the driver: DMA) into their slots on the upload stream.
//! - At the start of each pass ([`DeviceExpertCache::begin_pass`]) the uploads whose event has completed are
//!   installed (maps updated on the compute stream before any of the pass's kernels); the others wait for a later
//!   pass. A layer with uploads in flight plans no new ones.
//!
//! A slot being filled maps to no expert (`slot_of` -1, `resident` -1, the evicted and the admitted expert among
//! the streamed ones), so its expert is computed on the CPU, or streamed in by a long prefill, until it lands.

use std::sync::{Arc, Mutex};

use nebula_kernels::cudarc::driver::{CudaEvent, CudaStream};

use super::super::CudaError;
use super::super::device::htod;
use super::HybridLayer;
use crate::model::Qwen4Exp;
use crate::placement::PlacementStats;
use crate::placement::expert_cache::{ExpertCache, GpuCacheOptions, Swap};

/// Uploads of one layer's planned swaps, in flight on the upload stream.
struct Pending {
    layer: usize,
    swaps: Vec<Swap>,
    /// Recorded on the upload stream after the copies.
    done: CudaEvent,
}

struct CacheState {
    caches: Vec<ExpertCache>,
    pending: Vec<Pending>,
    /// Passes begun.
    pass: u64,
    /// Per layer, the pass it last planned in (a layer whose MoE runs in row chunks plans once per pass).
    planned: Vec<u64>,
}

/// See the module docs.
pub(crate) struct DeviceExpertCache {
    opts: GpuCacheOptions,
    upload: Arc<CudaStream>,
    /// Per trunk layer: (device address of slot 0, bytes per expert) of its gate, up and down stacks.
    stacks: Vec<[(u64, usize); 3]>,
    state: Mutex<CacheState>,
}

impl DeviceExpertCache {
    /// The cache over `caches` (one per trunk layer, from the policy), uploading into `stacks` on `upload`.
    pub(crate) fn new(
        opts: GpuCacheOptions,
        caches: Vec<ExpertCache>,
        stacks: Vec<[(u64, usize); 3]>,
        upload: Arc<CudaStream>,
    ) -> Self {
        let planned = vec![u64::MAX; caches.len()];
        Self { opts, upload, stacks, state: Mutex::new(CacheState { caches, pending: Vec::new(), pass: 0, planned }) }
    }

    /// The settings.
    pub(crate) fn options(&self) -> GpuCacheOptions {
        self.opts
    }

    /// The start of a pass: installs every finished upload into its layer's maps (device copies written on
    /// `stream`, before the pass's kernels).
    ///
    /// Errors: an event query or a map copy failed.
    pub(crate) fn begin_pass(&self, stream: &CudaStream, layers: &[HybridLayer]) -> Result<(), CudaError> {
        let mut st = self.state.lock().expect("expert cache lock");
        st.pass += 1;
        let mut changed = vec![false; layers.len()];
        let mut i = 0;
        while i < st.pending.len() {
            if !st.pending[i].done.try_is_complete()? {
                i += 1;
                continue;
            }
            let p = st.pending.swap_remove(i);
            let mut map = layers[p.layer].map.lock().expect("slot map lock");
            for s in &p.swaps {
                st.caches[p.layer].loaded(s.slot);
                map.install(s.slot, s.admitted);
            }
            changed[p.layer] = true;
        }
        for (hl, _) in layers.iter().zip(&changed).filter(|(_, c)| **c) {
            hl.map.lock().expect("slot map lock").upload(stream, hl)?;
        }
        Ok(())
    }

    /// Layer `li`'s tokens of this pass used `rows` (each token's experts, in any tier); on a refresh pass, plans
    /// the layer's swaps and queues their uploads (module docs). `stream` is the compute stream, with the layer's
    /// GPU share already queued; `model` holds the RAM tier the weights are copied from.
    ///
    /// Errors: a copy or event failed (the pass fails; the slots planned stay out of use).
    pub(crate) fn observe(
        &self,
        stream: &CudaStream,
        li: usize,
        hl: &HybridLayer,
        rows: &[Vec<usize>],
        model: &Qwen4Exp,
        stats: &PlacementStats,
    ) -> Result<(), CudaError> {
        use std::sync::atomic::Ordering::Relaxed;
        let mut st = self.state.lock().expect("expert cache lock");
        match st.caches.get_mut(li) {
            Some(cache) => rows.iter().for_each(|r| cache.observe(r)),
            None => return Ok(()),
        }
        let pass = st.pass;
        let due = pass % self.opts.interval.max(1) as u64 == 0 && st.planned[li] != pass;
        if !due || st.pending.iter().any(|p| p.layer == li) {
            return Ok(());
        }
        st.planned[li] = pass;
        let swaps = st.caches[li].plan(self.opts);
        if swaps.is_empty() {
            return Ok(());
        }
        {
            let mut map = hl.map.lock().expect("slot map lock");
            for s in &swaps {
                map.evict(s.slot, s.evicted);
            }
            map.upload(stream, hl)?;
        }
        let ctx = stream.context();
        // The uploads wait for every kernel queued so far (this layer's GPU share reads the evicted slots).
        let free = ctx.new_event(None)?;
        free.record(stream)?;
        self.upload.wait(&free)?;
        let mut bytes = 0usize;
        for s in &swaps {
            let x = model.ram_expert(li, s.admitted).ok_or_else(|| {
                CudaError::Unsupported(format!("expert {} of layer {li} is not in the RAM tier", s.admitted))
            })?;
            for (m, &(base, size)) in [&x.gate_proj, &x.up_proj, &x.down_proj].into_iter().zip(&self.stacks[li]) {
                let src = m.bytes();
                if src.len() != size {
                    return Err(CudaError::Unsupported(format!(
                        "expert {} of layer {li}: {} bytes where the GPU slots hold {size}",
                        s.admitted,
                        src.len()
                    )));
                }
                htod(&self.upload, base + (s.slot * size) as u64, src.as_ptr(), size)?;
                bytes += size;
            }
        }
        let done = ctx.new_event(None)?;
        done.record(&self.upload)?;
        stats.cache_uploads.fetch_add(swaps.len() as u64, Relaxed);
        stats.pcie_bytes.fetch_add(bytes as u64, Relaxed);
        st.pending.push(Pending { layer: li, swaps, done });
        Ok(())
    }
}
