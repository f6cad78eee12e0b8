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
