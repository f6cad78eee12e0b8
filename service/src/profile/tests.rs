//! Profile tests. The expected figures are typed in again from the original product's table, not read from
//! `deploy/profiles.toml`, so an edit of the table file that changes a figure fails here.

use super::*;
use nebula_engine::gguf::GgmlType;

/// One VRAM step of the table: (VRAM GB, GPU experts, max prefill, max context, CPU experts for 32/64/96/128 GB RAM,
/// SSD experts for 32/64/96/128 GB RAM).
type SpecLine = (u32, u32, u64, u64, [u32; 4], [u32; 4]);

/// The product's table. The n-gram table is on SSD except with 128 GB of RAM.
const SPEC_TABLE: [SpecLine; 4] = [
    (8, 11, 1024, 8192, [141, 400, 501, 501], [360, 101, 0, 0]),
    (12, 27, 2048, 24576, [124, 383, 485, 485], [361, 102, 0, 0]),
    (16, 34, 4096, 49152, [114, 372, 478, 478], [364, 106, 0, 0]),
    (24, 54, 8182, 98304, [90, 348, 458, 458], [368, 110, 0, 0]),
];
const RAM_STEPS: [u32; 4] = [32, 64, 96, 128];

/// Nebula's context per VRAM step: (VRAM GB, max context, KV window), with 8-bit KV caches (`q8_0`).
const NEBULA_CONTEXT: [(u32, u64, u64); 4] =
    [(8, 65536, 16384), (12, 131072, 65536), (16, 262144, 131072), (24, 262144, 0)];

fn nebula_context(vram: u32) -> (u64, u64) {
    NEBULA_CONTEXT.iter().find(|c| c.0 == vram).map(|c| (c.1, c.2)).expect("a VRAM step")
}

/// A `nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits` answer.
fn smi(lines: &[(u32, &str, u64)]) -> String {
    lines.iter().map(|(i, n, m)| format!("{i}, {n}, {m}\n")).collect()
}

/// A `/proc/meminfo` with the given MemTotal in kB.
fn meminfo(total_kib: u64) -> String {
    format!(
        "MemTotal:       {total_kib} kB\nMemFree:         1000000 kB\nMemAvailable:   {} kB\nBuffers:  1 kB\n",
        total_kib / 2
    )
}

/// An 8-core, 16-thread, one-socket `/proc/cpuinfo`.
fn cpuinfo_8c16t() -> String {
    (0..16).map(|p| format!("processor\t: {p}\nphysical id\t: 0\ncore id\t\t: {}\nsiblings\t: 16\n\n", p % 8)).collect()
}

fn hardware(smi_text: &str, meminfo_text: &str) -> Hardware {
    Hardware {
        gpus: Ok(parse_gpu_query(smi_text).unwrap()),
        meminfo: parse_meminfo(meminfo_text).unwrap(),
        cgroup_memory_bytes: None,
        cpus: parse_cpuinfo(&cpuinfo_8c16t()),
        available_parallelism: 16,
    }
}

fn gib_kib(gib: f64) -> u64 {
    (gib * 1024.0 * 1024.0) as u64
}

fn detect_on(smi_text: &str, meminfo_text: &str, opts: &DetectOptions) -> Result<Profile, DetectError> {
    select(&ProfileTable::embedded(), &hardware(smi_text, meminfo_text), opts)
}

fn tier<'a>(p: &'a Profile, name: &str) -> &'a TierPlacement {
    p.placement.iter().find(|t| t.tier == name).unwrap_or_else(|| panic!("no {name} tier in {p:?}"))
}

#[test]
fn embedded_table_is_the_spec_table() {
    let table = ProfileTable::embedded();
    assert_eq!(table.source, "original");
    assert_eq!(table.experts_per_layer, 512);
    assert_eq!(table.vram_steps_gb, [8, 12, 16, 24]);
    assert_eq!(table.ram_steps_gb, RAM_STEPS);
    assert_eq!(table.profile.len(), 16);
    for (vram, gpu, prefill, ctx, cpu, ssd) in SPEC_TABLE {
        for (i, ram) in RAM_STEPS.into_iter().enumerate() {
            let row = table.row(vram, ram).unwrap_or_else(|| panic!("no row {vram}/{ram}"));
            let want = TableRow {
                name: format!("{vram}gb-vram-{ram}gb-ram"),
                vram_gb: vram,
                ram_gb: ram,
                gpu_experts_per_layer: gpu,
                max_prefill: prefill,
                max_context: nebula_context(vram).0,
                original_max_context: ctx,
                kv_cache_type: KvCacheType::Q8_0,
                kv_window: nebula_context(vram).1,
                cpu_experts_per_layer: cpu[i],
                gpu_copies_in_ram: gpu,
                ssd_experts_per_layer: ssd[i],
                ngram_table: if ram == 128 { NgramPlacement::Ram } else { NgramPlacement::Ssd },
                free_vram_gb: row.free_vram_gb,
                free_ram_gb: row.free_ram_gb,
            };
            assert_eq!(row, &want);
        }
    }
}

/// Every row of the table, reached from a fake nvidia-smi and a fake meminfo of exactly the step's size, and from
/// sizes just under the next step (rounded down, VRAM and RAM separately).
#[test]
fn every_row_is_detected_from_fake_nvidia_smi_and_meminfo() {
    let next_vram = [12.0, 16.0, 24.0, 80.0];
    let next_ram = [64.0, 96.0, 128.0, 1024.0];
    for (vi, (vram, gpu, prefill, _original_context, cpu, ssd)) in SPEC_TABLE.into_iter().enumerate() {
        for (ri, ram) in RAM_STEPS.into_iter().enumerate() {
            let exact = (f64::from(vram), f64::from(ram));
            // Just under the next step, beyond its tolerance: still this row.
            let high = (next_vram[vi] * (1.0 - VRAM_TOLERANCE) - 0.05, next_ram[ri] * (1.0 - RAM_TOLERANCE) - 0.05);
            for (vram_gib, ram_gib) in [exact, high] {
                let s = smi(&[(0, "NVIDIA Test GPU", (vram_gib * 1024.0) as u64)]);
                let p = detect_on(&s, &meminfo(gib_kib(ram_gib)), &DetectOptions::default())
                    .unwrap_or_else(|e| panic!("{vram_gib} GiB VRAM / {ram_gib} GiB RAM: {e}"));
                let what = format!("{vram_gib} GiB VRAM / {ram_gib} GiB RAM");
                assert_eq!(p.name, format!("{vram}gb-vram-{ram}gb-ram"), "{what}");
                assert_eq!((p.vram_gb, p.ram_gb), (vram, ram), "{what}");
                assert_eq!(p.backend, "cuda");
                assert_eq!(p.source, "original");
                assert_eq!((p.max_prefill, p.max_context), (prefill, nebula_context(vram).0), "{what}");
                assert_eq!(p.kv_cache_type, Some(KvCacheType::Q8_0), "{what}");
                assert_eq!(p.kv_window, Some(nebula_context(vram).1), "{what}");
                let seqs = match vram {
                    8 | 12 => 8,
                    16 => 16,
                    _ => 32,
                };
                assert_eq!(p.max_sequences, Some(seqs), "{what}: batch slots for the VRAM step");
                assert_eq!(tier(&p, "gpu").experts_per_layer, gpu);
                assert_eq!(tier(&p, "ram").experts_per_layer, cpu[ri]);
                assert_eq!(tier(&p, "ram").gpu_copies, Some(gpu));
                assert_eq!(tier(&p, "ssd").experts_per_layer, ssd[ri]);
                assert_eq!(gpu + cpu[ri] + ssd[ri], 512);
                let ngram = if ram == 128 { NgramPlacement::Ram } else { NgramPlacement::Ssd };
                assert_eq!(p.ngram_table, ngram);
                assert_eq!(p.threads, 8, "physical cores, not threads");
                assert_eq!(p.cuda_visible_devices.as_deref(), Some("0"));
                assert!(p.detected.emulated.is_empty());
            }
        }
    }
}

/// Sizes as real cards and machines report them: a little under the nominal size still counts as it.
#[test]
fn real_cards_and_machines_round_to_their_nominal_step() {
    let cases: &[(&str, u64, u32)] = &[
        ("NVIDIA GeForce RTX 4060", 8188, 8),
        ("NVIDIA GeForce RTX 3070", 8192, 8),
        ("NVIDIA GeForce RTX 3080", 10240, 8),
        ("NVIDIA GeForce RTX 3060", 12288, 12),
        ("NVIDIA GeForce RTX 4070", 12282, 12),
        ("NVIDIA GeForce RTX 4060 Ti", 16380, 16),
        ("NVIDIA GeForce RTX 5080", 16303, 16),
        ("NVIDIA GeForce RTX 3090", 24576, 24),
        ("NVIDIA GeForce RTX 4090", 24564, 24),
        ("NVIDIA GeForce RTX 5090", 32607, 24),
        ("NVIDIA H200", 143771, 24),
    ];
    for &(name, mib, want) in cases {
        let p = detect_on(&smi(&[(0, name, mib)]), &meminfo(65_000_000), &DetectOptions::default()).unwrap();
        assert_eq!(p.vram_gb, want, "{name} {mib} MiB");
        assert_eq!(p.detected.gpu_name.as_deref(), Some(name));
    }
    // MemTotal of machines with 32/64/96/128 GiB installed, and an 80 GiB one (the original's example: 64).
    for (kib, want) in [(32_612_000, 32), (65_700_000, 64), (98_500_000, 96), (131_600_000, 128), (82_000_000, 64)] {
        let p = detect_on(&smi(&[(0, "g", 12288)]), &meminfo(kib), &DetectOptions::default()).unwrap();
        assert_eq!(p.ram_gb, want, "MemTotal {kib} kB");
    }
    // Read on the project's H200 machine (128 GiB installed): nvidia-smi "0, NVIDIA H200, 143771" and MemTotal
    // 131981020 kB (125.9 GiB, which plain rounding down would call 96).
    let p = detect_on("0, NVIDIA H200, 143771\n", &meminfo(131_981_020), &DetectOptions::default()).unwrap();
    assert_eq!(p.name, "24gb-vram-128gb-ram");
    // The original's example: 20 GB of VRAM and 80 GB of RAM use the 16 GB / 64 GB profile.
    let p = detect_on(&smi(&[(0, "g", 20 * 1024)]), &meminfo(gib_kib(80.0)), &DetectOptions::default()).unwrap();
    assert_eq!(p.name, "16gb-vram-64gb-ram");
}

#[test]
fn the_largest_gpu_is_chosen_and_gpus_are_never_added_up() {
    // Two 8 GB cards are not a 16 GB one.
    let two_small = smi(&[(0, "small A", 8192), (1, "small B", 8192)]);
    let p = detect_on(&two_small, &meminfo(gib_kib(64.0)), &DetectOptions::default()).unwrap();
    assert_eq!(p.vram_gb, 8);
    assert_eq!(p.detected.gpu_index, Some(0), "a tie goes to the lower index");
    assert_eq!(p.detected.gpus, 2);

    let mixed = smi(&[(0, "NVIDIA GeForce RTX 3060", 12288), (1, "NVIDIA GeForce RTX 4090", 24564), (2, "x", 8192)]);
    let p = detect_on(&mixed, &meminfo(gib_kib(128.0)), &DetectOptions::default()).unwrap();
    assert_eq!(p.name, "24gb-vram-128gb-ram");
    assert_eq!(p.detected.gpu_index, Some(1));
    assert_eq!(p.detected.gpu_name.as_deref(), Some("NVIDIA GeForce RTX 4090"));
    assert_eq!(p.cuda_visible_devices.as_deref(), Some("1"));

    // CUDA_VISIBLE_DEVICES narrows the candidates.
    let opts = DetectOptions { cuda_visible_devices: Some("0,2".into()), ..DetectOptions::default() };
    let p = detect_on(&mixed, &meminfo(gib_kib(128.0)), &opts).unwrap();
    assert_eq!((p.vram_gb, p.detected.gpu_index), (12, Some(0)));
    let opts = DetectOptions { cuda_visible_devices: Some("7".into()), ..DetectOptions::default() };
    let e = detect_on(&mixed, &meminfo(gib_kib(128.0)), &opts).unwrap_err();
    assert!(matches!(e, DetectError::NoGpu(NoGpu::NoneVisible(_))), "{e}");
    assert_eq!(e.exit_code(), EXIT_NO_GPU);
    // UUIDs are not understood: every GPU stays a candidate.
    let opts = DetectOptions { cuda_visible_devices: Some("GPU-1234".into()), ..DetectOptions::default() };
    assert_eq!(detect_on(&mixed, &meminfo(gib_kib(128.0)), &opts).unwrap().vram_gb, 24);
}

#[test]
fn below_minimum_vram_says_how_many_gib_are_missing() {
    let e =
        detect_on(&smi(&[(0, "NVIDIA GeForce RTX 2060", 6144)]), &meminfo(gib_kib(64.0)), &DetectOptions::default())
            .unwrap_err();
    assert_eq!(e.exit_code(), EXIT_BELOW_MINIMUM);
    let DetectError::BelowMinimum(s) = &e else { panic!("{e:?}") };
    assert_eq!(s.vram_missing_gib, Some(2.0));
    assert_eq!(s.ram_missing_gib, None);
    let msg = e.to_string();
    assert!(msg.contains("2.0 GiB of VRAM missing"), "{msg}");
    assert!(msg.contains("the minimum is 8 GB"), "{msg}");
    assert!(!msg.contains("of RAM missing"), "{msg}");

    // 7.5 GiB: 0.5 missing (rounded up to the next 0.1).
    let e = detect_on(&smi(&[(0, "g", 7680)]), &meminfo(gib_kib(64.0)), &DetectOptions::default()).unwrap_err();
    assert!(e.to_string().contains("0.5 GiB of VRAM missing"), "{e}");
    // Several small GPUs: still missing, never added up.
    let e = detect_on(&smi(&[(0, "a", 6144), (1, "b", 6144)]), &meminfo(gib_kib(64.0)), &DetectOptions::default())
        .unwrap_err();
    assert!(e.to_string().contains("2.0 GiB of VRAM missing"), "{e}");
}

#[test]
fn below_minimum_ram_says_how_many_gib_are_missing() {
    let e = detect_on(&smi(&[(0, "g", 12288)]), &meminfo(gib_kib(16.0)), &DetectOptions::default()).unwrap_err();
    assert_eq!(e.exit_code(), EXIT_BELOW_MINIMUM);
    let msg = e.to_string();
    assert!(msg.contains("16.0 GiB of RAM missing (the machine has 16.0 GiB)"), "{msg}");
    assert!(!msg.contains("VRAM missing"), "{msg}");
    // 29.3 GiB is beyond the tolerance of 32: 2.7 missing.
    let e = detect_on(&smi(&[(0, "g", 12288)]), &meminfo(gib_kib(29.3)), &DetectOptions::default()).unwrap_err();
    assert!(e.to_string().contains("2.7 GiB of RAM missing"), "{e}");
}

#[test]
fn below_minimum_on_both_reports_both() {
    let e = detect_on(&smi(&[(0, "g", 4096)]), &meminfo(gib_kib(24.0)), &DetectOptions::default()).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("4.0 GiB of VRAM missing") && msg.contains("8.0 GiB of RAM missing"), "{msg}");
}

#[test]
fn a_container_memory_limit_counts_not_the_host_ram() {
    let mut hw = hardware(&smi(&[(0, "g", 12288)]), &meminfo(gib_kib(128.0)));
    hw.cgroup_memory_bytes = Some(70 << 30);
    let p = select(&ProfileTable::embedded(), &hw, &DetectOptions::default()).unwrap();
    assert_eq!((p.ram_gb, p.detected.ram_source.as_str()), (64, "cgroup"));
    hw.cgroup_memory_bytes = Some(16 << 30);
    let e = select(&ProfileTable::embedded(), &hw, &DetectOptions::default()).unwrap_err();
    assert!(e.to_string().contains("16.0 GiB of RAM missing"), "{e}");
    assert_eq!(parse_cgroup_memory("max\n"), None);
    assert_eq!(parse_cgroup_memory("9223372036854771712\n"), None, "cgroup v1 'unlimited'");
    assert_eq!(parse_cgroup_memory("75161927680\n"), Some(75_161_927_680));
}

#[test]
fn no_gpu_refuses_unless_the_cpu_is_allowed() {
    let mut hw = hardware("", &meminfo(gib_kib(64.0)));
    for reason in [NoGpu::NoNvidiaSmi("nvidia-smi: not found".into()), NoGpu::NoneListed] {
        hw.gpus = Err(reason.clone());
        let e = select(&ProfileTable::embedded(), &hw, &DetectOptions::default()).unwrap_err();
        assert_eq!(e.exit_code(), EXIT_NO_GPU);
        assert_ne!(EXIT_NO_GPU, EXIT_BELOW_MINIMUM);
        let msg = e.to_string();
        assert!(msg.starts_with("no GPU: ") && msg.contains("--backend cpu"), "{msg}");
        let opts = DetectOptions { backend: Backend::Cuda, allow_cpu: true, ..DetectOptions::default() };
        assert!(select(&ProfileTable::embedded(), &hw, &opts).is_err(), "--backend cuda never falls back");
    }
    // An empty listing is "no GPU" too.
    let hw = hardware("", &meminfo(gib_kib(64.0)));
    let e = select(&ProfileTable::embedded(), &hw, &DetectOptions::default()).unwrap_err();
    assert!(matches!(e, DetectError::NoGpu(NoGpu::NoneListed)), "{e:?}");

    let opts = DetectOptions { allow_cpu: true, ..DetectOptions::default() };
    let p = select(&ProfileTable::embedded(), &hw, &opts).unwrap();
    assert_eq!((p.name.as_str(), p.backend.as_str(), p.source.as_str()), ("cpu-64gb-ram", "cpu", "derived-cpu"));
    assert_eq!(p.vram_gb, 0);
    assert_eq!(p.max_context, CPU_MAX_CONTEXT);
    assert_eq!(tier(&p, "gpu").experts_per_layer, 0);
    assert_eq!(tier(&p, "ram").experts_per_layer, 411, "the 8 GB column's 400 + 11 GPU experts move to RAM");
    assert_eq!(tier(&p, "ssd").experts_per_layer, 101);
    assert_eq!(p.cuda_visible_devices, None);
}

#[test]
fn cpu_backend_ignores_gpus_and_keeps_the_ram_minimum() {
    let hw = hardware(&smi(&[(0, "g", 24576)]), &meminfo(gib_kib(128.0)));
    let opts = DetectOptions { backend: Backend::Cpu, ..DetectOptions::default() };
    let p = select(&ProfileTable::embedded(), &hw, &opts).unwrap();
    assert_eq!(p.name, "cpu-128gb-ram");
    assert_eq!(tier(&p, "ram").experts_per_layer, 512);
    assert_eq!(p.ngram_table, NgramPlacement::Ram);
    let hw = hardware("", &meminfo(gib_kib(24.0)));
    let e = select(&ProfileTable::embedded(), &hw, &opts).unwrap_err();
    assert_eq!(e.exit_code(), EXIT_BELOW_MINIMUM);
    assert!(e.to_string().contains("8.0 GiB of RAM missing") && !e.to_string().contains("VRAM"), "{e}");
}

#[test]
fn the_demo_model_runs_below_the_minimums() {
    let hw = hardware("", &meminfo(gib_kib(24.0)));
    let opts = DetectOptions { backend: Backend::Cpu, demo: true, ..DetectOptions::default() };
    let p = select(&ProfileTable::embedded(), &hw, &opts).unwrap();
    assert_eq!((p.name.as_str(), p.source.as_str(), p.model.as_deref()), ("demo-cpu", "demo", Some("demo")));
    assert_eq!(p.ram_gb, 0);
    assert!(p.placement.is_empty());
    // Above the minimums the demo still gets the machine's row.
    let hw = hardware(&smi(&[(0, "g", 12288)]), &meminfo(gib_kib(64.0)));
    let p = select(&ProfileTable::embedded(), &hw, &DetectOptions { demo: true, ..DetectOptions::default() }).unwrap();
    assert_eq!((p.name.as_str(), p.model.as_deref()), ("12gb-vram-64gb-ram", Some("demo")));
}

#[test]
fn emulation_flags_shrink_the_budget_and_are_recorded() {
    let h200 = smi(&[(0, "NVIDIA H200", 143771)]);
    let opts = DetectOptions { vram_gib: Some(12.0), ram_gib: Some(128.0), threads: Some(14), ..Default::default() };
    let p = detect_on(&h200, &meminfo(gib_kib(2000.0)), &opts).unwrap();
    assert_eq!(p.name, "12gb-vram-128gb-ram");
    assert_eq!(p.threads, 14);
    assert_eq!(p.detected.emulated, ["threads=14", "ram_gib=128", "vram_gib=12"]);
    let opts = DetectOptions { vram_gib: Some(8.0), ram_gib: Some(32.0), ..Default::default() };
    assert_eq!(detect_on(&h200, &meminfo(gib_kib(2000.0)), &opts).unwrap().name, "8gb-vram-32gb-ram");

    // Emulation cannot grow the machine, nor use zero.
    for opts in [
        DetectOptions { vram_gib: Some(200.0), ..Default::default() },
        DetectOptions { ram_gib: Some(4000.0), ..Default::default() },
        DetectOptions { ram_gib: Some(0.0), ..Default::default() },
        DetectOptions { threads: Some(17), ..Default::default() },
        DetectOptions { threads: Some(0), ..Default::default() },
    ] {
        let e = detect_on(&h200, &meminfo(gib_kib(2000.0)), &opts).unwrap_err();
        assert_eq!(e.exit_code(), EXIT_USAGE, "{opts:?}: {e}");
    }
    // An emulated budget below the minimum is refused like real hardware.
    let opts = DetectOptions { vram_gib: Some(6.0), ..Default::default() };
    let e = detect_on(&h200, &meminfo(gib_kib(64.0)), &opts).unwrap_err();
    assert!(e.to_string().contains("2.0 GiB of VRAM missing"), "{e}");
}

#[test]
fn threads_follow_physical_cores_within_limits() {
    let mut hw = hardware(&smi(&[(0, "g", 12288)]), &meminfo(gib_kib(64.0)));
    hw.available_parallelism = 4; // a container limited to 4 CPUs
    assert_eq!(select(&ProfileTable::embedded(), &hw, &DetectOptions::default()).unwrap().threads, 4);
    hw.cpus = CpuCount { physical_cores: Some(64), logical_cpus: 128 };
    hw.available_parallelism = 128;
    assert_eq!(select(&ProfileTable::embedded(), &hw, &DetectOptions::default()).unwrap().threads, MAX_THREADS);
    hw.cpus = CpuCount { physical_cores: None, logical_cpus: 6 };
    assert_eq!(select(&ProfileTable::embedded(), &hw, &DetectOptions::default()).unwrap().threads, 6);
}

#[test]
fn parsers_read_real_formats_and_refuse_broken_ones() {
    let gpus = parse_gpu_query("0, NVIDIA GeForce RTX 4090, 24564\n1, NVIDIA A100-SXM4-80GB, [N/A]\n\n").unwrap();
    assert_eq!(gpus, [GpuInfo { index: 0, name: "NVIDIA GeForce RTX 4090".into(), memory_mib: 24564 }]);
    assert!(parse_gpu_query("garbage\n").is_err());
    assert!(parse_gpu_query("x, name, 100\n").is_err());

    let m = parse_meminfo("MemTotal:       32612000 kB\nMemAvailable:   1024 kB\n").unwrap();
    assert_eq!(m, MemInfo { total_bytes: 32_612_000 * 1024, available_bytes: Some(1024 * 1024) });
    assert!(parse_meminfo("MemFree: 1 kB\n").is_err());
    assert!(parse_meminfo("MemTotal: lots\n").is_err());

    assert_eq!(parse_cpuinfo(&cpuinfo_8c16t()), CpuCount { physical_cores: Some(8), logical_cpus: 16 });
    let two_sockets: String =
        (0..8).map(|p| format!("processor : {p}\nphysical id : {}\ncore id : {}\n\n", p / 4, p % 4)).collect();
    assert_eq!(parse_cpuinfo(&two_sockets), CpuCount { physical_cores: Some(8), logical_cpus: 8 });
    assert_eq!(parse_cpuinfo("processor : 0\n\nprocessor : 1\n"), CpuCount { physical_cores: None, logical_cpus: 2 });
}

#[test]
fn broken_tables_are_refused_with_the_row_named() {
    let good = EMBEDDED_TABLE;
    let cases = [
        (good.replacen("ssd_experts_per_layer = 360", "ssd_experts_per_layer = 361", 1), "= 513 experts per layer"),
        (good.replacen("name = \"12gb-vram-64gb-ram\"", "name = \"twelve\"", 1), "should be '12gb-vram-64gb-ram'"),
        (
            good.replacen(
                "name = \"16gb-vram-32gb-ram\"\nvram_gb = 16\nram_gb = 32",
                "name = \"16gb-vram-64gb-ram\"\nvram_gb = 16\nram_gb = 64",
                1,
            ),
            "a second row for 16 GB VRAM / 64 GB RAM",
        ),
        (good.replacen("gpu_copies_in_ram = 27", "gpu_copies_in_ram = 26", 1), "gpu_copies_in_ram = 26"),
        (good.replacen("ram_steps_gb = [32, 64, 96, 128]", "ram_steps_gb = [64, 32, 96, 128]", 1), "ascending"),
        (good.replacen("ngram_table = \"ram\"", "ngram_table = \"gpu\"", 1), "unknown variant"),
        (good.replacen("free_ram_gb = 8.0", "free_ram_gb = 8.0\nspare = 1", 1), "unknown field"),
        (good.replacen("max_prefill = 1024", "max_prefill = 100000", 1), "prefill <= context"),
    ];
    for (text, want) in cases {
        assert_ne!(text, good, "the replacement for '{want}' must apply");
        let e = ProfileTable::parse(&text, "t.toml").unwrap_err().to_string();
        assert!(e.contains(want), "expected '{want}' in: {e}");
    }
    // A table with a row left out names it.
    let start = good.find("[[profile]]\nname = \"16gb-vram-96gb-ram\"").unwrap();
    let end = start + good[start + 1..].find("[[profile]]").unwrap() + 1;
    let e = ProfileTable::parse(&format!("{}{}", &good[..start], &good[end..]), "t.toml").unwrap_err().to_string();
    assert!(e.contains("15 rows, expected 16; missing: 16gb-vram-96gb-ram"), "{e}");
}

#[test]
fn the_profile_file_round_trips_and_has_the_documented_keys() {
    let p = detect_on(&smi(&[(3, "NVIDIA GeForce RTX 4070", 12282)]), &meminfo(65_700_000), &DetectOptions::default())
        .unwrap();
    let text = p.to_toml();
    assert!(text.starts_with("# Nebula hardware profile"));
    let back: Profile = toml::from_str(&text).unwrap();
    assert_eq!(back, p);
    // The keys readers rely on (deploy/README.md), at the top level, as plain scalars.
    for line in [
        "schema_version = 1",
        "name = \"12gb-vram-64gb-ram\"",
        "backend = \"cuda\"",
        "source = \"original\"",
        "vram_gb = 12",
        "ram_gb = 64",
        "max_context = 131072",
        "kv_cache_type = \"q8_0\"",
        "kv_window = 65536",
        "max_prefill = 2048",
        "threads = 8",
        "ngram_table = \"ssd\"",
        "cuda_visible_devices = \"3\"",
        "[[placement]]",
        "[detected]",
        "gpu_name = \"NVIDIA GeForce RTX 4070\"",
    ] {
        assert!(text.lines().any(|l| l == line), "missing line {line:?} in:\n{text}");
    }
    // As JSON it is the shape the WebUI reads from /v1/models `profile`.
    let json = serde_json::to_value(&p).unwrap();
    assert_eq!(json["placement"][1], serde_json::json!({"tier": "ram", "experts_per_layer": 383, "gpu_copies": 27}));
    assert_eq!(json["max_context"], 131072);
}

// --- the model check -------------------------------------------------------------------------------------------

fn demo_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/nebula-demo.gguf")
}

/// Writes a 3-part qwen4exp GGUF (or `arch`) into `dir`; returns the parts.
fn write_split_model(dir: &Path, arch: &str) -> Vec<PathBuf> {
    use nebula_engine::gguf::{GgmlType, GgufWriter};
    let mut w = GgufWriter::create(dir.join("tiny.gguf"), 32).unwrap();
    w.split_max_bytes(64);
    w.add_kv("general.architecture", arch).unwrap();
    w.add_kv("general.name", "tiny").unwrap();
    for name in ["a", "b", "c"] {
        w.add_tensor(name, &[16], GgmlType::F32).unwrap();
    }
    let mut d = w.begin_data().unwrap();
    for name in ["a", "b", "c"] {
        d.write_tensor(name, &[0u8; 64]).unwrap();
    }
    d.finish().unwrap()
}

#[test]
fn the_demo_model_passes_the_model_check() {
    let m = check_model(&demo_model()).unwrap();
    assert_eq!(m.parts, 1);
    assert!(m.bytes > 1 << 20);
}

#[test]
fn a_complete_split_model_passes_and_a_missing_part_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let parts = write_split_model(dir.path(), "qwen4exp");
    assert_eq!(parts.len(), 3);
    let m = check_model(&parts[0]).unwrap();
    assert_eq!((m.parts, m.name.as_deref()), (3, Some("tiny")));

    std::fs::remove_file(&parts[1]).unwrap();
    std::fs::remove_file(&parts[2]).unwrap();
    let e = check_model(&parts[0]).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ModelError::MissingParts { count: 3, .. }), "{e:?}");
    assert!(msg.contains("2 of its 3 parts missing"), "{msg}");
    assert!(msg.contains("tiny-00002-of-00003.gguf") && msg.contains("tiny-00003-of-00003.gguf"), "{msg}");
    assert!(msg.contains("nebula convert"), "{msg}");
    assert_eq!(DetectError::from(e).exit_code(), EXIT_MODEL);
}

#[test]
fn missing_truncated_and_foreign_models_are_refused_with_how_to_fix() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("other-q4.gguf"), b"GGUF").unwrap();
    let e = check_model(&dir.path().join("model.gguf")).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ModelError::Missing { .. }), "{e:?}");
    assert!(msg.contains("not found") && msg.contains("other-q4.gguf") && msg.contains("nebula convert"), "{msg}");

    let e = check_model(dir.path()).unwrap_err();
    assert!(matches!(e, ModelError::IsFolder { .. }), "{e:?}");

    // Truncated: half of the demo model.
    let demo = std::fs::read(demo_model()).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &demo[..demo.len() / 2]).unwrap();
    let e = check_model(&cut).unwrap_err();
    assert!(matches!(e, ModelError::Invalid { .. }), "{e:?}");
    assert!(e.to_string().contains("download or convert it again"), "{e}");

    let text = dir.path().join("notes.gguf");
    std::fs::write(&text, b"hello, not a model").unwrap();
    assert!(check_model(&text).unwrap_err().to_string().contains("not a GGUF file"));

    let llama = tempfile::tempdir().unwrap();
    let parts = write_split_model(llama.path(), "llama");
    let e = check_model(&parts[0]).unwrap_err();
    assert!(matches!(&e, ModelError::WrongArchitecture { found, .. } if found == "llama"), "{e:?}");
}

// --- the command, end to end on files --------------------------------------------------------------------------

fn detect_args(dir: &Path, smi_text: &str, meminfo_text: &str) -> DetectArgs {
    std::fs::write(dir.join("smi.csv"), smi_text).unwrap();
    std::fs::write(dir.join("meminfo"), meminfo_text).unwrap();
    std::fs::write(dir.join("cpuinfo"), cpuinfo_8c16t()).unwrap();
    DetectArgs {
        out: dir.join("state/profile.toml"),
        backend: Backend::Auto,
        allow_cpu: false,
        demo: false,
        model: None,
        vram_gib: None,
        ram_gib: None,
        threads: None,
        table: None,
        nvidia_smi: "nvidia-smi".into(),
        gpu_query_file: Some(dir.join("smi.csv")),
        meminfo: dir.join("meminfo"),
        cpuinfo: dir.join("cpuinfo"),
        cgroup_memory: Some("none".into()),
    }
}

#[test]
fn detect_writes_the_profile_file_and_checks_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = detect_args(dir.path(), &smi(&[(0, "NVIDIA GeForce RTX 4090", 24564)]), &meminfo(98_500_000));
    args.model = Some(demo_model());
    let summary = detect(&args).unwrap();
    // The demo model's experts are Q8_0: the tiers are recounted for their size.
    assert!(summary.contains("profile 24gb-vram-96gb-ram (original-expert-size)"), "{summary}");
    let p = Profile::load(&args.out).unwrap();
    assert_eq!(p.name, "24gb-vram-96gb-ram");
    assert_eq!(p.model.as_deref(), Some(demo_model().display().to_string().as_str()));
    assert!(!args.out.with_extension("toml.tmp").exists());

    args.model = Some(dir.path().join("absent.gguf"));
    assert_eq!(detect(&args).unwrap_err().exit_code(), EXIT_MODEL);

    // An edited table is used when given.
    let table = dir.path().join("table.toml");
    std::fs::write(&table, EMBEDDED_TABLE.replace("max_context = 262144", "max_context = 200000")).unwrap();
    args.model = None;
    args.table = Some(table);
    detect(&args).unwrap();
    assert_eq!(Profile::load(&args.out).unwrap().max_context, 200000);
}

#[test]
fn detect_reports_a_missing_nvidia_smi_as_no_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = detect_args(dir.path(), "", &meminfo(gib_kib(64.0)));
    args.gpu_query_file = None;
    args.nvidia_smi = dir.path().join("no-such-nvidia-smi").display().to_string();
    let e = detect(&args).unwrap_err();
    assert_eq!(e.exit_code(), EXIT_NO_GPU, "{e}");
    assert!(e.to_string().contains("cannot be run"), "{e}");
    assert!(!args.out.exists(), "no profile is written on a refusal");
    args.allow_cpu = true;
    detect(&args).unwrap();
    assert_eq!(Profile::load(&args.out).unwrap().backend, "cpu");
}

// --- tier counts from the file's expert size -------------------------------------------------------------------

/// Routed-expert tensors of the release's shapes (2560 wide, 640 intermediate, 512 experts) in `gate_up` and
/// `down` types, for `blocks` blocks.
fn release_experts(gate_up: GgmlType, down: GgmlType, blocks: usize) -> Vec<(String, GgmlType, Vec<u64>)> {
    let mut v = Vec::new();
    for b in 0..blocks {
        v.push((format!("blk.{b}.ffn_gate_exps.weight"), gate_up, vec![2560, 640, 512]));
        v.push((format!("blk.{b}.ffn_up_exps.weight"), gate_up, vec![2560, 640, 512]));
        v.push((format!("blk.{b}.ffn_down_exps.weight"), down, vec![640, 2560, 512]));
        // Not routed experts: ignored.
        v.push((format!("blk.{b}.ffn_down_shexp.weight"), down, vec![640, 2560]));
    }
    v
}

fn size_of(v: &[(String, GgmlType, Vec<u64>)]) -> ExpertSize {
    ExpertSize::from_tensors(v.iter().map(|(n, t, d)| (n.as_str(), *t, d.as_slice()))).unwrap()
}

#[test]
fn q4_files_keep_the_table_and_the_sizes_are_the_block_sizes() {
    use GgmlType as T;
    let q4 = size_of(&release_experts(T::Q4_K, T::IQ4_NL, 3));
    // Q4_K: 144 bytes per 256 values, IQ4_NL: 18 per 32: 2 x 640 x 1440 + 2560 x 360 bytes.
    assert_eq!(q4.mean_bytes, 2_764_800.0);
    assert_eq!(q4.q4_bytes, 2_764_800.0);
    assert_eq!(q4.experts, 512);
    assert!(q4.is_table_mix());
    assert_eq!(q4.recount(27, 512), 27);
    // IQ2_XS (74 bytes per 256) gate/up and IQ4_NL down: 2 x 640 x 740 + 2560 x 360.
    let low = size_of(&release_experts(T::IQ2_XS, T::IQ4_NL, 3));
    assert_eq!(low.mean_bytes, 1_868_800.0);
    assert!(!low.is_table_mix());
    assert_eq!(low.recount(27, 512), 39, "27 x 2764800 / 1868800 = 39.9");
    assert_eq!(low.recount(400, 512), 512, "capped at the experts per layer");
    // Mixed blocks: the mean over blocks (one Q2_K/Q4_0 block, two IQ2_XS/IQ4_NL blocks).
    let mut mixed = release_experts(T::IQ2_XS, T::IQ4_NL, 3);
    for t in mixed.iter_mut().filter(|t| t.0.starts_with("blk.0.")) {
        t.1 = if t.0.contains("down") { T::Q4_0 } else { T::Q2_K };
    }
    // Q2_K: 84 bytes per 256 (2 x 640 x 840); Q4_0: 18 per 32 (2560 x 360).
    let m = size_of(&mixed);
    assert_eq!(m.mean_bytes, (2.0 * 1_868_800.0 + (2.0 * 640.0 * 840.0 + 2560.0 * 360.0)) / 3.0);
}

#[test]
fn tiers_are_recounted_in_the_files_experts() {
    use GgmlType as T;
    let low = size_of(&release_experts(T::IQ2_XS, T::IQ4_NL, 2));
    let hw = hardware(&smi(&[(0, "NVIDIA GeForce RTX 4070", 12282)]), &meminfo(gib_kib(31.5)));
    let mut p = select(&ProfileTable::embedded(), &hw, &DetectOptions::default()).unwrap();
    assert_eq!(p.name, "12gb-vram-32gb-ram");
    assert!(expert_size::apply(&mut p, &low));
    // The table: GPU 27, CPU 124 (+27 copies), SSD 361. In IQ2_XS/IQ4_NL experts (x 1.4795): GPU 39, RAM holds
    // floor(151 x 1.4795) = 223 of which 39 are the GPU copies, SSD the other 289.
    assert_eq!(tier(&p, "gpu").experts_per_layer, 39);
    assert_eq!((tier(&p, "ram").experts_per_layer, tier(&p, "ram").gpu_copies), (184, Some(39)));
    assert_eq!(tier(&p, "ssd").experts_per_layer, 289);
    let sum: u32 = p.placement.iter().map(|t| t.experts_per_layer).sum();
    assert_eq!(sum, 512);

    // 64 GB of RAM: every expert fits in RAM (383 + 27 = 410 -> 606, capped at 512).
    let hw = hardware(&smi(&[(0, "NVIDIA GeForce RTX 4070", 12282)]), &meminfo(gib_kib(63.0)));
    let mut p = select(&ProfileTable::embedded(), &hw, &DetectOptions::default()).unwrap();
    expert_size::apply(&mut p, &low);
    assert_eq!(tier(&p, "gpu").experts_per_layer, 39);
    assert_eq!((tier(&p, "ram").experts_per_layer, tier(&p, "ssd").experts_per_layer), (473, 0));

    // The CPU-only rows: no GPU tier, no copies; RAM 141 + 11 = 152 of the 8 GB column -> 224.
    let opts = DetectOptions { backend: Backend::Cpu, ..Default::default() };
    let hw = hardware("", &meminfo(gib_kib(31.5)));
    let mut p = select(&ProfileTable::embedded(), &hw, &opts).unwrap();
    expert_size::apply(&mut p, &low);
    assert_eq!(tier(&p, "gpu").experts_per_layer, 0);
    assert_eq!((tier(&p, "ram").experts_per_layer, tier(&p, "ram").gpu_copies), (224, Some(0)));
    assert_eq!(tier(&p, "ssd").experts_per_layer, 288);

    // A Q4_K/IQ4_NL file leaves the profile as the table has it.
    let q4 = size_of(&release_experts(T::Q4_K, T::IQ4_NL, 2));
    let before = p.clone();
    assert!(!expert_size::apply(&mut p, &q4) || p == before);
}

#[test]
fn detect_recounts_for_a_low_bit_model_file() {
    use nebula_engine::gguf::GgufWriter;
    let dir = tempfile::tempdir().unwrap();
    // A tiny qwen4exp file: IQ2_XS gate/up (256 wide), IQ4_NL down (64 wide), 16 experts, one block.
    let path = dir.path().join("low.gguf");
    let mut w = GgufWriter::create(&path, 32).unwrap();
    w.add_kv("general.architecture", "qwen4exp").unwrap();
    let t = [
        ("blk.0.ffn_gate_exps.weight", GgmlType::IQ2_XS, vec![256u64, 64, 16]),
        ("blk.0.ffn_up_exps.weight", GgmlType::IQ2_XS, vec![256, 64, 16]),
        ("blk.0.ffn_down_exps.weight", GgmlType::IQ4_NL, vec![64, 256, 16]),
    ];
    for (n, ty, d) in &t {
        w.add_tensor(*n, d, *ty).unwrap();
    }
    let mut data = w.begin_data().unwrap();
    for (n, ty, d) in &t {
        let bytes = ty.row_bytes(d[0]).unwrap() * d[1] * d[2];
        data.write_tensor(n, &vec![0u8; bytes as usize]).unwrap();
    }
    data.finish().unwrap();
    let mut args = detect_args(dir.path(), &smi(&[(0, "NVIDIA GeForce RTX 4070", 12282)]), &meminfo(gib_kib(31.5)));
    args.model = Some(path);
    let summary = detect(&args).unwrap();
    assert!(summary.contains("tiers recounted"), "{summary}");
    let p = Profile::load(&args.out).unwrap();
    assert_eq!(p.source, "original-expert-size");
    // Per expert: 2 x 64 x 74 + 256 x 36 bytes = 18688 (0.0178 MiB); in Q4_K/IQ4_NL 2 x 64 x 144 + 256 x 36 =
    // 27648: x 1.4795, as at the release's widths.
    assert_eq!(p.expert_mib, Some(0.018));
    // The file's one block of tiny experts and no dense weights fit the 12 GB step many times over: the GPU
    // tier grows to every expert RAM holds (223 after the recount), all of them GPU copies.
    assert!(summary.contains("GPU tier filled to 223 experts per layer"), "{summary}");
    assert_eq!(tier(&p, "gpu").experts_per_layer, 223);
    assert_eq!((tier(&p, "ram").experts_per_layer, tier(&p, "ram").gpu_copies), (0, Some(223)));
    assert_eq!(tier(&p, "ssd").experts_per_layer, 289);
}

/// At the release's shapes (48 decoder layers of 512 IQ2_XS/IQ4_NL experts, 1.782 MiB each) with 2.19 GiB of
/// dense weights, the 12 GB / 96 GB row's recount (39 GPU experts) leaves VRAM unused: filled, the GPU tier takes
/// the 12 GiB less the row's 2 GB headroom, the dense weights and one 131,072-token q8_0 sequence with its 64K
/// window (1,241 MiB): floor(6.60 GiB / (48 x 1.782 MiB)) = floor(78.98) = 78 experts, the RAM tier's copies with
/// them.
#[test]
fn the_gpu_tier_fills_the_vram_the_dense_weights_leave() {
    use GgmlType as T;
    let mut low = size_of(&release_experts(T::IQ2_XS, T::IQ4_NL, 48));
    low.dense_bytes = (2.19 * (1u64 << 30) as f64) as u64;
    assert_eq!(low.blocks, 48);
    let hw = hardware(&smi(&[(0, "NVIDIA GeForce RTX 4070", 12282)]), &meminfo(gib_kib(120.0)));
    let mut p = select(&ProfileTable::embedded(), &hw, &DetectOptions::default()).unwrap();
    assert_eq!(p.name, "12gb-vram-96gb-ram");
    expert_size::apply(&mut p, &low);
    assert_eq!(tier(&p, "gpu").experts_per_layer, 39);
    let (kv, _) = released_kv_bytes(131_072, KvCacheType::Q8_0, 65_536, true);
    assert_eq!(kv >> 20, 1241);
    let gib = (1u64 << 30) as f64;
    let want = ((12.0 * gib - 2.0 * gib - low.dense_bytes as f64 - kv as f64) / (48.0 * low.mean_bytes)).floor();
    assert_eq!(want, 78.0);
    assert_eq!(expert_size::fill_vram(&mut p, &low, 2.0, kv), Some(78));
    assert_eq!(tier(&p, "gpu").experts_per_layer, 78);
    assert_eq!((tier(&p, "ram").experts_per_layer, tier(&p, "ram").gpu_copies), (434, Some(78)));
    assert_eq!(tier(&p, "ssd").experts_per_layer, 0);
    // Filled once, a second fill changes nothing; dense weights that take the whole step leave the recount.
    assert_eq!(expert_size::fill_vram(&mut p, &low, 2.0, kv), None);
    let mut q = select(&ProfileTable::embedded(), &hw, &DetectOptions::default()).unwrap();
    expert_size::apply(&mut q, &low);
    low.dense_bytes = 11 << 30;
    assert_eq!(expert_size::fill_vram(&mut q, &low, 2.0, kv), None);
    assert_eq!(tier(&q, "gpu").experts_per_layer, 39);
}

/// The raised contexts fit where the original ones did: with its KV cache type and window, one full-context
/// sequence of every row takes no more VRAM than the original's f32 cache at the original context (every token
/// in VRAM, MTP drafting on in both), and its pinned host copies at most half the RAM the original left free.
/// The 12 GB rows reach 128K tokens.
#[test]
fn every_rows_context_fits_the_memory_the_original_used() {
    let table = ProfileTable::embedded();
    for row in &table.profile {
        let (device, host) = released_kv_bytes(row.max_context, row.kv_cache_type, row.kv_window, true);
        let (original, _) = released_kv_bytes(row.original_max_context, KvCacheType::F32, 0, true);
        assert!(
            device <= original,
            "{}: {} MiB of VRAM for {} tokens, the original used {} MiB for {}",
            row.name,
            device >> 20,
            row.max_context,
            original >> 20,
            row.original_max_context
        );
        let free_ram = (row.free_ram_gb * (1u64 << 30) as f64) as u64;
        assert!(host <= free_ram / 2, "{}: {} MiB of pinned host memory a sequence", row.name, host >> 20);
        assert!(row.max_context >= 4 * row.original_max_context / 2, "{}: context not raised", row.name);
    }
    assert!(table.profile.iter().filter(|r| r.vram_gb == 12).all(|r| r.max_context >= 131_072));
    // The 12 GB figures: about 1.2 GiB of VRAM and 1.8 GiB of host memory for 131,072 tokens at q8_0 with a
    // 64K window, against 1.4 GiB for the original's 24,576 at f32.
    let (d, h) = released_kv_bytes(131_072, KvCacheType::Q8_0, 65_536, true);
    assert_eq!((d >> 20, h >> 20), (1241, 1836));
}

/// A row whose window cannot hold its prefill chunk, or is not below its context, is refused naming the row.
#[test]
fn a_window_that_cannot_hold_a_prefill_chunk_is_refused() {
    let bad = EMBEDDED_TABLE.replacen("kv_window = 16384", "kv_window = 1000", 1);
    let e = ProfileTable::parse(&bad, "t").unwrap_err().to_string();
    assert!(e.contains("8gb-vram-32gb-ram") && e.contains("kv_window = 1000") && e.contains("max_prefill"), "{e}");
    let bad = EMBEDDED_TABLE.replacen("kv_window = 16384", "kv_window = 65536", 1);
    assert!(ProfileTable::parse(&bad, "t").is_err());
}
