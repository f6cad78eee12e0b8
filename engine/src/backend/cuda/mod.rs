//! The CUDA backend: every block of the model on the GPU, weights resident in VRAM (the "datacenter" case, and
//! the GPU half of the hybrid placement).
//!
//! [`CudaModel::from_cpu`] uploads the weights of a loaded (and validated) [`Qwen4Exp`] as they are stored —
//! quantized blocks stay quantized and are decoded in registers by the kernels. [`CudaModel::forward`] mirrors
//! the CPU forward pass block for block: decode-sized batches (up to 8 tokens) use the quantized GEMV kernels,
//! larger batches dequantize each weight to f32 and multiply with cuBLAS SGEMM. Everything accumulates in f32;
//! routed experts for small batches run through a gather GEMV over the device-resident expert stack without a
//! host round trip, larger batches group tokens by expert.

mod ops;

use std::sync::Mutex;

use nebula_kernels::cudarc::driver::CudaSlice;
use nebula_kernels::{Gpu, GpuError};

use crate::gguf::GgmlType;
use crate::model::config::{LayerKind, ModelConfig, PleConfig};
use crate::model::hyper_connection::GatedResidual;
use crate::model::{LogitsFor, Qwen4Exp, TokenMixer};
use crate::quant::Matrix;

use ops::{Arg, Dev, ptr, type_suffix};

/// Tokens up to which matrix products use the GEMV kernels (weights read once for all of them).
const GEMV_MAX_TOKENS: usize = 8;
/// Largest weight block dequantized at once for the SGEMM path, in values (64 Mi floats = 256 MiB).
const DEQUANT_CHUNK: usize = 64 << 20;

/// Errors of the CUDA backend.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The GPU or its driver.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// A model feature the kernels do not cover.
    #[error("the CUDA backend does not support {0}")]
    Unsupported(String),
    /// Input the model cannot take.
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
}

impl From<nebula_kernels::cudarc::driver::DriverError> for CudaError {
    fn from(e: nebula_kernels::cudarc::driver::DriverError) -> Self {
        CudaError::Gpu(GpuError::from(e))
    }
}

/// A weight matrix in device memory, blocks as stored in the GGUF.
struct DevMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: CudaSlice<u8>,
}

/// A stack of same-shaped matrices (the routed experts of a layer), `rows * row_bytes` apart.
struct DevStack {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: CudaSlice<u8>,
}

/// A matrix by address (a whole [`DevMatrix`] or one matrix of a [`DevStack`]).
#[derive(Clone, Copy)]
struct MatRef {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    ptr: u64,
}

struct DevHc {
    norm: CudaSlice<f32>,
    down: DevMatrix,
    up: DevMatrix,
    inject: Option<DevMatrix>,
}

struct DevGdn {
    qkv: DevMatrix,
    z: DevMatrix,
    b: DevMatrix,
    a: DevMatrix,
    conv: CudaSlice<f32>,
    dt_bias: CudaSlice<f32>,
    a_neg_exp: CudaSlice<f32>,
    norm: CudaSlice<f32>,
    out: DevMatrix,
    silu_gate: bool,
}

struct DevIndexer {
    q: DevMatrix,
    k: DevMatrix,
    q_norm: CudaSlice<f32>,
    k_norm: CudaSlice<f32>,
    ratio: usize,
}

struct DevAttn {
    q: DevMatrix,
    k: DevMatrix,
    v: DevMatrix,
    o: DevMatrix,
    q_norm: CudaSlice<f32>,
    k_norm: CudaSlice<f32>,
    indexer: Option<DevIndexer>,
}

enum DevMixer {
    Gdn(DevGdn),
    Attn(DevAttn),
}

struct DevMoe {
    router: DevMatrix,
    gate: DevStack,
    up: DevStack,
    down: DevStack,
    sh_gate: DevMatrix,
    sh_up: DevMatrix,
    sh_down: DevMatrix,
    sh_gate_inp: DevMatrix,
}

struct DevPle {
    cfg: PleConfig,
    key: DevMatrix,
    value: DevMatrix,
    norm_key: CudaSlice<f32>,
    norm_query: CudaSlice<f32>,
    norm_conv: CudaSlice<f32>,
    conv: CudaSlice<f32>,
    table: DevMatrix,
}

struct DevLayer {
    ple: Option<DevPle>,
    attn_hc: DevHc,
    mixer: DevMixer,
    mlp_hc: DevHc,
    moe: DevMoe,
}

/// Per-layer device state of one sequence.
enum DevLayerState {
    Gdn { conv: CudaSlice<f32>, s: CudaSlice<f32> },
    Attn { k: CudaSlice<f32>, v: CudaSlice<f32>, raw: CudaSlice<f32>, pooled: CudaSlice<f32>, blocks: usize },
}

/// The state of one sequence on the GPU (KV caches sized for `max_len` tokens up front).
pub struct CudaState {
    /// Tokens consumed.
    pub pos: usize,
    /// Capacity in tokens.
    pub max_len: usize,
    layers: Vec<DevLayerState>,
    ple_context: Vec<u32>,
    ple_conv: Option<CudaSlice<f32>>,
}

/// The model on the GPU.
pub struct CudaModel {
    dev: Dev,
    /// Shapes.
    pub config: ModelConfig,
    embed: DevMatrix,
    layers: Vec<DevLayer>,
    mixer: DevHc,
    lm_head: DevMatrix,
    masked: CudaSlice<i32>,
    n_masked: usize,
    scratch: Mutex<Option<CudaSlice<f32>>>,
    /// Bytes of weights uploaded.
    pub weight_bytes: usize,
}

impl std::fmt::Debug for CudaModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaModel").field("gpu", &self.dev.gpu.name).field("weight_bytes", &self.weight_bytes).finish()
    }
}

struct Uploader<'a> {
    dev: &'a Dev,
    bytes: usize,
}

impl Uploader<'_> {
    fn check_shape(m: &Matrix, what: &str) -> Result<(), CudaError> {
        type_suffix(m.ggml_type())?;
        let cols = m.cols();
        let ok = match m.ggml_type() {
            GgmlType::F32 => cols % 4 == 0,
            GgmlType::F16 | GgmlType::BF16 => cols % 4 == 0 && (cols < 32 || cols % 8 == 0),
            _ => true,
        };
        if !ok {
            return Err(CudaError::Unsupported(format!(
                "{what}: rows of {cols} values (need a multiple of 4, or 8 for 16-bit floats)"
            )));
        }
        Ok(())
    }
    fn matrix(&mut self, m: &Matrix, what: &str) -> Result<DevMatrix, CudaError> {
        Self::check_shape(m, what)?;
        self.upload(m)
    }
    /// A lookup table (read by `get_rows`, never multiplied): any row width.
    fn table(&mut self, m: &Matrix) -> Result<DevMatrix, CudaError> {
        type_suffix(m.ggml_type())?;
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
    fn vector(&mut self, v: &[f32]) -> Result<CudaSlice<f32>, CudaError> {
        self.bytes += v.len() * 4;
        Ok(self.dev.stream().clone_htod(v)?)
    }
    fn stack(&mut self, ms: &[&Matrix], what: &str) -> Result<DevStack, CudaError> {
        let first = ms.first().ok_or_else(|| CudaError::Unsupported(format!("{what}: no experts")))?;
        Self::check_shape(first, what)?;
        let mut all = Vec::with_capacity(first.bytes().len() * ms.len());
        for m in ms {
            all.extend_from_slice(m.bytes());
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
    fn hc(&mut self, g: &GatedResidual, what: &str) -> Result<DevHc, CudaError> {
        Ok(DevHc {
            norm: self.vector(&g.hc_norm)?,
            down: self.matrix(&g.input_mix_weight_down, what)?,
            up: self.matrix(&g.input_mix_weight_up, what)?,
            inject: g.block_inject_weight.as_ref().map(|m| self.matrix(m, what)).transpose()?,
        })
    }
}

impl DevMatrix {
    fn r(&self, dev: &Dev) -> MatRef {
        MatRef {
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
            row_bytes: self.row_bytes,
            ptr: ptr(&self.data, dev.stream(), 0),
        }
    }
}

impl DevStack {
    fn expert(&self, dev: &Dev, e: usize) -> MatRef {
        MatRef {
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
            row_bytes: self.row_bytes,
            ptr: ptr(&self.data, dev.stream(), e * self.rows * self.row_bytes),
        }
    }
    fn expert_bytes(&self) -> usize {
        self.rows * self.row_bytes
    }
}

/// A device f32 buffer of `n` values.
fn zeros(dev: &Dev, n: usize) -> Result<CudaSlice<f32>, CudaError> {
    Ok(dev.stream().alloc_zeros::<f32>(n.max(1))?)
}

impl CudaModel {
    /// Opens GPU `ordinal` and uploads `model`'s weights. `vram_budget` (bytes), when given, is checked against
    /// both the weights' size and the free device memory before anything is allocated.
    pub fn from_cpu(model: &Qwen4Exp, ordinal: usize, vram_budget: Option<u64>) -> Result<Self, CudaError> {
        let gpu = Gpu::open(ordinal)?;
        let (free, _total) = gpu.mem_info()?;
        let needed = estimate_weight_bytes(model) as u64;
        let budget = vram_budget.unwrap_or(free as u64);
        if needed > budget || needed > free as u64 {
            return Err(GpuError::OutOfMemory {
                what: "the model's weights".into(),
                needed_mib: needed >> 20,
                free_mib: (free as u64) >> 20,
                budget_mib: budget >> 20,
            }
            .into());
        }
        let dev = Dev::new(gpu)?;
        let cfg = model.config.clone();
        let mut up = Uploader { dev: &dev, bytes: 0 };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for (i, l) in model.layers.iter().enumerate() {
            let what = format!("layer {i}");
            let mixer = match &l.mixer {
                TokenMixer::LinearAttention(g) => DevMixer::Gdn(DevGdn {
                    qkv: up.matrix(&g.in_proj_qkv, &what)?,
                    z: up.matrix(&g.in_proj_z, &what)?,
                    b: up.matrix(&g.in_proj_b, &what)?,
                    a: up.matrix(&g.in_proj_a, &what)?,
                    conv: up.vector(&g.conv1d)?,
                    dt_bias: up.vector(&g.dt_bias)?,
                    a_neg_exp: up.vector(&g.a)?,
                    norm: up.vector(&g.norm)?,
                    out: up.matrix(&g.out_proj, &what)?,
                    silu_gate: g.gate == crate::model::GateActivation::Silu,
                }),
                TokenMixer::SelfAttention(a) => DevMixer::Attn(DevAttn {
                    q: up.matrix(&a.q_proj, &what)?,
                    k: up.matrix(&a.k_proj, &what)?,
                    v: up.matrix(&a.v_proj, &what)?,
                    o: up.matrix(&a.o_proj, &what)?,
                    q_norm: up.vector(&a.q_norm)?,
                    k_norm: up.vector(&a.k_norm)?,
                    indexer: match &a.indexer {
                        Some(ix) => Some(DevIndexer {
                            q: up.matrix(&ix.q_proj, &what)?,
                            k: up.matrix(&ix.k_proj, &what)?,
                            q_norm: up.vector(&ix.q_norm)?,
                            k_norm: up.vector(&ix.k_norm)?,
                            ratio: ix.compress_ratio,
                        }),
                        None => None,
                    },
                }),
            };
            let m = &l.mlp;
            let gates: Vec<&Matrix> = m.experts.iter().map(|e| &e.gate_proj).collect();
            let ups: Vec<&Matrix> = m.experts.iter().map(|e| &e.up_proj).collect();
            let downs: Vec<&Matrix> = m.experts.iter().map(|e| &e.down_proj).collect();
            let sg = Matrix::new(
                GgmlType::F32,
                1,
                m.shared_expert_gate.len(),
                crate::quant::WeightBytes::from_vec(
                    m.shared_expert_gate.iter().flat_map(|v| v.to_le_bytes()).collect(),
                ),
            )
            .map_err(|e| CudaError::Unsupported(e.to_string()))?;
            let moe = DevMoe {
                router: up.matrix(&m.gate, &what)?,
                gate: up.stack(&gates, &what)?,
                up: up.stack(&ups, &what)?,
                down: up.stack(&downs, &what)?,
                sh_gate: up.matrix(&m.shared_expert.gate_proj, &what)?,
                sh_up: up.matrix(&m.shared_expert.up_proj, &what)?,
                sh_down: up.matrix(&m.shared_expert.down_proj, &what)?,
                sh_gate_inp: up.matrix(&sg, &what)?,
            };
            let ple = match &l.ple {
                Some(p) => Some(DevPle {
                    cfg: p.cfg.clone(),
                    key: up.matrix(&p.key_proj, &what)?,
                    value: up.matrix(&p.value_proj, &what)?,
                    norm_key: up.vector(&p.norm_key)?,
                    norm_query: up.vector(&p.norm_query)?,
                    norm_conv: up.vector(&p.norm_conv)?,
                    conv: up.vector(&p.conv1d)?,
                    table: up.table(&p.ngram_embedding)?,
                }),
                None => None,
            };
            layers.push(DevLayer {
                ple,
                attn_hc: up.hc(&l.attn_hyper_connection, &what)?,
                mixer,
                mlp_hc: up.hc(&l.mlp_hyper_connection, &what)?,
                moe,
            });
        }
        let embed = up.matrix(&model.embed_tokens, "token_embd")?;
        let lm_head = up.matrix(&model.lm_head, "output")?;
        let mixer = up.hc(&model.hyper_connection_mixer, "output_hc")?;
        let ranges: Vec<i32> = model.masked.iter().flat_map(|r| [r.start as i32, r.end as i32]).collect();
        let n_masked = model.masked.len();
        let masked = dev.stream().clone_htod(if ranges.is_empty() { &[0i32, 0][..] } else { &ranges[..] })?;
        let weight_bytes = up.bytes;
        Ok(Self {
            dev,
            config: cfg,
            embed,
            layers,
            mixer,
            lm_head,
            masked,
            n_masked,
            scratch: Mutex::new(None),
            weight_bytes,
        })
    }

    /// Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written), measured with `bytes`-sized
    /// copies: the HBM ceiling of the floor computations.
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64, CudaError> {
        let n = bytes / 4;
        let src = zeros(&self.dev, n)?;
        let mut dst = zeros(&self.dev, n)?;
        let stream = self.dev.stream();
        stream.memcpy_dtod(&src, &mut dst)?;
        stream.synchronize()?;
        let reps = 10;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            stream.memcpy_dtod(&src, &mut dst)?;
        }
        stream.synchronize()?;
        Ok((2 * n * 4 * reps) as f64 / t.elapsed().as_secs_f64())
    }

    /// The GPU's name.
    pub fn gpu_name(&self) -> &str {
        &self.dev.gpu.name
    }

    /// A fresh state for at most `max_len` tokens (KV caches allocated now: an out-of-memory is reported here,
    /// never in the middle of a request).
    pub fn new_state(&self, max_len: usize) -> Result<CudaState, CudaError> {
        let cfg = &self.config;
        let dev = &self.dev;
        let mut layers = Vec::new();
        for l in &self.layers {
            layers.push(match &l.mixer {
                DevMixer::Gdn(_) => DevLayerState::Gdn {
                    conv: zeros(dev, (cfg.ssm_conv_kernel - 1) * cfg.ssm_conv_dim())?,
                    s: zeros(dev, cfg.ssm_v_heads * cfg.ssm_head_dim * cfg.ssm_head_dim)?,
                },
                DevMixer::Attn(a) => {
                    let kvw = cfg.n_head_kv * cfg.head_dim;
                    let (ihd, ratio) = a.indexer.as_ref().map_or((0, 0), |i| (cfg.indexer.head_dim, i.ratio));
                    DevLayerState::Attn {
                        k: zeros(dev, max_len * kvw)?,
                        v: zeros(dev, max_len * kvw)?,
                        raw: zeros(dev, max_len * ihd)?,
                        pooled: zeros(dev, if ratio > 0 { (max_len / ratio + 1) * ihd } else { 1 })?,
                        blocks: 0,
                    }
                }
            });
        }
        let ple = self.layers.iter().find_map(|l| l.ple.as_ref());
        Ok(CudaState {
            pos: 0,
            max_len,
            layers,
            ple_context: ple.map(|p| vec![p.cfg.eos_token_id; p.cfg.ngram_size - 1]).unwrap_or_default(),
            ple_conv: match ple {
                Some(p) => Some(zeros(dev, p.cfg.conv_state_len() * cfg.hc_dim())?),
                None => None,
            },
        })
    }

    fn p(&self, buf: &CudaSlice<f32>, offset: usize) -> u64 {
        ptr(buf, self.dev.stream(), offset)
    }

    /// `y[n][rows] = x[n][cols] . W^T`.
    fn matmul(&self, w: MatRef, x: u64, n: usize, y: u64) -> Result<(), CudaError> {
        let dev = &self.dev;
        let sfx = type_suffix(w.ty)?;
        if n <= GEMV_MAX_TOKENS {
            let nchunks = w.cols / 32;
            let lanes: u32 = if nchunks >= 24 { 32 } else { 16 };
            let rows_per_block = 256 / lanes as usize;
            let mut t0 = 0;
            while t0 < n {
                let c = [8usize, 4, 2, 1].into_iter().find(|&c| c <= n - t0).expect("1 always fits");
                dev.launch(
                    &format!("gemv_{sfx}_{c}"),
                    (w.rows.div_ceil(rows_per_block) as u32, 1, 1),
                    256,
                    &[
                        Arg::Ptr(w.ptr),
                        Arg::I64(w.row_bytes as i64),
                        Arg::I32(w.rows as i32),
                        Arg::I32(w.cols as i32),
                        Arg::Ptr(x + (t0 * w.cols * 4) as u64),
                        Arg::I64(w.cols as i64),
                        Arg::Ptr(y + (t0 * w.rows * 4) as u64),
                        Arg::I64(w.rows as i64),
                        Arg::I32(lanes as i32),
                    ],
                )?;
                t0 += c;
            }
            return Ok(());
        }
        // Dequantize row blocks to f32 and multiply with cuBLAS.
        let rows_per = (DEQUANT_CHUNK / w.cols).clamp(1, w.rows);
        let mut guard = self.scratch.lock().expect("scratch lock");
        let need = rows_per * w.cols;
        if guard.as_ref().is_none_or(|s| s.len() < need) {
            *guard = Some(zeros(dev, need)?);
        }
        let scratch = guard.as_ref().expect("allocated above");
        let sp = ptr(scratch, dev.stream(), 0);
        let elem = matches!(w.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) && w.cols % 32 != 0;
        let mut r0 = 0;
        while r0 < w.rows {
            let rows = rows_per.min(w.rows - r0);
            let wp = w.ptr + (r0 * w.row_bytes) as u64;
            if elem {
                dev.launch_1d(
                    &format!("dequant_elem_f32_{sfx}"),
                    rows * w.cols,
                    &[
                        Arg::Ptr(wp),
                        Arg::I64(w.row_bytes as i64),
                        Arg::I32(rows as i32),
                        Arg::I32(w.cols as i32),
                        Arg::Ptr(sp),
                    ],
                )?;
            } else {
                dev.launch_1d(
                    &format!("dequant_f32_{sfx}"),
                    rows * (w.cols / 32),
                    &[
                        Arg::Ptr(wp),
                        Arg::I64(w.row_bytes as i64),
                        Arg::I32(rows as i32),
                        Arg::I32(w.cols as i32),
                        Arg::Ptr(sp),
                    ],
                )?;
            }
            // y[:, r0..r0+rows] (row stride w.rows): one GEMM per row block writes a column slab, so run it on a
            // contiguous temporary when the block is partial.
            if rows == w.rows {
                dev.sgemm(sp, x, y, rows, n, w.cols)?;
            } else {
                let tmp = zeros(dev, n * rows)?;
                let tp = ptr(&tmp, dev.stream(), 0);
                dev.sgemm(sp, x, tp, rows, n, w.cols)?;
                dev.launch_1d(
                    "copy_rows",
                    n * rows,
                    &[
                        Arg::Ptr(tp),
                        Arg::I64(rows as i64),
                        Arg::Ptr(y + (r0 * 4) as u64),
                        Arg::I64(w.rows as i64),
                        Arg::I32(n as i32),
                        Arg::I32(rows as i32),
                    ],
                )?;
            }
            r0 += rows;
        }
        Ok(())
    }

    /// `out[r] = x[r] / rms(x[r]) * w[(r % w_rows)]` over `rows` rows of `width` (in place when out == x).
    fn rms_norm(&self, x: u64, w: u64, out: u64, rows: usize, width: usize, w_rows: usize) -> Result<(), CudaError> {
        self.dev.launch(
            "rms_norm_rows",
            (rows as u32, 1, 1),
            256,
            &[
                Arg::Ptr(x),
                Arg::Ptr(w),
                Arg::Ptr(out),
                Arg::I32(rows as i32),
                Arg::I32(width as i32),
                Arg::I32(w_rows as i32),
                Arg::F32(self.config.rms_eps),
            ],
        )?;
        Ok(())
    }

    fn rope(
        &self,
        x: u64,
        n: usize,
        heads: usize,
        token_stride: usize,
        head_stride: usize,
        pos0: usize,
        pos_mul: usize,
    ) -> Result<(), CudaError> {
        let cfg = &self.config;
        let half = cfg.rope_dim / 2;
        self.dev.launch_1d(
            "rope_heads",
            n * heads * half,
            &[
                Arg::Ptr(x),
                Arg::I32(n as i32),
                Arg::I32(heads as i32),
                Arg::I64(token_stride as i64),
                Arg::I64(head_stride as i64),
                Arg::I32(pos0 as i32),
                Arg::I32(pos_mul as i32),
                Arg::I32(cfg.rope_dim as i32),
                Arg::F32(cfg.rope_theta),
                Arg::I32(cfg.rope_sections[1] as i32),
                Arg::I32(cfg.rope_sections[2] as i32),
            ],
        )?;
        Ok(())
    }

    /// Hyper-connection mixer: returns (m [n][d], a [n][S] or empty).
    fn hc_mix(&self, hc: &DevHc, x: u64, n: usize) -> Result<(CudaSlice<f32>, Option<CudaSlice<f32>>), CudaError> {
        let dev = &self.dev;
        let cfg = &self.config;
        let (s, d) = (cfg.hc_count, cfg.hidden);
        let dim = s * d;
        let inv_s = 1.0 / s as f32;
        let xn = zeros(dev, n * dim)?;
        self.rms_norm(x, self.p(&hc.norm, 0), self.p(&xn, 0), n * s, d, s)?;
        let rank = hc.down.rows;
        let low = zeros(dev, n * rank)?;
        self.matmul(hc.down.r(dev), self.p(&xn, 0), n, self.p(&low, 0))?;
        dev.launch_1d(
            "hc_low_act",
            n * rank,
            &[Arg::Ptr(self.p(&low, 0)), Arg::I64((n * rank) as i64), Arg::F32(inv_s)],
        )?;
        let g = zeros(dev, n * dim)?;
        self.matmul(hc.up.r(dev), self.p(&low, 0), n, self.p(&g, 0))?;
        let m = zeros(dev, n * d)?;
        dev.launch_1d(
            "hc_mix",
            n * d,
            &[
                Arg::Ptr(self.p(&g, 0)),
                Arg::Ptr(self.p(&xn, 0)),
                Arg::Ptr(self.p(&m, 0)),
                Arg::I32(n as i32),
                Arg::I32(s as i32),
                Arg::I32(d as i32),
            ],
        )?;
        let a = match &hc.inject {
            None => None,
            Some(wi) => {
                let a = zeros(dev, n * s)?;
                self.matmul(wi.r(dev), self.p(&xn, 0), n, self.p(&a, 0))?;
                dev.launch_1d(
                    "hc_inject_act",
                    n * s,
                    &[Arg::Ptr(self.p(&a, 0)), Arg::I64((n * s) as i64), Arg::F32(inv_s)],
                )?;
                Some(a)
            }
        };
        Ok((m, a))
    }

    fn hc_residual(&self, x: u64, y: &CudaSlice<f32>, a: &CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
        let cfg = &self.config;
        self.dev.launch_1d(
            "hc_residual",
            n * cfg.hc_dim(),
            &[
                Arg::Ptr(x),
                Arg::Ptr(self.p(y, 0)),
                Arg::Ptr(self.p(a, 0)),
                Arg::I32(n as i32),
                Arg::I32(cfg.hc_count as i32),
                Arg::I32(cfg.hidden as i32),
            ],
        )?;
        Ok(())
    }

    fn gdn(
        &self,
        g: &DevGdn,
        st: &mut DevLayerState,
        m: &CudaSlice<f32>,
        n: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let dev = &self.dev;
        let cfg = &self.config;
        let DevLayerState::Gdn { conv, s } = st else { unreachable!("state follows the layer kinds") };
        let (nk, nv, dk) = (cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_head_dim);
        let (kd, vd, c) = (nk * dk, nv * dk, cfg.ssm_conv_dim());
        let mp = self.p(m, 0);
        let qkv = zeros(dev, n * c)?;
        self.matmul(g.qkv.r(dev), mp, n, self.p(&qkv, 0))?;
        let z = zeros(dev, n * vd)?;
        self.matmul(g.z.r(dev), mp, n, self.p(&z, 0))?;
        let b = zeros(dev, n * nv)?;
        self.matmul(g.b.r(dev), mp, n, self.p(&b, 0))?;
        let a = zeros(dev, n * nv)?;
        self.matmul(g.a.r(dev), mp, n, self.p(&a, 0))?;
        dev.launch(
            "gdn_conv",
            (c.div_ceil(256) as u32, 1, 1),
            256,
            &[
                Arg::Ptr(self.p(&qkv, 0)),
                Arg::Ptr(self.p(conv, 0)),
                Arg::Ptr(self.p(&g.conv, 0)),
                Arg::I32(n as i32),
                Arg::I32(c as i32),
                Arg::I32(cfg.ssm_conv_kernel as i32),
            ],
        )?;
        // L2 norms of q (scaled by 1/sqrt(dk)) and k, per (token, key head).
        for (off, scale) in [(0usize, 1.0 / (dk as f32).sqrt()), (kd, 1.0)] {
            dev.launch(
                "l2_norm_heads",
                ((n * nk) as u32, 1, 1),
                128,
                &[
                    Arg::Ptr(self.p(&qkv, off)),
                    Arg::I32((n * nk) as i32),
                    Arg::I32(dk as i32),
                    Arg::I32(nk as i32),
                    Arg::I64(c as i64),
                    Arg::F32(1e-6),
                    Arg::F32(scale),
                ],
            )?;
        }
        let beta = zeros(dev, n * nv)?;
        let gg = zeros(dev, n * nv)?;
        dev.launch_1d(
            "gdn_gates",
            n * nv,
            &[
                Arg::Ptr(self.p(&b, 0)),
                Arg::Ptr(self.p(&a, 0)),
                Arg::Ptr(self.p(&g.a_neg_exp, 0)),
                Arg::Ptr(self.p(&g.dt_bias, 0)),
                Arg::Ptr(self.p(&beta, 0)),
                Arg::Ptr(self.p(&gg, 0)),
                Arg::I32(n as i32),
                Arg::I32(nv as i32),
            ],
        )?;
        let o = zeros(dev, n * vd)?;
        let kernel = match dk {
            128 => "gdn_recurrent_128",
            64 => "gdn_recurrent_64",
            32 => "gdn_recurrent_32",
            16 => "gdn_recurrent_16",
            other => {
                return Err(CudaError::Unsupported(format!("Gated DeltaNet heads of {other} dims (16, 32, 64, 128)")));
            }
        };
        let cols = dk.min(32);
        dev.launch(
            kernel,
            (nv as u32, (dk / cols) as u32, 1),
            cols as u32,
            &[
                Arg::Ptr(self.p(&qkv, 0)),
                Arg::Ptr(self.p(&beta, 0)),
                Arg::Ptr(self.p(&gg, 0)),
                Arg::Ptr(self.p(s, 0)),
                Arg::Ptr(self.p(&o, 0)),
                Arg::I32(n as i32),
                Arg::I32(nk as i32),
                Arg::I32(nv as i32),
                Arg::I32(c as i32),
            ],
        )?;
        dev.launch(
            "gdn_gated_norm",
            ((n * nv) as u32, 1, 1),
            128,
            &[
                Arg::Ptr(self.p(&o, 0)),
                Arg::Ptr(self.p(&z, 0)),
                Arg::Ptr(self.p(&g.norm, 0)),
                Arg::I32((n * nv) as i32),
                Arg::I32(dk as i32),
                Arg::F32(cfg.rms_eps),
                Arg::I32(g.silu_gate as i32),
            ],
        )?;
        let y = zeros(dev, n * cfg.hidden)?;
        self.matmul(g.out.r(dev), self.p(&o, 0), n, self.p(&y, 0))?;
        Ok(y)
    }

    fn attn(
        &self,
        at: &DevAttn,
        st: &mut DevLayerState,
        m: &CudaSlice<f32>,
        n: usize,
        pos0: usize,
    ) -> Result<CudaSlice<f32>, CudaError> {
        let dev = &self.dev;
        let cfg = &self.config;
        let DevLayerState::Attn { k: kc, v: vc, raw, pooled, blocks } = st else {
            unreachable!("state follows the layer kinds")
        };
        let (nh, nkv, hd) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
        let kvw = nkv * hd;
        let mp = self.p(m, 0);
        let pq = zeros(dev, n * nh * hd * 2)?;
        self.matmul(at.q.r(dev), mp, n, self.p(&pq, 0))?;
        let q = zeros(dev, n * nh * hd)?;
        let gate = zeros(dev, n * nh * hd)?;
        dev.launch_1d(
            "attn_split_q",
            n * nh * hd,
            &[
                Arg::Ptr(self.p(&pq, 0)),
                Arg::Ptr(self.p(&q, 0)),
                Arg::Ptr(self.p(&gate, 0)),
                Arg::I32(n as i32),
                Arg::I32(nh as i32),
                Arg::I32(hd as i32),
            ],
        )?;
        self.rms_norm(self.p(&q, 0), self.p(&at.q_norm, 0), self.p(&q, 0), n * nh, hd, 1)?;
        self.rope(self.p(&q, 0), n, nh, nh * hd, hd, pos0, 1)?;
        // New keys and values go straight into the caches.
        let kp = self.p(kc, pos0 * kvw);
        self.matmul(at.k.r(dev), mp, n, kp)?;
        self.matmul(at.v.r(dev), mp, n, self.p(vc, pos0 * kvw))?;
        self.rms_norm(kp, self.p(&at.k_norm, 0), kp, n * nkv, hd, 1)?;
        self.rope(kp, n, nkv, kvw, hd, pos0, 1)?;

        let total = pos0 + n;
        let mut selection: Option<(CudaSlice<i32>, CudaSlice<i32>, usize)> = None;
        if let Some(ix) = &at.indexer {
            let ic = cfg.indexer;
            let (nih, ihd, r) = (ic.n_heads, ic.head_dim, ix.ratio);
            let qi = zeros(dev, n * nih * ihd)?;
            self.matmul(ix.q.r(dev), mp, n, self.p(&qi, 0))?;
            self.rms_norm(self.p(&qi, 0), self.p(&ix.q_norm, 0), self.p(&qi, 0), n * nih, ihd, 1)?;
            self.rope(self.p(&qi, 0), n, nih, nih * ihd, ihd, pos0, 1)?;
            self.matmul(ix.k.r(dev), mp, n, self.p(raw, pos0 * ihd))?;
            let b1 = total / r;
            if b1 > *blocks {
                let b0 = *blocks;
                dev.launch(
                    "qsa_pool",
                    ((b1 - b0) as u32, 1, 1),
                    128,
                    &[
                        Arg::Ptr(self.p(raw, 0)),
                        Arg::Ptr(self.p(pooled, 0)),
                        Arg::I32(b0 as i32),
                        Arg::I32(b1 as i32),
                        Arg::I32(r as i32),
                        Arg::I32(ihd as i32),
                        Arg::Ptr(self.p(&ix.k_norm, 0)),
                        Arg::F32(cfg.rms_eps),
                    ],
                )?;
                self.rope(self.p(pooled, b0 * ihd), b1 - b0, 1, ihd, ihd, b0, r)?;
                *blocks = b1;
            }
            let keep = ic.token_budget / r;
            if b1 > keep {
                let max_blocks = b1;
                let scores = zeros(dev, n * max_blocks)?;
                dev.launch_1d(
                    "qsa_scores",
                    n * max_blocks,
                    &[
                        Arg::Ptr(self.p(&qi, 0)),
                        Arg::Ptr(self.p(pooled, 0)),
                        Arg::Ptr(self.p(&scores, 0)),
                        Arg::I32(n as i32),
                        Arg::I32(pos0 as i32),
                        Arg::I32(r as i32),
                        Arg::I32(nih as i32),
                        Arg::I32(ihd as i32),
                        Arg::I32(max_blocks as i32),
                    ],
                )?;
                let cap = keep * r + r - 1;
                let sel = dev.stream().alloc_zeros::<i32>(n * cap)?;
                let count = dev.stream().alloc_zeros::<i32>(n)?;
                dev.launch(
                    "qsa_select",
                    (n as u32, 1, 1),
                    256,
                    &[
                        Arg::Ptr(self.p(&scores, 0)),
                        Arg::I32(max_blocks as i32),
                        Arg::I32(keep as i32),
                        Arg::I32(pos0 as i32),
                        Arg::I32(r as i32),
                        Arg::Ptr(ptr(&sel, dev.stream(), 0)),
                        Arg::Ptr(ptr(&count, dev.stream(), 0)),
                        Arg::I32(cap as i32),
                    ],
                )?;
                selection = Some((sel, count, cap));
            }
        }
        let out = zeros(dev, n * nh * hd)?;
        let (sp, cp, cap) = match &selection {
            Some((s, c, cap)) => (ptr(s, dev.stream(), 0), ptr(c, dev.stream(), 0), *cap),
            None => (0, 0, 0),
        };
        dev.launch(
            "attention",
            ((n * nh) as u32, 1, 1),
            128,
            &[
                Arg::Ptr(self.p(&q, 0)),
                Arg::Ptr(self.p(kc, 0)),
                Arg::Ptr(self.p(vc, 0)),
                Arg::Ptr(sp),
                Arg::Ptr(cp),
                Arg::I32(cap as i32),
                Arg::I32(pos0 as i32),
                Arg::Ptr(self.p(&out, 0)),
                Arg::I32(nh as i32),
                Arg::I32(nkv as i32),
                Arg::I32(hd as i32),
                Arg::F32(1.0 / (hd as f32).sqrt()),
            ],
        )?;
        dev.launch_1d(
            "mul_sigmoid",
            n * nh * hd,
            &[Arg::Ptr(self.p(&out, 0)), Arg::Ptr(self.p(&gate, 0)), Arg::I64((n * nh * hd) as i64)],
        )?;
        let y = zeros(dev, n * cfg.hidden)?;
        self.matmul(at.o.r(dev), self.p(&out, 0), n, self.p(&y, 0))?;
        Ok(y)
    }

    fn moe(&self, moe: &DevMoe, m: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<f32>, CudaError> {
        let dev = &self.dev;
        let cfg = &self.config;
        let (d, e, k, ff) = (cfg.hidden, cfg.n_expert, cfg.n_expert_used, cfg.expert_ff);
        let mp = self.p(m, 0);
        let logits = zeros(dev, n * e)?;
        self.matmul(moe.router.r(dev), mp, n, self.p(&logits, 0))?;
        let ids = dev.stream().alloc_zeros::<i32>(n * k)?;
        let w = zeros(dev, n * k)?;
        if e > 1024 {
            return Err(CudaError::Unsupported(format!("{e} experts (the router kernel takes up to 1024)")));
        }
        dev.launch(
            "router_topk",
            (n as u32, 1, 1),
            256,
            &[
                Arg::Ptr(self.p(&logits, 0)),
                Arg::I32(e as i32),
                Arg::I32(k as i32),
                Arg::Ptr(ptr(&ids, dev.stream(), 0)),
                Arg::Ptr(self.p(&w, 0)),
            ],
        )?;
        // Shared expert and its gate.
        let sff = moe.sh_gate.rows;
        let sg = zeros(dev, n * sff)?;
        let su = zeros(dev, n * sff)?;
        self.matmul(moe.sh_gate.r(dev), mp, n, self.p(&sg, 0))?;
        self.matmul(moe.sh_up.r(dev), mp, n, self.p(&su, 0))?;
        dev.launch_1d(
            "silu_mul",
            n * sff,
            &[Arg::Ptr(self.p(&sg, 0)), Arg::Ptr(self.p(&su, 0)), Arg::I64((n * sff) as i64)],
        )?;
        let shared = zeros(dev, n * d)?;
        self.matmul(moe.sh_down.r(dev), self.p(&sg, 0), n, self.p(&shared, 0))?;
        let sgate = zeros(dev, n)?;
        self.matmul(moe.sh_gate_inp.r(dev), mp, n, self.p(&sgate, 0))?;

        let out = zeros(dev, n * d)?;
        if n <= GEMV_MAX_TOKENS / 2 {
            // Decode: one GEMV per (token, expert) slot, expert ids read on the device.
            let slots = n * k;
            let g = zeros(dev, slots * ff)?;
            let u = zeros(dev, slots * ff)?;
            let ys = zeros(dev, slots * d)?;
            let idp = ptr(&ids, dev.stream(), 0);
            for (stack, x, xs, spx, y) in [(&moe.gate, mp, d, k, &g), (&moe.up, mp, d, k, &u)] {
                self.moe_gemv(stack, idp, slots, x, xs, spx, self.p(y, 0))?;
            }
            dev.launch_1d(
                "silu_mul",
                slots * ff,
                &[Arg::Ptr(self.p(&g, 0)), Arg::Ptr(self.p(&u, 0)), Arg::I64((slots * ff) as i64)],
            )?;
            self.moe_gemv(&moe.down, idp, slots, self.p(&g, 0), ff, 1, self.p(&ys, 0))?;
            dev.launch_1d(
                "moe_combine",
                n * d,
                &[
                    Arg::Ptr(self.p(&ys, 0)),
                    Arg::Ptr(self.p(&w, 0)),
                    Arg::Ptr(self.p(&shared, 0)),
                    Arg::Ptr(self.p(&sgate, 0)),
                    Arg::Ptr(self.p(&out, 0)),
                    Arg::I32(n as i32),
                    Arg::I32(k as i32),
                    Arg::I32(d as i32),
                ],
            )?;
            return Ok(out);
        }
        // Prefill: group tokens by expert on the host, then one batched product per expert.
        let ids_h: Vec<i32> = dev.stream().clone_dtoh(&ids)?;
        let w_h: Vec<f32> = dev.stream().clone_dtoh(&w)?;
        let mut by_expert: Vec<Vec<(i32, f32)>> = vec![Vec::new(); e];
        for t in 0..n {
            for j in 0..k {
                let ex = ids_h[t * k + j];
                if ex < 0 || ex as usize >= e {
                    return Err(CudaError::Unsupported(format!("router produced expert id {ex}")));
                }
                by_expert[ex as usize].push((t as i32, w_h[t * k + j]));
            }
        }
        for (ex, users) in by_expert.iter().enumerate() {
            if users.is_empty() {
                continue;
            }
            let c = users.len();
            let idx: Vec<i32> = users.iter().map(|u| u.0).collect();
            let wts: Vec<f32> = users.iter().map(|u| u.1).collect();
            let idx_d = dev.stream().clone_htod(&idx)?;
            let w_d = dev.stream().clone_htod(&wts)?;
            let xe = zeros(dev, c * d)?;
            dev.launch_1d(
                "gather_rows",
                c * d,
                &[
                    Arg::Ptr(mp),
                    Arg::Ptr(ptr(&idx_d, dev.stream(), 0)),
                    Arg::Ptr(self.p(&xe, 0)),
                    Arg::I32(c as i32),
                    Arg::I32(d as i32),
                ],
            )?;
            let ge = zeros(dev, c * ff)?;
            let ue = zeros(dev, c * ff)?;
            self.matmul(moe.gate.expert(dev, ex), self.p(&xe, 0), c, self.p(&ge, 0))?;
            self.matmul(moe.up.expert(dev, ex), self.p(&xe, 0), c, self.p(&ue, 0))?;
            dev.launch_1d(
                "silu_mul",
                c * ff,
                &[Arg::Ptr(self.p(&ge, 0)), Arg::Ptr(self.p(&ue, 0)), Arg::I64((c * ff) as i64)],
            )?;
            let ye = zeros(dev, c * d)?;
            self.matmul(moe.down.expert(dev, ex), self.p(&ge, 0), c, self.p(&ye, 0))?;
            dev.launch_1d(
                "scatter_add_rows",
                c * d,
                &[
                    Arg::Ptr(self.p(&ye, 0)),
                    Arg::Ptr(ptr(&idx_d, dev.stream(), 0)),
                    Arg::Ptr(self.p(&w_d, 0)),
                    Arg::Ptr(self.p(&out, 0)),
                    Arg::I32(c as i32),
                    Arg::I32(d as i32),
                ],
            )?;
        }
        dev.launch_1d(
            "add_gated_shared",
            n * d,
            &[
                Arg::Ptr(self.p(&shared, 0)),
                Arg::Ptr(self.p(&sgate, 0)),
                Arg::Ptr(self.p(&out, 0)),
                Arg::I32(n as i32),
                Arg::I32(d as i32),
            ],
        )?;
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn moe_gemv(
        &self,
        stack: &DevStack,
        ids: u64,
        slots: usize,
        x: u64,
        x_stride: usize,
        slots_per_x: usize,
        y: u64,
    ) -> Result<(), CudaError> {
        let sfx = type_suffix(stack.ty)?;
        let lanes: u32 = if stack.cols / 32 >= 24 { 32 } else { 16 };
        let rows_per_block = 256 / lanes as usize;
        self.dev.launch(
            &format!("moe_gemv_{sfx}"),
            (stack.rows.div_ceil(rows_per_block) as u32, slots as u32, 1),
            256,
            &[
                Arg::Ptr(ptr(&stack.data, self.dev.stream(), 0)),
                Arg::I64(stack.expert_bytes() as i64),
                Arg::I64(stack.row_bytes as i64),
                Arg::I32(stack.rows as i32),
                Arg::I32(stack.cols as i32),
                Arg::Ptr(ids),
                Arg::Ptr(x),
                Arg::I64(x_stride as i64),
                Arg::I32(slots_per_x as i32),
                Arg::Ptr(y),
                Arg::I32(lanes as i32),
            ],
        )?;
        Ok(())
    }

    fn get_rows(
        &self,
        w: &DevMatrix,
        ids: u64,
        n: usize,
        out: u64,
        out_stride: usize,
        copies: usize,
    ) -> Result<(), CudaError> {
        let sfx = type_suffix(w.ty)?;
        let args = [
            Arg::Ptr(ptr(&w.data, self.dev.stream(), 0)),
            Arg::I64(w.row_bytes as i64),
            Arg::I32(w.cols as i32),
            Arg::Ptr(ids),
            Arg::I32(n as i32),
            Arg::Ptr(out),
            Arg::I64(out_stride as i64),
            Arg::I32(copies as i32),
        ];
        if w.cols % 32 == 0 {
            self.dev.launch_1d(&format!("get_rows_{sfx}"), n * (w.cols / 32), &args)?;
        } else {
            self.dev.launch_1d(&format!("get_rows_elem_{sfx}"), n * w.cols, &args)?;
        }
        Ok(())
    }

    fn ple(&self, ple: &DevPle, st: &mut CudaState, x: u64, tokens: &[u32]) -> Result<(), CudaError> {
        let dev = &self.dev;
        let cfg = &self.config;
        let n = tokens.len();
        let (s, d) = (cfg.hc_count, cfg.hidden);
        let dim = s * d;
        let heads = ple.cfg.n_heads();
        let rows = crate::model::ple::ngram_rows(&ple.cfg, &st.ple_context, tokens);
        let ctx = st.ple_context.len();
        let mut hist = st.ple_context.clone();
        hist.extend_from_slice(tokens);
        st.ple_context.copy_from_slice(&hist[hist.len() - ctx..]);
        let table_rows = ple.table.rows as u64;
        let ids: Vec<i32> = rows
            .iter()
            .map(|&r| {
                if r < table_rows {
                    Ok(r as i32)
                } else {
                    Err(CudaError::Unsupported(format!("n-gram row {r} past the table")))
                }
            })
            .collect::<Result<_, _>>()?;
        let ids_d = dev.stream().clone_htod(&ids)?;
        let pe = heads * ple.cfg.head_dim;
        let emb = zeros(dev, n * pe)?;
        self.get_rows(&ple.table, ptr(&ids_d, dev.stream(), 0), n * heads, self.p(&emb, 0), ple.cfg.head_dim, 1)?;
        let key = zeros(dev, n * dim)?;
        self.matmul(ple.key.r(dev), self.p(&emb, 0), n, self.p(&key, 0))?;
        let value = zeros(dev, n * d)?;
        self.matmul(ple.value.r(dev), self.p(&emb, 0), n, self.p(&value, 0))?;
        self.rms_norm(self.p(&key, 0), self.p(&ple.norm_key, 0), self.p(&key, 0), n * s, d, s)?;
        let qn = zeros(dev, n * dim)?;
        self.rms_norm(x, self.p(&ple.norm_query, 0), self.p(&qn, 0), n * s, d, s)?;
        let u = zeros(dev, n * dim)?;
        dev.launch(
            "ple_gate",
            ((n * s) as u32, 1, 1),
            128,
            &[
                Arg::Ptr(self.p(&key, 0)),
                Arg::Ptr(self.p(&qn, 0)),
                Arg::Ptr(self.p(&value, 0)),
                Arg::Ptr(self.p(&u, 0)),
                Arg::I32(s as i32),
                Arg::I32(d as i32),
            ],
        )?;
        let nrm = zeros(dev, n * dim)?;
        self.rms_norm(self.p(&u, 0), self.p(&ple.norm_conv, 0), self.p(&nrm, 0), n * s, d, s)?;
        let conv_state = st.ple_conv.as_ref().expect("PLE state exists with a PLE layer");
        if ple.cfg.conv_state_len() + 1 > 32 {
            return Err(CudaError::Unsupported("PLE conv history over 31 steps".into()));
        }
        dev.launch(
            "ple_conv",
            (dim.div_ceil(256) as u32, 1, 1),
            256,
            &[
                Arg::Ptr(self.p(&nrm, 0)),
                Arg::Ptr(self.p(conv_state, 0)),
                Arg::Ptr(self.p(&ple.conv, 0)),
                Arg::Ptr(self.p(&u, 0)),
                Arg::I32(n as i32),
                Arg::I32(dim as i32),
                Arg::I32(ple.cfg.conv_kernel as i32),
                Arg::I32(ple.cfg.ngram_size as i32),
            ],
        )?;
        dev.launch_1d("add_inplace", n * dim, &[Arg::Ptr(x), Arg::Ptr(self.p(&u, 0)), Arg::I64((n * dim) as i64)])?;
        Ok(())
    }

    /// Runs `tokens` through the model on the GPU, continuing `st`, and returns the logits asked for
    /// (`[rows, vocab]`, masked ids at `-inf`), as [`Qwen4Exp::forward`] does on the CPU.
    pub fn forward(&self, st: &mut CudaState, tokens: &[u32], want: LogitsFor) -> Result<Vec<f32>, CudaError> {
        let cfg = &self.config;
        let dev = &self.dev;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= cfg.vocab) {
            return Err(crate::model::ModelError::TokenOutOfRange { token: bad, vocab: cfg.vocab }.into());
        }
        let needed = st.pos + tokens.len();
        if needed > st.max_len {
            return Err(crate::model::ModelError::ContextOverflow { needed, limit: st.max_len }.into());
        }
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let (s, d) = (cfg.hc_count, cfg.hidden);
        let dim = s * d;
        let pos0 = st.pos;
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let ids_d = dev.stream().clone_htod(&ids)?;
        let x = zeros(dev, n * dim)?;
        let xp = self.p(&x, 0);
        self.get_rows(&self.embed, ptr(&ids_d, dev.stream(), 0), n, xp, dim, s)?;
        for (li, layer) in self.layers.iter().enumerate() {
            if let Some(ple) = &layer.ple {
                self.ple(ple, st, xp, tokens)?;
            }
            let (m, a) = self.hc_mix(&layer.attn_hc, xp, n)?;
            let ls = &mut st.layers[li];
            let y = match &layer.mixer {
                DevMixer::Gdn(g) => self.gdn(g, ls, &m, n)?,
                DevMixer::Attn(at) => self.attn(at, ls, &m, n, pos0)?,
            };
            self.hc_residual(xp, &y, a.as_ref().expect("layers inject"), n)?;
            let (m, a) = self.hc_mix(&layer.mlp_hc, xp, n)?;
            let y = self.moe(&layer.moe, &m, n)?;
            self.hc_residual(xp, &y, a.as_ref().expect("layers inject"), n)?;
        }
        st.pos = needed;
        let (r0, rows) = match want {
            LogitsFor::None => {
                dev.stream().synchronize()?;
                return Ok(Vec::new());
            }
            LogitsFor::Last => (n - 1, 1),
            LogitsFor::All => (0, n),
        };
        let (h, _) = self.hc_mix(&self.mixer, self.p(&x, r0 * dim), rows)?;
        let logits = zeros(dev, rows * cfg.vocab)?;
        self.matmul(self.lm_head.r(dev), self.p(&h, 0), rows, self.p(&logits, 0))?;
        if self.n_masked > 0 {
            dev.launch_1d(
                "mask_logits",
                rows * cfg.vocab,
                &[
                    Arg::Ptr(self.p(&logits, 0)),
                    Arg::I32(rows as i32),
                    Arg::I32(cfg.vocab as i32),
                    Arg::Ptr(ptr(&self.masked, dev.stream(), 0)),
                    Arg::I32(self.n_masked as i32),
                ],
            )?;
        }
        Ok(dev.stream().clone_dtoh(&logits)?)
    }
}

/// Bytes of weights [`CudaModel::from_cpu`] uploads (checked against the VRAM budget before allocating).
fn estimate_weight_bytes(model: &Qwen4Exp) -> usize {
    let mut total = model.embed_tokens.bytes().len() + model.lm_head.bytes().len();
    for l in &model.layers {
        total += l
            .mlp
            .experts
            .iter()
            .map(|e| e.gate_proj.bytes().len() + e.up_proj.bytes().len() + e.down_proj.bytes().len())
            .sum::<usize>();
        if let Some(p) = &l.ple {
            total += p.ngram_embedding.bytes().len();
        }
    }
    // Dense trunk matrices are small next to the experts; allow 10 % for them and the norms.
    total + total / 10
}

/// Which layer kinds a model has (for reports).
pub fn describe(cfg: &ModelConfig) -> String {
    let gdn = cfg.layer_kinds.iter().filter(|k| **k == LayerKind::LinearAttention).count();
    format!("{} layers ({gdn} Gated DeltaNet, {} attention)", cfg.n_layer, cfg.n_layer - gdn)
}

/// True when an NVIDIA driver library is installed (no CUDA call is made).
pub fn driver_present() -> bool {
    nebula_kernels::find_cuda_driver().is_some()
}
