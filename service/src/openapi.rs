//! The OpenAPI document of the API, generated from the handlers' and wire types' annotations (utoipa), served at
//! `GET /openapi.json` and committed as `openapi/openapi.json` (a test fails when the two differ; regenerate with
//! `nebula openapi > openapi/openapi.json`).

use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::error::{ErrorBody, ErrorDetail};
use crate::openai;
use crate::routes;

/// The API's OpenAPI document.
#[derive(OpenApi)]
#[openapi(
    info(title = "Nebula", description = "OpenAI-compatible API of Nebula, an inference server for Qwen3.8-Flash-Next.",
        license(name = "Apache-2.0")),
    paths(
        routes::chat::chat_completions,
        routes::completions::completions,
        routes::models::list_models,
        routes::health::health,
        crate::metrics::metrics,
        openapi_json,
    ),
    components(schemas(
        openai::ChatCompletionRequest, openai::ChatCompletion, openai::ChatCompletionChunk, openai::CompletionRequest,
        openai::Completion, openai::ModelList, ErrorBody, ErrorDetail, routes::health::Health,
    )),
    modifiers(&BearerAuth),
    tags((name = "openai", description = "OpenAI-compatible endpoints"),
         (name = "observability", description = "Health, metrics and this document")),
)]
pub struct ApiDoc;

/// Declares the optional Bearer API key.
struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The document as pretty JSON with a trailing newline (the committed file's form).
pub fn document() -> String {
    let mut text = ApiDoc::openapi().to_pretty_json().unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    text.push('\n');
    text
}

/// `GET /openapi.json`.
#[utoipa::path(get, path = "/openapi.json", tag = "observability",
    responses((status = 200, description = "This document", content_type = "application/json", body = Object)))]
pub async fn openapi_json() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}
