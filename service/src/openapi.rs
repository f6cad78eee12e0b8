//! The OpenAPI document of the API, generated from the handlers' and wire types' annotations (utoipa), served at
//! `GET /openapi.json` and committed as `openapi/openapi.json` (a test fails when the two differ; regenerate with
//! `nebula openapi > openapi/openapi.json`).
//!
//! One part is added after generation, because utoipa has no words for it: the `text/event-stream` responses
//! describe each server-sent event (OpenAPI 3.1 / JSON Schema `contentMediaType` + `contentSchema`): its `data`
//! is either `[DONE]` or JSON that is a chunk or an error body.

use axum::Json;
use serde_json::{Value, json};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::error::{ErrorBody, ErrorDetail};
use crate::routes;
use crate::{anthropic, openai, responses};

/// The API's OpenAPI document.
#[derive(OpenApi)]
#[openapi(
    info(title = "Nebula", description = "OpenAI-compatible API of Nebula, an inference server for Qwen3.8-Flash-Next.",
        license(name = "Apache-2.0")),
    paths(
        routes::chat::chat_completions,
        routes::completions::completions,
        routes::responses::create_response,
        routes::messages::create_message,
        routes::messages::count_tokens,
        routes::tokenize::tokenize,
        routes::tokenize::detokenize,
        routes::models::list_models,
        routes::models::retrieve_model,
        routes::health::health,
        routes::placement::placement,
        crate::metrics::metrics,
        openapi_json,
    ),
    components(schemas(
        openai::ChatCompletionRequest, openai::ChatCompletion, openai::ChatCompletionChunk, openai::CompletionRequest,
        openai::Completion, openai::ModelList, ErrorBody, ErrorDetail, routes::health::Health,
        routes::placement::PlacementInfo, responses::CreateResponseRequest, responses::ResponseObject,
        responses::ResponseStreamEvent, anthropic::MessagesRequest, anthropic::CountTokensRequest,
        anthropic::CountTokensResponse, anthropic::MessageObject, anthropic::MessageStreamEvent,
        anthropic::AnthropicErrorBody, routes::tokenize::TokenizeRequest, routes::tokenize::TokenizeResponse,
        routes::tokenize::DetokenizeRequest, routes::tokenize::DetokenizeResponse,
    )),
    modifiers(&BearerAuth),
    tags((name = "openai", description = "OpenAI-compatible endpoints"),
         (name = "anthropic", description = "Anthropic Messages API endpoints"),
         (name = "tokens", description = "Tokenize and detokenize (llama.cpp and vLLM shapes)"),
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

/// The schema of one server-sent event whose JSON `data` is a `chunk` (or an error body), or `[DONE]`.
fn sse_event_schema(chunk: &str) -> Value {
    json!({
        "type": "object",
        "description": format!("One server-sent event: `data` is a {chunk} or an error body as JSON, or `[DONE]`."),
        "required": ["data"],
        "properties": {
            "data": {"anyOf": [
                {"type": "string", "const": "[DONE]"},
                {"type": "string", "contentMediaType": "application/json", "contentSchema": {"oneOf": [
                    {"$ref": format!("#/components/schemas/{chunk}")},
                    {"$ref": "#/components/schemas/ErrorBody"}
                ]}}
            ]},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"}
        }
    })
}

/// The schema of one server-sent event of the Responses or Messages API: `event` is the event type, `data` the
/// event object `payload` (or, for the Messages API, an error body) as JSON; no `[DONE]`.
fn typed_event_schema(payload: &str, error: Option<&str>) -> Value {
    let mut one_of = vec![json!({"$ref": format!("#/components/schemas/{payload}")})];
    if let Some(error) = error {
        one_of.push(json!({"$ref": format!("#/components/schemas/{error}")}));
    }
    json!({
        "type": "object",
        "description": format!("One server-sent event: `event` is its type, `data` a {payload} as JSON."),
        "required": ["data"],
        "properties": {
            "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": {"oneOf": one_of}},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"}
        }
    })
}

/// The document as JSON, with the event-stream schemas added.
pub fn document_value() -> Value {
    let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or_default();
    for (path, chunk, event) in [
        ("/v1/chat/completions", "ChatCompletionChunk", "ChatCompletionEvent"),
        ("/v1/completions", "Completion", "CompletionEvent"),
        ("/v1/responses", "ResponseStreamEvent", "ResponseEvent"),
        ("/v1/messages", "MessageStreamEvent", "MessageEvent"),
    ] {
        let schema = match path {
            "/v1/responses" => typed_event_schema(chunk, None),
            "/v1/messages" => typed_event_schema(chunk, Some("AnthropicErrorBody")),
            _ => sse_event_schema(chunk),
        };
        if let Some(schemas) = doc.pointer_mut("/components/schemas").and_then(Value::as_object_mut) {
            schemas.insert(event.to_owned(), schema);
        }
        let pointer = format!("/paths/{}/post/responses/200/content/text~1event-stream", path.replace('/', "~1"));
        if let Some(media) = doc.pointer_mut(&pointer) {
            *media = json!({"schema": {"$ref": format!("#/components/schemas/{event}")}});
        }
    }
    doc
}

/// The document as pretty JSON with a trailing newline (the committed file's form).
pub fn document() -> String {
    let mut text = serde_json::to_string_pretty(&document_value()).unwrap_or_default();
    text.push('\n');
    text
}

/// `GET /openapi.json`.
#[utoipa::path(get, path = "/openapi.json", tag = "observability",
    responses((status = 200, description = "This document", content_type = "application/json", body = Object)))]
pub async fn openapi_json() -> Json<Value> {
    Json(document_value())
}
