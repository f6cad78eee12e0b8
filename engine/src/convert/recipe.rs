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
}

impl RecipeName {
    /// Every recipe with its command-line name.
    pub const ALL: [(RecipeName, &'static str); 4] = [
        (RecipeName::NebulaQ4, "nebula-q4"),
        (RecipeName::Q8_0, "q8_0"),
        (RecipeName::UdQ4KXl, "ud-q4_k_xl"),
        (RecipeName::Iq4Xs, "iq4_xs"),
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
        }
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
    /// Whether an importance matrix is used.
    pub has_imatrix: bool,
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
        RecipeName::Iq4Xs => {
            let first_eighth = layer_of(name).is_some_and(|l| l < ctx.n_layers / 8);
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

#[cfg(test)]
mod tests {
    use super::*;

    const CTX: RecipeContext = RecipeContext { n_layers: 48, has_imatrix: false };

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
