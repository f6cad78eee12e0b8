//! Which SIMD instruction set the CPU kernels use, chosen once at run time.
//!
//! Every dot-product kernel has a scalar path and, on x86-64, an AVX2 and an AVX-512 path. All paths compute
//! the same exact integer sums and then the same `f32` operations in the same order, so their results are
//! bit-identical; the choice changes speed only. `NEBULA_CPU_ISA=scalar|avx2|avx512` caps the choice (for
//! benchmarks and tests); a path the CPU lacks is never chosen.

use std::sync::OnceLock;

/// An instruction-set level of the CPU kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Isa {
    /// Portable Rust (any CPU).
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (Haswell and later, Zen).
    Avx2,
    /// x86-64 AVX-512 F/BW/VL/VNNI (Ice Lake, Sapphire Rapids, Zen 4 and later).
    Avx512,
}

impl Isa {
    /// Every level this CPU can run, lowest first.
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.supported()).collect()
    }

    /// Whether this CPU can run the level.
    pub fn supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The level the kernels use: the best the CPU has, capped by [`crate::tuning::CpuTuning::isa`]
    /// (`NEBULA_CPU_ISA`) when set.
    pub fn detect() -> Isa {
        static CHOSEN: OnceLock<Isa> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let best = *Isa::available().last().expect("scalar is always available");
            match crate::tuning::cpu().isa {
                Some(cap) => cap.min(best),
                None => best,
            }
        })
    }

    /// Lower-case name (`scalar`, `avx2`, `avx512`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

impl std::str::FromStr for Isa {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "scalar" => Ok(Isa::Scalar),
            "avx2" => Ok(Isa::Avx2),
            "avx512" => Ok(Isa::Avx512),
            other => Err(format!("unknown instruction set '{other}' (scalar, avx2, avx512)")),
        }
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
