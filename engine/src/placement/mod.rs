//! Expert placement: which routed experts of each layer live on the GPU, in RAM or on SSD,
//! and where the n-gram table lives.
//!
//! A [`PlacementPlan`] ranks each layer's experts by the [`Hotlist`] (or by id when there is none) and gives the
//! top X to the GPU, the top H to RAM (the GPU experts keep a RAM copy) and the rest to SSD. [`PlacementOptions`]
//! carries X, H, the table's place, the budgets and the I/O settings; [`crate::model::Qwen4Exp::place`] builds
//! the placement:
//!
//! - **GPU tier**: marked for the GPU expert cache (the CUDA backend's concern); the CPU backend computes these
//!   experts from their RAM copy.
//! - **RAM tier**: the experts are read (direct I/O) into page-aligned anonymous memory, locked with `mlock` when
//!   the process may ([`memory`]); the file's page cache is never relied on.
//! - **SSD tier**: read on demand into a bounded pool of aligned buffers by several I/O threads, kept while there
//!   is room, and prefetched with the next layers' routers applied to the current hidden state (`ssd.rs`).
//! - **n-gram table**: in RAM, on SSD (rows fetched ahead of the PLE layer, `ngram.rs`) or left memory-mapped.
//!
//! Before anything is allocated the plan is checked against the budgets and `MemAvailable`; a placement that does
//! not fit is refused with what it needs and what there is. A failed read at run time fails that forward call
//! with the file and offset ([`crate::model::ModelError::WeightRead`]); the engine stays up.
//!
//! Results do not depend on the placement: each expert's output is computed the same way wherever its bytes
//! came from, and a layer's experts are summed in one fixed order ([`crate::quant::moe`]), so greedy tokens are
//! identical for any X, H, pool size and thread count.

pub mod campaign;
pub mod expert_cache;
pub mod hotlist;
pub mod memory;
pub(crate) mod ngram;
pub mod reader;
pub(crate) mod ssd;
pub mod stats;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::model::moe::{Expert, Routing, SparseMoe};
use crate::model::{ModelError, Qwen4Exp};
use crate::quant::moe::{ExpertContribution, ExpertOutputs, ExpertWork, combine_expert_outputs, expert_outputs};
use crate::quant::{Matrix, WeightBytes, dot_f32};

pub use expert_cache::{GpuCacheOptions, GpuCachePolicy};
pub use hotlist::{Hotlist, HotlistBuilder, HotlistError, HotlistModel};
pub use reader::{FaultyReader, FileReader, MemoryReader, ReadError, Span, WeightReader};
pub use stats::{PlacementStats, StatsSnapshot, Tier};

use memory::LockPolicy;
use ngram::{NgramTable, RowFetch, SsdTable};
use ssd::{ExpertSource, IoPool, Requested, SsdTier};

/// Where the hashed n-gram (PLE) table lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TablePlacement {
    /// Read through the file's memory map (page cache), as without placement.
    #[default]
    Mapped,
    /// Copied into (locked) RAM at start.
    Ram,
    /// Read from SSD a row at a time, ahead of the PLE layer.
    Ssd,
}

impl TablePlacement {
    /// `mapped`, `ram` or `ssd`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Mapped => "mapped",
            Self::Ram => "ram",
            Self::Ssd => "ssd",
        }
    }
}

impl std::str::FromStr for TablePlacement {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mapped" => Ok(Self::Mapped),
            "ram" => Ok(Self::Ram),
            "ssd" => Ok(Self::Ssd),
            other => Err(format!("unknown n-gram table placement '{other}' (ram, ssd, mapped)")),
        }
    }
}

/// The default expert handoff of the hybrid GPU backend ([`PlacementOptions::handoff`]): 0, so every token's
/// resident experts run on the GPU and the others on the CPU (1.43x the decode speed of the original rule's 0.9
/// on the H200 machine's 12 GB emulation, docs/benchmarks/2026-12-02-h200-mtp.md).
pub const DEFAULT_HANDOFF: f32 = 0.0;

/// How to place a model's experts and n-gram table.
#[derive(Clone)]
pub struct PlacementOptions {
    /// Experts per layer in the GPU tier (the top X of the ranking).
    pub gpu_experts: usize,
    /// Experts per layer held in RAM, the GPU ones' copies included (the top H); at least `gpu_experts`. Values
    /// at or above the layer's expert count put every expert in RAM.
    pub ram_experts: usize,
    /// The ranking; `None`: expert id order.
    pub hotlist: Option<Arc<Hotlist>>,
    /// Where the hotlist came from, for the report (a path, or `expert id order`).
    pub hotlist_label: String,
    /// Where the n-gram table goes.
    pub ngram_table: TablePlacement,
    /// VRAM the GPU side may use, bytes: the GPU experts plus the dense trunk must fit.
    pub vram_budget: Option<u64>,
    /// RAM the engine may use, bytes: the RAM tier, the SSD buffer pool, the table when in RAM and the dense
    /// trunk (read through the page cache on the CPU backend) must fit.
    pub ram_budget: Option<u64>,
    /// Bytes of the SSD buffer pool; `None`: room for `2 x n_expert_used x (1 + prefetch_layers)` experts.
    pub ssd_pool_bytes: Option<u64>,
    /// I/O threads reading the SSD tier and table rows.
    pub io_threads: usize,
    /// Layers ahead whose routers predict the SSD experts to prefetch (0: no prefetch).
    pub prefetch_layers: usize,
    /// Read with `O_DIRECT` (falls back to buffered reads, with a warning, where the file system refuses it).
    pub direct_io: bool,
    /// `mlock` the RAM tier, the pool and the RAM table (falls back to unlocked memory, with a warning).
    pub lock_memory: bool,
    /// Read through this instead of the model's files (tests, fault injection).
    pub reader: Option<Arc<dyn WeightReader>>,
    /// What the placement came from, for the report (e.g. `profile 12gb-vram-128gb-ram`).
    pub source: String,
    /// The experts per layer the counts were written for (a profile's `experts_per_layer`, 512): a model with
    /// another number gets the counts scaled to its own (the 28 MB demo model has 32). `None`: counts as given.
    pub counts_for_experts: Option<usize>,
    /// Hybrid GPU backend: a token whose GPU-resident experts cover less than this fraction of its
    /// router weight has the layer's whole routed MoE computed on the CPU. Default [`DEFAULT_HANDOFF`].
    pub handoff: f32,
    /// Hybrid GPU backend: the lightest CPU-side experts of a token are dropped while their summed weight stays
    /// within this fraction of the token's mass (marginal-expert omission; 0 = strict, the default).
    pub omit_marginal: f32,
    /// Hybrid GPU backend: whether the GPU tier's experts stay the placement's (static, the default) or follow the
    /// working set ([`expert_cache`]).
    pub gpu_cache: GpuCacheOptions,
}

impl Default for PlacementOptions {
    /// Everything in RAM, no GPU experts, the table left mapped, 4 I/O threads, one layer of prefetch.
    fn default() -> Self {
        Self {
            gpu_experts: 0,
            ram_experts: usize::MAX,
            hotlist: None,
            hotlist_label: DEFAULT_HOTLIST_LABEL.into(),
            ngram_table: TablePlacement::Mapped,
            vram_budget: None,
            ram_budget: None,
            ssd_pool_bytes: None,
            io_threads: 4,
            prefetch_layers: 1,
            direct_io: true,
            lock_memory: true,
            reader: None,
            source: "options".into(),
            counts_for_experts: None,
            handoff: DEFAULT_HANDOFF,
            omit_marginal: 0.0,
            gpu_cache: GpuCacheOptions::default(),
        }
    }
}

impl PlacementOptions {
    /// (GPU, RAM) experts per layer for a model of `n_expert` experts: as given, or scaled from
    /// [`PlacementOptions::counts_for_experts`] (rounded to the nearest expert, RAM kept at least the GPU count).
    pub fn counts_for(&self, n_expert: usize) -> (usize, usize) {
        match self.counts_for_experts {
            Some(base) if base > 0 && base != n_expert => {
                let scale = |c: usize| {
                    if c >= base {
                        n_expert
                    } else {
                        ((c as f64 * n_expert as f64 / base as f64).round() as usize).min(n_expert)
                    }
                };
                let gpu = scale(self.gpu_experts);
                (gpu, scale(self.ram_experts).max(gpu))
            }
            _ => (self.gpu_experts, self.ram_experts),
        }
    }
}

impl std::fmt::Debug for PlacementOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlacementOptions")
            .field("gpu_experts", &self.gpu_experts)
            .field("ram_experts", &self.ram_experts)
            .field("hotlist", &self.hotlist_label)
            .field("ngram_table", &self.ngram_table)
            .field("vram_budget", &self.vram_budget)
            .field("ram_budget", &self.ram_budget)
            .field("ssd_pool_bytes", &self.ssd_pool_bytes)
            .field("io_threads", &self.io_threads)
            .field("prefetch_layers", &self.prefetch_layers)
            .field("direct_io", &self.direct_io)
            .field("lock_memory", &self.lock_memory)
            .field("reader", &self.reader.as_ref().map(|r| r.describe()))
            .field("source", &self.source)
            .field("counts_for_experts", &self.counts_for_experts)
            .field("handoff", &self.handoff)
            .field("omit_marginal", &self.omit_marginal)
            .field("gpu_cache", &self.gpu_cache)
            .finish()
    }
}

/// The report's hotlist label when none is given.
pub const DEFAULT_HOTLIST_LABEL: &str = "expert id order (no hotlist given)";

/// Why a placement cannot be built. Each message says what was asked and what is there.
#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    /// The hotlist cannot be read or does not fit the model.
    #[error(transparent)]
    Hotlist(#[from] HotlistError),
    /// The options contradict each other or the model.
    #[error("placement: {0}")]
    Invalid(String),
    /// The placement needs more memory than the budget or the machine has; nothing was allocated.
    #[error("placement does not fit: {0}")]
    DoesNotFit(String),
    /// Reading the RAM tier or the table at start failed.
    #[error("placement: {0}")]
    Read(#[from] ReadError),
    /// An allocation or thread could not be made.
    #[error("placement: {what}: {source}")]
    Resource {
        /// What was being made.
        what: String,
        /// The system's error.
        source: std::io::Error,
    },
}

/// The tier of every routed expert of every layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementPlan {
    /// `[layer][expert]`.
    pub tiers: Vec<Vec<Tier>>,
    /// Each layer's experts, hottest first.
    pub ranking: Vec<Vec<usize>>,
}

impl PlacementPlan {
    /// The top `gpu` experts of each layer's ranking on the GPU, the next ones up to `ram` in RAM, the rest on
    /// SSD. The ranking is the hotlist's, or expert id order without one.
    ///
    /// Errors: [`PlacementError::Invalid`] when `gpu` exceeds the experts per layer or `ram` is below `gpu` (RAM
    /// keeps a copy of every GPU expert); a hotlist made for another shape of model.
    pub fn new(
        n_layer: usize,
        n_expert: usize,
        gpu: usize,
        ram: usize,
        hotlist: Option<&Hotlist>,
    ) -> Result<Self, PlacementError> {
        if gpu > n_expert {
            return Err(PlacementError::Invalid(format!(
                "{gpu} GPU experts per layer asked, the model has {n_expert} experts per layer"
            )));
        }
        if ram < gpu {
            return Err(PlacementError::Invalid(format!(
                "{ram} RAM experts per layer is fewer than the {gpu} GPU experts: RAM keeps a copy of every GPU \
                 expert, so the RAM count includes them"
            )));
        }
        if let Some(h) = hotlist {
            h.check_model(n_layer, n_expert)
                .map_err(|detail| HotlistError { source_name: "given to the engine".into(), detail })?;
        }
        if ram > n_expert {
            tracing::warn!(
                "placement: {ram} RAM experts per layer asked for, but the model has {n_expert} experts per layer: \
                 all {n_expert} go to RAM"
            );
        }
        let ram = ram.min(n_expert);
        let mut tiers = Vec::with_capacity(n_layer);
        let mut ranking = Vec::with_capacity(n_layer);
        for l in 0..n_layer {
            let rank = hotlist.map_or_else(|| (0..n_expert).collect(), |h| h.ranking(l));
            let mut t = vec![Tier::Ssd; n_expert];
            for (i, &e) in rank.iter().enumerate() {
                t[e] = if i < gpu {
                    Tier::Gpu
                } else if i < ram {
                    Tier::Ram
                } else {
                    Tier::Ssd
                };
            }
            tiers.push(t);
            ranking.push(rank);
        }
        Ok(Self { tiers, ranking })
    }

    /// Experts of `layer` in `tier`, ascending ids.
    pub fn experts(&self, layer: usize, tier: Tier) -> Vec<usize> {
        self.tiers.get(layer).map_or_else(Vec::new, |t| (0..t.len()).filter(|&e| t[e] == tier).collect())
    }
}

/// One layer in the [`PlacementReport`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LayerReport {
    /// Trunk layer.
    pub layer: usize,
    /// GPU-tier experts (each also has a RAM copy).
    pub gpu: usize,
    /// RAM-tier experts besides the GPU ones.
    pub ram: usize,
    /// SSD-tier experts.
    pub ssd: usize,
    /// Expert ids of each tier, ascending.
    pub experts: TierExperts,
}

/// Expert ids per tier of one layer.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct TierExperts {
    /// GPU tier.
    pub gpu: Vec<usize>,
    /// RAM tier (GPU copies not repeated).
    pub ram: Vec<usize>,
    /// SSD tier.
    pub ssd: Vec<usize>,
}

/// Memory the placement uses, bytes.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct MemoryReport {
    /// The VRAM budget, when given.
    pub vram_budget_bytes: Option<u64>,
    /// GPU-tier experts.
    pub gpu_expert_bytes: u64,
    /// What the GPU side needs: GPU experts + the dense weights (without the MTP block's routed experts).
    pub vram_planned_bytes: u64,
    /// The RAM budget, when given.
    pub ram_budget_bytes: Option<u64>,
    /// RAM tier (GPU copies included), as allocated.
    pub ram_tier_bytes: u64,
    /// SSD buffer pool.
    pub ssd_pool_bytes: u64,
    /// The n-gram table when in RAM.
    pub ngram_ram_bytes: u64,
    /// Dense trunk (every weight but routed experts, table and embedding), read through the page cache.
    pub dense_bytes: u64,
    /// Of the allocations above, bytes locked with mlock.
    pub locked_bytes: u64,
    /// `locked`, `partial` (mlock refused part way), `unlocked` (refused or not wanted) or `none` (nothing
    /// allocated).
    pub lock: String,
    /// `MemAvailable` when the placement was built.
    pub mem_available_bytes: Option<u64>,
}

/// The n-gram table's place.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TableReport {
    /// `ram`, `ssd`, `mapped`, or `none` (the model has no PLE).
    pub placement: String,
    /// The table's bytes in the file.
    pub bytes: u64,
}

/// The SSD tier's machinery.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SsdReport {
    /// How reads are done (`direct I/O on 1 file`, ...).
    pub reader: String,
    /// True when reads bypass the page cache.
    pub direct_io: bool,
    /// I/O threads.
    pub io_threads: usize,
    /// Pool buffers (experts the pool holds at once).
    pub pool_buffers: usize,
    /// Bytes of one pool buffer.
    pub buffer_bytes: usize,
    /// Layers ahead whose routers drive the prefetch.
    pub prefetch_layers: usize,
}

/// The placement as built: the startup report and `GET /v1/placement`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlacementReport {
    /// False when no placement was set: every weight is read through the file's memory map.
    pub placed: bool,
    /// What the placement came from.
    pub source: String,
    /// The ranking's source.
    pub hotlist: String,
    /// Routed experts per layer.
    pub experts_per_layer: usize,
    /// Bytes of one routed expert (gate + up + down), averaged.
    pub expert_bytes: u64,
    /// Per layer: experts per tier.
    pub layers: Vec<LayerReport>,
    /// The n-gram table.
    pub ngram_table: TableReport,
    /// Memory.
    pub memory: MemoryReport,
    /// The SSD tier (`None` when no expert and no table is on SSD).
    pub ssd: Option<SsdReport>,
}

impl PlacementReport {
    /// The report of a model without placement: everything memory-mapped, every expert counted as RAM.
    pub fn unplaced(model: &Qwen4Exp) -> Self {
        let (dense, experts, table) = model.weight_bytes();
        let (n_layer, n_expert) = (model.config.n_layer, model.config.n_expert);
        let all: Vec<usize> = (0..n_expert).collect();
        Self {
            placed: false,
            source: "none (every weight memory-mapped)".into(),
            hotlist: "none".into(),
            experts_per_layer: n_expert,
            expert_bytes: experts / (n_layer * n_expert).max(1) as u64,
            layers: (0..n_layer)
                .map(|layer| LayerReport {
                    layer,
                    gpu: 0,
                    ram: n_expert,
                    ssd: 0,
                    experts: TierExperts { ram: all.clone(), ..Default::default() },
                })
                .collect(),
            ngram_table: TableReport {
                placement: if model.config.ple.is_some() { "mapped" } else { "none" }.into(),
                bytes: table,
            },
            memory: MemoryReport { dense_bytes: dense, lock: "none".into(), ..Default::default() },
            ssd: None,
        }
    }

    /// Expert counts per tier summed over layers: (GPU, RAM, SSD).
    pub fn totals(&self) -> (usize, usize, usize) {
        self.layers.iter().fold((0, 0, 0), |(g, r, s), l| (g + l.gpu, r + l.ram, s + l.ssd))
    }

    /// A few lines for the startup log.
    pub fn summary(&self) -> String {
        let (g, r, s) = self.totals();
        let n = self.layers.len().max(1);
        let mut out = format!(
            "placement from {}: ranking {}; per layer (mean of {n}) {:.1} GPU + {:.1} RAM + {:.1} SSD experts of {} \
             ({} each)",
            self.source,
            self.hotlist,
            g as f64 / n as f64,
            r as f64 / n as f64,
            s as f64 / n as f64,
            self.experts_per_layer,
            human(self.expert_bytes)
        );
        let m = &self.memory;
        out.push_str(&format!(
            "\n  VRAM planned {} (GPU experts {} + dense {}){}; RAM tier {}, SSD pool {}, n-gram table {} ({}){}; \
             memory {}{}",
            human(m.vram_planned_bytes),
            human(m.gpu_expert_bytes),
            human(m.vram_planned_bytes.saturating_sub(m.gpu_expert_bytes)),
            m.vram_budget_bytes.map_or(String::new(), |b| format!(" of a {} budget", human(b))),
            human(m.ram_tier_bytes),
            human(m.ssd_pool_bytes),
            self.ngram_table.placement,
            human(self.ngram_table.bytes),
            m.ram_budget_bytes.map_or(String::new(), |b| format!("; RAM budget {}", human(b))),
            m.lock,
            m.mem_available_bytes.map_or(String::new(), |b| format!(", {} available at start", human(b)))
        ));
        if let Some(s) = &self.ssd {
            out.push_str(&format!(
                "\n  SSD: {}, {} I/O threads, pool of {} buffers x {}, prefetch {} layer(s) ahead",
                s.reader,
                s.io_threads,
                s.pool_buffers,
                human(s.buffer_bytes as u64),
                s.prefetch_layers
            ));
        }
        out
    }
}

/// `1.5 GiB`, `2.6 MiB`, `3.2 KiB`, `512 B`.
fn human(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..1024 => format!("{bytes} B"),
        1024..1_048_576 => format!("{:.1} KiB", b / 1024.0),
        1_048_576..1_073_741_824 => format!("{:.1} MiB", b / 1_048_576.0),
        _ => format!("{:.2} GiB", b / 1_073_741_824.0),
    }
}

/// An expert's host weights: borrowed from the RAM tier (or the model file), or held from the SSD pool.
pub(crate) enum HostExpert<'a> {
    /// In RAM.
    Borrowed(&'a Expert),
    /// Read from SSD; the pool buffer stays taken while this lives.
    Loaded(ssd::LoadedExpert),
}

impl std::ops::Deref for HostExpert<'_> {
    type Target = Expert;
    fn deref(&self) -> &Expert {
        match self {
            HostExpert::Borrowed(e) => e,
            HostExpert::Loaded(e) => e,
        }
    }
}

/// A model's placement as built: the tiers, the RAM copies, the SSD tier and the table.
pub(crate) struct Placement {
    tiers: Vec<Vec<Tier>>,
    /// RAM copies of the GPU and RAM tiers, `[layer][expert]`.
    resident: Vec<Vec<Option<Expert>>>,
    ssd: Option<SsdTier>,
    table: Option<NgramTable>,
    report: PlacementReport,
    prefetch_layers: usize,
    layer_has_ssd: Vec<bool>,
    stats: Arc<PlacementStats>,
    /// (handoff fraction, marginal omission fraction) for the hybrid GPU backend.
    hybrid: (f32, f32),
    /// The hybrid GPU backend's expert cache settings.
    gpu_cache: GpuCacheOptions,
    /// Kept alive for the SSD tier and the table.
    _io: Option<Arc<IoPool>>,
}

/// Where `m`'s bytes are in the model file.
fn span_of(model: &Qwen4Exp, m: &Matrix, what: &str) -> Result<Span, PlacementError> {
    let (part, offset) = model.file.locate(m.bytes()).ok_or_else(|| {
        PlacementError::Invalid(format!("{what}: its bytes are not inside the model file (internal error)"))
    })?;
    Ok(Span { part, offset, len: m.bytes().len() })
}

fn expert_source(model: &Qwen4Exp, layer: usize, e: usize) -> Result<ExpertSource, PlacementError> {
    let x = &model.layers[layer].mlp.experts[e];
    let what = format!("expert {e} of layer {layer}");
    let shape = |m: &Matrix| (m.ggml_type(), m.rows(), m.cols());
    Ok(ExpertSource {
        spans: [
            span_of(model, &x.gate_proj, &what)?,
            span_of(model, &x.up_proj, &what)?,
            span_of(model, &x.down_proj, &what)?,
        ],
        shapes: [shape(&x.gate_proj), shape(&x.up_proj), shape(&x.down_proj)],
    })
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// The default reader of a model: its part files (direct I/O when asked), or its bytes when it was loaded from
/// memory. A part that cannot be opened (a missing shard) is an error naming it.
fn default_reader(model: &Qwen4Exp, direct: bool) -> Result<Arc<dyn WeightReader>, PlacementError> {
    if model.file.is_mapped() {
        let paths: Vec<&Path> = model.file.part_paths().collect();
        Ok(Arc::new(FileReader::open(&paths, direct)?))
    } else {
        Ok(Arc::new(MemoryReader::new(model.file.clone())))
    }
}

impl Placement {
    /// Builds the placement of `model` (see the module docs). Checks every budget before allocating.
    pub(crate) fn build(
        model: &Qwen4Exp,
        opts: &PlacementOptions,
        stats: Arc<PlacementStats>,
    ) -> Result<Self, PlacementError> {
        let cfg = &model.config;
        let (n_layer, n_expert) = (cfg.n_layer, cfg.n_expert);
        let (gpu_experts, ram_experts) = opts.counts_for(n_expert);
        for (name, v) in [("handoff", opts.handoff), ("omit_marginal", opts.omit_marginal)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(PlacementError::Invalid(format!("{name} must be a fraction in [0, 1], got {v}")));
            }
        }
        let plan = PlacementPlan::new(n_layer, n_expert, gpu_experts, ram_experts, opts.hotlist.as_deref())?;
        let reader = match &opts.reader {
            Some(r) => r.clone(),
            None => default_reader(model, opts.direct_io)?,
        };
        let align = reader.alignment();
        let (dense, all_expert_bytes, table_bytes) = model.weight_bytes();
        let expert_bytes = all_expert_bytes / (n_layer * n_expert).max(1) as u64;

        // Sizes first: nothing is allocated until the plan is known to fit.
        let mut sources: Vec<Vec<ExpertSource>> = Vec::with_capacity(n_layer);
        let mut ram_tier = 0u64;
        let mut gpu_bytes = 0u64;
        let mut slot = 0usize;
        let mut ssd_count = 0usize;
        for l in 0..n_layer {
            let mut layer = Vec::with_capacity(n_expert);
            for e in 0..n_expert {
                let s = expert_source(model, l, e)?;
                match plan.tiers[l][e] {
                    Tier::Gpu => {
                        gpu_bytes += s.spans.iter().map(|s| s.len as u64).sum::<u64>();
                        ram_tier += s.buffer_len(align) as u64;
                    }
                    Tier::Ram => ram_tier += s.buffer_len(align) as u64,
                    Tier::Ssd => {
                        slot = slot.max(s.buffer_len(align));
                        ssd_count += 1;
                    }
                }
                layer.push(s);
            }
            sources.push(layer);
        }
        let ple = model.layers.iter().find_map(|l| l.ple.as_ref());
        let table_ram = match (ple, opts.ngram_table) {
            (Some(p), TablePlacement::Ram) => {
                let s = span_of(model, &p.ngram_embedding, "the n-gram table")?;
                s.padded_len(align).div_ceil(memory::BUFFER_ALIGN) as u64 * memory::BUFFER_ALIGN as u64
            }
            _ => 0,
        };
        let pool_buffers = if ssd_count == 0 {
            0
        } else {
            let default = 2 * cfg.n_expert_used * (1 + opts.prefetch_layers);
            let asked = opts.ssd_pool_bytes.map_or(default, |b| (b / slot.max(1) as u64) as usize);
            // Two batches of one token's experts, so one can be read while the other computes.
            asked.max(2 * cfg.n_expert_used).min(ssd_count).max(1)
        };
        let pool_bytes = (pool_buffers * slot.div_ceil(memory::BUFFER_ALIGN) * memory::BUFFER_ALIGN) as u64;
        let ram_needed = ram_tier + pool_bytes + table_ram;
        let available = memory::mem_available();
        if let Some(budget) = opts.ram_budget
            && ram_needed + dense > budget
        {
            return Err(PlacementError::DoesNotFit(format!(
                "the RAM budget is {} but the placement needs {}: RAM tier {} ({} experts per layer, GPU copies \
                 included), SSD buffer pool {}, n-gram table {}, dense trunk {}. Lower the RAM experts per layer, put \
                 the n-gram table on SSD, or raise the budget",
                gib(budget),
                gib(ram_needed + dense),
                gib(ram_tier),
                ram_experts.min(n_expert),
                gib(pool_bytes),
                gib(table_ram),
                gib(dense)
            )));
        }
        // Keep 512 MiB for everything else (state, activations, the service).
        const MARGIN: u64 = 512 << 20;
        if let Some(avail) = available
            && ram_needed + MARGIN > avail
        {
            return Err(PlacementError::DoesNotFit(format!(
                "the placement would allocate {} (RAM tier {}, SSD buffer pool {}, n-gram table {}) but only {} is \
                 available (MemAvailable, less a 512 MiB margin)",
                gib(ram_needed),
                gib(ram_tier),
                gib(pool_bytes),
                gib(table_ram),
                gib(avail.saturating_sub(MARGIN))
            )));
        }
        // The GPU side holds the dense weights but the MTP block's routed experts, which the CPU computes.
        let gpu_dense = dense.saturating_sub(model.mtp_routed_expert_bytes());
        let vram_planned = gpu_bytes + gpu_dense;
        if let Some(budget) = opts.vram_budget
            && vram_planned > budget
        {
            return Err(PlacementError::DoesNotFit(format!(
                "the VRAM budget is {} but the GPU side needs {}: {} GPU experts per layer ({}) and the dense trunk \
                 ({}). Lower the GPU experts per layer or raise the budget",
                gib(budget),
                gib(vram_planned),
                gpu_experts,
                gib(gpu_bytes),
                gib(gpu_dense)
            )));
        }

        // RAM tier: one region per layer, filled by parallel reads.
        let lock = LockPolicy::new(opts.lock_memory);
        let mut resident: Vec<Vec<Option<Expert>>> = Vec::with_capacity(n_layer);
        for (l, layer_sources) in sources.iter().enumerate() {
            let held: Vec<usize> = (0..n_expert).filter(|&e| plan.tiers[l][e] != Tier::Ssd).collect();
            let mut row: Vec<Option<Expert>> = vec![None; n_expert];
            if !held.is_empty() {
                let lens: Vec<usize> = held.iter().map(|&e| layer_sources[e].buffer_len(align)).collect();
                let total: usize = lens.iter().sum();
                let mut region = lock.alloc(total, "the RAM tier").map_err(|source| PlacementError::Resource {
                    what: format!("allocating {} for the RAM tier of layer {l}", gib(total as u64)),
                    source,
                })?;
                let mut slices = Vec::with_capacity(held.len());
                let mut starts = Vec::with_capacity(held.len());
                let mut rest = region.as_mut_slice();
                let mut at = 0;
                for &len in &lens {
                    let (a, b) = rest.split_at_mut(len);
                    slices.push(a);
                    starts.push(at);
                    at += len;
                    rest = b;
                }
                let ranges: Vec<[std::ops::Range<usize>; 3]> = slices
                    .into_par_iter()
                    .zip(held.par_iter())
                    .map(|(buf, &e)| layer_sources[e].read_into(reader.as_ref(), buf))
                    .collect::<Result<_, _>>()?;
                let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(region);
                for ((&e, r), start) in held.iter().zip(ranges).zip(starts) {
                    let shifted = r.map(|x| x.start + start..x.end + start);
                    let expert = layer_sources[e]
                        .build(owner.clone(), &shifted)
                        .map_err(|d| PlacementError::Invalid(format!("expert {e} of layer {l}: {d}")))?;
                    row[e] = Some(expert);
                }
            }
            resident.push(row);
        }

        let needs_io = ssd_count > 0 || (ple.is_some() && opts.ngram_table == TablePlacement::Ssd);
        let io = if needs_io {
            Some(Arc::new(
                IoPool::new(opts.io_threads)
                    .map_err(|source| PlacementError::Resource { what: "starting the I/O threads".into(), source })?,
            ))
        } else {
            None
        };

        // The n-gram table.
        let table = match (ple, opts.ngram_table) {
            (Some(p), TablePlacement::Ram) => {
                let m = &p.ngram_embedding;
                let span = span_of(model, m, "the n-gram table")?;
                let mut region = lock.alloc(span.padded_len(align), "the n-gram table").map_err(|source| {
                    PlacementError::Resource {
                        what: format!("allocating {} for the n-gram table", gib(table_ram)),
                        source,
                    }
                })?;
                let a = align.max(1) as u64;
                let start = span.offset / a * a;
                let end = span.offset + span.len as u64;
                const CHUNK: usize = 64 << 20;
                region
                    .as_mut_slice()
                    .par_chunks_mut(CHUNK)
                    .enumerate()
                    .filter(|(i, _)| start + ((*i * CHUNK) as u64) < end)
                    .try_for_each(|(i, buf)| {
                        let off = start + (i * CHUNK) as u64;
                        let sub = Span { part: span.part, offset: off, len: ((end - off) as usize).min(CHUNK) };
                        reader::read_span(reader.as_ref(), sub, buf).map(|_| ())
                    })?;
                let first = (span.offset - start) as usize;
                let owner: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(region);
                let bytes = WeightBytes::new(owner, first..first + span.len)
                    .and_then(|b| Matrix::new(m.ggml_type(), m.rows(), m.cols(), b))
                    .map_err(|e| PlacementError::Invalid(format!("the n-gram table: {e}")))?;
                Some(NgramTable::Ram(bytes))
            }
            (Some(p), TablePlacement::Ssd) => {
                let m = &p.ngram_embedding;
                let base = span_of(model, m, "the n-gram table")?;
                Some(NgramTable::Ssd(SsdTable {
                    base,
                    row_bytes: m.row_bytes(),
                    layout: m.clone(),
                    reader: reader.clone(),
                    io: io.clone().expect("I/O threads are started for an SSD table"),
                    stats: stats.clone(),
                }))
            }
            _ => None,
        };

        // The SSD pool and cache.
        let ssd = if ssd_count > 0 {
            let mut buffers = Vec::with_capacity(pool_buffers);
            for _ in 0..pool_buffers {
                buffers.push(lock.alloc(slot, "the SSD buffer pool").map_err(|source| PlacementError::Resource {
                    what: format!("allocating the SSD buffer pool ({})", gib(pool_bytes)),
                    source,
                })?);
            }
            let mut map = HashMap::with_capacity(ssd_count);
            for (l, layer) in sources.into_iter().enumerate() {
                for (e, s) in layer.into_iter().enumerate() {
                    if plan.tiers[l][e] == Tier::Ssd {
                        map.insert((l as u32, e as u32), s);
                    }
                }
            }
            Some(SsdTier::new(
                map,
                buffers,
                slot,
                reader.clone(),
                io.clone().expect("I/O threads are started for an SSD tier"),
                stats.clone(),
            ))
        } else {
            None
        };

        let layers: Vec<LayerReport> = (0..n_layer)
            .map(|l| {
                let experts = TierExperts {
                    gpu: plan.experts(l, Tier::Gpu),
                    ram: plan.experts(l, Tier::Ram),
                    ssd: plan.experts(l, Tier::Ssd),
                };
                LayerReport {
                    layer: l,
                    gpu: experts.gpu.len(),
                    ram: experts.ram.len(),
                    ssd: experts.ssd.len(),
                    experts,
                }
            })
            .collect();
        let locked = lock.locked_bytes();
        let allocated = ram_tier + pool_bytes + table_ram;
        let lock_word = if allocated == 0 {
            "none"
        } else if lock.all_locked() {
            "locked"
        } else if locked > 0 {
            "partial"
        } else {
            "unlocked"
        };
        let report = PlacementReport {
            placed: true,
            source: opts.source.clone(),
            hotlist: opts.hotlist_label.clone(),
            experts_per_layer: n_expert,
            expert_bytes,
            layers,
            ngram_table: TableReport {
                placement: if ple.is_some() { opts.ngram_table.name() } else { "none" }.into(),
                bytes: table_bytes,
            },
            memory: MemoryReport {
                vram_budget_bytes: opts.vram_budget,
                gpu_expert_bytes: gpu_bytes,
                vram_planned_bytes: vram_planned,
                ram_budget_bytes: opts.ram_budget,
                ram_tier_bytes: ram_tier,
                ssd_pool_bytes: pool_bytes,
                ngram_ram_bytes: table_ram,
                dense_bytes: dense,
                locked_bytes: locked,
                lock: lock_word.into(),
                mem_available_bytes: available,
            },
            ssd: needs_io.then(|| SsdReport {
                reader: reader.describe(),
                direct_io: reader.direct(),
                io_threads: io.as_ref().map_or(0, |i| i.threads()),
                pool_buffers: ssd.as_ref().map_or(0, |s| s.capacity()),
                buffer_bytes: ssd.as_ref().map_or(0, |s| s.slot_bytes()),
                prefetch_layers: opts.prefetch_layers,
            }),
        };
        let layer_has_ssd = plan.tiers.iter().map(|t| t.contains(&Tier::Ssd)).collect();
        Ok(Self {
            tiers: plan.tiers,
            resident,
            ssd,
            table,
            report,
            prefetch_layers: opts.prefetch_layers,
            layer_has_ssd,
            stats,
            hybrid: (opts.handoff, opts.omit_marginal),
            gpu_cache: opts.gpu_cache,
            _io: io,
        })
    }

    /// (handoff fraction, marginal omission fraction) of [`PlacementOptions`].
    pub(crate) fn hybrid_fractions(&self) -> (f32, f32) {
        self.hybrid
    }

    /// [`PlacementOptions::gpu_cache`].
    pub(crate) fn gpu_cache(&self) -> GpuCacheOptions {
        self.gpu_cache
    }

    /// The tier of every expert, `[layer][expert]`.
    pub(crate) fn tiers(&self) -> &[Vec<Tier>] {
        &self.tiers
    }

    /// Expert `e` of `layer` when it is in the RAM tier (no SSD read, unlike [`Placement::host_expert`]).
    pub(crate) fn ram_expert(&self, layer: usize, e: usize) -> Option<&Expert> {
        self.resident.get(layer).and_then(|l| l.get(e)).and_then(|x| x.as_ref())
    }

    /// Expert `e` of `layer` from its RAM copy, or read from SSD (waiting for the read): the weights the GPU
    /// streams in hybrid prefill.
    ///
    /// Errors: [`ModelError::WeightRead`] when the SSD read fails.
    pub(crate) fn host_expert<'a>(
        &'a self,
        layer: usize,
        e: usize,
        moe: &'a SparseMoe,
    ) -> Result<HostExpert<'a>, ModelError> {
        if let Some(x) = self.ram_expert(layer, e) {
            return Ok(HostExpert::Borrowed(x));
        }
        match &self.ssd {
            Some(ssd) if ssd.holds(layer, e) => {
                ssd.request(layer, e, false);
                ssd.take(layer, e).map(HostExpert::Loaded).map_err(|source| ModelError::WeightRead {
                    what: format!("expert {e} of layer {layer} (SSD tier)"),
                    detail: source.to_string(),
                })
            }
            _ => Ok(HostExpert::Borrowed(&moe.experts[e])),
        }
    }

    /// Starts reading those of `experts` of `layer` that live on SSD (as many as the pool has room for), so a
    /// following run of [`Placement::host_expert`] calls finds them loaded or loading.
    pub(crate) fn request_experts(&self, layer: usize, experts: &[usize]) {
        if let Some(ssd) = &self.ssd {
            for &e in experts {
                if ssd.holds(layer, e) && ssd.request(layer, e, true) == Requested::NoBuffer {
                    break;
                }
            }
        }
    }

    /// Read bandwidth of the SSD tier's experts in bytes/s (see `SsdTier::read_bandwidth`); `None` without an
    /// SSD tier.
    pub(crate) fn ssd_read_bandwidth(&self, seconds: f64) -> Option<Result<f64, reader::ReadError>> {
        self.ssd.as_ref().map(|s| s.read_bandwidth(seconds))
    }

    /// The address ranges of the RAM tier, one per layer (`(start, len)`): registered with the GPU driver in
    /// hybrid mode so expert uploads run at full PCIe speed.
    pub(crate) fn resident_ranges(&self) -> Vec<(usize, usize)> {
        self.resident
            .iter()
            .filter_map(|layer| {
                let mut lo = usize::MAX;
                let mut hi = 0usize;
                for x in layer.iter().flatten() {
                    for m in [&x.gate_proj, &x.up_proj, &x.down_proj] {
                        let b = m.bytes();
                        lo = lo.min(b.as_ptr() as usize);
                        hi = hi.max(b.as_ptr() as usize + b.len());
                    }
                }
                (lo < hi).then_some((lo, hi - lo))
            })
            .collect()
    }

    /// The report.
    pub(crate) fn report(&self) -> &PlacementReport {
        &self.report
    }

    /// The n-gram table, when placed in RAM or on SSD.
    pub(crate) fn table(&self) -> Option<&NgramTable> {
        self.table.as_ref()
    }

    /// Starts reading the table rows of a forward call, when the table is on SSD.
    pub(crate) fn fetch_rows(&self, rows: &[u64]) -> Option<RowFetch> {
        self.table.as_ref().map(|t| t.fetch(rows))
    }

    /// Predicts the experts of layer `target` from the current MoE input `x` (`[n, d]`) with that layer's router
    /// and starts reading those on SSD, most likely first, while the pool has free or evictable buffers.
    pub(crate) fn prefetch(&self, target: usize, moe: &SparseMoe, x: &[f32], n: usize) {
        let Some(ssd) = &self.ssd else { return };
        if !self.layer_has_ssd.get(target).copied().unwrap_or(false) || !ssd.prefetch_allowed() {
            return;
        }
        let routing = moe.route(x, n);
        let mut best: HashMap<usize, f32> = HashMap::new();
        for r in &routing {
            for (&e, &w) in r.experts.iter().zip(&r.weights) {
                let b = best.entry(e).or_insert(0.0);
                *b = b.max(w);
            }
        }
        let mut order: Vec<(usize, f32)> = best.into_iter().filter(|&(e, _)| ssd.holds(target, e)).collect();
        order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for (e, _) in order {
            if ssd.request(target, e, true) == Requested::NoBuffer {
                break;
            }
        }
    }

    /// How many layers ahead [`Placement::prefetch`] looks.
    pub(crate) fn prefetch_layers(&self) -> usize {
        self.prefetch_layers
    }

    /// Most tokens a forward call may have for the prefetcher to run: it is for decode and short verification
    /// batches, where a layer's SSD reads would otherwise stall the step. A long prefill needs most experts of
    /// every layer anyway, and reads them in groups while it computes the previous group.
    pub(crate) const PREFETCH_MAX_TOKENS: usize = 16;

    /// The MoE block of `layer` for `n` tokens `x` (`[n, d]`) routed as `routing`: RAM-resident experts computed
    /// while the SSD ones are read, SSD ones in groups as their reads land, everything summed in ascending expert
    /// id order with the shared expert last (as [`SparseMoe::forward`]), so the result is bit-identical to it.
    ///
    /// `ahead` are the MoE blocks of the next layers: once this layer's SSD reads are queued, their routers
    /// predict what to prefetch (see [`Placement::prefetch`]), so this layer's reads go first.
    ///
    /// Without `shared` only the routed experts are summed (the CPU's share in hybrid decode, where the GPU runs
    /// the shared expert).
    ///
    /// Errors: [`ModelError::WeightRead`] when an SSD read fails.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn moe_forward(
        &self,
        layer: usize,
        moe: &SparseMoe,
        x: &[f32],
        n: usize,
        routing: &[Routing],
        ahead: &[&SparseMoe],
        shared: bool,
    ) -> Result<Vec<f32>, ModelError> {
        let d = moe.shared_expert_gate.len();
        let tiers = &self.tiers[layer];
        let by_expert = moe.tokens_by_expert(routing);
        // Work items in the summation order: routed experts by ascending id, then the shared expert.
        let used: Vec<usize> = (0..by_expert.len()).filter(|&e| !by_expert[e].is_empty()).collect();
        let shared_tokens: Vec<(usize, f32)> = if shared {
            (0..n)
                .map(|t| (t, crate::model::norm::sigmoid(dot_f32(&moe.shared_expert_gate, &x[t * d..(t + 1) * d]))))
                .collect()
        } else {
            Vec::new()
        };
        // The hybrid backend (no shared expert here) counts its own uses.
        if shared {
            for &e in &used {
                self.stats.hit(tiers[e], by_expert[e].len() as u64);
            }
        }
        let on_ssd: Vec<usize> = used.iter().copied().filter(|&e| tiers[e] == Tier::Ssd).collect();
        let group = self.ssd.as_ref().map_or(1, |s| (s.capacity() / 2).max(1));
        let ssd_groups: Vec<&[usize]> = on_ssd.chunks(group).collect();
        if let (Some(ssd), Some(first)) = (&self.ssd, ssd_groups.first()) {
            for &e in *first {
                ssd.request(layer, e, false);
            }
        }
        if n <= Self::PREFETCH_MAX_TOKENS {
            for (k, next) in ahead.iter().enumerate() {
                self.prefetch(layer + 1 + k, next, x, n);
            }
        }

        // RAM (and GPU-copy) experts and the shared expert, while the first SSD group is read.
        let mut resident_work: Vec<ExpertWork<'_>> = Vec::new();
        let mut resident_index: Vec<usize> = Vec::new(); // position in `used` (used.len() = the shared expert)
        for (i, &e) in used.iter().enumerate() {
            if tiers[e] != Tier::Ssd {
                let expert = self.resident[layer][e].as_ref().unwrap_or(&moe.experts[e]);
                resident_work.push(ExpertWork { expert: expert.as_ref(), tokens: by_expert[e].clone() });
                resident_index.push(i);
            }
        }
        if shared {
            resident_work.push(ExpertWork { expert: moe.shared_expert.as_ref(), tokens: shared_tokens.clone() });
            resident_index.push(used.len());
        }
        let resident_out = expert_outputs(&resident_work, x, n);

        // SSD experts, group by group; the next group's reads start before this one computes.
        let mut ssd_outs: Vec<(Vec<usize>, ExpertOutputs)> = Vec::new();
        if let Some(ssd) = &self.ssd {
            for (g, ids) in ssd_groups.iter().enumerate() {
                let mut held = Vec::with_capacity(ids.len());
                for &e in *ids {
                    held.push(ssd.take(layer, e).map_err(|source| ModelError::WeightRead {
                        what: format!("expert {e} of layer {layer} (SSD tier)"),
                        detail: source.to_string(),
                    })?);
                }
                if let Some(next) = ssd_groups.get(g + 1) {
                    for &e in *next {
                        ssd.request(layer, e, false);
                    }
                }
                let work: Vec<ExpertWork<'_>> = ids
                    .iter()
                    .zip(&held)
                    .map(|(&e, ex)| ExpertWork { expert: ex.as_ref().as_ref(), tokens: by_expert[e].clone() })
                    .collect();
                let out = expert_outputs(&work, x, n);
                let positions = ids.iter().map(|e| used.binary_search(e).unwrap_or(usize::MAX)).collect();
                ssd_outs.push((positions, out));
            }
        }

        // Sum in the fixed order.
        let mut block: Vec<Option<&[f32]>> = vec![None; used.len() + usize::from(shared)];
        for (k, &i) in resident_index.iter().enumerate() {
            block[i] = Some(resident_out.block(k));
        }
        for (positions, out) in &ssd_outs {
            for (k, &i) in positions.iter().enumerate() {
                if let Some(b) = block.get_mut(i) {
                    *b = Some(out.block(k));
                }
            }
        }
        let mut parts = Vec::with_capacity(used.len() + 1);
        for (i, b) in block.iter().enumerate() {
            let tokens: &[(usize, f32)] = if i < used.len() { &by_expert[used[i]] } else { &shared_tokens };
            let y = b.ok_or_else(|| ModelError::WeightRead {
                what: format!("layer {layer}"),
                detail: "an expert's output is missing (internal error)".into(),
            })?;
            parts.push(ExpertContribution { tokens, y });
        }
        let mut out = vec![0f32; n * d];
        combine_expert_outputs(&parts, n, &mut out);
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
