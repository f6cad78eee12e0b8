//! Realistic routing for benchmarks: a seeded process that chooses each row's routed experts and their weights in
//! place of the router, with the real model's skew *and* temporal reuse.
//!
//! **Why not the weights.** A synthetic model's routers can be given the real model's skew (`synth` does: router
//! rows scaled by popularity), but not its reuse: the real model reuses experts across neighbouring tokens because
//! its hidden states follow the text, while a random-weight model's hidden states for random or greedily chosen
//! tokens are close to independent from one token to the next. So the synth keeps its skewed routers (the
//! *independent* mode, the router's own choice) and benchmarks can instead put a [`RoutingOverride`] on the model
//! ([`crate::model::Qwen4Exp::set_routing_override`]): for the row at position `p` of a sequence, each trunk layer
//! uses the experts and weights the override gives for `(stream, p, layer)` instead of the router's top-k. The
//! router still runs (its cost stays in the step), and everything after the choice is the forward's own code:
//! the same expert kernels, the same weighted sum, the same hybrid split. Only *which* experts and with *what
//! weights* changes, never the math (tests: `synth::routing::tests`, and `tests/gpu.rs` on the GPU).
//!
//! The stream of a sequence is [`stream_key`] of its first token, so concurrent sequences with different prompts
//! follow different streams; routing depends on the position, not on the token there, so an MTP draft row that
//! is rejected used the experts of the token that is finally accepted at its position (the real model's rejected
//! rows would route a little differently). The MTP block's own router is never overridden.
//!
//! **The process** ([`RealisticRouting`]), per stream and layer, fitted to the Transformers expert-streaming
//! study of the real model (48 layers x 512 experts, top-10):
//!
//! 1. A popularity over experts, `pi_e ~ (r_e + q)^-s exp(-r_e / c)` with `r_e = e` for 512 experts (expert 0 the
//!    most popular in every layer, as the synth's skewed routers make it, so the placement's default id order is
//!    the campaign hotlist of this routing).
//! 2. A conversation's working set: `M` experts drawn without replacement with probabilities `~ pi^alpha`
//!    (Efraimidis-Spirakis keys); the conversation never uses the others (its topic).
//! 3. Each token draws `k` distinct experts, slot by slot: with probability `rho` a copy of an expert used by one of
//!    the last `W` tokens (uniform over their uses: temporal reuse), otherwise a fresh draw from the working set
//!    with probabilities `~ pi^beta`.
//! 4. Weights: `softmax(sigma z)` of `k` standard normals, sorted, the largest to the first drawn expert (the
//!    study publishes no weights; counts and weights are independent, so mass shares equal use shares).
//!
//! The published figures it was fitted to, for one conversation of a short prompt and a 200-token answer from a
//! cold start: top 32/64/128/256 of 512 experts carry about 37/53/73/93 % of the routing mass (pooled over many
//! conversations, per layer); the answer touches 10.7-12.6 thousand distinct experts of 24,576; 10-13 % of the
//! lookups are first uses; new experts per layer and token fall from about 1.7 at the start of the answer to about
//! 0.2 by token 175. These hold together only if the prompt's lookups count too (a cold answer's first token
//! alone has 10 new experts per layer): we read them as a conversation of a [`FIT_PROMPT`]-token prompt and a
//! [`FIT_ANSWER`]-token answer, distinct experts and first uses over all its lookups, new experts per layer and
//! token at answer positions (means over 11 tokens: positions 0-10 for the start, 170-180 for token 175). The
//! LRU hit rate of a 125-expert-per-layer cache (the study's 12 GiB, 5,991 slots of 24,576) was a soft target:
//! 81-86 % in the study. `scripts/fit_realistic_routing.py` searched the parameters (Nelder-Mead on a numpy copy
//! of this process); [`fitted_figures`] measures this implementation, and the tests hold it to the figures.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use super::{Rng, splitmix};
use crate::model::moe::Routing;

/// Layers, experts per layer and experts per token of a routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutingShape {
    /// Trunk layers.
    pub n_layer: usize,
    /// Routed experts per layer.
    pub n_expert: usize,
    /// Experts per token (`top_k`).
    pub top_k: usize,
}

/// Chooses the routed experts and weights of rows in place of the router (see the module docs). Implementations
/// are pure functions of `(stream, position, layer)`: the same row always gets the same choice, on any backend,
/// in any pass (prefill, decode step, verify chain, batch).
pub trait RoutingOverride: Send + Sync {
    /// The shape the override was built for (checked against the model when it is set).
    fn shape(&self) -> RoutingShape;

    /// The rows of positions `pos0 .. pos0 + n` of `stream`: every trunk layer's experts and weights.
    fn rows(&self, stream: u64, pos0: usize, n: usize) -> ScriptedRows;

    /// One line for reports.
    fn describe(&self) -> String;
}

/// The stream a sequence follows under a [`RoutingOverride`]: a hash of its first token (so sequences with other
/// prompts follow other streams, and a repeated prompt replays its stream).
pub fn stream_key(first_token: u32) -> u64 {
    splitmix(u64::from(first_token) ^ 0x5EED_0F_5EC5)
}

/// Chosen experts and weights of `n` rows, `[row][layer][top_k]`, each row's experts of a layer distinct and best
/// first, weights summing to 1.
#[derive(Debug, Clone, PartialEq)]
pub struct ScriptedRows {
    shape: RoutingShape,
    n: usize,
    experts: Vec<u32>,
    weights: Vec<f32>,
}

impl ScriptedRows {
    /// Rows from flat `[row][layer][top_k]` arrays.
    ///
    /// Panics: the arrays are not `n * n_layer * top_k` long (a caller's bug).
    pub fn new(shape: RoutingShape, n: usize, experts: Vec<u32>, weights: Vec<f32>) -> Self {
        let len = n * shape.n_layer * shape.top_k;
        assert!(experts.len() == len && weights.len() == len, "scripted rows: {len} entries expected");
        Self { shape, n, experts, weights }
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    fn at(&self, row: usize, layer: usize) -> Range<usize> {
        let k = self.shape.top_k;
        let o = (row * self.shape.n_layer + layer) * k;
        o..o + k
    }

    /// Row `row`'s experts at `layer`, best first.
    pub fn experts(&self, row: usize, layer: usize) -> &[u32] {
        &self.experts[self.at(row, layer)]
    }

    /// Row `row`'s weights at `layer` (summing to 1), matching [`Self::experts`].
    pub fn weights(&self, row: usize, layer: usize) -> &[f32] {
        &self.weights[self.at(row, layer)]
    }

    /// Row `row` at `layer` as the router's output type.
    pub fn routing(&self, row: usize, layer: usize) -> Routing {
        Routing {
            experts: self.experts(row, layer).iter().map(|&e| e as usize).collect(),
            weights: self.weights(row, layer).to_vec(),
        }
    }
}

/// The parameters of the realistic process (module docs; expert ranks in units of a 512-expert layer).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RealisticParams {
    /// Zipf exponent `s` of the popularity.
    pub zipf_exponent: f64,
    /// Zipf offset `q` (ranks).
    pub zipf_offset: f64,
    /// Exponential cutoff `c` of the popularity (ranks).
    pub cutoff: f64,
    /// `alpha`: how strongly popularity decides membership of a conversation's working set.
    pub inclusion: f64,
    /// `beta`: how strongly popularity weighs fresh draws inside the working set.
    pub concentration: f64,
    /// `M / n_expert`: the working set's share of the layer's experts.
    pub working_set: f64,
    /// `rho`: probability that a slot copies a recent token's expert.
    pub reuse: f64,
    /// `W`: tokens whose experts count as recent.
    pub window: usize,
    /// `sigma` of the weights' logits.
    pub weight_spread: f64,
}

impl RealisticParams {
    /// The fitted values (module docs; `scripts/fit_realistic_routing.py`).
    pub const FITTED: RealisticParams = RealisticParams {
        zipf_exponent: 1.152,
        zipf_offset: 13.625,
        cutoff: 288.908,
        inclusion: 0.602,
        concentration: 0.572,
        working_set: 263.774 / 512.0,
        reuse: 0.536,
        window: 2,
        weight_spread: 1.0,
    };
}

/// Prompt tokens of the conversation the figures were fitted on (module docs).
pub const FIT_PROMPT: usize = 30;
/// Answer tokens of that conversation.
pub const FIT_ANSWER: usize = 200;

/// One layer's process of one stream.
struct LayerProcess {
    rng: Rng,
    /// The working set and the cumulative fresh-draw weights over it.
    members: Vec<u16>,
    cdf: Vec<f64>,
    /// The last `W` tokens' experts, oldest first.
    recent: std::collections::VecDeque<u16>,
}

/// One stream: its layers' processes and every row generated so far.
struct Stream {
    layers: Vec<LayerProcess>,
    /// `[position][layer][top_k]`.
    experts: Vec<u16>,
}

/// The realistic routing process (module docs): reproducible from `seed`, streams generated lazily as far as
/// asked and kept (about `n_layer * top_k * 2` bytes per position and stream: 960 for the real model).
pub struct RealisticRouting {
    shape: RoutingShape,
    seed: u64,
    params: RealisticParams,
    popularity: Vec<f64>,
    streams: Mutex<HashMap<u64, Stream>>,
}

impl std::fmt::Debug for RealisticRouting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealisticRouting").field("shape", &self.shape).field("seed", &self.seed).finish()
    }
}

/// Why a routing cannot be made for a shape.
#[derive(Debug, thiserror::Error)]
pub enum RoutingError {
    /// Experts per token out of range, or an expert count a 16-bit id cannot hold.
    #[error("realistic routing needs 1 <= top_k <= n_expert <= 65536, got top_k {top_k} of {n_expert} experts")]
    Shape {
        /// Experts per layer.
        n_expert: usize,
        /// Experts per token.
        top_k: usize,
    },
}

impl RealisticRouting {
    /// The fitted process for `shape`, seeded by `seed`.
    ///
    /// Errors: [`RoutingError::Shape`] for `top_k` 0 or above the expert count, or more than 65,536 experts.
    pub fn new(shape: RoutingShape, seed: u64) -> Result<Self, RoutingError> {
        Self::with_params(shape, seed, RealisticParams::FITTED)
    }

    /// The process with explicit parameters (the fit).
    ///
    /// Errors: as [`Self::new`].
    pub fn with_params(shape: RoutingShape, seed: u64, params: RealisticParams) -> Result<Self, RoutingError> {
        let RoutingShape { n_expert, top_k, .. } = shape;
        if top_k == 0 || top_k > n_expert || n_expert > 1 << 16 {
            return Err(RoutingError::Shape { n_expert, top_k });
        }
        let unit = 512.0 / n_expert as f64;
        let popularity = (0..n_expert)
            .map(|e| {
                let r = e as f64 * unit;
                (r + params.zipf_offset).powf(-params.zipf_exponent) * (-r / params.cutoff).exp()
            })
            .collect();
        Ok(Self { shape, seed, params, popularity, streams: Mutex::default() })
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Streams generated so far, ascending.
    pub fn streams(&self) -> Vec<u64> {
        let mut s: Vec<u64> = self.streams.lock().expect("routing streams lock").keys().copied().collect();
        s.sort_unstable();
        s
    }

    /// Positions of `stream` generated so far (0 for a stream never asked for).
    pub fn generated(&self, stream: u64) -> usize {
        let streams = self.streams.lock().expect("routing streams lock");
        streams.get(&stream).map_or(0, |s| s.experts.len() / (self.shape.n_layer * self.shape.top_k).max(1))
    }

    fn new_stream(&self, stream: u64) -> Stream {
        let RoutingShape { n_layer, n_expert, top_k } = self.shape;
        let p = &self.params;
        let m = ((p.working_set * n_expert as f64).round() as usize).clamp((2 * top_k).min(n_expert), n_expert);
        let layers = (0..n_layer)
            .map(|li| {
                let mut rng = Rng::new(self.seed ^ splitmix(stream) ^ ((li as u64 + 1) << 48));
                // Efraimidis-Spirakis: the m largest ln(u) / w_e are a weighted draw without replacement.
                let mut keys: Vec<(f64, u16)> = (0..n_expert)
                    .map(|e| {
                        let u = ((rng.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
                        (u.ln() / self.popularity[e].powf(p.inclusion), e as u16)
                    })
                    .collect();
                keys.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                let mut members: Vec<u16> = keys[..m].iter().map(|k| k.1).collect();
                members.sort_unstable();
                let mut acc = 0.0;
                let cdf = members
                    .iter()
                    .map(|&e| {
                        acc += self.popularity[e as usize].powf(p.concentration);
                        acc
                    })
                    .collect();
                LayerProcess { rng, members, cdf, recent: Default::default() }
            })
            .collect();
        Stream { layers, experts: Vec::new() }
    }

    /// Appends one position's experts (every layer) to `s`.
    fn step(&self, s: &mut Stream) {
        let k = self.shape.top_k;
        let p = &self.params;
        let mut chosen: Vec<u16> = Vec::with_capacity(k);
        for lp in &mut s.layers {
            chosen.clear();
            let mut tries = 0;
            while chosen.len() < k {
                tries += 1;
                let uniform = |rng: &mut Rng| (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
                let e = if tries > 64 * k {
                    // Cannot happen for the fitted parameters; keeps the loop finite for any others.
                    *lp.members.iter().find(|e| !chosen.contains(e)).expect("the working set has >= top_k experts")
                } else if !lp.recent.is_empty() && uniform(&mut lp.rng) < p.reuse {
                    lp.recent[(lp.rng.next() % lp.recent.len() as u64) as usize]
                } else {
                    let total = *lp.cdf.last().expect("a non-empty working set");
                    let x = uniform(&mut lp.rng) * total;
                    lp.members[lp.cdf.partition_point(|&c| c <= x).min(lp.members.len() - 1)]
                };
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
            s.experts.extend_from_slice(&chosen);
            lp.recent.extend(chosen.iter().copied());
            while lp.recent.len() > p.window * k {
                lp.recent.pop_front();
            }
        }
    }

    /// The weights of one row at one layer, sorted descending (a pure function of the row).
    fn weights(&self, stream: u64, pos: usize, layer: usize, out: &mut Vec<f32>) {
        let k = self.shape.top_k;
        let mut rng = Rng::new(self.seed ^ splitmix(stream ^ 0xA5A5) ^ splitmix((pos as u64) << 16 | layer as u64));
        let z: Vec<f64> = (0..k).map(|_| self.params.weight_spread * rng.normal()).collect();
        let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut w: Vec<f64> = z.iter().map(|v| (v - m).exp()).collect();
        w.sort_by(|a, b| b.total_cmp(a));
        let total: f64 = w.iter().sum();
        out.extend(w.iter().map(|v| (v / total) as f32));
    }

    /// Every layer's figures of `positions` of `stream` as one conversation from a cold start.
    pub fn stats(&self, stream: u64, positions: Range<usize>) -> RoutingStats {
        let mut st = RoutingStats::new(self.shape.n_layer, self.shape.n_expert);
        st.push_rows(&self.rows(stream, positions.start, positions.len()));
        st
    }
}

impl RoutingOverride for RealisticRouting {
    fn shape(&self) -> RoutingShape {
        self.shape
    }

    fn rows(&self, stream: u64, pos0: usize, n: usize) -> ScriptedRows {
        let RoutingShape { n_layer, top_k: k, .. } = self.shape;
        let per = n_layer * k;
        let experts: Vec<u32> = {
            let mut streams = self.streams.lock().expect("routing streams lock");
            let s = streams.entry(stream).or_insert_with(|| self.new_stream(stream));
            while s.experts.len() < (pos0 + n) * per {
                self.step(s);
            }
            s.experts[pos0 * per..(pos0 + n) * per].iter().map(|&e| u32::from(e)).collect()
        };
        let mut weights = Vec::with_capacity(n * per);
        for pos in pos0..pos0 + n {
            for li in 0..n_layer {
                self.weights(stream, pos, li, &mut weights);
            }
        }
        ScriptedRows::new(self.shape, n, experts, weights)
    }

    fn describe(&self) -> String {
        format!("realistic routing (seed {}, fitted skew and temporal reuse)", self.seed)
    }
}

/// The routing statistics of the module docs over tokens pushed in order, every layer from a cold start.
#[derive(Debug, Clone)]
pub struct RoutingStats {
    n_layer: usize,
    n_expert: usize,
    /// `[layer][expert]`: used so far.
    seen: Vec<bool>,
    /// `[layer][expert]`: summed weight.
    mass: Vec<f64>,
    /// Per layer, tokens pushed.
    tokens: Vec<usize>,
    lookups: u64,
    first_uses: u64,
    /// Per token index: new experts summed over the layers.
    new_at: Vec<u64>,
}

impl RoutingStats {
    /// No token yet.
    pub fn new(n_layer: usize, n_expert: usize) -> Self {
        Self {
            n_layer,
            n_expert,
            seen: vec![false; n_layer * n_expert],
            mass: vec![0.0; n_layer * n_expert],
            tokens: vec![0; n_layer],
            lookups: 0,
            first_uses: 0,
            new_at: Vec::new(),
        }
    }

    /// The next token of `layer`: its experts and weights. Out-of-range layers or experts are ignored.
    pub fn push(&mut self, layer: usize, experts: &[usize], weights: &[f32]) {
        if layer >= self.n_layer {
            return;
        }
        let t = self.tokens[layer];
        self.tokens[layer] += 1;
        if self.new_at.len() <= t {
            self.new_at.resize(t + 1, 0);
        }
        for (i, &e) in experts.iter().enumerate() {
            if e >= self.n_expert {
                continue;
            }
            let at = layer * self.n_expert + e;
            self.lookups += 1;
            self.mass[at] += f64::from(weights.get(i).copied().unwrap_or(0.0));
            if !self.seen[at] {
                self.seen[at] = true;
                self.first_uses += 1;
                self.new_at[t] += 1;
            }
        }
    }

    /// Every row of `rows`, in order.
    pub fn push_rows(&mut self, rows: &ScriptedRows) {
        for r in 0..rows.len() {
            for li in 0..self.n_layer.min(rows.shape.n_layer) {
                let e: Vec<usize> = rows.experts(r, li).iter().map(|&e| e as usize).collect();
                self.push(li, &e, rows.weights(r, li));
            }
        }
    }

    /// Adds `other`'s routing mass to this one's (pooling the top-N shares over conversations; the other figures
    /// stay this one's).
    pub fn add_mass(&mut self, other: &RoutingStats) {
        for (a, b) in self.mass.iter_mut().zip(&other.mass) {
            *a += b;
        }
    }

    /// Tokens pushed (the most of any layer).
    pub fn tokens(&self) -> usize {
        self.tokens.iter().copied().max().unwrap_or(0)
    }

    /// Lookups (token x expert uses) pushed.
    pub fn lookups(&self) -> u64 {
        self.lookups
    }

    /// Share of the routing mass the `n` heaviest experts of a layer carry, averaged over the layers that have
    /// any mass.
    pub fn top_share(&self, n: usize) -> f64 {
        let mut sum = 0.0;
        let mut layers = 0;
        for li in 0..self.n_layer {
            let mut m = self.mass[li * self.n_expert..(li + 1) * self.n_expert].to_vec();
            let total: f64 = m.iter().sum();
            if total <= 0.0 {
                continue;
            }
            m.sort_by(|a, b| b.total_cmp(a));
            sum += m[..n.min(m.len())].iter().sum::<f64>() / total;
            layers += 1;
        }
        if layers == 0 { 0.0 } else { sum / layers as f64 }
    }

    /// Distinct (layer, expert) pairs used.
    pub fn distinct(&self) -> u64 {
        self.first_uses
    }

    /// First uses over lookups (0 without lookups).
    pub fn first_use_share(&self) -> f64 {
        if self.lookups == 0 { 0.0 } else { self.first_uses as f64 / self.lookups as f64 }
    }

    /// Mean new experts per layer and token over token indices `tokens` (clipped to what was pushed; 0 when
    /// empty).
    pub fn new_per_layer_token(&self, tokens: Range<usize>) -> f64 {
        let r = tokens.start.min(self.new_at.len())..tokens.end.min(self.new_at.len());
        if r.is_empty() {
            return 0.0;
        }
        self.new_at[r.clone()].iter().sum::<u64>() as f64 / (r.len() * self.n_layer) as f64
    }

    /// The figures in one line: mass of the top 32/64/128/256 (scaled to the layer's expert count), distinct
    /// experts, first uses, and new experts per layer and token in bins of `bin` tokens.
    pub fn summary(&self, bin: usize) -> String {
        let ns = [32, 64, 128, 256].map(|n| (n * self.n_expert).div_ceil(512).max(1));
        let shares: Vec<String> = ns.iter().map(|&n| format!("{:.0}", self.top_share(n) * 100.0)).collect();
        let bin = bin.max(1);
        let bins: Vec<String> = (0..self.tokens().div_ceil(bin))
            .map(|b| {
                let end = ((b + 1) * bin).min(self.tokens());
                format!("{}-{}: {:.2}", b * bin, end - 1, self.new_per_layer_token(b * bin..end))
            })
            .collect();
        format!(
            "{} tokens: top {} of {} experts carry {} % of the mass; {} distinct experts of {} ({} x {}); first uses \
             {:.1} % of {} lookups; new experts per layer and token by position {}",
            self.tokens(),
            ns.map(|n| n.to_string()).join("/"),
            self.n_expert,
            shares.join("/"),
            self.distinct(),
            self.n_layer * self.n_expert,
            self.n_layer,
            self.n_expert,
            self.first_use_share() * 100.0,
            self.lookups,
            bins.join(", ")
        )
    }
}

/// The routing decisions a forward pass actually used, gathered from the host side of each backend (the CPU
/// forward; the hybrid GPU backend's CPU path, which sees every token's experts and weights of a decode step) into
/// [`RoutingStats`]: what `nebula bench` reports under the router's own (independent) routing. Rows of one layer
/// count as the tokens of one sequence in arrival order (benchmarks of one sequence).
#[derive(Debug)]
pub struct RoutingLog {
    stats: Mutex<RoutingStats>,
    /// Every row's routing per layer, in arrival order, when kept ([`Self::keeping_rows`]).
    rows: Option<Mutex<Vec<Vec<Routing>>>>,
}

impl RoutingLog {
    /// An empty log for `n_layer` layers of `n_expert` experts.
    pub fn new(n_layer: usize, n_expert: usize) -> Arc<Self> {
        Arc::new(Self { stats: Mutex::new(RoutingStats::new(n_layer, n_expert)), rows: None })
    }

    /// An empty log that also keeps every row's routing ([`Self::take_rows`]; tests, short runs: it grows with
    /// every row).
    pub fn keeping_rows(n_layer: usize, n_expert: usize) -> Arc<Self> {
        Arc::new(Self {
            stats: Mutex::new(RoutingStats::new(n_layer, n_expert)),
            rows: Some(Mutex::new(vec![Vec::new(); n_layer])),
        })
    }

    /// Adds `layer`'s routing of a pass's rows, in row order.
    pub fn record(&self, layer: usize, routing: &[Routing]) {
        let mut st = self.stats.lock().expect("routing log lock");
        for r in routing {
            st.push(layer, &r.experts, &r.weights);
        }
        if let Some(rows) = &self.rows
            && let Some(l) = rows.lock().expect("routing log lock").get_mut(layer)
        {
            l.extend_from_slice(routing);
        }
    }

    /// The rows kept since the last call, per layer (empty unless [`Self::keeping_rows`]); then cleared.
    pub fn take_rows(&self) -> Vec<Vec<Routing>> {
        match &self.rows {
            Some(rows) => {
                let mut r = rows.lock().expect("routing log lock");
                let fresh = vec![Vec::new(); r.len()];
                std::mem::replace(&mut *r, fresh)
            }
            None => Vec::new(),
        }
    }

    /// What was recorded since the last call (then cleared).
    pub fn take(&self) -> RoutingStats {
        let mut st = self.stats.lock().expect("routing log lock");
        let fresh = RoutingStats::new(st.n_layer, st.n_expert);
        std::mem::replace(&mut *st, fresh)
    }
}

/// The published figures' measures of a routing process (module docs), over `conversations` streams of
/// [`FIT_PROMPT`] + [`FIT_ANSWER`] tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FittedFigures {
    /// Mass shares of the top 32/64/128/256 experts per layer, pooled over the conversations.
    pub top_shares: [f64; 4],
    /// Mean distinct (layer, expert) pairs per conversation.
    pub distinct: f64,
    /// Mean first-use share of a conversation's lookups.
    pub first_use_share: f64,
    /// New experts per layer and token at answer positions 0-10.
    pub new_at_start: f64,
    /// New experts per layer and token at answer positions 170-180.
    pub new_at_175: f64,
}

impl FittedFigures {
    /// One line, next to the published values.
    pub fn summary(&self) -> String {
        format!(
            "top 32/64/128/256 carry {:.0}/{:.0}/{:.0}/{:.0} % of the mass (published 37/53/73/93); {:.1} k distinct \
             experts per conversation (10.7-12.6 k); first uses {:.1} % of lookups (10-13 %); new experts per layer and \
             token {:.2} at the answer's start and {:.2} by token 175 (1.7, 0.2)",
            self.top_shares[0] * 100.0,
            self.top_shares[1] * 100.0,
            self.top_shares[2] * 100.0,
            self.top_shares[3] * 100.0,
            self.distinct / 1000.0,
            self.first_use_share * 100.0,
            self.new_at_start,
            self.new_at_175
        )
    }
}

/// Measures `routing` as the published figures are measured (module docs), on streams `0..conversations`. Made
/// for the published shape (48 x 512, top-10); other shapes give the same measures of their own.
pub fn fitted_figures(routing: &RealisticRouting, conversations: usize) -> FittedFigures {
    let RoutingShape { n_layer, n_expert, .. } = routing.shape;
    let mut pooled = RoutingStats::new(n_layer, n_expert);
    let (mut distinct, mut first, mut start, mut late) = (0.0, 0.0, 0.0, 0.0);
    let answer = |t: usize| FIT_PROMPT + t;
    for c in 0..conversations {
        let st = routing.stats(c as u64, 0..FIT_PROMPT + FIT_ANSWER);
        distinct += st.distinct() as f64;
        first += st.first_use_share();
        start += st.new_per_layer_token(answer(0)..answer(11));
        late += st.new_per_layer_token(answer(170)..answer(181));
        pooled.add_mass(&st);
    }
    let c = conversations.max(1) as f64;
    let ns = [32, 64, 128, 256].map(|n| (n * n_expert).div_ceil(512).max(1));
    FittedFigures {
        top_shares: ns.map(|n| pooled.top_share(n)),
        distinct: distinct / c,
        first_use_share: first / c,
        new_at_start: start / c,
        new_at_175: late / c,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REAL: RoutingShape = RoutingShape { n_layer: 48, n_expert: 512, top_k: 10 };

    #[test]
    fn rows_are_distinct_weighted_and_reproducible() {
        let r = RealisticRouting::new(REAL, 7).unwrap();
        let a = r.rows(3, 0, 40);
        for row in 0..a.len() {
            for li in 0..48 {
                let e = a.experts(row, li);
                let mut d = e.to_vec();
                d.sort_unstable();
                d.dedup();
                assert_eq!(d.len(), 10, "distinct experts");
                assert!(e.iter().all(|&x| x < 512));
                let w = a.weights(row, li);
                assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-5);
                assert!(w.windows(2).all(|p| p[0] >= p[1]), "best first");
            }
        }
        // Asked piecewise, in another order, or from a fresh process with the same seed: the same rows.
        let late = r.rows(3, 25, 15);
        assert_eq!(late, {
            let b = RealisticRouting::new(REAL, 7).unwrap();
            b.rows(3, 25, 15)
        });
        assert_eq!(late.experts(0, 5), a.experts(25, 5));
        assert_eq!(late.weights(14, 47), a.weights(39, 47));
        // Another stream or seed: other rows.
        assert_ne!(r.rows(4, 0, 40), a);
        assert_ne!(RealisticRouting::new(REAL, 8).unwrap().rows(3, 0, 40), a);
        assert_eq!(r.streams(), vec![3, 4]);
        assert_eq!(r.generated(3), 40);
    }

    /// The published figures (module docs), within stated tolerances, for this implementation of the process over
    /// 48 conversations at the real model's shape.
    #[test]
    fn realistic_routing_fits_the_published_figures() {
        let r = RealisticRouting::new(REAL, 1).unwrap();
        let f = fitted_figures(&r, 48);
        let target = [0.37, 0.53, 0.73, 0.93];
        for (got, want) in f.top_shares.iter().zip(target) {
            assert!((got - want).abs() <= 0.03, "{}", f.summary());
        }
        assert!((10_200.0..=13_100.0).contains(&f.distinct), "{}", f.summary());
        assert!((0.095..=0.13).contains(&f.first_use_share), "{}", f.summary());
        assert!((1.4..=2.1).contains(&f.new_at_start), "{}", f.summary());
        assert!((0.1..=0.32).contains(&f.new_at_175), "{}", f.summary());
    }

    /// The router's own routing of the synth (independent draws per token, skewed) has none of the reuse: the
    /// same measures over independent draws from the pooled popularity touch far more experts.
    #[test]
    fn independent_draws_have_no_reuse() {
        let r = RealisticRouting::new(REAL, 1).unwrap();
        let flat = RealisticParams { working_set: 1.0, inclusion: 0.0, reuse: 0.0, concentration: 1.0, ..r.params };
        let ind = RealisticRouting::with_params(REAL, 1, flat).unwrap();
        let (fr, fi) = (fitted_figures(&r, 8), fitted_figures(&ind, 8));
        assert!(fi.distinct > 1.4 * fr.distinct, "{} vs {}", fi.summary(), fr.summary());
        assert!(fi.new_at_175 > 2.0 * fr.new_at_175, "{} vs {}", fi.summary(), fr.summary());
    }

    #[test]
    fn statistics_count_first_uses_and_mass() {
        let mut s = RoutingStats::new(2, 8);
        s.push(0, &[0, 1], &[0.75, 0.25]);
        s.push(1, &[2, 3], &[0.5, 0.5]);
        s.push(0, &[1, 4], &[0.5, 0.5]);
        s.push(1, &[2, 3], &[0.5, 0.5]);
        assert_eq!((s.tokens(), s.lookups(), s.distinct()), (2, 8, 5));
        assert!((s.first_use_share() - 5.0 / 8.0).abs() < 1e-12);
        assert!((s.new_per_layer_token(0..1) - 2.0).abs() < 1e-12);
        assert!((s.new_per_layer_token(1..2) - 0.5).abs() < 1e-12);
        // Layer 0: masses 0.75, 0.75, 0.5 of 2: top-1 0.375; layer 1: 1, 1 of 2: top-1 0.5.
        assert!((s.top_share(1) - (0.375 + 0.5) / 2.0).abs() < 1e-12);
        assert_eq!(s.new_per_layer_token(5..9), 0.0);
    }

    /// Replays a table of `(position, layer)` routings (any stream): what a forward recorded.
    struct Replay {
        shape: RoutingShape,
        table: Vec<Vec<Routing>>,
    }

    impl RoutingOverride for Replay {
        fn shape(&self) -> RoutingShape {
            self.shape
        }
        fn rows(&self, _stream: u64, pos0: usize, n: usize) -> ScriptedRows {
            let (mut e, mut w) = (Vec::new(), Vec::new());
            for pos in pos0..pos0 + n {
                for layer in &self.table {
                    e.extend(layer[pos].experts.iter().map(|&x| x as u32));
                    w.extend_from_slice(&layer[pos].weights);
                }
            }
            ScriptedRows::new(self.shape, n, e, w)
        }
        fn describe(&self) -> String {
            "replay".into()
        }
    }

    /// The demo model's prompt of 12 tokens and 4 decode steps with fixed tokens: every call's logits.
    fn run(model: &crate::model::Qwen4Exp, first: u32) -> Vec<Vec<f32>> {
        use crate::model::LogitsFor;
        let mut st = model.new_state(32);
        let prompt: Vec<u32> = (0..12).map(|i| first + 977 * i).collect();
        let mut out = vec![model.forward(&mut st, &prompt, LogitsFor::All).unwrap()];
        for t in [31u32, 4000, 77, 12_345] {
            out.push(model.forward(&mut st, &[t], LogitsFor::Last).unwrap());
        }
        out
    }

    /// The forward's math does not change under an override: replaying the router's own choices (experts and
    /// weights, recorded from a run without override) through the override gives the same logits bit for bit,
    /// while the realistic routing gives other logits and the forward uses exactly the rows the routing gives.
    #[test]
    fn an_override_changes_which_experts_run_and_nothing_else() {
        use std::sync::Arc;
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/nebula-demo.gguf");
        let mut model = crate::model::Qwen4Exp::load(&path).unwrap();
        let shape = model.routing_shape();
        let log = RoutingLog::keeping_rows(shape.n_layer, shape.n_expert);
        model.set_routing_log(Some(log.clone()));
        let own = run(&model, 1000);
        let recorded = log.take_rows();
        assert!(recorded.iter().all(|l| l.len() == 16), "12 prompt rows and 4 steps per layer");
        model.set_routing_override(Some(Arc::new(Replay { shape, table: recorded.clone() }))).unwrap();
        assert_eq!(run(&model, 1000), own, "the router's own choice through the override");
        assert_eq!(log.take_rows(), recorded);

        let realistic = Arc::new(RealisticRouting::new(shape, 3).unwrap());
        model.set_routing_override(Some(realistic.clone())).unwrap();
        let scripted = run(&model, 1000);
        assert_ne!(scripted, own, "the override takes effect");
        let used = log.take_rows();
        let want = realistic.rows(stream_key(1000), 0, 16);
        for (li, layer) in used.iter().enumerate() {
            for (pos, r) in layer.iter().enumerate() {
                assert_eq!(r, &want.routing(pos, li), "layer {li}, position {pos}");
            }
        }
        // Another prompt follows another stream; the same prompt the same one.
        run(&model, 1001);
        assert_ne!(log.take_rows(), used);
        assert_eq!(run(&model, 1000), scripted);

        // A shape the model does not have is refused, naming both.
        let other = RoutingShape { n_expert: shape.n_expert + 1, ..shape };
        let e = model.set_routing_override(Some(Arc::new(RealisticRouting::new(other, 3).unwrap()))).unwrap_err();
        assert!(e.to_string().contains("routing override"), "{e}");
    }

    #[test]
    fn bad_shapes_are_refused() {
        for (e, k) in [(8, 0), (8, 9), (70_000, 10)] {
            let shape = RoutingShape { n_layer: 1, n_expert: e, top_k: k };
            assert!(RealisticRouting::new(shape, 1).is_err());
        }
        // A tiny model still gets distinct experts per token.
        let tiny = RealisticRouting::new(RoutingShape { n_layer: 2, n_expert: 8, top_k: 8 }, 1).unwrap();
        let rows = tiny.rows(0, 0, 5);
        let mut e = rows.experts(4, 1).to_vec();
        e.sort_unstable();
        assert_eq!(e, (0..8).collect::<Vec<u32>>());
    }
}
