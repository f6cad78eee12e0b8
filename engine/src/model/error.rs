//! Errors of model loading and of the forward pass.

use crate::gguf::GgufError;
use crate::quant::QuantError;

/// What went wrong loading a model or running it. Every variant names the file, key, tensor or value at fault.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The GGUF file itself could not be read.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A metadata key is missing, has the wrong type, or an impossible value.
    #[error("{file}: metadata key '{key}': {problem}")]
    Metadata { file: String, key: String, problem: String },
    /// The file is not a `qwen4exp` model.
    #[error("{file}: general.architecture is '{found}', expected 'qwen4exp'")]
    Architecture { file: String, found: String },
    /// A tensor the model needs is absent.
    #[error("{file}: missing tensor '{name}' (expected shape {expected:?}, type {types})")]
    MissingTensor { file: String, name: String, expected: Vec<u64>, types: String },
    /// A tensor has the wrong shape.
    #[error("{file}: tensor '{name}' has shape {actual:?}, expected {expected:?}")]
    TensorShape { file: String, name: String, expected: Vec<u64>, actual: Vec<u64> },
    /// A tensor has a type the model cannot use for it.
    #[error("{file}: tensor '{name}' has type {actual}, expected {types}")]
    TensorType { file: String, name: String, actual: String, types: String },
    /// A tensor's values are unusable (e.g. NaN or infinity in a norm weight).
    #[error("{file}: tensor '{name}': {problem}")]
    TensorValue { file: String, name: String, problem: String },
    /// A weight's bytes do not fit its type and shape.
    #[error("tensor '{name}': {source}")]
    Quant { name: String, source: QuantError },
    /// A token id outside the vocabulary was given to the model.
    #[error("token id {token} is outside the vocabulary of {vocab} entries")]
    TokenOutOfRange { token: u32, vocab: usize },
    /// The sequence would grow past the context the state was created for.
    #[error("the sequence would hold {needed} tokens, over the context limit of {limit}")]
    ContextOverflow { needed: usize, limit: usize },
    /// Weights could not be read from the model file during a forward pass (an SSD-tier expert or n-gram rows):
    /// this call fails, the sequence's state is left part-way (discard it), and the model stays usable.
    #[error("{what}: {detail}")]
    WeightRead { what: String, detail: String },
    /// The expert placement could not be built.
    #[error(transparent)]
    Placement(#[from] crate::placement::PlacementError),
    /// A state snapshot does not belong to this sequence.
    #[error("snapshot at position {snapshot} cannot be restored into a sequence at position {current}")]
    BadSnapshot { snapshot: usize, current: usize },
    /// The KV cache type cannot hold this model's attention caches.
    #[error("kv_cache_type {ty}: {problem}")]
    KvCacheType { ty: String, problem: String },
    /// The injected embeddings or rope positions of a forward call do not fit its tokens (or the backend takes
    /// none).
    #[error("image input: {problem}")]
    MediaRows { problem: String },
    /// MTP drafting was asked for but cannot run (no MTP block, empty sequence, cache out of step).
    #[error("MTP drafting is unavailable: {reason}")]
    MtpUnavailable { reason: String },
    /// A routing override ([`crate::synth::routing::RoutingOverride`]) was made for another shape of model.
    #[error("routing override for {given}, but the model has {model}")]
    RoutingShape { given: String, model: String },
}
