//! The hotlist: per layer and routed expert, how often a routing campaign chose the expert and the router weight
//! it got. Experts are ranked by count, ties by summed weight, then by id; the top X of a layer go to
//! the GPU, the top H to RAM, the rest to SSD ([`super::PlacementPlan`]).
//!
//! # File format (version 1)
//!
//! One JSON object, written by `nebula hotlist` ([`Hotlist::to_json`]) and checked on read ([`Hotlist::parse`]):
//!
//! ```json
//! {
//!   "format": "nebula-hotlist",
//!   "version": 1,
//!   "model": {"name": "Qwen3.8-Flash-Next", "n_layer": 48, "n_expert": 512, "n_expert_used": 10},
//!   "campaign": {"prompt_set": "assets/hotlist/prompts.jsonl", "prompts": 132, "domains": 12, "tokens": 40321,
//!                "generated_per_prompt": 16},
//!   "layers": [{"layer": 0, "count": [3021, 17, ...], "weight": [812.5, 2.25, ...]}, ...]
//! }
//! ```
//!
//! `count[e]` is the number of tokens routed to expert `e` of that layer (each token picks `n_expert_used`
//! experts), `weight[e]` the sum of the renormalised router weights it got (each token's weights sum to 1, so
//! `weight[e] <= count[e]`). `layers` lists every trunk layer once, in order. The `campaign` object is
//! information for people; readers only require it to be an object. A file that breaks any rule is refused with
//! a message naming the file, the layer and the field.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::model::moe::Routing;

/// The `format` value of a hotlist file.
pub const HOTLIST_FORMAT: &str = "nebula-hotlist";
/// The layout version this engine writes and reads.
pub const HOTLIST_VERSION: u32 = 1;

/// A hotlist file that cannot be used; the message names the file (or `<memory>`) and the field.
#[derive(Debug, thiserror::Error)]
#[error("hotlist {source_name}: {detail}")]
pub struct HotlistError {
    /// The file's path, or `<memory>`.
    pub source_name: String,
    /// What is wrong.
    pub detail: String,
}

/// The model a hotlist was made for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotlistModel {
    /// `general.name` of the model the campaign ran on.
    pub name: String,
    /// Trunk layers.
    pub n_layer: usize,
    /// Routed experts per layer.
    pub n_expert: usize,
    /// Experts chosen per token.
    pub n_expert_used: usize,
}

/// One layer's counts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HotlistLayer {
    /// Trunk layer index (0-based).
    pub layer: usize,
    /// Tokens routed to each expert, `[n_expert]`.
    pub count: Vec<u64>,
    /// Summed renormalised router weight of each expert, `[n_expert]`.
    pub weight: Vec<f64>,
}

/// A hotlist: the campaign's counts for every layer and expert. Build one with [`HotlistBuilder`], read one
/// with [`Hotlist::load`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hotlist {
    /// [`HOTLIST_FORMAT`].
    pub format: String,
    /// [`HOTLIST_VERSION`].
    pub version: u32,
    /// The model the campaign ran on.
    pub model: HotlistModel,
    /// How the campaign ran (prompt set, counts); free-form for people.
    pub campaign: serde_json::Value,
    /// One entry per trunk layer, in order.
    pub layers: Vec<HotlistLayer>,
}

impl Hotlist {
    /// Reads and validates the hotlist file at `path`.
    ///
    /// Errors: [`HotlistError`] naming the file for an unreadable file, JSON that is not a hotlist (with the
    /// line and column), or any broken rule of the format (module docs).
    pub fn load(path: &Path) -> Result<Self, HotlistError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| HotlistError { source_name: name.clone(), detail: format!("cannot be read: {e}") })?;
        Self::parse(&text, &name)
    }

    /// Parses and validates a hotlist; `source_name` names it in errors.
    ///
    /// Errors: as [`Hotlist::load`].
    pub fn parse(text: &str, source_name: &str) -> Result<Self, HotlistError> {
        let err = |detail: String| HotlistError { source_name: source_name.to_owned(), detail };
        // The version is checked before the shape, so a newer file gets a version message, not a field error.
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| err(format!("not JSON: {e}")))?;
        match value.get("format").and_then(|v| v.as_str()) {
            Some(HOTLIST_FORMAT) => {}
            Some(other) => return Err(err(format!("format is {other:?}, expected {HOTLIST_FORMAT:?}"))),
            None => return Err(err(format!("no \"format\": {HOTLIST_FORMAT:?} key: not a hotlist file"))),
        }
        match value.get("version").and_then(|v| v.as_u64()) {
            Some(v) if v == u64::from(HOTLIST_VERSION) => {}
            Some(v) => return Err(err(format!("version {v}; this engine reads version {HOTLIST_VERSION}"))),
            None => return Err(err("no integer \"version\"".into())),
        }
        let list: Hotlist = serde_json::from_str(text).map_err(|e| err(e.to_string()))?;
        list.validate().map_err(err)?;
        Ok(list)
    }

    /// Checks the rules of the format; the message names the layer and field.
    fn validate(&self) -> Result<(), String> {
        let m = &self.model;
        if m.n_layer == 0 || m.n_expert == 0 || m.n_expert_used == 0 || m.n_expert_used > m.n_expert {
            return Err(format!(
                "model: n_layer {}, n_expert {}, n_expert_used {} are not a MoE model's",
                m.n_layer, m.n_expert, m.n_expert_used
            ));
        }
        if !self.campaign.is_object() {
            return Err("campaign must be an object".into());
        }
        if self.layers.len() != m.n_layer {
            return Err(format!("{} layers listed, model.n_layer is {}", self.layers.len(), m.n_layer));
        }
        for (i, l) in self.layers.iter().enumerate() {
            if l.layer != i {
                return Err(format!("layers[{i}] says layer {}; layers must be listed in order from 0", l.layer));
            }
            if l.count.len() != m.n_expert || l.weight.len() != m.n_expert {
                return Err(format!(
                    "layer {i}: {} counts and {} weights, expected {} of each (model.n_expert)",
                    l.count.len(),
                    l.weight.len(),
                    m.n_expert
                ));
            }
            for (e, (&c, &w)) in l.count.iter().zip(&l.weight).enumerate() {
                // Renormalised weights are at most 1 per use; allow float noise in the sum.
                if !w.is_finite() || w < 0.0 || w > c as f64 * (1.0 + 1e-6) + 1e-9 {
                    return Err(format!(
                        "layer {i}, expert {e}: weight {w} with count {c} (weights are sums of at most 1 per use)"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks that this hotlist was made for a model of `n_layer` layers of `n_expert` experts.
    ///
    /// Errors: a message saying which shape the hotlist has and which the model has.
    pub fn check_model(&self, n_layer: usize, n_expert: usize) -> Result<(), String> {
        if self.model.n_layer != n_layer || self.model.n_expert != n_expert {
            return Err(format!(
                "made for {} layers x {} experts ({}), but the model has {n_layer} layers x {n_expert} experts",
                self.model.n_layer, self.model.n_expert, self.model.name
            ));
        }
        Ok(())
    }

    /// The experts of `layer`, hottest first: by count, ties by summed weight, then by id. Empty past the last
    /// layer.
    pub fn ranking(&self, layer: usize) -> Vec<usize> {
        let Some(l) = self.layers.get(layer) else { return Vec::new() };
        let mut ids: Vec<usize> = (0..l.count.len()).collect();
        ids.sort_by(|&a, &b| l.count[b].cmp(&l.count[a]).then(l.weight[b].total_cmp(&l.weight[a])).then(a.cmp(&b)));
        ids
    }

    /// The file's text: pretty JSON with each layer's arrays on one line, and a trailing newline.
    pub fn to_json(&self) -> String {
        let head = serde_json::json!({
            "format": self.format, "version": self.version, "model": self.model, "campaign": self.campaign,
        });
        let mut out = serde_json::to_string_pretty(&head).unwrap_or_default();
        // Drop the closing brace (and the line break before it) to append the layers.
        out.truncate(out.trim_end().len().saturating_sub(1));
        out.truncate(out.trim_end().len());
        out.push_str(",\n  \"layers\": [\n");
        for (i, l) in self.layers.iter().enumerate() {
            let line = serde_json::to_string(l).unwrap_or_default();
            out.push_str("    ");
            out.push_str(&line);
            out.push_str(if i + 1 < self.layers.len() { ",\n" } else { "\n" });
        }
        out.push_str("  ]\n}\n");
        out
    }

    /// Share of all uses of `layer` that its top `k` experts (by [`Hotlist::ranking`]) got, in `[0, 1]`.
    pub fn coverage(&self, layer: usize, k: usize) -> f64 {
        let Some(l) = self.layers.get(layer) else { return 0.0 };
        let total: u64 = l.count.iter().sum();
        if total == 0 {
            return 0.0;
        }
        let top: u64 = self.ranking(layer).iter().take(k).map(|&e| l.count[e]).sum();
        top as f64 / total as f64
    }
}

/// Accumulates a routing campaign: call [`HotlistBuilder::record`] with each layer's routing decisions.
#[derive(Debug, Clone)]
pub struct HotlistBuilder {
    n_expert: usize,
    count: Vec<Vec<u64>>,
    weight: Vec<Vec<f64>>,
    /// Tokens seen (counted once per token, at layer 0).
    tokens: u64,
}

impl HotlistBuilder {
    /// An empty campaign for `n_layer` layers of `n_expert` experts.
    pub fn new(n_layer: usize, n_expert: usize) -> Self {
        Self {
            n_expert,
            count: vec![vec![0; n_expert]; n_layer],
            weight: vec![vec![0.0; n_expert]; n_layer],
            tokens: 0,
        }
    }

    /// Adds the routing decisions of `layer` for a batch of tokens. Out-of-range layers or experts are ignored.
    pub fn record(&mut self, layer: usize, routing: &[Routing]) {
        if layer == 0 {
            self.tokens += routing.len() as u64;
        }
        let (Some(c), Some(w)) = (self.count.get_mut(layer), self.weight.get_mut(layer)) else { return };
        for r in routing {
            for (&e, &wt) in r.experts.iter().zip(&r.weights) {
                if e < c.len() {
                    c[e] += 1;
                    w[e] += f64::from(wt);
                }
            }
        }
    }

    /// Tokens recorded so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The hotlist of what was recorded.
    pub fn finish(self, model: HotlistModel, campaign: serde_json::Value) -> Hotlist {
        debug_assert_eq!(model.n_expert, self.n_expert);
        Hotlist {
            format: HOTLIST_FORMAT.into(),
            version: HOTLIST_VERSION,
            model,
            campaign,
            layers: self
                .count
                .into_iter()
                .zip(self.weight)
                .enumerate()
                .map(|(layer, (count, weight))| HotlistLayer { layer, count, weight })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Hotlist {
        let mut b = HotlistBuilder::new(2, 4);
        let r = |experts: Vec<usize>, weights: Vec<f32>| Routing { experts, weights };
        // Layer 0: expert 2 twice; experts 1 and 3 once each with 3 heavier than 1; expert 0 never.
        b.record(0, &[r(vec![2, 1], vec![0.6, 0.4]), r(vec![2, 3], vec![0.3, 0.7])]);
        b.record(1, &[r(vec![0, 1], vec![0.5, 0.5]), r(vec![1, 0], vec![0.9, 0.1])]);
        b.finish(
            HotlistModel { name: "t".into(), n_layer: 2, n_expert: 4, n_expert_used: 2 },
            serde_json::json!({"prompts": 1}),
        )
    }

    #[test]
    fn ranks_by_count_then_weight_then_id() {
        let h = sample();
        assert_eq!(h.ranking(0), vec![2, 3, 1, 0], "count first, then weight (3: 0.7 > 1: 0.4), unused last");
        // Layer 1: experts 0 and 1 both twice; 1 has 1.4 of weight, 0 has 0.6.
        assert_eq!(h.ranking(1), vec![1, 0, 2, 3], "ties by weight, then by id");
        assert!((h.coverage(0, 1) - 0.5).abs() < 1e-12);
        assert!(h.ranking(7).is_empty());
    }

    #[test]
    fn round_trips_and_refuses_broken_files_naming_the_field() {
        let h = sample();
        let text = h.to_json();
        assert_eq!(Hotlist::parse(&text, "x.json").unwrap(), h);
        assert!(
            text.contains("\"campaign\": {\n    \"prompts\": 1\n  },\n  \"layers\": [\n    {\"layer\":0,"),
            "{text}"
        );
        let bad = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
            edit(&mut v);
            Hotlist::parse(&v.to_string(), "x.json").unwrap_err().to_string()
        };
        let e = bad(&|v| v["version"] = 2.into());
        assert!(e.contains("x.json") && e.contains("version 2"), "{e}");
        let e = bad(&|v| v["format"] = "other".into());
        assert!(e.contains("format"), "{e}");
        let e = bad(&|v| v["layers"][1]["count"] = serde_json::json!([1, 2]));
        assert!(e.contains("layer 1") && e.contains("2 counts"), "{e}");
        let e = bad(&|v| v["layers"][0]["weight"][2] = 5.0.into());
        assert!(e.contains("layer 0, expert 2"), "{e}");
        let e = bad(&|v| v["layers"][1]["layer"] = 0.into());
        assert!(e.contains("in order"), "{e}");
        let e = bad(&|v| {
            v["layers"].as_array_mut().unwrap().pop();
        });
        assert!(e.contains("1 layers listed"), "{e}");
        let e = Hotlist::parse("{\"format\": \"nebula-hotlist\", \"version\": 1, \"model\": 3}", "y").unwrap_err();
        assert!(e.to_string().starts_with("hotlist y: "), "{e}");
        assert!(Hotlist::parse("not json", "z").unwrap_err().to_string().contains("not JSON"));
        assert!(h.check_model(2, 4).is_ok());
        assert!(h.check_model(3, 4).unwrap_err().contains("3 layers x 4 experts"));
    }
}
