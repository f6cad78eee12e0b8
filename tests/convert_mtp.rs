//! `nebula convert` on a checkpoint that carries an MTP block (`mtp.*`, ignored by transformers, so the golden
//! checkpoints have none): the block is written as `blk.{n_layer}.nextn.*` plus a trunk-style attention block,
//! with llama.cpp's `qwen4exp` transforms (eh_proj = [fc_embedding | fc_hidden] along the
//! input axis, norms stored as 1 + w, the MTP mixer as `nextn.hc_head_*`, fused experts split gate-first), and
//! the trunk still loads unchanged.

use std::collections::HashMap;

use nebula_engine::convert::{ConvertOptions, OutType, convert};
use nebula_engine::gguf::GgufFile;
use nebula_engine::model::Qwen4Exp;
use safetensors::{Dtype, tensor::TensorView};

/// Deterministic pseudo-random values.
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

#[test]
fn mtp_block_is_written_as_nextn_with_the_format_transforms() {
    let golden = nebula_tests::repo_root().join("tests/fixtures/golden/ple_eos");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(golden.join("config.json")).unwrap()).unwrap();
    let u = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let (d, s, r) = (u("hidden_size"), u("hc_count"), u("hc_lowrank"));
    let (nh, nkv, hd) = (u("num_attention_heads"), u("num_key_value_heads"), u("head_dim"));
    let (nih, ihd) = (u("indexer_n_heads"), u("indexer_head_dim"));
    let (e, ff, sff) = (u("num_experts"), u("moe_intermediate_size"), u("shared_expert_intermediate_size"));
    let n_layer = u("num_hidden_layers");
    let dd = s * d;

    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("mtp.fc_embedding.weight".into(), vec![d, d]),
        ("mtp.fc_hidden.weight".into(), vec![d, d]),
        ("mtp.pre_fc_norm_embedding.weight".into(), vec![d]),
        ("mtp.pre_fc_norm_hidden.weight".into(), vec![dd]),
        ("mtp.hyper_connection_mixer.hc_norm.weight".into(), vec![dd]),
        ("mtp.hyper_connection_mixer.input_mix_weight_down.weight".into(), vec![r, dd]),
        ("mtp.hyper_connection_mixer.input_mix_weight_up.weight".into(), vec![dd, r]),
    ];
    for hc in ["attn_hyper_connection", "mlp_hyper_connection"] {
        shapes.push((format!("mtp.layers.0.{hc}.hc_norm.weight"), vec![dd]));
        shapes.push((format!("mtp.layers.0.{hc}.input_mix_weight_down.weight"), vec![r, dd]));
        shapes.push((format!("mtp.layers.0.{hc}.input_mix_weight_up.weight"), vec![dd, r]));
        shapes.push((format!("mtp.layers.0.{hc}.block_inject_weight.weight"), vec![s, dd]));
    }
    let sa = "mtp.layers.0.self_attn";
    shapes.extend([
        (format!("{sa}.q_proj.weight"), vec![nh * hd * 2, d]),
        (format!("{sa}.k_proj.weight"), vec![nkv * hd, d]),
        (format!("{sa}.v_proj.weight"), vec![nkv * hd, d]),
        (format!("{sa}.o_proj.weight"), vec![d, nh * hd]),
        (format!("{sa}.q_norm.weight"), vec![hd]),
        (format!("{sa}.k_norm.weight"), vec![hd]),
        (format!("{sa}.indexer.index_qk_proj.weight"), vec![(nih + 1) * ihd, d]),
        (format!("{sa}.indexer.q_layernorm.weight"), vec![ihd]),
        (format!("{sa}.indexer.k_layernorm.weight"), vec![ihd]),
        ("mtp.layers.0.mlp.gate.weight".into(), vec![e, d]),
        ("mtp.layers.0.mlp.experts.gate_up_proj".into(), vec![e, 2 * ff, d]),
        ("mtp.layers.0.mlp.experts.down_proj".into(), vec![e, d, ff]),
        ("mtp.layers.0.mlp.shared_expert.gate_proj.weight".into(), vec![sff, d]),
        ("mtp.layers.0.mlp.shared_expert.up_proj.weight".into(), vec![sff, d]),
        ("mtp.layers.0.mlp.shared_expert.down_proj.weight".into(), vec![d, sff]),
        ("mtp.layers.0.mlp.shared_expert_gate.weight".into(), vec![1, d]),
    ]);
    let data: HashMap<String, Vec<f32>> =
        shapes.iter().enumerate().map(|(i, (n, sh))| (n.clone(), values(i as u64 + 1, sh.iter().product()))).collect();
    let bytes: HashMap<String, Vec<u8>> =
        data.iter().map(|(n, v)| (n.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect())).collect();
    let views: Vec<(String, TensorView)> =
        shapes.iter().map(|(n, sh)| (n.clone(), TensorView::new(Dtype::F32, sh.clone(), &bytes[n]).unwrap())).collect();

    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    std::fs::create_dir(&ckpt).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(golden.join(f), ckpt.join(f)).unwrap();
    }
    safetensors::serialize_to_file(views, None, &ckpt.join("mtp.safetensors")).unwrap();
    let out = tmp.path().join("mtp.gguf");
    let report = convert(&ckpt, &out, &ConvertOptions { out_type: OutType::F32, ..Default::default() }).unwrap();
    assert!(report.mtp);

    let f = GgufFile::open(&out).unwrap();
    assert_eq!(f.get_u32("qwen4exp.block_count").unwrap() as usize, n_layer + 1);
    assert_eq!(f.get_u32("qwen4exp.nextn_predict_layers").unwrap(), 1);
    assert_eq!(f.get_i32_array("qwen4exp.attention.compress_ratios").unwrap().last(), Some(&0));
    let read = |name: &str| -> (Vec<u64>, Vec<f32>) {
        let t = f.tensor(name).unwrap_or_else(|| panic!("{name} missing"));
        let v = f.tensor_data(t).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        (t.dims.clone(), v)
    };
    let b = n_layer;
    let (dims, eh) = read(&format!("blk.{b}.nextn.eh_proj.weight"));
    assert_eq!(dims, vec![2 * d as u64, d as u64]);
    let (fe, fh) = (&data["mtp.fc_embedding.weight"], &data["mtp.fc_hidden.weight"]);
    for row in 0..d {
        assert_eq!(&eh[row * 2 * d..row * 2 * d + d], &fe[row * d..(row + 1) * d], "embedding columns first");
        assert_eq!(&eh[row * 2 * d + d..(row + 1) * 2 * d], &fh[row * d..(row + 1) * d]);
    }
    for (gg, hf) in [
        ("nextn.enorm", "mtp.pre_fc_norm_embedding.weight"),
        ("nextn.hnorm", "mtp.pre_fc_norm_hidden.weight"),
        ("nextn.hc_head_norm", "mtp.hyper_connection_mixer.hc_norm.weight"),
        ("hc_attn_norm", "mtp.layers.0.attn_hyper_connection.hc_norm.weight"),
        ("attn_q_norm", "mtp.layers.0.self_attn.q_norm.weight"),
        ("indexer.k_norm", "mtp.layers.0.self_attn.indexer.k_layernorm.weight"),
    ] {
        let (_, v) = read(&format!("blk.{b}.{gg}.weight"));
        let want: Vec<f32> = data[hf].iter().map(|x| x + 1.0).collect();
        assert_eq!(v, want, "{gg} is 1 + w");
    }
    let (dims, down) = read(&format!("blk.{b}.nextn.hc_head_down.weight"));
    assert_eq!(dims, vec![dd as u64, r as u64]);
    assert_eq!(down, data["mtp.hyper_connection_mixer.input_mix_weight_down.weight"]);
    let (dims, gate) = read(&format!("blk.{b}.ffn_gate_exps.weight"));
    assert_eq!(dims, vec![d as u64, ff as u64, e as u64]);
    let gu = &data["mtp.layers.0.mlp.experts.gate_up_proj"];
    assert_eq!(&gate[..ff * d], &gu[..ff * d], "expert 0 gate = the first ff rows of gate_up_proj");
    let (_, up) = read(&format!("blk.{b}.ffn_up_exps.weight"));
    assert_eq!(&up[..ff * d], &gu[ff * d..2 * ff * d]);
    let (_, iq) = read(&format!("blk.{b}.indexer.k_proj.weight"));
    assert_eq!(iq, data["mtp.layers.0.self_attn.indexer.index_qk_proj.weight"][nih * ihd * d..].to_vec());

    // The trunk loads as before: the MTP block is not a trunk layer.
    let model = Qwen4Exp::load(&out).unwrap();
    assert_eq!(model.config.n_layer, n_layer);
    assert_eq!(model.config.n_nextn, 1);
}
