//! The generation worker: one thread that owns the model and runs requests from a bounded queue.
//!
//! The HTTP service never touches tensors: it renders and tokenizes the prompt, hands an [`GenerateRequest`] to
//! [`Engine::submit`], and reads [`GenerationEvent`]s from the returned channel. Each request gets its own
//! sequence state and sampler. Generation stops at a stop token (`<|im_end|>`, `<|endoftext|>` and any extra
//! ones), at `max_tokens`, at the context limit, or when the request is cancelled — by its cancel flag or by the
//! receiver being dropped (the client went away); the check runs before every decode step and between prefill
//! chunks, so a cancelled request frees the worker within one step.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use tokio::sync::mpsc;

use crate::gguf::GgufFile;
use crate::model::{LogitsFor, ModelConfig, ModelError, Qwen4Exp};
use crate::sampling::{Sampler, SamplingParams};
use crate::text::chat_template::{ChatTemplate, TemplateError};
use crate::text::tokenizer::{GgufVocab, TextTokenizer, TokenizerError};

/// Tokens prefilled per forward call: bounds activation memory and lets a cancel land mid-prefill.
const PREFILL_CHUNK: usize = 512;

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
    /// The request was cancelled.
    Cancelled,
}

/// Counts and times of a finished request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    /// Prompt tokens prefilled.
    pub prompt_tokens: usize,
    /// Tokens generated (the stop token not counted).
    pub completion_tokens: usize,
    /// Time spent queued, ms.
    pub queue_ms: f64,
    /// Prefill time, ms (prompt in, first logits out).
    pub prefill_ms: f64,
    /// Decode time after the first token, ms.
    pub decode_ms: f64,
}

/// What the worker reports for a request, in order: [`GenerationEvent::Started`], any number of
/// [`GenerationEvent::Token`], then exactly one of [`GenerationEvent::Finished`] or [`GenerationEvent::Failed`].
#[derive(Debug, Clone, PartialEq)]
pub enum GenerationEvent {
    /// The request left the queue and prefill began.
    Started,
    /// One generated token.
    Token(u32),
    /// Generation ended normally.
    Finished { reason: FinishReason, usage: Usage },
    /// The model failed on this request (the engine stays up).
    Failed(String),
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
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self { max_context: None, queue_capacity: 64 }
    }
}

struct Job {
    req: GenerateRequest,
    events: mpsc::UnboundedSender<GenerationEvent>,
    queued: Instant,
}

/// A loaded model with its tokenizer, chat template and worker thread. Cheap to share behind an `Arc`.
pub struct Engine {
    jobs: std::sync::mpsc::SyncSender<Job>,
    waiting: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
    queue_capacity: usize,
    config: ModelConfig,
    tokenizer: Arc<TextTokenizer>,
    template: Option<Arc<ChatTemplate>>,
    stop_tokens: Vec<u32>,
    max_context: usize,
    name: String,
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
    /// Loads the GGUF model at `path` (validating every tensor), its tokenizer and chat template, and starts the
    /// worker thread.
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
        let model = Qwen4Exp::from_gguf(file)?;
        let config = model.config.clone();
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
        let worker = Worker {
            model,
            stop_tokens: stop_tokens.clone(),
            max_context,
            waiting: waiting.clone(),
            running: running.clone(),
        };
        std::thread::Builder::new()
            .name("nebula-engine".into())
            .spawn(move || worker.run(rx))
            .expect("spawning the engine thread");
        Ok(Self {
            jobs,
            waiting,
            running,
            queue_capacity: opts.queue_capacity,
            config,
            tokenizer,
            template,
            stop_tokens,
            max_context,
            name,
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
}

struct Worker {
    model: Qwen4Exp,
    stop_tokens: Vec<u32>,
    max_context: usize,
    waiting: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
}

impl Worker {
    fn run(self, rx: std::sync::mpsc::Receiver<Job>) {
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
                let _ = events.send(GenerationEvent::Failed(format!("internal error: {msg}")));
            }
            self.running.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn generate(&self, job: Job) {
        let Job { req, events, queued } = job;
        let cancelled = || req.cancel.load(Ordering::Relaxed) || events.is_closed();
        let queue_ms = queued.elapsed().as_secs_f64() * 1e3;
        if cancelled() {
            return;
        }
        let _ = events.send(GenerationEvent::Started);
        let limit = self.max_context.min(req.prompt.len() + req.max_tokens);
        let mut state = self.model.new_state(limit);
        let mut sampler = Sampler::new(req.sampling);
        let mut usage =
            Usage { prompt_tokens: req.prompt.len(), completion_tokens: 0, queue_ms, prefill_ms: 0.0, decode_ms: 0.0 };
        let finish = |reason: FinishReason, usage: Usage| {
            let _ = events.send(GenerationEvent::Finished { reason, usage });
        };
        let fail = |e: ModelError| {
            let _ = events.send(GenerationEvent::Failed(e.to_string()));
        };
        let t0 = Instant::now();
        let mut logits = Vec::new();
        let chunks: Vec<&[u32]> = req.prompt.chunks(PREFILL_CHUNK).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            if cancelled() {
                return finish(FinishReason::Cancelled, usage);
            }
            let want = if i + 1 == chunks.len() { LogitsFor::Last } else { LogitsFor::None };
            match self.model.forward(&mut state, chunk, want) {
                Ok(l) => logits = l,
                Err(e) => return fail(e),
            }
        }
        usage.prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        let t1 = Instant::now();
        loop {
            if usage.completion_tokens >= req.max_tokens {
                return finish(FinishReason::Length, usage);
            }
            let Some(next) = sampler.sample(&logits) else {
                let _ = events.send(GenerationEvent::Failed("every token has probability 0".into()));
                return;
            };
            if (!req.ignore_eos && self.stop_tokens.contains(&next)) || req.stop_tokens.contains(&next) {
                usage.decode_ms = t1.elapsed().as_secs_f64() * 1e3;
                return finish(FinishReason::Stop, usage);
            }
            usage.completion_tokens += 1;
            if events.send(GenerationEvent::Token(next)).is_err() {
                return;
            }
            if usage.completion_tokens >= req.max_tokens || state.pos + 1 > limit {
                usage.decode_ms = t1.elapsed().as_secs_f64() * 1e3;
                return finish(FinishReason::Length, usage);
            }
            if cancelled() {
                usage.decode_ms = t1.elapsed().as_secs_f64() * 1e3;
                return finish(FinishReason::Cancelled, usage);
            }
            match self.model.forward(&mut state, &[next], LogitsFor::Last) {
                Ok(l) => logits = l,
                Err(e) => return fail(e),
            }
            usage.decode_ms = t1.elapsed().as_secs_f64() * 1e3;
        }
    }
}
