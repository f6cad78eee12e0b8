//! `GET /v1/models`: the one served model with its context limit.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;

use crate::error::ApiError;
use crate::openai::{ModelCard, ModelList};
use crate::state::AppState;

/// Lists the served model (503 while it loads).
pub async fn list_models(State(state): State<Arc<AppState>>) -> Result<Json<ModelList>, ApiError> {
    let model = state.model()?;
    Ok(Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: model.id.clone(),
            object: "model",
            created: model.created,
            owned_by: "nebula",
            max_model_len: model.engine.max_context(),
        }],
    }))
}
