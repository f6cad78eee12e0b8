//! The embedded demo model end to end through the engine (no HTTP): chat template, tokenizer, the Q8_0 GGUF
//! forward pass, greedy sampling, stop tokens and detokenization must reproduce what transformers generated
//! from the f32 checkpoint when the demo model was made (`tests/fixtures/demo/reference_greedy.json`, written
//! by `scripts/make_demo_model.py`).

use nebula_engine::text::chat_template::RenderRequest;
use nebula_engine::worker::{Engine, EngineOptions, FinishReason, GenerateRequest, GenerationEvent};

fn demo_engine() -> Engine {
    Engine::load(&nebula_tests::repo_root().join("models/nebula-demo.gguf"), EngineOptions::default())
        .expect("the demo model loads")
}

#[test]
fn greedy_answers_equal_the_reference() {
    let engine = demo_engine();
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(nebula_tests::repo_root().join("tests/fixtures/demo/reference_greedy.json")).unwrap(),
    )
    .unwrap();
    let template = engine.chat_template().expect("the demo model carries a chat template");
    for case in fixture["cases"].as_array().unwrap() {
        let user = case["user"].as_str().unwrap();
        let messages = serde_json::json!([{"role": "user", "content": user}]);
        let mut req = RenderRequest::new(&messages);
        req.add_generation_prompt = true;
        let prompt = template.render(&req).expect("renders");
        let ids = engine.tokenizer().encode(&prompt).expect("encodes");
        let want_ids: Vec<u32> =
            case["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(ids, want_ids, "{user}: prompt ids differ from transformers' apply_chat_template");

        let mut rx = engine.submit(GenerateRequest::new(ids, 80)).expect("submits");
        let mut out = Vec::new();
        let finish = loop {
            match rx.blocking_recv().expect("the worker reports an end") {
                GenerationEvent::Started { .. } | GenerationEvent::Prefilled { .. } => {}
                GenerationEvent::Token { id, .. } => out.push(id),
                GenerationEvent::Finished { reason, usage } => {
                    assert_eq!(usage.completion_tokens, out.len());
                    break reason;
                }
                GenerationEvent::Failed(e) => panic!("{user}: generation failed: {e}"),
            }
        };
        let text = engine.tokenizer().decode(&out, false).unwrap();
        let want = case["completion"].as_str().unwrap();
        assert_eq!(finish, FinishReason::Stop, "{user}: expected <|im_end|>, got {text:?}");
        assert_eq!(format!("{text}<|im_end|>"), want, "{user}");
    }
}

/// The tool-call and JSON prompts of the fixture (`tool_cases`, from the training set in
/// `scripts/data/demo_tools.json`, with tools and thinking as given) give transformers' greedy answers, and those
/// answers show the features: each prompt that offers tools answers with the call the training data names, in the
/// template's format (`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n…</tool_call>`);
/// the follow-up after the tool's output is text; a JSON request is answered with a closed JSON object.
#[test]
fn tool_and_json_answers_equal_the_reference() {
    let engine = demo_engine();
    let root = nebula_tests::repo_root();
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("tests/fixtures/demo/reference_greedy.json")).unwrap())
            .unwrap();
    let data: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("scripts/data/demo_tools.json")).unwrap()).unwrap();
    let template = engine.chat_template().expect("the demo model carries a chat template");
    let cases = fixture["tool_cases"].as_array().expect("tool_cases");
    let (mut calls, mut json_answers) = (0, 0);
    for case in cases {
        let messages = &case["messages"];
        let last = messages.as_array().unwrap().last().unwrap();
        let mut req = RenderRequest::new(messages);
        req.tools = case["tools"].is_array().then_some(&case["tools"]);
        req.add_generation_prompt = true;
        req.enable_thinking = case["enable_thinking"].as_bool();
        let prompt = template.render(&req).expect("renders");
        let ids = engine.tokenizer().encode(&prompt).expect("encodes");
        let want_ids: Vec<u32> =
            case["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let what = last["content"].as_str().unwrap();
        assert_eq!(ids, want_ids, "{what}: prompt ids differ from transformers' apply_chat_template");
        let (out, finish, _) = nebula_tests::run_request(&engine, GenerateRequest::new(ids, 120));
        let text = engine.tokenizer().decode(&out, false).unwrap();
        assert_eq!(finish, FinishReason::Stop, "{what}: expected <|im_end|>, got {text:?}");
        assert_eq!(format!("{text}<|im_end|>"), case["completion"].as_str().unwrap(), "{what}");
        let answer = text.rsplit_once("</think>\n\n").map_or(text.as_str(), |(_, a)| a);
        if req.tools.is_some() && last["role"] == "user" {
            let call = data["calls"].as_array().unwrap().iter().find(|c| c["q"] == last["content"]).unwrap();
            let mut want = format!("<tool_call>\n<function={}>\n", call["call"]["name"].as_str().unwrap());
            for (k, v) in call["call"]["arguments"].as_object().unwrap() {
                let v = v.as_str().map_or_else(|| v.to_string(), str::to_string);
                want += &format!("<parameter={k}>\n{v}\n</parameter>\n");
            }
            assert_eq!(answer, format!("{want}</function>\n</tool_call>"), "{what}");
            calls += 1;
        } else if req.tools.is_some() {
            assert!(!answer.contains("<tool_call>") && !answer.is_empty(), "{what}: {answer:?}");
        } else {
            let value: serde_json::Value =
                serde_json::from_str(answer).unwrap_or_else(|e| panic!("{what}: {e}: {answer}"));
            assert!(value.is_object(), "{what}: {answer}");
            json_answers += 1;
        }
    }
    assert_eq!((calls, json_answers), (2, 2), "the fixture's cases");
}

#[test]
fn prompt_over_the_context_is_refused_not_truncated() {
    let engine = Engine::load(
        &nebula_tests::repo_root().join("models/nebula-demo.gguf"),
        EngineOptions { max_context: Some(16), ..Default::default() },
    )
    .unwrap();
    let err = engine.submit(GenerateRequest::new(vec![1; 17], 4)).unwrap_err();
    assert_eq!(err.to_string(), "the prompt has 17 tokens, more than this server's context limit of 16 tokens");
}

#[test]
fn dropping_the_receiver_frees_the_worker() {
    let engine = demo_engine();
    let rx = engine.submit(GenerateRequest::new(vec![248045, 846, 198], 100_000)).unwrap();
    drop(rx);
    // The next request runs to completion, so the first one released the worker.
    let mut rx = engine.submit(GenerateRequest::new(vec![248045, 846, 198], 3)).unwrap();
    let mut finished = false;
    while let Some(ev) = rx.blocking_recv() {
        if let GenerationEvent::Finished { .. } = ev {
            finished = true;
            break;
        }
    }
    assert!(finished);
}

/// The greedy answers of the committed model (their text equals transformers' answers on the f32 checkpoint,
/// `greedy_answers_equal_the_reference`), as `(prompt ids, completion ids)`.
fn reference_sequences(engine: &Engine) -> Vec<(Vec<u32>, Vec<u32>)> {
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(nebula_tests::repo_root().join("tests/fixtures/demo/reference_greedy.json")).unwrap(),
    )
    .unwrap();
    fixture["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|case| {
            let prompt: Vec<u32> =
                case["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
            let mut rx = engine.submit(GenerateRequest::new(prompt.clone(), 80)).unwrap();
            let mut out = Vec::new();
            while let Some(ev) = rx.blocking_recv() {
                match ev {
                    GenerationEvent::Token { id, .. } => out.push(id),
                    GenerationEvent::Finished { .. } => break,
                    GenerationEvent::Failed(e) => panic!("{e}"),
                    _ => {}
                }
            }
            (prompt, out)
        })
        .collect()
}

/// The demo model requantized with each recipe (`nebula convert --recipe R nebula-demo.gguf`): top-1 agreement,
/// teacher-forced along the reference answers, >= 95 % for the 4-bit mixes and >= 99 % for Q8_0. The demo is
/// 32 wide, so the 256-value k-quant blocks fall back to their 32-value types (Q4_K to Q5_0 and so on) and
/// IQ4_NL is used as such; the first quantization (Q8_0) stays under the second.
#[test]
fn requantized_demo_model_agrees_on_top1() {
    use nebula_engine::convert::{QuantRecipe, RecipeName, requantize};
    use nebula_engine::model::{LogitsFor, Qwen4Exp};
    let src = nebula_tests::repo_root().join("models/nebula-demo.gguf");
    let refs = reference_sequences(&demo_engine());
    let tmp = tempfile::tempdir().unwrap();
    for (recipe, bar) in
        [(RecipeName::NebulaQ4, 0.95), (RecipeName::UdQ4KXl, 0.95), (RecipeName::Iq4Xs, 0.95), (RecipeName::Q8_0, 0.99)]
    {
        let out = tmp.path().join(format!("demo-{}.gguf", recipe.name()));
        requantize(&src, &out, &QuantRecipe::Named(recipe)).expect("requantize");
        let model = Qwen4Exp::load(&out).expect("load");
        let vocab = model.config.vocab;
        let (mut same, mut total) = (0usize, 0usize);
        for (prompt, completion) in &refs {
            let ids: Vec<u32> = prompt.iter().chain(completion).copied().collect();
            let mut state = model.new_state(ids.len());
            let logits = model.forward(&mut state, &ids[..ids.len() - 1], LogitsFor::All).unwrap();
            for (k, &want) in completion.iter().enumerate() {
                let row = &logits[(prompt.len() - 1 + k) * vocab..(prompt.len() + k) * vocab];
                let top = row
                    .iter()
                    .enumerate()
                    .fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b })
                    .0;
                same += (top as u32 == want) as usize;
                total += 1;
            }
        }
        let agreement = same as f64 / total as f64;
        println!("demo {}: top-1 agreement {:.2} % ({same} of {total})", recipe.name(), 100.0 * agreement);
        assert!(agreement >= bar, "demo {}: {agreement:.4} < {bar}", recipe.name());
    }
}

/// The prefix cache on the CPU: exact repeat, follow-up turn, shared system prompt and a mid-prompt edit resume
/// from the nearest checkpoint, prefill only the rest and answer as a cold run does
/// ([`nebula_tests::check_prefix_cache`]).
#[test]
fn prefix_cache_resumes_exactly() {
    let engine = demo_engine();
    let cached = nebula_tests::check_prefix_cache(&engine);
    println!("cached tokens per warm request: {cached:?}");
    assert!(engine.stats().prefix_hits.load(std::sync::atomic::Ordering::Relaxed) > 0);
}

/// The on-disk prompt cache on the CPU: a restart resumes an exact repeat from disk and answers as a cold run
/// ([`nebula_tests::check_disk_cache_restart`]).
#[test]
fn disk_cache_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    nebula_tests::check_disk_cache_restart(EngineOptions::default(), dir.path());
}

/// Log-probabilities come with each token when asked for, the chosen (greedy) token first among the top ones.
#[test]
fn logprobs_come_with_tokens() {
    let engine = demo_engine();
    let mut req = GenerateRequest::new(vec![248045, 846, 198], 5);
    req.logprobs = Some(3);
    let mut rx = engine.submit(req).unwrap();
    let mut seen = 0;
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            GenerationEvent::Token { id, logprobs } => {
                let lp = logprobs.expect("logprobs asked for");
                assert!(lp.logprob <= 0.0);
                assert_eq!(lp.top.len(), 3);
                // Greedy: the chosen token is the most likely one.
                assert_eq!(lp.top[0].0, id);
                seen += 1;
            }
            GenerationEvent::Finished { .. } => break,
            _ => {}
        }
    }
    assert_eq!(seen, 5);
}

/// The demo model with tiny tiers (1 GPU, 3 RAM, 29 of 32 experts per layer on SSD, the n-gram table on SSD)
/// answers every reference prompt with the same tokens as the memory-mapped engine; an injected read error
/// fails only the request that hit it, and the worker serves the next one.
#[test]
fn placed_engine_answers_the_same_and_survives_read_errors() {
    use std::sync::Arc;

    use nebula_engine::gguf::GgufFile;
    use nebula_engine::placement::{FaultyReader, MemoryReader, PlacementOptions, TablePlacement};

    let path = nebula_tests::repo_root().join("models/nebula-demo.gguf");
    let reference = reference_sequences(&demo_engine());
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let faulty = Arc::new(FaultyReader::new(Arc::new(MemoryReader::new(file))));
    let placement = PlacementOptions {
        gpu_experts: 1,
        ram_experts: 3,
        ngram_table: TablePlacement::Ssd,
        ssd_pool_bytes: Some(1),
        reader: Some(faulty.clone()),
        ..Default::default()
    };
    let engine = Engine::load(&path, EngineOptions { placement: Some(placement), ..Default::default() }).unwrap();
    assert_eq!(engine.placement().totals(), (4, 8, 116));
    assert_eq!(reference_sequences(&engine), reference, "placement changed a greedy answer");
    let hits = engine.placement_stats().snapshot();
    assert!(hits.expert_hits_ssd > 0 && hits.expert_hits_gpu > 0 && hits.expert_hits_ram > 0, "{hits:?}");

    faulty.fail_next(1);
    let prompt = reference[0].0.clone();
    let mut rx =
        engine.submit(GenerateRequest { use_prefix_cache: false, ..GenerateRequest::new(prompt.clone(), 4) }).unwrap();
    let failure = loop {
        match rx.blocking_recv().expect("the worker reports an end") {
            GenerationEvent::Failed(e) => break e.to_string(),
            GenerationEvent::Finished { .. } => panic!("the injected read error did not fail the request"),
            _ => {}
        }
    };
    assert!(failure.contains("os error 5") && failure.contains("nebula-demo.gguf"), "{failure}");
    let mut rx = engine.submit(GenerateRequest::new(prompt, 80)).unwrap();
    let mut out = Vec::new();
    while let Some(ev) = rx.blocking_recv() {
        match ev {
            GenerationEvent::Token { id, .. } => out.push(id),
            GenerationEvent::Finished { .. } => break,
            GenerationEvent::Failed(e) => panic!("the engine did not recover: {e}"),
            _ => {}
        }
    }
    assert_eq!(out, reference[0].1, "the request after the failure answers as usual");
}
