//! Loading and validating the model's tensors by their llama.cpp `qwen4exp` names.
//!
//! Every tensor is checked against the shape and types the model expects before any math runs; a wrong or
//! missing tensor is reported with its expected and actual shape and type (names and shapes:
//! llama.cpp's `qwen4exp` tensor names as `nebula convert` writes them, shapes in ggml order `[ne0, ne1, ...]`).

use std::sync::Arc;

use crate::gguf::{GgmlType, GgufFile, TensorInfo};
use crate::quant::{Matrix, WeightBytes, check_scales, dequantize_row, row_kernels};

use super::error::ModelError;

/// A tensor's bytes inside a shared GGUF file, usable as the owner of [`WeightBytes`].
struct TensorBytes {
    file: Arc<GgufFile>,
    info: TensorInfo,
}

impl AsRef<[u8]> for TensorBytes {
    fn as_ref(&self) -> &[u8] {
        self.file.tensor_data(&self.info)
    }
}

/// Hands out validated weights from one GGUF file.
///
/// Besides names, shapes and types, every quantized weight's block scales are checked once, as it is handed
/// out, to be finite ([`check_scales`]: one `f16` read per block, in parallel): a NaN or infinite scale is an
/// error naming the tensor, the row and the block, never silent garbage in the logits. The scan pages in the
/// whole weight, so on a model stored on a slow disk it costs one read of the file; `NEBULA_SKIP_SCALE_SCAN=1`
/// turns it off.
pub struct TensorLoader {
    file: Arc<GgufFile>,
    scan_scales: bool,
}

const FLOAT_TYPES: &str = "F32, F16 or BF16";

impl TensorLoader {
    /// A loader over `file`.
    pub fn new(file: Arc<GgufFile>) -> Self {
        let scan_scales = crate::tuning::cpu().scan_scales;
        Self { file, scan_scales }
    }

    /// Checks the block scales of `bytes` (whole rows of `cols` values of the tensor's type).
    fn scan(&self, info: &TensorInfo, bytes: &WeightBytes, cols: usize) -> Result<(), ModelError> {
        if !self.scan_scales {
            return Ok(());
        }
        check_scales(info.ggml_type, bytes.as_slice(), cols).map_err(|e| ModelError::TensorValue {
            file: self.file_name(),
            name: info.name.clone(),
            problem: e.to_string(),
        })
    }

    fn file_name(&self) -> String {
        self.file.path().display().to_string()
    }

    /// True when the file has a tensor called `name`.
    pub fn has(&self, name: &str) -> bool {
        self.file.tensor(name).is_some()
    }

    fn get(&self, name: &str, expected: &[u64], types: &str) -> Result<&TensorInfo, ModelError> {
        let info = self.file.tensor(name).ok_or_else(|| ModelError::MissingTensor {
            file: self.file_name(),
            name: name.to_string(),
            expected: expected.to_vec(),
            types: types.to_string(),
        })?;
        if info.dims != expected {
            return Err(ModelError::TensorShape {
                file: self.file_name(),
                name: name.to_string(),
                expected: expected.to_vec(),
                actual: info.dims.clone(),
            });
        }
        Ok(info)
    }

    fn bytes(&self, info: &TensorInfo) -> Result<WeightBytes, ModelError> {
        let len = self.file.tensor_data(info).len();
        WeightBytes::new(Arc::new(TensorBytes { file: self.file.clone(), info: info.clone() }), 0..len)
            .map_err(|source| ModelError::Quant { name: info.name.clone(), source })
    }

    fn wrong_type(&self, info: &TensorInfo, types: &str) -> ModelError {
        ModelError::TensorType {
            file: self.file_name(),
            name: info.name.clone(),
            actual: info.ggml_type.name().to_string(),
            types: types.to_string(),
        }
    }

    fn check_matrix_type(&self, info: &TensorInfo) -> Result<(), ModelError> {
        row_kernels(info.ggml_type).map(|_| ()).map_err(|e| self.wrong_type(info, &e.to_string()))
    }

    /// The `rows x cols` matrix `name` (GGUF shape `[cols, rows]`), in any type the CPU kernels support.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
        let info = self.get(name, &[cols as u64, rows as u64], "any supported weight type")?;
        self.check_matrix_type(info)?;
        let bytes = self.bytes(info)?;
        let m = Matrix::new(info.ggml_type, rows, cols, bytes.clone())
            .map_err(|source| ModelError::Quant { name: name.into(), source })?;
        self.scan(info, &bytes, cols)?;
        Ok(m)
    }

    /// A matrix of `cols` columns and at least `min_rows` rows (the n-gram table, whose row count is padded up to a
    /// multiple of 128 beyond the rows the hash heads can reach).
    pub fn matrix_min_rows(&self, name: &str, cols: usize, min_rows: u64) -> Result<Matrix, ModelError> {
        let info = self.file.tensor(name).ok_or_else(|| ModelError::MissingTensor {
            file: self.file_name(),
            name: name.to_string(),
            expected: vec![cols as u64, min_rows],
            types: "any supported weight type".into(),
        })?;
        if info.dims.len() != 2 || info.dims[0] != cols as u64 || info.dims[1] < min_rows {
            return Err(ModelError::TensorShape {
                file: self.file_name(),
                name: name.to_string(),
                expected: vec![cols as u64, min_rows],
                actual: info.dims.clone(),
            });
        }
        self.check_matrix_type(info)?;
        let bytes = self.bytes(info)?;
        let m = Matrix::new(info.ggml_type, info.dims[1] as usize, cols, bytes.clone())
            .map_err(|source| ModelError::Quant { name: name.into(), source })?;
        self.scan(info, &bytes, cols)?;
        Ok(m)
    }

    /// Like [`TensorLoader::matrix`] but must be `F32` (routers and gates that llama.cpp never quantizes).
    pub fn f32_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
        let info = self.get(name, &[cols as u64, rows as u64], "F32")?;
        if !matches!(info.ggml_type, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            return Err(self.wrong_type(info, FLOAT_TYPES));
        }
        let bytes = self.bytes(info)?;
        Matrix::new(info.ggml_type, rows, cols, bytes).map_err(|source| ModelError::Quant { name: name.into(), source })
    }

    /// The vector `name` of `len` values (F32, F16 or BF16), decoded to `f32` and checked to be finite.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        self.decoded(name, &[len as u64])
    }

    /// A small tensor of shape `dims` decoded to `f32` (row-major over ggml order: `ne0` fastest).
    pub fn decoded(&self, name: &str, dims: &[u64]) -> Result<Vec<f32>, ModelError> {
        let info = self.get(name, dims, FLOAT_TYPES)?;
        if !matches!(info.ggml_type, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            return Err(self.wrong_type(info, FLOAT_TYPES));
        }
        let n: u64 = dims.iter().product();
        let mut out = vec![0f32; n as usize];
        dequantize_row(info.ggml_type, self.file.tensor_data(info), &mut out)
            .map_err(|source| ModelError::Quant { name: name.into(), source })?;
        if let Some(i) = out.iter().position(|v| !v.is_finite()) {
            return Err(ModelError::TensorValue {
                file: self.file_name(),
                name: name.into(),
                problem: format!("value {} at index {i} is not finite", out[i]),
            });
        }
        Ok(out)
    }

    /// `n` stacked `rows x cols` matrices (GGUF shape `[cols, rows, n]`, e.g. the routed experts), one [`Matrix`]
    /// each, sharing the file's bytes.
    pub fn matrix_stack(&self, name: &str, rows: usize, cols: usize, n: usize) -> Result<Vec<Matrix>, ModelError> {
        let info = self.get(name, &[cols as u64, rows as u64, n as u64], "any supported weight type")?;
        self.split_stack(info, 0, rows, rows, cols, n)
    }

    /// Rows `[row0, row0 + rows)` of each of the `n` stacked `total_rows x cols` matrices in `info`.
    fn split_stack(
        &self,
        info: &TensorInfo,
        row0: usize,
        rows: usize,
        total_rows: usize,
        cols: usize,
        n: usize,
    ) -> Result<Vec<Matrix>, ModelError> {
        self.check_matrix_type(info)?;
        let bytes = self.bytes(info)?;
        let rb = crate::quant::row_bytes(info.ggml_type, cols)
            .map_err(|source| ModelError::Quant { name: info.name.clone(), source })?;
        let per = rb * total_rows;
        if bytes.len() != per * n {
            return Err(ModelError::Quant {
                name: info.name.clone(),
                source: crate::quant::QuantError::WrongSize {
                    what: "stack".into(),
                    expected: per * n,
                    found: bytes.len(),
                },
            });
        }
        if row0 == 0 {
            // one scan per tensor (a fused gate/up stack is split twice)
            self.scan(info, &bytes, cols)?;
        }
        (0..n)
            .map(|e| {
                let start = e * per + row0 * rb;
                let b = bytes
                    .slice(start..start + rows * rb)
                    .map_err(|source| ModelError::Quant { name: info.name.clone(), source })?;
                Matrix::new(info.ggml_type, rows, cols, b)
                    .map_err(|source| ModelError::Quant { name: info.name.clone(), source })
            })
            .collect()
    }

    /// Expert gate and up projections: separate `ffn_gate_exps` / `ffn_up_exps` tensors, or one fused
    /// `ffn_gate_up_exps` of `2 * rows` rows per expert with the gate rows first (llama.cpp
    /// `create_tensor_gate_up_exps`, HF `gate_up_proj`).
    pub fn expert_gate_up(
        &self,
        prefix: &str,
        rows: usize,
        cols: usize,
        n: usize,
    ) -> Result<(Vec<Matrix>, Vec<Matrix>), ModelError> {
        let fused = format!("{prefix}.ffn_gate_up_exps.weight");
        if let Some(info) = self.file.tensor(&fused) {
            let expected = [cols as u64, 2 * rows as u64, n as u64];
            if info.dims != expected {
                return Err(ModelError::TensorShape {
                    file: self.file_name(),
                    name: fused,
                    expected: expected.to_vec(),
                    actual: info.dims.clone(),
                });
            }
            let gate = self.split_stack(info, 0, rows, 2 * rows, cols, n)?;
            let up = self.split_stack(info, rows, rows, 2 * rows, cols, n)?;
            return Ok((gate, up));
        }
        Ok((
            self.matrix_stack(&format!("{prefix}.ffn_gate_exps.weight"), rows, cols, n)?,
            self.matrix_stack(&format!("{prefix}.ffn_up_exps.weight"), rows, cols, n)?,
        ))
    }
}
