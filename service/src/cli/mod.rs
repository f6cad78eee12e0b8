//! Subcommands beside `serve`: `synth` (random-weight real-width GGUF), `bench model` (prefill/decode speed),
//! `generate` (greedy continuation), `imatrix` (importance matrices for quantization) and `hotlist` (the routing campaign that ranks experts for placement).

pub mod bench;
pub mod bench_batch;
pub mod bench_prefix;
pub mod generate;
pub mod hotlist;
pub mod imatrix;
pub mod synth;
