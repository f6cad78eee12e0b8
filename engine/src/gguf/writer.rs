//! [`GgufWriter`]: a streaming GGUF v3 writer, optionally splitting the model into parts like `gguf-split`.
//!
//! Memory stays bounded by the metadata and the tensor directory: tensor bytes are streamed to disk in declaration
//! order (whole or in chunks), so a 100+ GB model can be written from a converter that produces one tensor at a
//! time. Output goes to `<file>.partial` and is renamed into place by [`TensorDataWriter::finish`]; dropping an
//! unfinished writer removes the partial files.
//!
//! Layout written (GGUF spec, ggml `docs/gguf.md`): header, metadata, tensor infos, zero padding to the alignment,
//! then each tensor's bytes followed by zero padding to the alignment (also after the last tensor, as ggml and
//! gguf-py do). The bytes are identical to gguf-py's `GGUFWriter` for the same keys, tensors and order (tested).

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::error::{GgufError, GgufErrorKind, Result};
use super::metadata::Metadata;
use super::parse::tensor_bytes;
use super::split::{KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT, part_path};
use super::types::{GgmlType, MetadataArray, MetadataValue};
use super::{
    DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, KEY_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS, MAX_METADATA_VALUES,
    MAX_TENSOR_NAME_BYTES,
};

/// Write buffer per open part.
const WRITE_BUFFER_BYTES: usize = 8 << 20;

/// A tensor declared with [`GgufWriter::add_tensor`].
#[derive(Debug, Clone)]
struct PlannedTensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    n_bytes: u64,
}

/// Declares a GGUF file's metadata and tensors; [`GgufWriter::begin_data`] then writes the header and returns the
/// [`TensorDataWriter`] that takes the tensor bytes.
///
/// ```no_run
/// use nebula_engine::gguf::{GgmlType, GgufWriter};
/// let mut w = GgufWriter::create("model.gguf", 32)?;
/// w.add_kv("general.architecture", "qwen4exp")?;
/// w.add_kv("qwen4exp.block_count", 48u32)?;
/// w.add_tensor("output_hc_norm.weight", &[10240], GgmlType::F32)?;
/// let mut data = w.begin_data()?;
/// data.write_tensor("output_hc_norm.weight", &vec![0u8; 10240 * 4])?;
/// data.finish()?;
/// # Ok::<(), nebula_engine::gguf::GgufError>(())
/// ```
#[derive(Debug)]
pub struct GgufWriter {
    path: PathBuf,
    alignment: u32,
    max_bytes_per_part: Option<u64>,
    metadata: Metadata,
    tensors: Vec<PlannedTensor>,
    names: HashSet<String>,
    /// Metadata values so far (entries plus array elements), bounded like the reader's.
    n_values: u64,
}

impl GgufWriter {
    /// A writer for `path` with data aligned to `alignment` bytes (32 is the GGUF default; any other value is
    /// recorded as `general.alignment`). Nothing is created on disk until [`Self::begin_data`].
    ///
    /// # Errors
    /// [`GgufErrorKind::WriterAlignment`] unless `alignment` is a nonzero power of two.
    pub fn create(path: impl AsRef<Path>, alignment: u32) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let label = path.display().to_string();
        if !alignment.is_power_of_two() {
            return Err(GgufError::new(label, GgufErrorKind::WriterAlignment { alignment }));
        }
        Ok(Self {
            metadata: Metadata::new(label),
            path,
            alignment,
            max_bytes_per_part: None,
            tensors: Vec::new(),
            names: HashSet::new(),
            n_values: 0,
        })
    }

    /// Splits the output into parts of at most `max_bytes` of tensor data each (a part always holds at least one
    /// tensor, so a larger tensor gets a part of its own), named `<stem>-NNNNN-of-MMMMM.gguf` beside `path` (the
    /// `.gguf` extension of `path` is dropped), with `split.no` (u16), `split.count` (u16) and
    /// `split.tensors.count` (i32) in every part, as `gguf-split` writes them. Part 1 holds all other metadata.
    /// The naming applies even if everything fits in one part (`-00001-of-00001.gguf`).
    pub fn split_max_bytes(&mut self, max_bytes: u64) -> &mut Self {
        self.max_bytes_per_part = Some(max_bytes);
        self
    }

    fn err(&self, kind: GgufErrorKind) -> GgufError {
        GgufError::new(self.path.display().to_string(), kind)
    }

    /// Adds a metadata entry (written in the order added).
    ///
    /// # Errors
    /// A duplicate key; a `split.*` key (the writer writes those); `general.alignment` other than
    /// `MetadataValue::U32` equal to the writer's alignment; an array whose elements do not all have its declared
    /// element type, or nested deeper than [`super::MAX_ARRAY_DEPTH`]; more than [`MAX_METADATA_VALUES`] values in
    /// total (the reader's limit).
    pub fn add_kv(&mut self, key: impl Into<String>, value: impl Into<MetadataValue>) -> Result<()> {
        let key = key.into();
        let value = value.into();
        if self.metadata.contains_key(&key) {
            return Err(self.err(GgufErrorKind::DuplicateKey { key }));
        }
        if [KEY_SPLIT_NO, KEY_SPLIT_COUNT, KEY_SPLIT_TENSORS_COUNT].contains(&key.as_str()) {
            let detail = "use split_max_bytes to write a split model".to_string();
            return Err(self.err(GgufErrorKind::ReservedKey { key, detail }));
        }
        if key == KEY_ALIGNMENT && value != MetadataValue::U32(self.alignment) {
            let detail = format!(
                "it must be u32 {} (the alignment given to GgufWriter::create), got {} {:?}",
                self.alignment,
                value.type_description(),
                value
            );
            return Err(self.err(GgufErrorKind::ReservedKey { key, detail }));
        }
        let mut n_values = 1;
        if let MetadataValue::Array(array) = &value {
            n_values += check_array(&key, array, 1).map_err(|kind| self.err(kind))?;
        }
        match self.n_values.checked_add(n_values).filter(|&n| n <= MAX_METADATA_VALUES) {
            Some(n) => self.n_values = n,
            None => {
                return Err(self.err(GgufErrorKind::TooManyValues { key, limit: MAX_METADATA_VALUES }));
            }
        }
        self.metadata.insert(key, value);
        Ok(())
    }

    /// Declares a tensor with dims in ggml order (`dims[0]` = ne0, contiguous); its size follows from type and
    /// dims. Tensors are written in the order declared.
    ///
    /// # Errors
    /// A duplicate name, a name longer than [`MAX_TENSOR_NAME_BYTES`], more than [`MAX_DIMS`] dims, a zero dim,
    /// `dims[0]` not a multiple of the type's block size, or an element count or size beyond `i64::MAX`.
    pub fn add_tensor(&mut self, name: impl Into<String>, dims: &[u64], ggml_type: GgmlType) -> Result<()> {
        let name = name.into();
        if self.names.contains(&name) {
            return Err(self.err(GgufErrorKind::DuplicateTensor { name }));
        }
        if name.len() > MAX_TENSOR_NAME_BYTES {
            let kind = GgufErrorKind::TensorNameTooLong { name, max: MAX_TENSOR_NAME_BYTES };
            return Err(self.err(kind));
        }
        if dims.len() > MAX_DIMS {
            return Err(self.err(GgufErrorKind::TooManyDims { tensor: name, n_dims: dims.len() as u32 }));
        }
        if let Some(axis) = dims.iter().position(|&d| d == 0) {
            return Err(self.err(GgufErrorKind::ZeroDim { tensor: name, axis, dims: dims.to_vec() }));
        }
        let n_bytes = tensor_bytes(&name, dims, ggml_type).map_err(|kind| self.err(kind))?;
        self.names.insert(name.clone());
        self.tensors.push(PlannedTensor { name, dims: dims.to_vec(), ggml_type, n_bytes });
        Ok(())
    }

    /// Size in bytes of a declared tensor, if declared.
    pub fn tensor_n_bytes(&self, name: &str) -> Option<u64> {
        self.tensors.iter().find(|t| t.name == name).map(|t| t.n_bytes)
    }

    /// Creates the (first) output file, writes its header and returns the writer for tensor data.
    ///
    /// # Errors
    /// I/O errors; more than 65535 parts or more than `i32::MAX` tensors in split mode (the `split.*` key types).
    pub fn begin_data(self) -> Result<TensorDataWriter> {
        let groups = self.plan_parts();
        let split = self.max_bytes_per_part.is_some();
        let n_parts = groups.len();
        if split && (u16::try_from(n_parts).is_err() || i32::try_from(self.tensors.len()).is_err()) {
            return Err(self.err(GgufErrorKind::WriterState {
                detail: format!(
                    "{n_parts} parts / {} tensors exceed what split.count (u16) / split.tensors.count (i32) can hold",
                    self.tensors.len()
                ),
            }));
        }
        let prefix = self.path.with_extension("");
        let mut parts = Vec::with_capacity(n_parts);
        for (i, tensors) in groups.into_iter().enumerate() {
            let path = if split { part_path(&prefix, i as u32 + 1, n_parts as u32) } else { self.path.clone() };
            let header = self.header(i, n_parts, split, tensors.clone());
            parts.push(PartPlan { partial: partial_path(&path), path, header: Some(header), tensors });
        }
        let mut writer = TensorDataWriter {
            alignment: u64::from(self.alignment),
            parts,
            tensors: self.tensors,
            current: None,
            next: 0,
            open_tensor: None,
            poisoned: false,
            finished: false,
        };
        writer.open_part(0)?;
        Ok(writer)
    }

    /// Tensor index ranges of each part (one part unless splitting), grouped greedily like gguf-py: a new part
    /// starts when the current one is not empty and the next tensor would take it over the limit.
    fn plan_parts(&self) -> Vec<Range<usize>> {
        let Some(max) = self.max_bytes_per_part else {
            let everything = 0..self.tensors.len();
            return vec![everything];
        };
        let mut groups = Vec::new();
        let (mut start, mut bytes) = (0usize, 0u64);
        for (i, t) in self.tensors.iter().enumerate() {
            if i > start && bytes.saturating_add(t.n_bytes) > max {
                groups.push(start..i);
                (start, bytes) = (i, 0);
            }
            bytes = bytes.saturating_add(t.n_bytes);
        }
        groups.push(start..self.tensors.len());
        groups
    }

    /// Header of part `part`: magic, version, counts, metadata, tensor infos, padding.
    fn header(&self, part: usize, n_parts: usize, split: bool, tensors: Range<usize>) -> Vec<u8> {
        let mut kv: Vec<(&str, MetadataValue)> = Vec::new();
        if part == 0 {
            kv.extend(self.metadata.iter().map(|(k, v)| (k, v.clone())));
        }
        let alignment_value = MetadataValue::U32(self.alignment);
        if u64::from(self.alignment) != DEFAULT_ALIGNMENT && (part != 0 || !self.metadata.contains_key(KEY_ALIGNMENT)) {
            kv.push((KEY_ALIGNMENT, alignment_value));
        }
        if split {
            kv.push((KEY_SPLIT_NO, MetadataValue::U16(part as u16)));
            kv.push((KEY_SPLIT_COUNT, MetadataValue::U16(n_parts as u16)));
            kv.push((KEY_SPLIT_TENSORS_COUNT, MetadataValue::I32(self.tensors.len() as i32)));
        }

        let mut out = Vec::new();
        out.extend_from_slice(GGUF_MAGIC);
        out.extend_from_slice(&GGUF_VERSION.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(kv.len() as u64).to_le_bytes());
        for (key, value) in &kv {
            put_string(&mut out, key);
            out.extend_from_slice(&value.value_type().id().to_le_bytes());
            put_value(&mut out, value);
        }
        let alignment = u64::from(self.alignment);
        let mut offset = 0u64;
        for t in &self.tensors[tensors] {
            put_string(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset += t.n_bytes.next_multiple_of(alignment);
        }
        out.resize((out.len() as u64).next_multiple_of(alignment) as usize, 0);
        out
    }
}

/// Checks that every element of `array` has its element type, recursively; `depth` is this array's level.
/// Returns the number of elements, counted recursively.
fn check_array(key: &str, array: &MetadataArray, depth: u32) -> Result<u64, GgufErrorKind> {
    if depth > MAX_ARRAY_DEPTH {
        return Err(GgufErrorKind::NestingTooDeep { key: key.to_string(), limit: MAX_ARRAY_DEPTH });
    }
    let mut n = array.values.len() as u64;
    for (index, v) in array.values.iter().enumerate() {
        if v.value_type() != array.elem_type {
            return Err(GgufErrorKind::ArrayElementType {
                key: key.to_string(),
                index,
                found: v.value_type(),
                expected: array.elem_type,
            });
        }
        if let MetadataValue::Array(inner) = v {
            n += check_array(key, inner, depth + 1)?;
        }
    }
    Ok(n)
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Appends a value without its type id.
fn put_value(out: &mut Vec<u8>, value: &MetadataValue) {
    match value {
        MetadataValue::U8(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::Bool(v) => out.push(u8::from(*v)),
        MetadataValue::String(s) => put_string(out, s),
        MetadataValue::Array(a) => {
            out.extend_from_slice(&a.elem_type.id().to_le_bytes());
            out.extend_from_slice(&(a.values.len() as u64).to_le_bytes());
            for v in &a.values {
                put_value(out, v);
            }
        }
        MetadataValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}

/// `<path>.partial`.
fn partial_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push(".partial");
    PathBuf::from(name)
}

/// One output file.
#[derive(Debug)]
struct PartPlan {
    path: PathBuf,
    partial: PathBuf,
    /// Taken when the file is opened.
    header: Option<Vec<u8>>,
    tensors: Range<usize>,
}

/// Takes tensor bytes in declaration order, from [`GgufWriter::begin_data`]. Call [`Self::finish`] at the end.
#[derive(Debug)]
pub struct TensorDataWriter {
    alignment: u64,
    parts: Vec<PartPlan>,
    tensors: Vec<PlannedTensor>,
    /// The open part and its file.
    current: Option<(usize, BufWriter<File>)>,
    /// Index of the next tensor to begin.
    next: usize,
    /// The tensor being written and the bytes received so far.
    open_tensor: Option<(usize, u64)>,
    /// Set by an I/O error: every later call fails.
    poisoned: bool,
    finished: bool,
}

impl TensorDataWriter {
    fn err_for(&self, part: usize, kind: GgufErrorKind) -> GgufError {
        GgufError::new(self.parts[part.min(self.parts.len() - 1)].path.display().to_string(), kind)
    }

    fn state_err(&self, detail: impl Into<String>) -> GgufError {
        let part = self.current.as_ref().map_or(0, |(p, _)| *p);
        self.err_for(part, GgufErrorKind::WriterState { detail: detail.into() })
    }

    fn check_usable(&self) -> Result<()> {
        if self.poisoned {
            return Err(self.state_err("an earlier I/O error left the output incomplete"));
        }
        Ok(())
    }

    fn part_of(&self, tensor: usize) -> usize {
        self.parts.iter().position(|p| p.tensors.contains(&tensor)).unwrap_or(0)
    }

    /// Runs an I/O step on part `part`, poisoning the writer on failure.
    fn io<T>(&mut self, part: usize, op: &str, f: impl FnOnce(&mut Self) -> std::io::Result<T>) -> Result<T> {
        f(self).map_err(|e| {
            self.poisoned = true;
            self.err_for(part, GgufErrorKind::io(op, e))
        })
    }

    /// Flushes and closes the open part, then creates part `part` and writes its header.
    fn open_part(&mut self, part: usize) -> Result<()> {
        self.close_current()?;
        let header = self.parts[part].header.take().unwrap_or_default();
        let partial = self.parts[part].partial.clone();
        let file = self.io(part, "create the output file", |_| File::create(&partial))?;
        let mut file = BufWriter::with_capacity(WRITE_BUFFER_BYTES, file);
        self.io(part, "write the header", |_| file.write_all(&header))?;
        self.current = Some((part, file));
        Ok(())
    }

    fn close_current(&mut self) -> Result<()> {
        if let Some((part, file)) = self.current.take() {
            self.io(part, "flush the output file", |_| {
                let mut file = file.into_inner().map_err(|e| e.into_error())?;
                // A trailing hole (`write_hole`) is not in the file until its length covers it.
                let end = file.stream_position()?;
                if file.metadata()?.len() < end {
                    file.set_len(end)?;
                }
                file.sync_all()
            })?;
        }
        Ok(())
    }

    /// The name of the tensor expected next, or `None` when all have been written.
    pub fn next_tensor(&self) -> Option<&str> {
        match self.open_tensor {
            Some((i, _)) => Some(&self.tensors[i].name),
            None => self.tensors.get(self.next).map(|t| t.name.as_str()),
        }
    }

    /// Writes all of tensor `name`'s bytes (exactly its declared size) and its padding.
    ///
    /// # Errors
    /// [`GgufErrorKind::UnexpectedTensor`] if `name` is not the next declared tensor,
    /// [`GgufErrorKind::TensorSizeMismatch`] if `data` has the wrong length (nothing is written in either case, so
    /// the caller may retry), I/O errors.
    pub fn write_tensor(&mut self, name: &str, data: &[u8]) -> Result<()> {
        self.check_usable()?;
        let index = self.expect_next(name)?;
        let expected = self.tensors[index].n_bytes;
        if data.len() as u64 != expected {
            let kind = GgufErrorKind::TensorSizeMismatch { tensor: name.to_string(), expected, got: data.len() as u64 };
            return Err(self.err_for(self.part_of(index), kind));
        }
        self.begin_tensor(name)?;
        self.write_chunk(data)?;
        self.end_tensor()
    }

    /// Starts tensor `name` for chunked writing with [`Self::write_chunk`]; finish it with [`Self::end_tensor`].
    ///
    /// # Errors
    /// Another tensor still open, `name` not the next declared tensor, I/O errors.
    pub fn begin_tensor(&mut self, name: &str) -> Result<()> {
        self.check_usable()?;
        let index = self.expect_next(name)?;
        let part = self.part_of(index);
        if self.current.as_ref().map(|(p, _)| *p) != Some(part) {
            self.open_part(part)?;
        }
        self.open_tensor = Some((index, 0));
        self.next = index + 1;
        Ok(())
    }

    fn expect_next(&self, name: &str) -> Result<usize> {
        if let Some((i, _)) = self.open_tensor {
            return Err(
                self.state_err(format!("tensor '{}' is still open; call end_tensor first", self.tensors[i].name))
            );
        }
        match self.tensors.get(self.next) {
            Some(t) if t.name == name => Ok(self.next),
            other => {
                let expected = other.map_or("no more tensors".to_string(), |t| format!("'{}'", t.name));
                let part = self.part_of(self.next.min(self.tensors.len().saturating_sub(1)));
                Err(self.err_for(part, GgufErrorKind::UnexpectedTensor { got: name.to_string(), expected }))
            }
        }
    }

    /// Appends bytes to the open tensor.
    ///
    /// # Errors
    /// No tensor open, more bytes than the tensor's size (nothing is written), I/O errors.
    pub fn write_chunk(&mut self, chunk: &[u8]) -> Result<()> {
        self.check_usable()?;
        let Some((index, written)) = self.open_tensor else {
            return Err(self.state_err("write_chunk without begin_tensor"));
        };
        let expected = self.tensors[index].n_bytes;
        let got = written.saturating_add(chunk.len() as u64);
        let part = self.part_of(index);
        if got > expected {
            let kind = GgufErrorKind::TensorSizeMismatch { tensor: self.tensors[index].name.clone(), expected, got };
            return Err(self.err_for(part, kind));
        }
        self.io(part, "write tensor data", |w| match &mut w.current {
            Some((_, file)) => file.write_all(chunk),
            None => Err(std::io::Error::other("no open output file")),
        })?;
        self.open_tensor = Some((index, got));
        Ok(())
    }

    /// Appends `n` zero bytes to the open tensor as a hole in the file (a seek, nothing written: on file systems
    /// with sparse files the zeros take no disk and no write time). A file that ends in a hole is extended to
    /// its full length when it is closed.
    ///
    /// # Errors
    /// No tensor open, more bytes than the tensor's size (nothing is skipped), I/O errors.
    pub fn write_hole(&mut self, n: u64) -> Result<()> {
        self.check_usable()?;
        let Some((index, written)) = self.open_tensor else {
            return Err(self.state_err("write_hole without begin_tensor"));
        };
        let expected = self.tensors[index].n_bytes;
        let got = written.saturating_add(n);
        let part = self.part_of(index);
        if got > expected {
            let kind = GgufErrorKind::TensorSizeMismatch { tensor: self.tensors[index].name.clone(), expected, got };
            return Err(self.err_for(part, kind));
        }
        self.io(part, "skip over tensor data", |w| match &mut w.current {
            Some((_, file)) => {
                let delta = i64::try_from(n).map_err(std::io::Error::other)?;
                file.seek(SeekFrom::Current(delta)).map(|_| ())
            }
            None => Err(std::io::Error::other("no open output file")),
        })?;
        self.open_tensor = Some((index, got));
        Ok(())
    }

    /// Ends the open tensor, writing its padding.
    ///
    /// # Errors
    /// No tensor open, fewer bytes written than its size (the tensor stays open), I/O errors.
    pub fn end_tensor(&mut self) -> Result<()> {
        self.check_usable()?;
        let Some((index, written)) = self.open_tensor else {
            return Err(self.state_err("end_tensor without begin_tensor"));
        };
        let expected = self.tensors[index].n_bytes;
        let part = self.part_of(index);
        if written != expected {
            let kind =
                GgufErrorKind::TensorSizeMismatch { tensor: self.tensors[index].name.clone(), expected, got: written };
            return Err(self.err_for(part, kind));
        }
        let padding = (expected.next_multiple_of(self.alignment) - expected) as usize;
        self.io(part, "write padding", |w| match &mut w.current {
            Some((_, file)) => file.write_all(&vec![0u8; padding]),
            None => Err(std::io::Error::other("no open output file")),
        })?;
        self.open_tensor = None;
        Ok(())
    }

    /// Checks that every tensor was written, flushes and syncs the files and renames them into place. Returns the
    /// paths written (one, or every part in order).
    ///
    /// # Errors
    /// [`GgufErrorKind::MissingTensors`] if tensors were declared but not written (the partial files are removed
    /// when the writer is dropped), I/O errors.
    pub fn finish(mut self) -> Result<Vec<PathBuf>> {
        self.check_usable()?;
        let missing_from = match self.open_tensor {
            Some((i, _)) => Some(i),
            None => (self.next < self.tensors.len()).then_some(self.next),
        };
        if let Some(first) = missing_from {
            let kind = GgufErrorKind::MissingTensors {
                missing: self.tensors.len() - first,
                first: self.tensors[first].name.clone(),
            };
            return Err(self.err_for(self.part_of(first), kind));
        }
        // Parts without tensors (only possible for a model with no tensors at all) still get their header.
        for part in 0..self.parts.len() {
            if self.parts[part].header.is_some() {
                self.open_part(part)?;
            }
        }
        self.close_current()?;
        for part in 0..self.parts.len() {
            let (from, to) = (self.parts[part].partial.clone(), self.parts[part].path.clone());
            self.io(part, "rename the finished file into place", |_| std::fs::rename(&from, &to))?;
        }
        self.finished = true;
        Ok(self.parts.iter().map(|p| p.path.clone()).collect())
    }
}

impl Drop for TensorDataWriter {
    fn drop(&mut self) {
        if !self.finished {
            self.current = None;
            for p in &self.parts {
                // Best effort: the file may never have been created.
                let _ = std::fs::remove_file(&p.partial);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hole_reads_as_zeros_and_a_trailing_hole_extends_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.gguf");
        let mut w = GgufWriter::create(&path, 32).unwrap();
        w.add_kv("general.architecture", "test").unwrap();
        w.add_tensor("a", &[8], GgmlType::F32).unwrap();
        w.add_tensor("hole", &[1 << 20], GgmlType::F32).unwrap();
        let mut d = w.begin_data().unwrap();
        d.write_tensor("a", &[7u8; 32]).unwrap();
        d.begin_tensor("hole").unwrap();
        d.write_chunk(&[1, 2, 3, 4]).unwrap();
        assert!(d.write_hole(4 << 20).is_err(), "past the tensor's end");
        d.write_hole((4 << 20) - 4).unwrap();
        d.end_tensor().unwrap();
        d.finish().unwrap();
        let f = crate::gguf::GgufFile::open(&path).unwrap();
        let t = f.tensors().find(|t| t.name == "hole").unwrap();
        let bytes = f.tensor_data(t);
        assert_eq!(bytes.len(), 4 << 20);
        assert_eq!(&bytes[..4], &[1, 2, 3, 4]);
        assert!(bytes[4..].iter().all(|&b| b == 0));
        assert_eq!(f.tensor_data(f.tensors().next().unwrap()), &[7u8; 32]);
    }
    use crate::gguf::{GgufFile, ValueType};

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("nebula-gguf-writer-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn declaration_errors() {
        let mut w = GgufWriter::create("x.gguf", 32).unwrap();
        assert!(matches!(GgufWriter::create("x.gguf", 48).unwrap_err().kind(), GgufErrorKind::WriterAlignment { .. }));
        assert!(matches!(GgufWriter::create("x.gguf", 0).unwrap_err().kind(), GgufErrorKind::WriterAlignment { .. }));
        w.add_kv("a", 1u32).unwrap();
        assert!(matches!(w.add_kv("a", 2u32).unwrap_err().kind(), GgufErrorKind::DuplicateKey { .. }));
        assert!(matches!(w.add_kv("split.count", 2u16).unwrap_err().kind(), GgufErrorKind::ReservedKey { .. }));
        assert!(matches!(w.add_kv("general.alignment", 64u32).unwrap_err().kind(), GgufErrorKind::ReservedKey { .. }));
        w.add_kv("general.alignment", 32u32).unwrap();
        let bad = MetadataArray::new(ValueType::U32, vec![MetadataValue::U32(1), MetadataValue::I32(2)]);
        let e = w.add_kv("arr", bad).unwrap_err();
        assert_eq!(
            e.to_string(),
            "x.gguf: key 'arr': array element 1 has type i32, but the array's element type is u32"
        );
        let mut deep = MetadataArray::new(ValueType::U8, vec![]);
        for _ in 0..MAX_ARRAY_DEPTH {
            deep = MetadataArray::new(ValueType::Array, vec![MetadataValue::Array(deep)]);
        }
        assert!(matches!(w.add_kv("deep", deep).unwrap_err().kind(), GgufErrorKind::NestingTooDeep { .. }));
        let big = MetadataValue::from(vec![0u8; MAX_METADATA_VALUES as usize]);
        let e = w.add_kv("big", big).unwrap_err();
        assert!(matches!(e.kind(), GgufErrorKind::TooManyValues { .. }), "{e}");
        w.add_kv("fits", vec![0u8; 1000]).unwrap();
        w.add_tensor("t", &[32, 2], GgmlType::Q8_0).unwrap();
        assert_eq!(w.tensor_n_bytes("t"), Some(68));
        assert!(matches!(
            w.add_tensor("t", &[4], GgmlType::F32).unwrap_err().kind(),
            GgufErrorKind::DuplicateTensor { .. }
        ));
        let e = w.add_tensor("q", &[33], GgmlType::Q8_0).unwrap_err();
        assert!(matches!(e.kind(), GgufErrorKind::RowNotBlockMultiple { ne0: 33, .. }), "{e}");
        assert!(matches!(
            w.add_tensor("z", &[4, 0], GgmlType::F32).unwrap_err().kind(),
            GgufErrorKind::ZeroDim { axis: 1, .. }
        ));
        let long = "x".repeat(64);
        let e = w.add_tensor(&long, &[1], GgmlType::F32).unwrap_err();
        assert!(matches!(e.kind(), GgufErrorKind::TensorNameTooLong { max: 63, .. }), "{e}");
        w.add_tensor(&long[..63], &[1], GgmlType::F32).unwrap();
        assert!(matches!(
            w.add_tensor("d", &[1; 5], GgmlType::F32).unwrap_err().kind(),
            GgufErrorKind::TooManyDims { .. }
        ));
        let e = w.add_tensor("o", &[1 << 32, 1 << 31], GgmlType::F32).unwrap_err();
        assert!(matches!(e.kind(), GgufErrorKind::TensorSizeOverflow { .. }), "{e}");
    }

    #[test]
    fn data_order_and_size_are_enforced_and_partial_files_cleaned_up() {
        let dir = temp_dir("order");
        let path = dir.join("m.gguf");
        let mut w = GgufWriter::create(&path, 32).unwrap();
        w.add_tensor("a", &[4], GgmlType::F32).unwrap();
        w.add_tensor("b", &[3], GgmlType::F16).unwrap();
        let mut d = w.begin_data().unwrap();
        assert_eq!(d.next_tensor(), Some("a"));
        let e = d.write_tensor("b", &[0; 6]).unwrap_err();
        assert_eq!(e.to_string(), format!("{}: tensor data out of order: got 'b', expected 'a'", path.display()));
        let e = d.write_tensor("a", &[0; 15]).unwrap_err();
        assert!(matches!(e.kind(), GgufErrorKind::TensorSizeMismatch { expected: 16, got: 15, .. }));
        assert!(matches!(d.write_chunk(&[0]).unwrap_err().kind(), GgufErrorKind::WriterState { .. }));
        d.begin_tensor("a").unwrap();
        d.write_chunk(&[1; 10]).unwrap();
        let e = d.write_chunk(&[1; 7]).unwrap_err();
        assert!(matches!(e.kind(), GgufErrorKind::TensorSizeMismatch { expected: 16, got: 17, .. }));
        assert!(matches!(d.end_tensor().unwrap_err().kind(), GgufErrorKind::TensorSizeMismatch { got: 10, .. }));
        d.write_chunk(&[1; 6]).unwrap();
        d.end_tensor().unwrap();
        assert!(dir.join("m.gguf.partial").exists());
        let e = d.finish().unwrap_err();
        assert!(matches!(e.kind(), GgufErrorKind::MissingTensors { missing: 1, first } if first == "b"), "{e}");
        assert!(!dir.join("m.gguf.partial").exists(), "dropping an unfinished writer removes its partial file");
        assert!(!path.exists());

        let mut w = GgufWriter::create(&path, 32).unwrap();
        w.add_tensor("a", &[4], GgmlType::F32).unwrap();
        let mut d = w.begin_data().unwrap();
        d.write_tensor("a", &[7; 16]).unwrap();
        let e = d.write_tensor("a", &[7; 16]).unwrap_err();
        assert!(matches!(e.kind(), GgufErrorKind::UnexpectedTensor { expected, .. } if expected == "no more tensors"));
        assert_eq!(d.finish().unwrap(), vec![path.clone()]);
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.tensor_data_by_name("a").unwrap(), &[7; 16]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
