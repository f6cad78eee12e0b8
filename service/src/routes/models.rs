//! `GET /v1/models`: the one served model with its context limit, prefill chunk, modalities and the hardware
//! profile.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;

use crate::error::{ApiError, ErrorBody};
use crate::openai::{ModelCard, ModelList};
use crate::state::AppState;

/// Lists the served model (503 while it loads).
#[utoipa::path(get, path = "/v1/models", tag = "openai",
    responses((status = 200, description = "The served model", body = ModelList),
              (status = 401, description = "Missing or wrong API key", body = ErrorBody),
              (status = 503, description = "The model is loading", body = ErrorBody)))]
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
            max_prefill: model.max_prefill,
            input_modalities: vec!["text"],
            output_modalities: vec!["text"],
            profile: state.profile.clone(),
        }],
    }))
}
