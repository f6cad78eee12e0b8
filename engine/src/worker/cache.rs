//! The worker's side of the prefix cache: resuming a request from the best checkpoint (in memory, or promoted
//! from the on-disk prompt cache), keeping a finished sequence (compacted to its tokens on a device), and the
//! disk writer thread.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::{EngineOptions, EngineStats};
use crate::backend::{Backend, BackendError, BackendKind, HeldBytes, Kept};
use crate::model::Qwen4Exp;
use crate::prefix_cache::disk::{DiskCache, HostEntry, ModelIdentity, Stored};
use crate::prefix_cache::{CacheEntry, Checkpoint, PrefixCache};

/// A state to run a prompt on ([`CacheSide::start_state`]): the state, the prompt's last logits when the
/// cache covered all of it (empty otherwise), and the checkpoints of the prefix it already holds.
pub(super) type Start<B> = (<B as Backend>::State, Vec<f32>, Vec<Checkpoint<<B as Backend>::Snapshot>>);

/// The prefix cache of a worker and its disk writer.
pub(super) struct CacheSide<B: Backend> {
    pub(super) cache: PrefixCache<B>,
    pub(super) disk: Option<DiskWriter>,
    /// `<|im_start|>`: the prompt gets a checkpoint before each one (turn boundaries).
    pub(super) turn_start: Option<u32>,
    pub(super) stats: Arc<EngineStats>,
}

impl<B: Backend> CacheSide<B> {
    /// Reads the on-disk entry that covers more of `prompt` than the in-memory cache does into the in-memory
    /// cache (in host memory; a request resuming from it copies it to the backend).
    fn promote_from_disk(&mut self, backend: &B, prompt: &[u32]) {
        let Some(writer) = &self.disk else { return };
        let covered = self.cache.covered(prompt);
        let Some(hit) = writer.disk.lookup(prompt).filter(|h| h.pos > covered) else { return };
        let Some(loaded) = writer.disk.load(&hit) else { return };
        let HostEntry { tokens, state, checkpoints } = loaded.entry;
        let checkpoints = checkpoints
            .into_iter()
            .map(|c| {
                let image = Arc::try_unwrap(c.snapshot).unwrap_or_else(|shared| (*shared).clone());
                Checkpoint::new(backend.snapshot_from_image(image), c.logits)
            })
            .collect();
        let state_held = HeldBytes { device: 0, host: state.bytes() };
        self.cache.insert(CacheEntry { tokens, state: Kept::Host(state), checkpoints, state_held });
        // The entry may not have been kept (over the host budget); the request then prefills as without it.
        if self.cache.covered(prompt) >= hit.pos {
            self.stats.disk_hits.fetch_add(hit.pos, Ordering::Relaxed);
        }
    }

    /// Positions of the prompt where a checkpoint is taken: before each `<|im_start|>` after the first token,
    /// every `interval` tokens, and the end. Sorted, above `from`.
    pub(super) fn prompt_checkpoints(&self, prompt: &[u32], from: usize) -> Vec<usize> {
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

    /// The state to run `prompt` on: forked from the prefix cache's best checkpoint (with the cached logits when
    /// it covers the whole prompt, and the entry's earlier checkpoints), or fresh.
    ///
    /// Errors: a fresh state cannot be allocated (a failed fork falls back to a fresh state).
    pub(super) fn start_state(
        &mut self,
        backend: &B,
        prompt: &[u32],
        limit: usize,
        drafting: bool,
        use_cache: bool,
    ) -> Result<Start<B>, BackendError> {
        if use_cache {
            self.promote_from_disk(backend, prompt);
            self.stats.prefix_queries.fetch_add(prompt.len(), Ordering::Relaxed);
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

    /// Keeps a finished sequence (`tokens`, all consumed by `state`) with a checkpoint at its end: compacted on
    /// a device, written through to disk, inserted, the device budget enforced.
    pub(super) fn keep(
        &mut self,
        backend: &B,
        tokens: Vec<u32>,
        state: B::State,
        mut checkpoints: Vec<Checkpoint<B::Snapshot>>,
        drafting: bool,
    ) {
        let end = backend.position(&state);
        if checkpoints.last().is_none_or(|c| c.pos() != end) {
            match backend.snapshot(&state) {
                Ok(snap) => checkpoints.push(Checkpoint::new(snap, None)),
                Err(e) => tracing::warn!("prefix cache: no checkpoint at {end}: {e}"),
            }
        }
        let state = compact(backend, state, checkpoints.last(), end, drafting);
        self.write_to_disk(backend, &tokens, &state, &checkpoints);
        self.cache.insert(CacheEntry::new(backend, tokens, state, checkpoints));
        self.cache.fit_device_budget(backend);
    }

    /// Hands a host copy of a finished sequence to the disk writer, unless a write is still in flight.
    fn write_to_disk(&self, backend: &B, tokens: &[u32], state: &B::State, checkpoints: &[Checkpoint<B::Snapshot>]) {
        let Some(writer) = &self.disk else { return };
        if writer.busy.swap(true, Ordering::SeqCst) {
            return;
        }
        let entry = (|| -> Result<HostEntry, BackendError> {
            let checkpoints = checkpoints
                .iter()
                .map(|c| Ok(Checkpoint::new(backend.snapshot_image(&c.snapshot)?, c.logits.clone())))
                .collect::<Result<Vec<_>, BackendError>>()?;
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

    /// Publishes the cache's size to the stats.
    pub(super) fn report(&self) {
        let held = self.cache.held();
        self.stats.cache_entries.store(self.cache.len(), Ordering::Relaxed);
        self.stats.cache_bytes.store(held.device + held.host, Ordering::Relaxed);
        self.stats.cache_device_bytes.store(held.device, Ordering::Relaxed);
        self.stats.cache_spills.store(self.cache.spilled(), Ordering::Relaxed);
    }
}

/// A state made for `max_len` tokens, forked into `n` copies of its prefix at `snap` (which was taken from it
/// just now): the state comes back with the forks (a fork that fails is that copy's error).
pub(super) fn fork_live<B: Backend>(
    backend: &B,
    state: B::State,
    snap: &B::Snapshot,
    max_len: usize,
    drafting: bool,
    n: usize,
) -> (B::State, Vec<Result<B::State, BackendError>>) {
    let kept = Kept::Live(state);
    let forks = (0..n).map(|_| backend.fork(&kept, snap, max_len, drafting)).collect();
    match kept {
        Kept::Live(state) => (state, forks),
        Kept::Host(_) => unreachable!("made Live above"),
    }
}

/// A finished state kept for the cache, reallocated for the `end` tokens it holds when it lives on a device: a
/// GPU state's buffers are sized for the request's whole limit (and carry its chain buffers and graphs), so it
/// is forked from its last checkpoint (`last`, at `end`) into one sized to its tokens. A state without device
/// memory, or without a checkpoint at `end`, is kept as it is.
fn compact<B: Backend>(
    backend: &B,
    state: B::State,
    last: Option<&Checkpoint<B::Snapshot>>,
    end: usize,
    drafting: bool,
) -> B::State {
    let Some(last) = last.filter(|c| c.pos() == end) else { return state };
    if backend.state_held(&state).device == 0 {
        return state;
    }
    let (state, mut forks) = fork_live(backend, state, &last.snapshot, end, drafting, 1);
    match forks.pop() {
        Some(Ok(compact)) => compact,
        Some(Err(e)) => {
            tracing::warn!("prefix cache: keeping the state at its full size: {e}");
            state
        }
        None => state,
    }
}

/// The on-disk prompt cache of `opts` (`prefix_cache.disk_dir`) for `model`, keyed by the model file's identity
/// and the backend whose state layout its entries hold; `None` when it is off or cannot be opened (warned).
pub(super) fn open_disk_cache(model: &Qwen4Exp, opts: &EngineOptions) -> Option<Arc<DiskCache>> {
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
pub(super) struct DiskWriter {
    disk: Arc<DiskCache>,
    tx: std::sync::mpsc::SyncSender<HostEntry>,
    busy: Arc<AtomicBool>,
}

impl DiskWriter {
    pub(super) fn start(disk: Arc<DiskCache>, stats: Arc<EngineStats>) -> Self {
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
                        Ok(Stored::Written { .. }) => {
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
