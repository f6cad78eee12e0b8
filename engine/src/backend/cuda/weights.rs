//! Weights in device memory and their upload: a matrix ([`DevMatrix`]) or a stack of same-shaped matrices
//! ([`DevStack`], a layer's routed experts), blocks as stored in the GGUF (quantized blocks stay quantized; the
//! kernels decode them in registers), and the views the launch helpers take ([`MatRef`], [`StackView`]).
//!
//! [`Uploader`] checks every tensor against what the kernels cover before anything is copied, naming the tensor.

use nebula_kernels::GpuError;
use nebula_kernels::cudarc::driver::CudaSlice;

use super::CudaError;
use super::device::{Arg, Dev, ptr, type_suffix};
use crate::gguf::GgmlType;
use crate::model::Qwen4Exp;
use crate::quant::Matrix;

/// A weight matrix in device memory, blocks as stored in the GGUF.
pub(crate) struct DevMatrix {
    pub(crate) ty: GgmlType,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) row_bytes: usize,
    pub(crate) data: CudaSlice<u8>,
}

impl DevMatrix {
    /// The whole matrix by address.
    pub(crate) fn view(&self, dev: &Dev) -> MatRef {
        MatRef {
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
            row_bytes: self.row_bytes,
            ptr: ptr(&self.data, dev.stream(), 0),
        }
    }
}

/// A stack of same-shaped matrices (the routed experts of a layer), `rows * row_bytes` apart.
pub(crate) struct DevStack {
    pub(crate) ty: GgmlType,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) row_bytes: usize,
    pub(crate) data: CudaSlice<u8>,
}

impl DevStack {
    pub(crate) fn view(&self, dev: &Dev) -> StackView {
        StackView {
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
            row_bytes: self.row_bytes,
            ptr: ptr(&self.data, dev.stream(), 0),
        }
    }

    /// The launch arguments every routed-expert kernel takes after the weights: bytes per expert, bytes per
    /// row, rows, columns.
    pub(crate) fn shape_args(&self) -> [Arg; 4] {
        [
            Arg::I64(self.expert_bytes() as i64),
            Arg::I64(self.row_bytes as i64),
            Arg::I32(self.rows as i32),
            Arg::I32(self.cols as i32),
        ]
    }

    fn expert_bytes(&self) -> usize {
        self.rows * self.row_bytes
    }

    /// The matrices the stack holds (its bytes over one matrix's).
    pub(crate) fn count(&self) -> usize {
        self.data.len() / self.expert_bytes().max(1)
    }
}

/// A matrix by address (a whole [`DevMatrix`], one matrix of a [`DevStack`], or rows of a stacked matrix).
#[derive(Clone, Copy)]
pub(crate) struct MatRef {
    pub(crate) ty: GgmlType,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) row_bytes: usize,
    pub(crate) ptr: u64,
}

impl MatRef {
    /// The first `rows` rows.
    pub(crate) fn top(self, rows: usize) -> MatRef {
        MatRef { rows, ..self }
    }

    /// The rows after the first `rows` (the second matrix of a stack of two).
    pub(crate) fn below(self, rows: usize) -> MatRef {
        MatRef { ptr: self.ptr + (rows * self.row_bytes) as u64, rows: self.rows - rows, ..self }
    }
}

/// One stack of expert matrices by address: `ty`/`rows`/`cols`/`row_bytes` per matrix, consecutive matrices
/// `rows * row_bytes` apart from `ptr` (the resident stack or a staging buffer).
#[derive(Clone, Copy)]
pub(crate) struct StackView {
    pub(crate) ty: GgmlType,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) row_bytes: usize,
    pub(crate) ptr: u64,
}

impl StackView {
    /// Bytes per matrix, bytes per row, rows, columns (the kernels' shape arguments).
    pub(crate) fn shape_args(&self) -> [Arg; 4] {
        [
            Arg::I64((self.rows * self.row_bytes) as i64),
            Arg::I64(self.row_bytes as i64),
            Arg::I32(self.rows as i32),
            Arg::I32(self.cols as i32),
        ]
    }
}

/// Copies weights to the device, counting the bytes. Every matrix is named by its GGUF tensor name
/// (`blk.3.ffn_down_exps`) so that a type or shape the kernels do not take is reported with it.
pub(crate) struct Uploader<'a> {
    pub(crate) dev: &'a Dev,
    pub(crate) bytes: usize,
}

impl Uploader<'_> {
    /// Checks that the kernels cover `m`'s type and row width.
    ///
    /// Errors: [`GpuError::UnsupportedType`] naming `tensor`; [`CudaError::Unsupported`] for a row width the
    /// float kernels cannot vectorise.
    pub(crate) fn check_shape(m: &Matrix, tensor: &str) -> Result<(), CudaError> {
        Self::check_type(m, tensor)?;
        let cols = m.cols();
        let ok = match m.ggml_type() {
            GgmlType::F32 => cols.is_multiple_of(4),
            GgmlType::F16 | GgmlType::BF16 => cols.is_multiple_of(4) && (cols < 32 || cols.is_multiple_of(8)),
            _ => true,
        };
        if !ok {
            return Err(CudaError::Unsupported(format!(
                "{tensor}: rows of {cols} values (need a multiple of 4, or 8 for 16-bit floats)"
            )));
        }
        Ok(())
    }

    fn check_type(m: &Matrix, tensor: &str) -> Result<(), CudaError> {
        match type_suffix(m.ggml_type()) {
            Ok(_) => Ok(()),
            Err(GpuError::UnsupportedType { type_name, .. }) => {
                Err(GpuError::UnsupportedType { type_name, tensor: Some(tensor.to_string()) }.into())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// A matrix the GEMV kernels multiply, tensor `tensor`.
    pub(crate) fn matrix(&mut self, m: &Matrix, tensor: &str) -> Result<DevMatrix, CudaError> {
        Self::check_shape(m, tensor)?;
        self.upload(m)
    }

    /// A lookup table (read by `get_rows`, never multiplied): any row width.
    pub(crate) fn table(&mut self, m: &Matrix, tensor: &str) -> Result<DevMatrix, CudaError> {
        Self::check_type(m, tensor)?;
        self.upload(m)
    }

    fn upload(&mut self, m: &Matrix) -> Result<DevMatrix, CudaError> {
        self.bytes += m.bytes().len();
        Ok(DevMatrix {
            ty: m.ggml_type(),
            rows: m.rows(),
            cols: m.cols(),
            row_bytes: m.row_bytes(),
            data: self.dev.stream().clone_htod(m.bytes())?,
        })
    }

    /// An f32 vector (norm weights, conv taps, biases).
    pub(crate) fn vector(&mut self, v: &[f32]) -> Result<CudaSlice<f32>, CudaError> {
        self.bytes += v.len() * 4;
        Ok(self.dev.stream().clone_htod(v)?)
    }

    /// The matrices `ms` back to back (possibly none: the shape is `like`'s, one byte is allocated), tensor
    /// `tensor`.
    pub(crate) fn stack(&mut self, ms: &[&Matrix], like: &Matrix, tensor: &str) -> Result<DevStack, CudaError> {
        let first = ms.first().copied().unwrap_or(like);
        Self::check_shape(first, tensor)?;
        let mut all = Vec::with_capacity(first.bytes().len() * ms.len());
        for m in ms {
            all.extend_from_slice(m.bytes());
        }
        if all.is_empty() {
            all.push(0);
        }
        self.bytes += all.len();
        Ok(DevStack {
            ty: first.ggml_type(),
            rows: first.rows(),
            cols: first.cols(),
            row_bytes: first.row_bytes(),
            data: self.dev.stream().clone_htod(&all)?,
        })
    }

    /// The matrices `ms` (tensors `tensors`) as one matrix of their rows one after another, when they share a
    /// type and a width (`None` otherwise): several products of one input in a single GEMV.
    pub(crate) fn stacked(&mut self, ms: &[&Matrix], tensors: &[&str]) -> Result<Option<DevMatrix>, CudaError> {
        let first = ms[0];
        if ms.iter().any(|m| m.ggml_type() != first.ggml_type() || m.cols() != first.cols()) {
            return Ok(None);
        }
        Self::check_shape(first, tensors[0])?;
        let all: Vec<u8> = ms.iter().flat_map(|m| m.bytes().iter().copied()).collect();
        self.bytes += all.len();
        Ok(Some(DevMatrix {
            ty: first.ggml_type(),
            rows: ms.iter().map(|m| m.rows()).sum(),
            cols: first.cols(),
            row_bytes: first.row_bytes(),
            data: self.dev.stream().clone_htod(&all)?,
        }))
    }

    /// `a` and `b` as one stacked matrix when they share a type and width ([`Self::stacked`]): `(stack, None)`;
    /// else each on its own: `(a, Some(b))`.
    pub(crate) fn pair(
        &mut self,
        a: (&Matrix, &str),
        b: (&Matrix, &str),
    ) -> Result<(DevMatrix, Option<DevMatrix>), CudaError> {
        Ok(match self.stacked(&[a.0, b.0], &[a.1, b.1])? {
            Some(both) => (both, None),
            None => (self.matrix(a.0, a.1)?, Some(self.matrix(b.0, b.1)?)),
        })
    }
}

/// Bytes of weights the CUDA model uploads (checked against the VRAM budget before allocating): the dense trunk
/// (every tensor of the file but the routed experts and the n-gram table; the MTP block with its experts, which
/// the hybrid model keeps on the host), the embedding, the table (all-GPU only), and the routed experts
/// `resident` holds (all when `None`).
pub(crate) fn estimate_weight_bytes(model: &Qwen4Exp, resident: Option<&[Vec<usize>]>) -> usize {
    let (dense, experts, table) = model.weight_bytes();
    let size =
        |e: &crate::model::moe::Expert| e.gate_proj.bytes().len() + e.up_proj.bytes().len() + e.down_proj.bytes().len();
    let held = match resident {
        Some(r) => {
            r.iter().zip(&model.layers).map(|(r, l)| r.iter().map(|&e| size(&l.mlp.experts[e])).sum::<usize>()).sum()
        }
        None => experts as usize,
    };
    // In hybrid mode (`resident` given) the n-gram table and the MTP block's routed experts stay on the host.
    let table = if resident.is_some() { 0 } else { table as usize };
    let mtp_experts = if resident.is_some() { model.mtp_routed_expert_bytes() as usize } else { 0 };
    (dense as usize + model.embed_tokens.bytes().len() + table + held).saturating_sub(mtp_experts)
}

#[cfg(test)]
mod tests {
    use super::Uploader;
    use crate::gguf::GgmlType;
    use crate::quant::{Matrix, WeightBytes};

    /// Every type the CPU reads has CUDA kernels, so every matrix passes the type check; a type without kernels
    /// (none a `Matrix` can hold now) is refused with the type named, before anything is copied (no GPU needed).
    #[test]
    fn every_cpu_type_passes_the_upload_check_and_others_are_named() {
        for ty in crate::quant::SUPPORTED {
            let cols = ty.block_size().max(32);
            let bytes = vec![0u8; crate::quant::row_bytes(ty, cols).unwrap()];
            let m = Matrix::new(ty, 1, cols, WeightBytes::from_vec(bytes)).unwrap();
            Uploader::check_shape(&m, "blk.3.ffn_down_exps").unwrap_or_else(|e| panic!("{}: {e}", ty.name()));
        }
        let e = super::type_suffix(GgmlType::TQ1_0).unwrap_err().to_string();
        assert_eq!(e, "the CUDA backend has no kernels for weight type TQ1_0");
        let f32_odd = Matrix::new(GgmlType::F32, 1, 6, WeightBytes::from_vec(vec![0; 24])).unwrap();
        let e = Uploader::check_shape(&f32_odd, "output").unwrap_err().to_string();
        assert!(e.contains("output") && e.contains("rows of 6 values"), "{e}");
        let q8 = Matrix::new(GgmlType::Q8_0, 1, 32, WeightBytes::from_vec(vec![0; 34])).unwrap();
        assert!(Uploader::check_shape(&q8, "token_embd").is_ok());
    }
}
