//! Where the forward pass runs: the CPU model of [`crate::model`] or the CUDA model of [`cuda`] (all weights on
//! one GPU). [`Runner`] hides the choice from the generation worker and the benchmarks.

pub mod cuda;

use crate::model::{LogitsFor, ModelConfig, ModelError, Qwen4Exp, SequenceState};

/// Which backend to run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// Every block on the CPU.
    #[default]
    Cpu,
    /// Every block on GPU `device`, within `vram_budget` bytes when given.
    Cuda {
        /// GPU index (as `nvidia-smi` lists them).
        device: usize,
        /// VRAM the model may use, bytes; `None` = what is free.
        vram_budget: Option<u64>,
    },
}

impl std::str::FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda { device: 0, vram_budget: None }),
            other => Err(format!("unknown backend '{other}' (cpu, cuda)")),
        }
    }
}

/// Errors of either backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// From the CPU model (bad input, context overflow).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// From the GPU.
    #[error(transparent)]
    Cuda(#[from] cuda::CudaError),
}

/// A model ready to run on one backend.
pub enum Runner {
    /// The CPU model.
    Cpu(Qwen4Exp),
    /// The GPU model (the CPU copy of the weights is dropped after upload).
    Cuda(Box<cuda::CudaModel>),
}

/// A sequence's state on the runner's backend.
pub enum RunnerState {
    /// On the CPU.
    Cpu(SequenceState),
    /// On the GPU.
    Cuda(Box<cuda::CudaState>),
}

impl RunnerState {
    /// Tokens consumed so far.
    pub fn pos(&self) -> usize {
        match self {
            RunnerState::Cpu(s) => s.pos,
            RunnerState::Cuda(s) => s.pos,
        }
    }
}

impl Runner {
    /// Puts `model` on `kind`. A placed model ([`Qwen4Exp::place`]) on CUDA runs hybrid: its GPU-tier experts on
    /// the GPU, the others on the CPU ([`cuda::hybrid`]); unplaced, every weight goes to the GPU. `tuning` steers
    /// the CUDA backend.
    pub fn new(model: Qwen4Exp, kind: BackendKind, tuning: &crate::tuning::CudaTuning) -> Result<Self, BackendError> {
        Ok(match kind {
            BackendKind::Cpu => Runner::Cpu(model),
            BackendKind::Cuda { device, vram_budget } => Runner::Cuda(Box::new(cuda::CudaModel::for_model(
                std::sync::Arc::new(model),
                device,
                vram_budget,
                tuning,
            )?)),
        })
    }

    /// The model's shapes.
    pub fn config(&self) -> &ModelConfig {
        match self {
            Runner::Cpu(m) => &m.config,
            Runner::Cuda(m) => &m.config,
        }
    }

    /// The placement counters of a placed model (CPU, or hybrid CUDA); `None` otherwise.
    pub fn placement_stats(&self) -> Option<std::sync::Arc<crate::placement::PlacementStats>> {
        match self {
            Runner::Cpu(m) => Some(m.placement_stats()),
            Runner::Cuda(m) => m.host_model().map(|h| h.placement_stats()),
        }
    }

    /// Read bandwidth of a placed model's SSD tier in bytes/s, measured for about `seconds` (see
    /// [`Qwen4Exp::ssd_read_bandwidth`]); `None` without an SSD tier (an unplaced or all-GPU model).
    ///
    /// Errors: [`crate::model::ModelError::WeightRead`] when a read fails.
    pub fn ssd_read_bandwidth(&self, seconds: f64) -> Option<Result<f64, crate::model::ModelError>> {
        match self {
            Runner::Cpu(m) => m.ssd_read_bandwidth(seconds),
            Runner::Cuda(m) => m.host_model().and_then(|h| h.ssd_read_bandwidth(seconds)),
        }
    }

    /// One line for logs: backend and device.
    pub fn describe(&self) -> String {
        match self {
            Runner::Cpu(_) => format!("CPU ({} threads)", rayon::current_num_threads()),
            Runner::Cuda(m) => {
                format!(
                    "CUDA{} on {} ({:.1} GiB of weights on the GPU)",
                    if m.is_hybrid() {
                        format!(
                            " hybrid (GPU-tier experts on the GPU, the rest on the CPU; {:.1} GiB of RAM tier pinned for \
                             uploads)",
                            m.registered_bytes() as f64 / (1u64 << 30) as f64
                        )
                    } else {
                        String::new()
                    },
                    m.gpu_name(),
                    m.weight_bytes as f64 / (1u64 << 30) as f64
                )
            }
        }
    }

    /// A fresh state for at most `max_len` tokens, for plain decoding (on the GPU without an MTP cache).
    pub fn new_state(&self, max_len: usize) -> Result<RunnerState, BackendError> {
        Ok(match self {
            Runner::Cpu(m) => RunnerState::Cpu(m.new_state(max_len)),
            // Plain decoding: no MTP cache to keep aligned.
            Runner::Cuda(m) => RunnerState::Cuda(Box::new(m.new_state_with(max_len, false)?)),
        })
    }

    /// Runs `tokens` on `state` (see [`Qwen4Exp::forward`]).
    pub fn forward(&self, state: &mut RunnerState, tokens: &[u32], want: LogitsFor) -> Result<Vec<f32>, BackendError> {
        Ok(match (self, state) {
            (Runner::Cpu(m), RunnerState::Cpu(s)) => m.forward(s, tokens, want)?,
            (Runner::Cuda(m), RunnerState::Cuda(s)) => m.forward(s, tokens, want)?,
            _ => unreachable!("a runner only makes states of its own backend"),
        })
    }
}
