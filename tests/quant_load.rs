//! Bad quantized weights at load: a NaN or infinite block scale, an unknown tensor type id, a truncated file.
//! Each is a clear error naming the tensor, never a crash or silent garbage.

use std::path::{Path, PathBuf};

use nebula_engine::convert::{ConvertOptions, QuantRecipe, RecipeName, convert};
use nebula_engine::gguf::{GgmlType, GgufFile};
use nebula_engine::model::Qwen4Exp;

/// The 256-wide golden checkpoint converted with the 4-bit recipe, as bytes.
fn quantized_model(tmp: &Path) -> (PathBuf, Vec<u8>) {
    let out = tmp.join("wide256-q4.gguf");
    let opts = ConvertOptions { recipe: Some(QuantRecipe::Named(RecipeName::NebulaQ4)), ..Default::default() };
    convert(&nebula_tests::repo_root().join("tests/fixtures/golden/wide256"), &out, &opts).unwrap();
    let bytes = std::fs::read(&out).unwrap();
    (out, bytes)
}

/// Offset of tensor `name`'s data in the file (found by its content).
fn data_offset(path: &Path, bytes: &[u8], name: &str) -> usize {
    let f = GgufFile::open(path).unwrap();
    let data = f.tensor_data_by_name(name).unwrap();
    let probe = &data[..data.len().min(256)];
    bytes.windows(probe.len()).position(|w| w == probe).expect("tensor data found")
}

fn load_error(tmp: &Path, bytes: &[u8]) -> String {
    let p = tmp.join("bad.gguf");
    std::fs::write(&p, bytes).unwrap();
    match Qwen4Exp::load(&p) {
        Ok(_) => panic!("a corrupt model loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_non_finite_block_scale_is_an_error_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let (path, good) = quantized_model(tmp.path());
    Qwen4Exp::load(&path).expect("the intact model loads");
    let f = GgufFile::open(&path).unwrap();
    for (name, ty) in [("blk.2.ffn_gate_exps.weight", GgmlType::Q4_K), ("blk.1.ffn_down_exps.weight", GgmlType::IQ4_NL)]
    {
        let info = f.tensor(name).unwrap();
        assert_eq!(info.ggml_type, ty);
        let per_row = info.dims[0] as usize / ty.block_size();
        let want = format!("block {} (row {})", 2 % per_row, 2 / per_row);
        for bits in [0x7e00u16, 0x7c00, 0xfc00] {
            // NaN, +inf, -inf as the f16 `d` of the tensor's third block
            let mut bad = good.clone();
            let at = data_offset(&path, &good, name) + 2 * ty.type_size();
            bad[at..at + 2].copy_from_slice(&bits.to_le_bytes());
            let e = load_error(tmp.path(), &bad);
            assert!(e.contains(name) && e.contains("non-finite scale") && e.contains(&want), "{e}");
        }
    }
}

#[test]
fn an_unknown_type_id_is_an_error_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, good) = quantized_model(tmp.path());
    let name = b"blk.0.attn_qkv.weight";
    // tensor directory entry: u64 name length, name, u32 n_dims, n_dims x u64, u32 type
    let mut at = good.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let n_dims = u32::from_le_bytes(good[at..at + 4].try_into().unwrap()) as usize;
    at += 4 + 8 * n_dims;
    let mut bad = good.clone();
    bad[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
    let e = load_error(tmp.path(), &bad);
    assert!(e.contains("blk.0.attn_qkv.weight") && e.contains("99"), "{e}");
}

#[test]
fn a_truncated_file_is_an_error_naming_a_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, good) = quantized_model(tmp.path());
    let e = load_error(tmp.path(), &good[..good.len() - 1000]);
    assert!(e.contains("tensor '") && e.contains("beyond the end of the file"), "{e}");
}
