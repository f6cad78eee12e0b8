//! Errors of image decoding, preprocessing and the vision tower.

/// What went wrong with one image or video: every variant says what to fix, so the API can hand it to the client
/// as a 400 naming the part.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum VisionError {
    /// The bytes are in no format the decoder reads (PNG, JPEG, WebP and GIF are).
    #[error("unsupported image format (PNG, JPEG, WebP and GIF are read)")]
    UnsupportedFormat,
    /// The header declares more pixels than allowed, or a side past the decoder's limit: refused before decoding.
    #[error("image of {width} x {height} pixels is over the limit of {limit} pixels")]
    TooLarge {
        /// Declared width, pixels.
        width: u64,
        /// Declared height, pixels.
        height: u64,
        /// The configured limit, pixels.
        limit: u64,
    },
    /// The bytes are truncated or corrupt.
    #[error("the image could not be decoded (corrupt or truncated): {0}")]
    Corrupt(String),
    /// An image with a zero side or an aspect ratio of 200:1 or more (the reference processor refuses those).
    #[error("image of {width} x {height} pixels: {problem}")]
    BadShape {
        /// Width, pixels.
        width: u32,
        /// Height, pixels.
        height: u32,
        /// Why.
        problem: String,
    },
    /// A video with fewer frames than the temporal patch, or frames of different sizes.
    #[error("video: {0}")]
    BadVideo(String),
}
