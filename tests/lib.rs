//! Shared helpers for Nebula's cross-crate and end-to-end tests (the tests themselves are the `[[test]]`
//! targets of this crate).

use std::path::PathBuf;

/// The repository root: `NEBULA_REPO_ROOT` when set (test binaries carried to another machine), else the parent
/// of this crate's folder at build time.
pub fn repo_root() -> PathBuf {
    if let Ok(root) = std::env::var("NEBULA_REPO_ROOT") {
        return PathBuf::from(root);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// The golden `hc4_moe` trunk with the reference MTP block (`tests/fixtures/golden_mtp/hc4_mtp`, written by
/// `scripts/make_mtp_golden.py`), converted to an F32 GGUF in `tmp`; returns its path.
///
/// Panics: a fixture is missing or the conversion fails (test setup).
pub fn reference_mtp_gguf(tmp: &std::path::Path) -> PathBuf {
    use nebula_engine::convert::{ConvertOptions, OutType, convert};
    let ckpt = tmp.join("hc4_mtp");
    std::fs::create_dir_all(&ckpt).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(repo_root().join("tests/fixtures/golden/hc4_moe").join(f), ckpt.join(f)).unwrap();
    }
    std::fs::copy(repo_root().join("tests/fixtures/golden_mtp/hc4_mtp/mtp.safetensors"), ckpt.join("mtp.safetensors"))
        .unwrap();
    let out = tmp.join("hc4_mtp.gguf");
    let report = convert(&ckpt, &out, &ConvertOptions { out_type: OutType::F32, ..Default::default() }).unwrap();
    assert!(report.mtp);
    out
}

/// The golden checkpoint `name` converted to an F32 GGUF in `tmp` with a random MTP block appended; returns its
/// path.
///
/// Panics: as [`reference_mtp_gguf`].
pub fn golden_with_random_mtp_gguf(name: &str, tmp: &std::path::Path) -> PathBuf {
    use nebula_engine::convert::{ConvertOptions, OutType, convert};
    let plain = tmp.join(format!("{name}.gguf"));
    convert(
        &repo_root().join("tests/fixtures/golden").join(name),
        &plain,
        &ConvertOptions { out_type: OutType::F32, ..Default::default() },
    )
    .unwrap();
    let with = tmp.join(format!("{name}-mtp.gguf"));
    nebula_engine::synth::append_random_mtp(&plain, &with, 7).unwrap();
    with
}
