//! Logs and traces: `RUST_LOG`-filtered logs on stderr, and, when `otlp_endpoint` is set, the same spans
//! exported over OTLP/HTTP (protobuf) with a batch exporter. Each chat or text completion has a `request` span
//! (method, path, request id) with a `generation` child, and per choice `queue`, `prefill` (with the cached
//! prompt tokens) and `decode` spans.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::ServerConfig;
use crate::error::ServeError;

/// Keeps the trace exporter alive; flushes it on drop.
#[derive(Debug)]
pub struct TelemetryGuard(Option<SdkTracerProvider>);

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.0.take()
            && let Err(e) = provider.shutdown()
        {
            eprintln!("flushing traces failed: {e}");
        }
    }
}

/// Installs the global subscriber: logs to stderr (`RUST_LOG`, default `info`), plus OTLP export when the
/// config names an endpoint.
///
/// Errors: [`ServeError::Tracing`] when the exporter cannot be built or a subscriber is already installed.
pub fn init(config: &ServerConfig) -> Result<TelemetryGuard, ServeError> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,tower_http=info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer().with_ansi(ansi).with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry().with(filter).with(fmt);
    let Some(endpoint) = &config.otlp_endpoint else {
        registry.try_init().map_err(|e| ServeError::Tracing(e.to_string()))?;
        return Ok(TelemetryGuard(None));
    };
    let exporter = SpanExporter::builder()
        .with_http()
        .with_endpoint(endpoint.clone())
        .build()
        .map_err(|e| ServeError::Tracing(format!("OTLP exporter for {endpoint}: {e}")))?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(config.otlp_service_name.clone()).build())
        .build();
    let tracer = provider.tracer("nebula");
    registry
        .with(tracing_opentelemetry::layer().with_tracer(tracer))
        .try_init()
        .map_err(|e| ServeError::Tracing(e.to_string()))?;
    tracing::info!(%endpoint, "exporting traces over OTLP/HTTP");
    Ok(TelemetryGuard(Some(provider)))
}
