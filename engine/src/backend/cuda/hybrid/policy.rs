//! Where each layer's routed experts run in hybrid mode: every decision of the GPU + CPU split is made here, and
//! the kernels and the MoE block only carry it out.
//!
//! The placement (`crate::placement`) assigns every expert a tier (GPU, RAM, SSD) within the memory budgets. From
//! that plan and the [`HybridParams`], this module decides:
//!
//! 1. **Which experts are resident on the GPU** ([`HybridPolicy::resident`]): a layer's GPU-tier experts, in
//!    ascending id order (their slots in the layer's expert cache). The MTP block (layer index `n_layer`) keeps
//!    none: its experts stay on the host.
//! 2. **Which path a batch takes** ([`HybridPolicy::path`]): batches of up to [`HybridParams::cpu_max_tokens`]
//!    tokens, and every verify pass (its rows must be a decode step's rows), run their non-resident experts on
//!    the CPU ([`ExpertPath::CpuSplit`]); longer batches stream the non-resident experts to the GPU over PCIe
//!    ([`ExpertPath::Streamed`]).
//! 3. **The crossover between the two** ([`HybridPolicy::choose_crossover`]), unless fixed by
//!    [`crate::tuning::HybridTuning::cpu_max_tokens`] (`NEBULA_HYBRID_CPU_MAX_TOKENS`): from the PCIe upload and
//!    DRAM read bandwidths measured at load, the batch size up to which reading the used experts on the CPU costs
//!    less than moving every non-resident expert over PCIe ([`crossover_tokens`]), capped at
//!    [`CPU_PATH_MAX_TOKENS`].
//! 4. **Per token, on the CPU path** ([`HybridPolicy::split`], the numbers the `hybrid_split` kernel in
//!    kernels/cuda/moe.cu applies): when the resident experts cover less than [`HybridParams::handoff`]
//!    ([`crate::placement::DEFAULT_HANDOFF`], 0, by default; 0.9 is the original rule) of the token's router
//!    weight, the token's whole routed MoE goes to the CPU (expert handoff);
//!    otherwise the resident experts run on the GPU and the rest on the CPU, whose lightest experts are dropped
//!    while their summed weight stays within [`HybridParams::omit`] (marginal-expert omission, 0 = off). In an MTP
//!    verify pass, unless [`HybridParams::verify_handoff`], a row under the handoff threshold is not handed off but
//!    reported (its coverage written, the row untrusted, no CPU experts): the decoder cuts the chain there.
//! 5. **Whether the resident experts change during the run** ([`HybridPolicy::gpu_cache`], the placement's
//!    `gpu_cache`): static (the placement's GPU tier throughout), or LRU over the experts decode steps use, whose
//!    per-layer decisions ([`HybridPolicy::expert_caches`]: swaps, upload budget, refresh interval) are
//!    [`crate::placement::expert_cache`]'s; the backend uploads the newcomers over PCIe on a side stream without
//!    blocking a step (`hybrid::expert_cache`). A slot being filled is out of use, so its expert runs on the CPU
//!    until the upload lands. Experts outside the RAM tier (SSD) are never admitted.

use super::super::chain::MAX_CHAIN_ROWS;
use crate::model::Qwen4Exp;
use crate::placement::Tier;
use crate::placement::expert_cache::{ExpertCache, GpuCacheOptions, GpuCachePolicy};
use crate::tuning::HybridTuning;

/// Settings of the hybrid backend.
#[derive(Debug, Clone, Copy)]
pub struct HybridParams {
    /// Expert handoff: below this coverage of a token's router weight by GPU-resident experts, the token's
    /// routed MoE for the layer runs on the CPU (0.9).
    pub handoff: f32,
    /// Marginal omission: the lightest CPU experts of a token are dropped while their summed weight stays within
    /// this fraction (0 = strict).
    pub omit: f32,
    /// Batches up to this many tokens run their non-resident experts on the CPU; longer ones stream the experts
    /// to the GPU. 0 (the default) chooses at load by measured cost ([`crossover_tokens`]): PCIe upload bandwidth
    /// and DRAM read bandwidth measured on this machine.
    pub cpu_max_tokens: usize,
    /// Experts per staging buffer for streamed prefill (default 32).
    pub stage_experts: usize,
    /// Staging buffers in the ring (at least 2; default 6: about 0.5 GiB of 2.6 MiB experts, inside the ~1 GB
    /// the 12 GB profile leaves free). The copy stream runs up to this many groups minus one ahead of the experts'
    /// kernels, across layer boundaries, so transfers overlap the next layer's token mixer too.
    pub stages: usize,
    /// MTP verify passes hand a low-coverage row's experts to the CPU like a decode step (every row exact,
    /// coverage 1) instead of verifying it with the resident experts only and reporting its coverage (the
    /// default).
    pub verify_handoff: bool,
}

impl HybridParams {
    /// The placement's handoff and omission fractions with the tuning's crossover, staging and verify settings.
    pub fn for_model(model: &Qwen4Exp, tuning: &HybridTuning) -> Self {
        let (handoff, omit) = model.hybrid_fractions();
        Self {
            handoff,
            omit,
            cpu_max_tokens: tuning.cpu_max_tokens,
            stage_experts: tuning.stage_experts,
            stages: tuning.stages.max(2),
            verify_handoff: tuning.verify_handoff,
        }
    }
}

/// The CPU MoE kernel's share of the DRAM read bandwidth on batch-1 decode (measured on the H200 machine's 14
/// threads, with the spinning pool of `quant::spin_pool`: 57 of 90 GB/s; 40 of 81-104 before it), used to predict
/// the CPU path's cost from the measured bandwidth.
pub(crate) const CPU_EXPERT_EFFICIENCY: f64 = 0.6;

/// Largest batch the CPU path takes (the pinned buffers are sized for it).
pub const CPU_PATH_MAX_TOKENS: usize = 512;

/// The crossover when every expert is resident (nothing is ever streamed).
const ALL_RESIDENT_CROSSOVER: usize = 96;

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

/// How a batch's non-resident routed experts run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExpertPath {
    /// On the CPU, the resident ones on the GPU at the same time (`hybrid_split` decides per token).
    CpuSplit,
    /// Streamed from host RAM to the GPU through the staging ring.
    Streamed,
}

/// The numbers the `hybrid_split` kernel applies per token.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SplitRule {
    /// [`HybridParams::handoff`].
    pub(crate) handoff: f32,
    /// [`HybridParams::omit`].
    pub(crate) omit: f32,
}

/// The hybrid decisions of a loaded model ([module docs](self)).
#[derive(Debug, Clone)]
pub(crate) struct HybridPolicy {
    params: HybridParams,
    /// Per layer (the MTP block last, when the model has one): the resident experts, ascending.
    resident: Vec<Vec<usize>>,
    n_expert: usize,
    /// Whether and how the resident experts follow the working set.
    gpu_cache: GpuCacheOptions,
}

impl HybridPolicy {
    /// The policy of a placed `model` under `params` (the crossover still as given: see
    /// [`Self::choose_crossover`]); `None` when the model has no placement.
    pub(crate) fn plan(model: &Qwen4Exp, params: HybridParams) -> Option<Self> {
        let tiers = model.expert_tiers()?;
        let mut resident: Vec<Vec<usize>> =
            tiers.iter().map(|t| (0..t.len()).filter(|&e| t[e] == Tier::Gpu).collect()).collect();
        if model.mtp().is_some() {
            // The MTP block (layer index n_layer): none of its experts on the GPU, all computed on the host.
            resident.push(Vec::new());
        }
        Some(Self { params, resident, n_expert: model.config.n_expert, gpu_cache: model.gpu_cache_options() })
    }

    /// The GPU expert cache settings (static unless the placement asks for LRU).
    pub(crate) fn gpu_cache(&self) -> GpuCacheOptions {
        self.gpu_cache
    }

    /// Turns the adaptive cache off (the slots keep the placement's experts): where the backend cannot upload
    /// without blocking (host memory not registered with the driver).
    pub(crate) fn keep_static(&mut self) {
        self.gpu_cache.policy = GpuCachePolicy::Static;
    }

    /// The per-layer cache bookkeeping of the first `trunk_layers` layers when the cache adapts (`None` when
    /// static or with no GPU slots): slot `s` of layer `l` starts with `resident_lists()[l][s]`; `eligible(l, e)`
    /// says whether expert `e` of layer `l` may be uploaded.
    pub(crate) fn expert_caches(
        &self,
        trunk_layers: usize,
        eligible: impl Fn(usize, usize) -> bool,
    ) -> Option<Vec<ExpertCache>> {
        let slots = self.resident.iter().take(trunk_layers).map(Vec::len).sum::<usize>();
        if self.gpu_cache.policy == GpuCachePolicy::Static || slots == 0 {
            return None;
        }
        Some(
            self.resident
                .iter()
                .take(trunk_layers)
                .enumerate()
                .map(|(l, res)| ExpertCache::new(self.n_expert, res, |e| eligible(l, e)))
                .collect(),
        )
    }

    /// The settings in effect.
    pub(crate) fn params(&self) -> HybridParams {
        self.params
    }

    /// The resident experts of every layer (the MTP block's last, when present), ascending: slot `s` of a layer's
    /// expert cache holds expert `resident(layer)[s]`.
    pub(crate) fn resident_lists(&self) -> &[Vec<usize>] {
        &self.resident
    }

    /// The experts of `layer` the GPU does not hold, ascending.
    pub(crate) fn streamed(&self, layer: usize) -> Vec<usize> {
        let res = &self.resident[layer];
        (0..self.n_expert).filter(|e| res.binary_search(e).is_err()).collect()
    }

    /// Fixes the crossover ([`HybridParams::cpu_max_tokens`]) when it was left to the load (0): from `measure`'s
    /// (PCIe upload, DRAM read) bandwidths in bytes/s, called only then and only when some trunk layer streams,
    /// for the mean number of streamed experts over the `trunk_layers` and routing `top_k` of `n_expert`. Capped
    /// at [`CPU_PATH_MAX_TOKENS`] either way. Returns the measured bandwidths when it measured.
    pub(crate) fn choose_crossover<E>(
        &mut self,
        trunk_layers: usize,
        top_k: usize,
        measure: impl FnOnce(usize) -> Result<(f64, f64), E>,
    ) -> Result<Option<(f64, f64)>, E> {
        let mut measured = None;
        if self.params.cpu_max_tokens == 0 {
            let trunk = &self.resident[..trunk_layers];
            let streams = |r: &Vec<usize>| r.len() < self.n_expert;
            self.params.cpu_max_tokens = match trunk.iter().position(streams) {
                Some(first) => {
                    let (pcie, dram) = measure(first)?;
                    measured = Some((pcie, dram));
                    let streamed = trunk.iter().map(|r| self.n_expert - r.len()).sum::<usize>() / trunk.len().max(1);
                    crossover_tokens(self.n_expert, top_k, streamed, pcie, dram * CPU_EXPERT_EFFICIENCY)
                }
                None => ALL_RESIDENT_CROSSOVER,
            };
        }
        self.params.cpu_max_tokens = self.params.cpu_max_tokens.min(CPU_PATH_MAX_TOKENS);
        Ok(measured)
    }

    /// The most rows the CPU path takes: the crossover, or a verify chain's rows when larger (the pinned host
    /// buffers are sized for it).
    pub(crate) fn cpu_path_rows(&self) -> usize {
        self.params.cpu_max_tokens.max(MAX_CHAIN_ROWS)
    }

    /// The path of a batch of `n` tokens; `verify` for a verify pass (whose rows must be a decode step's rows).
    pub(crate) fn path(&self, n: usize, verify: bool) -> ExpertPath {
        if n <= self.params.cpu_max_tokens || verify { ExpertPath::CpuSplit } else { ExpertPath::Streamed }
    }

    /// The per-token rule of the CPU path.
    pub(crate) fn split(&self) -> SplitRule {
        SplitRule { handoff: self.params.handoff, omit: self.params.omit }
    }

    /// Whether a verify pass reports each row's coverage (rows under the handoff threshold untrusted) instead of
    /// handing their experts to the CPU.
    pub(crate) fn verify_reports_coverage(&self) -> bool {
        !self.params.verify_handoff
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn policy(resident: Vec<Vec<usize>>, cpu_max_tokens: usize) -> HybridPolicy {
        let params = HybridParams {
            handoff: 0.9,
            omit: 0.05,
            cpu_max_tokens,
            stage_experts: 32,
            stages: 6,
            verify_handoff: false,
        };
        HybridPolicy { params, resident, n_expert: 8, gpu_cache: GpuCacheOptions::default() }
    }

    #[test]
    fn short_batches_and_verify_passes_take_the_cpu_path_longer_ones_stream() {
        let p = policy(vec![vec![0, 3]], 16);
        assert_eq!(p.path(1, false), ExpertPath::CpuSplit);
        assert_eq!(p.path(16, false), ExpertPath::CpuSplit);
        assert_eq!(p.path(17, false), ExpertPath::Streamed);
        assert_eq!(p.path(17, true), ExpertPath::CpuSplit);
        assert_eq!(p.streamed(0), vec![1, 2, 4, 5, 6, 7]);
        assert_eq!(p.cpu_path_rows(), MAX_CHAIN_ROWS);
        let r = p.split();
        assert_eq!((r.handoff, r.omit), (0.9, 0.05));
        assert!(p.verify_reports_coverage());
    }

    #[test]
    fn the_cache_adapts_only_when_asked_and_where_there_are_slots() {
        let mut p = policy(vec![vec![0, 3], vec![1]], 16);
        assert!(p.expert_caches(2, |_, _| true).is_none(), "static by default");
        p.gpu_cache.policy = GpuCachePolicy::Lru;
        let caches = p.expert_caches(2, |l, e| l == 0 || e != 5).unwrap();
        assert_eq!(caches.len(), 2);
        assert_eq!((caches[0].slot_of(3), caches[1].slot_of(1), caches[1].slot_of(0)), (Some(1), Some(0), None));
        p.keep_static();
        assert!(p.expert_caches(2, |_, _| true).is_none());
        let mut none = policy(vec![vec![], vec![]], 16);
        none.gpu_cache.policy = GpuCachePolicy::Lru;
        assert!(none.expert_caches(2, |_, _| true).is_none(), "no slots: nothing to adapt");
    }

    #[test]
    fn the_crossover_is_measured_only_when_left_open_and_something_streams() {
        // Fixed: never measured, capped at the CPU path's limit.
        let mut p = policy(vec![vec![0]], 4096);
        let measured = p.choose_crossover(1, 2, |_| -> Result<(f64, f64), ()> { panic!("measured") }).unwrap();
        assert_eq!((measured, p.params().cpu_max_tokens), (None, CPU_PATH_MAX_TOKENS));
        // Everything resident: nothing to measure.
        let mut p = policy(vec![(0..8).collect()], 0);
        p.choose_crossover(1, 2, |_| -> Result<(f64, f64), ()> { panic!("measured") }).unwrap();
        assert_eq!(p.params().cpu_max_tokens, ALL_RESIDENT_CROSSOVER);
        // Open, layer 1 streams: measured on layer 1, from the mean streamed count (0 + 6) / 2 = 3.
        let mut p = policy(vec![(0..8).collect(), vec![0, 1]], 0);
        let measured = p.choose_crossover(2, 2, |layer| Ok::<_, ()>((layer as f64 * 1e9, 1e9))).unwrap();
        assert_eq!(measured, Some((1e9, 1e9)));
        assert_eq!(p.params().cpu_max_tokens, crossover_tokens(8, 2, 3, 1e9, 1e9 * CPU_EXPERT_EFFICIENCY));
    }
}
