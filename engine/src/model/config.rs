//! Hyper-parameters of a `qwen4exp` model, read from GGUF metadata.
//!
//! Keys: llama.cpp's `qwen4exp.*` metadata, as `engine/src/convert/` writes it; the HF equivalents are in
//! `transformers/models/qwen4_exp/configuration_qwen4_exp.py`.

use crate::gguf::{GgufFile, MetadataValue};

use super::error::ModelError;
use super::kv_cache::KvCacheType;

/// Activation of the Gated DeltaNet output gate (`output_gate_type` in HF; llama.cpp's `qwen4exp` always uses
/// sigmoid). Nebula's converter writes `qwen4exp.ssm.gate_activation = "silu"` for the rare checkpoints that use
/// SiLU; the key is absent in llama.cpp files, which means sigmoid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateActivation {
    /// `sigmoid(z)`.
    Sigmoid,
    /// `z * sigmoid(z)`.
    Silu,
}

/// The token mixer of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (`linear_attn`), a recurrent layer.
    LinearAttention,
    /// Gated softmax attention (`self_attn`); with `compress_ratio > 0` the QSA indexer picks the keys each query
    /// sees, with 0 it is dense (as the MTP block's attention).
    IndexedAttention {
        /// Tokens pooled into one indexer block (`indexer_compress_ratio`, 4 in the release).
        compress_ratio: usize,
    },
}

/// The QSA indexer's hyper-parameters (`qwen4exp.attention.indexer.*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexerConfig {
    /// Indexer query heads (4).
    pub n_heads: usize,
    /// Width of every indexer head (128).
    pub head_dim: usize,
    /// Tokens selected from complete blocks per query (`indexer_budget`, 2048).
    pub token_budget: usize,
}

/// The PLE (hashed n-gram per-layer embedding) hyper-parameters (`qwen4exp.ple.*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PleConfig {
    /// The one decoder layer (0-based) that carries PLE.
    pub layer: usize,
    /// Largest n-gram order (3): orders 2..=ngram_size are hashed.
    pub ngram_size: usize,
    /// Hash heads per n-gram order (8).
    pub heads_per_ngram: usize,
    /// Kernel of the dilated causal conv (4); the dilation is `ngram_size`.
    pub conv_kernel: usize,
    /// Token that starts a new n-gram segment (248044 `<|endoftext|>`).
    pub eos_token_id: u32,
    /// Width of one table row = one head's share of the n-gram embedding (160).
    pub head_dim: usize,
    /// Hash multipliers, one per shift 0..ngram_size.
    pub multipliers: Vec<u64>,
    /// First table row of each head.
    pub head_offsets: Vec<u64>,
    /// Rows of each head (distinct primes).
    pub head_sizes: Vec<u64>,
}

impl PleConfig {
    /// Number of hash heads, `(ngram_size - 1) * heads_per_ngram` (16).
    pub fn n_heads(&self) -> usize {
        (self.ngram_size - 1) * self.heads_per_ngram
    }
    /// Width of the concatenated n-gram embedding `E` (2560).
    pub fn embed_dim(&self) -> usize {
        self.n_heads() * self.head_dim
    }
    /// Steps of history the dilated conv keeps: `(conv_kernel - 1) * ngram_size` (9).
    pub fn conv_state_len(&self) -> usize {
        (self.conv_kernel - 1) * self.ngram_size
    }
}

/// Everything the forward pass needs to know about the model's shapes.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// Trunk decoder layers (`block_count - nextn_predict_layers`, 48).
    pub n_layer: usize,
    /// MTP blocks after the trunk (0 or 1).
    pub n_nextn: usize,
    /// Hidden size `d` of one residual stream (2560).
    pub hidden: usize,
    /// Rows of the embedding and the head (248320).
    pub vocab: usize,
    /// Trained context length (262144).
    pub context_length: usize,
    /// Attention query heads (24).
    pub n_head: usize,
    /// Attention key/value heads (2).
    pub n_head_kv: usize,
    /// Attention head width (256).
    pub head_dim: usize,
    /// RMSNorm epsilon (1e-6).
    pub rms_eps: f32,
    /// RoPE base (1e7).
    pub rope_theta: f32,
    /// Rotated dimensions of each head (64 = 256 x 0.25).
    pub rope_dim: usize,
    /// Interleaved M-RoPE sections (T, H, W, unused) in frequency pairs: [11, 11, 10, 0].
    pub rope_sections: [usize; 4],
    /// Routed experts per layer (512).
    pub n_expert: usize,
    /// Experts used per token (10).
    pub n_expert_used: usize,
    /// Routed expert intermediate size (640).
    pub expert_ff: usize,
    /// Shared expert intermediate size (640).
    pub shared_ff: usize,
    /// Gated DeltaNet conv kernel (4).
    pub ssm_conv_kernel: usize,
    /// Gated DeltaNet key/value head width (128).
    pub ssm_head_dim: usize,
    /// Gated DeltaNet key heads (16).
    pub ssm_k_heads: usize,
    /// Gated DeltaNet value heads (48).
    pub ssm_v_heads: usize,
    /// Gated DeltaNet output gate activation.
    pub ssm_gate: GateActivation,
    /// Residual streams of the hyper-connections (4).
    pub hc_count: usize,
    /// Rank of the hyper-connection mixer (320).
    pub hc_lowrank: usize,
    /// The QSA indexer.
    pub indexer: IndexerConfig,
    /// One entry per trunk layer.
    pub layer_kinds: Vec<LayerKind>,
    /// Compress ratio of the MTP block's attention (the `compress_ratios` entry after the trunk's; 0 = dense, as
    /// llama.cpp's converter writes it).
    pub nextn_compress_ratio: usize,
    /// PLE, if the model has it.
    pub ple: Option<PleConfig>,
    /// How the attention caches store their rows (not a property of the file: [`crate::model::LoadOptions`]
    /// or [`crate::model::Qwen4Exp::set_kv_cache`] choose it; `f32` by default).
    pub kv_cache: KvCacheType,
}

impl ModelConfig {
    /// Width of the hyper-connection bundle, `hc_count * hidden` (10240).
    pub fn hc_dim(&self) -> usize {
        self.hc_count * self.hidden
    }
    /// Gated DeltaNet key width, `ssm_k_heads * ssm_head_dim` (2048).
    pub fn ssm_key_dim(&self) -> usize {
        self.ssm_k_heads * self.ssm_head_dim
    }
    /// Gated DeltaNet value width, `ssm_v_heads * ssm_head_dim` (6144).
    pub fn ssm_value_dim(&self) -> usize {
        self.ssm_v_heads * self.ssm_head_dim
    }
    /// Channels of the Gated DeltaNet conv, `2 * key + value` (10240).
    pub fn ssm_conv_dim(&self) -> usize {
        2 * self.ssm_key_dim() + self.ssm_value_dim()
    }

    /// Bytes of state a sequence of `max_len` tokens holds once full, on either backend (both lay the caches out
    /// alike): per attention layer keys and values (`n_head_kv * head_dim` values each a token, in
    /// [`ModelConfig::kv_cache`]'s type), the indexer's raw keys and pooled blocks (in the type's
    /// [`KvCacheType::index_key_type`]); per Gated DeltaNet layer its `f32` conv history and `[v_heads,
    /// head_dim, head_dim]` recurrent state; the PLE conv history; with `mtp`, the MTP block's dense attention
    /// cache and bank. What admission into a batch reserves for a sequence.
    pub fn state_bytes(&self, max_len: usize, mtp: bool) -> usize {
        let layers: usize = self
            .layer_kinds
            .iter()
            .map(|k| match *k {
                LayerKind::LinearAttention => {
                    4 * ((self.ssm_conv_kernel.saturating_sub(1)) * self.ssm_conv_dim()
                        + self.ssm_v_heads * self.ssm_head_dim * self.ssm_head_dim)
                }
                LayerKind::IndexedAttention { compress_ratio } => self.attention_cache_bytes(max_len, compress_ratio),
            })
            .sum();
        let ple = self.ple.as_ref().map_or(0, |p| 4 * p.conv_state_len() * self.hc_dim());
        let mtp = if mtp && self.n_nextn > 0 {
            self.attention_cache_bytes(max_len, self.nextn_compress_ratio) + 4 * self.hc_dim()
        } else {
            0
        };
        layers + ple + mtp
    }

    /// Bytes of one attention layer's caches for `max_len` tokens (`compress_ratio` 0: dense, no indexer):
    /// [`KvCacheType::row_bytes`] of K and V per token, with the indexer its raw key per token and `max_len /
    /// compress_ratio + 1` pooled block keys (as the CUDA backend allocates them).
    pub fn attention_cache_bytes(&self, max_len: usize, compress_ratio: usize) -> usize {
        let [kv, raw, pooled] = self.attention_row_bytes(compress_ratio);
        let blocks = max_len.checked_div(compress_ratio).map_or(0, |b| b + 1);
        max_len * (2 * kv + raw) + blocks * pooled
    }

    /// Bytes of one row of an attention layer's caches under [`ModelConfig::kv_cache`]: a token's K (or V), a
    /// token's raw indexer key and a pooled block key (both 0 without an indexer, `compress_ratio` 0).
    pub fn attention_row_bytes(&self, compress_ratio: usize) -> [usize; 3] {
        let kv = self.kv_cache.row_bytes(self.n_head_kv * self.head_dim);
        if compress_ratio == 0 {
            return [kv, 0, 0];
        }
        let ihd = self.indexer.head_dim;
        let ik = self.kv_cache.index_key_type(ihd).row_bytes(ihd);
        [kv, ik, ik]
    }

    /// Reads the configuration from a GGUF file's `qwen4exp.*` metadata and checks it for consistency.
    ///
    /// Errors: [`ModelError::Architecture`] for another architecture; [`ModelError::Metadata`] naming the key for a
    /// missing, mistyped or impossible value.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ModelError> {
        let m = Meta { file };
        let arch = m.string("general.architecture")?;
        if arch != "qwen4exp" {
            return Err(ModelError::Architecture { file: m.name(), found: arch });
        }
        let block_count = m.usize("qwen4exp.block_count")?;
        let n_nextn = m.opt_usize("qwen4exp.nextn_predict_layers")?.unwrap_or(0);
        if n_nextn > 1 || n_nextn >= block_count {
            return Err(m.bad("qwen4exp.nextn_predict_layers", format!("{n_nextn} MTP blocks of {block_count}")));
        }
        let n_layer = block_count - n_nextn;
        let hidden = m.usize("qwen4exp.embedding_length")?;
        let n_head = m.usize("qwen4exp.attention.head_count")?;
        let n_head_kv = m.usize("qwen4exp.attention.head_count_kv")?;
        let head_dim = m.usize("qwen4exp.attention.key_length")?;
        let value_len = m.opt_usize("qwen4exp.attention.value_length")?.unwrap_or(head_dim);
        if value_len != head_dim {
            return Err(
                m.bad("qwen4exp.attention.value_length", format!("{value_len} differs from key_length {head_dim}"))
            );
        }
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(
                m.bad("qwen4exp.attention.head_count_kv", format!("{n_head} heads are not a multiple of {n_head_kv}"))
            );
        }
        let rope_dim = m.usize("qwen4exp.rope.dimension_count")?;
        if rope_dim % 2 != 0 || rope_dim > head_dim {
            return Err(m.bad("qwen4exp.rope.dimension_count", format!("{rope_dim} for heads of {head_dim}")));
        }
        let sections = m.usize_array("qwen4exp.rope.dimension_sections")?;
        if sections.len() > 4 || sections.iter().sum::<usize>() * 2 > rope_dim.max(2) * 4 {
            return Err(m.bad("qwen4exp.rope.dimension_sections", format!("{sections:?}")));
        }
        let mut rope_sections = [0usize; 4];
        rope_sections[..sections.len()].copy_from_slice(&sections);

        let interval = m.opt_usize("qwen4exp.full_attention_interval")?.unwrap_or(4).max(1);
        let recurrent = m.opt_bool_array("qwen4exp.attention.recurrent_layers")?;
        let ratios = m.opt_usize_array("qwen4exp.attention.compress_ratios")?;
        let mut layer_kinds = Vec::with_capacity(n_layer);
        for i in 0..n_layer {
            let is_recurrent = match &recurrent {
                Some(r) => *r.get(i).ok_or_else(|| {
                    m.bad("qwen4exp.attention.recurrent_layers", format!("{} entries for {n_layer} layers", r.len()))
                })?,
                None => (i + 1) % interval != 0,
            };
            layer_kinds.push(if is_recurrent {
                LayerKind::LinearAttention
            } else {
                let compress_ratio = match &ratios {
                    Some(r) => *r.get(i).ok_or_else(|| {
                        m.bad("qwen4exp.attention.compress_ratios", format!("{} entries for {n_layer} layers", r.len()))
                    })?,
                    None => 4,
                };
                LayerKind::IndexedAttention { compress_ratio }
            });
        }

        let nextn_compress_ratio =
            if n_nextn > 0 { ratios.as_ref().and_then(|r| r.get(n_layer).copied()).unwrap_or(0) } else { 0 };
        let indexer = IndexerConfig {
            n_heads: m.usize("qwen4exp.attention.indexer.head_count")?,
            head_dim: m.usize("qwen4exp.attention.indexer.key_length")?,
            token_budget: m.usize("qwen4exp.attention.indexer.top_k")?,
        };
        for kind in &layer_kinds {
            if let LayerKind::IndexedAttention { compress_ratio } = kind
                && *compress_ratio > 0
                && indexer.token_budget % compress_ratio != 0
            {
                return Err(m.bad(
                    "qwen4exp.attention.indexer.top_k",
                    format!("budget {} is not a multiple of the compress ratio {compress_ratio}", indexer.token_budget),
                ));
            }
        }
        if nextn_compress_ratio > 0 && !indexer.token_budget.is_multiple_of(nextn_compress_ratio) {
            return Err(m.bad(
                "qwen4exp.attention.compress_ratios",
                format!(
                    "the MTP block's ratio {nextn_compress_ratio} does not divide the budget {}",
                    indexer.token_budget
                ),
            ));
        }
        if rope_dim > indexer.head_dim {
            return Err(m.bad(
                "qwen4exp.attention.indexer.key_length",
                format!("{} is narrower than the rotary dims {rope_dim}", indexer.head_dim),
            ));
        }

        let ssm_head_dim = m.usize("qwen4exp.ssm.state_size")?;
        let ssm_k_heads = m.usize("qwen4exp.ssm.group_count")?;
        let ssm_v_heads = m.usize("qwen4exp.ssm.time_step_rank")?;
        if ssm_k_heads == 0 || ssm_v_heads % ssm_k_heads != 0 {
            return Err(
                m.bad("qwen4exp.ssm.time_step_rank", format!("{ssm_v_heads} value heads for {ssm_k_heads} key heads"))
            );
        }
        if let Some(inner) = m.opt_usize("qwen4exp.ssm.inner_size")?
            && inner != ssm_v_heads * ssm_head_dim
        {
            return Err(m.bad("qwen4exp.ssm.inner_size", format!("{inner} != {ssm_v_heads} x {ssm_head_dim}")));
        }
        let ssm_gate = match m.opt_string("qwen4exp.ssm.gate_activation")?.as_deref() {
            None | Some("sigmoid") => GateActivation::Sigmoid,
            Some("silu") => GateActivation::Silu,
            Some(other) => return Err(m.bad("qwen4exp.ssm.gate_activation", format!("unknown activation '{other}'"))),
        };
        let hc_count = m.usize("qwen4exp.hyper_connection.count")?;
        if hc_count <= 1 {
            return Err(
                m.bad("qwen4exp.hyper_connection.count", format!("{hc_count}; qwen4exp needs at least 2 streams"))
            );
        }
        let n_expert = m.usize("qwen4exp.expert_count")?;
        let n_expert_used = m.usize("qwen4exp.expert_used_count")?;
        if n_expert_used == 0 || n_expert_used > n_expert {
            return Err(m.bad("qwen4exp.expert_used_count", format!("{n_expert_used} of {n_expert} experts")));
        }

        let ple = match m.opt_usize_array("qwen4exp.ple.layers")? {
            None => None,
            Some(layers) if layers.is_empty() => None,
            Some(layers) => {
                if layers.len() != 1 {
                    return Err(m.bad("qwen4exp.ple.layers", format!("{layers:?}; exactly one PLE layer is supported")));
                }
                let layer = layers[0];
                if layer_kinds.get(layer) != Some(&LayerKind::LinearAttention) {
                    return Err(m.bad("qwen4exp.ple.layers", format!("layer {layer} is not a Gated DeltaNet layer")));
                }
                let ngram_size = m.usize("qwen4exp.ple.ngram_size")?;
                let heads_per_ngram = m.usize("qwen4exp.ple.heads_per_ngram")?;
                if ngram_size < 2 || heads_per_ngram == 0 {
                    return Err(m.bad(
                        "qwen4exp.ple.ngram_size",
                        format!("{ngram_size} with {heads_per_ngram} heads per n-gram"),
                    ));
                }
                let cfg = PleConfig {
                    layer,
                    ngram_size,
                    heads_per_ngram,
                    conv_kernel: m.usize("qwen4exp.ple.conv_kernel")?,
                    eos_token_id: m.usize("qwen4exp.ple.eos_token_id")? as u32,
                    head_dim: m.usize("qwen4exp.embedding_length_per_layer_input")?,
                    multipliers: m.u64_array("qwen4exp.ple.layer_multipliers")?,
                    head_offsets: m.u64_array("qwen4exp.ple.head_offsets")?,
                    head_sizes: m.u64_array("qwen4exp.ple.head_vocab_sizes")?,
                };
                if cfg.conv_kernel == 0 {
                    return Err(m.bad("qwen4exp.ple.conv_kernel", "0".into()));
                }
                if cfg.multipliers.len() != ngram_size {
                    return Err(m.bad(
                        "qwen4exp.ple.layer_multipliers",
                        format!("{} values for n-gram size {ngram_size}", cfg.multipliers.len()),
                    ));
                }
                for (key, v) in [
                    ("qwen4exp.ple.head_offsets", &cfg.head_offsets),
                    ("qwen4exp.ple.head_vocab_sizes", &cfg.head_sizes),
                ] {
                    if v.len() != cfg.n_heads() {
                        return Err(m.bad(key, format!("{} values for {} hash heads", v.len(), cfg.n_heads())));
                    }
                }
                if cfg.head_sizes.contains(&0) {
                    return Err(m.bad("qwen4exp.ple.head_vocab_sizes", "a head has 0 rows".into()));
                }
                Some(cfg)
            }
        };

        Ok(Self {
            n_layer,
            n_nextn,
            hidden,
            vocab: 0,
            context_length: m.opt_usize("qwen4exp.context_length")?.unwrap_or(262_144),
            n_head,
            n_head_kv,
            head_dim,
            rms_eps: m.f32("qwen4exp.attention.layer_norm_rms_epsilon")?,
            rope_theta: m.opt_f32("qwen4exp.rope.freq_base")?.unwrap_or(10_000.0),
            rope_dim,
            rope_sections,
            n_expert,
            n_expert_used,
            expert_ff: m.usize("qwen4exp.expert_feed_forward_length")?,
            shared_ff: m.usize("qwen4exp.expert_shared_feed_forward_length")?,
            ssm_conv_kernel: m.usize("qwen4exp.ssm.conv_kernel")?,
            ssm_head_dim,
            ssm_k_heads,
            ssm_v_heads,
            ssm_gate,
            hc_count,
            hc_lowrank: m.usize("qwen4exp.hyper_connection.low_rank")?,
            indexer,
            layer_kinds,
            nextn_compress_ratio,
            ple,
            kv_cache: KvCacheType::F32,
        })
    }
}

/// Typed reads of metadata values with errors that name the file and key.
pub(crate) struct Meta<'a> {
    pub(crate) file: &'a GgufFile,
}

fn as_u64(v: &MetadataValue) -> Option<u64> {
    match *v {
        MetadataValue::U8(x) => Some(x as u64),
        MetadataValue::U16(x) => Some(x as u64),
        MetadataValue::U32(x) => Some(x as u64),
        MetadataValue::U64(x) => Some(x),
        MetadataValue::I8(x) => u64::try_from(x).ok(),
        MetadataValue::I16(x) => u64::try_from(x).ok(),
        MetadataValue::I32(x) => u64::try_from(x).ok(),
        MetadataValue::I64(x) => u64::try_from(x).ok(),
        _ => None,
    }
}

fn type_name(v: &MetadataValue) -> &'static str {
    match v {
        MetadataValue::U8(_) => "u8",
        MetadataValue::I8(_) => "i8",
        MetadataValue::U16(_) => "u16",
        MetadataValue::I16(_) => "i16",
        MetadataValue::U32(_) => "u32",
        MetadataValue::I32(_) => "i32",
        MetadataValue::F32(_) => "f32",
        MetadataValue::Bool(_) => "bool",
        MetadataValue::String(_) => "string",
        MetadataValue::Array(_) => "array",
        MetadataValue::U64(_) => "u64",
        MetadataValue::I64(_) => "i64",
        MetadataValue::F64(_) => "f64",
    }
}

impl<'a> Meta<'a> {
    pub(crate) fn name(&self) -> String {
        self.file.path().display().to_string()
    }
    pub(crate) fn bad(&self, key: &str, problem: String) -> ModelError {
        ModelError::Metadata { file: self.name(), key: key.to_string(), problem }
    }
    fn required(&self, key: &str) -> Result<&'a MetadataValue, ModelError> {
        self.file.get(key).ok_or_else(|| self.bad(key, "missing".into()))
    }
    fn wrong(&self, key: &str, want: &str, v: &MetadataValue) -> ModelError {
        self.bad(key, format!("expected {want}, found {}", type_name(v)))
    }
    fn to_usize(&self, key: &str, v: &MetadataValue) -> Result<usize, ModelError> {
        as_u64(v)
            .and_then(|x| usize::try_from(x).ok())
            .filter(|&x| x <= u32::MAX as usize)
            .ok_or_else(|| self.wrong(key, "a non-negative integer below 2^32", v))
    }
    pub(crate) fn usize(&self, key: &str) -> Result<usize, ModelError> {
        self.to_usize(key, self.required(key)?)
    }
    pub(crate) fn opt_usize(&self, key: &str) -> Result<Option<usize>, ModelError> {
        self.file.get(key).map(|v| self.to_usize(key, v)).transpose()
    }
    pub(crate) fn f32(&self, key: &str) -> Result<f32, ModelError> {
        self.opt_f32(key)?.ok_or_else(|| self.bad(key, "missing".into()))
    }
    pub(crate) fn opt_f32(&self, key: &str) -> Result<Option<f32>, ModelError> {
        match self.file.get(key) {
            None => Ok(None),
            Some(MetadataValue::F32(x)) if x.is_finite() => Ok(Some(*x)),
            Some(MetadataValue::F64(x)) if x.is_finite() => Ok(Some(*x as f32)),
            Some(v) => Err(self.wrong(key, "a finite float", v)),
        }
    }
    pub(crate) fn string(&self, key: &str) -> Result<String, ModelError> {
        self.opt_string(key)?.ok_or_else(|| self.bad(key, "missing".into()))
    }
    pub(crate) fn opt_string(&self, key: &str) -> Result<Option<String>, ModelError> {
        match self.file.get(key) {
            None => Ok(None),
            Some(MetadataValue::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(self.wrong(key, "a string", v)),
        }
    }
    fn array(&self, key: &str, v: &'a MetadataValue) -> Result<&'a [MetadataValue], ModelError> {
        match v {
            MetadataValue::Array(a) => Ok(&a.values),
            other => Err(self.wrong(key, "an array", other)),
        }
    }
    pub(crate) fn u64_array(&self, key: &str) -> Result<Vec<u64>, ModelError> {
        let a = self.array(key, self.required(key)?)?;
        a.iter().map(|v| as_u64(v).ok_or_else(|| self.wrong(key, "an array of non-negative integers", v))).collect()
    }
    pub(crate) fn usize_array(&self, key: &str) -> Result<Vec<usize>, ModelError> {
        let a = self.array(key, self.required(key)?)?;
        a.iter().map(|v| self.to_usize(key, v)).collect()
    }
    pub(crate) fn opt_usize_array(&self, key: &str) -> Result<Option<Vec<usize>>, ModelError> {
        if self.file.get(key).is_none() {
            return Ok(None);
        }
        self.usize_array(key).map(Some)
    }
    pub(crate) fn opt_bool_array(&self, key: &str) -> Result<Option<Vec<bool>>, ModelError> {
        let Some(v) = self.file.get(key) else { return Ok(None) };
        self.array(key, v)?
            .iter()
            .map(|x| match x {
                MetadataValue::Bool(b) => Ok(*b),
                other => Err(self.wrong(key, "an array of bools", other)),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
    pub(crate) fn opt_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>, ModelError> {
        let Some(v) = self.file.get(key) else { return Ok(None) };
        self.array(key, v)?
            .iter()
            .map(|x| match *x {
                MetadataValue::F32(f) if f.is_finite() => Ok(f),
                MetadataValue::F64(f) if f.is_finite() => Ok(f as f32),
                ref other => Err(self.wrong(key, "an array of finite floats", other)),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
    pub(crate) fn opt_i32_array(&self, key: &str) -> Result<Option<Vec<i32>>, ModelError> {
        let Some(v) = self.file.get(key) else { return Ok(None) };
        self.array(key, v)?
            .iter()
            .map(|x| match *x {
                MetadataValue::I32(i) => Ok(i),
                MetadataValue::U32(u) if u <= i32::MAX as u32 => Ok(u as i32),
                MetadataValue::U8(u) => Ok(u as i32),
                MetadataValue::I8(i) => Ok(i as i32),
                ref other => Err(self.wrong(key, "an array of i32", other)),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}
