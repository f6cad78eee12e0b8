//! Python's text conversions for template values, so that rendering matches transformers' jinja2 renderer.
//!
//! Sources: CPython 3.11 `Objects/unicodeobject.c` (`str.strip`/`str.split` use `Py_UNICODE_ISSPACE`),
//! `Python/pystrtod.c` (`float.__repr__`: shortest round-trip digits, exponent form when the decimal point
//! position is <= -4 or > 16), `Lib/json/encoder.py` (`json.dumps` escaping, separators, indent) and
//! `Objects/unicodeobject.c` `unicode_repr` (quote choice and escapes of `repr(str)`).

use std::fmt::Write as _;

use minijinja::value::ValueKind;
use minijinja::{Error, ErrorKind, Value};

/// Python's `str.isspace()` for one character: Rust's Unicode `White_Space` plus the information separators
/// U+001C..U+001F, which CPython counts as whitespace (bidirectional class B/S) and Rust does not.
pub fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python `s.strip(chars)`: without `chars`, strips Python whitespace ([`is_python_space`]).
pub fn strip<'a>(s: &'a str, chars: Option<&str>) -> &'a str {
    match chars {
        None => s.trim_matches(is_python_space),
        Some(set) => s.trim_matches(|c| set.contains(c)),
    }
}

/// Python `s.lstrip(chars)`.
pub fn lstrip<'a>(s: &'a str, chars: Option<&str>) -> &'a str {
    match chars {
        None => s.trim_start_matches(is_python_space),
        Some(set) => s.trim_start_matches(|c| set.contains(c)),
    }
}

/// Python `s.rstrip(chars)`.
pub fn rstrip<'a>(s: &'a str, chars: Option<&str>) -> &'a str {
    match chars {
        None => s.trim_end_matches(is_python_space),
        Some(set) => s.trim_end_matches(|c| set.contains(c)),
    }
}

/// Python `s.split(None, maxsplit)`: runs of Python whitespace separate words, leading and trailing runs give no
/// empty words; once `maxsplit` splits are made the rest (without its leading whitespace) is the last word.
pub fn split_whitespace(s: &str, maxsplit: Option<i64>) -> Vec<String> {
    let mut words = Vec::new();
    let mut rest = s.trim_start_matches(is_python_space);
    let mut splits_left = maxsplit.filter(|&n| n >= 0);
    while !rest.is_empty() {
        if splits_left == Some(0) {
            words.push(rest.to_owned());
            break;
        }
        match rest.find(is_python_space) {
            Some(end) => {
                words.push(rest[..end].to_owned());
                rest = rest[end..].trim_start_matches(is_python_space);
                splits_left = splits_left.map(|n| n - 1);
            }
            None => {
                words.push(rest.to_owned());
                break;
            }
        }
    }
    words
}

/// Python `repr(x)` of a float, which is also how `json.dumps` and `str()` write it: `1e-05`, `0.1`, `1.0`,
/// `1e+16`, `inf`, `nan`.
pub fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // Rust's `{:e}` prints the shortest digits that round-trip, like CPython's repr (David Gay's mode 0).
    let sci = format!("{:e}", x.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if x < 0.0 { "-" } else { "" };
    // `decpt`: the value is 0.DIGITS * 10**decpt.
    let decpt = exp + 1;
    let n = digits.len() as i32;
    let body = if -4 < decpt && decpt <= 16 {
        if decpt <= 0 {
            format!("0.{}{}", "0".repeat((-decpt) as usize), digits)
        } else if decpt >= n {
            format!("{}{}.0", digits, "0".repeat((decpt - n) as usize))
        } else {
            let (int, frac) = digits.split_at(decpt as usize);
            format!("{int}.{frac}")
        }
    } else {
        let (first, more) = digits.split_at(1);
        let frac = if more.is_empty() { String::new() } else { format!(".{more}") };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{first}{frac}e{exp_sign}{:02}", exp.abs())
    };
    format!("{sign}{body}")
}

/// Writes a number the way Python prints it: integers as digits, floats as [`float_repr`].
fn number_repr(value: &Value) -> String {
    if value.is_integer() {
        value.to_string()
    } else {
        match f64::try_from(value.clone()) {
            Ok(x) => float_repr(x),
            Err(_) => value.to_string(),
        }
    }
}

/// Python's `str(x)` of a template value, as jinja2 prints `{{ x }}` and as `|string` converts: `None`, `True`,
/// `1e-05`, `['a', 1]`, `{'k': None}`. Undefined prints as the empty string (jinja2's default `Undefined`).
pub fn str_of(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or_default().to_owned(),
        _ => repr_of(value),
    }
}

/// Python's `repr(x)` of a template value (strings quoted, containers recursive).
pub fn repr_of(value: &Value) -> String {
    let mut out = String::new();
    write_repr(&mut out, value);
    out
}

fn write_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&number_repr(value)),
        ValueKind::String => write_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            // Pairs from `|items` and `dict.items()` are tuples in Python: `('k', 1)`, `(x,)`.
            let tuple = value.is_tuple();
            out.push(if tuple { '(' } else { '[' });
            let mut count = 0;
            if let Ok(items) = value.try_iter() {
                for item in items {
                    if count > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &item);
                    count += 1;
                }
            }
            if tuple && count == 1 {
                out.push(',');
            }
            out.push(if tuple { ')' } else { ']' });
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &key);
                    out.push_str(": ");
                    write_repr(out, &value.get_item(&key).unwrap_or_default());
                }
            }
            out.push('}');
        }
        ValueKind::Bytes => {
            out.push_str("b'");
            for &b in value.as_bytes().unwrap_or_default() {
                match b {
                    b'\\' | b'\'' => {
                        out.push('\\');
                        out.push(b as char);
                    }
                    b'\t' => out.push_str("\\t"),
                    b'\n' => out.push_str("\\n"),
                    b'\r' => out.push_str("\\r"),
                    0x20..=0x7e => out.push(b as char),
                    _ => {
                        let _ = write!(out, "\\x{b:02x}");
                    }
                }
            }
            out.push('\'');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Characters `repr(str)` escapes although they are not ASCII controls. CPython escapes every character that is
/// not `str.isprintable()`; this covers the C1 controls, separators and format characters that occur in text,
/// not unassigned code points.
fn is_unprintable(c: char) -> bool {
    let u = c as u32;
    u < 0x20
        || (0x7f..=0xa0).contains(&u)
        || u == 0xad
        || (c != ' ' && is_python_space(c))
        || (0x200b..=0x200f).contains(&u)
        || (0x202a..=0x202e).contains(&u)
        || (0x2060..=0x206f).contains(&u)
        || u == 0xfeff
        || (0xd800..=0xdfff).contains(&u)
        || (0xfff9..=0xfffb).contains(&u)
}

fn write_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if is_unprintable(c) => {
                let u = c as u32;
                let _ = if u < 0x100 {
                    write!(out, "\\x{u:02x}")
                } else if u < 0x10000 {
                    write!(out, "\\u{u:04x}")
                } else {
                    write!(out, "\\U{u:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Options of Python's `json.dumps` that transformers' `tojson` filter exposes; `Default` is transformers'
/// default (`ensure_ascii=False`, one line, insertion order).
#[derive(Debug, Clone, Default)]
pub struct JsonOptions {
    /// Escape every non-ASCII character as `\uXXXX` (transformers' default: `false`).
    pub ensure_ascii: bool,
    /// `None`: one line; `Some(s)`: newline and `s` repeated per level (an int `n` is `n` spaces).
    pub indent: Option<String>,
    /// Item and key separators; default `", "`/`": "`, or `","`/`": "` with an indent.
    pub separators: Option<(String, String)>,
    /// Sort object keys (transformers' default: `false`, insertion order).
    pub sort_keys: bool,
}

/// Python `json.dumps(value, ensure_ascii=.., indent=.., separators=.., sort_keys=..)` of a template value.
///
/// Errors: undefined values and objects that are not JSON (Python's `TypeError: Object of type X is not JSON
/// serializable`), and non-string keys that Python would reject.
pub fn json_dumps(value: &Value, opts: &JsonOptions) -> Result<String, Error> {
    let (item_sep, key_sep) = match &opts.separators {
        Some((item, key)) => (item.clone(), key.clone()),
        None if opts.indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let mut out = String::new();
    let mut writer = JsonWriter { opts, item_sep: &item_sep, key_sep: &key_sep, out: &mut out };
    writer.write(value, 0)?;
    Ok(out)
}

struct JsonWriter<'a> {
    opts: &'a JsonOptions,
    item_sep: &'a str,
    key_sep: &'a str,
    out: &'a mut String,
}

impl JsonWriter<'_> {
    fn newline(&mut self, level: usize) {
        if let Some(indent) = &self.opts.indent {
            self.out.push('\n');
            for _ in 0..level {
                self.out.push_str(indent);
            }
        }
    }

    fn write(&mut self, value: &Value, level: usize) -> Result<(), Error> {
        match value.kind() {
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self.out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if value.is_integer() {
                    self.out.push_str(&value.to_string());
                } else {
                    let x = f64::try_from(value.clone())?;
                    self.out.push_str(&match x {
                        x if x.is_nan() => "NaN".to_owned(),
                        x if x.is_infinite() && x > 0.0 => "Infinity".to_owned(),
                        x if x.is_infinite() => "-Infinity".to_owned(),
                        x => float_repr(x),
                    });
                }
            }
            ValueKind::String => self.write_string(value.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                if items.is_empty() {
                    self.out.push_str("[]");
                    return Ok(());
                }
                self.out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        self.out.push_str(self.item_sep);
                    }
                    self.newline(level + 1);
                    self.write(item, level + 1)?;
                }
                self.newline(level);
                self.out.push(']');
            }
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    entries.push((json_key(&key)?, item));
                }
                if self.opts.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                if entries.is_empty() {
                    self.out.push_str("{}");
                    return Ok(());
                }
                self.out.push('{');
                for (i, (key, item)) in entries.iter().enumerate() {
                    if i > 0 {
                        self.out.push_str(self.item_sep);
                    }
                    self.newline(level + 1);
                    self.write_string(key);
                    self.out.push_str(self.key_sep);
                    self.write(item, level + 1)?;
                }
                self.newline(level);
                self.out.push('}');
            }
            kind => {
                let type_name = match kind {
                    ValueKind::Undefined => "Undefined".to_owned(),
                    other => other.to_string(),
                };
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("Object of type {type_name} is not JSON serializable"),
                ));
            }
        }
        Ok(())
    }

    fn write_string(&mut self, s: &str) {
        let out = &mut *self.out;
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c if self.opts.ensure_ascii && !(' '..='~').contains(&c) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python's JSON object keys: strings as they are; numbers, booleans and None converted as `json.dumps` does.
fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
        ValueKind::None => "null".to_owned(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_owned(),
        ValueKind::Number => number_repr(key),
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("keys must be str, int, float, bool or None, not {kind}"),
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::super::json_value;
    use super::*;

    #[test]
    fn python_whitespace_is_rust_whitespace_plus_information_separators() {
        // The full list of `chr(c).isspace()` in CPython 3.11.
        let python: Vec<u32> = vec![
            0x9, 0xa, 0xb, 0xc, 0xd, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x85, 0xa0, 0x1680, 0x2000, 0x2001, 0x2002, 0x2003,
            0x2004, 0x2005, 0x2006, 0x2007, 0x2008, 0x2009, 0x200a, 0x2028, 0x2029, 0x202f, 0x205f, 0x3000,
        ];
        let ours: Vec<u32> =
            (0..=0x10ffffu32).filter_map(char::from_u32).filter(|&c| is_python_space(c)).map(|c| c as u32).collect();
        assert_eq!(ours, python);
    }

    #[test]
    fn strip_and_split_follow_python() {
        assert_eq!(strip("\x1c\u{3000} a b \x1f\n", None), "a b");
        assert_eq!(strip("xxaxx", Some("x")), "a");
        assert_eq!(lstrip("\n\nab\n", Some("\n")), "ab\n");
        assert_eq!(rstrip(" ab \x1e", None), " ab");
        assert_eq!(split_whitespace("  a \x1c b\tc  ", None), ["a", "b", "c"]);
        assert_eq!(split_whitespace("  a  b  c  ", Some(1)), ["a", "b  c  "]);
        assert_eq!(split_whitespace("   ", None), Vec::<String>::new());
    }

    #[test]
    fn floats_print_like_python_repr() {
        let cases = [
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (0.1, "0.1"),
            (1.0, "1.0"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (1.5e-7, "1.5e-07"),
            (123.456, "123.456"),
            (1e100, "1e+100"),
            (f64::MAX, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
        ];
        for (x, want) in cases {
            assert_eq!(float_repr(x), want, "{x:?}");
        }
    }

    #[test]
    fn json_dumps_matches_python_defaults() {
        let value = json_value(serde_json::json!({
            "z": 1, "a": [true, null, 1.0, 1e-5, "é<&>\"\\\n\u{1}\u{7f}"], "e": {}, "l": []
        }));
        assert_eq!(
            json_dumps(&value, &JsonOptions::default()).unwrap(),
            "{\"z\": 1, \"a\": [true, null, 1.0, 1e-05, \"é<&>\\\"\\\\\\n\\u0001\u{7f}\"], \"e\": {}, \"l\": []}"
        );
        let ascii = JsonOptions { ensure_ascii: true, ..JsonOptions::default() };
        assert_eq!(json_dumps(&Value::from("é😀\u{7f}"), &ascii).unwrap(), "\"\\u00e9\\ud83d\\ude00\\u007f\"");
        let indented = JsonOptions { indent: Some("  ".into()), sort_keys: true, ..JsonOptions::default() };
        let value = json_value(serde_json::json!({"b": [1, 2], "a": {}}));
        assert_eq!(json_dumps(&value, &indented).unwrap(), "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2\n  ]\n}");
    }

    #[test]
    fn str_and_repr_follow_python() {
        let value = json_value(serde_json::json!({"k": [true, null, 2, 0.5, "it's", "a'b\"c"]}));
        assert_eq!(str_of(&value), "{'k': [True, None, 2, 0.5, \"it's\", 'a\\'b\"c']}");
        assert_eq!(str_of(&Value::from(())), "None");
        assert_eq!(str_of(&Value::UNDEFINED), "");
        assert_eq!(str_of(&Value::from("x\ny")), "x\ny");
        assert_eq!(repr_of(&Value::from("x\ny\u{a0}")), "'x\\ny\\xa0'");
    }
}
