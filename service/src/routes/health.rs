//! `GET /health`: 200 `{"status": "ok"}` once the model is ready, 503 `{"status": "loading", "phase": ...}`
//! before, 503 `{"status": "failed", "message": ...}` when loading failed (the server then stops).

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Serialize;
use utoipa::ToSchema;

use crate::state::{AppState, LoadState};

/// Body of `GET /health`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Health {
    /// `ok`, `loading` or `failed`.
    pub status: &'static str,
    /// While loading: what the server is doing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase: Option<&'static str>,
    /// After a failed load: why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Readiness of the server.
#[utoipa::path(get, path = "/health", tag = "observability",
    responses((status = 200, description = "Ready", body = Health),
              (status = 503, description = "Loading (with its phase) or failed", body = Health)))]
pub async fn health(State(state): State<Arc<AppState>>) -> (StatusCode, Json<Health>) {
    let (code, health) = match &*state.load.borrow() {
        LoadState::Ready(_) => (StatusCode::OK, Health { status: "ok", phase: None, message: None }),
        LoadState::Loading(phase) => {
            (StatusCode::SERVICE_UNAVAILABLE, Health { status: "loading", phase: Some(phase), message: None })
        }
        LoadState::Failed(message) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Health { status: "failed", phase: None, message: Some(message.to_string()) },
        ),
    };
    (code, Json(health))
}
