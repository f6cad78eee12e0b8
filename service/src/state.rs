//! Shared state of the server: its config, metrics, the hardware profile, and the model once it is loaded.
//! Handlers get it as `State<Arc<AppState>>`.

use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use nebula_engine::prefix_cache::PrefixCacheOptions;
use nebula_engine::text::chat_template::{ChatTemplate, QWEN38_CHAT_TEMPLATE};
use nebula_engine::worker::{Engine, EngineOptions, PREFILL_CHUNK};
use serde_json::Value;
use tokio::sync::watch;

use crate::config::{EMBEDDED_DEMO_MODEL, ModelSource, ServerConfig};
use crate::constraint::GrammarCompiler;
use crate::error::{ApiError, ServeError};
use crate::layers::ConcurrencyLimit;
use crate::metrics::Metrics;
use crate::prompt::added_tokens;

/// A loaded model as the API serves it.
#[derive(Debug)]
pub struct ServedModel {
    /// The engine (worker thread, tokenizer, limits).
    pub engine: Engine,
    /// The id requests name in `model`.
    pub id: String,
    /// More names it answers to (`model_aliases`).
    pub aliases: Vec<String>,
    /// Answer to any model name (`serve_any_model`).
    pub serve_any_model: bool,
    /// Unix time the model finished loading, seconds.
    pub created: u64,
    /// The chat template: the model's own, else the official Qwen3.8 one.
    pub template: Arc<ChatTemplate>,
    /// Added-token spellings and ids, longest first (for encoding client text as plain text).
    pub specials: Vec<(String, u32)>,
    /// Prompt tokens per prefill chunk.
    pub max_prefill: usize,
    /// The vision tower, when one is loaded (`vision.mmproj`, or the demo's own).
    pub vision: Option<Arc<nebula_engine::vision::VisionModel>>,
    /// The same tower on the GPU, which encodes the images when the backend is `cuda` (`None`: the CPU tower
    /// does).
    pub vision_gpu: Option<Arc<nebula_engine::backend::cuda::CudaVisionModel>>,
    /// `[vision]` settings (URL rules, pixel bounds, limits).
    pub vision_config: crate::config::VisionConfig,
    /// The grammar compiler, built at the first constrained request.
    grammar: OnceLock<Result<GrammarCompiler, String>>,
    /// Turns true when the shutdown grace period ends (see [`AppState::cut_off`]).
    cut_off: watch::Receiver<bool>,
}

impl ServedModel {
    /// Whether a request for model `requested` is served by this model: its id, one of its aliases, or any name
    /// with `serve_any_model`.
    pub fn answers_to(&self, requested: &str) -> bool {
        self.serve_any_model || requested == self.id || self.aliases.iter().any(|a| a == requested)
    }

    /// Checks a request's `model` (absent: the served one). Errors: [`ApiError::ModelNotFound`].
    pub fn check_name(&self, requested: Option<&str>) -> Result<(), ApiError> {
        match requested {
            Some(name) if !self.answers_to(name) => {
                Err(ApiError::ModelNotFound { requested: name.to_owned(), served: self.id.clone() })
            }
            _ => Ok(()),
        }
    }

    /// The grammar compiler of this model (built on first use: a token trie over the whole vocabulary).
    ///
    /// Errors: 500 when llguidance refuses the vocabulary.
    pub fn grammar(&self) -> Result<&GrammarCompiler, ApiError> {
        let compiler = self.grammar.get_or_init(|| {
            let end_of_turn = self.engine.stop_tokens().first().copied().unwrap_or(0);
            GrammarCompiler::new(self.engine.tokenizer().clone(), self.engine.config().vocab, end_of_turn)
        });
        compiler.as_ref().map_err(|e| ApiError::Internal(format!("constrained decoding is unavailable: {e}")))
    }

    /// A receiver that turns true when the server's shutdown grace period ends: generations still running then
    /// end with [`SHUTDOWN_MESSAGE`].
    pub fn cut_off(&self) -> watch::Receiver<bool> {
        self.cut_off.clone()
    }
}

/// What a generation still running when the shutdown grace period ends reports (an error event in a stream, a
/// 503 otherwise).
pub const SHUTDOWN_MESSAGE: &str = "the server is shutting down and its grace period for open requests has ended";

/// Where model loading stands.
#[derive(Debug, Clone)]
pub enum LoadState {
    /// The model is being loaded; the phase says what the server is doing.
    Loading(&'static str),
    /// The model is ready to serve.
    Ready(Arc<ServedModel>),
    /// Loading failed; the server is shutting down. The message names the file and the problem.
    Failed(Arc<str>),
}

/// State shared by every handler.
#[derive(Debug)]
pub struct AppState {
    /// The settings the server runs with.
    pub config: ServerConfig,
    /// The model's load state; watchers wake when it changes.
    pub load: watch::Sender<LoadState>,
    /// Prometheus metrics.
    pub metrics: Arc<Metrics>,
    /// The hardware profile file's content, when one is configured.
    pub profile: Option<Value>,
    /// The concurrency limit of the generation routes.
    pub limit: ConcurrencyLimit,
    /// Set to true when the shutdown grace period (`shutdown_grace_s`) ends: open generations end with an error
    /// (an error event and `[DONE]` in a stream), requests still waiting get 503.
    pub cut_off: watch::Sender<bool>,
    /// Seals reasoning returned to clients so that replayed history can be read back.
    pub seal: crate::seal::ReasoningSeal,
}

impl AppState {
    /// State for `config`, with the model still loading.
    ///
    /// Errors: the configured profile file cannot be read or parsed.
    pub fn new(config: ServerConfig) -> Result<Self, ServeError> {
        let profile = match &config.profile {
            None => None,
            Some(path) => Some(read_profile(path)?),
        };
        let limit = ConcurrencyLimit::new(config.max_concurrent_requests, config.max_waiting_requests);
        let seal = match &config.reasoning_seal_key {
            Some(key) => crate::seal::ReasoningSeal::from_hex(key)
                .map_err(|e| ServeError::Config(crate::config::ConfigError(format!("reasoning_seal_key: {e}"))))?,
            None => crate::seal::ReasoningSeal::random(),
        };
        Ok(Self {
            seal,
            config,
            load: watch::Sender::new(LoadState::Loading("starting")),
            metrics: Arc::new(Metrics::new()),
            profile,
            limit,
            cut_off: watch::Sender::new(false),
        })
    }

    /// Whether the shutdown grace period has ended (see [`AppState::cut_off`]).
    pub fn is_cut_off(&self) -> bool {
        *self.cut_off.borrow()
    }

    /// The served model, or the error a request gets while there is none.
    pub fn model(&self) -> Result<Arc<ServedModel>, ApiError> {
        match &*self.load.borrow() {
            LoadState::Ready(model) => Ok(model.clone()),
            LoadState::Loading(phase) => Err(ApiError::Loading { phase }),
            LoadState::Failed(_) => Err(ApiError::Internal("the model failed to load; the server is stopping".into())),
        }
    }

    /// A limit of the profile (`max_context`, `max_prefill`), if it has one.
    pub fn profile_limit(&self, key: &str) -> Option<usize> {
        self.profile.as_ref()?.get(key)?.as_u64().map(|v| usize::try_from(v).unwrap_or(usize::MAX))
    }
}

/// The engine's batching limits: the config's `[batching]`, else the profile's, else the defaults.
fn batch_options(config: &crate::config::ServerConfig, state: &AppState) -> nebula_engine::worker::BatchOptions {
    let b = &config.batching;
    let d = nebula_engine::worker::BatchOptions::default();
    nebula_engine::worker::BatchOptions {
        max_sequences: b.max_sequences.or(state.profile_limit("max_sequences")).unwrap_or(d.max_sequences).max(1),
        max_batch_tokens: b.max_batch_tokens.or(state.profile_limit("max_batch_tokens")),
        state_budget: b.state_budget_mib.or(state.profile_limit("state_budget_mib")).map(|m| m.saturating_mul(1 << 20)),
        speculative_max_batch: b.speculative_max_batch,
        mode: if b.deterministic {
            nebula_engine::backend::BatchMode::Deterministic
        } else {
            nebula_engine::backend::BatchMode::Fast
        },
    }
}

/// Reads a profile file (TOML, as `nebula profile detect` writes it) as JSON.
///
/// Errors: [`ServeError::Profile`] naming the file.
pub fn read_profile(path: &std::path::Path) -> Result<Value, ServeError> {
    let error = |detail: String| ServeError::Profile { path: path.display().to_string(), detail };
    let text = std::fs::read_to_string(path).map_err(|e| error(e.to_string()))?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| error(e.to_string()))?;
    serde_json::to_value(table).map_err(|e| error(e.to_string()))
}

/// Loads the configured model (blocking: reads and validates every tensor, starts the engine thread), reporting
/// its phase through `state.load`.
///
/// Errors: [`ServeError::Load`] naming the file and the problem.
pub fn load_model(state: &AppState) -> Result<ServedModel, ServeError> {
    let config = &state.config;
    let started = Instant::now();
    let label = config.model.label();
    let max_context = config.max_context.or(state.profile_limit("max_context")).unwrap_or(config.engine_max_context());
    let max_prefill = config.max_prefill.or(state.profile_limit("max_prefill")).unwrap_or(PREFILL_CHUNK).max(1);
    let source = match &config.profile {
        Some(p) => format!("profile {} with the config's overrides", p.display()),
        None => "the config".to_owned(),
    };
    let mut placement_config = config.placement.clone();
    if let Some(profile) = &state.profile {
        placement_config.fill_from_profile(profile);
    }
    if config.batching.deterministic && placement_config.gpu_cache != nebula_engine::placement::GpuCachePolicy::Static {
        // A request's tokens must not depend on what ran before it: where an expert runs (GPU or CPU kernel)
        // changes its last bits, so the GPU tier stays the placement's.
        tracing::info!("placement.gpu_cache: static (batching.deterministic keeps a static placement)");
        placement_config.gpu_cache = nebula_engine::placement::GpuCachePolicy::Static;
    }
    let mut placement = placement_config
        .to_options(&source)
        .map_err(|e| ServeError::Config(crate::config::ConfigError(format!("placement.hotlist: {e}"))))?;
    // The vision tower, read before the model: on the cuda backend it goes to the GPU first, and the VRAM it
    // takes (weights and the activations of the largest image, `vision.max_pixels`) leaves the model's budget.
    let tower = read_vision(config)?;
    let vision_gpu = match &tower {
        Some((label, t)) if config.backend == "cuda" => gpu_vision(config, label, t),
        _ => None,
    };
    let mut vram_budget = config.placement.vram_budget_gib.map(|g| (g * (1u64 << 30) as f64) as u64);
    if let Some(g) = &vision_gpu {
        let taken = g.device_bytes() as u64;
        if let Some(p) = placement.as_mut() {
            p.vram_budget = p.vram_budget.map(|b| b.saturating_sub(taken));
        }
        vram_budget = vram_budget.map(|b| b.saturating_sub(taken));
    }
    // The KV cache: the config's (flag, file, NEBULA_KV_*) over the profile's over f32 and no window.
    let (profile_kv, profile_window) = match &state.profile {
        Some(p) => crate::kv::from_profile(p).map_err(|e| ServeError::Config(crate::config::ConfigError(e)))?,
        None => (None, None),
    };
    let kv_cache = config.kv_cache_type.or(profile_kv).unwrap_or_default();
    let mut cuda_tuning = config.tuning.cuda.clone();
    if let Some(w) = config.kv_window.or(profile_window) {
        cuda_tuning.kv_window = w;
    }
    if config.backend == "cuda" {
        crate::kv::check_window(cuda_tuning.kv_window, max_prefill)
            .map_err(|e| ServeError::Config(crate::config::ConfigError(e)))?;
    }
    let opts = EngineOptions {
        max_context: Some(max_context),
        queue_capacity: config.queue_capacity,
        prefix_cache: PrefixCacheOptions {
            max_entries: config.prefix_cache.max_entries,
            max_bytes: config.prefix_cache.max_mib.saturating_mul(1 << 20),
            device_bytes: config
                .prefix_cache
                .device_mib
                .or_else(|| state.profile_limit("vram_gb").filter(|&g| g > 0).map(|g| g * 1024 / 16))
                .unwrap_or(1024)
                .saturating_mul(1 << 20),
            interval: config.prefix_cache.interval.max(1),
            disk_dir: config.prefix_cache.dir.clone(),
            disk_max_bytes: config.prefix_cache.disk_max_bytes(),
        },
        placement,
        mtp: config.mtp.enabled,
        kv_cache,
        backend: match config.backend.as_str() {
            "cpu" => nebula_engine::backend::BackendKind::Cpu,
            _ => nebula_engine::backend::BackendKind::Cuda { device: config.gpu, vram_budget },
        },
        cuda_tuning,
        batch: batch_options(config, state),
        step_observer: Some(state.metrics.step_observer()),
        realistic_routing: None,
    };
    // The CPU kernels' options are process-wide: in effect from here, before the model loads.
    if !nebula_engine::tuning::install_cpu(config.tuning.cpu.clone())
        && nebula_engine::tuning::cpu() != &config.tuning.cpu
    {
        tracing::warn!(
            "the CPU tuning was already in effect in this process; the config's [tuning.cpu] is not applied"
        );
    }
    state.load.send_replace(LoadState::Loading(if opts.placement.is_some() {
        "reading and validating the weights, placing the experts"
    } else {
        "reading and validating the weights"
    }));
    let engine = match &config.model {
        ModelSource::EmbeddedDemo => Engine::from_gguf_bytes(&label, EMBEDDED_DEMO_MODEL.to_vec(), opts),
        ModelSource::File(path) => Engine::load(path, opts),
    }
    .map_err(|source| ServeError::Load { model: label.clone(), error: Box::new(source) })?;
    state.load.send_replace(LoadState::Loading("preparing the tokenizer and chat template"));
    let template = match engine.chat_template() {
        Some(t) => t.clone(),
        None => {
            tracing::warn!(model = %label, "the model file has no chat template; using the official Qwen3.8 one");
            Arc::new(ChatTemplate::new(QWEN38_CHAT_TEMPLATE).map_err(|e| ServeError::Template(e.to_string()))?)
        }
    };
    if engine.placement().placed {
        tracing::info!("{}", engine.placement().summary());
    }
    let specials = added_tokens(engine.tokenizer());
    let vision = check_vision(tower, &engine, vision_gpu.is_some())?;
    let id = config.model_id.clone().unwrap_or_else(|| engine.name().to_owned());
    tracing::info!(
        model = %label,
        id = %id,
        max_context = engine.max_context(),
        kv_cache = %engine.config().kv_cache,
        max_prefill,
        trained_context = engine.config().context_length,
        seconds = format_args!("{:.2}", started.elapsed().as_secs_f64()),
        "model loaded"
    );
    Ok(ServedModel {
        engine,
        id,
        aliases: config.model_aliases.clone(),
        serve_any_model: config.serve_any_model,
        created: unix_now(),
        template,
        specials,
        max_prefill,
        vision,
        vision_gpu: vision_gpu.map(Arc::new),
        vision_config: config.vision.clone(),
        grammar: OnceLock::new(),
        cut_off: state.cut_off.subscribe(),
    })
}

/// The vision tower: `vision.mmproj`, else the embedded demo tower when the demo model is served, else none; with
/// the label logs and errors name it by.
///
/// Errors: [`ServeError::Load`] naming the mmproj file (unreadable, not a `qwen3vl_merger` tower, a tensor of
/// the wrong shape or type).
fn read_vision(config: &ServerConfig) -> Result<Option<(String, nebula_engine::vision::VisionModel)>, ServeError> {
    use nebula_engine::vision::VisionModel;
    let (label, tower) = match (&config.vision.mmproj, &config.model) {
        (Some(path), _) => (path.display().to_string(), VisionModel::load(path)),
        (None, ModelSource::EmbeddedDemo) if !crate::config::EMBEDDED_DEMO_MMPROJ.is_empty() => {
            let label = crate::config::EMBEDDED_DEMO_MMPROJ_LABEL.to_owned();
            let file = nebula_engine::gguf::GgufFile::from_bytes(&label, crate::config::EMBEDDED_DEMO_MMPROJ.to_vec())
                .map_err(nebula_engine::model::ModelError::from);
            (label, file.and_then(|f| VisionModel::from_gguf(Arc::new(f))))
        }
        _ => return Ok(None),
    };
    let tower = tower.map_err(|e| vision_load_error(&label, e))?;
    Ok(Some((label, tower)))
}

fn vision_load_error(label: &str, e: nebula_engine::model::ModelError) -> ServeError {
    ServeError::Load { model: label.to_owned(), error: Box::new(nebula_engine::worker::LoadError::Model(e)) }
}

/// The tower on GPU `gpu` for images of up to the configured `vision.max_pixels` (else the tower's own bound),
/// or `None` with a warning when it cannot go there (no GPU, its head width, device memory): the CPU tower then
/// encodes the images.
fn gpu_vision(
    config: &ServerConfig,
    label: &str,
    tower: &nebula_engine::vision::VisionModel,
) -> Option<nebula_engine::backend::cuda::CudaVisionModel> {
    let max_pixels = config.vision.max_pixels.unwrap_or(tower.config.max_pixels);
    match nebula_engine::backend::cuda::CudaVisionModel::new(tower, config.gpu, max_pixels) {
        Ok(g) => {
            tracing::info!(
                mmproj = %label,
                gpu = %g.gpu_name(),
                max_pixels,
                mib = format_args!("{:.1}", g.device_bytes() as f64 / (1 << 20) as f64),
                "vision tower on the GPU (its VRAM leaves the model's budget)"
            );
            Some(g)
        }
        Err(e) => {
            tracing::warn!(mmproj = %label, error = %e, "the vision tower stays on the CPU");
            None
        }
    }
}

/// Checks the tower read by [`read_vision`] against the loaded model: its output width must be the model's
/// hidden size.
///
/// Errors: [`ServeError::Load`] naming the mmproj file (another width than the model's).
fn check_vision(
    tower: Option<(String, nebula_engine::vision::VisionModel)>,
    engine: &Engine,
    on_gpu: bool,
) -> Result<Option<Arc<nebula_engine::vision::VisionModel>>, ServeError> {
    let Some((label, tower)) = tower else { return Ok(None) };
    let hidden = engine.config().hidden;
    if tower.config.out_hidden != hidden {
        return Err(vision_load_error(
            &label,
            nebula_engine::model::ModelError::Metadata {
                file: label.clone(),
                key: "clip.vision.projection_dim".into(),
                problem: format!(
                    "{}: the model's hidden size is {hidden} (a tower of another model?)",
                    tower.config.out_hidden
                ),
            },
        ));
    }
    if !engine.accepts_media() {
        tracing::warn!(mmproj = %label, "the vision tower is loaded, but this backend takes no image input: image parts get 400");
    }
    tracing::info!(
        mmproj = %label,
        blocks = tower.config.depth,
        width = tower.config.hidden,
        mib = format_args!("{:.1}", tower.weight_bytes() as f64 / (1 << 20) as f64),
        device = if on_gpu { "GPU" } else { "CPU" },
        "vision tower loaded"
    );
    Ok(Some(Arc::new(tower)))
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
