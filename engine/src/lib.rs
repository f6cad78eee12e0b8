//! Nebula's inference engine for Qwen3.8-Flash-Next (`qwen4exp`).
//!
//! Data flows one way: [`gguf`] reads the file, [`quant`] turns its blocks into numbers, [`model`] runs the
//! forward pass of the reference (`transformers` `modeling_qwen4_exp.py`) with its experts and n-gram table placed
//! in GPU/RAM/SSD tiers by [`placement`], [`sampling`] picks the next token, and
//! [`text`] turns text into token ids and back (tokenizer, chat template, output parsing). [`worker`] runs
//! generation on a worker thread fed by a queue, resuming prompts from the [`prefix_cache`] and decoding through
//! [`speculative`] (MTP drafts verified in batched passes when the model has an MTP block); the HTTP service never
//! touches tensors.

pub mod backend;
pub mod bench;
pub mod convert;
pub mod gguf;
pub mod model;
pub mod placement;
pub mod prefix_cache;
pub mod quant;
pub mod sampling;
pub mod speculative;
pub mod synth;
pub mod text;
pub mod tuning;
pub mod vision;
pub mod worker;
