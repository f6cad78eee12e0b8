//! The tower layers around the API, assembled by [`crate::router`] (outermost first): request id
//! (`x-request-id`, made when absent and echoed back), tracing span, CORS (only when origins are configured),
//! body size limit (413 in the OpenAI body), API key (Bearer or `x-api-key`, compared in constant time; `/health`
//! stays open), Anthropic error bodies under `/v1/messages` ([`crate::routes::messages::anthropic_errors`]),
//! and, on the generation routes, a concurrency limit with a bounded wait queue (429 with `Retry-After` when
//! full; 503 once the shutdown grace period has ended) and a timeout for the response head (504).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower_http::cors::{AllowOrigin, Any, CorsLayer};

use crate::error::ApiError;
use crate::state::AppState;

/// Paths anyone may call, whatever the API key (load balancers and orchestrators probe them).
pub const OPEN_PATHS: [&str; 1] = ["/health"];

/// Refuses requests without the configured key, sent as `Authorization: Bearer KEY` or `x-api-key: KEY` (401). The comparison takes the same time whatever the
/// key sent.
pub async fn require_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let Some(key) = state.config.api_key.as_deref() else { return next.run(req).await };
    if OPEN_PATHS.contains(&req.uri().path()) || req.method() == Method::OPTIONS {
        return next.run(req).await;
    }
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")));
    // Anthropic clients send the key as `x-api-key`.
    let sent = bearer.or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok())).unwrap_or("").trim();
    if bool::from(sent.as_bytes().ct_eq(key.as_bytes())) {
        next.run(req).await
    } else {
        state.metrics.rejected("unauthorized");
        ApiError::Unauthorized.into_response()
    }
}

/// The concurrency limit of the generation routes: `max_concurrent_requests` run at once (a streamed response
/// holds its slot until its body ends), `max_waiting_requests` wait for one, the rest get 429.
#[derive(Debug)]
pub struct ConcurrencyLimit {
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    max_in_flight: usize,
    max_waiting: usize,
}

impl ConcurrencyLimit {
    /// A limit of `max_in_flight` requests with `max_waiting` more waiting.
    pub fn new(max_in_flight: usize, max_waiting: usize) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(max_in_flight)),
            waiting: AtomicUsize::new(0),
            max_in_flight,
            max_waiting,
        }
    }

    /// Requests holding a slot now.
    pub fn in_flight(&self) -> usize {
        self.max_in_flight - self.slots.available_permits()
    }
}

/// Middleware applying [`ConcurrencyLimit`] and the response-head timeout.
pub async fn limit_and_time(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let limit = &state.limit;
    if state.is_cut_off() {
        return ApiError::ShuttingDown.into_response();
    }
    let permit: OwnedSemaphorePermit = match limit.slots.clone().try_acquire_owned() {
        Ok(p) => p,
        Err(_) => {
            if limit.waiting.fetch_add(1, Ordering::SeqCst) >= limit.max_waiting {
                limit.waiting.fetch_sub(1, Ordering::SeqCst);
                state.metrics.rejected("busy");
                return ApiError::Busy { in_flight: limit.in_flight(), waiting: limit.max_waiting }.into_response();
            }
            let mut cut_off = state.cut_off.subscribe();
            let p = tokio::select! {
                p = limit.slots.clone().acquire_owned() => p.ok(),
                // Past the shutdown grace period nothing new starts.
                _ = cut_off.wait_for(|cut| *cut) => None,
            };
            limit.waiting.fetch_sub(1, Ordering::SeqCst);
            match p {
                Some(p) => p,
                None => return ApiError::ShuttingDown.into_response(),
            }
        }
    };
    let seconds = state.config.request_timeout_s;
    let response = match tokio::time::timeout(Duration::from_secs_f64(seconds), next.run(req)).await {
        Ok(r) => r,
        Err(_) => {
            state.metrics.rejected("timeout");
            return ApiError::Timeout { seconds: seconds.ceil() as u64 }.into_response();
        }
    };
    // The slot is held until the body (a stream, maybe) is done.
    let (parts, body) = response.into_parts();
    let body = Body::from_stream(PermitBody { inner: body.into_data_stream(), _permit: permit });
    Response::from_parts(parts, body)
}

/// A response body that releases its concurrency slot when it ends or is dropped.
struct PermitBody<S> {
    inner: S,
    _permit: OwnedSemaphorePermit,
}

impl<S: futures_util::Stream + Unpin> futures_util::Stream for PermitBody<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        std::pin::Pin::new(&mut self.inner).poll_next(cx)
    }
}

/// CORS for the configured origins; `None` when CORS is off (no origins).
pub fn cors(origins: &[String]) -> Option<CorsLayer> {
    if origins.is_empty() {
        return None;
    }
    let layer = CorsLayer::new().allow_methods([Method::GET, Method::POST, Method::OPTIONS]).allow_headers(Any);
    if origins.iter().any(|o| o == "*") {
        return Some(layer.allow_origin(Any));
    }
    let list: Vec<HeaderValue> = origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()).collect();
    Some(layer.allow_origin(AllowOrigin::list(list)))
}
