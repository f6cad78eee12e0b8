//! Expert placement settings (`[placement]` of the config, the `--gpu-experts`/`--ram-experts`/... flags, and
//! the hardware profile's tier counts) and their translation into the engine's
//! [`nebula_engine::placement::PlacementOptions`].
//!
//! The profile file written by `nebula profile detect` is a figment layer just above the built-in defaults
//! ([`profile_layer`]): its tier counts, n-gram table place, threads and VRAM/RAM steps become
//! `placement.gpu_experts`, `placement.ram_experts`, `placement.ngram_table`, `placement.threads`,
//! `placement.vram_budget_gib` and `placement.ram_budget_gib`, which the config file, `NEBULA_PLACEMENT__*`
//! variables and flags override. Emulating a profile on a bigger machine is therefore a matter of the budgets and
//! threads (`--vram-budget-gib 12 --ram-budget-gib 128 --threads 14`), or of a profile written with
//! `nebula profile detect --vram-gib ... --ram-gib ... --threads ...`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use nebula_engine::placement::{
    DEFAULT_HOTLIST_LABEL, GpuCacheOptions, GpuCachePolicy, Hotlist, PlacementOptions, TablePlacement,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// `[placement]`: where experts and the n-gram table live. Without `gpu_experts`, `ram_experts` and
/// `ngram_table` (from the profile or set here) there is no placement: every weight is read through the file's
/// memory map, as before placement existed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PlacementConfig {
    /// Experts per layer in the GPU tier (top X of the hotlist).
    pub gpu_experts: Option<usize>,
    /// Experts per layer held in RAM, GPU copies included (top H); the rest are read from SSD.
    pub ram_experts: Option<usize>,
    /// Experts per layer the counts are written for (the profile's `experts_per_layer`); a model with another
    /// number gets them scaled. `None`: the counts apply as they are.
    pub counts_for_experts: Option<usize>,
    /// Hotlist file (`nebula hotlist`); none: expert id order.
    pub hotlist: Option<PathBuf>,
    /// Where the n-gram table lives: `ram`, `ssd` or `mapped`.
    pub ngram_table: Option<TablePlacement>,
    /// VRAM budget, GiB (GPU experts + dense trunk must fit).
    pub vram_budget_gib: Option<f64>,
    /// RAM budget, GiB (RAM tier + SSD pool + table in RAM + dense trunk must fit).
    pub ram_budget_gib: Option<f64>,
    /// CPU threads of the compute pool; none: rayon's default (the logical CPUs).
    pub threads: Option<usize>,
    /// SSD buffer pool, MiB; none: room for two batches of experts per prefetched layer.
    pub ssd_pool_mib: Option<u64>,
    /// I/O threads reading from SSD.
    pub io_threads: usize,
    /// Layers ahead whose routers drive the SSD prefetch (0: off).
    pub prefetch_layers: usize,
    /// Read with O_DIRECT (falls back to buffered reads where the file system refuses it).
    pub direct_io: bool,
    /// mlock the RAM tier (falls back to unlocked memory, with a warning, when not permitted).
    pub lock_memory: bool,
    /// CUDA backend with a placement (hybrid decode): a token whose GPU-resident experts cover less than this
    /// fraction of its router weight has the layer's routed MoE computed on the CPU.
    pub handoff: f32,
    /// Hybrid decode: drop a token's lightest CPU-side experts while their summed weight stays within this
    /// fraction of its mass (0 = strict, the default; e.g. 0.1).
    pub omit_marginal: f32,
    /// Hybrid decode: whether the GPU tier's experts stay the placement's (`static`) or follow the working set
    /// (`lru`). `batching.deterministic` keeps it static.
    pub gpu_cache: GpuCachePolicy,
    /// With `gpu_cache = "lru"`: forward passes between two refreshes of the GPU expert cache.
    pub gpu_cache_interval: usize,
    /// With `gpu_cache = "lru"`: most experts uploaded per layer and refresh.
    pub gpu_cache_uploads: usize,
}

impl Default for PlacementConfig {
    fn default() -> Self {
        Self {
            gpu_experts: None,
            ram_experts: None,
            counts_for_experts: None,
            hotlist: None,
            ngram_table: None,
            vram_budget_gib: None,
            ram_budget_gib: None,
            threads: None,
            ssd_pool_mib: None,
            io_threads: 4,
            prefetch_layers: 1,
            direct_io: true,
            lock_memory: true,
            handoff: nebula_engine::placement::DEFAULT_HANDOFF,
            omit_marginal: 0.0,
            gpu_cache: GpuCachePolicy::Static,
            gpu_cache_interval: GpuCacheOptions::default().interval,
            gpu_cache_uploads: GpuCacheOptions::default().uploads,
        }
    }
}

/// GiB in bytes.
const GIB: f64 = (1u64 << 30) as f64;

impl PlacementConfig {
    /// True when anything asks for a placement.
    pub fn active(&self) -> bool {
        self.gpu_experts.is_some() || self.ram_experts.is_some() || self.ngram_table.is_some()
    }

    /// Checks values figment cannot.
    ///
    /// Errors: a message naming the key.
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in
            [("placement.vram_budget_gib", self.vram_budget_gib), ("placement.ram_budget_gib", self.ram_budget_gib)]
        {
            if let Some(v) = v
                && !(v.is_finite() && v > 0.0)
            {
                return Err(format!("{name} must be a positive number of GiB, got {v}"));
            }
        }
        for (name, v) in [("placement.handoff", self.handoff), ("placement.omit_marginal", self.omit_marginal)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("{name} must be a fraction between 0 and 1, got {v}"));
            }
        }
        if self.threads == Some(0) || self.io_threads == 0 {
            return Err("placement.threads and placement.io_threads must be at least 1".into());
        }
        if self.gpu_cache_interval == 0 || self.gpu_cache_uploads == 0 {
            return Err(format!(
                "placement.gpu_cache_interval ({}) and placement.gpu_cache_uploads ({}) must be at least 1",
                self.gpu_cache_interval, self.gpu_cache_uploads
            ));
        }
        if let (Some(g), Some(r)) = (self.gpu_experts, self.ram_experts)
            && r < g
        {
            return Err(format!(
                "placement.ram_experts = {r} is below placement.gpu_experts = {g}: RAM keeps a copy of every GPU expert"
            ));
        }
        Ok(())
    }

    /// Fills the settings left unset with the profile's ([`profile_layer`]): what `ServerConfig::resolve` does
    /// with figment, for a config built in code and handed to `start`.
    pub fn fill_from_profile(&mut self, profile: &Value) {
        let layer = profile_layer(profile);
        let Ok(p) = serde_json::from_value::<PlacementConfig>(layer["placement"].clone()) else { return };
        self.gpu_experts = self.gpu_experts.or(p.gpu_experts);
        self.ram_experts = self.ram_experts.or(p.ram_experts);
        self.counts_for_experts = self.counts_for_experts.or(p.counts_for_experts);
        self.ngram_table = self.ngram_table.or(p.ngram_table);
        self.vram_budget_gib = self.vram_budget_gib.or(p.vram_budget_gib);
        self.ram_budget_gib = self.ram_budget_gib.or(p.ram_budget_gib);
        self.threads = self.threads.or(p.threads);
        if self.gpu_cache == GpuCachePolicy::default() {
            self.gpu_cache = p.gpu_cache;
        }
    }

    /// The engine's options, reading the hotlist; `None` when no placement is asked for. `source` names where
    /// the settings come from, for the report.
    ///
    /// Errors: the hotlist cannot be read or is not a valid hotlist (the message names the file).
    pub fn to_options(&self, source: &str) -> Result<Option<PlacementOptions>, String> {
        if !self.active() {
            return Ok(None);
        }
        let (hotlist, hotlist_label) = match &self.hotlist {
            Some(path) => (Some(Arc::new(Hotlist::load(path).map_err(|e| e.to_string())?)), path.display().to_string()),
            None => (None, DEFAULT_HOTLIST_LABEL.to_owned()),
        };
        Ok(Some(PlacementOptions {
            gpu_experts: self.gpu_experts.unwrap_or(0),
            ram_experts: self.ram_experts.unwrap_or(usize::MAX),
            hotlist,
            hotlist_label,
            ngram_table: self.ngram_table.unwrap_or_default(),
            vram_budget: self.vram_budget_gib.map(|g| (g * GIB) as u64),
            ram_budget: self.ram_budget_gib.map(|g| (g * GIB) as u64),
            ssd_pool_bytes: self.ssd_pool_mib.map(|m| m << 20),
            io_threads: self.io_threads,
            prefetch_layers: self.prefetch_layers,
            direct_io: self.direct_io,
            lock_memory: self.lock_memory,
            reader: None,
            source: source.to_owned(),
            counts_for_experts: self.counts_for_experts,
            handoff: self.handoff,
            omit_marginal: self.omit_marginal,
            gpu_cache: GpuCacheOptions {
                policy: self.gpu_cache,
                interval: self.gpu_cache_interval,
                uploads: self.gpu_cache_uploads,
            },
        }))
    }
}

/// Placement flags, shared by `nebula serve` and `nebula bench model`; each overrides the config and the profile.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct PlacementFlags {
    /// Experts per layer in the GPU tier (top X of the hotlist). Default: the profile's.
    #[arg(long)]
    pub gpu_experts: Option<usize>,
    /// Experts per layer held in RAM, GPU copies included (top H); the rest are read from SSD. Default: the
    /// profile's.
    #[arg(long)]
    pub ram_experts: Option<usize>,
    /// Hotlist file written by `nebula hotlist`. Default: expert id order.
    #[arg(long)]
    pub hotlist: Option<PathBuf>,
    /// Where the n-gram table lives: ram, ssd or mapped. Default: the profile's.
    #[arg(long)]
    pub ngram_table: Option<TablePlacement>,
    /// Emulation: VRAM budget in GiB (GPU experts + dense trunk must fit). Default: the profile's VRAM step.
    #[arg(long)]
    pub vram_budget_gib: Option<f64>,
    /// Emulation: RAM budget in GiB (RAM tier + SSD pool + table in RAM + dense trunk must fit). Default: the
    /// profile's RAM step.
    #[arg(long)]
    pub ram_budget_gib: Option<f64>,
    /// Emulation: CPU threads of the compute pool. Default: the profile's, else every logical CPU.
    #[arg(long)]
    pub threads: Option<usize>,
    /// SSD buffer pool in MiB. Default: two batches of experts per prefetched layer.
    #[arg(long)]
    pub ssd_pool_mib: Option<u64>,
    /// I/O threads reading from SSD. Default: 4.
    #[arg(long)]
    pub io_threads: Option<usize>,
    /// Layers ahead whose routers choose the SSD experts to prefetch (0: no prefetch). Default: 1.
    #[arg(long)]
    pub prefetch_layers: Option<usize>,
    /// CUDA backend with a placement: hand a token's routed MoE to the CPU when GPU-resident experts cover less
    /// than this fraction of its router weight (0.9: the original rule). Default: 0 (the resident experts on the GPU,
    /// the others on the CPU, for every token: the faster exact schedule).
    #[arg(long, allow_negative_numbers = true, value_parser = fraction)]
    pub handoff: Option<f32>,
    /// CUDA backend with a placement: drop a token's lightest CPU-side experts within this fraction of its router
    /// weight (0 = strict). Default: 0.
    #[arg(long, allow_negative_numbers = true, value_parser = fraction)]
    pub omit_marginal: Option<f32>,
    /// CUDA backend with a placement: static (the GPU tier stays the placement's) or lru (it follows the experts
    /// recent decode steps used, uploading them over PCIe off the critical path). Default: static.
    #[arg(long)]
    pub gpu_cache: Option<GpuCachePolicy>,
    /// With --gpu-cache lru: forward passes between two refreshes. Default: 1.
    #[arg(long)]
    pub gpu_cache_interval: Option<usize>,
    /// With --gpu-cache lru: most experts uploaded per layer and refresh. Default: 4.
    #[arg(long)]
    pub gpu_cache_uploads: Option<usize>,
}

/// A fraction flag: a number in [0, 1] (NaN and infinities refused).
fn fraction(s: &str) -> Result<f32, String> {
    let v: f32 = s.parse().map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if (0.0..=1.0).contains(&v) { Ok(v) } else { Err(format!("must be a fraction between 0 and 1, got {s}")) }
}

impl PlacementFlags {
    /// The flags that were given, as a figment layer for `placement` (absent flags leave lower layers alone).
    pub fn overrides(&self) -> Value {
        let mut m = serde_json::Map::new();
        let mut put = |k: &str, v: Option<Value>| {
            if let Some(v) = v {
                m.insert(k.into(), v);
            }
        };
        put("gpu_experts", self.gpu_experts.map(Value::from));
        put("ram_experts", self.ram_experts.map(Value::from));
        put("hotlist", self.hotlist.as_ref().map(|p| Value::from(p.display().to_string())));
        put("ngram_table", self.ngram_table.map(|t| Value::from(t.name())));
        put("vram_budget_gib", self.vram_budget_gib.map(Value::from));
        put("ram_budget_gib", self.ram_budget_gib.map(Value::from));
        put("threads", self.threads.map(Value::from));
        put("ssd_pool_mib", self.ssd_pool_mib.map(Value::from));
        put("io_threads", self.io_threads.map(Value::from));
        put("prefetch_layers", self.prefetch_layers.map(Value::from));
        put("handoff", self.handoff.map(Value::from));
        put("omit_marginal", self.omit_marginal.map(Value::from));
        put("gpu_cache", self.gpu_cache.map(|p| Value::from(p.name())));
        put("gpu_cache_interval", self.gpu_cache_interval.map(Value::from));
        put("gpu_cache_uploads", self.gpu_cache_uploads.map(Value::from));
        Value::Object(m)
    }
}

/// The `placement` settings a profile file implies (see the module docs), as a figment layer; an empty object
/// for a profile without tiers (the demo profiles).
///
/// Reads both the file `nebula profile detect` writes (`placement = [{tier, experts_per_layer, gpu_copies}]`) and
/// a row of `deploy/profiles.toml` (`gpu_experts_per_layer`, `cpu_experts_per_layer`, `gpu_copies_in_ram`).
pub fn profile_layer(profile: &Value) -> Value {
    let mut p = serde_json::Map::new();
    let u = |v: Option<&Value>| v.and_then(Value::as_u64);
    let tier = |name: &str| {
        profile
            .get("placement")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().find(|t| t.get("tier").and_then(Value::as_str) == Some(name)))
    };
    // (GPU, CPU, RAM copies of the GPU experts, SSD) per layer.
    let (gpu, cpu, copies, ssd) = match (tier("gpu"), tier("ram")) {
        (Some(g), Some(r)) => (
            u(g.get("experts_per_layer")),
            u(r.get("experts_per_layer")),
            u(r.get("gpu_copies")).unwrap_or(0),
            tier("ssd").and_then(|s| u(s.get("experts_per_layer"))),
        ),
        _ => (
            u(profile.get("gpu_experts_per_layer")),
            u(profile.get("cpu_experts_per_layer")),
            u(profile.get("gpu_copies_in_ram")).unwrap_or(0),
            u(profile.get("ssd_experts_per_layer")),
        ),
    };
    if let (Some(g), Some(c)) = (gpu, cpu) {
        p.insert("gpu_experts".into(), g.into());
        p.insert("ram_experts".into(), (c + copies).into());
        // The experts per layer the counts are for: stated, or GPU + CPU + SSD.
        if let Some(n) = u(profile.get("experts_per_layer")).or(ssd.map(|s| g + c + s)) {
            p.insert("counts_for_experts".into(), n.into());
        }
        if let Some(t) = profile.get("ngram_table").and_then(Value::as_str) {
            p.insert("ngram_table".into(), t.into());
        }
        for (key, budget) in [("vram_gb", "vram_budget_gib"), ("ram_gb", "ram_budget_gib")] {
            if let Some(gb) = u(profile.get(key)).filter(|&g| g > 0) {
                p.insert(budget.into(), (gb as f64).into());
            }
        }
    }
    if let Some(t) = u(profile.get("threads")).filter(|&t| t > 0) {
        p.insert("threads".into(), t.into());
    }
    if let Some(c) = profile.get("gpu_cache").and_then(Value::as_str) {
        p.insert("gpu_cache".into(), c.into());
    }
    json!({ "placement": p })
}

/// The placement settings of a command without a config file (`nebula bench model`): defaults < the profile's
/// (when `profile` is given) < `flags`.
///
/// Errors: the profile cannot be read, or a value is invalid (the message names the key).
pub fn resolve(profile: Option<&Path>, flags: &PlacementFlags) -> Result<PlacementConfig, String> {
    use figment::Figment;
    use figment::providers::Serialized;
    let mut f = Figment::from(Serialized::defaults(json!({ "placement": PlacementConfig::default() })));
    if let Some(p) = profile {
        f = f.merge(Serialized::defaults(profile_layer(&read_profile_value(p)?)));
    }
    f = f.merge(Serialized::defaults(json!({ "placement": flags.overrides() })));
    let c: PlacementConfig = f.extract_inner("placement").map_err(|e| e.to_string())?;
    c.validate()?;
    Ok(c)
}

/// Reads a profile file (TOML) as JSON.
///
/// Errors: the file cannot be read or is not TOML (the message names the file).
pub fn read_profile_value(path: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read the profile {}: {e}", path.display()))?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| format!("profile {}: {e}", path.display()))?;
    serde_json::to_value(table).map_err(|e| format!("profile {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_profile_becomes_placement_defaults() {
        let written = json!({
            "name": "12gb-vram-128gb-ram", "vram_gb": 12, "ram_gb": 128, "threads": 14, "ngram_table": "ram",
            "experts_per_layer": 512,
            "placement": [
                {"tier": "gpu", "experts_per_layer": 27},
                {"tier": "ram", "experts_per_layer": 485, "gpu_copies": 27},
                {"tier": "ssd", "experts_per_layer": 0}
            ]
        });
        let p = &profile_layer(&written)["placement"];
        assert_eq!(p["gpu_experts"], 27);
        assert_eq!(p["ram_experts"], 512);
        assert_eq!((p["vram_budget_gib"].as_f64(), p["ram_budget_gib"].as_f64()), (Some(12.0), Some(128.0)));
        assert_eq!((p["threads"].as_u64(), p["ngram_table"].as_str()), (Some(14), Some("ram")));
        let row = json!({"gpu_experts_per_layer": 11, "cpu_experts_per_layer": 141, "gpu_copies_in_ram": 11,
                         "ngram_table": "ssd", "vram_gb": 8, "ram_gb": 32});
        let p = &profile_layer(&row)["placement"];
        assert_eq!((p["gpu_experts"].as_u64(), p["ram_experts"].as_u64()), (Some(11), Some(152)));
        assert!(p.get("counts_for_experts").is_none(), "no SSD count, no experts_per_layer: counts as they are");
        let row = json!({"gpu_experts_per_layer": 11, "cpu_experts_per_layer": 141, "gpu_copies_in_ram": 11,
                         "ssd_experts_per_layer": 360});
        assert_eq!(profile_layer(&row)["placement"]["counts_for_experts"], 512, "GPU + CPU + SSD");
        // A demo profile: no tiers, so no placement (threads still apply).
        let demo = json!({"name": "demo-cpu", "threads": 2, "placement": []});
        assert_eq!(profile_layer(&demo), json!({"placement": {"threads": 2}}));
        // The GPU expert cache is a profile key too.
        let lru = json!({"gpu_experts_per_layer": 27, "cpu_experts_per_layer": 485, "gpu_cache": "lru"});
        assert_eq!(profile_layer(&lru)["placement"]["gpu_cache"], "lru");
    }

    #[test]
    fn options_follow_the_settings_and_bad_values_are_named() {
        let mut c = PlacementConfig::default();
        assert!(c.to_options("x").unwrap().is_none(), "nothing asked: no placement");
        c.gpu_experts = Some(2);
        c.ram_experts = Some(8);
        c.ram_budget_gib = Some(1.5);
        let o = c.to_options("flags").unwrap().unwrap();
        assert_eq!((o.gpu_experts, o.ram_experts, o.ram_budget), (2, 8, Some(3 << 29)));
        c.ram_experts = Some(1);
        assert!(c.validate().unwrap_err().contains("placement.ram_experts"));
        c.ram_experts = None;
        assert_eq!(c.to_options("x").unwrap().unwrap().gpu_cache, GpuCacheOptions::default(), "static by default");
        c.gpu_cache = GpuCachePolicy::Lru;
        c.gpu_cache_uploads = 8;
        let o = c.to_options("x").unwrap().unwrap().gpu_cache;
        assert_eq!((o.policy, o.interval, o.uploads), (GpuCachePolicy::Lru, 1, 8));
        c.gpu_cache_interval = 0;
        assert!(c.validate().unwrap_err().contains("placement.gpu_cache_interval"));
        c.gpu_cache_interval = 1;
        c.hotlist = Some("/nonexistent/hot.json".into());
        assert!(c.to_options("x").unwrap_err().contains("/nonexistent/hot.json"));
    }
}
