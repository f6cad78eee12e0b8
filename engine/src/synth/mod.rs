//! `nebula synth`: a random-weight `qwen4exp` GGUF at the real widths, for benchmarks.
//!
//! The file has every tensor and key a real `qwen4exp` GGUF has (as `nebula convert` writes them, so llama.cpp
//! loads it unchanged), a chosen number of layers in the 3:1 Gated DeltaNet : attention pattern, weight types from a
//! `nebula convert` recipe (every one, the low-bit mixes included) or BF16, an n-gram table of a chosen size, and
//! the real tokenizer and chat template copied from another GGUF (the embedded demo model). Quantized tensors are
//! written as random *valid* blocks whose values have the intended spread (`synth/blocks.rs`: uniform random level and
//! grid-index bits, fixed sub-block scales, a calibrated super-block scale), so no float weights are
//! materialized and nothing is quantized: the write runs at disk speed on many cores.
//!
//! The recipes take their with-importance-matrix choices (as the published low-bit files are made). With
//! [`SynthOptions::sparse_ngram`] the n-gram table is left as a hole in the file (all-zero blocks, which every
//! block type reads as zeros): a full-size table then costs no disk and no write time, and the model's n-gram
//! embeddings are zero (the gather, gate and convolution still run at full cost).
//!
//! Routers are built so routing is as skewed as the real model's: the original study found the top 32 / 64 /
//! 128 / 256 of 512 experts carrying about 37 / 53 / 73 / 93 % of the routing mass. Router row `e` is a random
//! direction scaled by `exp(beta * u_e)` (expert 0 most popular), with `beta` and the overall scale fitted by
//! simulating softmax top-k routing over random inputs of the expected norm; the report gives the fitted shares.
//! The routing the benchmark then measures depends on the real activations, so `nebula bench` reports the shares
//! it actually saw. Random weights cannot give the real model's *temporal reuse* (neighbouring tokens sharing
//! experts): [`routing`] has the realistic routing benchmarks put on the model instead (`--routing realistic`).

use std::path::{Path, PathBuf};

use rayon::prelude::*;

use crate::convert::{QuantRecipe, RecipeContext, RecipeName};
use crate::gguf::{GgmlType, GgufError, GgufFile, GgufWriter, MetadataValue};
use crate::quant::f32_to_bf16_bits;

mod blocks;
pub mod routing;
pub mod vision;

/// Weight types of the synthetic model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthRecipe {
    /// A `nebula convert --recipe` mix (types as [`QuantRecipe::tensor_type`] picks them, with an importance
    /// matrix): `nebula-q4` is the original product's component table, `q8_0` ggml-org's Q8_0 files, the others
    /// llama.cpp's and Unsloth's mixes.
    Named(RecipeName),
    /// BF16 for every matrix.
    Bf16,
}

impl SynthRecipe {
    /// The original product's component table.
    pub const NEBULA_Q4: SynthRecipe = SynthRecipe::Named(RecipeName::NebulaQ4);

    /// `general.file_type` of the output (llama.cpp's `LLAMA_FTYPE_MOSTLY_*`).
    pub fn file_type(self) -> u32 {
        match self {
            SynthRecipe::Named(r) => r.file_type(),
            SynthRecipe::Bf16 => 32,
        }
    }
}

impl std::str::FromStr for SynthRecipe {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("bf16") {
            return Ok(Self::Bf16);
        }
        s.parse::<RecipeName>().map(Self::Named).map_err(|e| format!("{e}, or bf16"))
    }
}

/// Shape and content of the synthetic model.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    /// Trunk layers (every 4th is attention, as the release).
    pub layers: usize,
    /// Rows of each n-gram hash head (16 heads); the release has about 20 M.
    pub ngram_rows_per_head: u64,
    /// Weight types.
    pub recipe: SynthRecipe,
    /// Random seed.
    pub seed: u64,
    /// Build routers with the real model's routing skew (otherwise uniform).
    pub routing_skew: bool,
    /// Experts per layer (512 in the release).
    pub experts: usize,
    /// Vocabulary rows (248,320).
    pub vocab: usize,
    /// Trained context written to the metadata.
    pub context_length: usize,
    /// Also write the MTP block (`blk.{layers}.nextn.*` + a dense attention block), as `nebula convert` does.
    pub mtp: bool,
    /// Leave the n-gram table's data as a hole in the file (zeros; see the module docs).
    pub sparse_ngram: bool,
}

impl Default for SynthOptions {
    fn default() -> Self {
        Self {
            layers: 12,
            ngram_rows_per_head: 1 << 20,
            recipe: SynthRecipe::NEBULA_Q4,
            seed: 42,
            routing_skew: true,
            experts: 512,
            vocab: 248_320,
            context_length: 262_144,
            mtp: true,
            sparse_ngram: false,
        }
    }
}

/// What was written.
#[derive(Debug, Clone)]
pub struct SynthReport {
    /// Files written.
    pub files: Vec<PathBuf>,
    /// Bytes of tensor data (the sparse n-gram table included).
    pub data_bytes: u64,
    /// Bytes of tensor data left as a hole (the sparse n-gram table), taking no disk.
    pub sparse_bytes: u64,
    /// Bytes of routed-expert data per expert of one layer (gate + up + down).
    pub expert_bytes: u64,
    /// Routing-mass shares of the top 32/64/128/256 experts in the router fit (simulation).
    pub fitted_shares: [f64; 4],
}

/// Real widths (the published checkpoint's `config.json`).
/// The hidden size of every synthetic model (the released model's): a synthetic vision tower's output width.
pub const D: usize = 2560;
const HC: usize = 4;
const RANK: usize = 320;
const HEADS: usize = 24;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 256;
const SSM_K: usize = 16;
const SSM_V: usize = 48;
const SSM_DIM: usize = 128;
const FF: usize = 640;
const TOP_K: usize = 10;
const IDX_HEADS: usize = 4;
const IDX_DIM: usize = 128;
const PLE_HEAD_DIM: usize = 160;

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug)]
enum Init {
    /// Uniform noise of standard deviation `std` around `mean`.
    Noise { mean: f32, std: f32 },
    /// Router rows: row `e` scaled by `popularity(e) * scale`.
    Router { beta: f32, gamma: f32, scale: f32 },
    /// `-(0.2..2)`, the stored `-exp(A_log)`.
    NegDecay,
}

struct Spec {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    init: Init,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A small fast generator (xorshift64*), seeded per chunk so parallel generation is deterministic.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(splitmix(seed) | 1)
    }
    #[inline]
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    #[inline]
    fn sym(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f64 {
        let u1 = ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let u2 = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

fn f16_bytes(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_le_bytes()
}

/// Writes `n_rows` rows of `cols` values of type `ty` into `out`: floats drawn from `init`, or (`blocks`) random
/// valid blocks of the planned spread.
fn fill_rows(
    ty: GgmlType,
    cols: usize,
    n_rows: usize,
    init: Init,
    blocks: Option<&blocks::BlockPlan>,
    rng: &mut Rng,
    out: &mut Vec<u8>,
) {
    let value = |rng: &mut Rng| -> f32 {
        match init {
            Init::Noise { mean, std } => mean + rng.sym() * std * 3f32.sqrt(),
            Init::NegDecay => -(0.2 + 0.9 * (rng.sym() + 1.0)),
            Init::Router { .. } => unreachable!("routers are generated by rows"),
        }
    };
    let n = n_rows * cols;
    match ty {
        GgmlType::F32 => (0..n).for_each(|_| out.extend_from_slice(&value(rng).to_le_bytes())),
        GgmlType::F16 => (0..n).for_each(|_| out.extend_from_slice(&f16_bytes(value(rng)))),
        GgmlType::BF16 => (0..n).for_each(|_| out.extend_from_slice(&f32_to_bf16_bits(value(rng)).to_le_bytes())),
        _ => blocks.expect("block types are planned").fill(n / ty.block_size(), rng, out),
    }
}

/// Routing-mass shares of the top 32/64/128/256 experts when logits are `scale * exp(beta * u_e) * z`
/// (z standard normal per token and expert), routed softmax top-k with renormalised weights.
fn simulate_shares(experts: usize, beta: f64, gamma: f64, scale: f64, tokens: usize, seed: u64) -> [f64; 4] {
    let mut rng = Rng::new(seed);
    let a: Vec<f64> = (0..experts).map(|e| popularity(experts, e, beta, gamma)).collect();
    let mut mass = vec![0f64; experts];
    let mut logits = vec![0f64; experts];
    let mut idx: Vec<usize> = (0..experts).collect();
    for _ in 0..tokens {
        for e in 0..experts {
            logits[e] = scale * a[e] * rng.normal();
        }
        idx.select_nth_unstable_by(TOP_K - 1, |&x, &y| logits[y].total_cmp(&logits[x]));
        let top = &idx[..TOP_K];
        let m = top.iter().map(|&e| logits[e]).fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = top.iter().map(|&e| (logits[e] - m).exp()).sum();
        for &e in top {
            mass[e] += (logits[e] - m).exp() / z;
        }
    }
    mass.sort_by(|x, y| y.total_cmp(x));
    let total: f64 = mass.iter().sum();
    let share = |k: usize| mass[..k.min(experts)].iter().sum::<f64>() / total;
    [share(32), share(64), share(128), share(256)]
}

/// Router row scale of expert `e`: `exp(beta * u^gamma)` with `u = 1` for expert 0 and `0` for the last.
fn popularity(experts: usize, e: usize, beta: f64, gamma: f64) -> f64 {
    let u = (experts - 1 - e) as f64 / (experts - 1).max(1) as f64;
    (beta * u.powf(gamma)).exp()
}

/// Fits (beta, gamma, scale) to the real model's routing-mass shares (37/53/73/93 %).
fn fit_router(experts: usize, seed: u64) -> (f64, f64, f64, [f64; 4]) {
    let target = [0.37, 0.53, 0.73, 0.93];
    let err = |s: &[f64; 4]| s.iter().zip(&target).map(|(a, b)| (a - b).powi(2)).sum::<f64>();
    let mut best = (0.0, 1.0, 1.0, f64::INFINITY);
    for gamma in [1.0, 2.0, 3.0, 4.0, 6.0] {
        for bi in 0..=16 {
            let beta = bi as f64 * 0.25;
            for si in 0..=12 {
                let scale = 0.25 * 1.3f64.powi(si);
                let e = err(&simulate_shares(experts, beta, gamma, scale, 300, seed));
                if e < best.3 {
                    best = (beta, gamma, scale, e);
                }
            }
        }
    }
    let (beta, gamma, scale) = (best.0, best.1, best.2);
    (beta, gamma, scale, simulate_shares(experts, beta, gamma, scale, 2000, seed ^ 1))
}

fn plan(opts: &SynthOptions, router: Init) -> Vec<Spec> {
    // `W`: a weight matrix whose type the recipe picks; `F`: kept F32 (norms, routers, convolutions, vectors).
    const W: Option<GgmlType> = None;
    const F: Option<GgmlType> = Some(GgmlType::F32);
    let noise = |cols: usize| Init::Noise { mean: 0.0, std: 1.0 / (cols as f32).sqrt() };
    let resid = |cols: usize| Init::Noise { mean: 0.0, std: 0.3 / (cols as f32).sqrt() };
    let ones = Init::Noise { mean: 1.0, std: 0.05 };
    let dd = HC * D;
    let mut v: Vec<(Spec, bool)> = Vec::new();
    let mut push = |name: String, dims: Vec<usize>, ty: Option<GgmlType>, init: Init| {
        let dims = dims.into_iter().map(|x| x as u64).collect();
        v.push((Spec { name, dims, ty: ty.unwrap_or(GgmlType::F32), init }, ty.is_none()))
    };
    push("token_embd.weight".into(), vec![D, opts.vocab], W, Init::Noise { mean: 0.0, std: 0.5 });
    push("output.weight".into(), vec![D, opts.vocab], W, noise(D));
    push("output_hc_norm.weight".into(), vec![dd], F, ones);
    push("output_hc_down.weight".into(), vec![dd, RANK], W, noise(dd));
    push("output_hc_up.weight".into(), vec![RANK, dd], W, noise(RANK));
    let (kd, vd) = (SSM_K * SSM_DIM, SSM_V * SSM_DIM);
    let conv_dim = 2 * kd + vd;
    let e = opts.experts;
    // The trunk's layers, then the MTP block as one more attention-type layer with its `nextn.*` tensors (the
    // format's trailing block `blk.{layers}`).
    for i in 0..opts.layers + usize::from(opts.mtp) {
        let b = format!("blk.{i}");
        let is_mtp = i == opts.layers;
        if is_mtp {
            push(format!("{b}.nextn.eh_proj.weight"), vec![2 * D, D], W, noise(2 * D));
            push(format!("{b}.nextn.enorm.weight"), vec![D], F, ones);
            push(format!("{b}.nextn.hnorm.weight"), vec![dd], F, ones);
            push(format!("{b}.nextn.hc_head_norm.weight"), vec![dd], F, ones);
            push(format!("{b}.nextn.hc_head_down.weight"), vec![dd, RANK], W, noise(dd));
            push(format!("{b}.nextn.hc_head_up.weight"), vec![RANK, dd], W, noise(RANK));
        }
        for gg in ["hc_attn", "hc_ffn"] {
            push(format!("{b}.{gg}_norm.weight"), vec![dd], F, ones);
            push(format!("{b}.{gg}_down.weight"), vec![dd, RANK], W, noise(dd));
            push(format!("{b}.{gg}_up.weight"), vec![RANK, dd], W, noise(RANK));
            push(format!("{b}.{gg}_inject.weight"), vec![dd, HC], W, noise(dd));
        }
        if !is_mtp && (i + 1) % 4 != 0 {
            push(format!("{b}.attn_qkv.weight"), vec![D, conv_dim], W, noise(D));
            push(format!("{b}.attn_gate.weight"), vec![D, vd], W, noise(D));
            push(format!("{b}.ssm_beta.weight"), vec![D, SSM_V], W, noise(D));
            push(format!("{b}.ssm_alpha.weight"), vec![D, SSM_V], W, noise(D));
            push(format!("{b}.ssm_conv1d.weight"), vec![4, conv_dim], F, Init::Noise { mean: 0.0, std: 0.3 });
            push(format!("{b}.ssm_dt.bias"), vec![SSM_V], F, Init::Noise { mean: 0.0, std: 0.5 });
            push(format!("{b}.ssm_a"), vec![SSM_V], F, Init::NegDecay);
            push(format!("{b}.ssm_norm.weight"), vec![SSM_DIM], F, ones);
            push(format!("{b}.ssm_out.weight"), vec![vd, D], W, resid(vd));
        } else {
            push(format!("{b}.attn_q.weight"), vec![D, HEADS * HEAD_DIM * 2], W, noise(D));
            push(format!("{b}.attn_k.weight"), vec![D, KV_HEADS * HEAD_DIM], W, noise(D));
            push(format!("{b}.attn_v.weight"), vec![D, KV_HEADS * HEAD_DIM], W, noise(D));
            push(format!("{b}.attn_output.weight"), vec![HEADS * HEAD_DIM, D], W, resid(HEADS * HEAD_DIM));
            push(format!("{b}.attn_q_norm.weight"), vec![HEAD_DIM], F, ones);
            push(format!("{b}.attn_k_norm.weight"), vec![HEAD_DIM], F, ones);
            push(format!("{b}.indexer.q_proj.weight"), vec![D, IDX_HEADS * IDX_DIM], W, noise(D));
            push(format!("{b}.indexer.k_proj.weight"), vec![D, IDX_DIM], W, noise(D));
            push(format!("{b}.indexer.q_norm.weight"), vec![IDX_DIM], F, ones);
            push(format!("{b}.indexer.k_norm.weight"), vec![IDX_DIM], F, ones);
        }
        push(format!("{b}.ffn_gate_inp.weight"), vec![D, e], F, router);
        push(format!("{b}.ffn_gate_exps.weight"), vec![D, FF, e], W, noise(D));
        push(format!("{b}.ffn_up_exps.weight"), vec![D, FF, e], W, noise(D));
        push(format!("{b}.ffn_down_exps.weight"), vec![FF, D, e], W, resid(FF));
        push(format!("{b}.ffn_gate_shexp.weight"), vec![D, FF], W, noise(D));
        push(format!("{b}.ffn_up_shexp.weight"), vec![D, FF], W, noise(D));
        push(format!("{b}.ffn_down_shexp.weight"), vec![FF, D], W, resid(FF));
        push(format!("{b}.ffn_gate_inp_shexp.weight"), vec![D], F, noise(D));
        if i == 1 {
            push(format!("{b}.ple_key.weight"), vec![D, dd], W, noise(D));
            push(format!("{b}.ple_value.weight"), vec![D, D], W, noise(D));
            for n in ["ple_norm_key", "ple_norm_query", "ple_norm_conv"] {
                push(format!("{b}.{n}.weight"), vec![dd], F, ones);
            }
            push(format!("{b}.ple_conv1d.weight"), vec![4, dd], F, Init::Noise { mean: 0.0, std: 0.3 });
        }
    }
    let table_rows = head_sizes(opts.ngram_rows_per_head, 16).iter().sum::<u64>().div_ceil(128) * 128;
    push(
        "per_layer_token_embd.weight".into(),
        vec![PLE_HEAD_DIM, table_rows as usize],
        W,
        Init::Noise { mean: 0.0, std: 0.5 },
    );
    let ctx = RecipeContext { n_layers: opts.layers, mtp: opts.mtp, has_imatrix: true };
    v.into_iter()
        .map(|(mut s, weight)| {
            if weight {
                s.ty = match opts.recipe {
                    SynthRecipe::Bf16 => GgmlType::BF16,
                    SynthRecipe::Named(r) => QuantRecipe::Named(r).tensor_type(&s.name, &s.dims, &ctx),
                };
            }
            s
        })
        .collect()
}

/// Distinct primes >= base, one per head (the reference's `_find_nth_prime_after`).
fn head_sizes(base: u64, n: usize) -> Vec<u64> {
    let is_prime = |v: u64| v >= 2 && (2..).take_while(|d| d * d <= v).all(|d| v % d != 0);
    let mut out = Vec::with_capacity(n);
    let mut p = base.saturating_sub(1);
    while out.len() < n {
        p += 1;
        while !is_prime(p) {
            p += 1;
        }
        out.push(p);
    }
    out
}

/// Writes the synthetic model to `out`; tokenizer and chat template keys are copied from `tokenizer_from`.
pub fn synth(out: &Path, opts: &SynthOptions, tokenizer_from: &GgufFile) -> Result<SynthReport, GgufError> {
    let (router, fitted) = if opts.routing_skew {
        let (beta, gamma, scale, shares) = fit_router(opts.experts, opts.seed);
        // A router row of norm s maps an input of norm |m| to logits of std s |m| / sqrt(D) * sqrt(D)... the fit
        // is in units of the logits' standard deviation; the MoE input has roughly unit-scale elements, so
        // |m| ~ sqrt(D) and a row of norm `scale` gives logits of std ~ `scale`.
        (Init::Router { beta: beta as f32, gamma: gamma as f32, scale: (scale / (D as f64).sqrt()) as f32 }, shares)
    } else {
        (
            Init::Noise { mean: 0.0, std: 1.0 / (D as f32).sqrt() },
            [32.0 / 512.0, 64.0 / 512.0, 128.0 / 512.0, 256.0 / 512.0],
        )
    };
    let specs = plan(opts, router);
    let mut w = GgufWriter::create(out, 32)?;
    let a = "qwen4exp";
    let u = |x: usize| x as u32;
    w.add_kv("general.architecture", a)?;
    w.add_kv("general.name", format!("nebula-synth-{}l", opts.layers).as_str())?;
    w.add_kv("general.file_type", opts.recipe.file_type())?;
    w.add_kv(format!("{a}.block_count"), u(opts.layers + usize::from(opts.mtp)))?;
    if opts.mtp {
        w.add_kv(format!("{a}.nextn_predict_layers"), 1u32)?;
    }
    w.add_kv(format!("{a}.context_length"), u(opts.context_length))?;
    w.add_kv(format!("{a}.embedding_length"), u(D))?;
    w.add_kv(format!("{a}.attention.head_count"), u(HEADS))?;
    w.add_kv(format!("{a}.attention.head_count_kv"), u(KV_HEADS))?;
    w.add_kv(format!("{a}.attention.key_length"), u(HEAD_DIM))?;
    w.add_kv(format!("{a}.attention.value_length"), u(HEAD_DIM))?;
    w.add_kv(format!("{a}.attention.layer_norm_rms_epsilon"), 1e-6f32)?;
    w.add_kv(format!("{a}.rope.freq_base"), 1e7f32)?;
    w.add_kv(format!("{a}.rope.dimension_count"), 64u32)?;
    w.add_kv(format!("{a}.rope.dimension_sections"), vec![11i32, 11, 10, 0])?;
    w.add_kv(format!("{a}.expert_count"), u(opts.experts))?;
    w.add_kv(format!("{a}.expert_used_count"), u(TOP_K))?;
    w.add_kv(format!("{a}.expert_feed_forward_length"), u(FF))?;
    w.add_kv(format!("{a}.expert_shared_feed_forward_length"), u(FF))?;
    w.add_kv(format!("{a}.ssm.conv_kernel"), 4u32)?;
    w.add_kv(format!("{a}.ssm.state_size"), u(SSM_DIM))?;
    w.add_kv(format!("{a}.ssm.group_count"), u(SSM_K))?;
    w.add_kv(format!("{a}.ssm.time_step_rank"), u(SSM_V))?;
    w.add_kv(format!("{a}.ssm.inner_size"), u(SSM_V * SSM_DIM))?;
    w.add_kv(format!("{a}.full_attention_interval"), 4u32)?;
    w.add_kv(format!("{a}.hyper_connection.count"), u(HC))?;
    w.add_kv(format!("{a}.hyper_connection.low_rank"), u(RANK))?;
    w.add_kv(format!("{a}.attention.indexer.head_count"), u(IDX_HEADS))?;
    w.add_kv(format!("{a}.attention.indexer.key_length"), u(IDX_DIM))?;
    w.add_kv(format!("{a}.attention.indexer.top_k"), 2048u32)?;
    let mut ratios: Vec<i32> = (0..opts.layers).map(|i| if (i + 1) % 4 == 0 { 4 } else { 0 }).collect();
    if opts.mtp {
        ratios.push(0);
    }
    w.add_kv(format!("{a}.attention.compress_ratios"), ratios)?;
    w.add_kv(format!("{a}.ple.layers"), vec![1i32])?;
    w.add_kv(format!("{a}.ple.ngram_size"), 3u32)?;
    w.add_kv(format!("{a}.ple.heads_per_ngram"), 8u32)?;
    w.add_kv(format!("{a}.ple.conv_kernel"), 4u32)?;
    w.add_kv(format!("{a}.ple.eos_token_id"), 248_044u32)?;
    w.add_kv(format!("{a}.ple.image_token_id"), 248_056u32)?;
    w.add_kv(format!("{a}.embedding_length_per_layer_input"), u(PLE_HEAD_DIM))?;
    // Hash multipliers as the reference derives them (seed 1234, layer index 0).
    let mmax = ((1u64 << 63) - 1) / opts.vocab as u64;
    let half = (mmax / 2).max(1);
    let mults: Vec<u64> = (0..3u64)
        .map(|i| 2 * (splitmix(1234u64.wrapping_add(0x9E37_79B9_7F4A_7C15u64.wrapping_mul(i + 1))) % half) + 1)
        .collect();
    let sizes = head_sizes(opts.ngram_rows_per_head, 16);
    let offsets: Vec<u64> = sizes
        .iter()
        .scan(0u64, |acc, &s| {
            let o = *acc;
            *acc += s;
            Some(o)
        })
        .collect();
    w.add_kv(format!("{a}.ple.layer_multipliers"), mults)?;
    w.add_kv(format!("{a}.ple.head_offsets"), offsets)?;
    w.add_kv(format!("{a}.ple.head_vocab_sizes"), sizes)?;
    for (k, v) in tokenizer_from.metadata().entries() {
        if k.starts_with("tokenizer.") {
            w.add_kv(k.clone(), v.clone())?;
        }
    }
    for s in &specs {
        w.add_tensor(s.name.clone(), &s.dims, s.ty)?;
    }
    let mut data = w.begin_data()?;
    let (mut bytes, mut sparse_bytes) = (0u64, 0u64);
    for (ti, s) in specs.iter().enumerate() {
        let cols = s.dims[0] as usize;
        let rows: usize = s.dims[1..].iter().product::<u64>().max(1) as usize;
        data.begin_tensor(&s.name)?;
        if opts.sparse_ngram && s.name == NGRAM_TABLE {
            let n = s.ty.row_bytes(cols as u64).unwrap_or(0) * rows as u64;
            data.write_hole(n)?;
            bytes += n;
            sparse_bytes += n;
            data.end_tensor()?;
            continue;
        }
        let std = match s.init {
            Init::Noise { std, .. } => std,
            _ => 1.0,
        };
        let block_plan = blocks::BlockPlan::new(s.ty, std);
        let rows_per_chunk = ((32 << 20) / (cols * 4).max(1)).clamp(1, rows);
        let chunks: Vec<usize> = (0..rows).step_by(rows_per_chunk).collect();
        // Generate a batch of chunks in parallel, write them in order.
        for batch in chunks.chunks(rayon::current_num_threads().max(1) * 2) {
            let parts: Vec<Vec<u8>> = batch
                .par_iter()
                .map(|&r0| {
                    let n = rows_per_chunk.min(rows - r0);
                    let mut rng = Rng::new(opts.seed ^ ((ti as u64) << 40) ^ r0 as u64);
                    let mut out = Vec::new();
                    match s.init {
                        Init::Router { beta, gamma, scale } => {
                            for r in r0..r0 + n {
                                let e = r % opts.experts;
                                let a = popularity(opts.experts, e, beta as f64, gamma as f64) as f32;
                                let mut row: Vec<f32> = (0..cols).map(|_| rng.normal() as f32).collect();
                                let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt();
                                let f = scale * a * (cols as f32).sqrt() / norm;
                                for x in &mut row {
                                    out.extend_from_slice(&(*x * f).to_le_bytes());
                                }
                            }
                        }
                        init => fill_rows(s.ty, cols, n, init, block_plan.as_ref(), &mut rng, &mut out),
                    }
                    out
                })
                .collect();
            for p in parts {
                bytes += p.len() as u64;
                data.write_chunk(&p)?;
            }
        }
        data.end_tensor()?;
    }
    let files = data.finish()?;
    let expert_bytes = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
        .iter()
        .filter_map(|k| specs.iter().find(|s| s.name == format!("blk.0.{k}.weight")))
        .map(|s| s.ty.row_bytes(s.dims[0]).unwrap_or(0) * s.dims[1])
        .sum();
    Ok(SynthReport { files, data_bytes: bytes, sparse_bytes, expert_bytes, fitted_shares: fitted })
}

/// Free bytes for an unprivileged writer on the file system holding `dir` (`statvfs`), `None` when it cannot be
/// read.
pub fn free_disk_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `statvfs` is plain old data; all-zero is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a valid NUL-terminated string and `st` a properly sized out-parameter.
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail as u64 * st.f_frsize as u64)
}

/// The n-gram table's tensor name.
const NGRAM_TABLE: &str = "per_layer_token_embd.weight";

/// Every tensor `synth` writes for `opts`: name, ggml dims and type, in file order.
pub fn planned_tensors(opts: &SynthOptions) -> Vec<(String, Vec<u64>, GgmlType)> {
    plan(opts, Init::NegDecay).into_iter().map(|s| (s.name, s.dims, s.ty)).collect()
}

/// Bytes of tensor data `synth` writes for `opts` (before any is written: the disk-space check), and the part
/// of them a sparse n-gram table leaves as a hole.
pub fn planned_bytes(opts: &SynthOptions) -> (u64, u64) {
    let specs = plan(opts, Init::NegDecay);
    let size = |s: &Spec| s.ty.row_bytes(s.dims[0]).unwrap_or(0) * s.dims[1..].iter().product::<u64>().max(1);
    let total = specs.iter().map(size).sum();
    let hole = if opts.sparse_ngram { specs.iter().filter(|s| s.name == NGRAM_TABLE).map(size).sum() } else { 0 };
    (total, hole)
}

/// Copies the `qwen4exp` GGUF `input` to `output` (every key and tensor byte for byte) and appends a random-weight
/// MTP block at the model's own widths (F32, `blk.{n_layer}.nextn.*` plus a dense attention block, as `nebula
/// convert` writes it): a model without MTP can then exercise the speculative machinery. Random weights draft
/// badly; only the machinery and its exactness are meaningful.
///
/// Errors: the input is not a readable `qwen4exp` file, already has an MTP block, or the output cannot be
/// written.
pub fn append_random_mtp(input: &Path, output: &Path, seed: u64) -> Result<PathBuf, crate::model::ModelError> {
    use crate::model::{ModelConfig, ModelError};
    let file = GgufFile::open(input)?;
    let cfg = ModelConfig::from_gguf(&file)?;
    let bad = |problem: &str| ModelError::Metadata {
        file: input.display().to_string(),
        key: "qwen4exp.nextn_predict_layers".into(),
        problem: problem.into(),
    };
    if cfg.n_nextn > 0 {
        return Err(bad("the model already has an MTP block"));
    }
    let a = "qwen4exp";
    let (d, s, r) = (cfg.hidden, cfg.hc_count, cfg.hc_lowrank);
    let dd = s * d;
    let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
    let (e, ff, sff) = (cfg.n_expert, cfg.expert_ff, cfg.shared_ff);
    let b = format!("blk.{}", cfg.n_layer);
    let noise = |cols: usize| Init::Noise { mean: 0.0, std: 1.0 / (cols as f32).sqrt() };
    let resid = |cols: usize| Init::Noise { mean: 0.0, std: 0.3 / (cols as f32).sqrt() };
    let ones = Init::Noise { mean: 1.0, std: 0.1 };
    let mut specs: Vec<Spec> = Vec::new();
    let mut push = |name: String, dims: Vec<usize>, init: Init| {
        specs.push(Spec { name, dims: dims.into_iter().map(|x| x as u64).collect(), ty: GgmlType::F32, init })
    };
    push(format!("{b}.nextn.eh_proj.weight"), vec![2 * d, d], noise(2 * d));
    push(format!("{b}.nextn.enorm.weight"), vec![d], ones);
    push(format!("{b}.nextn.hnorm.weight"), vec![dd], ones);
    push(format!("{b}.nextn.hc_head_norm.weight"), vec![dd], ones);
    push(format!("{b}.nextn.hc_head_down.weight"), vec![dd, r], noise(dd));
    push(format!("{b}.nextn.hc_head_up.weight"), vec![r, dd], noise(r));
    for gg in ["hc_attn", "hc_ffn"] {
        push(format!("{b}.{gg}_norm.weight"), vec![dd], ones);
        push(format!("{b}.{gg}_down.weight"), vec![dd, r], noise(dd));
        push(format!("{b}.{gg}_up.weight"), vec![r, dd], noise(r));
        push(format!("{b}.{gg}_inject.weight"), vec![dd, s], noise(dd));
    }
    push(format!("{b}.attn_q.weight"), vec![d, nh * hd * 2], noise(d));
    push(format!("{b}.attn_k.weight"), vec![d, nkv * hd], noise(d));
    push(format!("{b}.attn_v.weight"), vec![d, nkv * hd], noise(d));
    push(format!("{b}.attn_output.weight"), vec![nh * hd, d], resid(nh * hd));
    push(format!("{b}.attn_q_norm.weight"), vec![hd], ones);
    push(format!("{b}.attn_k_norm.weight"), vec![hd], ones);
    push(format!("{b}.ffn_gate_inp.weight"), vec![d, e], noise(d));
    push(format!("{b}.ffn_gate_exps.weight"), vec![d, ff, e], noise(d));
    push(format!("{b}.ffn_up_exps.weight"), vec![d, ff, e], noise(d));
    push(format!("{b}.ffn_down_exps.weight"), vec![ff, d, e], resid(ff));
    push(format!("{b}.ffn_gate_shexp.weight"), vec![d, sff], noise(d));
    push(format!("{b}.ffn_up_shexp.weight"), vec![d, sff], noise(d));
    push(format!("{b}.ffn_down_shexp.weight"), vec![sff, d], resid(sff));
    push(format!("{b}.ffn_gate_inp_shexp.weight"), vec![d], noise(d));

    let mut w = GgufWriter::create(output, file.alignment() as u32)?;
    for (k, v) in file.metadata().entries() {
        let value = match k.as_str() {
            "general.alignment" => continue,
            k if k.starts_with("split.") => continue,
            k if k == format!("{a}.block_count") => MetadataValue::U32(cfg.n_layer as u32 + 1),
            k if k == format!("{a}.attention.compress_ratios") => {
                let mut r: Vec<i32> = (0..cfg.n_layer)
                    .map(|i| match cfg.layer_kinds[i] {
                        crate::model::LayerKind::IndexedAttention { compress_ratio } => compress_ratio as i32,
                        crate::model::LayerKind::LinearAttention => 0,
                    })
                    .collect();
                r.push(0);
                r.into()
            }
            k if k == format!("{a}.attention.recurrent_layers") => {
                let mut r: Vec<MetadataValue> = cfg
                    .layer_kinds
                    .iter()
                    .map(|k| MetadataValue::Bool(*k == crate::model::LayerKind::LinearAttention))
                    .collect();
                r.push(MetadataValue::Bool(false));
                MetadataValue::Array(crate::gguf::MetadataArray::new(crate::gguf::ValueType::Bool, r))
            }
            _ => v.clone(),
        };
        w.add_kv(k.clone(), value)?;
    }
    w.add_kv(format!("{a}.nextn_predict_layers"), 1u32)?;
    for t in file.tensors() {
        w.add_tensor(t.name.clone(), &t.dims, t.ggml_type)?;
    }
    for sp in &specs {
        w.add_tensor(sp.name.clone(), &sp.dims, sp.ty)?;
    }
    let mut data = w.begin_data()?;
    for t in file.tensors() {
        data.write_tensor(&t.name, file.tensor_data(t))?;
    }
    for (i, sp) in specs.iter().enumerate() {
        let cols = sp.dims[0] as usize;
        let rows: usize = sp.dims[1..].iter().product::<u64>().max(1) as usize;
        let mut rng = Rng::new(seed ^ ((i as u64 + 1) << 32));
        let mut out = Vec::with_capacity(rows * cols * 4);
        fill_rows(sp.ty, cols, rows, sp.init, None, &mut rng, &mut out);
        data.write_tensor(&sp.name, &out)?;
    }
    Ok(data.finish()?.into_iter().next().unwrap_or_else(|| output.to_path_buf()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_routing_shares_are_proportional_and_skew_concentrates_them() {
        // With equal rows the sorted shares only reflect sampling noise; scaled rows concentrate the mass.
        let flat = simulate_shares(512, 0.0, 1.0, 1.0, 2000, 1);
        assert!(flat[3] < 0.6 && flat[0] < 0.1, "{flat:?}");
        let skewed = simulate_shares(512, 3.0, 1.0, 1.5, 2000, 1);
        assert!(skewed[0] > flat[0] * 2.0, "{skewed:?} vs {flat:?}");
        assert!(skewed.windows(2).all(|w| w[0] < w[1]), "{skewed:?}");
    }

    /// A small low-bit synth with a sparse n-gram table: every planned tensor in its recipe type, the table a hole
    /// (zeros, no disk), the other blocks random and readable.
    #[test]
    fn a_small_low_bit_synth_writes_valid_blocks_and_a_sparse_table() {
        use std::os::unix::fs::MetadataExt;
        let demo = crate::gguf::GgufFile::open(
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/nebula-demo.gguf"),
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("s.gguf");
        let opts = SynthOptions {
            layers: 1,
            experts: 10,
            vocab: 512,
            ngram_rows_per_head: 1 << 16,
            recipe: SynthRecipe::Named(RecipeName::Iq2Xs),
            routing_skew: false,
            sparse_ngram: true,
            ..Default::default()
        };
        let report = synth(&out, &opts, &demo).unwrap();
        let (total, hole) = planned_bytes(&opts);
        assert_eq!((report.data_bytes, report.sparse_bytes), (total, hole));
        // 16 heads of ~65.5k rows of 160 IQ4_NL values (the 160-wide fallback of Q2_K is Q4_0: 90 bytes a row).
        assert!(hole > 16 * 65_536 * 90, "{hole}");
        // IQ2_XS gate/up (2 x 640 x 740 bytes) and IQ4_NL down (2560 x 360).
        assert_eq!(report.expert_bytes, 2 * 640 * 740 + 2560 * 360);
        let meta = std::fs::metadata(&out).unwrap();
        assert!(meta.blocks() * 512 < meta.len() - hole / 2, "the table is not allocated: {meta:?}");
        let f = crate::gguf::GgufFile::open(&out).unwrap();
        let planned = planned_tensors(&opts);
        assert_eq!(f.tensors().count(), planned.len());
        for (name, dims, ty) in &planned {
            let t = f.tensors().find(|t| &t.name == name).unwrap();
            assert_eq!((&t.dims, t.ggml_type), (dims, *ty), "{name}");
        }
        let get = |n: &str| f.tensors().find(|t| t.name == n).unwrap();
        assert_eq!(get("blk.0.ffn_gate_exps.weight").ggml_type, GgmlType::IQ2_XS);
        let table = get(NGRAM_TABLE);
        assert!(f.tensor_data(table).iter().all(|&b| b == 0));
        let gate = get("blk.0.ffn_gate_exps.weight");
        let mut v = vec![0f32; 2560];
        crate::quant::dequantize_row(GgmlType::IQ2_XS, &f.tensor_data(gate)[..740], &mut v).unwrap();
        let std = (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
        assert!((std * (2560f32).sqrt() - 1.0).abs() < 0.15, "row std {std}");
        assert_eq!(f.metadata().get_u32("general.file_type").unwrap(), 20);
    }

    #[test]
    fn head_sizes_are_distinct_primes_from_the_base() {
        let s = head_sizes(20_000_000, 3);
        assert_eq!(s, vec![20_000_003, 20_000_023, 20_000_033], "the release's first head sizes (format doc §1)");
    }
}

#[cfg(test)]
mod fit_probe {
    #[test]
    #[ignore = "prints the router fit: cargo test --release -p nebula-engine --lib fit_probe -- --ignored --nocapture"]
    fn print_fit() {
        let (b, g, s, sh) = super::fit_router(512, 42);
        println!("beta {b} gamma {g} scale {s} shares {sh:?}");
    }
}
