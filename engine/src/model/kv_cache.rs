//! How the attention caches store their rows: the KV cache type (`kv_cache_type`) and the row store
//! [`KvRows`] that the CPU model keeps per cache and the CUDA backend mirrors byte for byte.
//!
//! Four types, as llama.cpp's `--cache-type-k/--cache-type-v` name them:
//!
//! | type | a row of `w` values | bytes per value | error of a value |
//! |---|---|---|---|
//! | `f32` | `w` little-endian `f32` (the default: today's exact path, bit for bit) | 4 | none |
//! | `f16` | `w` IEEE half floats (round to nearest even) | 2 | 2^-11 relative |
//! | `q8_0` | `w / 32` ggml `block_q8_0`: an `f16` scale `d = max|x| / 127`, 32 signed bytes `round(x / d)` | 1.0625 | `d / 2` |
//! | `q4_0` | `w / 32` ggml `block_q4_0`: an `f16` scale `d = max / -8` (`max` the value of largest magnitude), 16 bytes of nibbles `min(15, trunc(x / d + 8.5))` (value `i` low nibble of byte `i`, value `i + 16` its high nibble) | 0.5625 | `d / 2` |
//!
//! The blocks are ggml's own (`ggml-common.h`; quantizers bit-exact with `gguf.quants`, [`crate::quant`]), laid
//! out along each token's row as llama.cpp lays out its K and V caches: a key row is `[n_head_kv, head_dim]`, so
//! with `head_dim % 32 == 0` every block holds 32 consecutive values of one head (a block never straddles two
//! heads), and a head's slice of a row is whole blocks. A cache of `q8_0` therefore holds exactly the numbers
//! llama.cpp's `q8_0` cache holds for the same keys and values.
//!
//! The QSA indexer's keys (its raw per-token keys and the pooled, normed and rotated block keys that every
//! query scores) are sized with the cache: [`KvCacheType::index_key_type`] stores them as `f32` with an `f32`
//! cache, `f16` with `f16`, and `q8_0` with either quantized cache when their width is a multiple of 32 (`f16`
//! otherwise). They stay at 8 bits under a 4-bit cache because they decide which blocks every query attends to:
//! a selection that changes is a different set of keys, not a rounded one. At 128K tokens the pooled keys are
//! what a decode step reads most of (every block, every step), so their width matters as much as K's.

use crate::quant::quantize::{quantize_row_q4_0, quantize_row_q8_0};
use crate::quant::{BlockFormat, Q4_0, Q8_0};

use super::error::ModelError;

/// The element type of the attention caches (see the module docs for the layouts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub enum KvCacheType {
    /// 32-bit floats: the exact path.
    #[default]
    #[serde(rename = "f32")]
    F32,
    /// IEEE half floats.
    #[serde(rename = "f16")]
    F16,
    /// ggml `Q8_0` blocks of 32 values.
    #[serde(rename = "q8_0")]
    Q8_0,
    /// ggml `Q4_0` blocks of 32 values.
    #[serde(rename = "q4_0")]
    Q4_0,
}

impl KvCacheType {
    /// Every type, in the order of the docs.
    pub const ALL: [KvCacheType; 4] = [Self::F32, Self::F16, Self::Q8_0, Self::Q4_0];

    /// The name configs and flags use (`f32`, `f16`, `q8_0`, `q4_0`).
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Q8_0 => "q8_0",
            Self::Q4_0 => "q4_0",
        }
    }

    /// A small number for the type, stable across versions (the on-disk prefix cache and the GPU kernels'
    /// type argument): 0 `f32`, 1 `f16`, 8 `q8_0`, 2 `q4_0` (ggml's type ids).
    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q8_0 => 8,
        }
    }

    /// The type of [`Self::id`].
    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.id() == id)
    }

    /// Values per block: 1 for the float types, 32 for the quantized ones.
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 => 1,
            Self::Q8_0 | Self::Q4_0 => 32,
        }
    }

    /// Bytes of one row of `width` values (`width` a multiple of [`Self::block_elems`]).
    pub fn row_bytes(self, width: usize) -> usize {
        match self {
            Self::F32 => 4 * width,
            Self::F16 => 2 * width,
            Self::Q8_0 => width / 32 * Q8_0::BLOCK_BYTES,
            Self::Q4_0 => width / 32 * Q4_0::BLOCK_BYTES,
        }
    }

    /// Whether rows (and heads) of `width` values can be stored as this type: a whole number of blocks.
    pub fn fits(self, width: usize) -> bool {
        width % self.block_elems() == 0
    }

    /// The type of the QSA indexer's raw and pooled keys of `width` values under a cache of this type (see the
    /// module docs): `f32`, `f16`, or `q8_0` for both quantized caches (`f16` when `width` is not a multiple of
    /// 32).
    pub fn index_key_type(self, width: usize) -> Self {
        match self {
            Self::F32 => Self::F32,
            Self::F16 => Self::F16,
            Self::Q8_0 | Self::Q4_0 if Self::Q8_0.fits(width) => Self::Q8_0,
            Self::Q8_0 | Self::Q4_0 => Self::F16,
        }
    }

    /// Checks that attention heads of `head_dim` values can be cached as this type.
    ///
    /// Errors: [`ModelError::KvCacheType`] naming the type and the width.
    pub fn check_head_dim(self, head_dim: usize) -> Result<(), ModelError> {
        if self.fits(head_dim) {
            Ok(())
        } else {
            Err(ModelError::KvCacheType {
                ty: self.name().into(),
                problem: format!(
                    "attention heads of {head_dim} values are not a whole number of {}-value blocks",
                    self.block_elems()
                ),
            })
        }
    }

    /// Appends `src` (rows of `width` values, `src.len()` a multiple of `width`) to `dst` in this type's bytes.
    /// For [`KvCacheType::F32`] the bytes are the values' little-endian encoding.
    pub fn encode(self, src: &[f32], dst: &mut Vec<u8>) {
        match self {
            Self::F32 => dst.extend(src.iter().flat_map(|v| v.to_le_bytes())),
            Self::F16 => dst.extend(src.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes())),
            Self::Q8_0 => quantize_row_q8_0(src, dst),
            Self::Q4_0 => quantize_row_q4_0(src, dst),
        }
    }

    /// Decodes `out.len()` values (a whole number of blocks) from `bytes`, which start at a block boundary.
    pub fn decode(self, bytes: &[u8], out: &mut [f32]) {
        match self {
            Self::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Self::F16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            Self::Q8_0 => {
                for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(Q8_0::BLOCK_BYTES)) {
                    Q8_0::dequantize_block(b, o);
                }
            }
            Self::Q4_0 => {
                for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(Q4_0::BLOCK_BYTES)) {
                    Q4_0::dequantize_block(b, o);
                }
            }
        }
    }
}

impl std::fmt::Display for KvCacheType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvCacheType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| format!("unknown KV cache type '{s}' (f32, f16, q8_0, q4_0)"))
    }
}

/// The rows of one cache (K, V, the indexer's raw keys or its pooled block keys) in a [`KvCacheType`]: `f32`
/// rows as values (read in place by the exact path), the other types as their bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct KvRows {
    ty: KvCacheType,
    width: usize,
    data: KvData,
}

#[derive(Debug, Clone, PartialEq)]
enum KvData {
    F32(Vec<f32>),
    Bytes(Vec<u8>),
}

impl KvRows {
    /// No rows of `width` values of type `ty` (`width` a whole number of `ty`'s blocks; 0 for an unused cache).
    pub fn new(ty: KvCacheType, width: usize) -> Self {
        debug_assert!(ty.fits(width), "{width} values are not whole {ty} blocks");
        let data = match ty {
            KvCacheType::F32 => KvData::F32(Vec::new()),
            _ => KvData::Bytes(Vec::new()),
        };
        Self { ty, width, data }
    }

    /// Rows of `width` values of type `ty` from their bytes as [`Self::bytes`] gives them (a host image of a
    /// device cache, a disk-cache entry).
    ///
    /// Errors: a byte count that is not a whole number of rows (the message gives both).
    pub fn from_bytes(ty: KvCacheType, width: usize, bytes: Vec<u8>) -> Result<Self, String> {
        let rb = ty.row_bytes(width);
        if !ty.fits(width) || (rb == 0 && !bytes.is_empty()) || (rb > 0 && bytes.len() % rb != 0) {
            return Err(format!("{} bytes are not whole {ty} rows of {width} values", bytes.len()));
        }
        let data = match ty {
            KvCacheType::F32 => {
                KvData::F32(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
            }
            _ => KvData::Bytes(bytes),
        };
        Ok(Self { ty, width, data })
    }

    /// `f32` rows of `width` values (`values.len()` a multiple of `width`).
    pub fn from_f32(width: usize, values: Vec<f32>) -> Self {
        Self { ty: KvCacheType::F32, width, data: KvData::F32(values) }
    }

    /// The element type.
    pub fn ty(&self) -> KvCacheType {
        self.ty
    }

    /// Values per row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        match &self.data {
            KvData::F32(v) => v.len().checked_div(self.width).unwrap_or(0),
            KvData::Bytes(b) => b.len().checked_div(self.ty.row_bytes(self.width)).unwrap_or(0),
        }
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn held_bytes(&self) -> usize {
        match &self.data {
            KvData::F32(v) => 4 * v.len(),
            KvData::Bytes(b) => b.len(),
        }
    }

    /// Appends `rows` (`[n, width]` values), rounding them to the type.
    pub fn push(&mut self, rows: &[f32]) {
        match &mut self.data {
            KvData::F32(v) => v.extend_from_slice(rows),
            KvData::Bytes(b) => self.ty.encode(rows, b),
        }
    }

    /// Drops every row from `rows` on.
    pub fn truncate(&mut self, rows: usize) {
        match &mut self.data {
            KvData::F32(v) => v.truncate(rows * self.width),
            KvData::Bytes(b) => b.truncate(rows * self.ty.row_bytes(self.width)),
        }
    }

    /// A copy of the first `rows` rows (`None` when fewer are held).
    pub fn prefix(&self, rows: usize) -> Option<Self> {
        let data = match &self.data {
            KvData::F32(v) => KvData::F32(v.get(..rows * self.width)?.to_vec()),
            KvData::Bytes(b) => KvData::Bytes(b.get(..rows * self.ty.row_bytes(self.width))?.to_vec()),
        };
        Some(Self { ty: self.ty, width: self.width, data })
    }

    /// The `f32` values of every row when the type is `f32` (read in place by the exact path).
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            KvData::F32(v) => Some(v),
            KvData::Bytes(_) => None,
        }
    }

    /// The stored bytes of the first `rows` rows (for `f32`, the values' little-endian encoding): the layout of
    /// the module docs, which the CUDA backend's caches hold too.
    pub fn bytes(&self, rows: usize) -> std::borrow::Cow<'_, [u8]> {
        match &self.data {
            KvData::F32(v) => {
                std::borrow::Cow::Owned(v[..rows * self.width].iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            KvData::Bytes(b) => std::borrow::Cow::Borrowed(&b[..rows * self.ty.row_bytes(self.width)]),
        }
    }

    /// Decodes values `[col, col + out.len())` of row `row` into `out` (`col` and `out.len()` whole blocks:
    /// one head of a K or V row, or a whole row).
    pub fn read(&self, row: usize, col: usize, out: &mut [f32]) {
        match &self.data {
            KvData::F32(v) => {
                let at = row * self.width + col;
                out.copy_from_slice(&v[at..at + out.len()]);
            }
            KvData::Bytes(b) => {
                let be = self.ty.block_elems();
                let bb = self.ty.row_bytes(be);
                let at = row * self.ty.row_bytes(self.width) + col / be * bb;
                self.ty.decode(&b[at..at + out.len() / be * bb], out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, w: usize) -> Vec<f32> {
        (0..n * w).map(|i| ((i * 7919 % 211) as f32 - 105.0) * 0.037).collect()
    }

    #[test]
    fn names_parse_back_and_ids_are_ggml_type_ids() {
        for t in KvCacheType::ALL {
            assert_eq!(t.name().parse::<KvCacheType>().unwrap(), t);
            assert_eq!(KvCacheType::from_id(t.id()), Some(t));
        }
        assert_eq!(
            [KvCacheType::F32, KvCacheType::F16, KvCacheType::Q4_0, KvCacheType::Q8_0].map(KvCacheType::id),
            [0, 1, 2, 8]
        );
        let e = "q5_1".parse::<KvCacheType>().unwrap_err();
        assert!(e.contains("q5_1") && e.contains("q8_0"), "{e}");
        assert!(KvCacheType::Q8_0.check_head_dim(48).is_err());
        assert!(KvCacheType::F16.check_head_dim(48).is_ok());
    }

    #[test]
    fn row_sizes_are_ggml_block_sizes() {
        // A real model's key row: 2 heads of 256.
        assert_eq!(KvCacheType::F32.row_bytes(512), 2048);
        assert_eq!(KvCacheType::F16.row_bytes(512), 1024);
        assert_eq!(KvCacheType::Q8_0.row_bytes(512), 16 * 34);
        assert_eq!(KvCacheType::Q4_0.row_bytes(512), 16 * 18);
        assert_eq!(KvCacheType::Q4_0.index_key_type(128), KvCacheType::Q8_0);
        assert_eq!(KvCacheType::Q8_0.index_key_type(16), KvCacheType::F16);
        assert_eq!(KvCacheType::F32.index_key_type(16), KvCacheType::F32);
    }

    #[test]
    fn rows_round_trip_within_the_type_error_and_cut_by_rows() {
        let (n, w) = (5, 64);
        let x = rows(n, w);
        for t in KvCacheType::ALL {
            let mut r = KvRows::new(t, w);
            r.push(&x[..2 * w]);
            r.push(&x[2 * w..]);
            assert_eq!((r.len(), r.held_bytes()), (n, n * t.row_bytes(w)));
            let mut back = vec![0f32; w];
            for row in 0..n {
                r.read(row, 0, &mut back);
                let src = &x[row * w..(row + 1) * w];
                for (blk, bb) in src.chunks(32).zip(back.chunks(32)) {
                    let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                    // Half a step, plus the f16 rounding of the scale (2^-11 relative, times up to 127 or 8
                    // steps); Q4_0 clamps the value opposite its scale's sign to 7 steps, one step off.
                    let tol = match t {
                        KvCacheType::F32 => 0.0,
                        KvCacheType::F16 => amax / 1024.0,
                        KvCacheType::Q8_0 => amax / 127.0 * 0.5 + amax / 1024.0,
                        KvCacheType::Q4_0 => amax / 8.0 + amax / 1024.0,
                    };
                    for (a, b) in blk.iter().zip(bb) {
                        assert!((a - b).abs() <= tol, "{t}: {a} read back as {b} (tolerance {tol})");
                    }
                }
                // The second head of the row alone equals the second half of the whole row.
                let mut half = vec![0f32; 32];
                r.read(row, 32, &mut half);
                assert_eq!(half, back[32..]);
            }
            let image = KvRows::from_bytes(t, w, r.bytes(3).into_owned()).unwrap();
            assert_eq!(image, r.prefix(3).unwrap());
            r.truncate(3);
            assert_eq!(r, image);
            assert!(r.prefix(4).is_none());
            assert!(KvRows::from_bytes(t, w, vec![0; t.row_bytes(w) + 1]).is_err());
        }
        // f32 keeps the values exactly, readable in place.
        let mut r = KvRows::new(KvCacheType::F32, w);
        r.push(&x);
        assert_eq!(r.as_f32().unwrap(), &x[..]);
    }
}
