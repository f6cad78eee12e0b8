//! Parses the bytes of one GGUF file (one part of a split model) into metadata and a validated tensor directory.
//!
//! Layout (GGUF spec, ggml `docs/gguf.md`), all little-endian:
//! `"GGUF"`, u32 version, u64 tensor count, u64 metadata count, metadata entries (string key, u32 value type,
//! value), tensor infos (string name, u32 n_dims, u64 dims[n_dims] in ggml order, u32 ggml type, u64 offset
//! relative to the data section), padding to `general.alignment`, the data section.
//!
//! Hostile input: every length and count is checked against the bytes that remain before anything is allocated,
//! arrays nest at most [`MAX_ARRAY_DEPTH`] deep, the metadata holds at most [`MAX_METADATA_VALUES`] values, and all
//! offset arithmetic is checked. The parser never panics and never reads out of bounds.

use std::collections::HashSet;

use super::error::{GgufError, GgufErrorKind, Result};
use super::metadata::Metadata;
use super::types::{GgmlType, MetadataArray, MetadataValue, TensorInfo, ValueType};
use super::{DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS, MAX_METADATA_VALUES};

/// The smallest tensor info: empty name (8), n_dims = 0 (4), type (4), offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;
/// The smallest metadata entry: empty key (8), type (4), a one-byte value (1).
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Preallocation cap for counts that are only bounded loosely by the remaining bytes.
const PREALLOC_CAP: u64 = 1 << 16;

/// One parsed file.
#[derive(Debug)]
pub(crate) struct ParsedFile {
    /// GGUF version (2 or 3).
    pub version: u32,
    /// Data alignment in bytes.
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    /// Metadata in file order.
    pub metadata: Metadata,
    /// Tensors in file order; `index` is the position in this file, `split` is 0, `offset` absolute.
    pub tensors: Vec<TensorInfo>,
}

/// Parses `bytes`; errors name `label`.
pub(crate) fn parse(label: &str, bytes: &[u8]) -> Result<ParsedFile> {
    Parser { label, buf: bytes, pos: 0, values_left: MAX_METADATA_VALUES }
        .file()
        .map_err(|kind| GgufError::new(label, kind))
}

type Kind = GgufErrorKind;

struct Parser<'a> {
    label: &'a str,
    buf: &'a [u8],
    pos: usize,
    /// Metadata values (entries and array elements) still allowed.
    values_left: u64,
}

impl<'a> Parser<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn offset(&self) -> u64 {
        self.pos as u64
    }

    /// Takes `n` bytes, or reports `what` as truncated at the current offset.
    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], Kind> {
        match self.buf.get(self.pos..).and_then(|rest| rest.get(..n)) {
            Some(bytes) => {
                self.pos += n;
                Ok(bytes)
            }
            None => Err(Kind::Truncated { what: what(), offset: self.offset() }),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], Kind> {
        let bytes = self.take(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, Kind> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, Kind> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Reads a u64 length and that many bytes of UTF-8.
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, Kind> {
        let len_offset = self.offset();
        let len = self.u64(what)?;
        if len > self.remaining() {
            return Err(Kind::LengthBeyondEnd {
                what: what(),
                offset: len_offset,
                length: len,
                remaining: self.remaining(),
            });
        }
        let start = self.offset();
        // `len <= remaining`, which fits in usize.
        let bytes = self.take(len as usize, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(Kind::InvalidUtf8 { what: what(), offset: start }),
        }
    }

    /// Reads a count and checks that `count` entries of at least `min_entry_bytes` fit in the rest of the file.
    fn count(&mut self, min_entry_bytes: u64, what: &dyn Fn() -> String) -> Result<u64, Kind> {
        let offset = self.offset();
        let count = self.u64(what)?;
        let remaining = self.remaining();
        if count.checked_mul(min_entry_bytes).is_none_or(|need| need > remaining) {
            return Err(Kind::CountBeyondEnd { what: what(), offset, count, min_entry_bytes, remaining });
        }
        Ok(count)
    }

    fn spend_values(&mut self, n: u64, key: &str) -> Result<(), Kind> {
        match self.values_left.checked_sub(n) {
            Some(left) => {
                self.values_left = left;
                Ok(())
            }
            None => Err(Kind::TooManyValues { key: key.to_string(), limit: MAX_METADATA_VALUES }),
        }
    }

    fn file(mut self) -> Result<ParsedFile, Kind> {
        let magic = self.buf.get(..4).unwrap_or(self.buf);
        if magic != GGUF_MAGIC {
            return Err(Kind::BadMagic { found: magic.to_vec() });
        }
        self.pos = 4;
        let version = self.u32(&|| "the version".into())?;
        match version {
            2 | 3 => {}
            v if v & 0xffff == 0 && (1..=3).contains(&v.swap_bytes()) => {
                return Err(Kind::BigEndian { version: v.swap_bytes() });
            }
            v => return Err(Kind::UnsupportedVersion { version: v }),
        }
        let n_tensors = self.count(MIN_TENSOR_INFO_BYTES, &|| "the tensor count".into())?;
        let n_kv = self.count(MIN_KV_BYTES, &|| "the metadata entry count".into())?;

        let mut metadata = Metadata::new(self.label);
        for i in 0..n_kv {
            let key = self.string(&|| format!("the key of metadata entry #{i}"))?;
            self.spend_values(1, &key)?;
            let what_type = || format!("the value type of key '{key}'");
            let type_id = self.u32(&what_type)?;
            let value_type =
                ValueType::from_id(type_id).ok_or_else(|| Kind::UnknownValueType { key: key.clone(), type_id })?;
            let value = self.value(&key, value_type, 0)?;
            if metadata.contains_key(&key) {
                return Err(Kind::DuplicateKey { key });
            }
            metadata.insert(key, value);
        }

        let alignment = alignment(&metadata)?;

        let mut tensors = Vec::with_capacity(n_tensors.min(PREALLOC_CAP) as usize);
        let mut names: HashSet<String> = HashSet::with_capacity(tensors.capacity());
        for i in 0..n_tensors {
            let tensor = self.tensor_info(i, alignment)?;
            if !names.insert(tensor.name.clone()) {
                return Err(Kind::DuplicateTensor { name: tensor.name });
            }
            tensors.push(tensor);
        }

        // The data section starts at the next multiple of the alignment (it may be absent without tensors).
        let data_offset = self.offset().next_multiple_of(alignment);
        let file_size = self.buf.len() as u64;
        for t in &mut tensors {
            let start = data_offset.checked_add(t.offset);
            let end = start.and_then(|s| s.checked_add(t.n_bytes));
            match (start, end) {
                (Some(_), Some(end)) if end <= file_size => t.offset = start.unwrap_or_default(),
                _ => {
                    return Err(Kind::TensorBeyondEnd {
                        tensor: t.name.clone(),
                        start: start.unwrap_or(u64::MAX),
                        end: end.unwrap_or(u64::MAX),
                        file_size,
                    });
                }
            }
        }
        check_overlaps(&tensors)?;

        Ok(ParsedFile { version, alignment, data_offset, metadata, tensors })
    }

    fn value(&mut self, key: &str, value_type: ValueType, depth: u32) -> Result<MetadataValue, Kind> {
        let what = || format!("the value of key '{key}'");
        Ok(match value_type {
            ValueType::U8 => MetadataValue::U8(u8::from_le_bytes(self.array(&what)?)),
            ValueType::I8 => MetadataValue::I8(i8::from_le_bytes(self.array(&what)?)),
            ValueType::U16 => MetadataValue::U16(u16::from_le_bytes(self.array(&what)?)),
            ValueType::I16 => MetadataValue::I16(i16::from_le_bytes(self.array(&what)?)),
            ValueType::U32 => MetadataValue::U32(u32::from_le_bytes(self.array(&what)?)),
            ValueType::I32 => MetadataValue::I32(i32::from_le_bytes(self.array(&what)?)),
            ValueType::F32 => MetadataValue::F32(f32::from_le_bytes(self.array(&what)?)),
            ValueType::U64 => MetadataValue::U64(u64::from_le_bytes(self.array(&what)?)),
            ValueType::I64 => MetadataValue::I64(i64::from_le_bytes(self.array(&what)?)),
            ValueType::F64 => MetadataValue::F64(f64::from_le_bytes(self.array(&what)?)),
            ValueType::Bool => {
                let offset = self.offset();
                match self.array::<1>(&what)?[0] {
                    0 => MetadataValue::Bool(false),
                    1 => MetadataValue::Bool(true),
                    byte => {
                        return Err(Kind::InvalidBool { key: key.to_string(), byte, offset });
                    }
                }
            }
            ValueType::String => MetadataValue::String(self.string(&what)?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(Kind::NestingTooDeep { key: key.to_string(), limit: MAX_ARRAY_DEPTH });
                }
                let type_id = self.u32(&|| format!("the element type of array key '{key}'"))?;
                let elem_type = ValueType::from_id(type_id)
                    .ok_or_else(|| Kind::UnknownValueType { key: key.to_string(), type_id })?;
                let n =
                    self.count(elem_type.min_encoded_size(), &|| format!("the element count of array key '{key}'"))?;
                self.spend_values(n, key)?;
                // Fixed-size elements: the count was checked exactly against the remaining bytes.
                let cap = if elem_type.min_encoded_size() >= 8 { n.min(PREALLOC_CAP) } else { n };
                let mut values = Vec::with_capacity(cap as usize);
                for _ in 0..n {
                    values.push(self.value(key, elem_type, depth + 1)?);
                }
                MetadataValue::Array(MetadataArray { elem_type, values })
            }
        })
    }

    fn tensor_info(&mut self, i: u64, alignment: u64) -> Result<TensorInfo, Kind> {
        let name = self.string(&|| format!("the name of tensor #{i}"))?;
        let n_dims = self.u32(&|| format!("the dimension count of tensor '{name}'"))?;
        if n_dims as usize > MAX_DIMS {
            return Err(Kind::TooManyDims { tensor: name, n_dims });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64(&|| format!("the dimensions of tensor '{name}'"))?);
        }
        let type_id = self.u32(&|| format!("the type of tensor '{name}'"))?;
        let offset = self.u64(&|| format!("the data offset of tensor '{name}'"))?;

        if let Some(axis) = dims.iter().position(|&d| d == 0) {
            return Err(Kind::ZeroDim { tensor: name, axis, dims });
        }
        let ggml_type =
            GgmlType::from_id(type_id).ok_or_else(|| Kind::UnknownTensorType { tensor: name.clone(), type_id })?;
        let n_bytes = tensor_bytes(&name, &dims, ggml_type)?;
        if !offset.is_multiple_of(alignment) {
            return Err(Kind::MisalignedOffset { tensor: name, offset, alignment });
        }
        Ok(TensorInfo { name, dims, ggml_type, n_bytes, index: i as usize, split: 0, offset })
    }
}

/// Validates a tensor shape (as ggml does) and returns its size in bytes: each dim >= 1 (checked by the caller),
/// element count and byte size within `i64::MAX`, `dims[0]` a multiple of the block size.
pub(crate) fn tensor_bytes(name: &str, dims: &[u64], ggml_type: GgmlType) -> Result<u64, Kind> {
    let overflow = || Kind::TensorSizeOverflow { tensor: name.to_string(), dims: dims.to_vec() };
    let n_elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).ok_or_else(overflow)?;
    if n_elements > i64::MAX as u64 {
        return Err(overflow());
    }
    let ne0 = dims.first().copied().unwrap_or(1);
    if !ne0.is_multiple_of(ggml_type.block_size() as u64) {
        return Err(Kind::RowNotBlockMultiple { tensor: name.to_string(), ggml_type, ne0 });
    }
    match ggml_type.tensor_bytes(dims) {
        Some(n) if n <= i64::MAX as u64 => Ok(n),
        _ => Err(overflow()),
    }
}

/// `general.alignment`: absent means 32; otherwise an integer that is a nonzero power of two fitting in a u32.
fn alignment(metadata: &Metadata) -> Result<u64, Kind> {
    let Some(value) = metadata.get(super::KEY_ALIGNMENT) else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    let bad = |detail: String| Kind::BadAlignment { detail };
    let v = value.as_integer().ok_or_else(|| {
        bad(format!("'{}' has type {}, expected u32", super::KEY_ALIGNMENT, value.type_description()))
    })?;
    match u32::try_from(v) {
        Ok(a) if a.is_power_of_two() => Ok(u64::from(a)),
        _ => Err(bad(format!("'{}' = {v} is not a nonzero power of two that fits in a u32", super::KEY_ALIGNMENT))),
    }
}

/// Rejects tensors whose byte ranges intersect (all ranges are non-empty and inside the file).
fn check_overlaps(tensors: &[TensorInfo]) -> Result<(), Kind> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| tensors[i].offset);
    for pair in order.windows(2) {
        let (a, b) = (&tensors[pair[0]], &tensors[pair[1]]);
        let a_end = a.offset + a.n_bytes;
        if b.offset < a_end {
            return Err(Kind::TensorOverlap {
                tensor: b.name.clone(),
                start: b.offset,
                end: b.offset + b.n_bytes,
                other: a.name.clone(),
                other_start: a.offset,
                other_end: a_end,
            });
        }
    }
    Ok(())
}
