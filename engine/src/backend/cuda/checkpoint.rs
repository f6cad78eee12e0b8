//! Snapshots, restore, fork and host images of a sequence on the GPU: what the prefix cache and the backend
//! trait's state operations need.
//!
//! A [`CudaState`]'s attention caches (K, V, raw indexer keys, pooled blocks) are written by position and only
//! grow, so a prefix of them is a copy of the first `pos` rows (`pos / ratio` complete pooled blocks). The Gated
//! DeltaNet conv and recurrent state, the PLE conv history and n-gram context and the MTP block's pending bank
//! are overwritten by every token, so a [`CudaSnapshot`] copies them: device to device while it is held in VRAM
//! (no synchronisation, a few MiB per snapshot), or as host vectors once spilled. A host image of a whole state
//! ([`CudaModel::state_image`]) uses the fields of the CPU [`SequenceState`] to carry the device buffers' bytes
//! as they are (the device layouts, not converted): only this backend reads it back.
//!
//! The MTP cache after `pos` tokens holds rows `0..pos - 1` (row `pos - 1` needs the next token); a fork or
//! restore keeps at most those rows and drops a draft's extra row, as the CPU model does.

use nebula_kernels::cudarc::driver::CudaSlice;

use nebula_kernels::cudarc::driver::sys as driver_sys;

use super::device::{Arg, htod};
use super::kv_cache::{HostKv, MappedHost};
use super::memory::zeros;
use super::self_attn::{AttnState as DevAttnState, DevAttention};
use super::state::LayerState as DevLayerState;
use super::{CudaError, CudaModel, CudaState, DevTokenMixer};
use crate::model::linear_attn::GdnState;
use crate::model::mtp::MtpState;
use crate::model::ple::PleState;
use crate::model::self_attn::AttnState;
use crate::model::state::LayerState;
use crate::model::{KvRows, ModelError, SequenceState, Snapshot};

/// A snapshot of a sequence on the GPU ([`CudaModel::snapshot_state`]).
pub struct CudaSnapshot {
    pos: usize,
    held: SnapshotHeld,
}

enum SnapshotHeld {
    /// Copies in VRAM.
    Device(DeviceSnapshot),
    /// Copies in host memory, in [`Snapshot`]'s fields (device layouts).
    Host(Snapshot),
}

struct DeviceSnapshot {
    /// Per layer, the Gated DeltaNet (conv, recurrent) state; `None` for attention layers.
    gdn: Vec<Option<(CudaSlice<f32>, CudaSlice<f32>)>>,
    ple_context: Vec<u32>,
    ple_conv: Option<CudaSlice<f32>>,
    /// The MTP block's pending bank and the rows its cache held (`None` without a usable MTP cache).
    mtp: Option<(CudaSlice<f32>, usize)>,
}

impl CudaSnapshot {
    /// A snapshot held in host memory, from an image [`CudaModel::snapshot_to_host`] made (for example one
    /// read back from the disk cache).
    pub fn from_image(image: Snapshot) -> Self {
        Self { pos: image.pos, held: SnapshotHeld::Host(image) }
    }

    /// Tokens consumed when it was taken.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Bytes held on the device and on the host.
    pub fn held(&self) -> crate::backend::HeldBytes {
        match &self.held {
            SnapshotHeld::Device(d) => {
                let gdn: usize = d.gdn.iter().flatten().map(|(c, s)| c.len() + s.len()).sum();
                let device =
                    4 * (gdn + d.ple_conv.as_ref().map_or(0, CudaSlice::len) + d.mtp.as_ref().map_or(0, |m| m.0.len()));
                crate::backend::HeldBytes { device, host: 4 * d.ple_context.len() }
            }
            SnapshotHeld::Host(s) => crate::backend::HeldBytes { device: 0, host: s.bytes() },
        }
    }
}

/// Where a copy reads from: a device buffer or a host image's vector.
#[derive(Clone, Copy)]
enum Source<'a> {
    Device(&'a CudaSlice<f32>),
    Host(&'a [f32]),
}

/// A sequence's attention caches, wherever they are: a live state's device caches, or a host image's rows.
enum AttnSource<'a> {
    Device(&'a DevAttnState),
    Host(&'a AttnState),
}

impl<'a> AttnSource<'a> {
    fn of_layer(ls: &'a DevLayerState) -> Option<Self> {
        match ls {
            DevLayerState::Attention(a) => Some(AttnSource::Device(a)),
            DevLayerState::LinearAttention(_) => None,
        }
    }
}

/// Which of an attention layer's per-token caches.
#[derive(Clone, Copy)]
enum Part {
    K,
    V,
    IndexK,
}

impl CudaModel {
    /// (bytes of one row of K or V, of one raw indexer key or pooled block key, compress ratio) of attention
    /// layer `attn`'s caches.
    fn attn_rows(&self, attn: &DevAttention) -> (usize, usize, usize) {
        let b = attn.cache_bytes(&self.config, 1, 0);
        (b.kv_row, b.ik_row, attn.indexer.as_ref().map_or(0, |i| i.compress_ratio))
    }

    /// Copies the first `rows` tokens of the attention caches `src` (of layer `attn`) into `dst` (a fresh state's
    /// cache): the pooled block keys device to device or from the image; K, V and the raw indexer keys into
    /// `dst`'s host copies (when windowed) and into its ring (the last `ring` of them, or all).
    fn copy_attn_prefix(
        &self,
        dst: &mut DevAttnState,
        src: &AttnSource<'_>,
        attn: &DevAttention,
        rows: usize,
    ) -> Result<(), CudaError> {
        let (kv_row, ik_row, ratio) = self.attn_rows(attn);
        let blocks = rows.checked_div(ratio).unwrap_or(0);
        let stream = self.launch.dev.stream();
        let short = |have: usize| CudaError::Model(ModelError::BadSnapshot { snapshot: rows, current: have });
        match src {
            AttnSource::Device(a) => {
                self.copy_bytes(self.launch.addr(&dst.pooled, 0), self.launch.addr(&a.pooled, 0), blocks * ik_row)?
            }
            AttnSource::Host(h) => {
                if h.pooled.len() < blocks || h.k.len() < rows || h.v.len() < rows {
                    return Err(short(h.k.len()));
                }
                let bytes = h.pooled.bytes(blocks);
                htod(stream, self.launch.addr(&dst.pooled, 0), bytes.as_ptr(), bytes.len())?;
                // The copy reads `bytes` before this function returns.
                stream.synchronize()?;
            }
        }
        for part in [Part::K, Part::V, Part::IndexK] {
            let row = match part {
                Part::K | Part::V => kv_row,
                Part::IndexK if ratio > 0 => ik_row,
                Part::IndexK => continue,
            };
            self.copy_rows(dst, src, part, row, rows)?;
        }
        Ok(())
    }

    /// Rows `[0, rows)` of one per-token cache `part` (`row` bytes a row) from `src` into `dst`.
    fn copy_rows(
        &self,
        dst: &mut DevAttnState,
        src: &AttnSource<'_>,
        part: Part,
        row: usize,
        rows: usize,
    ) -> Result<(), CudaError> {
        let stream = self.launch.dev.stream();
        let bytes = rows * row;
        // Where the source's rows are readable from the host, when they are: its host copy or the image.
        let image;
        let host_src: Option<&[u8]> = match src {
            AttnSource::Device(a) => match &a.host {
                Some(h) => {
                    // Kernels of the source's last pass may still be writing its host copy.
                    stream.synchronize()?;
                    Some(host_part(h, part).slice(bytes))
                }
                None => None,
            },
            AttnSource::Host(h) => {
                image = match part {
                    Part::K => h.k.bytes(rows),
                    Part::V => h.v.bytes(rows),
                    Part::IndexK => h.index_k.bytes(rows),
                };
                if image.len() < bytes {
                    return Err(CudaError::Model(ModelError::BadSnapshot { snapshot: rows, current: image.len() }));
                }
                Some(&image[..bytes])
            }
        };
        let ring = dst.ring;
        let dst_addr = self.launch.addr(dev_part(dst, part), 0);
        match (dst.host.as_mut(), host_src) {
            (Some(h), Some(from)) => host_part_mut(h, part).slice_mut(bytes).copy_from_slice(from),
            (Some(h), None) => {
                // A device source of every row (not windowed): straight into the pinned host copy.
                let AttnSource::Device(a) = src else { unreachable!("host sources are read above") };
                let dst_host = host_part_mut(h, part).slice_mut(bytes).as_mut_ptr();
                super::device::dtoh(
                    stream,
                    dst_host as *mut std::ffi::c_void,
                    self.launch.addr(dev_part(a, part), 0),
                    bytes,
                )?;
                stream.synchronize()?;
            }
            (None, None) => {
                let AttnSource::Device(a) = src else { unreachable!("host sources are read above") };
                return self.copy_bytes(dst_addr, self.launch.addr(dev_part(a, part), 0), bytes);
            }
            (None, Some(from)) => {
                htod(stream, dst_addr, from.as_ptr(), bytes)?;
                stream.synchronize()?;
                return Ok(());
            }
        }
        // A windowed destination: its ring gets the last `ring` rows from its own host copy.
        let first = rows.saturating_sub(ring);
        let h = dst.host.as_ref().expect("windowed above");
        self.put_ring_rows(dev_part(dst, part), ring, row, host_part(h, part), first, rows - first)?;
        stream.synchronize()?;
        Ok(())
    }

    /// Copies host rows `[first, first + count)` of `host` (`row` bytes each) into ring slots `j % ring` of
    /// `dst` (at most two contiguous pieces).
    fn put_ring_rows(
        &self,
        dst: &CudaSlice<u8>,
        ring: usize,
        row: usize,
        host: &super::kv_cache::MappedHost,
        first: usize,
        count: usize,
    ) -> Result<(), CudaError> {
        let stream = self.launch.dev.stream();
        let mut j = first;
        while j < first + count {
            let slot = j % ring;
            let run = (ring - slot).min(first + count - j);
            htod(stream, self.launch.addr(dst, slot * row), host.host_ptr(j * row), run * row)?;
            j += run;
        }
        Ok(())
    }

    /// Refills the ring slots of `st`'s windowed caches that rows past `len` overwrote, when the state is cut back
    /// from `old` rows to `len` (restore, rollback): rows `[len - ring, min(old - ring, len))` from the host
    /// copies (kernels/cuda/attention.cu `kv_ring_fill`).
    ///
    /// Errors: a launch failed.
    pub(crate) fn refill_rings(&self, st: &CudaState, len: usize, old: usize) -> Result<(), CudaError> {
        let dev = &self.launch.dev;
        for (ls, layer) in st.layers.iter().zip(&self.layers) {
            let (DevLayerState::Attention(a), DevTokenMixer::SelfAttention(attn)) = (ls, &layer.mixer) else {
                continue;
            };
            let Some(h) = &a.host else { continue };
            let first = len.saturating_sub(a.ring);
            let last = old.saturating_sub(a.ring).min(len);
            if last <= first {
                continue;
            }
            let (kv_row, ik_row, _) = self.attn_rows(attn);
            dev.launch(
                "kv_ring_fill",
                ((last - first) as u32, 1, 1),
                128,
                &[
                    Arg::Ptr(h.k.device_addr(0)),
                    Arg::Ptr(self.launch.addr(&a.k, 0)),
                    Arg::Ptr(h.v.device_addr(0)),
                    Arg::Ptr(self.launch.addr(&a.v, 0)),
                    Arg::I32(kv_row as i32),
                    Arg::Ptr(h.index_k.device_addr(0)),
                    Arg::Ptr(self.launch.addr(&a.index_k, 0)),
                    Arg::I32(ik_row as i32),
                    Arg::I32(first as i32),
                    Arg::I32(a.ring as i32),
                ],
            )?;
        }
        Ok(())
    }

    /// Copies `bytes` from device address `src` to `dst`, stream-ordered (nothing for 0).
    fn copy_bytes(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both are live device allocations of at least `bytes` (callers size them), ordered on the
        // model's stream like every kernel that touches them.
        let r = unsafe { driver_sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.launch.dev.stream().cu_stream()) };
        super::device::check(r, "a device-to-device copy")
    }

    /// The first `rows` rows (`row` bytes each) of one per-token cache of `a` in host memory (synchronises).
    fn download_rows(&self, a: &DevAttnState, part: Part, row: usize, rows: usize) -> Result<Vec<u8>, CudaError> {
        let stream = self.launch.dev.stream();
        let bytes = rows * row;
        let mut out = vec![0u8; bytes];
        if bytes == 0 {
            return Ok(out);
        }
        match &a.host {
            Some(h) => {
                stream.synchronize()?;
                out.copy_from_slice(host_part(h, part).slice(bytes));
            }
            None => stream.memcpy_dtoh(&dev_part(a, part).slice(0..bytes), &mut out)?,
        }
        Ok(out)
    }

    /// Copies `n` floats from `src` to the start of `dst` (stream-ordered).
    fn fill(&self, dst: &mut CudaSlice<f32>, src: Source<'_>, n: usize) -> Result<(), CudaError> {
        if n == 0 {
            return Ok(());
        }
        let short = || CudaError::Model(ModelError::BadSnapshot { snapshot: n, current: dst.len() });
        match src {
            Source::Device(s) => {
                if s.len() < n || dst.len() < n {
                    return Err(short());
                }
                self.launch.dtod(self.launch.addr(dst, 0), self.launch.addr(s, 0), n)
            }
            Source::Host(h) => {
                if h.len() < n || dst.len() < n {
                    return Err(short());
                }
                let mut view = dst.slice_mut(0..n);
                Ok(self.launch.dev.stream().memcpy_htod(&h[..n], &mut view)?)
            }
        }
    }

    /// A device copy of `src` (all of it).
    fn duplicate(&self, src: &CudaSlice<f32>) -> Result<CudaSlice<f32>, CudaError> {
        let mut out = zeros(&self.launch.dev, src.len())?;
        self.fill(&mut out, Source::Device(src), src.len())?;
        Ok(out)
    }

    /// The first `n` floats of `src` in host memory (synchronises the stream).
    fn download(&self, src: &CudaSlice<f32>, n: usize) -> Result<Vec<f32>, CudaError> {
        let mut out = vec![0f32; n];
        if n > 0 {
            self.launch.dev.stream().memcpy_dtoh(&src.slice(0..n), &mut out)?;
        }
        Ok(out)
    }

    /// MTP cache rows a state at `pos` may keep, given `rows` held: at most `pos - 1`.
    fn mtp_rows_kept(pos: usize, rows: usize) -> usize {
        rows.min(pos.saturating_sub(1))
    }

    /// A snapshot of `st` held in VRAM (device-to-device copies, queued on the stream).
    ///
    /// Errors: device memory.
    pub fn snapshot_state(&self, st: &CudaState) -> Result<CudaSnapshot, CudaError> {
        let mut gdn = Vec::with_capacity(st.layers.len());
        for ls in &st.layers {
            gdn.push(match ls {
                DevLayerState::LinearAttention(g) => Some((self.duplicate(&g.conv)?, self.duplicate(&g.recurrent)?)),
                DevLayerState::Attention(_) => None,
            });
        }
        let ple_conv = st.ple.as_ref().map(|p| self.duplicate(&p.conv)).transpose()?;
        let ple_context = st.ple.as_ref().map_or_else(Vec::new, |p| p.context.clone());
        let mtp = match &st.mtp {
            // Usable only when the cache is in step (rows up to pos - 1 present) and the bank is set.
            Some(ms) if ms.has_bank && st.pos > 0 && ms.rows + 1 >= st.pos => {
                Some((self.duplicate(&ms.last_bank)?, Self::mtp_rows_kept(st.pos, ms.rows)))
            }
            _ => None,
        };
        self.bump_writes();
        Ok(CudaSnapshot { pos: st.pos, held: SnapshotHeld::Device(DeviceSnapshot { gdn, ple_context, ple_conv, mtp }) })
    }

    /// A host image of `snap` (synchronises the stream when it is in VRAM).
    ///
    /// Errors: a device copy failed.
    pub fn snapshot_to_host(&self, snap: &CudaSnapshot) -> Result<Snapshot, CudaError> {
        let d = match &snap.held {
            SnapshotHeld::Host(h) => return Ok(h.clone()),
            SnapshotHeld::Device(d) => d,
        };
        let mut recurrent = Vec::with_capacity(d.gdn.len());
        for g in &d.gdn {
            recurrent.push(match g {
                Some((c, s)) => {
                    Some(GdnState { conv: self.download(c, c.len())?, recurrent: self.download(s, s.len())? })
                }
                None => None,
            });
        }
        let ple = match &d.ple_conv {
            Some(c) => Some(PleState { context: d.ple_context.clone(), conv: self.download(c, c.len())? }),
            None => None,
        };
        let mtp_bank = d.mtp.as_ref().map(|(b, _)| self.download(b, b.len())).transpose()?;
        Ok(Snapshot { pos: snap.pos, recurrent, ple, mtp_bank })
    }

    /// Writes `snap`'s recurrent, PLE and MTP-bank parts into `st` (whose attention caches already hold the
    /// first `snap.pos` tokens) and sets its position; `mtp_rows` is what the MTP cache holds now.
    fn apply_snapshot(&self, st: &mut CudaState, snap: &CudaSnapshot, mtp_rows: usize) -> Result<(), CudaError> {
        let pos = snap.pos;
        let current = st.pos;
        let bad = || CudaError::Model(ModelError::BadSnapshot { snapshot: pos, current });
        let (gdn, ple_context, ple_conv, mtp): (Vec<Option<(Source, Source)>>, &[u32], Option<Source>, _) =
            match &snap.held {
                SnapshotHeld::Device(d) => (
                    d.gdn.iter().map(|g| g.as_ref().map(|(c, s)| (Source::Device(c), Source::Device(s)))).collect(),
                    &d.ple_context,
                    d.ple_conv.as_ref().map(Source::Device),
                    d.mtp.as_ref().map(|(b, rows)| (Source::Device(b), *rows)),
                ),
                SnapshotHeld::Host(h) => (
                    h.recurrent
                        .iter()
                        .map(|g| g.as_ref().map(|g| (Source::Host(&g.conv), Source::Host(&g.recurrent))))
                        .collect(),
                    h.ple.as_ref().map_or(&[][..], |p| &p.context),
                    h.ple.as_ref().map(|p| Source::Host(&p.conv)),
                    // A host snapshot carries a bank only when its cache was in step: rows up to pos - 1.
                    h.mtp_bank.as_ref().map(|b| (Source::Host(b), pos.saturating_sub(1))),
                ),
            };
        if gdn.len() != st.layers.len() {
            return Err(bad());
        }
        for (ls, saved) in st.layers.iter_mut().zip(&gdn) {
            match (ls, saved) {
                (DevLayerState::LinearAttention(g), Some((c, r))) => {
                    let (nc, ns) = (g.conv.len(), g.recurrent.len());
                    self.fill(&mut g.conv, *c, nc)?;
                    self.fill(&mut g.recurrent, *r, ns)?;
                }
                (DevLayerState::Attention(_), None) => {}
                _ => return Err(bad()),
            }
        }
        match (&mut st.ple, ple_conv) {
            (Some(dst), Some(src)) if dst.context.len() == ple_context.len() => {
                let n = dst.conv.len();
                self.fill(&mut dst.conv, src, n)?;
                dst.context.copy_from_slice(ple_context);
            }
            (None, None) => {}
            _ => return Err(bad()),
        }
        if let Some(ms) = st.mtp.as_mut() {
            match mtp {
                Some((bank, rows)) => {
                    let n = ms.last_bank.len();
                    self.fill(&mut ms.last_bank, bank, n)?;
                    ms.rows = Self::mtp_rows_kept(pos, rows.min(mtp_rows));
                    ms.has_bank = true;
                }
                None => {
                    // Out of step: drafting refuses until a fresh state.
                    ms.rows = 0;
                    ms.has_bank = false;
                }
            }
            ms.drafted_with = None;
        }
        st.pos = pos;
        self.bump_writes();
        Ok(())
    }

    /// Truncates `st` back to `snap`, taken earlier from the same sequence.
    ///
    /// Errors: [`ModelError::BadSnapshot`] when `snap` lies beyond `st` or has another shape.
    pub fn restore_state(&self, st: &mut CudaState, snap: &CudaSnapshot) -> Result<(), CudaError> {
        if snap.pos > st.pos {
            return Err(ModelError::BadSnapshot { snapshot: snap.pos, current: st.pos }.into());
        }
        let rows = st.mtp.as_ref().map_or(0, |m| m.rows);
        self.refill_rings(st, snap.pos, st.pos)?;
        self.apply_snapshot(st, snap, rows)?;
        // The rope positions are cut by length, like the attention caches (the device table's rows past the cut
        // are rewritten before any kernel reads them).
        st.mrope.truncate(snap.pos);
        Ok(())
    }

    /// A new state for at most `max_len` tokens holding the first `snap.pos()` tokens of `source` (a live state
    /// or a host image made by [`CudaModel::state_image`]); `drafting` as [`CudaModel::new_state_with`].
    ///
    /// Errors: [`ModelError::BadSnapshot`] when `snap` does not fit `source` or `max_len`; device memory.
    pub fn fork_state(
        &self,
        source: &crate::backend::Kept<CudaState>,
        snap: &CudaSnapshot,
        max_len: usize,
        drafting: bool,
    ) -> Result<CudaState, CudaError> {
        use crate::backend::Kept;
        let pos = snap.pos;
        let source_pos = match source {
            Kept::Live(s) => s.pos,
            Kept::Host(h) => h.pos,
        };
        let bad = || CudaError::Model(ModelError::BadSnapshot { snapshot: pos, current: source_pos });
        if pos > source_pos || pos > max_len {
            return Err(bad());
        }
        let mut st = self.new_state_with(max_len, drafting && self.has_mtp())?;
        st.routing_stream = match source {
            Kept::Live(s) => s.routing_stream,
            Kept::Host(h) => h.routing_stream,
        };
        // The rope positions of the first `pos` tokens (an image's M-RoPE positions too).
        st.mrope = match source {
            Kept::Live(s) => s.mrope.prefix(pos),
            Kept::Host(h) => h.mrope.prefix(pos),
        };
        if !st.mrope.explicit().is_empty() {
            self.upload_positions(&mut st, 0, pos)?;
        }
        // Attention caches: the first `pos` rows.
        let attn_of = |li: usize| -> Option<AttnSource<'_>> {
            match source {
                Kept::Live(s) => s.layers.get(li).and_then(AttnSource::of_layer),
                Kept::Host(h) => match h.layers.get(li) {
                    Some(LayerState::Attention(a)) => Some(AttnSource::Host(a)),
                    _ => None,
                },
            }
        };
        for (li, layer) in self.layers.iter().enumerate() {
            if let (DevTokenMixer::SelfAttention(a), DevLayerState::Attention(cache)) =
                (&layer.mixer, &mut st.layers[li])
            {
                let src = attn_of(li).ok_or_else(bad)?;
                self.copy_attn_prefix(cache, &src, a, pos)?;
            }
        }
        // The MTP block's cache: rows up to pos - 1, as many as the source holds.
        let mut mtp_rows = 0;
        if let (Some(ms), Some(block)) = (st.mtp.as_mut(), self.mtp.as_ref()) {
            let (src, held) = match source {
                Kept::Live(s) => match &s.mtp {
                    Some(m) => (Some(AttnSource::Device(&m.attn)), m.rows),
                    None => (None, 0),
                },
                Kept::Host(h) => match &h.mtp {
                    Some(m) => (Some(AttnSource::Host(&m.attn)), m.attn.len()),
                    None => (None, 0),
                },
            };
            if let Some(src) = src {
                mtp_rows = Self::mtp_rows_kept(pos, held);
                self.copy_attn_prefix(&mut ms.attn, &src, &block.self_attn, mtp_rows)?;
            }
        }
        self.apply_snapshot(&mut st, snap, mtp_rows)?;
        Ok(st)
    }

    /// A host image of `st`'s first `st.pos` tokens (device layouts in [`SequenceState`]'s fields; synchronises
    /// the stream), which [`CudaModel::fork_state`] resumes from as from `st`.
    ///
    /// Errors: a device copy failed.
    pub fn state_image(&self, st: &CudaState) -> Result<SequenceState, CudaError> {
        let pos = st.pos;
        let attn_image = |a: &DevAttention, cache: &DevAttnState, len: usize| -> Result<AttnState, CudaError> {
            let (kv_row, ik_row, ratio) = self.attn_rows(a);
            let (ty, ity) = a.kv_types(&self.config);
            let kvw = self.config.n_head_kv * self.config.head_dim;
            let ihd = if ratio > 0 { self.config.indexer.head_dim } else { 0 };
            let raw = if ratio > 0 { len } else { 0 };
            let blocks = len.checked_div(ratio).unwrap_or(0);
            let mut pooled = vec![0u8; blocks * ik_row];
            if !pooled.is_empty() {
                self.launch.dev.stream().memcpy_dtoh(&cache.pooled.slice(0..pooled.len()), &mut pooled)?;
            }
            let rows = |ty, w, bytes| {
                KvRows::from_bytes(ty, w, bytes).map_err(|e| CudaError::Unsupported(format!("a cache image: {e}")))
            };
            Ok(AttnState {
                k: rows(ty, kvw, self.download_rows(cache, Part::K, kv_row, len)?)?,
                v: rows(ty, kvw, self.download_rows(cache, Part::V, kv_row, len)?)?,
                index_k: rows(ity, ihd, self.download_rows(cache, Part::IndexK, ik_row, raw)?)?,
                pooled: rows(ity, ihd, pooled)?,
            })
        };
        let mut layers = Vec::with_capacity(st.layers.len());
        for (ls, layer) in st.layers.iter().zip(&self.layers) {
            layers.push(match (ls, &layer.mixer) {
                (DevLayerState::LinearAttention(g), _) => LayerState::LinearAttention(GdnState {
                    conv: self.download(&g.conv, g.conv.len())?,
                    recurrent: self.download(&g.recurrent, g.recurrent.len())?,
                }),
                (DevLayerState::Attention(cache), DevTokenMixer::SelfAttention(a)) => {
                    LayerState::Attention(attn_image(a, cache, pos)?)
                }
                _ => return Err(ModelError::BadSnapshot { snapshot: pos, current: pos }.into()),
            });
        }
        let ple = match &st.ple {
            Some(p) => Some(PleState { context: p.context.clone(), conv: self.download(&p.conv, p.conv.len())? }),
            None => None,
        };
        let mtp = match (&st.mtp, &self.mtp) {
            (Some(ms), Some(block)) => {
                let rows = Self::mtp_rows_kept(pos, ms.rows);
                let last_bank =
                    if ms.has_bank { self.download(&ms.last_bank, ms.last_bank.len())? } else { Vec::new() };
                Some(MtpState { attn: attn_image(&block.self_attn, &ms.attn, rows)?, last_bank, drafted_with: None })
            }
            _ => None,
        };
        Ok(SequenceState {
            pos,
            max_len: pos,
            layers,
            ple,
            mtp,
            routing_stream: st.routing_stream,
            mrope: st.mrope.prefix(pos),
        })
    }

    /// Bytes of device memory `st` holds, every buffer counted at its allocated length: the caches (sized for
    /// `max_len` tokens up front), the position and decode-step buffers, the MTP cache and draft buffers, and a
    /// verify pass's chain buffers once it has them. For a fresh state this is
    /// [`CudaModel::state_alloc_bytes`]'s device part.
    pub fn state_device_bytes(&self, st: &CudaState) -> usize {
        let attn = |a: &DevAttnState| a.k.len() + a.v.len() + a.index_k.len() + a.pooled.len();
        let layer = |ls: &DevLayerState| match ls {
            DevLayerState::LinearAttention(g) => g.conv.len() + g.recurrent.len(),
            DevLayerState::Attention(_) => 0,
        };
        let cache_bytes: usize = st
            .layers
            .iter()
            .filter_map(|ls| match ls {
                DevLayerState::Attention(a) => Some(attn(a)),
                DevLayerState::LinearAttention(_) => None,
            })
            .sum::<usize>()
            + st.mtp.as_ref().map_or(0, |m| attn(&m.attn));
        let layers: usize = st.layers.iter().map(layer).sum();
        let ple = st.ple.as_ref().map_or(0, |p| p.conv.len());
        let step = &st.step;
        let fixed = st.pos_dev.len()
            + step.token.len()
            + step.ple_rows.len()
            + step.logits.len()
            + step.choice.len()
            + st.mrope_dev.as_ref().map_or(0, CudaSlice::len);
        let mtp = st
            .mtp
            .as_ref()
            .map_or(0, |m| m.last_bank.len() + m.draft_bank.len() + m.draft_ids.len() + m.draft_positions.len());
        let chain = st.chain.as_ref().map_or(0, |c| {
            let gdn: usize = c
                .gdn
                .iter()
                .flatten()
                .map(|g| g.conv.len() + g.recurrent.len() + g.qkv.len() + g.beta.len() + g.g.len())
                .sum();
            let opt = |b: &Option<CudaSlice<f32>>| b.as_ref().map_or(0, |b| b.len());
            gdn + opt(&c.ple_conv)
                + opt(&c.ple_nrm)
                + c.banks.len()
                + c.coverage.len()
                + c.ids.len()
                + c.ple_rows.len()
                + c.logits.len()
        });
        // f32 and i32 buffers alike: four bytes a value; the attention caches are bytes.
        4 * (layers + ple + fixed + mtp + chain) + cache_bytes
    }

    /// Bytes of pinned host memory `st`'s windowed caches hold (their copies of every row).
    pub fn state_host_cache_bytes(&self, st: &CudaState) -> usize {
        st.layers
            .iter()
            .filter_map(|ls| match ls {
                DevLayerState::Attention(a) => a.host.as_ref(),
                DevLayerState::LinearAttention(_) => None,
            })
            .map(|h| h.k.size() + h.v.size() + h.index_k.size())
            .sum()
    }

    /// Marks device buffers as rewritten outside the kernels, so no cached 8-bit activation is reused across it.
    fn bump_writes(&self) {
        self.launch.dev.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A windowed cache's host copy of `part`.
fn host_part(h: &HostKv, part: Part) -> &MappedHost {
    match part {
        Part::K => &h.k,
        Part::V => &h.v,
        Part::IndexK => &h.index_k,
    }
}

fn host_part_mut(h: &mut HostKv, part: Part) -> &mut MappedHost {
    match part {
        Part::K => &mut h.k,
        Part::V => &mut h.v,
        Part::IndexK => &mut h.index_k,
    }
}

/// A cache's device buffer of `part` (its ring when windowed).
fn dev_part(a: &DevAttnState, part: Part) -> &CudaSlice<u8> {
    match part {
        Part::K => &a.k,
        Part::V => &a.v,
        Part::IndexK => &a.index_k,
    }
}
