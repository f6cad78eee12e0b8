//! RMSE of Nebula's quantizers against llama.cpp's on the same tensors.
//!
//! 1. `cargo run --release -p nebula-engine --example quant_rmse -- write DIR` writes test tensors as raw
//!    little-endian f32 (`DIR/NAME.f32`, shapes in `DIR/tensors.txt`) and an importance vector per row width
//!    (`DIR/imatrix_COLS.f32`).
//! 2. llama.cpp quantizes each with `ggml_quantize_chunk` (a small harness linked against ggml, built outside
//!    this repository) into `DIR/NAME.TYPE.ref` and, with the importance vector, `DIR/NAME.TYPE.imat.ref`.
//! 3. `... quant_rmse -- compare DIR` quantizes the same tensors with Nebula, decodes both with Nebula's
//!    dequantizer (bit-exact with the `gguf` package, hence with ggml) and prints RMSE / RMS(x) for each, their
//!    ratio and the share of byte-identical blocks.
//!
//! The tensors: Gaussian and heavy-tailed (Student-t, 3 degrees of freedom, log-normal row scales) expert-shaped
//! matrices, a Laplace matrix with outliers 640 wide (the expert down width), and real weights of the
//! `wide256` golden checkpoint (bf16, 256 wide).

use std::io::Write;
use std::path::Path;

use nebula_engine::convert::Checkpoint;
use nebula_engine::gguf::GgmlType;
use nebula_engine::quant::{dequantize_row, quantize};

const TYPES: [GgmlType; 8] = [
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
];

struct Rng(u64);
impl Rng {
    fn u(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        (-2.0 * self.u().ln()).sqrt() * (2.0 * std::f64::consts::PI * self.u()).cos()
    }
    fn student3(&mut self) -> f64 {
        let z = self.normal();
        let c: f64 = (0..3).map(|_| self.normal().powi(2)).sum();
        z / (c / 3.0).sqrt()
    }
    fn laplace(&mut self) -> f64 {
        let u = self.u() - 0.5;
        -u.signum() * (1.0 - 2.0 * u.abs()).ln()
    }
}

fn write_f32(path: &Path, v: &[f32]) {
    let mut f = std::fs::File::create(path).unwrap();
    for x in v {
        f.write_all(&x.to_le_bytes()).unwrap();
    }
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn tensors() -> Vec<(String, usize, usize, Vec<f32>)> {
    let mut out = Vec::new();
    let mut r = Rng(0x5eed_1234_abcd_0001);
    let (rows, cols) = (640, 2560);
    out.push(("gauss_640x2560".into(), rows, cols, (0..rows * cols).map(|_| (0.02 * r.normal()) as f32).collect()));
    let mut v = Vec::with_capacity(rows * cols);
    for _ in 0..rows {
        let s = 0.01 * (0.5 * r.normal()).exp();
        v.extend((0..cols).map(|_| (s * r.student3()) as f32));
    }
    out.push(("student_640x2560".into(), rows, cols, v));
    let (rows, cols) = (2560, 640);
    let mut v: Vec<f32> = (0..rows * cols).map(|_| (0.01 * r.laplace()) as f32).collect();
    for k in 0..rows {
        // one outlier column per row, as LLM weights have
        v[k * cols + (k * 37) % cols] *= 20.0;
    }
    out.push(("laplace_2560x640".into(), rows, cols, v));
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/golden/wide256");
    let ck = Checkpoint::open(&dir).expect("wide256 checkpoint");
    for (name, label) in [
        ("model.layers.0.mlp.experts.0.gate_proj.weight", "wide256_expert_gate"),
        ("model.layers.3.self_attn.q_proj.weight", "wide256_q_proj"),
        ("lm_head.weight", "wide256_lm_head"),
    ] {
        let t = ck.get(name).unwrap_or_else(|| panic!("{name}"));
        let cols = *t.shape.last().unwrap();
        let vals = ck.read_f32(name, t, 0, t.numel()).unwrap();
        out.push((label.into(), vals.len() / cols, cols, vals));
    }
    out
}

fn imatrix(cols: usize) -> Vec<f32> {
    let mut r = Rng(cols as u64 * 7919 + 1);
    (0..cols).map(|_| (1.5 * r.normal()).exp() as f32).collect()
}

fn rmse(x: &[f32], ty: GgmlType, q: &[u8]) -> f64 {
    let mut y = vec![0f32; x.len()];
    dequantize_row(ty, q, &mut y).unwrap();
    (x.iter().zip(&y).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = Path::new(args.get(2).map(String::as_str).unwrap_or("/tmp/quant_rmse"));
    std::fs::create_dir_all(dir).unwrap();
    match args.get(1).map(String::as_str) {
        Some("write") => {
            let mut list = String::new();
            let mut widths = Vec::new();
            for (name, rows, cols, v) in tensors() {
                write_f32(&dir.join(format!("{name}.f32")), &v);
                list += &format!("{name} {rows} {cols}\n");
                if !widths.contains(&cols) {
                    widths.push(cols);
                    write_f32(&dir.join(format!("imatrix_{cols}.f32")), &imatrix(cols));
                }
            }
            std::fs::write(dir.join("tensors.txt"), list).unwrap();
            println!("wrote {}", dir.display());
        }
        Some("compare") => {
            println!(
                "{:<26} {:>7} {:>5} {:>12} {:>12} {:>7} {:>9}",
                "tensor", "type", "imat", "nebula", "llama.cpp", "ratio", "same blk"
            );
            for (name, _rows, cols, x) in tensors() {
                let rms = (x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt();
                for ty in TYPES {
                    if cols % ty.block_size() != 0 {
                        continue;
                    }
                    for with_imat in [false, true] {
                        let ext = if with_imat { "imat.ref" } else { "ref" };
                        let refp = dir.join(format!("{name}.{}.{ext}", ty.name()));
                        let Ok(theirs) = std::fs::read(&refp) else { continue };
                        let im = with_imat.then(|| read_f32(&dir.join(format!("imatrix_{cols}.f32"))));
                        let ours = quantize::quantize_tensor(ty, &x, cols, im.as_deref()).unwrap();
                        let (a, b) = (rmse(&x, ty, &ours) / rms, rmse(&x, ty, &theirs) / rms);
                        let bs = ty.type_size();
                        let same = ours.chunks(bs).zip(theirs.chunks(bs)).filter(|(p, q)| p == q).count() as f64
                            / (ours.len() / bs) as f64;
                        println!(
                            "{name:<26} {:>7} {:>5} {a:>12.5e} {b:>12.5e} {:>7.4} {:>8.1}%",
                            ty.name(),
                            if with_imat { "yes" } else { "no" },
                            a / b,
                            100.0 * same
                        );
                    }
                }
            }
        }
        _ => eprintln!("usage: quant_rmse write|compare [DIR]"),
    }
}
