//! Streamed prefill's staging: the ring of device buffers the non-resident experts of a layer are copied into on
//! the copy stream ([`Stage`]), the copies themselves ([`stage_group`], [`stage_expert`]), the PCIe bandwidth
//! measurement the crossover is chosen from ([`upload_bandwidth`]) and the copy timeline report
//! ([`copy_report`]).

use nebula_kernels::cudarc::driver::{CudaEvent, CudaSlice, CudaStream, sys as driver_sys};

use super::super::CudaError;
use super::super::device::{Dev, check, htod, ptr};
use crate::model::Qwen4Exp;

/// A staging buffer of streamed prefill: `stage_experts` experts' gate, up and down matrices.
pub(crate) struct Stage {
    pub(crate) gate: CudaSlice<u8>,
    pub(crate) up: CudaSlice<u8>,
    pub(crate) down: CudaSlice<u8>,
    /// Recorded on the copy stream when the buffer is filled.
    pub(crate) ready: CudaEvent,
    /// Recorded on the compute stream when the kernels reading the buffer are queued.
    pub(crate) free: CudaEvent,
}

/// One streamed expert group's events (copies start, copies end, kernels start, kernels end) and bytes copied.
pub(crate) type GroupTiming = ([CudaEvent; 4], usize);

/// Sums a streamed-prefill timeline ([`super::Hybrid::copy_log`]): copy-stream busy time and rate, kernel time of the
/// streamed groups, the time the copy stream waited for a free staging buffer and the compute stream for a
/// group's weights, and the span from the first copy to the last kernel. `None` when empty. Synchronises on
/// the events.
pub(crate) fn copy_report(log: &[GroupTiming]) -> Result<Option<String>, CudaError> {
    let (Some(first), Some(last)) = (log.first(), log.last()) else { return Ok(None) };
    let ms = |a: &CudaEvent, b: &CudaEvent| -> Result<f64, CudaError> { Ok(a.elapsed_ms(b)? as f64) };
    let (mut copy, mut kernels, mut copy_idle, mut compute_idle, mut bytes) = (0.0, 0.0, 0.0, 0.0, 0usize);
    for (i, (ev, b)) in log.iter().enumerate() {
        copy += ms(&ev[0], &ev[1])?;
        kernels += ms(&ev[2], &ev[3])?;
        bytes += b;
        if i > 0 {
            let prev = &log[i - 1].0;
            copy_idle += ms(&prev[1], &ev[0])?.max(0.0);
            compute_idle += ms(&prev[3], &ev[2])?.max(0.0);
        }
    }
    let span = ms(&first.0[0], &last.0[3])?;
    Ok(Some(format!(
        "streamed prefill, {} expert groups: span {span:.1} ms; copies {copy:.1} ms busy ({:.1} GB/s), {copy_idle:.1} ms \
         between groups; streamed expert kernels {kernels:.1} ms, {compute_idle:.1} ms between groups (the rest of \
         the layers and the waits for weights)",
        log.len(),
        bytes as f64 / (copy.max(1e-6) * 1e6)
    )))
}

/// Bytes of one expert's three matrices (gate, up, down) in layer `li` (types may differ between layers).
pub(crate) fn expert_bytes(model: &Qwen4Exp, li: usize) -> [usize; 3] {
    let e = &model.routed_moe(li).experts[0];
    [e.gate_proj.bytes().len(), e.up_proj.bytes().len(), e.down_proj.bytes().len()]
}

/// The largest [`expert_bytes`] of any layer, matrix by matrix: the size of a staging slot.
pub(crate) fn max_expert_bytes(model: &Qwen4Exp) -> [usize; 3] {
    (0..model.layers.len() + usize::from(model.mtp().is_some()))
        .map(|li| expert_bytes(model, li))
        .fold([0; 3], |m, b| std::array::from_fn(|i| m[i].max(b[i])))
}

/// Bytes/s of uploading layer `li`'s first `streamed` experts (up to `count`, a staging buffer's worth) into
/// `stage`, best of three timed runs.
pub(crate) fn upload_bandwidth(
    dev: &Dev,
    model: &Qwen4Exp,
    li: usize,
    streamed: &[usize],
    stage: &Stage,
    count: usize,
) -> Result<f64, CudaError> {
    let stream = dev.stream();
    let experts: Vec<usize> = streamed.iter().copied().take(count).collect();
    let mut best = f64::MAX;
    let mut bytes = 0usize;
    for _ in 0..3 {
        stream.synchronize()?;
        let t = std::time::Instant::now();
        bytes = 0;
        for (j, &e) in experts.iter().enumerate() {
            bytes += stage_expert(stream, model, li, e, stage, j)?;
        }
        stream.synchronize()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(bytes as f64 / best.max(1e-9))
}

/// Queues the upload of expert `e` of layer `li` (its host weights: RAM tier, SSD tier read now, or the file)
/// into slot `j` of `stage` on `stream`; returns the bytes copied.
///
/// Errors: an SSD read fails; the expert's matrices differ in size from the layer's first expert (the slots of
/// one layer are that size apart, as the grouped kernels read them).
pub(crate) fn stage_expert(
    stream: &CudaStream,
    model: &Qwen4Exp,
    li: usize,
    e: usize,
    stage: &Stage,
    j: usize,
) -> Result<usize, CudaError> {
    let x = model.host_expert(li, e)?;
    let sizes = expert_bytes(model, li);
    let mut copied = 0;
    for ((buf, mat), bytes) in
        [(&stage.gate, &x.gate_proj), (&stage.up, &x.up_proj), (&stage.down, &x.down_proj)].into_iter().zip(sizes)
    {
        let src = mat.bytes();
        if src.len() != bytes {
            return Err(CudaError::Unsupported(format!(
                "expert {e} of layer {li}: {} bytes where the layer's experts have {bytes}",
                src.len()
            )));
        }
        htod(stream, stage_ptr(buf, stream, j * bytes), src.as_ptr(), bytes)?;
        copied += bytes;
    }
    Ok(copied)
}

/// Queues the upload of the experts `experts` of layer `li` into slots `0..` of `stage` on `stream`, as
/// [`stage_expert`] does one by one, but with one strided copy per matrix for every run of RAM-tier experts that
/// lie at a constant stride in host memory (the RAM tier stores a layer's experts back to back, so a group of
/// consecutive expert ids is one run): 3 copy commands instead of 3 per expert. On the H200 machine (12 GB
/// profile, 2048-token chunks) the copy stream went from 47.5 to 53.6 GB/s; the prefill rate did not change (the
/// grouped expert kernels set it, as the `copies` profile shows). Returns the bytes copied.
///
/// Errors: as [`stage_expert`].
pub(crate) fn stage_group(
    stream: &CudaStream,
    model: &Qwen4Exp,
    li: usize,
    experts: &[usize],
    stage: &Stage,
) -> Result<usize, CudaError> {
    let sizes = expert_bytes(model, li);
    let bufs = [&stage.gate, &stage.up, &stage.down];
    // Host addresses of an expert's three matrices when it is in RAM and its sizes are the layer's (an SSD-tier
    // expert goes through `stage_expert`, which reads it once).
    let addrs = |e: usize| -> Option<[usize; 3]> {
        let x = model.ram_expert(li, e)?;
        let m = [&x.gate_proj, &x.up_proj, &x.down_proj];
        m.iter().zip(sizes).all(|(m, b)| m.bytes().len() == b).then(|| m.map(|m| m.bytes().as_ptr() as usize))
    };
    let mut copied = 0;
    let mut j = 0;
    while j < experts.len() {
        let Some(first) = addrs(experts[j]) else {
            copied += stage_expert(stream, model, li, experts[j], stage, j)?;
            j += 1;
            continue;
        };
        // Extend the run while the next expert sits one more stride further, for all three matrices.
        let mut len = 1;
        let mut stride = 0usize;
        while j + len < experts.len() {
            let Some(next) = addrs(experts[j + len]) else { break };
            let step = next[0].wrapping_sub(first[0]);
            if len == 1 {
                if step == 0 || step > isize::MAX as usize {
                    break;
                }
                stride = step;
            }
            if (0..3).any(|m| next[m] != first[m] + len * stride) {
                break;
            }
            len += 1;
        }
        for ((buf, &src), bytes) in bufs.iter().zip(&first).zip(sizes) {
            let dst = stage_ptr(buf, stream, j * bytes);
            if len == 1 {
                htod(stream, dst, src as *const u8, bytes)?;
            } else {
                htod_strided(stream, dst, src as *const u8, stride, bytes, len)?;
            }
        }
        copied += len * sizes.iter().sum::<usize>();
        j += len;
    }
    Ok(copied)
}

/// Copies `count` host blocks of `bytes` bytes, `stride` bytes apart from `src` on, to `count` consecutive blocks
/// at device address `dst` on `stream` (one `cuMemcpy2DAsync`).
fn htod_strided(
    stream: &CudaStream,
    dst: u64,
    src: *const u8,
    stride: usize,
    bytes: usize,
    count: usize,
) -> Result<(), CudaError> {
    let c = driver_sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: driver_sys::CUmemorytype::CU_MEMORYTYPE_HOST,
        srcHost: src as *const std::ffi::c_void,
        srcDevice: 0,
        srcArray: std::ptr::null_mut(),
        srcPitch: stride,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: driver_sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: bytes,
        WidthInBytes: bytes,
        Height: count,
    };
    // SAFETY: the host blocks are readable and outlive the copy (the RAM tier), the device range holds `count`
    // blocks (a staging buffer of the group's size).
    let r = unsafe { driver_sys::cuMemcpy2DAsync_v2(&c, stream.cu_stream()) };
    check(r, "copying experts to the GPU")
}

/// The device address of a staging matrix slot.
pub(crate) fn stage_ptr(buf: &CudaSlice<u8>, stream: &CudaStream, offset: usize) -> u64 {
    ptr(buf, stream, offset)
}
