//! The generation worker: one thread that owns the model and runs requests from a bounded queue.
//!
//! The HTTP service never touches tensors: it renders and tokenizes the prompt, hands an [`GenerateRequest`] to
//! [`Engine::submit`], and reads [`GenerationEvent`]s from the returned channel. Each request gets its own
//! sequence state and sampler. Generation stops at a stop token (`<|im_end|>`, `<|endoftext|>` and any extra
//! ones), at `max_tokens`, at the context limit, or when the request is cancelled — by its cancel flag or by the
//! receiver being dropped (the client went away); the check runs before every decode step and between prefill
//! chunks, so a cancelled request frees the worker within one step.
//!
//! The worker keeps a [`PrefixCache`]: each request resumes from the cached checkpoint that covers most of its
//! prompt and prefills only the rest; its own state and checkpoints are cached when it ends. A request may carry
//! a [`TokenConstraint`] (a grammar) that masks the logits before each draw, and ask for log-probabilities.
//! A repetition guard ends output that loops on one short pattern ([`FinishReason::Repetition`]).
//!
//! Decoding runs through [`SpeculativeDecoder`]: with an MTP block loaded (and the server's switch on) the
//! model drafts chains that the target verifies in one pass (`crate::speculative`), at the request's
//! [`AccuracyLevel`]; otherwise, and whenever drafting does not pay, it decodes one token per step.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use tokio::sync::mpsc;

use crate::backend::cuda::CudaModel;
use crate::backend::{Backend, BackendKind, Loaded};
use crate::gguf::GgufFile;
use crate::model::{LoadOptions, LogitsFor, ModelConfig, ModelError, Qwen4Exp};
use crate::placement::{PlacementOptions, PlacementReport, PlacementStats};
use crate::prefix_cache::disk::{DiskCache, HostEntry, ModelIdentity};
use crate::prefix_cache::{CacheEntry, Checkpoint, PrefixCache, PrefixCacheOptions};
use crate::sampling::{Sampler, SamplingParams, TokenConstraint, TokenLogprobs, logprobs_of};
use crate::speculative::decoder::{DecodeError, Flow, SpeculativeDecoder, SpeculativeOptions, TokenSink};
use crate::speculative::{AccuracyLevel, SpecStats};
use crate::text::chat_template::{ChatTemplate, TemplateError};
use crate::text::tokenizer::{GgufVocab, TextTokenizer, TokenizerError};

/// Tokens prefilled per forward call by default: bounds activation memory and lets a cancel land mid-prefill.
pub const PREFILL_CHUNK: usize = 512;

/// Why a model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The model file.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The tokenizer metadata.
    #[error("{path}: tokenizer: {source}")]
    Tokenizer { path: String, source: TokenizerError },
    /// The file has no tokenizer, so it cannot serve text.
    #[error(
        "{path}: the model file has no tokenizer (tokenizer.ggml.tokens); convert it with tokenizer.json beside the checkpoint"
    )]
    NoTokenizer { path: String },
    /// The chat template does not compile.
    #[error("{path}: chat template: {source}")]
    Template { path: String, source: TemplateError },
    /// The model could not be put on the chosen backend (no GPU, over the VRAM budget, kernels missing).
    #[error("backend: {source}")]
    Backend { path: String, source: crate::backend::cuda::CudaError },
}

/// Why a request was refused before it started.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum SubmitError {
    /// The prompt alone does not fit the context.
    #[error("the prompt has {prompt_tokens} tokens, more than this server's context limit of {limit} tokens")]
    PromptTooLong { prompt_tokens: usize, limit: usize },
    /// An empty prompt.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A token id outside the vocabulary.
    #[error("token id {0} is outside the vocabulary")]
    BadToken(u32),
    /// Bad sampling settings.
    #[error("{0}")]
    Sampling(String),
    /// The queue is full.
    #[error("the server is busy: {0} requests are already waiting")]
    QueueFull(usize),
    /// The worker has stopped.
    #[error("the engine has stopped")]
    Stopped,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was generated (not included in the output).
    Stop,
    /// `max_tokens` or the context limit was reached.
    Length,
    /// The output looped on one short pattern (the repetition guard ended it).
    Repetition,
    /// The request was cancelled.
    Cancelled,
}

/// Counts and times of a finished request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    /// Prompt tokens (cached + prefilled).
    pub prompt_tokens: usize,
    /// Prompt tokens taken from the prefix cache instead of being prefilled.
    pub cached_tokens: usize,
    /// Tokens generated (the stop token not counted).
    pub completion_tokens: usize,
    /// Time spent queued, ms.
    pub queue_ms: f64,
    /// Prefill time, ms (prompt in, first logits out).
    pub prefill_ms: f64,
    /// Decode time after the first token, ms.
    pub decode_ms: f64,
    /// MTP draft tokens proposed for this request.
    pub draft_tokens: usize,
    /// Of those, accepted.
    pub accepted_draft_tokens: usize,
}

/// What the worker reports for a request, in order: [`GenerationEvent::Started`], any number of
/// [`GenerationEvent::Token`], then exactly one of [`GenerationEvent::Finished`] or [`GenerationEvent::Failed`].
#[derive(Debug, Clone, PartialEq)]
pub enum GenerationEvent {
    /// The request left the queue and prefill began; `cached_tokens` of the prompt come from the prefix cache.
    Started {
        /// Prompt tokens that need no prefill.
        cached_tokens: usize,
    },
    /// Prefill progress, sent after each chunk (also a sign of life during a long prefill).
    Prefilled {
        /// Prompt tokens done (cached ones included).
        done: usize,
        /// Prompt tokens in all.
        total: usize,
    },
    /// One generated token, with its log-probabilities when the request asked for them.
    Token {
        /// The token id.
        id: u32,
        /// Its log-probability and the top alternatives.
        logprobs: Option<TokenLogprobs>,
    },
    /// Generation ended normally.
    Finished { reason: FinishReason, usage: Usage },
    /// The request failed (the engine stays up).
    Failed(GenerationError),
}

/// Why a started request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GenerationError {
    /// The request's constraint (JSON grammar, forced tool call) could not go on.
    #[error("constrained decoding: {0}")]
    Constraint(String),
    /// The model or the device failed on this request (a weight read, a device error, no token possible).
    #[error("{0}")]
    Backend(String),
    /// The worker caught a panic while running the request (a bug; the prefix cache was cleared).
    #[error("internal error: {0}")]
    Internal(String),
}

/// A request's [`TokenConstraint`], shareable so that [`GenerateRequest`] stays `Clone` (clones share it).
#[derive(Clone)]
pub struct ConstraintHandle(pub Arc<std::sync::Mutex<Box<dyn TokenConstraint>>>);

impl ConstraintHandle {
    /// Wraps `constraint`.
    pub fn new(constraint: Box<dyn TokenConstraint>) -> Self {
        Self(Arc::new(std::sync::Mutex::new(constraint)))
    }
}

impl std::fmt::Debug for ConstraintHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConstraintHandle")
    }
}

/// The repetition guard: output whose last `window` tokens repeat one pattern of at most `max_period` tokens
/// is ended with [`FinishReason::Repetition`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RepetitionGuard {
    /// Tokens that must all follow the pattern.
    pub window: usize,
    /// Longest pattern looked for.
    pub max_period: usize,
}

impl RepetitionGuard {
    /// Whether `tokens` end in `window` tokens with a period of at most `max_period`.
    pub fn trips(&self, tokens: &[u32]) -> bool {
        if self.window == 0 || tokens.len() < self.window {
            return false;
        }
        let tail = &tokens[tokens.len() - self.window..];
        (1..=self.max_period.min(self.window / 2)).any(|p| tail[p..].iter().zip(tail).all(|(a, b)| a == b))
    }
}

/// One generation request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// At most this many new tokens.
    pub max_tokens: usize,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Extra stop token ids (besides the model's end-of-turn tokens).
    pub stop_tokens: Vec<u32>,
    /// Set to stop the request (e.g. a stop string matched); checked before each step.
    pub cancel: Arc<AtomicBool>,
    /// Keep generating past the model's end-of-turn tokens, until `max_tokens` (benchmarks, tests); the extra
    /// `stop_tokens` still stop.
    pub ignore_eos: bool,
    /// Report log-probabilities of each token with this many top alternatives (`Some(0)`: the token's only).
    pub logprobs: Option<usize>,
    /// A rule on which tokens may come next (JSON grammar, forced tool call).
    pub constraint: Option<ConstraintHandle>,
    /// Prompt tokens per forward call during prefill (`None`: [`PREFILL_CHUNK`]).
    pub prefill_chunk: Option<usize>,
    /// Ends output that loops (`None`: off).
    pub repetition_guard: Option<RepetitionGuard>,
    /// Use and fill the prefix cache.
    pub use_prefix_cache: bool,
    /// How strictly MTP drafts are verified (greedy requests; sampling uses speculative sampling).
    pub accuracy_level: AccuracyLevel,
    /// Allow MTP drafting for this request (when the model and server have it).
    pub speculative: bool,
}

impl GenerateRequest {
    /// A request with default (greedy) sampling and no extra stops.
    pub fn new(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop_tokens: Vec::new(),
            cancel: Arc::default(),
            ignore_eos: false,
            logprobs: None,
            constraint: None,
            prefill_chunk: None,
            repetition_guard: None,
            use_prefix_cache: true,
            accuracy_level: AccuracyLevel::Strict,
            speculative: true,
        }
    }
}

/// Settings of an [`Engine`].
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Longest sequence (prompt + completion) served; `None` = the model's trained context.
    pub max_context: Option<usize>,
    /// Requests that may wait for the worker; more are refused with [`SubmitError::QueueFull`].
    pub queue_capacity: usize,
    /// The prefix cache's limits.
    pub prefix_cache: PrefixCacheOptions,
    /// Where the experts and the n-gram table go (`None`: everything read through the memory map).
    pub placement: Option<PlacementOptions>,
    /// MTP speculative decoding (server switch): load the model's MTP block and draft with it. Off, the block is
    /// not loaded at all.
    pub mtp: bool,
    /// Where the forward pass runs: the CPU model, or one GPU ([`BackendKind::Cuda`]: the GPU by index and an
    /// optional VRAM budget checked before anything is allocated; all-GPU, or hybrid with a placement). The
    /// prefix cache and MTP drafting work on every backend.
    pub backend: BackendKind,
    /// The CUDA backend's tuning ([`crate::tuning::CudaTuning`]; the service parses it once at start).
    pub cuda_tuning: crate::tuning::CudaTuning,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            max_context: None,
            queue_capacity: 64,
            prefix_cache: PrefixCacheOptions::default(),
            placement: None,
            mtp: true,
            backend: BackendKind::Cpu,
            cuda_tuning: Default::default(),
        }
    }
}

/// Counters of the worker since start, for metrics (read with [`Engine::stats`]).
#[derive(Debug, Default)]
pub struct EngineStats {
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: AtomicUsize,
    /// Of those, tokens found (resumed from a checkpoint, not prefilled).
    pub prefix_hits: AtomicUsize,
    /// Prompt tokens run through the model.
    pub prefilled_tokens: AtomicUsize,
    /// Sequences in the prefix cache now.
    pub cache_entries: AtomicUsize,
    /// Bytes the prefix cache holds now (host and device memory).
    pub cache_bytes: AtomicUsize,
    /// Of those, bytes in device memory (VRAM).
    pub cache_device_bytes: AtomicUsize,
    /// Prefix-cache entries moved from VRAM to host memory since start.
    pub cache_spills: AtomicUsize,
    /// Prompt tokens resumed from entries read back from the on-disk prompt cache.
    pub disk_hits: AtomicUsize,
    /// Entries written to the on-disk prompt cache.
    pub disk_writes: AtomicUsize,
    /// MTP speculative decoding.
    pub speculative: SpecStats,
}

struct Job {
    req: GenerateRequest,
    events: mpsc::UnboundedSender<GenerationEvent>,
    queued: Instant,
}

/// A loaded model with its tokenizer, chat template and worker thread. Cheap to share behind an `Arc`.
pub struct Engine {
    jobs: std::sync::mpsc::SyncSender<Job>,
    stats: Arc<EngineStats>,
    waiting: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
    queue_capacity: usize,
    config: ModelConfig,
    tokenizer: Arc<TextTokenizer>,
    template: Option<Arc<ChatTemplate>>,
    stop_tokens: Vec<u32>,
    max_context: usize,
    name: String,
    placement: Arc<PlacementReport>,
    placement_stats: Arc<PlacementStats>,
    mtp: bool,
    prefix_cache: PrefixCacheOptions,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("name", &self.name)
            .field("max_context", &self.max_context)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Loads the GGUF model at `path` (validating every tensor), its tokenizer and chat template, places its
    /// experts when `opts.placement` says so, and starts the worker thread.
    ///
    /// Errors: [`LoadError`]; a placement that does not fit the budgets or memory is refused here
    /// ([`ModelError::Placement`]), before the worker starts.
    pub fn load(path: &Path, opts: EngineOptions) -> Result<Self, LoadError> {
        let file = Arc::new(GgufFile::open(path).map_err(ModelError::from)?);
        Self::from_gguf(file, opts)
    }

    /// Loads a GGUF model held in memory (e.g. one embedded in the binary). `label` stands for the path in
    /// errors and is the fallback model name; otherwise as [`Engine::load`].
    pub fn from_gguf_bytes(label: &str, bytes: Vec<u8>, opts: EngineOptions) -> Result<Self, LoadError> {
        let file = Arc::new(GgufFile::from_bytes(label, bytes).map_err(ModelError::from)?);
        Self::from_gguf(file, opts)
    }

    /// Builds the engine from a parsed GGUF file: tokenizer, chat template, model (every tensor validated) and
    /// the worker thread.
    fn from_gguf(file: Arc<GgufFile>, opts: EngineOptions) -> Result<Self, LoadError> {
        let path = file.path().to_path_buf();
        let shown = path.display().to_string();
        let vocab = GgufVocab::from_gguf(&file)
            .map_err(|source| LoadError::Tokenizer { path: shown.clone(), source })?
            .ok_or_else(|| LoadError::NoTokenizer { path: shown.clone() })?;
        let tokenizer = Arc::new(
            TextTokenizer::from_gguf_vocab(&vocab)
                .map_err(|source| LoadError::Tokenizer { path: shown.clone(), source })?,
        );
        let template = match file.get_str_opt("tokenizer.chat_template").ok().flatten() {
            Some(src) => Some(Arc::new(
                ChatTemplate::new(src).map_err(|source| LoadError::Template { path: shown.clone(), source })?,
            )),
            None => None,
        };
        let name = file
            .get_str_opt("general.name")
            .ok()
            .flatten()
            .map(str::to_string)
            .unwrap_or_else(|| path.file_stem().map_or("model".into(), |s| s.to_string_lossy().into_owned()));
        let mut model = Qwen4Exp::from_gguf_with(file, LoadOptions { mtp: opts.mtp })?;
        if let Some(p) = &opts.placement {
            model.place(p).map_err(ModelError::from)?;
        }
        let placement = Arc::new(model.placement_report());
        let placement_stats = model.placement_stats();
        let config = model.config.clone();
        let mtp = model.mtp().is_some();
        let disk = open_disk_cache(&model, &opts);
        // The one place the backend is chosen; a placed model on CUDA runs hybrid.
        let backend = Loaded::new(Arc::new(model), opts.backend, &opts.cuda_tuning)
            .map_err(|source| LoadError::Backend { path: shown.clone(), source })?;
        // End of turn: <|im_end|> and <|endoftext|> by name, plus the file's EOS id.
        let mut stop_tokens: Vec<u32> =
            ["<|im_end|>", "<|endoftext|>"].iter().filter_map(|t| tokenizer.token_to_id(t)).collect();
        if let Some(e) = vocab.eos_token_id
            && !stop_tokens.contains(&e)
        {
            stop_tokens.push(e);
        }
        let max_context = opts.max_context.unwrap_or(config.context_length).min(config.context_length).max(1);
        let (jobs, rx) = std::sync::mpsc::sync_channel::<Job>(opts.queue_capacity);
        let waiting = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(AtomicUsize::new(0));
        let stats = Arc::new(EngineStats::default());
        let rules = WorkerRules {
            stop_tokens: stop_tokens.clone(),
            turn_start: tokenizer.token_to_id("<|im_start|>"),
            max_context,
            waiting: waiting.clone(),
            running: running.clone(),
            stats: stats.clone(),
        };
        let cache_opts = opts.prefix_cache.clone();
        let spawn = std::thread::Builder::new().name("nebula-engine".into());
        match backend {
            Loaded::Cpu(m) => spawn.spawn(move || Worker::new(m, rules, cache_opts, disk).run(rx)),
            Loaded::Cuda(m) => {
                spawn.spawn(move || Worker::<CudaModel>::new(Arc::from(m), rules, cache_opts, disk).run(rx))
            }
        }
        .expect("spawning the engine thread");
        Ok(Self {
            jobs,
            stats,
            waiting,
            running,
            queue_capacity: opts.queue_capacity,
            config,
            tokenizer,
            template,
            stop_tokens,
            max_context,
            name,
            placement,
            placement_stats,
            mtp,
            prefix_cache: opts.prefix_cache.clone(),
        })
    }

    /// Queues a request. Returns the channel its events arrive on; dropping the receiver cancels it.
    pub fn submit(&self, req: GenerateRequest) -> Result<mpsc::UnboundedReceiver<GenerationEvent>, SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if req.prompt.len() > self.max_context {
            return Err(SubmitError::PromptTooLong { prompt_tokens: req.prompt.len(), limit: self.max_context });
        }
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= self.config.vocab) {
            return Err(SubmitError::BadToken(t));
        }
        req.sampling.validate().map_err(SubmitError::Sampling)?;
        let (tx, rx) = mpsc::unbounded_channel();
        self.waiting.fetch_add(1, Ordering::SeqCst);
        match self.jobs.try_send(Job { req, events: tx, queued: Instant::now() }) {
            Ok(()) => Ok(rx),
            Err(e) => {
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                Err(match e {
                    std::sync::mpsc::TrySendError::Full(_) => SubmitError::QueueFull(self.queue_capacity),
                    std::sync::mpsc::TrySendError::Disconnected(_) => SubmitError::Stopped,
                })
            }
        }
    }

    /// Model name (`general.name`).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Longest prompt + completion served.
    pub fn max_context(&self) -> usize {
        self.max_context
    }
    /// The model's shapes.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<TextTokenizer> {
        &self.tokenizer
    }
    /// The model's own chat template, if the file has one.
    pub fn chat_template(&self) -> Option<&Arc<ChatTemplate>> {
        self.template.as_ref()
    }
    /// Token ids that end a turn.
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop_tokens
    }
    /// Requests waiting in the queue.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }
    /// Requests being generated (0 or 1).
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }
    /// The worker's counters.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }
    /// Where the experts and the n-gram table were placed at load.
    pub fn placement(&self) -> &Arc<PlacementReport> {
        &self.placement
    }
    /// The placement's counters (expert uses by tier, SSD reads), live.
    pub fn placement_stats(&self) -> &Arc<PlacementStats> {
        &self.placement_stats
    }
    /// The prefix cache's limits (host and device budgets).
    pub fn prefix_cache_options(&self) -> &PrefixCacheOptions {
        &self.prefix_cache
    }
    /// Whether the model drafts with its MTP block (the file has one and the server switch is on).
    pub fn has_mtp(&self) -> bool {
        self.mtp
    }
}

/// The worker's per-token rules for one request (grammar, events, stop rules, checkpoints), driven by the
/// decode loop.
struct RequestSink<'a, B: Backend> {
    req: &'a GenerateRequest,
    events: &'a mpsc::UnboundedSender<GenerationEvent>,
    stop_tokens: &'a [u32],
    output: Vec<u32>,
    completion_tokens: usize,
    checkpoints: &'a mut Vec<Checkpoint<B::Snapshot>>,
    use_cache: bool,
    prompt_len: usize,
    interval: usize,
    next_checkpoint: usize,
    /// Set when the request's constraint failed (the failure is then [`GenerationError::Constraint`]).
    constraint_failed: bool,
}

impl<B: Backend> RequestSink<'_, B> {
    fn constraint<T>(
        &mut self,
        f: impl FnOnce(&mut Box<dyn TokenConstraint>) -> Result<T, String>,
    ) -> Result<Option<T>, String> {
        let out = match &self.req.constraint {
            None => return Ok(None),
            Some(c) => match c.0.lock() {
                Ok(mut guard) => f(&mut guard).map(Some),
                Err(_) => Err("the constraint's lock is poisoned".to_owned()),
            },
        };
        self.constraint_failed |= out.is_err();
        out
    }
}

impl<B: Backend> TokenSink<B> for RequestSink<'_, B> {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        self.constraint(|c| c.mask(logits)).map(|_| ())
    }

    fn needs_logits(&self) -> bool {
        self.req.constraint.is_some() || self.req.logprobs.is_some()
    }

    fn commit(&mut self, token: u32, logits: &[f32], room: bool) -> Result<Flow, String> {
        let req = self.req;
        if (!req.ignore_eos && self.stop_tokens.contains(&token)) || req.stop_tokens.contains(&token) {
            return Ok(Flow::Finish(FinishReason::Stop));
        }
        self.constraint(|c| c.commit(token))?;
        let lp = req.logprobs.map(|n| logprobs_of(logits, token, n));
        self.completion_tokens += 1;
        self.output.push(token);
        if self.events.send(GenerationEvent::Token { id: token, logprobs: lp }).is_err() {
            return Ok(Flow::Finish(FinishReason::Cancelled));
        }
        if self.completion_tokens >= req.max_tokens || !room {
            return Ok(Flow::Finish(FinishReason::Length));
        }
        if req.repetition_guard.is_some_and(|g| g.trips(&self.output)) {
            return Ok(Flow::Finish(FinishReason::Repetition));
        }
        if req.cancel.load(Ordering::Relaxed) || self.events.is_closed() {
            return Ok(Flow::Finish(FinishReason::Cancelled));
        }
        Ok(Flow::Continue)
    }

    fn remaining(&self) -> usize {
        self.req.max_tokens.saturating_sub(self.completion_tokens)
    }

    fn consumed(&mut self, model: &B, state: &B::State) {
        let pos = model.position(state);
        if self.use_cache && pos >= self.next_checkpoint {
            match model.snapshot(state) {
                Ok(snap) => self.checkpoints.push(Checkpoint::new(snap, None)),
                Err(e) => tracing::warn!("prefix cache: no checkpoint at {pos}: {e}"),
            }
            let done = (pos - self.prompt_len) / self.interval;
            self.next_checkpoint = self.prompt_len + (done + 1) * self.interval;
        }
    }
}

/// What every worker shares with its [`Engine`], whatever the backend.
struct WorkerRules {
    stop_tokens: Vec<u32>,
    /// `<|im_start|>`: the prompt gets a checkpoint before each one (turn boundaries).
    turn_start: Option<u32>,
    max_context: usize,
    waiting: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
    stats: Arc<EngineStats>,
}

/// The on-disk prompt cache of `opts` (`prefix_cache.disk_dir`) for `model`, keyed by the model file's identity
/// and the backend whose state layout its entries hold; `None` when it is off or cannot be opened (warned).
fn open_disk_cache(model: &Qwen4Exp, opts: &EngineOptions) -> Option<Arc<DiskCache>> {
    let dir = opts.prefix_cache.disk_dir.as_ref()?;
    // GPU states are kept as images of their device buffers: only the same backend reads them back.
    let layout = match opts.backend {
        BackendKind::Cpu => "cpu",
        BackendKind::Cuda { .. } => "cuda",
    };
    let identity = ModelIdentity::of(model).with_tag(layout);
    match DiskCache::open(dir, opts.prefix_cache.disk_max_bytes, identity) {
        Ok(disk) => {
            tracing::info!(dir = %dir.display(), entries = disk.len(), bytes = disk.bytes(), "on-disk prompt cache");
            Some(Arc::new(disk))
        }
        Err(e) => {
            tracing::warn!("on-disk prompt cache off: {e}");
            None
        }
    }
}

/// Writes finished sequences to the on-disk prompt cache on a thread of its own, one at a time; the worker
/// skips a sequence while a write is in flight rather than wait.
struct DiskWriter {
    disk: Arc<DiskCache>,
    tx: std::sync::mpsc::SyncSender<HostEntry>,
    busy: Arc<AtomicBool>,
}

impl DiskWriter {
    fn start(disk: Arc<DiskCache>, stats: Arc<EngineStats>) -> Self {
        let (tx, rx) = std::sync::mpsc::sync_channel::<HostEntry>(1);
        let busy = Arc::new(AtomicBool::new(false));
        let (d, b) = (disk.clone(), busy.clone());
        std::thread::Builder::new()
            .name("nebula-disk-cache".into())
            .spawn(move || {
                for e in rx {
                    let stored = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        d.store(&e.tokens, &e.state, &e.checkpoints)
                    }));
                    let Ok(stored) = stored else {
                        tracing::error!("on-disk prompt cache: a write panicked; the entry was not written");
                        b.store(false, Ordering::SeqCst);
                        continue;
                    };
                    match stored {
                        Ok(crate::prefix_cache::disk::Stored::Written { .. }) => {
                            stats.disk_writes.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(other) => tracing::debug!("on-disk prompt cache: not written: {other:?}"),
                        Err(err) => tracing::warn!("on-disk prompt cache: {err}"),
                    }
                    b.store(false, Ordering::SeqCst);
                }
            })
            .expect("spawning the disk-cache writer");
        Self { disk, tx, busy }
    }
}

/// The worker thread's side: the backend, the prefix cache of its sequences, and the one generation loop.
struct Worker<B: Backend> {
    backend: Arc<B>,
    rules: WorkerRules,
    cache: PrefixCache<B>,
    disk: Option<DiskWriter>,
}

impl<B: Backend> Worker<B> {
    fn new(backend: Arc<B>, rules: WorkerRules, cache: PrefixCacheOptions, disk: Option<Arc<DiskCache>>) -> Self {
        let disk = disk.map(|d| DiskWriter::start(d, rules.stats.clone()));
        Self { backend, rules, cache: PrefixCache::new(cache), disk }
    }

    /// Reads the on-disk entry that covers more of `prompt` than the in-memory cache does into the in-memory
    /// cache (in host memory; a request resuming from it copies it to the backend).
    fn promote_from_disk(&mut self, prompt: &[u32]) {
        let Some(writer) = &self.disk else { return };
        let covered = self.cache.covered(prompt);
        let Some(hit) = writer.disk.lookup(prompt).filter(|h| h.pos > covered) else { return };
        let Some(loaded) = writer.disk.load(&hit) else { return };
        let HostEntry { tokens, state, checkpoints } = loaded.entry;
        let backend = &*self.backend;
        let checkpoints = checkpoints
            .into_iter()
            .map(|c| {
                let image = Arc::try_unwrap(c.snapshot).unwrap_or_else(|shared| (*shared).clone());
                Checkpoint::new(backend.snapshot_from_image(image), c.logits)
            })
            .collect();
        let state_held = crate::backend::HeldBytes { device: 0, host: state.bytes() };
        self.cache.insert(CacheEntry { tokens, state: crate::backend::Kept::Host(state), checkpoints, state_held });
        // The entry may not have been kept (over the host budget); the request then prefills as without it.
        if self.cache.covered(prompt) >= hit.pos {
            self.rules.stats.disk_hits.fetch_add(hit.pos, Ordering::Relaxed);
        }
    }

    /// A finished state kept for the cache, reallocated for the `end` tokens it holds when it lives on a device:
    /// a GPU state's buffers are sized for the request's whole limit (and carry its chain buffers and graphs),
    /// so it is forked from its last checkpoint (`last`, at `end`) into one sized to its tokens. A state
    /// without device memory, or without a checkpoint at `end`, is kept as it is.
    fn compact(&self, state: B::State, last: Option<&Checkpoint<B::Snapshot>>, end: usize, drafting: bool) -> B::State {
        let backend = &*self.backend;
        let Some(last) = last.filter(|c| c.pos() == end) else { return state };
        if backend.state_held(&state).device == 0 {
            return state;
        }
        let kept = crate::backend::Kept::Live(state);
        match backend.fork(&kept, &last.snapshot, end, drafting) {
            Ok(compact) => compact,
            Err(e) => {
                tracing::warn!("prefix cache: keeping the state at its full size: {e}");
                match kept {
                    crate::backend::Kept::Live(state) => state,
                    crate::backend::Kept::Host(_) => unreachable!("made Live above"),
                }
            }
        }
    }

    /// Hands a host copy of a finished sequence to the disk writer, unless a write is still in flight.
    fn write_to_disk(&self, tokens: &[u32], state: &B::State, checkpoints: &[Checkpoint<B::Snapshot>]) {
        let Some(writer) = &self.disk else { return };
        if writer.busy.swap(true, Ordering::SeqCst) {
            return;
        }
        let backend = &*self.backend;
        let entry = (|| -> Result<HostEntry, crate::backend::BackendError> {
            let checkpoints = checkpoints
                .iter()
                .map(|c| Ok(Checkpoint::new(backend.snapshot_image(&c.snapshot)?, c.logits.clone())))
                .collect::<Result<Vec<_>, crate::backend::BackendError>>()?;
            Ok(HostEntry { tokens: tokens.to_vec(), state: backend.spill_state(state)?, checkpoints })
        })();
        match entry {
            Ok(e) => {
                if writer.tx.try_send(e).is_err() {
                    writer.busy.store(false, Ordering::SeqCst);
                }
            }
            Err(e) => {
                tracing::warn!("on-disk prompt cache: copying the sequence failed: {e}");
                writer.busy.store(false, Ordering::SeqCst);
            }
        }
    }

    fn run(mut self, rx: std::sync::mpsc::Receiver<Job>) {
        while let Ok(job) = rx.recv() {
            self.rules.waiting.fetch_sub(1, Ordering::SeqCst);
            self.rules.running.fetch_add(1, Ordering::SeqCst);
            let events = job.events.clone();
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.generate(job)));
            if let Err(panic) = outcome {
                let msg = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                // The cache may hold a half-updated entry; start it afresh.
                self.cache.clear();
                let _ = events.send(GenerationEvent::Failed(GenerationError::Internal(msg)));
            }
            let stats = &self.rules.stats;
            let held = self.cache.held();
            stats.cache_entries.store(self.cache.len(), Ordering::Relaxed);
            stats.cache_bytes.store(held.device + held.host, Ordering::Relaxed);
            stats.cache_device_bytes.store(held.device, Ordering::Relaxed);
            stats.cache_spills.store(self.cache.spilled(), Ordering::Relaxed);
            self.rules.running.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Positions of the prompt where a checkpoint is taken: before each `<|im_start|>` after the first token,
    /// every `interval` tokens, and the end. Sorted, above `from`.
    fn prompt_checkpoints(&self, prompt: &[u32], from: usize) -> Vec<usize> {
        let interval = self.cache.options().interval.max(1);
        let mut at: Vec<usize> = prompt
            .iter()
            .enumerate()
            .filter(|&(i, t)| i > 0 && Some(*t) == self.rules.turn_start)
            .map(|(i, _)| i)
            .chain((interval..prompt.len()).step_by(interval))
            .chain(std::iter::once(prompt.len()))
            .filter(|&p| p > from)
            .collect();
        at.sort_unstable();
        at.dedup();
        at
    }

    /// The state to run `prompt` on: forked from the prefix cache's best checkpoint (with the cached logits when
    /// it covers the whole prompt, and the entry's earlier checkpoints), or fresh.
    ///
    /// Errors: a fresh state cannot be allocated (a failed fork falls back to a fresh state).
    #[allow(clippy::type_complexity)]
    fn start_state(
        &mut self,
        prompt: &[u32],
        limit: usize,
        drafting: bool,
        use_cache: bool,
    ) -> Result<(B::State, Vec<f32>, Vec<Checkpoint<B::Snapshot>>), crate::backend::BackendError> {
        if use_cache {
            self.promote_from_disk(prompt);
        }
        let backend = &*self.backend;
        if use_cache {
            self.rules.stats.prefix_queries.fetch_add(prompt.len(), Ordering::Relaxed);
            if let Some(hit) = self.cache.lookup(prompt) {
                let pos = hit.checkpoint.pos();
                match backend.fork(&hit.entry.state, &hit.checkpoint.snapshot, limit, drafting) {
                    Ok(state) => {
                        let checkpoints = hit.entry.checkpoints.iter().filter(|c| c.pos() <= pos).cloned().collect();
                        let logits = if pos == prompt.len() { hit.checkpoint.logits.clone() } else { None };
                        return Ok((state, logits.unwrap_or_default(), checkpoints));
                    }
                    Err(e) => tracing::warn!("prefix cache: resuming at {pos} failed, prefilling afresh: {e}"),
                }
            }
        }
        Ok((backend.new_state(limit, drafting)?, Vec::new(), Vec::new()))
    }

    /// Runs one request to its end: resume or start a state, prefill the rest of the prompt in chunks (ending
    /// at checkpoint positions), decode through [`SpeculativeDecoder`], keep the sequence in the prefix cache.
    fn generate(&mut self, job: Job) {
        let Job { req, events, queued } = job;
        let cancelled = || req.cancel.load(Ordering::Relaxed) || events.is_closed();
        let queue_ms = queued.elapsed().as_secs_f64() * 1e3;
        if cancelled() {
            return;
        }
        let fail = |error: GenerationError| {
            let _ = events.send(GenerationEvent::Failed(error));
        };
        let backend = self.backend.clone();
        let stats = self.rules.stats.clone();
        let prompt = &req.prompt;
        let limit = self.rules.max_context.min(prompt.len() + req.max_tokens);
        let use_cache = req.use_prefix_cache && self.cache.enabled();
        let drafting = req.speculative && backend.has_mtp();

        let (mut state, mut logits, mut checkpoints) = match self.start_state(prompt, limit, drafting, use_cache) {
            Ok(s) => s,
            Err(e) => return fail(GenerationError::Backend(e.to_string())),
        };
        let cached_tokens = backend.position(&state);
        stats.prefix_hits.fetch_add(cached_tokens, Ordering::Relaxed);
        let _ = events.send(GenerationEvent::Started { cached_tokens });

        let mut sampler = Sampler::new(req.sampling);
        sampler.observe_prompt(prompt);
        let mut usage = Usage {
            prompt_tokens: prompt.len(),
            cached_tokens,
            completion_tokens: 0,
            queue_ms,
            prefill_ms: 0.0,
            decode_ms: 0.0,
            draft_tokens: 0,
            accepted_draft_tokens: 0,
        };
        let finish = |reason: FinishReason, usage: Usage| {
            let _ = events.send(GenerationEvent::Finished { reason, usage });
        };

        // Prefill what the cache did not cover, in chunks that end at each checkpoint position.
        let t0 = Instant::now();
        let chunk = req.prefill_chunk.unwrap_or(PREFILL_CHUNK).max(1);
        let marks = if use_cache { self.prompt_checkpoints(prompt, cached_tokens) } else { vec![prompt.len()] };
        let mut next_mark = 0;
        let mut pos = cached_tokens;
        while pos < prompt.len() {
            if cancelled() {
                return finish(FinishReason::Cancelled, usage);
            }
            while marks.get(next_mark).is_some_and(|&m| m <= pos) {
                next_mark += 1;
            }
            let end = marks.get(next_mark).copied().unwrap_or(prompt.len()).min(pos + chunk);
            let want = if end == prompt.len() { LogitsFor::Last } else { LogitsFor::None };
            match backend.forward(&mut state, &prompt[pos..end], want) {
                Ok(l) => logits = l,
                Err(e) => return fail(GenerationError::Backend(e.to_string())),
            }
            stats.prefilled_tokens.fetch_add(end - pos, Ordering::Relaxed);
            pos = end;
            if use_cache && marks.contains(&end) {
                match backend.snapshot(&state) {
                    Ok(snap) => {
                        let keep = (end == prompt.len()).then(|| logits.clone());
                        checkpoints.push(Checkpoint::new(snap, keep));
                    }
                    Err(e) => tracing::warn!("prefix cache: no checkpoint at {end}: {e}"),
                }
            }
            let _ = events.send(GenerationEvent::Prefilled { done: end, total: prompt.len() });
        }
        usage.prefill_ms = t0.elapsed().as_secs_f64() * 1e3;

        let t1 = Instant::now();
        let interval = self.cache.options().interval.max(1);
        let opts = SpeculativeOptions { enabled: drafting, level: req.accuracy_level, ..SpeculativeOptions::default() };
        let mut decoder = SpeculativeDecoder::new(&*backend, opts, Some(&stats.speculative));
        let mut sink = RequestSink::<B> {
            req: &req,
            events: &events,
            stop_tokens: &self.rules.stop_tokens,
            output: Vec::new(),
            completion_tokens: 0,
            checkpoints: &mut checkpoints,
            use_cache,
            prompt_len: prompt.len(),
            interval,
            next_checkpoint: prompt.len() + interval,
            constraint_failed: false,
        };
        let outcome = decoder.run(&mut state, logits, &mut sampler, &mut sink, limit);
        let output = std::mem::take(&mut sink.output);
        let constraint_failed = sink.constraint_failed;
        usage.completion_tokens = sink.completion_tokens;
        usage.draft_tokens = decoder.report.drafted;
        usage.accepted_draft_tokens = decoder.report.accepted;
        let reason = match outcome {
            Ok(o) => o.reason,
            Err(DecodeError::Request(m)) if constraint_failed => return fail(GenerationError::Constraint(m)),
            Err(e) => return fail(GenerationError::Backend(e.to_string())),
        };
        usage.decode_ms = t1.elapsed().as_secs_f64() * 1e3;
        finish(reason, usage);

        // Keep the sequence: every token the state consumed, with a checkpoint at its end.
        let end = backend.position(&state);
        if use_cache && end >= prompt.len() {
            if checkpoints.last().is_none_or(|c| c.pos() != end) {
                match backend.snapshot(&state) {
                    Ok(snap) => checkpoints.push(Checkpoint::new(snap, None)),
                    Err(e) => tracing::warn!("prefix cache: no checkpoint at {end}: {e}"),
                }
            }
            let mut tokens = prompt.clone();
            tokens.extend_from_slice(&output[..end - prompt.len()]);
            let state = self.compact(state, checkpoints.last(), end, drafting);
            self.write_to_disk(&tokens, &state, &checkpoints);
            self.cache.insert(CacheEntry::new(&*backend, tokens, state, checkpoints));
            self.cache.fit_device_budget(&backend);
        }
    }
}

impl<B: Backend> Drop for Worker<B> {
    fn drop(&mut self) {
        // Cached device states go before the backend they were allocated on.
        self.cache.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::RepetitionGuard;

    #[test]
    fn repetition_guard_trips_on_a_looping_tail_only() {
        let guard = RepetitionGuard { window: 8, max_period: 3 };
        assert!(guard.trips(&[9, 1, 2, 1, 2, 1, 2, 1, 2]), "period 2 over the last 8");
        assert!(guard.trips(&[5; 8]), "period 1");
        assert!(!guard.trips(&[1, 2, 1, 2, 1, 2, 1]), "shorter than the window");
        assert!(!guard.trips(&[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4]), "period 4 is over max_period");
        assert!(!guard.trips(&[1, 2, 1, 2, 1, 2, 1, 3]), "the last token breaks the pattern");
        assert!(!RepetitionGuard { window: 0, max_period: 3 }.trips(&[5; 8]), "window 0 is off");
    }
}
