//! Nebula's HTTP service: the OpenAI-compatible API in front of the engine.
//!
//! Data flows one way: [`extract`] parses a request body into the [`openai`] types, [`chat`] checks it and turns
//! it into an engine request (template, tokenizer, limits, sampling defaults), [`generation`] follows the engine's
//! events and turns generated ids into reasoning, answer and tool-call pieces, and [`stream`] (SSE) or the
//! handler in [`routes::chat`] writes them in OpenAI's shapes. The server never touches tensors: the engine runs
//! on its own thread behind a bounded queue.
//!
//! [`start`] binds first and loads the model on a blocking thread, so `/health` answers 503 while it loads; a
//! model that fails to load stops the server with [`ServeError::Load`]. [`serve`] is `nebula serve`: it adds the
//! runtime and the SIGINT/SIGTERM handling.

#![warn(missing_docs)]

pub mod chat;
pub mod cli;
pub mod config;
pub mod error;
pub mod extract;
pub mod generation;
pub mod openai;
pub mod profile;
pub mod routes;
pub mod state;
pub mod stream;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use tokio::sync::watch;
use tower_http::trace::{DefaultMakeSpan, DefaultOnFailure, DefaultOnResponse, TraceLayer};
use tracing::Level;

pub use crate::config::{ModelSource, ServeArgs, ServerConfig};
pub use crate::error::{ApiError, LoadFailed, ServeError};
use crate::state::{AppState, LoadState, ServedModel, load_model};

/// Largest request body accepted (a full 256k-token conversation fits).
pub const MAX_BODY_BYTES: usize = 32 << 20;

/// The API's routes and layers, over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(routes::health::health))
        .route("/v1/models", get(routes::models::list_models))
        .route("/v1/chat/completions", post(routes::chat::chat_completions))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(DefaultMakeSpan::new().level(Level::INFO))
                .on_response(DefaultOnResponse::new().level(Level::INFO))
                // Error statuses are already in the response line; 503 while loading is expected.
                .on_failure(DefaultOnFailure::new().level(Level::DEBUG)),
        )
        .with_state(state)
}

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
        let state =
            load.wait_for(|s| !matches!(s, LoadState::Loading)).await.map_err(|e| LoadFailed(e.to_string()))?.clone();
        match state {
            LoadState::Ready(model) => Ok(model),
            LoadState::Failed(message) => Err(LoadFailed(message.to_string())),
            LoadState::Loading => Err(LoadFailed("still loading".into())),
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
    let grace = config.shutdown_grace;
    let state = Arc::new(AppState::new(config));
    let (stop, _) = watch::channel(false);
    let load_error: Arc<Mutex<Option<ServeError>>> = Arc::default();

    // Load on a blocking thread; a failure stops the server and becomes its outcome.
    {
        let state = state.clone();
        let stop = stop.clone();
        let load_error = load_error.clone();
        tokio::task::spawn_blocking(move || match load_model(&state.config) {
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
    let task = tokio::spawn(async move {
        let server = axum::serve(listener, app).with_graceful_shutdown(async move {
            let _ = graceful.wait_for(|stopped| *stopped).await;
        });
        let forced = async move {
            let _ = deadline.wait_for(|stopped| *stopped).await;
            tokio::time::sleep(grace).await;
        };
        tokio::select! {
            result = server => result?,
            () = forced => tracing::warn!(seconds = grace.as_secs_f64(), "open requests outlived the shutdown grace period"),
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
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let model = config.model.label();
        let handle = start(config).await?;
        tracing::info!(addr = %handle.addr(), %model, "listening; loading the model");
        let stop = handle.stopper();
        tokio::spawn(async move {
            shutdown_signal().await;
            tracing::info!("shutting down");
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
