//! What a cached state belongs to: a fingerprint of the model file, the engine's state layout and the shapes a
//! state of this model must have ([`ModelIdentity`]).

use xxhash_rust::xxh3::Xxh3;

use crate::gguf::GgufFile;
use crate::model::state::STATE_LAYOUT_VERSION;
use crate::model::{KvCacheType, Qwen4Exp, SequenceState, TokenMixer};

/// Data blocks sampled from each file part's tensor data.
const SAMPLES_PER_PART: u64 = 64;
/// Bytes per sampled block.
const SAMPLE_BYTES: u64 = 4096;

/// The shape of one layer's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum LayerShape {
    /// Gated DeltaNet: f32 counts of the conv history and of the recurrent `S`.
    LinearAttention { conv: usize, recurrent: usize },
    /// Attention: values per token of keys (and of values), of raw indexer keys, tokens per pooled block (0: no
    /// pooling), and the KV cache types of the keys and values and of the indexer keys.
    Attention { kv_width: usize, index_dim: usize, ratio: usize, kv_type: KvCacheType, index_type: KvCacheType },
}

/// The shapes every [`SequenceState`] and [`crate::model::Snapshot`] of one loaded model has.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct StateShape {
    pub(crate) layers: Vec<LayerShape>,
    /// PLE: tokens of n-gram context, f32s of conv history.
    pub(crate) ple: Option<(usize, usize)>,
    /// MTP block (when loaded): its attention's shape and the f32 count of its pending bank (`[S*d]`).
    pub(crate) mtp: Option<(LayerShape, usize)>,
}

impl StateShape {
    fn of(model: &Qwen4Exp) -> Self {
        let kv_type = model.config.kv_cache;
        let attn = |a: &crate::model::self_attn::Attention| {
            let (index_dim, ratio) = a.index_shape();
            let index_type = kv_type.index_key_type(index_dim);
            LayerShape::Attention { kv_width: a.kv_width(), index_dim, ratio, kv_type, index_type }
        };
        let layers = model
            .layers
            .iter()
            .map(|l| match &l.mixer {
                TokenMixer::LinearAttention(g) => {
                    let s = g.new_state();
                    LayerShape::LinearAttention { conv: s.conv.len(), recurrent: s.recurrent.len() }
                }
                TokenMixer::SelfAttention(a) => attn(a),
            })
            .collect();
        let fresh: SequenceState = model.new_state(0);
        let ple = fresh.ple.as_ref().map(|p| (p.context.len(), p.conv.len()));
        let bank = model.config.hc_dim();
        let mtp = model.mtp.as_ref().map(|m| (attn(&m.self_attn), bank));
        Self { layers, ple, mtp }
    }

    fn hash_into(&self, h: &mut Xxh3) {
        let word = |h: &mut Xxh3, v: usize| h.update(&(v as u64).to_le_bytes());
        word(h, self.layers.len());
        for l in &self.layers {
            match *l {
                LayerShape::LinearAttention { conv, recurrent } => {
                    for v in [0, conv, recurrent] {
                        word(h, v);
                    }
                }
                LayerShape::Attention { kv_width, index_dim, ratio, kv_type, index_type } => {
                    for v in [1, kv_width, index_dim, ratio, kv_type.id() as usize, index_type.id() as usize] {
                        word(h, v);
                    }
                }
            }
        }
        match self.ple {
            Some((context, conv)) => [1, context, conv].into_iter().for_each(|v| word(h, v)),
            None => word(h, 0),
        }
        match self.mtp {
            Some((LayerShape::Attention { kv_width, index_dim, ratio, kv_type, index_type }, bank)) => {
                [1, kv_width, index_dim, ratio, kv_type.id() as usize, index_type.id() as usize, bank]
                    .into_iter()
                    .for_each(|v| word(h, v))
            }
            _ => word(h, 0),
        }
    }
}

/// Identity of a loaded model as the prefix cache sees it: two models with the same identity give the same state
/// for the same tokens, so an entry written under one may be resumed under the other. Anything else is never
/// trusted.
///
/// The digest (XXH3-128) covers: the engine's [`STATE_LAYOUT_VERSION`] and crate version; per file part of the
/// GGUF, its size in bytes, its whole header (the metadata key-values and the tensor-info table: names, types,
/// shapes, offsets) and 64 blocks of 4 KiB sampled evenly over its tensor data (so a file rewritten in place
/// with the same layout but other weights differs too; reading all the data would take minutes for a large
/// model); the state shapes of the model as loaded (layer kinds, recurrent sizes, attention widths and KV cache
/// types, PLE, whether the MTP block is loaded); and any tags mixed in with [`ModelIdentity::with_tag`]. Computing it reads the
/// header and 256 KiB per part through the memory map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelIdentity {
    digest: u128,
    pub(crate) shape: StateShape,
}

impl ModelIdentity {
    /// The identity of `model` (its file as opened, and its state shapes as loaded).
    pub fn of(model: &Qwen4Exp) -> Self {
        let shape = StateShape::of(model);
        let mut h = Xxh3::new();
        h.update(b"nebula prefix-cache model identity\0");
        h.update(&STATE_LAYOUT_VERSION.to_le_bytes());
        h.update(env!("CARGO_PKG_VERSION").as_bytes());
        h.update(&[0]);
        hash_file(&mut h, model.file());
        shape.hash_into(&mut h);
        Self { digest: h.digest128(), shape }
    }

    /// This identity with `tag` mixed in: for what else decides a state's bits, e.g. the backend that computed
    /// it (`"cpu"`, `"cuda"`) when backends do not compute bit-identical states.
    pub fn with_tag(self, tag: &str) -> Self {
        let mut h = Xxh3::new();
        h.update(&self.digest.to_le_bytes());
        h.update(&(tag.len() as u64).to_le_bytes());
        h.update(tag.as_bytes());
        Self { digest: h.digest128(), shape: self.shape }
    }

    /// The 128-bit digest entries are stored under.
    pub fn digest(&self) -> u128 {
        self.digest
    }
}

/// Mixes each part's size, header bytes and sampled data blocks into `h`.
fn hash_file(h: &mut Xxh3, file: &GgufFile) {
    h.update(&(file.n_parts() as u64).to_le_bytes());
    for part in 0..file.n_parts() {
        let bytes = file.part_bytes(part).unwrap_or_default();
        let len = bytes.len() as u64;
        let data = file.data_offset(part).unwrap_or(len).min(len);
        h.update(&len.to_le_bytes());
        h.update(&data.to_le_bytes());
        h.update(&bytes[..data as usize]);
        let span = len - data;
        for i in 0..SAMPLES_PER_PART {
            let start = data + span / SAMPLES_PER_PART * i;
            let end = (start + SAMPLE_BYTES).min(len);
            h.update(&bytes[start as usize..end as usize]);
        }
    }
}
