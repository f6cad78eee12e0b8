//! `Qwen4ExpVisionRotaryEmbedding`: axial 2-D RoPE over the whole head. With head width `hd`, `hd / 4`
//! frequencies `1 / 10000^(2i / (hd / 2))`; slot `i < hd / 4` turns with the patch's row, slot `hd / 4 + i` with
//! its column, and the `hd / 2` angles rotate the pairs `(j, j + hd / 2)` (`rotate_half`).

/// The rotary tables of the tower.
#[derive(Debug, Clone)]
pub struct VisionRotary {
    inv_freq: Vec<f32>,
}

impl VisionRotary {
    /// Tables for head width `head_dim` (a multiple of 4) and base 10000 (the reference's default, which
    /// llama.cpp's graph fixes).
    pub fn new(head_dim: usize) -> Self {
        let spatial = head_dim / 2;
        // As the reference: 1 / base^(arange(0, spatial, 2) / spatial) in f32.
        let inv_freq = (0..spatial / 2).map(|i| 1.0 / 10000f32.powf((2 * i) as f32 / spatial as f32)).collect();
        Self { inv_freq }
    }

    /// The `hd / 4` frequencies (what the GPU tower uploads).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// `(cos, sin)` of the `hd / 2` angles of a patch at (`row`, `col`).
    pub fn angles(&self, row: usize, col: usize) -> (Vec<f32>, Vec<f32>) {
        let a: Vec<f32> =
            self.inv_freq.iter().map(|f| row as f32 * f).chain(self.inv_freq.iter().map(|f| col as f32 * f)).collect();
        (a.iter().map(|&x| (x as f64).cos() as f32).collect(), a.iter().map(|&x| (x as f64).sin() as f32).collect())
    }

    /// Rotates one head `x` (`hd` values) by `(cos, sin)`.
    #[inline]
    pub fn apply(x: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = cos.len();
        for i in 0..half {
            let (x1, x2) = (x[i], x[i + half]);
            x[i] = x1 * cos[i] - x2 * sin[i];
            x[i + half] = x2 * cos[i] + x1 * sin[i];
        }
    }
}
