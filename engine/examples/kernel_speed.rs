//! Single-thread kernel speed with the weights in cache (compute-bound view), per type and instruction set.
//! `cargo run --release -p nebula-engine --example kernel_speed [types...]`

use std::time::Instant;

use nebula_engine::gguf::GgmlType;
use nebula_engine::quant::{Isa, Matrix, SUPPORTED, WeightBytes, synthetic_blocks};

fn main() {
    let names: Vec<String> = std::env::args().skip(1).collect();
    let (rows, cols) = (64usize, 2560usize);
    for &ty in SUPPORTED.iter() {
        if !names.is_empty() && !names.iter().any(|n| n.eq_ignore_ascii_case(ty.name())) {
            continue;
        }
        if cols % ty.block_size() != 0 {
            continue;
        }
        let bytes = synthetic_blocks(ty, rows * cols / ty.block_size(), 0.01, 1);
        let nbytes = bytes.len();
        let m = Matrix::new(ty, rows, cols, WeightBytes::from_vec(bytes)).unwrap();
        let x: Vec<f32> = (0..cols).map(|i| (i % 17) as f32 * 0.1 - 0.8).collect();
        let mut line = format!("{:>8}", ty.name());
        for isa in Isa::available() {
            let m = m.clone().with_isa(isa);
            let a = m.prepare(&x, 1);
            let mut y = vec![0f32; rows];
            let mut iters = 0u64;
            let t = Instant::now();
            while t.elapsed().as_secs_f64() < 0.2 {
                m.dot_rows(0..rows, &a, 0..1, &mut y);
                iters += 1;
            }
            let gbs = iters as f64 * nbytes as f64 / t.elapsed().as_secs_f64() / 1e9;
            line += &format!("  {isa}: {gbs:7.2} GB/s");
        }
        println!("{line}");
    }
    let _ = GgmlType::F32;
}
