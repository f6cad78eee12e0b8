//! Splits generated text into reasoning, answer and tool calls (Qwen3.5/3.6/3.8 output format).
//!
//! The model writes, after a prompt that ends with `<think>\n` (thinking on):
//!
//! ```text
//! {reasoning}\n</think>\n\n{answer}\n\n<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...
//! </function>\n</tool_call>\n<tool_call>...</tool_call>
//! ```
//!
//! and after a prompt that ends with the closed block `<think>\n\n</think>\n\n` (thinking off) only the answer and
//! tool calls. Sources: the Qwen3.8 chat template (it renders exactly this shape for history turns, see
//! `assets/chat_template.jinja` and design note `tokenizer-and-template.md` section 2.3 rules 9, 10, 12) and vLLM's
//! `qwen3_coder` tool parser (one newline stripped at each end of a parameter value, values typed by the tool's
//! JSON schema, `arguments` written as `json.dumps(ensure_ascii=False)`).
//!
//! Rules of this parser:
//! - The parser starts in reasoning when the prompt ended inside a think block ([`prompt_ends_in_reasoning`]).
//!   `</think>` ends the reasoning. In the answer, a `<think>` before any answer text or tool call opens reasoning
//!   (models run without the template's prompt); later ones are text.
//! - `<tool_call>…</tool_call>` becomes a tool call wherever the model writes it, inside reasoning too, but not
//!   where it only quotes it: inside a Markdown fenced code block (```` ``` ```` or `~~~`) or an inline code span
//!   it stays text, in the reasoning and in the answer alike (the rules are in `output/markup.rs`). A block that
//!   does not parse, and (with whole calls) a block still open when the output ends, are returned as answer
//!   text, never dropped.
//! - A parameter value ends at a `</parameter>` followed by the next `<parameter=`, `</function>` or the end of the
//!   call; any other `</parameter>` (or `</tool_call>`) in it is part of the value, which the template writes raw.
//!   A parameter written twice keeps its first value, streamed or not (a stream has sent it already).
//! - Output cut off inside a call ([`OutputParser::finish_truncated`]) leaves the call unclosed, as written; output
//!   that ends inside a call otherwise ([`OutputParser::finish`]) closes it with everything written.
//! - Leading and trailing whitespace of the reasoning and of the answer is dropped (the template strips both when
//!   the turn is sent back); whitespace inside them, including around tool calls, is kept.
//! - Text that may be the start of a tag (`<tool`, `</th`) is held back until the next text decides it.
//!
//! [`OutputParser`] does this incrementally; [`parse_output`] is the same machine over the whole text, so the
//! streamed events always add up to the whole-text result.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::chat_template::python_json;

mod markup;

use markup::{CodeTracker, XmlCall, parse_xml_call};

const THINK_START: &str = "<think>";
const THINK_END: &str = "</think>";
const TOOL_CALL_START: &str = "<tool_call>";
const TOOL_CALL_END: &str = "</tool_call>";
const FUNCTION_START: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER_START: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// Whether a rendered prompt leaves the model inside a think block: its last `<think>` is not closed. True for
/// the Qwen3.8 generation prompt with thinking on (`…<|im_start|>assistant\n<think>\n`), false with thinking off
/// (`…<think>\n\n</think>\n\n`) and for prompts without think tags.
pub fn prompt_ends_in_reasoning(prompt: &str) -> bool {
    match (prompt.rfind(THINK_START), prompt.rfind(THINK_END)) {
        (Some(start), Some(end)) => start > end,
        (Some(_), None) => true,
        _ => false,
    }
}

/// How to read one generation.
#[derive(Debug, Clone)]
pub struct ParseOptions {
    /// The prompt ended inside a think block, so the output starts with reasoning (see
    /// [`prompt_ends_in_reasoning`]).
    pub starts_in_reasoning: bool,
    /// The request's OpenAI tools array (`[{"type": "function", "function": {"name", "parameters"}}]`): parameter
    /// values are typed by each function's JSON schema. `None`: values that parse as JSON (other than strings)
    /// are JSON, the rest strings.
    pub tools: Option<Value>,
    /// Tool call ids are this prefix followed by the call's index in the output (`call_0`, `call_1`, …). Give
    /// each request its own prefix when ids must be unique across a conversation.
    pub call_id_prefix: String,
    /// Stream XML tool calls as they are written: [`OutputEvent::ToolCallStart`] once `<function=NAME>` is
    /// complete, then [`OutputEvent::ToolCallArguments`] fragments, one per completed parameter and a closing
    /// `}`, which concatenate to the arguments [`OutputEvent::ToolCall`] would carry. Off: one whole
    /// [`OutputEvent::ToolCall`] per call.
    pub stream_tool_calls: bool,
}

impl Default for ParseOptions {
    fn default() -> Self {
        Self { starts_in_reasoning: false, tools: None, call_id_prefix: "call_".to_owned(), stream_tool_calls: false }
    }
}

impl ParseOptions {
    /// Options for the output that follows `prompt`: reasoning first when the prompt ends inside `<think>`.
    pub fn for_prompt(prompt: &str) -> Self {
        Self { starts_in_reasoning: prompt_ends_in_reasoning(prompt), ..Self::default() }
    }

    /// The same options with the request's tools (for typing parameter values).
    pub fn with_tools(mut self, tools: Option<&Value>) -> Self {
        self.tools = tools.cloned();
        self
    }
}

/// The function of an OpenAI tool call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments object as a JSON string (`{"city": "Paris"}`).
    pub arguments: String,
}

/// An OpenAI tool call: `{"id", "type": "function", "function": {"name", "arguments"}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

/// One generation split into its parts. Empty parts are `None`, as in OpenAI messages.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParsedOutput {
    pub reasoning_content: Option<String>,
    pub content: Option<String>,
    pub tool_calls: Vec<ToolCall>,
}

impl ParsedOutput {
    /// Sums streamed events into the message they describe.
    pub fn from_events<'a>(events: impl IntoIterator<Item = &'a OutputEvent>) -> Self {
        let mut reasoning = String::new();
        let mut content = String::new();
        let mut tool_calls = Vec::new();
        for event in events {
            match event {
                OutputEvent::Reasoning(text) => reasoning.push_str(text),
                OutputEvent::Content(text) => content.push_str(text),
                OutputEvent::ToolCall { id, name, arguments, .. } => tool_calls.push(ToolCall {
                    id: id.clone(),
                    kind: "function".to_owned(),
                    function: FunctionCall { name: name.clone(), arguments: arguments.clone() },
                }),
                OutputEvent::ToolCallStart { id, name, .. } => tool_calls.push(ToolCall {
                    id: id.clone(),
                    kind: "function".to_owned(),
                    function: FunctionCall { name: name.clone(), arguments: String::new() },
                }),
                OutputEvent::ToolCallArguments { fragment, .. } => {
                    if let Some(call) = tool_calls.last_mut() {
                        call.function.arguments.push_str(fragment);
                    }
                }
            }
        }
        Self {
            reasoning_content: Some(reasoning).filter(|s| !s.is_empty()),
            content: Some(content).filter(|s| !s.is_empty()),
            tool_calls,
        }
    }
}

/// A piece of a streamed generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputEvent {
    /// More reasoning text.
    Reasoning(String),
    /// More answer text.
    Content(String),
    /// A whole tool call, emitted when its `</tool_call>` arrives. `index` counts calls from 0 in this output.
    ToolCall { index: usize, id: String, name: String, arguments: String },
    /// With [`ParseOptions::stream_tool_calls`]: a tool call began (its function name is complete).
    ToolCallStart { index: usize, id: String, name: String },
    /// With [`ParseOptions::stream_tool_calls`]: more of the arguments of call `index`. The fragments of a call
    /// concatenate to its arguments object as JSON text.
    ToolCallArguments { index: usize, fragment: String },
}

/// Parses a whole generation.
pub fn parse_output(text: &str, options: &ParseOptions) -> ParsedOutput {
    let mut parser = OutputParser::new(options);
    let mut events = parser.push(text);
    events.extend(parser.finish());
    ParsedOutput::from_events(&events)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Reasoning,
    Content,
}

/// One output field (reasoning or answer) with its outer whitespace dropped as it streams: leading whitespace is
/// skipped, trailing whitespace is held until more text shows it was inside the field.
#[derive(Debug, Default)]
struct Field {
    started: bool,
    pending_space: String,
}

impl Field {
    fn take(&mut self, text: &str) -> Option<String> {
        let text = if self.started { text } else { text.trim_start() };
        let body = text.trim_end();
        if body.is_empty() {
            if self.started {
                self.pending_space.push_str(text);
            }
            return None;
        }
        self.started = true;
        let mut out = std::mem::take(&mut self.pending_space);
        out.push_str(body);
        self.pending_space = text[body.len()..].to_owned();
        Some(out)
    }
}

/// Incremental parser of one generation: feed decoded text with [`OutputParser::push`], then call
/// [`OutputParser::finish`]. Never panics and never drops text.
#[derive(Debug)]
pub struct OutputParser {
    schemas: Map<String, Value>,
    call_id_prefix: String,
    mode: Mode,
    /// Text not yet classified: a possible partial tag, or the body of an open tool call.
    buffer: String,
    /// Inside `<tool_call>`: where the search for `</tool_call>` resumes in `buffer`.
    tool_call_scan: Option<usize>,
    reasoning: Field,
    content: Field,
    /// A tool call was emitted or a think block closed: a later `<think>` is answer text.
    saw_tool_call: bool,
    think_closed: bool,
    next_index: usize,
    stream_tool_calls: bool,
    /// The tool call being streamed: its index and the arguments sent so far (key, value).
    streaming: Option<(usize, Vec<(String, Value)>)>,
    /// Where Markdown code stands in the text emitted so far in this mode: tool markup inside code is quoted.
    code: CodeTracker,
}

impl OutputParser {
    /// A parser for one generation read with `options`.
    pub fn new(options: &ParseOptions) -> Self {
        Self {
            schemas: tool_schemas(options.tools.as_ref()),
            call_id_prefix: options.call_id_prefix.clone(),
            mode: if options.starts_in_reasoning { Mode::Reasoning } else { Mode::Content },
            buffer: String::new(),
            tool_call_scan: None,
            reasoning: Field::default(),
            content: Field::default(),
            saw_tool_call: false,
            think_closed: false,
            next_index: 0,
            stream_tool_calls: options.stream_tool_calls,
            streaming: None,
            code: CodeTracker::default(),
        }
    }

    /// Feeds the next decoded text; returns what it completes.
    pub fn push(&mut self, delta: &str) -> Vec<OutputEvent> {
        self.buffer.push_str(delta);
        let mut events = Vec::new();
        loop {
            if let Some(scan) = self.tool_call_scan {
                let Some(end) = self.find_call_end(scan) else {
                    if self.stream_tool_calls {
                        self.stream_tool_call_progress(&mut events);
                    }
                    break;
                };
                let block = self.buffer[..end].to_owned();
                self.buffer.drain(..end + TOOL_CALL_END.len());
                self.tool_call_scan = None;
                self.code = CodeTracker::default();
                self.finish_tool_call(&block, &mut events);
                continue;
            }
            let tags = self.active_tags();
            // Tool markup inside Markdown code is quoted text, not a call.
            let quoted = if self.code.in_code() || self.buffer.contains(['`', '~']) {
                self.code.states(&self.buffer)
            } else {
                Vec::new()
            };
            // `<think>` opens reasoning only before any answer text, counted up to the tag itself, so the
            // decision does not depend on where the text was cut.
            let buffer = &self.buffer;
            let valid = |at: usize, tag: &str| match tag {
                THINK_START => buffer[..at].trim().is_empty(),
                TOOL_CALL_START => !quoted.get(at).copied().unwrap_or(false),
                _ => true,
            };
            let earliest = tags
                .iter()
                .filter_map(|tag| buffer.match_indices(tag).map(|(at, _)| (at, *tag)).find(|&(at, tag)| valid(at, tag)))
                .min();
            match earliest {
                Some((at, tag)) => {
                    let text = self.buffer[..at].to_owned();
                    self.buffer.drain(..at + tag.len());
                    self.emit_text(self.mode, &text, &mut events);
                    self.code = CodeTracker::default();
                    match tag {
                        THINK_START => self.mode = Mode::Reasoning,
                        THINK_END => {
                            self.mode = Mode::Content;
                            self.think_closed = true;
                        }
                        _ => self.tool_call_scan = Some(0),
                    }
                }
                None => {
                    let held = partial_tag_len(buffer, &tags, valid);
                    let text: String = self.buffer.drain(..self.buffer.len() - held).collect();
                    self.code.feed(&text);
                    self.emit_text(self.mode, &text, &mut events);
                    break;
                }
            }
        }
        events
    }

    /// The end of the open tool call in the buffer: the first `</tool_call>` from `scan` that is not inside a
    /// parameter value. `None` (and the scan moved on) when none has arrived yet.
    fn find_call_end(&mut self, mut scan: usize) -> Option<usize> {
        while let Some(found) = self.buffer.get(scan..).and_then(|rest| rest.find(TOOL_CALL_END)) {
            let end = scan + found;
            let block = &self.buffer[..end];
            let json = block.trim_start().starts_with('{');
            if json || parse_xml_call(block, true).is_none_or(|call| !call.unclosed) {
                return Some(end);
            }
            // Inside a value: this `</tool_call>` is text, whatever follows.
            scan = end + 1;
        }
        // Resume where a split `</tool_call>` could start next time.
        let keep = self.buffer.len().saturating_sub(TOOL_CALL_END.len() - 1);
        self.tool_call_scan = Some(floor_char_boundary(&self.buffer, keep.max(scan)));
        None
    }

    /// Ends the generation: held text is released as text. A call still open is closed with what was written
    /// (the model ended its turn inside it) when calls stream, and is answer text otherwise.
    pub fn finish(mut self) -> Vec<OutputEvent> {
        let mut events = Vec::new();
        let rest = std::mem::take(&mut self.buffer);
        if self.tool_call_scan.is_some() && self.close_streamed_call(&rest, &mut events) {
        } else if self.tool_call_scan.is_some() {
            self.emit_text(Mode::Content, &format!("{TOOL_CALL_START}{rest}"), &mut events);
        } else {
            self.emit_text(self.mode, &rest, &mut events);
        }
        events
    }

    /// Ends a generation that was cut off (`max_tokens`, the context limit): like [`OutputParser::finish`], but
    /// a tool call still open is reported as far as it was written and never closed. Its arguments are the
    /// complete parameters and the one being written, as JSON text without the closing quote of that value and
    /// without the closing `}`, so they do not parse, as OpenAI's cut-off calls do not. A call whose function name
    /// is not complete yet is answer text.
    pub fn finish_truncated(mut self) -> Vec<OutputEvent> {
        if self.tool_call_scan.is_none() {
            return self.finish();
        }
        let mut events = Vec::new();
        let rest = std::mem::take(&mut self.buffer);
        let call = (!rest.trim_start().starts_with('{')).then(|| parse_xml_call(&rest, false)).flatten();
        let Some(call) = call else {
            self.streaming = None;
            self.emit_text(Mode::Content, &format!("{TOOL_CALL_START}{rest}"), &mut events);
            return events;
        };
        let arguments = self.typed_arguments(&call);
        let (index, sent) = match self.streaming.take() {
            Some((index, sent)) => (index, sent.len()),
            None => {
                let index = self.next_index;
                self.next_index += 1;
                self.saw_tool_call = true;
                let id = format!("{}{index}", self.call_id_prefix);
                events.push(OutputEvent::ToolCallStart { index, id, name: call.name.to_owned() });
                (index, 0)
            }
        };
        let mut fragment = String::new();
        let mut first = sent == 0;
        for (key, value) in arguments.iter().skip(sent) {
            fragment.push_str(&argument_member(key, value, first));
            first = false;
        }
        if let Some((key, raw)) = call.open
            && !arguments.iter().any(|(k, _)| k == key)
        {
            let schema = self.schemas.get(call.name).and_then(|p| p.get(key));
            let mut member = argument_member(key, &typed_value(raw, schema), first);
            if member.ends_with('"') {
                member.pop();
            }
            fragment.push_str(&member);
            first = false;
        }
        if first {
            fragment.push('{');
        }
        if self.stream_tool_calls {
            events.push(OutputEvent::ToolCallArguments { index, fragment });
        } else {
            // Whole calls: the start above becomes one call with the arguments so far.
            events.pop();
            let id = format!("{}{index}", self.call_id_prefix);
            events.push(OutputEvent::ToolCall { index, id, name: call.name.to_owned(), arguments: fragment });
        }
        events
    }

    /// The typed arguments of an XML call, in the order written; a parameter written twice keeps its first value
    /// (the one a stream has already sent).
    fn typed_arguments(&self, call: &XmlCall<'_>) -> Vec<(String, Value)> {
        let properties = self.schemas.get(call.name);
        let mut out: Vec<(String, Value)> = Vec::new();
        for &(key, raw) in &call.params {
            if !out.iter().any(|(k, _)| k == key) {
                out.push((key.to_owned(), typed_value(raw, properties.and_then(|p| p.get(key)))));
            }
        }
        out
    }

    /// Ends the streamed call, if one is open: the members of `block` not sent yet, then `}`. Whatever the
    /// whole block parses to, fragments already sent stay. False when no call was being streamed.
    fn close_streamed_call(&mut self, block: &str, events: &mut Vec<OutputEvent>) -> bool {
        let Some((index, sent)) = self.streaming.take() else { return false };
        let arguments = parse_tool_call(block, &self.schemas).map(|(_, a)| a).unwrap_or_default();
        let mut first = sent.is_empty();
        let mut fragment = String::new();
        for (key, value) in arguments.into_iter().skip(sent.len()) {
            fragment.push_str(&argument_member(&key, &value, first));
            first = false;
        }
        fragment.push_str(if first { "{}" } else { "}" });
        events.push(OutputEvent::ToolCallArguments { index, fragment });
        true
    }

    /// The tags that change state in the current mode.
    fn active_tags(&self) -> Vec<&'static str> {
        match self.mode {
            Mode::Reasoning => vec![THINK_END, TOOL_CALL_START],
            Mode::Content if !self.content.started && !self.saw_tool_call && !self.think_closed => {
                vec![THINK_START, TOOL_CALL_START]
            }
            Mode::Content => vec![TOOL_CALL_START],
        }
    }

    fn emit_text(&mut self, mode: Mode, text: &str, events: &mut Vec<OutputEvent>) {
        if text.is_empty() {
            return;
        }
        match mode {
            Mode::Reasoning => {
                if let Some(out) = self.reasoning.take(text) {
                    events.push(OutputEvent::Reasoning(out));
                }
            }
            Mode::Content => {
                if let Some(out) = self.content.take(text) {
                    events.push(OutputEvent::Content(out));
                }
            }
        }
    }

    /// Streams what the open tool call's text (the buffer) completes: the start once the function name is
    /// known, then each parameter whose end is certain (see [`parse_xml_call`]).
    fn stream_tool_call_progress(&mut self, events: &mut Vec<OutputEvent>) {
        let block = self.buffer.as_str();
        if block.trim_start().starts_with('{') {
            return; // The JSON form is parsed whole at `</tool_call>`.
        }
        let Some(call) = parse_xml_call(block, false) else { return };
        let arguments = self.typed_arguments(&call);
        if self.streaming.is_none() {
            let index = self.next_index;
            self.next_index += 1;
            self.saw_tool_call = true;
            let id = format!("{}{index}", self.call_id_prefix);
            events.push(OutputEvent::ToolCallStart { index, id, name: call.name.to_owned() });
            self.streaming = Some((index, Vec::new()));
        }
        let Some((index, sent)) = self.streaming.as_mut() else { return };
        for (key, value) in arguments.into_iter().skip(sent.len()) {
            let fragment = argument_member(&key, &value, sent.is_empty());
            events.push(OutputEvent::ToolCallArguments { index: *index, fragment });
            sent.push((key, value));
        }
    }

    fn finish_tool_call(&mut self, block: &str, events: &mut Vec<OutputEvent>) {
        if self.stream_tool_calls {
            if self.streaming.is_none() {
                if block.trim_start().starts_with('{') {
                    // The JSON form: parsed whole, sent as a start and one fragment.
                    if let Some((name, arguments)) = parse_tool_call(block, &self.schemas) {
                        let index = self.next_index;
                        self.next_index += 1;
                        self.saw_tool_call = true;
                        let id = format!("{}{index}", self.call_id_prefix);
                        events.push(OutputEvent::ToolCallStart { index, id, name });
                        let fragment = python_json(&Value::Object(arguments));
                        events.push(OutputEvent::ToolCallArguments { index, fragment });
                        return;
                    }
                } else {
                    let saved = std::mem::replace(&mut self.buffer, block.to_owned());
                    self.stream_tool_call_progress(events);
                    self.buffer = saved;
                }
            }
            if self.close_streamed_call(block, events) {
                return;
            }
        }
        match parse_tool_call(block, &self.schemas) {
            Some((name, arguments)) => {
                let index = self.next_index;
                self.next_index += 1;
                self.saw_tool_call = true;
                events.push(OutputEvent::ToolCall {
                    index,
                    id: format!("{}{index}", self.call_id_prefix),
                    name,
                    arguments: python_json(&Value::Object(arguments)),
                });
            }
            None => {
                let raw = format!("{TOOL_CALL_START}{block}{TOOL_CALL_END}");
                self.emit_text(Mode::Content, &raw, events);
            }
        }
    }
}

/// One member of an arguments object as JSON text: `{"key": value` for the first, `, "key": value` after.
fn argument_member(key: &str, value: &Value, first: bool) -> String {
    let mut one = Map::new();
    one.insert(key.to_owned(), value.clone());
    let member = python_json(&Value::Object(one));
    let inner = &member[1..member.len() - 1];
    if first { format!("{{{inner}") } else { format!(", {inner}") }
}

/// The largest char boundary of `s` at or below `at`.
fn floor_char_boundary(s: &str, mut at: usize) -> usize {
    at = at.min(s.len());
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// Length of the longest suffix of `buffer` that is a proper prefix of one of `tags` (all ASCII, starting with
/// `<`, so the cut is a char boundary) and `valid` at the position where it would start.
fn partial_tag_len(buffer: &str, tags: &[&str], valid: impl Fn(usize, &str) -> bool) -> usize {
    tags.iter()
        .flat_map(|tag| {
            (1..tag.len()).rev().filter(|&k| buffer.ends_with(&tag[..k]) && valid(buffer.len() - k, tag)).take(1)
        })
        .max()
        .unwrap_or(0)
}

/// Function name → JSON-schema `properties` of its parameters, from an OpenAI tools array.
fn tool_schemas(tools: Option<&Value>) -> Map<String, Value> {
    let mut schemas = Map::new();
    for tool in tools.and_then(Value::as_array).into_iter().flatten() {
        let function = tool.get("function").unwrap_or(tool);
        let Some(name) = function.get("name").and_then(Value::as_str) else {
            continue;
        };
        let properties = function
            .get("parameters")
            .and_then(|p| p.get("properties"))
            .cloned()
            .unwrap_or_else(|| Value::Object(Map::new()));
        schemas.insert(name.to_owned(), properties);
    }
    schemas
}

/// Parses the inside of `<tool_call>…</tool_call>`: the XML format, or the older JSON `{"name", "arguments"}`.
/// `None` when it is neither.
fn parse_tool_call(block: &str, schemas: &Map<String, Value>) -> Option<(String, Map<String, Value>)> {
    let trimmed = block.trim();
    if trimmed.starts_with('{') {
        let value: Value = serde_json::from_str(trimmed).ok()?;
        let name = value.get("name")?.as_str()?.to_owned();
        let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(map)) => map.clone(),
            Some(Value::String(text)) => match serde_json::from_str(text) {
                Ok(Value::Object(map)) => map,
                _ => return None,
            },
            Some(_) => return None,
        };
        return Some((name, arguments));
    }
    let call = parse_xml_call(block, true)?;
    let properties = schemas.get(call.name);
    let mut arguments = Map::new();
    for (key, raw) in call.params {
        // A parameter written twice keeps its first value, as a stream (which sent it already) does.
        if !arguments.contains_key(key) {
            arguments.insert(key.to_owned(), typed_value(raw, properties.and_then(|p| p.get(key))));
        }
    }
    Some((call.name.to_owned(), arguments))
}

/// The JSON-schema type names of a parameter (`type` as a string or list, or the types of `anyOf`/`oneOf`).
fn schema_types(schema: &Value) -> Vec<String> {
    match schema.get("type") {
        Some(Value::String(t)) => vec![t.clone()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).map(str::to_owned).collect(),
        _ => ["anyOf", "oneOf"]
            .iter()
            .filter_map(|k| schema.get(*k).and_then(Value::as_array))
            .flatten()
            .flat_map(schema_types)
            .collect(),
    }
}

/// A parameter value from its text. With a schema: a `string` stays the text; `integer`, `number`, `boolean`,
/// `object`, `array`, `null` are parsed from the text, and the text is kept when none parses. Without a schema:
/// JSON when the text is a JSON object, array, number, boolean or null, else the text.
fn typed_value(raw: &str, schema: Option<&Value>) -> Value {
    let types = schema.map(schema_types).unwrap_or_default();
    if types.is_empty() {
        return match serde_json::from_str::<Value>(raw) {
            Ok(value) if !value.is_string() => value,
            _ => Value::String(raw.to_owned()),
        };
    }
    let text = raw.trim();
    for kind in &types {
        let parsed = match kind.as_str() {
            "integer" => text.parse::<i64>().map(Value::from).or_else(|_| text.parse::<u64>().map(Value::from)).ok(),
            "number" => serde_json::from_str::<serde_json::Number>(text).ok().map(Value::Number),
            "boolean" => match text {
                "true" | "True" => Some(Value::Bool(true)),
                "false" | "False" => Some(Value::Bool(false)),
                _ => None,
            },
            "object" => serde_json::from_str::<Value>(text).ok().filter(Value::is_object),
            "array" => serde_json::from_str::<Value>(text).ok().filter(Value::is_array),
            "null" => (text == "null" || text == "None").then_some(Value::Null),
            _ => None,
        };
        if let Some(value) = parsed {
            return value;
        }
    }
    Value::String(raw.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather_tools() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
            "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
            "note": {"type": ["string", "null"]}, "zip": {"type": "string"}
        }}}}])
    }

    fn thinking() -> ParseOptions {
        ParseOptions { starts_in_reasoning: true, ..ParseOptions::default() }
    }

    fn arguments(call: &ToolCall) -> Value {
        serde_json::from_str(&call.function.arguments).expect("arguments are JSON")
    }

    #[test]
    fn prompt_state_follows_the_last_think_tag() {
        assert!(prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(!prompt_ends_in_reasoning("<|im_start|>assistant\n"));
        assert!(ParseOptions::for_prompt("x<think>\n").starts_in_reasoning);
    }

    #[test]
    fn reasoning_then_answer() {
        let out = parse_output("Let me think.\nStill thinking.\n</think>\n\nThe answer is 4.", &thinking());
        assert_eq!(out.reasoning_content.as_deref(), Some("Let me think.\nStill thinking."));
        assert_eq!(out.content.as_deref(), Some("The answer is 4."));
        assert!(out.tool_calls.is_empty());
    }

    #[test]
    fn unclosed_reasoning_stays_reasoning() {
        let out = parse_output("I ran out of tokens <tool", &thinking());
        assert_eq!(out.reasoning_content.as_deref(), Some("I ran out of tokens <tool"));
        assert_eq!(out.content, None);
    }

    #[test]
    fn thinking_off_output_is_all_answer() {
        let out = parse_output("\n\nJust the answer </think> literally.\n", &ParseOptions::default());
        assert_eq!(out.reasoning_content, None);
        assert_eq!(out.content.as_deref(), Some("Just the answer </think> literally."));
    }

    #[test]
    fn think_tag_at_the_start_opens_reasoning() {
        let out = parse_output("<think>\nhmm\n</think>\n\nok <think> is text", &ParseOptions::default());
        assert_eq!(out.reasoning_content.as_deref(), Some("hmm"));
        assert_eq!(out.content.as_deref(), Some("ok <think> is text"));
    }

    #[test]
    fn xml_tool_calls_typed_by_schema() {
        let text = "Checking.\n</think>\n\nLet me look.\n\n<tool_call>\n<function=get_weather>\n\
            <parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n\
            <parameter=ratio>\n1e-05\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n\
            <parameter=opts>\n{\"b\": 1, \"a\": [null]}\n</parameter>\n<parameter=tags>\n[\"x\", 2]\n</parameter>\n\
            <parameter=note>\nnull\n</parameter>\n<parameter=zip>\n01234\n</parameter>\n\
            <parameter=extra>\n  two\nlines \n</parameter>\n</function>\n</tool_call>\n<tool_call>\n\
            <function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>";
        let options = ParseOptions { tools: Some(weather_tools()), ..thinking() };
        let out = parse_output(text, &options);
        assert_eq!(out.reasoning_content.as_deref(), Some("Checking."));
        assert_eq!(out.content.as_deref(), Some("Let me look."));
        assert_eq!(out.tool_calls.len(), 2);
        let call = &out.tool_calls[0];
        assert_eq!(
            (call.id.as_str(), call.kind.as_str(), call.function.name.as_str()),
            ("call_0", "function", "get_weather")
        );
        assert_eq!(
            call.function.arguments,
            "{\"city\": \"New York\", \"days\": 3, \"ratio\": 1e-05, \"metric\": true, \"opts\": {\"b\": 1, \"a\": [null]}, \
             \"tags\": [\"x\", 2], \"note\": null, \"zip\": \"01234\", \"extra\": \"  two\\nlines \"}"
        );
        // A value that does not parse as its type stays text.
        assert_eq!(arguments(&out.tool_calls[1]), json!({"days": "three"}));
        assert_eq!(out.tool_calls[1].id, "call_1");
    }

    #[test]
    fn tool_calls_serialize_in_openai_shape() {
        let out = parse_output(
            "<tool_call>\n<function=f>\n<parameter=a>\nx\n</parameter>\n</function>\n</tool_call>",
            &ParseOptions::default(),
        );
        assert_eq!(
            serde_json::to_value(&out).unwrap(),
            json!({"reasoning_content": null, "content": null, "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{\"a\": \"x\"}"}}]})
        );
    }

    #[test]
    fn values_without_tools_are_json_when_they_parse() {
        let text = "<tool_call>\n<function=f>\n<parameter=a>\n42\n</parameter>\n<parameter=b>\n\"q\"\n</parameter>\n\
            <parameter=c>\n[1, {\"x\": true}]\n</parameter>\n<parameter=d>\nhello world\n</parameter>\n\
            <parameter=e>\nnull\n</parameter>\n<parameter=f>\nfalse\n</parameter>\n</function>\n</tool_call>";
        let out = parse_output(text, &ParseOptions::default());
        assert_eq!(out.content, None);
        assert_eq!(
            arguments(&out.tool_calls[0]),
            json!({"a": 42, "b": "\"q\"", "c": [1, {"x": true}], "d": "hello world", "e": null, "f": false})
        );
    }

    #[test]
    fn tool_call_inside_reasoning() {
        let text = "I should search.\n<tool_call>\n<function=search>\n<parameter=q>\nrust\n</parameter>\n</function>\n</tool_call>";
        let out = parse_output(text, &thinking());
        assert_eq!(out.reasoning_content.as_deref(), Some("I should search."));
        assert_eq!(out.content, None);
        assert_eq!(out.tool_calls[0].function.name, "search");
        assert_eq!(arguments(&out.tool_calls[0]), json!({"q": "rust"}));
    }

    #[test]
    fn json_tool_call_body_is_accepted() {
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"z\": 1, \"a\": \"b\"}}\n</tool_call>";
        let out = parse_output(text, &ParseOptions::default());
        assert_eq!(out.tool_calls[0].function.arguments, "{\"z\": 1, \"a\": \"b\"}");
    }

    #[test]
    fn broken_and_unterminated_tool_calls_are_kept_as_text() {
        let out = parse_output("A <tool_call>not a call</tool_call> B", &ParseOptions::default());
        assert_eq!(out.content.as_deref(), Some("A <tool_call>not a call</tool_call> B"));
        assert!(out.tool_calls.is_empty());
        let out = parse_output("Sure.\n<tool_call>\n<function=f>\n<parameter=a>\n1", &thinking());
        assert_eq!(out.reasoning_content.as_deref(), Some("Sure."));
        assert_eq!(out.content.as_deref(), Some("<tool_call>\n<function=f>\n<parameter=a>\n1"));
        assert!(out.tool_calls.is_empty());
    }

    #[test]
    fn partial_tags_are_held_then_released() {
        let mut parser = OutputParser::new(&ParseOptions::default());
        assert_eq!(parser.push("Hello <tool"), vec![OutputEvent::Content("Hello".into())]);
        assert_eq!(parser.push("box> x"), vec![OutputEvent::Content(" <toolbox> x".into())]);
        assert_eq!(parser.push(" <tool_ca"), vec![]);
        assert_eq!(parser.finish(), vec![OutputEvent::Content(" <tool_ca".into())]);
        let mut parser = OutputParser::new(&thinking());
        assert_eq!(parser.push("plan </th"), vec![OutputEvent::Reasoning("plan".into())]);
        assert_eq!(parser.push("ought>"), vec![OutputEvent::Reasoning(" </thought>".into())]);
        assert_eq!(parser.push("</th"), vec![]);
        assert_eq!(parser.push("ink>\n\nDone"), vec![OutputEvent::Content("Done".into())]);
        assert!(parser.finish().is_empty());
    }

    #[test]
    fn tool_call_event_arrives_whole() {
        let mut parser = OutputParser::new(&ParseOptions { call_id_prefix: "req7-".into(), ..thinking() });
        let mut events = parser.push("ok</think>\n\n<tool_call>\n<function=f>\n<parameter=a>\n1\n</param");
        assert_eq!(events, vec![OutputEvent::Reasoning("ok".into())]);
        events = parser.push("eter>\n</function>\n</tool_");
        assert!(events.is_empty());
        events = parser.push("call>");
        assert_eq!(
            events,
            vec![OutputEvent::ToolCall {
                index: 0,
                id: "req7-0".into(),
                name: "f".into(),
                arguments: "{\"a\": 1}".into()
            }]
        );
        assert!(parser.finish().is_empty());
    }

    /// Streamed tool calls: for every split point, each call's fragments concatenate to the arguments of the
    /// whole-text parse, and the start comes once, before them.
    #[test]
    fn streamed_tool_call_fragments_concatenate_to_the_arguments() {
        let text = "plan\n</think>\n\nSure.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>";
        let whole = parse_output(text, &ParseOptions { tools: Some(weather_tools()), ..thinking() });
        assert_eq!(whole.tool_calls.len(), 3);
        let streaming = ParseOptions { tools: Some(weather_tools()), stream_tool_calls: true, ..thinking() };
        for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            let mut parser = OutputParser::new(&streaming);
            let mut events = parser.push(&text[..cut]);
            events.extend(parser.push(&text[cut..]));
            events.extend(parser.finish());
            let streamed = ParsedOutput::from_events(&events);
            assert_eq!(streamed, whole, "cut at {cut}");
            let starts = events.iter().filter(|e| matches!(e, OutputEvent::ToolCallStart { .. })).count();
            assert_eq!(starts, 3);
        }
        // Fed token by token, the first call's parameters arrive one by one.
        let mut parser = OutputParser::new(&streaming);
        let mut fragments = Vec::new();
        for piece in text.split_inclusive('\n') {
            for e in parser.push(piece) {
                if let OutputEvent::ToolCallArguments { index: 0, fragment } = e {
                    fragments.push(fragment);
                }
            }
        }
        assert_eq!(fragments, vec!["{\"city\": \"Paris\"", ", \"days\": 2", ", \"opts\": {\"a\": [1, 2]}", "}"]);
    }

    #[test]
    fn a_call_left_open_is_closed_with_everything_written() {
        let streaming = ParseOptions { stream_tool_calls: true, ..ParseOptions::default() };
        let mut parser = OutputParser::new(&streaming);
        let mut events = parser.push("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nhal");
        events.extend(parser.finish());
        let out = ParsedOutput::from_events(&events);
        assert_eq!(out.tool_calls[0].function.arguments, "{\"a\": 1, \"b\": \"hal\"}");
        assert_eq!(out.content, None);
    }

    /// Cut off by the token limit, a call is never reported complete: its arguments are what was written, open.
    #[test]
    fn a_call_cut_off_stays_open_as_written() {
        let text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nsay \"hal";
        for stream_tool_calls in [false, true] {
            let options = ParseOptions { stream_tool_calls, ..ParseOptions::default() };
            let mut parser = OutputParser::new(&options);
            let mut events = parser.push(text);
            events.extend(parser.finish_truncated());
            let out = ParsedOutput::from_events(&events);
            assert_eq!(out.tool_calls.len(), 1, "{events:?}");
            assert_eq!(out.tool_calls[0].function.name, "f");
            assert_eq!(out.tool_calls[0].function.arguments, "{\"a\": 1, \"b\": \"say \\\"hal");
            assert!(serde_json::from_str::<Value>(&out.tool_calls[0].function.arguments).is_err());
        }
        // Cut before any parameter: an open object, not a made-up `{}`.
        let mut parser = OutputParser::new(&ParseOptions { stream_tool_calls: true, ..ParseOptions::default() });
        let mut events = parser.push("<tool_call>\n<function=f>\n<parameter=a>\n");
        events.extend(parser.finish_truncated());
        assert_eq!(ParsedOutput::from_events(&events).tool_calls[0].function.arguments, "{\"a\": \"");
        // Cut inside the function name: text.
        let mut parser = OutputParser::new(&ParseOptions::default());
        let mut events = parser.push("ok <tool_call>\n<function=ge");
        events.extend(parser.finish_truncated());
        assert_eq!(ParsedOutput::from_events(&events).content.as_deref(), Some("ok <tool_call>\n<function=ge"));
    }

    /// Markup the model only quotes in Markdown code is text, in the answer and in the reasoning, whole or
    /// streamed; the model's own call after the quote is still a call.
    #[test]
    fn quoted_tool_markup_is_text() {
        let call = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>";
        let fenced = format!("Write it like this:\n\n```xml\n{call}\n```\n\nor inline: `{call}`.");
        let text = format!("{fenced}\n\n{call}");
        for starts_in_reasoning in [false, true] {
            for stream_tool_calls in [false, true] {
                let options = ParseOptions { starts_in_reasoning, stream_tool_calls, ..ParseOptions::default() };
                let whole = parse_output(&text, &options);
                assert_eq!(whole.tool_calls.len(), 1, "{whole:?}");
                assert_eq!(whole.tool_calls[0].function.arguments, "{\"a\": 1}");
                let quoted = if starts_in_reasoning { &whole.reasoning_content } else { &whole.content };
                assert_eq!(quoted.as_deref(), Some(fenced.as_str()));
                for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
                    let mut parser = OutputParser::new(&options);
                    let mut events = parser.push(&text[..cut]);
                    events.extend(parser.push(&text[cut..]));
                    events.extend(parser.finish());
                    assert_eq!(ParsedOutput::from_events(&events), whole, "cut at {cut}");
                }
            }
        }
        let tilde = format!("~~~\n{call}\n~~~");
        assert_eq!(parse_output(&tilde, &ParseOptions::default()).content.as_deref(), Some(tilde.as_str()));
    }

    /// A value may contain `</parameter>` (the template writes strings raw): nothing is cut, streamed or not.
    #[test]
    fn literal_closing_tags_stay_in_the_value() {
        let text = "<tool_call>\n<function=write>\n<parameter=body>\nuse </parameter> and </tool_call> here\n</parameter>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>";
        let expected = "{\"body\": \"use </parameter> and </tool_call> here\", \"n\": 2}";
        let whole = parse_output(text, &ParseOptions::default());
        assert_eq!(whole.tool_calls[0].function.arguments, expected);
        assert_eq!(whole.content, None);
        let streaming = ParseOptions { stream_tool_calls: true, ..ParseOptions::default() };
        for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            let mut parser = OutputParser::new(&streaming);
            let mut events = parser.push(&text[..cut]);
            events.extend(parser.push(&text[cut..]));
            events.extend(parser.finish());
            assert_eq!(ParsedOutput::from_events(&events), whole, "cut at {cut}");
        }
    }

    /// A parameter written twice keeps its first value, whole or streamed.
    #[test]
    fn a_repeated_parameter_keeps_its_first_value() {
        let text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nx\n</parameter>\n<parameter=a>\n2\n</parameter>\n</function>\n</tool_call>";
        let whole = parse_output(text, &ParseOptions::default());
        assert_eq!(whole.tool_calls[0].function.arguments, "{\"a\": 1, \"b\": \"x\"}");
        let streaming = ParseOptions { stream_tool_calls: true, ..ParseOptions::default() };
        let mut parser = OutputParser::new(&streaming);
        let mut events = Vec::new();
        for piece in text.split_inclusive('\n') {
            events.extend(parser.push(piece));
        }
        events.extend(parser.finish());
        assert_eq!(ParsedOutput::from_events(&events), whole);
    }

    /// Streaming equals whole-text parsing for every way of cutting the text (property test over split points).
    #[test]
    fn streamed_events_add_up_to_the_whole_parse() {
        let texts = [
            "Reasoning with <b>tags</b> and é🙂.\n</think>\n\nAnswer <tool but not a call.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=tags>\n[1]\n</parameter>\n</function>\n</tool_call>\n",
            "<think>\nplan</think>ans <think>x</think> end",
            "thinking <tool_call>\n<function=f>\n</function>\n</tool_call> more thinking </think> answer <tool_call>bad</tool_call> <tool_call>\n<function=g>\n<parameter=x>\n</tool_call",
            "  \n </think> \n <tool_call><function=a></function></tool_call>  \n  tail  \n",
            "</thi</think></tool_call><tool_cal<tool_call>x</tool_call></think>",
            "abc <think>x</think> y",
            " \n <think>y</think> z <think>",
            "<thin<think><think></think>",
            "```\n<tool_call>\n<function=f>\n</function>\n</tool_call>\n```\n`<tool_call>` ``x`<tool_call>`` ~~~ <tool_call>\n<function=g>\n<parameter=v>\na</parameter>b\n</parameter>\n</function>\n</tool_call>\n\n~~~\n<tool_call></tool_call>",
            "",
        ];
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for text in texts {
            for starts_in_reasoning in [false, true] {
                let options =
                    ParseOptions { starts_in_reasoning, tools: Some(weather_tools()), ..ParseOptions::default() };
                let whole = parse_output(text, &options);
                let boundaries: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
                let mut splits: Vec<Vec<usize>> = boundaries.iter().map(|&b| vec![b]).collect();
                splits.push(boundaries.clone());
                for _ in 0..300 {
                    let mut cuts: Vec<usize> =
                        (0..(next() % 12)).map(|_| boundaries[(next() % boundaries.len() as u64) as usize]).collect();
                    cuts.sort_unstable();
                    splits.push(cuts);
                }
                for cuts in splits {
                    let mut parser = OutputParser::new(&options);
                    let mut events = Vec::new();
                    let mut from = 0;
                    for &cut in cuts.iter().chain([text.len()].iter()) {
                        events.extend(parser.push(&text[from..cut.max(from)]));
                        from = cut.max(from);
                    }
                    events.extend(parser.finish());
                    assert_eq!(ParsedOutput::from_events(&events), whole, "text {text:?} cut at {cuts:?}");
                    let indices: Vec<usize> = events
                        .iter()
                        .filter_map(|e| if let OutputEvent::ToolCall { index, .. } = e { Some(*index) } else { None })
                        .collect();
                    assert_eq!(indices, (0..indices.len()).collect::<Vec<_>>());
                }
            }
        }
    }

    #[test]
    fn no_text_is_lost_without_tags() {
        // Without tags, the parts together are the text minus its outer whitespace.
        let text = " a<b </c> <tool_cal <thin d\n";
        let out = parse_output(text, &ParseOptions::default());
        assert_eq!(out.content.as_deref(), Some(text.trim()));
    }
}
