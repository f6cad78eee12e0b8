//! Nebula's HTTP service: the OpenAI-compatible API in front of the engine.
//!
//! Data flows one way: [`extract`] parses a request body into the [`openai`] types (the Responses and Messages
//! APIs' bodies, [`responses`] and [`anthropic`], are first rebuilt as chat requests by [`conversation`]), [`chat`] checks it and turns
//! it into an engine request (template, [`prompt`] encoding, limits, sampling defaults, a [`constraint`]
//! grammar), [`generation`] follows the engine's events and turns generated ids into reasoning, answer and
//! tool-call pieces, and [`stream`] (SSE) or the handlers in [`routes`] write them in OpenAI's shapes ([`blocks`]
//! groups them into the typed output blocks of the Responses and Messages APIs; [`seal`] seals returned reasoning). The server
//! never touches tensors: the engine runs on its own thread behind a bounded queue.
//!
//! [`start`] binds first and loads the model on a blocking thread, so `/health` answers 503 with the loading
//! phase while it loads; a model that fails to load stops the server with [`ServeError::Load`]. [`serve`] is
//! `nebula serve`: it adds the runtime and the SIGINT/SIGTERM handling (open requests drain for
//! `shutdown_grace_s`). [`config`] resolves the settings (file, environment, flags), [`layers`] holds the tower
//! middleware, [`metrics`] the Prometheus families, [`telemetry`] the logs and OTLP traces, [`openapi`] the
//! generated document.

#![warn(missing_docs)]

pub mod anthropic;
pub mod blocks;
pub mod chat;
pub mod cli;
pub mod config;
pub mod constraint;
pub mod conversation;
pub mod error;
pub mod extract;
pub mod generation;
pub mod kv;
pub mod layers;
pub mod metrics;
pub mod openai;
pub mod openapi;
pub mod placement;
pub mod profile;
pub mod prompt;
pub mod responses;
pub mod routes;
pub mod seal;
pub mod state;
pub mod stream;
pub mod telemetry;
pub mod vision;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::Request;
use axum::middleware::from_fn_with_state;
use axum::routing::{get, post};
use tokio::sync::watch;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnFailure, DefaultOnResponse, TraceLayer};
use tracing::Level;

pub use crate::config::{ModelSource, ServeArgs, ServerConfig};
pub use crate::error::{ApiError, LoadFailed, ServeError};
use crate::state::{AppState, LoadState, ServedModel, load_model};

/// The API's routes and layers, over `state` (layers: see [`layers`]).
pub fn router(state: Arc<AppState>) -> Router {
    let generation = Router::new()
        .route("/v1/chat/completions", post(routes::chat::chat_completions))
        .route("/v1/completions", post(routes::completions::completions))
        .route("/v1/responses", post(routes::responses::create_response))
        .route("/v1/messages", post(routes::messages::create_message))
        .route_layer(from_fn_with_state(state.clone(), layers::limit_and_time));
    let mut app = Router::new()
        .route("/health", get(routes::health::health))
        .route("/v1/models", get(routes::models::list_models))
        .route("/v1/models/{*model}", get(routes::models::retrieve_model))
        .route("/v1/placement", get(routes::placement::placement))
        .route("/metrics", get(metrics::metrics))
        .route("/openapi.json", get(openapi::openapi_json))
        .route("/v1/messages/count_tokens", post(routes::messages::count_tokens))
        .route("/tokenize", post(routes::tokenize::tokenize))
        .route("/detokenize", post(routes::tokenize::detokenize))
        .merge(generation)
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(from_fn_with_state(state.clone(), layers::require_api_key))
        .layer(axum::middleware::from_fn(routes::messages::anthropic_errors))
        .layer(DefaultBodyLimit::max(state.config.body_limit_bytes));
    if let Some(cors) = layers::cors(&state.config.cors_allow_origins) {
        app = app.layer(cors);
    }
    app.layer(
        TraceLayer::new_for_http()
            .make_span_with(|req: &Request<_>| {
                let id = req.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("");
                tracing::info_span!("request", method = %req.method(), uri = %req.uri(), request_id = %id)
            })
            .on_response(DefaultOnResponse::new().level(Level::INFO))
            // Error statuses are already in the response line; 503 while loading is expected.
            .on_failure(DefaultOnFailure::new().level(Level::DEBUG)),
    )
    .layer(PropagateRequestIdLayer::x_request_id())
    .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
    .with_state(state)
}

/// How long, past the shutdown grace period, open responses get to send their final error event and `[DONE]`
/// before the connections are dropped.
const CUT_OFF_FLUSH: std::time::Duration = std::time::Duration::from_secs(5);

/// A running server: its address, a way to stop it, and its outcome.
#[derive(Debug)]
pub struct ServerHandle {
    addr: SocketAddr,
    state: Arc<AppState>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), ServeError>>,
}

impl ServerHandle {
    /// The address the server listens on (the chosen port when the config asked for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://{addr}`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Asks the server to stop: it stops accepting connections, lets open requests finish for at most the
    /// configured grace period, then [`ServerHandle::wait`] returns.
    pub fn shutdown(&self) {
        self.stop.send_replace(true);
    }

    /// A function that stops the server, for signal handlers and other tasks.
    pub fn stopper(&self) -> impl Fn() + Send + Sync + 'static {
        let stop = self.stop.clone();
        move || {
            stop.send_replace(true);
        }
    }

    /// Waits until the model is loaded and returns it. Errors: [`LoadFailed`] with the load error's message (the
    /// error itself comes from [`ServerHandle::wait`]).
    pub async fn ready(&self) -> Result<Arc<ServedModel>, LoadFailed> {
        let mut load = self.state.load.subscribe();
        let state = load
            .wait_for(|s| !matches!(s, LoadState::Loading(_)))
            .await
            .map_err(|e| LoadFailed(e.to_string()))?
            .clone();
        match state {
            LoadState::Ready(model) => Ok(model),
            LoadState::Failed(message) => Err(LoadFailed(message.to_string())),
            LoadState::Loading(_) => Err(LoadFailed("still loading".into())),
        }
    }

    /// Waits until the server has stopped. Errors: [`ServeError::Load`] when the model failed to load, or an I/O
    /// error of the listener.
    pub async fn wait(self) -> Result<(), ServeError> {
        match self.task.await {
            Ok(result) => result,
            Err(e) => Err(ServeError::Io(std::io::Error::other(format!("the server task failed: {e}")))),
        }
    }
}

/// Binds `config.host:config.port`, starts serving, and loads the model in the background.
///
/// Errors: [`ServeError::Bind`] when the address cannot be bound. Load errors arrive later, through
/// [`ServerHandle::wait`] (and [`ServerHandle::ready`]).
pub async fn start(config: ServerConfig) -> Result<ServerHandle, ServeError> {
    let wanted = SocketAddr::new(config.host, config.port);
    let listener =
        tokio::net::TcpListener::bind(wanted).await.map_err(|source| ServeError::Bind { addr: wanted, source })?;
    let addr = listener.local_addr()?;
    let grace = config.shutdown_grace();
    let state = Arc::new(AppState::new(config)?);
    let (stop, _) = watch::channel(false);
    let load_error: Arc<Mutex<Option<ServeError>>> = Arc::default();

    // Load on a blocking thread; a failure stops the server and becomes its outcome.
    {
        let state = state.clone();
        let stop = stop.clone();
        let load_error = load_error.clone();
        tokio::task::spawn_blocking(move || match load_model(&state) {
            Ok(model) => {
                state.load.send_replace(LoadState::Ready(Arc::new(model)));
            }
            Err(err) => {
                tracing::error!("{err}");
                state.load.send_replace(LoadState::Failed(err.to_string().into()));
                if let Ok(mut slot) = load_error.lock() {
                    *slot = Some(err);
                }
                stop.send_replace(true);
            }
        });
    }

    let app = router(state.clone());
    let mut graceful = stop.subscribe();
    let mut deadline = stop.subscribe();
    let cut_state = state.clone();
    let task = tokio::spawn(async move {
        let server = axum::serve(listener, app).with_graceful_shutdown(async move {
            let _ = graceful.wait_for(|stopped| *stopped).await;
        });
        let server = std::future::IntoFuture::into_future(server);
        tokio::pin!(server);
        let forced = async move {
            let _ = deadline.wait_for(|stopped| *stopped).await;
            tokio::time::sleep(grace).await;
        };
        tokio::select! {
            result = &mut server => result?,
            () = forced => {
                // Past the grace period: every open generation ends with an error (an error event and `[DONE]`
                // in a stream) and waiting requests get 503; then the connections close as their responses end.
                tracing::warn!(seconds = grace.as_secs_f64(), "open requests outlived the shutdown grace period; ending them");
                cut_state.cut_off.send_replace(true);
                match tokio::time::timeout(CUT_OFF_FLUSH, &mut server).await {
                    Ok(result) => result?,
                    Err(_) => tracing::warn!("connections still open after the cut-off; closing them"),
                }
            }
        }
        match load_error.lock().ok().and_then(|mut slot| slot.take()) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    });
    Ok(ServerHandle { addr, state, stop, task })
}

/// `nebula serve`: runs the server until SIGINT or SIGTERM, or until the model fails to load.
///
/// Errors: the address cannot be bound, the model cannot be loaded (the message names the file and the problem),
/// or the runtime fails.
pub fn serve(config: ServerConfig) -> Result<(), ServeError> {
    let _telemetry = telemetry::init(&config)?;
    if let Some(threads) = config.placement.threads {
        // Emulation and tuning: the compute pool's size, set before anything uses it.
        match rayon::ThreadPoolBuilder::new().num_threads(threads).build_global() {
            Ok(()) => tracing::info!(threads, "compute threads"),
            Err(e) => tracing::warn!(threads, "cannot set the compute threads: {e}"),
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let model = config.model.label();
        let handle = start(config).await?;
        tracing::info!(addr = %handle.addr(), %model, "listening; loading the model");
        let stop = handle.stopper();
        let state = handle.state.clone();
        tokio::spawn(async move {
            shutdown_signal().await;
            tracing::info!(
                in_flight = state.limit.in_flight(),
                grace_s = state.config.shutdown_grace_s,
                "shutting down: no new connections; open requests drain"
            );
            stop();
        });
        handle.wait().await
    })
}

/// Resolves on SIGINT (Ctrl-C) or, on Unix, SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}
