//! Partial, interleaved multi-axis rotary position embedding (M-RoPE) as `Qwen4ExpTextRotaryEmbedding` and
//! `apply_rotary_pos_emb` compute it (transformers' `modeling_qwen4_exp.py`).
//!
//! Only the first `rope_dim` dims of a head rotate, in `rotate_half` pairs `(i, i + rope_dim/2)`. Frequency slot
//! `i` takes the height position when `i % 3 == 1 && i < 3 * sections[1]`, the width position when
//! `i % 3 == 2 && i < 3 * sections[2]`, and the time position otherwise; for text all three are the token's
//! position, so text positions reduce to plain partial RoPE.

/// The rotary tables of one model.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    sections: [usize; 4],
}

/// `cos` and `sin` for the `rope_dim / 2` frequency slots of one position.
#[derive(Debug, Clone)]
pub struct RopeAngles {
    /// Cosines, one per slot.
    pub cos: Vec<f32>,
    /// Sines, one per slot.
    pub sin: Vec<f32>,
}

impl Rope {
    /// Tables for `rope_dim` rotated dims, base `theta` and M-RoPE `sections` (in slots).
    pub fn new(rope_dim: usize, theta: f32, sections: [usize; 4]) -> Self {
        // As the reference: inv_freq = 1 / theta^(2i / dim), computed in f32.
        let inv_freq = (0..rope_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / rope_dim as f32)).collect();
        Self { inv_freq, sections }
    }

    /// Rotated dims.
    pub fn dim(&self) -> usize {
        self.inv_freq.len() * 2
    }

    /// Angles for a text token at `pos` (time = height = width = `pos`).
    pub fn angles(&self, pos: usize) -> RopeAngles {
        self.angles_thw([pos, pos, pos])
    }

    /// Angles for a token with separate time/height/width positions.
    pub fn angles_thw(&self, thw: [usize; 3]) -> RopeAngles {
        let n = self.inv_freq.len();
        let mut cos = Vec::with_capacity(n);
        let mut sin = Vec::with_capacity(n);
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let axis = if i % 3 == 1 && i < 3 * self.sections[1] {
                1
            } else if i % 3 == 2 && i < 3 * self.sections[2] {
                2
            } else {
                0
            };
            let a = thw[axis] as f32 * f;
            cos.push((a as f64).cos() as f32);
            sin.push((a as f64).sin() as f32);
        }
        RopeAngles { cos, sin }
    }

    /// Rotates the first `dim()` values of one head `x` in place.
    #[inline]
    pub fn apply(&self, x: &mut [f32], a: &RopeAngles) {
        let half = self.inv_freq.len();
        for i in 0..half {
            let (x1, x2) = (x[i], x[i + half]);
            x[i] = x1 * a.cos[i] - x2 * a.sin[i];
            x[i + half] = x2 * a.cos[i] + x1 * a.sin[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_preserves_norm_and_position_zero_is_identity() {
        let rope = Rope::new(8, 1e7, [2, 1, 1, 0]);
        let x: Vec<f32> = (0..16).map(|i| i as f32 * 0.3 - 2.0).collect();
        let mut y = x.clone();
        rope.apply(&mut y, &rope.angles(0));
        assert_eq!(x, y);
        rope.apply(&mut y, &rope.angles(1234));
        let n = |v: &[f32]| v[..8].iter().map(|a| a * a).sum::<f32>();
        assert!((n(&x) - n(&y)).abs() < 1e-4);
        assert_eq!(&x[8..], &y[8..], "dims past rope_dim never rotate");
    }

    #[test]
    fn relative_position_property() {
        // <R(p) q, R(s) k> depends only on p - s for equal axes.
        let rope = Rope::new(8, 1e4, [2, 1, 1, 0]);
        let q: Vec<f32> = (0..8).map(|i| (i as f32).sin()).collect();
        let k: Vec<f32> = (0..8).map(|i| (i as f32 * 0.7).cos()).collect();
        let dot = |p: usize, s: usize| {
            let (mut a, mut b) = (q.clone(), k.clone());
            rope.apply(&mut a, &rope.angles(p));
            rope.apply(&mut b, &rope.angles(s));
            a.iter().zip(&b).map(|(x, y)| x * y).sum::<f32>()
        };
        assert!((dot(10, 3) - dot(17, 10)).abs() < 1e-4);
    }
}
