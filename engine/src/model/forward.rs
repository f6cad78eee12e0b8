//! The forward pass of [`Qwen4Exp`] over one or several sequences at once.
//!
//! A pass takes a list of sequences, each with its own state and tokens. The row-wise work — embedding,
//! hyper-connection mixes and injections, the token mixers' projections, routers, routed and shared experts, the
//! final mixer and the head — runs once over the rows of every sequence, so each weight is read once per pass
//! and each routed expert once for all the rows that chose it. The sequence-mixing work — the PLE n-gram context
//! and conv, Gated DeltaNet's conv and recurrence, attention and the QSA indexer over the sequence's own cache,
//! the MTP cache — runs per sequence on its state. Every row-wise kernel computes each row with the same
//! operations in the same order whatever the other rows are (`Matrix::matmul` equals `Matrix::matvec` per
//! token; the expert kernel sums each token's experts in ascending id order), so a sequence's logits are, bit
//! for bit, those of the same call made for it alone.

use std::ops::Range;

use super::linear_attn::GdnRecord;
use super::ple::PleRecord;
use super::state::LayerState;
use super::{
    ChainRecord, DecoderLayer, ForwardOptions, LogitsFor, ModelError, MtpBlock, MtpState, Qwen4Exp, SequenceState,
    TokenMixer, moe,
};
use crate::backend::BatchItem;
use crate::placement::Tier;
use crate::placement::hotlist::HotlistBuilder;
use crate::synth::routing::{ScriptedRows, stream_key};

/// Checks that a state at `pos` with room for `max_len` tokens can take `tokens`: every id below `vocab`, and
/// room for all of them.
///
/// Errors: [`ModelError::TokenOutOfRange`], [`ModelError::ContextOverflow`].
pub(crate) fn check_tokens(vocab: usize, pos: usize, max_len: usize, tokens: &[u32]) -> Result<(), ModelError> {
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ModelError::TokenOutOfRange { token: bad, vocab });
    }
    let needed = pos + tokens.len();
    if needed > max_len {
        return Err(ModelError::ContextOverflow { needed, limit: max_len });
    }
    Ok(())
}

impl Qwen4Exp {
    /// `lm_head` over `m` hidden rows (`[m, d]`), masked ids at `-inf`: `[m, vocab]`.
    pub(super) fn head(&self, h: &[f32], m: usize) -> Vec<f32> {
        let vocab = self.config.vocab;
        let mut logits = vec![0f32; m * vocab];
        self.lm_head.matmul(h, m, &mut logits);
        for row in logits.chunks_exact_mut(vocab) {
            for r in &self.masked {
                row[r.clone()].fill(f32::NEG_INFINITY);
            }
        }
        logits
    }

    /// One sequence's forward pass (see [`Qwen4Exp::forward_items`]).
    pub(super) fn forward_inner(
        &self,
        state: &mut SequenceState,
        tokens: &[u32],
        want: LogitsFor,
        opts: ForwardOptions,
        campaign: Option<&mut HotlistBuilder>,
        record: Option<&mut ChainRecord>,
    ) -> Result<Vec<f32>, ModelError> {
        let mut items = [BatchItem::text(state, tokens, want)];
        let mut out = self.forward_items(&mut items, opts, campaign, record)?;
        Ok(out.pop().unwrap_or_default())
    }

    /// Runs several sequences in one pass (module doc): each item's tokens continue its state, and its logits
    /// come back as its `want` asks (`[rows, vocab]`, masked ids at `-inf`), in the items' order. With
    /// `campaign`, records each layer's routing of every row; with `record` (a single item only), keeps what a
    /// chain rollback needs.
    ///
    /// Errors: [`ModelError::TokenOutOfRange`] or [`ModelError::ContextOverflow`] in any item, before anything
    /// runs (every state unchanged); [`ModelError::WeightRead`] when a placed weight cannot be read (SSD tier,
    /// n-gram rows on SSD): every state of the pass is then left part-way and must be discarded.
    pub(crate) fn forward_items(
        &self,
        items: &mut [BatchItem<'_, SequenceState>],
        opts: ForwardOptions,
        mut campaign: Option<&mut HotlistBuilder>,
        mut record: Option<&mut ChainRecord>,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let cfg = &self.config;
        for it in items.iter() {
            check_tokens(cfg.vocab, it.state.pos, it.state.max_len, it.tokens)?;
            if let Some(m) = &it.media {
                m.check(it.tokens.len(), cfg.hidden)?;
            }
        }
        assert!(record.is_none() || items.len() == 1, "a chain record covers one sequence");
        // Rows of item i: rows[i].
        let mut rows: Vec<Range<usize>> = Vec::with_capacity(items.len());
        let mut n = 0;
        for it in items.iter() {
            rows.push(n..n + it.tokens.len());
            n += it.tokens.len();
        }
        if n == 0 {
            return Ok(items.iter().map(|_| Vec::new()).collect());
        }
        let (d, s) = (cfg.hidden, cfg.hc_count);
        let dim = s * d;
        let pos0: Vec<usize> = items.iter().map(|it| it.state.pos).collect();
        // A routing override's choice for every row (each item's stream and positions), all layers.
        let scripted: Option<Vec<ScriptedRows>> = self.routing_override.as_ref().map(|o| {
            items
                .iter_mut()
                .map(|it| {
                    if it.state.pos == 0
                        && let Some(&first) = it.tokens.first()
                    {
                        it.state.routing_stream = stream_key(first);
                    }
                    o.rows(it.state.routing_stream, it.state.pos, it.tokens.len())
                })
                .collect()
        });
        // The n-gram rows depend on known tokens only: with the table placed, start reading them now, so the
        // layers before the PLE layer run while the reads are in flight.
        let ple_layer = self.layers.iter().find_map(|l| l.ple.as_ref());
        let placed_table = self.placement.as_ref().and_then(|p| p.table().map(|t| (p, t)));
        let mut table_rows = None;
        if let (Some((p, _)), Some(ple)) = (placed_table, ple_layer) {
            let mut all = Vec::new();
            for it in items.iter() {
                let ps = it.state.ple.as_ref().expect("a model with a PLE layer always has PLE state");
                all.extend(ple.rows(it.tokens, ps));
            }
            table_rows = p.fetch_rows(&all).map(|f| (all, f));
        }
        // X_0 = [e; e; ...; e], e the token's embedding or the row's injected one (an image's features).
        let mut x = vec![0f32; n * dim];
        let mut e = vec![0f32; d];
        for (it, r) in items.iter().zip(&rows) {
            let mut injected = it.media.iter().flat_map(|m| m.rows.iter().zip(m.embeds.chunks_exact(d))).peekable();
            for (k, &tok) in it.tokens.iter().enumerate() {
                let t = r.start + k;
                match injected.next_if(|(row, _)| **row == k) {
                    Some((_, emb)) => e.copy_from_slice(emb),
                    None => self.embed_tokens.dequantize_row(tok as usize, &mut e),
                }
                for st in 0..s {
                    x[t * dim + st * d..t * dim + (st + 1) * d].copy_from_slice(&e);
                }
            }
        }
        // Every row's rope position (given, or text continuing the sequence's), recorded in its state.
        let mut positions: Vec<[u32; 3]> = Vec::with_capacity(n);
        for it in items.iter_mut() {
            let base = it.state.pos;
            for k in 0..it.tokens.len() {
                let p = match &it.media {
                    Some(m) => m.positions[k],
                    None => [it.state.mrope.next_text(); 3],
                };
                it.state.mrope.push(base + k, p);
                positions.push(p);
            }
        }
        if let Some(r) = record.as_deref_mut() {
            r.gdn = Vec::with_capacity(self.layers.len());
        }
        for (li, layer) in self.layers.iter().enumerate() {
            if let Some(ple) = &layer.ple {
                let emb = match (placed_table, table_rows.take()) {
                    (Some((_, table)), Some((all, fetch))) => {
                        let mut emb = vec![0f32; n * ple.cfg.embed_dim()];
                        table.gather(fetch, &all, &mut emb).map_err(|e| ModelError::WeightRead {
                            what: "n-gram table rows".into(),
                            detail: e.to_string(),
                        })?;
                        Some(emb)
                    }
                    _ => None,
                };
                let ed = ple.cfg.embed_dim();
                for (it, r) in items.iter_mut().zip(&rows) {
                    let ps = it.state.ple.as_mut().expect("a model with a PLE layer always has PLE state");
                    let mut rec = record.as_ref().map(|_| PleRecord::default());
                    let xs = &x[r.start * dim..r.end * dim];
                    let delta = match &emb {
                        Some(emb) => {
                            ple.forward_gathered(xs, it.tokens, ps, &emb[r.start * ed..r.end * ed], rec.as_mut())
                        }
                        None => ple.forward_recorded(xs, it.tokens, ps, rec.as_mut()),
                    };
                    if let Some(rc) = record.as_deref_mut() {
                        rc.ple = rec;
                    }
                    for (a, b) in x[r.start * dim..r.end * dim].iter_mut().zip(&delta) {
                        *a += b;
                    }
                }
            }
            let mixed = layer.attn_hyper_connection.mix(&x, n);
            let y =
                self.token_mixer(li, layer, items, &rows, &pos0, &positions, &mixed.mixed, opts, record.as_deref_mut());
            layer.attn_hyper_connection.inject(&mut x, &y, &mixed.inject);
            let mixed = layer.mlp_hyper_connection.mix(&x, n);
            let computed = layer.mlp.route(&mixed.mixed, n);
            // With an override the router still runs (its cost is part of the step) but its choice is replaced.
            let routing = match &scripted {
                Some(rows) => rows.iter().flat_map(|r| (0..r.len()).map(move |j| r.routing(j, li))).collect(),
                None => computed,
            };
            if let Some(c) = campaign.as_deref_mut() {
                c.record(li, &routing);
            }
            if let Some(log) = &self.routing_log {
                log.record(li, &routing);
            }
            let y = match &self.placement {
                None => {
                    self.placement_stats.hit(Tier::Ram, (n * cfg.n_expert_used) as u64);
                    layer.mlp.forward_routed(&mixed.mixed, n, &routing)
                }
                Some(p) => {
                    // The next layers' routers on this hidden state predict which SSD experts to prefetch.
                    let ahead: Vec<&moe::SparseMoe> =
                        self.layers.iter().skip(li + 1).take(p.prefetch_layers()).map(|l| &l.mlp).collect();
                    p.moe_forward(li, &layer.mlp, &mixed.mixed, n, &routing, &ahead, true)?
                }
            };
            layer.mlp_hyper_connection.inject(&mut x, &y, &mixed.inject);
        }
        for ((it, r), &p0) in items.iter_mut().zip(&rows).zip(&pos0) {
            if r.is_empty() {
                continue;
            }
            it.state.pos = p0 + r.len();
            let xs = &x[r.start * dim..r.end * dim];
            match record.as_deref_mut() {
                // A chain's MTP rows wait for its rollback, which knows which rows are kept.
                Some(rc) => rc.bank = xs.to_vec(),
                None => {
                    if let (Some(block), Some(ms)) = (&self.mtp, it.state.mtp.as_mut()) {
                        self.extend_mtp(block, ms, xs, it.tokens, p0);
                    }
                }
            }
        }
        // The rows that want logits, gathered for one mixer and head pass.
        let wanted: Vec<Range<usize>> = items
            .iter()
            .zip(&rows)
            .map(|(it, r)| match it.want {
                _ if r.is_empty() => r.end..r.end,
                LogitsFor::None => r.end..r.end,
                LogitsFor::Last => r.end - 1..r.end,
                LogitsFor::All => r.clone(),
            })
            .collect();
        let m: usize = wanted.iter().map(Range::len).sum();
        let mut out: Vec<Vec<f32>> = Vec::with_capacity(items.len());
        if m == 0 {
            out.resize_with(items.len(), Vec::new);
            return Ok(out);
        }
        let mut h_in = Vec::with_capacity(m * dim);
        for w in &wanted {
            h_in.extend_from_slice(&x[w.start * dim..w.end * dim]);
        }
        let h = self.hyper_connection_mixer.mix(&h_in, m).mixed;
        let logits = self.head(&h, m);
        let vocab = cfg.vocab;
        let mut at = 0;
        for w in &wanted {
            out.push(logits[at * vocab..(at + w.len()) * vocab].to_vec());
            at += w.len();
        }
        Ok(out)
    }

    /// Layer `li`'s token mixer over the mixed input of every row (`[n, d]`): projections for all rows, then each
    /// item's recurrence or attention on its own state, then the output projection for all rows: `[n, d]`.
    #[allow(clippy::too_many_arguments)]
    fn token_mixer(
        &self,
        li: usize,
        layer: &DecoderLayer,
        items: &mut [BatchItem<'_, SequenceState>],
        rows: &[Range<usize>],
        pos0: &[usize],
        positions: &[[u32; 3]],
        mixed: &[f32],
        opts: ForwardOptions,
        record: Option<&mut ChainRecord>,
    ) -> Vec<f32> {
        let n = rows.last().map_or(0, |r| r.end);
        match &layer.mixer {
            TokenMixer::LinearAttention(g) => {
                let proj = g.project(mixed, n);
                let (dk, nv) = (g.head_dim, g.v_heads);
                let (cd, vd) = (g.conv_dim(), nv * dk);
                let mut per_head: Vec<Vec<f32>> = vec![Vec::with_capacity(n * dk); nv];
                for (it, r) in items.iter_mut().zip(rows) {
                    let LayerState::LinearAttention(st) = &mut it.state.layers[li] else {
                        unreachable!("state layout always follows the model's layers")
                    };
                    let heads = g.update_state(
                        &proj.qkv[r.start * cd..r.end * cd],
                        &proj.b[r.start * nv..r.end * nv],
                        &proj.a[r.start * nv..r.end * nv],
                        r.len(),
                        st,
                        opts.gdn,
                    );
                    for (all, h) in per_head.iter_mut().zip(heads) {
                        all.extend_from_slice(&h);
                    }
                }
                debug_assert_eq!(proj.z.len(), n * vd);
                let y = g.output(&per_head, &proj.z, n);
                if let Some(rc) = record {
                    rc.gdn.push(Some(GdnRecord { qkv: proj.qkv, b: proj.b, a: proj.a }));
                }
                y
            }
            TokenMixer::SelfAttention(a) => {
                if let Some(rc) = record {
                    rc.gdn.push(None);
                }
                let proj = a.project(mixed, n);
                let mut attn = Vec::with_capacity(n * a.n_head * a.head_dim);
                for ((it, r), &p0) in items.iter_mut().zip(rows).zip(pos0) {
                    let SequenceState { layers, mrope, .. } = &mut *it.state;
                    let LayerState::Attention(st) = &mut layers[li] else {
                        unreachable!("state layout always follows the model's layers")
                    };
                    attn.extend(a.attend(&proj, r.clone(), p0, &positions[r.clone()], mrope, st, &self.rope));
                }
                a.output(&attn, n)
            }
        }
    }

    /// Keeps the MTP cache aligned with the target after the target consumed `tokens` from `pos0` (their banks are
    /// `x`, `[n, S*d]`): runs every MTP row whose next token is now known (row `j` reads the target's bank at `j`
    /// and token `j + 1`) in one batch, and keeps the last row's bank for the next one. A cache that is not
    /// aligned (cannot happen through this API) is left as it is, and drafting then refuses.
    pub(super) fn extend_mtp(&self, block: &MtpBlock, ms: &mut MtpState, x: &[f32], tokens: &[u32], pos0: usize) {
        let dim = self.config.hc_dim();
        let n = tokens.len();
        let mut rows = block.rows(&ms.attn);
        if pos0 > 0 && rows == pos0 && ms.drafted_with != Some(tokens[0]) {
            // A draft ran the row for another pending token: redo it.
            block.truncate(&mut ms.attn, pos0 - 1);
            rows = pos0 - 1;
        }
        ms.drafted_with = None;
        let aligned = if pos0 == 0 { rows == 0 } else { rows + 1 == pos0 || rows == pos0 };
        let has_bank = pos0 == 0 || rows == pos0 || ms.last_bank.len() == dim;
        if !aligned || !has_bank {
            return;
        }
        let end = pos0 + n - 1; // rows [rows, end) now have their next token
        if rows < end {
            let mut banks = Vec::with_capacity((end - rows) * dim);
            let mut next = Vec::with_capacity(end - rows);
            for j in rows..end {
                if j + 1 == pos0 {
                    banks.extend_from_slice(&ms.last_bank);
                } else {
                    banks.extend_from_slice(&x[(j - pos0) * dim..(j - pos0 + 1) * dim]);
                }
                next.push(tokens[j + 1 - pos0]);
            }
            if block.forward(&self.embed_tokens, &mut ms.attn, &banks, &next, rows, 0..0).is_err() {
                return;
            }
        }
        ms.last_bank = x[(n - 1) * dim..n * dim].to_vec();
    }
}
