//! Hardware profiles: `nebula profile detect`.
//!
//! The profile table (`deploy/profiles.toml`, embedded in the binary) holds the product's 16 configurations: VRAM
//! 8/12/16/24 GB x RAM 32/64/96/128 GB, each with the GPU expert cache size, prefill and context limits and the
//! number of experts per layer in RAM and on SSD. Detection reads the GPUs from `nvidia-smi`, the memory from
//! `/proc/meminfo` (and the cgroup limit, in a container) and the physical cores from `/proc/cpuinfo`, rounds VRAM
//! and RAM down *separately* to the table's steps, takes the one GPU with the most VRAM (GPUs are never added up)
//! and writes the chosen row as the profile file (TOML, keys in `deploy/README.md`) that the engine, the service
//! (`/v1/models`) and the WebUI read. The file's path is [`PROFILE_ENV`] (`NEBULA_PROFILE`), by default
//! [`DEFAULT_PROFILE_PATH`].
//!
//! Refusals have their own exit codes ([`DetectError::exit_code`]): no GPU visible, below the minimum (8 GB VRAM,
//! 32 GB RAM; the message says how many GiB are missing), a missing or incomplete model.
//!
//! The pure part ([`select`]) takes a [`Hardware`] description and is what the unit tests drive; [`read_hardware`]
//! fills it from the system (or from files and commands given for tests and emulation).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use nebula_engine::gguf::{GgufErrorKind, GgufFile, SplitPath};
use nebula_engine::model::KvCacheType;
use serde::{Deserialize, Serialize};

/// The profile table shipped with the binary: `deploy/profiles.toml`.
pub const EMBEDDED_TABLE: &str = include_str!("../../deploy/profiles.toml");

/// Where `nebula profile detect` writes the profile unless `--out` or [`PROFILE_ENV`] says otherwise.
pub const DEFAULT_PROFILE_PATH: &str = "/var/lib/nebula/profile.toml";

/// Environment variable holding the profile file's path, for the writer and every reader.
pub const PROFILE_ENV: &str = "NEBULA_PROFILE";

/// Version of the written profile file's layout (`schema_version`).
pub const PROFILE_SCHEMA_VERSION: u32 = 1;

/// Most CPU threads a profile asks for (the original engine's cap on threads from physical cores).
pub const MAX_THREADS: usize = 28;

/// Fraction below a VRAM step that still counts as that step: `nvidia-smi` reports a little less than the card's
/// nominal size (RTX 4060 8 GB: 8188 MiB; RTX 4090 24 GB: 24564 MiB; RTX 5080 16 GB: 16303 MiB).
pub const VRAM_TOLERANCE: f64 = 0.03;

/// Fraction below a RAM step that still counts as that step: `MemTotal` is the installed RAM less what firmware
/// and the kernel reserve (a 32 GiB machine shows about 31.1–31.5 GiB).
pub const RAM_TOLERANCE: f64 = 0.06;

/// Context limit of the CPU-only profiles (the CPU path's default, [`crate::config::DEFAULT_CPU_MAX_CONTEXT`]).
pub const CPU_MAX_CONTEXT: u64 = crate::config::DEFAULT_CPU_MAX_CONTEXT as u64;

const MIB: f64 = 1024.0 * 1024.0;
const GIB: f64 = 1024.0 * MIB;

// ---------------------------------------------------------------------------------------------------------------
// The table

/// The profile table: the steps and one row per (VRAM step, RAM step).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileTable {
    /// Layout version of the table file (1).
    pub schema_version: u32,
    /// Where the figures come from: `"original"` for the original product's table.
    pub source: String,
    /// Routed experts per layer (512).
    pub experts_per_layer: u32,
    /// VRAM steps in GB (GiB), ascending; the first is the minimum.
    pub vram_steps_gb: Vec<u32>,
    /// RAM steps in GB (GiB), ascending; the first is the minimum.
    pub ram_steps_gb: Vec<u32>,
    /// One row per (VRAM step, RAM step).
    pub profile: Vec<TableRow>,
}

/// One configuration of the table (per layer counts are of routed experts).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TableRow {
    /// Row name, `"<vram>gb-vram-<ram>gb-ram"`.
    pub name: String,
    /// VRAM step, GB (GiB).
    pub vram_gb: u32,
    /// RAM step, GB (GiB).
    pub ram_gb: u32,
    /// Experts per layer in the GPU expert cache.
    pub gpu_experts_per_layer: u32,
    /// Tokens per prefill chunk.
    pub max_prefill: u64,
    /// Longest prompt + completion, tokens (Nebula's, with `kv_cache_type` and `kv_window`).
    pub max_context: u64,
    /// The original table's context (an f32 cache, every token in VRAM).
    pub original_max_context: u64,
    /// How the attention caches store their rows.
    pub kv_cache_type: KvCacheType,
    /// Tokens of each attention layer's K and V in VRAM per sequence, the rest in pinned host memory (0: all).
    pub kv_window: u64,
    /// Experts per layer in RAM computed by the CPU, not counting the copies of the GPU experts.
    pub cpu_experts_per_layer: u32,
    /// RAM copies of the GPU experts (the table's "(+X)").
    pub gpu_copies_in_ram: u32,
    /// Experts per layer left on SSD.
    pub ssd_experts_per_layer: u32,
    /// Where the n-gram table lives.
    pub ngram_table: NgramPlacement,
    /// VRAM left free, GB, as the original reported it (information only).
    pub free_vram_gb: f64,
    /// RAM left free, GB, as the original reported it (information only).
    pub free_ram_gb: f64,
}

/// Where the hashed n-gram (PLE) table lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NgramPlacement {
    /// Read from SSD on demand.
    Ssd,
    /// Held in RAM.
    Ram,
}

/// A table that cannot be used; the message names the row and the value.
#[derive(Debug, thiserror::Error)]
#[error("profile table {label}: {detail}")]
pub struct TableError {
    /// The table's path or `<embedded>`.
    pub label: String,
    /// What is wrong.
    pub detail: String,
}

impl ProfileTable {
    /// The table built into the binary ([`EMBEDDED_TABLE`]); it is checked by the unit tests, so this cannot fail.
    pub fn embedded() -> Self {
        Self::parse(EMBEDDED_TABLE, "<embedded>/deploy/profiles.toml").expect("the embedded profile table is valid")
    }

    /// Parses and validates a table: steps ascending, exactly one row per (VRAM, RAM) step pair, names as
    /// `<vram>gb-vram-<ram>gb-ram`, GPU + CPU + SSD experts = `experts_per_layer`, the RAM copies equal to the GPU
    /// experts, limits positive.
    ///
    /// # Errors
    /// TOML syntax or an unknown key, or any broken rule above, naming the row.
    pub fn parse(text: &str, label: &str) -> Result<Self, TableError> {
        let err = |detail: String| TableError { label: label.to_owned(), detail };
        let table: ProfileTable = toml::from_str(text).map_err(|e| err(e.to_string()))?;
        if table.schema_version != 1 {
            return Err(err(format!("schema_version {} (this binary reads 1)", table.schema_version)));
        }
        for (what, steps) in [("vram_steps_gb", &table.vram_steps_gb), ("ram_steps_gb", &table.ram_steps_gb)] {
            if steps.is_empty() || steps[0] == 0 || steps.windows(2).any(|w| w[0] >= w[1]) {
                return Err(err(format!("{what} = {steps:?}: must be positive and strictly ascending")));
            }
        }
        let mut seen = BTreeSet::new();
        for row in &table.profile {
            let bad = |detail: String| err(format!("row '{}': {detail}", row.name));
            if !table.vram_steps_gb.contains(&row.vram_gb) {
                return Err(bad(format!("vram_gb = {} is not one of {:?}", row.vram_gb, table.vram_steps_gb)));
            }
            if !table.ram_steps_gb.contains(&row.ram_gb) {
                return Err(bad(format!("ram_gb = {} is not one of {:?}", row.ram_gb, table.ram_steps_gb)));
            }
            if !seen.insert((row.vram_gb, row.ram_gb)) {
                return Err(bad(format!("a second row for {} GB VRAM / {} GB RAM", row.vram_gb, row.ram_gb)));
            }
            let expected_name = format!("{}gb-vram-{}gb-ram", row.vram_gb, row.ram_gb);
            if row.name != expected_name {
                return Err(bad(format!("name should be '{expected_name}'")));
            }
            let sum = row.gpu_experts_per_layer + row.cpu_experts_per_layer + row.ssd_experts_per_layer;
            if sum != table.experts_per_layer {
                return Err(bad(format!(
                    "gpu {} + cpu {} + ssd {} = {sum} experts per layer, expected {}",
                    row.gpu_experts_per_layer,
                    row.cpu_experts_per_layer,
                    row.ssd_experts_per_layer,
                    table.experts_per_layer
                )));
            }
            if row.gpu_copies_in_ram != row.gpu_experts_per_layer {
                return Err(bad(format!(
                    "gpu_copies_in_ram = {} but gpu_experts_per_layer = {} (RAM keeps a copy of every GPU expert)",
                    row.gpu_copies_in_ram, row.gpu_experts_per_layer
                )));
            }
            if row.max_prefill == 0 || row.max_context == 0 || row.max_prefill > row.max_context {
                return Err(bad(format!(
                    "max_prefill = {} and max_context = {} must be positive with prefill <= context",
                    row.max_prefill, row.max_context
                )));
            }
            if row.kv_window > 0 && (row.kv_window >= row.max_context || row.max_prefill + 4 > row.kv_window) {
                return Err(bad(format!(
                    "kv_window = {} must be 0, or below max_context = {} and at least max_prefill = {} + 4",
                    row.kv_window, row.max_context, row.max_prefill
                )));
            }
        }
        let wanted = table.vram_steps_gb.len() * table.ram_steps_gb.len();
        if seen.len() != wanted {
            let missing: Vec<String> = table
                .vram_steps_gb
                .iter()
                .flat_map(|&v| table.ram_steps_gb.iter().map(move |&r| (v, r)))
                .filter(|k| !seen.contains(k))
                .map(|(v, r)| format!("{v}gb-vram-{r}gb-ram"))
                .collect();
            return Err(err(format!("{} rows, expected {wanted}; missing: {}", seen.len(), missing.join(", "))));
        }
        Ok(table)
    }

    /// The row for a VRAM step and a RAM step.
    pub fn row(&self, vram_gb: u32, ram_gb: u32) -> Option<&TableRow> {
        self.profile.iter().find(|r| r.vram_gb == vram_gb && r.ram_gb == ram_gb)
    }

    /// The smallest VRAM step: below it a GPU profile is refused.
    pub fn min_vram_gb(&self) -> u32 {
        self.vram_steps_gb[0]
    }

    /// The smallest RAM step: below it every profile for the full model is refused.
    pub fn min_ram_gb(&self) -> u32 {
        self.ram_steps_gb[0]
    }
}

/// Bytes one sequence of `context` tokens holds in its attention caches on the GPU, (VRAM, pinned host memory),
/// for the released model (`qwen4exp` with 12 QSA layers of 2 KV heads of 256 values, indexer keys of 128 pooled
/// every 4 tokens, and the dense MTP layer when `drafting`), with caches of type `ty` and a hot window of
/// `window` tokens (0: none): per QSA layer K, V and the raw indexer keys of the window's rows (of every row
/// without one) and every pooled block key in VRAM, the staging buffers of one layer's cold K and V, the MTP
/// layer's K and V; every row of a windowed layer in host memory. The same layout as the CUDA backend's
/// allocation (`CudaModel::state_alloc_bytes`), for the profile table, which is chosen before any model loads.
pub fn released_kv_bytes(context: u64, ty: KvCacheType, window: u64, drafting: bool) -> (u64, u64) {
    const QSA_LAYERS: u64 = 12;
    let kv = ty.row_bytes(2 * 256) as u64;
    let ik = ty.index_key_type(128).row_bytes(128) as u64;
    let windowed = window > 0 && context > window;
    let ring = if windowed { window } else { context };
    let mut device = QSA_LAYERS * (ring * (2 * kv + ik) + (context / 4 + 1) * ik);
    if windowed {
        device += 2 * context * kv;
    }
    if drafting {
        device += 2 * context * kv;
    }
    let host = if windowed { QSA_LAYERS * context * (2 * kv + ik) } else { 0 };
    (device, host)
}

/// The largest step that `gib` reaches, counting `gib >= step * (1 - tolerance)` as reaching it.
pub fn round_down_to_step(gib: f64, steps: &[u32], tolerance: f64) -> Option<u32> {
    steps.iter().rev().copied().find(|&s| gib >= f64::from(s) * (1.0 - tolerance))
}

// ---------------------------------------------------------------------------------------------------------------
// Selection

/// Which compute backend the profile is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// CUDA when a GPU is visible; otherwise refuse, or CPU with `--allow-cpu`.
    Auto,
    /// The GPU (with CPU, RAM and SSD tiers).
    Cuda,
    /// CPU only: no GPU expert cache.
    Cpu,
}

/// Choices and overrides for [`select`].
#[derive(Debug, Clone, PartialEq)]
pub struct DetectOptions {
    /// Requested backend.
    pub backend: Backend,
    /// With [`Backend::Auto`] and no GPU: use a CPU profile instead of refusing.
    pub allow_cpu: bool,
    /// Serving the embedded demo model (28 MB): the hardware minimums, which are the full model's, do not apply.
    pub demo: bool,
    /// Emulation: VRAM budget in GiB instead of the GPU's (at most the GPU's).
    pub vram_gib: Option<f64>,
    /// Emulation: RAM budget in GiB instead of the machine's (at most the machine's).
    pub ram_gib: Option<f64>,
    /// Emulation or tuning: CPU threads instead of the physical cores (at most the available CPUs).
    pub threads: Option<usize>,
    /// `CUDA_VISIBLE_DEVICES` as set, if set: only the GPUs it names by index are candidates.
    pub cuda_visible_devices: Option<String>,
}

impl Default for DetectOptions {
    fn default() -> Self {
        Self {
            backend: Backend::Auto,
            allow_cpu: false,
            demo: false,
            vram_gib: None,
            ram_gib: None,
            threads: None,
            cuda_visible_devices: None,
        }
    }
}

/// One tier of the expert placement, as the WebUI reads it (`placement` of the profile).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierPlacement {
    /// `gpu`, `ram` or `ssd`.
    pub tier: String,
    /// Experts per layer in this tier (for `ram`: those the CPU computes, without the GPU copies).
    pub experts_per_layer: u32,
    /// `ram` only: the RAM copies of the GPU experts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_copies: Option<u32>,
}

/// What was detected, written under `[detected]` for people and the status page.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Detected {
    /// nvidia-smi index of the chosen GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_index: Option<u32>,
    /// Name of the chosen GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_name: Option<String>,
    /// Its memory, MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_vram_mib: Option<u64>,
    /// GPUs listed (only one is used).
    pub gpus: usize,
    /// RAM the profile was chosen from, GiB (MemTotal, or the cgroup limit when lower).
    pub ram_gib: f64,
    /// Where `ram_gib` comes from: `meminfo` or `cgroup`.
    pub ram_source: String,
    /// MemAvailable at detection, GiB (information only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mem_available_gib: Option<f64>,
    /// Physical cores, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub physical_cores: Option<usize>,
    /// Logical CPUs in /proc/cpuinfo.
    pub logical_cpus: usize,
    /// CPUs this process may use.
    pub available_cpus: usize,
    /// Emulation overrides in force, e.g. `["vram_gib=12"]`; empty when the profile is the machine's own.
    pub emulated: Vec<String>,
}

/// The chosen profile: the file `nebula profile detect` writes (see `deploy/README.md` for the keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Layout version ([`PROFILE_SCHEMA_VERSION`]).
    pub schema_version: u32,
    /// `<vram>gb-vram-<ram>gb-ram` (table rows), `cpu-<ram>gb-ram` (CPU only) or `demo-<backend>` (demo model
    /// below the minimums).
    pub name: String,
    /// `cuda` or `cpu`.
    pub backend: String,
    /// `original` (the table's figures), `derived-cpu` (CPU-only rows built from the 8 GB column), either with
    /// `-expert-size` when the tiers were recounted for the model file's expert size ([`Profile::expert_mib`]),
    /// or `demo`.
    pub source: String,
    /// The model the profile was checked against: a GGUF path, or `demo` for the embedded demo model; absent
    /// when no model was given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// VRAM step, GB (0 on the CPU).
    pub vram_gb: u32,
    /// RAM step, GB.
    pub ram_gb: u32,
    /// Longest prompt + completion, tokens.
    pub max_context: u64,
    /// Tokens per prefill chunk.
    pub max_prefill: u64,
    /// CPU threads for the CPU experts: physical cores (or the override), at most the CPUs available, at most
    /// [`MAX_THREADS`].
    pub threads: usize,
    /// Where the n-gram table lives: `ssd` or `ram`.
    pub ngram_table: NgramPlacement,
    /// Routed experts per layer.
    pub experts_per_layer: u32,
    /// `CUDA_VISIBLE_DEVICES` that selects the chosen GPU (its nvidia-smi index); CUDA only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda_visible_devices: Option<String>,
    /// Experts per layer per tier: `gpu`, `ram` (+ `gpu_copies`), `ssd`.
    pub placement: Vec<TierPlacement>,
    /// Mean MiB of one routed expert of the model file the tiers were recounted for (`expert_size.rs`: the
    /// table's byte budgets in the file's experts); absent without a model and for Q4_K/IQ4_NL files, whose counts
    /// are the table's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_mib: Option<f64>,
    /// How the attention caches store their rows (`kv_cache_type`); absent in older profile files and on the CPU
    /// (f32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_type: Option<KvCacheType>,
    /// Tokens of K and V kept in VRAM per attention layer and sequence, the rest in pinned host memory (0: all);
    /// absent in older profile files and on the CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_window: Option<u64>,
    /// Sequences the server decodes together (`[batching] max_sequences`): Nebula's default for the VRAM step
    /// ([`default_max_sequences`]), not a figure of the original table; absent in older profile files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sequences: Option<u32>,
    /// What detection saw.
    pub detected: Detected,
}

/// Sequences decoded together by default at a VRAM step (GB; 0 for the CPU): 8 up to 12 GB, 16 at 16 GB, 32
/// from 24 GB. A sequence's state (KV caches and recurrent states) lives where the trunk runs, so small cards
/// hold fewer; admission still checks each request's own state against what can be allocated.
pub fn default_max_sequences(vram_gb: u32) -> u32 {
    match vram_gb {
        0..=12 => 8,
        13..=16 => 16,
        _ => 32,
    }
}

impl Profile {
    /// The profile as TOML, with a header saying who wrote it and who reads it.
    pub fn to_toml(&self) -> String {
        let body = toml::to_string(self).expect("a profile serializes to TOML");
        format!(
            "# Nebula hardware profile, written by `nebula profile detect` (nebula {}).\n\
             # Read by the engine (placement, limits), the service (/v1/models `profile`) and the WebUI.\n\
             # Keys: deploy/README.md. Figures of source = \"original\" are the original product's: defaults to \
             beat.\n{body}",
            env!("CARGO_PKG_VERSION")
        )
    }

    /// Reads a profile file written by [`Profile::to_toml`].
    ///
    /// # Errors
    /// The file cannot be read or is not a profile.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("cannot read the profile {}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("profile {}: {e}", path.display()))
    }
}

/// Why detection refuses.
#[derive(Debug, thiserror::Error)]
pub enum DetectError {
    /// A GPU profile was asked for (or `auto` without `--allow-cpu`) and no GPU can be used.
    #[error(
        "no GPU: {0}. Nebula needs an NVIDIA GPU with at least 8 GB of VRAM; to run on the CPU instead, use \
         --backend cpu (NEBULA_BACKEND=cpu) or --allow-cpu (NEBULA_ALLOW_CPU=1)"
    )]
    NoGpu(NoGpu),
    /// The machine is below the minimum of the table.
    #[error("{0}")]
    BelowMinimum(Shortfall),
    /// An emulation override asks for more than the machine has, or is not positive.
    #[error("--{flag} {asked}: {why}")]
    BadOverride {
        /// The flag, e.g. `vram-gib`.
        flag: &'static str,
        /// Its value.
        asked: String,
        /// Why it is refused.
        why: String,
    },
    /// The model is missing, incomplete or not a qwen4exp GGUF.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The hardware could not be read (meminfo missing, malformed nvidia-smi output, unreadable table, ...).
    #[error("{0}")]
    Input(String),
}

/// Exit code: success.
pub const EXIT_OK: u8 = 0;
/// Exit code: the hardware could not be read, or the profile not written.
pub const EXIT_ERROR: u8 = 1;
/// Exit code: a bad flag or override (clap's usage errors also exit 2).
pub const EXIT_USAGE: u8 = 2;
/// Exit code: no GPU visible and the CPU not allowed.
pub const EXIT_NO_GPU: u8 = 3;
/// Exit code: below the minimum VRAM and/or RAM.
pub const EXIT_BELOW_MINIMUM: u8 = 4;
/// Exit code: the model is missing, incomplete or of another architecture.
pub const EXIT_MODEL: u8 = 5;

impl DetectError {
    /// The process exit code for this refusal ([`EXIT_NO_GPU`], [`EXIT_BELOW_MINIMUM`], [`EXIT_MODEL`], ...).
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::NoGpu(_) => EXIT_NO_GPU,
            Self::BelowMinimum(_) => EXIT_BELOW_MINIMUM,
            Self::BadOverride { .. } => EXIT_USAGE,
            Self::Model(_) => EXIT_MODEL,
            Self::Input(_) => EXIT_ERROR,
        }
    }
}

/// GiB missing, rounded up to 0.1 so that "free this much" is always enough.
fn missing_gib(need: u32, have: f64) -> f64 {
    // The 1e-3 keeps float noise (2.7000002) from rounding up a whole tenth.
    ((f64::from(need) - have) * 10.0 - 1e-3).ceil().max(1.0) / 10.0
}

/// How far a machine is below the table's minimum.
#[derive(Debug, Clone, PartialEq)]
pub struct Shortfall {
    /// GiB of VRAM missing to reach the minimum step (rounded up to 0.1), if VRAM is short.
    pub vram_missing_gib: Option<f64>,
    /// GiB of RAM missing to reach the minimum step (rounded up to 0.1), if RAM is short.
    pub ram_missing_gib: Option<f64>,
    /// VRAM of the chosen GPU, GiB (`None` on the CPU).
    pub vram_gib: Option<f64>,
    /// RAM, GiB.
    pub ram_gib: f64,
    /// The table's minimum VRAM step, GB.
    pub min_vram_gb: u32,
    /// The table's minimum RAM step, GB.
    pub min_ram_gb: u32,
}

impl std::fmt::Display for Shortfall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if let Some(m) = self.vram_missing_gib {
            let have = self.vram_gib.map_or(String::new(), |v| format!(" (the GPU has {v:.1} GiB)"));
            parts.push(format!("{m:.1} GiB of VRAM missing{have}: the minimum is {} GB", self.min_vram_gb));
        }
        if let Some(m) = self.ram_missing_gib {
            parts.push(format!(
                "{m:.1} GiB of RAM missing (the machine has {:.1} GiB): the minimum is {} GB",
                self.ram_gib, self.min_ram_gb
            ));
        }
        write!(
            f,
            "below the minimum hardware for Qwen3.8-Flash-Next: {}. Use a larger GPU or more RAM (or give the \
             container more memory); the embedded demo model runs anywhere (leave NEBULA_MODEL unset)",
            parts.join("; ")
        )
    }
}

fn check_override(flag: &'static str, asked: f64, have: f64, unit: &str) -> Result<(), DetectError> {
    if !(asked.is_finite() && asked > 0.0) {
        return Err(DetectError::BadOverride { flag, asked: asked.to_string(), why: "must be positive".into() });
    }
    if asked > have + 1e-9 {
        return Err(DetectError::BadOverride {
            flag,
            asked: asked.to_string(),
            why: format!("emulation can only shrink the budget, and this machine has {have:.1} {unit}"),
        });
    }
    Ok(())
}

/// Chooses the profile for `hw`: see the module docs. Pure: every input is in `hw` and `opts`.
///
/// # Errors
/// [`DetectError::NoGpu`], [`DetectError::BelowMinimum`] (VRAM and RAM shortfalls together) or
/// [`DetectError::BadOverride`].
pub fn select(table: &ProfileTable, hw: &Hardware, opts: &DetectOptions) -> Result<Profile, DetectError> {
    let mut emulated = Vec::new();

    // CPU threads: physical cores (logical CPUs when unknown), within what this process may use, capped.
    let available = hw.available_parallelism.max(1);
    let threads = match opts.threads {
        Some(t) => {
            if t == 0 || t > available {
                return Err(DetectError::BadOverride {
                    flag: "threads",
                    asked: t.to_string(),
                    why: format!("must be between 1 and the {available} CPUs available"),
                });
            }
            emulated.push(format!("threads={t}"));
            t
        }
        None => hw.cpus.physical_cores.unwrap_or(hw.cpus.logical_cpus).clamp(1, available).min(MAX_THREADS),
    };

    // RAM: MemTotal, or the container's limit when lower.
    let meminfo_gib = hw.meminfo.total_bytes as f64 / GIB;
    let (mut ram_gib, mut ram_source) = (meminfo_gib, "meminfo");
    if let Some(limit) = hw.cgroup_memory_bytes.map(|b| b as f64 / GIB).filter(|&l| l < meminfo_gib) {
        (ram_gib, ram_source) = (limit, "cgroup");
    }
    if let Some(asked) = opts.ram_gib {
        check_override("ram-gib", asked, ram_gib, "GiB of RAM")?;
        emulated.push(format!("ram_gib={asked}"));
        ram_gib = asked;
    }

    // GPU: the one with the most VRAM among those visible; never a sum.
    let backend = match opts.backend {
        Backend::Cpu => Backend::Cpu,
        Backend::Cuda | Backend::Auto => match visible_gpus(&hw.gpus, opts.cuda_visible_devices.as_deref()) {
            Ok(_) => Backend::Cuda,
            Err(_) if opts.backend == Backend::Auto && opts.allow_cpu => Backend::Cpu,
            Err(e) => return Err(DetectError::NoGpu(e)),
        },
    };
    let gpus_listed = hw.gpus.as_ref().map_or(0, Vec::len);
    let gpu = match backend {
        Backend::Cuda => {
            let visible = visible_gpus(&hw.gpus, opts.cuda_visible_devices.as_deref()).map_err(DetectError::NoGpu)?;
            // Most memory wins; on a tie the lower index (nvidia-smi order).
            visible.into_iter().max_by(|a, b| a.memory_mib.cmp(&b.memory_mib).then(b.index.cmp(&a.index)))
        }
        _ => None,
    };
    let gpu_gib = gpu.as_ref().map(|g| g.memory_mib as f64 * MIB / GIB);
    let mut vram_gib = gpu_gib;
    if let (Some(asked), Some(have)) = (opts.vram_gib, gpu_gib) {
        check_override("vram-gib", asked, have, "GiB of VRAM")?;
        emulated.push(format!("vram_gib={asked}"));
        vram_gib = Some(asked);
    } else if opts.vram_gib.is_some() {
        emulated.push("vram_gib ignored on the CPU".into());
    }

    let vram_step = vram_gib.and_then(|v| round_down_to_step(v, &table.vram_steps_gb, VRAM_TOLERANCE));
    let ram_step = round_down_to_step(ram_gib, &table.ram_steps_gb, RAM_TOLERANCE);
    let vram_short = matches!((vram_gib, vram_step), (Some(_), None));
    let ram_short = ram_step.is_none();

    let detected = Detected {
        gpu_index: gpu.as_ref().map(|g| g.index),
        gpu_name: gpu.as_ref().map(|g| g.name.clone()),
        gpu_vram_mib: gpu.as_ref().map(|g| g.memory_mib),
        gpus: gpus_listed,
        ram_gib: round1(ram_gib),
        ram_source: ram_source.into(),
        mem_available_gib: hw.meminfo.available_bytes.map(|b| round1(b as f64 / GIB)),
        physical_cores: hw.cpus.physical_cores,
        logical_cpus: hw.cpus.logical_cpus,
        available_cpus: available,
        emulated,
    };
    let backend_name = if backend == Backend::Cuda { "cuda" } else { "cpu" };
    let cuda_visible_devices = gpu.as_ref().map(|g| g.index.to_string());

    if vram_short || ram_short {
        if !opts.demo {
            return Err(DetectError::BelowMinimum(Shortfall {
                vram_missing_gib: vram_gib.filter(|_| vram_short).map(|v| missing_gib(table.min_vram_gb(), v)),
                ram_missing_gib: ram_short.then(|| missing_gib(table.min_ram_gb(), ram_gib)),
                vram_gib,
                ram_gib,
                min_vram_gb: table.min_vram_gb(),
                min_ram_gb: table.min_ram_gb(),
            }));
        }
        // The demo model fits anywhere: the smallest row's limits, no expert placement to speak of.
        let smallest = table.row(table.min_vram_gb(), table.min_ram_gb()).expect("validated table");
        return Ok(Profile {
            schema_version: PROFILE_SCHEMA_VERSION,
            name: format!("demo-{backend_name}"),
            backend: backend_name.into(),
            source: "demo".into(),
            model: Some("demo".into()),
            vram_gb: vram_step.unwrap_or(0),
            ram_gb: ram_step.unwrap_or(0),
            max_context: if backend == Backend::Cpu { CPU_MAX_CONTEXT } else { smallest.max_context },
            max_prefill: smallest.max_prefill,
            threads,
            ngram_table: NgramPlacement::Ssd,
            experts_per_layer: table.experts_per_layer,
            cuda_visible_devices,
            placement: Vec::new(),
            expert_mib: None,
            kv_cache_type: None,
            kv_window: None,
            max_sequences: Some(default_max_sequences(vram_step.unwrap_or(0))),
            detected,
        });
    }
    let ram_gb = ram_step.expect("checked above");

    let profile = match vram_step {
        Some(vram_gb) => {
            let row = table.row(vram_gb, ram_gb).expect("validated table has every step pair");
            Profile {
                schema_version: PROFILE_SCHEMA_VERSION,
                name: row.name.clone(),
                backend: backend_name.into(),
                source: table.source.clone(),
                model: opts.demo.then(|| "demo".to_owned()),
                vram_gb,
                ram_gb,
                max_context: row.max_context,
                max_prefill: row.max_prefill,
                threads,
                ngram_table: row.ngram_table,
                experts_per_layer: table.experts_per_layer,
                cuda_visible_devices,
                placement: vec![
                    TierPlacement {
                        tier: "gpu".into(),
                        experts_per_layer: row.gpu_experts_per_layer,
                        gpu_copies: None,
                    },
                    TierPlacement {
                        tier: "ram".into(),
                        experts_per_layer: row.cpu_experts_per_layer,
                        gpu_copies: Some(row.gpu_copies_in_ram),
                    },
                    TierPlacement {
                        tier: "ssd".into(),
                        experts_per_layer: row.ssd_experts_per_layer,
                        gpu_copies: None,
                    },
                ],
                expert_mib: None,
                kv_cache_type: Some(row.kv_cache_type),
                kv_window: Some(row.kv_window),
                max_sequences: Some(default_max_sequences(vram_gb)),
                detected,
            }
        }
        None => {
            // CPU only: the smallest-VRAM column's RAM/SSD split with the GPU experts moved to RAM.
            let row = table.row(table.min_vram_gb(), ram_gb).expect("validated table has every step pair");
            Profile {
                schema_version: PROFILE_SCHEMA_VERSION,
                name: format!("cpu-{ram_gb}gb-ram"),
                backend: "cpu".into(),
                source: "derived-cpu".into(),
                model: opts.demo.then(|| "demo".to_owned()),
                vram_gb: 0,
                ram_gb,
                max_context: CPU_MAX_CONTEXT,
                max_prefill: row.max_prefill,
                threads,
                ngram_table: row.ngram_table,
                experts_per_layer: table.experts_per_layer,
                cuda_visible_devices: None,
                placement: vec![
                    TierPlacement { tier: "gpu".into(), experts_per_layer: 0, gpu_copies: None },
                    TierPlacement {
                        tier: "ram".into(),
                        experts_per_layer: row.cpu_experts_per_layer + row.gpu_experts_per_layer,
                        gpu_copies: Some(0),
                    },
                    TierPlacement {
                        tier: "ssd".into(),
                        experts_per_layer: row.ssd_experts_per_layer,
                        gpu_copies: None,
                    },
                ],
                expert_mib: None,
                kv_cache_type: None,
                kv_window: None,
                max_sequences: Some(default_max_sequences(0)),
                detected,
            }
        }
    };
    Ok(profile)
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// The GPUs `CUDA_VISIBLE_DEVICES` leaves (only integer indices are understood; other forms, such as UUIDs, keep
/// every GPU).
fn visible_gpus(gpus: &Result<Vec<GpuInfo>, NoGpu>, cuda_visible: Option<&str>) -> Result<Vec<GpuInfo>, NoGpu> {
    let gpus = gpus.as_ref().map_err(Clone::clone)?;
    if gpus.is_empty() {
        return Err(NoGpu::NoneListed);
    }
    let Some(spec) = cuda_visible.map(str::trim) else { return Ok(gpus.clone()) };
    let indices: Option<Vec<u32>> = spec.split(',').map(|s| s.trim().parse().ok()).collect();
    let Some(indices) = indices.filter(|v| !v.is_empty()) else {
        return if spec.is_empty() || spec == "-1" { Err(NoGpu::NoneVisible(spec.into())) } else { Ok(gpus.clone()) };
    };
    let kept: Vec<GpuInfo> = gpus.iter().filter(|g| indices.contains(&g.index)).cloned().collect();
    if kept.is_empty() { Err(NoGpu::NoneVisible(spec.into())) } else { Ok(kept) }
}

// ---------------------------------------------------------------------------------------------------------------
// The model

/// A model file set that cannot be served; each message says what is missing and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The path does not exist.
    #[error("model {path} not found{}. {HOW_TO_GET_A_MODEL}", found_list(.found))]
    Missing {
        /// The path given.
        path: String,
        /// GGUF files that do exist in its folder (up to 10), to spot a typo or another part number.
        found: Vec<String>,
    },
    /// The path is a folder, not a GGUF file.
    #[error("model {path} is a folder: give a .gguf file (split models: the first part){}. {HOW_TO_GET_A_MODEL}", found_list(.found))]
    IsFolder {
        /// The path given.
        path: String,
        /// GGUF files in it (up to 10).
        found: Vec<String>,
    },
    /// A split model with parts missing.
    #[error(
        "model {path} is incomplete: {} of its {count} parts missing: {}. Copy or download the missing parts next to \
         the others (same folder, same names). {HOW_TO_GET_A_MODEL}",
        .missing.len(), .missing.join(", ")
    )]
    MissingParts {
        /// The path given.
        path: String,
        /// Number of parts the name says.
        count: u32,
        /// The missing parts' paths.
        missing: Vec<String>,
    },
    /// The file is there but is not a valid GGUF (truncated, wrong magic, inconsistent split keys, ...).
    #[error(
        "model {path} cannot be read: {detail}. The file may be truncated or damaged: download or convert it again. {HOW_TO_GET_A_MODEL}"
    )]
    Invalid {
        /// The path given.
        path: String,
        /// The reader's message, naming the file and field.
        detail: String,
    },
    /// A GGUF of another architecture.
    #[error("model {path} is a '{found}' GGUF; Nebula serves 'qwen4exp' (Qwen3.8-Flash-Next). {HOW_TO_GET_A_MODEL}")]
    WrongArchitecture {
        /// The path given.
        path: String,
        /// Its `general.architecture`.
        found: String,
    },
}

/// The hint every model error ends with.
pub const HOW_TO_GET_A_MODEL: &str = "Point --model/NEBULA_MODEL at a qwen4exp GGUF (split files: the first part, \
    e.g. Qwen3.8-Flash-Next-Q4_K_M-00001-of-00003.gguf), or convert a Hugging Face checkpoint with \
    `nebula convert <checkpoint-dir> -o <model>.gguf`";

fn found_list(found: &[String]) -> String {
    if found.is_empty() { String::new() } else { format!(" (GGUF files there: {})", found.join(", ")) }
}

fn gguf_files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".gguf"))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names.truncate(10);
    names
}

/// What [`check_model`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSummary {
    /// Number of files (parts).
    pub parts: usize,
    /// Their total size, bytes.
    pub bytes: u64,
    /// `general.name`, if set.
    pub name: Option<String>,
}

/// Checks that `path` is a complete qwen4exp GGUF (every split part present, headers valid, the architecture
/// right). Tensor data is memory-mapped, not read.
///
/// # Errors
/// A [`ModelError`] saying what is missing and how to convert or mount the model.
pub fn check_model(path: &Path) -> Result<ModelSummary, ModelError> {
    let label = path.display().to_string();
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if path.is_dir() {
        return Err(ModelError::IsFolder { path: label, found: gguf_files_in(path) });
    }
    if let Some(split) = SplitPath::parse(path).filter(|s| s.count > 1) {
        let missing: Vec<String> = (1..=split.count)
            .map(|no| split.part(no))
            .filter(|p| !p.is_file())
            .map(|p| p.display().to_string())
            .collect();
        if !missing.is_empty() {
            return Err(ModelError::MissingParts { path: label, count: split.count, missing });
        }
    } else if !path.exists() {
        return Err(ModelError::Missing { path: label, found: gguf_files_in(parent) });
    }
    let file = GgufFile::open(path).map_err(|e| match e.kind() {
        GgufErrorKind::MissingSplitPart { part } => {
            ModelError::MissingParts { path: label.clone(), count: 0, missing: vec![part.clone()] }
        }
        _ => ModelError::Invalid { path: label.clone(), detail: e.to_string() },
    })?;
    let arch = file.architecture().map_err(|e| ModelError::Invalid { path: label.clone(), detail: e.to_string() })?;
    if arch != "qwen4exp" {
        return Err(ModelError::WrongArchitecture { path: label, found: arch.to_owned() });
    }
    let bytes = file.part_paths().map(|p| std::fs::metadata(p).map_or(0, |m| m.len())).sum();
    let name = file.get("general.name").and_then(|v| v.as_str()).map(str::to_owned);
    Ok(ModelSummary { parts: file.n_parts(), bytes, name })
}

// ---------------------------------------------------------------------------------------------------------------
// The command

/// `nebula profile ...`.
#[derive(clap::Args, Debug, Clone)]
pub struct ProfileArgs {
    /// What to do.
    #[command(subcommand)]
    pub action: ProfileAction,
}

/// Subcommands of `nebula profile`.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum ProfileAction {
    /// Detect the GPU, RAM and cores, choose the profile of deploy/profiles.toml and write it.
    ///
    /// Exit codes: 0 written; 1 hardware unreadable or file not written; 2 bad flag; 3 no GPU (and the CPU not
    /// allowed); 4 below the minimum VRAM/RAM (the message says how many GiB are missing); 5 model missing or
    /// incomplete.
    Detect(DetectArgs),
}

/// Arguments of `nebula profile detect`.
#[derive(clap::Args, Debug, Clone)]
pub struct DetectArgs {
    /// Where to write the profile (`-`: standard output).
    #[arg(long, env = PROFILE_ENV, default_value = DEFAULT_PROFILE_PATH)]
    pub out: PathBuf,
    /// Backend: auto (CUDA when a GPU is visible), cuda or cpu.
    #[arg(long, env = "NEBULA_BACKEND", value_enum, default_value_t = Backend::Auto)]
    pub backend: Backend,
    /// With --backend auto and no GPU: write a CPU profile instead of refusing.
    #[arg(long, env = "NEBULA_ALLOW_CPU", value_parser = clap::builder::FalseyValueParser::new())]
    pub allow_cpu: bool,
    /// The embedded demo model will be served: the full model's minimums do not apply.
    #[arg(long, conflicts_with = "model")]
    pub demo: bool,
    /// Check this GGUF (split files: the first part): every part present, a valid qwen4exp header.
    #[arg(long, env = "NEBULA_MODEL")]
    pub model: Option<PathBuf>,
    /// Emulate a smaller GPU: VRAM budget in GiB (at most the GPU's).
    #[arg(long, env = "NEBULA_VRAM_GIB")]
    pub vram_gib: Option<f64>,
    /// Emulate less RAM: RAM budget in GiB (at most the machine's).
    #[arg(long, env = "NEBULA_RAM_GIB")]
    pub ram_gib: Option<f64>,
    /// CPU threads instead of the physical core count.
    #[arg(long, env = "NEBULA_THREADS")]
    pub threads: Option<usize>,
    /// Profile table to use instead of the embedded deploy/profiles.toml.
    #[arg(long, env = "NEBULA_PROFILE_TABLE")]
    pub table: Option<PathBuf>,
    /// The nvidia-smi command.
    #[arg(long, env = "NEBULA_NVIDIA_SMI", default_value = "nvidia-smi")]
    pub nvidia_smi: String,
    /// Read the GPU list (nvidia-smi's CSV: index, name, MiB) from this file instead of running nvidia-smi.
    #[arg(long, env = "NEBULA_GPU_QUERY_FILE")]
    pub gpu_query_file: Option<PathBuf>,
    /// meminfo file.
    #[arg(long, env = "NEBULA_MEMINFO", default_value = "/proc/meminfo")]
    pub meminfo: PathBuf,
    /// cpuinfo file.
    #[arg(long, env = "NEBULA_CPUINFO", default_value = "/proc/cpuinfo")]
    pub cpuinfo: PathBuf,
    /// cgroup memory limit file (default: cgroup v2 memory.max, then v1 memory.limit_in_bytes); `none`: ignore.
    #[arg(long, env = "NEBULA_CGROUP_MEMORY")]
    pub cgroup_memory: Option<PathBuf>,
}

/// Runs `nebula profile ...`: prints a summary on stdout, refusals on stderr, and returns the exit code
/// ([`EXIT_OK`], or [`DetectError::exit_code`]).
pub fn run(args: ProfileArgs) -> u8 {
    match args.action {
        ProfileAction::Detect(args) => match detect(&args) {
            Ok(summary) => {
                print!("{summary}");
                EXIT_OK
            }
            Err(e) => {
                eprintln!("nebula profile detect: {e}");
                e.exit_code()
            }
        },
    }
}

/// The vision tower served with `model` by convention (`<stem>-mmproj.gguf` beside it, as `nebula bench vision`
/// finds it) and the VRAM the GPU tower takes at its own `max_pixels` (`CudaVisionModel::vram_bytes`); `None`
/// when there is none or it cannot be read.
fn mmproj_beside(model: &Path) -> Option<(PathBuf, u64)> {
    let stem = model.file_stem()?.to_string_lossy().into_owned();
    let path = model.with_file_name(format!("{stem}-mmproj.gguf"));
    let file = GgufFile::open(&path).ok()?;
    let cfg = nebula_engine::vision::VisionConfig::from_gguf(&file).ok()?;
    let bytes = nebula_engine::backend::cuda::CudaVisionModel::vram_bytes(&cfg, cfg.max_pixels);
    Some((path, bytes))
}

/// `nebula profile detect`: reads the machine, chooses, checks the model, writes the file; returns the summary.
///
/// # Errors
/// Any [`DetectError`]; a file that cannot be written is [`DetectError::Input`].
pub fn detect(args: &DetectArgs) -> Result<String, DetectError> {
    let table = match &args.table {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| DetectError::Input(format!("cannot read {}: {e}", path.display())))?;
            ProfileTable::parse(&text, &path.display().to_string()).map_err(|e| DetectError::Input(e.to_string()))?
        }
        None => ProfileTable::embedded(),
    };
    let mut sources = Sources {
        nvidia_smi: args.nvidia_smi.clone(),
        gpu_query_file: args.gpu_query_file.clone(),
        meminfo: args.meminfo.clone(),
        cpuinfo: args.cpuinfo.clone(),
        ..Sources::default()
    };
    if let Some(p) = &args.cgroup_memory {
        sources.cgroup_memory = if p.as_os_str() == "none" { Vec::new() } else { vec![p.clone()] };
    }
    let hw = read_hardware(&sources)?;
    let opts = DetectOptions {
        backend: args.backend,
        allow_cpu: args.allow_cpu,
        demo: args.demo,
        vram_gib: args.vram_gib,
        ram_gib: args.ram_gib,
        threads: args.threads,
        cuda_visible_devices: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
    };
    let mut profile = select(&table, &hw, &opts)?;
    let mut summary = String::new();
    if let Some(model) = &args.model {
        let m = check_model(model)?;
        profile.model = Some(model.display().to_string());
        let size = GgufFile::open(model).ok().as_ref().and_then(ExpertSize::of_file);
        if let Some(size) = size.filter(|s| !s.is_table_mix()) {
            expert_size::apply(&mut profile, &size);
            profile.expert_mib = Some((size.mean_bytes / MIB * 1000.0).round() / 1000.0);
            if !profile.placement.is_empty() {
                profile.source = format!("{}-expert-size", profile.source);
            }
            let _ = writeln!(
                summary,
                "experts: {:.3} MiB each ({}), {:.3} MiB in the table's Q4_K/IQ4_NL: tiers recounted",
                size.mean_bytes / MIB,
                size.types.iter().map(|t| t.name()).collect::<Vec<_>>().join("/"),
                size.q4_bytes / MIB
            );
            // The GPU tier grown into the VRAM the file's smaller dense weights leave (expert_size.rs).
            if let Some(row) = table.row(profile.vram_gb, profile.ram_gb)
                && profile.backend == "cuda"
            {
                let kv_type = profile.kv_cache_type.unwrap_or(KvCacheType::F32);
                let (kv, _) = released_kv_bytes(profile.max_context, kv_type, profile.kv_window.unwrap_or(0), true);
                // A vision tower beside the model goes to the GPU when served: its VRAM at its own max_pixels.
                let vision = mmproj_beside(model).map(|(_, bytes)| bytes).unwrap_or(0);
                if let Some(gpu) = expert_size::fill_vram(&mut profile, &size, row.free_vram_gb, kv + vision) {
                    let _ = writeln!(
                        summary,
                        "GPU tier filled to {gpu} experts per layer: {} GB step less the {} GB headroom, the \
                         file's dense weights ({:.2} GiB), one {}-token sequence's KV cache ({:.2} GiB){}",
                        profile.vram_gb,
                        row.free_vram_gb,
                        size.dense_bytes as f64 / GIB,
                        profile.max_context,
                        kv as f64 / GIB,
                        if vision > 0 {
                            format!(" and the vision tower beside the model ({:.2} GiB)", vision as f64 / GIB)
                        } else {
                            String::new()
                        }
                    );
                }
            }
        }
        let _ = writeln!(
            summary,
            "model: {} ({} part{}, {}{})",
            model.display(),
            m.parts,
            if m.parts == 1 { "" } else { "s" },
            human_size(m.bytes),
            m.name.map_or(String::new(), |n| format!(", {n}"))
        );
    }
    let text = profile.to_toml();
    if args.out.as_os_str() == "-" {
        print!("{text}");
    } else {
        write_atomically(&args.out, &text)
            .map_err(|e| DetectError::Input(format!("cannot write the profile {}: {e}", args.out.display())))?;
    }
    let gpu = match (&profile.detected.gpu_name, profile.detected.gpu_vram_mib) {
        (Some(name), Some(mib)) => format!(
            "GPU {} {name} ({:.1} GiB{})",
            profile.detected.gpu_index.unwrap_or(0),
            mib as f64 / 1024.0,
            if profile.detected.gpus > 1 {
                format!(", the largest of {}", profile.detected.gpus)
            } else {
                String::new()
            }
        ),
        _ => "no GPU (CPU only)".into(),
    };
    let _ = writeln!(
        summary,
        "profile {} ({}): {gpu}; RAM {:.1} GiB ({}); {} threads; max context {}, max prefill {}{}",
        profile.name,
        profile.source,
        profile.detected.ram_gib,
        profile.detected.ram_source,
        profile.threads,
        profile.max_context,
        profile.max_prefill,
        if profile.detected.emulated.is_empty() {
            String::new()
        } else {
            format!("; emulated: {}", profile.detected.emulated.join(", "))
        }
    );
    if args.out.as_os_str() != "-" {
        let _ = writeln!(summary, "wrote {}", args.out.display());
    }
    Ok(summary)
}

/// `94.3 GiB`, `28.6 MiB`.
fn human_size(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= GIB { format!("{:.1} GiB", b / GIB) } else { format!("{:.1} MiB", b / MIB) }
}

/// Writes `text` to `path` through a temporary file and a rename, so readers never see half a profile.
fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("toml.tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

pub mod expert_size;
pub mod hardware;
pub use expert_size::ExpertSize;
pub use hardware::*;

#[cfg(test)]
mod tests;
