//! GPU kernels for Nebula: CUDA C sources (`cuda/`, one file per kernel family) and their loader.
//!
//! `build.rs` compiles the sources to fatbins (SASS for sm_80/86/89/90/120 + PTX) when nvcc is present at build
//! time; otherwise [`Gpu::open`] compiles them with NVRTC on the machine that has the GPU. cudarc loads the CUDA
//! driver dynamically, and its loader panics when the driver is missing, so [`Gpu::open`] first looks for the
//! driver library on disk ([`find_cuda_driver`]) and reports a clean error on CPU-only machines.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

pub use cudarc;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};

include!(concat!(env!("OUT_DIR"), "/fatbins.rs"));

/// The kernel sources, for NVRTC when no fatbin was built: (file stem, source).
pub const SOURCES: &[(&str, &str)] = &[
    ("attention", include_str!("../cuda/attention.cu")),
    ("gdn", include_str!("../cuda/gdn.cu")),
    ("gemv", include_str!("../cuda/gemv.cu")),
    ("hyper_connection", include_str!("../cuda/hyper_connection.cu")),
    ("moe", include_str!("../cuda/moe.cu")),
    ("norm_rope", include_str!("../cuda/norm_rope.cu")),
    ("ple", include_str!("../cuda/ple.cu")),
    ("sampling", include_str!("../cuda/sampling.cu")),
];
const COMMON: &str = include_str!("../cuda/common.cuh");

/// Directories where the NVIDIA driver library `libcuda.so.1` is commonly installed on Linux.
const DRIVER_DIRS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/nvidia/lib64",
    "/usr/local/nvidia/lib",
    "/usr/local/cuda/compat",
    "/usr/lib/wsl/lib",
];

/// Returns the path of the NVIDIA driver library if one is installed, by looking for `libcuda.so.1` in the
/// usual directories and in `LD_LIBRARY_PATH`. Never loads the library.
pub fn find_cuda_driver() -> Option<std::path::PathBuf> {
    let from_env = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    from_env
        .split(':')
        .filter(|d| !d.is_empty())
        .chain(DRIVER_DIRS.iter().copied())
        .map(|dir| Path::new(dir).join("libcuda.so.1"))
        .find(|p| p.exists())
}

/// Why the GPU could not be used.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No NVIDIA driver on this machine.
    #[error("no NVIDIA driver found (libcuda.so.1 is not installed); use the CPU backend")]
    NoDriver,
    /// The driver refused (no device with that index, driver too old, ...).
    #[error("CUDA: {0}")]
    Driver(String),
    /// Compiling the kernels at run time failed.
    #[error("compiling CUDA kernel file {file}.cu with NVRTC: {message}")]
    Compile { file: String, message: String },
    /// A driver call failed: its result code and what it means, in words ([`driver_result_words`]).
    #[error("CUDA driver: {}", driver_result_words(*.0))]
    DriverCall(cudarc::driver::sys::CUresult),
    /// A kernel the caller asked for does not exist.
    #[error("no CUDA kernel named {0}")]
    MissingKernel(String),
    /// The kernels cover no weights of this GGML type (`type_name`, e.g. `Q5_1`); `tensor` names the tensor
    /// that has it, when known.
    #[error("the CUDA backend has no kernels for weight type {type_name}{}", tensor_suffix(.tensor))]
    UnsupportedType { type_name: String, tensor: Option<String> },
    /// Not enough device memory for what was asked.
    #[error("{what} needs {needed_mib} MiB of GPU memory but {free_mib} MiB are free (budget {budget_mib} MiB)")]
    OutOfMemory { what: String, needed_mib: u64, free_mib: u64, budget_mib: u64 },
}

impl From<cudarc::driver::DriverError> for GpuError {
    /// Keeps the result code only: cudarc's own formatting asks the driver for the message
    /// (`cuGetErrorString`), which the toolkit's stub library and a missing driver cannot answer.
    fn from(e: cudarc::driver::DriverError) -> Self {
        GpuError::DriverCall(e.0)
    }
}

fn tensor_suffix(tensor: &Option<String>) -> String {
    tensor.as_ref().map_or_else(String::new, |t| format!(" (tensor {t})"))
}

/// A driver result code and its meaning in words, e.g. `CUDA_ERROR_NO_DEVICE: no CUDA-capable GPU is visible
/// ...`. The words are ours (what the code means for running Nebula and what to check), written from the
/// CUDA driver API's documentation of `CUresult`; codes without words of their own give the code's name only.
/// Never calls the driver, so it works where the driver is missing or is the toolkit's stub.
pub fn driver_result_words(r: cudarc::driver::sys::CUresult) -> String {
    use cudarc::driver::sys::CUresult as R;
    let words = match r {
        R::CUDA_ERROR_STUB_LIBRARY => {
            "the CUDA library that was loaded is the toolkit's stub (a `stubs/libcuda.so` ahead of the real driver \
             on the library path), not the NVIDIA driver: remove the toolkit's stubs directory from LD_LIBRARY_PATH"
        }
        R::CUDA_ERROR_NO_DEVICE => {
            "no CUDA-capable GPU is visible to this process (check `nvidia-smi` and CUDA_VISIBLE_DEVICES)"
        }
        R::CUDA_ERROR_INVALID_DEVICE => {
            "there is no GPU with that index (`nvidia-smi -L` lists the GPUs; CUDA_VISIBLE_DEVICES renumbers them)"
        }
        R::CUDA_ERROR_OUT_OF_MEMORY => "the GPU is out of memory (other processes may hold it: see `nvidia-smi`)",
        R::CUDA_ERROR_NOT_INITIALIZED => {
            "the CUDA driver is not initialised: the NVIDIA driver is missing or failed to load"
        }
        R::CUDA_ERROR_DEINITIALIZED => "the CUDA driver is shutting down",
        R::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE => {
            "the installed NVIDIA driver is older than this CUDA version needs (insufficient driver), and this GPU \
             cannot use the forward-compatibility package: update the driver"
        }
        R::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH => {
            "the NVIDIA kernel module and the user-space driver library have different versions (reboot, or \
             reinstall the driver)"
        }
        R::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => {
            "the kernels' PTX comes from a newer CUDA toolkit than the installed driver supports: update the \
             NVIDIA driver, or compile the kernels with a toolkit (NVRTC) no newer than the driver"
        }
        R::CUDA_ERROR_NO_BINARY_FOR_GPU => "the kernels were not compiled for this GPU's architecture",
        R::CUDA_ERROR_INVALID_PTX => "the driver could not compile the kernels' PTX for this GPU",
        R::CUDA_ERROR_ILLEGAL_ADDRESS => "a kernel accessed memory outside its buffers (an internal error)",
        R::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES => "a kernel launch asked for more registers or threads than allowed",
        R::CUDA_ERROR_INVALID_VALUE => "a driver call got an invalid argument (an internal error)",
        R::CUDA_ERROR_OPERATING_SYSTEM => "the operating system refused a driver request",
        _ => return format!("{r:?}"),
    };
    format!("{r:?}: {words}")
}

/// How the kernels were obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelSource {
    /// Fatbins compiled by nvcc at build time.
    Fatbin,
    /// Compiled by NVRTC at run time.
    Nvrtc,
}

/// An opened GPU: its context, a stream, and every kernel by name.
pub struct Gpu {
    /// The CUDA context.
    pub ctx: Arc<CudaContext>,
    /// The stream all work is issued on.
    pub stream: Arc<CudaStream>,
    /// Every kernel by name, with the most threads a block of it can have on this device (its registers and
    /// shared memory decide: `CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK`).
    functions: HashMap<String, (CudaFunction, u32)>,
    _modules: Vec<Arc<CudaModule>>,
    /// How the kernels were built.
    pub source: KernelSource,
    /// Device name.
    pub name: String,
    /// Compute capability (major, minor).
    pub capability: (i32, i32),
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu").field("name", &self.name).field("source", &self.source).finish_non_exhaustive()
    }
}

fn kernel_names(src: &str) -> Vec<String> {
    // Every `extern "C" __global__ void NAME(` of the source, macro-expanded families included.
    let mut names = Vec::new();
    for line in src.lines() {
        if let Some(rest) = line.split("__global__ void ").nth(1) {
            // `__launch_bounds__(...)` may stand between the return type and the name.
            let rest = match rest.strip_prefix("__launch_bounds__(") {
                Some(r) => r.split_once(") ").map_or(r, |(_, name)| name),
                None => rest,
            };
            let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '#').collect();
            names.push(name);
        }
    }
    names
}

/// Expands the `NAME(name, T)` macro instantiations of a source into concrete kernel names (every macro
/// `#define FAMILY(NAME, T)` is a kernel family).
fn expand_names(src: &str) -> Vec<String> {
    let templates = kernel_names(src);
    let mut out: Vec<String> = templates.iter().filter(|n| !n.contains("##")).cloned().collect();
    let families: Vec<&str> = src
        .lines()
        .filter_map(|l| l.strip_prefix("#define ")?.split_once("(NAME, T)").map(|(family, _)| family))
        .collect();
    for line in src.lines() {
        let line = line.trim();
        for &macro_name in &families {
            if let Some(args) = line.strip_prefix(&format!("{macro_name}(")) {
                let ty = args.split(',').next().unwrap_or("").trim();
                let block: String = src
                    .split(&format!("#define {macro_name}("))
                    .nth(1)
                    .map(|b| b.split("\n\n").next().unwrap_or("").to_string())
                    .unwrap_or_default();
                for t in kernel_names(&block) {
                    out.push(t.replace("##NAME", ty).replace("##", ""));
                }
            }
        }
    }
    out
}

/// `NEBULA_CUDA_CARVEOUT`: the preferred shared-memory carve-out, in percent of the SM's unified L1/shared
/// memory (0-100), given to every kernel at load (`CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`); unset
/// or empty leaves the driver's per-kernel choice. Errors: anything but an integer 0-100, naming the variable.
fn carveout_from_env() -> Result<Option<i32>, GpuError> {
    parse_carveout(std::env::var("NEBULA_CUDA_CARVEOUT").ok().as_deref())
}

fn parse_carveout(v: Option<&str>) -> Result<Option<i32>, GpuError> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some(t) => match t.parse::<i32>() {
            Ok(p) if (0..=100).contains(&p) => Ok(Some(p)),
            _ => Err(GpuError::Driver(format!(
                "NEBULA_CUDA_CARVEOUT must be a percentage from 0 to 100 (the shared-memory share of L1), got {t:?}"
            ))),
        },
    }
}

/// Compiles one kernel source with NVRTC for `arch` (e.g. "sm_90"), the run-time path of [`Gpu::open`].
pub fn nvrtc_compile(stem: &str, src: &str, arch: &'static str) -> Result<cudarc::nvrtc::Ptx, GpuError> {
    let full = src.replace("#include \"common.cuh\"", COMMON);
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        options: vec!["-std=c++17".into()],
        name: Some(format!("{stem}.cu")),
        ..Default::default()
    };
    std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(full, opts))
        .map_err(|_| GpuError::Compile { file: stem.to_string(), message: "libnvrtc could not be loaded".into() })?
        .map_err(|e| GpuError::Compile { file: stem.to_string(), message: format!("{e:?}") })
}

impl Gpu {
    /// Opens GPU `ordinal`, loading every kernel.
    ///
    /// Errors: [`GpuError::NoDriver`] on machines without the NVIDIA driver (checked before cudarc is touched),
    /// [`GpuError::Driver`] for a missing device, [`GpuError::Compile`] if run-time compilation fails.
    pub fn open(ordinal: usize) -> Result<Self, GpuError> {
        if find_cuda_driver().is_none() {
            return Err(GpuError::NoDriver);
        }
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal)).map_err(|_| {
            GpuError::Driver(
                "the CUDA driver library could not be loaded, or lacks a function this build calls (an NVIDIA \
                     driver older than CUDA 13 is insufficient: update the driver)"
                    .into(),
            )
        })??;
        // A stream of our own: CUDA Graph capture is not allowed on the legacy default stream.
        let stream = ctx.new_stream()?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let capability = ctx.compute_capability().unwrap_or((0, 0));
        let force_nvrtc = std::env::var("NEBULA_NVRTC").is_ok_and(|v| v == "1");
        let use_fatbins = !FATBINS.is_empty() && !force_nvrtc;
        let mut functions = HashMap::new();
        let mut modules = Vec::new();
        for (stem, src) in SOURCES {
            let module = if use_fatbins {
                let bin = FATBINS.iter().find(|(s, _)| s == stem).map(|(_, b)| *b).ok_or_else(|| {
                    GpuError::Compile { file: stem.to_string(), message: "missing from the build".into() }
                })?;
                ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bin.to_vec()))?
            } else {
                let arch: &'static str = Box::leak(format!("sm_{}{}", capability.0, capability.1).into_boxed_str());
                ctx.load_module(nvrtc_compile(stem, src, arch)?)?
            };
            for name in expand_names(src) {
                let f = module
                    .load_function(&name)
                    .map_err(|e| GpuError::Driver(format!("loading {name}: {}", driver_result_words(e.0))))?;
                let max = f
                    .get_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
                    .map_err(|e| {
                        GpuError::Driver(format!("querying {name}'s block size limit: {}", driver_result_words(e.0)))
                    })?;
                functions.insert(name, (f, max.max(0) as u32));
            }
            modules.push(module);
        }
        if let Some(carveout) = carveout_from_env()? {
            // One preferred L1/shared split for every kernel, so the SM is not reconfigured between neighbours.
            for (name, (f, _)) in &functions {
                f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                    carveout,
                )
                .map_err(|e| {
                    GpuError::Driver(format!("setting {name}'s shared-memory carve-out: {}", driver_result_words(e.0)))
                })?;
            }
        }
        Ok(Self {
            ctx,
            stream,
            functions,
            _modules: modules,
            source: if use_fatbins { KernelSource::Fatbin } else { KernelSource::Nvrtc },
            name,
            capability,
        })
    }

    /// The kernel called `name` and the most threads a block of it can have on this device.
    pub fn func(&self, name: &str) -> Result<(&CudaFunction, u32), GpuError> {
        self.functions.get(name).map(|(f, max)| (f, *max)).ok_or_else(|| GpuError::MissingKernel(name.to_string()))
    }

    /// Number of kernels loaded.
    pub fn n_kernels(&self) -> usize {
        self.functions.len()
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), GpuError> {
        Ok(self.ctx.mem_get_info()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_does_not_panic_and_points_at_an_existing_file() {
        if let Some(p) = find_cuda_driver() {
            assert!(p.exists(), "probe returned {} which does not exist", p.display());
        }
    }

    #[test]
    fn every_macro_instantiated_kernel_is_named() {
        let gemv = SOURCES.iter().find(|(s, _)| *s == "gemv").unwrap().1;
        let names = expand_names(gemv);
        for n in [
            "gemv_q4_k_1",
            "gemv_q8_0_8",
            "moe_gemv_iq4_xs",
            "dequant_f32_q6_k",
            "dequant_bf16_f16",
            "get_rows_q8_0",
            "get_rows_elem_bf16",
            "dequant_elem_f32_f16",
            "gemvq_q4_k_1",
            "gemvq_iq4_nl_8",
            "gemvqd_q4_k",
            "gemvqd_iq4_nl",
            "moe_gemvq_q8_0",
            "gemvqp_q4_k",
            "moe_gemvqp_iq4_nl",
            "quantize_act",
            "moe_groupedq_q4_k",
            "moe_groupedmma_iq4_nl",
        ] {
            assert!(names.iter().any(|x| x == n), "{n} missing from {names:?}");
        }
        assert!(names.iter().all(|n| !n.contains('#')), "{names:?}");
    }

    /// Every kernel name found in every source is an identifier followed by its parameter list there (a
    /// declaration the parser misreads, e.g. with the name on the line after `__launch_bounds__(...)`, would
    /// otherwise only fail when a GPU loads the module), and the hyper-connection norm is among them.
    #[test]
    fn every_kernel_name_is_an_identifier_of_its_source() {
        let mut all = Vec::new();
        for (stem, src) in SOURCES {
            for name in expand_names(src) {
                let first = name.chars().next().unwrap_or('0');
                assert!(first.is_ascii_alphabetic() || first == '_', "{stem}.cu: kernel name {name:?}");
                all.push(name);
            }
            for name in kernel_names(src).iter().filter(|n| !n.contains('#')) {
                assert!(src.contains(&format!(" {name}(")), "{stem}.cu: {name} is not followed by its parameters");
            }
        }
        for n in ["hc_norm", "router_topk", "hc_mix", "rms_norm_rows"] {
            assert!(all.iter().any(|x| x == n), "{n} missing");
        }
    }

    /// Programmatic dependent launch is safe only if every kernel waits for its predecessor before anything else
    /// (common.cuh `pdl_entry`): a kernel that read first, or returned before waiting, could see stale inputs or let
    /// a later kernel overtake the one before it. The one exception, marked `pdl_deferred()`, is the dense decode
    /// GEMV, which loads weights (written by no kernel) first: its body must be `gemvq_body` with the wait on, and
    /// that body must wait before its first activation read or output write.
    #[test]
    fn every_kernel_body_begins_with_the_dependent_launch_wait() {
        let mut kernels = 0;
        for (stem, src) in SOURCES {
            for (i, _) in src.match_indices("__global__ void") {
                let open = i + src[i..].find('{').expect("a kernel body");
                let first: String = src[open + 1..]
                    .chars()
                    .filter(|c| !c.is_whitespace() && *c != '\\')
                    .take("pdl_entry();".len())
                    .collect();
                let head: String = src[i..open].chars().take(80).collect();
                if first.starts_with("pdl_deferred") {
                    let body = &src[open..open + src[open..].find("\n    }").expect("the kernel's end")];
                    // The body is the dense GEMV body with its template's WAIT argument on.
                    let call = body.find("gemvq_body<T, ").map(|i| &body[i..]);
                    let args = call.and_then(|c| c.split_once('>')).map_or("", |(a, _)| a);
                    assert!(args.contains(", true"), "{stem}.cu: `{head}` defers its wait without gemvq_body's");
                } else {
                    assert_eq!(
                        first, "pdl_entry();",
                        "{stem}.cu: the kernel at `{head}` does not begin with pdl_entry()"
                    );
                }
                kernels += 1;
            }
        }
        assert!(kernels >= 50, "found only {kernels} kernel definitions");
        let gemv = SOURCES.iter().find(|(stem, _)| *stem == "gemv").expect("gemv.cu").1;
        let body = &gemv[gemv.find("__device__ __forceinline__ void gemvq_body").expect("gemvq_body")..];
        let body = &body[..body.find("\n}\n").expect("gemvq_body's end")];
        let wait = body.find("if constexpr (WAIT) pdl_wait();").expect("gemvq_body waits");
        for use_ in ["quantize_prologue", "q8_task_accumulate", "y["] {
            assert!(body.find(use_).is_some_and(|u| u > wait), "gemvq_body uses `{use_}` before it waits");
        }
    }

    /// Needs libnvrtc (e.g. `pip install nvidia-cuda-nvrtc`, then point LD_LIBRARY_PATH at its lib folder):
    /// `cargo test -p nebula-kernels -- --ignored nvrtc`.
    #[test]
    #[ignore = "needs libnvrtc on LD_LIBRARY_PATH: cargo test -p nebula-kernels -- --ignored nvrtc"]
    fn nvrtc_compiles_every_source() {
        for (stem, src) in SOURCES {
            if let Err(e) = nvrtc_compile(stem, src, "sm_90") {
                panic!("{e}");
            }
        }
    }

    #[test]
    fn carveout_accepts_percentages_and_names_the_variable_otherwise() {
        assert_eq!(parse_carveout(None).unwrap(), None);
        assert_eq!(parse_carveout(Some(" ")).unwrap(), None);
        assert_eq!(parse_carveout(Some("0")).unwrap(), Some(0));
        assert_eq!(parse_carveout(Some("100")).unwrap(), Some(100));
        for bad in ["101", "-1", "half", "50%"] {
            let e = parse_carveout(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("NEBULA_CUDA_CARVEOUT") && e.contains(bad), "{e}");
        }
    }

    /// The driver codes a start-up can stop with read as their cause in words; the conversion never asks the
    /// driver (none is loaded here).
    #[test]
    fn driver_errors_say_their_cause_in_words() {
        use cudarc::driver::sys::CUresult as R;
        let cases = [
            (R::CUDA_ERROR_STUB_LIBRARY, "stub"),
            (R::CUDA_ERROR_NO_DEVICE, "no CUDA-capable GPU"),
            (R::CUDA_ERROR_INVALID_DEVICE, "no GPU with that index"),
            (R::CUDA_ERROR_OUT_OF_MEMORY, "out of memory"),
            (R::CUDA_ERROR_NOT_INITIALIZED, "driver is missing"),
            (R::CUDA_ERROR_UNSUPPORTED_PTX_VERSION, "newer CUDA toolkit"),
            (R::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE, "insufficient driver"),
        ];
        for (code, words) in cases {
            let e = GpuError::from(cudarc::driver::DriverError(code)).to_string();
            assert!(e.contains(&format!("{code:?}")) && e.contains(words), "{e}");
            assert!(!e.contains("cuGetErrorString"), "{e}");
        }
        let e = GpuError::from(cudarc::driver::DriverError(R::CUDA_ERROR_STUB_LIBRARY)).to_string();
        assert!(e.contains("LD_LIBRARY_PATH"), "{e}");
        // A code without words of its own is still named.
        assert_eq!(driver_result_words(R::CUDA_ERROR_NOT_FOUND), "CUDA_ERROR_NOT_FOUND");
    }

    #[test]
    fn a_missing_weight_type_names_the_type_and_the_tensor() {
        let e = GpuError::UnsupportedType { type_name: "Q5_1".into(), tensor: Some("blk.3.ffn_down_exps".into()) };
        assert_eq!(e.to_string(), "the CUDA backend has no kernels for weight type Q5_1 (tensor blk.3.ffn_down_exps)");
        let e = GpuError::UnsupportedType { type_name: "Q5_1".into(), tensor: None };
        assert_eq!(e.to_string(), "the CUDA backend has no kernels for weight type Q5_1");
    }

    #[test]
    fn opening_without_a_driver_is_a_clean_error() {
        if find_cuda_driver().is_none() {
            assert!(matches!(Gpu::open(0), Err(GpuError::NoDriver)));
        }
    }
}
