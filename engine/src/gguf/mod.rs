//! GGUF v3 reader and streaming writer (also reads v2), with split-model support.
//!
//! Source: the GGUF specification, ggml `docs/gguf.md`; split conventions from llama.cpp's `gguf-split` and
//! gguf-py's `GGUFWriter`. The PyPI `gguf` package (0.19.0) is the outside truth for the tests: fixtures in
//! `testdata/` are written by `scripts/gguf_fixtures.py`, and `scripts/gguf_check.py` reads files our writer
//! produced.
//!
//! - [`GgufFile::open`] memory-maps a file (or all parts of a split model) and validates it: magic, version 2 or 3,
//!   little-endian, every metadata value type including nested arrays, unique keys and tensor names,
//!   `general.alignment` a nonzero power of two, at most [`MAX_DIMS`] dims each >= 1, element count and byte size
//!   without overflow, `ne0` a multiple of the block size, known tensor types, aligned offsets, every tensor's
//!   bytes inside its file and not overlapping another's. Hostile counts and lengths are bounded by the bytes that
//!   remain before anything is allocated. Nothing panics.
//!
//!   Deliberate differences from ggml's own loader (`gguf.cpp`): we refuse dims of size 0 (ggml only refuses
//!   negative ones; a zero-size weight is never valid for us), accept tensor data in any order and with gaps as long
//!   as it is aligned and does not overlap (ggml requires tensors packed densely in directory order), and accept
//!   tensor names of 64 bytes or more (ggml refuses them; our writer does too). Like ggml and gguf-py we accept
//!   0-dimensional tensors (one element).
//! - [`GgufWriter`] writes a file (or a split set) with bounded memory: declare metadata and tensors, then stream
//!   each tensor's bytes in declaration order.
//!
//! Shapes are in ggml order throughout: `dims[0]` (ne0) is the contiguous axis.

mod error;
mod metadata;
mod parse;
mod reader;
mod split;
mod types;
mod writer;

#[cfg(test)]
mod tests;

pub use error::{GgufError, GgufErrorKind, Result};
pub use metadata::Metadata;
pub use reader::GgufFile;
pub use split::{KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT, SplitPath, part_path};
pub use types::{GgmlType, MetadataArray, MetadataValue, TensorInfo, ValueType};
pub use writer::{GgufWriter, TensorDataWriter};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
/// The version the writer produces.
pub const GGUF_VERSION: u32 = 3;
/// Data alignment when `general.alignment` is absent, in bytes.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of metadata arrays the reader accepts (an array of arrays is depth 2).
pub const MAX_ARRAY_DEPTH: u32 = 8;
/// Longest tensor name ggml accepts, in bytes (`GGML_MAX_NAME` minus the terminator). The writer enforces it; the
/// reader does not.
pub const MAX_TENSOR_NAME_BYTES: usize = 63;
/// Most metadata values (entries plus array elements, counted recursively) one file may hold. A real model holds
/// about a million (three vocabulary-sized arrays); the cap (16.7 M, at most about 32 bytes each in memory) bounds
/// what a hostile file can make us allocate.
pub const MAX_METADATA_VALUES: u64 = 1 << 24;

/// Key: the model architecture, e.g. "qwen4exp".
pub const KEY_ARCHITECTURE: &str = "general.architecture";
/// Key: the data alignment (u32).
pub const KEY_ALIGNMENT: &str = "general.alignment";
