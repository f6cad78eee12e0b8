//! The worker thread's loop: continuous batching.
//!
//! Requests wait in arrival order. A request is admitted into the running batch when the batch has a free
//! sequence slot ([`BatchOptions::max_sequences`]) and the state memory it will hold once full
//! ([`Backend::state_bytes`] for its limit) fits what the running sequences leave of the budget
//! ([`BatchOptions::state_budget`]); the first request that does not fit waits, and the ones behind it wait
//! too (arrival order is kept). Its state is allocated at admission, so memory runs out there, never inside a
//! step; a request whose state cannot be allocated waits while others run, and fails only when it runs alone.
//!
//! Each step makes one pass ([`Backend::forward_batch`]) over every decoding sequence's next token and, in
//! arrival order, the next prefill chunk of sequences still reading their prompt, as many chunks as the token
//! budget ([`BatchOptions::max_batch_tokens`]) leaves after the decode rows. A chunk ends at the request's
//! chunk size or at its next prefix-cache checkpoint, whatever else is in the batch, so a sequence's chunks do
//! not depend on the batch; and a long prompt is read a chunk per step while the others go on decoding.
//! Finished, cancelled and failed sequences leave at the end of the step; their slots and memory are free for
//! the next admission.
//!
//! A sequence decodes through its own [`SpeculativeDecoder`]: when no more than
//! [`BatchOptions::speculative_max_batch`] sequences decode, each may run its MTP chains on its own; in bigger
//! batches every sequence takes plain steps in the shared pass (one pass for all of them reads each weight once,
//! which pays more than drafting). A lone decoding sequence steps on its own, so the backend's single-sequence
//! path (CUDA Graphs, the argmax on the device) serves it. Sampling, grammars, penalties, log-probabilities and
//! stop rules are per sequence, applied to its rows in order as before.
//!
//! `n` choices of one prompt ([`super::Engine::submit_choices`]) are admitted together: the first reads the
//! prompt, and at its end the state is forked for the others, which then decode in the batch.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use tokio::sync::mpsc;

use super::cache::{CacheSide, DiskWriter, fork_live};
use super::{
    BatchOptions, EngineStats, FinishReason, GenerateRequest, GenerationError, GenerationEvent, Job, PREFILL_CHUNK,
    StepObserver, StepReport, Usage,
};
use crate::backend::{Backend, BatchItem, MediaRows};
use crate::model::LogitsFor;
use crate::prefix_cache::disk::DiskCache;
use crate::prefix_cache::{Checkpoint, PrefixCache, PrefixCacheOptions};
use crate::sampling::{Sampler, TokenConstraint, logprobs_of};
use crate::speculative::decoder::{DecodeError, Flow, SpeculativeDecoder, SpeculativeOptions, TokenSink};

/// What every worker shares with its [`super::Engine`], whatever the backend.
pub(super) struct WorkerRules {
    pub(super) stop_tokens: Vec<u32>,
    /// `<|im_start|>`: the prompt gets a checkpoint before each one (turn boundaries).
    pub(super) turn_start: Option<u32>,
    pub(super) max_context: usize,
    pub(super) waiting: Arc<std::sync::atomic::AtomicUsize>,
    pub(super) running: Arc<std::sync::atomic::AtomicUsize>,
    pub(super) stats: Arc<EngineStats>,
    pub(super) batch: BatchOptions,
    /// Whether `batch.state_budget` was configured (a request over it fails) or defaulted (it runs alone).
    pub(super) budget_explicit: bool,
    /// Sequences admitted at most now ([`super::Engine::set_max_sequences`]; starts at the batch's own).
    pub(super) max_sequences: Arc<std::sync::atomic::AtomicUsize>,
    pub(super) observer: Option<StepObserver>,
}

/// The worker thread's side: the backend, the prefix cache, the queue and the running batch.
pub(super) struct Worker<B: Backend> {
    backend: Arc<B>,
    rules: WorkerRules,
    side: CacheSide<B>,
    /// Bytes of state the running sequences reserved at admission.
    reserved: usize,
}

/// The request's side of decoding for one running sequence: its rules, its events, its output and its
/// checkpoints.
struct SeqSink<B: Backend> {
    req: GenerateRequest,
    events: mpsc::UnboundedSender<GenerationEvent>,
    stop_tokens: Arc<[u32]>,
    output: Vec<u32>,
    completion_tokens: usize,
    checkpoints: Vec<Checkpoint<B::Snapshot>>,
    use_cache: bool,
    interval: usize,
    next_checkpoint: usize,
    /// Set when the request's constraint failed (the failure is then [`GenerationError::Constraint`]).
    constraint_failed: bool,
}

impl<B: Backend> SeqSink<B> {
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

    fn cancelled(&self) -> bool {
        self.req.cancel.load(Ordering::Relaxed) || self.events.is_closed()
    }
}

impl<B: Backend> TokenSink<B> for SeqSink<B> {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        self.constraint(|c| c.mask(logits)).map(|_| ())
    }

    fn needs_logits(&self) -> bool {
        self.req.constraint.is_some() || self.req.logprobs.is_some()
    }

    fn commit(&mut self, token: u32, logits: &[f32], room: bool) -> Result<Flow, String> {
        if (!self.req.ignore_eos && self.stop_tokens.contains(&token)) || self.req.stop_tokens.contains(&token) {
            return Ok(Flow::Finish(FinishReason::Stop));
        }
        self.constraint(|c| c.commit(token))?;
        let req = &self.req;
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
        if self.cancelled() {
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
            let prompt_len = self.req.prompt.len();
            let done = (pos - prompt_len) / self.interval;
            self.next_checkpoint = prompt_len + (done + 1) * self.interval;
        }
    }
}

/// Where a running sequence is.
enum Phase {
    /// Reading its prompt: `pos` tokens consumed.
    Prefill { pos: usize },
    /// The prompt is read; its last logits choose the first token.
    Ready { logits: Vec<f32> },
    /// Decoding: `pending` is the token the next step consumes.
    Decode { pending: u32 },
    /// Ended: leaves the batch at the end of the step.
    Finished(FinishReason),
    /// Failed: leaves the batch, its state discarded.
    Failed(GenerationError),
}

/// A choice of the same prompt that waits for the first choice's prefill ([`super::Engine::submit_choices`]).
struct Follower {
    req: GenerateRequest,
    events: mpsc::UnboundedSender<GenerationEvent>,
    reserved: usize,
}

/// One sequence's part of a step's shared pass.
#[derive(Debug, Clone, Copy)]
enum Planned {
    /// A decode row: the sequence consumes `token`.
    Decode { seq: usize, token: u32 },
    /// A prefill chunk: prompt tokens `start..end`.
    Prefill { seq: usize, start: usize, end: usize },
}

impl Planned {
    fn seq(&self) -> usize {
        match *self {
            Planned::Decode { seq, .. } | Planned::Prefill { seq, .. } => seq,
        }
    }
}

/// A running sequence.
struct Seq<'m, B: Backend> {
    sink: SeqSink<B>,
    state: B::State,
    /// Bytes reserved for it at admission.
    reserved: usize,
    limit: usize,
    drafting: bool,
    sampler: Sampler,
    decoder: SpeculativeDecoder<'m, B>,
    usage: Usage,
    phase: Phase,
    /// Prompt positions where a checkpoint is taken, ascending.
    marks: Vec<usize>,
    chunk: usize,
    prefill_started: Instant,
    decode_started: Instant,
    /// When it last sent an event while reading its prompt (a waiting prefill sends a sign of life).
    heartbeat: Instant,
    followers: Vec<Follower>,
}

/// Sequences running, the followers still waiting for their leader's prompt included.
fn sequences<B: Backend>(running: &[Seq<'_, B>]) -> usize {
    running.iter().map(|s| 1 + s.followers.len()).sum()
}

impl<B: Backend> Seq<'_, B> {
    /// Bytes reserved for it and its followers.
    fn reservation(&self) -> usize {
        self.reserved + self.followers.iter().map(|f| f.reserved).sum::<usize>()
    }

    /// The next prefill chunk's end, from `pos`: the request's chunk size or the next checkpoint mark.
    fn chunk_end(&self, pos: usize) -> usize {
        let len = self.sink.req.prompt.len();
        let mark = self.marks.iter().copied().find(|&m| m > pos).unwrap_or(len);
        mark.min(pos + self.chunk).min(len)
    }

    fn fail(&mut self, e: DecodeError) {
        self.phase = Phase::Failed(match e {
            DecodeError::Request(m) if self.sink.constraint_failed => GenerationError::Constraint(m),
            e => GenerationError::Backend(e.to_string()),
        });
    }

    /// Applies what a decode step returned.
    fn advance(&mut self, out: Result<(u32, Flow), DecodeError>) {
        match out {
            Ok((_, Flow::Finish(reason))) => self.phase = Phase::Finished(reason),
            Ok((next, Flow::Continue)) => self.phase = Phase::Decode { pending: next },
            Err(e) => self.fail(e),
        }
    }
}

impl<B: Backend> Worker<B> {
    pub(super) fn new(
        backend: Arc<B>,
        rules: WorkerRules,
        cache: PrefixCacheOptions,
        disk: Option<Arc<DiskCache>>,
    ) -> Self {
        let disk = disk.map(|d| DiskWriter::start(d, rules.stats.clone()));
        let side = CacheSide {
            cache: PrefixCache::new(cache),
            disk,
            turn_start: rules.turn_start,
            stats: rules.stats.clone(),
        };
        Self { backend, rules, side, reserved: 0 }
    }

    /// Bytes a request's state reserves: what a full state of its limit holds, host and device.
    fn reservation(&self, req: &GenerateRequest) -> usize {
        let limit = self.rules.max_context.min(req.prompt.len() + req.max_tokens);
        let drafting = req.speculative && self.backend.has_mtp();
        let held = self.backend.state_bytes(limit, drafting);
        held.device + held.host
    }

    /// Runs until the engine is dropped (the job channel closes) and every admitted request has ended.
    pub(super) fn run(mut self, rx: std::sync::mpsc::Receiver<Job>) {
        let backend = self.backend.clone();
        let stats = self.rules.stats.clone();
        let stop_tokens: Arc<[u32]> = self.rules.stop_tokens.clone().into();
        let mut queue: VecDeque<Job> = VecDeque::new();
        let mut running: Vec<Seq<'_, B>> = Vec::new();
        let mut open = true;
        loop {
            if running.is_empty() && queue.is_empty() {
                match rx.recv() {
                    Ok(job) => queue.push_back(job),
                    Err(_) => break,
                }
            }
            while open {
                match rx.try_recv() {
                    Ok(job) => queue.push_back(job),
                    Err(std::sync::mpsc::TryRecvError::Empty) => break,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => open = false,
                }
            }
            let admitted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.admit(&backend, &stats, &stop_tokens, &mut queue, &mut running)
            }));
            if admitted.is_err() {
                // The job being started is gone (its receivers see the channel close); the cache may hold a
                // half-updated entry.
                tracing::error!("the engine caught a panic while starting a request; the prefix cache was cleared");
                self.side.cache.clear();
            }
            if running.is_empty() {
                // Everything queued has failed or was cancelled (admission never leaves a lone request waiting).
                if !open && queue.is_empty() {
                    break;
                }
                continue;
            }
            let outcome =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.step(&backend, &stats, &mut running)));
            if let Err(panic) = outcome {
                let msg = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                // The cache may hold a half-updated entry, and the batch's states a half-run pass: start afresh.
                self.side.cache.clear();
                for seq in &mut running {
                    seq.phase = Phase::Failed(GenerationError::Internal(msg.clone()));
                }
            }
            let retired =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.retire(&backend, &mut running)));
            if retired.is_err() {
                tracing::error!(
                    "the engine caught a panic while keeping a finished sequence; the prefix cache was cleared"
                );
                self.side.cache.clear();
            }
            // Recounted from what runs, so that no path (a panic half-way, a failed fork) leaks a reservation.
            self.reserved = running.iter().map(Seq::reservation).sum();
            self.side.report();
            self.rules.running.store(sequences(&running), Ordering::SeqCst);
            stats.reserved_state_bytes.store(self.reserved, Ordering::Relaxed);
        }
    }

    /// Admits queued requests in arrival order while a slot and the memory for each are free.
    fn admit<'m>(
        &mut self,
        backend: &'m B,
        stats: &'m EngineStats,
        stop_tokens: &Arc<[u32]>,
        queue: &mut VecDeque<Job>,
        running: &mut Vec<Seq<'m, B>>,
    ) {
        let opts = self.rules.batch;
        while let Some(job) = queue.front() {
            let cancelled = job.req.cancel.load(Ordering::Relaxed) || job.events.is_closed();
            let live_followers =
                job.followers.iter().any(|(r, e)| !(r.cancel.load(Ordering::Relaxed) || e.is_closed()));
            if cancelled && !live_followers {
                let job = queue.pop_front().expect("front exists");
                self.rules.waiting.fetch_sub(1 + job.followers.len(), Ordering::SeqCst);
                continue;
            }
            let seqs = 1 + job.followers.len();
            let need: usize =
                self.reservation(&job.req) + job.followers.iter().map(|(r, _)| self.reservation(r)).sum::<usize>();
            let budget = opts.state_budget.unwrap_or(usize::MAX);
            let slots = self.rules.max_sequences.load(Ordering::Relaxed).max(1);
            let fits = sequences(running) + seqs <= slots.max(seqs) && self.reserved.saturating_add(need) <= budget;
            let refuse = need > budget && self.rules.budget_explicit;
            if !fits && !running.is_empty() && !refuse {
                break;
            }
            let job = queue.pop_front().expect("front exists");
            // Out of the queue from here, whatever happens to the job.
            self.rules.waiting.fetch_sub(seqs, Ordering::SeqCst);
            if refuse {
                // Refused at submission when it alone exceeds the budget; kept here for budgets that change.
                let msg = format!(
                    "the request's state needs {} MiB, more than the {} MiB this server keeps for running sequences",
                    need >> 20,
                    budget >> 20
                );
                let _ = job.events.send(GenerationEvent::Failed(GenerationError::Backend(msg.clone())));
                for (_, e) in &job.followers {
                    let _ = e.send(GenerationEvent::Failed(GenerationError::Backend(msg.clone())));
                }
                continue;
            }
            match self.start(backend, stats, stop_tokens, job, running.is_empty()) {
                Ok(seq) => {
                    self.reserved += seq.reservation();
                    running.push(seq);
                }
                Err(Some(job)) => {
                    // Its state could not be allocated while others run: it waits for them.
                    self.rules.waiting.fetch_add(seqs, Ordering::SeqCst);
                    queue.push_front(*job);
                    break;
                }
                Err(None) => {}
            }
        }
        self.rules.running.store(sequences(running), Ordering::SeqCst);
    }

    /// Starts a job's sequence: its state resumed from the prefix cache or fresh. `Err(Some(job))` gives the job
    /// back when its state cannot be allocated and `alone` is false (it waits); `Err(None)` when it failed (its
    /// events said so).
    fn start<'m>(
        &mut self,
        backend: &'m B,
        stats: &'m EngineStats,
        stop_tokens: &Arc<[u32]>,
        job: Job,
        alone: bool,
    ) -> Result<Seq<'m, B>, Option<Box<Job>>> {
        let queue_ms = job.queued.elapsed().as_secs_f64() * 1e3;
        let req = &job.req;
        let limit = self.rules.max_context.min(req.prompt.len() + req.max_tokens);
        let use_cache = req.use_prefix_cache && self.side.cache.enabled();
        let drafting = req.speculative && backend.has_mtp();
        let (state, logits, checkpoints) =
            match self.side.start_state(backend, req.cache_key(), limit, drafting, use_cache) {
                Ok(s) => s,
                Err(e) if !alone && e.is_out_of_memory() => return Err(Some(Box::new(job))),
                Err(e) => {
                    let error = GenerationError::Backend(e.to_string());
                    let _ = job.events.send(GenerationEvent::Failed(error.clone()));
                    for (_, ev) in &job.followers {
                        let _ = ev.send(GenerationEvent::Failed(error.clone()));
                    }
                    return Err(None);
                }
            };
        let reserved = self.reservation(&job.req);
        let followers = job
            .followers
            .into_iter()
            .map(|(req, events)| Follower { reserved: self.reservation(&req), req, events })
            .collect();
        let cached_tokens = backend.position(&state);
        stats.prefix_hits.fetch_add(cached_tokens, Ordering::Relaxed);
        let Job { req, events, .. } = job;
        let _ = events.send(GenerationEvent::Started { cached_tokens });
        let prompt_len = req.prompt.len();
        let marks =
            if use_cache { self.side.prompt_checkpoints(req.cache_key(), cached_tokens) } else { vec![prompt_len] };
        let interval = self.side.cache.options().interval.max(1);
        let opts = SpeculativeOptions { enabled: drafting, level: req.accuracy_level, ..SpeculativeOptions::default() };
        let mut sampler = Sampler::new(req.sampling);
        sampler.observe_prompt(&req.prompt);
        // A chunk fits a pass beside a decode row of every other sequence (a server constant, so a sequence's
        // chunks never depend on the batch).
        let most = self
            .rules
            .batch
            .max_batch_tokens
            .map_or(usize::MAX, |b| b.saturating_sub(self.rules.batch.max_sequences - 1));
        let chunk = req.prefill_chunk.unwrap_or(PREFILL_CHUNK).min(most).max(1);
        let phase = if cached_tokens == prompt_len && !logits.is_empty() {
            Phase::Ready { logits }
        } else {
            Phase::Prefill { pos: cached_tokens }
        };
        let now = Instant::now();
        Ok(Seq {
            sink: SeqSink {
                req,
                events,
                stop_tokens: stop_tokens.clone(),
                output: Vec::new(),
                completion_tokens: 0,
                checkpoints,
                use_cache,
                interval,
                next_checkpoint: prompt_len + interval,
                constraint_failed: false,
            },
            state,
            reserved,
            limit,
            drafting,
            sampler,
            decoder: SpeculativeDecoder::new(backend, opts, Some(&stats.speculative)),
            usage: Usage {
                prompt_tokens: prompt_len,
                cached_tokens,
                completion_tokens: 0,
                queue_ms,
                prefill_ms: 0.0,
                decode_ms: 0.0,
                draft_tokens: 0,
                accepted_draft_tokens: 0,
            },
            phase,
            marks,
            chunk,
            prefill_started: now,
            decode_started: now,
            heartbeat: now,
            followers,
        })
    }

    /// One step of the batch (module doc).
    fn step<'m>(&mut self, backend: &'m B, stats: &'m EngineStats, running: &mut Vec<Seq<'m, B>>) {
        let opts = self.rules.batch;
        for seq in running.iter_mut() {
            if seq.sink.cancelled() && !matches!(seq.phase, Phase::Finished(_) | Phase::Failed(_)) {
                seq.phase = Phase::Finished(FinishReason::Cancelled);
            }
        }
        self.choose_first_tokens(backend, stats, running);
        let decoding = running.iter().filter(|s| matches!(s.phase, Phase::Decode { .. })).count();
        let prefilling = running.iter().filter(|s| matches!(s.phase, Phase::Prefill { .. })).count();
        // Sequences that step on their own: MTP chains in small batches, and a lone decoding sequence.
        let lone = decoding == 1 && prefilling == 0;
        let drafts = decoding <= opts.speculative_max_batch;
        let mut stepped = vec![false; running.len()];
        for (seq, stepped) in running.iter_mut().zip(&mut stepped) {
            let Phase::Decode { pending } = seq.phase else { continue };
            if lone || (drafts && seq.decoder.chain_window(&seq.state, &seq.sink, seq.limit) > 0) {
                let t = Instant::now();
                let before = backend.position(&seq.state);
                let out = seq.decoder.step(&mut seq.state, pending, &mut seq.sampler, &mut seq.sink, seq.limit);
                seq.advance(out);
                *stepped = true;
                let rows = backend.position(&seq.state).saturating_sub(before).max(1);
                self.report(&StepReport {
                    sequences: 1,
                    tokens: rows,
                    decode_rows: rows,
                    seconds: t.elapsed().as_secs_f64(),
                });
            }
        }
        // The shared pass: decode rows, then prefill chunks in arrival order within the token budget (by
        // default: the decode rows and one prefill chunk, or more while they fit in `PREFILL_CHUNK` tokens).
        let decode_rows = running
            .iter()
            .zip(&stepped)
            .filter(|(s, stepped)| !**stepped && matches!(s.phase, Phase::Decode { .. }))
            .count();
        let first_chunk = running.iter().find_map(|s| match s.phase {
            Phase::Prefill { pos } => Some(s.chunk_end(pos) - pos),
            _ => None,
        });
        let budget = opts.max_batch_tokens.unwrap_or(decode_rows + first_chunk.unwrap_or(0).max(PREFILL_CHUNK)).max(1);
        let mut rows = 0;
        let mut plan: Vec<Planned> = Vec::new();
        for (i, seq) in running.iter().enumerate() {
            if let Phase::Decode { pending } = seq.phase
                && !stepped[i]
            {
                plan.push(Planned::Decode { seq: i, token: pending });
                rows += 1;
            }
        }
        debug_assert_eq!(rows, decode_rows);
        for (i, seq) in running.iter().enumerate() {
            if let Phase::Prefill { pos } = seq.phase {
                let end = seq.chunk_end(pos);
                if rows + (end - pos) <= budget || rows == 0 {
                    plan.push(Planned::Prefill { seq: i, start: pos, end });
                    rows += end - pos;
                }
            }
        }
        // A prompt that waits for room in the budget says so now and then (the service's watchdog listens).
        for (i, seq) in running.iter_mut().enumerate() {
            if let Phase::Prefill { pos } = seq.phase
                && !plan.iter().any(|p| p.seq() == i)
                && seq.heartbeat.elapsed().as_secs_f64() >= 1.0
            {
                let _ =
                    seq.sink.events.send(GenerationEvent::Prefilled { done: pos, total: seq.sink.req.prompt.len() });
                seq.heartbeat = Instant::now();
            }
        }
        if !plan.is_empty() {
            self.pass(backend, running, &plan, decode_rows, rows);
        }
        self.choose_first_tokens(backend, stats, running);
    }

    /// Runs the planned pass and hands each sequence its rows.
    fn pass<'m>(
        &mut self,
        backend: &'m B,
        running: &mut [Seq<'m, B>],
        plan: &[Planned],
        decode_rows: usize,
        rows: usize,
    ) {
        let t = Instant::now();
        let tokens: Vec<Vec<u32>> = plan
            .iter()
            .map(|p| match *p {
                Planned::Decode { token, .. } => vec![token],
                Planned::Prefill { seq, start, end } => running[seq].sink.req.prompt[start..end].to_vec(),
            })
            .collect();
        let wants: Vec<LogitsFor> = plan
            .iter()
            .map(|p| match *p {
                Planned::Prefill { seq, end, .. } if end < running[seq].sink.req.prompt.len() => LogitsFor::None,
                _ => LogitsFor::Last,
            })
            .collect();
        // A prompt chunk with images: its rows' positions and the feature rows within it.
        let hidden = backend.config().hidden;
        let media: Vec<Option<(Arc<crate::vision::MediaPrompt>, std::ops::Range<usize>, Vec<usize>)>> = plan
            .iter()
            .map(|p| match *p {
                Planned::Prefill { seq, start, end } => running[seq].sink.req.media.clone().map(|m| {
                    let rows = m.rows_in(start..end, hidden).0;
                    (m, start..end, rows)
                }),
                Planned::Decode { .. } => None,
            })
            .collect();
        let result = {
            // Items borrow each planned sequence's state; the plan lists each sequence once.
            let mut states: Vec<Option<&mut B::State>> = running.iter_mut().map(|s| Some(&mut s.state)).collect();
            let mut items: Vec<BatchItem<'_, B::State>> = plan
                .iter()
                .zip(&tokens)
                .zip(&wants)
                .zip(&media)
                .map(|(((p, toks), &want), media)| BatchItem {
                    state: states[p.seq()].take().expect("each sequence is planned once"),
                    tokens: toks,
                    want,
                    media: media.as_ref().map(|(m, range, rows)| MediaRows {
                        positions: &m.positions[range.clone()],
                        rows,
                        embeds: m.rows_in(range.clone(), hidden).1,
                    }),
                })
                .collect();
            backend.forward_batch(&mut items, self.rules.batch.mode)
        };
        let secs = t.elapsed().as_secs_f64();
        self.report(&StepReport { sequences: plan.len(), tokens: rows, decode_rows, seconds: secs });
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                let error = GenerationError::Backend(e.to_string());
                for p in plan {
                    running[p.seq()].phase = Phase::Failed(error.clone());
                }
                return;
            }
        };
        for ((p, l), toks) in plan.iter().zip(logits).zip(&tokens) {
            let seq = &mut running[p.seq()];
            let Planned::Prefill { end, .. } = *p else {
                let out = seq.decoder.finish_plain(&seq.state, l, secs, &mut seq.sampler, &mut seq.sink, seq.limit);
                seq.advance(out);
                continue;
            };
            self.rules.stats.prefilled_tokens.fetch_add(toks.len(), Ordering::Relaxed);
            let len = seq.sink.req.prompt.len();
            if seq.sink.use_cache && seq.marks.contains(&end) {
                match backend.snapshot(&seq.state) {
                    Ok(snap) => {
                        let keep = (end == len).then(|| l.clone());
                        seq.sink.checkpoints.push(Checkpoint::new(snap, keep));
                    }
                    Err(e) => tracing::warn!("prefix cache: no checkpoint at {end}: {e}"),
                }
            }
            let _ = seq.sink.events.send(GenerationEvent::Prefilled { done: end, total: len });
            seq.heartbeat = Instant::now();
            seq.phase = if end == len {
                seq.usage.prefill_ms = seq.prefill_started.elapsed().as_secs_f64() * 1e3;
                Phase::Ready { logits: l }
            } else {
                Phase::Prefill { pos: end }
            };
        }
    }

    /// Counts a pass (shared, or one sequence's own step) and tells the observer.
    fn report(&self, r: &StepReport) {
        self.rules.stats.batch_steps.fetch_add(1, Ordering::Relaxed);
        self.rules.stats.batch_rows.fetch_add(r.tokens, Ordering::Relaxed);
        if let Some(observer) = &self.rules.observer {
            (observer.0)(r);
        }
    }

    /// Sequences whose prompt is read: their followers forked off, the first token chosen.
    fn choose_first_tokens<'m>(&mut self, backend: &'m B, stats: &'m EngineStats, running: &mut Vec<Seq<'m, B>>) {
        let mut i = 0;
        while i < running.len() {
            if !matches!(running[i].phase, Phase::Ready { .. }) {
                i += 1;
                continue;
            }
            let mut forks = Vec::new();
            if !running[i].followers.is_empty() {
                let seq = running.remove(i);
                let (seq, new) = self.fork_followers(backend, stats, seq);
                running.insert(i, seq);
                forks = new;
            }
            let n = 1 + forks.len();
            for (k, f) in forks.into_iter().enumerate() {
                running.insert(i + 1 + k, f);
            }
            for seq in &mut running[i..i + n] {
                let Phase::Ready { logits } = std::mem::replace(&mut seq.phase, Phase::Prefill { pos: 0 }) else {
                    continue;
                };
                seq.decode_started = Instant::now();
                let out = seq.decoder.start(&seq.state, logits, &mut seq.sampler, &mut seq.sink, seq.limit);
                seq.advance(out);
            }
            i += n;
        }
    }

    /// Forks a sequence whose prompt is read into one state per follower (each a choice of its own).
    fn fork_followers<'m>(
        &mut self,
        backend: &'m B,
        stats: &'m EngineStats,
        mut seq: Seq<'m, B>,
    ) -> (Seq<'m, B>, Vec<Seq<'m, B>>) {
        let followers = std::mem::take(&mut seq.followers);
        let Phase::Ready { logits } = &seq.phase else { return (seq, Vec::new()) };
        let logits = logits.clone();
        let snap = match backend.snapshot(&seq.state) {
            Ok(s) => s,
            Err(e) => {
                for f in &followers {
                    let _ = f.events.send(GenerationEvent::Failed(GenerationError::Backend(e.to_string())));
                }
                return (seq, Vec::new());
            }
        };
        let (state, forks) = fork_live(backend, seq.state, &snap, seq.limit, seq.drafting, followers.len());
        seq.state = state;
        let mut out = Vec::new();
        for (f, fork) in followers.into_iter().zip(forks) {
            let state = match fork {
                Ok(s) => s,
                Err(e) => {
                    let _ = f.events.send(GenerationEvent::Failed(GenerationError::Backend(e.to_string())));
                    continue;
                }
            };
            let _ = f.events.send(GenerationEvent::Started { cached_tokens: seq.usage.cached_tokens });
            let opts = SpeculativeOptions {
                enabled: seq.drafting && f.req.speculative,
                level: f.req.accuracy_level,
                ..Default::default()
            };
            let mut sampler = Sampler::new(f.req.sampling);
            sampler.observe_prompt(&f.req.prompt);
            let limit = self.rules.max_context.min(f.req.prompt.len() + f.req.max_tokens);
            out.push(Seq {
                sink: SeqSink {
                    events: f.events,
                    stop_tokens: seq.sink.stop_tokens.clone(),
                    output: Vec::new(),
                    completion_tokens: 0,
                    checkpoints: seq.sink.checkpoints.clone(),
                    use_cache: seq.sink.use_cache,
                    interval: seq.sink.interval,
                    next_checkpoint: seq.sink.next_checkpoint,
                    constraint_failed: false,
                    req: f.req,
                },
                state,
                reserved: f.reserved,
                limit: limit.min(seq.limit),
                drafting: seq.drafting,
                sampler,
                decoder: SpeculativeDecoder::new(backend, opts, Some(&stats.speculative)),
                usage: seq.usage,
                phase: Phase::Ready { logits: logits.clone() },
                marks: seq.marks.clone(),
                chunk: seq.chunk,
                prefill_started: seq.prefill_started,
                decode_started: seq.decode_started,
                heartbeat: seq.heartbeat,
                followers: Vec::new(),
            });
        }
        (seq, out)
    }

    /// Ends the sequences that finished or failed this step: their last event, the prefix cache, their memory.
    fn retire<'m>(&mut self, backend: &'m B, running: &mut Vec<Seq<'m, B>>) {
        let mut i = 0;
        while i < running.len() {
            if !matches!(running[i].phase, Phase::Finished(_) | Phase::Failed(_)) {
                i += 1;
                continue;
            }
            let mut seq = running.remove(i);
            for f in &seq.followers {
                // Followers of a sequence that ended before its prompt was read end with it.
                let event = match &seq.phase {
                    Phase::Failed(e) => GenerationEvent::Failed(e.clone()),
                    _ => GenerationEvent::Finished { reason: FinishReason::Cancelled, usage: seq.usage },
                };
                let _ = f.events.send(event);
            }
            let reason = match std::mem::replace(&mut seq.phase, Phase::Prefill { pos: 0 }) {
                Phase::Failed(e) => {
                    let _ = seq.sink.events.send(GenerationEvent::Failed(e));
                    continue;
                }
                Phase::Finished(r) => r,
                _ => unreachable!("matched above"),
            };
            seq.usage.completion_tokens = seq.sink.completion_tokens;
            seq.usage.draft_tokens = seq.decoder.report.drafted;
            seq.usage.accepted_draft_tokens = seq.decoder.report.accepted;
            if seq.sink.completion_tokens > 0 || !matches!(reason, FinishReason::Cancelled) {
                seq.usage.decode_ms = seq.decode_started.elapsed().as_secs_f64() * 1e3;
            }
            let _ = seq.sink.events.send(GenerationEvent::Finished { reason, usage: seq.usage });
            // Keep the sequence: every token the state consumed.
            let prompt = seq.sink.req.cache_key();
            let end = backend.position(&seq.state);
            if seq.sink.use_cache && end >= prompt.len() {
                let mut tokens = prompt.to_vec();
                tokens.extend_from_slice(&seq.sink.output[..end - prompt.len()]);
                let checkpoints = std::mem::take(&mut seq.sink.checkpoints);
                self.side.keep(backend, tokens, seq.state, checkpoints, seq.drafting);
            }
        }
    }
}

impl<B: Backend> Drop for Worker<B> {
    fn drop(&mut self) {
        // Cached device states go before the backend they were allocated on.
        self.side.cache.clear();
    }
}
