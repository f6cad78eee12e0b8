//! RMS norms and activations shared by the blocks (`modeling_qwen4_exp.py` `Qwen4ExpTextRMSNorm`,
//! `Qwen4ExpTextRMSNormGated`, `l2norm`).

/// `1 / sqrt(mean(x^2) + eps)`, the mean accumulated in `f64`.
#[inline]
pub fn rms_inv(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    (1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt()) as f32
}

/// `out = x / rms(x) * w` (w as stored in GGUF: llama.cpp's converter already added the reference's `+1`).
#[inline]
pub fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let s = rms_inv(x, eps);
    for ((o, &v), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = v * s * wi;
    }
}

/// In-place [`rms_norm_into`].
#[inline]
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let s = rms_inv(x, eps);
    for (v, &wi) in x.iter_mut().zip(w) {
        *v = *v * s * wi;
    }
}

/// Grouped RMS norm over a hyper-connection bundle: one RMS per `group`-wide stream, then `* w` over the whole
/// bundle (`Qwen4ExpTextRMSNorm(group_size=hidden)` in transformers).
pub fn grouped_rms_norm_into(x: &[f32], w: &[f32], group: usize, eps: f32, out: &mut [f32]) {
    for ((xs, ws), os) in x.chunks_exact(group).zip(w.chunks_exact(group)).zip(out.chunks_exact_mut(group)) {
        rms_norm_into(xs, ws, eps, os);
    }
}

/// L2 normalisation `x * rsqrt(sum(x^2) + eps)` in place (the reference's `l2norm`, eps 1e-6).
#[inline]
pub fn l2_norm(x: &mut [f32], eps: f32) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let s = 1.0 / (ss as f32 + eps).sqrt();
    for v in x {
        *v *= s;
    }
}

/// Logistic sigmoid.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SiLU, `x * sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Softplus as PyTorch computes it (`beta = 1`, `threshold = 20`: linear above 20).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// Numerically stable softmax in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}
