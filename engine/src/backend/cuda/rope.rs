//! Rotary position embedding on the device (`rope_heads`, kernels/cuda/norm_rope.cu), as `crate::model::rope`:
//! the partial, sectioned rope of the model's config, at positions read from the device (so graph replays
//! advance): the sequence position for text, or a state's M-RoPE table after an image.

use super::CudaError;
use super::device::Arg;
use super::launch::Launch;

impl Launch {
    /// Rotates `heads` heads of `n` tokens starting at the sequence position (`pos_dev`): at that position and
    /// the next ones, or with `thw` (a state's M-RoPE table, `[cache index][3]`; 0: none) at the positions the
    /// table holds for those cache indices.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rope(
        &self,
        x: u64,
        n: usize,
        heads: usize,
        token_stride: usize,
        head_stride: usize,
        pos_dev: u64,
        thw: u64,
    ) -> Result<(), CudaError> {
        let cfg = &self.cfg;
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
                Arg::I32(0),
                Arg::Ptr(pos_dev),
                Arg::I32(1),
                Arg::I32(cfg.rope_dim as i32),
                Arg::F32(cfg.rope_theta),
                Arg::I32(cfg.rope_sections[1] as i32),
                Arg::I32(cfg.rope_sections[2] as i32),
                Arg::Ptr(thw),
            ],
        )?;
        Ok(())
    }
}
