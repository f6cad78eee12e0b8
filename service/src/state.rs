//! Shared state of the server: its config and the model once it is loaded. Handlers get it as
//! `State<Arc<AppState>>`.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use nebula_engine::text::chat_template::{ChatTemplate, QWEN38_CHAT_TEMPLATE};
use nebula_engine::worker::{Engine, EngineOptions};
use tokio::sync::watch;

use crate::config::{EMBEDDED_DEMO_MODEL, ModelSource, ServerConfig};
use crate::error::{ApiError, ServeError};

/// A loaded model as the API serves it.
#[derive(Debug)]
pub struct ServedModel {
    /// The engine (worker thread, tokenizer, limits).
    pub engine: Engine,
    /// The id requests name in `model`.
    pub id: String,
    /// Unix time the model finished loading, seconds.
    pub created: u64,
    /// The chat template: the model's own, else the official Qwen3.8 one.
    pub template: Arc<ChatTemplate>,
}

/// Where model loading stands.
#[derive(Debug, Clone)]
pub enum LoadState {
    /// The model is being read and validated.
    Loading,
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
}

impl AppState {
    /// State for `config`, with the model still loading.
    pub fn new(config: ServerConfig) -> Self {
        Self { config, load: watch::Sender::new(LoadState::Loading) }
    }

    /// The served model, or the error a request gets while there is none.
    pub fn model(&self) -> Result<Arc<ServedModel>, ApiError> {
        match &*self.load.borrow() {
            LoadState::Ready(model) => Ok(model.clone()),
            LoadState::Loading => Err(ApiError::Loading { phase: "loading the model" }),
            LoadState::Failed(_) => Err(ApiError::Internal("the model failed to load; the server is stopping".into())),
        }
    }
}

/// Loads the configured model (blocking: reads and validates every tensor, starts the engine thread).
///
/// Errors: [`ServeError::Load`] naming the file and the problem.
pub fn load_model(config: &ServerConfig) -> Result<ServedModel, ServeError> {
    let started = Instant::now();
    let label = config.model.label();
    let opts = EngineOptions { max_context: Some(config.engine_max_context()), queue_capacity: config.queue_capacity };
    let engine = match &config.model {
        ModelSource::EmbeddedDemo => Engine::from_gguf_bytes(&label, EMBEDDED_DEMO_MODEL.to_vec(), opts),
        ModelSource::File(path) => Engine::load(path, opts),
    }
    .map_err(|source| ServeError::Load { model: label.clone(), error: Box::new(source) })?;
    let template = match engine.chat_template() {
        Some(t) => t.clone(),
        None => {
            tracing::warn!(model = %label, "the model file has no chat template; using the official Qwen3.8 one");
            Arc::new(ChatTemplate::new(QWEN38_CHAT_TEMPLATE).map_err(|e| ServeError::Template(e.to_string()))?)
        }
    };
    let id = config.model_id.clone().unwrap_or_else(|| engine.name().to_owned());
    tracing::info!(
        model = %label,
        id = %id,
        max_context = engine.max_context(),
        trained_context = engine.config().context_length,
        seconds = format_args!("{:.2}", started.elapsed().as_secs_f64()),
        "model loaded"
    );
    Ok(ServedModel { engine, id, created: unix_now(), template })
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
