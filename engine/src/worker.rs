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

use crate::backend::BackendKind;
use crate::backend::cuda::{CudaModel, CudaState};
use crate::gguf::GgufFile;
use crate::model::{LoadOptions, LogitsFor, ModelConfig, ModelError, Qwen4Exp, SequenceState};
use crate::placement::{PlacementOptions, PlacementReport, PlacementStats};
use crate::prefix_cache::{CacheEntry, Checkpoint, PrefixCache, PrefixCacheOptions};
use crate::sampling::{Sampler, SamplingParams, TokenConstraint, TokenLogprobs, logprobs_of};
use crate::speculative::decoder::{Flow, SpeculativeDecoder, SpeculativeOptions, TokenSink};
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
    /// The model failed on this request (the engine stays up).
    Failed(String),
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
    /// Where the forward pass runs: the CPU model, or every weight on one GPU ([`BackendKind::Cuda`]: the GPU by
    /// index and an optional VRAM budget checked before anything is allocated). On the GPU the prefix cache and
    /// MTP drafting are not used yet (their state snapshots are CPU-side).
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
    /// Bytes the prefix cache holds now.
    pub cache_bytes: AtomicUsize,
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
        let model = Arc::new(model);
        let gpu = match opts.backend {
            BackendKind::Cpu => None,
            // A placed model runs hybrid: GPU-tier experts on the GPU, the rest on the CPU.
            BackendKind::Cuda { device, vram_budget } => Some(Box::new(
                CudaModel::for_model(model.clone(), device, vram_budget, &opts.cuda_tuning)
                    .map_err(|source| LoadError::Backend { path: shown.clone(), source })?,
            )),
        };
        let config = model.config.clone();
        let mtp = model.mtp().is_some();
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
        let worker = Worker {
            model,
            gpu,
            stop_tokens: stop_tokens.clone(),
            turn_start: tokenizer.token_to_id("<|im_start|>"),
            max_context,
            waiting: waiting.clone(),
            running: running.clone(),
            cache: PrefixCache::new(opts.prefix_cache.clone()),
            stats: stats.clone(),
        };
        std::thread::Builder::new()
            .name("nebula-engine".into())
            .spawn(move || worker.run(rx))
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
    /// Whether the model drafts with its MTP block (the file has one and the server switch is on).
    pub fn has_mtp(&self) -> bool {
        self.mtp
    }
}

/// The worker's per-token rules for one request (grammar, events, stop rules, checkpoints), driven by the
/// decode loop.
struct RequestSink<'a> {
    req: &'a GenerateRequest,
    events: &'a mpsc::UnboundedSender<GenerationEvent>,
    stop_tokens: &'a [u32],
    output: Vec<u32>,
    completion_tokens: usize,
    checkpoints: &'a mut Vec<Checkpoint>,
    use_cache: bool,
    prompt_len: usize,
    interval: usize,
    next_checkpoint: usize,
}

impl RequestSink<'_> {
    fn constraint<T>(
        &self,
        f: impl FnOnce(&mut Box<dyn TokenConstraint>) -> Result<T, String>,
    ) -> Result<Option<T>, String> {
        match &self.req.constraint {
            None => Ok(None),
            Some(c) => {
                let mut guard =
                    c.0.lock().map_err(|_| "constrained decoding: the constraint's lock is poisoned".to_owned())?;
                f(&mut guard).map(Some).map_err(|e| format!("constrained decoding: {e}"))
            }
        }
    }
}

impl TokenSink<SequenceState> for RequestSink<'_> {
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

    fn consumed(&mut self, state: &SequenceState) {
        if self.use_cache && state.pos >= self.next_checkpoint {
            self.checkpoints.push(Checkpoint { snapshot: state.snapshot(), logits: None });
            let done = (state.pos - self.prompt_len) / self.interval;
            self.next_checkpoint = self.prompt_len + (done + 1) * self.interval;
        }
    }
}

struct Worker {
    model: Arc<Qwen4Exp>,
    /// The GPU copy of the model when the backend is CUDA (then every forward runs there).
    gpu: Option<Box<CudaModel>>,
    stop_tokens: Vec<u32>,
    /// `<|im_start|>`: the prompt gets a checkpoint before each one (turn boundaries).
    turn_start: Option<u32>,
    max_context: usize,
    waiting: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
    cache: PrefixCache,
    stats: Arc<EngineStats>,
}

impl Worker {
    fn run(mut self, rx: std::sync::mpsc::Receiver<Job>) {
        while let Ok(job) = rx.recv() {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            self.running.fetch_add(1, Ordering::SeqCst);
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
                let _ = events.send(GenerationEvent::Failed(format!("internal error: {msg}")));
            }
            self.stats.cache_entries.store(self.cache.len(), Ordering::Relaxed);
            self.stats.cache_bytes.store(self.cache.bytes(), Ordering::Relaxed);
            self.running.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Positions of the prompt where a checkpoint is taken: before each `<|im_start|>` after the first token,
    /// every `interval` tokens, and the end. Sorted, above `from`.
    fn prompt_checkpoints(&self, prompt: &[u32], from: usize) -> Vec<usize> {
        let interval = self.cache.options().interval.max(1);
        let mut at: Vec<usize> = prompt
            .iter()
            .enumerate()
            .filter(|&(i, t)| i > 0 && Some(*t) == self.turn_start)
            .map(|(i, _)| i)
            .chain((interval..prompt.len()).step_by(interval))
            .chain(std::iter::once(prompt.len()))
            .filter(|&p| p > from)
            .collect();
        at.sort_unstable();
        at.dedup();
        at
    }

    fn generate(&mut self, job: Job) {
        if let Some(gpu) = self.gpu.take() {
            self.generate_on_gpu(&gpu, job);
            self.gpu = Some(gpu);
            return;
        }
        let Job { req, events, queued } = job;
        let cancelled = || req.cancel.load(Ordering::Relaxed) || events.is_closed();
        let queue_ms = queued.elapsed().as_secs_f64() * 1e3;
        if cancelled() {
            return;
        }
        let prompt = &req.prompt;
        let limit = self.max_context.min(prompt.len() + req.max_tokens);
        let use_cache = req.use_prefix_cache && self.cache.enabled();

        // Resume from the best checkpoint, or start afresh.
        let mut checkpoints: Vec<Checkpoint> = Vec::new();
        let mut resumed: Option<(SequenceState, Option<Vec<f32>>)> = None;
        if use_cache {
            self.stats.prefix_queries.fetch_add(prompt.len(), Ordering::Relaxed);
            if let Some(hit) = self.cache.lookup(prompt) {
                let pos = hit.checkpoint.snapshot.pos();
                if let Ok(state) = self.model.fork_state(&hit.entry.state, &hit.checkpoint.snapshot, limit) {
                    checkpoints = hit.entry.checkpoints.iter().filter(|c| c.snapshot.pos() <= pos).cloned().collect();
                    let logits = if pos == prompt.len() { hit.checkpoint.logits.clone() } else { None };
                    resumed = Some((state, logits));
                }
            }
        }
        let (mut state, mut logits) = match resumed {
            Some((state, logits)) => (state, logits.unwrap_or_default()),
            None => (self.model.new_state(limit), Vec::new()),
        };
        let cached_tokens = state.pos;
        self.stats.prefix_hits.fetch_add(cached_tokens, Ordering::Relaxed);
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
        let fail = |message: String| {
            let _ = events.send(GenerationEvent::Failed(message));
        };

        // Prefill what the cache did not cover, in chunks that end at each checkpoint position.
        let t0 = Instant::now();
        let chunk = req.prefill_chunk.unwrap_or(PREFILL_CHUNK).max(1);
        let marks = if use_cache { self.prompt_checkpoints(prompt, state.pos) } else { vec![prompt.len()] };
        let mut next_mark = 0;
        while state.pos < prompt.len() {
            if cancelled() {
                return finish(FinishReason::Cancelled, usage);
            }
            while marks.get(next_mark).is_some_and(|&m| m <= state.pos) {
                next_mark += 1;
            }
            let end = marks.get(next_mark).copied().unwrap_or(prompt.len()).min(state.pos + chunk);
            let want = if end == prompt.len() { LogitsFor::Last } else { LogitsFor::None };
            let from = state.pos;
            let n = end - from;
            match self.model.forward(&mut state, &prompt[from..end], want) {
                Ok(l) => logits = l,
                Err(e) => return fail(e.to_string()),
            }
            self.stats.prefilled_tokens.fetch_add(n, Ordering::Relaxed);
            if use_cache && marks.contains(&end) {
                let keep = (end == prompt.len()).then(|| logits.clone());
                checkpoints.push(Checkpoint { snapshot: state.snapshot(), logits: keep });
            }
            let _ = events.send(GenerationEvent::Prefilled { done: end, total: prompt.len() });
        }
        usage.prefill_ms = t0.elapsed().as_secs_f64() * 1e3;

        let t1 = Instant::now();
        let interval = self.cache.options().interval.max(1);
        let opts =
            SpeculativeOptions { enabled: req.speculative, level: req.accuracy_level, ..SpeculativeOptions::default() };
        let mut decoder = SpeculativeDecoder::new(&*self.model, opts, Some(&self.stats.speculative));
        let mut sink = RequestSink {
            req: &req,
            events: &events,
            stop_tokens: &self.stop_tokens,
            output: Vec::new(),
            completion_tokens: 0,
            checkpoints: &mut checkpoints,
            use_cache,
            prompt_len: prompt.len(),
            interval,
            next_checkpoint: prompt.len() + interval,
        };
        let outcome = decoder.run(&mut state, logits, &mut sampler, &mut sink, limit);
        let output = std::mem::take(&mut sink.output);
        usage.completion_tokens = sink.completion_tokens;
        usage.draft_tokens = decoder.report.drafted;
        usage.accepted_draft_tokens = decoder.report.accepted;
        let reason = match outcome {
            Ok(o) => o.reason,
            Err(e) => return fail(e),
        };
        usage.decode_ms = t1.elapsed().as_secs_f64() * 1e3;
        finish(reason, usage);

        // Keep the sequence: every token the state consumed, with a checkpoint at its end.
        if use_cache && state.pos >= prompt.len() {
            if checkpoints.last().is_none_or(|c| c.snapshot.pos() != state.pos) {
                checkpoints.push(Checkpoint { snapshot: state.snapshot(), logits: None });
            }
            let mut tokens = prompt.clone();
            tokens.extend_from_slice(&output[..state.pos - prompt.len()]);
            self.cache.insert(CacheEntry { tokens, state, checkpoints });
        }
    }
}

impl Worker {
    /// [`Worker::generate`] on the GPU model: prefill in chunks, then the same decode loop, sampler, grammar and
    /// stop rules as on the CPU (through [`SpeculativeDecoder`], drafting with the GPU's MTP block when loaded). No prefix cache: its
    /// checkpoints are CPU states.
    fn generate_on_gpu(&self, gpu: &CudaModel, job: Job) {
        let Job { req, events, queued } = job;
        let cancelled = || req.cancel.load(Ordering::Relaxed) || events.is_closed();
        let queue_ms = queued.elapsed().as_secs_f64() * 1e3;
        if cancelled() {
            return;
        }
        let prompt = &req.prompt;
        let limit = self.max_context.min(prompt.len() + req.max_tokens);
        let fail = |message: String| {
            let _ = events.send(GenerationEvent::Failed(message));
        };
        // Drafting with the GPU's MTP block; without it the state needs no MTP cache.
        let drafting = req.speculative && gpu.has_mtp();
        let mut state = match gpu.new_state_with(limit, drafting) {
            Ok(s) => s,
            Err(e) => return fail(e.to_string()),
        };
        let _ = events.send(GenerationEvent::Started { cached_tokens: 0 });
        let mut sampler = Sampler::new(req.sampling);
        sampler.observe_prompt(prompt);
        let mut usage = Usage {
            prompt_tokens: prompt.len(),
            cached_tokens: 0,
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
        let t0 = Instant::now();
        let chunk = req.prefill_chunk.unwrap_or(PREFILL_CHUNK).max(1);
        let mut logits = Vec::new();
        while state.pos < prompt.len() {
            if cancelled() {
                return finish(FinishReason::Cancelled, usage);
            }
            let (from, end) = (state.pos, (state.pos + chunk).min(prompt.len()));
            let want = if end == prompt.len() { LogitsFor::Last } else { LogitsFor::None };
            match gpu.forward(&mut state, &prompt[from..end], want) {
                Ok(l) => logits = l,
                Err(e) => return fail(e.to_string()),
            }
            self.stats.prefilled_tokens.fetch_add(end - from, Ordering::Relaxed);
            let _ = events.send(GenerationEvent::Prefilled { done: end, total: prompt.len() });
        }
        usage.prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        let t1 = Instant::now();
        let opts = SpeculativeOptions { enabled: drafting, level: req.accuracy_level, ..SpeculativeOptions::default() };
        let mut decoder = SpeculativeDecoder::new(gpu, opts, Some(&self.stats.speculative));
        let mut checkpoints = Vec::new();
        let mut sink = RequestSink {
            req: &req,
            events: &events,
            stop_tokens: &self.stop_tokens,
            output: Vec::new(),
            completion_tokens: 0,
            checkpoints: &mut checkpoints,
            use_cache: false,
            prompt_len: prompt.len(),
            interval: usize::MAX,
            next_checkpoint: usize::MAX,
        };
        let outcome = decoder.run(&mut state, logits, &mut sampler, &mut sink, limit);
        usage.completion_tokens = sink.completion_tokens;
        usage.draft_tokens = decoder.report.drafted;
        usage.accepted_draft_tokens = decoder.report.accepted;
        match outcome {
            Ok(o) => {
                usage.decode_ms = t1.elapsed().as_secs_f64() * 1e3;
                finish(o.reason, usage)
            }
            Err(e) => fail(e),
        }
    }
}

/// The decode loop's sink on the GPU: the same rules; no checkpoints (the state lives on the device).
impl TokenSink<CudaState> for RequestSink<'_> {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        <Self as TokenSink<SequenceState>>::mask(self, logits)
    }

    fn commit(&mut self, token: u32, logits: &[f32], room: bool) -> Result<Flow, String> {
        <Self as TokenSink<SequenceState>>::commit(self, token, logits, room)
    }

    fn remaining(&self) -> usize {
        <Self as TokenSink<SequenceState>>::remaining(self)
    }

    fn needs_logits(&self) -> bool {
        <Self as TokenSink<SequenceState>>::needs_logits(self)
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
