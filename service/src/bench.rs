//! `nebula bench kernels`: the CPU kernels against the machine's own memory bandwidth, measured in one run.
//!
//! 1. Read bandwidth: a STREAM-like pass (sum of 64-bit words) over a buffer much larger than the caches,
//!    split evenly over the threads, for each thread count.
//! 2. Expert matrix-vector throughput: for each type and expert shape (`[640, 2560]` gate/up, `[2560, 640]`
//!    down; a shape whose rows are not whole blocks of the type is reported as n/a), a stack of experts far
//!    larger than the caches (512 by default, as one qwen4exp layer) and, per iteration, 10 distinct experts
//!    drawn at random times one token, as MoE decode reads them:
//!    - `moe10`: the 10 products in one parallel region over their rows (the MoE kernel's shape of work);
//!    - `matvec`: 10 calls of `Matrix::matvec` (a parallel region each).
//!
//!    The figure is weight bytes read per second and its fraction of the read bandwidth at the same thread
//!    count. Activations are prepared once, outside the timing (per token they are a few microseconds).
//! 3. The MoE kernel as the model runs it (`quant::moe::routed_experts`, one parallel region): a layer of
//!    `--experts` experts in the `nebula-q4` types (Q4_K gate and up `[640, 2560]`, IQ4_NL down `[2560, 640]`),
//!    batches of 1 and 17 tokens each routed to 10 random experts, activation quantization included; weight
//!    bytes of the distinct experts touched per second.
//!
//! Numbers are printed, never asserted: this is a benchmark, not a test.

use std::time::Instant;

use anyhow::{Context, bail};
use nebula_engine::bench::read_bandwidth;
use nebula_engine::gguf::GgmlType;
use nebula_engine::quant::moe::{ExpertRef, ExpertWork, routed_experts};
use nebula_engine::quant::{Isa, Matrix, WeightBytes, quantize, synthetic_blocks};
use rayon::prelude::*;

/// Options of `nebula bench kernels`.
#[derive(Debug, Clone, clap::Args)]
pub struct KernelBenchArgs {
    /// Thread counts, comma-separated (default: 1, 2, 4, ... and the machine's core count).
    #[arg(long, value_delimiter = ',')]
    pub threads: Vec<usize>,
    /// Weight types, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "q4_k,iq4_nl,q6_k,q8_0,iq2_xxs,iq2_xs,iq2_s,iq3_xxs,iq3_s")]
    pub types: Vec<String>,
    /// Experts in each stack (a qwen4exp layer has 512).
    #[arg(long, default_value_t = 512)]
    pub experts: usize,
    /// Size of the read-bandwidth buffer in GiB.
    #[arg(long, default_value_t = 2.0)]
    pub stream_gib: f64,
    /// Seconds of timed work per measurement.
    #[arg(long, default_value_t = 0.5)]
    pub seconds: f64,
    /// Highest instruction set the kernels may use (scalar, avx2, avx512); default the best available.
    #[arg(long)]
    pub isa: Option<Isa>,
}

fn parse_type(s: &str) -> anyhow::Result<GgmlType> {
    GgmlType::ALL
        .iter()
        .copied()
        .find(|t| t.name().eq_ignore_ascii_case(s))
        .with_context(|| format!("unknown type '{s}'"))
}

fn pool(threads: usize) -> anyhow::Result<rayon::ThreadPool> {
    Ok(rayon::ThreadPoolBuilder::new().num_threads(threads).build()?)
}

/// One expert's bytes: quantized from random data when the converter can write the type, else synthetic
/// blocks with normal scales.
fn expert_bytes(ty: GgmlType, rows: usize, cols: usize) -> anyhow::Result<Vec<u8>> {
    if quantize::QUANTIZABLE.contains(&ty) {
        let mut s = 0x1234_5678_9abc_def1u64;
        let vals: Vec<f32> = (0..rows * cols)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.05
            })
            .collect();
        Ok(quantize::quantize_tensor(ty, &vals, cols, None)?)
    } else {
        Ok(synthetic_blocks(ty, rows * cols / ty.block_size(), 0.001, 7))
    }
}

struct Stack {
    experts: Vec<Matrix>,
    bytes_each: usize,
}

fn build_stack(ty: GgmlType, rows: usize, cols: usize, n: usize, isa: Isa) -> anyhow::Result<Stack> {
    let one = expert_bytes(ty, rows, cols)?;
    let each = one.len();
    let mut all = vec![0u8; each * n];
    all.par_chunks_mut(each).for_each(|c| c.copy_from_slice(&one));
    let wb = WeightBytes::from_vec(all);
    let experts = (0..n)
        .map(|e| Ok(Matrix::new(ty, rows, cols, wb.slice(e * each..(e + 1) * each)?)?.with_isa(isa)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Stack { experts, bytes_each: each })
}

/// 10 distinct expert indices below `n`.
fn draw10(state: &mut u64, n: usize) -> [usize; 10] {
    let mut out = [usize::MAX; 10];
    let mut k = 0;
    while k < 10 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        let e = (*state % n as u64) as usize;
        if !out[..k].contains(&e) {
            out[k] = e;
            k += 1;
        }
    }
    out
}

/// Bytes/s of `step` (each call returns the weight bytes it read): three untimed calls, then calls for at least
/// `seconds` and at least five times. Run it inside the benchmark's pool, as the engine calls its kernels
/// (entering a rayon pool from outside costs a thread wake-up each way, tens of microseconds a call).
fn timed_rate(seconds: f64, mut step: impl FnMut() -> usize) -> f64 {
    for _ in 0..3 {
        step();
    }
    let start = Instant::now();
    let (mut iters, mut bytes) = (0u64, 0usize);
    while start.elapsed().as_secs_f64() < seconds || iters < 5 {
        bytes += step();
        iters += 1;
    }
    bytes as f64 / start.elapsed().as_secs_f64()
}

/// Weight bytes/s of the 10-expert products in `mode`.
fn expert_throughput(stack: &Stack, threads: usize, seconds: f64, one_region: bool) -> anyhow::Result<f64> {
    const ROWS: usize = 16;
    let p = pool(threads)?;
    let m0 = &stack.experts[0];
    let (rows, cols) = (m0.rows(), m0.cols());
    let x: Vec<f32> = (0..cols).map(|i| ((i * 7919 % 1000) as f32 / 1000.0) - 0.5).collect();
    let acts = m0.prepare(&x, 1);
    let mut y = vec![0f32; 10 * rows];
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let chunks = rows.div_ceil(ROWS);
    let run = |ids: [usize; 10], y: &mut [f32]| {
        if one_region {
            y.par_chunks_mut(ROWS).enumerate().for_each(|(i, out)| {
                let (e, c) = (ids[i / chunks], i % chunks);
                let r0 = c * ROWS;
                stack.experts[e].dot_rows(r0..r0 + out.len(), &acts, 0..1, out);
            });
        } else {
            for (k, &e) in ids.iter().enumerate() {
                stack.experts[e].matvec_prepared(&acts, &mut y[k * rows..(k + 1) * rows]);
            }
        }
    };
    // Rows of each expert fill whole chunks only when rows % 16 == 0 (640 and 2560 both do).
    if rows % ROWS != 0 {
        bail!("expert rows {rows} are not a multiple of {ROWS}");
    }
    let n = stack.experts.len();
    let rate = p.install(|| {
        timed_rate(seconds, || {
            run(draw10(&mut rng, n), &mut y);
            10 * stack.bytes_each
        })
    });
    std::hint::black_box(&y);
    Ok(rate)
}

/// Weight bytes/s of the MoE kernel for `tokens` tokens, each routed to 10 random experts of the layer.
fn moe_kernel_throughput(
    gate: &Stack,
    up: &Stack,
    down: &Stack,
    tokens: usize,
    threads: usize,
    spin_us: u64,
    seconds: f64,
) -> anyhow::Result<f64> {
    let p = pool(threads)?;
    let d = gate.experts[0].cols();
    let x: Vec<f32> = (0..tokens * d).map(|i| ((i * 7919 % 1000) as f32 / 1000.0) - 0.5).collect();
    let mut out = vec![0f32; tokens * d];
    let n = gate.experts.len();
    let expert_bytes = gate.bytes_each + up.bytes_each + down.bytes_each;
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let step = |out: &mut [f32], rng: &mut u64| -> usize {
        let mut by: Vec<Vec<(usize, f32)>> = vec![Vec::new(); n];
        for t in 0..tokens {
            for e in draw10(rng, n) {
                by[e].push((t, 0.1));
            }
        }
        let work: Vec<ExpertWork<'_>> = by
            .into_iter()
            .enumerate()
            .filter(|(_, toks)| !toks.is_empty())
            .map(|(e, toks)| ExpertWork {
                expert: ExpertRef { gate: &gate.experts[e], up: &up.experts[e], down: &down.experts[e] },
                tokens: toks,
            })
            .collect();
        routed_experts(&work, &x, tokens, out);
        work.len() * expert_bytes
    };
    let rate = p.install(|| {
        nebula_engine::quant::spin_pool::set_spin(spin_us);
        timed_rate(seconds, || step(&mut out, &mut rng))
    });
    std::hint::black_box(&out);
    Ok(rate)
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn l3_size() -> String {
    std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index3/size")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// Runs the kernel benchmark and prints its tables.
pub fn run_kernels(args: &KernelBenchArgs) -> anyhow::Result<()> {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mut threads = args.threads.clone();
    if threads.is_empty() {
        let mut t = 1;
        while t < cores {
            threads.push(t);
            t *= 2;
        }
        for extra in [cores.saturating_sub(2), cores] {
            if extra > 0 && !threads.contains(&extra) {
                threads.push(extra);
            }
        }
        threads.sort_unstable();
    }
    let isa = args.isa.map(|i| i.min(Isa::detect())).unwrap_or_else(Isa::detect);
    let types = args.types.iter().map(|s| parse_type(s)).collect::<anyhow::Result<Vec<_>>>()?;
    println!(
        "nebula bench kernels: {} ({cores} cores, L3 {}), kernels: {isa}, threads {threads:?}",
        cpu_model(),
        l3_size()
    );

    let words = (args.stream_gib * (1u64 << 30) as f64) as usize / 8;
    let mut buf = vec![0u64; words];
    buf.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(i, c)| c.iter_mut().enumerate().for_each(|(j, w)| *w = (i ^ j) as u64));
    println!("\nread bandwidth (sum of 64-bit words over {:.1} GiB)", args.stream_gib);
    println!("{:>8} {:>12}", "threads", "GB/s");
    let mut bw = Vec::new();
    for &t in &threads {
        let b = read_bandwidth(&buf, t, args.seconds)?;
        println!("{t:>8} {:>12.2}", b / 1e9);
        bw.push(b);
    }
    drop(buf);

    println!(
        "\nexpert matrix-vector products: 10 random experts of {} per iteration, one token\n(moe10: the 10 products in \
         one parallel region over their rows; matvec: 10 calls one after another; % of read: of the read bandwidth \
         above at the same thread count)",
        args.experts
    );
    println!(
        "{:>8} {:>12} {:>7} {:>8} {:>10} {:>12} {:>9}",
        "type", "rows x cols", "mode", "threads", "stack MiB", "GB/s", "% of read"
    );
    for &ty in &types {
        for (rows, cols) in [(640usize, 2560usize), (2560, 640)] {
            if cols % ty.block_size() != 0 {
                println!(
                    "{:>8} {:>12} {:>7} not measured: rows of {cols} values are not whole {}-value blocks (such rows are stored in a 32-block type)",
                    ty.name(),
                    format!("{rows}x{cols}"),
                    "-",
                    ty.block_size()
                );
                continue;
            }
            let stack = build_stack(ty, rows, cols, args.experts, isa)?;
            let mib = (stack.bytes_each * args.experts) as f64 / (1 << 20) as f64;
            for (mode, one_region) in [("moe10", true), ("matvec", false)] {
                for (ti, &t) in threads.iter().enumerate() {
                    let r = expert_throughput(&stack, t, args.seconds, one_region)?;
                    println!(
                        "{:>8} {:>12} {:>7} {t:>8} {mib:>10.0} {:>12.2} {:>8.1}%",
                        ty.name(),
                        format!("{rows}x{cols}"),
                        mode,
                        r / 1e9,
                        100.0 * r / bw[ti]
                    );
                }
            }
        }
    }

    println!(
        "\nMoE kernel (routed_experts, one region): {} experts, Q4_K gate/up 640x2560, IQ4_NL down 2560x640, 10 experts/token",
        args.experts
    );
    println!(
        "(pool: rayon's, or the spinning pool the hybrid path's CPU thread uses for one-token batches,\n engine/src/quant/spin_pool.rs; NEBULA_CPU_SPIN_US=0 makes both rows rayon's)\n{:>8} {:>8} {:>9} {:>12} {:>9}",
        "tokens", "threads", "pool", "GB/s", "% of read"
    );
    let gate = build_stack(GgmlType::Q4_K, 640, 2560, args.experts, isa)?;
    let up = build_stack(GgmlType::Q4_K, 640, 2560, args.experts, isa)?;
    let down = build_stack(GgmlType::IQ4_NL, 2560, 640, args.experts, isa)?;
    for tokens in [1usize, 17] {
        for (ti, &t) in threads.iter().enumerate() {
            // The spinning pool serves one-token batches only (engine/src/quant/moe.rs).
            let pools: &[(u64, &str)] = if tokens == 1 { &[(0, "rayon"), (2000, "spinning")] } else { &[(0, "rayon")] };
            for &(spin, name) in pools {
                let _ = nebula_engine::quant::moe::trace::report(); // (drops earlier calls' events)
                let r = moe_kernel_throughput(&gate, &up, &down, tokens, t, spin, args.seconds)?;
                println!("{tokens:>8} {t:>8} {name:>9} {:>12.2} {:>8.1}%", r / 1e9, 100.0 * r / bw[ti]);
                if let Some(trace) = nebula_engine::quant::moe::trace::report() {
                    println!("         {trace}");
                }
            }
        }
    }
    Ok(())
}
