//! Settings of `nebula serve`, resolved with figment from, lowest first: the built-in defaults, the config file
//! (`--config PATH`, `NEBULA_CONFIG`, else `./nebula.toml` when it exists), `NEBULA_*` environment variables
//! (nested keys with `__`: `NEBULA_PREFIX_CACHE__MAX_ENTRIES=4`), then the command-line flags ([`ServeArgs`]).
//! Every key, its default and its meaning is listed in `docs/config.md`; [`ServerConfig`] is the resolved result.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};

/// The demo model built into the binary (`models/nebula-demo.gguf`, made by `scripts/make_demo_model.py`), served
/// when no model is given so that a fresh clone and any copied binary work.
#[cfg(not(feature = "lean"))]
pub static EMBEDDED_DEMO_MODEL: &[u8] = include_bytes!("../../models/nebula-demo.gguf");
/// Built with the `lean` feature: no demo model inside (a smaller binary to carry to benchmark machines).
#[cfg(feature = "lean")]
pub static EMBEDDED_DEMO_MODEL: &[u8] = &[];

/// The demo model's vision tower (`models/nebula-demo-mmproj.gguf`, made by `scripts/make_demo_vision.py`),
/// loaded with the embedded demo model when no `vision.mmproj` is given.
#[cfg(not(feature = "lean"))]
pub static EMBEDDED_DEMO_MMPROJ: &[u8] = include_bytes!("../../models/nebula-demo-mmproj.gguf");
/// Built with the `lean` feature: no demo tower inside.
#[cfg(feature = "lean")]
pub static EMBEDDED_DEMO_MMPROJ: &[u8] = &[];

/// Label of the embedded demo tower in logs and errors.
pub const EMBEDDED_DEMO_MMPROJ_LABEL: &str = "<embedded>/nebula-demo-mmproj.gguf";

/// Label of the embedded demo model in logs and errors (it stands where a path would).
pub const EMBEDDED_DEMO_LABEL: &str = "<embedded>/nebula-demo.gguf";

/// Default context limit on the CPU path: the longest prompt + completion served when `max_context` is not
/// given and the model's trained context is longer. It bounds the per-request state the CPU engine allocates.
pub const DEFAULT_CPU_MAX_CONTEXT: usize = 32_768;

/// The config file read when neither `--config` nor `NEBULA_CONFIG` names one (only if it exists).
pub const DEFAULT_CONFIG_FILE: &str = "nebula.toml";

/// Arguments of `nebula serve`. Each flag overrides the config file and the environment (`docs/config.md`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ServeArgs {
    /// Config file (TOML). Default: ./nebula.toml when it exists.
    #[arg(long, env = "NEBULA_CONFIG")]
    pub config: Option<PathBuf>,
    /// GGUF model to serve (split files: give the first part). Default: the embedded demo model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Address to bind. Default: 127.0.0.1.
    #[arg(long)]
    pub host: Option<IpAddr>,
    /// Port to bind (0: any free port). Default: 8090.
    #[arg(long)]
    pub port: Option<u16>,
    /// Longest prompt + completion served, in tokens. Default: the profile's, else the model's trained context
    /// capped at 32768 on the CPU. Prompts that do not fit are refused with 400, never truncated.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_context: Option<u64>,
    /// Requests that may wait for the engine; more are refused with 429. Default: 64.
    #[arg(long = "queue", value_parser = clap::value_parser!(u64).range(1..))]
    pub queue_capacity: Option<u64>,
    /// Model id in the API (`model` of requests and `/v1/models`). Default: the GGUF's `general.name`.
    #[arg(long)]
    pub model_id: Option<String>,
    /// Hardware profile file written by `nebula profile detect` (TOML). Default: none.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Require `Authorization: Bearer KEY` on every route but /health. Prefer NEBULA_API_KEY (flags are visible
    /// in the process list).
    #[arg(long)]
    pub api_key: Option<String>,
    /// OTLP/HTTP endpoint for traces (e.g. http://127.0.0.1:4318/v1/traces). Default: no tracing export.
    #[arg(long)]
    pub otlp_endpoint: Option<String>,
    /// Where the forward pass runs: `cpu`, or `cuda` (every weight on one GPU; with a placement, hybrid: the GPU
    /// tier and the dense trunk on the GPU, the rest on the CPU; `placement.vram_budget_gib` bounds it). Default:
    /// cpu.
    #[arg(long)]
    pub backend: Option<String>,
    /// GPU index for the cuda backend (as nvidia-smi lists them). Default: 0.
    #[arg(long)]
    pub gpu: Option<u64>,
    /// How the attention caches store their rows: f32 (exact), f16, q8_0 or q4_0 (ggml's blocks, as llama.cpp's
    /// --cache-type-k/v). Default: the profile's, else f32.
    #[arg(long)]
    pub kv_cache_type: Option<nebula_engine::model::KvCacheType>,
    /// Tokens of each attention layer's keys and values kept in VRAM per sequence on the cuda backend; older ones
    /// live in pinned host memory (0: all in VRAM). Default: the profile's, else 0.
    #[arg(long)]
    pub kv_window: Option<u64>,
    /// The model's vision tower: an mmproj GGUF (`nebula convert --mmproj`, or llama.cpp's). Default: none (the
    /// embedded demo model brings its own); without one, image parts get 400.
    #[arg(long)]
    pub mmproj: Option<PathBuf>,
    /// Expert placement and emulation flags (`[placement]` of the config).
    #[command(flatten)]
    pub placement: crate::placement::PlacementFlags,
}

/// Where the served model comes from. In config files and the environment: a path, or empty for the embedded
/// demo model.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ModelSource {
    /// The demo model built into the binary ([`EMBEDDED_DEMO_MODEL`]).
    #[default]
    EmbeddedDemo,
    /// A GGUF file on disk (split files: the first part).
    File(PathBuf),
}

impl ModelSource {
    /// How logs and errors name the model file.
    pub fn label(&self) -> String {
        match self {
            Self::EmbeddedDemo => EMBEDDED_DEMO_LABEL.to_owned(),
            Self::File(path) => path.display().to_string(),
        }
    }
}

impl Serialize for ModelSource {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::EmbeddedDemo => s.serialize_str(""),
            Self::File(p) => p.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for ModelSource {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let path = PathBuf::deserialize(d)?;
        Ok(if path.as_os_str().is_empty() { Self::EmbeddedDemo } else { Self::File(path) })
    }
}

/// Sampling defaults of one mode (thinking on or off); a request's own values win.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingDefaults {
    /// Softmax temperature.
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Top-k (0: no limit).
    pub top_k: usize,
    /// Min-p.
    pub min_p: f32,
    /// OpenAI presence penalty.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty.
    pub frequency_penalty: f32,
    /// HF repetition penalty (1: off).
    pub repetition_penalty: f32,
}

/// Server-wide generation defaults (Qwen's published sampling values for the model).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GenerationDefaults {
    /// Think before answering unless a request says otherwise.
    pub enable_thinking: bool,
    /// Reasoning effort when a request gives none: `low`, `medium` or `xhigh`; empty: the template's (`xhigh`).
    pub reasoning_effort: String,
    /// Sampling with thinking on (Qwen3.8: T=1.0, top_p=0.95, top_k=20, min_p=0, presence 0).
    pub thinking: SamplingDefaults,
    /// Sampling with thinking off (Qwen3.8: T=0.7, top_p=0.8, top_k=20, min_p=0, presence 1.5).
    pub non_thinking: SamplingDefaults,
    /// Output that repeats one pattern of at most `repetition_max_period` tokens for this many tokens ends with
    /// `finish_reason: "length"` (0: off). Off for `ignore_eos` requests.
    pub repetition_window: usize,
    /// Longest pattern the repetition guard looks for, tokens.
    pub repetition_max_period: usize,
    /// Let special tokens typed in message text (`<|im_end|>`, `<think>`) act as control tokens. Off: they are
    /// encoded as plain text, so a user cannot forge turns.
    pub allow_special_tokens_in_content: bool,
    /// Most tokens a chat completion generates (reasoning included) when the request sets neither `max_tokens`
    /// nor `max_completion_tokens`; the room left in the context still bounds it. 0: only the context bounds it.
    /// Default 32,768, the output length Qwen recommends for Qwen3 models.
    pub default_max_tokens: usize,
}

impl Default for GenerationDefaults {
    fn default() -> Self {
        Self {
            enable_thinking: true,
            reasoning_effort: String::new(),
            thinking: SamplingDefaults {
                temperature: 1.0,
                top_p: 0.95,
                top_k: 20,
                min_p: 0.0,
                presence_penalty: 0.0,
                frequency_penalty: 0.0,
                repetition_penalty: 1.0,
            },
            non_thinking: SamplingDefaults {
                temperature: 0.7,
                top_p: 0.8,
                top_k: 20,
                min_p: 0.0,
                presence_penalty: 1.5,
                frequency_penalty: 0.0,
                repetition_penalty: 1.0,
            },
            repetition_window: 256,
            repetition_max_period: 32,
            allow_special_tokens_in_content: false,
            default_max_tokens: 32_768,
        }
    }
}

/// Prefix cache limits (`[prefix_cache]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixCacheConfig {
    /// Sequences kept (0: off).
    pub max_entries: usize,
    /// Most MiB of host memory kept (CPU states, and GPU states spilled from VRAM).
    pub max_mib: usize,
    /// Most MiB of VRAM the cached GPU states and checkpoints may keep before the least recently used are
    /// spilled to host memory. Unset: 1/16 of the profile's VRAM step (768 MiB at 12 GB), or 1024 MiB without a
    /// profile.
    pub device_mib: Option<usize>,
    /// A checkpoint every this many tokens inside long prompts and answers (besides turn boundaries).
    pub interval: usize,
    /// Directory of the on-disk prefix cache (created if missing); `None`: no disk cache.
    pub dir: Option<PathBuf>,
    /// Most GiB the on-disk cache keeps in `dir` (all entries together).
    pub disk_max_gib: f64,
}

impl Default for PrefixCacheConfig {
    fn default() -> Self {
        Self { max_entries: 8, max_mib: 2048, device_mib: None, interval: 1024, dir: None, disk_max_gib: 64.0 }
    }
}

impl PrefixCacheConfig {
    /// `disk_max_gib` in bytes (saturating).
    pub fn disk_max_bytes(&self) -> u64 {
        (self.disk_max_gib * (1u64 << 30) as f64) as u64
    }
}

/// Vision input (`[vision]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VisionConfig {
    /// The vision tower, an mmproj GGUF; `None`: the embedded demo tower with the demo model, else no images.
    pub mmproj: Option<PathBuf>,
    /// Accept local file paths (`file:///...` or an absolute path) in `image_url` parts. Off by default: a
    /// server should not read its own disk for clients.
    pub allow_local_files: bool,
    /// When set, local files must lie under this directory (after resolving links).
    pub local_files_root: Option<PathBuf>,
    /// Fewest pixels an image is resized to; `None`: the tower file's (`clip.vision.image_min_pixels`, else
    /// Qwen3-VL's 65,536).
    pub min_pixels: Option<u64>,
    /// Most pixels an image is resized to; `None`: the tower file's (else Qwen3-VL's 16,777,216).
    pub max_pixels: Option<u64>,
    /// Most pixels an image may declare in its header; larger ones are refused before decoding (pixel bombs).
    pub max_decode_pixels: u64,
    /// Most images in one request.
    pub max_images: usize,
}

impl Default for VisionConfig {
    fn default() -> Self {
        Self {
            mmproj: None,
            allow_local_files: false,
            local_files_root: None,
            min_pixels: None,
            max_pixels: None,
            max_decode_pixels: 64 << 20,
            max_images: 32,
        }
    }
}

/// MTP speculative decoding (`[mtp]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MtpConfig {
    /// Draft with the model's MTP block when it has one (greedy requests are verified at their
    /// `accuracy_level`, sampled ones by speculative sampling). Off: the block is not even loaded.
    pub enabled: bool,
}

impl Default for MtpConfig {
    fn default() -> Self {
        Self { enabled: true }
    }
}

/// Continuous batching (`[batching]`): how many requests decode together and within what limits. Unset keys
/// take the profile's (`max_sequences`, `max_batch_tokens`, `state_budget_mib`), else the defaults below.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BatchingConfig {
    /// Sequences running at once; 1 turns batching off (one request at a time, the rest wait). Default 16.
    pub max_sequences: Option<usize>,
    /// Tokens one pass runs at most (decode rows plus prefill chunks); default the decode rows plus one prefill
    /// chunk, or several short ones within 512 tokens.
    pub max_batch_tokens: Option<usize>,
    /// MiB of sequence state (KV caches, recurrent states) the running sequences may reserve; default: on the
    /// CPU half the memory available at start, on the GPU what can be allocated (a request whose state cannot
    /// be allocated waits for others to end).
    pub state_budget_mib: Option<usize>,
    /// MTP drafting while at most this many sequences decode; bigger batches take plain steps together.
    pub speculative_max_batch: usize,
    /// Batched passes compute each sequence exactly as alone (on the GPU: row by row; the CPU always does).
    pub deterministic: bool,
}

impl Default for BatchingConfig {
    fn default() -> Self {
        Self {
            max_sequences: None,
            max_batch_tokens: None,
            state_budget_mib: None,
            speculative_max_batch: 1,
            deterministic: false,
        }
    }
}

/// Everything the server runs with. Keys as in `nebula.toml`; see `docs/config.md`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// Address to bind.
    pub host: IpAddr,
    /// Port to bind; 0 picks a free one (see [`crate::ServerHandle::addr`]).
    pub port: u16,
    /// The model to serve.
    pub model: ModelSource,
    /// Model id in the API; `None`: the GGUF's `general.name`.
    pub model_id: Option<String>,
    /// More names the served model answers to in every API (`model` of chat completions, responses and
    /// messages); `/v1/models` lists them after the id.
    pub model_aliases: Vec<String>,
    /// Answer a request for any model name with the served model (agents ask for their own names, such as
    /// `claude-opus-4-…` or `gpt-5-codex`). Off: an unknown name is a 404.
    pub serve_any_model: bool,
    /// Key that seals returned reasoning (`encrypted_content`, thinking `signature`) so that it can be read back
    /// when a client replays it: 64 hex digits (32 bytes). `None`: a random key per process (sealed reasoning
    /// does not survive a restart).
    pub reasoning_seal_key: Option<String>,
    /// Longest prompt + completion in tokens; `None`: the profile's, else the model's, capped at
    /// [`DEFAULT_CPU_MAX_CONTEXT`].
    pub max_context: Option<usize>,
    /// Prompt tokens per prefill chunk; `None`: the profile's `max_prefill`, else 512.
    pub max_prefill: Option<usize>,
    /// Requests that may wait for the engine before new ones get 429.
    #[serde(rename = "queue")]
    pub queue_capacity: usize,
    /// The hardware profile file (`nebula profile detect`); shown in `/v1/models` and bounding the limits.
    pub profile: Option<PathBuf>,
    /// Bearer key every route but `/health` requires; `None`: open.
    pub api_key: Option<String>,
    /// Origins allowed by CORS (`["*"]` for any); empty: CORS off.
    pub cors_allow_origins: Vec<String>,
    /// Largest request body, bytes (413 above).
    pub body_limit_bytes: usize,
    /// API requests handled at once (streams count until they end); more wait in a bounded queue.
    pub max_concurrent_requests: usize,
    /// API requests that may wait for a slot; more get 429 with `Retry-After`.
    pub max_waiting_requests: usize,
    /// A request that produced no response head after this many seconds gets 504 (streams answer at once, so
    /// this bounds non-streamed requests).
    pub request_timeout_s: f64,
    /// A generation with no word from the engine for this many seconds fails (the watchdog).
    pub watchdog_s: f64,
    /// Seconds between SSE keep-alive comments while nothing else is sent (long prefill).
    pub sse_keepalive_s: f64,
    /// After SIGTERM, seconds open requests may run before the server stops anyway.
    pub shutdown_grace_s: f64,
    /// OTLP/HTTP endpoint for traces; `None`: no export.
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported traces.
    pub otlp_service_name: String,
    /// Generation defaults.
    pub defaults: GenerationDefaults,
    /// Prefix cache limits.
    pub prefix_cache: PrefixCacheConfig,
    /// Expert placement (defaults from the profile).
    pub placement: crate::placement::PlacementConfig,
    /// MTP speculative decoding.
    pub mtp: MtpConfig,
    /// Vision input.
    pub vision: VisionConfig,
    /// Continuous batching.
    pub batching: BatchingConfig,
    /// `cpu` or `cuda`.
    pub backend: String,
    /// GPU index for the cuda backend.
    pub gpu: usize,
    /// How the attention caches store their rows (`f32`, `f16`, `q8_0`, `q4_0`); `None`: the profile's, else `f32`.
    pub kv_cache_type: Option<nebula_engine::model::KvCacheType>,
    /// Tokens of K and V kept in VRAM per attention layer and sequence on the cuda backend (0: all); `None`: the
    /// profile's, else `tuning.cuda.kv_window` (`NEBULA_CUDA_KV_WINDOW`, 0).
    pub kv_window: Option<usize>,
    /// Tuning of the backends (`[tuning.cuda]`, `[tuning.cuda.hybrid]`, `[tuning.cpu]`); the `NEBULA_CUDA_*`,
    /// `NEBULA_HYBRID_*`, `NEBULA_CPU_*` ... variables of `docs/config.md` override it.
    pub tuning: nebula_engine::tuning::Tuning,
}

impl Default for ServerConfig {
    /// The embedded demo model on 127.0.0.1:8090.
    fn default() -> Self {
        Self {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 8090,
            model: ModelSource::EmbeddedDemo,
            model_id: None,
            model_aliases: Vec::new(),
            serve_any_model: false,
            reasoning_seal_key: None,
            max_context: None,
            max_prefill: None,
            queue_capacity: 64,
            profile: None,
            api_key: None,
            cors_allow_origins: Vec::new(),
            body_limit_bytes: 32 << 20,
            max_concurrent_requests: 256,
            max_waiting_requests: 256,
            request_timeout_s: 1800.0,
            watchdog_s: 300.0,
            sse_keepalive_s: 10.0,
            shutdown_grace_s: 30.0,
            otlp_endpoint: None,
            otlp_service_name: "nebula".into(),
            defaults: GenerationDefaults::default(),
            prefix_cache: PrefixCacheConfig::default(),
            placement: crate::placement::PlacementConfig::default(),
            mtp: MtpConfig::default(),
            vision: VisionConfig::default(),
            batching: BatchingConfig::default(),
            backend: "cpu".into(),
            gpu: 0,
            kv_cache_type: None,
            kv_window: None,
            tuning: nebula_engine::tuning::Tuning::default(),
        }
    }
}

/// A figment error as users write the key: `placement.threads` in a file (figment would print
/// `default.placement.threads`, its profile), `NEBULA_PLACEMENT__THREADS` for an environment variable; one line
/// per error of the chain.
fn describe_figment_error(e: figment::Error) -> String {
    e.into_iter()
        .map(|e| {
            let mut line = e.kind.to_string();
            let from_env = e.metadata.as_ref().is_some_and(|m| m.name.contains("environment variable"));
            if !e.path.is_empty() {
                let key = if from_env {
                    format!("NEBULA_{}", e.path.join("__").to_ascii_uppercase())
                } else {
                    e.path.join(".")
                };
                line.push_str(&format!(" for key `{key}`"));
            }
            if let Some(md) = &e.metadata {
                match &md.source {
                    Some(source) => line.push_str(&format!(" in {source} {}", md.name)),
                    None => line.push_str(&format!(" in {}", md.name)),
                }
            }
            line
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Why the configuration could not be resolved.
#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigError(pub String);

impl ServerConfig {
    /// Resolves the configuration: defaults < the profile's placement (when a profile is configured) < config
    /// file < `NEBULA_*` environment < `args`.
    ///
    /// Errors: an unreadable or malformed file (config or profile), an unknown key, or a value of the wrong type
    /// (the message names the key and where it came from).
    pub fn resolve(args: &ServeArgs) -> Result<Self, ConfigError> {
        let config = Self::extract(args, None)?;
        let Some(profile) = &config.profile else { return Ok(config) };
        // The profile's tier counts, budgets and threads sit just above the defaults (crate::placement).
        let value = crate::placement::read_profile_value(profile).map_err(ConfigError)?;
        Self::extract(args, Some(crate::placement::profile_layer(&value)))
    }

    fn extract(args: &ServeArgs, profile_layer: Option<serde_json::Value>) -> Result<Self, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(ServerConfig::default()));
        if let Some(layer) = profile_layer {
            figment = figment.merge(Serialized::defaults(layer));
        }
        match &args.config {
            Some(path) if !path.exists() => {
                return Err(ConfigError(format!("the config file {} does not exist", path.display())));
            }
            Some(path) => figment = figment.merge(Toml::file_exact(path)),
            None if std::path::Path::new(DEFAULT_CONFIG_FILE).exists() => {
                figment = figment.merge(Toml::file_exact(DEFAULT_CONFIG_FILE));
            }
            None => {}
        }
        // Only variables naming a key: other tools share the prefix (NEBULA_BIN, NEBULA_API_URL, ...).
        let known: Vec<String> = match serde_json::to_value(ServerConfig::default()) {
            Ok(serde_json::Value::Object(map)) => map.keys().cloned().collect(),
            _ => Vec::new(),
        };
        figment = figment.merge(
            Env::prefixed("NEBULA_")
                .filter(move |key| {
                    let top = key.as_str().to_ascii_lowercase();
                    let top = top.split("__").next().unwrap_or_default();
                    known.iter().any(|k| k == top)
                })
                .split("__"),
        );
        let flags = FlagOverrides::from(args);
        figment = figment.merge(Serialized::defaults(flags));
        let mut config: ServerConfig = figment.extract().map_err(|e| ConfigError(describe_figment_error(e)))?;
        // The tuning variables keep their own names (NEBULA_CUDA_GRAPHS, ...), applied over the table.
        config.tuning = config.tuning.with_env(|k| std::env::var(k).ok()).map_err(|e| ConfigError(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks values figment cannot (ranges, effort names).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.tuning.validate().map_err(|e| ConfigError(e.to_string()))?;
        let effort = self.defaults.reasoning_effort.as_str();
        if !["", "low", "medium", "xhigh"].contains(&effort) {
            return Err(ConfigError(format!("defaults.reasoning_effort must be low, medium or xhigh, got {effort:?}")));
        }
        for (name, v) in [
            ("request_timeout_s", self.request_timeout_s),
            ("watchdog_s", self.watchdog_s),
            ("sse_keepalive_s", self.sse_keepalive_s),
            ("shutdown_grace_s", self.shutdown_grace_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(ConfigError(format!("{name} must be a positive number of seconds, got {v}")));
            }
        }
        if self.queue_capacity == 0 || self.max_concurrent_requests == 0 {
            return Err(ConfigError("queue and max_concurrent_requests must be at least 1".into()));
        }
        if self.api_key.as_deref() == Some("") {
            return Err(ConfigError("api_key is empty; leave it unset for an open server".into()));
        }
        if let Some(key) = &self.reasoning_seal_key {
            crate::seal::parse_key(key).map_err(|e| ConfigError(format!("reasoning_seal_key: {e}")))?;
        }
        if let Some(alias) = self.model_aliases.iter().find(|a| a.trim().is_empty()) {
            return Err(ConfigError(format!("model_aliases must not contain empty names, got {alias:?}")));
        }
        if !["cpu", "cuda"].contains(&self.backend.as_str()) {
            return Err(ConfigError(format!("backend must be cpu or cuda, got {:?}", self.backend)));
        }
        let gib = self.prefix_cache.disk_max_gib;
        if !(gib.is_finite() && gib > 0.0) {
            return Err(ConfigError(format!("prefix_cache.disk_max_gib must be a positive number of GiB, got {gib}")));
        }
        if self.prefix_cache.dir.as_ref().is_some_and(|d| d.as_os_str().is_empty()) {
            return Err(ConfigError("prefix_cache.dir is empty; leave it unset for no disk cache".into()));
        }
        self.placement.validate().map_err(ConfigError)?;
        Ok(())
    }

    /// The context limit handed to the engine (which also caps it at the model's own context length).
    pub fn engine_max_context(&self) -> usize {
        self.max_context.unwrap_or(DEFAULT_CPU_MAX_CONTEXT)
    }

    /// `shutdown_grace_s` as a duration.
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_secs_f64(self.shutdown_grace_s)
    }
}

/// The flags that were given, as a figment layer (absent flags leave lower layers alone).
#[derive(Debug, Serialize)]
struct FlagOverrides {
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    host: Option<IpAddr>,
    #[serde(skip_serializing_if = "Option::is_none")]
    port: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_context: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    queue: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    model_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    profile: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    api_key: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    otlp_endpoint: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    backend: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_cache_type: Option<nebula_engine::model::KvCacheType>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_window: Option<u64>,
    #[serde(skip_serializing_if = "is_empty_object")]
    placement: serde_json::Value,
    #[serde(skip_serializing_if = "is_empty_object")]
    vision: serde_json::Value,
}

fn is_empty_object(v: &serde_json::Value) -> bool {
    v.as_object().is_none_or(|m| m.is_empty())
}

impl From<&ServeArgs> for FlagOverrides {
    fn from(a: &ServeArgs) -> Self {
        Self {
            model: a.model.clone(),
            host: a.host,
            port: a.port,
            max_context: a.max_context,
            queue: a.queue_capacity,
            model_id: a.model_id.clone(),
            profile: a.profile.clone(),
            api_key: a.api_key.clone(),
            otlp_endpoint: a.otlp_endpoint.clone(),
            backend: a.backend.clone(),
            gpu: a.gpu,
            kv_cache_type: a.kv_cache_type,
            kv_window: a.kv_window,
            placement: a.placement.overrides(),
            vision: match &a.mmproj {
                Some(p) => serde_json::json!({ "mmproj": p }),
                None => serde_json::json!({}),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backend_is_cpu_or_cuda() {
        let mut c = ServerConfig::default();
        assert!(c.validate().is_ok());
        c.backend = "cuda".into();
        assert!(c.validate().is_ok());
        c.backend = "rocm".into();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("backend must be cpu or cuda") && err.contains("rocm"), "{err}");
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail closure returns figment::Error.
    fn layers_apply_in_order_and_errors_name_the_key() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "nebula.toml",
                "port = 9000\nqueue = 3\n[defaults]\nenable_thinking = false\n[prefix_cache]\nmax_entries = 2\n",
            )?;
            let c = ServerConfig::resolve(&ServeArgs::default()).unwrap();
            assert_eq!((c.port, c.queue_capacity, c.defaults.enable_thinking), (9000, 3, false));
            assert_eq!(c.prefix_cache.max_entries, 2);
            jail.set_env("NEBULA_PORT", "9100");
            jail.set_env("NEBULA_PREFIX_CACHE__INTERVAL", "64");
            jail.set_env("NEBULA_MODEL", "/models/x.gguf");
            let c = ServerConfig::resolve(&ServeArgs::default()).unwrap();
            assert_eq!((c.port, c.prefix_cache.interval), (9100, 64));
            assert_eq!(c.model, ModelSource::File("/models/x.gguf".into()));
            let c = ServerConfig::resolve(&ServeArgs { port: Some(1), ..Default::default() }).unwrap();
            assert_eq!(c.port, 1);
            assert_eq!(c.prefix_cache.dir, None, "no disk cache unless asked");
            jail.set_env("NEBULA_PREFIX_CACHE__DIR", "/var/cache/nebula");
            jail.set_env("NEBULA_PREFIX_CACHE__DISK_MAX_GIB", "0.5");
            let c = ServerConfig::resolve(&ServeArgs::default()).unwrap();
            assert_eq!(c.prefix_cache.dir.as_deref(), Some(std::path::Path::new("/var/cache/nebula")));
            assert_eq!(c.prefix_cache.disk_max_bytes(), 512 << 20);
            jail.set_env("NEBULA_PREFIX_CACHE__DISK_MAX_GIB", "-1");
            let err = ServerConfig::resolve(&ServeArgs::default()).unwrap_err().to_string();
            assert!(err.contains("prefix_cache.disk_max_gib"), "{err}");
            jail.set_env("NEBULA_PREFIX_CACHE__DISK_MAX_GIB", "64");
            jail.set_env("NEBULA_PORT", "not-a-port");
            let err = ServerConfig::resolve(&ServeArgs::default()).unwrap_err().to_string();
            assert!(err.contains("`NEBULA_PORT`"), "the variable is named as it is set: {err}");
            jail.set_env("NEBULA_PORT", "9100");
            jail.create_file("nebula.toml", "prot = 1\n")?;
            let err = ServerConfig::resolve(&ServeArgs::default()).unwrap_err().to_string();
            assert!(err.contains("prot"), "{err}");
            // Keys are named as written in the file, without figment's profile prefix.
            jail.create_file("nebula.toml", "[placement]\nthreads = \"many\"\n")?;
            let err = ServerConfig::resolve(&ServeArgs::default()).unwrap_err().to_string();
            assert!(err.contains("for key `placement.threads`") && !err.contains("default."), "{err}");
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail closure returns figment::Error.
    fn the_profile_sets_placement_defaults_that_config_env_and_flags_override() {
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "p.toml",
                "name = \"8gb-vram-32gb-ram\"\nvram_gb = 8\nram_gb = 32\nthreads = 6\nngram_table = \"ssd\"\n\
                 experts_per_layer = 512\n[[placement]]\ntier = \"gpu\"\nexperts_per_layer = 11\n\
                 [[placement]]\ntier = \"ram\"\nexperts_per_layer = 141\ngpu_copies = 11\n",
            )?;
            let args = ServeArgs { profile: Some("p.toml".into()), ..Default::default() };
            let c = ServerConfig::resolve(&args).unwrap();
            let p = &c.placement;
            assert_eq!((p.gpu_experts, p.ram_experts, p.threads), (Some(11), Some(152), Some(6)));
            assert_eq!((p.vram_budget_gib, p.ram_budget_gib), (Some(8.0), Some(32.0)));
            assert_eq!(p.ngram_table, Some(nebula_engine::placement::TablePlacement::Ssd));
            jail.create_file("nebula.toml", "[placement]\nram_experts = 200\n")?;
            jail.set_env("NEBULA_PLACEMENT__THREADS", "3");
            let mut args = args;
            args.placement.ram_budget_gib = Some(64.0);
            let c = ServerConfig::resolve(&args).unwrap();
            assert_eq!((c.placement.ram_experts, c.placement.threads), (Some(200), Some(3)));
            assert_eq!((c.placement.ram_budget_gib, c.placement.gpu_experts), (Some(64.0), Some(11)));
            jail.create_file("nebula.toml", "[placement]\nram_experts = 5\n")?;
            let err = ServerConfig::resolve(&args).unwrap_err().to_string();
            assert!(err.contains("placement.ram_experts"), "{err}");
            Ok(())
        });
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail closure returns figment::Error.
    fn the_tuning_table_is_read_and_the_engine_variables_override_it() {
        use nebula_engine::tuning::{CudaFusions, CudaProfile};
        figment::Jail::expect_with(|jail| {
            jail.create_file(
                "nebula.toml",
                "[tuning.cuda]\ngraphs = false\ngemv_depth = 4\nprofile = \"kernels\"\n[tuning.cuda.fuse]\nqkvz = false\n\
                 [tuning.cuda.hybrid]\nstages = 3\n[tuning.cpu]\nisa = \"avx2\"\nmoe_rows = [16, 48]\n",
            )?;
            let c = ServerConfig::resolve(&ServeArgs::default()).unwrap();
            let t = &c.tuning;
            assert!(!t.cuda.graphs && t.cuda.gemv_depth == 4 && t.cuda.profile == CudaProfile::Kernels);
            assert_eq!(t.cuda.fuse, CudaFusions { shared: true, qkvz: false, gates: true });
            assert_eq!((t.cuda.hybrid.stages, t.cuda.hybrid.stage_experts), (3, 32));
            assert_eq!((t.cpu.isa, t.cpu.moe_rows), (Some(nebula_engine::quant::Isa::Avx2), (16, 48)));
            // The engine's own variables win over the table; the nested form works as for every key.
            jail.set_env("NEBULA_CUDA_GRAPHS", "1");
            jail.set_env("NEBULA_CUDA_GEMV_DEPTH", "2");
            jail.set_env("NEBULA_TUNING__CUDA__HYBRID__STAGES", "5");
            let c = ServerConfig::resolve(&ServeArgs::default()).unwrap();
            assert!(c.tuning.cuda.graphs && c.tuning.cuda.gemv_depth == 2 && c.tuning.cuda.hybrid.stages == 5);
            // Bad values are refused naming the key or the variable.
            jail.set_env("NEBULA_CUDA_FUSE", "shared,router");
            let e = ServerConfig::resolve(&ServeArgs::default()).unwrap_err().to_string();
            assert!(e.contains("NEBULA_CUDA_FUSE") && e.contains("router"), "{e}");
            jail.set_env("NEBULA_CUDA_FUSE", "0");
            jail.create_file("nebula.toml", "[tuning.cuda.hybrid]\nstages = 1\n")?;
            jail.set_env("NEBULA_TUNING__CUDA__HYBRID__STAGES", "1");
            let e = ServerConfig::resolve(&ServeArgs::default()).unwrap_err().to_string();
            assert!(e.contains("tuning.cuda.hybrid.stages"), "{e}");
            jail.create_file("nebula.toml", "[tuning.cuda]\nfast = true\n")?;
            let e = ServerConfig::resolve(&ServeArgs::default()).unwrap_err().to_string();
            assert!(e.contains("fast"), "{e}");
            Ok(())
        });
    }

    #[test]
    fn defaults_are_loopback_and_closed_cors() {
        let c = ServerConfig::default();
        assert_eq!(c.host, IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert!(c.cors_allow_origins.is_empty() && c.api_key.is_none());
    }
}
