//! The MoE kernel alone, for profiling: `cargo run --release -p nebula-engine --example moe_speed [tokens]`
//! (`POOL=N` runs it inside an `install`ed pool of N threads instead of the global pool; `NEBULA_CPU_MOE_TRACE=1`
//! prints where a call's time goes).

use std::time::Instant;

use nebula_engine::gguf::GgmlType;
use nebula_engine::quant::moe::{ExpertRef, ExpertWork, routed_experts};
use nebula_engine::quant::{Matrix, WeightBytes, synthetic_blocks};

fn stack(ty: GgmlType, rows: usize, cols: usize, n: usize) -> Vec<Matrix> {
    let one = synthetic_blocks(ty, rows * cols / ty.block_size(), 0.001, 3);
    let all: Vec<u8> = (0..n).flat_map(|_| one.iter().copied()).collect();
    let wb = WeightBytes::from_vec(all);
    (0..n)
        .map(|e| Matrix::new(ty, rows, cols, wb.slice(e * one.len()..(e + 1) * one.len()).unwrap()).unwrap())
        .collect()
}

fn main() {
    let tokens: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(1);
    let n = 512;
    let (g, u, d) = (
        stack(GgmlType::Q4_K, 640, 2560, n),
        stack(GgmlType::Q4_K, 640, 2560, n),
        stack(GgmlType::IQ4_NL, 2560, 640, n),
    );
    let x: Vec<f32> = (0..tokens * 2560).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
    let mut out = vec![0f32; tokens * 2560];
    let mut s = 12345u64;
    let pool = std::env::var("POOL")
        .ok()
        .map(|t| rayon::ThreadPoolBuilder::new().num_threads(t.parse().unwrap()).build().unwrap());
    let t0 = Instant::now();
    let mut bytes = 0usize;
    let mut iters = 0;
    while t0.elapsed().as_secs_f64() < 3.0 {
        let mut by: Vec<Vec<(usize, f32)>> = vec![Vec::new(); n];
        for t in 0..tokens {
            let mut k = 0;
            while k < 10 {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let e = (s % n as u64) as usize;
                if !by[e].iter().any(|&(tt, _)| tt == t) {
                    by[e].push((t, 0.1));
                    k += 1;
                }
            }
        }
        let work: Vec<ExpertWork<'_>> = by
            .into_iter()
            .enumerate()
            .filter(|(_, v)| !v.is_empty())
            .map(|(e, v)| ExpertWork { expert: ExpertRef { gate: &g[e], up: &u[e], down: &d[e] }, tokens: v })
            .collect();
        bytes += work.len() * (g[0].data().len() + u[0].data().len() + d[0].data().len());
        if let Some(p) = &pool {
            p.install(|| routed_experts(&work, &x, tokens, &mut out))
        } else {
            routed_experts(&work, &x, tokens, &mut out)
        }
        iters += 1;
    }
    println!("{iters} iterations, {:.2} GB/s", bytes as f64 / t0.elapsed().as_secs_f64() / 1e9);
    if let Some(t) = nebula_engine::quant::moe::trace::report() {
        println!("{t} (NEBULA_CPU_MOE_TRACE=1)");
    }
}
