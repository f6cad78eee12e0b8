//! Prefix cache for the hybrid model: earlier sequences kept with state checkpoints, so a request whose prompt
//! starts like an earlier one prefills only the tokens after the longest shared checkpoint.
//!
//! Attention layers could resume at any length (their caches only grow and can be cut), but the Gated DeltaNet
//! recurrent and conv state and the PLE n-gram context are overwritten by every token: a sequence can only be
//! resumed where a [`Snapshot`] was taken. The worker therefore takes checkpoints while it runs a request:
//! at every turn boundary of the prompt (before each `<|im_start|>`, so a new chat that shares a system prompt
//! resumes after it), every [`PrefixCacheOptions::interval`] tokens, at the end of the prompt (with its last
//! logits, so an exact repeat prefills nothing) and at the end of the output (so a follow-up turn, whose prompt
//! is this prompt + this answer + the new message, prefills only the new message).
//!
//! An entry is the whole [`SequenceState`] of a finished request (its attention caches hold every token) plus its
//! checkpoints. A new request forks a fresh state from an entry ([`crate::model::Qwen4Exp::fork_state`]), so the
//! entry stays usable; entries are evicted least recently used first, by count and by bytes.

pub mod disk;

use crate::model::{SequenceState, Snapshot};

/// Settings of the prefix cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixCacheOptions {
    /// Sequences kept (0 turns the cache off).
    pub max_entries: usize,
    /// Most bytes of state kept, all entries together (attention caches + checkpoints).
    pub max_bytes: usize,
    /// A checkpoint every this many tokens inside a long prompt or answer, besides turn boundaries.
    pub interval: usize,
    /// Directory of the on-disk prefix cache ([`disk::DiskCache`]); `None`: no disk cache.
    pub disk_dir: Option<std::path::PathBuf>,
    /// Most bytes the on-disk cache keeps in `disk_dir`, all entries together (every model's sharing it).
    pub disk_max_bytes: u64,
}

impl Default for PrefixCacheOptions {
    /// 8 sequences, 2 GiB, a checkpoint every 1024 tokens; no disk cache.
    fn default() -> Self {
        Self { max_entries: 8, max_bytes: 2 << 30, interval: 1024, disk_dir: None, disk_max_bytes: 0 }
    }
}

/// A resumable point of a cached sequence.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// The recurrent and PLE state after `snapshot.pos()` tokens.
    pub snapshot: Snapshot,
    /// The logits after the last of those tokens, when kept (end of a prompt): resuming here needs no forward.
    pub logits: Option<Vec<f32>>,
}

impl Checkpoint {
    fn bytes(&self) -> usize {
        self.snapshot.bytes() + 4 * self.logits.as_ref().map_or(0, Vec::len)
    }
}

/// One cached sequence.
#[derive(Debug)]
pub struct CacheEntry {
    /// Tokens the state consumed (`state.pos == tokens.len()`).
    pub tokens: Vec<u32>,
    /// The sequence's state after all of `tokens`.
    pub state: SequenceState,
    /// Resumable points, by position.
    pub checkpoints: Vec<Checkpoint>,
}

impl CacheEntry {
    fn bytes(&self) -> usize {
        self.state.bytes() + self.checkpoints.iter().map(Checkpoint::bytes).sum::<usize>()
    }
}

/// Where a prompt can resume.
#[derive(Debug)]
pub struct CacheHit<'a> {
    /// The cached sequence.
    pub entry: &'a CacheEntry,
    /// Its checkpoint to resume from: the prompt's first `checkpoint.snapshot.pos()` tokens need no prefill.
    pub checkpoint: &'a Checkpoint,
}

/// The cache: entries in least-recently-used order (most recent last).
#[derive(Debug, Default)]
pub struct PrefixCache {
    opts: PrefixCacheOptions,
    entries: Vec<CacheEntry>,
}

impl PrefixCache {
    /// An empty cache.
    pub fn new(opts: PrefixCacheOptions) -> Self {
        Self { opts, entries: Vec::new() }
    }

    /// The settings.
    pub fn options(&self) -> &PrefixCacheOptions {
        &self.opts
    }

    /// Whether the cache keeps anything.
    pub fn enabled(&self) -> bool {
        self.opts.max_entries > 0 && self.opts.max_bytes > 0
    }

    /// Sequences held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no sequence is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(CacheEntry::bytes).sum()
    }

    /// The checkpoint that covers the most of `prompt`: its tokens are a prefix of `prompt`, and it is either
    /// shorter than the prompt or the whole prompt with logits kept. Marks the entry as recently used.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<CacheHit<'_>> {
        let mut best: Option<(usize, usize, usize)> = None; // (covered, entry, checkpoint)
        for (e, entry) in self.entries.iter().enumerate() {
            let common = entry.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
            for (c, cp) in entry.checkpoints.iter().enumerate() {
                let pos = cp.snapshot.pos();
                let usable = pos > 0 && pos <= common && (pos < prompt.len() || cp.logits.is_some());
                if usable && best.is_none_or(|(covered, _, _)| pos > covered) {
                    best = Some((pos, e, c));
                }
            }
        }
        let (_, e, c) = best?;
        let entry = self.entries.remove(e);
        self.entries.push(entry);
        let entry = self.entries.last()?;
        Some(CacheHit { entry, checkpoint: &entry.checkpoints[c] })
    }

    /// Keeps a finished sequence. Its checkpoints are thinned when it would take more than half the budget
    /// (interior ones go first, oldest first; the first, which a chat sharing the system prompt resumes from, and
    /// the last two, the end of the prompt and of the answer, stay). Entries whose tokens are a prefix of it are
    /// dropped (it covers them), then the least recently used go until the limits hold. A sequence still larger
    /// than the whole budget is not kept.
    pub fn insert(&mut self, mut entry: CacheEntry) {
        if !self.enabled() || entry.checkpoints.is_empty() {
            return;
        }
        while entry.bytes() > self.opts.max_bytes / 2 && entry.checkpoints.len() > 3 {
            entry.checkpoints.remove(1);
        }
        if entry.bytes() > self.opts.max_bytes {
            return;
        }
        self.entries.retain(|old| !entry.tokens.starts_with(&old.tokens));
        self.entries.push(entry);
        while self.entries.len() > self.opts.max_entries || self.bytes() > self.opts.max_bytes {
            self.entries.remove(0);
        }
    }

    /// Drops every entry.
    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::linear_attn::GdnState;
    use crate::model::state::LayerState;

    /// A one-layer recurrent sequence of `tokens` with a checkpoint at each of `at` (1 KiB each).
    fn entry(tokens: &[u32], at: &[usize]) -> CacheEntry {
        let gdn = GdnState { conv: vec![0.0; 0], recurrent: vec![0.0; 256] };
        let state = SequenceState {
            pos: tokens.len(),
            max_len: 1 << 20,
            layers: vec![LayerState::LinearAttention(gdn.clone())],
            ple: None,
            mtp: None,
        };
        let checkpoints = at
            .iter()
            .map(|&pos| Checkpoint {
                snapshot: Snapshot { pos, recurrent: vec![Some(gdn.clone())], ple: None, mtp_bank: None },
                logits: None,
            })
            .collect();
        CacheEntry { tokens: tokens.to_vec(), state, checkpoints }
    }

    #[test]
    fn lookup_takes_the_longest_usable_checkpoint() {
        let mut cache = PrefixCache::new(PrefixCacheOptions::default());
        cache.insert(entry(&[1, 2, 3, 4, 5, 6], &[2, 4, 6]));
        let hit = cache.lookup(&[1, 2, 3, 4, 9]).unwrap();
        assert_eq!(hit.checkpoint.snapshot.pos(), 4);
        // The whole prompt is covered only by a checkpoint with logits; otherwise one token is left to run.
        let hit = cache.lookup(&[1, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!(hit.checkpoint.snapshot.pos(), 4);
        assert!(cache.lookup(&[7, 8]).is_none());
    }

    #[test]
    fn limits_thin_checkpoints_and_evict_the_least_recently_used() {
        // Each entry: 1 KiB of state + 1 KiB per checkpoint.
        let opts = PrefixCacheOptions { max_entries: 2, max_bytes: 8 * 1024, interval: 4, ..Default::default() };
        let mut cache = PrefixCache::new(opts);
        cache.insert(entry(&[1; 10], &[1, 2, 3, 4, 5, 6, 7, 8]));
        let kept: Vec<usize> = cache.entries[0].checkpoints.iter().map(|c| c.snapshot.pos()).collect();
        assert_eq!(kept, vec![1, 7, 8], "thinned to half the budget: the first and the last two stay");
        cache.insert(entry(&[2; 10], &[5]));
        cache.lookup(&[1; 12]);
        cache.insert(entry(&[3; 10], &[5]));
        let firsts: Vec<u32> = cache.entries.iter().map(|e| e.tokens[0]).collect();
        assert_eq!(firsts, vec![1, 3], "the least recently used entry went");
        // A sequence that extends a cached one replaces it.
        cache.insert(entry(&[3; 14], &[12]));
        assert_eq!(cache.len(), 2);
        assert!(cache.entries.iter().all(|e| e.tokens.len() != 10 || e.tokens[0] != 3));
    }
}
