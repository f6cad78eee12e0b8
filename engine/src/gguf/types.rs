//! The GGUF data model: ggml tensor types, metadata value types and values, tensor directory entries.
//!
//! Source: the GGUF specification (ggml `docs/gguf.md`). Type ids, block sizes and block byte sizes are checked
//! against `gguf.constants.GGMLQuantizationType` / `GGML_QUANT_SIZES` of the PyPI `gguf` package by a test
//! (fixture `testdata/ggml_types.json`, written by `scripts/gguf_fixtures.py`).

use std::fmt;

macro_rules! ggml_types {
    ($( $(#[$doc:meta])* $variant:ident = $id:literal, $name:literal, $block:expr, $bytes:expr; )*) => {
        /// A ggml tensor element type, with its on-disk id.
        ///
        /// Quantized types store `block_size()` elements in `type_size()` bytes; plain types have a block size of 1.
        /// Ids no longer produced by ggml (4, 5, 31..=33, 36..=38) are not listed and are rejected on load.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[allow(non_camel_case_types)]
        #[non_exhaustive]
        pub enum GgmlType {
            $( $(#[$doc])* $variant = $id, )*
        }

        impl GgmlType {
            /// Every known type, in id order.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$variant),*];

            /// The type with on-disk id `id`, or `None` for unknown or retired ids.
            pub fn from_id(id: u32) -> Option<Self> {
                match id {
                    $( $id => Some(GgmlType::$variant), )*
                    _ => None,
                }
            }

            /// The ggml name, as in `gguf.GGMLQuantizationType` (e.g. "Q4_K", "BF16", "IQ2_XXS").
            pub fn name(self) -> &'static str {
                match self {
                    $( GgmlType::$variant => $name, )*
                }
            }

            /// Elements per block (1 for F32, F16, BF16 and the integer types; 32 or 256 for most quantized
            /// types).
            pub fn block_size(self) -> usize {
                match self {
                    $( GgmlType::$variant => $block, )*
                }
            }

            /// Bytes per block.
            pub fn type_size(self) -> usize {
                match self {
                    $( GgmlType::$variant => $bytes, )*
                }
            }
        }
    };
}

/// Elements per super-block of the k-quants and most i-quants.
const QK_K: usize = 256;

ggml_types! {
    /// IEEE 754 binary32.
    F32 = 0, "F32", 1, 4;
    /// IEEE 754 binary16.
    F16 = 1, "F16", 1, 2;
    /// 4-bit, block of 32: f16 scale + 16 bytes of nibbles.
    Q4_0 = 2, "Q4_0", 32, 2 + 16;
    /// 4-bit, block of 32: f16 scale and min + 16 bytes of nibbles.
    Q4_1 = 3, "Q4_1", 32, 2 + 2 + 16;
    /// 5-bit, block of 32.
    Q5_0 = 6, "Q5_0", 32, 2 + 4 + 16;
    /// 5-bit with min, block of 32.
    Q5_1 = 7, "Q5_1", 32, 2 + 2 + 4 + 16;
    /// 8-bit, block of 32: f16 scale + 32 int8.
    Q8_0 = 8, "Q8_0", 32, 2 + 32;
    /// 8-bit with f32 scale and sum, block of 32 (an activation format).
    Q8_1 = 9, "Q8_1", 32, 4 + 4 + 32;
    /// 2-bit k-quant, super-block of 256.
    Q2_K = 10, "Q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4;
    /// 3-bit k-quant.
    Q3_K = 11, "Q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12;
    /// 4-bit k-quant.
    Q4_K = 12, "Q4_K", QK_K, 2 + 2 + QK_K / 2 + 12;
    /// 5-bit k-quant.
    Q5_K = 13, "Q5_K", QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12;
    /// 6-bit k-quant.
    Q6_K = 14, "Q6_K", QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16;
    /// 8-bit k-quant (an activation format).
    Q8_K = 15, "Q8_K", QK_K, 4 + QK_K + QK_K / 8;
    /// 2.06 bpw i-quant.
    IQ2_XXS = 16, "IQ2_XXS", QK_K, 2 + QK_K / 4;
    /// 2.31 bpw i-quant.
    IQ2_XS = 17, "IQ2_XS", QK_K, 2 + QK_K / 4 + QK_K / 32;
    /// 3.06 bpw i-quant.
    IQ3_XXS = 18, "IQ3_XXS", QK_K, 2 + QK_K / 4 + QK_K / 8;
    /// 1.56 bpw i-quant.
    IQ1_S = 19, "IQ1_S", QK_K, 2 + QK_K / 8 + QK_K / 16;
    /// 4-bit non-linear, block of 32.
    IQ4_NL = 20, "IQ4_NL", 32, 2 + 16;
    /// 3.44 bpw i-quant.
    IQ3_S = 21, "IQ3_S", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4;
    /// 2.5 bpw i-quant.
    IQ2_S = 22, "IQ2_S", QK_K, 2 + QK_K / 4 + QK_K / 16;
    /// 4.25 bpw non-linear, super-block of 256.
    IQ4_XS = 23, "IQ4_XS", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64;
    /// int8.
    I8 = 24, "I8", 1, 1;
    /// int16.
    I16 = 25, "I16", 1, 2;
    /// int32.
    I32 = 26, "I32", 1, 4;
    /// int64.
    I64 = 27, "I64", 1, 8;
    /// IEEE 754 binary64.
    F64 = 28, "F64", 1, 8;
    /// 1.75 bpw i-quant (no scale field of its own).
    IQ1_M = 29, "IQ1_M", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32;
    /// bfloat16.
    BF16 = 30, "BF16", 1, 2;
    /// Ternary, 1.69 bpw.
    TQ1_0 = 34, "TQ1_0", QK_K, 2 + 4 * 13;
    /// Ternary, 2.06 bpw.
    TQ2_0 = 35, "TQ2_0", QK_K, 2 + 64;
    /// OCP microscaling FP4, block of 32: e8m0 scale + 16 bytes of e2m1.
    MXFP4 = 39, "MXFP4", 32, 1 + 16;
    /// NVIDIA FP4, block of 64 (present in gguf-py 0.19.0).
    NVFP4 = 40, "NVFP4", 64, 4 + 32;
    /// 1-bit, block of 128 (present in gguf-py 0.19.0).
    Q1_0 = 41, "Q1_0", 128, 2 + 16;
}

impl GgmlType {
    /// The on-disk id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Whether elements are stored in blocks of more than one element.
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Bytes of one row of `ne0` elements.
    ///
    /// Returns `None` when `ne0` is not a multiple of [`Self::block_size`] or the size overflows a u64.
    pub fn row_bytes(self, ne0: u64) -> Option<u64> {
        let block = self.block_size() as u64;
        if !ne0.is_multiple_of(block) {
            return None;
        }
        (ne0 / block).checked_mul(self.type_size() as u64)
    }

    /// Bytes of a tensor with dims `dims` (ggml order, `dims[0]` = ne0).
    ///
    /// Returns `None` when `dims[0]` is not a multiple of the block size or the size overflows a u64. An empty
    /// `dims` is a scalar (one element).
    pub fn tensor_bytes(self, dims: &[u64]) -> Option<u64> {
        let (ne0, rest) = match dims.split_first() {
            Some((ne0, rest)) => (*ne0, rest),
            None => (1, &[][..]),
        };
        let rows = rest.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))?;
        self.row_bytes(ne0)?.checked_mul(rows)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A GGUF metadata value type, with its on-disk id (spec `gguf_metadata_value_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ValueType {
    /// 0: u8.
    U8 = 0,
    /// 1: i8.
    I8 = 1,
    /// 2: u16.
    U16 = 2,
    /// 3: i16.
    I16 = 3,
    /// 4: u32.
    U32 = 4,
    /// 5: i32.
    I32 = 5,
    /// 6: f32.
    F32 = 6,
    /// 7: bool, one byte, 0 or 1.
    Bool = 7,
    /// 8: UTF-8 string, u64 length then bytes, no terminator.
    String = 8,
    /// 9: array: u32 element type, u64 count, elements.
    Array = 9,
    /// 10: u64.
    U64 = 10,
    /// 11: i64.
    I64 = 11,
    /// 12: f64.
    F64 = 12,
}

impl ValueType {
    /// Every value type, in id order.
    pub const ALL: [ValueType; 13] = [
        ValueType::U8,
        ValueType::I8,
        ValueType::U16,
        ValueType::I16,
        ValueType::U32,
        ValueType::I32,
        ValueType::F32,
        ValueType::Bool,
        ValueType::String,
        ValueType::Array,
        ValueType::U64,
        ValueType::I64,
        ValueType::F64,
    ];

    /// The type with on-disk id `id` (0..=12).
    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.get(usize::try_from(id).ok()?).copied()
    }

    /// The on-disk id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// A short name for messages: "u8", "i32", "f32", "bool", "string", "array", ...
    pub fn name(self) -> &'static str {
        match self {
            ValueType::U8 => "u8",
            ValueType::I8 => "i8",
            ValueType::U16 => "u16",
            ValueType::I16 => "i16",
            ValueType::U32 => "u32",
            ValueType::I32 => "i32",
            ValueType::F32 => "f32",
            ValueType::Bool => "bool",
            ValueType::String => "string",
            ValueType::Array => "array",
            ValueType::U64 => "u64",
            ValueType::I64 => "i64",
            ValueType::F64 => "f64",
        }
    }

    /// The fewest bytes one value of this type takes on disk: its full size for scalars, the u64 length for a
    /// string, the u32 type plus u64 count for an array.
    pub fn min_encoded_size(self) -> u64 {
        match self {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => 1,
            ValueType::U16 | ValueType::I16 => 2,
            ValueType::U32 | ValueType::I32 | ValueType::F32 => 4,
            ValueType::U64 | ValueType::I64 | ValueType::F64 | ValueType::String => 8,
            ValueType::Array => 12,
        }
    }

    /// Whether this is one of the eight integer types.
    pub fn is_integer(self) -> bool {
        matches!(
            self,
            ValueType::U8
                | ValueType::I8
                | ValueType::U16
                | ValueType::I16
                | ValueType::U32
                | ValueType::I32
                | ValueType::U64
                | ValueType::I64
        )
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetadataValue {
    /// u8.
    U8(u8),
    /// i8.
    I8(i8),
    /// u16.
    U16(u16),
    /// i16.
    I16(i16),
    /// u32.
    U32(u32),
    /// i32.
    I32(i32),
    /// f32.
    F32(f32),
    /// bool.
    Bool(bool),
    /// UTF-8 string.
    String(String),
    /// Array of values of one type (arrays may nest).
    Array(MetadataArray),
    /// u64.
    U64(u64),
    /// i64.
    I64(i64),
    /// f64.
    F64(f64),
}

/// A metadata array: its declared element type and its elements.
///
/// Every element has type `elem_type` (the reader guarantees it; the writer checks it). Elements of an array of
/// arrays are [`MetadataValue::Array`]s, each with its own element type.
#[derive(Debug, Clone, PartialEq)]
pub struct MetadataArray {
    /// The declared element type.
    pub elem_type: ValueType,
    /// The elements.
    pub values: Vec<MetadataValue>,
}

impl MetadataArray {
    /// An array of `elem_type` holding `values` (not checked here; [`super::GgufWriter::add_kv`] checks it).
    pub fn new(elem_type: ValueType, values: Vec<MetadataValue>) -> Self {
        Self { elem_type, values }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
}

impl MetadataValue {
    /// The value's type.
    pub fn value_type(&self) -> ValueType {
        match self {
            MetadataValue::U8(_) => ValueType::U8,
            MetadataValue::I8(_) => ValueType::I8,
            MetadataValue::U16(_) => ValueType::U16,
            MetadataValue::I16(_) => ValueType::I16,
            MetadataValue::U32(_) => ValueType::U32,
            MetadataValue::I32(_) => ValueType::I32,
            MetadataValue::F32(_) => ValueType::F32,
            MetadataValue::Bool(_) => ValueType::Bool,
            MetadataValue::String(_) => ValueType::String,
            MetadataValue::Array(_) => ValueType::Array,
            MetadataValue::U64(_) => ValueType::U64,
            MetadataValue::I64(_) => ValueType::I64,
            MetadataValue::F64(_) => ValueType::F64,
        }
    }

    /// The type for messages: "u32", "string", "array of i32", "array of array of u8".
    pub fn type_description(&self) -> String {
        match self {
            MetadataValue::Array(a) => {
                let mut s = format!("array of {}", a.elem_type);
                let mut inner = a;
                while let Some(MetadataValue::Array(next)) = inner.values.first() {
                    s.push_str(" of ");
                    s.push_str(next.elem_type.name());
                    inner = next;
                }
                s
            }
            v => v.value_type().name().to_string(),
        }
    }

    /// The value of any integer type, widened to i128 (so every u64 and i64 fits); `None` for non-integers.
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            MetadataValue::U8(v) => v.into(),
            MetadataValue::I8(v) => v.into(),
            MetadataValue::U16(v) => v.into(),
            MetadataValue::I16(v) => v.into(),
            MetadataValue::U32(v) => v.into(),
            MetadataValue::I32(v) => v.into(),
            MetadataValue::U64(v) => v.into(),
            MetadataValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The string, if this is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetadataValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The array, if this is an array.
    pub fn as_array(&self) -> Option<&MetadataArray> {
        match self {
            MetadataValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The bool, if this is a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            MetadataValue::Bool(b) => Some(*b),
            _ => None,
        }
    }
}

macro_rules! value_from {
    ($($t:ty => $variant:ident),*) => {$(
        impl From<$t> for MetadataValue {
            fn from(v: $t) -> Self {
                MetadataValue::$variant(v)
            }
        }

        impl From<Vec<$t>> for MetadataValue {
            fn from(v: Vec<$t>) -> Self {
                MetadataValue::Array(MetadataArray {
                    elem_type: ValueType::$variant,
                    values: v.into_iter().map(MetadataValue::$variant).collect(),
                })
            }
        }
    )*};
}

value_from!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32, bool => Bool,
    String => String, u64 => U64, i64 => I64, f64 => F64);

impl From<&str> for MetadataValue {
    fn from(v: &str) -> Self {
        MetadataValue::String(v.to_string())
    }
}

impl From<Vec<&str>> for MetadataValue {
    fn from(v: Vec<&str>) -> Self {
        MetadataValue::Array(MetadataArray {
            elem_type: ValueType::String,
            values: v.into_iter().map(MetadataValue::from).collect(),
        })
    }
}

impl From<MetadataArray> for MetadataValue {
    fn from(v: MetadataArray) -> Self {
        MetadataValue::Array(v)
    }
}

/// One entry of the tensor directory.
///
/// `dims` are in ggml order: `dims[0]` is ne0, the contiguous axis, so a PyTorch `[out, in]` matrix has
/// `dims == [in, out]`. `n_bytes` is the exact size of the data (without alignment padding). The reader
/// guarantees: at most [`super::MAX_DIMS`] dims, each at least 1, `dims[0]` a multiple of the type's block size,
/// element count and byte size within `i64::MAX`, and the bytes inside the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name, e.g. "blk.0.attn_qkv.weight".
    pub name: String,
    /// Dimensions, ggml order (`dims[0]` = ne0, contiguous). Empty for a 0-dimensional (scalar) tensor.
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Data size in bytes.
    pub n_bytes: u64,
    /// Position in the file's (or split set's) tensor directory.
    pub(crate) index: usize,
    /// Which part of a split model holds the data (0-based).
    pub(crate) split: usize,
    /// Absolute offset of the data within its part.
    pub(crate) offset: u64,
}

impl TensorInfo {
    /// Number of elements: the product of `dims` (1 for a scalar). Saturates at u64::MAX (impossible for a
    /// tensor from the reader, which checks the product).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |acc, &d| acc.saturating_mul(d))
    }

    /// Number of dimensions.
    pub fn n_dims(&self) -> usize {
        self.dims.len()
    }

    /// Which part of a split model holds the data (0-based; 0 for an unsplit file).
    pub fn split_index(&self) -> usize {
        self.split
    }

    /// Absolute byte offset of the data in its part's file.
    pub fn file_offset(&self) -> u64 {
        self.offset
    }
}
