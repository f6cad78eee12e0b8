//! `nebula convert --imatrix` against llama.cpp (the quantizers with an optional importance matrix).
//!
//! The wide256 golden checkpoint converted to F32, then every weight quantized with the committed importance
//! matrix, byte for byte as llama.cpp's `llama-quantize --pure --imatrix` wrote it for Q4_K, Q5_K, Q6_K, IQ4_NL
//! and IQ4_XS and their 32-block fallbacks (Q5_0, Q5_1, Q8_0, IQ4_NL): the SHA-256 of each tensor is in
//! `tests/fixtures/imatrix/wide256.llama-quantize.json`, written by `scripts/gen_imatrix_fixture.py` (which also
//! writes the matrix in both of llama.cpp's file formats).

use std::collections::BTreeMap;
use std::path::Path;

use nebula_engine::convert::{
    ConvertOptions, ImportanceMatrix, OutType, QuantRecipe, RecipeName, convert, requantize, requantize_with,
};
use nebula_engine::gguf::{GgmlType, GgufFile};
use nebula_engine::model::Qwen4Exp;
use nebula_engine::quant::{dequantize_row, quantize};
use sha2::{Digest, Sha256};

fn fixture(name: &str) -> std::path::PathBuf {
    nebula_tests::repo_root().join("tests/fixtures/imatrix").join(name)
}

/// The wide256 checkpoint as an F32 GGUF (what the fixture script quantized with llama-quantize).
fn f32_gguf(dir: &Path) -> std::path::PathBuf {
    let out = dir.join("w256.gguf");
    let src = nebula_tests::repo_root().join("tests/fixtures/golden/wide256");
    let opts = ConvertOptions { out_type: OutType::F32, include_mtp: false, ..Default::default() };
    convert(&src, &out, &opts).expect("convert wide256");
    out
}

fn ggml_type(name: &str) -> GgmlType {
    GgmlType::ALL.iter().copied().find(|t| t.name().eq_ignore_ascii_case(name)).unwrap_or_else(|| panic!("{name}"))
}

#[test]
fn both_file_formats_hold_the_same_weights() {
    let dat = ImportanceMatrix::load(&fixture("wide256.imatrix.dat")).unwrap();
    let gguf = ImportanceMatrix::load(&fixture("wide256.imatrix.gguf")).unwrap();
    assert_eq!(dat.len(), gguf.len());
    assert!(dat.len() > 50, "{}", dat.len());
    assert_eq!(dat.datasets, gguf.datasets);
    let tmp = tempfile::tempdir().unwrap();
    let f = GgufFile::open(f32_gguf(tmp.path())).unwrap();
    let mut compared = 0;
    for t in f.tensors().filter(|t| t.dims.len() >= 2) {
        let mats = t.dims[2..].iter().product::<u64>() as usize;
        let a = dat.weights(&t.name, t.dims[0] as usize, mats).unwrap();
        let b = gguf.weights(&t.name, t.dims[0] as usize, mats).unwrap();
        assert_eq!(a, b, "{}", t.name);
        compared += a.is_some() as usize;
    }
    assert_eq!(compared, dat.len());
}

#[test]
fn imatrix_quantization_matches_llama_quantize() {
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("wide256.llama-quantize.json")).unwrap()).unwrap();
    let m = ImportanceMatrix::load(&fixture("wide256.imatrix.dat")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let f = GgufFile::open(f32_gguf(tmp.path())).unwrap();
    let mut checked: BTreeMap<String, usize> = BTreeMap::new();
    let mut wrong = Vec::new();
    for (run, tensors) in want["types"].as_object().unwrap() {
        for (name, v) in tensors.as_object().unwrap() {
            let ty = ggml_type(v[0].as_str().unwrap());
            if ty == GgmlType::F32 {
                continue; // left unquantized by llama-quantize
            }
            let t = f.tensors().find(|t| &t.name == name).unwrap_or_else(|| panic!("no tensor {name}"));
            let (cols, rows) = (t.dims[0] as usize, t.dims[1] as usize);
            let mats = t.dims[2..].iter().product::<u64>() as usize;
            let vals: Vec<f32> =
                f.tensor_data(t).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            let w = m.weights(name, cols, mats).unwrap().expect("an entry for every fixture tensor");
            let mut bytes = Vec::new();
            for j in 0..mats {
                let wj = &w[j * cols..(j + 1) * cols];
                let mat = &vals[j * rows * cols..(j + 1) * rows * cols];
                bytes.extend(quantize::quantize_tensor(ty, mat, cols, Some(wj)).unwrap());
            }
            let ours = format!("{:x}", Sha256::digest(&bytes));
            if ours != v[1].as_str().unwrap() {
                wrong.push(format!("{run}: {name} ({})", ty.name()));
            }
            *checked.entry(ty.name().to_string()).or_default() += 1;
        }
    }
    println!("tensors compared per type: {checked:?}");
    assert!(wrong.is_empty(), "{} tensors differ from llama-quantize: {wrong:?}", wrong.len());
    for ty in ["Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"] {
        assert!(checked.get(ty).is_some_and(|&n| n > 0), "no {ty} tensor compared: {checked:?}");
    }
}

/// The importance matrix changes what it should, and only that: through `requantize_with` the covered 4-bit
/// tensors differ from a plain requantization while their importance-weighted squared error is lower, the
/// provenance keys are written, and the model loads and runs.
#[test]
fn requantize_with_imatrix_weights_the_error() {
    let tmp = tempfile::tempdir().unwrap();
    let src = f32_gguf(tmp.path());
    let m = ImportanceMatrix::load(&fixture("wide256.imatrix.gguf")).unwrap();
    let recipe = QuantRecipe::Named(RecipeName::NebulaQ4);
    let (plain, weighted) = (tmp.path().join("plain.gguf"), tmp.path().join("weighted.gguf"));
    requantize(&src, &plain, &recipe).unwrap();
    requantize_with(&src, &weighted, &recipe, Some(&m)).unwrap();
    let (f, p, q) =
        (GgufFile::open(&src).unwrap(), GgufFile::open(&plain).unwrap(), GgufFile::open(&weighted).unwrap());
    // As llama-quantize: the entries in the file.
    assert_eq!(q.metadata().get_i32("quantize.imatrix.entries_count").unwrap() as usize, m.len());
    assert!(q.metadata().get_str("quantize.imatrix.file").unwrap().ends_with("wide256.imatrix.gguf"));
    let (mut lower, mut covered) = (0, 0);
    for t in q.tensors().filter(|t| matches!(t.ggml_type, GgmlType::Q4_K | GgmlType::IQ4_NL)) {
        let (cols, rows) = (t.dims[0] as usize, t.dims[1] as usize);
        let mats = t.dims[2..].iter().product::<u64>() as usize;
        let Some(w) = m.weights(&t.name, cols, mats).unwrap() else { continue };
        covered += 1;
        let x: Vec<f32> = f
            .tensor_data_by_name(&t.name)
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let err = |file: &GgufFile| -> f64 {
            let data = file.tensor_data_by_name(&t.name).unwrap();
            let rb = data.len() / (rows * mats);
            let mut row = vec![0f32; cols];
            let mut e = 0f64;
            for r in 0..rows * mats {
                dequantize_row(t.ggml_type, &data[r * rb..(r + 1) * rb], &mut row).unwrap();
                let wj = &w[(r / rows) * cols..(r / rows + 1) * cols];
                for c in 0..cols {
                    let d = (row[c] - x[r * cols + c]) as f64;
                    e += wj[c] as f64 * d * d;
                }
            }
            e
        };
        assert_ne!(p.tensor_data_by_name(&t.name), q.tensor_data_by_name(&t.name), "{}: imatrix ignored", t.name);
        let (ep, eq) = (err(&p), err(&q));
        lower += (eq < ep) as usize;
        assert!(eq <= ep * 1.02, "{}: weighted error {eq:.4e} with the imatrix, {ep:.4e} without", t.name);
    }
    assert!(covered >= 20 && lower * 10 >= covered * 9, "{lower} of {covered} tensors lowered their weighted error");
    let model = Qwen4Exp::load(&weighted).unwrap();
    let mut state = model.new_state(8);
    let logits = model.forward(&mut state, &[1, 2, 3], nebula_engine::model::LogitsFor::Last).unwrap();
    assert!(logits.iter().all(|v| v.is_finite()));
}

/// An importance matrix that covers nothing of this model (its names are another model's) is refused before
/// anything is written, as is a model file given in its place.
#[test]
fn an_imatrix_for_other_tensors_or_a_model_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = f32_gguf(tmp.path());
    let p = tmp.path().join("other.dat");
    let m = one_entry_dat(&p, "blk.0.some_other_model.weight", 4);
    let out = tmp.path().join("out.gguf");
    let e = requantize_with(&src, &out, &QuantRecipe::Named(RecipeName::NebulaQ4), Some(&m)).unwrap_err().to_string();
    assert!(e.contains("none of its 1 entries"), "{e}");
    let e = ImportanceMatrix::load(&src).unwrap_err().to_string();
    assert!(e.contains("not an importance matrix"), "{e}");
}

/// An importance matrix made for another model is refused before anything is written.
#[test]
fn a_mismatched_imatrix_is_refused_before_writing() {
    let tmp = tempfile::tempdir().unwrap();
    let src = f32_gguf(tmp.path());
    let p = tmp.path().join("other.dat");
    let name = "blk.0.attn_qkv.weight";
    let m = one_entry_dat(&p, name, 100);
    let out = tmp.path().join("out.gguf");
    let e = requantize_with(&src, &out, &QuantRecipe::Named(RecipeName::NebulaQ4), Some(&m)).unwrap_err().to_string();
    assert!(e.contains(name) && e.contains("100 values"), "{e}");
    let written = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
    assert!(written < 4096, "{written} bytes written before the error");
}

/// `nebula imatrix` against `llama-imatrix`: the demo model over `calibration.txt` in chunks of 64 tokens gives
/// the entries llama.cpp's collector gives (all but `ffn_gate_inp_shexp`, the one-row shared-expert gate that
/// Nebula computes as a dot product and that no quantizer touches), with per-column weights within a few percent
/// (dense weights: same token counts, median deviation 0.1 %, largest 4.2 %; experts: routing near-ties move a
/// token or two between experts). The file `write_gguf` writes reads back to the same weights.
#[test]
fn nebula_imatrix_matches_llama_imatrix_on_the_demo_model() {
    use nebula_engine::convert::ImatrixCollector;
    use nebula_engine::text::tokenizer::{GgufVocab, TextTokenizer};
    let path = nebula_tests::repo_root().join("models/nebula-demo.gguf");
    let file = std::sync::Arc::new(GgufFile::open(&path).unwrap());
    let tok = TextTokenizer::from_gguf_vocab(&GgufVocab::from_gguf(&file).unwrap().unwrap()).unwrap();
    let model = Qwen4Exp::from_gguf(file).unwrap();
    let ids = tok.encode_plain(&std::fs::read_to_string(fixture("calibration.txt")).unwrap()).unwrap();
    let chunks: Vec<&[u32]> = ids.chunks_exact(64).collect();
    assert_eq!(chunks.len(), 6, "llama-imatrix ran 6 chunks of 64 tokens");
    let c = ImatrixCollector::new(&model, false);
    assert_eq!(c.run(&model, &chunks).unwrap(), 384);
    assert_eq!(c.unmatched(), 0, "a product on a weight outside the file");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("demo.imatrix.gguf");
    c.write_gguf(&out, "calibration.txt", 6, 64).unwrap();
    let ours = ImportanceMatrix::load(&out).unwrap();
    assert_eq!((ours.chunks, ours.datasets.clone()), (6, vec!["calibration.txt".to_string()]));
    let want = ImportanceMatrix::load(&fixture("demo.llama-imatrix.gguf")).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let (mut dense, mut experts) = (0, 0);
    for t in f.tensors().filter(|t| t.dims.len() >= 2) {
        let (cols, mats) = (t.dims[0] as usize, t.dims[2..].iter().product::<u64>() as usize);
        let (a, b) = (ours.weights(&t.name, cols, mats).unwrap(), want.weights(&t.name, cols, mats).unwrap());
        let (a, b) = match (a, b) {
            (Some(a), Some(b)) => (a, b),
            (None, None) => continue,
            (None, Some(_)) if t.name.contains("ffn_gate_inp_shexp") => continue,
            other => panic!("{}: entry in only one file: {:?}", t.name, (other.0.is_some(), other.1.is_some())),
        };
        assert_eq!(a.len(), b.len(), "{}", t.name);
        let mut rel: Vec<f32> = a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1e-30)).collect();
        rel.sort_by(f32::total_cmp);
        let (median, max) = (rel[rel.len() / 2], rel[rel.len() - 1]);
        if mats == 1 {
            assert!(median < 0.01 && max < 0.1, "{}: median {median:.2e}, max {max:.2e}", t.name);
            dense += 1;
        } else {
            assert!(median < 0.05, "{}: median {median:.2e}", t.name);
            experts += 1;
        }
    }
    assert!(dense >= 50 && experts == 12, "{dense} dense and {experts} expert entries compared");
    // With the head (`--process-output`), every position's logits run, so the head has an entry too.
    let head = ImatrixCollector::new(&model, true);
    head.run(&model, &chunks[..1]).unwrap();
    let hm = head.matrix(&out);
    let h = f.tensors().find(|t| t.name == "output.weight").unwrap();
    assert!(hm.weights("output.weight", h.dims[0] as usize, 1).unwrap().is_some(), "no head entry");
    assert!(direct_has_no_head(&c.matrix(&out), h.dims[0] as usize));
    // The collected weights are what the writer wrote.
    let direct = c.matrix(&out);
    for t in f.tensors().filter(|t| t.dims.len() >= 2) {
        let (cols, mats) = (t.dims[0] as usize, t.dims[2..].iter().product::<u64>() as usize);
        assert_eq!(direct.weights(&t.name, cols, mats).unwrap(), ours.weights(&t.name, cols, mats).unwrap());
    }
}

fn direct_has_no_head(m: &ImportanceMatrix, cols: usize) -> bool {
    m.weights("output.weight", cols, 1).unwrap().is_none()
}

/// Writes a legacy (`.dat`) importance matrix at `p` with one entry `name` of `n` weights 1.0, and loads it.
fn one_entry_dat(p: &Path, name: &str, n: usize) -> ImportanceMatrix {
    let mut b = 1i32.to_le_bytes().to_vec();
    b.extend((name.len() as i32).to_le_bytes());
    b.extend(name.as_bytes());
    b.extend(1i32.to_le_bytes());
    b.extend((n as i32).to_le_bytes());
    b.extend(std::iter::repeat_n(1f32.to_le_bytes(), n).flatten());
    std::fs::write(p, b).unwrap();
    ImportanceMatrix::load(p).unwrap()
}
