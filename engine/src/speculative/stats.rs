//! Counters of speculative decoding: per request ([`DecodeReport`]) and server-wide ([`SpecStats`], read by the
//! service's `/metrics`).

use std::sync::atomic::{AtomicU64, Ordering};

use super::window::{ChainCase, ChainSample, MAX_WINDOW};

/// What speculative decoding did for one request (or a benchmark run).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodeReport {
    /// Draft tokens proposed.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// Chains by case: `[A, B, C]`.
    pub chains: [usize; 3],
    /// Chains whose first draft was rejected.
    pub first_rejected: usize,
    /// Plain (non-speculative) decode steps.
    pub plain_steps: usize,
    /// Tokens produced by chains (accepted drafts + bonus or replacement tokens).
    pub chain_tokens: usize,
    /// Chains per window size (index = window, 0..=16).
    pub windows: Vec<usize>,
    /// Drafting turned off (acceptance collapse).
    pub collapses: usize,
    /// Drafting came back after a collapse.
    pub recoveries: usize,
    /// Seconds drafting.
    pub draft_s: f64,
    /// Seconds in verify passes (save and realign excluded).
    pub verify_s: f64,
    /// Seconds saving state before verify passes.
    pub save_s: f64,
    /// Seconds rolling back.
    pub restore_s: f64,
    /// Seconds realigning the MTP cache inside verify passes.
    pub realign_s: f64,
    /// Seconds in case-B exact steps.
    pub exact_s: f64,
    /// Seconds in plain decode steps.
    pub plain_s: f64,
}

impl DecodeReport {
    /// Chains run.
    pub fn total_chains(&self) -> usize {
        self.chains.iter().sum()
    }

    /// Accepted / proposed drafts (0 without drafts).
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 { 0.0 } else { self.accepted as f64 / self.drafted as f64 }
    }

    /// Mean tokens a chain produced (accepted drafts + the bonus or replacement).
    pub fn mean_accepted_length(&self) -> f64 {
        let c = self.total_chains();
        if c == 0 { 0.0 } else { self.chain_tokens as f64 / c as f64 }
    }

    /// Adds one chain.
    pub fn add_chain(&mut self, s: &ChainSample) {
        self.drafted += s.window;
        self.accepted += s.accepted;
        self.chains[case_index(s.case)] += 1;
        if s.case == ChainCase::C && s.accepted == 0 {
            self.first_rejected += 1;
        }
        self.chain_tokens += s.tokens;
        if self.windows.len() <= s.window {
            self.windows.resize(s.window.max(MAX_WINDOW) + 1, 0);
        }
        self.windows[s.window] += 1;
        self.draft_s += s.draft_s;
        self.verify_s += s.verify_s;
        self.save_s += s.save_s;
        self.restore_s += s.restore_s;
        self.realign_s += s.realign_s;
        self.exact_s += s.exact_s;
    }

    /// Adds another report.
    pub fn merge(&mut self, o: &DecodeReport) {
        self.drafted += o.drafted;
        self.accepted += o.accepted;
        for i in 0..3 {
            self.chains[i] += o.chains[i];
        }
        self.first_rejected += o.first_rejected;
        self.plain_steps += o.plain_steps;
        self.chain_tokens += o.chain_tokens;
        if self.windows.len() < o.windows.len() {
            self.windows.resize(o.windows.len(), 0);
        }
        for (a, b) in self.windows.iter_mut().zip(&o.windows) {
            *a += b;
        }
        self.collapses += o.collapses;
        self.recoveries += o.recoveries;
        self.draft_s += o.draft_s;
        self.verify_s += o.verify_s;
        self.save_s += o.save_s;
        self.restore_s += o.restore_s;
        self.realign_s += o.realign_s;
        self.exact_s += o.exact_s;
        self.plain_s += o.plain_s;
    }
}

fn case_index(c: ChainCase) -> usize {
    match c {
        ChainCase::A => 0,
        ChainCase::B => 1,
        ChainCase::C => 2,
    }
}

/// Server-wide counters since start (atomics, read by the metrics endpoint).
#[derive(Debug, Default)]
pub struct SpecStats {
    /// Draft tokens proposed.
    pub drafted: AtomicU64,
    /// Draft tokens accepted.
    pub accepted: AtomicU64,
    /// Chains by case `[A, B, C]`.
    pub chains: [AtomicU64; 3],
    /// Chains per window size (index = window).
    pub windows: [AtomicU64; MAX_WINDOW + 1],
    /// Acceptance collapses (drafting turned off for a request).
    pub collapses: AtomicU64,
    /// Drafting came back after a collapse.
    pub recoveries: AtomicU64,
    /// Microseconds per phase: `[draft, verify, save, restore, realign, exact]`.
    pub phase_us: [AtomicU64; 6],
    /// Recent acceptance (accepted / proposed drafts per chain, exponentially averaged with weight 0.05 per
    /// chain), as `f64` bits; read with [`SpecStats::recent_acceptance`].
    recent_acceptance: AtomicU64,
}

impl SpecStats {
    /// Recent acceptance in [0, 1] (0 before any chain).
    pub fn recent_acceptance(&self) -> f64 {
        f64::from_bits(self.recent_acceptance.load(Ordering::Relaxed))
    }
}

/// Names of [`SpecStats::phase_us`] entries, in order.
pub const PHASES: [&str; 6] = ["draft", "verify", "save", "restore", "realign", "exact"];

impl SpecStats {
    /// Adds one chain.
    pub fn add_chain(&self, s: &ChainSample) {
        let r = Ordering::Relaxed;
        self.drafted.fetch_add(s.window as u64, r);
        self.accepted.fetch_add(s.accepted as u64, r);
        self.chains[case_index(s.case)].fetch_add(1, r);
        if let Some(w) = self.windows.get(s.window) {
            w.fetch_add(1, r);
        }
        if s.window > 0 {
            let a = s.accepted as f64 / s.window as f64;
            let _ = self.recent_acceptance.fetch_update(r, r, |bits| {
                let old = f64::from_bits(bits);
                // Bits 0 (0.0) mean "no chain yet": the first chain sets the value.
                let new = if bits == 0 { a } else { 0.95 * old + 0.05 * a };
                Some(if new == 0.0 { f64::MIN_POSITIVE.to_bits() } else { new.to_bits() })
            });
        }
        let us = |x: f64| (x * 1e6).max(0.0) as u64;
        for (slot, v) in
            self.phase_us.iter().zip([s.draft_s, s.verify_s, s.save_s, s.restore_s, s.realign_s, s.exact_s])
        {
            slot.fetch_add(us(v), r);
        }
    }
}
