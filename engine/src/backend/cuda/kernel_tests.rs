//! The block-type kernels against the CPU kernels on the same bytes, for every type the CPU reads: decode GEMVs,
//! prefill matmuls (tensor cores or dequantized f32 cuBLAS), routed-expert GEMVs, the grouped expert kernels
//! (int8 MMA, dp4a, f32), row gather and dequantization, each through the launch helpers the model uses. The
//! GPU tests are `#[ignore]` without a GPU: `cargo test --release -p nebula-engine -- --ignored
//! --test-threads 1 kernel_types` (or the carried library test binary with the same arguments and
//! `NEBULA_REPO_ROOT` set to the repository, which holds the demo model whose shapes they borrow).
//!
//! Weights: `quant::synthetic_blocks` (every bit field random, the block scales set, varied by row) so each
//! format's whole layout is read. Activations: uniform in [-1, 1) times a factor varying by 32-block.
//!
//! Bounds, per output value, relative to `S = sum_i |w_i x_i|` (w from the CPU decoder, x the f32 activations),
//! which a wrong decode misses by orders of magnitude:
//! - the 8-bit path ([`q8_type_block`]: every quantized type, the ones with a scale per 16 values through their
//!   integer run scales): against the CPU kernel (`Matrix::matmul`, same 8-bit activations, same integer dot
//!   products; only the f32 sums of the block terms differ in order): `2e-5 S`;
//! - the f32-activation kernels (every type, run with the 8-bit path turned off, `LaunchFlags::q8_acts`, and
//!   by the prefill matmul without tensor cores): against the f64 dot of the CPU-decoded weights with the f32
//!   activations, `3e-5 S` (f32 accumulation), and against the CPU kernel (which rounds the activations to 8
//!   bits: at most half a step of 1/127 of a block's largest value each) `2e-2 S`;
//! - the mid-size kernels of fast batched passes (`gemvqm_*` dense, `moe_gemvqg_*` grouped experts; every type with
//!   an 8-bit path, `mid_type`) at 2, 5, 17 and 64 rows: against the CPU kernel, `2e-5 S` as above (the
//!   same integer products, another f32 order);
//! - row gather and dequantization of the new types: bit for bit the CPU decoder's values (same f32 operations,
//!   unfused), the bf16 copy its round-to-nearest-even.

use nebula_kernels::Gpu;
use nebula_kernels::cudarc::driver::CudaSlice;
use rand::{Rng, SeedableRng};

use super::device::{Arg, Dev, ptr, type_suffix};
use super::gemv::{Acts, grouped_grid, mid_lanes, mid_type, q8_type_block};
use super::launch::{Launch, mid_path};
use super::weights::Uploader;
use crate::gguf::{GgmlType, GgufFile};
use crate::model::config::ModelConfig;
use crate::quant::{Matrix, SUPPORTED, WeightBytes, f32_to_bf16_bits, synthetic_blocks};

/// The types added with the low-bit kernels: their gather and dequantization are bit-exact with the CPU decoder.
const LOW_BIT: [GgmlType; 12] = [
    GgmlType::Q4_1,
    GgmlType::Q5_1,
    GgmlType::MXFP4,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
];

/// The quantized types under test: the low-bit ones and, as controls, the types that had kernels before.
fn types() -> Vec<GgmlType> {
    let mut t = LOW_BIT.to_vec();
    t.extend([
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::IQ4_NL,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_XS,
    ]);
    t
}

const TOL_SAME_INT: f64 = 2e-5;
const TOL_F32: f64 = 3e-5;
const TOL_VS_8BIT: f64 = 2e-2;

/// Every launch name the helpers form for a type exists in the kernel sources, for every type the CPU reads (no
/// GPU needed: a missing instantiation would otherwise fail only when a model of that type runs).
#[test]
fn every_cpu_type_has_each_kernel_a_launch_asks_for() {
    let names = nebula_kernels::all_kernel_names();
    for ty in SUPPORTED {
        let sfx = type_suffix(ty).unwrap();
        let mut want: Vec<String> = [1, 2, 4, 8].iter().map(|c| format!("gemv_{sfx}_{c}")).collect();
        want.extend([
            format!("moe_gemv_{sfx}"),
            format!("dequant_f32_{sfx}"),
            format!("dequant_bf16_{sfx}"),
            format!("moe_grouped_{sfx}"),
        ]);
        if ty.block_size() > 1 {
            want.push(format!("get_rows_{sfx}"));
        } else {
            want.extend([format!("get_rows_{sfx}"), format!("get_rows_elem_{sfx}"), format!("dequant_elem_f32_{sfx}")]);
        }
        if q8_type_block(ty).is_some() {
            want.extend([1, 2, 4, 8].iter().map(|c| format!("gemvq_{sfx}_{c}")));
            for k in ["gemvqd", "moe_gemvq", "gemvqp", "moe_gemvqp", "moe_groupedq", "moe_groupedmma"] {
                want.push(format!("{k}_{sfx}"));
            }
        }
        if mid_type(ty) {
            want.extend([format!("gemvqm_{sfx}"), format!("moe_gemvqg_{sfx}")]);
        }
        for w in want {
            assert!(names.contains(&w), "{}: no kernel {w}", ty.name());
        }
    }
}

/// The launch context of these tests: GPU 0, the demo model's shapes with 8 experts, 2 per token.
fn launch() -> Launch {
    let tuning = crate::tuning::Tuning::from_env().expect("the NEBULA_* tuning variables parse").cuda;
    let gpu = Gpu::open(0).expect("a GPU");
    let dev = Dev::new(gpu, &tuning).expect("the device opens");
    // The repository root: NEBULA_REPO_ROOT where the test binary runs away from its build tree (a GPU machine).
    let root = std::env::var_os("NEBULA_REPO_ROOT")
        .map_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".."), std::path::PathBuf::from);
    let path = root.join("models/nebula-demo.gguf");
    let mut cfg = ModelConfig::from_gguf(&GgufFile::open(&path).expect("the demo model")).expect("its config");
    cfg.n_expert = 8;
    cfg.n_expert_used = 2;
    Launch::new(dev, cfg, &tuning)
}

/// `rows x cols` weights of `ty`: synthetic blocks, row `r` with block scale 0.02 (1 + (r % 5) / 4).
fn weights(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Matrix {
    let per_row = cols / ty.block_size();
    let mut bytes = Vec::new();
    for r in 0..rows {
        let scale = 0.02 * (1.0 + (r % 5) as f32 / 4.0);
        bytes.extend(synthetic_blocks(ty, per_row, scale, seed.wrapping_mul(1000).wrapping_add(r as u64)));
    }
    Matrix::new(ty, rows, cols, WeightBytes::from_vec(bytes)).expect("valid synthetic weights")
}

/// `n x cols` activations, uniform in [-1, 1) times 1, 2 or 3 by 32-block.
fn activations(n: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n * cols).map(|i| rng.random_range(-1.0f32..1.0) * (1 + (i / 32) % 3) as f32).collect()
}

fn upload<T: nebula_kernels::cudarc::driver::DeviceRepr>(ctx: &Launch, v: &[T]) -> CudaSlice<T> {
    ctx.dev.stream().clone_htod(v).expect("upload")
}

fn download(ctx: &Launch, buf: &CudaSlice<f32>) -> Vec<f32> {
    let mut out = vec![0f32; buf.len()];
    ctx.dev.stream().memcpy_dtoh(buf, &mut out).expect("download");
    ctx.dev.stream().synchronize().expect("the stream completes");
    out
}

/// (f64 dot, S = sum |w x|) of every (token, row): `[n][rows]`.
fn reference(m: &Matrix, x: &[f32], n: usize) -> (Vec<f64>, Vec<f64>) {
    let w = m.to_f32();
    let (rows, cols) = (m.rows(), m.cols());
    let (mut y, mut s) = (vec![0f64; n * rows], vec![0f64; n * rows]);
    for t in 0..n {
        for r in 0..rows {
            let (wr, xt) = (&w[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
            y[t * rows + r] = wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
            s[t * rows + r] = wr.iter().zip(xt).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
        }
    }
    (y, s)
}

/// The largest |got - want| / S.
fn worst(got: &[f32], want: &[f64], scale: &[f64]) -> f64 {
    (0..got.len()).fold(0f64, |m, i| {
        assert!(got[i].is_finite(), "value {i} is {}", got[i]);
        m.max((got[i] as f64 - want[i]).abs() / scale[i].max(1e-30))
    })
}

/// Checks `got` (`[n][rows]` of `m . x`) against the CPU: the bound of the type's path (module doc).
/// Prints the figures when `print`.
fn check(what: &str, m: &Matrix, got: &[f32], x: &[f32], n: usize, print: bool) {
    check_path(what, m, got, x, n, print, q8_type_block(m.ggml_type()).is_some())
}

/// [`check`] for a path that runs on 8-bit activations (`int8`: the CPU kernel's integer products) or on f32
/// ones (the exact product's bound): the 40-token matmul without tensor cores dequantizes the weights to f32
/// for cuBLAS whatever the type.
fn check_path(what: &str, m: &Matrix, got: &[f32], x: &[f32], n: usize, print: bool, int8: bool) {
    let ty = m.ggml_type();
    let (exact, scale) = reference(m, x, n);
    let mut cpu = vec![0f32; n * m.rows()];
    m.matmul(x, n, &mut cpu);
    let cpu64: Vec<f64> = cpu.iter().map(|&v| v as f64).collect();
    let vs_cpu = worst(got, &cpu64, &scale);
    let vs_exact = worst(got, &exact, &scale);
    if print {
        println!(
            "{:8} {what}: vs CPU kernel {vs_cpu:.2e} S, vs f64 of the CPU-decoded weights {vs_exact:.2e} S",
            ty.name()
        );
    }
    if int8 {
        assert!(vs_cpu <= TOL_SAME_INT, "{} {what}: {vs_cpu:.3e} S from the CPU kernel", ty.name());
    } else {
        assert!(vs_exact <= TOL_F32, "{} {what}: {vs_exact:.3e} S from the exact product", ty.name());
        assert!(vs_cpu <= TOL_VS_8BIT, "{} {what}: {vs_cpu:.3e} S from the CPU kernel", ty.name());
    }
}

/// Dense products through `Launch::matmul`: decode GEMVs for 1, 2, 5 and 8 tokens (every token-count kernel),
/// and 40-token prefill matmuls with tensor cores on and off.
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release -p nebula-engine -- --ignored kernel_types"]
fn kernel_types_dense_products_match_the_cpu() {
    let mut ctx = launch();
    let (rows, cols) = (200, 1024);
    for (k, ty) in types().into_iter().enumerate() {
        let m = weights(ty, rows, cols, 10 + k as u64);
        let dm = Uploader { dev: &ctx.dev, bytes: 0 }.matrix(&m, "test.weight").unwrap();
        let runs = [(1, true, true), (2, true, true), (5, true, true), (8, true, true), (40, true, true)];
        for (n, mma, q8) in runs.into_iter().chain([(40, false, true), (1, true, false), (5, true, false)]) {
            ctx.flags.tensor_cores = mma && ctx.dev.gpu.capability.0 >= 8;
            ctx.flags.q8_acts = q8;
            ctx.arena_reset().unwrap();
            let x = activations(n, cols, 100 + n as u64);
            let xb = upload(&ctx, &x);
            let yb = upload(&ctx, &vec![0f32; n * rows]);
            let (xp, yp) = (ptr(&xb, ctx.dev.stream(), 0), ptr(&yb, ctx.dev.stream(), 0));
            ctx.matmul(dm.view(&ctx.dev), xp, n, yp).unwrap();
            let label = match (n <= 8, q8) {
                (true, true) => format!("GEMV n={n}"),
                (true, false) => format!("GEMV n={n} f32 activations"),
                _ => format!("matmul n={n} tensor cores {mma}"),
            };
            // Without tensor cores a prefill matmul dequantizes to f32 for cuBLAS: f32 activations.
            let int8 = q8 && q8_type_block(ty).is_some() && (n <= 8 || ctx.flags.tensor_cores);
            check_path(&label, &m, &download(&ctx, &yb), &x, n, true, int8);
        }
    }
}

/// Routed experts: the decode GEMVs (`Launch::moe_gemv`, gate and up in one launch on 8-bit activations) and the
/// grouped prefill kernels (`Launch::moe_grouped`: int8 MMA, dp4a or f32), including a launch over a subset of
/// experts mapped by `slot_expert` (hybrid streaming).
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release -p nebula-engine -- --ignored kernel_types"]
fn kernel_types_expert_products_match_the_cpu() {
    let mut ctx = launch();
    let (e, k, rows, cols) = (8usize, 2usize, 96usize, 512usize);
    for (ti, ty) in types().into_iter().enumerate() {
        let gate: Vec<Matrix> = (0..e).map(|j| weights(ty, rows, cols, 1000 + 20 * ti as u64 + j as u64)).collect();
        let up: Vec<Matrix> = (0..e).map(|j| weights(ty, rows, cols, 5000 + 20 * ti as u64 + j as u64)).collect();
        let mut up_ = Uploader { dev: &ctx.dev, bytes: 0 };
        let gs = up_.stack(&gate.iter().collect::<Vec<_>>(), &gate[0], "test.gate_exps").unwrap();
        let us = up_.stack(&up.iter().collect::<Vec<_>>(), &up[0], "test.up_exps").unwrap();
        // Two experts uploaded in the order (5, 2), for the slot_expert launch.
        let sub = up_.stack(&[&gate[5], &gate[2]], &gate[0], "test.gate_exps").unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7 + ti as u64);
        for n in [3usize, 40] {
            ctx.arena_reset().unwrap();
            let slots = n * k;
            // Two distinct experts per token, as the router picks them.
            let mut ids = Vec::with_capacity(slots);
            for _ in 0..n {
                let a = rng.random_range(0..e as i32);
                ids.extend([a, (a + rng.random_range(1..e as i32)) % e as i32]);
            }
            let x = activations(n, cols, 300 + n as u64);
            let xb = upload(&ctx, &x);
            let xp = ptr(&xb, ctx.dev.stream(), 0);
            let idb = upload(&ctx, &ids);
            let idp = ptr(&idb, ctx.dev.stream(), 0);
            // Per slot: the CPU product of its expert with its token's row, checked on that slot's rows.
            let check_slots = |what: &str, ms: &[Matrix], got: &[f32], only: &[i32]| {
                let mut shown = false;
                for (s, &ex) in ids.iter().enumerate() {
                    if !only.is_empty() && !only.contains(&ex) {
                        continue;
                    }
                    let xt = &x[(s / k) * cols..(s / k + 1) * cols];
                    let y = &got[s * rows..(s + 1) * rows];
                    check(&format!("{what} (slot {s} shown, every slot checked)"), &ms[ex as usize], y, xt, 1, !shown);
                    shown = true;
                }
            };
            if n <= 8 {
                // The 8-bit path, then the f32-activation kernels (check's bound follows the path taken).
                for q8 in [true, false] {
                    ctx.flags.q8_acts = q8;
                    let xa = ctx.acts(ty, xp, n, cols).unwrap();
                    let (y0, y1) = (upload(&ctx, &vec![0f32; slots * rows]), upload(&ctx, &vec![0f32; slots * rows]));
                    let (p0, p1) = (ptr(&y0, ctx.dev.stream(), 0), ptr(&y1, ctx.dev.stream(), 0));
                    ctx.moe_gemv(&gs, Some(&us), idp, slots, xa, cols, k, (p0, p1), None).unwrap();
                    let (g, u) = (download(&ctx, &y0), download(&ctx, &y1));
                    let int8 = matches!(xa, Acts::Q8(..) | Acts::Pro(_));
                    for (what, ms, got) in [("MoE GEMV gate", &gate, &g), ("MoE GEMV up", &up, &u)] {
                        for (s, &ex) in ids.iter().enumerate() {
                            let xt = &x[(s / k) * cols..(s / k + 1) * cols];
                            let y = &got[s * rows..(s + 1) * rows];
                            let label = format!("{what}{} (slot {s})", if int8 { "" } else { " f32 activations" });
                            check_path(&label, &ms[ex as usize], y, xt, 1, s == 0, int8);
                        }
                    }
                }
                ctx.flags.q8_acts = true;
                continue;
            }
            // Grouped by expert, as moe_sort orders them: offsets[e] .. offsets[e + 1] index perm.
            let mut perm: Vec<i32> = (0..slots as i32).collect();
            perm.sort_by_key(|&s| (ids[s as usize], s));
            let mut offsets = vec![0i32; e + 1];
            for &ex in &ids {
                offsets[ex as usize + 1] += 1;
            }
            for j in 0..e {
                offsets[j + 1] += offsets[j];
            }
            let (ob, pb) = (upload(&ctx, &offsets), upload(&ctx, &perm));
            let (op, pp) = (ptr(&ob, ctx.dev.stream(), 0), ptr(&pb, ctx.dev.stream(), 0));
            let se = upload(&ctx, &[5i32, 2]);
            let sp = ptr(&se, ctx.dev.stream(), 0);
            for mma in [true, false] {
                ctx.flags.tensor_cores = mma && ctx.dev.gpu.capability.0 >= 8;
                let xa = ctx.acts(ty, xp, n, cols).unwrap();
                let kernel = match (xa, ctx.flags.tensor_cores) {
                    (Acts::Q8(..), true) => "int8 MMA",
                    (Acts::Q8(..), false) => "dp4a",
                    _ => "f32",
                };
                let y = upload(&ctx, &vec![0f32; slots * rows]);
                let yp = ptr(&y, ctx.dev.stream(), 0);
                ctx.moe_grouped(gs.view(&ctx.dev), e, 0, op, pp, xa, k, cols, yp, slots).unwrap();
                check_slots(&format!("grouped {kernel}"), &gate, &download(&ctx, &y), &[]);
                let y = upload(&ctx, &vec![0f32; slots * rows]);
                let yp = ptr(&y, ctx.dev.stream(), 0);
                ctx.moe_grouped(sub.view(&ctx.dev), 2, sp, op, pp, xa, k, cols, yp, slots).unwrap();
                let got = download(&ctx, &y);
                check_slots(&format!("grouped {kernel}, experts (5, 2) by slot map"), &gate, &got, &[5, 2]);
                for (s, &ex) in ids.iter().enumerate() {
                    if ex != 5 && ex != 2 {
                        assert!(got[s * rows..(s + 1) * rows].iter().all(|&v| v == 0.0), "slot {s} was written");
                    }
                }
            }
        }
    }
}

/// Row gather (embeddings, the n-gram table: `Launch::get_rows`, two copies side by side) and dequantization to
/// f32 and bf16: the CPU decoder's values, bit for bit for the low-bit types (the older types' kernels may fuse a
/// multiply-add: within 1e-6 of the row's largest value).
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release -p nebula-engine -- --ignored kernel_types"]
fn kernel_types_gather_and_dequantize_match_the_cpu() {
    let ctx = launch();
    let (rows, cols) = (64usize, 512usize);
    for (k, ty) in types().into_iter().enumerate() {
        ctx.arena_reset().unwrap();
        let m = weights(ty, rows, cols, 77 + k as u64);
        let cpu = m.to_f32();
        let exact = LOW_BIT.contains(&ty);
        let near = |got: f32, want: f32, r: usize| {
            let amax = cpu[r * cols..(r + 1) * cols].iter().fold(0f32, |a, v| a.max(v.abs()));
            if exact { got.to_bits() == want.to_bits() } else { (got - want).abs() <= 1e-6 * amax }
        };
        let table = Uploader { dev: &ctx.dev, bytes: 0 }.table(&m, "test.token_embd").unwrap();
        let ids: Vec<i32> = vec![5, 0, 63, 5, 17];
        let stride = 2 * cols + 8;
        let out = upload(&ctx, &vec![0f32; ids.len() * stride]);
        let idb = upload(&ctx, &ids);
        let (op, ip) = (ptr(&out, ctx.dev.stream(), 0), ptr(&idb, ctx.dev.stream(), 0));
        ctx.get_rows(&table, ip, ids.len(), op, stride, 2).unwrap();
        let got = download(&ctx, &out);
        for (t, &r) in ids.iter().enumerate() {
            let r = r as usize;
            for copy in 0..2 {
                for c in 0..cols {
                    let (g, w) = (got[t * stride + copy * cols + c], cpu[r * cols + c]);
                    assert!(near(g, w, r), "{} get_rows: row {r} col {c}: {g} vs the CPU's {w}", ty.name());
                }
            }
            assert!(got[t * stride + 2 * cols..(t + 1) * stride].iter().all(|&v| v == 0.0), "past the copies");
        }
        let sfx = type_suffix(ty).unwrap();
        let wp = ptr(&table.data, ctx.dev.stream(), 0);
        let shape = [Arg::Ptr(wp), Arg::I64(m.row_bytes() as i64), Arg::I32(rows as i32), Arg::I32(cols as i32)];
        let f = upload(&ctx, &vec![0f32; rows * cols]);
        let b = upload(&ctx, &vec![0u16; rows * cols]);
        let (fp, bp) = (ptr(&f, ctx.dev.stream(), 0), ptr(&b, ctx.dev.stream(), 0));
        ctx.dev
            .launch_1d(&format!("dequant_f32_{sfx}"), rows * cols / 32, &[&shape[..], &[Arg::Ptr(fp)]].concat())
            .unwrap();
        ctx.dev
            .launch_1d(&format!("dequant_bf16_{sfx}"), rows * cols / 32, &[&shape[..], &[Arg::Ptr(bp)]].concat())
            .unwrap();
        let got = download(&ctx, &f);
        let mut got_b = vec![0u16; rows * cols];
        ctx.dev.stream().memcpy_dtoh(&b, &mut got_b).unwrap();
        ctx.dev.stream().synchronize().unwrap();
        for i in 0..rows * cols {
            assert!(near(got[i], cpu[i], i / cols), "{} dequant_f32: value {i}: {} vs {}", ty.name(), got[i], cpu[i]);
            if exact {
                assert_eq!(got_b[i], f32_to_bf16_bits(cpu[i]), "{} dequant_bf16: value {i}", ty.name());
            }
        }
        println!(
            "{:8} get_rows and dequantize (f32, bf16): {}",
            ty.name(),
            if exact { "bit-exact" } else { "within 1e-6" }
        );
    }
}

/// The selection and geometry of the mid-size kernels, on the host: they run only in fast batched passes of 2 to
/// `mid_rows` rows (never in the exact mode, never with `mid_rows` 0); threads per row stay within a warp; the
/// grouped grid has one y per possible active expert and a z for gate and up.
#[test]
fn mid_size_kernels_are_chosen_only_for_fast_batched_passes_of_their_rows() {
    for n in [2, 5, 17, 64] {
        assert!(mid_path(64, true, false, n), "{n} rows of a fast batched pass");
        assert!(!mid_path(64, true, true, n), "{n} rows in the exact mode");
        assert!(!mid_path(64, false, false, n), "{n} rows of one sequence's pass");
        assert!(!mid_path(0, true, false, n), "{n} rows with mid_rows 0");
    }
    assert!(!mid_path(64, true, false, 1) && !mid_path(64, true, false, 65) && mid_path(65, true, false, 65));
    for (tasks, rows) in [(1, 1), (8, 96), (64, 200), (512, 2048), (2048, 1)] {
        let lanes = mid_lanes(tasks, rows, 1 << 15);
        assert!(lanes.is_power_of_two() && lanes <= 32 && lanes <= tasks.max(1).next_power_of_two(), "{tasks} {rows}");
    }
    assert_eq!(grouped_grid(96, 8, 16, true), (6, 16, 2));
    assert_eq!(grouped_grid(100, 32, 0, false), (25, 1, 1));
}

/// The host form of what `moe_sort` computes for `ids` over `count` experts (the reference of its GPU test, and
/// its specification): (offsets `[count + 1]`, perm, active list of length min(count, slots), -1 padded). Ids
/// outside `0..count` are left out.
fn sort_plan_host(ids: &[i32], count: usize) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let valid = |e: i32| e >= 0 && (e as usize) < count;
    let mut offsets = vec![0i32; count + 1];
    for &e in ids.iter().filter(|&&e| valid(e)) {
        offsets[e as usize + 1] += 1;
    }
    let mut active: Vec<i32> = (0..count).filter(|&e| offsets[e + 1] > 0).map(|e| e as i32).collect();
    for e in 0..count {
        offsets[e + 1] += offsets[e];
    }
    let mut perm: Vec<i32> = (0..ids.len() as i32).filter(|&s| valid(ids[s as usize])).collect();
    perm.sort_by_key(|&s| (ids[s as usize], s));
    active.resize(count.min(ids.len()), -1);
    (offsets, perm, active)
}

/// The sort plan of the grouped expert kernels (`moe_sort`, here its host form): experts in id order, each
/// expert's slots ascending, ids out of range (negative: computed elsewhere; `count` and above) left out, the
/// active list the experts with slots then -1 up to min(count, slots).
#[test]
fn the_sort_plan_groups_valid_slots_by_expert_and_lists_the_active_ones() {
    let ids = [3, 1, -1, 3, 8, 0, 3, 1];
    let (offsets, perm, active) = sort_plan_host(&ids, 5);
    assert_eq!(offsets, [0, 1, 3, 3, 6, 6]);
    assert_eq!(perm, [5, 1, 7, 0, 3, 6]);
    assert_eq!(active, [0, 1, 3, -1, -1]);
    // Fewer slots than experts: the active list is as long as the slots.
    let (offsets, perm, active) = sort_plan_host(&[2, 2], 4);
    assert_eq!((offsets, perm, active), (vec![0, 0, 0, 2, 2], vec![0, 1], vec![2, -1]));
    let (offsets, perm, active) = sort_plan_host(&[-1, -7], 3);
    assert_eq!((offsets, perm, active), (vec![0, 0, 0, 0], vec![], vec![-1, -1]));
}

/// The types of the mid-size kernels ([`mid_type`]: every type with an 8-bit path).
fn q8_types() -> Vec<GgmlType> {
    types().into_iter().filter(|&t| mid_type(t)).collect()
}

/// Dense products of a fast batched pass through `Launch::matmul` with the mid-size kernel (`gemvqm_*`) at 2, 5,
/// 17 and 64 rows, against the CPU kernel (`2e-5 S`); and in the exact mode the same call gives, bit for bit, what
/// it gives with the mid-size kernels off (the exact mode keeps its kernels).
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release -p nebula-engine -- --ignored kernel_types"]
fn kernel_types_mid_dense_products_match_the_cpu() {
    use std::sync::atomic::Ordering::Relaxed;
    let mut ctx = launch();
    let (rows, cols) = (200, 1024);
    for (k, ty) in q8_types().into_iter().enumerate() {
        let m = weights(ty, rows, cols, 40 + k as u64);
        let dm = Uploader { dev: &ctx.dev, bytes: 0 }.matrix(&m, "test.weight").unwrap();
        for n in [2usize, 5, 17, 64] {
            let x = activations(n, cols, 500 + n as u64);
            let xb = upload(&ctx, &x);
            let xp = ptr(&xb, ctx.dev.stream(), 0);
            let run = |ctx: &Launch| {
                ctx.arena_reset().unwrap();
                let yb = upload(ctx, &vec![0f32; n * rows]);
                ctx.matmul(dm.view(&ctx.dev), xp, n, ptr(&yb, ctx.dev.stream(), 0)).unwrap();
                download(ctx, &yb)
            };
            ctx.flags.mid_rows = 64;
            ctx.batched_rows.store(true, Relaxed);
            assert!(ctx.mid(n));
            check(&format!("mid-size GEMV n={n}"), &m, &run(&ctx), &x, n, true);
            ctx.exact_rows.store(true, Relaxed);
            let exact_mid = run(&ctx);
            ctx.flags.mid_rows = 0;
            let exact_old = run(&ctx);
            ctx.exact_rows.store(false, Relaxed);
            ctx.batched_rows.store(false, Relaxed);
            assert!(
                exact_mid.iter().zip(&exact_old).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{} n={n}: the exact mode's result depends on mid_rows",
                ty.name()
            );
        }
    }
}

/// Routed experts of a fast batched pass grouped by expert (`Launch::sort_plan`, `Launch::moe_gemvqg`) at 2, 5,
/// 17 and 64 tokens of 2 slots: expert 3 takes every token, experts 6 and 7 none, the second slots spread over the
/// others, and some slots name no expert of the stack (-1, and 9 of 8), which the sort leaves out and the kernels
/// leave unwritten. The device's sort plan equals its host form; gate and up (one launch) and down (each slot its
/// own activations) match the CPU kernel per slot (`2e-5 S`).
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release -p nebula-engine -- --ignored kernel_types"]
fn kernel_types_grouped_expert_decode_matches_the_cpu() {
    let ctx = launch();
    let (e, k, ff, d) = (8usize, 2usize, 256usize, 512usize);
    // `len` i32 values at a device address (the arena's sort plan).
    let dl = |at: u64, len: usize| {
        let mut out = vec![0i32; len];
        super::device::dtoh(ctx.dev.stream(), out.as_mut_ptr() as *mut std::ffi::c_void, at, len * 4).unwrap();
        ctx.dev.stream().synchronize().unwrap();
        out
    };
    for (ti, ty) in q8_types().into_iter().enumerate() {
        let seed = 9000 + 30 * ti as u64;
        let gate: Vec<Matrix> = (0..e).map(|j| weights(ty, ff, d, seed + j as u64)).collect();
        let up: Vec<Matrix> = (0..e).map(|j| weights(ty, ff, d, seed + 10 + j as u64)).collect();
        let down: Vec<Matrix> = (0..e).map(|j| weights(ty, d, ff, seed + 20 + j as u64)).collect();
        let mut upl = Uploader { dev: &ctx.dev, bytes: 0 };
        let gs = upl.stack(&gate.iter().collect::<Vec<_>>(), &gate[0], "test.gate_exps").unwrap();
        let us = upl.stack(&up.iter().collect::<Vec<_>>(), &up[0], "test.up_exps").unwrap();
        let ds = upl.stack(&down.iter().collect::<Vec<_>>(), &down[0], "test.down_exps").unwrap();
        assert_eq!((gs.count(), ds.count()), (e, e));
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for n in [2usize, 5, 17, 64] {
            ctx.arena_reset().unwrap();
            let slots = n * k;
            let mut ids = Vec::with_capacity(slots);
            for t in 0..n {
                let second = match t % 7 {
                    3 => -1,
                    5 => 9,
                    _ => [0, 1, 2, 4, 5][rng.random_range(0..5usize)],
                };
                ids.extend([3, second]);
            }
            let idb = upload(&ctx, &ids);
            let plan = ctx.sort_plan(ptr(&idb, ctx.dev.stream(), 0), slots, e).unwrap();
            let (want_off, want_perm, want_active) = sort_plan_host(&ids, e);
            let (got_off, got_perm, got_active) =
                (dl(plan.offsets, e + 1), dl(plan.perm, slots), dl(plan.active, plan.experts));
            assert_eq!(got_off, want_off, "{} n={n}: offsets", ty.name());
            assert_eq!(got_perm[..want_perm.len()], want_perm[..], "{} n={n}: perm", ty.name());
            assert_eq!(got_active, want_active, "{} n={n}: active experts", ty.name());
            // Gate and up: slot s reads token s / k.
            let x = activations(n, d, 700 + n as u64);
            let xb = upload(&ctx, &x);
            let Acts::Q8(qx, dx) = ctx.acts(ty, ptr(&xb, ctx.dev.stream(), 0), n, d).unwrap() else {
                panic!("{}: no 8-bit activations", ty.name())
            };
            let (y0, y1) = (upload(&ctx, &vec![0f32; slots * ff]), upload(&ctx, &vec![0f32; slots * ff]));
            let (p0, p1) = (ptr(&y0, ctx.dev.stream(), 0), ptr(&y1, ctx.dev.stream(), 0));
            ctx.moe_gemvqg(&gs, Some(&us), plan, (qx, dx), k, d, (p0, p1)).unwrap();
            // Down: slot s reads its own row of h.
            let h = activations(slots, ff, 900 + n as u64);
            let hb = upload(&ctx, &h);
            let Acts::Q8(hq, hd) = ctx.acts(ty, ptr(&hb, ctx.dev.stream(), 0), slots, ff).unwrap() else {
                panic!("{}: no 8-bit activations", ty.name())
            };
            let yd = upload(&ctx, &vec![0f32; slots * d]);
            let pd = ptr(&yd, ctx.dev.stream(), 0);
            ctx.moe_gemvqg(&ds, None, plan, (hq, hd), 1, ff, (pd, pd)).unwrap();
            let (g, u, dn) = (download(&ctx, &y0), download(&ctx, &y1), download(&ctx, &yd));
            let mut shown = false;
            for (s, &ex) in ids.iter().enumerate() {
                let (gy, uy, dy) = (&g[s * ff..(s + 1) * ff], &u[s * ff..(s + 1) * ff], &dn[s * d..(s + 1) * d]);
                if !(0..e as i32).contains(&ex) {
                    assert!(gy.iter().chain(uy).chain(dy).all(|&v| v == 0.0), "{} n={n}: slot {s} written", ty.name());
                    continue;
                }
                let xt = &x[(s / k) * d..(s / k + 1) * d];
                let label = |what: &str| format!("grouped decode {what} n={n} (slot {s} shown, every slot checked)");
                check(&label("gate"), &gate[ex as usize], gy, xt, 1, !shown);
                check(&label("up"), &up[ex as usize], uy, xt, 1, !shown);
                check(&label("down"), &down[ex as usize], dy, &h[s * ff..(s + 1) * ff], 1, !shown);
                shown = true;
            }
        }
    }
}

/// Mean seconds of `f` over `reps` calls after one warm-up, the stream drained before and after.
fn time_calls(ctx: &Launch, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    ctx.dev.stream().synchronize().unwrap();
    let t = std::time::Instant::now();
    for _ in 0..reps {
        f();
    }
    ctx.dev.stream().synchronize().unwrap();
    t.elapsed().as_secs_f64() / reps as f64
}

/// The mid-size kernels against the paths they replace, at the released model's shapes (hidden 2560, expert
/// hidden 640, 10 of 128 experts per token here, Q4_K gate/up, IQ4_NL down; a dense Q4_K `[4096, 2560]`), at 8,
/// 16, 32 and 64 rows: prints the time of each (host clock over 20 launches, the stream drained) for the A/B, and
/// asserts that both give the same products (within `1e-4` of the largest value: the same integer dot products,
/// other f32 orders; the prefill matmul's tensor-core sums included; `2e-2` against its f32 cuBLAS form when
/// tensor cores are off).
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release -p nebula-engine -- --ignored kernel_timing"]
fn kernel_timing_of_the_mid_size_kernels_against_the_old_paths() {
    use std::sync::atomic::Ordering::Relaxed;
    let mut ctx = launch();
    let (d, ff, e, k, reps) = (2560usize, 640usize, 128usize, 10usize, 20usize);
    ctx.cfg.n_expert = e;
    ctx.cfg.n_expert_used = k;
    ctx.flags.mid_rows = 64;
    let close = |what: &str, a: &[f32], b: &[f32], tol: f32| {
        let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(diff <= tol * amax, "{what}: {diff:e} apart (largest value {amax:e})");
    };
    let dense = weights(GgmlType::Q4_K, 4096, d, 3);
    let dm = Uploader { dev: &ctx.dev, bytes: 0 }.matrix(&dense, "test.weight").unwrap();
    let gate = weights(GgmlType::Q4_K, ff, d, 4);
    let down = weights(GgmlType::IQ4_NL, d, ff, 5);
    let mut upl = Uploader { dev: &ctx.dev, bytes: 0 };
    let gs = upl.stack(&vec![&gate; e], &gate, "test.gate_exps").unwrap();
    let us = upl.stack(&vec![&gate; e], &gate, "test.up_exps").unwrap();
    let ds = upl.stack(&vec![&down; e], &down, "test.down_exps").unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    println!(
        "{:>5} {:>26} {:>12} {:>26} {:>12}",
        "rows", "dense old (GEMV / matmul)", "gemvqm", "experts old (per slot / grouped)", "moe_gemvqg"
    );
    for n in [8usize, 16, 32, 64] {
        ctx.arena_reset().unwrap();
        let x = activations(n, d, 40 + n as u64);
        let xb = upload(&ctx, &x);
        let xp = ptr(&xb, ctx.dev.stream(), 0);
        let yb = upload(&ctx, &vec![0f32; n * 4096]);
        let yp = ptr(&yb, ctx.dev.stream(), 0);
        // Dense: the mid-size kernel in a fast batched pass, else what matmul chose before.
        let dense_run = |mid: bool| {
            ctx.batched_rows.store(mid, Relaxed);
            let s = time_calls(&ctx, reps, || ctx.matmul(dm.view(&ctx.dev), xp, n, yp).unwrap());
            ctx.batched_rows.store(false, Relaxed);
            (s, download(&ctx, &yb))
        };
        let (t_old, y_old) = dense_run(false);
        let (t_mid, y_mid) = dense_run(true);
        // (Without tensor cores the old matmul multiplies f32 activations: the 8-bit rounding's bound instead.)
        let tol = if n > 8 && !ctx.flags.tensor_cores { 2e-2 } else { 1e-4 };
        close(&format!("dense n={n}"), &y_mid, &y_old, tol);
        // Experts: n tokens of k distinct experts each.
        let slots = n * k;
        let mut ids = Vec::with_capacity(slots);
        for _ in 0..n {
            let mut chosen: Vec<i32> = Vec::new();
            while chosen.len() < k {
                let c = rng.random_range(0..e as i32);
                if !chosen.contains(&c) {
                    chosen.push(c);
                }
            }
            ids.extend(chosen);
        }
        let idb = upload(&ctx, &ids);
        let idp = ptr(&idb, ctx.dev.stream(), 0);
        let Acts::Q8(qx, dx) = ctx.acts(GgmlType::Q4_K, xp, n, d).unwrap() else { panic!("Q4_K has an 8-bit path") };
        let h = activations(slots, ff, 60 + n as u64);
        let hb = upload(&ctx, &h);
        let Acts::Q8(hq, hd) = ctx.acts(GgmlType::IQ4_NL, ptr(&hb, ctx.dev.stream(), 0), slots, ff).unwrap() else {
            panic!("IQ4_NL has an 8-bit path")
        };
        let bufs: Vec<CudaSlice<f32>> =
            (0..6).map(|i| upload(&ctx, &vec![0f32; slots * if i % 3 == 2 { d } else { ff }])).collect();
        let p: Vec<u64> = bufs.iter().map(|b| ptr(b, ctx.dev.stream(), 0)).collect();
        // Before: per-slot GEMVs up to 4 rows, the grouped prefill kernels (tensor cores) beyond.
        let t_exp_old = time_calls(&ctx, reps, || {
            let (offsets, perm) = (ctx.tmp(e + 1).unwrap(), ctx.tmp(slots).unwrap());
            ctx.dev
                .launch(
                    "moe_sort",
                    (1, 1, 1),
                    1024,
                    &[
                        Arg::Ptr(idp),
                        Arg::I32(slots as i32),
                        Arg::I32(e as i32),
                        Arg::Ptr(offsets),
                        Arg::Ptr(perm),
                        Arg::Ptr(0),
                    ],
                )
                .unwrap();
            for (view, out) in [(gs.view(&ctx.dev), p[0]), (us.view(&ctx.dev), p[1])] {
                ctx.moe_grouped(view, e, 0, offsets, perm, Acts::Q8(qx, dx), k, d, out, slots).unwrap();
            }
            ctx.moe_grouped(ds.view(&ctx.dev), e, 0, offsets, perm, Acts::Q8(hq, hd), 1, ff, p[2], slots).unwrap();
        });
        let t_exp_slot = time_calls(&ctx, reps, || {
            ctx.moe_gemv(&gs, Some(&us), idp, slots, Acts::Q8(qx, dx), d, k, (p[0], p[1]), None).unwrap();
            ctx.moe_gemv(&ds, None, idp, slots, Acts::Q8(hq, hd), ff, 1, (p[2], p[2]), None).unwrap();
        });
        let t_exp_mid = time_calls(&ctx, reps, || {
            let plan = ctx.sort_plan(idp, slots, e).unwrap();
            ctx.moe_gemvqg(&gs, Some(&us), plan, (qx, dx), k, d, (p[3], p[4])).unwrap();
            ctx.moe_gemvqg(&ds, None, plan, (hq, hd), 1, ff, (p[5], p[5])).unwrap();
        });
        for (a, b) in [(3, 0), (4, 1), (5, 2)] {
            close(&format!("experts n={n} buffer {a}"), &download(&ctx, &bufs[a]), &download(&ctx, &bufs[b]), 1e-4);
        }
        let us_ = |t: f64| t * 1e6;
        println!(
            "{n:>5} {:>26} {:>12.1} {:>26} {:>12.1}",
            format!("{:.1} us", us_(t_old)),
            us_(t_mid),
            format!("{:.1} / {:.1} us", us_(t_exp_slot), us_(t_exp_old)),
            us_(t_exp_mid)
        );
    }
}

/// The CUDA grids (kernels/cuda/iq_grids.cuh) hold the CPU's tables row for row (both generated by
/// `scripts/make_iq_grids.py`; a hand edit or a stale regeneration of one would make the GPU decode differently).
#[test]
fn the_cuda_grids_equal_the_cpu_grids() {
    use crate::quant::grids::*;
    let header = nebula_kernels::HEADERS.iter().find(|(n, _)| *n == "iq_grids.cuh").expect("the grid header").1;
    let table = |name: &str| -> Vec<u64> {
        let start = header.find(&format!(" {name}[")).unwrap_or_else(|| panic!("{name} missing"));
        let body = &header[start..];
        let body = &body[body.find('{').unwrap() + 1..body.find('}').unwrap()];
        body.split(',')
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(|v| match v.strip_prefix("0x") {
                Some(h) => u64::from_str_radix(h, 16).unwrap(),
                None => v.parse::<i64>().unwrap() as u64,
            })
            .collect()
    };
    assert_eq!(table("iq2xxs_grid"), IQ2XXS_GRID.to_vec());
    assert_eq!(table("iq2xs_grid"), IQ2XS_GRID.to_vec());
    assert_eq!(table("iq2s_grid"), IQ2S_GRID.to_vec());
    assert_eq!(table("iq1s_grid"), IQ1S_GRID.to_vec());
    assert_eq!(table("iq3xxs_grid"), IQ3XXS_GRID.iter().map(|&v| v as u64).collect::<Vec<_>>());
    assert_eq!(table("iq3s_grid"), IQ3S_GRID.iter().map(|&v| v as u64).collect::<Vec<_>>());
    assert_eq!(table("ksigns_iq2xs"), KSIGNS_IQ2XS.iter().map(|&v| v as u64).collect::<Vec<_>>());
    assert_eq!(table("kvalues_mxfp4"), KVALUES_MXFP4.iter().map(|&v| v as i64 as u64).collect::<Vec<_>>());
}

/// Every kernel a KV cache type's attention launches exists for that type (no GPU needed): the row store, the
/// three attention kernels and, for the indexer key types, pooling and scoring.
#[test]
fn every_kv_cache_type_has_its_attention_kernels() {
    use crate::model::KvCacheType;
    let names = nebula_kernels::all_kernel_names();
    for ty in KvCacheType::ALL {
        let s = super::kv_cache::kv_suffix(ty);
        let mut want = vec![
            format!("kv_store_rows_{s}"),
            format!("attention_{s}"),
            format!("attention_gqa_{s}"),
            format!("attention_part_{s}"),
        ];
        // The indexer keys of every cache type, whatever their width (KvCacheType::index_key_type).
        for w in [16, 128] {
            let it = super::kv_cache::kv_suffix(ty.index_key_type(w));
            want.extend([format!("kv_store_rows_{it}"), format!("qsa_pool_new_{it}"), format!("qsa_scores_{it}")]);
        }
        for w in want {
            assert!(names.contains(&w), "{ty}: no kernel {w}");
        }
    }
    for w in ["kv_cold_gather", "kv_ring_fill"] {
        assert!(names.iter().any(|n| n == w), "no kernel {w}");
    }
}

/// The device's KV row store writes the CPU cache's bytes (`model::KvRows`, ggml's quantizers) bit for bit from
/// the same f32 rows, for every type, into ring slots and the mapped host copy alike.
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release -p nebula-engine -- --ignored kernel_types"]
fn kernel_types_kv_cache_rows_match_the_cpu() {
    use crate::model::{KvCacheType, KvRows};
    let ctx = launch();
    let stream = ctx.dev.stream();
    // Six rows from position 5 into a ring of 8: slots 5, 6, 7, 0, 1, 2, wrapping without a slot written twice in
    // one launch (in use the window holds a whole prefill chunk, so a launch never laps its ring).
    let (n, width, ring, at) = (6, 128, 8, 5usize);
    let x = activations(n, width, 11);
    for ty in KvCacheType::ALL {
        let rb = ty.row_bytes(width);
        let mut cpu = KvRows::new(ty, width);
        cpu.push(&x);
        let want = cpu.bytes(n).into_owned();
        let src = upload(&ctx, &x);
        let ring_buf = stream.alloc_zeros::<u8>(ring * rb).unwrap();
        // Rows 0..n at positions at..at + n: ring slots (at + t) % ring, host rows at + t.
        let host = super::kv_cache::MappedHost::new((n + at) * rb).unwrap();
        let pos = upload(&ctx, &[at as i32]);
        ctx.dev
            .launch_1d(
                &format!("kv_store_rows_{}", super::kv_cache::kv_suffix(ty)),
                n * width,
                &[
                    Arg::Ptr(ptr(&src, stream, 0)),
                    Arg::Ptr(ptr(&ring_buf, stream, 0)),
                    Arg::Ptr(host.device_addr(0)),
                    Arg::Ptr(ptr(&pos, stream, 0)),
                    Arg::I32(n as i32),
                    Arg::I32(width as i32),
                    Arg::I32(ring as i32),
                ],
            )
            .unwrap();
        let mut back = vec![0u8; ring * rb];
        stream.memcpy_dtoh(&ring_buf, &mut back).unwrap();
        stream.synchronize().unwrap();
        assert_eq!(host.slice((n + at) * rb)[at * rb..], want[..], "{ty}: the host copy differs from the CPU's bytes");
        for t in 0..n {
            let slot = (at + t) % ring;
            assert_eq!(back[slot * rb..(slot + 1) * rb], want[t * rb..(t + 1) * rb], "{ty}: ring row {t}");
        }
    }
}

/// `rope_heads` with a sequence's M-RoPE table (`[cache index][3]`, read at the cache indices from the position
/// in `pos_dev`) rotates every head as the CPU's `Rope::angles_thw` at those positions, each frequency slot with
/// its section's stream (time, height or width), and without a table as `Rope::angles` at the indices. Bound:
/// `1e-5 x max |x|` per value (the frequencies are computed on the device with `powf`, the angles' cos and sin in
/// double on both sides).
#[test]
#[ignore = "needs an NVIDIA GPU: cargo test --release -p nebula-engine -- --ignored kernel_types"]
fn kernel_types_mrope_rotation_matches_the_cpu() {
    let mut ctx = launch();
    ctx.cfg.rope_dim = 64;
    ctx.cfg.rope_theta = 1e7;
    ctx.cfg.rope_sections = [11, 11, 10, 0];
    let (n, heads, hd, pos0) = (12usize, 3usize, 96usize, 5usize);
    let stream = ctx.dev.stream().clone();
    let x = activations(n, heads * hd, 21);
    // Cache indices 0..pos0 + n: text, then an image of 3 x 4 merged tokens at p = 5, then text from 9.
    let mut table: Vec<[u32; 3]> = (0..pos0 as u32).map(|i| [i; 3]).collect();
    for r in 0..3u32 {
        for c in 0..4u32 {
            table.push([5, 5 + r, 5 + c]);
        }
    }
    assert_eq!(table.len(), pos0 + n);
    let flat: Vec<i32> = table.iter().flatten().map(|&v| v as i32).collect();
    let rope = crate::model::rope::Rope::new(ctx.cfg.rope_dim, ctx.cfg.rope_theta, ctx.cfg.rope_sections);
    let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    for with_table in [true, false] {
        let buf = upload(&ctx, &x);
        let thw = upload(&ctx, &flat);
        let pos = upload(&ctx, &[pos0 as i32]);
        let table_ptr = if with_table { ptr(&thw, &stream, 0) } else { 0 };
        ctx.rope(ptr(&buf, &stream, 0), n, heads, heads * hd, hd, ptr(&pos, &stream, 0), table_ptr).unwrap();
        let got = download(&ctx, &buf);
        let mut want = x.clone();
        for t in 0..n {
            let p = if with_table { table[pos0 + t].map(|v| v as usize) } else { [pos0 + t; 3] };
            let a = rope.angles_thw(p);
            for h in 0..heads {
                rope.apply(&mut want[(t * heads + h) * hd..(t * heads + h + 1) * hd], &a);
            }
        }
        let err = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
        println!("rope_heads (M-RoPE table: {with_table}): max |delta| {err:.2e} x max |x|");
        assert!(err <= 1e-5, "rope_heads (table {with_table}): {err:.2e} x max |x|");
        // Dims past rope_dim are untouched.
        for t in 0..n {
            for h in 0..heads {
                let at = (t * heads + h) * hd;
                assert_eq!(got[at + 64..at + hd], x[at + 64..at + hd], "token {t} head {h}: dims past rope_dim");
            }
        }
        if with_table {
            // The image rows differ from text rotation at the same indices (the table is read).
            let text = rope.angles(pos0 + 1);
            let mut t1 = x[heads * hd..heads * hd + hd].to_vec();
            rope.apply(&mut t1, &text);
            let d = t1.iter().zip(&got[heads * hd..heads * hd + hd]).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(d > 1e-3 * scale, "an image token rotated as text");
        }
    }
}
