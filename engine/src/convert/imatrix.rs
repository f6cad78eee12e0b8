//! Importance matrices for `nebula convert --imatrix FILE`: the per-column activation statistics that llama.cpp's
//! `llama-imatrix` gathers over a calibration text, read in either of its file formats, so that the quantizers
//! weight each column's rounding error by how strongly the model drives it (`quantize_row`'s `imatrix`).
//!
//! Formats (llama.cpp `tools/imatrix/imatrix.cpp`, `tools/quantize/quantize.cpp`):
//! - GGUF (the default since 2025): per entry, an f32 tensor `<name>.in_sum2` `[cols, n_mat]` (sums of squared
//!   activations) and `<name>.counts` `[1, n_mat]` (tokens seen per matrix); metadata `imatrix.datasets` (string
//!   array) and `imatrix.chunk_count`. The weight of column `i` of matrix `j` is `in_sum2[j][i] / counts[j]`, or
//!   1 where a matrix saw no token.
//! - Legacy binary (`.dat`, little-endian): `i32` entry count; per entry `i32` name length, the name, `i32` call
//!   count `ncall`, `i32` value count, `f32` values (each the mean times `ncall`); then `i32` chunk count, `i32`
//!   length and the dataset name. The weight is `value / ncall` (the value itself when `ncall` is 0).
//!
//! Entries are keyed by GGUF tensor name (`blk.3.ffn_down_exps.weight`); a 3-D expert tensor has one row of
//! columns per expert (`n_mat` = experts).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::ConvertError;
use crate::gguf::{GgmlType, GgufFile};

/// An importance matrix: per tensor name, the column weights of each of its matrices.
#[derive(Debug, Clone)]
pub struct ImportanceMatrix {
    /// The file it was read from.
    pub path: PathBuf,
    /// The calibration datasets the file names (may be empty).
    pub datasets: Vec<String>,
    /// Chunks of calibration text the statistics cover (0 when the file does not say).
    pub chunks: u32,
    /// Per tensor: `n_mat * cols` weights, matrix by matrix (every value finite and >= 0).
    entries: HashMap<String, Vec<f32>>,
}

impl ImportanceMatrix {
    /// Reads a GGUF or legacy importance matrix (told apart by the GGUF magic).
    ///
    /// # Errors
    /// [`ConvertError::Io`] when the file cannot be read; [`ConvertError::Input`] naming the file and the
    /// problem when it is truncated, inconsistent (values not a whole number of matrices, a `counts` tensor
    /// that does not match its sums), or holds a negative, NaN or infinite weight (named by entry).
    pub fn load(path: &Path) -> Result<Self, ConvertError> {
        let bytes = std::fs::read(path).map_err(|e| ConvertError::Io { path: path.to_path_buf(), source: e })?;
        let m = if bytes.starts_with(b"GGUF") { Self::from_gguf(path)? } else { Self::from_legacy(path, &bytes)? };
        for (name, w) in &m.entries {
            if let Some(v) = w.iter().find(|v| !v.is_finite() || **v < 0.0) {
                return Err(bad(path, format!("entry '{name}' has the weight {v} (weights must be finite and >= 0)")));
            }
        }
        Ok(m)
    }

    fn from_legacy(path: &Path, b: &[u8]) -> Result<Self, ConvertError> {
        let mut r = Reader { b, at: 0, path };
        let n = r.count("entry count")?;
        let mut entries = HashMap::with_capacity(n.min(1 << 16));
        for _ in 0..n {
            let len = r.count("name length")?;
            if len == 0 || len > 4096 {
                return Err(bad(
                    path,
                    format!(
                        "not an importance matrix: an entry name of {len} bytes at byte {} (expected llama.cpp's GGUF \
                         imatrix or its legacy .dat layout)",
                        r.at - 4
                    ),
                ));
            }
            let name = String::from_utf8(r.take(len, "entry name")?.to_vec())
                .map_err(|_| bad(path, "an entry name is not UTF-8".into()))?;
            let ncall = r.i32(&format!("call count of '{name}'"))?;
            let nval = r.count(&format!("value count of '{name}'"))?;
            let raw = r.take(4 * nval, &format!("values of '{name}'"))?;
            let vals = raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            let w: Vec<f32> = if ncall > 0 { vals.map(|v| v / ncall as f32).collect() } else { vals.collect() };
            if entries.insert(name.clone(), w).is_some() {
                return Err(bad(path, format!("entry '{name}' appears twice")));
            }
        }
        // The trailer (chunk count, dataset name) is optional in old files.
        let chunks = if r.at + 4 <= b.len() { r.i32("chunk count")?.max(0) as u32 } else { 0 };
        let mut datasets = Vec::new();
        if r.at + 4 <= b.len() {
            let len = r.count("dataset name length")?;
            datasets.push(String::from_utf8_lossy(r.take(len, "dataset name")?).into_owned());
        }
        Ok(Self { path: path.to_path_buf(), datasets, chunks, entries })
    }

    fn from_gguf(path: &Path) -> Result<Self, ConvertError> {
        let f = GgufFile::open(path)?;
        let md = f.metadata();
        let datasets = md.get_string_array_opt("imatrix.datasets")?.unwrap_or_default();
        let datasets = datasets.into_iter().map(str::to_string).collect();
        let chunks = md.get_u32_opt("imatrix.chunk_count")?.unwrap_or(0);
        let f32s = |name: &str| -> Result<(Vec<f32>, Vec<u64>), ConvertError> {
            let t = f.tensors().find(|t| t.name == name).ok_or_else(|| bad(path, format!("no tensor '{name}'")))?;
            if t.ggml_type != GgmlType::F32 {
                return Err(bad(path, format!("tensor '{name}' is {}, not F32", t.ggml_type.name())));
            }
            let mut v = vec![0f32; t.dims.iter().product::<u64>() as usize];
            crate::quant::dequantize_row(GgmlType::F32, f.tensor_data(t), &mut v)
                .map_err(|e| bad(path, format!("tensor '{name}': {e}")))?;
            Ok((v, t.dims.clone()))
        };
        if let Some(ty) = md.get_str_opt("general.type")?
            && ty != "imatrix"
        {
            return Err(bad(path, format!("this GGUF is a {ty:?}, not an importance matrix (general.type)")));
        }
        if !f.tensors().any(|t| t.name.ends_with(".in_sum2")) {
            return Err(bad(path, "this GGUF has no `<name>.in_sum2` tensors: not an importance matrix".into()));
        }
        let mut entries = HashMap::new();
        for t in f.tensors() {
            let Some(name) = t.name.strip_suffix(".in_sum2") else { continue };
            let (sums, dims) = f32s(&t.name)?;
            let (counts, _) = f32s(&format!("{name}.counts"))?;
            let cols = dims.first().copied().unwrap_or(0) as usize;
            if cols == 0 || counts.is_empty() || sums.len() != cols * counts.len() {
                return Err(bad(
                    path,
                    format!("entry '{name}': {} sums for {} counts of {cols} columns", sums.len(), counts.len()),
                ));
            }
            entries.insert(name.to_string(), means(&sums, &counts, cols));
        }
        Ok(Self { path: path.to_path_buf(), datasets, chunks, entries })
    }

    /// Entries (tensors) it covers.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it covers no tensor.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The weights for tensor `name` of `cols` columns made of `mats` matrices (experts): `mats * cols` values,
    /// matrix by matrix. `Ok(None)` when the file has no entry for it.
    ///
    /// # Errors
    /// [`ConvertError::Input`] when the entry has another length (the file was made for another model; as
    /// `llama-quantize`, one row for all the experts of a 3-D tensor is refused too).
    pub fn weights(&self, name: &str, cols: usize, mats: usize) -> Result<Option<&[f32]>, ConvertError> {
        let Some(w) = self.entries.get(name) else { return Ok(None) };
        if w.len() == cols * mats {
            Ok(Some(w))
        } else {
            Err(bad(
                &self.path,
                format!("entry '{name}' has {} values; the tensor has {mats} matrices of {cols} columns", w.len()),
            ))
        }
    }
}

/// Per-column weights from sums of squares (`[n_mat, cols]`) and rows seen per matrix, as llama-quantize loads a
/// GGUF imatrix: `sum / count`, or 1 for every column of a matrix that saw no row.
fn means(sums: &[f32], counts: &[f32], cols: usize) -> Vec<f32> {
    let mut w = Vec::with_capacity(sums.len());
    for (row, &c) in sums.chunks_exact(cols).zip(counts) {
        if c > 0.0 { w.extend(row.iter().map(|s| s / c)) } else { w.extend(std::iter::repeat_n(1.0, cols)) }
    }
    w
}

fn bad(path: &Path, problem: String) -> ConvertError {
    ConvertError::Input { path: path.to_path_buf(), problem: format!("importance matrix: {problem}") }
}

/// A bounds-checked little-endian cursor.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl Reader<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], ConvertError> {
        let end =
            self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or_else(|| {
                bad(self.path, format!("truncated at byte {} reading the {what} ({n} bytes)", self.at))
            })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn i32(&mut self, what: &str) -> Result<i32, ConvertError> {
        let s = self.take(4, what)?;
        Ok(i32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }

    /// A non-negative `i32` count.
    fn count(&mut self, what: &str) -> Result<usize, ConvertError> {
        let v = self.i32(what)?;
        usize::try_from(v).map_err(|_| bad(self.path, format!("negative {what} ({v})")))
    }
}

/// Gathers an importance matrix by running the CPU model over calibration text, as llama.cpp's `llama-imatrix`
/// does: for every weight product (through [`crate::quant::set_act_observer`]), per input column the sum of the
/// squared inputs and per matrix the number of input rows (a routed expert counts only its tokens). Written in
/// llama.cpp's GGUF format ([`Self::write_gguf`]), so `llama-quantize --imatrix` reads it too. As llama.cpp
/// (`collect_imatrix`), only the `blk.*` weights are collected (the output head too when asked for:
/// `--process-output`), and a dense product of fewer than 16 input rows is skipped.
pub struct ImatrixCollector {
    /// Weight tensors by the address range of their bytes, sorted by start.
    spans: Vec<Span>,
    stats: std::sync::Mutex<Vec<Option<Stat>>>,
    /// Inputs whose weight matched no span (a copy outside the file), or whose width did not match.
    unmatched: std::sync::atomic::AtomicUsize,
    /// Whether the head's inputs are collected (then every position's logits are computed, as llama-imatrix does).
    process_output: bool,
}

struct Span {
    /// Whether its inputs are collected (a `blk.*` weight, or the head when asked for).
    collect: bool,
    start: usize,
    end: usize,
    name: String,
    cols: usize,
    mat_bytes: usize,
    n_mat: usize,
}

struct Stat {
    sums: Vec<f32>,
    counts: Vec<u64>,
}

impl ImatrixCollector {
    /// A collector for the `blk.*` weights of `model`'s file (tensors of 2 or 3 dimensions; `process_output`:
    /// also the output head `output.weight`).
    pub fn new(model: &crate::model::Qwen4Exp, process_output: bool) -> std::sync::Arc<Self> {
        let f = &model.file;
        let mut spans: Vec<Span> = f
            .tensors()
            .filter(|t| (2..=3).contains(&t.dims.len()))
            .map(|t| {
                let d = f.tensor_data(t);
                let n_mat = t.dims.get(2).copied().unwrap_or(1).max(1) as usize;
                Span {
                    collect: t.name.starts_with("blk.") || (process_output && t.name == "output.weight"),
                    start: d.as_ptr() as usize,
                    end: d.as_ptr() as usize + d.len(),
                    name: t.name.clone(),
                    cols: t.dims[0] as usize,
                    mat_bytes: d.len() / n_mat,
                    n_mat,
                }
            })
            .filter(|s| s.end > s.start)
            .collect();
        spans.sort_by_key(|s| s.start);
        let n = spans.len();
        std::sync::Arc::new(Self {
            spans,
            stats: std::sync::Mutex::new((0..n).map(|_| None).collect()),
            unmatched: Default::default(),
            process_output,
        })
    }

    fn record(&self, ptr: usize, xs: &[f32], n: usize) {
        if n == 0 {
            return;
        }
        let i = self.spans.partition_point(|s| s.start <= ptr);
        let span = i.checked_sub(1).map(|i| (i, &self.spans[i])).filter(|(_, s)| ptr < s.end);
        let Some((i, s)) = span.filter(|(_, s)| xs.len() == n * s.cols) else {
            self.unmatched.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return;
        };
        if !s.collect || (s.n_mat == 1 && n < 16) {
            return; // llama-imatrix skips small dense batches
        }
        let mat = ((ptr - s.start) / s.mat_bytes.max(1)).min(s.n_mat - 1);
        let mut stats = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        let st = stats[i].get_or_insert_with(|| Stat { sums: vec![0.0; s.n_mat * s.cols], counts: vec![0; s.n_mat] });
        let sums = &mut st.sums[mat * s.cols..(mat + 1) * s.cols];
        for row in xs.chunks_exact(s.cols) {
            for (a, &x) in sums.iter_mut().zip(row) {
                *a += x * x;
            }
        }
        st.counts[mat] += n as u64;
    }

    /// Runs `model` over each chunk of tokens from an empty state, collecting; the observer is removed again
    /// whatever happens. Returns the number of tokens evaluated.
    ///
    /// # Errors
    /// A forward pass's error (the statistics gathered so far stay).
    pub fn run(
        self: &std::sync::Arc<Self>,
        model: &crate::model::Qwen4Exp,
        chunks: &[&[u32]],
    ) -> Result<usize, crate::model::ModelError> {
        struct Uninstall;
        impl Drop for Uninstall {
            fn drop(&mut self) {
                crate::quant::set_act_observer(None);
            }
        }
        let me = std::sync::Arc::clone(self);
        crate::quant::set_act_observer(Some(std::sync::Arc::new(move |p, xs, n| me.record(p, xs, n))));
        let _guard = Uninstall;
        let mut tokens = 0;
        for c in chunks {
            let mut state = model.new_state(c.len());
            // The head runs on every position only when its inputs are collected.
            let want = if self.process_output { crate::model::LogitsFor::All } else { crate::model::LogitsFor::Last };
            model.forward(&mut state, c, want)?;
            tokens += c.len();
        }
        Ok(tokens)
    }

    /// Entries with data so far.
    pub fn entries(&self) -> usize {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).iter().filter(|s| s.is_some()).count()
    }

    /// Products whose weight was not found among the file's tensors (0 when every weight is read in place).
    pub fn unmatched(&self) -> usize {
        self.unmatched.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The collected statistics as an [`ImportanceMatrix`] (weights = sums / counts; 1 for a matrix that saw no
    /// input, as llama-quantize does), named after `path`.
    pub fn matrix(&self, path: &Path) -> ImportanceMatrix {
        let stats = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        let mut entries = HashMap::new();
        for (s, st) in self.spans.iter().zip(stats.iter()) {
            let Some(st) = st else { continue };
            let counts: Vec<f32> = st.counts.iter().map(|&c| c as f32).collect();
            entries.insert(s.name.clone(), means(&st.sums, &counts, s.cols));
        }
        ImportanceMatrix { path: path.to_path_buf(), datasets: Vec::new(), chunks: 0, entries }
    }

    /// Writes llama.cpp's GGUF importance-matrix format: per entry `<name>.in_sum2` (f32 `[cols, n_mat]`) and
    /// `<name>.counts` (f32 `[1, n_mat]`), names sorted; `general.type = imatrix`, `imatrix.datasets`,
    /// `imatrix.chunk_count`, `imatrix.chunk_size`.
    ///
    /// # Errors
    /// Writing the file failed.
    pub fn write_gguf(&self, path: &Path, dataset: &str, chunks: u32, chunk_size: u32) -> Result<(), ConvertError> {
        let stats = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        let mut order: Vec<usize> = (0..self.spans.len()).filter(|&i| stats[i].is_some()).collect();
        order.sort_by(|&a, &b| self.spans[a].name.cmp(&self.spans[b].name));
        let mut w = crate::gguf::GgufWriter::create(path, 32)?;
        w.add_kv("general.type", "imatrix")?;
        w.add_kv("imatrix.datasets", vec![dataset])?;
        w.add_kv("imatrix.chunk_count", chunks)?;
        w.add_kv("imatrix.chunk_size", chunk_size)?;
        for &i in &order {
            let s = &self.spans[i];
            // 2-D `[cols, n_mat]` and `[1, n_mat]`, trailing 1s dropped as ggml writes them.
            let (sum_dims, count_dims) = if s.n_mat == 1 {
                (vec![s.cols as u64], vec![1])
            } else {
                (vec![s.cols as u64, s.n_mat as u64], vec![1, s.n_mat as u64])
            };
            w.add_tensor(format!("{}.in_sum2", s.name), &sum_dims, GgmlType::F32)?;
            w.add_tensor(format!("{}.counts", s.name), &count_dims, GgmlType::F32)?;
        }
        let mut data = w.begin_data()?;
        for &i in &order {
            let (s, st) = (&self.spans[i], stats[i].as_ref().expect("filtered above"));
            data.begin_tensor(&format!("{}.in_sum2", s.name))?;
            data.write_chunk(&st.sums.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
            data.end_tensor()?;
            data.begin_tensor(&format!("{}.counts", s.name))?;
            data.write_chunk(&st.counts.iter().flat_map(|&c| (c as f32).to_le_bytes()).collect::<Vec<u8>>())?;
            data.end_tensor()?;
        }
        data.finish()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn legacy(entries: &[(&str, i32, &[f32])]) -> Vec<u8> {
        let mut b = (entries.len() as i32).to_le_bytes().to_vec();
        for (name, ncall, vals) in entries {
            b.extend((name.len() as i32).to_le_bytes());
            b.extend(name.as_bytes());
            b.extend(ncall.to_le_bytes());
            b.extend((vals.len() as i32).to_le_bytes());
            vals.iter().for_each(|v| b.extend(v.to_le_bytes()));
        }
        b.extend(3i32.to_le_bytes());
        b.extend(4i32.to_le_bytes());
        b.extend(b"wiki");
        b
    }

    #[test]
    fn legacy_values_are_divided_by_the_call_count() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.dat");
        std::fs::write(&p, legacy(&[("a.weight", 2, &[2.0, 4.0, 6.0, 8.0]), ("b.weight", 0, &[1.5, 0.5])])).unwrap();
        let m = ImportanceMatrix::load(&p).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!((m.chunks, m.datasets.clone()), (3, vec!["wiki".to_string()]));
        assert_eq!(m.weights("a.weight", 4, 1).unwrap().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(m.weights("a.weight", 2, 2).unwrap().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(m.weights("b.weight", 2, 1).unwrap().unwrap(), &[1.5, 0.5]);
        // One row for all eight experts is refused, as llama-quantize does.
        assert!(m.weights("b.weight", 2, 8).unwrap_err().to_string().contains("8 matrices of 2 columns"));
        assert!(m.weights("c.weight", 2, 1).unwrap().is_none());
        let e = m.weights("a.weight", 3, 1).unwrap_err().to_string();
        assert!(e.contains("'a.weight'") && e.contains("4 values"), "{e}");
    }

    #[test]
    fn bad_files_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.dat");
        let good = legacy(&[("a.weight", 1, &[1.0, 2.0])]);
        for cut in [2usize, 6, 12, 20] {
            std::fs::write(&p, &good[..cut]).unwrap();
            let e = ImportanceMatrix::load(&p).unwrap_err().to_string();
            assert!(e.contains("importance matrix") && e.contains("truncated"), "{cut}: {e}");
        }
        std::fs::write(&p, legacy(&[("a.weight", 1, &[1.0, f32::NAN])])).unwrap();
        let e = ImportanceMatrix::load(&p).unwrap_err().to_string();
        assert!(e.contains("'a.weight'") && e.contains("NaN"), "{e}");
        std::fs::write(&p, legacy(&[("a.weight", 1, &[-1.0])])).unwrap();
        assert!(ImportanceMatrix::load(&p).unwrap_err().to_string().contains("-1"));
        let mut neg = legacy(&[("a.weight", 1, &[1.0])]);
        neg[0..4].copy_from_slice(&(-5i32).to_le_bytes());
        std::fs::write(&p, neg).unwrap();
        assert!(ImportanceMatrix::load(&p).unwrap_err().to_string().contains("negative entry count"));
        std::fs::write(&p, "this is plain text, not an importance matrix\n").unwrap();
        let e = ImportanceMatrix::load(&p).unwrap_err().to_string();
        assert!(e.contains("not an importance matrix"), "{e}");
        let missing = dir.path().join("none.dat");
        assert!(matches!(ImportanceMatrix::load(&missing), Err(ConvertError::Io { .. })));
    }
}
