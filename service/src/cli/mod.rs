//! Subcommands beside `serve`: `synth` (random-weight real-width GGUF) and `bench model` (prefill/decode speed).

pub mod bench;
pub mod generate;
pub mod synth;
