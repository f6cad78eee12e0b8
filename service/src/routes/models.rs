//! `GET /v1/models`: the one served model (and a card per alias) with its context limit, prefill chunk, modalities and the hardware
//! profile.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};

use crate::error::{ApiError, ErrorBody};
use crate::openai::{ModelCard, ModelList};
use crate::state::{AppState, ServedModel};

/// Lists the served model (503 while it loads).
#[utoipa::path(get, path = "/v1/models", tag = "openai",
    responses((status = 200, description = "The served model", body = ModelList),
              (status = 401, description = "Missing or wrong API key", body = ErrorBody),
              (status = 503, description = "The model is loading", body = ErrorBody)))]
pub async fn list_models(State(state): State<Arc<AppState>>) -> Result<Json<ModelList>, ApiError> {
    let model = state.model()?;
    let mut data = vec![card(&state, &model)];
    for alias in &model.aliases {
        data.push(ModelCard { id: alias.clone(), ..card(&state, &model) });
    }
    Ok(Json(ModelList { object: "list", data }))
}

/// `GET /v1/models/{model}`: the served model's card, 404 for any other id.
#[utoipa::path(get, path = "/v1/models/{model}", tag = "openai",
    params(("model" = String, Path, description = "A model id")),
    responses((status = 200, description = "The served model", body = ModelCard),
              (status = 401, description = "Missing or wrong API key", body = ErrorBody),
              (status = 404, description = "Not the served model", body = ErrorBody),
              (status = 503, description = "The model is loading", body = ErrorBody)))]
pub async fn retrieve_model(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    let model = state.model()?;
    if !model.answers_to(&id) {
        return Err(ApiError::ModelNotFound { requested: id, served: model.id.clone() });
    }
    Ok(Json(ModelCard { id, ..card(&state, &model) }))
}

fn card(state: &AppState, model: &ServedModel) -> ModelCard {
    ModelCard {
        id: model.id.clone(),
        object: "model",
        created: model.created,
        owned_by: "nebula",
        max_model_len: model.engine.max_context(),
        max_prefill: model.max_prefill,
        // Images when a tower is loaded and the backend takes them.
        input_modalities: if model.vision.is_some() && model.engine.accepts_media() {
            vec!["text", "image"]
        } else {
            vec!["text"]
        },
        output_modalities: vec!["text"],
        profile: state.profile.clone().map(with_placement).map(with_actual_placement(model)),
    }
}

/// Adds `placement_report` (the `/v1/placement` URL) and `placement_actual` (experts per tier, summed over the
/// layers, and the n-gram table's place, as built) to the profile object.
fn with_actual_placement(model: &ServedModel) -> impl FnOnce(serde_json::Value) -> serde_json::Value + '_ {
    move |mut profile| {
        let report = model.engine.placement();
        let (gpu, ram, ssd) = report.totals();
        if let Some(map) = profile.as_object_mut() {
            map.insert("placement_report".into(), "/v1/placement".into());
            map.insert(
                "placement_actual".into(),
                serde_json::json!({
                    "placed": report.placed, "layers": report.layers.len(),
                    "experts": {"gpu": gpu, "ram": ram, "ssd": ssd},
                    "ngram_table": report.ngram_table.placement,
                }),
            );
        }
        profile
    }
}

/// The profile with a `placement` list (the WebUI's shape) derived from the per-tier expert counts of a
/// `nebula profile detect` file, unless it has one already.
fn with_placement(mut profile: serde_json::Value) -> serde_json::Value {
    let count = |key: &str| profile.get(key).and_then(serde_json::Value::as_u64);
    if profile.get("placement").is_some() {
        return profile;
    }
    let (Some(gpu), Some(cpu), Some(ssd)) =
        (count("gpu_experts_per_layer"), count("cpu_experts_per_layer"), count("ssd_experts_per_layer"))
    else {
        return profile;
    };
    let copies = count("gpu_copies_in_ram").unwrap_or(0);
    let placement = serde_json::json!([
        {"tier": "gpu", "experts_per_layer": gpu},
        {"tier": "ram", "experts_per_layer": cpu, "gpu_copies": copies},
        {"tier": "ssd", "experts_per_layer": ssd},
    ]);
    if let Some(map) = profile.as_object_mut() {
        map.insert("placement".into(), placement);
    }
    profile
}
