//! Quantization recipes for `nebula convert --recipe`: which GGUF type each weight gets.
//!
//! A recipe names a type for every weight matrix the converter writes (norms, routers, convolutions and other
//! vectors always stay F32, as llama.cpp's converter writes them). A type whose block does not divide a row's
//! width falls back the way llama.cpp's `tensor_type_fallback` does (`llama-quant.cpp`): Q4_K to Q5_0, Q5_K to
//! Q5_1, Q6_K to Q8_0, the other 256-blocks of the i-quants to IQ4_NL, Q2_K/Q3_K to Q4_0; when the 32-block
//! type does not fit either, F16. That is how the 160-wide n-gram table rows, the 320-wide hyper-connection
//! projections and the 640-wide expert down projections of qwen4exp get 32-block types
//! (as llama.cpp's `llama-quantize` falls back for rows that are not whole 256-value blocks).
//!
//! | recipe | what it reproduces, and the basis |
//! |---|---|
//! | `nebula-q4` | the product's original component tables ("Components held on the GPU/CPU"): Q4_K token embedding, head, expert gate/up, dense projections; IQ4_NL expert and shared-expert down; F32 routers, norms and GDN alpha/beta; BF16 indexer; IQ4_NL/Q4_K target hyper-connections; Q6_K MTP `attn_v` and MTP mixer down, Q5_0 MTP 320-wide HC; IQ4_NL n-gram table |
//! | `q8_0` | ggml-org's Q8_0 GGUFs (`convert_hf_to_gguf.py --outtype q8_0`): every weight Q8_0 except the never-quantized indexer (BF16) |
//! | `ud-q4_k_xl` | Unsloth's UD-Q4_K_XL: expert gate/up Q4_K, expert down Q5_K (stored Q5_1 at 640 wide), n-gram table IQ4_NL and attention Q8_0, as measured from the published file by third parties; the other dense weights Q8_0, an assumption that matches the published size to within 1.5 GiB of 103.7 GiB |
//! | `iq4_xs` | llama.cpp's `llama-quantize ... IQ4_XS` type selection (`llama_tensor_get_type` in `llama-quant.cpp`): IQ4_XS by default, Q6_K head, Q5_K `attn_v`/`attn_qkv` (grouped-query factor 12 >= 4), Q5_K `ffn_down` in the first eighth of the layers without an importance matrix |
//! | `q2_k` | `llama-quantize ... Q2_K`: Q2_K by default (token and n-gram embeddings too), Q6_K head, Q4_K `attn_v`/`attn_qkv` (grouped-query factor >= 4), Q3_K `attn_output` and every `ffn_down` (expert, shared and the hyper-connection `hc_ffn_down`); the same with an importance matrix |
//! | `q3_k_s` | `llama-quantize ... Q3_K_S`: Q3_K everywhere but the Q6_K head (with or without an importance matrix) |
//! | `q3_k_m` | `llama-quantize ... Q3_K_M`: Q3_K by default, Q6_K head, Q4_K `attn_output`; `attn_v`/`attn_qkv` Q5_K for the first two of them in file order (`blk.0`/`blk.1.attn_qkv`), Q4_K after; `ffn_down` Q5_K in blocks below `blocks / 16`, Q4_K above |
//! | `iq3_xxs` | `llama-quantize ... IQ3_XXS` (needs an importance matrix, as llama.cpp does: `--imatrix`): IQ3_XXS by default, Q5_K head, IQ3_S token and n-gram embeddings and `attn_output`, Q4_K `attn_v`/`attn_qkv`, IQ2_S `attn_q`/`attn_k`; the no-matrix branch (Q4_K `ffn_down` below `blocks / 8`, Q3_K above) only for `nebula synth` |
//! | `iq2_xs` | `llama-quantize ... IQ2_XS` (needs an importance matrix): IQ2_XS by default, Q5_K head, Q2_K token and n-gram embeddings, Q4_K `attn_v`/`attn_qkv` (experts >= 4), Q2_K for the first `blocks / 8` `ffn_down` tensors in file order (three per block: expert, shared, `hc_ffn_down`) |
//! | `iq1_m` | `llama-quantize ... IQ1_M` (needs an importance matrix): as `iq2_xs` with IQ1_M by default and IQ2_XXS `attn_output` |
//! | `ud-q2_k_xl` | Unsloth's UD-Q2_K_XL: routed experts IQ2_XS gate/up and IQ3_XXS down (IQ4_NL at 640 wide), n-gram table IQ4_NL, as a third-party loader of the published file reports its storage ("routed experts retain their mixed IQ2_XS/IQ3_XXS/IQ4_NL storage", FastLLM's Qwen4-Exp deployment guide); which layers hold IQ3_XXS gate/up is not published, so every layer takes IQ2_XS; the dense weights take the `q2_k` row's types, an assumption (no per-tensor listing of the dense weights was found) |
//!
//! "File order" is llama.cpp's: tensors sorted by block number, then by name; `blocks` counts the MTP block when
//! the file has one (llama.cpp's `n_layer_all`). Types below 4 bits at 256-value blocks fall back at the
//! 640-wide expert down projections and the 160/320-wide rows as the table above says.
//!
//! `--recipe-from FILE.gguf` copies the type of every same-named tensor of a published GGUF instead (a like for
//! like test of a published mix); tensors it lacks take the `nebula-q4` type.

use std::collections::HashMap;
use std::path::Path;

use crate::gguf::{GgmlType, GgufFile};

/// A named quantization recipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecipeName {
    /// The product description's component table.
    NebulaQ4,
    /// ggml-org's Q8_0 files.
    Q8_0,
    /// Unsloth's UD-Q4_K_XL mix.
    UdQ4KXl,
    /// llama.cpp's IQ4_XS mix.
    Iq4Xs,
    /// llama.cpp's Q2_K mix.
    Q2K,
    /// llama.cpp's Q3_K_S mix.
    Q3KS,
    /// llama.cpp's Q3_K_M mix.
    Q3KM,
    /// llama.cpp's IQ3_XXS mix.
    Iq3Xxs,
    /// llama.cpp's IQ2_XS mix.
    Iq2Xs,
    /// llama.cpp's IQ1_M mix.
    Iq1M,
    /// Unsloth's UD-Q2_K_XL mix.
    UdQ2KXl,
}

impl RecipeName {
    /// Every recipe with its command-line name.
    pub const ALL: [(RecipeName, &'static str); 11] = [
        (RecipeName::NebulaQ4, "nebula-q4"),
        (RecipeName::Q8_0, "q8_0"),
        (RecipeName::UdQ4KXl, "ud-q4_k_xl"),
        (RecipeName::Iq4Xs, "iq4_xs"),
        (RecipeName::Q2K, "q2_k"),
        (RecipeName::Q3KS, "q3_k_s"),
        (RecipeName::Q3KM, "q3_k_m"),
        (RecipeName::Iq3Xxs, "iq3_xxs"),
        (RecipeName::Iq2Xs, "iq2_xs"),
        (RecipeName::Iq1M, "iq1_m"),
        (RecipeName::UdQ2KXl, "ud-q2_k_xl"),
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(r, _)| *r == self).map(|(_, n)| *n).unwrap()
    }

    /// llama.cpp's `general.file_type` for files of this mix (`LLAMA_FTYPE_MOSTLY_*`).
    pub fn file_type(self) -> u32 {
        match self {
            RecipeName::NebulaQ4 | RecipeName::UdQ4KXl => 15, // Q4_K_M
            RecipeName::Q8_0 => 7,
            RecipeName::Iq4Xs => 30,
            RecipeName::Q2K | RecipeName::UdQ2KXl => 10,
            RecipeName::Q3KS => 11,
            RecipeName::Q3KM => 12,
            RecipeName::Iq3Xxs => 23,
            RecipeName::Iq2Xs => 20,
            RecipeName::Iq1M => 31,
        }
    }

    /// Whether `llama-quantize` refuses this mix without an importance matrix (its `tensor_requires_imatrix`:
    /// the mix's default type is IQ3_XXS, IQ2_XS or IQ1_M).
    pub fn requires_imatrix(self) -> bool {
        matches!(self, RecipeName::Iq3Xxs | RecipeName::Iq2Xs | RecipeName::Iq1M)
    }
}

impl std::str::FromStr for RecipeName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let l = s.to_ascii_lowercase();
        Self::ALL.iter().find(|(_, n)| *n == l).map(|(r, _)| *r).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|(_, n)| *n).collect();
            format!("unknown recipe '{s}' ({})", names.join(", "))
        })
    }
}

/// What a recipe may look at besides a tensor's name and shape.
#[derive(Debug, Clone, Copy)]
pub struct RecipeContext {
    /// Trunk layers (`num_hidden_layers`); the MTP block, when written, is block `n_layers`.
    pub n_layers: usize,
    /// Whether the file has the MTP block (`blk.{n_layers}`): llama.cpp's layer thresholds count it.
    pub mtp: bool,
    /// Whether an importance matrix is used.
    pub has_imatrix: bool,
}

impl RecipeContext {
    /// Blocks in the file, the MTP block included (llama.cpp's `n_layer_all`).
    pub fn blocks(&self) -> usize {
        self.n_layers + usize::from(self.mtp)
    }
}

/// A recipe: a named one, or the types of a published GGUF.
#[derive(Debug, Clone)]
pub enum QuantRecipe {
    /// One of [`RecipeName`].
    Named(RecipeName),
    /// Tensor name to type, read from a GGUF file.
    FromFile { path: String, types: HashMap<String, GgmlType> },
}

impl QuantRecipe {
    /// Reads the tensor types of `path` (a GGUF, or the first part of a split one; only the header is read).
    pub fn from_gguf(path: &Path) -> Result<Self, crate::gguf::GgufError> {
        let f = GgufFile::open(path)?;
        let types = f.tensors().map(|t| (t.name.clone(), t.ggml_type)).collect();
        Ok(QuantRecipe::FromFile { path: path.display().to_string(), types })
    }

    /// `general.file_type` for the output.
    pub fn file_type(&self) -> u32 {
        match self {
            QuantRecipe::Named(n) => n.file_type(),
            QuantRecipe::FromFile { .. } => 15,
        }
    }

    /// The type of weight `name` (ggml dims `dims`), after the row-width fallback.
    pub fn tensor_type(&self, name: &str, dims: &[u64], ctx: &RecipeContext) -> GgmlType {
        let want = match self {
            QuantRecipe::Named(r) => named_type(*r, name, ctx),
            QuantRecipe::FromFile { types, .. } => {
                let fused =
                    name.replace("ffn_gate_exps", "ffn_gate_up_exps").replace("ffn_up_exps", "ffn_gate_up_exps");
                match types.get(name).or_else(|| types.get(&fused)) {
                    Some(&t) => t,
                    None => named_type(RecipeName::NebulaQ4, name, ctx),
                }
            }
        };
        fallback(want, dims[0])
    }
}

/// The type llama.cpp falls back to when `ty`'s block does not divide a row of `ne0` values (then F16 when
/// that does not divide either).
pub fn fallback(ty: GgmlType, ne0: u64) -> GgmlType {
    let fits = |t: GgmlType| ne0.is_multiple_of(t.block_size() as u64);
    if fits(ty) {
        return ty;
    }
    let next = match ty {
        GgmlType::IQ1_S
        | GgmlType::IQ1_M
        | GgmlType::IQ2_XXS
        | GgmlType::IQ2_XS
        | GgmlType::IQ2_S
        | GgmlType::IQ3_XXS
        | GgmlType::IQ3_S
        | GgmlType::IQ4_XS => GgmlType::IQ4_NL,
        GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::Q4_0,
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        _ => GgmlType::F16,
    };
    if fits(next) { next } else { GgmlType::F16 }
}

/// `blk.N.` layer index of a tensor name.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

fn is_expert_gate_up(name: &str) -> bool {
    name.contains("ffn_gate_exps") || name.contains("ffn_up_exps") || name.contains("ffn_gate_up_exps")
}

fn named_type(r: RecipeName, name: &str, ctx: &RecipeContext) -> GgmlType {
    use GgmlType as T;
    let is = |s: &str| name.contains(s);
    // Never quantized by llama.cpp (`tensor_allows_quantization`): the indexer projections.
    if is("indexer.q_proj") || is("indexer.k_proj") {
        return T::BF16;
    }
    let mtp = layer_of(name) == Some(ctx.n_layers);
    match r {
        RecipeName::Q8_0 => T::Q8_0,
        RecipeName::NebulaQ4 => {
            if is_expert_gate_up(name) || is("ffn_gate_shexp") || is("ffn_up_shexp") {
                T::Q4_K
            } else if is("ffn_down_exps") || is("ffn_down_shexp") || name == "per_layer_token_embd.weight" {
                T::IQ4_NL
            } else if is("ssm_alpha") || is("ssm_beta") {
                T::F32
            } else if mtp && (is("hc_attn_up") || is("hc_ffn_up") || is("hc_head_up")) {
                T::Q5_0
            } else if is("hc_attn_up") || is("hc_ffn_up") || name == "output_hc_up.weight" {
                T::IQ4_NL
            } else if mtp && (is("attn_v.weight") || is("hc_head_down")) {
                T::Q6_K
            } else {
                T::Q4_K
            }
        }
        RecipeName::UdQ4KXl => {
            if is_expert_gate_up(name) {
                T::Q4_K
            } else if is("ffn_down_exps") {
                T::Q5_K
            } else if name == "per_layer_token_embd.weight" {
                T::IQ4_NL
            } else {
                T::Q8_0
            }
        }
        RecipeName::Q2K | RecipeName::Q3KS | RecipeName::Q3KM | RecipeName::Iq3Xxs => k_mix(r, name, ctx),
        RecipeName::Iq2Xs | RecipeName::Iq1M => i_mix(r, name, ctx),
        RecipeName::UdQ2KXl => {
            if is_expert_gate_up(name) {
                T::IQ2_XS
            } else if is("ffn_down_exps") {
                T::IQ3_XXS
            } else if name == "per_layer_token_embd.weight" {
                T::IQ4_NL
            } else {
                k_mix(RecipeName::Q2K, name, ctx)
            }
        }
        RecipeName::Iq4Xs => {
            let first_eighth = layer_of(name).is_some_and(|l| l < ctx.blocks() / 8);
            if name == "output.weight" {
                T::Q6_K
            } else if is("attn_v.weight")
                || is("attn_qkv.weight")
                || (is("ffn_down") && first_eighth && !ctx.has_imatrix)
            {
                T::Q5_K
            } else {
                T::IQ4_XS
            }
        }
    }
}

/// llama.cpp's tensor categories (`tensor_get_category` in `llama-quant.cpp`), by name substring in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Category {
    TokenEmbd,
    Output,
    AttnVLike,
    AttnK,
    AttnQ,
    AttnOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Other,
}

fn category(name: &str) -> Category {
    let is = |s: &str| name.contains(s);
    if name == "output.weight" {
        Category::Output
    } else if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
        Category::TokenEmbd
    } else if is("attn_qkv.weight") || is("attn_kv_b.weight") || is("attn_v.weight") {
        Category::AttnVLike
    } else if is("attn_k.weight") {
        Category::AttnK
    } else if is("attn_q.weight") {
        Category::AttnQ
    } else if is("attn_output.weight") {
        Category::AttnOutput
    } else if is("ffn_up") {
        Category::FfnUp
    } else if is("ffn_gate") {
        Category::FfnGate
    } else if is("ffn_down") {
        Category::FfnDown
    } else {
        Category::Other
    }
}

/// Position of an `attn_v`-like tensor (`attn_qkv` of the Gated DeltaNet blocks, `attn_v` of the attention
/// blocks) in llama.cpp's file order (qwen4exp has one per block).
fn attn_v_ordinal(name: &str) -> Option<usize> {
    layer_of(name)
}

/// Position of an `ffn_down` tensor in llama.cpp's file order: three per block, sorted by name
/// (`ffn_down_exps`, `ffn_down_shexp`, `hc_ffn_down`).
fn ffn_down_ordinal(name: &str) -> Option<usize> {
    let l = layer_of(name)?;
    let k = if name.contains("ffn_down_exps") {
        0
    } else if name.contains("ffn_down_shexp") {
        1
    } else {
        2
    };
    Some(3 * l + k)
}

/// llama.cpp's Q2_K, Q3_K_S, Q3_K_M and IQ3_XXS mixes (`llama_tensor_get_type_impl` for a 512-expert model with
/// grouped-query factor 12).
fn k_mix(r: RecipeName, name: &str, ctx: &RecipeContext) -> GgmlType {
    use GgmlType as T;
    let default = match r {
        RecipeName::Q2K => T::Q2_K,
        RecipeName::Iq3Xxs => T::IQ3_XXS,
        _ => T::Q3_K,
    };
    let blocks = ctx.blocks();
    let layer = layer_of(name).unwrap_or(0);
    match category(name) {
        Category::Output => {
            if r == RecipeName::Iq3Xxs {
                T::Q5_K
            } else {
                T::Q6_K
            }
        }
        Category::TokenEmbd => {
            if r == RecipeName::Iq3Xxs {
                T::IQ3_S
            } else {
                default
            }
        }
        Category::AttnVLike => match r {
            RecipeName::Q2K | RecipeName::Iq3Xxs => T::Q4_K,
            RecipeName::Q3KM if attn_v_ordinal(name).is_some_and(|i| i < 2) => T::Q5_K,
            RecipeName::Q3KM => T::Q4_K,
            _ => default,
        },
        Category::AttnK | Category::AttnQ if r == RecipeName::Iq3Xxs => T::IQ2_S,
        Category::FfnDown => match r {
            RecipeName::Q2K => T::Q3_K,
            RecipeName::Iq3Xxs if !ctx.has_imatrix => {
                if layer < blocks / 8 {
                    T::Q4_K
                } else {
                    T::Q3_K
                }
            }
            RecipeName::Q3KM if layer < blocks / 16 => T::Q5_K,
            RecipeName::Q3KM => T::Q4_K,
            _ => default,
        },
        Category::AttnOutput => match r {
            RecipeName::Q2K => T::Q3_K,
            RecipeName::Iq3Xxs => T::IQ3_S,
            RecipeName::Q3KM => T::Q4_K,
            _ => default,
        },
        _ => default,
    }
}

/// llama.cpp's IQ2_XS and IQ1_M mixes (the IQ2/IQ1 branch of `llama_tensor_get_type_impl`, 512 experts).
fn i_mix(r: RecipeName, name: &str, ctx: &RecipeContext) -> GgmlType {
    use GgmlType as T;
    let default = if r == RecipeName::Iq1M { T::IQ1_M } else { T::IQ2_XS };
    match category(name) {
        Category::Output => T::Q5_K,
        Category::TokenEmbd => T::Q2_K,
        Category::AttnVLike => T::Q4_K,
        Category::FfnDown if ffn_down_ordinal(name).is_some_and(|i| i < ctx.blocks() / 8) => T::Q2_K,
        Category::AttnOutput if r == RecipeName::Iq1M => T::IQ2_XXS,
        _ => default,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CTX: RecipeContext = RecipeContext { n_layers: 48, mtp: true, has_imatrix: false };

    fn ty(r: RecipeName, name: &str, ne0: u64) -> GgmlType {
        QuantRecipe::Named(r).tensor_type(name, &[ne0, 1], &CTX)
    }

    #[test]
    fn nebula_q4_follows_the_seed_table_at_real_widths() {
        use GgmlType as T;
        let r = RecipeName::NebulaQ4;
        assert_eq!(ty(r, "token_embd.weight", 2560), T::Q4_K);
        assert_eq!(ty(r, "output.weight", 2560), T::Q4_K);
        assert_eq!(ty(r, "blk.3.ffn_gate_exps.weight", 2560), T::Q4_K);
        assert_eq!(ty(r, "blk.3.ffn_up_exps.weight", 2560), T::Q4_K);
        assert_eq!(ty(r, "blk.3.ffn_down_exps.weight", 640), T::IQ4_NL);
        assert_eq!(ty(r, "blk.3.ffn_down_shexp.weight", 640), T::IQ4_NL);
        assert_eq!(ty(r, "blk.3.ffn_gate_shexp.weight", 2560), T::Q4_K);
        assert_eq!(ty(r, "blk.0.ssm_alpha.weight", 2560), T::F32);
        assert_eq!(ty(r, "blk.3.indexer.q_proj.weight", 2560), T::BF16);
        assert_eq!(ty(r, "blk.0.attn_qkv.weight", 2560), T::Q4_K);
        assert_eq!(ty(r, "blk.0.ssm_out.weight", 6144), T::Q4_K);
        assert_eq!(ty(r, "blk.0.hc_attn_up.weight", 320), T::IQ4_NL);
        assert_eq!(ty(r, "blk.0.hc_attn_down.weight", 10240), T::Q4_K);
        assert_eq!(ty(r, "per_layer_token_embd.weight", 160), T::IQ4_NL);
        assert_eq!(ty(r, "blk.48.attn_v.weight", 2560), T::Q6_K);
        assert_eq!(ty(r, "blk.48.hc_ffn_up.weight", 320), T::Q5_0);
        assert_eq!(ty(r, "blk.48.nextn.hc_head_down.weight", 10240), T::Q6_K);
        assert_eq!(ty(r, "blk.48.ffn_down_exps.weight", 640), T::IQ4_NL);
    }

    #[test]
    fn row_widths_that_blocks_do_not_divide_fall_back_like_llama_cpp() {
        use GgmlType as T;
        assert_eq!(fallback(T::Q4_K, 640), T::Q5_0);
        assert_eq!(fallback(T::Q5_K, 640), T::Q5_1);
        assert_eq!(fallback(T::Q6_K, 160), T::Q8_0);
        assert_eq!(fallback(T::IQ4_XS, 160), T::IQ4_NL);
        assert_eq!(fallback(T::Q3_K, 320), T::Q4_0);
        assert_eq!(fallback(T::Q4_K, 24), T::F16);
        assert_eq!(fallback(T::IQ4_NL, 24), T::F16);
        assert_eq!(fallback(T::Q4_K, 2560), T::Q4_K);
        assert_eq!(ty(RecipeName::UdQ4KXl, "blk.0.ffn_down_exps.weight", 640), T::Q5_1);
        assert_eq!(ty(RecipeName::Iq4Xs, "blk.2.ffn_down_exps.weight", 640), T::Q5_1);
        assert_eq!(ty(RecipeName::Iq4Xs, "blk.20.ffn_down_exps.weight", 640), T::IQ4_NL);
        assert_eq!(ty(RecipeName::Iq4Xs, "per_layer_token_embd.weight", 160), T::IQ4_NL);
    }
}
