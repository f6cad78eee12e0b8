//! CUDA Graphs of fixed-shape passes (decode steps, MTP draft chains, verify passes): a pass is enqueued eagerly
//! on its first use, captured on the next and replayed from then on while the arena keeps its buffers.

use nebula_kernels::cudarc::driver::{CudaGraph, sys as driver_sys};

use super::CudaError;
use super::launch::Launch;

/// A captured pass and the arena generation its temporaries live in.
pub(crate) struct DecodeGraph {
    graph: CudaGraph,
    arena_generation: u64,
    /// The address the pass returned (an arena address, valid after each replay: the decode step's pre-mixer
    /// bank).
    bank: u64,
    /// Arena values the captured pass uses (after a replay, later temporaries go past them).
    arena_used: usize,
}

/// A slot for a pass's graph and how often the pass ran (a graph is captured on its second run).
pub(crate) type GraphSlot = (Option<DecodeGraph>, usize);

impl Launch {
    /// Enqueues a pass on fresh arena space: eagerly on its first use, captured as a CUDA Graph into `slot` on the
    /// next (`seen` counts uses) and replayed from there while the arena keeps its buffers. `enqueue` returns an
    /// address the caller reads after the pass (kept with the graph and returned on replays); it must issue no host
    /// synchronisation and use only buffers whose addresses do not change between uses.
    pub(crate) fn run_graphed(
        &self,
        slot: &mut Option<DecodeGraph>,
        seen: &mut usize,
        enqueue: impl FnOnce() -> Result<u64, CudaError>,
    ) -> Result<u64, CudaError> {
        let stream = self.dev.stream().clone();
        let generation = {
            let mut arena = self.arena.lock().expect("arena lock");
            arena.reset(&self.dev)?;
            arena.generation
        };
        if self.flags.graphs
            && let Some(g) = slot.as_ref().filter(|g| g.arena_generation == generation)
        {
            g.graph.launch()?;
            self.arena.lock().expect("arena lock").used = g.arena_used;
            return Ok(g.bank);
        }
        let capture = self.flags.graphs && *seen >= 1;
        *seen += 1;
        if !capture {
            return enqueue();
        }
        stream.begin_capture(driver_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let out = enqueue();
        let graph = stream.end_capture(driver_sys::CUgraphInstantiate_flags(0))?;
        let bank = out?;
        let (arena_generation, arena_used) = {
            let a = self.arena.lock().expect("arena lock");
            (a.generation, a.used)
        };
        let graph = graph.ok_or_else(|| CudaError::Unsupported("a captured pass produced no graph".into()))?;
        graph.launch()?;
        *slot = Some(DecodeGraph { graph, arena_generation, bank, arena_used });
        Ok(bank)
    }
}
