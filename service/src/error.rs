//! API errors and their OpenAI wire form: `{"error": {"message", "type", "param", "code"}}` with the matching HTTP
//! status. Every failure a handler or extractor can meet becomes an [`ApiError`]; axum's plain-text rejections
//! never reach a client.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// A request that failed, with what the client needs to fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or asks for something invalid (400). `param` names the offending field
    /// (`messages[0].content`, `n`), `code` a machine-readable reason where one exists.
    #[error("{message}")]
    InvalidRequest {
        /// What is wrong, for a person.
        message: String,
        /// The request field at fault.
        param: Option<String>,
        /// A machine-readable reason.
        code: Option<&'static str>,
    },
    /// The request names a model this server does not serve (404).
    #[error("The model `{requested}` does not exist. This server serves `{served}`.")]
    ModelNotFound {
        /// The `model` of the request.
        requested: String,
        /// The id this server serves.
        served: String,
    },
    /// No route for this method and path (404).
    #[error("No route for {method} {path}.")]
    RouteNotFound {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
    },
    /// The route exists but not with this method (405).
    #[error("Method {method} is not allowed for {path}.")]
    MethodNotAllowed {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
    },
    /// The request body is over the server's size limit (413).
    #[error("The request body is too large.")]
    PayloadTooLarge,
    /// The engine's queue is full (429); the client may retry after `retry_after_s`.
    #[error("The server is busy: {waiting} requests are already waiting. Retry later.")]
    QueueFull {
        /// Requests already waiting (the queue's capacity).
        waiting: usize,
        /// Seconds the client should wait (the `Retry-After` header).
        retry_after_s: u32,
    },
    /// No or a wrong API key (401).
    #[error("Missing or invalid API key: send `Authorization: Bearer <key>`.")]
    Unauthorized,
    /// Too many requests are in flight and the wait queue is full (429).
    #[error("The server is busy: {in_flight} requests are in flight and {waiting} are waiting. Retry later.")]
    Busy {
        /// Requests being handled.
        in_flight: usize,
        /// Requests waiting for a slot.
        waiting: usize,
    },
    /// The request did not produce a response in time (504).
    #[error("The request took longer than {seconds} s and was stopped.")]
    Timeout {
        /// The configured limit, seconds (rounded up).
        seconds: u64,
    },
    /// The model is still loading (503).
    #[error("The model is still loading ({phase}). Retry when GET /health answers 200.")]
    Loading {
        /// What the server is doing.
        phase: &'static str,
    },
    /// The server is shutting down and its grace period for open requests has ended (503).
    #[error("The server is shutting down; the request was not completed. Retry on another instance.")]
    ShuttingDown,
    /// Something failed inside the server (500); the message says what.
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    /// A 400 naming the field at fault.
    pub fn invalid(message: impl Into<String>, param: impl Into<String>) -> Self {
        Self::InvalidRequest { message: message.into(), param: Some(param.into()), code: None }
    }

    /// A 400 with a machine-readable `code`.
    pub fn invalid_with_code(message: impl Into<String>, param: Option<String>, code: &'static str) -> Self {
        Self::InvalidRequest { message: message.into(), param, code: Some(code) }
    }

    /// The HTTP status of this error.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            Self::ModelNotFound { .. } | Self::RouteNotFound { .. } => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::QueueFull { .. } | Self::Busy { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            Self::Loading { .. } | Self::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI body of this error.
    pub fn body(&self) -> ErrorBody {
        let (kind, param, code) = match self {
            Self::InvalidRequest { param, code, .. } => {
                ("invalid_request_error", param.clone(), code.map(str::to_owned))
            }
            Self::ModelNotFound { .. } => {
                ("invalid_request_error", Some("model".to_owned()), Some("model_not_found".into()))
            }
            Self::RouteNotFound { .. } => ("invalid_request_error", None, Some("not_found".into())),
            Self::MethodNotAllowed { .. } => ("invalid_request_error", None, Some("method_not_allowed".into())),
            Self::PayloadTooLarge => ("invalid_request_error", None, Some("payload_too_large".into())),
            Self::QueueFull { .. } => ("rate_limit_error", None, Some("queue_full".into())),
            Self::Busy { .. } => ("rate_limit_error", None, Some("server_busy".into())),
            Self::Unauthorized => ("invalid_request_error", None, Some("invalid_api_key".into())),
            Self::Timeout { .. } => ("server_error", None, Some("timeout".into())),
            Self::Loading { .. } => ("server_error", None, Some("model_loading".into())),
            Self::ShuttingDown => ("server_error", None, Some("shutting_down".into())),
            Self::Internal(_) => ("server_error", None, None),
        };
        ErrorBody { error: ErrorDetail { message: self.to_string(), kind: kind.to_owned(), param, code } }
    }
}

/// Why the server could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The listening socket could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: std::net::SocketAddr,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The model could not be loaded: the file (or the embedded model's label) and the problem. The engine's
    /// error is shown in the message rather than chained, so the reason is printed once.
    #[error("cannot load the model {model}: {error}")]
    Load {
        /// The model file, or the embedded model's label.
        model: String,
        /// The engine's error.
        error: Box<nebula_engine::worker::LoadError>,
    },
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The hardware profile file cannot be read.
    #[error("cannot read the profile {path}: {detail}")]
    Profile {
        /// The file.
        path: String,
        /// Why.
        detail: String,
    },
    /// OpenTelemetry could not be set up.
    #[error("tracing: {0}")]
    Tracing(String),
    /// The fallback chat template did not compile.
    #[error("the built-in chat template does not compile: {0}")]
    Template(String),
    /// The async runtime could not be started, or serving failed.
    #[error("server I/O error: {0}")]
    Io(#[from] std::io::Error),
}

/// The model did not load; the message names the file and the problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LoadFailed(pub String);

/// `{"error": {...}}`, the OpenAI error envelope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// The fields of an OpenAI error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    /// What went wrong, for a person.
    pub message: String,
    /// The error class (`invalid_request_error`, `rate_limit_error`, `server_error`).
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable reason (`model_not_found`, `context_length_exceeded`), if one applies.
    pub code: Option<String>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        if matches!(self, Self::Unauthorized) {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        let retry_after = match &self {
            Self::QueueFull { retry_after_s, .. } => Some(*retry_after_s),
            Self::Busy { .. } => Some(1),
            Self::Loading { .. } => Some(1),
            _ => None,
        };
        if let Some(seconds) = retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_not_found_has_the_openai_shape() {
        let err = ApiError::ModelNotFound { requested: "gpt-4".into(), served: "demo".into() };
        assert_eq!(err.status(), StatusCode::NOT_FOUND);
        let body = serde_json::to_value(err.body()).unwrap();
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["code"], "model_not_found");
        assert_eq!(body["error"]["param"], "model");
        assert!(body["error"]["message"].as_str().unwrap().contains("gpt-4"));
    }

    #[test]
    fn invalid_request_keeps_null_fields() {
        let body = serde_json::to_value(ApiError::invalid("bad", "n").body()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": null}})
        );
    }
}
