//! Placement on the demo model (4 layers, 32 experts, top-4, a PLE layer): outputs bit-identical to the
//! memory-mapped model for any tiers, pool size, reader and table placement; read faults fail the call and leave
//! the model usable; placements that do not fit are refused before allocating.

use std::path::PathBuf;
use std::sync::Arc;

use super::*;
use crate::gguf::GgufFile;
use crate::model::{LogitsFor, Qwen4Exp};

fn demo_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/nebula-demo.gguf")
}

/// A prompt of ordinary tokens, with an EOS inside so the PLE rows cross a segment start.
fn prompt() -> Vec<u32> {
    let mut p: Vec<u32> = (0..40u32).map(|i| 1000 + (i * 7919) % 150_000).collect();
    p[20] = 248_044;
    p
}

/// Logits of a prefill then `steps` greedy steps, as bits.
fn run(model: &Qwen4Exp, steps: usize) -> Result<Vec<u32>, ModelError> {
    let p = prompt();
    let mut st = model.new_state(p.len() + steps + 1);
    let mut all = Vec::new();
    let mut logits = model.forward(&mut st, &p, LogitsFor::Last)?;
    for _ in 0..steps {
        all.extend(logits.iter().map(|v| v.to_bits()));
        let next = crate::sampling::argmax(&logits).unwrap_or(0) as u32;
        logits = model.forward(&mut st, &[next], LogitsFor::Last)?;
    }
    all.extend(logits.iter().map(|v| v.to_bits()));
    Ok(all)
}

/// A hotlist that ranks experts in a shuffled order, different per layer.
fn shuffled_hotlist(model: &Qwen4Exp) -> Hotlist {
    let (nl, ne) = (model.config.n_layer, model.config.n_expert);
    let mut b = HotlistBuilder::new(nl, ne);
    for l in 0..nl {
        let routing: Vec<Routing> =
            (0..ne).map(|e| Routing { experts: vec![(e * 13 + l * 5) % ne], weights: vec![1.0] }).collect();
        for (i, r) in routing.iter().enumerate() {
            // Expert order i gets i + 1 uses: later entries are hotter.
            for _ in 0..=i {
                b.record(l, std::slice::from_ref(r));
            }
        }
    }
    b.finish(
        HotlistModel { name: "demo".into(), n_layer: nl, n_expert: ne, n_expert_used: model.config.n_expert_used },
        serde_json::json!({}),
    )
}

#[test]
fn outputs_are_identical_whatever_the_placement() {
    let reference = run(&Qwen4Exp::load(&demo_path()).unwrap(), 6).unwrap();
    let hot = Arc::new(shuffled_hotlist(&Qwen4Exp::load(&demo_path()).unwrap()));
    let cases: Vec<(&str, PlacementOptions)> = vec![
        // Everything in RAM (read through direct I/O), table in RAM.
        ("all ram", PlacementOptions { ngram_table: TablePlacement::Ram, ..Default::default() }),
        // Tiny tiers: 2 GPU, 4 RAM, 28 of 32 on SSD with the smallest pool (groups of 4), table on SSD.
        (
            "tiny tiers",
            PlacementOptions {
                gpu_experts: 2,
                ram_experts: 4,
                ssd_pool_bytes: Some(1),
                ngram_table: TablePlacement::Ssd,
                io_threads: 3,
                ..Default::default()
            },
        ),
        // No RAM tier at all, a hotlist, buffered reads, no prefetch, one I/O thread.
        (
            "all ssd",
            PlacementOptions {
                ram_experts: 0,
                hotlist: Some(hot.clone()),
                direct_io: false,
                prefetch_layers: 0,
                io_threads: 1,
                ngram_table: TablePlacement::Ssd,
                ..Default::default()
            },
        ),
        // Two layers of prefetch, a bigger pool, the hotlist's ranking.
        (
            "prefetch 2",
            PlacementOptions {
                gpu_experts: 3,
                ram_experts: 10,
                hotlist: Some(hot),
                prefetch_layers: 2,
                ssd_pool_bytes: Some(1 << 20),
                ..Default::default()
            },
        ),
    ];
    for (name, opts) in cases {
        let mut model = Qwen4Exp::load(&demo_path()).unwrap();
        model.place(&opts).unwrap_or_else(|e| panic!("{name}: {e}"));
        let report = model.placement_report();
        assert!(report.placed, "{name}");
        let got = run(&model, 6).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(got == reference, "{name}: logits differ from the memory-mapped model's");
        let s = model.placement_stats().snapshot();
        let (_, _, ssd) = report.totals();
        if ssd > 0 {
            assert!(s.expert_hits_ssd > 0 && s.ssd_expert_bytes > 0, "{name}: no SSD reads counted: {s:?}");
            assert!(report.ssd.as_ref().is_some_and(|r| r.pool_buffers >= 8), "{name}: {report:?}");
        } else {
            assert_eq!((s.expert_hits_ssd, s.ssd_expert_reads), (0, 0), "{name}");
        }
        if opts.ngram_table == TablePlacement::Ssd {
            assert!(s.ngram_rows_read >= prompt().len() as u64 * 16, "{name}: n-gram rows not read: {s:?}");
        }
        if name == "prefetch 2" {
            assert!(s.prefetch_issued > 0, "{name}: the prefetcher never ran: {s:?}");
        }
    }
}

#[test]
fn tiers_follow_the_ranking_and_the_counts() {
    let model = Qwen4Exp::load(&demo_path()).unwrap();
    let hot = shuffled_hotlist(&model);
    let plan = PlacementPlan::new(4, 32, 3, 10, Some(&hot)).unwrap();
    for l in 0..4 {
        let rank = hot.ranking(l);
        assert_eq!(plan.experts(l, Tier::Gpu).len(), 3);
        assert_eq!(plan.experts(l, Tier::Ram).len(), 7);
        assert_eq!(plan.experts(l, Tier::Ssd).len(), 22);
        assert!(rank[..3].iter().all(|&e| plan.tiers[l][e] == Tier::Gpu), "layer {l}: top 3 on the GPU");
        assert!(rank[10..].iter().all(|&e| plan.tiers[l][e] == Tier::Ssd), "layer {l}: the rest on SSD");
    }
    let id_order = PlacementPlan::new(4, 32, 1, 2, None).unwrap();
    assert_eq!(id_order.experts(0, Tier::Gpu), vec![0]);
    assert_eq!(id_order.experts(3, Tier::Ram), vec![1]);
    let e = PlacementPlan::new(4, 32, 5, 4, None).unwrap_err().to_string();
    assert!(e.contains("fewer than the 5 GPU experts"), "{e}");
    let e = PlacementPlan::new(4, 32, 33, 40, None).unwrap_err().to_string();
    assert!(e.contains("33 GPU experts"), "{e}");
    let e = PlacementPlan::new(5, 32, 0, 4, Some(&hot)).unwrap_err().to_string();
    assert!(e.contains("4 layers x 32 experts") && e.contains("5 layers"), "{e}");
}

#[test]
fn a_read_error_fails_the_call_and_the_model_stays_usable() {
    let reference = run(&Qwen4Exp::load(&demo_path()).unwrap(), 2).unwrap();
    let mut model = Qwen4Exp::load(&demo_path()).unwrap();
    let faulty = Arc::new(FaultyReader::new(Arc::new(MemoryReader::new(model.file().clone()))));
    let opts =
        PlacementOptions { ram_experts: 4, prefetch_layers: 0, reader: Some(faulty.clone()), ..Default::default() };
    model.place(&opts).unwrap();
    faulty.fail_next(1);
    let err = run(&model, 2).unwrap_err().to_string();
    assert!(err.contains("SSD tier") && err.contains("nebula-demo.gguf") && err.contains("os error 5"), "{err}");
    assert_eq!(faulty.failed(), 1);
    // The failed expert is read again next time; the answer is the usual one.
    assert!(run(&model, 2).unwrap() == reference, "after a failed read the model answers as before");
    assert_eq!(model.placement_stats().snapshot().ssd_read_errors, 1);

    // n-gram rows on SSD fail the same way.
    let mut model = Qwen4Exp::load(&demo_path()).unwrap();
    let faulty = Arc::new(FaultyReader::new(Arc::new(MemoryReader::new(model.file().clone()))));
    let opts =
        PlacementOptions { ngram_table: TablePlacement::Ssd, reader: Some(faulty.clone()), ..Default::default() };
    model.place(&opts).unwrap();
    faulty.fail_next(1);
    let err = run(&model, 2).unwrap_err().to_string();
    assert!(err.contains("n-gram table rows"), "{err}");
    assert!(run(&model, 2).unwrap() == reference);
}

#[test]
fn a_truncated_file_fails_the_call_with_the_file_and_offset() {
    let bytes = std::fs::read(demo_path()).unwrap();
    let dir = std::env::temp_dir().join(format!("nebula-placement-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("demo-copy.gguf");
    std::fs::write(&copy, &bytes).unwrap();
    // The model is parsed from memory; its SSD tier reads the copy on disk, which is then cut.
    let mut model = Qwen4Exp::from_gguf(Arc::new(GgufFile::from_bytes("demo", bytes.clone()).unwrap())).unwrap();
    let reader = Arc::new(FileReader::open(&[copy.as_path()], true).unwrap());
    let opts = PlacementOptions { ram_experts: 2, prefetch_layers: 0, reader: Some(reader), ..Default::default() };
    model.place(&opts).unwrap();
    std::fs::OpenOptions::new().write(true).open(&copy).unwrap().set_len(bytes.len() as u64 / 4).unwrap();
    let err = run(&model, 1).unwrap_err().to_string();
    assert!(err.contains("demo-copy.gguf") && err.contains("ends at byte"), "{err}");
    // Restored, the same model answers.
    std::fs::write(&copy, &bytes).unwrap();
    run(&model, 1).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn placements_that_do_not_fit_are_refused_before_allocating() {
    let mut model = Qwen4Exp::load(&demo_path()).unwrap();
    let tiny = PlacementOptions { ram_budget: Some(1 << 20), ..Default::default() };
    let e = model.place(&tiny).unwrap_err().to_string();
    assert!(e.contains("does not fit") && e.contains("RAM budget is 0.00 GiB") && e.contains("RAM tier"), "{e}");
    let vram = PlacementOptions { gpu_experts: 8, ram_experts: 8, vram_budget: Some(1000), ..Default::default() };
    let e = model.place(&vram).unwrap_err().to_string();
    assert!(e.contains("VRAM budget") && e.contains("8 GPU experts per layer"), "{e}");
    assert!(!model.placement_report().placed, "a refused placement leaves the model unplaced");
    run(&model, 1).unwrap();
}

/// The VRAM a placement plans holds the MTP block's dense weights but not its routed experts (the CPU computes
/// them in hybrid mode): appending a block to the demo model adds exactly its other tensors to the plan.
#[test]
fn the_vram_plan_leaves_the_mtp_experts_on_the_host() {
    let dir = std::env::temp_dir().join(format!("nebula-placement-mtp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let with = crate::synth::append_random_mtp(&demo_path(), &dir.join("mtp.gguf"), 7).unwrap();
    let opts = PlacementOptions { gpu_experts: 8, ram_experts: 32, lock_memory: false, ..Default::default() };
    let mut plain = Qwen4Exp::load(&demo_path()).unwrap();
    plain.place(&opts).unwrap();
    let mut mtp = Qwen4Exp::load(&with).unwrap();
    mtp.place(&opts).unwrap();
    let (routed, all) = (mtp.mtp_routed_expert_bytes(), mtp.mtp_weight_bytes());
    assert!(routed > 0 && routed < all, "the block has routed experts and other weights: {routed} of {all}");
    assert_eq!(plain.mtp_weight_bytes(), 0);
    let (a, b) = (plain.placement_report().memory, mtp.placement_report().memory);
    assert_eq!(b.gpu_expert_bytes, a.gpu_expert_bytes, "the trunk's GPU experts are the same");
    assert_eq!(b.vram_planned_bytes - a.vram_planned_bytes, all - routed, "only the block's non-expert weights");
    drop(mtp);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The CPU half of the hybrid GPU backend: `cpu_routed` (routed experts only, any per-token subset) plus the
/// gated shared expert is the layer's MoE output bit for bit, and gives the same bits from RAM and SSD tiers as
/// from the memory map; `gather_ngram_rows` decodes the same rows wherever the table lives.
#[test]
fn the_hybrid_cpu_half_matches_the_moe_and_the_table() {
    use crate::model::norm::sigmoid;
    use crate::quant::dot_f32;
    let mapped = Qwen4Exp::load(&demo_path()).unwrap();
    let mut tiered = Qwen4Exp::load(&demo_path()).unwrap();
    tiered
        .place(&PlacementOptions {
            gpu_experts: 4,
            ram_experts: 12,
            ngram_table: TablePlacement::Ssd,
            lock_memory: false,
            prefetch_layers: 1,
            ..Default::default()
        })
        .unwrap();
    let cfg = &mapped.config;
    let (n, d) = (5, cfg.hidden);
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let x: Vec<f32> = (0..n * d)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
        })
        .collect();
    for layer in 0..cfg.n_layer {
        let moe = &mapped.layers[layer].mlp;
        let routing = moe.route(&x, n);
        let whole = moe.forward_routed(&x, n, &routing);
        let routed = mapped.cpu_routed(layer, &x, n, &routing).unwrap();
        let shared = crate::model::moe::run_expert(&moe.shared_expert, &x, n);
        for t in 0..n {
            let g = sigmoid(dot_f32(&moe.shared_expert_gate, &x[t * d..(t + 1) * d]));
            for i in 0..d {
                let sum = routed[t * d + i] + g * shared[t * d + i];
                let want = whole[t * d + i];
                assert!((sum - want).abs() <= 1e-5 * want.abs().max(1.0), "layer {layer}: {sum} vs {want}");
            }
        }
        // The same experts from RAM and SSD tiers: the same bits.
        assert_eq!(tiered.cpu_routed(layer, &x, n, &routing).unwrap(), routed, "layer {layer}: tiers changed bits");
        // A subset per token (what the GPU leaves to the CPU), including a token with none.
        let subset: Vec<Routing> = routing
            .iter()
            .enumerate()
            .map(|(t, r)| Routing {
                experts: r.experts[..t.min(r.experts.len())].to_vec(),
                weights: r.weights[..t.min(r.experts.len())].to_vec(),
            })
            .collect();
        let part = mapped.cpu_routed(layer, &x, n, &subset).unwrap();
        assert!(part[..d].iter().all(|&v| v == 0.0), "a token with no CPU experts gets zeros");
        assert_eq!(tiered.cpu_routed(layer, &x, n, &subset).unwrap(), part);
    }
    // n-gram rows: from the SSD-placed table and from the memory map, equal to the table's own decoding.
    let ple = mapped.layers.iter().find_map(|l| l.ple.as_ref()).expect("the demo model has a PLE layer");
    let rows: Vec<u64> = vec![0, 5, ple.ngram_embedding.rows() as u64 - 1, 5];
    let a = mapped.gather_ngram_rows(&rows).unwrap().unwrap();
    let b = tiered.gather_ngram_rows(&rows).unwrap().unwrap();
    assert_eq!(a, b);
    let cols = ple.ngram_embedding.cols();
    let mut one = vec![0f32; cols];
    ple.ngram_embedding.dequantize_row(rows[2] as usize, &mut one);
    assert_eq!(&a[2 * cols..3 * cols], &one[..]);
}

#[test]
fn the_prefetch_gate_closes_while_prefetches_go_unused_and_probes_again() {
    use super::ssd::PrefetchGate;
    let mut g = PrefetchGate::new();
    let (mut issued, mut used) = (0u64, 0u64);
    // Useful prefetches (half of them used): the gate stays open over several windows.
    for _ in 0..10 * PrefetchGate::WINDOW {
        assert!(g.allow(issued, used), "closed with {used} of {issued} used");
        issued += 2;
        used += 1;
    }
    // One in ten used: it closes within two windows (the first may still hold the earlier, useful share).
    let mut calls = 0;
    while g.allow(issued, used) {
        issued += 10;
        used += 1;
        calls += 1;
        assert!(calls as u64 <= 2 * PrefetchGate::WINDOW / 10 + 2, "still open after {calls} calls");
    }
    // Closed: the next PROBE - 1 calls are refused, then it opens for a fresh window.
    for i in 1..PrefetchGate::PROBE {
        assert!(!g.allow(issued, used), "open again after {i} skipped calls");
    }
    assert!(g.allow(issued, used), "the probe window did not open");
    // In the probe window prefetches pay again: it stays open.
    for _ in 0..3 * PrefetchGate::WINDOW {
        issued += 1;
        used += 1;
        assert!(g.allow(issued, used));
    }
}

#[test]
fn the_ssd_tier_read_bandwidth_is_measured_only_with_an_ssd_tier() {
    let mut m = Qwen4Exp::load(&demo_path()).unwrap();
    assert!(m.ssd_read_bandwidth(0.05).is_none(), "an unplaced model has no SSD tier");
    m.place(&PlacementOptions { ram_experts: 8, lock_memory: false, ..Default::default() }).unwrap();
    let b = m.ssd_read_bandwidth(0.05).expect("an SSD tier").unwrap();
    assert!(b > 0.0 && b.is_finite(), "{b}");
    // Reading for the measurement leaves the model's outputs unchanged.
    let mut plain = Qwen4Exp::load(&demo_path()).unwrap();
    plain.place(&PlacementOptions { ram_experts: usize::MAX, lock_memory: false, ..Default::default() }).unwrap();
    assert_eq!(run(&m, 2).unwrap(), run(&plain, 2).unwrap());
}

/// Streamed prefill reads the next group's SSD experts ahead (`request_experts`) while it takes the current
/// group's in order (`host_expert`): the read-ahead must not evict the current group's experts that have landed but
/// were not taken yet (they would be read twice), even when the two groups do not fit in the pool together.
#[test]
fn a_read_ahead_never_evicts_experts_read_ahead_and_not_yet_used() {
    let mut m = Qwen4Exp::load(&demo_path()).unwrap();
    m.place(&PlacementOptions { ram_experts: 0, lock_memory: false, prefetch_layers: 0, ..Default::default() })
        .unwrap();
    let p = m.placement.as_ref().expect("placed");
    let capacity = p.ssd.as_ref().expect("an SSD tier").capacity();
    let group = capacity - capacity / 4;
    assert!(2 * group > capacity && 2 * group <= m.config.n_expert, "pool {capacity}, groups of {group}");
    let (g0, g1): (Vec<usize>, Vec<usize>) = ((0..group).collect(), (group..2 * group).collect());
    let layer = 1;
    let moe = &m.layers[layer].mlp;
    let before = m.placement_stats().snapshot();
    p.request_experts(layer, &g0);
    // Let the first group's reads land (then they are evictable by age alone).
    std::thread::sleep(std::time::Duration::from_millis(300));
    p.request_experts(layer, &g1);
    for &e in g0.iter().chain(&g1) {
        drop(p.host_expert(layer, e, moe).unwrap());
    }
    let after = m.placement_stats().snapshot();
    assert_eq!(after.ssd_expert_reads - before.ssd_expert_reads, 2 * group as u64, "an expert was read twice");
}
