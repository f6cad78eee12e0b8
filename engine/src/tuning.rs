//! Tuning options of the backends, parsed once at start into [`Tuning`] and passed down: no hot module reads the
//! environment.
//!
//! Every option has a default (the values the engine is tuned for) and a `NEBULA_*` environment variable that
//! overrides it ([`Tuning::with_env`]); the service also reads them from the `[tuning]` table of its config file
//! (docs/config.md lists them all). Libraries and tests that have no config take [`Tuning::from_env`], once, at
//! the top.
//!
//! The CUDA part ([`CudaTuning`]) goes to [`crate::backend::cuda::CudaModel`]'s constructors. The CPU part
//! ([`CpuTuning`]) steers the CPU kernels (instruction set, MoE work split, prefetch, spinning pool), which are
//! process-wide by nature: it is installed once with [`install_cpu`] and read with [`cpu`]; when nothing was
//! installed, [`cpu`] takes the environment's values the first time it is asked.

use std::sync::OnceLock;

use crate::quant::Isa;

/// A tuning value that does not parse, naming the variable (or config key) and the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{variable} {expected}; got {value:?}")]
pub struct TuningError {
    /// The environment variable or `[tuning]` key.
    pub variable: String,
    /// The value given.
    pub value: String,
    /// What the option takes.
    pub expected: String,
}

fn invalid(variable: &str, value: &str, expected: &str) -> TuningError {
    TuningError { variable: variable.into(), value: value.into(), expected: expected.into() }
}

/// Every tuning option.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Tuning {
    /// The CUDA backend's.
    pub cuda: CudaTuning,
    /// The CPU kernels'.
    pub cpu: CpuTuning,
}

impl Tuning {
    /// The defaults with the `NEBULA_*` variables of the process environment applied ([`Tuning::with_env`]).
    ///
    /// # Errors
    /// As [`Tuning::with_env`].
    pub fn from_env() -> Result<Self, TuningError> {
        Self::default().with_env(|k| std::env::var(k).ok())
    }

    /// `self` with every `NEBULA_*` tuning variable that `lookup` returns applied over it (each keeps the meaning
    /// it has always had; docs/config.md lists them), then checked ([`Tuning::validate`]).
    ///
    /// # Errors
    /// `NEBULA_CUDA_FUSE`, `NEBULA_CUDA_GEMV_DEPTH` or `NEBULA_CUDA_PROFILE` with a value they do not take; a
    /// value out of range after the overrides.
    pub fn with_env(mut self, lookup: impl Fn(&str) -> Option<String>) -> Result<Self, TuningError> {
        self.cuda.apply_env(&lookup)?;
        self.cpu.apply_env(&lookup);
        self.validate()?;
        Ok(self)
    }

    /// Checks the ranges of the values (a config file can hold anything its types allow).
    ///
    /// # Errors
    /// The first value out of range, by its `[tuning]` key.
    pub fn validate(&self) -> Result<(), TuningError> {
        let c = &self.cuda;
        if !matches!(c.gemv_depth, 2 | 4) {
            return Err(invalid("tuning.cuda.gemv_depth", &c.gemv_depth.to_string(), "must be 2 or 4"));
        }
        if c.gemv_min_threads == 0 {
            return Err(invalid("tuning.cuda.gemv_min_threads", "0", "must be at least 1"));
        }
        if c.hybrid.stage_experts == 0 {
            return Err(invalid("tuning.cuda.hybrid.stage_experts", "0", "must be at least 1"));
        }
        if c.hybrid.stages < 2 {
            return Err(invalid("tuning.cuda.hybrid.stages", &c.hybrid.stages.to_string(), "must be at least 2"));
        }
        let (g, d) = self.cpu.moe_rows;
        if g == 0 || d == 0 {
            return Err(invalid("tuning.cpu.moe_rows", &format!("[{g}, {d}]"), "takes two row counts of at least 1"));
        }
        Ok(())
    }
}

/// What `NEBULA_CUDA_PROFILE` measures. Any profiling turns the decode-step CUDA Graphs off.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CudaProfile {
    /// No profiling (the variable unset).
    #[default]
    Off,
    /// Wall time per phase of the forward pass, the stream synchronised after each (`1`).
    Phases,
    /// Wall time per kernel, the stream synchronised around each launch (`kernels`).
    Kernels,
    /// The streamed-prefill copy timeline of the hybrid backend (`copies`).
    Copies,
}

/// Independent pieces of decode work that share a launch (`NEBULA_CUDA_FUSE`): `shared`, the shared expert's
/// gate/up and SiLU in the routed experts' launches; `qkvz`, Gated DeltaNet's `in_proj_qkv` and `in_proj_z` in one
/// GEMV; `gates`, its gates in the conv launch. Every fusion computes the same values as the separate launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CudaFusions {
    /// The shared expert in the routed experts' gate/up launch.
    pub shared: bool,
    /// `in_proj_qkv` and `in_proj_z` in one GEMV.
    pub qkvz: bool,
    /// The Gated DeltaNet gates in the conv launch.
    pub gates: bool,
}

impl Default for CudaFusions {
    fn default() -> Self {
        Self::ALL
    }
}

impl CudaFusions {
    /// All three.
    pub const ALL: CudaFusions = CudaFusions { shared: true, qkvz: true, gates: true };
    /// None.
    pub const NONE: CudaFusions = CudaFusions { shared: false, qkvz: false, gates: false };

    /// `NEBULA_CUDA_FUSE`'s syntax: `0`, none; else a comma-separated list of `shared`, `qkvz`, `gates` (study:
    /// Nsight Compute times a fused step below the unfused one, yet the CUDA Graph step can measure otherwise, as
    /// with the GEMV prologues).
    ///
    /// # Errors
    /// An unknown name, quoted in the message.
    pub fn parse(v: &str) -> Result<Self, TuningError> {
        let mut f = Self::NONE;
        if v.trim() == "0" {
            return Ok(f);
        }
        for name in v.split(',').map(str::trim) {
            match name {
                "shared" => f.shared = true,
                "qkvz" => f.qkvz = true,
                "gates" => f.gates = true,
                other => {
                    return Err(TuningError {
                        variable: "NEBULA_CUDA_FUSE".into(),
                        value: other.into(),
                        expected: "takes 0 or a list of shared, qkvz, gates".into(),
                    });
                }
            }
        }
        Ok(f)
    }
}

/// The CUDA backend's options.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CudaTuning {
    /// Decode steps (and MTP draft/verify passes) replay as CUDA Graphs (`NEBULA_CUDA_GRAPHS=0` turns them off;
    /// any profiling does too). Never in hybrid mode, whose steps wait on the host once per layer.
    pub graphs: bool,
    /// Profiling (`NEBULA_CUDA_PROFILE`).
    pub profile: CudaProfile,
    /// 8-bit activations for the GEMVs of Q8_0, Q4_0, Q4_1, Q5_1, MXFP4, IQ4_NL, Q4_K, IQ1_S, IQ2_XXS, IQ3_XXS and
    /// IQ3_S weights (integer dot products, as the CPU kernels do); off (`NEBULA_CUDA_Q8=0`) keeps f32 activations for every type.
    pub q8_activations: bool,
    /// Down projections and hyper-connection up projections compute and quantize their input themselves (a GEMV
    /// prologue) instead of after a SiLU or `hc_acts` kernel (`NEBULA_CUDA_GEMV_PROLOGUE=1`). It takes 48 launches
    /// out of a 12-layer decode step and Nsight Compute times each fused kernel below the two it replaces, yet the
    /// CUDA Graph step measured slower with it (H200: 384 against 432 tok/s; later, with four repeats in each of
    /// two processes per setting, 411.3 against 434.7 on average), so it is opt-in for study.
    pub gemv_prologue: bool,
    /// The launch size (threads) below which a dense decode GEMV widens its rows (`NEBULA_CUDA_GEMV_THREADS`;
    /// 2^15).
    pub gemv_min_threads: usize,
    /// Tasks a dense one-token GEMV thread on 8-bit activations keeps in flight: 2 (`gemvq_*_1`), or 4
    /// (`gemvqd_*`, every weight load of a thread issued before the first is used, rows widened so that no thread
    /// has more than four tasks) (`NEBULA_CUDA_GEMV_DEPTH`).
    pub gemv_depth: usize,
    /// Which decode launches are fused (`NEBULA_CUDA_FUSE`).
    pub fuse: CudaFusions,
    /// Routed experts and quantized dense matmuls of prefill batches on int8 tensor cores where the GPU has
    /// compute capability 8.0 or newer (`NEBULA_CUDA_MMA=0` turns it off).
    pub tensor_cores: bool,
    /// Programmatic dependent launch on compute capability 9.0 and newer (`NEBULA_CUDA_PDL=0` turns it off).
    pub pdl: bool,
    /// The hot window of the KV cache, tokens (`NEBULA_CUDA_KV_WINDOW`; 0, the default, keeps every token's keys
    /// and values in VRAM): a QSA layer of a longer sequence keeps only its most recent `kv_window` rows of K, V
    /// and raw indexer keys in VRAM and every row in pinned host memory, and fetches the blocks each step
    /// selects from there (`backend::cuda::kv_cache`). The tokens do not change. At least the QSA token budget
    /// plus a block, and a pass (a prefill chunk) may hold at most `kv_window` minus a block of tokens.
    pub kv_window: usize,
    /// The most rows of a fast batched pass (several sequences in one pass, not the exact mode of verify passes
    /// and deterministic batches) whose 8-bit products take the mid-size kernels (`NEBULA_CUDA_MID_ROWS`; 64):
    /// dense matrices of 2 rows and more the tiled GEMV `gemvqm_*` (each weight task decoded once per 16 rows),
    /// routed experts of more than 4 rows the grouped decode GEMV `moe_gemvqg_*` (each expert read once for all
    /// the rows routed to it). 0 keeps the one-row GEMVs (repeated per 8 rows) and, past 8 rows, the prefill
    /// kernels.
    pub mid_rows: usize,
    /// The hybrid backend's.
    pub hybrid: HybridTuning,
}

impl Default for CudaTuning {
    fn default() -> Self {
        Self {
            graphs: true,
            profile: CudaProfile::Off,
            q8_activations: true,
            gemv_prologue: false,
            gemv_min_threads: 1 << 15,
            gemv_depth: 2,
            fuse: CudaFusions::ALL,
            tensor_cores: true,
            pdl: true,
            kv_window: 0,
            mid_rows: 64,
            hybrid: HybridTuning::default(),
        }
    }
}

impl CudaTuning {
    fn apply_env(&mut self, lookup: &impl Fn(&str) -> Option<String>) -> Result<(), TuningError> {
        if let Some(v) = lookup("NEBULA_CUDA_GRAPHS") {
            self.graphs = v != "0";
        }
        if let Some(v) = lookup("NEBULA_CUDA_PROFILE") {
            self.profile = match v.as_str() {
                "1" => CudaProfile::Phases,
                "kernels" => CudaProfile::Kernels,
                "copies" => CudaProfile::Copies,
                other => return Err(invalid("NEBULA_CUDA_PROFILE", other, "takes 1, kernels or copies")),
            };
        }
        if let Some(v) = lookup("NEBULA_CUDA_Q8") {
            self.q8_activations = v != "0";
        }
        if let Some(v) = lookup("NEBULA_CUDA_GEMV_PROLOGUE") {
            self.gemv_prologue = v == "1";
        }
        if let Some(t) = lookup("NEBULA_CUDA_GEMV_THREADS").and_then(|v| v.parse::<usize>().ok()).filter(|&t| t > 0) {
            self.gemv_min_threads = t;
        }
        if let Some(v) = lookup("NEBULA_CUDA_GEMV_DEPTH") {
            self.gemv_depth = parse_gemv_depth(&v)?;
        }
        if let Some(v) = lookup("NEBULA_CUDA_FUSE") {
            self.fuse = CudaFusions::parse(&v)?;
        }
        if let Some(v) = lookup("NEBULA_CUDA_MMA") {
            self.tensor_cores = v != "0";
        }
        if let Some(v) = lookup("NEBULA_CUDA_PDL") {
            self.pdl = v != "0";
        }
        if let Some(v) = lookup("NEBULA_CUDA_KV_WINDOW") {
            self.kv_window = v
                .trim()
                .parse::<usize>()
                .map_err(|_| invalid("NEBULA_CUDA_KV_WINDOW", &v, "takes a token count (0: every token in VRAM)"))?;
        }
        if let Some(v) = lookup("NEBULA_CUDA_MID_ROWS") {
            self.mid_rows = v
                .trim()
                .parse::<usize>()
                .map_err(|_| invalid("NEBULA_CUDA_MID_ROWS", &v, "takes a row count (0: no mid-size kernels)"))?;
        }
        self.hybrid.apply_env(lookup);
        Ok(())
    }

    /// Whether decode steps may be captured as CUDA Graphs: asked for and no profiling.
    pub fn graphs_in_effect(&self) -> bool {
        self.graphs && self.profile == CudaProfile::Off
    }
}

/// `NEBULA_CUDA_GEMV_DEPTH`: 2 or 4.
fn parse_gemv_depth(v: &str) -> Result<usize, TuningError> {
    match v.trim() {
        "2" => Ok(2),
        "4" => Ok(4),
        t => Err(invalid("NEBULA_CUDA_GEMV_DEPTH", t, "must be 2 or 4")),
    }
}

/// The hybrid GPU + CPU backend's options (the policy's inputs: `backend::cuda::hybrid::policy`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HybridTuning {
    /// Batches up to this many tokens run their non-resident experts on the CPU, longer ones stream them to the
    /// GPU; 0 chooses at load from the measured PCIe and DRAM bandwidths (`NEBULA_HYBRID_CPU_MAX_TOKENS`).
    pub cpu_max_tokens: usize,
    /// Experts per staging buffer of streamed prefill (`NEBULA_HYBRID_STAGE_EXPERTS`; 32).
    pub stage_experts: usize,
    /// Staging buffers in the ring, at least 2 (`NEBULA_HYBRID_STAGES`; 6).
    pub stages: usize,
    /// MTP verify passes hand a low-coverage row's experts to the CPU like a decode step (every row exact)
    /// instead of verifying it with the resident experts only and reporting its coverage
    /// (`NEBULA_MTP_VERIFY_HANDOFF=1`).
    pub verify_handoff: bool,
    /// A CPU thread computes each layer's CPU experts while the host enqueues the rest of the step
    /// (`NEBULA_HYBRID_PIPELINE=0` turns it off: the host computes them between two synchronisations).
    pub pipeline: bool,
}

impl Default for HybridTuning {
    fn default() -> Self {
        Self { cpu_max_tokens: 0, stage_experts: 32, stages: 6, verify_handoff: false, pipeline: true }
    }
}

impl HybridTuning {
    fn apply_env(&mut self, lookup: &impl Fn(&str) -> Option<String>) {
        // Positive integers; anything else keeps the value (as these variables always did).
        let count = |k: &str| lookup(k).and_then(|v| v.parse::<usize>().ok()).filter(|&v| v > 0);
        if let Some(v) = count("NEBULA_HYBRID_CPU_MAX_TOKENS") {
            self.cpu_max_tokens = v;
        }
        if let Some(v) = count("NEBULA_HYBRID_STAGE_EXPERTS") {
            self.stage_experts = v;
        }
        if let Some(v) = count("NEBULA_HYBRID_STAGES") {
            self.stages = v.max(2);
        }
        if let Some(v) = lookup("NEBULA_MTP_VERIFY_HANDOFF") {
            self.verify_handoff = v == "1";
        }
        if let Some(v) = lookup("NEBULA_HYBRID_PIPELINE") {
            self.pipeline = v != "0";
        }
    }
}

/// The CPU kernels' options (process-wide: [`install_cpu`], [`cpu`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CpuTuning {
    /// Caps the instruction set of the CPU kernels (`NEBULA_CPU_ISA=scalar|avx2|avx512`; all paths give the same
    /// bits). `None`: the best the CPU has.
    pub isa: Option<Isa>,
    /// Rows per gate/up and per down-projection work item of the MoE kernel (`NEBULA_CPU_MOE_ROWS=G,D`; 32, 64;
    /// any sizes give the same bits).
    pub moe_rows: (usize, usize),
    /// Rows ahead of the one being multiplied whose bytes the MoE kernel prefetches (`NEBULA_CPU_PREFETCH`; 8,
    /// 0 = none).
    pub prefetch_rows: usize,
    /// Records where the MoE kernel's time goes (`NEBULA_CPU_MOE_TRACE=1`).
    pub moe_trace: bool,
    /// How long idle workers of the spinning MoE pool spin before they sleep, microseconds, for the threads that
    /// opted in (the hybrid CPU thread; `NEBULA_CPU_SPIN_US`, 0 = rayon). `None`: each thread's own choice.
    pub spin_us: Option<u64>,
    /// Gate SSD prefetches by whether they have been paying (`NEBULA_SSD_PREFETCH_GATE=0` turns the gate off).
    pub ssd_prefetch_gate: bool,
    /// Scan every quantized weight's block scales for NaN/Inf at load (`NEBULA_SKIP_SCALE_SCAN=1` turns it off).
    pub scan_scales: bool,
}

impl Default for CpuTuning {
    fn default() -> Self {
        Self {
            isa: None,
            moe_rows: (32, 64),
            prefetch_rows: 8,
            moe_trace: false,
            spin_us: None,
            ssd_prefetch_gate: true,
            scan_scales: true,
        }
    }
}

impl CpuTuning {
    /// Unparsable values keep the default, as these variables always did.
    fn apply_env(&mut self, lookup: &impl Fn(&str) -> Option<String>) {
        if let Some(isa) = lookup("NEBULA_CPU_ISA").and_then(|s| s.parse::<Isa>().ok()) {
            self.isa = Some(isa);
        }
        if let Some(rows) = lookup("NEBULA_CPU_MOE_ROWS").and_then(|v| {
            let (g, d) = v.split_once(',')?;
            Some((g.trim().parse::<usize>().ok()?.max(1), d.trim().parse::<usize>().ok()?.max(1)))
        }) {
            self.moe_rows = rows;
        }
        if let Some(r) = lookup("NEBULA_CPU_PREFETCH").and_then(|v| v.parse().ok()) {
            self.prefetch_rows = r;
        }
        if let Some(v) = lookup("NEBULA_CPU_MOE_TRACE") {
            self.moe_trace = v == "1";
        }
        if let Some(us) = lookup("NEBULA_CPU_SPIN_US").and_then(|v| v.trim().parse().ok()) {
            self.spin_us = Some(us);
        }
        if let Some(v) = lookup("NEBULA_SSD_PREFETCH_GATE") {
            self.ssd_prefetch_gate = v != "0";
        }
        if let Some(v) = lookup("NEBULA_SKIP_SCALE_SCAN") {
            self.scan_scales = v.is_empty() || v == "0";
        }
    }
}

static CPU: OnceLock<CpuTuning> = OnceLock::new();

/// Installs the CPU kernels' options for the life of the process (call once at start, before any model is
/// loaded). Returns false when options were already in effect (installed, or taken from the environment by an
/// earlier [`cpu`]); the first ones stay.
pub fn install_cpu(tuning: CpuTuning) -> bool {
    CPU.set(tuning).is_ok()
}

/// The CPU kernels' options: the installed ones, else the defaults with the environment's `NEBULA_*` values
/// (read the first time).
pub fn cpu() -> &'static CpuTuning {
    CPU.get_or_init(|| {
        let mut t = CpuTuning::default();
        t.apply_env(&|k| std::env::var(k).ok());
        t
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn fusions_parse_lists_and_name_unknown_entries() {
        assert_eq!(CudaFusions::parse("0").unwrap(), CudaFusions::NONE);
        assert_eq!(CudaFusions::parse("qkvz, gates").unwrap(), CudaFusions { shared: false, qkvz: true, gates: true });
        let e = CudaFusions::parse("shared,router").unwrap_err().to_string();
        assert!(e.contains("NEBULA_CUDA_FUSE") && e.contains("\"router\""), "{e}");
        assert_eq!(Tuning::default().with_env(env(&[])).unwrap().cuda.fuse, CudaFusions::ALL);
    }

    #[test]
    fn gemv_depth_is_two_or_four_and_names_the_variable_otherwise() {
        let depth =
            |v: &str| Tuning::default().with_env(env(&[("NEBULA_CUDA_GEMV_DEPTH", v)])).map(|t| t.cuda.gemv_depth);
        assert_eq!(Tuning::default().cuda.gemv_depth, 2);
        assert_eq!(depth("4").unwrap(), 4);
        assert_eq!(depth(" 2 ").unwrap(), 2);
        for bad in ["3", "8", "deep", ""] {
            let e = depth(bad).unwrap_err().to_string();
            assert!(e.contains("NEBULA_CUDA_GEMV_DEPTH") && e.contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn the_environment_overrides_each_default_with_its_old_meaning() {
        let t = Tuning::default()
            .with_env(env(&[
                ("NEBULA_CUDA_GRAPHS", "0"),
                ("NEBULA_CUDA_Q8", "0"),
                ("NEBULA_CUDA_GEMV_PROLOGUE", "1"),
                ("NEBULA_CUDA_GEMV_THREADS", "4096"),
                ("NEBULA_CUDA_MMA", "0"),
                ("NEBULA_CUDA_PDL", "0"),
                ("NEBULA_CUDA_PROFILE", "kernels"),
                ("NEBULA_HYBRID_CPU_MAX_TOKENS", "24"),
                ("NEBULA_HYBRID_STAGE_EXPERTS", "16"),
                ("NEBULA_HYBRID_STAGES", "1"),
                ("NEBULA_MTP_VERIFY_HANDOFF", "1"),
                ("NEBULA_HYBRID_PIPELINE", "0"),
                ("NEBULA_CPU_ISA", "AVX2"),
                ("NEBULA_CPU_MOE_ROWS", "16, 0"),
                ("NEBULA_CPU_PREFETCH", "0"),
                ("NEBULA_CPU_MOE_TRACE", "1"),
                ("NEBULA_CPU_SPIN_US", " 500 "),
                ("NEBULA_SSD_PREFETCH_GATE", "0"),
                ("NEBULA_SKIP_SCALE_SCAN", "1"),
            ]))
            .unwrap();
        let c = &t.cuda;
        assert!(!c.graphs && !c.q8_activations && c.gemv_prologue && !c.tensor_cores && !c.pdl);
        assert_eq!((c.gemv_min_threads, c.profile), (4096, CudaProfile::Kernels));
        assert!(!c.graphs_in_effect());
        let h = &c.hybrid;
        // Stages below 2 are raised to 2, as before.
        assert_eq!(
            (h.cpu_max_tokens, h.stage_experts, h.stages, h.verify_handoff, h.pipeline),
            (24, 16, 2, true, false)
        );
        let p = &t.cpu;
        assert_eq!(
            (p.isa, p.moe_rows, p.prefetch_rows, p.moe_trace, p.spin_us),
            (Some(Isa::Avx2), (16, 1), 0, true, Some(500))
        );
        assert!(!p.ssd_prefetch_gate && !p.scan_scales);
        // Values these variables never took leave the default.
        let t = Tuning::default()
            .with_env(env(&[
                ("NEBULA_CUDA_GEMV_THREADS", "0"),
                ("NEBULA_HYBRID_STAGES", "many"),
                ("NEBULA_CPU_ISA", "sse"),
            ]))
            .unwrap();
        assert_eq!((t.cuda.gemv_min_threads, t.cuda.hybrid.stages, t.cpu.isa), (1 << 15, 6, None));
        // Profiling switches the graphs off whatever NEBULA_CUDA_GRAPHS says; an unknown profile is refused.
        let t = Tuning::default().with_env(env(&[("NEBULA_CUDA_PROFILE", "1")])).unwrap();
        assert!(t.cuda.graphs && !t.cuda.graphs_in_effect());
        let e = Tuning::default().with_env(env(&[("NEBULA_CUDA_PROFILE", "all")])).unwrap_err().to_string();
        assert!(e.contains("NEBULA_CUDA_PROFILE") && e.contains("\"all\""), "{e}");
    }

    #[test]
    fn mid_rows_default_to_64_and_take_a_row_count_from_the_environment() {
        let mid = |v: &str| Tuning::default().with_env(env(&[("NEBULA_CUDA_MID_ROWS", v)])).map(|t| t.cuda.mid_rows);
        assert_eq!(Tuning::default().cuda.mid_rows, 64);
        assert_eq!(Tuning::default().with_env(env(&[])).unwrap().cuda.mid_rows, 64);
        assert_eq!(mid("0").unwrap(), 0);
        assert_eq!(mid(" 32 ").unwrap(), 32);
        for bad in ["-1", "all", ""] {
            let e = mid(bad).unwrap_err().to_string();
            assert!(e.contains("NEBULA_CUDA_MID_ROWS") && e.contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn out_of_range_config_values_are_refused_by_key() {
        let mut t = Tuning::default();
        t.cuda.hybrid.stages = 1;
        assert!(t.validate().unwrap_err().to_string().contains("tuning.cuda.hybrid.stages"));
        let mut t = Tuning::default();
        t.cuda.gemv_depth = 3;
        assert!(t.validate().unwrap_err().to_string().contains("tuning.cuda.gemv_depth"));
        assert_eq!(Tuning::default().validate(), Ok(()));
    }
}
