//! The low-bit recipes' type choices against llama.cpp's own.
//!
//! `tests/fixtures/recipes/release-shape.llama-quantize.json` holds the type `llama-quantize --dry-run` picks for
//! every weight of a qwen4exp file at the release's widths and depth (48 blocks + MTP, 512 experts), for the
//! Q2_K, Q3_K_S, Q3_K_M, IQ3_XXS, IQ2_XS, IQ1_M and IQ4_XS mixes, with an importance matrix and (where the answer
//! differs) without one; written by `scripts/gen_recipe_fixture.py` from llama.cpp's binary. Every type
//! `nebula convert --recipe` and `nebula synth --recipe` choose must be that one.

use std::collections::BTreeMap;

use nebula_engine::convert::{QuantRecipe, RecipeContext, RecipeName};
use nebula_engine::gguf::GgmlType;
use nebula_engine::synth::{SynthOptions, SynthRecipe, planned_tensors};

struct Fixture {
    dims: BTreeMap<String, Vec<u64>>,
    /// mix -> (with imatrix, without where different).
    types: BTreeMap<String, (BTreeMap<String, GgmlType>, BTreeMap<String, GgmlType>)>,
}

fn ggml_type(name: &str) -> GgmlType {
    GgmlType::ALL.iter().copied().find(|t| t.name().eq_ignore_ascii_case(name)).unwrap_or_else(|| panic!("{name}"))
}

fn fixture() -> Fixture {
    let path = nebula_tests::repo_root().join("tests/fixtures/recipes/release-shape.llama-quantize.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let dims = v["dims"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, d)| (k.clone(), d.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()))
        .collect();
    let map = |o: &serde_json::Value| -> BTreeMap<String, GgmlType> {
        o.as_object().unwrap().iter().map(|(k, t)| (k.clone(), ggml_type(t.as_str().unwrap()))).collect()
    };
    let types = v["types"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(mix, t)| (mix.clone(), (map(&t["imatrix"]), map(&t["no_imatrix_where_different"]))))
        .collect();
    Fixture { dims, types }
}

fn recipe_of(mix: &str) -> RecipeName {
    mix.to_ascii_lowercase().parse().unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn every_mix_picks_llama_quantizes_types_with_and_without_an_imatrix() {
    let f = fixture();
    assert_eq!(f.types.len(), 7);
    let mut wrong = Vec::new();
    let mut checked = 0;
    for (mix, (with_m, without)) in &f.types {
        let r = QuantRecipe::Named(recipe_of(mix));
        for has_imatrix in [true, false] {
            let ctx = RecipeContext { n_layers: 48, mtp: true, has_imatrix };
            for (name, want) in with_m {
                let want = if has_imatrix { *want } else { *without.get(name).unwrap_or(want) };
                let got = r.tensor_type(name, &f.dims[name], &ctx);
                checked += 1;
                if got != want {
                    wrong.push(format!(
                        "{mix} imatrix={has_imatrix} {name}: {} (llama.cpp {})",
                        got.name(),
                        want.name()
                    ));
                }
            }
        }
    }
    assert!(checked > 7 * 2 * 800, "{checked}");
    assert!(wrong.is_empty(), "{} of {checked} differ:\n{}", wrong.len(), wrong.join("\n"));
}

#[test]
fn the_fixture_exercises_the_layer_rules() {
    // Not a check of our code: the fixture must hold the cases the recipes' layer rules are about, or the test
    // above would pass on a recipe that ignores them.
    let f = fixture();
    let t = |mix: &str, name: &str| f.types[mix].0[name];
    assert_eq!(t("Q3_K_M", "blk.0.attn_qkv.weight"), GgmlType::Q5_K);
    assert_eq!(t("Q3_K_M", "blk.2.attn_qkv.weight"), GgmlType::Q4_K);
    assert_eq!(t("IQ2_XS", "blk.1.hc_ffn_down.weight"), GgmlType::Q2_K);
    assert_eq!(t("IQ2_XS", "blk.2.hc_ffn_down.weight"), GgmlType::IQ2_XS);
    assert!(!f.types["IQ3_XXS"].1.is_empty(), "IQ3_XXS chooses differently without an importance matrix");
}

#[test]
fn synth_at_full_depth_writes_the_release_tensors_in_llama_quantizes_types() {
    let f = fixture();
    for mix in ["Q2_K", "Q3_K_M", "IQ2_XS", "IQ1_M", "IQ3_XXS"] {
        let opts = SynthOptions { layers: 48, recipe: SynthRecipe::Named(recipe_of(mix)), ..Default::default() };
        let planned: BTreeMap<String, (Vec<u64>, GgmlType)> =
            planned_tensors(&opts).into_iter().map(|(n, d, t)| (n, (d, t))).collect();
        for (name, want) in &f.types[mix].0 {
            let (dims, ty) = planned.get(name).unwrap_or_else(|| panic!("synth has no {name}"));
            if name != "per_layer_token_embd.weight" {
                assert_eq!(dims, &f.dims[name], "{name}");
            }
            assert_eq!(ty, want, "{mix} {name}");
        }
        // The weights synth writes beyond the fixture's are vectors, norms, routers and convolutions (F32).
        for (name, (_, ty)) in &planned {
            assert!(f.types[mix].0.contains_key(name) || *ty == GgmlType::F32, "{name} {}", ty.name());
        }
    }
}

#[test]
fn the_i_quant_mixes_need_an_importance_matrix_to_convert() {
    for (r, needs) in [
        (RecipeName::Iq2Xs, true),
        (RecipeName::Iq1M, true),
        (RecipeName::Iq3Xxs, true),
        (RecipeName::Q2K, false),
        (RecipeName::Q3KM, false),
        (RecipeName::UdQ2KXl, false),
    ] {
        assert_eq!(r.requires_imatrix(), needs, "{}", r.name());
    }
}
