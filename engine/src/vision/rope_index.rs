//! The language model's 3-D M-RoPE positions of a prompt with vision tokens, as `Qwen4ExpModel.get_rope_index`
//! computes them (with `get_vision_position_ids`), and [`MediaPrompt`], what such a prompt carries into the engine.
//!
//! The prompt is cut into runs of text and runs of vision tokens (an image, or one temporal group of a video: the
//! reference splits a video's grid into one grid per group, each preceded by its timestamp text). A text run
//! continues the running position `p`: its tokens get `(p, p, p)`, `(p+1, p+1, p+1)`, ... A vision run of an
//! `h x w` merged grid gets `(p, p + row, p + col)` in row-major order, and the running position then moves to
//! `p + max(h, w)`. So text after an image continues from the image's largest position plus one, and a sequence's
//! rope position can be smaller than its token count; decoding goes on from the last position plus one.

/// One run of vision tokens: an image or one temporal group of a video.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaSpan {
    /// Index of the run's first pad token in the prompt.
    pub start: usize,
    /// Merged grid rows (`patch rows / merge`).
    pub rows: usize,
    /// Merged grid columns.
    pub cols: usize,
}

impl MediaSpan {
    /// Tokens of the run, `rows * cols`.
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// Whether the run is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `[t, h, w]` positions of the `n` tokens of a prompt whose vision runs are `spans` (ascending, disjoint, within
/// the prompt): module doc.
///
/// Panics: spans out of order, overlapping or past `n` (callers build them from the prompt they describe).
pub fn rope_index(n: usize, spans: &[MediaSpan]) -> Vec<[u32; 3]> {
    let mut out = Vec::with_capacity(n);
    let mut p = 0u32;
    let mut at = 0usize;
    for s in spans {
        assert!(s.start >= at && s.start + s.len() <= n, "media spans are ordered and within the prompt");
        for _ in at..s.start {
            out.push([p; 3]);
            p += 1;
        }
        for r in 0..s.rows as u32 {
            for c in 0..s.cols as u32 {
                out.push([p, p + r, p + c]);
            }
        }
        p += s.rows.max(s.cols) as u32;
        at = s.start + s.len();
    }
    for _ in at..n {
        out.push([p; 3]);
        p += 1;
    }
    out
}

/// A prompt's media as the engine takes it: the features placed at the vision tokens, every token's rope
/// position, and the prefix-cache key.
#[derive(Debug, Clone, PartialEq)]
pub struct MediaPrompt {
    /// `[t, h, w]` rope position of every prompt token ([`rope_index`]).
    pub positions: Vec<[u32; 3]>,
    /// Prompt indices whose input embedding is replaced, ascending.
    pub rows: Vec<usize>,
    /// The replacing embeddings, `[rows.len(), hidden]`.
    pub features: Vec<f32>,
    /// The prompt with each vision token's id replaced by one derived from its image's content hash and its
    /// index in the image (ids at or above the vocabulary size, so never a real token's): what the prefix cache
    /// keys the prompt by. The tokens alone are the same for every image of a size; the key tells them apart,
    /// and the same image in a follow-up turn gives the same key, so its prefill is reused.
    pub cache_key: Vec<u32>,
}

/// One image or video group's part of a [`MediaPrompt`].
#[derive(Debug, Clone)]
pub struct MediaItem {
    /// Where its tokens are and their grid.
    pub span: MediaSpan,
    /// Its features, `[span.len(), hidden]`.
    pub features: Vec<f32>,
    /// A hash of the image's content (its bytes, or its pixels) and the processing settings.
    pub content_hash: u64,
}

impl MediaPrompt {
    /// Builds the media of a prompt of `tokens` whose vision runs are `items` (ascending, disjoint), for a model
    /// of `vocab` ids and `hidden` width.
    ///
    /// Errors: a description of the first inconsistency (spans out of order or past the prompt, features of the
    /// wrong size).
    pub fn new(tokens: &[u32], items: &[MediaItem], vocab: usize, hidden: usize) -> Result<Self, String> {
        let mut at = 0;
        for (i, it) in items.iter().enumerate() {
            let s = it.span;
            if s.start < at || s.start + s.len() > tokens.len() {
                return Err(format!(
                    "media {i}: tokens {}..{} out of order or past the prompt",
                    s.start,
                    s.start + s.len()
                ));
            }
            if it.features.len() != s.len() * hidden {
                return Err(format!(
                    "media {i}: {} feature values for {} tokens of width {hidden}",
                    it.features.len(),
                    s.len()
                ));
            }
            at = s.start + s.len();
        }
        let spans: Vec<MediaSpan> = items.iter().map(|i| i.span).collect();
        let mut rows = Vec::new();
        let mut features = Vec::new();
        let mut cache_key = tokens.to_vec();
        let room = (u32::MAX as u64).saturating_sub(vocab as u64).max(1);
        for it in items {
            for k in 0..it.span.len() {
                let row = it.span.start + k;
                rows.push(row);
                let mixed = splitmix64(it.content_hash ^ splitmix64(k as u64));
                cache_key[row] = (vocab as u64 + mixed % room) as u32;
            }
            features.extend_from_slice(&it.features);
        }
        Ok(Self { positions: rope_index(tokens.len(), &spans), rows, features, cache_key })
    }

    /// The rows of this prompt within `range`, as indices relative to `range.start`, and their features.
    pub fn rows_in(&self, range: std::ops::Range<usize>, hidden: usize) -> (Vec<usize>, &[f32]) {
        let a = self.rows.partition_point(|&r| r < range.start);
        let b = self.rows.partition_point(|&r| r < range.end);
        (self.rows[a..b].iter().map(|r| r - range.start).collect(), &self.features[a * hidden..b * hidden])
    }
}

/// A 64-bit hash of an image's bytes and `settings` (whatever else changes its features, e.g. the pixel bounds):
/// XXH3-64 with `settings` as the seed.
pub fn content_hash(bytes: &[u8], settings: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(bytes, settings)
}

/// SplitMix64's finaliser (a bijective 64-bit mix).
fn splitmix64(mut v: u64) -> u64 {
    v = v.wrapping_add(0x9E37_79B9_7F4A_7C15);
    v = (v ^ (v >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    v = (v ^ (v >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    v ^ (v >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_image_text_positions() {
        // 2 text, a 2 x 3 grid, 2 text: the text after the image continues at 2 + max(2, 3) = 5.
        let p = rope_index(10, &[MediaSpan { start: 2, rows: 2, cols: 3 }]);
        assert_eq!(&p[..2], &[[0; 3], [1; 3]]);
        assert_eq!(&p[2..8], &[[2, 2, 2], [2, 2, 3], [2, 2, 4], [2, 3, 2], [2, 3, 3], [2, 3, 4]]);
        assert_eq!(&p[8..], &[[5; 3], [6; 3]]);
    }

    #[test]
    fn cache_keys_tell_images_apart() {
        let tokens = vec![1, 2, 9, 9, 9, 9, 3];
        let item = |h| MediaItem {
            span: MediaSpan { start: 2, rows: 2, cols: 2 },
            features: vec![0.0; 4 * 2],
            content_hash: h,
        };
        let a = MediaPrompt::new(&tokens, &[item(1)], 10, 2).unwrap();
        let b = MediaPrompt::new(&tokens, &[item(2)], 10, 2).unwrap();
        let a2 = MediaPrompt::new(&tokens, &[item(1)], 10, 2).unwrap();
        assert_eq!(a.cache_key, a2.cache_key);
        assert_ne!(a.cache_key[2..6], b.cache_key[2..6]);
        assert_eq!(a.cache_key[..2], tokens[..2]);
        assert!(a.cache_key[2..6].iter().all(|&k| k >= 10));
        assert_eq!(a.rows_in(3..7, 2).0, vec![0, 1, 2]);
        assert!(MediaPrompt::new(&tokens, &[item(1), item(1)], 10, 2).is_err());
    }
}
