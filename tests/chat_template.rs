//! The chat template renderer against transformers' own renderer.
//!
//! Truth: `tests/fixtures/chat_template/cases.json`, written by `scripts/make_template_fixtures.py` with
//! transformers' `render_jinja_template` (jinja2) on the same template files. Each case must render to the same
//! bytes, or fail with the same `raise_exception` message.

use nebula_engine::text::chat_template::{ChatTemplate, RenderRequest, TemplateError};
use nebula_tests::repo_root;
use serde_json::Value;

fn fixture() -> Value {
    let path = repo_root().join("tests/fixtures/chat_template/cases.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).expect("cases.json is JSON")
}

fn request(case: &Value) -> RenderRequest<'_> {
    let req = &case["request"];
    RenderRequest {
        messages: &req["messages"],
        tools: Some(&req["tools"]).filter(|t| !t.is_null()),
        add_generation_prompt: req["add_generation_prompt"].as_bool().expect("add_generation_prompt"),
        enable_thinking: req["enable_thinking"].as_bool(),
        reasoning_effort: req["reasoning_effort"].as_str(),
        extra: req["extra"].as_object().cloned().unwrap_or_default(),
    }
}

#[test]
fn fixture_templates_are_the_files_in_the_repository() {
    let fixture = fixture();
    for (name, template) in fixture["templates"].as_object().expect("templates") {
        let path = repo_root().join(template["path"].as_str().expect("path"));
        let on_disk = std::fs::read_to_string(&path).expect("template file");
        assert_eq!(
            on_disk,
            template["text"].as_str().expect("text"),
            "template {name} ({}) changed: rerun scripts/make_template_fixtures.py",
            path.display()
        );
    }
}

#[test]
fn renders_like_transformers() {
    let fixture = fixture();
    let templates: Vec<(String, ChatTemplate)> = fixture["templates"]
        .as_object()
        .expect("templates")
        .iter()
        .map(|(name, t)| (name.clone(), ChatTemplate::new(t["text"].as_str().expect("text")).expect("compiles")))
        .collect();
    let cases = fixture["cases"].as_array().expect("cases");
    assert!(cases.len() >= 15, "only {} cases", cases.len());
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let template_name = case["template"].as_str().expect("template");
        let (_, template) = templates.iter().find(|(n, _)| n == template_name).expect("known template");
        let got = template.render(&request(case));
        match (&got, case.get("expected"), case.get("error")) {
            (Ok(text), Some(Value::String(want)), None) if text == want => {}
            (Err(TemplateError::Raised { message }), None, Some(Value::String(want))) if message == want => {}
            _ => failures.push(format!(
                "{name}: got {got:?}\n  want {}",
                case.get("expected").or(case.get("error")).map(Value::to_string).unwrap_or_default()
            )),
        }
    }
    assert!(failures.is_empty(), "{} of {} cases differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

#[test]
fn worked_example_matches_the_design_note() {
    // Design note section 2.4: 1,648 bytes ending with the closed think block of enable_thinking=false.
    let fixture = fixture();
    let case = fixture["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .find(|c| c["name"] == "worked_example_2_4")
        .expect("worked example case");
    let source = std::fs::read_to_string(repo_root().join("assets/chat_template.jinja")).expect("template");
    let text = ChatTemplate::new(&source).expect("compiles").render(&request(case)).expect("renders");
    assert_eq!(text.len(), 1648);
    assert!(text.ends_with("<|im_start|>user\nAnd in Lyon?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"));
}

#[test]
fn parser_reads_back_what_the_template_writes() {
    use nebula_engine::text::output::{ParseOptions, parse_output};
    let tools = serde_json::json!([{"type": "function", "function": {"name": "book", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "nights": {"type": "integer"}, "budget": {"type": "number"},
            "smoking": {"type": "boolean"}, "guests": {"type": "array"}, "prefs": {"type": "object"},
            "note": {"type": ["string", "null"]}, "code": {"type": "string"}}}}}]);
    let arguments = serde_json::json!({"city": "Kyōto\nold town", "nights": 2, "budget": 1e-05, "smoking": false,
        "guests": [{"name": "Aiko"}, "Ben", null], "prefs": {"z": 1, "a": [true]}, "note": null, "code": "007"});
    let messages = serde_json::json!([
        {"role": "user", "content": "Book it."},
        {"role": "assistant", "content": "Booking.", "reasoning_content": "Use the tool.\nTwice.",
         "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "book", "arguments": arguments.to_string()}},
            {"id": "b", "type": "function", "function": {"name": "book", "arguments": "{}"}}]}
    ]);
    let source = std::fs::read_to_string(repo_root().join("assets/chat_template.jinja")).expect("template");
    let mut request = RenderRequest::new(&messages);
    request.tools = Some(&tools);
    let text = ChatTemplate::new(&source).expect("compiles").render(&request).expect("renders");
    let prompt_end = text.rfind("<|im_start|>assistant\n<think>\n").expect("assistant turn") + 29;
    let generated = text[prompt_end..].strip_suffix("<|im_end|>\n").expect("turn end");
    let parsed = parse_output(generated, &ParseOptions::for_prompt(&text[..prompt_end]).with_tools(Some(&tools)));
    assert_eq!(parsed.reasoning_content.as_deref(), Some("Use the tool.\nTwice."));
    assert_eq!(parsed.content.as_deref(), Some("Booking."));
    assert_eq!(parsed.tool_calls.len(), 2);
    let first: Value = serde_json::from_str(&parsed.tool_calls[0].function.arguments).expect("JSON");
    assert_eq!(first, arguments);
    assert_eq!(parsed.tool_calls[1].function.arguments, "{}");
}
