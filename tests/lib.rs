//! Shared helpers for Nebula's cross-crate and end-to-end tests (the tests themselves are the `[[test]]`
//! targets of this crate).

use std::path::PathBuf;

/// The repository root (the parent of this crate's folder).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}
