//! `GET /v1/placement`: where the served model's experts and n-gram table actually are (per layer and tier),
//! the memory the placement uses, and its counters since start (expert uses by tier, SSD reads, prefetches).
//! `?experts=true` adds each layer's expert ids per tier.

use std::sync::Arc;

use axum::Json;
use axum::extract::{RawQuery, State};
use nebula_engine::placement::{PlacementReport, StatsSnapshot};
use serde::Serialize;
use utoipa::ToSchema;

use crate::error::{ApiError, ErrorBody};
use crate::state::AppState;

/// Expert counts per tier.
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub struct TierCounts {
    /// GPU tier (each also has a RAM copy, not counted under `ram`).
    pub gpu: usize,
    /// RAM tier.
    pub ram: usize,
    /// SSD tier.
    pub ssd: usize,
}

/// Expert ids of one layer per tier, ascending.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TierExpertIds {
    /// GPU tier.
    pub gpu: Vec<usize>,
    /// RAM tier (GPU copies not repeated).
    pub ram: Vec<usize>,
    /// SSD tier.
    pub ssd: Vec<usize>,
}

/// One layer's placement.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LayerPlacement {
    /// Trunk layer (0-based).
    pub layer: usize,
    /// Experts per tier.
    #[serde(flatten)]
    pub counts: TierCounts,
    /// Expert ids per tier (with `?experts=true`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<TierExpertIds>,
}

/// The n-gram (PLE) table's place.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct NgramTablePlacement {
    /// `ram`, `ssd`, `mapped` (the file's page cache) or `none` (no PLE).
    pub placement: String,
    /// The table's size, bytes.
    pub bytes: u64,
}

/// Memory the placement uses, bytes.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PlacementMemory {
    /// VRAM budget, when given (profile or flag).
    pub vram_budget_bytes: Option<u64>,
    /// GPU-tier experts.
    pub gpu_expert_bytes: u64,
    /// What the GPU side needs: GPU experts + the dense trunk.
    pub vram_planned_bytes: u64,
    /// RAM budget, when given.
    pub ram_budget_bytes: Option<u64>,
    /// RAM tier (GPU copies included).
    pub ram_tier_bytes: u64,
    /// SSD buffer pool.
    pub ssd_pool_bytes: u64,
    /// The n-gram table when in RAM.
    pub ngram_ram_bytes: u64,
    /// Dense trunk (read through the page cache on the CPU backend).
    pub dense_bytes: u64,
    /// Bytes locked with mlock.
    pub locked_bytes: u64,
    /// `locked`, `partial`, `unlocked` or `none`.
    pub lock: String,
    /// MemAvailable when the placement was built.
    pub mem_available_bytes: Option<u64>,
}

/// The SSD tier's machinery.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SsdTierInfo {
    /// How reads are done, e.g. `direct I/O on 1 file`.
    pub reader: String,
    /// True when reads bypass the page cache (O_DIRECT).
    pub direct_io: bool,
    /// I/O threads.
    pub io_threads: usize,
    /// Pool buffers (experts held at once).
    pub pool_buffers: usize,
    /// Bytes per pool buffer.
    pub buffer_bytes: usize,
    /// Layers ahead whose routers drive the prefetch.
    pub prefetch_layers: usize,
}

/// Counters since the model loaded.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PlacementCounters {
    /// Routed expert uses (token x expert) by tier.
    pub expert_hits: TierCountsU64,
    /// Experts read from SSD.
    pub ssd_expert_reads: u64,
    /// Expert bytes read from SSD.
    pub ssd_expert_bytes: u64,
    /// Failed reads (each failed the request that needed it).
    pub ssd_read_errors: u64,
    /// Expert reads started by the prefetcher.
    pub prefetch_issued: u64,
    /// Of those, experts then used.
    pub prefetch_hits: u64,
    /// n-gram table rows read from SSD.
    pub ngram_rows_read: u64,
    /// n-gram table bytes read from SSD.
    pub ngram_bytes_read: u64,
}

/// Counts per tier (64-bit).
#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub struct TierCountsU64 {
    /// GPU tier.
    pub gpu: u64,
    /// RAM tier.
    pub ram: u64,
    /// SSD tier.
    pub ssd: u64,
}

/// Body of `GET /v1/placement`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PlacementInfo {
    /// False when no placement is configured: every weight is read through the file's memory map.
    pub placed: bool,
    /// Where the placement comes from (profile, config, flags).
    pub source: String,
    /// The expert ranking: a hotlist file, or expert id order.
    pub hotlist: String,
    /// Routed experts per layer.
    pub experts_per_layer: usize,
    /// Bytes of one routed expert (gate + up + down).
    pub expert_bytes: u64,
    /// Experts per tier summed over layers.
    pub totals: TierCounts,
    /// Per layer.
    pub layers: Vec<LayerPlacement>,
    /// The n-gram table.
    pub ngram_table: NgramTablePlacement,
    /// Memory used.
    pub memory: PlacementMemory,
    /// The SSD tier, when experts or the table are read from SSD.
    pub ssd: Option<SsdTierInfo>,
    /// Counters since the model loaded.
    pub counters: PlacementCounters,
    /// The prefix cache's budgets and what it holds now.
    pub prefix_cache: PrefixCacheMemory,
}

/// The prefix cache's memory: budgets from the config or the profile, use now.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct PrefixCacheMemory {
    /// VRAM the cached GPU states may keep before the least recently used are spilled to host memory, bytes.
    pub device_budget_bytes: u64,
    /// Host memory the cache may keep, bytes.
    pub host_budget_bytes: u64,
    /// Sequences held.
    pub entries: u64,
    /// Bytes held in VRAM.
    pub device_bytes: u64,
    /// Bytes held in all (VRAM and host memory).
    pub bytes: u64,
    /// Entries spilled from VRAM to host memory since the model loaded.
    pub spills: u64,
}

impl PlacementInfo {
    /// The body for `report` and `stats`, with expert ids when `experts`.
    pub fn new(report: &PlacementReport, stats: StatsSnapshot, experts: bool) -> Self {
        let (gpu, ram, ssd) = report.totals();
        let m = &report.memory;
        Self {
            placed: report.placed,
            source: report.source.clone(),
            hotlist: report.hotlist.clone(),
            experts_per_layer: report.experts_per_layer,
            expert_bytes: report.expert_bytes,
            totals: TierCounts { gpu, ram, ssd },
            layers: report
                .layers
                .iter()
                .map(|l| LayerPlacement {
                    layer: l.layer,
                    counts: TierCounts { gpu: l.gpu, ram: l.ram, ssd: l.ssd },
                    experts: experts.then(|| TierExpertIds {
                        gpu: l.experts.gpu.clone(),
                        ram: l.experts.ram.clone(),
                        ssd: l.experts.ssd.clone(),
                    }),
                })
                .collect(),
            ngram_table: NgramTablePlacement {
                placement: report.ngram_table.placement.clone(),
                bytes: report.ngram_table.bytes,
            },
            memory: PlacementMemory {
                vram_budget_bytes: m.vram_budget_bytes,
                gpu_expert_bytes: m.gpu_expert_bytes,
                vram_planned_bytes: m.vram_planned_bytes,
                ram_budget_bytes: m.ram_budget_bytes,
                ram_tier_bytes: m.ram_tier_bytes,
                ssd_pool_bytes: m.ssd_pool_bytes,
                ngram_ram_bytes: m.ngram_ram_bytes,
                dense_bytes: m.dense_bytes,
                locked_bytes: m.locked_bytes,
                lock: m.lock.clone(),
                mem_available_bytes: m.mem_available_bytes,
            },
            ssd: report.ssd.as_ref().map(|s| SsdTierInfo {
                reader: s.reader.clone(),
                direct_io: s.direct_io,
                io_threads: s.io_threads,
                pool_buffers: s.pool_buffers,
                buffer_bytes: s.buffer_bytes,
                prefetch_layers: s.prefetch_layers,
            }),
            counters: PlacementCounters {
                expert_hits: TierCountsU64 {
                    gpu: stats.expert_hits_gpu,
                    ram: stats.expert_hits_ram,
                    ssd: stats.expert_hits_ssd,
                },
                ssd_expert_reads: stats.ssd_expert_reads,
                ssd_expert_bytes: stats.ssd_expert_bytes,
                ssd_read_errors: stats.ssd_read_errors,
                prefetch_issued: stats.prefetch_issued,
                prefetch_hits: stats.prefetch_hits,
                ngram_rows_read: stats.ngram_rows_read,
                ngram_bytes_read: stats.ngram_bytes_read,
            },
            prefix_cache: PrefixCacheMemory::default(),
        }
    }
}

/// Where the served model's experts and n-gram table are, the memory used and the counters (503 while loading).
#[utoipa::path(get, path = "/v1/placement", tag = "observability",
    params(("experts" = Option<bool>, Query, description = "Also list each layer's expert ids per tier")),
    responses((status = 200, description = "The placement", body = PlacementInfo),
              (status = 400, description = "A bad query parameter", body = ErrorBody),
              (status = 401, description = "Missing or wrong API key", body = ErrorBody),
              (status = 503, description = "The model is loading", body = ErrorBody)))]
pub async fn placement(
    State(state): State<Arc<AppState>>,
    RawQuery(query): RawQuery,
) -> Result<Json<PlacementInfo>, ApiError> {
    let mut experts = false;
    for pair in query.as_deref().unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key != "experts" {
            continue;
        }
        experts = match value {
            "true" | "1" | "" => true,
            "false" | "0" => false,
            other => {
                return Err(ApiError::invalid(format!("experts must be true or false, got {other:?}"), "experts"));
            }
        };
    }
    let model = state.model()?;
    let engine = &model.engine;
    let mut info = PlacementInfo::new(engine.placement(), engine.placement_stats().snapshot(), experts);
    let (opts, stats) = (engine.prefix_cache_options(), engine.stats());
    let load = |a: &std::sync::atomic::AtomicUsize| a.load(std::sync::atomic::Ordering::Relaxed) as u64;
    info.prefix_cache = PrefixCacheMemory {
        device_budget_bytes: opts.device_bytes as u64,
        host_budget_bytes: opts.max_bytes as u64,
        entries: load(&stats.cache_entries),
        device_bytes: load(&stats.cache_device_bytes),
        bytes: load(&stats.cache_bytes),
        spills: load(&stats.cache_spills),
    };
    Ok(Json(info))
}
