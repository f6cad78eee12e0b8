//! The CPU mixture-of-experts kernel of the hybrid path: every routed expert of a layer for a batch of up to
//! 17 tokens (any count works) in one parallel region.
//!
//! For each expert `e` and each of its tokens `t` with router weight `w`:
//! `out[t] += w * W_down[e] (silu(W_gate[e] x_t) * W_up[e] x_t)` (transformers' `Qwen4ExpTextExperts`).
//!
//! One parallel region ([`rayon::broadcast`], or for a single token the spinning pool of [`super::spin_pool`] on a
//! thread that opted in, with as many participants as the rayon pool has threads) runs the first three phases separated by spin barriers, each phase taking work items
//! from a shared counter:
//! 1. gate/up: items are (expert, 32 rows); each weight row is dotted with the expert's tokens in tiles of 4
//!    (one decode of each weight block per tile), and `silu(gate) * up` is written at once;
//! 2. each expert's hidden vectors are quantized for its down projection;
//! 3. down: items are (expert, 64 rows), each a contiguous run of the expert's down projection (so the
//!    hardware prefetchers stream it), written to the expert's output block;
//! 4. combine: items are 64 output rows; each output value sums `w * y` over the experts in the order given.
//!
//! Phases 1-3 ([`expert_outputs`]) and phase 4 ([`combine_expert_outputs`]) are also callable apart, so the
//! experts of one layer can be computed in several groups (those in RAM while those on SSD are still being read,
//! then the SSD ones as their reads land) and still be summed in one fixed order.
//!
//! Every output value is produced by one item in a fixed order (experts in the order of the work list, usually
//! ascending id), and every dot product goes through the same kernels whatever the tile, so the result is
//! bit-identical for any thread count.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

use super::{ActFormat, ActRow, Activations, Matrix};

/// One expert's three projections: `gate` and `up` are `[ff, d]`, `down` is `[d, ff]`.
#[derive(Debug, Clone, Copy)]
pub struct ExpertRef<'a> {
    /// `W_gate`, `[ff, d]`.
    pub gate: &'a Matrix,
    /// `W_up`, `[ff, d]`.
    pub up: &'a Matrix,
    /// `W_down`, `[d, ff]`.
    pub down: &'a Matrix,
}

/// An expert and the tokens routed to it, with their weights (token indices into the batch, any order; the
/// expert's output for token `t` is scaled by its weight and added to `out[t]`).
#[derive(Debug, Clone)]
pub struct ExpertWork<'a> {
    /// The expert's weights.
    pub expert: ExpertRef<'a>,
    /// `(token, weight)` pairs.
    pub tokens: Vec<(usize, f32)>,
}

/// Rows per gate/up and per down-projection work item: (32, 64), or `NEBULA_CPU_MOE_ROWS=G,D` (tuning; any sizes
/// give the same bits, only the work split changes). Measured on the H200 machine's 16-core host in one run
/// (`nebula bench kernels`, `nebula-q4` layer, 10 experts a token): (16, 32) / (32, 64) / (64, 128) reached 66 / 64 /
/// 71 % of the read bandwidth for one token at 14 threads and 70 / 86 / 78 % for 17 tokens; hybrid decode's CPU
/// expert time 9.3 ms a token with (16, 32), 8.4 ms with (32, 64). Longer runs restart the prefetch streams less;
/// much longer ones leave threads idle at the end of a phase.
fn item_rows() -> (usize, usize) {
    crate::tuning::cpu().moe_rows
}
/// Largest batch the MoE kernel runs on the spinning pool (when the calling thread opted in, see
/// [`super::spin_pool::set_spin`]).
const SPIN_POOL_MAX_TOKENS: usize = 1;

/// Output rows per combining work item.
const COMBINE_ROWS: usize = 64;

/// Rows ahead of the one being multiplied whose bytes are prefetched into the cache (`NEBULA_CPU_PREFETCH`, 0 =
/// none; default 8, twice that for the short down-projection rows). A work item's rows are one contiguous run,
/// but items are taken from a shared counter, so each thread's stream of weight bytes restarts every few KiB and
/// the hardware prefetchers barely get going; asking for the next rows explicitly keeps more reads in flight per
/// core. Measured on the H200 machine's 16-core host (`nebula bench kernels`, the MoE kernel on the `nebula-q4`
/// types, one token, 14 threads): 43.6 % of the read bandwidth without, 53.3 % at 4 rows, 59.6 % at 8.
fn prefetch_rows() -> usize {
    crate::tuning::cpu().prefetch_rows
}

/// Asks the cache hierarchy for every 64-byte line of `bytes` (no effect on the result; a no-op off x86-64).
#[inline(always)]
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        let mut off = 0;
        while off < bytes.len() {
            // SAFETY: the address lies inside `bytes`; a prefetch never faults and changes no state.
            unsafe {
                core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                    bytes.as_ptr().add(off) as *const i8
                )
            };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Where the time of [`expert_outputs`] goes, for benchmarks (`NEBULA_CPU_MOE_TRACE=1`; off, it costs one flag
/// test per thread and phase). Every call adds, in nanoseconds from the call's start: when the parallel region
/// began (the setup before it: work lists, activations, buffers), when the first and the last thread of the region
/// started, when the first and the last finished gate/up (phase 1), when phase 2 ended (the
/// second barrier released), when the first and the last finished the down projections, and when the call
/// returned; plus the weight bytes of each phase. [`trace::report`] prints the means.
pub mod trace {
    use std::sync::atomic::{AtomicU64, Ordering};

    /// The events of one call, in order (see the module docs).
    pub(super) const EVENTS: [&str; 9] = [
        "region",
        "first start",
        "last start",
        "first gate/up done",
        "last gate/up done",
        "phase 2 done",
        "first down done",
        "last down done",
        "return",
    ];

    /// Whether tracing is on ([`crate::tuning::CpuTuning::moe_trace`], `NEBULA_CPU_MOE_TRACE=1`).
    pub fn enabled() -> bool {
        crate::tuning::cpu().moe_trace
    }

    /// Sums over calls: calls, the 9 event times, gate/up bytes, down bytes.
    pub(super) static TOTALS: [AtomicU64; 12] = [const { AtomicU64::new(0) }; 12];

    /// One call's events, min/max folded by the threads of the region.
    pub(super) struct Call {
        pub(super) t0: std::time::Instant,
        pub(super) ev: [AtomicU64; 9],
    }

    impl Call {
        pub(super) fn new() -> Self {
            let ev = std::array::from_fn(|i| AtomicU64::new(if matches!(i, 1 | 3 | 6) { u64::MAX } else { 0 }));
            Self { t0: std::time::Instant::now(), ev }
        }
        fn now(&self) -> u64 {
            self.t0.elapsed().as_nanos() as u64
        }
        /// Records "first/last" event pair `k` (1: start, 3: gate/up done, 6: down done) for this thread.
        pub(super) fn pair(&self, k: usize) {
            let t = self.now();
            self.ev[k].fetch_min(t, Ordering::Relaxed);
            self.ev[k + 1].fetch_max(t, Ordering::Relaxed);
        }
        pub(super) fn single(&self, k: usize) {
            self.ev[k].fetch_max(self.now(), Ordering::Relaxed);
        }
        /// Folds the call into the totals.
        pub(super) fn finish(&self, bytes_gate_up: u64, bytes_down: u64) {
            self.single(8);
            TOTALS[0].fetch_add(1, Ordering::Relaxed);
            for (i, e) in self.ev.iter().enumerate() {
                TOTALS[1 + i].fetch_add(e.load(Ordering::Relaxed), Ordering::Relaxed);
            }
            TOTALS[10].fetch_add(bytes_gate_up, Ordering::Relaxed);
            TOTALS[11].fetch_add(bytes_down, Ordering::Relaxed);
        }
    }

    /// Hybrid decode's hand-offs (count, nanoseconds): from the host thread sending a layer's CPU experts to the
    /// CPU thread starting them (engine/src/backend/cuda/hybrid/cpu.rs; recorded only while tracing).
    static HANDOFF: [AtomicU64; 2] = [const { AtomicU64::new(0) }; 2];

    /// Records one hand-off latency (see [`HANDOFF`]).
    pub fn handoff(ns: u64) {
        HANDOFF[0].fetch_add(1, Ordering::Relaxed);
        HANDOFF[1].fetch_add(ns, Ordering::Relaxed);
    }

    /// Hybrid decode's CPU jobs (count, nanoseconds): a layer's whole CPU share, of which the kernel calls are
    /// part (the rest: routing lists, the weighted sum of the experts' outputs, the copy into the upload buffer).
    static JOB: [AtomicU64; 2] = [const { AtomicU64::new(0) }; 2];

    /// Records one CPU job's duration (see [`JOB`]).
    pub fn job(ns: u64) {
        JOB[0].fetch_add(1, Ordering::Relaxed);
        JOB[1].fetch_add(ns, Ordering::Relaxed);
    }

    /// The mean time of each event since the call's start (microseconds), the weight bytes per call and the
    /// phases' rates (gate/up: bytes / last gate/up done - first start; down: bytes / last down done - phase 2
    /// done); `None` before any traced call. Clears the totals.
    pub fn report() -> Option<String> {
        let t: Vec<u64> = TOTALS.iter().map(|a| a.swap(0, Ordering::Relaxed)).collect();
        if t[0] == 0 {
            return None;
        }
        let calls = t[0] as f64;
        let us = |i: usize| t[1 + i] as f64 / calls / 1e3;
        let mut s = format!("CPU MoE kernel, mean of {} calls (microseconds from the call):", t[0]);
        for (i, name) in EVENTS.iter().enumerate() {
            s += &format!(" {name} {:.1};", us(i));
        }
        let (gu, dn) = (t[10] as f64 / calls, t[11] as f64 / calls);
        s += &format!(
            " weight bytes gate/up {:.2} MB at {:.1} GB/s, down {:.2} MB at {:.1} GB/s",
            gu / 1e6,
            gu / ((us(4) - us(1)).max(1e-3) * 1e3),
            dn / 1e6,
            dn / ((us(7) - us(5)).max(1e-3) * 1e3)
        );
        let (n, ns) = (HANDOFF[0].swap(0, Ordering::Relaxed), HANDOFF[1].swap(0, Ordering::Relaxed));
        if n > 0 {
            s += &format!("; hybrid hand-off to the CPU thread {:.1} us (mean of {n})", ns as f64 / n as f64 / 1e3);
        }
        let (n, ns) = (JOB[0].swap(0, Ordering::Relaxed), JOB[1].swap(0, Ordering::Relaxed));
        if n > 0 {
            s += &format!("; hybrid CPU job {:.1} us (mean of {n})", ns as f64 / n as f64 / 1e3);
        }
        Some(s)
    }
}

/// `x / (1 + e^-x)`.
#[inline(always)]
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// The rows of one matrix with its bytes resolved once (a work item's loop then slices them directly instead of
/// going through [`Matrix::row_bytes_of`]'s shared-owner indirection for every row).
#[derive(Clone, Copy)]
struct Rows<'a> {
    bytes: &'a [u8],
    rb: usize,
}

impl<'a> Rows<'a> {
    fn of(m: &'a Matrix) -> Self {
        Self { bytes: m.bytes(), rb: m.row_bytes() }
    }
    /// Raw bytes of row `r` (as [`Matrix::row_bytes_of`]).
    #[inline(always)]
    fn row(&self, r: usize) -> &'a [u8] {
        &self.bytes[r * self.rb..(r + 1) * self.rb]
    }
}

/// A slice shared by the threads of the region, each item writing a range no other item writes.
struct Shared<T>(*mut T, usize);
unsafe impl<T: Send> Send for Shared<T> {}
unsafe impl<T: Send> Sync for Shared<T> {}
impl<T> Shared<T> {
    fn new(v: &mut [T]) -> Self {
        Self(v.as_mut_ptr(), v.len())
    }
    /// # Safety
    /// No other thread may access `start..start + len` while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn range(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start + len <= self.1);
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

/// A sense-reversing spin barrier for the threads of one region.
struct SpinBarrier {
    count: AtomicUsize,
    generation: AtomicUsize,
    n: usize,
}

impl SpinBarrier {
    fn new(n: usize) -> Self {
        Self { count: AtomicUsize::new(0), generation: AtomicUsize::new(0), n }
    }
    fn wait(&self) {
        let g = self.generation.load(Ordering::Acquire);
        if self.count.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            self.count.store(0, Ordering::Relaxed);
            self.generation.store(g + 1, Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == g {
            if spins < 1 << 12 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// Prepared activations of the batch, one per format the experts ask for.
struct BatchActs {
    f32: OnceLock<Activations>,
    q8_32: OnceLock<Activations>,
    q8k: OnceLock<Activations>,
}

impl BatchActs {
    fn get(&self, format: ActFormat, x: &[f32], d: usize, n: usize) -> &Activations {
        let cell = match format {
            ActFormat::F32 => &self.f32,
            ActFormat::Q8_32 => &self.q8_32,
            ActFormat::Q8K => &self.q8k,
        };
        cell.get_or_init(|| Activations::new(format, x, d, n))
    }
}

/// Adds the routed experts' outputs for the `n` tokens `x` (`[n, d]`) into `out` (`[n, d]`). Runs on the
/// current rayon pool (the global one, or the one `install`ed); must not be called from inside another
/// parallel operation of that pool. Panics if the shapes disagree.
///
/// Equals [`expert_outputs`] followed by [`combine_expert_outputs`] over the whole work list, bit for bit.
pub fn routed_experts(work: &[ExpertWork<'_>], x: &[f32], n: usize, out: &mut [f32]) {
    if work.is_empty() || n == 0 {
        return;
    }
    if super::matrix::observing() {
        observe_expert_inputs(work, x);
    }
    let outputs = expert_outputs(work, x, n);
    let parts: Vec<ExpertContribution<'_>> =
        work.iter().enumerate().map(|(i, w)| ExpertContribution { tokens: &w.tokens, y: outputs.block(i) }).collect();
    combine_expert_outputs(&parts, n, out);
}

/// For importance-matrix collection ([`super::matrix::ActObserver`]): each work item's gate and up inputs (its
/// tokens' rows of `x`) and its down input `silu(W_gate x) * W_up x`, computed here through the plain products
/// (the fused kernel never materialises it; the extra work happens only while an observer is installed).
fn observe_expert_inputs(work: &[ExpertWork<'_>], x: &[f32]) {
    for w in work {
        let (d, ff) = (w.expert.gate.cols(), w.expert.gate.rows());
        let xs: Vec<f32> = w.tokens.iter().flat_map(|&(t, _)| x[t * d..(t + 1) * d].iter().copied()).collect();
        let k = w.tokens.len();
        w.expert.gate.observe_input(&xs, k);
        w.expert.up.observe_input(&xs, k);
        let mut h = vec![0f32; k * ff];
        let mut u = vec![0f32; ff];
        for (i, row) in xs.chunks_exact(d).enumerate() {
            let g = &mut h[i * ff..(i + 1) * ff];
            w.expert.gate.matvec_prepared(&w.expert.gate.prepare(row, 1), g);
            w.expert.up.matvec_prepared(&w.expert.up.prepare(row, 1), &mut u);
            for (gj, uj) in g.iter_mut().zip(&u) {
                *gj = silu(*gj) * uj;
            }
        }
        w.expert.down.observe_input(&h, k);
    }
}

/// The unweighted down-projection outputs of a list of experts for their tokens: block `i` belongs to work item
/// `i` and is `[d, tokens_i]` (output rows, tokens inner, tokens in the item's order).
#[derive(Debug, Clone, Default)]
pub struct ExpertOutputs {
    y: Vec<f32>,
    offsets: Vec<usize>,
}

impl ExpertOutputs {
    /// Block `i` (`[d, tokens_i]`); empty for an item without tokens or past the end.
    pub fn block(&self, i: usize) -> &[f32] {
        match (self.offsets.get(i), self.offsets.get(i + 1)) {
            (Some(&a), Some(&b)) => &self.y[a..b],
            _ => &[],
        }
    }

    /// Number of blocks (work items).
    pub fn len(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// True when there are no blocks.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One expert's part of a layer's output: its `(token, weight)` pairs and its unweighted outputs `y`
/// (`[d, tokens.len()]`, a block of [`ExpertOutputs`]).
#[derive(Debug, Clone, Copy)]
pub struct ExpertContribution<'a> {
    /// `(token, weight)` pairs, in the order `y`'s columns follow.
    pub tokens: &'a [(usize, f32)],
    /// `[d, tokens.len()]`.
    pub y: &'a [f32],
}

/// Phases 1-3 of the kernel: gate/up with `silu(gate) * up`, the hidden vectors prepared for the down projection,
/// and the down projection, for every expert of `work` over its tokens of `x` (`[n, d]`). Each block depends on
/// its expert and tokens only, so any split of a layer's experts into several calls gives the same blocks.
/// Runs on the current rayon pool (see [`routed_experts`]). Panics if the shapes disagree.
pub fn expert_outputs(work: &[ExpertWork<'_>], x: &[f32], n: usize) -> ExpertOutputs {
    if work.is_empty() || n == 0 {
        return ExpertOutputs { y: Vec::new(), offsets: vec![0; work.len() + 1] };
    }
    let call = trace::enabled().then(trace::Call::new);
    let d = work[0].expert.gate.cols();
    assert_eq!(x.len(), n * d, "routed_experts: x is not [n, d]");
    for w in work {
        let (g, u, dn) = (w.expert.gate, w.expert.up, w.expert.down);
        assert!(g.cols() == d && u.cols() == d && dn.rows() == d, "routed_experts: expert shapes disagree");
        assert!(g.rows() == u.rows() && dn.cols() == g.rows(), "routed_experts: expert ff sizes disagree");
        assert!(w.tokens.iter().all(|&(t, _)| t < n), "routed_experts: token index out of range");
    }

    // Batch activations for gate/up, prepared once per format before the region.
    let acts = BatchActs { f32: OnceLock::new(), q8_32: OnceLock::new(), q8k: OnceLock::new() };
    for w in work {
        acts.get(w.expert.gate.act_format(), x, d, n);
        acts.get(w.expert.up.act_format(), x, d, n);
    }

    // Hidden vectors, one [tokens, ff] block per expert; gate/up items fill rows of the transposed [ff, tokens].
    let mut h_offsets = Vec::with_capacity(work.len() + 1);
    h_offsets.push(0usize);
    for w in work {
        h_offsets.push(h_offsets.last().unwrap() + w.tokens.len() * w.expert.gate.rows());
    }
    let mut h_t = vec![0f32; *h_offsets.last().unwrap()];
    let h_shared = Shared::new(&mut h_t);
    let down_acts: Vec<OnceLock<Activations>> = work.iter().map(|_| OnceLock::new()).collect();
    // Down outputs, one [d, tokens] block per expert (row-major, tokens inner).
    let mut y_offsets = Vec::with_capacity(work.len() + 1);
    y_offsets.push(0usize);
    for w in work {
        y_offsets.push(y_offsets.last().unwrap() + w.tokens.len() * d);
    }
    let mut y_all = vec![0f32; *y_offsets.last().unwrap()];
    let y_shared = Shared::new(&mut y_all);

    let (rows1, rows3) = item_rows();
    // Work items of phase 1: (expert index, first row).
    let mut items1 = Vec::new();
    for (e, w) in work.iter().enumerate() {
        if w.tokens.is_empty() {
            continue;
        }
        for r0 in (0..w.expert.gate.rows()).step_by(rows1) {
            items1.push((e, r0));
        }
    }
    let mut items3 = Vec::new();
    for (e, w) in work.iter().enumerate() {
        if !w.tokens.is_empty() {
            items3.extend((0..d).step_by(rows3).map(|r0| (e, r0)));
        }
    }
    let next1 = AtomicUsize::new(0);
    let next2 = AtomicUsize::new(0);
    let next3 = AtomicUsize::new(0);
    let threads = rayon::current_num_threads();
    let barrier = SpinBarrier::new(threads);
    if let Some(c) = &call {
        c.single(0);
    }

    let region = |_: usize| {
        if let Some(c) = &call {
            c.pair(1);
        }
        // Phase 1: gate, up, silu * up.
        loop {
            let i = next1.fetch_add(1, Ordering::Relaxed);
            if i >= items1.len() {
                break;
            }
            let (e, r0) = items1[i];
            let w = &work[e];
            let ff = w.expert.gate.rows();
            let nt = w.tokens.len();
            let r1 = (r0 + rows1).min(ff);
            let ga = acts.get(w.expert.gate.act_format(), x, d, n);
            let ua = acts.get(w.expert.up.act_format(), x, d, n);
            // SAFETY: rows r0..r1 of expert e's transposed block belong to this item alone.
            let h = unsafe { h_shared.range(h_offsets[e] + r0 * nt, (r1 - r0) * nt) };
            let mut gv = [0f32; 4];
            let mut uv = [0f32; 4];
            let ahead = prefetch_rows();
            let (gr, ur) = (Rows::of(w.expert.gate), Rows::of(w.expert.up));
            for r in r0..(r0 + ahead).min(r1) {
                prefetch(gr.row(r));
                prefetch(ur.row(r));
            }
            // Token tiles outside, rows inside: the tile's views are built once, the item's rows stay in cache.
            for (c, tile) in w.tokens.chunks(4).enumerate() {
                let m = tile.len();
                let tg: [ActRow<'_>; 4] = std::array::from_fn(|i| ga.row(tile[i.min(m - 1)].0));
                let tu: [ActRow<'_>; 4] = std::array::from_fn(|i| ua.row(tile[i.min(m - 1)].0));
                for (k, r) in (r0..r1).enumerate() {
                    if c == 0 && ahead > 0 && r + ahead < r1 {
                        prefetch(gr.row(r + ahead));
                        prefetch(ur.row(r + ahead));
                    }
                    (w.expert.gate.kernels().dot)(gr.row(r), &tg[..m], &mut gv[..m]);
                    (w.expert.up.kernels().dot)(ur.row(r), &tu[..m], &mut uv[..m]);
                    for i in 0..m {
                        h[k * nt + 4 * c + i] = silu(gv[i]) * uv[i];
                    }
                }
            }
        }
        if let Some(c) = &call {
            c.pair(3);
        }
        barrier.wait();
        // Phase 2: each expert's hidden vectors, token-major, prepared for its down projection.
        loop {
            let e = next2.fetch_add(1, Ordering::Relaxed);
            if e >= work.len() {
                break;
            }
            let w = &work[e];
            let (ff, nt) = (w.expert.gate.rows(), w.tokens.len());
            if nt == 0 {
                continue;
            }
            // SAFETY: phase 1 is over (barrier); expert e's block is read by this item alone here.
            let ht = unsafe { h_shared.range(h_offsets[e], ff * nt) };
            let mut h = vec![0f32; ff * nt];
            for r in 0..ff {
                for t in 0..nt {
                    h[t * ff + r] = ht[r * nt + t];
                }
            }
            let _ = down_acts[e].set(w.expert.down.prepare(&h, nt));
        }
        barrier.wait();
        if let Some(c) = &call {
            c.single(5);
        }
        // Phase 3: down projections, one contiguous run of rows of one expert per item.
        loop {
            let i = next3.fetch_add(1, Ordering::Relaxed);
            if i >= items3.len() {
                break;
            }
            let (e, r0) = items3[i];
            let w = &work[e];
            let nt = w.tokens.len();
            let r1 = (r0 + rows3).min(d);
            let da = down_acts[e].get().expect("phase 2 prepared every expert with tokens");
            // SAFETY: rows r0..r1 of expert e's output block belong to this item alone.
            let y = unsafe { y_shared.range(y_offsets[e] + r0 * nt, (r1 - r0) * nt) };
            let mut v = [0f32; 4];
            // Down rows are short (640 values): twice as many rows ahead.
            let ahead = 2 * prefetch_rows();
            let dr = Rows::of(w.expert.down);
            for r in r0..(r0 + ahead).min(r1) {
                prefetch(dr.row(r));
            }
            for (c, tile) in w.tokens.chunks(4).enumerate() {
                let m = tile.len();
                let tx: [ActRow<'_>; 4] = std::array::from_fn(|i| da.row(4 * c + i.min(m - 1)));
                for (k, r) in (r0..r1).enumerate() {
                    if c == 0 && ahead > 0 && r + ahead < r1 {
                        prefetch(dr.row(r + ahead));
                    }
                    (w.expert.down.kernels().dot)(dr.row(r), &tx[..m], &mut v[..m]);
                    // Element by element: a copy of 1-4 values as `copy_from_slice` is a `memcpy` call per row.
                    for (i, &vi) in v[..m].iter().enumerate() {
                        y[k * nt + 4 * c + i] = vi;
                    }
                }
            }
        }
        if let Some(c) = &call {
            c.pair(6);
        }
    };
    // The spinning pool serves one-token batches (hybrid decode); longer ones keep rayon, which was faster for
    // 17 tokens in `nebula bench kernels` (H200 host: 54-68 % against 46-62 % of the read bandwidth), and whose
    // wake-up costs little against a multi-millisecond call.
    let spinning = if n <= SPIN_POOL_MAX_TOKENS { super::spin_pool::pool(threads) } else { None };
    match spinning {
        Some(pool) => pool.run(&region),
        None => {
            rayon::broadcast(|ctx| region(ctx.index()));
        }
    }
    if let Some(c) = &call {
        let active = work.iter().filter(|w| !w.tokens.is_empty());
        let gate_up: usize = active.clone().map(|w| w.expert.gate.bytes().len() + w.expert.up.bytes().len()).sum();
        let down: usize = active.map(|w| w.expert.down.bytes().len()).sum();
        c.finish(gate_up as u64, down as u64);
    }
    ExpertOutputs { y: y_all, offsets: y_offsets }
}

/// Phase 4 of the kernel: adds `sum_e w_e y_e[t]` to `out[t]` (`out` is `[n, d]`), each output value summing the
/// contributions in the order of `parts` (so the result does not depend on how the blocks were computed). Runs
/// on the current rayon pool. Panics if a block's size disagrees with its tokens or `out` is not `[n, d]`.
pub fn combine_expert_outputs(parts: &[ExpertContribution<'_>], n: usize, out: &mut [f32]) {
    if n == 0 {
        return;
    }
    let d = out.len() / n;
    assert_eq!(out.len(), n * d, "routed_experts: out is not [n, d]");
    for p in parts {
        assert_eq!(p.y.len(), p.tokens.len() * d, "routed_experts: an output block does not match its tokens");
        assert!(p.tokens.iter().all(|&(t, _)| t < n), "routed_experts: token index out of range");
    }
    // Output transposed: [d, n], items of COMBINE_ROWS rows.
    let mut out_t = vec![0f32; d * n];
    let combine = |i: usize, o: &mut [f32]| {
        let r0 = i * COMBINE_ROWS;
        let r1 = (r0 + COMBINE_ROWS).min(d);
        for p in parts {
            let nt = p.tokens.len();
            if nt == 0 {
                continue;
            }
            let y = &p.y[r0 * nt..r1 * nt];
            if let [(t, wt)] = *p.tokens {
                // One token (every part of a decode step): a strided axpy, contiguous (and vectorised) for a batch
                // of one; the same operations in the same order as the general loop below.
                if n == 1 {
                    for (ov, &v) in o.iter_mut().zip(y) {
                        *ov += wt * v;
                    }
                } else {
                    for (k, &v) in y.iter().enumerate() {
                        o[k * n + t] += wt * v;
                    }
                }
                continue;
            }
            for k in 0..r1 - r0 {
                for (i, &(t, wt)) in p.tokens.iter().enumerate() {
                    o[k * n + t] += wt * y[k * nt + i];
                }
            }
        }
    };
    if d * n * parts.len() < PARALLEL_COMBINE_MIN {
        out_t.chunks_mut(COMBINE_ROWS * n).enumerate().for_each(|(i, o)| combine(i, o));
    } else {
        out_t.par_chunks_mut(COMBINE_ROWS * n).enumerate().for_each(|(i, o)| combine(i, o));
    }
    for r in 0..d {
        for t in 0..n {
            out[t * d + r] += out_t[r * n + t];
        }
    }
}

/// Below this many multiply-adds the combine runs on the calling thread.
const PARALLEL_COMBINE_MIN: usize = 1 << 16;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgmlType;
    use crate::quant::{WeightBytes, quantize};

    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
            })
            .collect()
    }

    fn matrix(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Matrix {
        let v = rand_vec(rows * cols, seed);
        let bytes = quantize::quantize_tensor(ty, &v, cols, None).unwrap();
        Matrix::new(ty, rows, cols, WeightBytes::from_vec(bytes)).unwrap()
    }

    struct Experts {
        m: Vec<(Matrix, Matrix, Matrix)>,
    }

    fn experts(types: (GgmlType, GgmlType), count: usize, d: usize, ff: usize) -> Experts {
        Experts {
            m: (0..count)
                .map(|e| {
                    let s = 100 * e as u64;
                    (matrix(types.0, ff, d, s + 1), matrix(types.0, ff, d, s + 2), matrix(types.1, d, ff, s + 3))
                })
                .collect(),
        }
    }

    fn work<'a>(ex: &'a Experts, n: usize, k: usize) -> Vec<ExpertWork<'a>> {
        let mut by: Vec<Vec<(usize, f32)>> = vec![Vec::new(); ex.m.len()];
        for t in 0..n {
            for j in 0..k {
                let e = (t * 7 + j * 3) % ex.m.len();
                if !by[e].iter().any(|&(tt, _)| tt == t) {
                    by[e].push((t, 1.0 / (j + 1) as f32));
                }
            }
        }
        ex.m.iter()
            .zip(by)
            .filter(|(_, toks)| !toks.is_empty())
            .map(|((g, u, dn), tokens)| ExpertWork { expert: ExpertRef { gate: g, up: u, down: dn }, tokens })
            .collect()
    }

    /// The same sums through Matrix::matmul, one expert at a time (the unfused reference).
    fn reference(w: &[ExpertWork<'_>], x: &[f32], n: usize, d: usize) -> Vec<f32> {
        let mut out = vec![0f32; n * d];
        for ew in w {
            let ff = ew.expert.gate.rows();
            let nt = ew.tokens.len();
            let xs: Vec<f32> = ew.tokens.iter().flat_map(|&(t, _)| x[t * d..(t + 1) * d].to_vec()).collect();
            let (mut g, mut u) = (vec![0f32; nt * ff], vec![0f32; nt * ff]);
            ew.expert.gate.matmul(&xs, nt, &mut g);
            ew.expert.up.matmul(&xs, nt, &mut u);
            let h: Vec<f32> = g.iter().zip(&u).map(|(&a, &b)| silu(a) * b).collect();
            let mut y = vec![0f32; nt * d];
            ew.expert.down.matmul(&h, nt, &mut y);
            for (i, &(t, wt)) in ew.tokens.iter().enumerate() {
                for r in 0..d {
                    out[t * d + r] += wt * y[i * d + r];
                }
            }
        }
        out
    }

    #[test]
    fn same_result_for_any_thread_count_or_pool_and_equal_to_unfused() {
        let (d, ff) = (512, 96);
        for types in
            [(GgmlType::Q4_K, GgmlType::IQ4_NL), (GgmlType::Q8_0, GgmlType::Q8_0), (GgmlType::F32, GgmlType::BF16)]
        {
            let ex = experts(types, 12, d, ff);
            for n in [1usize, 4, 17] {
                let w = work(&ex, n, 4);
                let x = rand_vec(n * d, 7 + n as u64);
                let want = reference(&w, &x, n, d);
                let mut results = Vec::new();
                // rayon pools of 1, 2 and 5 threads, then the hybrid path's spinning pool of 3 participants.
                for (threads, spin_us) in [(1, 0), (2, 0), (5, 0), (3, 200)] {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    let mut out = vec![0f32; n * d];
                    pool.install(|| {
                        super::super::spin_pool::set_spin(spin_us);
                        routed_experts(&w, &x, n, &mut out)
                    });
                    results.push(out);
                }
                for r in &results[1..] {
                    assert!(
                        r.iter().zip(&results[0]).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{types:?} n={n}: thread counts disagree"
                    );
                }
                assert_eq!(results[0], want, "{types:?} n={n}: fused kernel differs from the unfused products");
            }
        }
    }

    #[test]
    fn experts_computed_in_groups_combine_to_the_same_bits() {
        let (d, ff, n) = (256, 64, 5);
        let ex = experts((GgmlType::Q4_K, GgmlType::IQ4_NL), 9, d, ff);
        let w = work(&ex, n, 3);
        let x = rand_vec(n * d, 3);
        let mut whole = vec![0.5f32; n * d];
        routed_experts(&w, &x, n, &mut whole);
        // Odd items in one call, even items in another, then combined in the original order.
        let odd: Vec<ExpertWork<'_>> = w.iter().skip(1).step_by(2).cloned().collect();
        let even: Vec<ExpertWork<'_>> = w.iter().step_by(2).cloned().collect();
        let (yo, ye) = (expert_outputs(&odd, &x, n), expert_outputs(&even, &x, n));
        let parts: Vec<ExpertContribution<'_>> = (0..w.len())
            .map(|i| ExpertContribution {
                tokens: &w[i].tokens,
                y: if i % 2 == 1 { yo.block(i / 2) } else { ye.block(i / 2) },
            })
            .collect();
        let mut split = vec![0.5f32; n * d];
        combine_expert_outputs(&parts, n, &mut split);
        assert!(whole.iter().zip(&split).all(|(a, b)| a.to_bits() == b.to_bits()), "grouping changed the sums");
        assert_eq!((yo.len(), ye.len()), (odd.len(), even.len()));
    }
}
