//! The Qwen3.8-Flash-Next (`qwen4exp`) model on the CPU: one file per block, named as the reference names it
//! (`transformers/models/qwen4_exp/modeling_qwen4_exp.py`).
//!
//! The trunk reads top to bottom as the reference's `Qwen4ExpTextModel.forward`: embed each token into every
//! residual stream; per layer, optional PLE, then the attention hyper-connection around Gated DeltaNet or gated
//! attention, then the MLP hyper-connection around the MoE; the final mixer collapses the streams; `lm_head`
//! gives the logits. All math is `f32`.

pub mod config;
pub mod error;
mod forward;

pub(crate) use forward::check_tokens;
pub mod hyper_connection;
pub mod kv_cache;
pub mod linear_attn;
pub mod moe;
pub mod mtp;
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
use crate::synth::routing::{RoutingLog, RoutingOverride, RoutingShape};

pub use config::{GateActivation, LayerKind, ModelConfig};
pub use error::ModelError;
pub use kv_cache::{KvCacheType, KvRows};
pub use linear_attn::GdnAlgorithm;
pub use mtp::{MtpBlock, MtpState};
pub use state::{MropeTrack, SequenceState, Snapshot};

use config::Meta;
use hyper_connection::GatedResidual;
use linear_attn::{GatedDeltaNet, GdnRecord};
use moe::SparseMoe;
use ple::{PleLayer, PleRecord};
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

/// What to load besides the trunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// Load the MTP block when the file has one (`qwen4exp.nextn_predict_layers = 1`); without it the model
    /// cannot draft, and its states carry no MTP cache.
    pub mtp: bool,
    /// How the attention caches store their rows ([`KvCacheType`]; `f32`, the exact path, by default).
    pub kv_cache: KvCacheType,
}

impl Default for LoadOptions {
    /// Everything the file has.
    fn default() -> Self {
        Self { mtp: true, kv_cache: KvCacheType::F32 }
    }
}

/// The output of [`Qwen4Exp::forward_chain`]: a speculative chain verified in one forward.
#[derive(Debug)]
pub struct ChainOutput {
    /// Logits of every row, `[n, vocab]` (masked ids at `-inf`).
    pub logits: Vec<f32>,
    /// Per row, the smallest share of the normalised router weight that resident experts covered in any layer
    /// (a verify row under `speculative::COVERAGE_THRESHOLD` ends its chain as case B). On the CPU every expert is
    /// resident, so every value is 1.
    pub coverage: Vec<f32>,
    /// What [`Qwen4Exp::rollback_chain`] needs to cut the chain back to any prefix.
    pub record: ChainRecord,
}

/// Everything needed to roll a verified chain back to a prefix of its rows without recomputing them: the
/// recurrent state before the chain and, per layer, the projections its state update read.
#[derive(Debug)]
pub struct ChainRecord {
    pos0: usize,
    n: usize,
    before: Snapshot,
    gdn: Vec<Option<GdnRecord>>,
    ple: Option<PleRecord>,
    /// The pre-mixer bank of every row, `[n, S*d]`.
    bank: Vec<f32>,
    /// The chain's tokens.
    tokens: Vec<u32>,
    save_s: f64,
}

impl ChainRecord {
    /// Position of the chain's first row.
    pub fn pos0(&self) -> usize {
        self.pos0
    }
    /// Rows in the chain.
    pub fn len(&self) -> usize {
        self.n
    }
    /// Whether the chain had no rows.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
    /// Seconds spent saving the state before the chain.
    pub fn save_s(&self) -> f64 {
        self.save_s
    }
}

/// Tokens proposed by [`Qwen4Exp::draft`].
#[derive(Debug, Clone, Default)]
pub struct DraftChain {
    /// The drafts, greedy over the MTP logits, in order.
    pub tokens: Vec<u32>,
    /// The MTP logits of each draft step, `[tokens.len(), vocab]`, when asked for (empty otherwise).
    pub logits: Vec<f32>,
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
    pub(crate) mtp: Option<MtpBlock>,
    pub(crate) file: Arc<GgufFile>,
    /// Where the experts and the n-gram table live; `None`: everything read through the memory map.
    pub(crate) placement: Option<Box<Placement>>,
    /// Expert uses by tier, SSD reads (also counted without placement: every expert then counts as RAM).
    pub(crate) placement_stats: Arc<PlacementStats>,
    /// Chooses the trunk layers' experts in place of the routers (benchmarks: [`crate::synth::routing`]).
    pub(crate) routing_override: Option<Arc<dyn RoutingOverride>>,
    /// Collects the routing the forward used (benchmarks' statistics).
    pub(crate) routing_log: Option<Arc<RoutingLog>>,
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

    /// Builds the model from an opened GGUF file, validating every tensor's presence, shape and type; loads the
    /// MTP block when the file has one.
    pub fn from_gguf(file: Arc<GgufFile>) -> Result<Self, ModelError> {
        Self::from_gguf_with(file, LoadOptions::default())
    }

    /// [`Qwen4Exp::from_gguf`] with explicit options.
    pub fn from_gguf_with(file: Arc<GgufFile>, opts: LoadOptions) -> Result<Self, ModelError> {
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
        let mtp = if opts.mtp && config.n_nextn > 0 {
            Some(MtpBlock::load(&w, &config, config.n_layer, config.nextn_compress_ratio)?)
        } else {
            None
        };
        let mut model = Self {
            mtp,
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
            routing_override: None,
            routing_log: None,
        };
        model.set_kv_cache(opts.kv_cache)?;
        Ok(model)
    }

    /// Sets how the attention caches of states made from now on store their rows (the trunk's and the MTP
    /// block's; states made before keep theirs).
    ///
    /// Errors: [`ModelError::KvCacheType`] when an attention layer's heads are not whole blocks of `ty`.
    pub fn set_kv_cache(&mut self, ty: KvCacheType) -> Result<(), ModelError> {
        for l in &self.layers {
            if let TokenMixer::SelfAttention(a) = &l.mixer {
                a.check_kv_cache(ty)?;
            }
        }
        if let Some(m) = &self.mtp {
            m.self_attn.check_kv_cache(ty)?;
        }
        self.config.kv_cache = ty;
        Ok(())
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

    /// Puts `routing` in place of the trunk layers' routers (`None`: the routers' own choice again): each row then
    /// uses the experts and weights `routing` gives for its sequence's stream and position (see
    /// [`crate::synth::routing`]); the routers still run, and nothing after the choice changes. The CUDA backend
    /// takes the override the host model has when it is loaded.
    ///
    /// Errors: [`ModelError::RoutingShape`] when `routing` was made for another number of layers, experts or
    /// experts per token.
    pub fn set_routing_override(&mut self, routing: Option<Arc<dyn RoutingOverride>>) -> Result<(), ModelError> {
        if let Some(r) = &routing {
            let model = self.routing_shape();
            if r.shape() != model {
                return Err(ModelError::RoutingShape {
                    given: format!("{:?}", r.shape()),
                    model: format!("{model:?}"),
                });
            }
        }
        self.routing_override = routing;
        Ok(())
    }

    /// The routing override in place, if any.
    pub fn routing_override(&self) -> Option<&Arc<dyn RoutingOverride>> {
        self.routing_override.as_ref()
    }

    /// The trunk's routing shape: layers, experts per layer, experts per token.
    pub fn routing_shape(&self) -> RoutingShape {
        RoutingShape { n_layer: self.config.n_layer, n_expert: self.config.n_expert, top_k: self.config.n_expert_used }
    }

    /// Collects the routing every forward pass uses into `log` (`None`: stop): the CPU forward's rows, and the
    /// hybrid GPU backend's CPU-path rows (decode steps and verify passes; streamed prefill is not seen).
    pub fn set_routing_log(&mut self, log: Option<Arc<RoutingLog>>) {
        self.routing_log = log;
    }

    /// The routing log, if any.
    pub(crate) fn routing_log(&self) -> Option<&Arc<RoutingLog>> {
        self.routing_log.as_ref()
    }

    /// The tier of every routed expert, `[layer][expert]`, when the model is placed.
    pub fn expert_tiers(&self) -> Option<&[Vec<Tier>]> {
        self.placement.as_ref().map(|p| p.tiers())
    }

    /// The routed experts of `layer` on the CPU for `n` tokens `x` (`[n, d]`), each token with its own
    /// `(expert, weight)` list (`routing`; empty lists are fine): `sum_e w_e y_e`, `[n, d]`, without the shared
    /// expert. The CPU half of hybrid decode: experts come from the RAM tier or the SSD tier (with the
    /// next layers' SSD experts prefetched from `x`), summed in ascending expert id order.
    ///
    /// Errors: [`ModelError::WeightRead`] when an SSD read fails.
    pub(crate) fn cpu_routed(
        &self,
        layer: usize,
        x: &[f32],
        n: usize,
        routing: &[moe::Routing],
    ) -> Result<Vec<f32>, ModelError> {
        let mlp = self.routed_moe(layer);
        match self.trunk_placement(layer) {
            Some(p) => {
                let ahead: Vec<&moe::SparseMoe> =
                    self.layers.iter().skip(layer + 1).take(p.prefetch_layers()).map(|l| &l.mlp).collect();
                p.moe_forward(layer, mlp, x, n, routing, &ahead, false)
            }
            None => {
                let work: Vec<crate::quant::moe::ExpertWork<'_>> = mlp
                    .tokens_by_expert(routing)
                    .into_iter()
                    .enumerate()
                    .filter(|(_, users)| !users.is_empty())
                    .map(|(e, tokens)| crate::quant::moe::ExpertWork { expert: mlp.experts[e].as_ref(), tokens })
                    .collect();
                let mut out = vec![0f32; n * self.config.hidden];
                crate::quant::moe::routed_experts(&work, x, n, &mut out);
                Ok(out)
            }
        }
    }

    /// The placement of `layer`'s experts: `None` unplaced, and for the MTP block (`layer == n_layer`), whose
    /// experts are never placed.
    fn trunk_placement(&self, layer: usize) -> Option<&Placement> {
        self.placement.as_deref().filter(|_| layer < self.layers.len())
    }

    /// The routed-expert MoE of `layer`: a trunk layer's, or the MTP block's for `layer == n_layer` (the hybrid
    /// GPU backend numbers the block after the trunk; its experts are never placed, they stay in the model file).
    ///
    /// Panics: `layer` past the trunk without an MTP block (callers only pass layers they hold).
    pub(crate) fn routed_moe(&self, layer: usize) -> &moe::SparseMoe {
        match self.layers.get(layer) {
            Some(l) => &l.mlp,
            None => &self.mtp.as_ref().expect("layer n_layer is the MTP block").mlp,
        }
    }

    /// Expert `e` of `layer`'s host weights (RAM tier, SSD tier read now, or the model file): what hybrid prefill
    /// uploads. Errors: [`ModelError::WeightRead`] when the SSD read fails.
    pub(crate) fn host_expert(&self, layer: usize, e: usize) -> Result<crate::placement::HostExpert<'_>, ModelError> {
        let mlp = self.routed_moe(layer);
        match self.trunk_placement(layer) {
            Some(p) => p.host_expert(layer, e, mlp),
            None => Ok(crate::placement::HostExpert::Borrowed(&mlp.experts[e])),
        }
    }

    /// Expert `e` of `layer` when its weights are in host memory without a read: the RAM tier of a placement, or
    /// the model's own (file-mapped) experts when unplaced; `None` for an SSD-tier expert.
    pub(crate) fn ram_expert(&self, layer: usize, e: usize) -> Option<&crate::model::moe::Expert> {
        match self.trunk_placement(layer) {
            Some(p) => p.ram_expert(layer, e),
            None => self.routed_moe(layer).experts.get(e),
        }
    }

    /// The placement's GPU expert cache settings for the hybrid GPU backend; static unplaced.
    pub(crate) fn gpu_cache_options(&self) -> crate::placement::GpuCacheOptions {
        self.placement.as_ref().map_or_else(Default::default, |p| p.gpu_cache())
    }

    /// The placement's (handoff, marginal omission) fractions for the hybrid GPU backend;
    /// ([`crate::placement::DEFAULT_HANDOFF`], 0) unplaced.
    pub(crate) fn hybrid_fractions(&self) -> (f32, f32) {
        self.placement.as_ref().map_or((crate::placement::DEFAULT_HANDOFF, 0.0), |p| p.hybrid_fractions())
    }

    /// The decoded n-gram table rows `rows` (`[rows.len(), head_dim]` f32) from wherever the table lives (RAM or
    /// SSD with a placement, else the model file): the hybrid GPU backend keeps the table on the host and uploads
    /// only the rows a forward pass reads. `None` for a model without a PLE layer.
    ///
    /// Errors: [`ModelError::WeightRead`] when a row read from SSD fails.
    pub(crate) fn gather_ngram_rows(&self, rows: &[u64]) -> Result<Option<Vec<f32>>, ModelError> {
        let Some(ple) = self.layers.iter().find_map(|l| l.ple.as_ref()) else { return Ok(None) };
        let cols = ple.ngram_embedding.cols();
        let mut out = vec![0f32; rows.len() * cols];
        match self.placement.as_ref().and_then(|p| p.table().and_then(|t| p.fetch_rows(rows).map(|f| (t, f)))) {
            Some((table, fetch)) => {
                table
                    .gather(fetch, rows, &mut out)
                    .map_err(|e| ModelError::WeightRead { what: "n-gram table rows".into(), detail: e.to_string() })?;
            }
            None => {
                for (r, o) in rows.iter().zip(out.chunks_exact_mut(cols)) {
                    ple.ngram_embedding.dequantize_row(*r as usize, o);
                }
            }
        }
        Ok(Some(out))
    }

    /// Starts the SSD reads of those of `experts` of `layer` that live on SSD (see [`Qwen4Exp::host_expert`]).
    pub(crate) fn request_experts(&self, layer: usize, experts: &[usize]) {
        if let Some(p) = self.trunk_placement(layer) {
            p.request_experts(layer, experts);
        }
    }

    /// Address ranges of the RAM tier (see [`crate::placement`]), empty when not placed.
    pub(crate) fn resident_ranges(&self) -> Vec<(usize, usize)> {
        self.placement.as_ref().map_or_else(Vec::new, |p| p.resident_ranges())
    }

    /// The placement as built ([`PlacementReport::unplaced`] when [`Qwen4Exp::place`] was not called).
    pub fn placement_report(&self) -> PlacementReport {
        match &self.placement {
            Some(p) => p.report().clone(),
            None => PlacementReport::unplaced(self),
        }
    }

    /// Read bandwidth of the SSD tier in bytes/s, measured now for about `seconds` (whole experts read through
    /// the tier's reader, `O_DIRECT` where the file system allows it); `None` when the placement has no SSD tier.
    /// For benchmarks (the floor of decode with an SSD tier), while nothing else reads.
    ///
    /// Errors: [`ModelError::WeightRead`] when a read fails.
    pub fn ssd_read_bandwidth(&self, seconds: f64) -> Option<Result<f64, ModelError>> {
        let p = self.placement.as_ref()?;
        p.ssd_read_bandwidth(seconds)
            .map(|r| r.map_err(|e| ModelError::WeightRead { what: "SSD tier bandwidth".into(), detail: e.to_string() }))
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

    /// Bytes of the MTP block's routed experts (gate + up + down of its 512; 0 without a block): in hybrid mode
    /// they stay on the host (the CPU computes them), so they are not VRAM.
    pub fn mtp_routed_expert_bytes(&self) -> u64 {
        self.mtp.as_ref().map_or(0, |b| {
            b.mlp
                .experts
                .iter()
                .map(|e| (e.gate_proj.bytes().len() + e.up_proj.bytes().len() + e.down_proj.bytes().len()) as u64)
                .sum()
        })
    }

    /// Bytes of the MTP block's tensors in the file (`blk.{n_layer}.*`; 0 without one): counted in
    /// [`Self::weight_bytes`]'s dense part, although a plain decode step never reads them.
    pub fn mtp_weight_bytes(&self) -> u64 {
        let prefix = format!("blk.{}.", self.config.n_layer);
        self.file.tensors().filter(|t| t.name.starts_with(&prefix)).map(|t| t.n_bytes).sum()
    }

    /// The MTP block, when loaded.
    pub fn mtp(&self) -> Option<&MtpBlock> {
        self.mtp.as_ref()
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
                    TokenMixer::SelfAttention(a) => LayerState::Attention(a.new_state(self.config.kv_cache)),
                })
                .collect(),
            ple: self.layers.iter().find_map(|l| l.ple.as_ref().map(|p| p.new_state())),
            mtp: self.mtp.as_ref().map(|m| m.new_state(self.config.kv_cache)),
            routing_stream: 0,
            mrope: MropeTrack::default(),
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
                    a.truncate(snap.pos, att.index_shape().1);
                }
                _ => return Err(ModelError::BadSnapshot { snapshot: snap.pos, current: state.pos }),
            }
        }
        match (state.mtp.as_mut(), &snap.mtp_bank, &self.mtp) {
            (Some(ms), Some(bank), Some(block)) => {
                block.truncate(&mut ms.attn, snap.pos.saturating_sub(1));
                ms.last_bank.clone_from(bank);
                ms.drafted_with = None;
            }
            (None, _, _) => {}
            _ => return Err(ModelError::BadSnapshot { snapshot: snap.pos, current: state.pos }),
        }
        state.ple.clone_from(&snap.ple);
        state.mrope.truncate(snap.pos);
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
                    LayerState::Attention(a.prefix(snap.pos, att.index_shape().1).ok_or_else(bad)?)
                }
                _ => return Err(bad()),
            });
        }
        let mtp = match (&source.mtp, &snap.mtp_bank, &self.mtp) {
            (Some(ms), Some(bank), Some(block)) => {
                let attn = block.prefix(&ms.attn, snap.pos.saturating_sub(1)).ok_or_else(bad)?;
                Some(MtpState { attn, last_bank: bank.clone(), drafted_with: None })
            }
            (None, _, _) => None,
            _ => return Err(bad()),
        };
        let mrope = source.mrope.prefix(snap.pos);
        Ok(SequenceState {
            pos: snap.pos,
            max_len,
            layers,
            ple: snap.ple.clone(),
            mtp,
            routing_stream: source.routing_stream,
            mrope,
        })
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
        self.forward_inner(state, tokens, want, opts, None, None)
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
        self.forward_inner(state, tokens, want, ForwardOptions::default(), Some(campaign), None)
    }

    /// Runs a speculative chain (the pending token and the drafts after it) in one forward that returns the
    /// logits of every row and keeps what [`Qwen4Exp::rollback_chain`] needs to cut the chain back to any prefix.
    /// Gated DeltaNet runs token by token, so every row's logits are bit for bit those of decoding the rows one
    /// at a time (level 3 relies on this). The MTP cache is left as it was: [`Qwen4Exp::rollback_chain`], which
    /// must follow (with `keep` = every row to keep them all), runs its rows for the kept prefix only.
    ///
    /// Errors: as [`Qwen4Exp::forward`]; the state is unchanged on error.
    pub fn forward_chain(&self, state: &mut SequenceState, tokens: &[u32]) -> Result<ChainOutput, ModelError> {
        let t = std::time::Instant::now();
        let before = state.snapshot();
        let save_s = t.elapsed().as_secs_f64();
        let mut record = ChainRecord {
            pos0: state.pos,
            n: tokens.len(),
            before,
            gdn: Vec::new(),
            ple: None,
            bank: Vec::new(),
            tokens: tokens.to_vec(),
            save_s,
        };
        let opts = ForwardOptions { gdn: GdnAlgorithm::Recurrent };
        let logits = self.forward_inner(state, tokens, LogitsFor::All, opts, None, Some(&mut record))?;
        Ok(ChainOutput { logits, coverage: vec![1.0; tokens.len()], record })
    }

    /// Cuts a chain run by [`Qwen4Exp::forward_chain`] back to its first `keep` rows: attention caches and
    /// indexer keys are truncated, Gated DeltaNet and PLE states are rebuilt from the state before the chain by
    /// replaying only their recurrences over the kept rows (no projection, router, MoE or head work is redone),
    /// and the MTP cache is realigned: its rows for the kept prefix run in one batch from the chain's banks (rows
    /// of rejected drafts are never run). The result equals, bit for bit, the state a forward of only the kept
    /// rows would have left. Returns the seconds spent realigning the MTP cache.
    ///
    /// Errors: [`ModelError::BadSnapshot`] when `state` is not the state the chain left or `keep` exceeds it.
    pub fn rollback_chain(
        &self,
        state: &mut SequenceState,
        record: &ChainRecord,
        keep: usize,
    ) -> Result<f64, ModelError> {
        let bad = || ModelError::BadSnapshot { snapshot: record.pos0 + keep, current: state.pos };
        if keep > record.n
            || state.pos != record.pos0 + record.n
            || record.before.recurrent.len() != self.layers.len()
            || record.bank.len() != record.n * self.config.hc_dim()
        {
            return Err(bad());
        }
        if keep < record.n {
            self.cut_chain(state, record, keep)?;
        }
        state.pos = record.pos0 + keep;
        state.mrope.truncate(state.pos);
        let t = std::time::Instant::now();
        if keep > 0
            && let (Some(ms), Some(block)) = (state.mtp.as_mut(), &self.mtp)
        {
            let dim = self.config.hc_dim();
            self.extend_mtp(block, ms, &record.bank[..keep * dim], &record.tokens[..keep], record.pos0);
        }
        Ok(t.elapsed().as_secs_f64())
    }

    /// The trunk part of [`Qwen4Exp::rollback_chain`] (`keep` below the chain's length).
    fn cut_chain(&self, state: &mut SequenceState, record: &ChainRecord, keep: usize) -> Result<(), ModelError> {
        let new_pos = record.pos0 + keep;
        for (i, (ls, layer)) in state.layers.iter_mut().zip(&self.layers).enumerate() {
            match (ls, &layer.mixer, &record.before.recurrent[i], record.gdn.get(i)) {
                (LayerState::LinearAttention(g), TokenMixer::LinearAttention(net), Some(before), Some(Some(rec))) => {
                    g.clone_from(before);
                    net.replay(g, rec, keep);
                }
                (LayerState::Attention(a), TokenMixer::SelfAttention(att), None, _) => {
                    a.truncate(new_pos, att.index_shape().1);
                }
                _ => return Err(ModelError::BadSnapshot { snapshot: new_pos, current: record.pos0 + record.n }),
            }
        }
        if let Some(ple_layer) = self.layers.iter().find_map(|l| l.ple.as_ref()) {
            match (state.ple.as_mut(), &record.before.ple, &record.ple) {
                (Some(ps), Some(before), Some(rec)) => {
                    ps.clone_from(before);
                    ple_layer.replay(ps, rec, keep);
                }
                _ => return Err(ModelError::BadSnapshot { snapshot: new_pos, current: record.pos0 + record.n }),
            }
        }
        Ok(())
    }

    /// Proposes `n` draft tokens after `pending` (the token the target will consume next) with the MTP block,
    /// greedily: the first step reads the target's bank at `pos - 1` (kept in the state) and `pending` at rope
    /// position `pos - 1`; each further step reads the previous step's own bank and draft one position later.
    /// The chained rows are dropped from the MTP cache afterwards; the first row, which is what the target-aligned
    /// row for `pending` will be, stays (the next forward of `pending` does not redo it). `keep_logits` also
    /// returns each step's MTP logits.
    ///
    /// Errors: [`ModelError::MtpUnavailable`] when the model has no MTP block loaded, the sequence is empty, or
    /// the MTP cache is not aligned with it; [`ModelError::TokenOutOfRange`] for a bad `pending`.
    pub fn draft(
        &self,
        state: &mut SequenceState,
        pending: u32,
        n: usize,
        keep_logits: bool,
    ) -> Result<DraftChain, ModelError> {
        let cfg = &self.config;
        if pending as usize >= cfg.vocab {
            return Err(ModelError::TokenOutOfRange { token: pending, vocab: cfg.vocab });
        }
        let unavailable = |reason: String| ModelError::MtpUnavailable { reason };
        let block = self.mtp.as_ref().ok_or_else(|| unavailable("the model has no MTP block loaded".into()))?;
        let pos = state.pos;
        let ms = state.mtp.as_mut().ok_or_else(|| unavailable("the sequence state has no MTP cache".into()))?;
        let dim = cfg.hc_dim();
        if pos == 0 || ms.last_bank.len() != dim {
            return Err(unavailable("no target hidden state yet (empty sequence)".into()));
        }
        let rows = block.rows(&ms.attn);
        if rows == pos {
            block.truncate(&mut ms.attn, pos - 1);
        } else if rows + 1 != pos {
            return Err(unavailable(format!("the MTP cache holds {rows} rows for a sequence of {pos} tokens")));
        }
        let mut out = DraftChain::default();
        let mut bank = ms.last_bank.clone();
        let mut tok = pending;
        for i in 0..n {
            let step = block.forward(&self.embed_tokens, &mut ms.attn, &bank, &[tok], pos - 1 + i, 0..1)?;
            let logits = self.head(&step.hidden, 1);
            let Some(d) = crate::sampling::argmax(&logits) else { break };
            out.tokens.push(d as u32);
            if keep_logits {
                out.logits.extend_from_slice(&logits);
            }
            bank = step.bank;
            tok = d as u32;
        }
        if n == 0 {
            return Ok(out);
        }
        block.truncate(&mut ms.attn, pos);
        ms.drafted_with = Some(pending);
        Ok(out)
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
