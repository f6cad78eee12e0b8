//! `nebula convert`: a Hugging Face `qwen4_exp` safetensors checkpoint to a GGUF file with llama.cpp's
//! `qwen4exp` names, metadata and transforms (llama.cpp's `convert_hf_to_gguf.py`).
//!
//! Transforms: RMSNorm weights stored as `1 + w` (except the Gated DeltaNet gated norm); `A_log` stored as
//! `-exp(A_log)`; Gated DeltaNet value heads reordered from HF's grouped order to GGUF's tiled order;
//! the indexer's fused `index_qk_proj` split into `q_proj` and `k_proj`; fused or per-expert expert weights
//! split into `ffn_{gate,up,down}_exps`; the sharded n-gram table concatenated into `per_layer_token_embd`; the
//! PLE hash buffers written as metadata; the MTP block written as `blk.{n_layer}.nextn.*` plus a trunk-style
//! block. Tensors stream through one at a time (large ones in row chunks), so memory stays bounded.

mod checkpoint;
mod hf_config;
mod imatrix;
mod mmproj;
pub mod recipe;
mod requantize;

use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::gguf::{GgmlType, GgufError, GgufWriter, MetadataArray, MetadataValue, TensorDataWriter, ValueType};
use crate::quant::{f32_to_bf16_bits, quantize};

pub use checkpoint::{Checkpoint, SourceTensor};
pub use hf_config::HfTextConfig;
pub use imatrix::{ImatrixCollector, ImportanceMatrix};
pub use mmproj::{QWEN3VL_IMAGE_MEAN, QWEN3VL_IMAGE_STD, QWEN3VL_PIXEL_BOUNDS, convert_mmproj};
pub use recipe::{QuantRecipe, RecipeContext, RecipeName};
pub use requantize::{requantize, requantize_with};

/// Conversion failures, each naming the file, key or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// Reading an input file failed.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// An input file is malformed.
    #[error("{path}: {problem}")]
    Input { path: PathBuf, problem: String },
    /// `config.json` is unusable.
    #[error("config.json: {0}")]
    Config(String),
    /// A tensor the model needs is not in the checkpoint.
    #[error("checkpoint has no tensor '{name}'")]
    Missing { name: String },
    /// A tensor has an unexpected shape.
    #[error("tensor '{name}' has shape {actual:?}, expected {expected:?}")]
    Shape { name: String, expected: Vec<usize>, actual: Vec<usize> },
    /// The tokenizer files could not be turned into GGUF vocabulary arrays.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The recipe cannot be applied: it needs an importance matrix, or it picks a type the converter's
    /// quantizers do not write.
    #[error("recipe: {0}")]
    Recipe(String),
    /// Writing the GGUF failed.
    #[error(transparent)]
    Gguf(#[from] GgufError),
}

/// Refuses a recipe that llama.cpp's `llama-quantize` refuses without an importance matrix.
pub(crate) fn check_recipe(recipe: &QuantRecipe, has_imatrix: bool) -> Result<(), ConvertError> {
    if let QuantRecipe::Named(r) = recipe
        && r.requires_imatrix()
        && !has_imatrix
    {
        return Err(ConvertError::Recipe(format!(
            "'{}' needs an importance matrix (--imatrix FILE), as llama.cpp's llama-quantize does for its \
             sub-3-bit i-quants; `nebula imatrix` gathers one",
            r.name()
        )));
    }
    Ok(())
}

/// Refuses a planned type the converter cannot write (before anything is written).
pub(crate) fn check_writable(name: &str, ty: GgmlType) -> Result<(), ConvertError> {
    if matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) || quantize::QUANTIZABLE.contains(&ty) {
        return Ok(());
    }
    let can: Vec<&str> = quantize::QUANTIZABLE.iter().map(|t| t.name()).collect();
    Err(ConvertError::Recipe(format!(
        "the recipe picks {} for '{name}', which this converter cannot quantize (it writes {}); convert to \
         --outtype f32 or bf16 and quantize with llama.cpp's llama-quantize, or use `nebula synth` for a \
         random-weight file of this mix",
        ty.name(),
        can.join(", ")
    )))
}

/// Storage type for the weight matrices (1-D tensors, norms, routers and convs are always F32, as llama.cpp's
/// converter writes them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutType {
    /// 32-bit floats.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit blocks of 32 (falls back to F16 for rows that are not a multiple of 32 wide; the indexer
    /// projections stay BF16 as llama.cpp never quantizes them).
    Q8_0,
}

impl std::str::FromStr for OutType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            "bf16" => Ok(Self::Bf16),
            "q8_0" => Ok(Self::Q8_0),
            other => Err(format!("unknown output type '{other}' (f32, f16, bf16, q8_0)")),
        }
    }
}

/// Conversion settings.
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    /// Type of the weight matrices.
    pub out_type: OutType,
    /// Write the MTP block when the checkpoint has one.
    pub include_mtp: bool,
    /// Split the output into parts of at most this many bytes of tensor data (`-0000i-of-0000n.gguf`).
    pub split_max_bytes: Option<u64>,
    /// `general.name`.
    pub name: Option<String>,
    /// A quantization recipe: when set, it chooses every weight's type and `out_type` only names the float type
    /// of the weights the recipe leaves unquantized.
    pub recipe: Option<QuantRecipe>,
    /// An importance matrix (`--imatrix`): the quantized weights it covers are fitted with its column weights,
    /// and the recipes take their with-imatrix choices.
    pub imatrix: Option<ImportanceMatrix>,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        Self {
            out_type: OutType::Bf16,
            include_mtp: true,
            split_max_bytes: None,
            name: None,
            recipe: None,
            imatrix: None,
        }
    }
}

/// What a conversion produced.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    /// Files written (one, or the split parts).
    pub files: Vec<PathBuf>,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of tensor data.
    pub data_bytes: u64,
    /// Whether an MTP block was written.
    pub mtp: bool,
    /// Whether tokenizer metadata was written.
    pub tokenizer: bool,
}

/// Elementwise transform applied to every value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elementwise {
    None,
    /// `1 + w` (RMSNorm weights).
    PlusOne,
    /// `-exp(w)` (`A_log`).
    NegExp,
}

/// How to produce one output tensor's values (row-major over ggml order: `ne0` values per row).
#[derive(Debug, Clone)]
enum Recipe {
    /// The whole source.
    Plain { src: String },
    /// Source viewed as `[rows, block * n_blocks...]`: rows `[0, offset)` copied, then blocks of `block` rows in
    /// the order `perm`.
    RowPermute { src: String, offset: usize, block: usize, perm: Vec<usize> },
    /// Within each row, column blocks of `block` in the order `perm`.
    ColPermute { src: String, block: usize, perm: Vec<usize> },
    /// Rows `rows` of the source (viewed as `[R, ne0]`).
    RowRange { src: String, rows: Range<usize> },
    /// Source `[n, rows_per, ne0]`: rows `take` of each of the `n` matrices, stacked.
    StackRows { src: String, n: usize, rows_per: usize, take: Range<usize> },
    /// Several sources concatenated along rows (stacked experts, n-gram shards).
    Concat { srcs: Vec<String> },
    /// Several `[R, c_i]` sources concatenated along columns.
    ConcatCols { srcs: Vec<String> },
}

#[derive(Debug, Clone)]
struct OutTensor {
    name: String,
    /// ggml order.
    dims: Vec<u64>,
    ty: GgmlType,
    recipe: Recipe,
    transform: Elementwise,
    /// A weight whose type a quantization recipe chooses (false: a vector, norm, router or conv kept F32).
    weight: bool,
}

/// Converts the checkpoint in `dir` to `out`.
pub fn convert(dir: &Path, out: &Path, opts: &ConvertOptions) -> Result<ConvertReport, ConvertError> {
    let cfg_path = dir.join("config.json");
    let cfg_text =
        std::fs::read_to_string(&cfg_path).map_err(|e| ConvertError::Io { path: cfg_path.clone(), source: e })?;
    let cfg = HfTextConfig::parse(&cfg_text)?;
    let ckpt = Checkpoint::open(dir)?;
    let names = Names::detect(&ckpt)?;
    let has_mtp = opts.include_mtp && ckpt.get("mtp.fc_hidden.weight").is_some();
    let mut plan = plan_tensors(&cfg, &ckpt, &names, opts.out_type, has_mtp)?;
    if let Some(recipe) = &opts.recipe {
        let ctx = RecipeContext { n_layers: cfg.num_hidden_layers, mtp: has_mtp, has_imatrix: opts.imatrix.is_some() };
        check_recipe(recipe, opts.imatrix.is_some())?;
        for t in plan.iter_mut().filter(|t| t.weight) {
            t.ty = recipe.tensor_type(&t.name, &t.dims, &ctx);
            check_writable(&t.name, t.ty)?;
        }
    }

    let mut w = GgufWriter::create(out, 32)?;
    if let Some(max) = opts.split_max_bytes {
        w.split_max_bytes(max);
    }
    write_metadata(&mut w, &cfg, &ckpt, &names, opts, has_mtp)?;
    let tokenizer = write_tokenizer(&mut w, dir, cfg.vocab_size)?;
    for t in &plan {
        w.add_tensor(t.name.clone(), &t.dims, t.ty)?;
    }
    // Check every importance-matrix entry against its tensor before any data is written.
    let weights = plan
        .iter()
        .map(|t| imatrix_rows(opts.imatrix.as_ref(), &t.name, &t.dims, t.ty))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(m) = &opts.imatrix {
        check_imatrix_used(m, weights.iter().filter(|x| x.is_some()).count())?;
        add_imatrix_metadata(&mut w, m)?;
    }
    let mut data = w.begin_data()?;
    let mut data_bytes = 0u64;
    for (t, imx) in plan.iter().zip(weights) {
        data_bytes += write_tensor(&mut data, &ckpt, t, imx)?;
    }
    let files = data.finish()?;
    Ok(ConvertReport { files, tensors: plan.len(), data_bytes, mtp: has_mtp, tokenizer })
}

/// The prefix of text-model tensors in this checkpoint (`model.language_model.`, `model.`, or none).
struct Names {
    text: String,
}

impl Names {
    fn detect(ckpt: &Checkpoint) -> Result<Self, ConvertError> {
        for p in ["model.language_model.", "model.", ""] {
            if ckpt.get(&format!("{p}embed_tokens.weight")).is_some() {
                return Ok(Self { text: p.to_string() });
            }
        }
        Err(ConvertError::Missing { name: "model.language_model.embed_tokens.weight".into() })
    }
    fn t(&self, rest: &str) -> String {
        format!("{}{rest}", self.text)
    }
}

fn shape_of<'a>(ckpt: &'a Checkpoint, name: &str) -> Result<&'a SourceTensor, ConvertError> {
    ckpt.get(name).ok_or_else(|| ConvertError::Missing { name: name.to_string() })
}

fn expect_shape(ckpt: &Checkpoint, name: &str, expected: &[usize]) -> Result<(), ConvertError> {
    let t = shape_of(ckpt, name)?;
    if t.shape != expected {
        return Err(ConvertError::Shape { name: name.into(), expected: expected.to_vec(), actual: t.shape.clone() });
    }
    Ok(())
}

/// GGUF value-head order from HF's grouped order: GGUF head `j` is HF head `(j % nk) * r + j / nk`.
fn value_head_perm(nk: usize, nv: usize) -> Vec<usize> {
    let r = nv / nk;
    (0..nv).map(|j| (j % nk) * r + j / nk).collect()
}

struct Planner<'a> {
    ckpt: &'a Checkpoint,
    out_type: OutType,
    tensors: Vec<OutTensor>,
}

impl Planner<'_> {
    fn matrix_type(&self, ne0: u64) -> GgmlType {
        match self.out_type {
            OutType::F32 => GgmlType::F32,
            OutType::F16 => GgmlType::F16,
            OutType::Bf16 => GgmlType::BF16,
            OutType::Q8_0 if ne0.is_multiple_of(32) => GgmlType::Q8_0,
            OutType::Q8_0 => GgmlType::F16,
        }
    }
    fn float_type(&self) -> GgmlType {
        match self.out_type {
            OutType::F32 => GgmlType::F32,
            OutType::F16 => GgmlType::F16,
            _ => GgmlType::BF16,
        }
    }
    fn push(&mut self, name: String, dims: Vec<u64>, ty: GgmlType, recipe: Recipe, transform: Elementwise) {
        self.tensors.push(OutTensor { name, dims, ty, recipe, transform, weight: false });
    }
    /// Like `push`, for a weight matrix (a recipe may change its type).
    fn push_weight(&mut self, name: String, dims: Vec<u64>, ty: GgmlType, recipe: Recipe) {
        self.tensors.push(OutTensor { name, dims, ty, recipe, transform: Elementwise::None, weight: true });
    }
    /// A 2-D weight `[out, in]` → ggml `[in, out]`, stored in the matrix type.
    fn matrix(&mut self, gguf: String, src: String, rows: usize, cols: usize) -> Result<(), ConvertError> {
        expect_shape(self.ckpt, &src, &[rows, cols])?;
        let ty = self.matrix_type(cols as u64);
        self.push_weight(gguf, vec![cols as u64, rows as u64], ty, Recipe::Plain { src });
        Ok(())
    }
    /// A vector stored F32, with a transform.
    fn vector(&mut self, gguf: String, src: String, len: usize, transform: Elementwise) -> Result<(), ConvertError> {
        let t = shape_of(self.ckpt, &src)?;
        if t.numel() != len {
            return Err(ConvertError::Shape { name: src, expected: vec![len], actual: t.shape.clone() });
        }
        self.push(gguf, vec![len as u64], GgmlType::F32, Recipe::Plain { src }, transform);
        Ok(())
    }
}

fn plan_tensors(
    cfg: &HfTextConfig,
    ckpt: &Checkpoint,
    names: &Names,
    out_type: OutType,
    has_mtp: bool,
) -> Result<Vec<OutTensor>, ConvertError> {
    let mut p = Planner { ckpt, out_type, tensors: Vec::new() };
    let (d, v) = (cfg.hidden_size, cfg.vocab_size);
    let (s, r) = (cfg.hc_count, cfg.hc_lowrank);
    let hc = s * d;
    p.matrix("token_embd.weight".into(), names.t("embed_tokens.weight"), v, d)?;
    let lm =
        if ckpt.get("lm_head.weight").is_some() { "lm_head.weight".to_string() } else { names.t("lm_head.weight") };
    p.matrix("output.weight".into(), lm, v, d)?;
    let mix = names.t("hyper_connection_mixer.");
    p.vector("output_hc_norm.weight".into(), format!("{mix}hc_norm.weight"), hc, Elementwise::PlusOne)?;
    p.matrix("output_hc_down.weight".into(), format!("{mix}input_mix_weight_down.weight"), r, hc)?;
    p.matrix("output_hc_up.weight".into(), format!("{mix}input_mix_weight_up.weight"), hc, r)?;

    for i in 0..cfg.num_hidden_layers {
        let hf = names.t(&format!("layers.{i}."));
        plan_layer(&mut p, cfg, &hf, i, cfg.recurrent[i])?;
        if cfg.ple_layer_ids.contains(&(i + 1)) {
            plan_ple(&mut p, cfg, &hf, i)?;
        }
    }
    if has_mtp {
        let b = cfg.num_hidden_layers;
        let eh = ["mtp.fc_embedding.weight".to_string(), "mtp.fc_hidden.weight".to_string()];
        for n in &eh {
            expect_shape(ckpt, n, &[d, d])?;
        }
        let ty = p.matrix_type(2 * d as u64);
        p.push_weight(
            format!("blk.{b}.nextn.eh_proj.weight"),
            vec![2 * d as u64, d as u64],
            ty,
            Recipe::ConcatCols { srcs: eh.to_vec() },
        );
        p.vector(
            format!("blk.{b}.nextn.enorm.weight"),
            "mtp.pre_fc_norm_embedding.weight".into(),
            d,
            Elementwise::PlusOne,
        )?;
        p.vector(
            format!("blk.{b}.nextn.hnorm.weight"),
            "mtp.pre_fc_norm_hidden.weight".into(),
            hc,
            Elementwise::PlusOne,
        )?;
        p.vector(
            format!("blk.{b}.nextn.hc_head_norm.weight"),
            "mtp.hyper_connection_mixer.hc_norm.weight".into(),
            hc,
            Elementwise::PlusOne,
        )?;
        p.matrix(
            format!("blk.{b}.nextn.hc_head_down.weight"),
            "mtp.hyper_connection_mixer.input_mix_weight_down.weight".into(),
            r,
            hc,
        )?;
        p.matrix(
            format!("blk.{b}.nextn.hc_head_up.weight"),
            "mtp.hyper_connection_mixer.input_mix_weight_up.weight".into(),
            hc,
            r,
        )?;
        plan_layer(&mut p, cfg, "mtp.layers.0.", b, false)?;
    }
    Ok(p.tensors)
}

fn plan_layer(p: &mut Planner, cfg: &HfTextConfig, hf: &str, i: usize, recurrent: bool) -> Result<(), ConvertError> {
    let d = cfg.hidden_size;
    let (s, r) = (cfg.hc_count, cfg.hc_lowrank);
    let hc = s * d;
    let b = format!("blk.{i}");
    for (hf_hc, gg) in [("attn_hyper_connection", "hc_attn"), ("mlp_hyper_connection", "hc_ffn")] {
        p.vector(format!("{b}.{gg}_norm.weight"), format!("{hf}{hf_hc}.hc_norm.weight"), hc, Elementwise::PlusOne)?;
        p.matrix(format!("{b}.{gg}_down.weight"), format!("{hf}{hf_hc}.input_mix_weight_down.weight"), r, hc)?;
        p.matrix(format!("{b}.{gg}_up.weight"), format!("{hf}{hf_hc}.input_mix_weight_up.weight"), hc, r)?;
        p.matrix(format!("{b}.{gg}_inject.weight"), format!("{hf}{hf_hc}.block_inject_weight.weight"), s, hc)?;
    }
    if recurrent {
        let (nk, nv, dk) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim);
        let (kd, vd) = (nk * dk, nv * dk);
        let conv_dim = 2 * kd + vd;
        let perm = value_head_perm(nk, nv);
        let la = format!("{hf}linear_attn.");
        expect_shape(p.ckpt, &format!("{la}in_proj_qkv.weight"), &[conv_dim, d])?;
        let mt = p.matrix_type(d as u64);
        p.push_weight(
            format!("{b}.attn_qkv.weight"),
            vec![d as u64, conv_dim as u64],
            mt,
            Recipe::RowPermute {
                src: format!("{la}in_proj_qkv.weight"),
                offset: 2 * kd,
                block: dk,
                perm: perm.clone(),
            },
        );
        expect_shape(p.ckpt, &format!("{la}in_proj_z.weight"), &[vd, d])?;
        p.push_weight(
            format!("{b}.attn_gate.weight"),
            vec![d as u64, vd as u64],
            mt,
            Recipe::RowPermute { src: format!("{la}in_proj_z.weight"), offset: 0, block: dk, perm: perm.clone() },
        );
        for (hfn, gg) in [("in_proj_b", "ssm_beta"), ("in_proj_a", "ssm_alpha")] {
            expect_shape(p.ckpt, &format!("{la}{hfn}.weight"), &[nv, d])?;
            p.push_weight(
                format!("{b}.{gg}.weight"),
                vec![d as u64, nv as u64],
                mt,
                Recipe::RowPermute { src: format!("{la}{hfn}.weight"), offset: 0, block: 1, perm: perm.clone() },
            );
        }
        expect_shape(p.ckpt, &format!("{la}conv1d.weight"), &[conv_dim, 1, cfg.linear_conv_kernel_dim])?;
        p.push(
            format!("{b}.ssm_conv1d.weight"),
            vec![cfg.linear_conv_kernel_dim as u64, conv_dim as u64],
            GgmlType::F32,
            Recipe::RowPermute { src: format!("{la}conv1d.weight"), offset: 2 * kd, block: dk, perm: perm.clone() },
            Elementwise::None,
        );
        for (hfn, gg, tr) in [("dt_bias", "ssm_dt.bias", Elementwise::None), ("A_log", "ssm_a", Elementwise::NegExp)] {
            expect_shape(p.ckpt, &format!("{la}{hfn}"), &[nv])?;
            p.push(
                format!("{b}.{gg}"),
                vec![nv as u64],
                GgmlType::F32,
                Recipe::RowPermute { src: format!("{la}{hfn}"), offset: 0, block: 1, perm: perm.clone() },
                tr,
            );
        }
        p.vector(format!("{b}.ssm_norm.weight"), format!("{la}norm.weight"), dk, Elementwise::None)?;
        expect_shape(p.ckpt, &format!("{la}out_proj.weight"), &[d, vd])?;
        let ot = p.matrix_type(vd as u64);
        p.push_weight(
            format!("{b}.ssm_out.weight"),
            vec![vd as u64, d as u64],
            ot,
            Recipe::ColPermute { src: format!("{la}out_proj.weight"), block: dk, perm },
        );
    } else {
        let (nh, nkv, hd) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        let sa = format!("{hf}self_attn.");
        p.matrix(format!("{b}.attn_q.weight"), format!("{sa}q_proj.weight"), nh * hd * 2, d)?;
        p.matrix(format!("{b}.attn_k.weight"), format!("{sa}k_proj.weight"), nkv * hd, d)?;
        p.matrix(format!("{b}.attn_v.weight"), format!("{sa}v_proj.weight"), nkv * hd, d)?;
        p.matrix(format!("{b}.attn_output.weight"), format!("{sa}o_proj.weight"), d, nh * hd)?;
        p.vector(format!("{b}.attn_q_norm.weight"), format!("{sa}q_norm.weight"), hd, Elementwise::PlusOne)?;
        p.vector(format!("{b}.attn_k_norm.weight"), format!("{sa}k_norm.weight"), hd, Elementwise::PlusOne)?;
        let (nih, ihd) = (cfg.indexer_n_heads, cfg.indexer_head_dim);
        let qk = format!("{sa}indexer.index_qk_proj.weight");
        expect_shape(p.ckpt, &qk, &[(nih + 1) * ihd, d])?;
        let ft = if p.out_type == OutType::Q8_0 { p.float_type() } else { p.matrix_type(d as u64) };
        p.push_weight(
            format!("{b}.indexer.q_proj.weight"),
            vec![d as u64, (nih * ihd) as u64],
            ft,
            Recipe::RowRange { src: qk.clone(), rows: 0..nih * ihd },
        );
        p.push_weight(
            format!("{b}.indexer.k_proj.weight"),
            vec![d as u64, ihd as u64],
            ft,
            Recipe::RowRange { src: qk, rows: nih * ihd..(nih + 1) * ihd },
        );
        p.vector(
            format!("{b}.indexer.q_norm.weight"),
            format!("{sa}indexer.q_layernorm.weight"),
            ihd,
            Elementwise::PlusOne,
        )?;
        p.vector(
            format!("{b}.indexer.k_norm.weight"),
            format!("{sa}indexer.k_layernorm.weight"),
            ihd,
            Elementwise::PlusOne,
        )?;
    }
    // MoE.
    let (e, ff, sff) = (cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size);
    let mlp = format!("{hf}mlp.");
    expect_shape(p.ckpt, &format!("{mlp}gate.weight"), &[e, d])?;
    p.push(
        format!("{b}.ffn_gate_inp.weight"),
        vec![d as u64, e as u64],
        GgmlType::F32,
        Recipe::Plain { src: format!("{mlp}gate.weight") },
        Elementwise::None,
    );
    let fused = format!("{mlp}experts.gate_up_proj");
    let gt = p.matrix_type(d as u64);
    let dt = p.matrix_type(ff as u64);
    if p.ckpt.get(&fused).is_some() {
        expect_shape(p.ckpt, &fused, &[e, 2 * ff, d])?;
        p.push_weight(
            format!("{b}.ffn_gate_exps.weight"),
            vec![d as u64, ff as u64, e as u64],
            gt,
            Recipe::StackRows { src: fused.clone(), n: e, rows_per: 2 * ff, take: 0..ff },
        );
        p.push_weight(
            format!("{b}.ffn_up_exps.weight"),
            vec![d as u64, ff as u64, e as u64],
            gt,
            Recipe::StackRows { src: fused, n: e, rows_per: 2 * ff, take: ff..2 * ff },
        );
        let down = format!("{mlp}experts.down_proj");
        expect_shape(p.ckpt, &down, &[e, d, ff])?;
        p.push_weight(
            format!("{b}.ffn_down_exps.weight"),
            vec![ff as u64, d as u64, e as u64],
            dt,
            Recipe::Plain { src: down },
        );
    } else {
        for (proj, gg, rows, cols, ty) in [
            ("gate_proj", "ffn_gate_exps", ff, d, gt),
            ("up_proj", "ffn_up_exps", ff, d, gt),
            ("down_proj", "ffn_down_exps", d, ff, dt),
        ] {
            let srcs: Vec<String> = (0..e).map(|x| format!("{mlp}experts.{x}.{proj}.weight")).collect();
            for sname in &srcs {
                expect_shape(p.ckpt, sname, &[rows, cols])?;
            }
            p.push_weight(
                format!("{b}.{gg}.weight"),
                vec![cols as u64, rows as u64, e as u64],
                ty,
                Recipe::Concat { srcs },
            );
        }
    }
    p.matrix(format!("{b}.ffn_gate_shexp.weight"), format!("{mlp}shared_expert.gate_proj.weight"), sff, d)?;
    p.matrix(format!("{b}.ffn_up_shexp.weight"), format!("{mlp}shared_expert.up_proj.weight"), sff, d)?;
    p.matrix(format!("{b}.ffn_down_shexp.weight"), format!("{mlp}shared_expert.down_proj.weight"), d, sff)?;
    p.vector(
        format!("{b}.ffn_gate_inp_shexp.weight"),
        format!("{mlp}shared_expert_gate.weight"),
        d,
        Elementwise::None,
    )?;
    Ok(())
}

fn ple_prefix(hf: &str) -> String {
    format!("{hf}ple.")
}

fn plan_ple(p: &mut Planner, cfg: &HfTextConfig, hf: &str, i: usize) -> Result<(), ConvertError> {
    let d = cfg.hidden_size;
    let hc = cfg.hc_count * d;
    let pe = cfg.ple_embed_dim;
    let pp = ple_prefix(hf);
    let b = format!("blk.{i}");
    p.matrix(format!("{b}.ple_key.weight"), format!("{pp}key_proj.weight"), hc, pe)?;
    p.matrix(format!("{b}.ple_value.weight"), format!("{pp}value_proj.weight"), d, pe)?;
    for n in ["norm_key", "norm_query", "norm_conv"] {
        p.vector(format!("{b}.ple_{n}.weight"), format!("{pp}{n}.weight"), hc, Elementwise::PlusOne)?;
    }
    expect_shape(p.ckpt, &format!("{pp}conv1d.weight"), &[hc, 1, cfg.ple_conv_kernel_size])?;
    p.push(
        format!("{b}.ple_conv1d.weight"),
        vec![cfg.ple_conv_kernel_size as u64, hc as u64],
        GgmlType::F32,
        Recipe::Plain { src: format!("{pp}conv1d.weight") },
        Elementwise::None,
    );
    // The n-gram table: one tensor or shards `shard_{k}` concatenated in shard order.
    let heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram;
    if heads == 0 || !pe.is_multiple_of(heads) {
        return Err(ConvertError::Config(format!("ple_embed_dim {pe} is not divisible by {heads} n-gram heads")));
    }
    let hd = pe / heads;
    let emb = format!("{pp}ple_embedding.ngram_embedding");
    let srcs: Vec<String> = if p.ckpt.get(&format!("{emb}.weight")).is_some() {
        vec![format!("{emb}.weight")]
    } else {
        let mut v = Vec::new();
        while p.ckpt.get(&format!("{emb}.shard_{}.weight", v.len())).is_some() {
            v.push(format!("{emb}.shard_{}.weight", v.len()));
        }
        if v.is_empty() {
            return Err(ConvertError::Missing { name: format!("{emb}.shard_0.weight") });
        }
        v
    };
    let mut rows = 0usize;
    for sname in &srcs {
        let t = shape_of(p.ckpt, sname)?;
        if t.shape.len() != 2 || t.shape[1] != hd {
            return Err(ConvertError::Shape { name: sname.clone(), expected: vec![0, hd], actual: t.shape.clone() });
        }
        rows += t.shape[0];
    }
    let ty = p.matrix_type(hd as u64);
    p.push_weight("per_layer_token_embd.weight".into(), vec![hd as u64, rows as u64], ty, Recipe::Concat { srcs });
    Ok(())
}

fn write_metadata(
    w: &mut GgufWriter,
    cfg: &HfTextConfig,
    ckpt: &Checkpoint,
    names: &Names,
    opts: &ConvertOptions,
    has_mtp: bool,
) -> Result<(), ConvertError> {
    let a = "qwen4exp";
    let n_blocks = cfg.num_hidden_layers + has_mtp as usize;
    w.add_kv("general.architecture", a)?;
    w.add_kv(
        "general.name",
        opts.name
            .clone()
            .unwrap_or_else(|| ckpt.dir().file_name().map_or("qwen4exp".into(), |n| n.to_string_lossy().into_owned()))
            .as_str(),
    )?;
    let file_type = match (&opts.recipe, opts.out_type) {
        (Some(r), _) => r.file_type(),
        (None, OutType::F32) => 0u32,
        (None, OutType::F16) => 1,
        (None, OutType::Q8_0) => 7,
        (None, OutType::Bf16) => 32,
    };
    w.add_kv("general.file_type", file_type)?;
    let u = |x: usize| x as u32;
    w.add_kv(format!("{a}.block_count"), u(n_blocks))?;
    w.add_kv(format!("{a}.context_length"), u(cfg.max_position_embeddings))?;
    w.add_kv(format!("{a}.embedding_length"), u(cfg.hidden_size))?;
    w.add_kv(format!("{a}.attention.head_count"), u(cfg.num_attention_heads))?;
    w.add_kv(format!("{a}.attention.head_count_kv"), u(cfg.num_key_value_heads))?;
    w.add_kv(format!("{a}.attention.key_length"), u(cfg.head_dim))?;
    w.add_kv(format!("{a}.attention.value_length"), u(cfg.head_dim))?;
    w.add_kv(format!("{a}.attention.layer_norm_rms_epsilon"), cfg.rms_norm_eps as f32)?;
    w.add_kv(format!("{a}.rope.freq_base"), cfg.rope_theta as f32)?;
    w.add_kv(format!("{a}.rope.dimension_count"), u(cfg.rope_dim()))?;
    let mut sections: Vec<i32> = cfg.mrope_section.iter().map(|&x| x as i32).collect();
    sections.resize(4, 0);
    w.add_kv(format!("{a}.rope.dimension_sections"), sections)?;
    w.add_kv(format!("{a}.expert_count"), u(cfg.num_experts))?;
    w.add_kv(format!("{a}.expert_used_count"), u(cfg.num_experts_per_tok))?;
    w.add_kv(format!("{a}.expert_feed_forward_length"), u(cfg.moe_intermediate_size))?;
    w.add_kv(format!("{a}.expert_shared_feed_forward_length"), u(cfg.shared_expert_intermediate_size))?;
    w.add_kv(format!("{a}.ssm.conv_kernel"), u(cfg.linear_conv_kernel_dim))?;
    w.add_kv(format!("{a}.ssm.state_size"), u(cfg.linear_key_head_dim))?;
    w.add_kv(format!("{a}.ssm.group_count"), u(cfg.linear_num_key_heads))?;
    w.add_kv(format!("{a}.ssm.time_step_rank"), u(cfg.linear_num_value_heads))?;
    w.add_kv(format!("{a}.ssm.inner_size"), u(cfg.linear_num_value_heads * cfg.linear_value_head_dim))?;
    if cfg.output_gate_type != "sigmoid" {
        w.add_kv(format!("{a}.ssm.gate_activation"), cfg.output_gate_type.as_str())?;
    }
    w.add_kv(format!("{a}.full_attention_interval"), u(cfg.full_attention_interval))?;
    let pattern: Vec<bool> = (0..cfg.num_hidden_layers).map(|i| (i + 1) % cfg.full_attention_interval != 0).collect();
    if pattern != cfg.recurrent {
        let mut rec = cfg.recurrent.clone();
        if has_mtp {
            rec.push(false);
        }
        w.add_kv(
            format!("{a}.attention.recurrent_layers"),
            MetadataValue::Array(MetadataArray::new(
                ValueType::Bool,
                rec.into_iter().map(MetadataValue::Bool).collect(),
            )),
        )?;
    }
    w.add_kv(format!("{a}.hyper_connection.count"), u(cfg.hc_count))?;
    w.add_kv(format!("{a}.hyper_connection.low_rank"), u(cfg.hc_lowrank))?;
    w.add_kv(format!("{a}.attention.indexer.head_count"), u(cfg.indexer_n_heads))?;
    w.add_kv(format!("{a}.attention.indexer.key_length"), u(cfg.indexer_head_dim))?;
    w.add_kv(format!("{a}.attention.indexer.top_k"), u(cfg.indexer_budget))?;
    let mut ratios: Vec<i32> =
        cfg.recurrent.iter().map(|&r| if r { 0 } else { cfg.indexer_compress_ratio as i32 }).collect();
    if has_mtp {
        ratios.push(0);
        w.add_kv(format!("{a}.nextn_predict_layers"), 1u32)?;
    }
    w.add_kv(format!("{a}.attention.compress_ratios"), ratios)?;
    if !cfg.ple_layer_ids.is_empty() {
        if cfg.ple_layer_ids.len() != 1 {
            return Err(ConvertError::Config(format!(
                "ple_layer_ids {:?}: qwen4exp GGUF supports exactly one PLE layer",
                cfg.ple_layer_ids
            )));
        }
        let layer = cfg.ple_layer_ids[0] - 1;
        let eos = cfg.eos_token_id.ok_or_else(|| ConvertError::Config("PLE needs eos_token_id".into()))?;
        w.add_kv(format!("{a}.ple.layers"), vec![layer as i32])?;
        w.add_kv(format!("{a}.ple.ngram_size"), u(cfg.ngram_size))?;
        w.add_kv(format!("{a}.ple.heads_per_ngram"), u(cfg.heads_per_ngram))?;
        w.add_kv(format!("{a}.ple.conv_kernel"), u(cfg.ple_conv_kernel_size))?;
        w.add_kv(format!("{a}.ple.eos_token_id"), eos)?;
        w.add_kv(format!("{a}.ple.image_token_id"), cfg.image_token_id)?;
        let heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram;
        w.add_kv(format!("{a}.embedding_length_per_layer_input"), u(cfg.ple_embed_dim / heads))?;
        let pp = format!("{}ple_embedding.", ple_prefix(&names.t(&format!("layers.{layer}."))));
        for (hf, key) in [
            ("layer_multipliers", "layer_multipliers"),
            ("ngram_heads_offsets", "head_offsets"),
            ("ngram_heads_vocab_sizes", "head_vocab_sizes"),
        ] {
            let vals = ckpt.read_i64(&format!("{pp}{hf}"))?;
            let vals: Vec<u64> = vals
                .into_iter()
                .map(|x| {
                    u64::try_from(x).map_err(|_| ConvertError::Config(format!("{pp}{hf} holds a negative value {x}")))
                })
                .collect::<Result<_, _>>()?;
            w.add_kv(format!("{a}.ple.{key}"), vals)?;
        }
    }
    Ok(())
}

/// Writes `tokenizer.ggml.*` and `tokenizer.chat_template` when the directory has `tokenizer.json`.
fn write_tokenizer(w: &mut GgufWriter, dir: &Path, vocab_size: usize) -> Result<bool, ConvertError> {
    let tj = dir.join("tokenizer.json");
    if !tj.exists() {
        return Ok(false);
    }
    let bytes = std::fs::read(&tj).map_err(|e| ConvertError::Io { path: tj.clone(), source: e })?;
    let mut vocab = crate::text::tokenizer::GgufVocab::from_tokenizer_json(&bytes, vocab_size)
        .map_err(|e| ConvertError::Tokenizer(e.to_string()))?;
    // eos/bos/pad and add_bos live in tokenizer_config.json, not tokenizer.json.
    let tc = dir.join("tokenizer_config.json");
    if tc.exists() {
        let cfg = std::fs::read(&tc).map_err(|e| ConvertError::Io { path: tc.clone(), source: e })?;
        vocab.apply_tokenizer_config(&cfg).map_err(|e| ConvertError::Tokenizer(format!("{}: {e}", tc.display())))?;
    }
    w.add_kv("tokenizer.ggml.model", vocab.model.as_str())?;
    w.add_kv("tokenizer.ggml.pre", vocab.pre.as_str())?;
    w.add_kv("tokenizer.ggml.tokens", vocab.tokens.iter().map(String::as_str).collect::<Vec<_>>())?;
    w.add_kv("tokenizer.ggml.token_type", vocab.token_types.clone())?;
    w.add_kv("tokenizer.ggml.merges", vocab.merges.iter().map(String::as_str).collect::<Vec<_>>())?;
    if let Some(id) = vocab.eos_token_id {
        w.add_kv("tokenizer.ggml.eos_token_id", id)?;
    }
    if let Some(id) = vocab.bos_token_id {
        w.add_kv("tokenizer.ggml.bos_token_id", id)?;
    }
    if let Some(id) = vocab.padding_token_id {
        w.add_kv("tokenizer.ggml.padding_token_id", id)?;
    }
    w.add_kv("tokenizer.ggml.add_bos_token", vocab.add_bos_token)?;
    let template = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
        Ok(t) => Some(t),
        Err(_) => std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v.get("chat_template").and_then(|c| c.as_str()).map(str::to_string)),
    };
    if let Some(t) = template {
        w.add_kv("tokenizer.chat_template", t.as_str())?;
    }
    Ok(true)
}

/// Elements read per chunk of a large source (bounds memory for the n-gram table and fused experts).
const CHUNK_ELEMS: usize = 1 << 24;

fn write_tensor(
    data: &mut TensorDataWriter,
    ckpt: &Checkpoint,
    t: &OutTensor,
    imx: Option<ImatrixRows<'_>>,
) -> Result<u64, ConvertError> {
    let ne0 = t.dims[0] as usize;
    data.begin_tensor(&t.name)?;
    let mut written = 0u64;
    let mut rows_done = 0usize;
    let mut emit = |vals: Vec<f32>| -> Result<(), ConvertError> {
        let mut vals = vals;
        match t.transform {
            Elementwise::None => {}
            Elementwise::PlusOne => vals.iter_mut().for_each(|v| *v += 1.0),
            Elementwise::NegExp => vals.iter_mut().for_each(|v| *v = -v.exp()),
        }
        let bytes = encode(&vals, t.ty, ne0, imx.map(|m| (m, rows_done)));
        rows_done += vals.len() / ne0;
        written += bytes.len() as u64;
        data.write_chunk(&bytes)?;
        Ok(())
    };
    let src_t = |name: &str| shape_of(ckpt, name);
    match &t.recipe {
        Recipe::Plain { src } => {
            let s = src_t(src)?;
            let total = s.numel();
            let step = (CHUNK_ELEMS / ne0).max(1) * ne0;
            let mut start = 0;
            while start < total {
                let len = step.min(total - start);
                emit(ckpt.read_f32(src, s, start, len)?)?;
                start += len;
            }
        }
        Recipe::RowPermute { src, offset, block, perm } => {
            let s = src_t(src)?;
            let row = s.numel() / s.shape[0];
            let all = ckpt.read_f32(src, s, 0, s.numel())?;
            let mut out = Vec::with_capacity(all.len());
            out.extend_from_slice(&all[..offset * row]);
            for &pb in perm {
                let b0 = (offset + pb * block) * row;
                out.extend_from_slice(&all[b0..b0 + block * row]);
            }
            emit(out)?;
        }
        Recipe::ColPermute { src, block, perm } => {
            let s = src_t(src)?;
            let all = ckpt.read_f32(src, s, 0, s.numel())?;
            let cols = s.shape[1];
            let mut out = Vec::with_capacity(all.len());
            for row in all.chunks_exact(cols) {
                for &pb in perm {
                    out.extend_from_slice(&row[pb * block..(pb + 1) * block]);
                }
            }
            emit(out)?;
        }
        Recipe::RowRange { src, rows } => {
            let s = src_t(src)?;
            let cols = s.numel() / s.shape[0];
            emit(ckpt.read_f32(src, s, rows.start * cols, rows.len() * cols)?)?;
        }
        Recipe::StackRows { src, n, rows_per, take } => {
            let s = src_t(src)?;
            let cols = s.shape[2];
            for e in 0..*n {
                emit(ckpt.read_f32(src, s, (e * rows_per + take.start) * cols, take.len() * cols)?)?;
            }
        }
        Recipe::Concat { srcs } => {
            for src in srcs {
                let s = src_t(src)?;
                let total = s.numel();
                let step = (CHUNK_ELEMS / ne0).max(1) * ne0;
                let mut start = 0;
                while start < total {
                    let len = step.min(total - start);
                    emit(ckpt.read_f32(src, s, start, len)?)?;
                    start += len;
                }
            }
        }
        Recipe::ConcatCols { srcs } => {
            let parts: Vec<(Vec<f32>, usize)> = srcs
                .iter()
                .map(|src| {
                    let s = src_t(src)?;
                    Ok((ckpt.read_f32(src, s, 0, s.numel())?, s.shape[1]))
                })
                .collect::<Result<_, ConvertError>>()?;
            let rows = parts[0].0.len() / parts[0].1;
            let mut out = Vec::with_capacity(rows * ne0);
            for r in 0..rows {
                for (vals, c) in &parts {
                    out.extend_from_slice(&vals[r * c..(r + 1) * c]);
                }
            }
            emit(out)?;
        }
    }
    data.end_tensor()?;
    Ok(written)
}

/// A tensor's importance-matrix weights: `weights` (one row of `cols` per matrix) for matrices of `rows_per_mat`
/// rows.
#[derive(Clone, Copy)]
pub(crate) struct ImatrixRows<'a> {
    weights: &'a [f32],
    rows_per_mat: usize,
}

/// The importance-matrix weights of tensor `name` (ggml dims `dims`: `[cols, rows]` or `[cols, rows, experts]`)
/// when it is written in the quantized type `ty` whose quantizer weights its fit; `None` without a matrix, an
/// entry, or such a type.
pub(crate) fn imatrix_rows<'a>(
    m: Option<&'a ImportanceMatrix>,
    name: &str,
    dims: &[u64],
    ty: GgmlType,
) -> Result<Option<ImatrixRows<'a>>, ConvertError> {
    let Some(m) = m else { return Ok(None) };
    if dims.len() < 2 || !quantize::uses_importance(ty) {
        return Ok(None);
    }
    let mats = dims[2..].iter().product::<u64>() as usize;
    Ok(m.weights(name, dims[0] as usize, mats)?.map(|weights| ImatrixRows { weights, rows_per_mat: dims[1] as usize }))
}

/// Refuses an importance matrix none of whose entries matches a quantized tensor (made for another model, or
/// for a recipe that quantizes nothing it covers); prints how many it covers otherwise.
pub(crate) fn check_imatrix_used(m: &ImportanceMatrix, used: usize) -> Result<(), ConvertError> {
    if used == 0 {
        return Err(ConvertError::Input {
            path: m.path.clone(),
            problem: format!(
                "importance matrix: none of its {} entries names a tensor this conversion quantizes (made for another \
                 model?)",
                m.len()
            ),
        });
    }
    eprintln!("importance matrix: applied to {used} quantized tensors ({} entries in the file)", m.len());
    Ok(())
}

/// Writes llama.cpp's provenance keys for a quantization with the importance matrix `m` (`entries_count`: the
/// entries in the file, as `llama-quantize` writes it).
pub(crate) fn add_imatrix_metadata(w: &mut GgufWriter, m: &ImportanceMatrix) -> Result<(), GgufError> {
    w.add_kv("quantize.imatrix.file", m.path.display().to_string().as_str())?;
    if !m.datasets.is_empty() {
        w.add_kv("quantize.imatrix.dataset", m.datasets.join(", ").as_str())?;
    }
    w.add_kv("quantize.imatrix.entries_count", m.len() as i32)?;
    w.add_kv("quantize.imatrix.chunks_count", m.chunks as i32)
}

/// Encodes whole rows of `ne0` values in `ty` (rows quantized in parallel). With `imx = Some((weights, row0))`
/// the rows are rows `row0..` of their tensor, each quantized with its matrix's importance weights.
fn encode(vals: &[f32], ty: GgmlType, ne0: usize, imx: Option<(ImatrixRows<'_>, usize)>) -> Vec<u8> {
    let quantize = |vals: &[f32], w: Option<&[f32]>| {
        quantize::quantize_tensor(ty, vals, ne0, w)
            .unwrap_or_else(|e| unreachable!("the planner only picks writable types with whole blocks: {e}"))
    };
    match ty {
        GgmlType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => vals.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        GgmlType::BF16 => vals.iter().flat_map(|v| f32_to_bf16_bits(*v).to_le_bytes()).collect(),
        _ => match imx {
            None => quantize(vals, None),
            Some((m, row0)) => {
                // Runs of rows within one matrix, each with that matrix's weights.
                let rows = vals.len() / ne0;
                let per = m.rows_per_mat.max(1);
                let mut out = Vec::new();
                let mut r = 0;
                while r < rows {
                    let mat = (row0 + r) / per;
                    let end = ((mat + 1) * per - row0).min(rows);
                    let w = &m.weights[mat * ne0..(mat + 1) * ne0];
                    out.extend(quantize(&vals[r * ne0..end * ne0], Some(w)));
                    r = end;
                }
                out
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_head_permutation_matches_the_format_doc() {
        // 16 key heads, 48 value heads: GGUF head j' = v*16 + k holds HF head k*3 + v.
        let p = value_head_perm(16, 48);
        assert_eq!(p[0], 0);
        assert_eq!(p[1], 3);
        assert_eq!(p[16], 1);
        assert_eq!(p[47], 15 * 3 + 2);
        let mut sorted = p.clone();
        sorted.sort();
        assert_eq!(sorted, (0..48).collect::<Vec<_>>());
    }
}
