//! Prefix cache: earlier sequences kept with state checkpoints, so a request whose prompt starts like an earlier
//! one prefills only the tokens after the longest shared checkpoint. It works the same on every backend
//! ([`Backend`]): the CPU model, the all-GPU and the hybrid CUDA model.
//!
//! Attention layers could resume at any length (their caches only grow and can be cut), but the Gated DeltaNet
//! recurrent and conv state and the PLE n-gram context are overwritten by every token: a sequence can only be
//! resumed where a snapshot ([`Backend::snapshot`]) was taken. The worker therefore takes checkpoints while it
//! runs a request: at every turn boundary of the prompt (before each `<|im_start|>`, so a new chat that shares a
//! system prompt resumes after it), every [`PrefixCacheOptions::interval`] tokens, at the end of the prompt (with
//! its last logits, so an exact repeat prefills nothing) and at the end of the output (so a follow-up turn, whose
//! prompt is this prompt + this answer + the new message, prefills only the new message).
//!
//! An entry is the whole state of a finished request (its attention caches hold every token) plus its
//! checkpoints. A new request forks a fresh state from an entry ([`Backend::fork`]), so the entry stays usable;
//! entries are evicted least recently used first, by count and by host bytes. On a GPU an entry's state and
//! snapshots live in VRAM up to [`PrefixCacheOptions::device_bytes`]; past it the least recently used entries
//! are spilled to host memory ([`Backend::spill_state`], [`Backend::spill_snapshot`]) and copied back when a
//! request resumes from them, never recomputed.

pub mod disk;

use crate::backend::{Backend, BackendSnapshot, HeldBytes, Kept};

/// Settings of the prefix cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixCacheOptions {
    /// Sequences kept (0 turns the cache off).
    pub max_entries: usize,
    /// Most bytes of host memory kept, all entries together (attention caches + checkpoints, spilled GPU entries
    /// included).
    pub max_bytes: usize,
    /// Most bytes of device memory (VRAM) entries may keep before the least recently used are spilled to host
    /// memory (GPU backends; the CPU model keeps nothing on a device).
    pub device_bytes: usize,
    /// A checkpoint every this many tokens inside a long prompt or answer, besides turn boundaries.
    pub interval: usize,
    /// Directory of the on-disk prefix cache ([`disk::DiskCache`]); `None`: no disk cache.
    pub disk_dir: Option<std::path::PathBuf>,
    /// Most bytes the on-disk cache keeps in `disk_dir`, all entries together (every model's sharing it).
    pub disk_max_bytes: u64,
}

impl Default for PrefixCacheOptions {
    /// 8 sequences, 2 GiB of host memory, 1 GiB of VRAM, a checkpoint every 1024 tokens; no disk cache.
    fn default() -> Self {
        Self {
            max_entries: 8,
            max_bytes: 2 << 30,
            device_bytes: 1 << 30,
            interval: 1024,
            disk_dir: None,
            disk_max_bytes: 0,
        }
    }
}

/// A resumable point of a cached sequence. Snapshots never change once taken, so entries and requests share them.
pub struct Checkpoint<S> {
    /// The recurrent and PLE state after `snapshot.pos()` tokens.
    pub snapshot: std::sync::Arc<S>,
    /// The logits after the last of those tokens, when kept (end of a prompt): resuming here needs no forward.
    pub logits: Option<Vec<f32>>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for Checkpoint<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint").field("snapshot", &self.snapshot).field("logits", &self.logits.is_some()).finish()
    }
}

impl<S> Clone for Checkpoint<S> {
    fn clone(&self) -> Self {
        Self { snapshot: self.snapshot.clone(), logits: self.logits.clone() }
    }
}

impl<S: BackendSnapshot> Checkpoint<S> {
    /// A checkpoint at `snapshot`, with the logits there when given.
    pub fn new(snapshot: S, logits: Option<Vec<f32>>) -> Self {
        Self { snapshot: std::sync::Arc::new(snapshot), logits }
    }

    /// Tokens covered.
    pub fn pos(&self) -> usize {
        self.snapshot.pos()
    }

    fn held(&self) -> HeldBytes {
        self.snapshot.held() + HeldBytes { device: 0, host: 4 * self.logits.as_ref().map_or(0, Vec::len) }
    }
}

/// One cached sequence.
pub struct CacheEntry<B: Backend> {
    /// Tokens the state consumed.
    pub tokens: Vec<u32>,
    /// The sequence's state after all of `tokens`.
    pub state: Kept<B::State>,
    /// Resumable points, by position.
    pub checkpoints: Vec<Checkpoint<B::Snapshot>>,
    /// What the state holds (checkpoints not included), by where.
    pub state_held: HeldBytes,
}

impl<B: Backend> CacheEntry<B> {
    /// An entry for `state` (live on `backend`) after `tokens`.
    pub fn new(backend: &B, tokens: Vec<u32>, state: B::State, checkpoints: Vec<Checkpoint<B::Snapshot>>) -> Self {
        let state_held = backend.state_held(&state);
        Self { tokens, state: Kept::Live(state), checkpoints, state_held }
    }

    /// Bytes held, by where.
    pub fn held(&self) -> HeldBytes {
        self.state_held + self.checkpoints.iter().map(Checkpoint::held).sum()
    }

    fn total(&self) -> usize {
        let h = self.held();
        h.device + h.host
    }

    /// Moves the state and every checkpoint to host memory.
    ///
    /// Errors: a device copy failed (the entry is then to be dropped).
    fn spill(&mut self, backend: &B) -> Result<(), crate::backend::BackendError> {
        if let Kept::Live(state) = &self.state {
            let image = backend.spill_state(state)?;
            self.state_held = HeldBytes { device: 0, host: image.bytes() };
            self.state = Kept::Host(image);
        }
        let checkpoints = std::mem::take(&mut self.checkpoints);
        for c in checkpoints {
            self.checkpoints.push(Checkpoint::new(backend.spill_snapshot(&c.snapshot)?, c.logits));
        }
        Ok(())
    }
}

/// Where a prompt can resume.
pub struct CacheHit<'a, B: Backend> {
    /// The cached sequence.
    pub entry: &'a CacheEntry<B>,
    /// Its checkpoint to resume from: the prompt's first `checkpoint.pos()` tokens need no prefill.
    pub checkpoint: &'a Checkpoint<B::Snapshot>,
}

/// The cache: entries in least-recently-used order (most recent last).
pub struct PrefixCache<B: Backend> {
    opts: PrefixCacheOptions,
    entries: Vec<CacheEntry<B>>,
    spilled: usize,
}

impl<B: Backend> PrefixCache<B> {
    /// An empty cache.
    pub fn new(opts: PrefixCacheOptions) -> Self {
        Self { opts, entries: Vec::new(), spilled: 0 }
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

    /// Bytes held, by where.
    pub fn held(&self) -> HeldBytes {
        self.entries.iter().map(CacheEntry::held).sum()
    }

    /// Bytes held in all (device and host).
    pub fn bytes(&self) -> usize {
        let h = self.held();
        h.device + h.host
    }

    /// Entries moved from device to host memory since the start.
    pub fn spilled(&self) -> usize {
        self.spilled
    }

    /// The checkpoint that covers the most of `prompt`: its tokens are a prefix of `prompt`, and it is either
    /// shorter than the prompt or the whole prompt with logits kept. Marks the entry as recently used.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<CacheHit<'_, B>> {
        let (_, e, c) = self.best(prompt)?;
        let entry = self.entries.remove(e);
        self.entries.push(entry);
        let entry = self.entries.last()?;
        Some(CacheHit { entry, checkpoint: &entry.checkpoints[c] })
    }

    /// Prompt tokens the best checkpoint for `prompt` covers (0 without one); marks nothing as used.
    pub fn covered(&self, prompt: &[u32]) -> usize {
        self.best(prompt).map_or(0, |(pos, _, _)| pos)
    }

    /// (covered tokens, entry, checkpoint) of the best usable checkpoint for `prompt`.
    fn best(&self, prompt: &[u32]) -> Option<(usize, usize, usize)> {
        let mut best: Option<(usize, usize, usize)> = None;
        for (e, entry) in self.entries.iter().enumerate() {
            let common = entry.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
            for (c, cp) in entry.checkpoints.iter().enumerate() {
                let pos = cp.pos();
                let usable = pos > 0 && pos <= common && (pos < prompt.len() || cp.logits.is_some());
                if usable && best.is_none_or(|(covered, _, _)| pos > covered) {
                    best = Some((pos, e, c));
                }
            }
        }
        best
    }

    /// Keeps a finished sequence. Its checkpoints are thinned when it would take more than half the budget (host
    /// memory, plus device memory for an entry that holds some): interior ones go first, oldest first; the first,
    /// which a chat sharing the system prompt resumes from, and the last two (the end of the answer and the one
    /// before it, usually the end of the prompt) stay. Entries whose tokens are a prefix of it are
    /// dropped (it covers them), then the least recently used are evicted while the count or the host budget is
    /// exceeded. A sequence still larger than the whole budget is not kept. A backend with device memory then
    /// calls [`PrefixCache::fit_device_budget`].
    pub fn insert(&mut self, mut entry: CacheEntry<B>) {
        if !self.enabled() || entry.checkpoints.is_empty() {
            return;
        }
        // Device memory counts only for entries that hold some (GPU states).
        let device = if entry.held().device > 0 { self.opts.device_bytes } else { 0 };
        let budget = self.opts.max_bytes.saturating_add(device);
        while entry.total() > budget / 2 && entry.checkpoints.len() > 3 {
            entry.checkpoints.remove(1);
        }
        if entry.held().host > self.opts.max_bytes || entry.total() > budget {
            return;
        }
        self.entries.retain(|old| !entry.tokens.starts_with(&old.tokens));
        self.entries.push(entry);
        self.evict();
    }

    /// Spills the least recently used entries to host memory while the entries hold more device memory than
    /// [`PrefixCacheOptions::device_bytes`] (an entry whose copy fails is dropped), then evicts as
    /// [`PrefixCache::insert`] does.
    pub fn fit_device_budget(&mut self, backend: &B) {
        let mut i = 0;
        while self.held().device > self.opts.device_bytes && i < self.entries.len() {
            if self.entries[i].held().device > 0 {
                if let Err(e) = self.entries[i].spill(backend) {
                    tracing::warn!("prefix cache: dropping an entry whose spill to host memory failed: {e}");
                    self.entries.remove(i);
                    continue;
                }
                self.spilled += 1;
            }
            i += 1;
        }
        self.evict();
    }

    fn evict(&mut self) {
        while self.entries.len() > self.opts.max_entries || self.held().host > self.opts.max_bytes {
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
    use crate::model::{Qwen4Exp, SequenceState, Snapshot};

    /// A one-layer recurrent sequence of `tokens` with a checkpoint at each of `at` (1 KiB each).
    fn entry(tokens: &[u32], at: &[usize]) -> CacheEntry<Qwen4Exp> {
        let gdn = GdnState { conv: vec![0.0; 0], recurrent: vec![0.0; 256] };
        let state = SequenceState {
            pos: tokens.len(),
            max_len: 1 << 20,
            layers: vec![LayerState::LinearAttention(gdn.clone())],
            ple: None,
            mtp: None,
            routing_stream: 0,
            mrope: Default::default(),
        };
        let checkpoints = at
            .iter()
            .map(|&pos| {
                Checkpoint::new(Snapshot { pos, recurrent: vec![Some(gdn.clone())], ple: None, mtp_bank: None }, None)
            })
            .collect();
        let state_held = HeldBytes { device: 0, host: state.bytes() };
        CacheEntry { tokens: tokens.to_vec(), state: Kept::Live(state), checkpoints, state_held }
    }

    #[test]
    fn lookup_takes_the_longest_usable_checkpoint() {
        let mut cache = PrefixCache::new(PrefixCacheOptions::default());
        cache.insert(entry(&[1, 2, 3, 4, 5, 6], &[2, 4, 6]));
        let hit = cache.lookup(&[1, 2, 3, 4, 9]).unwrap();
        assert_eq!(hit.checkpoint.pos(), 4);
        // The whole prompt is covered only by a checkpoint with logits; otherwise one token is left to run.
        let hit = cache.lookup(&[1, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!(hit.checkpoint.pos(), 4);
        assert!(cache.lookup(&[7, 8]).is_none());
    }

    #[test]
    fn limits_thin_checkpoints_and_evict_the_least_recently_used() {
        // Each entry: 1 KiB of state + 1 KiB per checkpoint.
        let opts = PrefixCacheOptions {
            max_entries: 2,
            max_bytes: 8 * 1024,
            device_bytes: 0,
            interval: 4,
            ..Default::default()
        };
        let mut cache = PrefixCache::new(opts);
        cache.insert(entry(&[1; 10], &[1, 2, 3, 4, 5, 6, 7, 8]));
        let kept: Vec<usize> = cache.entries[0].checkpoints.iter().map(|c| c.pos()).collect();
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
