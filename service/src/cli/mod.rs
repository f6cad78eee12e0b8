//! Subcommands beside `serve`: `synth` (random-weight real-width GGUF), `bench model` (prefill/decode speed),
//! `bench prefix` and `bench batch` (prefix cache, continuous batching), `bench vision` (image encode and TTFT), `generate` (greedy continuation), `imatrix` (importance matrices for quantization) and `hotlist` (the routing campaign that ranks experts for placement).

pub mod bench;
pub mod bench_batch;
pub mod bench_prefix;
pub mod bench_vision;
pub mod generate;
pub mod hotlist;
pub mod imatrix;
pub mod synth;

/// Random token ids for benchmark prompts: xorshift64 from a fixed seed, below `vocab` (the same ids every run).
pub(crate) struct RandomTokens {
    state: u64,
    vocab: u64,
}

impl RandomTokens {
    /// A stream seeded with `seed` (non-zero) over ids `0..vocab`.
    pub(crate) fn new(seed: u64, vocab: u64) -> Self {
        Self { state: seed.max(1), vocab: vocab.max(1) }
    }

    /// The next `n` ids.
    pub(crate) fn take(&mut self, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| {
                self.state ^= self.state << 13;
                self.state ^= self.state >> 7;
                self.state ^= self.state << 17;
                (self.state % self.vocab) as u32
            })
            .collect()
    }
}
