//! `GET /health`: 200 `{"status": "ok"}` once the model is ready, 503 `{"status": "loading"}` before.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Serialize;

use crate::state::{AppState, LoadState};

/// Body of `GET /health`.
#[derive(Debug, Clone, Serialize)]
pub struct Health {
    /// `ok`, `loading` or `failed`.
    pub status: &'static str,
}

/// Readiness of the server.
pub async fn health(State(state): State<Arc<AppState>>) -> (StatusCode, Json<Health>) {
    let (code, status) = match &*state.load.borrow() {
        LoadState::Ready(_) => (StatusCode::OK, "ok"),
        LoadState::Loading => (StatusCode::SERVICE_UNAVAILABLE, "loading"),
        LoadState::Failed(_) => (StatusCode::SERVICE_UNAVAILABLE, "failed"),
    };
    (code, Json(Health { status }))
}
