//! The CUDA backend: every block of the model on the GPU, weights resident in VRAM (the "datacenter" case, and
//! the GPU half of the hybrid placement).
//!
//! The files mirror `crate::model` block for block, named as the reference names the blocks:
//! [`hyper_connection`], [`linear_attn`] (Gated DeltaNet), [`self_attn`] (with the QSA indexer), [`moe`], [`ple`]
//! and [`mtp`]; each device block owns its weights and its `forward`. Below them, knowing nothing of the blocks:
//! [`launch`] (the context every forward takes), [`gemv`] (launch geometry and the 8-bit activation helpers),
//! [`norm`], [`rope`], [`graphs`] (CUDA Graphs), [`memory`] (the arena), [`weights`] (upload) and [`device`] (the
//! GPU, kernel launches and copies). [`vision`] is the vision tower on the GPU ([`CudaVisionModel`]), beside the
//! language model; images reach the language model as injected rows with M-RoPE positions
//! ([`CudaModel::forward_media`]). [`hybrid`] is the host half of the hybrid placement, its
//! [`hybrid::policy`] every decision of the GPU/CPU split; [`chain`] drafts, verifies and rolls back MTP chains.
//!
//! [`CudaModel::from_cpu`] uploads the weights of a loaded (and validated) [`Qwen4Exp`] as they are stored —
//! quantized blocks stay quantized and are decoded in registers by the kernels. [`CudaModel::forward`] mirrors
//! the CPU forward pass block for block: decode-sized batches (up to 8 tokens) use the quantized GEMV kernels,
//! larger batches dequantize each weight to f32 and multiply with cuBLAS SGEMM (or int8 tensor cores).
//! Everything accumulates in f32; routed experts for small batches run through a gather GEMV over the
//! device-resident expert stack without a host round trip, larger batches group tokens by expert.

mod backend;
mod batch;
mod chain;
mod checkpoint;
mod device;
mod gemv;
mod graphs;
mod head;
pub mod hybrid;
mod hyper_connection;
#[cfg(test)]
mod kernel_tests;
mod kv_cache;
mod launch;
mod linear_attn;
mod memory;
mod moe;
mod mtp;
mod norm;
mod ple;
mod rope;
mod self_attn;
mod state;
mod vision;
mod weights;

pub use chain::{CudaChain, MAX_CHAIN_ROWS};
pub use checkpoint::CudaSnapshot;
pub use state::CudaState;
pub use vision::{CudaVisionModel, VISION_HEAD_DIMS};

use std::sync::Arc;
use std::sync::atomic::Ordering;

use nebula_kernels::cudarc::driver::{CudaSlice, CudaStream};
use nebula_kernels::{Gpu, GpuError};

use crate::backend::MediaRows;
use crate::model::config::{LayerKind, ModelConfig};
use crate::model::{LogitsFor, ModelError, Qwen4Exp, TokenMixer};
use crate::synth::routing::{RoutingOverride, stream_key};
use crate::tuning::CudaTuning;
use device::{Arg, Dev, dtoh, htod, ptr};
use head::TokenHead;
use hybrid::Hybrid;
use hybrid::policy::HybridPolicy;
use hyper_connection::DevGatedResidual;
use launch::{Launch, Seq};
use linear_attn::{DevGatedDeltaNet, GdnState};
use memory::zeros;
use moe::DevSparseMoe;
use mtp::DevMtpBlock;
use ple::DevPle;
use self_attn::DevAttention;
use state::{LayerState, RoutingBufs, StepBuffers};
use weights::{Uploader, estimate_weight_bytes};

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
    Model(#[from] ModelError),
}

impl From<nebula_kernels::cudarc::driver::DriverError> for CudaError {
    fn from(e: nebula_kernels::cudarc::driver::DriverError) -> Self {
        CudaError::Gpu(GpuError::from(e))
    }
}

/// A layer's token mixer on the device (`crate::model::TokenMixer`).
pub(crate) enum DevTokenMixer {
    LinearAttention(DevGatedDeltaNet),
    SelfAttention(DevAttention),
}

impl DevTokenMixer {
    /// The type of the first matrix that multiplies the mixer's input.
    fn input_type(&self) -> crate::gguf::GgmlType {
        match self {
            DevTokenMixer::LinearAttention(g) => g.input_type(),
            DevTokenMixer::SelfAttention(a) => a.input_type(),
        }
    }
}

/// One decoder layer on the device (`crate::model::DecoderLayer`).
pub(crate) struct DevDecoderLayer {
    pub(crate) ple: Option<DevPle>,
    pub(crate) attn_hyper_connection: DevGatedResidual,
    pub(crate) mixer: DevTokenMixer,
    pub(crate) mlp_hyper_connection: DevGatedResidual,
    pub(crate) mlp: DevSparseMoe,
}

/// A sequence's rows in a pass ([`CudaModel::launch_layers`]): its state, its first row and row count in the
/// pass's buffers, the device address of its position (`st.pos_dev`) and of its M-RoPE table (`st.mrope_dev`,
/// 0 without one).
#[derive(Clone, Copy)]
pub(crate) struct PassSeq<'a> {
    pub(crate) st: &'a CudaState,
    pub(crate) r0: usize,
    pub(crate) n: usize,
    pub(crate) pos_dev: u64,
    pub(crate) thw: u64,
}

impl<'a> PassSeq<'a> {
    /// The `n` rows from `r0` of the pass that `st` consumes.
    pub(crate) fn new(st: &'a CudaState, r0: usize, n: usize, stream: &std::sync::Arc<CudaStream>) -> Self {
        let thw = st.mrope_dev.as_ref().map_or(0, |t| ptr(t, stream, 0));
        Self { st, r0, n, pos_dev: ptr(&st.pos_dev, stream, 0), thw }
    }

    /// The sequence's rows with `part`, a block's part of its state.
    fn part<T>(&self, part: &'a T) -> Seq<'a, T> {
        Seq {
            st: part,
            r0: self.r0,
            n: self.n,
            pos_dev: self.pos_dev,
            thw: self.thw,
            pos: self.st.pos,
            capacity: self.st.max_len,
        }
    }
}

/// A pass's injected input rows on the device ([`CudaModel::launch_layers`]): `count` pass rows (`rows`, i32,
/// ascending) whose embedding is the `[count, hidden]` f32 rows at `embeds` instead of their token's.
#[derive(Clone, Copy)]
pub(crate) struct Injected {
    pub(crate) rows: u64,
    pub(crate) embeds: u64,
    pub(crate) count: usize,
}

/// The model on the GPU.
pub struct CudaModel {
    /// The device, the arena and the tuning flags every block's forward takes.
    pub(crate) launch: Launch,
    /// Shapes.
    pub config: ModelConfig,
    pub(crate) head: TokenHead,
    pub(crate) layers: Vec<DevDecoderLayer>,
    /// The final hyper-connection mixer before the output head.
    pub(crate) hyper_connection_mixer: DevGatedResidual,
    /// Bytes of weights uploaded.
    pub weight_bytes: usize,
    /// The host half when only the policy's resident experts are on the device (hybrid decode and streamed
    /// prefill, [`hybrid`]); `None`: every expert is on the GPU.
    pub(crate) hybrid: Option<Hybrid>,
    /// The MTP draft block (when the model has one loaded).
    pub(crate) mtp: Option<DevMtpBlock>,
    /// CUDA Graphs of batched decode steps, by the batch's sequences ([`batch::BatchGraphs`]).
    pub(crate) batch_graphs: std::sync::Mutex<batch::BatchGraphs>,
    /// The VRAM budget the model was loaded with less the hybrid staging ring, bytes (`None`: what is free).
    pub(crate) vram_budget: Option<u64>,
    /// The host model's routing override, if any (`crate::synth::routing`): every pass uploads its choice for
    /// the pass's rows and the trunk's MoE blocks use it in place of the routers'.
    pub(crate) routing: Option<Arc<dyn RoutingOverride>>,
}

impl std::fmt::Debug for CudaModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaModel")
            .field("gpu", &self.launch.dev.gpu.name)
            .field("weight_bytes", &self.weight_bytes)
            .finish()
    }
}

impl CudaModel {
    /// Opens GPU `ordinal` and uploads `model`'s weights. `vram_budget` (bytes), when given, is checked against
    /// both the weights' size and the free device memory before anything is allocated.
    pub fn from_cpu(
        model: &Qwen4Exp,
        ordinal: usize,
        vram_budget: Option<u64>,
        tuning: &CudaTuning,
    ) -> Result<Self, CudaError> {
        Self::build(model, ordinal, vram_budget, None, 0, tuning)
    }

    /// `model` on GPU `ordinal`: hybrid ([`CudaModel::hybrid`]) when it is placed, else every weight on the GPU
    /// ([`CudaModel::from_cpu`]).
    pub fn for_model(
        model: Arc<Qwen4Exp>,
        ordinal: usize,
        vram_budget: Option<u64>,
        tuning: &CudaTuning,
    ) -> Result<Self, CudaError> {
        if model.expert_tiers().is_some() {
            Self::hybrid(model, ordinal, vram_budget, tuning)
        } else {
            Self::from_cpu(&model, ordinal, vram_budget, tuning)
        }
    }

    /// The hybrid model ([`hybrid`]): `model` must be placed ([`Qwen4Exp::place`]); its GPU-tier experts and the
    /// dense trunk go to GPU `ordinal`, the CPU model keeps the rest and computes them. `vram_budget` (bytes)
    /// covers the trunk, the GPU experts and the staging buffers of streamed prefill.
    ///
    /// Errors: [`CudaError::Unsupported`] for a model without a placement; as [`CudaModel::from_cpu`].
    pub fn hybrid(
        model: Arc<Qwen4Exp>,
        ordinal: usize,
        vram_budget: Option<u64>,
        tuning: &CudaTuning,
    ) -> Result<Self, CudaError> {
        let params = hybrid::HybridParams::for_model(&model, &tuning.hybrid);
        Self::hybrid_with(model, ordinal, vram_budget, params, tuning)
    }

    /// [`CudaModel::hybrid`] with explicit [`hybrid::HybridParams`] (tests, benchmarks); `tuning.hybrid` is not
    /// consulted for what `params` sets.
    pub fn hybrid_with(
        model: Arc<Qwen4Exp>,
        ordinal: usize,
        vram_budget: Option<u64>,
        params: hybrid::HybridParams,
        tuning: &CudaTuning,
    ) -> Result<Self, CudaError> {
        if !(params.stage_experts > 0 && params.stages >= 2) {
            return Err(CudaError::Unsupported(
                "hybrid: stage_experts must be at least 1 and stages at least 2".into(),
            ));
        }
        let policy = HybridPolicy::plan(&model, params)
            .ok_or_else(|| CudaError::Unsupported("hybrid decode without a placement".into()))?;
        let stage = Hybrid::stage_bytes(&model, &params);
        let mut m = Self::build(&model, ordinal, vram_budget, Some(policy.resident_lists()), stage, tuning)?;
        let dev = &m.launch.dev;
        let stacks = m.layers.iter().map(|l| l.mlp.experts.views(dev).map(|v| (v.ptr, v.rows * v.row_bytes))).collect();
        m.hybrid = Some(Hybrid::new(&m.launch.dev, model, policy, tuning, stacks)?);
        // The step synchronises with the host once per layer: no whole-step graph.
        m.launch.flags.graphs = false;
        Ok(m)
    }

    /// Uploads the trunk and the routed experts `resident[layer]` (all of them when `None`; the MTP block's
    /// list follows the trunk's) after checking the weights plus `extra` bytes against the budget and the free
    /// memory.
    fn build(
        model: &Qwen4Exp,
        ordinal: usize,
        vram_budget: Option<u64>,
        resident: Option<&[Vec<usize>]>,
        extra: usize,
        tuning: &CudaTuning,
    ) -> Result<Self, CudaError> {
        let gpu = Gpu::open(ordinal)?;
        let (free, _total) = gpu.mem_info()?;
        let needed = (estimate_weight_bytes(model, resident) + extra) as u64;
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
        let dev = Dev::new(gpu, tuning)?;
        let cfg = model.config.clone();
        let mut up = Uploader { dev: &dev, bytes: 0 };
        let held = |layer: usize| resident.map(|r| &r[layer][..]);
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for (i, l) in model.layers.iter().enumerate() {
            let mixer = match &l.mixer {
                TokenMixer::LinearAttention(g) => {
                    DevTokenMixer::LinearAttention(DevGatedDeltaNet::upload(&mut up, g, i)?)
                }
                TokenMixer::SelfAttention(a) => DevTokenMixer::SelfAttention(DevAttention::upload(&mut up, a, i)?),
            };
            let mlp = DevSparseMoe::upload(&mut up, &l.mlp, held(i), i)?;
            let ple = match &l.ple {
                Some(p) => Some(DevPle::upload(&mut up, p, resident.is_none())?),
                None => None,
            };
            let attn_hyper_connection =
                DevGatedResidual::upload(&mut up, &l.attn_hyper_connection, &format!("blk.{i}.hc_attn"))?;
            let mlp_hyper_connection =
                DevGatedResidual::upload(&mut up, &l.mlp_hyper_connection, &format!("blk.{i}.hc_ffn"))?;
            layers.push(DevDecoderLayer { ple, attn_hyper_connection, mixer, mlp_hyper_connection, mlp });
        }
        // The MTP block's experts: the list after the trunk's (the policy keeps none resident).
        let mtp_held = resident.map(|r| r.get(model.layers.len()).map_or(&[][..], |l| &l[..]));
        let mtp = DevMtpBlock::upload(&mut up, model, mtp_held)?;
        let head = TokenHead::upload(&mut up, &dev, model)?;
        let hyper_connection_mixer = DevGatedResidual::upload(&mut up, &model.hyper_connection_mixer, "output_hc")?;
        let weight_bytes = up.bytes;
        check_kv_window(&cfg, tuning.kv_window)?;
        Ok(Self {
            launch: Launch::new(dev, cfg.clone(), tuning),
            config: cfg,
            head,
            layers,
            hyper_connection_mixer,
            weight_bytes,
            hybrid: None,
            mtp,
            batch_graphs: Default::default(),
            // What the states may take of the budget: less the streamed prefill's staging (`extra`).
            vram_budget: vram_budget.map(|b| b.saturating_sub(extra as u64)),
            routing: model.routing_override().cloned(),
        })
    }

    /// The hybrid half and the MTP block's layer index, for the MTP block's MoE (`None` unless hybrid).
    pub(crate) fn mtp_host(&self) -> Option<(&Hybrid, usize)> {
        self.hybrid.as_ref().map(|h| (h, self.layers.len()))
    }

    /// Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written), measured with `bytes`-sized
    /// copies: the HBM ceiling of the floor computations.
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64, CudaError> {
        let dev = &self.launch.dev;
        let n = bytes / 4;
        let src = zeros(dev, n)?;
        let mut dst = zeros(dev, n)?;
        let stream = dev.stream();
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

    /// The CPU model of a hybrid model.
    pub fn host_model(&self) -> Option<&Qwen4Exp> {
        self.hybrid.as_ref().map(|h| &*h.host)
    }

    /// The hybrid settings in effect (the CPU/streaming crossover as chosen at load); `None` unless hybrid.
    pub fn hybrid_params(&self) -> Option<hybrid::HybridParams> {
        self.hybrid.as_ref().map(|h| h.policy.params())
    }

    /// The GPU expert cache in effect (hybrid only; static when the placement asks for none or it cannot adapt).
    pub fn gpu_cache(&self) -> Option<crate::placement::GpuCacheOptions> {
        self.hybrid.as_ref().map(|h| h.gpu_cache())
    }

    /// Bytes of the RAM tier registered with the GPU driver for full-speed uploads (hybrid only).
    pub fn registered_bytes(&self) -> usize {
        self.hybrid.as_ref().map_or(0, |h| h.registered_bytes)
    }

    /// True when only the placement's GPU-tier experts are on the device ([`CudaModel::hybrid`]).
    pub fn is_hybrid(&self) -> bool {
        self.hybrid.is_some()
    }

    /// Where hybrid steps spent their time since the last call (then reset); `None` unless hybrid.
    pub fn take_hybrid_times(&self) -> Option<hybrid::HybridTimes> {
        use std::sync::atomic::Ordering::Relaxed;
        self.hybrid.as_ref().map(|h| hybrid::HybridTimes {
            cpu_s: h.cpu_ns.swap(0, Relaxed) as f64 * 1e-9,
            wait_s: h.wait_ns.swap(0, Relaxed) as f64 * 1e-9,
            gpu_s: h.gpu_ns.swap(0, Relaxed) as f64 * 1e-9,
            trips: h.trips.swap(0, Relaxed),
        })
    }

    /// The streamed-prefill timeline since the last call (the `copies` profile, hybrid only), then cleared.
    pub fn take_copy_report(&self) -> Result<Option<String>, CudaError> {
        let Some(log) = self.hybrid.as_ref().and_then(|h| h.copy_log.as_ref()) else { return Ok(None) };
        let entries = std::mem::take(&mut *log.lock().expect("copy log lock"));
        hybrid::copy_report(&entries)
    }

    /// Mean seconds of one host -> GPU -> host round trip of a small buffer (a copy each way and a stream
    /// synchronisation, as a hybrid layer does), over 200 trips.
    pub fn round_trip(&self) -> Result<f64, CudaError> {
        let stream = self.launch.dev.stream();
        let mut buf = stream.alloc_zeros::<f32>(2560)?;
        let host = vec![1f32; 2560];
        let mut back = vec![0f32; 2560];
        stream.memcpy_htod(&host, &mut buf)?;
        stream.memcpy_dtoh(&buf, &mut back)?;
        stream.synchronize()?;
        let t = std::time::Instant::now();
        for _ in 0..200 {
            stream.memcpy_htod(&host, &mut buf)?;
            stream.memcpy_dtoh(&buf, &mut back)?;
            stream.synchronize()?;
        }
        Ok(t.elapsed().as_secs_f64() / 200.0)
    }

    /// Device bytes the sequence states may take: what the GPU has free now, within the VRAM budget the model
    /// was loaded with (less its weights and the staging buffers).
    ///
    /// Errors: the device query failed.
    pub fn state_room(&self) -> Result<usize, CudaError> {
        let (free, _) = self.launch.dev.gpu.mem_info()?;
        let within = self
            .vram_budget
            .map_or(usize::MAX, |b| (b as usize).saturating_sub(self.weight_bytes + self.staging_bytes()));
        Ok(free.min(within))
    }

    /// Device bytes of the shared staging buffers of windowed KV caches (0 until a windowed state was made).
    pub fn staging_bytes(&self) -> usize {
        self.launch.cold.lock().expect("staging lock").held()
    }

    /// The hot window of the KV cache in effect, tokens (0: every token in VRAM).
    pub fn kv_window(&self) -> usize {
        self.launch.kv_window
    }

    /// The GPU's name.
    pub fn gpu_name(&self) -> &str {
        &self.launch.dev.gpu.name
    }

    /// A fresh state for at most `max_len` tokens (KV caches allocated now: an out-of-memory is reported here,
    /// never in the middle of a request), with an MTP cache that every forward keeps aligned when the model has
    /// the block ([`CudaModel::new_state_with`] without it).
    pub fn new_state(&self, max_len: usize) -> Result<CudaState, CudaError> {
        self.new_state_with(max_len, true)
    }

    /// [`CudaModel::new_state`]; `draft` false leaves out the MTP cache (no MTP pass after each forward: for
    /// sequences that never draft), and drafting then refuses.
    pub fn new_state_with(&self, max_len: usize, draft: bool) -> Result<CudaState, CudaError> {
        let ctx = &self.launch;
        let (cfg, dev) = (&self.config, &ctx.dev);
        let mut layers = Vec::new();
        for l in &self.layers {
            layers.push(match &l.mixer {
                DevTokenMixer::LinearAttention(_) => LayerState::LinearAttention(GdnState::new(ctx)?),
                DevTokenMixer::SelfAttention(a) => LayerState::Attention(a.new_state(ctx, max_len, ctx.kv_window)?),
            });
        }
        let ple = self.layers.iter().find_map(|l| l.ple.as_ref());
        Ok(CudaState {
            id: state::next_state_id(),
            pos: 0,
            max_len,
            layers,
            ple: ple.map(|p| p.new_state(ctx)).transpose()?,
            pos_dev: dev.stream().alloc_zeros::<i32>(1)?,
            step: StepBuffers {
                token: dev.stream().alloc_zeros::<i32>(1)?,
                ple_rows: dev.stream().alloc_zeros::<i32>(ple.map_or(1, |p| p.cfg.n_heads()))?,
                logits: zeros(dev, cfg.vocab)?,
                choice: dev.stream().alloc_zeros::<i32>(1)?,
            },
            graph: None,
            mtp: match (&self.mtp, draft) {
                (Some(mtp), true) => Some(mtp.new_state(ctx, max_len)?),
                _ => None,
            },
            chain: None,
            verify_graphs: (0..=MAX_CHAIN_ROWS).map(|_| (None, 0)).collect(),
            decode_steps: 0,
            want_argmax: false,
            argmax_out: None,
            routing_stream: 0,
            mrope: crate::model::MropeTrack::default(),
            mrope_dev: None,
            routing: match &self.routing {
                Some(_) => {
                    let len = MAX_CHAIN_ROWS * cfg.n_layer * cfg.n_expert_used;
                    Some(RoutingBufs { ids: dev.stream().alloc_zeros(len)?, weights: zeros(dev, len)? })
                }
                None => None,
            },
        })
    }

    /// Bytes of every buffer [`Self::new_state_with`] allocates for `max_len` tokens (`draft` as there): device
    /// memory (each layer's caches, in the KV cache type and with the hot window, or recurrent state, the PLE conv
    /// history, the position, the decode step's token, PLE rows, logits and argmax, the MTP cache, banks and draft
    /// buffers) and host memory (the PLE n-gram context, the host copies of windowed caches). A verify pass adds
    /// its chain buffers to a state later, on its first chain. The staging buffers of windowed caches are the
    /// model's, shared by every state ([`Self::staging_bytes`]).
    pub fn state_alloc_bytes(&self, max_len: usize, draft: bool) -> crate::backend::HeldBytes {
        let cfg = &self.config;
        let mut values = 0usize;
        let (mut cache_device, mut cache_host) = (0usize, 0usize);
        for l in &self.layers {
            match &l.mixer {
                DevTokenMixer::LinearAttention(_) => values += GdnState::lens(cfg).iter().sum::<usize>(),
                DevTokenMixer::SelfAttention(a) => {
                    let b = a.cache_bytes(cfg, max_len, self.launch.kv_window);
                    cache_device += b.device;
                    cache_host += b.host;
                }
            }
        }
        let ple = self.layers.iter().find_map(|l| l.ple.as_ref());
        values += ple.map_or(0, |p| p.conv_len(cfg));
        // pos_dev, then the step buffers: token, PLE rows, logits, argmax.
        values += 1 + 1 + ple.map_or(1, |p| p.cfg.n_heads()) + cfg.vocab.max(1) + 1;
        if self.routing.is_some() {
            values += 2 * MAX_CHAIN_ROWS * cfg.n_layer * cfg.n_expert_used;
        }
        let mtp = match (&self.mtp, draft) {
            (Some(m), true) => m.state_bytes(cfg, max_len),
            _ => 0,
        };
        crate::backend::HeldBytes {
            device: 4 * values + cache_device + mtp,
            host: ple.map_or(0, |p| 4 * p.context_len()) + cache_host,
        }
    }

    /// A plain decode step that consumes `token` and returns the argmax of its logits (masked vocabulary rows
    /// excluded; ties to the lower id; `None` when every logit is `-inf` or NaN), chosen on the device: one
    /// 4-byte copy instead of the `[vocab]` logits. Greedy decoding without penalties, grammar or log-probabilities
    /// gives the same token as [`crate::sampling::argmax`] on [`Self::forward`]'s logits.
    ///
    /// Errors: as [`Self::forward`].
    pub fn step_argmax(&self, st: &mut CudaState, token: u32) -> Result<Option<u32>, CudaError> {
        st.want_argmax = true;
        st.argmax_out = None;
        let out = self.forward(st, &[token], LogitsFor::Last);
        st.want_argmax = false;
        out?;
        Ok(st.argmax_out.take())
    }

    /// Per-kernel (name, total seconds, launches) under the `kernels` profile; then clears it.
    pub fn take_kernel_times(&self) -> Vec<(String, f64, u64)> {
        self.launch
            .dev
            .kernel_times
            .as_ref()
            .map_or_else(Vec::new, |t| std::mem::take(&mut *t.lock().expect("kernel times lock")))
    }

    /// Turns decode-step CUDA Graphs on or off (on by default; [`CudaTuning::graphs`]). A hybrid model never
    /// captures one: its steps synchronise with the host once per layer.
    pub fn set_graphs(&mut self, on: bool) {
        self.launch.flags.graphs = on && self.hybrid.is_none();
    }

    /// Turns int8 tensor-core prefill on or off (on by default where the GPU has compute capability 8.0 or newer;
    /// [`CudaTuning::tensor_cores`]): routed experts (`moe_groupedmma_*` instead of the dp4a `moe_groupedq_*`,
    /// the same integer products) and quantized dense matmuls (MMA on 8-bit activations instead of f32 cuBLAS on
    /// dequantized weights, so outputs also differ by activation rounding). Below compute capability 8.0, or with
    /// 8-bit activations off ([`CudaTuning::q8_activations`]), it stays off.
    pub fn set_tensor_cores(&mut self, on: bool) {
        self.launch.flags.tensor_cores = on && self.launch.dev.gpu.capability.0 >= 8;
    }

    /// The profile so far: (phase, total seconds, count), under the `phases` profile; then clears it.
    pub fn take_profile(&self) -> Vec<(&'static str, f64, u64)> {
        self.launch.take_profile()
    }

    /// Every launch of one forward pass of `n` tokens (ids and PLE rows already on the device, the position in
    /// `st.pos_dev`), ending with the logits of `rows` tokens from `r0` in `logits` (when `rows > 0`); returns
    /// the address of the pre-mixer banks. Issues no host synchronisation, so the decode step can be captured as
    /// a CUDA Graph. Reads like `Qwen4Exp::forward_inner`.
    #[allow(clippy::too_many_arguments)]
    fn launch_pass(
        &self,
        st: &CudaState,
        n: usize,
        ids: u64,
        ple_rows: u64,
        ple_emb: Option<u64>,
        r0: usize,
        rows: usize,
        logits: u64,
        rec: Option<&chain::ChainBufs>,
        scripted: Option<(u64, u64)>,
        inject: Option<Injected>,
    ) -> Result<u64, CudaError> {
        let ctx = &self.launch;
        let dim = self.config.hc_dim();
        let seq = PassSeq::new(st, 0, n, ctx.dev.stream());
        let x = self.launch_layers(&[seq], n, ids, ple_rows, ple_emb, rec, scripted, inject)?;
        if let Some(r) = rec {
            ctx.dtod(r.banks_rec(ctx), x, n * dim)?;
        }
        if rows > 0 {
            self.launch_head(x + (r0 * dim * 4) as u64, rows, logits)?;
        }
        Ok(x)
    }

    /// The embedding and every decoder layer over the `n` rows of the sequences `seqs` (which cover the rows in
    /// order; ids and PLE rows of all of them already on the device, each position in its `pos_dev`): the
    /// row-wise work of each block over all rows at once, the sequence mixing (Gated DeltaNet conv and
    /// recurrence, attention over each sequence's own cache, the PLE conv) per sequence. Returns the address of
    /// the pre-mixer banks `[n, S*d]`. With `rec` (a verify pass, one sequence) the states are saved first and
    /// the recurrences' inputs recorded. With `scripted` (device `[layer][n][k]` expert ids and weights of a
    /// routing override, from [`Self::scripted_routing`]) every trunk MoE uses those instead of its router's choice.
    /// With `inject` (a prompt's image rows) those rows start from the given embeddings instead of their tokens'.
    /// Issues no host synchronisation (but hybrid layers').
    #[allow(clippy::too_many_arguments)]
    fn launch_layers(
        &self,
        seqs: &[PassSeq<'_>],
        n: usize,
        ids: u64,
        ple_rows: u64,
        ple_emb: Option<u64>,
        rec: Option<&chain::ChainBufs>,
        scripted: Option<(u64, u64)>,
        inject: Option<Injected>,
    ) -> Result<u64, CudaError> {
        let ctx = &self.launch;
        let cfg = &self.config;
        let dev = &ctx.dev;
        let (s, d) = (cfg.hc_count, cfg.hidden);
        let dim = s * d;
        dev.set_pass_tokens(n);
        if let (Some(r), [seq]) = (rec, seqs) {
            self.save_chain_states(seq.st, r)?;
        }
        ctx.settle_cold()?;
        if let [q] = seqs
            && let Some((first, ratio)) = self.next_attention(q.st, usize::MAX)
        {
            // The first windowed layer's cold keys start copying now.
            let kv_row = cfg.kv_cache.row_bytes(cfg.n_head_kv * cfg.head_dim);
            ctx.prefetch_cold(first, q.st.pos, q.n, ratio, kv_row)?;
        }
        ctx.phase("start")?;
        // X_0 = [e; e; ...; e], e the token's embedding or the row's injected one (an image's features).
        let x = ctx.tmp(n * dim)?;
        ctx.get_rows(&self.head.embed_tokens, ids, n, x, dim, s)?;
        if let Some(inj) = inject.filter(|i| i.count > 0) {
            dev.launch_1d(
                "inject_rows",
                inj.count * d,
                &[
                    Arg::Ptr(x),
                    Arg::Ptr(inj.rows),
                    Arg::Ptr(inj.embeds),
                    Arg::I32(inj.count as i32),
                    Arg::I32(d as i32),
                    Arg::I32(s as i32),
                ],
            )?;
        }
        ctx.phase("embedding")?;
        // The hybrid CPU path's pinned buffers hold `cpu_path_rows` rows: an exact-rows pass (which always takes
        // that path) over more runs its MoE in row chunks; every other pass is within them (`HybridPolicy::path`).
        let moe_rows = match &self.hybrid {
            Some(h) if ctx.exact() => h.policy.cpu_path_rows(),
            _ => n,
        };
        for (li, layer) in self.layers.iter().enumerate() {
            // A layer's temporaries are dead once its output is in `x`: the next layer reuses their memory, so a
            // pass needs one layer's worth of scratch, not the sum over layers.
            let mark = ctx.arena_mark();
            if let Some(ple) = &layer.ple {
                let convs: Vec<_> = seqs
                    .iter()
                    .map(|q| q.part(&q.st.ple.as_ref().expect("PLE state exists with a PLE layer").conv))
                    .collect();
                ple.forward_seqs(ctx, &convs, x, ple_rows, ple_emb, n, rec.and_then(|r| r.ple_rec(ctx)))?;
                ctx.phase("ple")?;
            }
            let mixed = layer.attn_hyper_connection.forward(ctx, x, n, Some(layer.mixer.input_type()), None)?;
            ctx.phase("hyper-connections")?;
            let y = match &layer.mixer {
                DevTokenMixer::LinearAttention(g) => {
                    let states: Vec<_> = seqs
                        .iter()
                        .map(|q| match &q.st.layers[li] {
                            LayerState::LinearAttention(gs) => q.part(gs),
                            LayerState::Attention(_) => unreachable!("state follows the layer kinds"),
                        })
                        .collect();
                    let y = g.forward_seqs(ctx, mixed.mixed, n, &states, rec.and_then(|r| r.gdn_rec(ctx, li)))?;
                    ctx.phase("gated deltanet")?;
                    y
                }
                DevTokenMixer::SelfAttention(a) => {
                    let states: Vec<_> = seqs
                        .iter()
                        .map(|q| match &q.st.layers[li] {
                            LayerState::Attention(at) => q.part(at),
                            LayerState::LinearAttention(_) => unreachable!("state follows the layer kinds"),
                        })
                        .collect();
                    // A prefill pass of one sequence copies the next windowed layer's cold keys while the layers
                    // in between run (kv_cache.rs).
                    let next = match seqs {
                        [q] => self.next_attention(q.st, li),
                        _ => None,
                    };
                    let y = a.forward_seqs(ctx, mixed.mixed, n, &states, next)?;
                    ctx.phase("attention + qsa")?;
                    y
                }
            };
            let a = mixed.inject.expect("layers inject");
            let mixed = layer.mlp_hyper_connection.forward(ctx, x, n, Some(layer.mlp.input_type()), Some((y, a)))?;
            ctx.phase("hyper-connections")?;
            let host = self.hybrid.as_ref().map(|h| (h, li));
            let inject = mixed.inject.expect("layers inject");
            let k = cfg.n_expert_used;
            let mut c0 = 0;
            while c0 < n {
                let c = moe_rows.min(n - c0);
                let res = Some((x + (c0 * dim * 4) as u64, inject + (c0 * s * 4) as u64));
                let at = ((li * n + c0) * k * 4) as u64;
                let chosen = scripted.map(|(ids, w)| (ids + at, w + at));
                layer.mlp.forward(ctx, host, mixed.mixed + (c0 * d * 4) as u64, c, res, chosen)?;
                c0 += c;
            }
            ctx.phase("moe")?;
            ctx.arena_release(mark);
        }
        Ok(x)
    }

    /// The cache of the first windowed attention layer of `st` after layer `after` (`usize::MAX`: from the
    /// first layer), with its compress ratio.
    fn next_attention<'s>(&self, st: &'s CudaState, after: usize) -> Option<(&'s self_attn::AttnState, usize)> {
        let from = after.wrapping_add(1);
        self.layers.iter().zip(&st.layers).enumerate().skip(from).find_map(|(_, (l, ls))| match (&l.mixer, ls) {
            (DevTokenMixer::SelfAttention(a), LayerState::Attention(at)) if at.host.is_some() => {
                a.indexer.as_ref().map(|i| (at, i.compress_ratio))
            }
            _ => None,
        })
    }

    /// The final hyper-connection mixer and the output head over `rows` pre-mixer banks at `banks` (`[rows,
    /// S*d]`): their masked logits into `logits` (`[rows, vocab]`).
    fn launch_head(&self, banks: u64, rows: usize, logits: u64) -> Result<(), CudaError> {
        let ctx = &self.launch;
        let h = self.hyper_connection_mixer.forward(ctx, banks, rows, Some(self.head.lm_head.ty), None)?;
        ctx.matmul(self.head.lm_head.view(&ctx.dev), h.mixed, rows, logits)?;
        ctx.phase("head")?;
        self.head.mask_logits(ctx, logits, rows)
    }

    /// Runs `tokens` through the model on the GPU, continuing `st`, and returns the logits asked for
    /// (`[rows, vocab]`, masked ids at `-inf`), as [`Qwen4Exp::forward`] does on the CPU. Single-token steps that
    /// want the last logits run as a CUDA Graph captured on the state's second such step (unless
    /// [`CudaTuning::graphs`] is off).
    pub fn forward(&self, st: &mut CudaState, tokens: &[u32], want: LogitsFor) -> Result<Vec<f32>, CudaError> {
        self.forward_guarded(st, tokens, want, None, None)
    }

    /// [`CudaModel::forward`] for a chunk of a prompt with images (`crate::model::Qwen4Exp::forward_batch` with
    /// [`MediaRows`] on the CPU): the rows `media.rows` start from the vision tower's features `media.embeds`
    /// instead of their pad tokens' embeddings, and every row takes its rope position from `media.positions`
    /// (kept in the state's M-RoPE track; text after the image continues from it). `None` is
    /// [`CudaModel::forward`]. A chunk with media runs eagerly (never as a captured graph).
    ///
    /// Errors: as [`CudaModel::forward`]; [`ModelError::MediaRows`] for rows or positions that do not fit the
    /// chunk (state unchanged).
    pub fn forward_media(
        &self,
        st: &mut CudaState,
        tokens: &[u32],
        want: LogitsFor,
        media: Option<&MediaRows<'_>>,
    ) -> Result<Vec<f32>, CudaError> {
        self.forward_guarded(st, tokens, want, None, media)
    }

    /// [`CudaModel::forward_media`], recording into `rec` for a verify pass (see [`chain`]).
    fn forward_guarded(
        &self,
        st: &mut CudaState,
        tokens: &[u32],
        want: LogitsFor,
        rec: Option<&chain::ChainBufs>,
        media: Option<&MediaRows<'_>>,
    ) -> Result<Vec<f32>, CudaError> {
        use std::sync::atomic::Ordering::Relaxed;
        let ctx = &self.launch;
        if let Some(r) = rec {
            ctx.exact_rows.store(true, Relaxed);
            if self.verify_reports_coverage() {
                ctx.coverage_out.store(r.coverage_rec(ctx), Relaxed);
            }
        }
        let out = self.forward_inner(st, tokens, want, rec, media);
        ctx.exact_rows.store(false, Relaxed);
        ctx.coverage_out.store(0, Relaxed);
        self.settle(out)
    }

    /// The outcome of a call that ran passes: a failed CPU job of hybrid decode (an SSD read error) fails it (its
    /// states must be discarded), and after any failure the stream is drained so no enqueued wait on the CPU
    /// thread outlives the call.
    fn settle<T>(&self, out: Result<T, CudaError>) -> Result<T, CudaError> {
        let stream = self.launch.dev.stream();
        if let Some(e) = self.hybrid.as_ref().and_then(|h| h.cpu.as_ref()).and_then(|c| c.take_error()) {
            if out.is_err() {
                // The stream may still hold work that waits on the CPU thread, which signals even on errors.
                let _ = stream.synchronize();
            }
            return Err(e.into());
        }
        if out.is_err() && self.hybrid.is_some() {
            // Let every enqueued wait drain (the CPU thread signals each job) before the next call.
            let _ = stream.synchronize();
        }
        out
    }

    /// Hybrid: the n-gram table stays on the host; the rows `ple_rows` a pass reads are decoded there and
    /// uploaded (`[rows, head_dim]`: 10 KiB a token for the real model). `None` for an all-GPU model (its table is
    /// on the device) or without rows.
    fn upload_ngram_rows(&self, ple_rows: &[i32]) -> Result<Option<CudaSlice<f32>>, CudaError> {
        let Some(h) = self.hybrid.as_ref().filter(|_| !ple_rows.is_empty()) else { return Ok(None) };
        let rows: Vec<u64> = ple_rows.iter().map(|&r| r as u64).collect();
        Ok(match h.host.gather_ngram_rows(&rows)? {
            Some(emb) => {
                h.stats.pcie_bytes.fetch_add((emb.len() * 4) as u64, Ordering::Relaxed);
                Some(self.launch.dev.stream().clone_htod(&emb)?)
            }
            None => None,
        })
    }

    /// The injected rows of a pass on the device: for each `(first pass row, media)` of the pass's items, its
    /// rows (offset to pass rows, i32) and their embeddings, concatenated in order; `None` when no item injects.
    ///
    /// Errors: a device copy fails.
    pub(crate) fn upload_injected<'a, 'b: 'a>(
        &self,
        items: impl Iterator<Item = (usize, &'a MediaRows<'b>)>,
    ) -> Result<Option<(CudaSlice<i32>, CudaSlice<f32>)>, CudaError> {
        let (mut rows, mut embeds) = (Vec::new(), Vec::new());
        for (r0, m) in items {
            rows.extend(m.rows.iter().map(|&r| (r0 + r) as i32));
            embeds.extend_from_slice(m.embeds);
        }
        if rows.is_empty() {
            return Ok(None);
        }
        let stream = self.launch.dev.stream();
        Ok(Some((stream.clone_htod(&rows)?, stream.clone_htod(&embeds)?)))
    }

    /// The routing override's choice for the rows of `items` (each state's stream, from its first token when
    /// it starts now, and positions; the items' rows in order) in the device layout `[layer][row][k]`: expert ids
    /// and weights. `None` without an override.
    pub(crate) fn scripted_routing(&self, items: &mut [(&mut CudaState, &[u32])]) -> Option<(Vec<i32>, Vec<f32>)> {
        let o = self.routing.as_ref()?;
        let (l, k) = (self.config.n_layer, self.config.n_expert_used);
        let rows: Vec<_> = items
            .iter_mut()
            .map(|(st, tokens)| {
                if st.pos == 0
                    && let Some(&first) = tokens.first()
                {
                    st.routing_stream = stream_key(first);
                }
                o.rows(st.routing_stream, st.pos, tokens.len())
            })
            .collect();
        let n: usize = rows.iter().map(|r| r.len()).sum();
        let (mut ids, mut w) = (vec![0i32; l * n * k], vec![0f32; l * n * k]);
        for li in 0..l {
            let mut row = 0;
            for r in &rows {
                for j in 0..r.len() {
                    let at = (li * n + row) * k;
                    for (o, &e) in ids[at..at + k].iter_mut().zip(r.experts(j, li)) {
                        *o = e as i32;
                    }
                    w[at..at + k].copy_from_slice(r.weights(j, li));
                    row += 1;
                }
            }
        }
        Some((ids, w))
    }

    /// Records the rope positions of the `n` tokens `st` takes next (`media`'s, or text continuing its M-RoPE
    /// track) and, once any position differs from its index, keeps the state's device table of them
    /// (`CudaState::mrope_dev`) up to date for the kernels: made with every earlier position on the first such
    /// token, then given each new row's.
    ///
    /// Errors: the table cannot be allocated or copied.
    pub(crate) fn stage_positions(
        &self,
        st: &mut CudaState,
        n: usize,
        media: Option<&MediaRows<'_>>,
    ) -> Result<(), CudaError> {
        let base = st.pos;
        for k in 0..n {
            let p = match media {
                Some(m) => m.positions[k],
                None => [st.mrope.next_text(); 3],
            };
            st.mrope.push(base + k, p);
        }
        if st.mrope_dev.is_none() && st.mrope.explicit().is_empty() {
            return Ok(());
        }
        self.upload_positions(st, base, base + n)
    }

    /// Copies the positions of cache indices `[from, to)` of `st`'s track into its device table, making the table
    /// first (then with every position before `to`). Graphs captured before the table existed read none: the
    /// state's own are dropped and it takes a new id, which retires the batched decode graphs keyed by the old.
    ///
    /// Errors: the table cannot be allocated or copied.
    pub(crate) fn upload_positions(&self, st: &mut CudaState, from: usize, to: usize) -> Result<(), CudaError> {
        let stream = self.launch.dev.stream().clone();
        let mut from = from;
        if st.mrope_dev.is_none() {
            st.mrope_dev = Some(stream.alloc_zeros::<i32>(3 * st.max_len.max(1))?);
            st.id = state::next_state_id();
            st.graph = None;
            st.decode_steps = 0;
            for g in st.verify_graphs.iter_mut() {
                *g = (None, 0);
            }
            from = 0;
        }
        if to <= from {
            return Ok(());
        }
        let vals: Vec<i32> = (from..to).flat_map(|i| st.mrope.position(i).map(|v| v as i32)).collect();
        let table = st.mrope_dev.as_mut().expect("made above");
        let mut view = table.slice_mut(3 * from..3 * to);
        stream.memcpy_htod(&vals, &mut view)?;
        Ok(())
    }

    fn forward_inner(
        &self,
        st: &mut CudaState,
        tokens: &[u32],
        want: LogitsFor,
        rec: Option<&chain::ChainBufs>,
        media: Option<&MediaRows<'_>>,
    ) -> Result<Vec<f32>, CudaError> {
        let ctx = &self.launch;
        let cfg = &self.config;
        if let Some(h) = &self.hybrid {
            // The GPU's critical path of this step starts here.
            h.step_started(ctx.dev.stream())?;
        }
        let dev = &ctx.dev;
        self.check_tokens(st, tokens)?;
        if let Some(m) = media {
            m.check(tokens.len(), cfg.hidden)?;
        }
        let needed = st.pos + tokens.len();
        let n = tokens.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let stream = dev.stream().clone();
        self.stage_positions(st, n, media)?;
        let ple_rows = match (self.layers.iter().find_map(|l| l.ple.as_ref()), st.ple.as_mut()) {
            (Some(ple), Some(ps)) => ple.ngram_rows(ps, tokens)?,
            _ => Vec::new(),
        };
        // Kept alive until the pass is queued; the free is stream-ordered.
        let ple_emb = self.upload_ngram_rows(&ple_rows)?;
        let ple_emb_ptr = ple_emb.as_ref().map(|e| ptr(e, &stream, 0));
        stream.memcpy_htod(&[st.pos as i32], &mut st.pos_dev)?;
        let pos0 = st.pos;
        // A routing override's choice for the rows (`[layer][row][k]`), uploaded into the state's fixed buffers
        // for the graphed passes, or fresh ones for an eager pass.
        let table = self.scripted_routing(&mut [(&mut *st, tokens)]);
        let decode_step = n == 1 && want == LogitsFor::Last && rec.is_none() && media.is_none();
        let graphed_verify = rec.is_some() && ctx.flags.graphs && want == LogitsFor::All && n <= MAX_CHAIN_ROWS;
        let mut eager_table = None;
        let scripted = match (&table, &st.routing) {
            (Some((ti, tw)), Some(bufs)) if decode_step || graphed_verify => {
                htod(&stream, ptr(&bufs.ids, &stream, 0), ti.as_ptr() as *const u8, ti.len() * 4)?;
                htod(&stream, ptr(&bufs.weights, &stream, 0), tw.as_ptr() as *const u8, tw.len() * 4)?;
                Some((ptr(&bufs.ids, &stream, 0), ptr(&bufs.weights, &stream, 0)))
            }
            (Some((ti, tw)), _) => {
                let up = (stream.clone_htod(ti)?, stream.clone_htod(tw)?);
                let p = (ptr(&up.0, &stream, 0), ptr(&up.1, &stream, 0));
                eager_table = Some(up);
                Some(p)
            }
            (None, _) => None,
        };
        if decode_step {
            stream.memcpy_htod(&[tokens[0] as i32], &mut st.step.token)?;
            if !ple_rows.is_empty() {
                stream.memcpy_htod(&ple_rows, &mut st.step.ple_rows)?;
            }
            let ids = ptr(&st.step.token, &stream, 0);
            let rows = ptr(&st.step.ple_rows, &stream, 0);
            let logits = ptr(&st.step.logits, &stream, 0);
            let mut slot = st.graph.take();
            let mut seen = st.decode_steps;
            let bank = ctx.run_graphed(&mut slot, &mut seen, || {
                self.launch_pass(st, 1, ids, rows, ple_emb_ptr, 0, 1, logits, None, scripted, None)
            });
            st.graph = slot;
            let bank = bank?;
            st.decode_steps += 1;
            st.pos = needed;
            self.mtp_extend(st, bank, tokens, pos0)?;
            if st.want_argmax {
                // Greedy: the token is chosen on the device; 4 bytes come back instead of the vocabulary.
                let choice = ptr(&st.step.choice, &stream, 0);
                dev.launch(
                    "argmax_rows",
                    (1, 1, 1),
                    1024,
                    &[Arg::Ptr(logits), Arg::I32(cfg.vocab as i32), Arg::Ptr(choice)],
                )?;
                let id = stream.clone_dtoh(&st.step.choice)?[0];
                st.argmax_out = u32::try_from(id).ok();
                return Ok(Vec::new());
            }
            return Ok(stream.clone_dtoh(&st.step.logits)?);
        }
        if let Some(bufs) = rec.filter(|_| graphed_verify) {
            // A verify pass: fixed buffers, so it replays as a CUDA Graph per chain length.
            let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
            let (ids_p, rows_p, logits_p) = bufs.pass_buffers(ctx);
            htod(&stream, ids_p, ids.as_ptr() as *const u8, n * 4)?;
            if !ple_rows.is_empty() {
                htod(&stream, rows_p, ple_rows.as_ptr() as *const u8, ple_rows.len() * 4)?;
            }
            let mut graphs = std::mem::take(&mut st.verify_graphs);
            let out = {
                let (slot, seen) = &mut graphs[n];
                ctx.run_graphed(slot, seen, || {
                    self.launch_pass(st, n, ids_p, rows_p, None, 0, n, logits_p, rec, scripted, None)
                })
            };
            st.verify_graphs = graphs;
            out?;
            st.pos = needed;
            let mut logits = vec![0f32; n * cfg.vocab];
            dtoh(&stream, logits.as_mut_ptr() as *mut std::ffi::c_void, logits_p, n * cfg.vocab * 4)?;
            stream.synchronize()?;
            return Ok(logits);
        }
        // Prefill (or a multi-token step): eager launches on fresh temporaries.
        ctx.arena_reset()?;
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let ids_d = stream.clone_htod(&ids)?;
        let rows_d = stream.clone_htod(if ple_rows.is_empty() { &[0i32][..] } else { &ple_rows[..] })?;
        let (r0, rows) = match want {
            LogitsFor::None => (0, 0),
            LogitsFor::Last => (n - 1, 1),
            LogitsFor::All => (0, n),
        };
        let logits = zeros(dev, (rows * cfg.vocab).max(1))?;
        let (ids_p, rows_p) = (ptr(&ids_d, &stream, 0), ptr(&rows_d, &stream, 0));
        let inject_d = self.upload_injected(media.map(|m| (0, m)).into_iter())?;
        let inject = inject_d.as_ref().map(|(r, e)| Injected {
            rows: ptr(r, &stream, 0),
            embeds: ptr(e, &stream, 0),
            count: r.len(),
        });
        let logits_p = ctx.addr(&logits, 0);
        let bank = self.launch_pass(st, n, ids_p, rows_p, ple_emb_ptr, r0, rows, logits_p, rec, scripted, inject)?;
        // Kept alive until the pass is queued; the frees are stream-ordered.
        drop(eager_table);
        drop(inject_d);
        st.pos = needed;
        if rec.is_none() {
            // A verify pass's MTP rows wait for its rollback, which knows the kept rows.
            self.mtp_extend(st, bank, tokens, pos0)?;
        }
        if rows == 0 {
            stream.synchronize()?;
            return Ok(Vec::new());
        }
        let mut out = stream.clone_dtoh(&logits)?;
        out.truncate(rows * cfg.vocab);
        Ok(out)
    }
}

/// Checks a hot window of `window` tokens against the model: 0, or at least the QSA token budget plus a block
/// (queries that attend densely, below the budget, then read only the ring).
///
/// Errors: [`CudaError::Unsupported`] naming both numbers.
fn check_kv_window(cfg: &ModelConfig, window: usize) -> Result<(), CudaError> {
    let ratio = cfg
        .layer_kinds
        .iter()
        .filter_map(|k| match *k {
            LayerKind::IndexedAttention { compress_ratio } if compress_ratio > 0 => Some(compress_ratio),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    let least = cfg.indexer.token_budget + ratio;
    if window > 0 && window < least {
        return Err(CudaError::Unsupported(format!(
            "a KV window of {window} tokens: it must hold at least the QSA token budget plus a block, {least} tokens"
        )));
    }
    Ok(())
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
