//! RMS norms over rows on the device (`rms_norm_rows`, kernels/cuda/norm_rope.cu), as `crate::model::norm`.

use super::CudaError;
use super::device::Arg;
use super::launch::Launch;

impl Launch {
    /// Threads of a one-block-per-row norm over rows of `width`: about two values per thread, a multiple of
    /// `multiple` (32, or 256 when the kernel also quantizes in 256-value blocks), at most 1024.
    pub(crate) fn norm_threads(width: usize, multiple: usize) -> usize {
        width.div_ceil(2).next_multiple_of(multiple).clamp(multiple, 1024)
    }

    /// `out[r] = x[r] / rms(x[r]) * w[(r % w_rows)]` over `rows` rows of `width` (in place when out == x), one
    /// block per row with about two values per thread (up to 1024 threads): a decode step's few wide rows are
    /// latency-bound, so each thread loads little.
    pub(crate) fn rms_norm(
        &self,
        x: u64,
        w: u64,
        out: u64,
        rows: usize,
        width: usize,
        w_rows: usize,
    ) -> Result<(), CudaError> {
        let threads = Self::norm_threads(width, 32);
        self.dev.launch(
            "rms_norm_rows",
            (rows as u32, 1, 1),
            threads as u32,
            &[
                Arg::Ptr(x),
                Arg::Ptr(w),
                Arg::Ptr(out),
                Arg::I32(rows as i32),
                Arg::I32(width as i32),
                Arg::I32(w_rows as i32),
                Arg::F32(self.cfg.rms_eps),
            ],
        )?;
        Ok(())
    }
}
