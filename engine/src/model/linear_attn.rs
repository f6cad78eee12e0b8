//! Gated DeltaNet (`Qwen4ExpTextGatedDeltaNet`, `torch_chunk_gated_delta_rule`,
//! `torch_recurrent_gated_delta_rule` in transformers' `modeling_qwen4_exp.py`).
//!
//! Per token: `[q; k; v] = silu(causal depthwise conv(W_qkv x))`, `beta = sigmoid(W_b x)`,
//! `g = A * softplus(W_a x + dt_bias)` with `A = -exp(A_log)` (stored already negated in GGUF), q and k
//! L2-normalised per head and q scaled by `1/sqrt(dk)`. Each value head keeps a `dk x dv` state `S`:
//! `S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q`. Output: gated RMS norm of `o` with `act(W_z x)`, then
//! `W_out`. Value heads are in GGUF's tiled order: value head `j` reads key head `j % k_heads`.
//!
//! Two algorithms give the same numbers: the token-by-token recurrence (decode) and the chunked form (prefill),
//! which folds 64 delta-rule updates into triangular solves (the WY/UT transform of the DeltaNet paper, as the
//! reference's `torch_chunk_gated_delta_rule`).

use rayon::prelude::*;

use crate::quant::Matrix;

use super::config::{GateActivation, ModelConfig};
use super::error::ModelError;
use super::norm::{l2_norm, rms_inv, sigmoid, silu, softplus};
use super::weights::TensorLoader;

/// Chunk length of the chunked algorithm (the reference's `chunk_size`).
pub const CHUNK: usize = 64;

/// Which form of the delta rule to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdnAlgorithm {
    /// Chunked for several tokens, recurrent for one.
    Auto,
    /// Always the chunked form.
    Chunked,
    /// Always token by token.
    Recurrent,
}

/// The conv history and recurrent state of one Gated DeltaNet layer for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct GdnState {
    /// The last `conv_kernel - 1` conv inputs, `[steps, conv_dim]`, oldest first.
    pub conv: Vec<f32>,
    /// `S` of every value head, `[v_heads, dk, dv]`.
    pub recurrent: Vec<f32>,
}

/// The projections a recorded forward kept for [`GatedDeltaNet::replay`]: `qkv` `[n, conv_dim]` (before the
/// conv), `b` and `a` `[n, v_heads]` (before the gates).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GdnRecord {
    /// `W_qkv x` per token.
    pub qkv: Vec<f32>,
    /// `W_b x` per token.
    pub b: Vec<f32>,
    /// `W_a x` per token.
    pub a: Vec<f32>,
}

/// One Gated DeltaNet token mixer.
#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    pub(crate) in_proj_qkv: Matrix,
    pub(crate) in_proj_z: Matrix,
    pub(crate) in_proj_b: Matrix,
    pub(crate) in_proj_a: Matrix,
    /// `[conv_dim, kernel]`.
    pub(crate) conv1d: Vec<f32>,
    pub(crate) dt_bias: Vec<f32>,
    /// `-exp(A_log)`.
    pub(crate) a: Vec<f32>,
    pub(crate) norm: Vec<f32>,
    pub(crate) out_proj: Matrix,
    pub(crate) kernel: usize,
    pub(crate) k_heads: usize,
    pub(crate) v_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) gate: GateActivation,
    pub(crate) eps: f32,
}

impl GatedDeltaNet {
    /// Loads `blk.{layer}.attn_qkv`, `attn_gate`, `ssm_*`.
    pub fn load(w: &TensorLoader, cfg: &ModelConfig, layer: usize) -> Result<Self, ModelError> {
        let p = format!("blk.{layer}");
        let d = cfg.hidden;
        let (kd, vd, nv) = (cfg.ssm_key_dim(), cfg.ssm_value_dim(), cfg.ssm_v_heads);
        let conv_dim = 2 * kd + vd;
        let a = w.vector(&format!("{p}.ssm_a"), nv)?;
        Ok(Self {
            in_proj_qkv: w.matrix(&format!("{p}.attn_qkv.weight"), conv_dim, d)?,
            in_proj_z: w.matrix(&format!("{p}.attn_gate.weight"), vd, d)?,
            in_proj_b: w.matrix(&format!("{p}.ssm_beta.weight"), nv, d)?,
            in_proj_a: w.matrix(&format!("{p}.ssm_alpha.weight"), nv, d)?,
            conv1d: w.decoded(&format!("{p}.ssm_conv1d.weight"), &[cfg.ssm_conv_kernel as u64, conv_dim as u64])?,
            dt_bias: w.vector(&format!("{p}.ssm_dt.bias"), nv)?,
            a,
            norm: w.vector(&format!("{p}.ssm_norm.weight"), cfg.ssm_head_dim)?,
            out_proj: w.matrix(&format!("{p}.ssm_out.weight"), d, vd)?,
            kernel: cfg.ssm_conv_kernel,
            k_heads: cfg.ssm_k_heads,
            v_heads: nv,
            head_dim: cfg.ssm_head_dim,
            gate: cfg.ssm_gate,
            eps: cfg.rms_eps,
        })
    }

    pub(crate) fn conv_dim(&self) -> usize {
        2 * self.k_heads * self.head_dim + self.v_heads * self.head_dim
    }

    /// A zero state.
    pub fn new_state(&self) -> GdnState {
        GdnState {
            conv: vec![0.0; (self.kernel - 1) * self.conv_dim()],
            recurrent: vec![0.0; self.v_heads * self.head_dim * self.head_dim],
        }
    }

    /// Runs `n` tokens `x` (`[n, d]`) through the layer, updating `state`; returns `[n, d]`.
    pub fn forward(&self, x: &[f32], n: usize, state: &mut GdnState, algo: GdnAlgorithm) -> Vec<f32> {
        self.forward_recorded(x, n, state, algo, None)
    }

    /// [`GatedDeltaNet::forward`] that also keeps, in `record`, the projections the state update reads, so that
    /// [`GatedDeltaNet::replay`] can later rebuild the state after any prefix of these tokens.
    pub fn forward_recorded(
        &self,
        x: &[f32],
        n: usize,
        state: &mut GdnState,
        algo: GdnAlgorithm,
        record: Option<&mut GdnRecord>,
    ) -> Vec<f32> {
        let GdnProjections { qkv, z, b, a } = self.project(x, n);
        let per_head = self.update_state(&qkv, &b, &a, n, state, algo);
        if let Some(r) = record {
            *r = GdnRecord { qkv, b, a };
        }
        self.output(&per_head, &z, n)
    }

    /// The input projections of `n` rows `x` (`[n, d]`), row by row: what a batched pass computes once for the
    /// rows of every sequence before [`GatedDeltaNet::update_state`] runs each sequence on its own state.
    pub(crate) fn project(&self, x: &[f32], n: usize) -> GdnProjections {
        let (dk, nv) = (self.head_dim, self.v_heads);
        let vd = nv * dk;
        let mut qkv = vec![0f32; n * self.conv_dim()];
        self.in_proj_qkv.matmul(x, n, &mut qkv);
        let mut z = vec![0f32; n * vd];
        self.in_proj_z.matmul(x, n, &mut z);
        let mut b = vec![0f32; n * nv];
        self.in_proj_b.matmul(x, n, &mut b);
        let mut a = vec![0f32; n * nv];
        self.in_proj_a.matmul(x, n, &mut a);
        GdnProjections { qkv, z, b, a }
    }

    /// Rebuilds `state` after the first `keep` tokens recorded by [`GatedDeltaNet::forward_recorded`], starting
    /// from the state those tokens started from. The token-by-token rule runs again on the recorded projections
    /// (no projection, MoE or head work), so the result is bit for bit the state a recurrent forward of only
    /// those `keep` tokens leaves.
    pub fn replay(&self, state: &mut GdnState, record: &GdnRecord, keep: usize) {
        let (cd, nv) = (self.conv_dim(), self.v_heads);
        let keep = keep.min(record.b.len() / nv.max(1));
        self.update_state(
            &record.qkv[..keep * cd],
            &record.b[..keep * nv],
            &record.a[..keep * nv],
            keep,
            state,
            GdnAlgorithm::Recurrent,
        );
    }

    /// Conv, gates and the delta rule for `n` tokens' projections; updates `state` and returns each value
    /// head's outputs `[n, dk]`.
    pub(crate) fn update_state(
        &self,
        qkv: &[f32],
        b: &[f32],
        a: &[f32],
        n: usize,
        state: &mut GdnState,
        algo: GdnAlgorithm,
    ) -> Vec<Vec<f32>> {
        let cd = self.conv_dim();
        let (dk, nk, nv) = (self.head_dim, self.k_heads, self.v_heads);
        let kd = nk * dk;
        let vd = nv * dk;

        // Causal depthwise conv with the kept history, then SiLU.
        let hist = self.kernel - 1;
        let mut seq = Vec::with_capacity((hist + n) * cd);
        seq.extend_from_slice(&state.conv);
        seq.extend_from_slice(qkv);
        let mut conv = vec![0f32; n * cd];
        for t in 0..n {
            for c in 0..cd {
                let mut acc = 0f32;
                for k in 0..self.kernel {
                    acc += self.conv1d[c * self.kernel + k] * seq[(t + k) * cd + c];
                }
                conv[t * cd + c] = silu(acc);
            }
        }
        state.conv.copy_from_slice(&seq[n * cd..]);

        // Split, normalise, gates.
        let scale = 1.0 / (dk as f32).sqrt();
        let mut q = vec![0f32; n * kd];
        let mut k = vec![0f32; n * kd];
        let mut v = vec![0f32; n * vd];
        for t in 0..n {
            let row = &conv[t * cd..(t + 1) * cd];
            q[t * kd..(t + 1) * kd].copy_from_slice(&row[..kd]);
            k[t * kd..(t + 1) * kd].copy_from_slice(&row[kd..2 * kd]);
            v[t * vd..(t + 1) * vd].copy_from_slice(&row[2 * kd..]);
        }
        for h in q.chunks_exact_mut(dk) {
            l2_norm(h, 1e-6);
            for x in h.iter_mut() {
                *x *= scale;
            }
        }
        for h in k.chunks_exact_mut(dk) {
            l2_norm(h, 1e-6);
        }
        let mut beta = vec![0f32; n * nv];
        let mut g = vec![0f32; n * nv];
        for t in 0..n {
            for j in 0..nv {
                beta[t * nv + j] = sigmoid(b[t * nv + j]);
                g[t * nv + j] = self.a[j] * softplus(a[t * nv + j] + self.dt_bias[j]);
            }
        }

        let chunked = match algo {
            GdnAlgorithm::Auto => n > 1,
            GdnAlgorithm::Chunked => true,
            GdnAlgorithm::Recurrent => false,
        };
        // Per value head, in parallel: gather its inputs, run the rule, scatter its outputs.
        state
            .recurrent
            .par_chunks_mut(dk * dk)
            .enumerate()
            .map(|(j, s)| {
                let kh = j % nk;
                let gather = |src: &[f32], width: usize, head: usize| -> Vec<f32> {
                    (0..n)
                        .flat_map(|t| src[t * width + head * dk..t * width + (head + 1) * dk].iter().copied())
                        .collect()
                };
                let qh = gather(&q, kd, kh);
                let kh_ = gather(&k, kd, kh);
                let vh = gather(&v, vd, j);
                let bh: Vec<f32> = (0..n).map(|t| beta[t * nv + j]).collect();
                let gh: Vec<f32> = (0..n).map(|t| g[t * nv + j]).collect();
                if chunked {
                    chunked_rule(s, &qh, &kh_, &vh, &bh, &gh, dk)
                } else {
                    recurrent_rule(s, &qh, &kh_, &vh, &bh, &gh, dk)
                }
            })
            .collect()
    }

    /// Gated RMS norm of each head's outputs with `act(z)`, then `out_proj`: `[n, d]`.
    pub(crate) fn output(&self, per_head: &[Vec<f32>], z: &[f32], n: usize) -> Vec<f32> {
        let (dk, nv) = (self.head_dim, self.v_heads);
        let vd = nv * dk;
        let mut o = vec![0f32; n * vd];
        for (j, out) in per_head.iter().enumerate() {
            for t in 0..n {
                let src = &out[t * dk..(t + 1) * dk];
                let inv = rms_inv(src, self.eps);
                let zt = &z[t * vd + j * dk..t * vd + (j + 1) * dk];
                let dst = &mut o[t * vd + j * dk..t * vd + (j + 1) * dk];
                for e in 0..dk {
                    let gate = match self.gate {
                        GateActivation::Sigmoid => sigmoid(zt[e]),
                        GateActivation::Silu => silu(zt[e]),
                    };
                    dst[e] = self.norm[e] * (src[e] * inv) * gate;
                }
            }
        }
        let mut y = vec![0f32; n * self.out_proj.rows()];
        self.out_proj.matmul(&o, n, &mut y);
        y
    }
}

/// A Gated DeltaNet layer's row-wise input projections ([`GatedDeltaNet::project`]): `qkv` `[n, conv_dim]`,
/// the output gate `z` `[n, v_heads * head_dim]`, `b` and `a` `[n, v_heads]`.
pub(crate) struct GdnProjections {
    pub(crate) qkv: Vec<f32>,
    pub(crate) z: Vec<f32>,
    pub(crate) b: Vec<f32>,
    pub(crate) a: Vec<f32>,
}

/// Token-by-token delta rule for one value head. `s` is `[dk, dv]` (dk = dv = `d`), `q`/`k`/`v` are `[n, d]`.
/// Returns the outputs `[n, d]`.
pub fn recurrent_rule(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], beta: &[f32], g: &[f32], d: usize) -> Vec<f32> {
    let n = beta.len();
    let mut out = vec![0f32; n * d];
    let mut kv = vec![0f32; d];
    for t in 0..n {
        let (qt, kt, vt) = (&q[t * d..(t + 1) * d], &k[t * d..(t + 1) * d], &v[t * d..(t + 1) * d]);
        let decay = g[t].exp();
        for x in s.iter_mut() {
            *x *= decay;
        }
        kv.iter_mut().for_each(|x| *x = 0.0);
        for a in 0..d {
            let ka = kt[a];
            for (e, acc) in kv.iter_mut().enumerate() {
                *acc += s[a * d + e] * ka;
            }
        }
        for e in 0..d {
            kv[e] = (vt[e] - kv[e]) * beta[t];
        }
        let ot = &mut out[t * d..(t + 1) * d];
        for a in 0..d {
            let ka = kt[a];
            let qa = qt[a];
            let row = &mut s[a * d..(a + 1) * d];
            for e in 0..d {
                row[e] += ka * kv[e];
                ot[e] += row[e] * qa;
            }
        }
    }
    out
}

/// Chunked delta rule for one value head (same arguments and result as [`recurrent_rule`]).
///
/// Within a chunk with cumulative log-decay `G`, `A[i][j] = beta_i <k_i, k_j> exp(G_i - G_j)` (j < i);
/// `U = (I + A)^-1 (beta v)` and `W = (I + A)^-1 (beta exp(G) k)` by forward substitution; then
/// `v'_i = U_i - S^T W_i`, `o_i = exp(G_i) S^T q_i + sum_{j<=i} <q_i, k_j> exp(G_i - G_j) v'_j`, and
/// `S = exp(G_last) S + sum_i exp(G_last - G_i) k_i v'_i^T`.
pub fn chunked_rule(s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], beta: &[f32], g: &[f32], d: usize) -> Vec<f32> {
    let n = beta.len();
    let mut out = vec![0f32; n * d];
    let mut start = 0;
    while start < n {
        let c = CHUNK.min(n - start);
        let qc = &q[start * d..(start + c) * d];
        let kc = &k[start * d..(start + c) * d];
        let vc = &v[start * d..(start + c) * d];
        let bc = &beta[start..start + c];
        let mut gcum = vec![0f32; c];
        let mut acc = 0f32;
        for i in 0..c {
            acc += g[start + i];
            gcum[i] = acc;
        }
        let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(a, b)| a * b).sum::<f32>();
        // Strictly lower triangle of A.
        let mut amat = vec![0f32; c * c];
        for i in 0..c {
            for j in 0..i {
                amat[i * c + j] =
                    bc[i] * dot(&kc[i * d..(i + 1) * d], &kc[j * d..(j + 1) * d]) * (gcum[i] - gcum[j]).exp();
            }
        }
        // Forward substitution for U and W.
        let mut u = vec![0f32; c * d];
        let mut w = vec![0f32; c * d];
        for i in 0..c {
            let eg = gcum[i].exp();
            for e in 0..d {
                u[i * d + e] = bc[i] * vc[i * d + e];
                w[i * d + e] = bc[i] * eg * kc[i * d + e];
            }
            for j in 0..i {
                let aij = amat[i * c + j];
                if aij != 0.0 {
                    for e in 0..d {
                        u[i * d + e] -= aij * u[j * d + e];
                        w[i * d + e] -= aij * w[j * d + e];
                    }
                }
            }
        }
        // v' = U - W S.
        let mut vnew = u;
        for i in 0..c {
            let wi = &w[i * d..(i + 1) * d];
            let vi = &mut vnew[i * d..(i + 1) * d];
            for a in 0..d {
                let wa = wi[a];
                let row = &s[a * d..(a + 1) * d];
                for e in 0..d {
                    vi[e] -= wa * row[e];
                }
            }
        }
        // Outputs.
        for i in 0..c {
            let qi = &qc[i * d..(i + 1) * d];
            let oi = &mut out[(start + i) * d..(start + i + 1) * d];
            let eg = gcum[i].exp();
            for a in 0..d {
                let qa = qi[a] * eg;
                let row = &s[a * d..(a + 1) * d];
                for e in 0..d {
                    oi[e] += qa * row[e];
                }
            }
            for j in 0..=i {
                let coef = dot(qi, &kc[j * d..(j + 1) * d]) * (gcum[i] - gcum[j]).exp();
                let vj = &vnew[j * d..(j + 1) * d];
                for e in 0..d {
                    oi[e] += coef * vj[e];
                }
            }
        }
        // State update.
        let glast = gcum[c - 1];
        let decay = glast.exp();
        for x in s.iter_mut() {
            *x *= decay;
        }
        for i in 0..c {
            let f = (glast - gcum[i]).exp();
            let ki = &kc[i * d..(i + 1) * d];
            let vi = &vnew[i * d..(i + 1) * d];
            for a in 0..d {
                let ka = ki[a] * f;
                let row = &mut s[a * d..(a + 1) * d];
                for e in 0..d {
                    row[e] += ka * vi[e];
                }
            }
        }
        start += c;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    #[test]
    fn chunked_equals_recurrent_across_chunk_boundaries() {
        let (n, d) = (150, 8);
        let mut seed = 7;
        let mut mk = |len: usize| (0..len).map(|_| lcg(&mut seed)).collect::<Vec<f32>>();
        let mut q = mk(n * d);
        let mut k = mk(n * d);
        for h in q.chunks_exact_mut(d).chain(k.chunks_exact_mut(d)) {
            l2_norm(h, 1e-6);
        }
        let v = mk(n * d);
        let beta: Vec<f32> = mk(n).iter().map(|x| sigmoid(*x * 3.0)).collect();
        let g: Vec<f32> = mk(n).iter().map(|x| -softplus(*x * 2.0) * 0.5).collect();
        let s0 = mk(d * d);
        let (mut s1, mut s2) = (s0.clone(), s0.clone());
        let o1 = recurrent_rule(&mut s1, &q, &k, &v, &beta, &g, d);
        let o2 = chunked_rule(&mut s2, &q, &k, &v, &beta, &g, d);
        let max = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(max(&o1, &o2) < 1e-4, "outputs differ by {}", max(&o1, &o2));
        assert!(max(&s1, &s2) < 1e-4, "states differ by {}", max(&s1, &s2));
    }
}
