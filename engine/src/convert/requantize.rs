//! `nebula convert --recipe R model.gguf -o out.gguf`: a GGUF requantized with a recipe (as llama.cpp's
//! `llama-quantize` does): metadata copied (with the new `general.file_type`), every weight that llama.cpp
//! would quantize (`tensor_allows_quantization` in `llama-quant.cpp`: 2-D or 3-D, named `*weight`, not a norm,
//! not `ffn_gate_inp`, not `ssm_conv1d`) decoded to `f32` and written in the recipe's type, everything else
//! copied byte for byte. Requantizing an already-quantized file adds the new rounding to the old one.

use std::path::Path;

use super::recipe::{QuantRecipe, RecipeContext};
use super::{
    ConvertError, ConvertReport, ImportanceMatrix, add_imatrix_metadata, check_imatrix_used, encode, imatrix_rows,
};
use crate::gguf::{GgmlType, GgufFile, GgufWriter, TensorInfo};
use crate::quant::{SUPPORTED, row_kernels};

/// Whether llama.cpp's `llama-quantize` would quantize this tensor.
fn allows_quantization(t: &TensorInfo) -> bool {
    let n = t.name.as_str();
    t.dims.len() >= 2
        && n.ends_with("weight")
        && !n.contains("_norm.weight")
        && !n.contains("ffn_gate_inp")
        && !n.contains("ssm_conv1d")
        && SUPPORTED.contains(&t.ggml_type)
}

/// Rows decoded per chunk (bounds memory for the n-gram table).
const CHUNK_VALUES: usize = 1 << 24;

/// Requantizes the GGUF `input` into `out` with `recipe`.
pub fn requantize(input: &Path, out: &Path, recipe: &QuantRecipe) -> Result<ConvertReport, ConvertError> {
    requantize_with(input, out, recipe, None)
}

/// [`requantize`] with an optional importance matrix (`nebula convert --imatrix`): every tensor it has an entry
/// for is fitted with those column weights (per expert for 3-D expert tensors), the recipe takes its
/// with-imatrix choices, and the output records the matrix as llama.cpp's `quantize.imatrix.*` keys (the input's
/// keys are never copied: they described the old rounding). An entry whose length fits no tensor shape, or a
/// matrix none of whose entries is used, is an error before anything is written.
pub fn requantize_with(
    input: &Path,
    out: &Path,
    recipe: &QuantRecipe,
    imatrix: Option<&ImportanceMatrix>,
) -> Result<ConvertReport, ConvertError> {
    let f = GgufFile::open(input)?;
    let arch = f.architecture()?.to_string();
    let blocks = f.metadata().get_u32(&format!("{arch}.block_count"))? as usize;
    let nextn = f.metadata().get_u32_opt(&format!("{arch}.nextn_predict_layers"))?.unwrap_or(0) as usize;
    let ctx = RecipeContext { n_layers: blocks - nextn, mtp: nextn > 0, has_imatrix: imatrix.is_some() };
    super::check_recipe(recipe, imatrix.is_some())?;
    let mut w = GgufWriter::create(out, f.alignment() as u32)?;
    for (k, v) in f.metadata().iter() {
        if k.starts_with("split.")
            || k == "general.alignment"
            || k == "general.file_type"
            || k.starts_with("quantize.imatrix.")
        {
            continue;
        }
        w.add_kv(k, v.clone())?;
    }
    w.add_kv("general.file_type", recipe.file_type())?;
    let plan: Vec<(&TensorInfo, GgmlType)> = f
        .tensors()
        .map(|t| (t, if allows_quantization(t) { recipe.tensor_type(&t.name, &t.dims, &ctx) } else { t.ggml_type }))
        .collect();
    for (t, ty) in &plan {
        if *ty != t.ggml_type {
            super::check_writable(&t.name, *ty)?;
        }
        w.add_tensor(t.name.clone(), &t.dims, *ty)?;
    }
    let weights = plan
        .iter()
        .map(|(t, ty)| if *ty == t.ggml_type { Ok(None) } else { imatrix_rows(imatrix, &t.name, &t.dims, *ty) })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(m) = imatrix {
        check_imatrix_used(m, weights.iter().filter(|x| x.is_some()).count())?;
        add_imatrix_metadata(&mut w, m)?;
    }
    let mut data = w.begin_data()?;
    let mut data_bytes = 0u64;
    for ((t, ty), imx) in plan.iter().zip(weights) {
        let src = f.tensor_data(t);
        data.begin_tensor(&t.name)?;
        if *ty == t.ggml_type {
            data.write_chunk(src)?;
            data_bytes += src.len() as u64;
        } else {
            let ne0 = t.dims[0] as usize;
            let k = row_kernels(t.ggml_type).map_err(|e| ConvertError::Input {
                path: input.to_path_buf(),
                problem: format!("tensor '{}': {e}", t.name),
            })?;
            let row_bytes = ne0 / k.block_elems * k.block_bytes;
            let rows_per_chunk = (CHUNK_VALUES / ne0).max(1);
            for (c, chunk) in src.chunks(row_bytes * rows_per_chunk).enumerate() {
                let rows = chunk.len() / row_bytes;
                let mut vals = vec![0f32; rows * ne0];
                for (r, o) in vals.chunks_exact_mut(ne0).enumerate() {
                    (k.dequantize_row)(&chunk[r * row_bytes..(r + 1) * row_bytes], o);
                }
                let bytes = encode(&vals, *ty, ne0, imx.map(|m| (m, c * rows_per_chunk)));
                data_bytes += bytes.len() as u64;
                data.write_chunk(&bytes)?;
            }
        }
        data.end_tensor()?;
    }
    let files = data.finish()?;
    Ok(ConvertReport {
        files,
        tensors: plan.len(),
        data_bytes,
        mtp: nextn > 0,
        tokenizer: f.get("tokenizer.ggml.tokens").is_some(),
    })
}
