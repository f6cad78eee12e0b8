//! Tier counts from the model file's own expert size.
//!
//! The profile table's counts are the original product's, for experts stored as Q4_K gate/up and IQ4_NL down
//! (2.64 MiB per expert at the release's widths). A file of another mix holds more (or fewer) experts in the same
//! bytes, so with a model `nebula profile detect` keeps each tier's byte budget and recounts it in the file's
//! experts: `count' = min(experts, floor(count x q4 / actual))`, where `q4` is the size an expert of the file's
//! shapes has in the table's types (Q4_K gate/up, IQ4_NL down, each with llama.cpp's fallback for rows the block
//! does not divide) and `actual` its mean size in the file over every block that has routed experts. The GPU
//! tier (the expert cache) and the RAM tier (the experts the CPU computes plus the RAM copies of the GPU ones)
//! are recounted separately; the RAM copies stay equal to the GPU count and the SSD tier takes the rest. A file
//! whose routed experts are all Q4_K or IQ4_NL keeps the table's counts as they are.
//!
//! Recounting keeps the table's byte budget for experts, but a smaller mix's dense weights are smaller too, so on
//! the GPU that budget leaves VRAM unused (a 48-layer UD-Q2_K_XL-class file planned 5.45 GiB of a 12 GiB step).
//! [`fill_vram`] then grows the GPU tier to what the step holds after the file's own dense weights, one
//! full-context sequence's KV cache (`released_kv_bytes`) and the headroom the table's row leaves free:
//! `gpu = floor((step - free - dense - kv) / (blocks x mean expert bytes))`, when that is more than the recount.
//! The RAM tier keeps what it holds; its copies of the GPU experts grow with the GPU tier, so the CPU computes
//! that many fewer.

use std::collections::BTreeSet;

use nebula_engine::convert::recipe::fallback;
use nebula_engine::gguf::{GgmlType, GgufFile};

/// The routed-expert storage of a model file.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertSize {
    /// Mean bytes of one routed expert (gate + up + down) over the blocks that have routed experts.
    pub mean_bytes: f64,
    /// Bytes of one expert of the same shapes in the table's types (Q4_K gate/up, IQ4_NL down).
    pub q4_bytes: f64,
    /// Routed experts per block.
    pub experts: u64,
    /// The block types the routed experts use, in the order first seen.
    pub types: Vec<GgmlType>,
    /// Blocks with routed experts (the decoder layers, and the MTP block when the file has one).
    pub blocks: u64,
    /// Bytes of every tensor that is neither a routed expert nor the n-gram table (`per_layer_token_embd`, which
    /// the profiles keep on SSD or in RAM): what the GPU holds besides its expert tier.
    pub dense_bytes: u64,
}

impl ExpertSize {
    /// Reads the routed-expert tensors (`blk.N.ffn_{gate,up,down,gate_up}_exps.weight`) of `file`; `None` when it
    /// has none.
    pub fn of_file(file: &GgufFile) -> Option<Self> {
        Self::from_tensors(file.tensors().map(|t| (t.name.as_str(), t.ggml_type, t.dims.as_slice())))
    }

    /// [`ExpertSize::of_file`] on `(name, type, ggml dims)` triples; `None` without routed-expert tensors.
    pub fn from_tensors<'a>(tensors: impl Iterator<Item = (&'a str, GgmlType, &'a [u64])>) -> Option<Self> {
        let (mut bytes, mut q4) = (0f64, 0f64);
        let mut blocks = BTreeSet::new();
        let mut types = Vec::new();
        let mut experts = 0u64;
        let mut dense = 0u64;
        for (name, ty, dims) in tensors {
            let is_exps = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps"]
                .iter()
                .any(|k| name.ends_with(&format!(".{k}.weight")));
            if !is_exps || dims.len() != 3 {
                if !name.starts_with("per_layer_token_embd") && !dims.is_empty() {
                    let rows: u64 = dims[1..].iter().product();
                    dense += ty.row_bytes(dims[0]).unwrap_or(0) * rows;
                }
                continue;
            }
            let Some(block) = name.strip_prefix("blk.").and_then(|r| r.split('.').next()) else { continue };
            let row = |t: GgmlType| t.row_bytes(dims[0]).unwrap_or(0) as f64 * dims[1] as f64;
            let table_ty = if name.contains("ffn_down_exps") { GgmlType::IQ4_NL } else { GgmlType::Q4_K };
            bytes += row(ty);
            q4 += row(fallback(table_ty, dims[0]));
            experts = experts.max(dims[2]);
            blocks.insert(block.to_owned());
            if !types.contains(&ty) {
                types.push(ty);
            }
        }
        if blocks.is_empty() || bytes == 0.0 {
            return None;
        }
        let n = blocks.len() as f64;
        Some(Self {
            mean_bytes: bytes / n,
            q4_bytes: q4 / n,
            experts,
            types,
            blocks: blocks.len() as u64,
            dense_bytes: dense,
        })
    }

    /// Whether the table's counts apply unchanged: every routed expert is Q4_K or IQ4_NL.
    pub fn is_table_mix(&self) -> bool {
        self.types.iter().all(|t| matches!(t, GgmlType::Q4_K | GgmlType::IQ4_NL))
    }

    /// `count` experts of the table's size recounted in this file's experts, at most `experts_per_layer`.
    pub fn recount(&self, count: u32, experts_per_layer: u32) -> u32 {
        if self.is_table_mix() {
            return count;
        }
        let c = (count as f64 * self.q4_bytes / self.mean_bytes).floor();
        (c.max(0.0) as u32).min(experts_per_layer)
    }
}

/// Recounts a profile's tiers for `size` (see the module docs): the GPU tier, the RAM tier (CPU experts plus the
/// GPU copies), the SSD rest. Returns whether anything changed.
pub fn apply(profile: &mut super::Profile, size: &ExpertSize) -> bool {
    let total = profile.experts_per_layer;
    let get = |p: &super::Profile, tier: &str| p.placement.iter().find(|t| t.tier == tier).cloned();
    let (Some(gpu), Some(ram)) = (get(profile, "gpu"), get(profile, "ram")) else { return false };
    let copies = ram.gpu_copies.unwrap_or(0);
    let gpu_n = size.recount(gpu.experts_per_layer, total);
    // RAM holds the top `cpu + copies`; on the CPU backend there are no copies and no GPU tier.
    let held = size.recount(ram.experts_per_layer + copies, total).max(gpu_n);
    let new_copies = if copies > 0 { gpu_n } else { 0 };
    let cpu_n = held - new_copies;
    let ssd_n = total - held.max(gpu_n);
    let mut changed = false;
    for t in &mut profile.placement {
        let (n, c) = match t.tier.as_str() {
            "gpu" => (gpu_n, None),
            "ram" => (cpu_n, Some(new_copies)),
            "ssd" => (ssd_n, None),
            _ => continue,
        };
        changed |= t.experts_per_layer != n || (c.is_some() && t.gpu_copies != c);
        t.experts_per_layer = n;
        if c.is_some() {
            t.gpu_copies = c;
        }
    }
    changed
}

/// Grows the GPU tier of a CUDA profile to fill its VRAM step (see the module docs): `free_vram_gb` is the table
/// row's headroom, `kv_vram` the VRAM of one full-context sequence's caches. The RAM tier keeps the experts it
/// holds (its copies of the GPU experts grow, its CPU-computed experts shrink as much), the SSD tier is unchanged.
/// Returns the new GPU count when it grew, `None` when the recount already fills the step (or there is no GPU
/// tier).
pub fn fill_vram(profile: &mut super::Profile, size: &ExpertSize, free_vram_gb: f64, kv_vram: u64) -> Option<u32> {
    const GIB: f64 = (1u64 << 30) as f64;
    let total = profile.experts_per_layer;
    let gpu_now = profile.placement.iter().find(|t| t.tier == "gpu")?.experts_per_layer;
    let ram = profile.placement.iter().find(|t| t.tier == "ram")?.clone();
    let copies = ram.gpu_copies?;
    if profile.vram_gb == 0 || size.blocks == 0 || size.mean_bytes <= 0.0 {
        return None;
    }
    let free = profile.vram_gb as f64 * GIB - free_vram_gb * GIB - size.dense_bytes as f64 - kv_vram as f64;
    let fit = (free / (size.blocks as f64 * size.mean_bytes)).floor();
    let held = ram.experts_per_layer + copies;
    // The GPU experts keep their RAM copies, so the tier is at most what RAM holds.
    let gpu = (fit.max(0.0) as u32).min(total).min(held);
    if gpu <= gpu_now {
        return None;
    }
    for t in &mut profile.placement {
        match t.tier.as_str() {
            "gpu" => t.experts_per_layer = gpu,
            "ram" => {
                t.experts_per_layer = held - gpu;
                t.gpu_copies = Some(gpu);
            }
            _ => {}
        }
    }
    Some(gpu)
}
