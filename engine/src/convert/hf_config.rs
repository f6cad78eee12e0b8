//! The text configuration of a `qwen4_exp` checkpoint (`config.json`), with the defaults of
//! `configuration_qwen4_exp.py` for absent fields.

use serde_json::Value;

use super::ConvertError;

/// What the converter needs from `config.json`.
#[derive(Debug, Clone)]
pub struct HfTextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub rope_theta: f64,
    pub partial_rotary_factor: f64,
    pub mrope_section: Vec<usize>,
    pub linear_conv_kernel_dim: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub num_experts_per_tok: usize,
    pub num_experts: usize,
    /// `true` = linear attention (Gated DeltaNet), `false` = indexed attention.
    pub recurrent: Vec<bool>,
    pub full_attention_interval: usize,
    pub hc_count: usize,
    pub hc_lowrank: usize,
    /// 1-based, as in HF.
    pub ple_layer_ids: Vec<usize>,
    pub ple_embed_dim: usize,
    pub ple_conv_kernel_size: usize,
    pub ngram_size: usize,
    pub heads_per_ngram: usize,
    pub indexer_n_heads: usize,
    pub indexer_head_dim: usize,
    pub indexer_budget: usize,
    pub indexer_compress_ratio: usize,
    /// The PLE segment token (`eos_token_id`, the first if a list, as HF).
    pub eos_token_id: Option<u32>,
    pub image_token_id: u32,
    /// `"sigmoid"` or `"silu"`.
    pub output_gate_type: String,
}

fn get<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key).filter(|x| !x.is_null())
}

impl HfTextConfig {
    /// Parses `config.json` text: either a `qwen4_exp` config with `text_config` or a flat `qwen4_exp_text` one.
    pub fn parse(text: &str) -> Result<Self, ConvertError> {
        let root: Value =
            serde_json::from_str(text).map_err(|e| ConvertError::Config(format!("config.json is not JSON: {e}")))?;
        let tc = get(&root, "text_config").unwrap_or(&root);
        let model_type = get(&root, "model_type").and_then(Value::as_str).unwrap_or("");
        if !matches!(model_type, "qwen4_exp" | "qwen4_exp_text") {
            return Err(ConvertError::Config(format!(
                "model_type is '{model_type}', expected 'qwen4_exp' or 'qwen4_exp_text'"
            )));
        }
        let uint = |key: &str, default: Option<usize>| -> Result<usize, ConvertError> {
            match get(tc, key) {
                Some(v) => v.as_u64().and_then(|x| usize::try_from(x).ok()).ok_or_else(|| {
                    ConvertError::Config(format!("text_config.{key} is {v}, expected a non-negative integer"))
                }),
                None => default.ok_or_else(|| ConvertError::Config(format!("text_config.{key} is missing"))),
            }
        };
        let float = |v: Option<&Value>, key: &str, default: f64| -> Result<f64, ConvertError> {
            match v {
                Some(x) => x.as_f64().ok_or_else(|| ConvertError::Config(format!("{key} is {x}, expected a number"))),
                None => Ok(default),
            }
        };
        let uint_list = |key: &str| -> Result<Option<Vec<usize>>, ConvertError> {
            match get(tc, key) {
                None => Ok(None),
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|x| {
                        x.as_u64().map(|u| u as usize).ok_or_else(|| ConvertError::Config(format!("{key} holds {x}")))
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map(Some),
                Some(other) => Err(ConvertError::Config(format!("{key} is {other}, expected a list"))),
            }
        };

        let hidden_size = uint("hidden_size", Some(2048))?;
        let num_hidden_layers = uint("num_hidden_layers", Some(40))?;
        let interval = uint("full_attention_interval", Some(4))?.max(1);
        let recurrent = match get(tc, "layer_types") {
            None => (0..num_hidden_layers).map(|i| (i + 1) % interval != 0).collect(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| match x.as_str() {
                    Some("linear_attention") => Ok(true),
                    Some("full_attention") | Some("indexed_attention") => Ok(false),
                    _ => Err(ConvertError::Config(format!("unsupported layer type {x}"))),
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(other) => return Err(ConvertError::Config(format!("layer_types is {other}"))),
        };
        if recurrent.len() != num_hidden_layers {
            return Err(ConvertError::Config(format!(
                "{} layer_types for {num_hidden_layers} layers",
                recurrent.len()
            )));
        }
        let rope = get(tc, "rope_parameters").or_else(|| get(tc, "rope_scaling"));
        let rope_theta =
            float(rope.and_then(|r| get(r, "rope_theta")).or_else(|| get(tc, "rope_theta")), "rope_theta", 10_000.0)?;
        let partial_rotary_factor = float(
            rope.and_then(|r| get(r, "partial_rotary_factor")).or_else(|| get(tc, "partial_rotary_factor")),
            "partial_rotary_factor",
            1.0,
        )?;
        let mrope_section = match rope.and_then(|r| get(r, "mrope_section")) {
            Some(Value::Array(a)) => a.iter().map(|x| x.as_u64().unwrap_or(0) as usize).collect(),
            _ => vec![11, 11, 10],
        };
        let eos_token_id = match get(tc, "eos_token_id") {
            None => None,
            Some(Value::Array(a)) => a.first().and_then(Value::as_u64).map(|x| x as u32),
            Some(v) => v.as_u64().map(|x| x as u32),
        };
        if let Some(v) = get(tc, "norm_topk_prob")
            && v.as_bool() == Some(false)
        {
            return Err(ConvertError::Config("norm_topk_prob=false is not supported by qwen4exp".into()));
        }
        let hidden_act = get(tc, "hidden_act").and_then(Value::as_str).unwrap_or("silu").to_string();
        let output_gate_type =
            get(tc, "output_gate_type").and_then(Value::as_str).map(str::to_string).unwrap_or(hidden_act);
        if !matches!(output_gate_type.as_str(), "sigmoid" | "silu") {
            return Err(ConvertError::Config(format!("unsupported output_gate_type '{output_gate_type}'")));
        }
        let linear_key_head_dim = uint("linear_key_head_dim", Some(128))?;
        let linear_value_head_dim = uint("linear_value_head_dim", Some(128))?;
        if linear_key_head_dim != linear_value_head_dim {
            return Err(ConvertError::Config(format!(
                "linear_key_head_dim {linear_key_head_dim} != linear_value_head_dim {linear_value_head_dim}; qwen4exp GGUF has one ssm.state_size"
            )));
        }
        let cfg = Self {
            vocab_size: uint("vocab_size", Some(248_320))?,
            hidden_size,
            num_hidden_layers,
            num_attention_heads: uint("num_attention_heads", Some(16))?,
            num_key_value_heads: uint("num_key_value_heads", Some(2))?,
            head_dim: uint("head_dim", Some(256))?,
            rms_norm_eps: float(get(tc, "rms_norm_eps"), "rms_norm_eps", 1e-6)?,
            max_position_embeddings: uint("max_position_embeddings", Some(32_768))?,
            rope_theta,
            partial_rotary_factor,
            mrope_section,
            linear_conv_kernel_dim: uint("linear_conv_kernel_dim", Some(4))?,
            linear_key_head_dim,
            linear_value_head_dim,
            linear_num_key_heads: uint("linear_num_key_heads", Some(16))?,
            linear_num_value_heads: uint("linear_num_value_heads", Some(32))?,
            moe_intermediate_size: uint("moe_intermediate_size", Some(512))?,
            shared_expert_intermediate_size: uint("shared_expert_intermediate_size", Some(512))?,
            num_experts_per_tok: uint("num_experts_per_tok", Some(10))?,
            num_experts: uint("num_experts", Some(512))?,
            recurrent,
            full_attention_interval: interval,
            hc_count: uint("hc_count", Some(4))?,
            hc_lowrank: uint("hc_lowrank", Some(320))?,
            ple_layer_ids: uint_list("ple_layer_ids")?.unwrap_or_default(),
            ple_embed_dim: uint("ple_embed_dim", Some(hidden_size))?,
            ple_conv_kernel_size: uint("ple_conv_kernel_size", Some(4))?,
            ngram_size: uint("ngram_size", Some(3))?,
            heads_per_ngram: uint("heads_per_ngram", Some(8))?,
            indexer_n_heads: uint("indexer_n_heads", None)?,
            indexer_head_dim: uint("indexer_head_dim", None)?,
            indexer_budget: uint("indexer_budget", None)?,
            indexer_compress_ratio: uint("indexer_compress_ratio", None)?,
            eos_token_id,
            image_token_id: get(&root, "image_token_id").and_then(Value::as_u64).unwrap_or(248_056) as u32,
            output_gate_type,
        };
        if cfg.linear_num_key_heads == 0 || cfg.linear_num_value_heads % cfg.linear_num_key_heads != 0 {
            return Err(ConvertError::Config(format!(
                "{} linear value heads are not a multiple of {} key heads",
                cfg.linear_num_value_heads, cfg.linear_num_key_heads
            )));
        }
        Ok(cfg)
    }

    /// Rotated dims per attention head (`head_dim * partial_rotary_factor`).
    pub fn rope_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }
}
