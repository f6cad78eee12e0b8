//! The SSD tier: experts read on demand into a bounded pool of aligned buffers by a few I/O threads, kept while
//! the pool has room (experts a compute step used go first, least recently used first; then a compute step may
//! evict the prefetched expert read last; a prefetch never evicts a prefetched expert not yet used), and
//! prefetched from a prediction of the next layers' routing while that pays ([`PrefetchGate`]).
//!
//! An expert's entry is `Loading` (a read is in flight), `Ready` (its three matrices live in a pool buffer) or
//! `Failed` (the read's error, handed to the one who asked). A compute step *wants* the experts it asked for:
//! they are not evicted until it has taken them ([`SsdTier::take`]); what it holds is pinned by its `Arc`s, and a
//! buffer goes back to the pool when the last `Arc` of its expert drops. Prefetches only use free or evictable
//! buffers and never wait, so they can never starve a compute step.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;

use crate::model::moe::Expert;
use crate::quant::{Matrix, WeightBytes};

use super::memory::AlignedBuf;
use super::reader::{ReadError, Span, WeightReader, read_span};
use super::stats::PlacementStats;

/// A job for the I/O threads.
pub(crate) type IoJob = Box<dyn FnOnce() + Send>;

/// A few threads that run blocking reads, fed by a queue.
pub(crate) struct IoPool {
    jobs: Mutex<Option<Sender<IoJob>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    count: usize,
}

impl IoPool {
    /// Starts `threads` I/O threads (at least one).
    pub(crate) fn new(threads: usize) -> std::io::Result<Self> {
        let (tx, rx) = channel::<IoJob>();
        let rx = Arc::new(Mutex::new(rx));
        let count = threads.max(1);
        let mut handles = Vec::with_capacity(count);
        for i in 0..count {
            let rx: Arc<Mutex<Receiver<IoJob>>> = rx.clone();
            handles.push(std::thread::Builder::new().name(format!("nebula-io-{i}")).spawn(move || {
                loop {
                    let job = match rx.lock() {
                        Ok(r) => r.recv(),
                        Err(_) => return,
                    };
                    match job {
                        // A panicking job must not take the thread down with it (its caller sees the loss).
                        Ok(job) => {
                            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                        }
                        Err(_) => return,
                    }
                }
            })?);
        }
        Ok(Self { jobs: Mutex::new(Some(tx)), threads: Mutex::new(handles), count })
    }

    /// Number of threads.
    pub(crate) fn threads(&self) -> usize {
        self.count
    }

    /// Queues `job`; returns it back when the pool has shut down.
    pub(crate) fn submit(&self, job: IoJob) -> Result<(), IoJob> {
        let guard = match self.jobs.lock() {
            Ok(g) => g,
            Err(_) => return Err(job),
        };
        match guard.as_ref() {
            Some(tx) => tx.send(job).map_err(|e| e.0),
            None => Err(job),
        }
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        if let Ok(mut j) = self.jobs.lock() {
            j.take();
        }
        if let Ok(mut t) = self.threads.lock() {
            for h in t.drain(..) {
                let _ = h.join();
            }
        }
    }
}

/// Where one routed expert's bytes are in the model file and how its matrices are shaped: enough to read it into
/// a buffer and rebuild the [`Expert`].
#[derive(Debug, Clone)]
pub(crate) struct ExpertSource {
    /// Gate, up and down projections, in that order.
    pub(crate) spans: [Span; 3],
    /// `(type, rows, cols)` of each.
    pub(crate) shapes: [(crate::gguf::GgmlType, usize, usize); 3],
}

impl ExpertSource {
    /// Buffer bytes to read this expert with `align`-aligned reads (each projection in its own aligned run).
    pub(crate) fn buffer_len(&self, align: usize) -> usize {
        self.spans.iter().map(|s| s.padded_len(align).div_ceil(align.max(64)) * align.max(64)).sum()
    }

    /// Reads the expert into `buf` (aligned, at least [`ExpertSource::buffer_len`] long) and returns where each
    /// projection's bytes landed (for [`ExpertSource::build`]).
    ///
    /// Errors: the read of any projection failed or came up short.
    pub(crate) fn read_into(
        &self,
        reader: &dyn WeightReader,
        buf: &mut [u8],
    ) -> Result<[std::ops::Range<usize>; 3], ReadError> {
        let align = reader.alignment().max(64);
        let mut at = 0usize;
        let mut ranges: [std::ops::Range<usize>; 3] = [0..0, 0..0, 0..0];
        for (i, s) in self.spans.iter().enumerate() {
            let len = s.padded_len(reader.alignment()).div_ceil(align) * align;
            let r = read_span(reader, *s, &mut buf[at..at + len])?;
            ranges[i] = at + r.start..at + r.end;
            at += len;
        }
        Ok(ranges)
    }

    /// The expert's matrices over bytes `ranges` of `owner`.
    pub(crate) fn build(
        &self,
        owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
        ranges: &[std::ops::Range<usize>; 3],
    ) -> Result<Expert, String> {
        let m = |i: usize| -> Result<Matrix, String> {
            let (ty, rows, cols) = self.shapes[i];
            let bytes = WeightBytes::new(owner.clone(), ranges[i].clone()).map_err(|e| e.to_string())?;
            Matrix::new(ty, rows, cols, bytes).map_err(|e| e.to_string())
        };
        Ok(Expert { gate_proj: m(0)?, up_proj: m(1)?, down_proj: m(2)? })
    }
}

/// A pool buffer holding one expert; goes back to the pool's free list when dropped.
struct PoolBuf {
    buf: Option<AlignedBuf>,
    home: Weak<Shared>,
}

impl AsRef<[u8]> for PoolBuf {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_ref().map_or(&[], |b| b.as_slice())
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        if let (Some(buf), Some(home)) = (self.buf.take(), self.home.upgrade()) {
            home.give_back(buf);
        }
    }
}

/// An expert read from SSD, alive while someone holds its `Arc`.
pub(crate) type LoadedExpert = Arc<Expert>;

enum Entry {
    Loading { prefetch: bool, wanted: bool },
    Ready { expert: LoadedExpert, last_use: u64, prefetch: bool, wanted: bool },
    Failed(ReadError),
}

struct State {
    free: Vec<AlignedBuf>,
    entries: HashMap<(u32, u32), Entry>,
    tick: u64,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn give_back(&self, buf: AlignedBuf) {
        if let Ok(mut s) = self.state.lock() {
            s.free.push(buf);
        }
        self.changed.notify_all();
    }
}

/// Outcome of asking for an expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Requested {
    /// Already loaded or loading.
    Present,
    /// A read was queued.
    Issued,
    /// No buffer can be had without waiting for the caller's own experts: take those first, then ask again.
    NoBuffer,
}

/// Turns prefetching off while it does not pay: a prefetched expert that no compute step takes cost a read the
/// compute steps' own reads had to queue behind. Every [`PrefetchGate::WINDOW`] prefetches the share a compute
/// step then used is checked; below [`PrefetchGate::MIN_USED`] the gate closes, and after
/// [`PrefetchGate::PROBE`] skipped prefetch calls it opens again for a fresh window (routing, and with it the
/// prediction's accuracy, changes with the text). `NEBULA_SSD_PREFETCH_GATE=0` keeps it open.
#[derive(Debug, Clone)]
pub(crate) struct PrefetchGate {
    open: bool,
    /// Prefetches issued and used at the start of the window.
    issued0: u64,
    used0: u64,
    /// Prefetch calls skipped since the gate closed.
    skipped: u64,
}

impl PrefetchGate {
    /// Prefetches judged together.
    pub(crate) const WINDOW: u64 = 128;
    /// Share of prefetched experts a compute step must take for prefetching to stay on.
    pub(crate) const MIN_USED: f64 = 0.3;
    /// Prefetch calls (one per layer and step) skipped before trying again.
    pub(crate) const PROBE: u64 = 384;

    pub(crate) fn new() -> Self {
        Self { open: true, issued0: 0, used0: 0, skipped: 0 }
    }

    /// Whether a prefetch call should run, given the counters so far (`issued` prefetches, `used` of them taken
    /// by a compute step).
    pub(crate) fn allow(&mut self, issued: u64, used: u64) -> bool {
        if self.open {
            let n = issued.saturating_sub(self.issued0);
            if n >= Self::WINDOW {
                let share = used.saturating_sub(self.used0) as f64 / n as f64;
                self.issued0 = issued;
                self.used0 = used;
                if share < Self::MIN_USED {
                    self.open = false;
                    self.skipped = 0;
                }
            }
        } else {
            self.skipped += 1;
            if self.skipped >= Self::PROBE {
                self.open = true;
                self.issued0 = issued;
                self.used0 = used;
            }
        }
        self.open
    }
}

/// The SSD tier of one model: sources of every SSD expert, the buffer pool, the cache and the I/O threads.
pub(crate) struct SsdTier {
    gate: Option<Mutex<PrefetchGate>>,
    shared: Arc<Shared>,
    sources: HashMap<(u32, u32), ExpertSource>,
    reader: Arc<dyn WeightReader>,
    io: Arc<IoPool>,
    stats: Arc<PlacementStats>,
    capacity: usize,
    slot_bytes: usize,
}

impl SsdTier {
    /// A tier over `sources` with `buffers` pool buffers of `slot_bytes` each (already allocated, locked when
    /// permitted), reading through `reader` on `io`'s threads.
    pub(crate) fn new(
        sources: HashMap<(u32, u32), ExpertSource>,
        buffers: Vec<AlignedBuf>,
        slot_bytes: usize,
        reader: Arc<dyn WeightReader>,
        io: Arc<IoPool>,
        stats: Arc<PlacementStats>,
    ) -> Self {
        let capacity = buffers.len();
        let gated = crate::tuning::cpu().ssd_prefetch_gate;
        Self {
            gate: gated.then(|| Mutex::new(PrefetchGate::new())),
            shared: Arc::new(Shared {
                state: Mutex::new(State { free: buffers, entries: HashMap::new(), tick: 0 }),
                changed: Condvar::new(),
            }),
            sources,
            reader,
            io,
            stats,
            capacity,
            slot_bytes,
        }
    }

    /// Whether prefetching pays at the moment ([`PrefetchGate`]; always true with the gate off).
    pub(crate) fn prefetch_allowed(&self) -> bool {
        let Some(gate) = &self.gate else { return true };
        let issued = self.stats.prefetch_issued.load(Ordering::Relaxed);
        let used = self.stats.prefetch_hits.load(Ordering::Relaxed);
        let mut g = gate.lock().unwrap_or_else(|p| p.into_inner());
        let was_open = g.open;
        let open = g.allow(issued, used);
        if was_open && !open {
            self.stats.prefetch_gate_closed.fetch_add(1, Ordering::Relaxed);
        }
        open
    }

    /// Read bandwidth of this tier's experts in bytes/s: as many threads as the I/O pool has each read whole
    /// experts, in turn from the tier's sources (spread over the file), into their own aligned buffer through the
    /// tier's reader, for about `seconds`. Meant for benchmarks while nothing else reads (the floor of
    /// decode with an SSD tier); with buffered reads (no `O_DIRECT`) the page cache can inflate it.
    ///
    /// Errors: a read failed.
    pub(crate) fn read_bandwidth(&self, seconds: f64) -> Result<f64, ReadError> {
        let mut keys: Vec<&(u32, u32)> = self.sources.keys().collect();
        keys.sort();
        if keys.is_empty() {
            return Ok(0.0);
        }
        let threads = self.io.threads().max(1);
        // A stride coprime-ish with the count walks the experts of every layer rather than one layer's in order.
        let stride = (keys.len() / 7).max(1) | 1;
        let next = std::sync::atomic::AtomicUsize::new(0);
        let bytes = std::sync::atomic::AtomicU64::new(0);
        let t0 = std::time::Instant::now();
        let deadline = std::time::Duration::from_secs_f64(seconds);
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| -> Result<(), ReadError> {
                        let mut buf = AlignedBuf::new(self.slot_bytes).map_err(|e| ReadError {
                            file: self.reader.part_name(0),
                            offset: 0,
                            len: self.slot_bytes,
                            detail: format!("allocating a read buffer: {e}"),
                        })?;
                        while t0.elapsed() < deadline {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let src = &self.sources[keys[(i * stride) % keys.len()]];
                            src.read_into(self.reader.as_ref(), buf.as_mut_slice())?;
                            bytes.fetch_add(src.spans.iter().map(|s| s.len as u64).sum(), Ordering::Relaxed);
                        }
                        Ok(())
                    })
                })
                .collect();
            for w in workers {
                w.join().expect("read bandwidth worker panicked")?;
            }
            Ok::<(), ReadError>(())
        })?;
        Ok(bytes.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64())
    }

    /// Pool buffers.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes of one pool buffer.
    pub(crate) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// True when expert `expert` of `layer` lives on SSD.
    pub(crate) fn holds(&self, layer: usize, expert: usize) -> bool {
        self.sources.contains_key(&(layer as u32, expert as u32))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the map inconsistent (entries are replaced whole).
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks for expert `expert` of `layer`: a compute step (`prefetch` false) marks it wanted and may wait for
    /// a prefetch in flight to free a buffer; a prefetch never waits and never takes a wanted expert's buffer.
    pub(crate) fn request(&self, layer: usize, expert: usize, prefetch: bool) -> Requested {
        let key = (layer as u32, expert as u32);
        let Some(source) = self.sources.get(&key) else { return Requested::Present };
        let mut st = self.lock();
        loop {
            match st.entries.get_mut(&key) {
                Some(Entry::Loading { wanted, .. }) | Some(Entry::Ready { wanted, .. }) => {
                    *wanted |= !prefetch;
                    return Requested::Present;
                }
                Some(Entry::Failed(_)) if prefetch => return Requested::Present,
                Some(Entry::Failed(_)) => {
                    st.entries.remove(&key);
                }
                None => {}
            }
            if let Some(buf) = st.free.pop() {
                st.entries.insert(key, Entry::Loading { prefetch, wanted: !prefetch });
                drop(st);
                self.issue(key, source.clone(), buf, prefetch);
                return Requested::Issued;
            }
            // Evict an expert nobody wants or holds: the least recently used of those a compute step took
            // already; failing that, and only for a compute step, the prefetched expert read last (read-ahead
            // runs in the order of use, so it is needed furthest ahead). A prefetch never evicts a prefetched
            // expert not yet used: a read-ahead longer than the pool would otherwise evict its own head and
            // read it twice.
            let evictable = |e: &Entry| match e {
                Entry::Ready { expert, last_use, wanted: false, prefetch } if Arc::strong_count(expert) == 1 => {
                    Some((*prefetch, *last_use))
                }
                _ => None,
            };
            let victim = st
                .entries
                .iter()
                .filter_map(|(k, e)| evictable(e).filter(|(pending, _)| !pending).map(|(_, t)| (t, *k)))
                .min()
                .or_else(|| {
                    if prefetch {
                        return None;
                    }
                    st.entries
                        .iter()
                        .filter_map(|(k, e)| evictable(e).filter(|(pending, _)| *pending).map(|(_, t)| (t, *k)))
                        .max()
                });
            if let Some((_, k)) = victim {
                let evicted = st.entries.remove(&k);
                drop(st);
                // Dropping the expert returns its buffer (which takes the lock).
                drop(evicted);
                st = self.lock();
                continue;
            }
            let prefetches_in_flight = st.entries.values().any(|e| matches!(e, Entry::Loading { wanted: false, .. }));
            if prefetch || !prefetches_in_flight {
                return Requested::NoBuffer;
            }
            st = self.shared.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn issue(&self, key: (u32, u32), source: ExpertSource, mut buf: AlignedBuf, prefetch: bool) {
        let shared = Arc::downgrade(&self.shared);
        let reader = self.reader.clone();
        let stats = self.stats.clone();
        if prefetch {
            stats.prefetch_issued.fetch_add(1, Ordering::Relaxed);
        }
        let job: IoJob = Box::new(move || {
            let Some(home) = shared.upgrade() else { return };
            // A panic here would leave the entry loading forever and its waiter stuck: make it a read error.
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                source.read_into(reader.as_ref(), buf.as_mut_slice())
            }))
            .unwrap_or_else(|_| {
                Err(ReadError {
                    file: reader.part_name(source.spans[0].part),
                    offset: source.spans[0].offset,
                    len: source.spans.iter().map(|s| s.len).sum(),
                    detail: "the read failed with an internal error (panic)".into(),
                })
            });
            let bytes: u64 = source.spans.iter().map(|s| s.len as u64).sum();
            let entry = match outcome {
                Ok(ranges) => {
                    let owner = Arc::new(PoolBuf { buf: Some(buf), home: Arc::downgrade(&home) });
                    match source.build(owner, &ranges) {
                        Ok(expert) => {
                            stats.ssd_bytes.fetch_add(bytes, Ordering::Relaxed);
                            stats.ssd_reads.fetch_add(1, Ordering::Relaxed);
                            Ok(Arc::new(expert))
                        }
                        Err(detail) => Err((
                            None,
                            ReadError {
                                file: reader.part_name(source.spans[0].part),
                                offset: source.spans[0].offset,
                                len: bytes as usize,
                                detail,
                            },
                        )),
                    }
                }
                Err(e) => Err((Some(buf), e)),
            };
            let mut st = home.state.lock().unwrap_or_else(|p| p.into_inner());
            let (wanted, prefetch) = match st.entries.get(&key) {
                Some(Entry::Loading { wanted, prefetch }) => (*wanted, *prefetch),
                _ => (false, prefetch),
            };
            match entry {
                Ok(expert) => {
                    st.tick += 1;
                    let last_use = st.tick;
                    st.entries.insert(key, Entry::Ready { expert, last_use, prefetch, wanted });
                }
                Err((buf, e)) => {
                    stats.ssd_errors.fetch_add(1, Ordering::Relaxed);
                    if let Some(buf) = buf {
                        st.free.push(buf);
                    }
                    if wanted {
                        st.entries.insert(key, Entry::Failed(e));
                    } else {
                        // A failed prefetch is forgotten: a compute step that needs the expert reads it again.
                        st.entries.remove(&key);
                    }
                }
            }
            drop(st);
            home.changed.notify_all();
        });
        let done = self.io.submit(job);
        if done.is_err() {
            let mut st = self.lock();
            st.entries.insert(
                key,
                Entry::Failed(ReadError {
                    file: self.reader.part_name(0),
                    offset: 0,
                    len: 0,
                    detail: "the I/O threads have stopped".into(),
                }),
            );
            drop(st);
            self.shared.changed.notify_all();
        }
    }

    /// Waits for expert `expert` of `layer` (asked for with [`SsdTier::request`]; asked again when it was
    /// evicted meanwhile) and returns it pinned. Counts a prefetch hit when a prefetch had brought it in.
    ///
    /// Errors: the read failed (the entry is dropped, so a later request reads it again).
    pub(crate) fn take(&self, layer: usize, expert: usize) -> Result<LoadedExpert, ReadError> {
        let key = (layer as u32, expert as u32);
        let mut st = self.lock();
        loop {
            let ready = match st.entries.get_mut(&key) {
                Some(Entry::Ready { expert, prefetch, wanted, .. }) => {
                    *wanted = false;
                    Some((expert.clone(), std::mem::take(prefetch)))
                }
                Some(Entry::Failed(_)) => match st.entries.remove(&key) {
                    Some(Entry::Failed(e)) => return Err(e),
                    _ => unreachable!("the entry was Failed a moment ago under the same lock"),
                },
                Some(Entry::Loading { wanted, .. }) => {
                    *wanted = true;
                    None
                }
                None => {
                    drop(st);
                    if self.request(layer, expert, false) == Requested::NoBuffer {
                        return Err(ReadError {
                            file: self.reader.part_name(0),
                            offset: 0,
                            len: self.slot_bytes,
                            detail: format!(
                                "no SSD buffer is free for expert {expert} of layer {layer}: all {} pool buffers \
                                 hold experts in use",
                                self.capacity
                            ),
                        });
                    }
                    st = self.lock();
                    continue;
                }
            };
            match ready {
                Some((e, was_prefetch)) => {
                    if was_prefetch {
                        self.stats.prefetch_hits.fetch_add(1, Ordering::Relaxed);
                    }
                    st.tick += 1;
                    let now = st.tick;
                    if let Some(Entry::Ready { last_use, .. }) = st.entries.get_mut(&key) {
                        *last_use = now;
                    }
                    return Ok(e);
                }
                None => st = self.shared.changed.wait(st).unwrap_or_else(|p| p.into_inner()),
            }
        }
    }
}
