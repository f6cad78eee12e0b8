//! Device memory of a forward pass: zeroed buffers ([`zeros`]) and the bump allocator of temporaries
//! ([`Arena`]), whose addresses stay put between decode steps so a captured CUDA Graph can replay over them.

use nebula_kernels::cudarc::driver::CudaSlice;

use super::CudaError;
use super::device::{Dev, ptr};

/// A device f32 buffer of `n` values (at least one), zeroed.
pub(crate) fn zeros(dev: &Dev, n: usize) -> Result<CudaSlice<f32>, CudaError> {
    Ok(dev.stream().alloc_zeros::<f32>(n.max(1))?)
}

/// A place in the arena ([`Arena::mark`]): (chunk count, values used).
pub(crate) type ArenaMark = (usize, usize);

/// Bump allocator for a forward pass's temporaries: one device buffer reused by every call, so decode steps
/// allocate nothing and a captured graph's addresses stay valid. When a pass needs more, a bigger buffer is added
/// for the rest of that pass and the two are merged at the next reset; the generation counter changes then, so
/// graphs captured over the old buffer are recaptured.
#[derive(Default)]
pub(crate) struct Arena {
    chunks: Vec<CudaSlice<f32>>,
    pub(crate) used: usize,
    pub(crate) generation: u64,
}

impl Arena {
    /// Values per allocation are rounded up to this (256-byte alignment).
    const ALIGN: usize = 64;

    pub(crate) fn reset(&mut self, dev: &Dev) -> Result<(), CudaError> {
        if self.chunks.len() > 1 {
            let total: usize = self.chunks.iter().map(|c| c.len()).sum();
            self.chunks.clear();
            self.chunks.push(zeros(dev, total)?);
            self.generation += 1;
        }
        self.used = 0;
        Ok(())
    }

    /// Where the next temporary would go. See [`Arena::release`].
    pub(crate) fn mark(&self) -> ArenaMark {
        (self.chunks.len(), self.used)
    }

    /// Frees every temporary taken since `mark` for reuse by later launches. All work is on one stream, so a
    /// later kernel writing reused memory runs after the earlier ones that read it; callers release only values
    /// nothing enqueued later reads (a layer's temporaries once its output is added to the residual stream, an
    /// expert group's once its kernels are queued). When a chunk was added since the mark, the new chunk is reused
    /// from its start and the rest of the old one waits for the next reset.
    pub(crate) fn release(&mut self, mark: ArenaMark) {
        if self.chunks.len() == mark.0 {
            self.used = self.used.min(mark.1);
        } else {
            self.used = 0;
        }
    }

    /// The device address of `n` fresh f32 (or i32) values.
    pub(crate) fn take(&mut self, dev: &Dev, n: usize) -> Result<u64, CudaError> {
        let n = n.max(1).div_ceil(Self::ALIGN) * Self::ALIGN;
        let cur = self.chunks.last().map_or(0, |c| c.len());
        if self.chunks.is_empty() || self.used + n > cur {
            self.chunks.push(zeros(dev, (2 * cur).max(n).max(1 << 20))?);
            self.used = 0;
            self.generation += 1;
        }
        let p = ptr(self.chunks.last().expect("pushed above"), dev.stream(), self.used);
        self.used += n;
        Ok(p)
    }
}
