//! Sparse MoE with a gated shared expert (`Qwen4ExpTextSparseMoeBlock`, `Qwen4ExpTextTopKRouter`,
//! `Qwen4ExpTextExperts` in transformers' `modeling_qwen4_exp.py`).
//!
//! Router: `p = softmax(W_router x)` in f32, the top `k` experts, weights renormalised to sum to 1 (no clamp, as
//! HF; llama.cpp clamps the sum at 6.1e-5). Expert `e`: `W_down[e] (silu(W_gate[e] x) * W_up[e] x)`. Output:
//! `sum_e w_e y_e + sigmoid(w_sg . x) * shared_expert(x)`.

use crate::quant::moe::{ExpertRef, ExpertWork, routed_experts};
use crate::quant::{Matrix, dot_f32};

use super::config::ModelConfig;
use super::error::ModelError;
use super::norm::{sigmoid, softmax};
use super::weights::TensorLoader;

/// One routed expert's three projections.
#[derive(Debug, Clone)]
pub struct Expert {
    /// `[ff, d]`.
    pub gate_proj: Matrix,
    /// `[ff, d]`.
    pub up_proj: Matrix,
    /// `[d, ff]`.
    pub down_proj: Matrix,
}

/// The routing decision for one token: expert ids and their renormalised weights, best first.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Chosen experts.
    pub experts: Vec<usize>,
    /// Their weights (sum to 1).
    pub weights: Vec<f32>,
}

/// The MoE block of one layer.
#[derive(Debug, Clone)]
pub struct SparseMoe {
    /// `[n_expert, d]`, F32.
    pub(crate) gate: Matrix,
    pub(crate) experts: Vec<Expert>,
    pub(crate) shared_expert: Expert,
    /// `[d]`.
    pub(crate) shared_expert_gate: Vec<f32>,
    pub(crate) top_k: usize,
}

impl SparseMoe {
    /// Loads `blk.{layer}.ffn_*`.
    pub fn load(w: &TensorLoader, cfg: &ModelConfig, layer: usize) -> Result<Self, ModelError> {
        let p = format!("blk.{layer}");
        let (d, e, ff, sff) = (cfg.hidden, cfg.n_expert, cfg.expert_ff, cfg.shared_ff);
        let (gates, ups) = w.expert_gate_up(&p, ff, d, e)?;
        let downs = w.matrix_stack(&format!("{p}.ffn_down_exps.weight"), d, ff, e)?;
        let experts = gates
            .into_iter()
            .zip(ups)
            .zip(downs)
            .map(|((gate_proj, up_proj), down_proj)| Expert { gate_proj, up_proj, down_proj })
            .collect();
        Ok(Self {
            gate: w.f32_matrix(&format!("{p}.ffn_gate_inp.weight"), e, d)?,
            experts,
            shared_expert: Expert {
                gate_proj: w.matrix(&format!("{p}.ffn_gate_shexp.weight"), sff, d)?,
                up_proj: w.matrix(&format!("{p}.ffn_up_shexp.weight"), sff, d)?,
                down_proj: w.matrix(&format!("{p}.ffn_down_shexp.weight"), d, sff)?,
            },
            shared_expert_gate: w.vector(&format!("{p}.ffn_gate_inp_shexp.weight"), d)?,
            top_k: cfg.n_expert_used,
        })
    }

    /// Routes each of the `n` tokens of `x` (`[n, d]`).
    pub fn route(&self, x: &[f32], n: usize) -> Vec<Routing> {
        let ne = self.gate.rows();
        let mut logits = vec![0f32; n * ne];
        self.gate.matmul(x, n, &mut logits);
        logits
            .chunks_exact_mut(ne)
            .map(|p| {
                softmax(p);
                let mut idx: Vec<usize> = (0..ne).collect();
                idx.select_nth_unstable_by(self.top_k - 1, |&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
                idx.truncate(self.top_k);
                idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
                let sum: f32 = idx.iter().map(|&i| p[i]).sum();
                Routing { weights: idx.iter().map(|&i| p[i] / sum).collect(), experts: idx }
            })
            .collect()
    }

    /// The MoE output for `n` tokens `x` (`[n, d]`): `[n, d]`.
    ///
    /// The routed experts and the gated shared expert run in one call of the CPU MoE kernel
    /// ([`routed_experts`]): routed experts in ascending id order (as the reference's `index_add_` loop), the
    /// shared expert last, each output a fixed-order sum whatever the thread count.
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        let routing = self.route(x, n);
        self.forward_routed(x, n, &routing)
    }

    /// [`SparseMoe::forward`] with the routing already computed (by [`SparseMoe::route`] on the same `x`).
    pub fn forward_routed(&self, x: &[f32], n: usize, routing: &[Routing]) -> Vec<f32> {
        let d = self.shared_expert_gate.len();
        let mut work: Vec<ExpertWork<'_>> = self
            .tokens_by_expert(routing)
            .into_iter()
            .enumerate()
            .filter(|(_, users)| !users.is_empty())
            .map(|(e, tokens)| ExpertWork { expert: self.experts[e].as_ref(), tokens })
            .collect();
        let shared_weights = (0..n).map(|t| (t, sigmoid(dot_f32(&self.shared_expert_gate, &x[t * d..(t + 1) * d]))));
        work.push(ExpertWork { expert: self.shared_expert.as_ref(), tokens: shared_weights.collect() });
        let mut out = vec![0f32; n * d];
        routed_experts(&work, x, n, &mut out);
        out
    }

    /// For each routed expert, the `(token, weight)` pairs routed to it, tokens ascending.
    pub fn tokens_by_expert(&self, routing: &[Routing]) -> Vec<Vec<(usize, f32)>> {
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); self.experts.len()];
        for (t, r) in routing.iter().enumerate() {
            for (&e, &w) in r.experts.iter().zip(&r.weights) {
                if let Some(v) = by_expert.get_mut(e) {
                    v.push((t, w));
                }
            }
        }
        by_expert
    }
}

impl Expert {
    /// The three projections as the MoE kernel takes them.
    pub fn as_ref(&self) -> ExpertRef<'_> {
        ExpertRef { gate: &self.gate_proj, up: &self.up_proj, down: &self.down_proj }
    }
}

/// `W_down (silu(W_gate x) * W_up x)` for `n` tokens (`x` is `[n, d]`, the result `[n, d]`), through the MoE
/// kernel with weight 1.
pub fn run_expert(e: &Expert, x: &[f32], n: usize) -> Vec<f32> {
    let d = e.down_proj.rows();
    let mut y = vec![0f32; n * d];
    routed_experts(&[ExpertWork { expert: e.as_ref(), tokens: (0..n).map(|t| (t, 1.0)).collect() }], x, n, &mut y);
    y
}
