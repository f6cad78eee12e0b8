//! [`GgufFile`]: a memory-mapped GGUF model (one file, or every part of a split model) with its metadata and a
//! validated tensor directory.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::KEY_ARCHITECTURE;
use super::error::{GgufError, GgufErrorKind, Result};
use super::metadata::Metadata;
use super::parse::{ParsedFile, parse};
use super::split::{KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT, SplitPath};
use super::types::{MetadataArray, MetadataValue, TensorInfo};

/// A parsed GGUF model: metadata from the (first) file, tensors from every part, data as zero-copy slices of the
/// read-only memory maps.
///
/// Opening validates everything listed in [`super`]'s module docs, so every [`TensorInfo`] it hands out has
/// in-bounds, aligned, non-overlapping data. `GgufFile` is `Send + Sync`; share it with an `Arc`.
pub struct GgufFile {
    /// Part 1's path, or the label for [`GgufFile::from_bytes`].
    path: PathBuf,
    parts: Vec<Part>,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

/// One file of the model.
struct Part {
    path: PathBuf,
    bytes: Bytes,
    version: u32,
    alignment: u64,
    data_offset: u64,
}

enum Bytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("parts", &self.parts.iter().map(|p| (&p.path, p.bytes.as_slice().len())).collect::<Vec<_>>())
            .field("metadata_entries", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Maps `path` read-only.
fn map_file(path: &Path) -> Result<Bytes> {
    let label = path.display().to_string();
    let io = |op: &str, e| GgufError::new(&label, GgufErrorKind::io(op, e));
    let file = File::open(path).map_err(|e| io("open the file", e))?;
    let len = file.metadata().map_err(|e| io("read the file's size", e))?.len();
    if len == 0 {
        return Ok(Bytes::Owned(Vec::new()));
    }
    // SAFETY: the map is read-only and private to this process. If another process truncates or rewrites the file
    // while it is mapped, reads may fault or see new bytes; model files are not modified while being served.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| io("memory-map the file", e))?;
    Ok(Bytes::Mapped(map))
}

impl GgufFile {
    /// Opens and validates a GGUF file, memory-mapping it read-only.
    ///
    /// If the file name follows the split pattern `<prefix>-NNNNN-of-MMMMM.gguf` with MMMMM > 1, every part is
    /// opened, whichever part `path` names (a middle part opens the whole set; [`Self::path`] is then part 1).
    /// Metadata comes from part 1; tensors come from all parts in part order. Each part must exist, carry
    /// `split.no` = its 0-based index and `split.count` = MMMMM, and part 1's `split.tensors.count` must equal the
    /// number of tensors over all parts. A file with `split.count` > 1 whose name does not follow the pattern is
    /// an error (the other parts cannot be found).
    ///
    /// # Errors
    /// I/O errors, any malformed or hostile content ([`GgufErrorKind`] lists them), a missing part
    /// ([`GgufErrorKind::MissingSplitPart`]) or inconsistent `split.*` keys ([`GgufErrorKind::SplitMismatch`]).
    /// The error names the file it is about.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        match SplitPath::parse(path) {
            Some(split) if split.count > 1 => Self::open_split(path, &split),
            _ => {
                let bytes = map_file(path)?;
                let label = path.display().to_string();
                let parsed = parse(&label, bytes.as_slice())?;
                let count = parsed.metadata.get_u64_opt(KEY_SPLIT_COUNT)?;
                if let Some(count) = count.filter(|&c| c > 1) {
                    return Err(GgufError::new(
                        label,
                        GgufErrorKind::SplitMismatch {
                            detail: format!(
                                "'{KEY_SPLIT_COUNT}' = {count}, but the file name does not follow the split \
                                 pattern '<name>-00001-of-{count:05}.gguf', so the other parts cannot be found"
                            ),
                        },
                    ));
                }
                Ok(Self::assemble(path.to_path_buf(), vec![(path.to_path_buf(), bytes, parsed)]))
            }
        }
    }

    /// Parses a GGUF file held in memory (tests, fuzzing). `label` stands for the path in errors and in
    /// [`Self::path`]. The bytes are parsed as one file: `split.*` keys are kept as metadata but not followed.
    ///
    /// # Errors
    /// As [`Self::open`], without the I/O and split errors.
    pub fn from_bytes(label: &str, bytes: Vec<u8>) -> Result<Self> {
        let parsed = parse(label, &bytes)?;
        Ok(Self::assemble(PathBuf::from(label), vec![(PathBuf::from(label), Bytes::Owned(bytes), parsed)]))
    }

    fn open_split(given: &Path, split: &SplitPath) -> Result<Self> {
        let paths: Vec<PathBuf> = (1..=split.count).map(|no| split.part(no)).collect();
        let given_label = given.display().to_string();
        for p in &paths {
            match p.try_exists() {
                Ok(true) => {}
                Ok(false) => {
                    return Err(GgufError::new(
                        given_label,
                        GgufErrorKind::MissingSplitPart { part: p.display().to_string() },
                    ));
                }
                Err(e) => {
                    return Err(GgufError::new(
                        p.display().to_string(),
                        GgufErrorKind::io("check that the split part exists", e),
                    ));
                }
            }
        }

        let mut parts = Vec::with_capacity(paths.len());
        let mut total_tensors: u64 = 0;
        for (i, p) in paths.iter().enumerate() {
            let label = p.display().to_string();
            let mismatch = |detail: String| GgufError::new(&label, GgufErrorKind::SplitMismatch { detail });
            let bytes = map_file(p)?;
            let parsed = parse(&label, bytes.as_slice())?;
            let count = parsed.metadata.get_u64_opt(KEY_SPLIT_COUNT)?;
            if count != Some(u64::from(split.count)) {
                return Err(mismatch(format!(
                    "the file name says {} parts, but '{KEY_SPLIT_COUNT}' is {}",
                    split.count,
                    count.map_or("absent".to_string(), |c| c.to_string())
                )));
            }
            let no = parsed.metadata.get_u64_opt(KEY_SPLIT_NO)?;
            if no != Some(i as u64) {
                return Err(mismatch(format!(
                    "this is part {} of {}, so '{KEY_SPLIT_NO}' should be {i}, but it is {}",
                    i + 1,
                    split.count,
                    no.map_or("absent".to_string(), |n| n.to_string())
                )));
            }
            total_tensors += parsed.tensors.len() as u64;
            parts.push((p.clone(), bytes, parsed));
        }

        let first = &parts[0];
        let first_label = first.0.display().to_string();
        let declared = first.2.metadata.get_u64_opt(KEY_SPLIT_TENSORS_COUNT)?;
        if declared != Some(total_tensors) {
            return Err(GgufError::new(
                first_label,
                GgufErrorKind::SplitMismatch {
                    detail: format!(
                        "'{KEY_SPLIT_TENSORS_COUNT}' is {}, but the {} parts hold {total_tensors} tensors",
                        declared.map_or("absent".to_string(), |n| n.to_string()),
                        split.count
                    ),
                },
            ));
        }
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (i, (p, _, parsed)) in parts.iter().enumerate() {
            for t in &parsed.tensors {
                if seen.insert(&t.name, i).is_some() {
                    return Err(GgufError::new(
                        p.display().to_string(),
                        GgufErrorKind::DuplicateTensor { name: t.name.clone() },
                    ));
                }
            }
        }
        let first_path = parts[0].0.clone();
        Ok(Self::assemble(first_path, parts))
    }

    /// Builds the file from parsed parts (tensor names already known to be unique).
    fn assemble(path: PathBuf, parsed_parts: Vec<(PathBuf, Bytes, ParsedFile)>) -> Self {
        let mut parts = Vec::with_capacity(parsed_parts.len());
        let mut tensors = Vec::new();
        let mut metadata = None;
        for (split, (part_path, bytes, parsed)) in parsed_parts.into_iter().enumerate() {
            for mut t in parsed.tensors {
                t.split = split;
                t.index = tensors.len();
                tensors.push(t);
            }
            if metadata.is_none() {
                metadata = Some(parsed.metadata);
            }
            parts.push(Part {
                path: part_path,
                bytes,
                version: parsed.version,
                alignment: parsed.alignment,
                data_offset: parsed.data_offset,
            });
        }
        let by_name = tensors.iter().map(|t: &TensorInfo| (t.name.clone(), t.index)).collect();
        Self { path, parts, metadata: metadata.unwrap_or_default(), tensors, by_name }
    }

    /// True when the parts are memory-mapped files ([`Self::open`]), false for bytes held in memory
    /// ([`Self::from_bytes`]).
    pub fn is_mapped(&self) -> bool {
        self.parts.iter().all(|p| matches!(p.bytes, Bytes::Mapped(_)))
    }

    /// All bytes of part `split` (0-based): the memory map, or the bytes given to [`Self::from_bytes`].
    pub fn part_bytes(&self, split: usize) -> Option<&[u8]> {
        self.parts.get(split).map(|p| p.bytes.as_slice())
    }

    /// Where `bytes`, a slice of this file's data (e.g. a tensor or part of one), lies: its part (0-based) and
    /// absolute offset in that part. `None` when the slice is not inside one part's bytes.
    pub fn locate(&self, bytes: &[u8]) -> Option<(usize, u64)> {
        let (start, end) = (bytes.as_ptr() as usize, bytes.as_ptr() as usize + bytes.len());
        self.parts.iter().enumerate().find_map(|(i, p)| {
            let all = p.bytes.as_slice();
            let base = all.as_ptr() as usize;
            (start >= base && end <= base + all.len()).then(|| (i, (start - base) as u64))
        })
    }

    /// The path opened (part 1 for a split model), or the label given to [`Self::from_bytes`].
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The paths of all parts, in order (one for an unsplit file).
    pub fn part_paths(&self) -> impl ExactSizeIterator<Item = &Path> {
        self.parts.iter().map(|p| p.path.as_path())
    }

    /// Number of files (1 unless split).
    pub fn n_parts(&self) -> usize {
        self.parts.len()
    }

    /// GGUF version of part 1 (2 or 3).
    pub fn version(&self) -> u32 {
        self.parts.first().map_or(0, |p| p.version)
    }

    /// Data alignment of part 1 in bytes (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.parts.first().map_or(super::DEFAULT_ALIGNMENT, |p| p.alignment)
    }

    /// Absolute offset of the data section of part `split` (0-based), if that part exists.
    pub fn data_offset(&self, split: usize) -> Option<u64> {
        self.parts.get(split).map(|p| p.data_offset)
    }

    /// All metadata (of part 1 for a split model), in file order, with the typed getters.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.metadata.get(key)
    }

    /// `general.architecture`, e.g. "qwen4exp".
    ///
    /// # Errors
    /// Missing key, or not a string.
    pub fn architecture(&self) -> Result<&str> {
        self.metadata.get_str(KEY_ARCHITECTURE)
    }

    /// Tensors in file order (part 1's first, then part 2's, ...).
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = &TensorInfo> {
        self.tensors.iter()
    }

    /// Number of tensors over all parts.
    pub fn n_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// The tensor named `name`, if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of `info`'s data: a zero-copy slice of its part's memory map, `info.n_bytes` long.
    ///
    /// The range used is the one validated when the file was opened (looked up by `info`'s position and name),
    /// so edits to a cloned `TensorInfo`'s public fields cannot make it read out of bounds.
    ///
    /// # Panics
    /// If `info` did not come from this file (no tensor of this name at that position).
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let own = self
            .tensors
            .get(info.index)
            .filter(|t| t.name == info.name)
            .unwrap_or_else(|| panic!("tensor '{}' does not belong to {}", info.name, self.path.display()));
        self.data_of(own)
    }

    /// The data of the tensor named `name`, if present.
    pub fn tensor_data_by_name(&self, name: &str) -> Option<&[u8]> {
        self.tensor(name).map(|t| self.data_of(t))
    }

    fn data_of(&self, own: &TensorInfo) -> &[u8] {
        let bytes = self.parts[own.split].bytes.as_slice();
        let range = (own.offset as usize)..((own.offset + own.n_bytes) as usize);
        // Checked at open: the range is inside the part.
        &bytes[range]
    }
}

/// Delegates getters to [`Metadata`].
macro_rules! delegate_getters {
    ($($name:ident -> $t:ty;)*) => {
        impl GgufFile {
            $(
                #[doc = concat!("[`Metadata::", stringify!($name), "`] on this file's metadata.")]
                ///
                /// # Errors
                /// As the [`Metadata`] getter; the error names the key and the file.
                pub fn $name(&self, key: &str) -> Result<$t> {
                    self.metadata.$name(key)
                }
            )*
        }
    };
}

delegate_getters! {
    get_u8 -> u8; get_u8_opt -> Option<u8>;
    get_u16 -> u16; get_u16_opt -> Option<u16>;
    get_u32 -> u32; get_u32_opt -> Option<u32>;
    get_i32 -> i32; get_i32_opt -> Option<i32>;
    get_u64 -> u64; get_u64_opt -> Option<u64>;
    get_i64 -> i64; get_i64_opt -> Option<i64>;
    get_usize -> usize; get_usize_opt -> Option<usize>;
    get_f32 -> f32; get_f32_opt -> Option<f32>;
    get_f64 -> f64; get_f64_opt -> Option<f64>;
    get_bool -> bool; get_bool_opt -> Option<bool>;
    get_str -> &str; get_str_opt -> Option<&str>;
    get_array -> &MetadataArray; get_array_opt -> Option<&MetadataArray>;
    get_u32_array -> Vec<u32>; get_u32_array_opt -> Option<Vec<u32>>;
    get_i32_array -> Vec<i32>; get_i32_array_opt -> Option<Vec<i32>>;
    get_u64_array -> Vec<u64>; get_u64_array_opt -> Option<Vec<u64>>;
    get_i64_array -> Vec<i64>; get_i64_array_opt -> Option<Vec<i64>>;
    get_f32_array -> Vec<f32>; get_f32_array_opt -> Option<Vec<f32>>;
    get_bool_array -> Vec<bool>; get_bool_array_opt -> Option<Vec<bool>>;
    get_string_array -> Vec<&str>; get_string_array_opt -> Option<Vec<&str>>;
}
