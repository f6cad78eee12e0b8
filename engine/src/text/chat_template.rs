//! Chat template rendering with the semantics of transformers' `apply_chat_template(tokenize=False)`.
//!
//! A model brings its chat template as Jinja text (GGUF `tokenizer.chat_template`, HF `chat_template.jinja`);
//! [`ChatTemplate::new`] compiles it once and [`ChatTemplate::render`] turns an OpenAI-style request into the
//! prompt text. The reference renderer is transformers 5 `utils/chat_template_utils.py` on jinja2 3.1:
//! `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with `loopcontrols`, globals
//! `raise_exception`, `strftime_now`, `namespace`, and `tojson` replaced by Python's `json.dumps(x,
//! ensure_ascii=False)`. minijinja provides the Jinja language; this module adds what differs from it:
//!
//! - output of `{{ x }}` and `|string` is Python's `str(x)` (`None`, `True`, `1e-05`, `{'a': 1}`);
//! - `|tojson` is `json.dumps` (`", "`/`": "` separators, insertion order, raw UTF-8, no HTML escaping, floats as
//!   Python writes them), with transformers' arguments `ensure_ascii, indent, separators, sort_keys`;
//! - `|trim`, `str.strip/lstrip/rstrip/split` use Python whitespace, which includes U+001C..U+001F;
//! - other Python `str`/`dict` methods come from `minijinja_contrib::pycompat`;
//! - `raise_exception(msg)` fails the render with [`TemplateError::Raised`] carrying `msg`.
//!
//! Before rendering, the messages get the preparation that transformers and OpenAI servers apply: keys whose value
//! is `null` are dropped (transformers `_normalize_chat_messages`), the reasoning is aliased under
//! `reasoning_content` and `thinking` from `reasoning_content`/`thinking`/`reasoning` (transformers
//! `_alias_reasoning_fields`), and each tool call's `function.arguments` JSON string becomes an ordered map, as
//! vLLM and SGLang do, because templates iterate it with `|items`.
//!
//! Also jinja2's `int`/`float` filters (fallbacks instead of errors) and `sequence` test (true for strings and
//! mappings). `tests/fixtures/chat_template/jinja_features.jinja` checks ~250 expressions against jinja2.
//!
//! Known differences from jinja2, none of which the Qwen templates reach: the `~` operator prints `none`/`true`
//! the minijinja way, not `None`/`True`; jinja2 filters minijinja lacks (`wordcount`, `truncate`, `center`,
//! `wordwrap`, `filesizeformat`, `striptags`, `xmlattr`, `urlize`, `pprint`, `random`) are unknown-filter errors;
//! error texts of Jinja's own errors (undefined values, type errors) are minijinja's; `repr()` of a string escapes
//! only the common non-printable characters; `strftime_now` uses UTC, not the local time zone.

mod python;

use std::fmt;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, ValueKind, from_args};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State, UndefinedBehavior, Value};
use serde_json::Map;

pub use python::{JsonOptions, float_repr, is_python_space, json_dumps};

/// The Qwen3.8-Flash-Next chat template (`assets/chat_template.jinja`), for models that do not bring their own.
pub const QWEN38_CHAT_TEMPLATE: &str = include_str!("../../../assets/chat_template.jinja");

/// Name under which the template is stored in its environment (appears in error locations).
const TEMPLATE_NAME: &str = "chat_template";

/// Errors of compiling or rendering a chat template, or of a request it cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// The template text does not parse.
    #[error("chat template syntax error: {message}")]
    Syntax { message: String },
    /// The template called `raise_exception(message)`: the request is invalid for this model, and `message` is
    /// the template's own words (e.g. "System message must be at the beginning.").
    #[error("{message}")]
    Raised { message: String },
    /// The template used an undefined value in a way jinja2 also rejects (e.g. an attribute of an undefined
    /// value).
    #[error("chat template used an undefined value: {message}")]
    Undefined { message: String },
    /// Any other failure during rendering (a type error, a failed filter, too deep recursion).
    #[error("chat template render failed: {message}")]
    Render { message: String },
    /// The request's `messages` are not an array of objects.
    #[error("invalid chat messages: {message}")]
    InvalidMessages { message: String },
    /// A tool call's `arguments` string is not a JSON object.
    #[error(
        "message {message_index} tool call {call_index}: arguments must be a JSON object, got {arguments:?}: {reason}"
    )]
    InvalidToolArguments { message_index: usize, call_index: usize, arguments: String, reason: String },
}

impl TemplateError {
    /// The message without the kind's prefix: for [`TemplateError::Raised`], exactly the template's text.
    pub fn message(&self) -> String {
        match self {
            Self::Syntax { message }
            | Self::Raised { message }
            | Self::Undefined { message }
            | Self::Render { message }
            | Self::InvalidMessages { message } => message.clone(),
            Self::InvalidToolArguments { .. } => self.to_string(),
        }
    }
}

/// One rendering of a conversation: the arguments of transformers' `apply_chat_template`.
#[derive(Debug, Clone)]
pub struct RenderRequest<'a> {
    /// OpenAI-style messages array: `[{"role": "system"|"user"|"assistant"|"tool", "content": ..., ...}]`.
    pub messages: &'a serde_json::Value,
    /// OpenAI tools array (`[{"type": "function", "function": {...}}]`), passed to the template as `tools`.
    pub tools: Option<&'a serde_json::Value>,
    /// Append the assistant header that starts the model's turn.
    pub add_generation_prompt: bool,
    /// `enable_thinking` template variable; `None` leaves it undefined (Qwen3.8: thinking on).
    pub enable_thinking: Option<bool>,
    /// `reasoning_effort` template variable; `None` leaves it undefined (Qwen3.8: `xhigh`).
    pub reasoning_effort: Option<&'a str>,
    /// Other `chat_template_kwargs` (e.g. `preserve_thinking`, `add_vision_id`). The named fields above win
    /// over entries of the same name here when they are set.
    pub extra: Map<String, serde_json::Value>,
}

impl<'a> RenderRequest<'a> {
    /// A request for `messages` with every option at its default (no tools, no generation prompt).
    pub fn new(messages: &'a serde_json::Value) -> Self {
        Self {
            messages,
            tools: None,
            add_generation_prompt: false,
            enable_thinking: None,
            reasoning_effort: None,
            extra: Map::new(),
        }
    }
}

/// A compiled chat template. Cheap to share (`Send + Sync`); rendering does not mutate it.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source` (Jinja) with transformers' environment settings.
    ///
    /// Errors: [`TemplateError::Syntax`] when the text does not parse.
    pub fn new(source: &str) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| TemplateError::Syntax { message: e.to_string() })?;
        env.set_syntax(syntax);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_formatter(|out, _state, value| {
            out.write_str(&python::str_of(value)).map_err(|_| Error::from(ErrorKind::WriteFailure))
        });
        env.set_unknown_method_callback(python_methods);
        env.add_filter("tojson", tojson);
        env.add_filter("trim", trim);
        env.add_filter("string", string);
        env.add_filter("int", int);
        env.add_test("sequence", is_sequence);
        env.add_filter("float", float);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| TemplateError::Syntax { message: e.to_string() })?;
        Ok(Self { env })
    }

    /// Renders `req` to the prompt text.
    ///
    /// Errors: [`TemplateError::InvalidMessages`] / [`TemplateError::InvalidToolArguments`] for requests that
    /// cannot be prepared, [`TemplateError::Raised`] when the template rejects the conversation, and
    /// [`TemplateError::Undefined`] / [`TemplateError::Render`] for other failures.
    pub fn render(&self, req: &RenderRequest<'_>) -> Result<String, TemplateError> {
        let messages = prepare_messages(req.messages)?;
        let mut ctx = Map::new();
        ctx.insert("messages".into(), messages);
        ctx.insert("tools".into(), req.tools.cloned().unwrap_or(serde_json::Value::Null));
        ctx.insert("documents".into(), serde_json::Value::Null);
        ctx.insert("add_generation_prompt".into(), req.add_generation_prompt.into());
        for (key, value) in &req.extra {
            ctx.insert(key.clone(), value.clone());
        }
        if let Some(on) = req.enable_thinking {
            ctx.insert("enable_thinking".into(), on.into());
        }
        if let Some(effort) = req.reasoning_effort {
            ctx.insert("reasoning_effort".into(), effort.into());
        }
        let ctx = json_value(serde_json::Value::Object(ctx));
        let template = self.env.get_template(TEMPLATE_NAME).map_err(classify)?;
        template.render(ctx).map_err(classify)
    }
}

/// Applies transformers' message normalization and converts tool-call argument strings to ordered maps.
fn prepare_messages(messages: &serde_json::Value) -> Result<serde_json::Value, TemplateError> {
    let list = messages.as_array().ok_or_else(|| TemplateError::InvalidMessages {
        message: format!("messages must be an array, got {}", json_kind(messages)),
    })?;
    let mut prepared = Vec::with_capacity(list.len());
    for (index, message) in list.iter().enumerate() {
        let object = message.as_object().ok_or_else(|| TemplateError::InvalidMessages {
            message: format!("message {index} must be an object, got {}", json_kind(message)),
        })?;
        let mut message: Map<String, serde_json::Value> =
            object.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k.clone(), v.clone())).collect();
        alias_reasoning(&mut message);
        if let Some(serde_json::Value::Array(calls)) = message.get_mut("tool_calls") {
            for (call_index, call) in calls.iter_mut().enumerate() {
                parse_arguments(call, index, call_index)?;
            }
        }
        prepared.push(serde_json::Value::Object(message));
    }
    Ok(serde_json::Value::Array(prepared))
}

/// transformers `_alias_reasoning_fields`: `{"thinking": r, **message, "reasoning_content": r}` where `r` is the
/// first of `reasoning_content`, `thinking`, `reasoning` that is present.
fn alias_reasoning(message: &mut Map<String, serde_json::Value>) {
    let Some(reasoning) =
        ["reasoning_content", "thinking", "reasoning"].iter().find_map(|key| message.get(*key).cloned())
    else {
        return;
    };
    let mut aliased = Map::new();
    aliased.insert("thinking".into(), reasoning.clone());
    for (key, value) in std::mem::take(message) {
        aliased.insert(key, value);
    }
    aliased.insert("reasoning_content".into(), reasoning);
    *message = aliased;
}

/// Replaces a tool call's `arguments` JSON string (OpenAI wire format) by the object it encodes, keeping key
/// order. The call is `{"function": {"name", "arguments"}}` or, unwrapped, `{"name", "arguments"}`. An empty
/// string stays (templates skip it); a string that is not a JSON object is an error.
fn parse_arguments(call: &mut serde_json::Value, message_index: usize, call_index: usize) -> Result<(), TemplateError> {
    let Some(call) = call.as_object_mut() else {
        return Ok(());
    };
    let target = match call.get("function") {
        Some(serde_json::Value::Object(_)) => call.get_mut("function").and_then(|f| f.as_object_mut()),
        _ => Some(call),
    };
    let Some(function) = target else {
        return Ok(());
    };
    let Some(serde_json::Value::String(text)) = function.get("arguments") else {
        return Ok(());
    };
    if text.is_empty() {
        return Ok(());
    }
    let invalid = |reason: String| TemplateError::InvalidToolArguments {
        message_index,
        call_index,
        arguments: text.clone(),
        reason,
    };
    let parsed: serde_json::Value = serde_json::from_str(text).map_err(|e| invalid(e.to_string()))?;
    if !parsed.is_object() {
        return Err(invalid(format!("it is a JSON {}", json_kind(&parsed))));
    }
    function.insert("arguments".into(), parsed);
    Ok(())
}

/// Python `json.dumps(value, ensure_ascii=False)` of a JSON value: `", "`/`": "` separators, key order kept, raw
/// UTF-8, floats as Python writes them (`1e-05`). This is how vLLM's Qwen tool parsers write `arguments`.
pub fn python_json(value: &serde_json::Value) -> String {
    // A `serde_json::Value` always converts to a JSON-representable template value, so this cannot fail.
    json_dumps(&json_value(value.clone()), &JsonOptions::default()).unwrap_or_else(|_| value.to_string())
}

/// A JSON value as a template value, keeping object key order.
pub(crate) fn json_value(value: serde_json::Value) -> Value {
    Value::from(minijinja::value::Serde(value))
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "boolean",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "array",
        serde_json::Value::Object(_) => "object",
    }
}

/// Marks a minijinja error as coming from `raise_exception`, so that [`classify`] can return its message.
#[derive(Debug)]
struct RaisedException(String);

impl fmt::Display for RaisedException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

fn classify(error: Error) -> TemplateError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&error);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<RaisedException>() {
            return TemplateError::Raised { message: raised.0.clone() };
        }
        source = e.source();
    }
    let message = error.to_string();
    match error.kind() {
        ErrorKind::SyntaxError | ErrorKind::BadEscape => TemplateError::Syntax { message },
        ErrorKind::UndefinedError => TemplateError::Undefined { message },
        _ => TemplateError::Render { message },
    }
}

/// `raise_exception(message)`: transformers raises `jinja2.exceptions.TemplateError(message)`.
fn raise_exception(message: Value) -> Result<Value, Error> {
    let message = python::str_of(&message);
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedException(message)))
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &Value, positional: &[Value], kwargs: Kwargs) -> Result<Value, Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if positional.len() > NAMES.len() {
        return Err(Error::from(ErrorKind::TooManyArguments));
    }
    let arg = |i: usize| -> Result<Option<Value>, Error> {
        let value = match positional.get(i) {
            Some(v) => Some(v.clone()),
            None => kwargs.get::<Option<Value>>(NAMES[i])?,
        };
        Ok(value.filter(|v| !v.is_none() && !v.is_undefined()))
    };
    let mut opts = JsonOptions::default();
    if let Some(v) = arg(0)? {
        opts.ensure_ascii = v.is_true();
    }
    if let Some(v) = arg(1)? {
        opts.indent = Some(match v.as_str() {
            Some(s) => s.to_owned(),
            None => {
                let n = v.as_i64().ok_or_else(|| {
                    Error::new(ErrorKind::InvalidOperation, "tojson indent must be an int or a string")
                })?;
                " ".repeat(n.clamp(0, 64) as usize)
            }
        });
    }
    if let Some(v) = arg(2)? {
        let parts: Vec<Value> = v.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] => opts.separators = Some((python::str_of(item), python::str_of(key))),
            _ => {
                return Err(Error::new(ErrorKind::InvalidOperation, "tojson separators must be a pair"));
            }
        }
    }
    if let Some(v) = arg(3)? {
        opts.sort_keys = v.is_true();
    }
    kwargs.assert_all_used()?;
    Ok(Value::from(json_dumps(value, &opts)?))
}

/// jinja2 `trim(value, chars=None)`: `str(value).strip(chars)` with Python whitespace.
fn trim(value: &Value, chars: Option<Value>) -> Result<Value, Error> {
    let text = python::str_of(value);
    let chars = chars.filter(|c| !c.is_none() && !c.is_undefined()).map(|c| python::str_of(&c));
    Ok(Value::from(python::strip(&text, chars.as_deref())))
}

/// jinja2 `string(value)`: Python `str(value)`; strings pass unchanged (safe strings stay safe).
fn string(value: &Value) -> Value {
    if value.kind() == ValueKind::String { value.clone() } else { Value::from(python::str_of(value)) }
}

/// jinja2 `sequence` test: anything with a length and item access, so strings and mappings too.
fn is_sequence(value: &Value) -> bool {
    matches!(value.kind(), ValueKind::String | ValueKind::Bytes | ValueKind::Seq | ValueKind::Map)
}

/// jinja2 `int(value, default=0, base=10)`: Python `int(value)`, else `int(float(value))`, else `default`.
fn int(value: &Value, default: Option<Value>, base: Option<u32>) -> Value {
    let default = default.unwrap_or(Value::from(0));
    match value.kind() {
        ValueKind::Bool => Value::from(i64::from(value.is_true())),
        ValueKind::Number if value.is_integer() => value.clone(),
        ValueKind::Number => match f64::try_from(value.clone()) {
            Ok(x) if x.is_finite() => Value::from(x.trunc() as i64),
            _ => default,
        },
        ValueKind::String => {
            let text = python::strip(value.as_str().unwrap_or_default(), None).replace('_', "");
            let base = base.unwrap_or(10);
            let (negative, digits) = match text.strip_prefix('-') {
                Some(rest) => (true, rest),
                None => (false, text.strip_prefix('+').unwrap_or(&text)),
            };
            let prefix = match base {
                16 => ["0x", "0X"],
                8 => ["0o", "0O"],
                2 => ["0b", "0B"],
                _ => ["", ""],
            };
            let digits = prefix.iter().filter(|p| !p.is_empty()).find_map(|p| digits.strip_prefix(p)).unwrap_or(digits);
            match (2..=36).contains(&base).then(|| i64::from_str_radix(digits, base).ok()).flatten() {
                Some(n) if !digits.starts_with(['+', '-']) => Value::from(if negative { -n } else { n }),
                _ => match python_float(&text) {
                    Some(x) if x.is_finite() => Value::from(x.trunc() as i64),
                    _ => default,
                },
            }
        }
        _ => default,
    }
}

/// jinja2 `float(value, default=0.0)`: Python `float(value)`, else `default`.
fn float(value: &Value, default: Option<Value>) -> Value {
    let default = default.unwrap_or(Value::from(0.0));
    match value.kind() {
        ValueKind::Bool => Value::from(if value.is_true() { 1.0 } else { 0.0 }),
        ValueKind::Number => f64::try_from(value.clone()).map(Value::from).unwrap_or(default),
        ValueKind::String => python_float(value.as_str().unwrap_or_default()).map(Value::from).unwrap_or(default),
        _ => default,
    }
}

/// Python `float(str)`: surrounding whitespace allowed, `inf`/`nan` spelled any case, underscores between digits.
fn python_float(text: &str) -> Option<f64> {
    let text = python::strip(text, None);
    let unsigned = text.trim_start_matches(['+', '-']);
    match unsigned.to_ascii_lowercase().as_str() {
        "inf" | "infinity" | "nan" => return text.parse().ok(),
        _ => {}
    }
    if unsigned.is_empty() || !unsigned.starts_with(|c: char| c.is_ascii_digit() || c == '.') {
        return None;
    }
    text.replace('_', "").parse().ok()
}

/// transformers' `strftime_now(format)`: the current time (UTC here) formatted with the common `strftime`
/// directives `%Y %y %m %d %e %B %b %A %a %H %I %M %S %p %j %%`.
fn strftime_now(format: &str) -> String {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    format_utc(secs, format)
}

fn format_utc(secs: i64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (hour, minute, second) = (rem / 3600, rem % 3600 / 60, rem % 60);
    // Howard Hinnant's days-from-civil inverse.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_march = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_march + 2) / 153;
    let day = doy_march - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Python `str` methods with Python whitespace (`strip`, `lstrip`, `rstrip`, `split`); every other method goes to
/// `minijinja_contrib::pycompat`.
fn python_methods(state: &mut State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let Some(s) = value.as_str() {
        let optional_str = |v: Option<Value>| -> Result<Option<String>, Error> {
            match v {
                None => Ok(None),
                Some(v) if v.is_none() => Ok(None),
                Some(v) => v.as_str().map(|s| Some(s.to_owned())).ok_or_else(|| {
                    Error::new(ErrorKind::InvalidOperation, format!("{method} arg must be None or str"))
                }),
            }
        };
        match method {
            "strip" | "lstrip" | "rstrip" => {
                let (chars,): (Option<Value>,) = from_args(args)?;
                let chars = optional_str(chars)?;
                let out = match method {
                    "strip" => python::strip(s, chars.as_deref()),
                    "lstrip" => python::lstrip(s, chars.as_deref()),
                    _ => python::rstrip(s, chars.as_deref()),
                };
                return Ok(Value::from(out));
            }
            "split" => {
                let (sep, maxsplit): (Option<Value>, Option<i64>) = from_args(args)?;
                let sep = optional_str(sep)?;
                let words: Vec<String> = match sep.as_deref() {
                    None => python::split_whitespace(s, maxsplit),
                    Some("") => {
                        return Err(Error::new(ErrorKind::InvalidOperation, "empty separator"));
                    }
                    Some(sep) => match maxsplit {
                        Some(n) if n >= 0 => s.splitn(n as usize + 1, sep).map(str::to_owned).collect(),
                        _ => s.split(sep).map(str::to_owned).collect(),
                    },
                };
                return Ok(Value::from(words));
            }
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, messages: serde_json::Value) -> Result<String, TemplateError> {
        ChatTemplate::new(source)?.render(&RenderRequest::new(&messages))
    }

    #[test]
    fn python_output_conventions() {
        let out = render(
            "{{ messages[0].x }}|{{ messages[0].x|string }}|{{ messages[0].x|tojson }}|{{ none }}|{{ true }}",
            json!([{"x": {"a": [1.0, 1e-5, null, true, "é<"]}}]),
        )
        .unwrap();
        assert_eq!(
            out,
            "{'a': [1.0, 1e-05, None, True, 'é<']}|{'a': [1.0, 1e-05, None, True, 'é<']}|\
             {\"a\": [1.0, 1e-05, null, true, \"é<\"]}|None|True"
        );
    }

    #[test]
    fn tojson_takes_transformers_arguments() {
        let out = render(
            "{{ messages[0]|tojson(indent=2, sort_keys=true) }}\n{{ messages[0]|tojson(separators=(',', ':')) }}\
             {{ messages[0].s|tojson(true) }}",
            json!([{"s": "é", "a": 1}]),
        )
        .unwrap();
        assert_eq!(out, "{\n  \"a\": 1,\n  \"s\": \"é\"\n}\n{\"s\":\"é\",\"a\":1}\"\\u00e9\"");
    }

    #[test]
    fn trim_and_methods_use_python_whitespace() {
        let out = render(
            "[{{ messages[0].t|trim }}][{{ messages[0].t.strip() }}][{{ messages[0].t.lstrip() }}]\
             [{{ messages[0].t.split()|join(',') }}][{{ 'a-b-c'.split('-', 1)|join('|') }}]",
            json!([{"t": "\x1c\u{3000} a  b \x1f"}]),
        )
        .unwrap();
        assert_eq!(out, "[a  b][a  b][a  b \x1f][a,b][a|b-c]");
    }

    #[test]
    fn raise_exception_is_typed() {
        let err = render("{{ raise_exception('No user query found in messages.') }}", json!([])).unwrap_err();
        assert_eq!(err, TemplateError::Raised { message: "No user query found in messages.".into() });
        assert_eq!(err.to_string(), "No user query found in messages.");
        // Raised inside a macro called from a loop: still the template's message.
        let err = render(
            "{% macro m(x) %}{{ raise_exception('bad ' ~ x) }}{% endmacro %}{% for y in [1] %}{{ m(y) }}{% endfor %}",
            json!([]),
        )
        .unwrap_err();
        assert_eq!(err, TemplateError::Raised { message: "bad 1".into() });
    }

    #[test]
    fn syntax_and_undefined_errors_are_typed() {
        assert!(matches!(ChatTemplate::new("{% if %}"), Err(TemplateError::Syntax { .. })));
        assert!(matches!(ChatTemplate::new("{{ x "), Err(TemplateError::Syntax { .. })));
        let err = render("{{ messages[0].a.b.c }}", json!([{}])).unwrap_err();
        assert!(matches!(err, TemplateError::Undefined { .. }), "{err:?}");
    }

    #[test]
    fn arguments_strings_become_ordered_maps() {
        let template =
            "{% for k, v in messages[0].tool_calls[0].function.arguments|items %}{{ k }}={{ v|tojson }};{% endfor %}";
        let out = render(
            template,
            json!([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{\"z\": 1, \"a\": [true]}"}}]}]),
        )
        .unwrap();
        assert_eq!(out, "z=1;a=[true];");
        let err = render(
            template,
            json!([{"role": "user"}, {"role": "assistant", "tool_calls": [{}, {"function": {"name": "f", "arguments": "[1]"}}]}]),
        )
        .unwrap_err();
        assert!(matches!(err, TemplateError::InvalidToolArguments { message_index: 1, call_index: 1, .. }), "{err:?}");
        let err = render(template, json!([{"tool_calls": [{"function": {"arguments": "{oops"}}]}])).unwrap_err();
        assert!(matches!(err, TemplateError::InvalidToolArguments { .. }), "{err:?}");
    }

    #[test]
    fn messages_are_normalized_like_transformers() {
        let out = render(
            "{% for m in messages %}{{ m|tojson }}\n{% endfor %}",
            json!([{"role": "assistant", "content": null, "reasoning": "r"}, {"role": "user", "x": null}]),
        )
        .unwrap();
        assert_eq!(
            out,
            "{\"thinking\": \"r\", \"role\": \"assistant\", \"reasoning\": \"r\", \"reasoning_content\": \"r\"}\n\
             {\"role\": \"user\"}\n"
        );
        assert!(matches!(render("", json!({"role": "user"})), Err(TemplateError::InvalidMessages { .. })));
        assert!(matches!(render("", json!(["hi"])), Err(TemplateError::InvalidMessages { .. })));
    }

    #[test]
    fn loop_controls_namespace_and_adjacent_items() {
        let out = render(
            "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.previtem is defined %}<{{ loop.previtem.r }}{% endif %}\
             {% if loop.nextitem is defined %}>{{ loop.nextitem.r }}{% endif %}{% if m.r == 'b' %}{% continue %}{% endif %}\
             {% set ns.n = ns.n + 1 %}{% if m.r == 'c' %}{% break %}{% endif %}{% endfor %}|{{ ns.n }}",
            json!([{"r": "a"}, {"r": "b"}, {"r": "c"}, {"r": "d"}]),
        )
        .unwrap();
        assert_eq!(out, ">b<a>c<b>d|2");
    }

    #[test]
    fn int_and_float_filters_follow_jinja2() {
        let out = render(
            "{{ '5'|int }} {{ ' 7 '|int }} {{ '2.5'|int }} {{ 'x'|int }} {{ 'x'|int(9) }} {{ '0x1A'|int(0, 16) }} \
             {{ 3.9|int }} {{ true|int }} {{ '2.5'|float }} {{ 'x'|float }} {{ '1e-5'|float }} {{ 3|float }}",
            json!([]),
        )
        .unwrap();
        assert_eq!(out, "5 7 2 0 9 26 3 1 2.5 0.0 1e-05 3.0");
    }

    #[test]
    fn chat_template_is_shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
    }

    /// Malformed requests fail with an error or render; they never panic.
    #[test]
    fn malformed_requests_do_not_panic() {
        let template = ChatTemplate::new(QWEN38_CHAT_TEMPLATE).unwrap();
        let shapes = [
            json!(null),
            json!([null]),
            json!([{}]),
            json!([{"role": 5, "content": [1, [2], {"x": null}]}]),
            json!([{"role": "user", "content": {"text": "x"}}]),
            json!([{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "tool_calls": "x"}]),
            json!([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [null, 1, {"function": 2}]}]),
            json!([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]),
            json!([{"role": "user", "content": "q"}, {"role": "tool"}, {"role": "tool", "content": [[[[[]]]]]}]),
            json!([{"role": "user", "content": "q", "reasoning_content": {"deep": [1.5e300, -0.0, 1e-320]}}]),
        ];
        for messages in &shapes {
            for tools in [None, Some(json!("tools")), Some(json!([null, {"function": {}}]))] {
                let mut request = RenderRequest::new(messages);
                request.tools = tools.as_ref();
                request.reasoning_effort = Some("\u{0}");
                let _ = template.render(&request);
                request.reasoning_effort = None;
                let _ = template.render(&request);
            }
        }
    }

    #[test]
    fn strftime_formats_utc_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        assert_eq!(
            format_utc(1_709_211_909, "%Y-%m-%d %H:%M:%S %a %A %b %B %j %y %I%p %%"),
            "2024-02-29 13:05:09 Thu Thursday Feb February 060 24 01PM %"
        );
        assert_eq!(format_utc(0, "%d %b %Y"), "01 Jan 1970");
    }
}
