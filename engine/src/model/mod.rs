//! The Qwen3.8-Flash-Next (`qwen4exp`) model on the CPU: one file per block, named as the reference names it
//! (`transformers/models/qwen4_exp/modeling_qwen4_exp.py`).
//!
//! The trunk reads top to bottom as the reference's `Qwen4ExpTextModel.forward`: embed each token into every
//! residual stream; per layer, optional PLE, then the attention hyper-connection around Gated DeltaNet or gated
//! attention, then the MLP hyper-connection around the MoE; the final mixer collapses the streams; `lm_head`
//! gives the logits. All math is `f32`.

pub mod config;
pub mod error;
pub mod hyper_connection;
pub mod linear_attn;
pub mod moe;
pub mod norm;
pub mod ple;
pub mod rope;
pub mod self_attn;
pub mod state;
pub mod weights;

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use crate::gguf::GgufFile;
use crate::placement::hotlist::HotlistBuilder;
use crate::placement::{Placement, PlacementError, PlacementOptions, PlacementReport, PlacementStats, Tier};
use crate::quant::Matrix;

pub use config::{GateActivation, LayerKind, ModelConfig};
pub use error::ModelError;
pub use linear_attn::GdnAlgorithm;
pub use state::{SequenceState, Snapshot};

use config::Meta;
use hyper_connection::GatedResidual;
use linear_attn::GatedDeltaNet;
use moe::SparseMoe;
use ple::PleLayer;
use rope::Rope;
use self_attn::Attention;
use state::LayerState;
use weights::TensorLoader;

/// The token mixer of a layer.
#[derive(Debug, Clone)]
pub enum TokenMixer {
    /// Gated DeltaNet.
    LinearAttention(GatedDeltaNet),
    /// Gated attention (with the QSA indexer unless dense).
    SelfAttention(Attention),
}

/// One decoder layer (`Qwen4ExpTextDecoderLayer`).
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    /// PLE block, on the PLE layer only.
    pub ple: Option<PleLayer>,
    /// Hyper-connection around the token mixer.
    pub attn_hyper_connection: GatedResidual,
    /// Gated DeltaNet or attention.
    pub mixer: TokenMixer,
    /// Hyper-connection around the MoE.
    pub mlp_hyper_connection: GatedResidual,
    /// Routed experts + shared expert.
    pub mlp: SparseMoe,
}

/// Which positions of a forward call need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    /// None (prefill of a prefix).
    None,
    /// Only the last token.
    Last,
    /// Every token.
    All,
}

/// Knobs of a forward call that do not change the math's meaning.
#[derive(Debug, Clone, Copy)]
pub struct ForwardOptions {
    /// Gated DeltaNet algorithm.
    pub gdn: GdnAlgorithm,
}

impl Default for ForwardOptions {
    fn default() -> Self {
        Self { gdn: GdnAlgorithm::Auto }
    }
}

/// A loaded `qwen4exp` model.
pub struct Qwen4Exp {
    /// Shapes and hyper-parameters.
    pub config: ModelConfig,
    pub(crate) embed_tokens: Matrix,
    pub(crate) layers: Vec<DecoderLayer>,
    pub(crate) hyper_connection_mixer: GatedResidual,
    pub(crate) lm_head: Matrix,
    pub(crate) rope: Rope,
    pub(crate) masked: Vec<Range<usize>>,
    pub(crate) file: Arc<GgufFile>,
    /// Where the experts and the n-gram table live; `None`: everything read through the memory map.
    pub(crate) placement: Option<Box<Placement>>,
    /// Expert uses by tier, SSD reads (also counted without placement: every expert then counts as RAM).
    pub(crate) placement_stats: Arc<PlacementStats>,
}

impl std::fmt::Debug for Qwen4Exp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qwen4Exp").field("config", &self.config).finish_non_exhaustive()
    }
}

impl Qwen4Exp {
    /// Opens and validates a GGUF model (split files included).
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        Self::from_gguf(Arc::new(GgufFile::open(path)?))
    }

    /// Builds the model from an opened GGUF file, validating every tensor's presence, shape and type.
    pub fn from_gguf(file: Arc<GgufFile>) -> Result<Self, ModelError> {
        let mut config = ModelConfig::from_gguf(&file)?;
        let w = TensorLoader::new(file.clone());
        let d = config.hidden;
        let vocab = match file.tensor("token_embd.weight") {
            Some(t) if t.dims.len() == 2 && t.dims[0] == d as u64 && t.dims[1] > 0 => t.dims[1] as usize,
            Some(t) => {
                return Err(ModelError::TensorShape {
                    file: file.path().display().to_string(),
                    name: "token_embd.weight".into(),
                    expected: vec![d as u64, 0],
                    actual: t.dims.clone(),
                });
            }
            None => {
                return Err(ModelError::MissingTensor {
                    file: file.path().display().to_string(),
                    name: "token_embd.weight".into(),
                    expected: vec![d as u64, 0],
                    types: "any supported weight type".into(),
                });
            }
        };
        config.vocab = vocab;
        let (s, r, eps) = (config.hc_count, config.hc_lowrank, config.rms_eps);
        let mut layers = Vec::with_capacity(config.n_layer);
        for (i, kind) in config.layer_kinds.iter().enumerate() {
            let mixer = match *kind {
                LayerKind::LinearAttention => TokenMixer::LinearAttention(GatedDeltaNet::load(&w, &config, i)?),
                LayerKind::IndexedAttention { compress_ratio } => {
                    TokenMixer::SelfAttention(Attention::load(&w, &config, i, compress_ratio)?)
                }
            };
            let ple = match &config.ple {
                Some(p) if p.layer == i => Some(PleLayer::load(&w, p, s, d, eps)?),
                _ => None,
            };
            layers.push(DecoderLayer {
                ple,
                attn_hyper_connection: GatedResidual::load(&w, &format!("blk.{i}.hc_attn"), s, d, r, true, eps)?,
                mixer,
                mlp_hyper_connection: GatedResidual::load(&w, &format!("blk.{i}.hc_ffn"), s, d, r, true, eps)?,
                mlp: SparseMoe::load(&w, &config, i)?,
            });
        }
        let masked = unassigned_token_ranges(&file, vocab)?;
        Ok(Self {
            embed_tokens: w.matrix("token_embd.weight", vocab, d)?,
            lm_head: w.matrix("output.weight", vocab, d)?,
            hyper_connection_mixer: GatedResidual::load(&w, "output_hc", s, d, r, false, eps)?,
            rope: Rope::new(config.rope_dim, config.rope_theta, config.rope_sections),
            layers,
            masked,
            config,
            file,
            placement: None,
            placement_stats: Arc::default(),
        })
    }

    /// Places the routed experts and the n-gram table in tiers as `opts` says (see [`crate::placement`]): reads
    /// the RAM tier into (locked) anonymous memory, sets up the SSD tier's buffer pool and I/O threads. Replaces
    /// any earlier placement. Outputs do not change, only where the weights are read from.
    ///
    /// Errors: [`PlacementError`]: an unusable hotlist, contradictory counts, a placement over the RAM or VRAM
    /// budget or `MemAvailable` (refused before anything is allocated), a failed read of the RAM tier.
    pub fn place(&mut self, opts: &PlacementOptions) -> Result<(), PlacementError> {
        self.placement = None;
        self.placement = Some(Box::new(Placement::build(self, opts, self.placement_stats.clone())?));
        Ok(())
    }

    /// The placement as built ([`PlacementReport::unplaced`] when [`Qwen4Exp::place`] was not called).
    pub fn placement_report(&self) -> PlacementReport {
        match &self.placement {
            Some(p) => p.report().clone(),
            None => PlacementReport::unplaced(self),
        }
    }

    /// The placement's counters (expert uses by tier, SSD reads), shared: they keep counting after the call.
    pub fn placement_stats(&self) -> Arc<PlacementStats> {
        self.placement_stats.clone()
    }

    /// The GGUF file the model was loaded from.
    pub fn file(&self) -> &Arc<GgufFile> {
        &self.file
    }

    /// (dense weight bytes, routed-expert bytes summed over layers, n-gram table bytes): the dense part is every
    /// weight read for every token (trunk, head, embedding row aside), the experts are read only when routed.
    pub fn weight_bytes(&self) -> (u64, u64, u64) {
        let mut experts = 0u64;
        let mut table = 0u64;
        for l in &self.layers {
            experts += l
                .mlp
                .experts
                .iter()
                .map(|e| (e.gate_proj.bytes().len() + e.up_proj.bytes().len() + e.down_proj.bytes().len()) as u64)
                .sum::<u64>();
            if let Some(p) = &l.ple {
                table += p.ngram_embedding.bytes().len() as u64;
            }
        }
        let total: u64 = self.file.tensors().map(|t| t.n_bytes).sum();
        let embed = self.embed_tokens.bytes().len() as u64;
        (total.saturating_sub(experts + table + embed), experts, table)
    }

    /// Token ids whose logits are always `-inf` (vocabulary rows no token has, e.g. 248077..248320).
    pub fn masked_tokens(&self) -> &[Range<usize>] {
        &self.masked
    }

    /// A fresh state for a sequence of at most `max_len` tokens.
    pub fn new_state(&self, max_len: usize) -> SequenceState {
        SequenceState {
            pos: 0,
            max_len,
            layers: self
                .layers
                .iter()
                .map(|l| match &l.mixer {
                    TokenMixer::LinearAttention(g) => LayerState::LinearAttention(g.new_state()),
                    TokenMixer::SelfAttention(a) => LayerState::Attention(a.new_state()),
                })
                .collect(),
            ple: self.layers.iter().find_map(|l| l.ple.as_ref().map(|p| p.new_state())),
        }
    }

    /// Restores `state` to `snap`, taken earlier from the same sequence (the sequence may have grown since).
    pub fn restore(&self, state: &mut SequenceState, snap: &Snapshot) -> Result<(), ModelError> {
        if snap.pos > state.pos || snap.recurrent.len() != state.layers.len() {
            return Err(ModelError::BadSnapshot { snapshot: snap.pos, current: state.pos });
        }
        for ((ls, saved), layer) in state.layers.iter_mut().zip(&snap.recurrent).zip(&self.layers) {
            match (ls, saved, &layer.mixer) {
                (LayerState::LinearAttention(g), Some(s), _) => g.clone_from(s),
                (LayerState::Attention(a), None, TokenMixer::SelfAttention(att)) => {
                    let (idim, ratio) = att.index_shape();
                    a.truncate(snap.pos, att.kv_width(), idim, ratio);
                }
                _ => return Err(ModelError::BadSnapshot { snapshot: snap.pos, current: state.pos }),
            }
        }
        state.ple.clone_from(&snap.ple);
        state.pos = snap.pos;
        Ok(())
    }

    /// A new state for at most `max_len` tokens that holds the first `snap.pos()` tokens of `source`: attention
    /// caches copied up to that length, recurrent and PLE parts from `snap` (taken earlier from `source`, which
    /// may have grown since). `source` is left as it is, so one cached sequence can seed many requests (the
    /// prefix cache).
    ///
    /// Errors: [`ModelError::BadSnapshot`] when `snap` is not from a state shaped like this model's or lies
    /// beyond `source`, or `max_len` is below `snap.pos()`.
    pub fn fork_state(
        &self,
        source: &SequenceState,
        snap: &Snapshot,
        max_len: usize,
    ) -> Result<SequenceState, ModelError> {
        let bad = || ModelError::BadSnapshot { snapshot: snap.pos, current: source.pos };
        if snap.pos > source.pos || snap.pos > max_len || snap.recurrent.len() != self.layers.len() {
            return Err(bad());
        }
        let mut layers = Vec::with_capacity(self.layers.len());
        for ((ls, saved), layer) in source.layers.iter().zip(&snap.recurrent).zip(&self.layers) {
            layers.push(match (ls, saved, &layer.mixer) {
                (LayerState::LinearAttention(_), Some(s), _) => LayerState::LinearAttention(s.clone()),
                (LayerState::Attention(a), None, TokenMixer::SelfAttention(att)) => {
                    let (idim, ratio) = att.index_shape();
                    let kv = snap.pos * att.kv_width();
                    let blocks = snap.pos.checked_div(ratio).unwrap_or(0);
                    let prefix = |v: &Vec<f32>, n: usize| v.get(..n).map(<[f32]>::to_vec).ok_or_else(bad);
                    LayerState::Attention(self_attn::AttnState {
                        k: prefix(&a.k, kv)?,
                        v: prefix(&a.v, kv)?,
                        index_k: prefix(&a.index_k, snap.pos * idim)?,
                        pooled: prefix(&a.pooled, blocks * idim)?,
                    })
                }
                _ => return Err(bad()),
            });
        }
        Ok(SequenceState { pos: snap.pos, max_len, layers, ple: snap.ple.clone() })
    }

    /// Runs `tokens` through the model, continuing `state`, and returns the logits asked for (`[rows, vocab]`,
    /// masked ids at `-inf`).
    ///
    /// Errors: [`ModelError::TokenOutOfRange`] for an id outside the vocabulary and
    /// [`ModelError::ContextOverflow`] past the state's `max_len` (the state is then unchanged), and
    /// [`ModelError::WeightRead`] when a placed weight (SSD tier) cannot be read (the state is then left part-way
    /// and must be discarded; the model stays usable).
    pub fn forward(&self, state: &mut SequenceState, tokens: &[u32], want: LogitsFor) -> Result<Vec<f32>, ModelError> {
        self.forward_with(state, tokens, want, ForwardOptions::default())
    }

    /// [`Qwen4Exp::forward`] with explicit options.
    pub fn forward_with(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        want: LogitsFor,
        opts: ForwardOptions,
    ) -> Result<Vec<f32>, ModelError> {
        self.forward_inner(state, tokens, want, opts, None)
    }

    /// [`Qwen4Exp::forward`] that also records each layer's routing decisions into `campaign` (the hotlist
    /// campaign of `nebula hotlist`).
    pub fn forward_recording(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        want: LogitsFor,
        campaign: &mut HotlistBuilder,
    ) -> Result<Vec<f32>, ModelError> {
        self.forward_inner(state, tokens, want, ForwardOptions::default(), Some(campaign))
    }

    /// The forward pass. Errors as [`Qwen4Exp::forward`], plus [`ModelError::WeightRead`] when a placed weight
    /// cannot be read (SSD tier, n-gram rows on SSD): the state is then left part-way and must be discarded.
    fn forward_inner(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        want: LogitsFor,
        opts: ForwardOptions,
        mut campaign: Option<&mut HotlistBuilder>,
    ) -> Result<Vec<f32>, ModelError> {
        let cfg = &self.config;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= cfg.vocab) {
            return Err(ModelError::TokenOutOfRange { token: bad, vocab: cfg.vocab });
        }
        let needed = state.pos + tokens.len();
        if needed > state.max_len {
            return Err(ModelError::ContextOverflow { needed, limit: state.max_len });
        }
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let (d, s) = (cfg.hidden, cfg.hc_count);
        let dim = s * d;
        // The n-gram rows depend on known tokens only: with the table placed, start reading them now, so the
        // layers before the PLE layer run while the reads are in flight.
        let placed_table = self.placement.as_ref().and_then(|p| p.table().map(|t| (p, t)));
        let mut table_rows = None;
        if let (Some((p, _)), Some(ple), Some(ps)) =
            (placed_table, self.layers.iter().find_map(|l| l.ple.as_ref()), state.ple.as_ref())
        {
            let rows = ple.rows(tokens, ps);
            table_rows = p.fetch_rows(&rows).map(|f| (rows, f));
        }
        // X_0 = [e; e; ...; e].
        let mut x = vec![0f32; n * dim];
        let mut e = vec![0f32; d];
        for (t, &tok) in tokens.iter().enumerate() {
            self.embed_tokens.dequantize_row(tok as usize, &mut e);
            for st in 0..s {
                x[t * dim + st * d..t * dim + (st + 1) * d].copy_from_slice(&e);
            }
        }
        let pos0 = state.pos;
        for (li, (layer, ls)) in self.layers.iter().zip(state.layers.iter_mut()).enumerate() {
            if let Some(ple) = &layer.ple {
                let ps = state.ple.as_mut().expect("a model with a PLE layer always has PLE state");
                let delta = match (placed_table, table_rows.take()) {
                    (Some((_, table)), Some((rows, fetch))) => {
                        let mut emb = vec![0f32; n * ple.cfg.embed_dim()];
                        table.gather(fetch, &rows, &mut emb).map_err(|e| ModelError::WeightRead {
                            what: "n-gram table rows".into(),
                            detail: e.to_string(),
                        })?;
                        ple.forward_gathered(&x, tokens, ps, &emb)
                    }
                    _ => ple.forward(&x, tokens, ps),
                };
                for (a, b) in x.iter_mut().zip(&delta) {
                    *a += b;
                }
            }
            let mixed = layer.attn_hyper_connection.mix(&x, n);
            let y = match (&layer.mixer, ls) {
                (TokenMixer::LinearAttention(g), LayerState::LinearAttention(st)) => {
                    g.forward(&mixed.mixed, n, st, opts.gdn)
                }
                (TokenMixer::SelfAttention(a), LayerState::Attention(st)) => {
                    a.forward(&mixed.mixed, n, pos0, st, &self.rope)
                }
                _ => unreachable!("state layout always follows the model's layers"),
            };
            layer.attn_hyper_connection.inject(&mut x, &y, &mixed.inject);
            let mixed = layer.mlp_hyper_connection.mix(&x, n);
            let routing = layer.mlp.route(&mixed.mixed, n);
            if let Some(c) = campaign.as_deref_mut() {
                c.record(li, &routing);
            }
            let y = match &self.placement {
                None => {
                    self.placement_stats.hit(Tier::Ram, (n * cfg.n_expert_used) as u64);
                    layer.mlp.forward_routed(&mixed.mixed, n, &routing)
                }
                Some(p) => {
                    // The next layers' routers on this hidden state predict which SSD experts to prefetch.
                    let ahead: Vec<&moe::SparseMoe> =
                        self.layers.iter().skip(li + 1).take(p.prefetch_layers()).map(|l| &l.mlp).collect();
                    p.moe_forward(li, &layer.mlp, &mixed.mixed, n, &routing, &ahead)?
                }
            };
            layer.mlp_hyper_connection.inject(&mut x, &y, &mixed.inject);
        }
        state.pos = needed;
        let rows: Range<usize> = match want {
            LogitsFor::None => return Ok(Vec::new()),
            LogitsFor::Last => n - 1..n,
            LogitsFor::All => 0..n,
        };
        let m = rows.len();
        let h = self.hyper_connection_mixer.mix(&x[rows.start * dim..rows.end * dim], m).mixed;
        let mut logits = vec![0f32; m * cfg.vocab];
        self.lm_head.matmul(&h, m, &mut logits);
        for row in logits.chunks_exact_mut(cfg.vocab) {
            for r in &self.masked {
                row[r.clone()].fill(f32::NEG_INFINITY);
            }
        }
        Ok(logits)
    }
}

/// Vocabulary rows that no token has: GGUF `tokenizer.ggml.token_type` UNUSED (5) entries and rows past the
/// token list (the 243 padding rows 248077..248320 of Qwen). Without a tokenizer nothing is masked.
fn unassigned_token_ranges(file: &GgufFile, vocab: usize) -> Result<Vec<Range<usize>>, ModelError> {
    let m = Meta { file };
    let Some(types) = m.opt_i32_array("tokenizer.ggml.token_type")? else { return Ok(Vec::new()) };
    let mut ranges: Vec<Range<usize>> = Vec::new();
    let mut push = |i: usize| match ranges.last_mut() {
        Some(r) if r.end == i => r.end = i + 1,
        _ => ranges.push(i..i + 1),
    };
    for i in 0..vocab {
        if types.get(i).is_none_or(|&t| t == 5) {
            push(i);
        }
    }
    Ok(ranges)
}
