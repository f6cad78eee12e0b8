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

mod cache;
mod scheduler;

use cache::open_disk_cache;
use scheduler::{Worker, WorkerRules};

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use tokio::sync::mpsc;

use crate::backend::cuda::CudaModel;
use crate::backend::{Backend, BackendKind, Loaded};
use crate::gguf::GgufFile;
use crate::model::{LoadOptions, ModelConfig, ModelError, Qwen4Exp};
use crate::placement::{PlacementOptions, PlacementReport, PlacementStats};
use crate::prefix_cache::PrefixCacheOptions;
use crate::sampling::{SamplingParams, TokenConstraint, TokenLogprobs};
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
    /// One sequence of the full context would not fit in the memory left after the weights.
    #[error(
        "a sequence of max_context = {max_context} tokens needs {need_mib} MiB of {memory} (KV cache {kv_cache}{window}) \
         but {have_mib} MiB are left after the weights: lower max_context, or use kv_cache_type = \"q8_0\"{hint}"
    )]
    ContextTooLarge {
        /// The context limit asked for, tokens.
        max_context: usize,
        /// `VRAM` or `host memory`.
        memory: &'static str,
        /// What one full state holds there, MiB.
        need_mib: usize,
        /// What is free there, MiB.
        have_mib: usize,
        /// The cache type in effect.
        kv_cache: crate::model::KvCacheType,
        /// `, kv_window N` when a window is in effect.
        window: String,
        /// A further way out.
        hint: &'static str,
    },
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
    /// The request's state (its prompt plus `max_tokens`) needs more memory than all running sequences may hold.
    #[error(
        "the request needs {need_mib} MiB of sequence state (prompt plus max_tokens), more than this server's \
         {budget_mib} MiB for running sequences; ask for fewer max_tokens or a shorter prompt"
    )]
    StateTooLarge { need_mib: usize, budget_mib: usize },
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
    /// Images or video in the prompt: the features placed at their pad tokens, every prompt token's 3-D rope
    /// position and the prefix-cache key that tells images apart (`None`: a text prompt).
    pub media: Option<Arc<crate::vision::MediaPrompt>>,
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
            media: None,
        }
    }

    /// What the prefix cache keys this prompt by: the prompt, with a media prompt's vision tokens replaced by
    /// ids derived from their images' content ([`crate::vision::MediaPrompt::cache_key`]).
    pub fn cache_key(&self) -> &[u32] {
        self.media.as_ref().map_or(&self.prompt, |m| &m.cache_key)
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
    /// How the attention caches store their rows ([`crate::model::KvCacheType`]; `f32`, the exact path, by
    /// default), on every backend.
    pub kv_cache: crate::model::KvCacheType,
    /// Where the forward pass runs: the CPU model, or one GPU ([`BackendKind::Cuda`]: the GPU by index and an
    /// optional VRAM budget checked before anything is allocated; all-GPU, or hybrid with a placement). The
    /// prefix cache and MTP drafting work on every backend.
    pub backend: BackendKind,
    /// The CUDA backend's tuning ([`crate::tuning::CudaTuning`]; the service parses it once at start).
    pub cuda_tuning: crate::tuning::CudaTuning,
    /// Continuous batching: how many sequences run together and within what limits.
    pub batch: BatchOptions,
    /// Called after every batched pass (metrics).
    pub step_observer: Option<StepObserver>,
    /// Benchmarks: the seed of a realistic routing ([`crate::synth::routing::RealisticRouting`]) put in place of
    /// the trunk's routers; `None` (serving): the routers' own choice.
    pub realistic_routing: Option<u64>,
}

/// Limits of continuous batching (see the worker's scheduler: requests are admitted into a running batch and
/// decoded together, new prompts prefilled in chunks inside the same steps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchOptions {
    /// Sequences running at once at most; 1 runs one request at a time (batching off).
    pub max_sequences: usize,
    /// Tokens one pass runs at most, decode rows and prefill chunks together; `None`: the decode rows plus
    /// one prefill chunk, or several short ones while they total at most [`PREFILL_CHUNK`] tokens.
    pub max_batch_tokens: Option<usize>,
    /// Bytes of sequence state (KV caches, recurrent states, MTP caches; host and device together) the running
    /// sequences may reserve, each what its state holds once full ([`crate::backend::Backend::state_bytes`]);
    /// `None`: no limit beyond `max_sequences` on the GPU (allocation is the limit), half of `MemAvailable` on the
    /// CPU. A request that alone needs more than a configured budget is refused; over the CPU's default one, it
    /// runs alone.
    pub state_budget: Option<usize>,
    /// MTP chains are drafted only while at most this many sequences decode (each drafting on its own); in
    /// bigger batches every sequence takes plain steps in the shared pass.
    pub speculative_max_batch: usize,
    /// How the shared pass may order its sums ([`BatchMode`]; the CPU is always deterministic).
    pub mode: crate::backend::BatchMode,
}

impl Default for BatchOptions {
    fn default() -> Self {
        Self {
            max_sequences: 16,
            max_batch_tokens: None,
            state_budget: None,
            speculative_max_batch: 1,
            mode: crate::backend::BatchMode::Fast,
        }
    }
}

/// One batched pass, as reported to a [`StepObserver`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Sequences in the pass.
    pub sequences: usize,
    /// Tokens the pass ran (decode rows and prefill chunk tokens).
    pub tokens: usize,
    /// Of those, decode rows.
    pub decode_rows: usize,
    /// Wall time of the pass, seconds.
    pub seconds: f64,
}

/// A callback run on the engine thread after every batched pass (keep it cheap: it holds up the batch).
#[derive(Clone)]
pub struct StepObserver(pub Arc<dyn Fn(&StepReport) + Send + Sync>);

impl std::fmt::Debug for StepObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepObserver")
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            max_context: None,
            queue_capacity: 64,
            prefix_cache: PrefixCacheOptions::default(),
            placement: None,
            mtp: true,
            kv_cache: crate::model::KvCacheType::F32,
            backend: BackendKind::Cpu,
            cuda_tuning: Default::default(),
            batch: BatchOptions::default(),
            step_observer: None,
            realistic_routing: None,
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
    /// Bytes of state the running sequences reserved (see [`BatchOptions::state_budget`]).
    pub reserved_state_bytes: AtomicUsize,
    /// Batched passes run since start.
    pub batch_steps: AtomicUsize,
    /// Tokens those passes ran (decode rows and prefill tokens).
    pub batch_rows: AtomicUsize,
}

struct Job {
    req: GenerateRequest,
    events: mpsc::UnboundedSender<GenerationEvent>,
    queued: Instant,
    /// Further choices of the same prompt, forked from this one's state once its prompt is read.
    followers: Vec<(GenerateRequest, mpsc::UnboundedSender<GenerationEvent>)>,
}

/// A loaded model with its tokenizer, chat template and worker thread. Cheap to share behind an `Arc`.
pub struct Engine {
    jobs: std::sync::mpsc::Sender<Job>,
    batch: BatchOptions,
    /// Whether the state budget was configured (a request over it is refused) or defaulted (it runs alone).
    budget_explicit: bool,
    max_sequences: Arc<AtomicUsize>,
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
    accepts_media: bool,
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
        let mut model = Qwen4Exp::from_gguf_with(file, LoadOptions { mtp: opts.mtp, kv_cache: opts.kv_cache })?;
        if let Some(p) = &opts.placement {
            model.place(p).map_err(ModelError::from)?;
        }
        if let Some(seed) = opts.realistic_routing {
            let routing = crate::synth::routing::RealisticRouting::new(model.routing_shape(), seed).map_err(|e| {
                ModelError::RoutingShape { given: e.to_string(), model: format!("{:?}", model.routing_shape()) }
            })?;
            model.set_routing_override(Some(Arc::new(routing)))?;
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
        check_context_fits(&backend, max_context, mtp)?;
        let (jobs, rx) = std::sync::mpsc::channel::<Job>();
        let waiting = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(AtomicUsize::new(0));
        let stats = Arc::new(EngineStats::default());
        let mut batch = opts.batch;
        batch.max_sequences = batch.max_sequences.max(1);
        // A pass must hold a decode row of every sequence and a token of prefill.
        batch.max_batch_tokens = batch.max_batch_tokens.map(|b| b.max(batch.max_sequences + 1));
        let budget_explicit = batch.state_budget.is_some();
        if batch.state_budget.is_none() && matches!(opts.backend, BackendKind::Cpu) {
            // Host states grow as they fill: keep what they may reserve to half the memory free now. A request
            // that needs more than this default runs alone rather than being refused.
            batch.state_budget = mem_available().map(|b| b / 2);
        }
        let max_sequences = Arc::new(AtomicUsize::new(batch.max_sequences));
        let rules = WorkerRules {
            stop_tokens: stop_tokens.clone(),
            turn_start: tokenizer.token_to_id("<|im_start|>"),
            max_context,
            waiting: waiting.clone(),
            running: running.clone(),
            stats: stats.clone(),
            batch,
            budget_explicit,
            max_sequences: max_sequences.clone(),
            observer: opts.step_observer.clone(),
        };
        let cache_opts = opts.prefix_cache.clone();
        let accepts_media = match &backend {
            Loaded::Cpu(m) => m.accepts_media(),
            Loaded::Cuda(m) => m.accepts_media(),
        };
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
            batch,
            budget_explicit,
            max_sequences,
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
            accepts_media,
            mtp,
            prefix_cache: opts.prefix_cache.clone(),
        })
    }

    /// Queues a request. Returns the channel its events arrive on; dropping the receiver cancels it.
    ///
    /// Errors: [`SubmitError`]: a bad prompt or sampling setting, a state larger than the batch's whole state
    /// budget, a full queue ([`EngineOptions::queue_capacity`] requests waiting), a stopped engine.
    pub fn submit(&self, req: GenerateRequest) -> Result<mpsc::UnboundedReceiver<GenerationEvent>, SubmitError> {
        let mut rx = self.submit_choices(vec![req])?;
        Ok(rx.pop().expect("one receiver per request"))
    }

    /// Queues several choices of one prompt (`n` > 1) as one job: they are admitted together, the first reads
    /// the prompt, and its state is forked for the others at the prompt's end, so the prompt is prefilled once;
    /// then every choice decodes in the batch with its own sampler, constraint and stop rules. A choice's output
    /// equals that of the same request submitted alone (a fork at the prompt's end holds exactly what its own
    /// prefill would have). Returns one event channel per request, in order.
    ///
    /// Errors: as [`Engine::submit`]; [`SubmitError::Sampling`] when the requests' prompts differ or the list
    /// is empty.
    pub fn submit_choices(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<mpsc::UnboundedReceiver<GenerationEvent>>, SubmitError> {
        let Some(first) = reqs.first() else { return Err(SubmitError::Sampling("no choices to generate".into())) };
        if reqs.iter().any(|r| r.prompt != first.prompt) {
            return Err(SubmitError::Sampling("the choices of one job share one prompt".into()));
        }
        if first.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if first.prompt.len() > self.max_context {
            return Err(SubmitError::PromptTooLong { prompt_tokens: first.prompt.len(), limit: self.max_context });
        }
        if let Some(&t) = first.prompt.iter().find(|&&t| t as usize >= self.config.vocab) {
            return Err(SubmitError::BadToken(t));
        }
        for r in &reqs {
            r.sampling.validate().map_err(SubmitError::Sampling)?;
        }
        if let Some(budget) = self.batch.state_budget.filter(|_| self.budget_explicit) {
            let need: usize = reqs
                .iter()
                .map(|r| {
                    let limit = self.max_context.min(r.prompt.len() + r.max_tokens);
                    self.config.state_bytes(limit, self.mtp && r.speculative)
                })
                .sum();
            if need > budget {
                return Err(SubmitError::StateTooLarge { need_mib: need.div_ceil(1 << 20), budget_mib: budget >> 20 });
            }
        }
        let n = reqs.len();
        // Reserve the queue places first, so concurrent submissions never exceed the capacity.
        let reserved = self.waiting.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
            (w + n <= self.queue_capacity.max(n)).then_some(w + n)
        });
        if reserved.is_err() {
            return Err(SubmitError::QueueFull(self.queue_capacity));
        }
        let mut receivers = Vec::with_capacity(n);
        let mut senders = Vec::with_capacity(n);
        for _ in 0..n {
            let (tx, rx) = mpsc::unbounded_channel();
            senders.push(tx);
            receivers.push(rx);
        }
        let mut pairs = reqs.into_iter().zip(senders);
        let (req, events) = pairs.next().expect("one choice at least");
        let job = Job { req, events, queued: Instant::now(), followers: pairs.collect() };
        match self.jobs.send(job) {
            Ok(()) => Ok(receivers),
            Err(_) => {
                self.waiting.fetch_sub(n, Ordering::SeqCst);
                Err(SubmitError::Stopped)
            }
        }
    }

    /// Sets how many sequences may run at once from the next admission on (1: batching off); running ones go
    /// on. For A/B benchmarks in one process.
    pub fn set_max_sequences(&self, n: usize) {
        self.max_sequences.store(n.max(1), Ordering::Relaxed);
    }

    /// The batching limits in force (the state budget filled in where it defaulted).
    pub fn batch_options(&self) -> &BatchOptions {
        &self.batch
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
    /// Requests being generated (running in the batch).
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
    /// Whether the backend takes prompts with images ([`GenerateRequest::media`]); the CPU backend does.
    pub fn accepts_media(&self) -> bool {
        self.accepts_media
    }

    /// Whether the model drafts with its MTP block (the file has one and the server switch is on).
    pub fn has_mtp(&self) -> bool {
        self.mtp
    }
}

/// `MemAvailable` of `/proc/meminfo`, bytes (`None` where there is no such file).
/// Refuses a context limit one sequence of which (its state once full, drafting included when the model has an
/// MTP block) cannot fit: on the GPU in the VRAM free after the weights (within the budget) and in host memory
/// (the host copies of windowed caches), on the CPU in `MemAvailable`.
///
/// Errors: [`LoadError::ContextTooLarge`] naming the numbers; a device query failed.
fn check_context_fits(backend: &Loaded, max_context: usize, mtp: bool) -> Result<(), LoadError> {
    const MIB: usize = 1 << 20;
    let available = mem_available();
    let (held, device_room, window) = match backend {
        Loaded::Cpu(m) => {
            (crate::backend::HeldBytes { device: 0, host: m.config.state_bytes(max_context, mtp) }, None, 0)
        }
        Loaded::Cuda(m) => {
            let room = m.state_room().map_err(|source| LoadError::Backend { path: String::new(), source })?;
            (m.state_alloc_bytes(max_context, mtp), Some(room), m.kv_window())
        }
    };
    let kv_cache = backend.config().kv_cache;
    let window_text = if window > 0 { format!(", kv_window {window}") } else { String::new() };
    if let Some(room) = device_room
        && held.device > room
    {
        return Err(LoadError::ContextTooLarge {
            max_context,
            memory: "VRAM",
            need_mib: held.device.div_ceil(MIB),
            have_mib: room / MIB,
            kv_cache,
            window: window_text,
            hint: ", or keep fewer tokens in VRAM with kv_window",
        });
    }
    if let Some(avail) = available
        && held.host > avail
    {
        return Err(LoadError::ContextTooLarge {
            max_context,
            memory: "host memory",
            need_mib: held.host.div_ceil(MIB),
            have_mib: avail / MIB,
            kv_cache,
            window: window_text,
            hint: if window > 0 { ", or a larger kv_window" } else { "" },
        });
    }
    Ok(())
}

fn mem_available() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
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
