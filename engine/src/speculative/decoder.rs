//! The decode loop of one request, speculative when it can be: plain steps while drafting is off (no MTP block,
//! collapse cooldown, no room left), MTP chains otherwise.
//!
//! Each row's logits go through the same per-token rules as plain decoding, in the same order (the request's
//! penalties, then its [`TokenSink::mask`], then the choice, then [`TokenSink::commit`]), one row at a time, so
//! penalties and grammars see exactly the tokens before the row. A chain:
//! 1. the drafter proposes `d_1..d_N` after the pending token `c`;
//! 2. the target verifies `[c, d_1..d_N]` in one pass (the state is saved first);
//! 3. rows are judged in order: a row whose resident-expert coverage is under the threshold stops the chain there
//!    (**case B**: the kept prefix is rolled back to, and the full target produces that row's token in a plain
//!    step); a rejected draft is replaced by the target's token (**case C**); after `N` accepted drafts the last
//!    row gives the bonus token (**case A**);
//! 4. the state is rolled back to the rows kept (accepted work is never recomputed) and the window controller
//!    records the chain.

use std::time::Instant;

use crate::sampling::Sampler;
use crate::worker::FinishReason;

use super::COVERAGE_THRESHOLD;
use super::stats::{DecodeReport, SpecStats};
use super::verify::{AccuracyLevel, RowVerdict, verify_greedy, verify_sampled};
use super::window::{ChainCase, ChainSample, WindowController};
use crate::backend::{Backend, BackendError};

/// Whether generation goes on after a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// Keep generating.
    Continue,
    /// Stop, for this reason.
    Finish(FinishReason),
}

/// The request's side of decoding: its grammar, its events and its stop rules, for a sequence on backend `M`.
pub trait TokenSink<M: Backend> {
    /// Sets the logits of tokens the request forbids next to `-inf` (grammar), in place. Called after the
    /// penalties, before the choice.
    ///
    /// Errors: the request cannot go on (the message fails it).
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String>;

    /// Takes the chosen token, given the row's prepared logits (for log-probabilities). A stop token ends
    /// generation without being emitted; otherwise the token is emitted and generation ends when the request's
    /// limits say so: `room` is false when the sequence has no room to consume this token (context limit).
    ///
    /// Errors: the request cannot go on.
    fn commit(&mut self, token: u32, logits: &[f32], room: bool) -> Result<Flow, String>;

    /// Tokens that may still be emitted.
    fn remaining(&self) -> usize;

    /// Whether [`TokenSink::mask`] or [`TokenSink::commit`] reads the logits (a grammar, log-probabilities).
    /// When not, and the sampler is plain greedy, a plain step may choose its token on the device
    /// ([`Backend::step_greedy`]) and commit it with empty logits.
    fn needs_logits(&self) -> bool {
        true
    }

    /// Called after the state consumed tokens (e.g. to take prefix-cache checkpoints through `model`).
    fn consumed(&mut self, _model: &M, _state: &M::State) {}
}

/// Why a request's decoding failed.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The backend failed (the state is to be discarded).
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The request's own rules cannot go on (its grammar refused every token, say), or decoding found no
    /// token to choose.
    #[error("{0}")]
    Request(String),
}

impl From<String> for DecodeError {
    fn from(message: String) -> Self {
        DecodeError::Request(message)
    }
}

impl From<&str> for DecodeError {
    fn from(message: &str) -> Self {
        DecodeError::Request(message.to_owned())
    }
}

/// Deterministic costs that replace the measured ones (tests of the controller's behaviour).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FixedCosts {
    /// Seconds per drafted token.
    pub draft_per_token: f64,
    /// Seconds of a verify pass (and of a plain step) = `verify_base + verify_per_row * rows`.
    pub verify_base: f64,
    /// See `verify_base`.
    pub verify_per_row: f64,
    /// Seconds per save.
    pub save: f64,
    /// Seconds per rollback.
    pub restore: f64,
    /// Seconds per realignment.
    pub realign: f64,
}

/// Settings of one request's decoding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeculativeOptions {
    /// Draft at all (the server switch and the model's MTP block).
    pub enabled: bool,
    /// Acceptance level for greedy requests.
    pub level: AccuracyLevel,
    /// Resident-expert coverage under which a verify row is not trusted (case B).
    pub coverage_threshold: f32,
    /// Costs to feed the controller instead of measured times.
    pub fixed_costs: Option<FixedCosts>,
}

impl Default for SpeculativeOptions {
    fn default() -> Self {
        Self { enabled: true, level: AccuracyLevel::Strict, coverage_threshold: COVERAGE_THRESHOLD, fixed_costs: None }
    }
}

/// How decoding ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeOutcome {
    /// The finish reason.
    pub reason: FinishReason,
}

/// One request's decoder.
pub struct SpeculativeDecoder<'a, M: Backend> {
    model: &'a M,
    opts: SpeculativeOptions,
    /// The window controller (public for inspection by tests and benchmarks).
    pub controller: WindowController,
    /// What this request's decoding did.
    pub report: DecodeReport,
    stats: Option<&'a SpecStats>,
}

/// What one chain's rows decided.
struct RowsResult {
    keep: usize,
    accepted: usize,
    case: ChainCase,
    tokens: usize,
    finish: Option<FinishReason>,
    next: Option<u32>,
    exact_row: Option<usize>,
}

impl<'a, M: Backend> SpeculativeDecoder<'a, M> {
    /// A decoder over `model`; `stats` receives server-wide counters.
    pub fn new(model: &'a M, opts: SpeculativeOptions, stats: Option<&'a SpecStats>) -> Self {
        Self { model, opts, controller: WindowController::new(), report: DecodeReport::default(), stats }
    }

    /// Decodes from `logits` (the prompt's last row) until the sink finishes: chooses and commits the first
    /// token, then runs plain steps or chains. `limit` is the most tokens the state may hold.
    ///
    /// Errors: [`DecodeError`] (the request fails; the engine stays up).
    pub fn run(
        &mut self,
        state: &mut M::State,
        logits: Vec<f32>,
        sampler: &mut Sampler,
        sink: &mut dyn TokenSink<M>,
        limit: usize,
    ) -> Result<DecodeOutcome, DecodeError> {
        let (mut pending, flow) = self.start(state, logits, sampler, sink, limit)?;
        if let Flow::Finish(reason) = flow {
            return Ok(DecodeOutcome { reason });
        }
        loop {
            match self.step(state, pending, sampler, sink, limit)? {
                (_, Flow::Finish(reason)) => return Ok(DecodeOutcome { reason }),
                (next, Flow::Continue) => pending = next,
            }
        }
    }

    /// Chooses and commits the first token from `logits` (the prompt's last row): the token the next step
    /// consumes, or the finish (a request with no tokens to emit finishes with [`FinishReason::Length`]).
    ///
    /// Errors: [`DecodeError::Request`] from the sink's rules, or when no token can be chosen.
    pub fn start(
        &mut self,
        state: &M::State,
        mut logits: Vec<f32>,
        sampler: &mut Sampler,
        sink: &mut dyn TokenSink<M>,
        limit: usize,
    ) -> Result<(u32, Flow), DecodeError> {
        if sink.remaining() == 0 {
            return Ok((0, Flow::Finish(FinishReason::Length)));
        }
        let room = self.model.position(state) < limit;
        self.choose_and_commit(&mut logits, sampler, sink, room)
    }

    /// The number of drafts the next step would verify (0: it would be a plain step), from the window
    /// controller, the room left and whether the drafter can propose now.
    pub fn chain_window(&self, state: &M::State, sink: &dyn TokenSink<M>, limit: usize) -> usize {
        if !self.opts.enabled {
            return 0;
        }
        let pos = self.model.position(state);
        let n = self
            .controller
            .window()
            .unwrap_or(0)
            .min(limit.saturating_sub(pos + 1))
            .min(sink.remaining().saturating_sub(1));
        if n > 0 && !self.controller.wants_plain_probe() && self.model.can_draft(state) { n } else { 0 }
    }

    /// One step after `pending` (the token chosen last): a chain when [`SpeculativeDecoder::chain_window`] says
    /// so, a plain step otherwise. Returns the next pending token and whether to go on.
    ///
    /// Errors: [`DecodeError`].
    pub fn step(
        &mut self,
        state: &mut M::State,
        pending: u32,
        sampler: &mut Sampler,
        sink: &mut dyn TokenSink<M>,
        limit: usize,
    ) -> Result<(u32, Flow), DecodeError> {
        match self.chain_window(state, &*sink, limit) {
            0 => self.plain(state, pending, sampler, sink, limit),
            n => self.chain(state, pending, n, sampler, sink, limit),
        }
    }

    /// Finishes a plain step whose forward pass ran elsewhere (a batched pass that consumed `pending` on
    /// `state`): `logits` are its row, `measured` the pass's seconds. Chooses and commits the next token as
    /// [`SpeculativeDecoder::step`] would have.
    ///
    /// Errors: [`DecodeError::Request`] from the sink's rules, or when no token can be chosen.
    pub fn finish_plain(
        &mut self,
        state: &M::State,
        mut logits: Vec<f32>,
        measured: f64,
        sampler: &mut Sampler,
        sink: &mut dyn TokenSink<M>,
        limit: usize,
    ) -> Result<(u32, Flow), DecodeError> {
        self.count_plain(measured);
        sink.consumed(self.model, state);
        let room = self.model.position(state) < limit;
        self.choose_and_commit(&mut logits, sampler, sink, room)
    }

    /// Books a plain step of `measured` seconds with the report and the window controller.
    fn count_plain(&mut self, measured: f64) {
        let secs = self.opts.fixed_costs.map_or(measured, |c| c.verify_base + c.verify_per_row);
        self.report.plain_steps += 1;
        self.report.plain_s += measured;
        if self.controller.on_plain_step(secs) {
            self.report.recoveries += 1;
            if let Some(s) = self.stats {
                s.recoveries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    /// Penalties, mask, choice and commit of one row.
    fn choose_and_commit(
        &self,
        logits: &mut [f32],
        sampler: &mut Sampler,
        sink: &mut dyn TokenSink<M>,
        room: bool,
    ) -> Result<(u32, Flow), DecodeError> {
        sampler.apply_penalties(logits);
        sink.mask(logits)?;
        let token = sampler.sample(logits);
        Self::commit_choice(token, logits, sampler, sink, room)
    }

    /// Commits the chosen token (`None`: no token had a finite logit) and tells the sampler it was taken.
    fn commit_choice(
        token: Option<u32>,
        logits: &[f32],
        sampler: &mut Sampler,
        sink: &mut dyn TokenSink<M>,
        room: bool,
    ) -> Result<(u32, Flow), DecodeError> {
        let token = token.ok_or("every token has probability 0")?;
        let flow = sink.commit(token, logits, room)?;
        if flow == Flow::Continue {
            sampler.accept(token);
        }
        Ok((token, flow))
    }

    /// One plain step: consume `pending`, choose the next token.
    fn plain(
        &mut self,
        state: &mut M::State,
        pending: u32,
        sampler: &mut Sampler,
        sink: &mut dyn TokenSink<M>,
        limit: usize,
    ) -> Result<(u32, Flow), DecodeError> {
        let t = Instant::now();
        // Plain greedy decoding with nothing else reading the logits: the model chooses the token itself (on a
        // GPU, without copying the vocabulary-sized row back); the same token as sampling its logits.
        let greedy = sampler.is_plain_greedy() && !sink.needs_logits();
        let (mut logits, chosen) = if greedy {
            (Vec::new(), Some(self.model.step_greedy(state, pending)?))
        } else {
            (self.model.step(state, pending)?, None)
        };
        self.count_plain(t.elapsed().as_secs_f64());
        sink.consumed(self.model, state);
        let room = self.model.position(state) < limit;
        match chosen {
            Some(token) => Self::commit_choice(token, &logits, sampler, sink, room),
            None => self.choose_and_commit(&mut logits, sampler, sink, room),
        }
    }

    /// One chain of `n` drafts after `pending`.
    fn chain(
        &mut self,
        state: &mut M::State,
        pending: u32,
        n: usize,
        sampler: &mut Sampler,
        sink: &mut dyn TokenSink<M>,
        limit: usize,
    ) -> Result<(u32, Flow), DecodeError> {
        let t = Instant::now();
        // A drafter that cannot propose (e.g. its cache is out of step) costs a plain step, not the request.
        let mut drafts = self.model.draft(state, pending, n).unwrap_or_default();
        drafts.truncate(n);
        let draft_s = t.elapsed().as_secs_f64();
        if drafts.is_empty() {
            return self.plain(state, pending, sampler, sink, limit);
        }
        let n = drafts.len();
        let mut chain = Vec::with_capacity(n + 1);
        chain.push(pending);
        chain.extend_from_slice(&drafts);
        let pos0 = self.model.position(state);

        let t = Instant::now();
        let v = self.model.verify(state, &chain)?;
        let verify_total = t.elapsed().as_secs_f64();
        let vocab = self.model.vocab();
        if v.logits.len() != (n + 1) * vocab {
            return Err(DecodeError::Request(format!(
                "the verify pass returned {} logits for {} rows of {vocab}",
                v.logits.len(),
                n + 1
            )));
        }
        let rows = self.judge_rows(&chain, &v.logits, &v.coverage, vocab, pos0, limit, sampler, sink)?;

        let t = Instant::now();
        let rb = self.model.rollback(state, &v.record, rows.keep)?;
        let rollback_s = (t.elapsed().as_secs_f64() - rb.realign_s).max(0.0);
        let restore_s = if rows.keep < n + 1 { rollback_s } else { 0.0 };

        let mut next = rows.next;
        let mut finish = rows.finish;
        let mut exact_s = 0.0;
        if let Some(k) = rows.exact_row {
            // Case B: the full target produces this row's token.
            let t = Instant::now();
            let mut logits = self.model.step(state, chain[k])?;
            exact_s = t.elapsed().as_secs_f64();
            let room = self.model.position(state) < limit;
            let (tok, flow) = self.choose_and_commit(&mut logits, sampler, sink, room)?;
            next = Some(tok);
            if let Flow::Finish(r) = flow {
                finish = Some(r);
            }
        }
        sink.consumed(self.model, state);

        let mut sample = ChainSample {
            window: n,
            accepted: rows.accepted,
            case: rows.case,
            tokens: rows.tokens + usize::from(rows.exact_row.is_some()),
            draft_s,
            verify_s: (verify_total - v.save_s - v.realign_s).max(0.0),
            save_s: v.save_s,
            restore_s,
            realign_s: v.realign_s + rb.realign_s,
            exact_s,
        };
        self.report.add_chain(&sample);
        if let Some(s) = self.stats {
            s.add_chain(&sample);
        }
        if let Some(c) = self.opts.fixed_costs {
            sample.draft_s = c.draft_per_token * n as f64;
            sample.verify_s = c.verify_base + c.verify_per_row * (n + 1) as f64;
            sample.save_s = c.save;
            sample.restore_s = if rows.keep < n + 1 { c.restore } else { 0.0 };
            sample.realign_s = c.realign;
            sample.exact_s = if rows.exact_row.is_some() { c.verify_base + c.verify_per_row } else { 0.0 };
        }
        if finish.is_none() && self.controller.on_chain(sample).collapsed {
            self.report.collapses += 1;
            if let Some(s) = self.stats {
                s.collapses.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        match (finish, next) {
            (Some(r), _) => Ok((pending, Flow::Finish(r))),
            (None, Some(tok)) => Ok((tok, Flow::Continue)),
            (None, None) => Err("a verified chain produced no token".into()),
        }
    }

    /// Judges the rows of a verified chain in order (see the module doc).
    #[allow(clippy::too_many_arguments)]
    fn judge_rows(
        &self,
        chain: &[u32],
        logits: &[f32],
        coverage: &[f32],
        vocab: usize,
        pos0: usize,
        limit: usize,
        sampler: &mut Sampler,
        sink: &mut dyn TokenSink<M>,
    ) -> Result<RowsResult, DecodeError> {
        let n = chain.len() - 1;
        let greedy = sampler.params().is_greedy();
        let rule = self.opts.level.relaxed_rule();
        let mut budget = rule.map_or(0, |r| r.max_per_chain);
        let mut accepted = 0;
        for i in 0..=n {
            if coverage.get(i).is_some_and(|&c| c < self.opts.coverage_threshold) {
                return Ok(RowsResult {
                    keep: i,
                    accepted,
                    case: ChainCase::B,
                    tokens: accepted,
                    finish: None,
                    next: None,
                    exact_row: Some(i),
                });
            }
            let mut row = logits[i * vocab..(i + 1) * vocab].to_vec();
            sampler.apply_penalties(&mut row);
            sink.mask(&mut row)?;
            // After row i the state holds rows 0..=i; the row's token needs one more slot.
            let room = pos0 + i + 1 < limit;
            let (token, is_draft) = if i < n {
                let draft = chain[i + 1];
                let verdict = if greedy {
                    verify_greedy(&row, draft, rule.as_ref(), &mut budget)
                } else {
                    verify_sampled(sampler, &row, draft)
                };
                match verdict.ok_or("every token has probability 0")? {
                    RowVerdict::Accept { .. } => (draft, true),
                    RowVerdict::Reject { replacement } => (replacement, false),
                }
            } else {
                (sampler.sample(&row).ok_or("every token has probability 0")?, false)
            };
            let flow = sink.commit(token, &row, room)?;
            if let Flow::Finish(reason) = flow {
                let case = if is_draft || i == n { ChainCase::A } else { ChainCase::C };
                return Ok(RowsResult {
                    keep: i + 1,
                    accepted: accepted + usize::from(is_draft),
                    case,
                    tokens: accepted + 1,
                    finish: Some(reason),
                    next: None,
                    exact_row: None,
                });
            }
            sampler.accept(token);
            if is_draft {
                accepted += 1;
                continue;
            }
            let case = if i == n { ChainCase::A } else { ChainCase::C };
            return Ok(RowsResult {
                keep: i + 1,
                accepted,
                case,
                tokens: accepted + 1,
                finish: None,
                next: Some(token),
                exact_row: None,
            });
        }
        unreachable!("the last row always ends the chain")
    }
}
