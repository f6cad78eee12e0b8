//! Compiles the CUDA sources in `cuda/` ahead of time when `nvcc` is available.
//!
//! With nvcc (found through `NVCC`, `CUDA_HOME`/`CUDA_PATH`, `/usr/local/cuda` or `PATH`), every `cuda/*.cu`
//! becomes one fatbin holding SASS for sm_80, sm_86, sm_89, sm_90 and sm_120 plus PTX for compute_80 (so newer
//! GPUs can JIT it), embedded in the library. Without nvcc (CI, CPU-only machines) nothing is compiled here and
//! the loader compiles the same sources with NVRTC at run time on a machine that has a GPU. Set
//! `NEBULA_NVCC=0` to force the NVRTC path.

use std::path::{Path, PathBuf};
use std::process::Command;

const ARCHS: &[&str] = &["80", "86", "89", "90", "120"];

fn find_nvcc() -> Option<PathBuf> {
    if std::env::var("NEBULA_NVCC").is_ok_and(|v| v == "0") {
        return None;
    }
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(p) = std::env::var("NVCC") {
        candidates.push(p.into());
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(p) = std::env::var(var) {
            candidates.push(Path::new(&p).join("bin/nvcc"));
        }
    }
    candidates.push("/usr/local/cuda/bin/nvcc".into());
    if let Ok(path) = std::env::var("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join("nvcc")));
    }
    candidates.into_iter().find(|p| p.is_file())
}

fn main() {
    println!("cargo:rerun-if-changed=cuda");
    for var in ["NVCC", "CUDA_HOME", "CUDA_PATH", "NEBULA_NVCC", "PATH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let mut sources: Vec<PathBuf> = std::fs::read_dir("cuda")
        .expect("kernels/cuda exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    let mut entries = Vec::new();
    if let Some(nvcc) = find_nvcc() {
        for src in &sources {
            let stem = src.file_stem().unwrap().to_string_lossy().into_owned();
            let fatbin = out.join(format!("{stem}.fatbin"));
            let mut cmd = Command::new(&nvcc);
            cmd.arg("-fatbin").arg("-O3").arg("-std=c++17").arg("-Icuda").arg("-o").arg(&fatbin).arg(src);
            for a in ARCHS {
                cmd.arg(format!("-gencode=arch=compute_{a},code=sm_{a}"));
            }
            cmd.arg("-gencode=arch=compute_80,code=compute_80");
            let status = cmd.status().unwrap_or_else(|e| panic!("running {}: {e}", nvcc.display()));
            assert!(status.success(), "nvcc failed on {}", src.display());
            entries.push(format!("(\"{stem}\", include_bytes!(\"{}\") as &[u8])", fatbin.display()));
        }
        println!("cargo:rustc-cfg=nebula_fatbins");
        println!("cargo:warning=CUDA kernels compiled ahead of time with {}", nvcc.display());
    }
    println!("cargo:rustc-check-cfg=cfg(nebula_fatbins)");
    let code = format!(
        "/// Ahead-of-time compiled kernels: (source stem, fatbin).\npub const FATBINS: &[(&str, &[u8])] = &[{}];\n",
        entries.join(", ")
    );
    std::fs::write(out.join("fatbins.rs"), code).expect("writing fatbins.rs");
}
