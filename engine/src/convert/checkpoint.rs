//! Reading a Hugging Face safetensors checkpoint directory (`config.json` + one or more `*.safetensors` shards).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::ConvertError;

/// One tensor of the checkpoint: where it lives and what it is.
#[derive(Debug, Clone)]
pub struct SourceTensor {
    /// Shard index.
    shard: usize,
    /// Element type.
    pub dtype: Dtype,
    /// Shape (PyTorch order, outermost first).
    pub shape: Vec<usize>,
    /// Byte range inside the shard's data.
    range: std::ops::Range<usize>,
}

impl SourceTensor {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A memory-mapped checkpoint with its tensors indexed by name (as stored, prefixes included).
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    tensors: BTreeMap<String, SourceTensor>,
}

impl Checkpoint {
    /// Opens every `*.safetensors` file of `dir` (all of them, in name order; the index file is not needed).
    pub fn open(dir: &Path) -> Result<Self, ConvertError> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| ConvertError::Io { path: dir.to_path_buf(), source: e })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(ConvertError::Input { path: dir.to_path_buf(), problem: "no *.safetensors files".into() });
        }
        let mut shards = Vec::new();
        let mut tensors = BTreeMap::new();
        for (i, path) in files.into_iter().enumerate() {
            let file = File::open(&path).map_err(|e| ConvertError::Io { path: path.clone(), source: e })?;
            // SAFETY: the checkpoint is treated as read-only input; a concurrent writer is outside our contract.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| ConvertError::Io { path: path.clone(), source: e })?;
            let st = SafeTensors::deserialize(&map).map_err(|e| ConvertError::Input {
                path: path.clone(),
                problem: format!("not a safetensors file: {e}"),
            })?;
            let base = map.as_ptr() as usize;
            for (name, view) in st.tensors() {
                let data = view.data();
                let start = data.as_ptr() as usize - base;
                let t = SourceTensor {
                    shard: i,
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    range: start..start + data.len(),
                };
                if tensors.insert(name.clone(), t).is_some() {
                    return Err(ConvertError::Input {
                        path: path.clone(),
                        problem: format!("tensor '{name}' appears in two shards"),
                    });
                }
            }
            drop(st);
            shards.push((path, map));
        }
        Ok(Self { dir: dir.to_path_buf(), shards, tensors })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// All tensor names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The tensor called `name`, if present.
    pub fn get(&self, name: &str) -> Option<&SourceTensor> {
        self.tensors.get(name)
    }

    fn bytes(&self, t: &SourceTensor) -> &[u8] {
        &self.shards[t.shard].1[t.range.clone()]
    }

    /// Elements `[start, start + len)` of `t` (flattened, row-major) as `f32`.
    pub fn read_f32(&self, name: &str, t: &SourceTensor, start: usize, len: usize) -> Result<Vec<f32>, ConvertError> {
        let b = self.bytes(t);
        let width = match t.dtype {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            other => {
                return Err(ConvertError::Input {
                    path: self.shards[t.shard].0.clone(),
                    problem: format!(
                        "tensor '{name}' has dtype {other:?}; only F32, F16 and BF16 weights are supported"
                    ),
                });
            }
        };
        let bytes = b.get(start * width..(start + len) * width).ok_or_else(|| ConvertError::Input {
            path: self.shards[t.shard].0.clone(),
            problem: format!("tensor '{name}' is shorter than its shape says"),
        })?;
        Ok(match t.dtype {
            Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            _ => {
                bytes.chunks_exact(2).map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)).collect()
            }
        })
    }

    /// An integer tensor (the PLE hash buffers, stored as int64) as `i64`s.
    pub fn read_i64(&self, name: &str) -> Result<Vec<i64>, ConvertError> {
        let t = self.get(name).ok_or_else(|| ConvertError::Missing { name: name.to_string() })?;
        let b = self.bytes(t);
        match t.dtype {
            Dtype::I64 => Ok(b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()),
            Dtype::I32 => {
                Ok(b.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64).collect())
            }
            other => Err(ConvertError::Input {
                path: self.shards[t.shard].0.clone(),
                problem: format!("tensor '{name}' has dtype {other:?}, expected an integer type"),
            }),
        }
    }
}
