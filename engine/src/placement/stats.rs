//! Counters of the placement since start: routed expert uses by tier, SSD reads and bytes, read errors,
//! prefetches, n-gram table rows fetched. Read by the service's `/metrics` and `/v1/placement`.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// The tier an expert lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// GPU-resident (the top X of the layer); the CPU backend computes it from its RAM copy.
    Gpu,
    /// RAM (locked anonymous memory, or the file's page cache when no placement is set).
    Ram,
    /// Read from SSD on demand.
    Ssd,
}

impl Tier {
    /// Every tier, in order.
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Ram, Tier::Ssd];

    /// `gpu`, `ram` or `ssd`.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Ram => "ram",
            Tier::Ssd => "ssd",
        }
    }
}

/// Counters, updated by the forward pass and the I/O threads (relaxed atomics: totals, not a consistent cut).
#[derive(Debug, Default)]
pub struct PlacementStats {
    /// Routed expert uses (token x expert) served from the GPU tier.
    pub hits_gpu: AtomicU64,
    /// Routed expert uses served from the RAM tier.
    pub hits_ram: AtomicU64,
    /// Routed expert uses served from the SSD tier.
    pub hits_ssd: AtomicU64,
    /// Experts read from SSD (each read brings in gate, up and down).
    pub ssd_reads: AtomicU64,
    /// Bytes of expert weights read from SSD.
    pub ssd_bytes: AtomicU64,
    /// Failed reads (experts and n-gram rows).
    pub ssd_errors: AtomicU64,
    /// Expert reads started by the prefetcher.
    pub prefetch_issued: AtomicU64,
    /// Of those, experts a compute step then found loaded or loading.
    pub prefetch_hits: AtomicU64,
    /// Times the prefetch gate closed because too few prefetched experts were used (see `ssd::PrefetchGate`).
    pub prefetch_gate_closed: AtomicU64,
    /// n-gram table rows read from SSD.
    pub ngram_rows: AtomicU64,
    /// Bytes of n-gram table rows read from SSD.
    pub ngram_bytes: AtomicU64,
    /// Token-layers whose routed MoE the hybrid GPU backend handed to the CPU (GPU-resident experts covered
    /// less than the handoff fraction of the token's router weight).
    pub handoffs: AtomicU64,
    /// Routed expert uses dropped by the marginal-expert omission (off in strict mode).
    pub omitted: AtomicU64,
    /// Bytes copied between host and GPU by the hybrid backend (per-layer activations both ways, expert weights
    /// streamed for prefill).
    pub pcie_bytes: AtomicU64,
    /// Experts the hybrid backend's adaptive GPU expert cache uploaded into GPU slots (their bytes also count in
    /// `pcie_bytes`).
    pub cache_uploads: AtomicU64,
}

impl PlacementStats {
    /// Adds `uses` routed expert uses to `tier`.
    pub fn hit(&self, tier: Tier, uses: u64) {
        let c = match tier {
            Tier::Gpu => &self.hits_gpu,
            Tier::Ram => &self.hits_ram,
            Tier::Ssd => &self.hits_ssd,
        };
        c.fetch_add(uses, Ordering::Relaxed);
    }

    /// Routed expert uses of `tier` so far.
    pub fn hits(&self, tier: Tier) -> u64 {
        match tier {
            Tier::Gpu => &self.hits_gpu,
            Tier::Ram => &self.hits_ram,
            Tier::Ssd => &self.hits_ssd,
        }
        .load(Ordering::Relaxed)
    }

    /// A copy of every counter.
    pub fn snapshot(&self) -> StatsSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            expert_hits_gpu: l(&self.hits_gpu),
            expert_hits_ram: l(&self.hits_ram),
            expert_hits_ssd: l(&self.hits_ssd),
            ssd_expert_reads: l(&self.ssd_reads),
            ssd_expert_bytes: l(&self.ssd_bytes),
            ssd_read_errors: l(&self.ssd_errors),
            prefetch_issued: l(&self.prefetch_issued),
            prefetch_hits: l(&self.prefetch_hits),
            prefetch_gate_closed: l(&self.prefetch_gate_closed),
            ngram_rows_read: l(&self.ngram_rows),
            ngram_bytes_read: l(&self.ngram_bytes),
            handoffs: l(&self.handoffs),
            omitted: l(&self.omitted),
            pcie_bytes: l(&self.pcie_bytes),
            cache_uploads: l(&self.cache_uploads),
        }
    }
}

/// The counters at one moment (see [`PlacementStats`] for each one's meaning).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StatsSnapshot {
    /// Routed expert uses from the GPU tier.
    pub expert_hits_gpu: u64,
    /// Routed expert uses from the RAM tier.
    pub expert_hits_ram: u64,
    /// Routed expert uses from the SSD tier.
    pub expert_hits_ssd: u64,
    /// Experts read from SSD.
    pub ssd_expert_reads: u64,
    /// Expert bytes read from SSD.
    pub ssd_expert_bytes: u64,
    /// Failed reads.
    pub ssd_read_errors: u64,
    /// Prefetched expert reads.
    pub prefetch_issued: u64,
    /// Prefetched experts then used.
    pub prefetch_hits: u64,
    /// Times the prefetch gate closed.
    pub prefetch_gate_closed: u64,
    /// n-gram rows read from SSD.
    pub ngram_rows_read: u64,
    /// n-gram bytes read from SSD.
    pub ngram_bytes_read: u64,
    /// Token-layers handed to the CPU by the hybrid backend.
    pub handoffs: u64,
    /// Marginal expert uses omitted.
    pub omitted: u64,
    /// Bytes over PCIe (hybrid backend).
    pub pcie_bytes: u64,
    /// Experts uploaded by the adaptive GPU expert cache.
    pub cache_uploads: u64,
}
