//! `GET /metrics`: Prometheus text format with vLLM's metric names (so existing Grafana boards and the WebUI read
//! them) plus Nebula's own `nebula:*` families.
//!
//! vLLM names (`vllm:` prefix, labelled `model_name`): `num_requests_running`, `num_requests_waiting`,
//! `prompt_tokens_total`, `generation_tokens_total`, `request_success_total{finished_reason}`,
//! `time_to_first_token_seconds`, `inter_token_latency_seconds`, `e2e_request_latency_seconds`,
//! `request_queue_time_seconds`, `request_prefill_time_seconds`, `request_decode_time_seconds`,
//! `prefix_cache_queries_total` and `prefix_cache_hits_total` (prompt tokens looked up / found),
//! `kv_cache_usage_perc` (the share of the batch's state budget the running requests reserve, 0 to 1; without a
//! budget, running sequences over the batch's slots): what the Kubernetes inference gateway's endpoint picker
//! reads.
//!
//! Nebula's: `nebula:prompt_tokens_cached_total` and `nebula:prompt_tokens_prefilled_total` (prompt tokens taken
//! from the prefix cache / run through the model), `nebula:prefix_cache_entries`, `nebula:prefix_cache_bytes`,
//! `nebula:prefix_cache_device_bytes` (of those, in VRAM), `nebula:prefix_cache_spills_total` (entries moved from
//! VRAM to host memory), `nebula:requests_rejected_total{reason}`, `nebula:request_errors_total{kind}`, `nebula:model_loaded`, and the
//! placement families `nebula:expert_hits_total{tier}` (routed expert uses, token x expert, by the tier that held
//! the expert: `gpu`, `ram`, `ssd`; without a placement every use counts as `ram`), `nebula:ssd_read_bytes_total`
//! (expert and n-gram bytes read from SSD), `nebula:ssd_read_errors_total`, `nebula:expert_prefetch_total{outcome}`
//! (`issued`, `used`), `nebula:pcie_bytes_total` (host <-> GPU bytes of the hybrid backend),
//! `nebula:expert_handoffs_total` (token-layers whose routed MoE went to the CPU), `nebula:experts_omitted_total`
//! (marginal experts dropped), `nebula:gpu_cache_uploads_total` (experts the adaptive GPU expert cache uploaded;
//! its hit rate is `expert_hits_total{tier="gpu"}` over all uses), and MTP speculative decoding:
//! `nebula:draft_tokens_total` and `nebula:draft_accepted_tokens_total` (drafts proposed / accepted),
//! `nebula:draft_chains_total{case}` (verified chains by case: `A` all accepted, `B` handed to the full
//! target for low resident-expert coverage, `C` a draft rejected), `nebula:draft_window_chains_total{window}`
//! (chains per draft window size: 4..16, fewer near the end of an answer), `nebula:draft_collapses_total` and
//! `nebula:draft_recoveries_total` (drafting turned off for a request because it lost time, and back on after the
//! cooldown),
//! `nebula:draft_phase_seconds_total{phase}` (time in `draft`, `verify`, `save`, `restore`, `realign`, `exact`),
//! `nebula:draft_acceptance_ratio` (recent acceptance, exponentially averaged over chains), `nebula:mtp_enabled`
//! (1 when the served model drafts), and continuous batching: `nebula:batch_size` (sequences per pass),
//! `nebula:batch_tokens` (tokens per pass: decode rows and prefill chunk tokens) and `nebula:batch_step_seconds`
//! (wall time per pass), histograms.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use nebula_engine::speculative::stats::PHASES;
use nebula_engine::speculative::window::MAX_WINDOW;
use prometheus::{
    CounterVec, Encoder, Gauge, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::state::{AppState, LoadState};

/// Every metric the server exports.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    running: IntGaugeVec,
    waiting: IntGaugeVec,
    prompt_tokens: IntCounterVec,
    generation_tokens: IntCounterVec,
    success: IntCounterVec,
    ttft: HistogramVec,
    itl: HistogramVec,
    e2e: HistogramVec,
    queue_time: HistogramVec,
    prefill_time: HistogramVec,
    decode_time: HistogramVec,
    prefix_queries: IntCounterVec,
    prefix_hits: IntCounterVec,
    cached_tokens: IntCounter,
    prefilled_tokens: IntCounter,
    cache_entries: IntGauge,
    cache_bytes: IntGauge,
    cache_device_bytes: IntGauge,
    cache_spills: IntCounter,
    rejected: IntCounterVec,
    errors: IntCounterVec,
    model_loaded: IntGauge,
    expert_hits: IntCounterVec,
    pcie_bytes: IntCounter,
    handoffs: IntCounter,
    omitted: IntCounter,
    cache_uploads: IntCounter,
    ssd_bytes: IntCounter,
    ssd_errors: IntCounter,
    prefetch: IntCounterVec,
    draft_tokens: IntCounter,
    draft_accepted: IntCounter,
    draft_chains: IntCounterVec,
    draft_windows: IntCounterVec,
    draft_collapses: IntCounter,
    draft_recoveries: IntCounter,
    draft_phase_seconds: CounterVec,
    draft_acceptance: Gauge,
    mtp_enabled: IntGauge,
    kv_usage: prometheus::GaugeVec,
    batch_size: prometheus::Histogram,
    batch_tokens: prometheus::Histogram,
    batch_seconds: prometheus::Histogram,
}

/// What one finished request adds to the metrics.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestRecord {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Seconds from arrival to the first token (`None`: no token came).
    pub ttft_s: Option<f64>,
    /// Seconds from arrival to the end.
    pub e2e_s: f64,
    /// Seconds in the engine's queue.
    pub queue_s: f64,
    /// Seconds of prefill.
    pub prefill_s: f64,
    /// Seconds of decode.
    pub decode_s: f64,
}

const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const REQUEST_BUCKETS: &[f64] =
    &[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0];

fn counter(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    registry.register(Box::new(c.clone())).expect("unique metric");
    c
}

const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];
const TOKEN_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0];

fn plain_histogram(registry: &Registry, name: &str, help: &str, buckets: &[f64]) -> prometheus::Histogram {
    let h = prometheus::Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
        .expect("valid metric");
    registry.register(Box::new(h.clone())).expect("unique metric");
    h
}

fn histogram(registry: &Registry, name: &str, help: &str, buckets: &[f64]) -> HistogramVec {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets.to_vec()), &["model_name"])
        .expect("valid metric");
    registry.register(Box::new(h.clone())).expect("unique metric");
    h
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every family registered.
    pub fn new() -> Self {
        let r = Registry::new();
        let gauge_vec = |name: &str, help: &str| {
            let g = IntGaugeVec::new(Opts::new(name, help), &["model_name"]).expect("valid metric");
            r.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("valid metric");
            r.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        let plain = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("valid metric");
            r.register(Box::new(c.clone())).expect("unique metric");
            c
        };
        let m = "model_name";
        Self {
            running: gauge_vec("vllm:num_requests_running", "Requests the engine is generating now."),
            waiting: gauge_vec("vllm:num_requests_waiting", "Requests waiting in the engine's queue."),
            prompt_tokens: counter(&r, "vllm:prompt_tokens_total", "Prompt tokens of finished requests.", &[m]),
            generation_tokens: counter(&r, "vllm:generation_tokens_total", "Generated tokens.", &[m]),
            success: counter(
                &r,
                "vllm:request_success_total",
                "Finished requests by finish reason.",
                &[m, "finished_reason"],
            ),
            ttft: histogram(&r, "vllm:time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS),
            itl: histogram(&r, "vllm:inter_token_latency_seconds", "Time between output tokens.", LATENCY_BUCKETS),
            e2e: histogram(&r, "vllm:e2e_request_latency_seconds", "Arrival to the end.", REQUEST_BUCKETS),
            queue_time: histogram(&r, "vllm:request_queue_time_seconds", "Time in the engine queue.", REQUEST_BUCKETS),
            prefill_time: histogram(&r, "vllm:request_prefill_time_seconds", "Prefill time.", REQUEST_BUCKETS),
            decode_time: histogram(&r, "vllm:request_decode_time_seconds", "Decode time.", REQUEST_BUCKETS),
            prefix_queries: counter(
                &r,
                "vllm:prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache.",
                &[m],
            ),
            prefix_hits: counter(&r, "vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", &[m]),
            cached_tokens: plain(
                "nebula:prompt_tokens_cached_total",
                "Prompt tokens resumed from a prefix-cache checkpoint instead of being prefilled.",
            ),
            prefilled_tokens: plain("nebula:prompt_tokens_prefilled_total", "Prompt tokens run through the model."),
            cache_entries: gauge("nebula:prefix_cache_entries", "Sequences held by the prefix cache."),
            cache_bytes: gauge("nebula:prefix_cache_bytes", "Bytes of state held by the prefix cache (VRAM and host)."),
            cache_device_bytes: gauge(
                "nebula:prefix_cache_device_bytes",
                "Bytes of the prefix cache's GPU states and checkpoints held in VRAM.",
            ),
            cache_spills: plain(
                "nebula:prefix_cache_spills_total",
                "Prefix-cache entries moved from VRAM to host memory (resumed by copying back).",
            ),
            rejected: counter(&r, "nebula:requests_rejected_total", "Requests refused before running.", &["reason"]),
            errors: counter(&r, "nebula:request_errors_total", "Requests that failed after they started.", &["kind"]),
            model_loaded: gauge("nebula:model_loaded", "1 once the model is loaded and served."),
            expert_hits: counter(
                &r,
                "nebula:expert_hits_total",
                "Routed expert uses (token x expert) by the tier that held the expert.",
                &["tier"],
            ),
            pcie_bytes: plain(
                "nebula:pcie_bytes_total",
                "Bytes copied between host and GPU by the hybrid backend (per-layer activations, streamed experts).",
            ),
            handoffs: plain(
                "nebula:expert_handoffs_total",
                "Token-layers whose routed MoE ran on the CPU: GPU-resident experts covered less than the handoff fraction.",
            ),
            omitted: plain(
                "nebula:experts_omitted_total",
                "Routed expert uses dropped by the marginal-expert omission (off in strict mode).",
            ),
            cache_uploads: plain(
                "nebula:gpu_cache_uploads_total",
                "Experts the adaptive GPU expert cache uploaded into GPU slots (hybrid backend, placement.gpu_cache = lru).",
            ),
            ssd_bytes: plain("nebula:ssd_read_bytes_total", "Expert and n-gram table bytes read from SSD."),
            ssd_errors: plain(
                "nebula:ssd_read_errors_total",
                "Failed SSD reads (each fails the request that needed it).",
            ),
            prefetch: counter(
                &r,
                "nebula:expert_prefetch_total",
                "SSD expert reads started by the prefetcher (issued) and prefetched experts then used (used).",
                &["outcome"],
            ),
            draft_tokens: plain("nebula:draft_tokens_total", "MTP draft tokens proposed."),
            draft_accepted: plain("nebula:draft_accepted_tokens_total", "MTP draft tokens accepted."),
            draft_chains: counter(
                &r,
                "nebula:draft_chains_total",
                "Verified MTP chains by case: A all drafts accepted, B low resident-expert coverage, C a draft rejected.",
                &["case"],
            ),
            draft_windows: counter(&r, "nebula:draft_window_chains_total", "MTP chains by draft window size.", &[
                "window",
            ]),
            draft_collapses: plain(
                "nebula:draft_collapses_total",
                "Requests whose drafting turned itself off because it lost time (acceptance collapse).",
            ),
            draft_recoveries: plain(
                "nebula:draft_recoveries_total",
                "Times drafting came back for a request after a collapse cooldown.",
            ),
            draft_phase_seconds: {
                let c = CounterVec::new(
                    Opts::new("nebula:draft_phase_seconds_total", "Seconds of speculative decoding by phase."),
                    &["phase"],
                )
                .expect("valid metric");
                r.register(Box::new(c.clone())).expect("unique metric");
                c
            },
            draft_acceptance: {
                let g = Gauge::new(
                    "nebula:draft_acceptance_ratio",
                    "Recent MTP acceptance: accepted / proposed drafts per chain, exponentially averaged.",
                )
                .expect("valid metric");
                r.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            mtp_enabled: gauge("nebula:mtp_enabled", "1 when the served model drafts with its MTP block."),
            kv_usage: {
                let g = prometheus::GaugeVec::new(
                    Opts::new(
                        "vllm:kv_cache_usage_perc",
                        "Share of the sequence-state budget (KV caches, recurrent states) the running requests \
                         reserve, 0 to 1; without a budget, running sequences over the batch's slots.",
                    ),
                    &[m],
                )
                .expect("valid metric");
                r.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            batch_size: plain_histogram(&r, "nebula:batch_size", "Sequences per batched pass.", BATCH_BUCKETS),
            batch_tokens: plain_histogram(
                &r,
                "nebula:batch_tokens",
                "Tokens per batched pass (decode rows and prefill tokens).",
                TOKEN_BUCKETS,
            ),
            batch_seconds: plain_histogram(&r, "nebula:batch_step_seconds", "Wall time of a batched pass.", LATENCY_BUCKETS),
            registry: r,
        }
        .with_zero_series()
    }

    /// Creates the unlabelled-by-request series at 0 so they show before the first request.
    fn with_zero_series(self) -> Self {
        for tier in ["gpu", "ram", "ssd"] {
            self.expert_hits.with_label_values(&[tier]);
        }
        for outcome in ["issued", "used"] {
            self.prefetch.with_label_values(&[outcome]);
        }
        for reason in ["queue_full", "busy", "unauthorized", "timeout"] {
            self.rejected.with_label_values(&[reason]);
        }
        for case in ["A", "B", "C"] {
            self.draft_chains.with_label_values(&[case]);
        }
        for w in 1..=MAX_WINDOW {
            self.draft_windows.with_label_values(&[&w.to_string()]);
        }
        for phase in PHASES {
            self.draft_phase_seconds.with_label_values(&[phase]);
        }
        self
    }

    /// The engine's per-pass hook: batch size, tokens and wall time of every batched pass.
    pub fn step_observer(&self) -> nebula_engine::worker::StepObserver {
        let (size, tokens, secs) = (self.batch_size.clone(), self.batch_tokens.clone(), self.batch_seconds.clone());
        nebula_engine::worker::StepObserver(Arc::new(move |r: &nebula_engine::worker::StepReport| {
            size.observe(r.sequences as f64);
            tokens.observe(r.tokens as f64);
            secs.observe(r.seconds);
        }))
    }

    /// Counts a request refused before it ran (`queue_full`, `busy`, `unauthorized`, `timeout`).
    pub fn rejected(&self, reason: &str) {
        self.rejected.with_label_values(&[reason]).inc();
    }

    /// Counts a request that failed after it started (`engine`, `watchdog`, `constraint`).
    pub fn error(&self, kind: &str) {
        self.errors.with_label_values(&[kind]).inc();
    }

    /// Records the gap between two output tokens.
    pub fn inter_token(&self, model: &str, seconds: f64) {
        self.itl.with_label_values(&[model]).observe(seconds);
    }

    /// Records a finished request.
    pub fn finished(&self, model: &str, reason: &str, r: &RequestRecord) {
        self.prompt_tokens.with_label_values(&[model]).inc_by(r.prompt_tokens as u64);
        self.generation_tokens.with_label_values(&[model]).inc_by(r.completion_tokens as u64);
        self.success.with_label_values(&[model, reason]).inc();
        if let Some(t) = r.ttft_s {
            self.ttft.with_label_values(&[model]).observe(t);
        }
        self.e2e.with_label_values(&[model]).observe(r.e2e_s);
        self.queue_time.with_label_values(&[model]).observe(r.queue_s);
        self.prefill_time.with_label_values(&[model]).observe(r.prefill_s);
        self.decode_time.with_label_values(&[model]).observe(r.decode_s);
    }

    /// The text exposition, after reading the engine's gauges and counters.
    pub fn render(&self, state: &AppState) -> String {
        if let LoadState::Ready(model) = &*state.load.borrow() {
            let engine = &model.engine;
            let id = model.id.as_str();
            self.model_loaded.set(1);
            self.running.with_label_values(&[id]).set(engine.running() as i64);
            self.waiting.with_label_values(&[id]).set(engine.waiting() as i64);
            let batch = engine.batch_options();
            let usage = match batch.state_budget {
                Some(b) if b > 0 => engine.stats().reserved_state_bytes.load(Ordering::Relaxed) as f64 / b as f64,
                _ => engine.running() as f64 / batch.max_sequences.max(1) as f64,
            };
            self.kv_usage.with_label_values(&[id]).set(usage.min(1.0));
            let stats = engine.stats();
            let set = |c: &IntCounter, v: usize| {
                let v = v as u64;
                if v > c.get() {
                    c.inc_by(v - c.get());
                }
            };
            let queries = stats.prefix_queries.load(Ordering::Relaxed);
            let hits = stats.prefix_hits.load(Ordering::Relaxed);
            set(&self.prefix_queries.with_label_values(&[id]), queries);
            set(&self.prefix_hits.with_label_values(&[id]), hits);
            set(&self.cached_tokens, hits);
            set(&self.prefilled_tokens, stats.prefilled_tokens.load(Ordering::Relaxed));
            self.cache_entries.set(stats.cache_entries.load(Ordering::Relaxed) as i64);
            self.cache_bytes.set(stats.cache_bytes.load(Ordering::Relaxed) as i64);
            self.cache_device_bytes.set(stats.cache_device_bytes.load(Ordering::Relaxed) as i64);
            set(&self.cache_spills, stats.cache_spills.load(Ordering::Relaxed));
            let p = engine.placement_stats().snapshot();
            let set64 = |c: &IntCounter, v: u64| {
                if v > c.get() {
                    c.inc_by(v - c.get());
                }
            };
            for (tier, v) in [("gpu", p.expert_hits_gpu), ("ram", p.expert_hits_ram), ("ssd", p.expert_hits_ssd)] {
                set64(&self.expert_hits.with_label_values(&[tier]), v);
            }
            set64(&self.ssd_bytes, p.ssd_expert_bytes + p.ngram_bytes_read);
            set64(&self.ssd_errors, p.ssd_read_errors);
            set64(&self.pcie_bytes, p.pcie_bytes);
            set64(&self.handoffs, p.handoffs);
            set64(&self.omitted, p.omitted);
            set64(&self.cache_uploads, p.cache_uploads);
            set64(&self.prefetch.with_label_values(&["issued"]), p.prefetch_issued);
            set64(&self.prefetch.with_label_values(&["used"]), p.prefetch_hits);
            let spec = &stats.speculative;
            let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed) as usize;
            self.mtp_enabled.set(i64::from(engine.has_mtp()));
            // A decayed average below 1e-9 is 0 (Prometheus text would print hundreds of digits of it).
            let recent = spec.recent_acceptance();
            self.draft_acceptance.set(if recent < 1e-9 { 0.0 } else { recent });
            set(&self.draft_tokens, load(&spec.drafted));
            set(&self.draft_accepted, load(&spec.accepted));
            for (case, n) in ["A", "B", "C"].iter().zip(&spec.chains) {
                set(&self.draft_chains.with_label_values(&[case]), load(n));
            }
            for w in 1..=MAX_WINDOW {
                set(&self.draft_windows.with_label_values(&[&w.to_string()]), load(&spec.windows[w]));
            }
            set(&self.draft_collapses, load(&spec.collapses));
            set(&self.draft_recoveries, load(&spec.recoveries));
            for (phase, us) in PHASES.iter().zip(&spec.phase_us) {
                let c = self.draft_phase_seconds.with_label_values(&[phase]);
                let v = us.load(Ordering::Relaxed) as f64 * 1e-6;
                if v > c.get() {
                    c.inc_by(v - c.get());
                }
            }
        }
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::error!("encoding the metrics failed: {e}");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

/// `GET /metrics`.
#[utoipa::path(get, path = "/metrics", tag = "observability",
    responses((status = 200, description = "Prometheus text exposition format 0.0.4", content_type = "text/plain", body = String)))]
pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let body = state.metrics.render(&state);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], body).into_response()
}
