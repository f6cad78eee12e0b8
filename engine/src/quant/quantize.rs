//! Quantizers for the converter: `f32` rows to GGUF block formats.
//!
//! Bit-exact with the PyPI `gguf` package (`gguf.quants.quantize`): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 and
//! BF16. The k-quants (Q4_K, Q5_K, Q6_K) and the non-linear 4-bit types (IQ4_NL, IQ4_XS) follow the reference
//! algorithms of ggml's `ggml-quants.c` (written here from their description, not copied): a weighted
//! least-squares search for each block's scale (and min), with an optional importance matrix.

pub use super::mxfp4::quantize_row_mxfp4;
pub use super::q4_0::quantize_row_q4_0;
pub use super::q4_1::quantize_row_q4_1;
pub use super::q5_0::quantize_row_q5_0;
pub use super::q5_1::quantize_row_q5_1;
pub use super::q8_0::quantize_row_q8_0;

/// The value of largest magnitude (the first one among equals), as numpy's `argmax(abs(x))` picks it.
pub(crate) fn signed_absmax(x: &[f32]) -> f32 {
    let mut best = 0f32;
    let mut amax = -1f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            best = v;
        }
    }
    best
}

/// `(min, max)` of a block.
pub(crate) fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

use rayon::prelude::*;

use super::grids::KVALUES_IQ4NL;
use super::q4_k::scale_min;
use super::{QK_K, QuantError, f32_to_bf16_bits, row_bytes};
use crate::gguf::GgmlType;

/// Sub-block magnitudes below this count as all-zero (ggml `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// Round half to even, as ggml's `nearest_int` (exact for |x| < 2^22).
#[inline(always)]
fn nearest_int(x: f32) -> i32 {
    x.round_ties_even() as i32
}

/// Every type [`quantize_tensor`] can write.
pub const QUANTIZABLE: [GgmlType; 14] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::MXFP4,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
];

/// Quantizes `values` (whole rows of `cols` values, row-major) to `ty`, rows in parallel.
///
/// `imatrix`, when given, holds one importance weight per column (llama.cpp's `--imatrix` values: the mean of
/// the squared activations each column saw); the types of [`uses_importance`] weight their fits with it (as ggml
/// does), the others ignore it. Errors: a type it cannot write, a row length that is not whole blocks, an
/// importance matrix of the wrong length.
pub fn quantize_tensor(
    ty: GgmlType,
    values: &[f32],
    cols: usize,
    imatrix: Option<&[f32]>,
) -> Result<Vec<u8>, QuantError> {
    if !QUANTIZABLE.contains(&ty) {
        return Err(QuantError::Unsupported(ty.name()));
    }
    let rb = row_bytes(ty, cols)?;
    if cols == 0 || !values.len().is_multiple_of(cols) {
        return Err(QuantError::WrongSize { what: "values".into(), expected: cols, found: values.len() });
    }
    if let Some(w) = imatrix
        && w.len() != cols
    {
        return Err(QuantError::WrongSize { what: "importance matrix".into(), expected: cols, found: w.len() });
    }
    let rows = values.len() / cols;
    let mut out = vec![0u8; rows * rb];
    out.par_chunks_mut(rb).zip(values.par_chunks(cols)).for_each(|(dst, src)| {
        let mut v = Vec::with_capacity(rb);
        quantize_row(ty, src, imatrix, &mut v);
        dst.copy_from_slice(&v);
    });
    Ok(out)
}

/// Whether [`quantize_row`] weights its fit for `ty` with an importance matrix: the k-quants, IQ4_NL/IQ4_XS and
/// Q4_0/Q4_1/Q5_0/Q5_1 (Q8_0 and MXFP4 round the same with or without one, as in ggml).
pub fn uses_importance(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::IQ4_NL
            | GgmlType::IQ4_XS
    )
}

/// Quantizes one row (`src.len()` whole blocks of `ty`), appending to `dst`. Panics on a type outside
/// [`QUANTIZABLE`].
pub fn quantize_row(ty: GgmlType, src: &[f32], imatrix: Option<&[f32]>, dst: &mut Vec<u8>) {
    if let (GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1, Some(w)) = (ty, imatrix) {
        return quantize_row_32_weighted(ty, src, w, dst);
    }
    match ty {
        GgmlType::F32 => dst.extend(src.iter().flat_map(|v| v.to_le_bytes())),
        GgmlType::F16 => dst.extend(src.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes())),
        GgmlType::BF16 => dst.extend(src.iter().flat_map(|v| f32_to_bf16_bits(*v).to_le_bytes())),
        GgmlType::Q8_0 => quantize_row_q8_0(src, dst),
        GgmlType::Q4_0 => quantize_row_q4_0(src, dst),
        GgmlType::Q4_1 => quantize_row_q4_1(src, dst),
        GgmlType::Q5_0 => quantize_row_q5_0(src, dst),
        GgmlType::Q5_1 => quantize_row_q5_1(src, dst),
        GgmlType::MXFP4 => quantize_row_mxfp4(src, dst),
        GgmlType::Q4_K => quantize_row_q4_k(src, imatrix, dst),
        GgmlType::Q5_K => quantize_row_q5_k(src, imatrix, dst),
        GgmlType::Q6_K => quantize_row_q6_k(src, imatrix, dst),
        GgmlType::IQ4_NL => quantize_row_iq4_nl(src, imatrix, dst),
        GgmlType::IQ4_XS => quantize_row_iq4_xs(src, imatrix, dst),
        other => panic!("quantize_row: cannot write {}", other.name()),
    }
}

/// Q4_0, Q4_1, Q5_0 or Q5_1 with an importance matrix `imatrix` (one weight per column of the row), as ggml's
/// `quantize_row_{q4_0,q4_1,q5_0,q5_1}_impl` (ggml-quants.c): block value `j` weighs `imatrix[j] * sqrt(sigma2 +
/// x_j^2)` with `sigma2` the mean square of the whole row; Q4_0/Q5_0 fit a symmetric scale ([`fit_symmetric`],
/// levels `-8..8` / `-16..16`), Q4_1/Q5_1 a scale and a min ([`fit_scale_min`], levels `0..=15` / `0..=31`,
/// 37 grid widths from `nmax - 0.9` in steps of 0.05). Without an importance matrix these types keep the
/// reference rounding of `quantize_row_q4_0` and the others (as ggml does).
fn quantize_row_32_weighted(ty: GgmlType, src: &[f32], imatrix: &[f32], dst: &mut Vec<u8>) {
    let sum_x2 = src.iter().fold(0f32, |a, &v| a + v * v);
    let sigma2 = sum_x2 / src.len() as f32;
    let five = matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1);
    let with_min = matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
    for (xb, qw) in src.chunks_exact(32).zip(imatrix.chunks_exact(32)) {
        let mut w = [0f32; 32];
        for j in 0..32 {
            w[j] = qw[j] * (sigma2 + xb[j] * xb[j]).sqrt();
        }
        let mut l = [0u8; 32];
        if with_min {
            let (d, neg_min) = fit_scale_min(xb, &w, if five { 31 } else { 15 }, -0.9, 0.05, 36, &mut l);
            dst.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
            dst.extend_from_slice(&half::f16::from_f32(-neg_min).to_le_bytes());
        } else {
            let mut li = [0i8; 32];
            let d = fit_symmetric(xb, if five { 16 } else { 8 }, Some(&w), &mut li);
            for j in 0..32 {
                l[j] = li[j] as u8;
            }
            dst.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        }
        if five {
            let qh = l.iter().enumerate().fold(0u32, |h, (i, &u)| h | (((u >> 4) as u32 & 1) << i));
            dst.extend_from_slice(&qh.to_le_bytes());
        }
        for j in 0..16 {
            dst.push((l[j] & 15) | ((l[j + 16] & 15) << 4));
        }
    }
}

/// Weighted least-squares fit of `x ~ scale * l + min` with integer levels `l` in `0..=nmax` and `min <= 0`
/// (ggml's `make_qkx2_quants`/`make_qkx3_quants`): start from the min/max grid, then try `nstep + 1` grid
/// widths `nmax + rmin + rdelta * k`, each solved in closed form for scale and min, keeping the lowest weighted
/// squared error. Returns `(scale, -min)` and the levels in `l`.
fn fit_scale_min(x: &[f32], w: &[f32], nmax: i32, rmin: f32, rdelta: f32, nstep: i32, l: &mut [u8]) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        min = min.min(x[i]);
        max = max.max(x[i]);
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max <= min {
        l.fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best = 0f32;
    for i in 0..n {
        l[i] = nearest_int(iscale * (x[i] - min)).clamp(0, nmax) as u8;
        let diff = scale * l[i] as f32 + min - x[i];
        best += w[i] * diff * diff;
    }
    let mut aux = [0u8; 32];
    for step in 0..=nstep {
        iscale = (rmin + rdelta * step as f32 + nmax as f32) / (max - min);
        let (mut sl, mut sl2, mut sxl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = q as u8;
            let q = q as f32;
            sl += w[i] * q;
            sl2 += w[i] * q * q;
            sxl += w[i] * q * x[i];
        }
        let det = sum_w * sl2 - sl * sl;
        if det > 0.0 {
            let mut this_scale = (sum_w * sxl - sum_x * sl) / det;
            let mut this_min = (sl2 * sum_x - sl * sxl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sxl / sl2;
            }
            let mut err = 0f32;
            for i in 0..n {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                err += w[i] * diff * diff;
            }
            if err < best {
                l[..n].copy_from_slice(&aux[..n]);
                best = err;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Weighted fit of `x ~ scale * l` with signed levels `l` in `-nmax..nmax` (ggml's `make_qx_quants` with
/// `rmse_type = 1`: weights `w` or `x^2`): 19 grid widths around `nmax / max`, the closed-form scale of each,
/// keeping the one that explains most of the weighted energy. Levels go to `l` as `l + nmax`.
fn fit_symmetric(x: &[f32], nmax: i32, w: Option<&[f32]>, l: &mut [i8]) -> f32 {
    let n = x.len();
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let weight = |i: usize| w.map_or(x[i] * x[i], |w| w[i]);
    let eval = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for i in 0..n {
            let q = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1) as f32;
            sumlx += weight(i) * x[i] * q;
            suml2 += weight(i) * q * q;
        }
        (sumlx, suml2)
    };
    let set = |iscale: f32, l: &mut [i8]| {
        for i in 0..n {
            l[i] = (nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1) + nmax) as i8;
        }
    };
    let iscale = -(nmax as f32) / max;
    set(iscale, l);
    let (sumlx, suml2) = eval(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        let iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = eval(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            set(iscale, l);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Weighted fit of non-negative values `x ~ scale * l`, `l` in `0..=nmax` (ggml's `make_qp_quants`): the best
/// of 9 grid widths, then up to 5 rounds of single-level refinements that raise the explained energy.
fn fit_positive(x: &[f32], nmax: i32, w: &[f32], l: &mut [u8]) -> f32 {
    let n = x.len();
    let max = x.iter().fold(0f32, |m, &v| m.max(v));
    if max < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let mse = |iscale: f32| {
        let scale = 1.0 / iscale;
        (0..n)
            .map(|i| {
                let q = nearest_int(iscale * x[i]).min(nmax) as f32;
                let diff = x[i] - scale * q;
                w[i] * diff * diff
            })
            .sum::<f32>()
    };
    let mut iscale = nmax as f32 / max;
    let mut best = mse(iscale);
    for is in -4..=4 {
        if is == 0 {
            continue;
        }
        let cand = (0.1 * is as f32 + nmax as f32) / max;
        let m = mse(cand);
        if m < best {
            best = m;
            iscale = cand;
        }
    }
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..n {
        let q = nearest_int(iscale * x[i]).min(nmax);
        l[i] = q as u8;
        sumlx += w[i] * x[i] * q as f32;
        suml2 += w[i] * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for i in 0..n {
            let li = l[i] as f32;
            let mut slx = sumlx - w[i] * x[i] * li;
            let mut sl2 = suml2 - w[i] * li * li;
            if slx > 0.0 && sl2 > 0.0 {
                let nl = nearest_int(x[i] * sl2 / slx).min(nmax);
                if nl != l[i] as i32 {
                    slx += w[i] * x[i] * nl as f32;
                    sl2 += w[i] * nl as f32 * nl as f32;
                    if slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = nl as u8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// Packs eight 6-bit scales and mins into the 12 bytes of Q4_K/Q5_K (inverse of [`scale_min`]).
fn pack_scales_mins(ls: &[u8; 8], lm: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] = ls[j];
            s[j + 4] = lm[j];
        } else {
            s[j + 4] = (ls[j] & 15) | ((lm[j] & 15) << 4);
            s[j - 4] |= (ls[j] >> 4) << 6;
            s[j] |= (lm[j] >> 4) << 6;
        }
    }
    s
}

/// The shared Q4_K/Q5_K super-block quantizer: per run of 32, a scale/min fit with `nmax` levels, then the
/// scales and mins on a 6-bit grid under the `f16` super-scales, then the final levels against the stored
/// scales. Returns `(d, dmin, scales[12], levels[256])`.
fn quantize_kx(
    x: &[f32],
    imatrix: Option<&[f32]>,
    nmax: i32,
    ref_params: (f32, f32, i32),
) -> (u16, u16, [u8; 12], [u8; 256]) {
    let mut levels = [0u8; 256];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut wsum = [0f32; 8];
    let mut w = [0f32; 32];
    let sum_x2: f32 = x.iter().map(|v| v * v).sum();
    let sigma2 = 2.0 * sum_x2 / QK_K as f32;
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let (rmin, rdelta, nstep) = match imatrix {
            Some(qw) => {
                for l in 0..32 {
                    w[l] = qw[32 * j + l] * (sigma2 + xs[l] * xs[l]).sqrt();
                }
                (-0.9, 0.05, 36)
            }
            None => {
                let av = (xs.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
                for l in 0..32 {
                    w[l] = av + xs[l].abs();
                }
                ref_params
            }
        };
        wsum[j] = w.iter().sum();
        (scales[j], mins[j]) = fit_scale_min(xs, &w, nmax, rmin, rdelta, nstep, &mut levels[32 * j..32 * j + 32]);
    }
    let (mut ls, mut lm) = ([0u8; 8], [0u8; 8]);
    let (d, dmin) = if imatrix.is_some() {
        (fit_positive(&scales, 63, &wsum, &mut ls), fit_positive(&mins, 63, &wsum, &mut lm))
    } else {
        let max_scale = scales.iter().fold(0f32, |m, &v| m.max(v));
        let max_min = mins.iter().fold(0f32, |m, &v| m.max(v));
        let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
        let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
        for j in 0..8 {
            ls[j] = nearest_int(inv_scale * scales[j]).clamp(0, 63) as u8;
            lm[j] = nearest_int(inv_min * mins[j]).clamp(0, 63) as u8;
        }
        (max_scale / 63.0, max_min / 63.0)
    };
    let packed = pack_scales_mins(&ls, &lm);
    let (dh, mh) = (half::f16::from_f32(d), half::f16::from_f32(dmin));
    for j in 0..8 {
        let (sc, m) = scale_min(&packed, j);
        let dl = dh.to_f32() * sc as f32;
        if dl == 0.0 {
            continue;
        }
        let dm = mh.to_f32() * m as f32;
        for i in 0..32 {
            levels[32 * j + i] = nearest_int((x[32 * j + i] + dm) / dl).clamp(0, nmax) as u8;
        }
    }
    (dh.to_bits(), mh.to_bits(), packed, levels)
}

/// Q4_K (ggml `quantize_row_q4_K_ref` without an importance matrix: fits with weights `rms + |x|` and 21
/// grid widths from `15 - 1`; with one, `quantize_row_q4_K_impl`: weights `imatrix * sqrt(sigma2 + x^2)`,
/// 37 widths from `15 - 0.9`, and the scales themselves fitted by weighted least squares).
pub fn quantize_row_q4_k(src: &[f32], imatrix: Option<&[f32]>, dst: &mut Vec<u8>) {
    for (b, x) in src.chunks_exact(QK_K).enumerate() {
        let qw = imatrix.map(|w| &w[b * QK_K..(b + 1) * QK_K]);
        let (d, dmin, scales, l) = quantize_kx(x, qw, 15, (-1.0, 0.1, 20));
        dst.extend_from_slice(&d.to_le_bytes());
        dst.extend_from_slice(&dmin.to_le_bytes());
        dst.extend_from_slice(&scales);
        for c in 0..4 {
            for i in 0..32 {
                dst.push(l[64 * c + i] | (l[64 * c + 32 + i] << 4));
            }
        }
    }
}

/// Q5_K (as Q4_K with 32 levels; reference grid widths from `31 - 0.5`, 16 of them).
pub fn quantize_row_q5_k(src: &[f32], imatrix: Option<&[f32]>, dst: &mut Vec<u8>) {
    for (b, x) in src.chunks_exact(QK_K).enumerate() {
        let qw = imatrix.map(|w| &w[b * QK_K..(b + 1) * QK_K]);
        let (d, dmin, scales, l) = quantize_kx(x, qw, 31, (-0.5, 0.1, 15));
        dst.extend_from_slice(&d.to_le_bytes());
        dst.extend_from_slice(&dmin.to_le_bytes());
        dst.extend_from_slice(&scales);
        let mut qh = [0u8; 32];
        let mut ql = [0u8; 128];
        for c in 0..4 {
            for i in 0..32 {
                let (a, b2) = (l[64 * c + i], l[64 * c + 32 + i]);
                qh[i] |= ((a >> 4) << (2 * c)) | ((b2 >> 4) << (2 * c + 1));
                ql[32 * c + i] = (a & 15) | ((b2 & 15) << 4);
            }
        }
        dst.extend_from_slice(&qh);
        dst.extend_from_slice(&ql);
    }
}

/// Q6_K (ggml `quantize_row_q6_K_ref`/`_impl`): a signed fit per run of 16 (weights `x^2`, or the importance
/// matrix), the 16 run scales on a signed 8-bit grid under one `f16` scale, final levels against the stored
/// scales.
pub fn quantize_row_q6_k(src: &[f32], imatrix: Option<&[f32]>, dst: &mut Vec<u8>) {
    for (b, x) in src.chunks_exact(QK_K).enumerate() {
        let mut l = [0i8; 256];
        let mut scales = [0f32; 16];
        let (mut max_scale, mut max_abs) = (0f32, 0f32);
        for ib in 0..16 {
            let qw = imatrix.map(|w| &w[b * QK_K + 16 * ib..b * QK_K + 16 * ib + 16]);
            scales[ib] = fit_symmetric(&x[16 * ib..16 * ib + 16], 32, qw, &mut l[16 * ib..16 * ib + 16]);
            if scales[ib].abs() > max_abs {
                max_abs = scales[ib].abs();
                max_scale = scales[ib];
            }
        }
        let mut block = [0u8; 210];
        if max_abs >= GROUP_MAX_EPS {
            let iscale = -128.0 / max_scale;
            let d = half::f16::from_f32(1.0 / iscale);
            block[208..210].copy_from_slice(&d.to_bits().to_le_bytes());
            for ib in 0..16 {
                let s = nearest_int(iscale * scales[ib]).min(127) as i8;
                block[192 + ib] = s as u8;
                let dl = d.to_f32() * s as f32;
                if dl == 0.0 {
                    continue;
                }
                for i in 0..16 {
                    l[16 * ib + i] = (nearest_int(x[16 * ib + i] / dl).clamp(-32, 31) + 32) as i8;
                }
            }
            for h in 0..2 {
                for i in 0..32 {
                    let q = |k: usize| l[128 * h + 32 * k + i] as u8;
                    block[64 * h + i] = (q(0) & 15) | ((q(2) & 15) << 4);
                    block[64 * h + 32 + i] = (q(1) & 15) | ((q(3) & 15) << 4);
                    block[128 + 32 * h + i] =
                        (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
                }
            }
        }
        dst.extend_from_slice(&block);
    }
}

/// Index of the level nearest `x` in the sorted `values` (ties to the upper one, as ggml's `best_index_int8`).
#[inline(always)]
fn best_index(values: &[i8; 16], x: f32) -> u8 {
    if x <= values[0] as f32 {
        return 0;
    }
    if x >= values[15] as f32 {
        return 15;
    }
    let (mut lo, mut hi) = (0usize, 15usize);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if x < values[mid] as f32 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if x - (values[hi - 1] as f32) < values[hi] as f32 - x { (hi - 1) as u8 } else { hi as u8 }
}

/// The IQ4 scale search for one run of 32 (ggml `quantize_row_iq4_nl_impl` with `ntry = 7`): the scale that
/// maps the largest value to the lowest level, refined by weighted least squares over 15 grid widths.
fn iq4_run_scale(x: &[f32], w: &[f32]) -> f32 {
    let values = &KVALUES_IQ4NL;
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        return 0.0;
    }
    let sums = |id: f32| {
        let (mut sqx, mut sq2) = (0f32, 0f32);
        for (&v, &wi) in x.iter().zip(w) {
            let q = values[best_index(values, id * v) as usize] as f32;
            sqx += wi * q * v;
            sq2 += wi * q * q;
        }
        (sqx, sq2)
    };
    let d0 = -max / values[0] as f32;
    let (sqx, sq2) = sums(1.0 / d0);
    let mut d = if sq2 > 0.0 { sqx / sq2 } else { 0.0 };
    let mut best = d * sqx;
    for itry in -7..=7 {
        let (sqx, sq2) = sums((itry as f32 + values[0] as f32) / max);
        if sq2 > 0.0 && sqx * sqx > best * sq2 {
            d = sqx / sq2;
            best = d * sqx;
        }
    }
    d
}

/// IQ4 weights of one super-block (`x^2`, or `imatrix * sqrt(sigma2 + x^2)` with `sigma2 = 2 * mean(x^2)`).
fn iq4_weights(x: &[f32], imatrix: Option<&[f32]>) -> Vec<f32> {
    match imatrix {
        None => x.iter().map(|v| v * v).collect(),
        Some(qw) => {
            let sigma2 = 2.0 * x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
            x.iter().zip(qw).map(|(v, q)| q * (sigma2 + v * v).sqrt()).collect()
        }
    }
}

fn pack_nibbles32(l: &[u8], dst: &mut Vec<u8>) {
    for i in 0..16 {
        dst.push(l[i] | (l[16 + i] << 4));
    }
}

/// IQ4_NL (ggml `quantize_iq4_nl`): per block of 32 the IQ4 scale search, stored as `f16`, then each value to
/// its nearest level under that scale.
pub fn quantize_row_iq4_nl(src: &[f32], imatrix: Option<&[f32]>, dst: &mut Vec<u8>) {
    for (b, x) in src.chunks_exact(32).enumerate() {
        let w = iq4_weights(x, imatrix.map(|w| &w[32 * b..32 * b + 32]));
        let d = iq4_run_scale(x, &w);
        dst.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let l: Vec<u8> = x.iter().map(|&v| best_index(&KVALUES_IQ4NL, id * v)).collect();
        pack_nibbles32(&l, dst);
    }
}

/// IQ4_XS (ggml `quantize_iq4_xs`): the IQ4 scale search per run of 32, the run scales on a signed 6-bit grid
/// under one `f16` scale, each value to its nearest level under its stored run scale.
pub fn quantize_row_iq4_xs(src: &[f32], imatrix: Option<&[f32]>, dst: &mut Vec<u8>) {
    for (b, x) in src.chunks_exact(QK_K).enumerate() {
        let w = iq4_weights(x, imatrix.map(|w| &w[QK_K * b..QK_K * (b + 1)]));
        let mut scales = [0f32; 8];
        let (mut max_scale, mut amax) = (0f32, 0f32);
        for ib in 0..8 {
            scales[ib] = iq4_run_scale(&x[32 * ib..32 * ib + 32], &w[32 * ib..32 * ib + 32]);
            if scales[ib].abs() > amax {
                amax = scales[ib].abs();
                max_scale = scales[ib];
            }
        }
        let d = -max_scale / 32.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let (mut sh, mut sl) = (0u16, [0u8; 4]);
        let mut l = [0u8; 256];
        for ib in 0..8 {
            let ls = nearest_int(id * scales[ib]).clamp(-32, 31);
            let dl = d * ls as f32;
            let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
            for i in 0..32 {
                l[32 * ib + i] = best_index(&KVALUES_IQ4NL, idl * x[32 * ib + i]);
            }
            let u = (ls + 32) as u8;
            sl[ib / 2] |= (u & 15) << (4 * (ib % 2));
            sh |= ((u >> 4) as u16) << (2 * ib);
        }
        dst.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        dst.extend_from_slice(&sh.to_le_bytes());
        dst.extend_from_slice(&sl);
        for ib in 0..8 {
            pack_nibbles32(&l[32 * ib..32 * ib + 32], dst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_row;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 11) as f64 / (1u64 << 53) as f64;
                // heavy-ish tails: a cubed uniform
                ((2.0 * u - 1.0).powi(3) * 0.05) as f32
            })
            .collect()
    }

    fn rmse(ty: GgmlType, x: &[f32], imatrix: Option<&[f32]>) -> f64 {
        let q = quantize_tensor(ty, x, x.len(), imatrix).unwrap();
        let mut y = vec![0f32; x.len()];
        dequantize_row(ty, &q, &mut y).unwrap();
        (x.iter().zip(&y).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt()
    }

    /// More bits, less error; every quantizer beats the plain round-to-grid of its bit width.
    #[test]
    fn quantizers_rank_by_bits_and_beat_the_simple_grids() {
        let x = data(4096, 11);
        let r = |t| rmse(t, &x, None);
        let (q4k, q5k, q6k, q4_0, q5_0, q8_0) = (
            r(GgmlType::Q4_K),
            r(GgmlType::Q5_K),
            r(GgmlType::Q6_K),
            r(GgmlType::Q4_0),
            r(GgmlType::Q5_0),
            r(GgmlType::Q8_0),
        );
        let (nl, xs) = (r(GgmlType::IQ4_NL), r(GgmlType::IQ4_XS));
        eprintln!(
            "rmse q4_0 {q4_0:e} q4_k {q4k:e} iq4_nl {nl:e} iq4_xs {xs:e} q5_0 {q5_0:e} q5_k {q5k:e} q6_k {q6k:e} q8_0 {q8_0:e}"
        );
        assert!(q4k < q4_0 && nl < q4_0 && xs < q4_0, "4-bit fits beat Q4_0");
        assert!(q5k < q5_0 && q5k < q4k, "Q5_K beats Q5_0 and Q4_K");
        assert!(q6k < q5k && q8_0 < q6k, "bits order the errors");
    }

    #[test]
    fn an_importance_matrix_lowers_the_weighted_error() {
        let x = data(2048, 5);
        // Columns 0..64 of each 256 matter a lot.
        let imp: Vec<f32> = (0..2048).map(|i| if i % 256 < 64 { 100.0 } else { 0.01 }).collect();
        for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::IQ4_XS, GgmlType::IQ4_NL] {
            let werr = |w: Option<&[f32]>| {
                let q = quantize_tensor(ty, &x, x.len(), w).unwrap();
                let mut y = vec![0f32; x.len()];
                dequantize_row(ty, &q, &mut y).unwrap();
                x.iter().zip(&y).zip(&imp).map(|((a, b), w)| (*w as f64) * ((a - b) as f64).powi(2)).sum::<f64>()
            };
            let (plain, weighted) = (werr(None), werr(Some(&imp)));
            eprintln!("{}: weighted error {plain:e} -> {weighted:e}", ty.name());
            assert!(weighted < plain, "{}: the importance matrix did not help ({plain:e} -> {weighted:e})", ty.name());
        }
    }

    #[test]
    fn zero_rows_quantize_to_zero() {
        for &ty in &QUANTIZABLE {
            let x = vec![0f32; 512];
            let q = quantize_tensor(ty, &x, 512, None).unwrap();
            let mut y = vec![1f32; 512];
            dequantize_row(ty, &q, &mut y).unwrap();
            assert!(y.iter().all(|&v| v == 0.0), "{}", ty.name());
        }
    }
}
