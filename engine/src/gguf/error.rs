//! The one error type of the GGUF module: which file, and what is wrong with it.

use super::types::{GgmlType, ValueType};

/// An error while reading or writing a GGUF file.
///
/// `Display` names the file (its path, or the label given to [`super::GgufFile::from_bytes`]) followed by the
/// problem, e.g. `model.gguf: tensor 'blk.3.attn_q.weight' data [123456..999999) lies beyond the end of the file
/// (500000 bytes)`. Match on [`GgufError::kind`] to tell problems apart.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {kind}")]
pub struct GgufError {
    file: String,
    #[source]
    kind: GgufErrorKind,
}

impl GgufError {
    /// An error about `file` (a path or a label).
    pub fn new(file: impl Into<String>, kind: GgufErrorKind) -> Self {
        Self { file: file.into(), kind }
    }

    /// What went wrong.
    pub fn kind(&self) -> &GgufErrorKind {
        &self.kind
    }

    /// The file (path or label) the error is about.
    pub fn file(&self) -> &str {
        &self.file
    }
}

/// Shorthand for results in this module.
pub type Result<T, E = GgufError> = std::result::Result<T, E>;

/// Which problem a [`GgufError`] reports. Every variant carries the offending name or value.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufErrorKind {
    /// An operating-system error (open, stat, mmap, create, write, rename).
    #[error("cannot {op}: {source}")]
    Io {
        /// What was being done, e.g. "open the file" or "write tensor data".
        op: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: the first bytes are {found:02x?}, expected \"GGUF\"")]
    BadMagic {
        /// The bytes found (fewer than four if the file is shorter).
        found: Vec<u8>,
    },

    /// The version field reads as a byte-swapped small number: a big-endian GGUF file.
    #[error("big-endian GGUF file (version {version} byte-swapped); only little-endian files are supported")]
    BigEndian {
        /// The version, once byte-swapped.
        version: u32,
    },

    /// A version other than 2 or 3.
    #[error("unsupported GGUF version {version}{hint}", hint = if *version == 1 {
        " (GGUF v1 used 32-bit counts and is obsolete; convert the file again)"
    } else {
        " (supported: 2 and 3)"
    })]
    UnsupportedVersion {
        /// The version field, read little-endian.
        version: u32,
    },

    /// The file ends in the middle of a field.
    #[error("truncated while reading {what} at offset {offset}")]
    Truncated {
        /// Which field, e.g. "the value of key 'tokenizer.ggml.tokens'".
        what: String,
        /// The file offset where the field starts.
        offset: u64,
    },

    /// A string length is larger than what remains of the file.
    #[error("{what} at offset {offset} claims {length} bytes, but only {remaining} bytes remain in the file")]
    LengthBeyondEnd {
        /// Which string, e.g. "the name of tensor #3".
        what: String,
        /// The file offset of the length field.
        offset: u64,
        /// The claimed length in bytes.
        length: u64,
        /// Bytes left after the length field.
        remaining: u64,
    },

    /// An element count (tensors, metadata entries, array elements) that cannot fit in the rest of the file.
    #[error(
        "{what} at offset {offset} claims {count} entries of at least {min_entry_bytes} bytes each, \
         but only {remaining} bytes remain in the file"
    )]
    CountBeyondEnd {
        /// Which count, e.g. "the tensor count".
        what: String,
        /// The file offset of the count field.
        offset: u64,
        /// The claimed count.
        count: u64,
        /// The smallest possible encoding of one entry.
        min_entry_bytes: u64,
        /// Bytes left after the count field.
        remaining: u64,
    },

    /// The metadata holds more values (entries plus array elements) than [`super::MAX_METADATA_VALUES`].
    #[error("key '{key}': the metadata holds more than {limit} values in total")]
    TooManyValues {
        /// The key being read when the limit was hit.
        key: String,
        /// The limit.
        limit: u64,
    },

    /// A key, tensor name or string value that is not valid UTF-8.
    #[error("{what} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 {
        /// Which string.
        what: String,
        /// The file offset of its first byte.
        offset: u64,
    },

    /// A metadata value type id outside 0..=12.
    #[error("key '{key}' has unknown value type id {type_id}")]
    UnknownValueType {
        /// The key whose value (or array element type) is unknown.
        key: String,
        /// The type id found.
        type_id: u32,
    },

    /// A bool stored as a byte other than 0 or 1.
    #[error("key '{key}' holds bool byte {byte} at offset {offset}; expected 0 or 1")]
    InvalidBool {
        /// The key.
        key: String,
        /// The byte found.
        byte: u8,
        /// Its offset.
        offset: u64,
    },

    /// Arrays nested deeper than [`super::MAX_ARRAY_DEPTH`].
    #[error("key '{key}': arrays nested deeper than {limit} levels")]
    NestingTooDeep {
        /// The key.
        key: String,
        /// The limit.
        limit: u32,
    },

    /// The same metadata key twice.
    #[error("duplicate metadata key '{key}'")]
    DuplicateKey {
        /// The key.
        key: String,
    },

    /// The same tensor name twice (within a file or across the parts of a split model).
    #[error("duplicate tensor name '{name}'")]
    DuplicateTensor {
        /// The tensor name.
        name: String,
    },

    /// `general.alignment` is not a nonzero power of two that fits in a u32, or not an integer.
    #[error("invalid alignment: {detail}")]
    BadAlignment {
        /// What is wrong with it.
        detail: String,
    },

    /// More than [`super::MAX_DIMS`] dimensions.
    #[error("tensor '{tensor}' has {n_dims} dimensions; at most {max} are allowed", max = super::MAX_DIMS)]
    TooManyDims {
        /// The tensor name.
        tensor: String,
        /// The dimension count found.
        n_dims: u32,
    },

    /// A dimension of size zero.
    #[error("tensor '{tensor}' has size 0 in dimension {axis} (dims {dims:?})")]
    ZeroDim {
        /// The tensor name.
        tensor: String,
        /// The axis (0 = ne0).
        axis: usize,
        /// All dims, ggml order.
        dims: Vec<u64>,
    },

    /// The element count or byte size of a tensor does not fit in 63 bits.
    #[error("tensor '{tensor}' with dims {dims:?} has too many elements or bytes (overflow)")]
    TensorSizeOverflow {
        /// The tensor name.
        tensor: String,
        /// All dims, ggml order.
        dims: Vec<u64>,
    },

    /// A tensor type id that is not a known ggml type.
    #[error("tensor '{tensor}' has unknown ggml type id {type_id}")]
    UnknownTensorType {
        /// The tensor name.
        tensor: String,
        /// The id found.
        type_id: u32,
    },

    /// `ne0` is not a multiple of the type's block size.
    #[error(
        "tensor '{tensor}' of type {ggml_type} has {ne0} elements per row, not a multiple of the block size \
         {block_size}", block_size = ggml_type.block_size()
    )]
    RowNotBlockMultiple {
        /// The tensor name.
        tensor: String,
        /// Its type.
        ggml_type: GgmlType,
        /// The row length found.
        ne0: u64,
    },

    /// A tensor offset that is not a multiple of the file's alignment.
    #[error("tensor '{tensor}' has offset {offset}, not a multiple of the alignment {alignment}")]
    MisalignedOffset {
        /// The tensor name.
        tensor: String,
        /// The offset relative to the data section.
        offset: u64,
        /// The file's alignment.
        alignment: u64,
    },

    /// A tensor's bytes extend past the end of the file (or its end overflows).
    #[error("tensor '{tensor}' data [{start}..{end}) lies beyond the end of the file ({file_size} bytes)")]
    TensorBeyondEnd {
        /// The tensor name.
        tensor: String,
        /// First byte, absolute file offset.
        start: u64,
        /// One past the last byte (saturated at u64::MAX on overflow).
        end: u64,
        /// The file size.
        file_size: u64,
    },

    /// Two tensors share bytes.
    #[error("tensor '{tensor}' data [{start}..{end}) overlaps tensor '{other}' data [{other_start}..{other_end})")]
    TensorOverlap {
        /// The later tensor (by offset).
        tensor: String,
        /// Its first byte.
        start: u64,
        /// One past its last byte.
        end: u64,
        /// The earlier tensor.
        other: String,
        /// Its first byte.
        other_start: u64,
        /// One past its last byte.
        other_end: u64,
    },

    /// A required metadata key is absent.
    #[error("missing metadata key '{key}'")]
    MissingKey {
        /// The key.
        key: String,
    },

    /// A metadata value of another type than the getter asked for.
    #[error("key '{key}' has type {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// The type found, e.g. "string" or "array of i32".
        found: String,
        /// What was asked for, e.g. "an integer" or "an array of strings".
        expected: &'static str,
    },

    /// An integer that does not fit in the type asked for.
    #[error("key '{key}' holds {value}, which does not fit in {target}")]
    OutOfRange {
        /// The key.
        key: String,
        /// The value (for arrays: which element and its value).
        value: String,
        /// The target type, e.g. "u32".
        target: &'static str,
    },

    /// A part of a split model is absent.
    #[error("missing split part '{part}'")]
    MissingSplitPart {
        /// The path of the part that was looked for.
        part: String,
    },

    /// The `split.*` keys disagree with each other or with the file names.
    #[error("inconsistent split model: {detail}")]
    SplitMismatch {
        /// What disagrees.
        detail: String,
    },

    /// Writer: the alignment is not a nonzero power of two.
    #[error("invalid writer alignment {alignment}: must be a nonzero power of two")]
    WriterAlignment {
        /// The alignment asked for.
        alignment: u32,
    },

    /// Writer: a key the writer manages itself (`split.*`, or `general.alignment` with another value).
    #[error("key '{key}' is managed by the writer: {detail}")]
    ReservedKey {
        /// The key.
        key: String,
        /// Why.
        detail: String,
    },

    /// Writer: a tensor name of 64 bytes or more, which ggml (`GGML_MAX_NAME` = 64, with the terminator) refuses.
    #[error("tensor name '{name}' is {len} bytes; ggml allows at most {max}", len = name.len())]
    TensorNameTooLong {
        /// The name.
        name: String,
        /// The longest allowed, in bytes.
        max: usize,
    },

    /// Writer: an array element whose type differs from the array's element type.
    #[error("key '{key}': array element {index} has type {found}, but the array's element type is {expected}")]
    ArrayElementType {
        /// The key.
        key: String,
        /// The element index (of the innermost array holding it).
        index: usize,
        /// The element's type.
        found: ValueType,
        /// The declared element type.
        expected: ValueType,
    },

    /// Writer: tensor data written out of declaration order.
    #[error("tensor data out of order: got '{got}', expected {expected}")]
    UnexpectedTensor {
        /// The name passed in.
        got: String,
        /// The name expected next (quoted), or "no more tensors".
        expected: String,
    },

    /// Writer: a tensor received more or fewer bytes than its type and dims require.
    #[error("tensor '{tensor}' needs {expected} bytes, got {got}")]
    TensorSizeMismatch {
        /// The tensor name.
        tensor: String,
        /// The size computed from type and dims.
        expected: u64,
        /// The bytes received (so far, for a chunk that overshoots).
        got: u64,
    },

    /// Writer: `finish` before every declared tensor was written.
    #[error("{missing} declared tensor(s) were never written, starting with '{first}'")]
    MissingTensors {
        /// How many are missing.
        missing: usize,
        /// The first missing one.
        first: String,
    },

    /// Writer: a call that does not fit the writer's state (e.g. a chunk with no tensor begun, or any call after
    /// an I/O error).
    #[error("writer misuse: {detail}")]
    WriterState {
        /// What was wrong.
        detail: String,
    },
}

impl GgufErrorKind {
    pub(crate) fn io(op: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io { op: op.into(), source }
    }
}
