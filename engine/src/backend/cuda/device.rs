//! The device floor: the GPU with its stream and cuBLAS handle ([`Dev`]), kernel launches by name on raw device
//! addresses ([`Arg`]), and the stream-ordered copies every layer above uses. It knows nothing of the model.
//!
//! Buffers are `CudaSlice`s owned by the model or the state; kernels take their raw addresses so one buffer can
//! be read and written by the same launch (in-place norms) without fighting the borrow checker. All work goes
//! to one stream, in order.

use std::sync::Arc;

use nebula_kernels::cudarc::cublas::{CudaBlas, sys as cublas_sys};
use nebula_kernels::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use nebula_kernels::{Gpu, GpuError};

use nebula_kernels::cudarc::driver::sys as driver_sys;

use super::CudaError;
use crate::gguf::GgmlType;
use crate::tuning::{CudaProfile, CudaTuning};

/// A kernel argument.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

/// Raw device address of a buffer (plus an element offset).
pub(crate) fn ptr<T: DeviceRepr>(buf: &CudaSlice<T>, stream: &CudaStream, offset: usize) -> u64 {
    let (p, _sync) = buf.device_ptr(stream);
    p + (offset * std::mem::size_of::<T>()) as u64
}

/// Kernel-name suffix of a weight type.
///
/// Errors: [`GpuError::UnsupportedType`] for a type the kernels do not cover (the upload checks every tensor
/// first, naming it, so a launch never meets one).
pub(crate) fn type_suffix(ty: GgmlType) -> Result<&'static str, GpuError> {
    Ok(match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::IQ4_NL => "iq4_nl",
        GgmlType::Q4_K => "q4_k",
        GgmlType::Q5_K => "q5_k",
        GgmlType::Q6_K => "q6_k",
        GgmlType::IQ4_XS => "iq4_xs",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::MXFP4 => "mxfp4",
        GgmlType::Q2_K => "q2_k",
        GgmlType::Q3_K => "q3_k",
        GgmlType::IQ1_S => "iq1_s",
        GgmlType::IQ1_M => "iq1_m",
        GgmlType::IQ2_XXS => "iq2_xxs",
        GgmlType::IQ2_XS => "iq2_xs",
        GgmlType::IQ2_S => "iq2_s",
        GgmlType::IQ3_XXS => "iq3_xxs",
        GgmlType::IQ3_S => "iq3_s",
        other => return Err(GpuError::UnsupportedType { type_name: other.name().to_string(), tensor: None }),
    })
}

/// The GPU with its cuBLAS handle.
pub(crate) struct Dev {
    pub(crate) gpu: Gpu,
    pub(crate) blas: CudaBlas,
    /// Per-kernel wall time when profiling kernels ([`CudaProfile::Kernels`]; the stream is synchronised around
    /// each launch).
    pub(crate) kernel_times: Option<std::sync::Mutex<Vec<(String, f64, u64)>>>,
    /// Launches of kernels other than the GEMVs and `quantize_act` (which write only fresh outputs); the 8-bit
    /// activation cache of the CUDA model is valid while this count is unchanged.
    pub(crate) writes: std::sync::atomic::AtomicU64,
    /// Kernels are launched with programmatic dependent launch (compute capability 9.0 and newer, unless
    /// [`CudaTuning::pdl`] is off): each may be scheduled while the one before it finishes and waits in `pdl_entry`
    /// (kernels/cuda/common.cuh) for its inputs.
    pub(crate) pdl: bool,
    /// Whether the current pass uses `pdl` ([`Dev::set_pass_tokens`]): short passes only.
    pub(crate) pdl_pass: std::sync::atomic::AtomicBool,
}

/// Passes of up to this many tokens launch with programmatic dependent launch. Decode steps (1 token) and MTP
/// verify/draft passes (up to 17) are chains of small kernels whose launch gaps it hides (H200, 12-layer synth:
/// decode 349-377 -> 395-403 tok/s at 512 tokens of context, same run); prefill chunks are few large kernels
/// and cuBLAS calls, where the early-scheduled blocks only took resources (prefill 2 % slower in that run).
const PDL_MAX_TOKENS: usize = 64;

impl Dev {
    pub(crate) fn new(gpu: Gpu, tuning: &CudaTuning) -> Result<Self, GpuError> {
        // One stream: ordering is the program order, so cudarc's per-buffer event tracking is not needed.
        unsafe { gpu.ctx.disable_event_tracking() };
        let blas = CudaBlas::new(gpu.stream.clone()).map_err(|e| GpuError::Driver(format!("cuBLAS: {e:?}")))?;
        let kernel_times = (tuning.profile == CudaProfile::Kernels).then(Default::default);
        let pdl = gpu.capability.0 >= 9 && tuning.pdl;
        Ok(Self { gpu, blas, kernel_times, writes: Default::default(), pdl, pdl_pass: pdl.into() })
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.gpu.stream
    }

    /// Launches kernel `name` on `grid` x `block` threads with `args`.
    pub(crate) fn launch(&self, name: &str, grid: (u32, u32, u32), block: u32, args: &[Arg]) -> Result<(), GpuError> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let (f, max) = self.gpu.func(name)?;
        if block > max {
            // The driver would refuse with a bare "invalid value": say which kernel and why.
            return Err(GpuError::Driver(format!(
                "launching {name}: {block} threads per block asked, its registers and shared memory allow {max}"
            )));
        }
        // router_topk writes only fresh outputs (ids, weights, the shared expert's gate logits), never an
        // activation a GEMV reads.
        if !(name.starts_with("gemv")
            || name.starts_with("moe_gemv")
            || name == "quantize_act"
            || name == "router_topk")
        {
            // Any other kernel may write a buffer an earlier quantize_act read: cached 8-bit activations expire.
            self.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let t0 = match &self.kernel_times {
            Some(_) => {
                self.gpu.stream.synchronize().map_err(GpuError::from)?;
                Some(std::time::Instant::now())
            }
            None => None,
        };
        if self.pdl_pass.load(std::sync::atomic::Ordering::Relaxed) {
            self.launch_dependent(f, name, grid, block, args)?;
        } else {
            let mut b = self.gpu.stream.launch_builder(f);
            for a in args {
                match a {
                    Arg::Ptr(p) => b.arg(p),
                    Arg::I32(v) => b.arg(v),
                    Arg::I64(v) => b.arg(v),
                    Arg::F32(v) => b.arg(v),
                };
            }
            let cfg = LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: 0 };
            unsafe { b.launch(cfg) }.map_err(|e| {
                GpuError::Driver(format!("launching {name}: {}", nebula_kernels::driver_result_words(e.0)))
            })?;
        }
        if let (Some(times), Some(t0)) = (&self.kernel_times, t0) {
            self.gpu.stream.synchronize().map_err(GpuError::from)?;
            let dt = t0.elapsed().as_secs_f64();
            let mut t = times.lock().expect("kernel times lock");
            match t.iter_mut().find(|e| e.0 == name) {
                Some(e) => {
                    e.1 += dt;
                    e.2 += 1;
                }
                None => t.push((name.to_string(), dt, 1)),
            }
        }
        Ok(())
    }

    /// Chooses the launch mode for a pass of `n` tokens: programmatic dependent launch for short passes (see
    /// [`PDL_MAX_TOKENS`]) when the device supports it.
    pub(crate) fn set_pass_tokens(&self, n: usize) {
        self.pdl_pass.store(self.pdl && n <= PDL_MAX_TOKENS, std::sync::atomic::Ordering::Relaxed);
    }

    /// Launches `f` with `cuLaunchKernelEx` and the programmatic-stream-serialization attribute, so the driver
    /// may start it before the previous kernel of the stream has finished (it waits in `pdl_entry`). Stream
    /// capture records the relaxed order as programmatic edges of the CUDA Graph.
    fn launch_dependent(
        &self,
        f: &nebula_kernels::cudarc::driver::CudaFunction,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        use nebula_kernels::cudarc::driver::sys;
        // Every argument in an 8-byte slot: the driver reads each parameter's own size (4 or 8 bytes) from the
        // start of its slot, which on little-endian x86-64/aarch64 holds the low bytes.
        let mut slots: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(p) => p,
                Arg::I32(v) => v as u32 as u64,
                Arg::I64(v) => v as u64,
                Arg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        let mut params: Vec<*mut std::ffi::c_void> =
            slots.iter_mut().map(|s| s as *mut u64 as *mut std::ffi::c_void).collect();
        // SAFETY: an all-zero launch attribute is a valid C value (an id and a plain-data union).
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: self.gpu.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        self.gpu.ctx.bind_to_thread().map_err(GpuError::from)?;
        // SAFETY: `params` points at one live slot per kernel parameter, in the kernel's order (the same
        // contract as the cudarc builder path), and the context is current on this thread.
        let r = unsafe { sys::cuLaunchKernelEx(&cfg, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(GpuError::Driver(format!("launching {name}: {}", nebula_kernels::driver_result_words(r))));
        }
        Ok(())
    }

    /// One thread per element, 256 per block.
    pub(crate) fn launch_1d(&self, name: &str, count: usize, args: &[Arg]) -> Result<(), GpuError> {
        let blocks = count.div_ceil(256) as u32;
        self.launch(name, (blocks, 1, 1), 256, args)
    }

    /// `C[n][m] = A[n][k] . W[m][k]^T` in f32 with cuBLAS (row-major views of column-major GEMM).
    pub(crate) fn sgemm(&self, w: u64, x: u64, y: u64, m: usize, n: usize, k: usize) -> Result<(), GpuError> {
        let (alpha, beta) = (1f32, 0f32);
        let status = unsafe {
            cublas_sys::cublasSgemm_v2(
                *self.blas.handle(),
                cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha,
                w as *const f32,
                k as i32,
                x as *const f32,
                k as i32,
                &beta,
                y as *mut f32,
                m as i32,
            )
        };
        if status != cublas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(GpuError::Driver(format!("cublasSgemm: {status:?}")));
        }
        Ok(())
    }
}

/// `Ok` for a successful driver result, else the result in words with `what` the call was doing.
pub(crate) fn check(r: driver_sys::CUresult, what: &str) -> Result<(), CudaError> {
    if r == driver_sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Gpu(GpuError::Driver(format!("{what}: {}", nebula_kernels::driver_result_words(r)))))
    }
}

/// Copies `bytes` host bytes at `src` to device address `dst` on `stream` (asynchronous for registered memory).
pub(crate) fn htod(stream: &CudaStream, dst: u64, src: *const u8, bytes: usize) -> Result<(), CudaError> {
    // SAFETY: `src` points at `bytes` readable host bytes that outlive the copy (the RAM tier, or pageable memory
    // the driver stages before returning); `dst` is a device allocation of at least `bytes`.
    let r = unsafe { driver_sys::cuMemcpyHtoDAsync_v2(dst, src as *const std::ffi::c_void, bytes, stream.cu_stream()) };
    check(r, "copying to the GPU")
}

/// Copies `bytes` from device address `src` to pinned host memory `dst` on `stream`.
pub(crate) fn dtoh(stream: &CudaStream, dst: *mut std::ffi::c_void, src: u64, bytes: usize) -> Result<(), CudaError> {
    // SAFETY: `dst` is pinned host memory of at least `bytes` that is not read until the stream passes an event
    // recorded after this copy.
    let r = unsafe { driver_sys::cuMemcpyDtoHAsync_v2(dst, src, bytes, stream.cu_stream()) };
    check(r, "copying from the GPU")
}

/// Copies `n` floats from device address `src` to `dst`, stream-ordered (nothing for `n = 0`).
pub(crate) fn dtod(stream: &CudaStream, dst: u64, src: u64, n: usize) -> Result<(), CudaError> {
    if n == 0 {
        return Ok(());
    }
    // SAFETY: both addresses are live device allocations of at least `n` floats (callers size them), and the
    // copy is ordered on the model's stream like every kernel that touches them.
    let r = unsafe { driver_sys::cuMemcpyDtoDAsync_v2(dst, src, n * 4, stream.cu_stream()) };
    check(r, "a device-to-device copy")
}
