//! What `nebula profile detect` reads of the machine: the GPUs from `nvidia-smi`, the memory from `/proc/meminfo`
//! and the cgroup limit, the cores from `/proc/cpuinfo` ([`read_hardware`], from [`Sources`] that tests and
//! emulation point at files and fake commands), and the parsers of each.

use std::collections::BTreeSet;
use std::path::PathBuf;

use super::DetectError;

/// One GPU as `nvidia-smi --query-gpu=index,name,memory.total` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// `nvidia-smi`'s index (PCI bus order).
    pub index: u32,
    /// Marketing name, e.g. `NVIDIA GeForce RTX 4090`.
    pub name: String,
    /// Total memory, MiB.
    pub memory_mib: u64,
}

/// Parses `nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits`: one line per GPU,
/// `index, name, MiB`. Lines whose memory is not a number (`[N/A]`) are skipped; blank lines ignored.
///
/// # Errors
/// A line with fewer than three fields or a non-numeric index, quoted.
pub fn parse_gpu_query(text: &str) -> Result<Vec<GpuInfo>, String> {
    let mut gpus = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if fields.len() < 3 {
            return Err(format!("unexpected nvidia-smi line {line:?} (expected 'index, name, memory MiB')"));
        }
        let index = fields[0].parse().map_err(|_| format!("unexpected GPU index in nvidia-smi line {line:?}"))?;
        let name = fields[1..fields.len() - 1].join(",");
        let Ok(memory_mib) = fields[fields.len() - 1].parse() else {
            continue;
        };
        gpus.push(GpuInfo { index, name, memory_mib });
    }
    Ok(gpus)
}

/// The two `/proc/meminfo` lines detection uses, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    /// `MemTotal`.
    pub total_bytes: u64,
    /// `MemAvailable`, if present (reported, never used to choose: other programs' usage is temporary).
    pub available_bytes: Option<u64>,
}

/// Parses `/proc/meminfo` (`MemTotal:  32612000 kB`).
///
/// # Errors
/// No `MemTotal` line, or one that is not `<number> kB`.
pub fn parse_meminfo(text: &str) -> Result<MemInfo, String> {
    let field = |key: &str| -> Result<Option<u64>, String> {
        let Some(line) = text.lines().find(|l| l.split(':').next() == Some(key)) else { return Ok(None) };
        let rest = line[key.len() + 1..].trim();
        let kib = rest
            .strip_suffix("kB")
            .and_then(|n| n.trim().parse::<u64>().ok())
            .ok_or_else(|| format!("unexpected meminfo line {line:?} (expected '{key}: <number> kB')"))?;
        Ok(Some(kib * 1024))
    };
    let total_bytes = field("MemTotal")?.ok_or("no MemTotal line in meminfo")?;
    Ok(MemInfo { total_bytes, available_bytes: field("MemAvailable")? })
}

/// Parses a cgroup memory limit (`memory.max` of cgroup v2, `memory.limit_in_bytes` of v1): bytes, or `None` for
/// `max` or a v1 "unlimited" value (at least 2^60).
pub fn parse_cgroup_memory(text: &str) -> Option<u64> {
    text.trim().parse::<u64>().ok().filter(|&b| b > 0 && b < 1 << 60)
}

/// CPU counts from `/proc/cpuinfo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuCount {
    /// Distinct (`physical id`, `core id`) pairs; `None` when the file does not say (some VMs and architectures).
    pub physical_cores: Option<usize>,
    /// `processor` entries.
    pub logical_cpus: usize,
}

/// Counts physical cores (distinct `physical id` + `core id`) and logical CPUs in `/proc/cpuinfo`.
pub fn parse_cpuinfo(text: &str) -> CpuCount {
    let mut cores = BTreeSet::new();
    let mut logical = 0;
    let (mut package, mut core) = (None::<String>, None::<String>);
    let mut flush = |package: &mut Option<String>, core: &mut Option<String>| {
        if let Some(c) = core.take() {
            cores.insert((package.take().unwrap_or_default(), c));
        }
        *package = None;
    };
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            if line.trim().is_empty() {
                flush(&mut package, &mut core);
            }
            continue;
        };
        match key.trim() {
            "processor" => {
                flush(&mut package, &mut core);
                logical += 1;
            }
            "physical id" => package = Some(value.trim().to_owned()),
            "core id" => core = Some(value.trim().to_owned()),
            _ => {}
        }
    }
    flush(&mut package, &mut core);
    CpuCount { physical_cores: (!cores.is_empty()).then_some(cores.len()), logical_cpus: logical }
}

/// Why no GPU can be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoGpu {
    /// `nvidia-smi` could not be started (no driver in this container or host).
    NoNvidiaSmi(String),
    /// `nvidia-smi` ran and failed (driver not loaded, no device node, ...): its exit status and message.
    NvidiaSmiFailed(String),
    /// `nvidia-smi` answered but listed no GPU (or none with a readable memory size).
    NoneListed,
    /// `CUDA_VISIBLE_DEVICES` leaves none of the listed GPUs.
    NoneVisible(String),
}

impl std::fmt::Display for NoGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoNvidiaSmi(e) => write!(f, "nvidia-smi cannot be run ({e}): no NVIDIA driver is visible here"),
            Self::NvidiaSmiFailed(e) => write!(f, "nvidia-smi failed: {e}"),
            Self::NoneListed => write!(f, "nvidia-smi lists no GPU"),
            Self::NoneVisible(v) => write!(f, "CUDA_VISIBLE_DEVICES={v} hides every GPU nvidia-smi lists"),
        }
    }
}

/// What the machine has, as read by [`read_hardware`] or written by a test.
#[derive(Debug, Clone, PartialEq)]
pub struct Hardware {
    /// The GPUs, or why there are none.
    pub gpus: Result<Vec<GpuInfo>, NoGpu>,
    /// `/proc/meminfo`.
    pub meminfo: MemInfo,
    /// The cgroup's memory limit, bytes, when one is set (a container's `--memory`).
    pub cgroup_memory_bytes: Option<u64>,
    /// `/proc/cpuinfo` counts.
    pub cpus: CpuCount,
    /// CPUs this process may run on (affinity and cgroup quota: `std::thread::available_parallelism`).
    pub available_parallelism: usize,
}

/// Where [`read_hardware`] looks; tests and emulation point these at files and fake commands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sources {
    /// The `nvidia-smi` command (looked up on `PATH` unless it contains a `/`).
    pub nvidia_smi: String,
    /// Read the GPU list from this file (the query's CSV output) instead of running `nvidia-smi`.
    pub gpu_query_file: Option<PathBuf>,
    /// `/proc/meminfo`.
    pub meminfo: PathBuf,
    /// `/proc/cpuinfo`.
    pub cpuinfo: PathBuf,
    /// The cgroup memory limit files, first readable one wins (`memory.max` of v2, `memory.limit_in_bytes` of v1).
    pub cgroup_memory: Vec<PathBuf>,
}

impl Default for Sources {
    fn default() -> Self {
        Self {
            nvidia_smi: "nvidia-smi".into(),
            gpu_query_file: None,
            meminfo: "/proc/meminfo".into(),
            cpuinfo: "/proc/cpuinfo".into(),
            cgroup_memory: vec![
                "/sys/fs/cgroup/memory.max".into(),
                "/sys/fs/cgroup/memory/memory.limit_in_bytes".into(),
            ],
        }
    }
}

/// The arguments `nvidia-smi` is run with.
pub const NVIDIA_SMI_ARGS: [&str; 2] = ["--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"];

/// Reads the GPUs, memory and CPUs from `sources`.
///
/// # Errors
/// [`DetectError::Input`] when meminfo cannot be read or parsed, or nvidia-smi's output is malformed. A missing
/// or failing `nvidia-smi` is not an error here: it is [`Hardware::gpus`]' `Err`.
pub fn read_hardware(sources: &Sources) -> Result<Hardware, DetectError> {
    let gpus = match &sources.gpu_query_file {
        Some(file) => {
            let text = std::fs::read_to_string(file)
                .map_err(|e| DetectError::Input(format!("cannot read {}: {e}", file.display())))?;
            Ok(parse_gpu_query(&text).map_err(DetectError::Input)?)
        }
        None => match std::process::Command::new(&sources.nvidia_smi).args(NVIDIA_SMI_ARGS).output() {
            Err(e) => Err(NoGpu::NoNvidiaSmi(format!("{}: {e}", sources.nvidia_smi))),
            Ok(out) if !out.status.success() => {
                let msg = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
                let msg = msg.split_whitespace().collect::<Vec<_>>().join(" ");
                Err(NoGpu::NvidiaSmiFailed(format!("{} ({})", msg.trim(), out.status)))
            }
            Ok(out) => Ok(parse_gpu_query(&String::from_utf8_lossy(&out.stdout)).map_err(DetectError::Input)?),
        },
    };
    let meminfo_text = std::fs::read_to_string(&sources.meminfo)
        .map_err(|e| DetectError::Input(format!("cannot read {}: {e}", sources.meminfo.display())))?;
    let meminfo =
        parse_meminfo(&meminfo_text).map_err(|e| DetectError::Input(format!("{}: {e}", sources.meminfo.display())))?;
    let cgroup_memory_bytes = sources
        .cgroup_memory
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| parse_cgroup_memory(&t));
    let cpus = std::fs::read_to_string(&sources.cpuinfo)
        .map(|t| parse_cpuinfo(&t))
        .unwrap_or(CpuCount { physical_cores: None, logical_cpus: 0 });
    let available_parallelism = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cpus = CpuCount { logical_cpus: cpus.logical_cpus.max(1), ..cpus };
    Ok(Hardware { gpus, meminfo, cgroup_memory_bytes, cpus, available_parallelism })
}
