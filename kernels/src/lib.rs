//! GPU kernels for Nebula.
//!
//! CUDA sources (one file per kernel family) and their loader arrive with the CUDA backend issue. This crate
//! already owns the one question the rest of the program asks today: is an NVIDIA driver present? It answers
//! without loading anything CUDA-related, so a CPU-only machine never reaches a CUDA loader that would panic.

use std::path::Path;

/// Directories where the NVIDIA driver library `libcuda.so.1` is commonly installed on Linux.
const DRIVER_DIRS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/nvidia/lib64",
    "/usr/local/cuda/compat",
    "/usr/lib/wsl/lib",
];

/// Returns the path of the NVIDIA driver library if one is installed, by looking for `libcuda.so.1` in the
/// usual directories and in `LD_LIBRARY_PATH`. Never loads the library.
pub fn find_cuda_driver() -> Option<std::path::PathBuf> {
    let from_env = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    from_env
        .split(':')
        .filter(|d| !d.is_empty())
        .chain(DRIVER_DIRS.iter().copied())
        .map(|dir| Path::new(dir).join("libcuda.so.1"))
        .find(|p| p.exists())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_does_not_panic_and_points_at_an_existing_file() {
        if let Some(p) = find_cuda_driver() {
            assert!(p.exists(), "probe returned {} which does not exist", p.display());
        }
    }
}
