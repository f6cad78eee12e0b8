//! The sparse MoE block (`mlp` in the reference: router `gate`, routed `experts`, `shared_expert` and its
//! `shared_expert_gate`) on the device (kernels/cuda/moe.cu, gemv.cu), as `crate::model::moe`.
//!
//! Routing, the routed experts and the gated shared expert run without a host round trip: decode batches take
//! one GEMV per (token, expert) slot over the device-resident expert stack, prefill batches group the slots by
//! expert, and the mid-size rows of a fast batched pass (`tuning.cuda.mid_rows`) group them by expert on the
//! decode-sized kernel `moe_gemvqg_*` (each expert read once for all its slots). In hybrid mode the block holds only the policy's resident experts and its forward follows the path
//! the policy picks (`hybrid::policy`): the rest on the CPU, or streamed to the GPU.

use nebula_kernels::cudarc::driver::CudaSlice;

use super::CudaError;
use super::device::{Arg, Dev, ptr};
use super::gemv::{Acts, GEMV_MAX_TOKENS, mid_type};
use super::hybrid::Hybrid;
use super::hybrid::policy::ExpertPath;
use super::launch::Launch;
use super::weights::{DevMatrix, DevStack, MatRef, StackView, Uploader};
use crate::gguf::GgmlType;
use crate::model::moe::{Expert, SparseMoe};

/// A layer's routed experts on the device: the gate, up and down projections of each held expert, stacked in
/// slot order (all experts in id order, or the policy's resident ones in hybrid mode).
pub(crate) struct DevExperts {
    /// `[slots][ff, d]`.
    pub(crate) gate_proj: DevStack,
    /// `[slots][ff, d]`.
    pub(crate) up_proj: DevStack,
    /// `[slots][d, ff]`.
    pub(crate) down_proj: DevStack,
}

impl DevExperts {
    /// The three stacks by address.
    pub(crate) fn views(&self, dev: &Dev) -> [StackView; 3] {
        [self.gate_proj.view(dev), self.up_proj.view(dev), self.down_proj.view(dev)]
    }
}

/// The shared expert on the device.
pub(crate) struct DevSharedExpert {
    /// The gate projection `[sff, d]`, with the up projection stacked under it (`[2 sff, d]`, one decode GEMV for
    /// both) when the two share a type; `separate_up` holds the up projection otherwise.
    pub(crate) gate_up_proj: DevMatrix,
    pub(crate) separate_up: Option<DevMatrix>,
    /// `[d, sff]`.
    pub(crate) down_proj: DevMatrix,
}

impl DevSharedExpert {
    /// The hidden size `sff`.
    pub(crate) fn ff(&self) -> usize {
        if self.separate_up.is_some() { self.gate_up_proj.rows } else { self.gate_up_proj.rows / 2 }
    }

    /// The gate projection `[sff, d]`.
    fn gate_proj(&self, dev: &Dev) -> MatRef {
        self.gate_up_proj.view(dev).top(self.ff())
    }

    /// The up projection `[sff, d]` (the lower half of the stack when stacked).
    fn up_proj(&self, dev: &Dev) -> MatRef {
        match &self.separate_up {
            Some(u) => u.view(dev),
            None => self.gate_up_proj.view(dev).below(self.ff()),
        }
    }
}

/// One layer's MoE block on the device (`crate::model::moe::SparseMoe`).
pub(crate) struct DevSparseMoe {
    /// The router, `[n_expert, d]`.
    pub(crate) gate: DevMatrix,
    pub(crate) experts: DevExperts,
    pub(crate) shared_expert: DevSharedExpert,
    /// The shared expert's gate row (f32 `[d]`), applied by the router kernel.
    pub(crate) shared_expert_gate: CudaSlice<f32>,
}

/// The router's outputs for `n` tokens (device addresses): expert ids and weights `[n * k]`, the shared expert's
/// gate logits `[n]`.
#[derive(Debug, Clone, Copy)]
struct Routed {
    ids: u64,
    w: u64,
    sgate: u64,
}

impl DevSparseMoe {
    /// Uploads block `block`'s MoE (tensors `blk.{block}.ffn_*`) with the routed experts `held` (all when `None`)
    /// as slot stacks.
    pub(crate) fn upload(
        up: &mut Uploader<'_>,
        m: &SparseMoe,
        held: Option<&[usize]>,
        block: usize,
    ) -> Result<Self, CudaError> {
        let p = format!("blk.{block}");
        let held: Vec<&Expert> = match held {
            Some(r) => r.iter().map(|&e| &m.experts[e]).collect(),
            None => m.experts.iter().collect(),
        };
        let gates: Vec<&crate::quant::Matrix> = held.iter().map(|e| &e.gate_proj).collect();
        let ups: Vec<&crate::quant::Matrix> = held.iter().map(|e| &e.up_proj).collect();
        let downs: Vec<&crate::quant::Matrix> = held.iter().map(|e| &e.down_proj).collect();
        let e0 = &m.experts[0];
        let se = &m.shared_expert;
        let (sg_name, su_name) = (format!("{p}.ffn_gate_shexp"), format!("{p}.ffn_up_shexp"));
        // The up projection's type and width are checked even when it is stacked under the gate.
        Uploader::check_shape(&se.up_proj, &su_name)?;
        if se.up_proj.rows() != se.gate_proj.rows() {
            return Err(CudaError::Unsupported(format!(
                "{su_name}: shared expert gate {} and up {} rows differ",
                se.gate_proj.rows(),
                se.up_proj.rows()
            )));
        }
        let (gate_up_proj, separate_up) = up.pair((&se.gate_proj, &sg_name), (&se.up_proj, &su_name))?;
        Ok(Self {
            gate: up.matrix(&m.gate, &format!("{p}.ffn_gate_inp"))?,
            experts: DevExperts {
                gate_proj: up.stack(&gates, &e0.gate_proj, &format!("{p}.ffn_gate_exps"))?,
                up_proj: up.stack(&ups, &e0.up_proj, &format!("{p}.ffn_up_exps"))?,
                down_proj: up.stack(&downs, &e0.down_proj, &format!("{p}.ffn_down_exps"))?,
            },
            shared_expert: DevSharedExpert {
                gate_up_proj,
                separate_up,
                down_proj: up.matrix(&se.down_proj, &format!("{p}.ffn_down_shexp"))?,
            },
            shared_expert_gate: up.vector(&m.shared_expert_gate)?,
        })
    }

    /// The type of the first matrix that multiplies the block's input (its 8-bit form is written by the mixer).
    pub(crate) fn input_type(&self) -> GgmlType {
        self.shared_expert.gate_up_proj.ty
    }

    /// The MoE block of layer `li`: routing, the routed experts (one GEMV per token-expert slot for small
    /// batches, grouped by expert for larger ones, both without a host round trip) and the gated shared expert.
    /// With a hybrid placement the routed experts the GPU does not hold run on the CPU ([`Self::forward_cpu_split`])
    /// or are streamed in ([`Self::forward_streamed`]). Returns the output `[n, d]` of the `n` tokens `m`; with
    /// `res = Some((x, a))` the combine kernel also applies the hyper-connection residual update `x += a * out`.
    /// With `scripted = Some((ids, weights))` (device `[n, k]` each: a routing override's choice,
    /// `crate::synth::routing`) the router still runs but those experts and weights replace its choice; nothing
    /// after it changes.
    pub(crate) fn forward(
        &self,
        ctx: &Launch,
        host: Option<(&Hybrid, usize)>,
        m: u64,
        n: usize,
        res: Option<(u64, u64)>,
        scripted: Option<(u64, u64)>,
    ) -> Result<u64, CudaError> {
        let moe = self;
        let dev = &ctx.dev;
        let cfg = &ctx.cfg;
        let (d, e, k) = (cfg.hidden, cfg.n_expert, cfg.n_expert_used);
        if e > 1024 || k > 32 {
            return Err(CudaError::Unsupported(format!(
                "{e} experts, {k} per token (the router kernel takes up to 1024 and 32)"
            )));
        }
        let logits = ctx.tmp(n * e)?;
        ctx.matmul(moe.gate.view(dev), m, n, logits)?;
        let ids = ctx.tmp(n * k)?;
        let w = ctx.tmp(n * k)?;
        // The shared expert's gate logits, computed by the router kernel's warp (d a multiple of 128: float4 loads).
        let sgate = ctx.tmp(n)?;
        let (sgw, sg_out) = if d.is_multiple_of(128) { (ctx.addr(&moe.shared_expert_gate, 0), sgate) } else { (0, 0) };
        dev.launch(
            "router_topk",
            (n as u32, 1, 1),
            32,
            &[
                Arg::Ptr(logits),
                Arg::I32(e as i32),
                Arg::I32(k as i32),
                Arg::Ptr(ids),
                Arg::Ptr(w),
                Arg::Ptr(m),
                Arg::I32(d as i32),
                Arg::Ptr(sgw),
                Arg::Ptr(sg_out),
            ],
        )?;
        if sgw == 0 {
            let gi = MatRef {
                ty: GgmlType::F32,
                rows: 1,
                cols: d,
                row_bytes: 4 * d,
                ptr: ctx.addr(&moe.shared_expert_gate, 0),
            };
            ctx.matmul(gi, m, n, sgate)?;
        }
        let (ids, w) = scripted.unwrap_or((ids, w));
        if let Some((h, li)) = host {
            let routed = Routed { ids, w, sgate };
            return match h.policy.path(n, ctx.exact()) {
                ExpertPath::CpuSplit => moe.forward_cpu_split(ctx, h, li, m, n, routed, res),
                ExpertPath::Streamed => moe.forward_streamed(ctx, h, li, m, n, routed, res),
            };
        }
        let slots = n * k;
        let ys = ctx.tmp(slots * d)?;
        let shared = if n <= GEMV_MAX_TOKENS / 2 || ctx.exact() || moe.grouped_decode(ctx, n) {
            // Decode: one GEMV per (token, expert) slot, expert ids read on the device (a mid-size fast batched
            // pass: one per expert for all its slots).
            moe.shared_and_routed(ctx, m, n, Some((ids, ys)))?
        } else {
            // Prefill: slots grouped by expert on the device; each expert's weights decoded once per 8 tokens.
            let shared = moe.shared_expert(ctx, m, n)?;
            let (offsets, perm) = Self::sort_slots(ctx, ids, slots)?;
            let views = moe.experts.views(dev);
            Self::grouped_ffn(ctx, views, e, 0, offsets, perm, m, n, ys, false)?;
            shared
        };
        Self::combine(ctx, ys, w, shared, sgate, 0, n, res)
    }

    /// The shared expert of `n` tokens `m`: its outputs `[n, d]`, before the gate (the router kernel computes the
    /// gate logits).
    pub(crate) fn shared_expert(&self, ctx: &Launch, m: u64, n: usize) -> Result<u64, CudaError> {
        self.shared_and_routed(ctx, m, n, None)
    }

    /// The shared expert of `n` tokens `m` (returned as in [`Self::shared_expert`]) and, with
    /// `routed = Some((ids, ys))`, the routed experts' decode GEMVs: slot `s` multiplies the stacks' matrix
    /// `ids[s]` (a slot of the stack; negative = skipped) into `ys + s * d`. Every product of `m` runs before the
    /// first activation kernel, so they all read one 8-bit form of `m`; the down projections compute and
    /// quantize `silu(g) * u` in their prologues where they can ([`Self::acts_silu`]), else a SiLU kernel does.
    pub(crate) fn shared_and_routed(
        &self,
        ctx: &Launch,
        m: u64,
        n: usize,
        routed: Option<(u64, u64)>,
    ) -> Result<u64, CudaError> {
        let moe = self;
        let dev = &ctx.dev;
        let cfg = &ctx.cfg;
        let (d, k, ff) = (cfg.hidden, cfg.n_expert_used, cfg.expert_ff);
        let sff = moe.shared_expert.ff();
        if let Some((ids, ys)) = routed
            && moe.grouped_decode(ctx, n)
        {
            return moe.shared_and_grouped(ctx, m, n, ids, ys);
        }
        if let Some((ids, ys)) = routed
            && let Some(parts) = moe.shared_parts(ctx)
        {
            return moe.shared_in_routed_slots(ctx, m, n, ids, ys, parts);
        }
        let (sg, su) = if n == 1 && moe.shared_expert.separate_up.is_none() {
            // Gate and up in one GEMV of the stacked matrix: [gate | up] for the one token, each half with the
            // threads per row it has when launched alone (as multi-token passes do).
            let both = ctx.tmp(2 * sff)?;
            let stack = moe.shared_expert.gate_up_proj.view(dev);
            let xa = ctx.acts(stack.ty, m, 1, d)?;
            ctx.gemv_as(stack, xa, 1, both, sff)?;
            (both, both + (4 * sff) as u64)
        } else {
            let (sg, su) = (ctx.tmp(n * sff)?, ctx.tmp(n * sff)?);
            ctx.matmul(moe.shared_expert.gate_proj(dev), m, n, sg)?;
            ctx.matmul(moe.shared_expert.up_proj(dev), m, n, su)?;
            (sg, su)
        };
        let slots = n * k;
        let gu = match routed {
            None => None,
            Some((ids, _)) => {
                let g = ctx.tmp(slots * ff)?;
                let u = ctx.tmp(slots * ff)?;
                let xa = ctx.acts(moe.experts.gate_proj.ty, m, n, d)?;
                if moe.experts.up_proj.ty == moe.experts.gate_proj.ty {
                    ctx.moe_gemv(
                        &moe.experts.gate_proj,
                        Some(&moe.experts.up_proj),
                        ids,
                        slots,
                        xa,
                        d,
                        k,
                        (g, u),
                        None,
                    )?;
                } else {
                    ctx.moe_gemv(&moe.experts.gate_proj, None, ids, slots, xa, d, k, (g, g), None)?;
                    let xu = ctx.acts(moe.experts.up_proj.ty, m, n, d)?;
                    ctx.moe_gemv(&moe.experts.up_proj, None, ids, slots, xu, d, k, (u, u), None)?;
                }
                Some((g, u))
            }
        };
        // The SwiGLU hidden layers silu(g) * u: computed by the down projections' prologues where they can.
        let shared = ctx.tmp(n * d)?;
        let sh = moe.shared_expert.down_proj.view(dev);
        if n == 1 && ctx.q8_block(sh.ty, sff).is_some() {
            let xa = ctx.acts_silu(sh.ty, sg, su, 1, sff, false)?;
            ctx.gemv(sh, xa, 1, shared)?;
        } else {
            ctx.silu_mul_q8(sg, su, n, sff, moe.shared_expert.down_proj.ty)?;
            ctx.matmul(sh, sg, n, shared)?;
        }
        if let (Some((g, u)), Some((ids, ys))) = (gu, routed) {
            let xg = ctx.acts_silu(moe.experts.down_proj.ty, g, u, slots, ff, true)?;
            ctx.moe_gemv(&moe.experts.down_proj, None, ids, slots, xg, ff, 1, (ys, ys), None)?;
        }
        Ok(shared)
    }

    /// Whether the routed experts of `n` rows run grouped by expert on the mid-size decode kernel
    /// (`moe_gemvqg_*`, [`Self::shared_and_grouped`]): a fast batched pass of more than `GEMV_MAX_TOKENS / 2` and
    /// at most `mid_rows` rows ([`Launch::mid`]), gate and up of one type, and mid-size kernels and 8-bit paths for
    /// gate/up and down.
    /// Otherwise the per-slot GEMVs or the prefill kernels, as before.
    pub(crate) fn grouped_decode(&self, ctx: &Launch, n: usize) -> bool {
        let (d, ff) = (ctx.cfg.hidden, ctx.cfg.expert_ff);
        let ex = &self.experts;
        n > GEMV_MAX_TOKENS / 2
            && ctx.mid(n)
            && mid_type(ex.gate_proj.ty)
            && mid_type(ex.down_proj.ty)
            && ex.up_proj.ty == ex.gate_proj.ty
            && ex.up_proj.rows == ex.gate_proj.rows
            && ex.gate_proj.cols == d
            && ex.down_proj.cols == ff
            && ctx.q8_block(ex.gate_proj.ty, d).is_some()
            && ctx.q8_block(ex.down_proj.ty, ff).is_some()
    }

    /// The MoE of [`Self::shared_and_routed`] for a mid-size fast batched pass ([`Self::grouped_decode`]): the
    /// `n k` slots grouped by expert on the device (`ids`: a matrix of the stacks per slot, negative or out of
    /// range = not here, its output left alone), gate and up of every slot in one grouped launch (each expert's
    /// rows read once for all its slots), the SiLU and its 8-bit form in one launch, the down projections grouped
    /// the same way into `ys + s * d`; the shared expert through [`Launch::matmul`] (the mid-size dense GEMV), its
    /// gate and up beside the routed ones on the same 8-bit form of `m`. Returns the shared expert's output
    /// `[n, d]` (before its gate, as [`Self::shared_expert`]).
    fn shared_and_grouped(&self, ctx: &Launch, m: u64, n: usize, ids: u64, ys: u64) -> Result<u64, CudaError> {
        let ex = &self.experts;
        let dev = &ctx.dev;
        let (d, k, ff) = (ctx.cfg.hidden, ctx.cfg.n_expert_used, ctx.cfg.expert_ff);
        let sff = self.shared_expert.ff();
        let slots = n * k;
        // Every product of m before any other kernel, so they all read one 8-bit form of it (the one the mixer
        // wrote, Launch::q8_produced; the GEMVs leave it valid, the sort is queued after them).
        let Acts::Q8(qx, dx) = ctx.acts(ex.gate_proj.ty, m, n, d)? else {
            return Err(CudaError::Unsupported(format!("no 8-bit activations for {:?} experts", ex.gate_proj.ty)));
        };
        let (sg, su) = (ctx.tmp(n * sff)?, ctx.tmp(n * sff)?);
        ctx.matmul(self.shared_expert.gate_proj(dev), m, n, sg)?;
        ctx.matmul(self.shared_expert.up_proj(dev), m, n, su)?;
        let plan = ctx.sort_plan(ids, slots, ex.gate_proj.count())?;
        let (g, u) = (ctx.tmp(slots * ff)?, ctx.tmp(slots * ff)?);
        ctx.moe_gemvqg(&ex.gate_proj, Some(&ex.up_proj), plan, (qx, dx), k, d, (g, u))?;
        let (hq, hd, _) = ctx.silu_mul_q8(g, u, slots, ff, ex.down_proj.ty)?.ok_or_else(|| {
            CudaError::Unsupported(format!("no 8-bit SiLU output for a {:?} down projection", ex.down_proj.ty))
        })?;
        ctx.moe_gemvqg(&ex.down_proj, None, plan, (hq, hd), 1, ff, (ys, ys))?;
        let shared = ctx.tmp(n * d)?;
        ctx.silu_mul_q8(sg, su, n, sff, self.shared_expert.down_proj.ty)?;
        ctx.matmul(self.shared_expert.down_proj.view(dev), sg, n, shared)?;
        Ok(shared)
    }

    /// The parts of `expert_ff` rows the shared expert's gate and up split into when they run as extra slots of
    /// the routed gate/up launch ([`Self::shared_in_routed_slots`]): `Some(sff / ff)` when the shared gate and up
    /// are one stack of the routed gate's type (so equal row bytes), `sff` is a multiple of `ff`, the activations
    /// are 8-bit and the SiLU outputs of both down projections quantize in the same blocks; `None` otherwise
    /// (and with the GEMV prologues on, whose down projections compute their own SiLU).
    fn shared_parts(&self, ctx: &Launch) -> Option<usize> {
        let moe = self;
        let (d, ff) = (ctx.cfg.hidden, ctx.cfg.expert_ff);
        let sff = moe.shared_expert.ff();
        let ok = ctx.flags.fuse.shared
            && moe.shared_expert.separate_up.is_none()
            && !ctx.flags.gemv_prologue
            && moe.experts.up_proj.ty == moe.experts.gate_proj.ty
            && moe.shared_expert.gate_up_proj.ty == moe.experts.gate_proj.ty
            && moe.experts.gate_proj.cols == d
            && ff > 0
            && sff.is_multiple_of(ff)
            && ctx.q8_block(moe.experts.gate_proj.ty, d).is_some()
            && ctx.q8_block(moe.experts.down_proj.ty, ff).is_some()
            && ctx.q8_block(moe.experts.down_proj.ty, ff) == ctx.q8_block(moe.shared_expert.down_proj.ty, sff);
        ok.then_some(sff / ff)
    }

    /// The decode MoE of [`Self::shared_and_routed`] with the shared expert folded into the routed launches: its
    /// gate and up run as `parts` extra slots per token of the routed gate/up GEMV (slot `n k + t parts + j`: rows
    /// `[j ff, (j + 1) ff)` of token `t`), so the SwiGLU rows of the routed slots and of the shared expert are
    /// contiguous and one SiLU launch computes and quantizes them all; the shared down projection then reads token
    /// `t`'s `sff` values from there. Each row's dot product is the one the routed kernel computes for an expert
    /// row (same threads per row for every token count: batch invariance holds). Two launches fewer per layer than
    /// the separate shared-expert GEMV and SiLU. Returns the shared expert's output `[n, d]`.
    fn shared_in_routed_slots(
        &self,
        ctx: &Launch,
        m: u64,
        n: usize,
        ids: u64,
        ys: u64,
        parts: usize,
    ) -> Result<u64, CudaError> {
        let moe = self;
        let dev = &ctx.dev;
        let cfg = &ctx.cfg;
        let (d, k, ff) = (cfg.hidden, cfg.n_expert_used, cfg.expert_ff);
        let slots = n * k;
        let rows = slots + n * parts;
        let g = ctx.tmp(rows * ff)?;
        let u = ctx.tmp(rows * ff)?;
        let xa = ctx.acts(moe.experts.gate_proj.ty, m, n, d)?;
        let (sg, su) = (moe.shared_expert.gate_proj(dev).ptr, moe.shared_expert.up_proj(dev).ptr);
        ctx.moe_gemv(
            &moe.experts.gate_proj,
            Some(&moe.experts.up_proj),
            ids,
            slots,
            xa,
            d,
            k,
            (g, u),
            Some((sg, su, parts, n)),
        )?;
        let (qx, dx, _) = ctx.silu_mul_q8(g, u, rows, ff, moe.experts.down_proj.ty)?.ok_or_else(|| {
            CudaError::Unsupported(format!("no 8-bit SiLU output for a {:?} down projection", moe.experts.down_proj.ty))
        })?;
        ctx.moe_gemv(&moe.experts.down_proj, None, ids, slots, Acts::Q8(qx, dx), ff, 1, (ys, ys), None)?;
        let shared = ctx.tmp(n * d)?;
        let off = slots * ff;
        ctx.gemv(
            moe.shared_expert.down_proj.view(dev),
            Acts::Q8(qx + off as u64, dx + (off / 32 * 4) as u64),
            n,
            shared,
        )?;
        Ok(shared)
    }

    /// `out = sum_j w_j ys_j + extra + sigmoid(sgate) shared` for `n` tokens (`extra` 0 = none); with
    /// `res = Some((x, a))` also the residual update `x[t][s] += a[t][s] * out[t]` of the hyper-connection bundle.
    #[allow(clippy::too_many_arguments)]
    fn combine(
        ctx: &Launch,
        ys: u64,
        w: u64,
        shared: u64,
        sgate: u64,
        extra: u64,
        n: usize,
        res: Option<(u64, u64)>,
    ) -> Result<u64, CudaError> {
        let cfg = &ctx.cfg;
        let (d, k) = (cfg.hidden, cfg.n_expert_used);
        let out = ctx.tmp(n * d)?;
        let (x, a) = res.unwrap_or((0, 0));
        ctx.dev.launch_1d(
            "moe_combine",
            n * d,
            &[
                Arg::Ptr(ys),
                Arg::Ptr(w),
                Arg::Ptr(shared),
                Arg::Ptr(sgate),
                Arg::Ptr(extra),
                Arg::Ptr(out),
                Arg::I32(n as i32),
                Arg::I32(k as i32),
                Arg::I32(d as i32),
                Arg::Ptr(x),
                Arg::Ptr(a),
                Arg::I32(cfg.hc_count as i32),
            ],
        )?;
        Ok(out)
    }

    /// Groups the `slots` routed (token, expert) slots by expert: (`offsets` `[E + 1]`, `perm` `[slots]`).
    fn sort_slots(ctx: &Launch, ids: u64, slots: usize) -> Result<(u64, u64), CudaError> {
        let e = ctx.cfg.n_expert;
        let offsets = ctx.tmp(e + 1)?;
        let perm = ctx.tmp(slots)?;
        ctx.dev.launch(
            "moe_sort",
            (1, 1, 1),
            1024,
            &[
                Arg::Ptr(ids),
                Arg::I32(slots as i32),
                Arg::I32(e as i32),
                Arg::Ptr(offsets),
                Arg::Ptr(perm),
                Arg::Ptr(0),
            ],
        )?;
        Ok((offsets, perm))
    }

    /// The routed experts of `count` weight slots for prefill, grouped by expert: `views` are the gate, up and
    /// down matrices of slot 0 (slot `j` at `j * expert_bytes`), `slot_expert` maps slots to expert ids (0 = slot
    /// `j` is expert `j`). Every token slot routed to one of these experts gets its output in `ys`. With
    /// `partial`, the other slots' activations are left alone (SiLU into a separate buffer), so several calls
    /// can cover one layer's experts.
    #[allow(clippy::too_many_arguments)]
    fn grouped_ffn(
        ctx: &Launch,
        views: [StackView; 3],
        count: usize,
        slot_expert: u64,
        offsets: u64,
        perm: u64,
        m: u64,
        n: usize,
        ys: u64,
        partial: bool,
    ) -> Result<(), CudaError> {
        let cfg = &ctx.cfg;
        let (d, k, ff) = (cfg.hidden, cfg.n_expert_used, cfg.expert_ff);
        let slots = n * k;
        let [gate, up, down] = views;
        let g = ctx.tmp(slots * ff)?;
        let u = ctx.tmp(slots * ff)?;
        for (view, out) in [(gate, g), (up, u)] {
            let xa = ctx.acts(view.ty, m, n, d)?;
            ctx.moe_grouped(view, count, slot_expert, offsets, perm, xa, k, d, out, slots)?;
        }
        let h = if partial {
            let h = ctx.tmp(slots * ff)?;
            ctx.dev.launch_1d(
                "silu_mul_into",
                slots * ff,
                &[Arg::Ptr(g), Arg::Ptr(u), Arg::Ptr(h), Arg::I64((slots * ff) as i64)],
            )?;
            h
        } else {
            ctx.silu_mul_q8(g, u, slots, ff, down.ty)?;
            g
        };
        let xh = ctx.acts(down.ty, h, slots, ff)?;
        ctx.moe_grouped(down, count, slot_expert, offsets, perm, xh, 1, ff, ys, slots)
    }

    /// The policy's CPU path (decode, verification): the GPU splits each token's experts (`hybrid_split`), one
    /// copy brings the MoE input, ids and CPU weights to the host, the CPU computes its experts while the GPU runs
    /// the shared and resident ones, and one copy brings the CPU's weighted sum back into the combine.
    #[allow(clippy::too_many_arguments)]
    fn forward_cpu_split(
        &self,
        ctx: &Launch,
        h: &Hybrid,
        li: usize,
        m: u64,
        n: usize,
        routed: Routed,
        res: Option<(u64, u64)>,
    ) -> Result<u64, CudaError> {
        let (d, k) = (ctx.cfg.hidden, ctx.cfg.n_expert_used);
        let slots = n * k;
        let share = h.send_cpu_share(ctx, li, m, n, routed.ids, routed.w)?;
        let (gpu_slot, w_gpu) = (share.gpu_slot, share.w_gpu);
        // The GPU's share, queued before the host waits: it runs while the CPU computes.
        let ys = ctx.tmp(slots * d)?;
        let resident = (h.layers[li].slots > 0).then_some((gpu_slot, ys));
        let shared = self.shared_and_routed(ctx, m, n, resident)?;
        let extra = h.run_cpu_share(ctx, li, share, n)?;
        Self::combine(ctx, ys, w_gpu, shared, routed.sgate, extra, n, res)
    }

    /// The policy's streamed path (prefill): the resident experts from the expert cache, every other expert of the
    /// layer streamed from host RAM in groups through the staging ring ([`Hybrid::stream_experts`]).
    #[allow(clippy::too_many_arguments)]
    fn forward_streamed(
        &self,
        ctx: &Launch,
        h: &Hybrid,
        li: usize,
        m: u64,
        n: usize,
        routed: Routed,
        res: Option<(u64, u64)>,
    ) -> Result<u64, CudaError> {
        let dev = &ctx.dev;
        let (d, k) = (ctx.cfg.hidden, ctx.cfg.n_expert_used);
        let stream = dev.stream();
        let hl = &h.layers[li];
        let slots = n * k;
        let shared = self.shared_expert(ctx, m, n)?;
        let ys = ctx.tmp(slots * d)?;
        let (offsets, perm) = Self::sort_slots(ctx, routed.ids, slots)?;
        let views = self.experts.views(dev);
        if hl.slots > 0 {
            let se = ptr(&hl.resident_dev, stream, 0);
            Self::grouped_ffn(ctx, views, hl.slots, se, offsets, perm, m, n, ys, true)?;
        }
        h.stream_experts(ctx, li, |[gate, up, down], count, slot_expert| {
            let staged = [
                StackView { ptr: gate, ..views[0] },
                StackView { ptr: up, ..views[1] },
                StackView { ptr: down, ..views[2] },
            ];
            // The group's activations are dead once its kernels are queued: the next group reuses them.
            let mark = ctx.arena_mark();
            Self::grouped_ffn(ctx, staged, count, slot_expert, offsets, perm, m, n, ys, true)?;
            ctx.arena_release(mark);
            Ok(())
        })?;
        Self::combine(ctx, ys, routed.w, shared, routed.sgate, 0, n, res)
    }
}
