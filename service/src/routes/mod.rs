//! The HTTP handlers, one file per resource. The router that mounts them is assembled in [`crate::router`].

pub mod chat;
pub mod completions;
pub mod health;
pub mod messages;
pub mod models;
pub mod placement;
pub mod responses;
pub mod tokenize;

use axum::http::{Method, Uri};

use crate::error::ApiError;

/// Any path without a route: a 404 in the OpenAI error body.
pub async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::RouteNotFound { method: method.to_string(), path: uri.path().to_owned() }
}

/// A known path with the wrong method: a 405 in the OpenAI error body.
pub async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed { method: method.to_string(), path: uri.path().to_owned() }
}
