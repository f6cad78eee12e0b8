//! Fixture tests of the block formats against the `gguf` package (fixtures written by
//! `scripts/make_quant_fixtures.py`), and equality tests of the kernel paths.

use super::*;
use crate::gguf::GgmlType;

struct Dequant {
    blocks: Vec<u8>,
    values: Vec<f32>,
}

fn fixture(name: &str) -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/quant/testdata").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}

fn load_dequant(ty: GgmlType) -> Dequant {
    let b = fixture(&format!("dequant_{}.bin", ty.name()));
    assert_eq!(u32_at(&b, 0), ty.id());
    let n = u32_at(&b, 4) as usize;
    let nbytes = n * ty.type_size();
    let blocks = b[8..8 + nbytes].to_vec();
    let values: Vec<f32> = b[8 + nbytes..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(values.len(), n * ty.block_size());
    Dequant { blocks, values }
}

/// Every type with a dequantization fixture (all supported types but F32, whose decode is a byte copy).
fn fixture_types() -> Vec<GgmlType> {
    SUPPORTED.iter().copied().filter(|&t| t != GgmlType::F32).collect()
}

#[test]
fn dequantize_matches_gguf_bit_for_bit() {
    for ty in fixture_types() {
        let f = load_dequant(ty);
        let mut out = vec![0f32; f.values.len()];
        dequantize_row(ty, &f.blocks, &mut out).unwrap();
        let mut bad = 0;
        for (i, (a, b)) in out.iter().zip(&f.values).enumerate() {
            if a.to_bits() != b.to_bits() {
                if bad < 5 {
                    eprintln!(
                        "{} value {i}: ours {a:e} ({:08x}), gguf {b:e} ({:08x})",
                        ty.name(),
                        a.to_bits(),
                        b.to_bits()
                    );
                }
                bad += 1;
            }
        }
        assert_eq!(bad, 0, "{}: {bad} of {} values differ from gguf.quants.dequantize", ty.name(), out.len());
    }
}

#[test]
fn quantize_matches_gguf_bit_for_bit() {
    type Q = fn(&[f32], &mut Vec<u8>);
    let bf16: Q = |src, dst| dst.extend(src.iter().flat_map(|&v| f32_to_bf16_bits(v).to_le_bytes()));
    let cases: [(GgmlType, Q); 7] = [
        (GgmlType::Q8_0, quantize::quantize_row_q8_0),
        (GgmlType::Q4_0, quantize::quantize_row_q4_0),
        (GgmlType::Q4_1, quantize::quantize_row_q4_1),
        (GgmlType::Q5_0, quantize::quantize_row_q5_0),
        (GgmlType::Q5_1, quantize::quantize_row_q5_1),
        (GgmlType::MXFP4, quantize::quantize_row_mxfp4),
        (GgmlType::BF16, bf16),
    ];
    for (ty, q) in cases {
        let b = fixture(&format!("quant_{}.bin", ty.name()));
        assert_eq!(u32_at(&b, 0), ty.id());
        let m = u32_at(&b, 4) as usize;
        let x: Vec<f32> = b[8..8 + 4 * m].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        let want = &b[8 + 4 * m..];
        let mut got = Vec::new();
        q(&x, &mut got);
        assert_eq!(got.len(), want.len(), "{}", ty.name());
        let bs = ty.type_size();
        for (i, (g, w)) in got.chunks(bs).zip(want.chunks(bs)).enumerate() {
            assert_eq!(g, w, "{} block {i} differs from gguf.quants.quantize", ty.name());
        }
    }
}

/// A deterministic pseudo-random generator (xorshift) for activations.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn normal(&mut self) -> f32 {
        // sum of uniforms: good enough for test activations
        (0..4).map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32).sum::<f32>() - 2.0
    }
}

/// Weight rows of `ty` built from the fixture blocks (finite scales, random levels): `(rows, cols, bytes)`.
fn weight_rows(ty: GgmlType) -> (usize, usize, Vec<u8>) {
    if ty == GgmlType::F32 {
        let mut r = Rng(99);
        let vals: Vec<u8> = (0..8 * 160).flat_map(|_| r.normal().to_le_bytes()).collect();
        return (8, 160, vals);
    }
    let f = load_dequant(ty);
    let nblocks = f.blocks.len() / ty.type_size();
    // Rows of 4 blocks for the super-block types, 10 blocks (320 values: 2.5 groups of 4, a tail) for the
    // 32-blocks, 160 values (16-lane groups and no tail... plus a tail of 0) for plain floats.
    let per_row = match ty.block_size() {
        256 => 4,
        32 => 10,
        _ => 166,
    };
    let rows = nblocks / per_row;
    (rows, per_row * ty.block_size(), f.blocks[..rows * per_row * ty.type_size()].to_vec())
}

fn activations(format: ActFormat, cols: usize, tokens: usize, seed: u64) -> (Vec<f32>, Activations) {
    let mut r = Rng(seed);
    let xs: Vec<f32> = (0..cols * tokens).map(|_| r.normal()).collect();
    let a = Activations::new(format, &xs, cols, tokens);
    (xs, a)
}

/// Every instruction-set path of `ty` on every row of `bytes` (`[rows, cols]`) gives the scalar path's bits, for
/// 1 to 4 tokens of random activations (`seed`).
fn assert_paths_match_scalar(ty: GgmlType, rows: usize, cols: usize, bytes: &[u8], seed: u64) {
    let rb = row_bytes(ty, cols).unwrap();
    let scalar = row_kernels_for(ty, Isa::Scalar).unwrap();
    let (_, acts) = activations(scalar.acts, cols, 4, seed);
    for isa in Isa::available() {
        let k = row_kernels_for(ty, isa).unwrap();
        assert_eq!(k.isa, isa, "{} has no {isa} path", ty.name());
        for nt in 1..=4 {
            let xs: Vec<ActRow<'_>> = (0..nt).map(|t| acts.row(t)).collect();
            for r in 0..rows {
                let row = &bytes[r * rb..(r + 1) * rb];
                let (mut want, mut got) = ([0f32; 4], [0f32; 4]);
                (scalar.dot)(row, &xs, &mut want[..nt]);
                (k.dot)(row, &xs, &mut got[..nt]);
                for t in 0..nt {
                    assert_eq!(
                        got[t].to_bits(),
                        want[t].to_bits(),
                        "{} {isa} row {r} token {t} of {nt}: {} vs scalar {}",
                        ty.name(),
                        got[t],
                        want[t]
                    );
                }
            }
        }
    }
}

#[test]
fn every_instruction_set_is_bit_identical_to_scalar() {
    eprintln!("instruction sets on this CPU: {:?}", Isa::available());
    for &ty in &SUPPORTED {
        let (rows, cols, bytes) = weight_rows(ty);
        assert_paths_match_scalar(ty, rows, cols, &bytes, 7 + ty.id() as u64);
    }
}

/// Bit patterns that random blocks almost never contain: IQ1_S runs whose `u16` word is 0 (scale 1, index
/// highs 0, positive delta) or has only the delta bit set. `psignw` zeroes where its operand is 0, so a SIMD
/// path that signed the scales by the raw word lost such runs' delta part; every path must equal the scalar one.
#[test]
fn iq1_s_runs_with_all_zero_words_are_exact() {
    let ty = GgmlType::IQ1_S;
    let (rows, cols, mut bytes) = weight_rows(ty);
    let bs = ty.type_size();
    for (b, blk) in bytes.chunks_exact_mut(bs).enumerate() {
        for ib in 0..8 {
            // Alternate: all zero, delta bit only, and (every third) the random word left as it was.
            match (b + ib) % 3 {
                0 => blk[34 + 2 * ib..36 + 2 * ib].copy_from_slice(&0u16.to_le_bytes()),
                1 => blk[34 + 2 * ib..36 + 2 * ib].copy_from_slice(&0x8000u16.to_le_bytes()),
                _ => {}
            }
        }
    }
    assert_paths_match_scalar(ty, rows, cols, &bytes, 17);
}

/// The kernels compute what the formats mean: the dot product of the dequantized weights with the
/// dequantized activations, up to `f32` rounding (relative to the sum of |products|).
#[test]
fn dot_equals_the_dequantized_product() {
    for &ty in &SUPPORTED {
        let (rows, cols, bytes) = weight_rows(ty);
        let rb = row_bytes(ty, cols).unwrap();
        let k = row_kernels(ty).unwrap();
        let (xs, acts) = activations(k.acts, cols, 1, 3);
        // the activations as the kernel sees them
        let xq: Vec<f64> = match k.acts {
            ActFormat::F32 => xs.iter().map(|&v| v as f64).collect(),
            f => {
                let r = acts.row(0);
                r.qs.iter().enumerate().map(|(i, &q)| q as f64 * r.d[i / f.block()] as f64).collect()
            }
        };
        let mut w = vec![0f32; cols];
        for r in 0..rows {
            let row = &bytes[r * rb..(r + 1) * rb];
            (k.dequantize_row)(row, &mut w);
            let exact: f64 = w.iter().zip(&xq).map(|(&a, &b)| a as f64 * b).sum();
            let mag: f64 = w.iter().zip(&xq).map(|(&a, &b)| (a as f64 * b).abs()).sum();
            let mut got = [0f32];
            (k.dot)(row, &[acts.row(0)], &mut got);
            let err = (got[0] as f64 - exact).abs();
            assert!(
                err <= 1e-5 * mag + 1e-30,
                "{} row {r}: kernel {} vs dequantized product {exact} (sum |terms| {mag})",
                ty.name(),
                got[0]
            );
        }
    }
}

#[test]
fn matmul_equals_matvec_per_token_on_every_path() {
    for &ty in &[GgmlType::Q4_K, GgmlType::IQ4_NL, GgmlType::Q8_0, GgmlType::F16, GgmlType::IQ2_XS] {
        let (rows, cols, bytes) = weight_rows(ty);
        for isa in Isa::available() {
            let m = Matrix::new(ty, rows, cols, WeightBytes::from_vec(bytes.clone())).unwrap().with_isa(isa);
            let mut r = Rng(5);
            let n = 7;
            let xs: Vec<f32> = (0..n * cols).map(|_| r.normal()).collect();
            let mut ys = vec![0f32; n * rows];
            m.matmul(&xs, n, &mut ys);
            for t in 0..n {
                let mut y = vec![0f32; rows];
                m.matvec(&xs[t * cols..(t + 1) * cols], &mut y);
                assert_eq!(&ys[t * rows..(t + 1) * rows], &y[..], "{} {isa} token {t}", ty.name());
            }
        }
    }
}

#[test]
fn non_finite_scales_are_found() {
    for ty in fixture_types().into_iter().filter(|t| t.is_quantized() && *t != GgmlType::MXFP4) {
        let (rows, cols, mut bytes) = weight_rows(ty);
        check_scales(ty, &bytes, cols).unwrap();
        let rb = row_bytes(ty, cols).unwrap();
        // Make every f16 field of one block infinite: find a scale field by flipping candidate pairs.
        let target = (rows - 1) * rb + ty.type_size(); // second block of the last row
        let k = row_kernels(ty).unwrap();
        let mut found = false;
        for off in 0..ty.type_size() - 1 {
            let mut b = bytes[target..target + ty.type_size()].to_vec();
            b[off] = 0x00;
            b[off + 1] = 0x7c; // +inf as f16
            if !(k.scales_finite)(&b) {
                bytes[target..target + ty.type_size()].copy_from_slice(&b);
                found = true;
                break;
            }
        }
        if ty == GgmlType::IQ1_M {
            // its f16 is spread over four nibbles: set them all to build +inf (0x7c00)
            let b = &mut bytes[target..target + ty.type_size()];
            for (kk, nib) in [0u16, 0, 0xc, 0x7].iter().enumerate() {
                let w = u16::from_le_bytes([b[48 + 2 * kk], b[49 + 2 * kk]]) & 0x0fff | (nib << 12);
                b[48 + 2 * kk..50 + 2 * kk].copy_from_slice(&w.to_le_bytes());
            }
            found = !(k.scales_finite)(b);
        }
        assert!(found, "{}: no scale field found", ty.name());
        let err = check_scales(ty, &bytes, cols).unwrap_err();
        assert_eq!(err, QuantError::NonFiniteScale { ty: ty.name(), row: rows - 1, block: 1 }, "{}", ty.name());
    }
}

#[test]
fn synthetic_blocks_have_finite_scales_of_every_type() {
    for &ty in &SUPPORTED {
        let n = 40;
        let b = synthetic_blocks(ty, n, 0.01, 3);
        assert_eq!(b.len(), n * ty.type_size());
        let cols = n * ty.block_size();
        check_scales(ty, &b, cols).unwrap();
        let mut v = vec![0f32; cols];
        dequantize_row(ty, &b, &mut v).unwrap();
        assert!(v.iter().all(|x| x.is_finite() && x.abs() < 100.0), "{}", ty.name());
    }
}
