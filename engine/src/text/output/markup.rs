//! The two readers behind [`super::OutputParser`]: where Markdown code begins and ends in the model's text (tool
//! markup quoted there is text, not a call), and the inside of one XML tool call.

use super::{FUNCTION_END, FUNCTION_START, PARAMETER_END, PARAMETER_START};

/// Follows Markdown code in streamed text, one character at a time, so that the parser can tell the model's own
/// tags from tags it quotes. The rules are CommonMark's, simplified where a stream cannot look ahead:
///
/// - A fenced code block opens at a line that starts (after spaces) with three or more backticks or tildes, and
///   closes at a line that starts with at least as many of the same character followed only by whitespace. An
///   unclosed fence runs to the end of the text, as in CommonMark.
/// - Outside fences, a run of N backticks opens a code span that closes at the next run of exactly N backticks.
///   CommonMark treats an unmatched run as literal text; a stream cannot know yet, so the span is taken as open
///   until its match or the end of the paragraph (a blank line), whichever comes first.
///
/// The state before a character depends only on the characters before it, so any split of the text gives the
/// same answer.
#[derive(Debug, Clone)]
pub(super) struct CodeTracker {
    /// Open fence: its character and length.
    fence: Option<(char, usize)>,
    /// Open code span: its backtick count.
    span: Option<usize>,
    /// A run of backticks or tildes not ended yet: character, length, whether it began the line.
    run: Option<(char, usize, bool)>,
    /// Only spaces and tabs so far on this line.
    line_start: bool,
    /// Inside a fence, this line is a closing fence so far (a long enough run, then only whitespace).
    closing: bool,
}

impl Default for CodeTracker {
    fn default() -> Self {
        Self { fence: None, span: None, run: None, line_start: true, closing: false }
    }
}

impl CodeTracker {
    /// Whether the next character (any but a backtick or tilde) is inside code.
    pub(super) fn in_code(&self) -> bool {
        let mut next = self.clone();
        next.end_run();
        next.fence.is_some() || next.span.is_some()
    }

    /// Advances over `text`.
    pub(super) fn feed(&mut self, text: &str) {
        for c in text.chars() {
            self.step(c);
        }
    }

    /// For each byte offset of `text` (and its end), whether a tag starting there would be inside code: the
    /// state after the characters before it. Offsets inside a character copy the state before that character.
    pub(super) fn states(&self, text: &str) -> Vec<bool> {
        let mut out = Vec::with_capacity(text.len() + 1);
        let mut state = self.clone();
        for c in text.chars() {
            let inside = state.in_code();
            out.extend(std::iter::repeat_n(inside, c.len_utf8()));
            state.step(c);
        }
        out.push(state.in_code());
        out
    }

    fn end_run(&mut self) {
        let Some((ch, len, at_line_start)) = self.run.take() else { return };
        if let Some((fence_ch, fence_len)) = self.fence {
            self.closing = at_line_start && ch == fence_ch && len >= fence_len;
        } else if at_line_start && len >= 3 {
            self.fence = Some((ch, len));
            self.span = None;
        } else if ch == '`' {
            match self.span {
                Some(n) if n == len => self.span = None,
                Some(_) => {}
                None => self.span = Some(len),
            }
        }
    }

    fn step(&mut self, c: char) {
        if let Some((ch, len, _)) = &mut self.run
            && *ch == c
        {
            *len += 1;
            return;
        }
        let blank_line = self.line_start && self.run.is_none();
        self.end_run();
        match c {
            '`' | '~' => {
                self.run = Some((c, 1, self.line_start));
                self.line_start = false;
            }
            '\n' => {
                if self.closing {
                    self.fence = None;
                }
                if blank_line {
                    // A blank line ends the paragraph, and an unmatched code span with it.
                    self.span = None;
                }
                self.line_start = true;
                self.closing = false;
            }
            ' ' | '\t' | '\r' => {}
            _ => {
                self.line_start = false;
                self.closing = false;
            }
        }
    }
}

/// The inside of one `<tool_call>` in the XML format, as far as it is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct XmlCall<'a> {
    /// The function name.
    pub name: &'a str,
    /// Parameters whose end is certain, in the order written, repeats included: key and raw value (one newline
    /// dropped at each end, as the template writes them).
    pub params: Vec<(&'a str, &'a str)>,
    /// The parameter still being written: key and the raw value so far (partial reads only).
    pub open: Option<(&'a str, &'a str)>,
    /// A complete read took the last value to the end of the block, with no `</parameter>` that could close it:
    /// a `</tool_call>` there is part of that value, not the end of the call.
    pub unclosed: bool,
}

/// How a value ended.
enum ValueEnd {
    /// At a `</parameter>` (value length, where the rest of the body starts).
    Closed(usize, usize),
    /// Without `</parameter>`, at the next tag (value length = where the rest starts).
    Cut(usize),
    /// Not decided yet (partial reads).
    Open,
    /// Ran to the end of the block (complete reads).
    ToEnd(usize),
}

/// Reads the XML body of a tool call: `<function=NAME>`, then `<parameter=KEY>\nVALUE\n</parameter>` per
/// argument, then `</function>`, as the chat template writes them. `complete`: the block is all there is (its
/// `</tool_call>` arrived or the output ended); otherwise more text may follow and only what that text cannot
/// change is reported. `None` until the function name is complete, and for a block without `<function=`.
///
/// The template writes string values raw, so a value may itself contain `</parameter>`. A `</parameter>` closes
/// the value only when what follows it (after whitespace) is the next `<parameter=`, the `</function>`, or the
/// end of the call; any other `</parameter>` is part of the value. A value with no `</parameter>` before the
/// next `<parameter=` ends there (a model that forgot to close it, read as vLLM's parser does).
pub(super) fn parse_xml_call(block: &str, complete: bool) -> Option<XmlCall<'_>> {
    let after = &block[block.find(FUNCTION_START)? + FUNCTION_START.len()..];
    let name_end = after.find('>')?;
    let name = after[..name_end].trim();
    if name.is_empty() {
        return None;
    }
    let body = &after[name_end + 1..];
    let mut call = XmlCall { name, params: Vec::new(), open: None, unclosed: false };
    let mut pos = 0;
    loop {
        let rest = &body[pos..];
        let Some(start) = rest.find(PARAMETER_START) else { break };
        if rest.find(FUNCTION_END).is_some_and(|end| end < start) {
            break;
        }
        let tag = &rest[start + PARAMETER_START.len()..];
        let Some(key_end) = tag.find('>') else { break };
        let key = tag[..key_end].trim();
        let value = &tag[key_end + 1..];
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value_at = body.len() - value.len();
        match value_end(value, complete) {
            ValueEnd::Closed(len, next) => {
                call.params.push((key, drop_newline(&value[..len])));
                pos = value_at + next;
            }
            ValueEnd::Cut(len) => {
                call.params.push((key, drop_newline(&value[..len])));
                pos = value_at + len;
            }
            ValueEnd::ToEnd(len) => {
                call.params.push((key, drop_newline(&value[..len])));
                call.unclosed = len == value.len();
                break;
            }
            ValueEnd::Open => {
                call.open = Some((key, value));
                break;
            }
        }
    }
    Some(call)
}

/// `v` without one trailing newline.
fn drop_newline(v: &str) -> &str {
    v.strip_suffix('\n').unwrap_or(v)
}

/// Where the value at the start of `v` ends (see [`parse_xml_call`]).
fn value_end(v: &str, complete: bool) -> ValueEnd {
    let first_close = v.find(PARAMETER_END);
    if let Some(next) = v.find(PARAMETER_START)
        && first_close.is_none_or(|close| next < close)
    {
        return ValueEnd::Cut(next);
    }
    let mut from = 0;
    while let Some(found) = v[from..].find(PARAMETER_END) {
        let close = from + found;
        let after = &v[close + PARAMETER_END.len()..];
        let next = after.trim_start();
        if next.starts_with(PARAMETER_START) || next.starts_with(FUNCTION_END) {
            return ValueEnd::Closed(close, close + PARAMETER_END.len());
        }
        if next.is_empty() {
            return if complete { ValueEnd::Closed(close, close + PARAMETER_END.len()) } else { ValueEnd::Open };
        }
        if !complete && (PARAMETER_START.starts_with(next) || FUNCTION_END.starts_with(next)) {
            return ValueEnd::Open;
        }
        from = close + 1;
    }
    if !complete {
        return ValueEnd::Open;
    }
    // No `</parameter>` closes it: up to the call's `</function>` if the block ends with one, else everything.
    let trimmed = v.trim_end();
    match trimmed.strip_suffix(FUNCTION_END) {
        Some(before) => ValueEnd::ToEnd(before.len()),
        None => ValueEnd::ToEnd(v.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quoted_at(text: &str, needle: &str) -> bool {
        let at = text.find(needle).unwrap();
        CodeTracker::default().states(text)[at]
    }

    #[test]
    fn fences_and_spans_are_code() {
        assert!(quoted_at("Use\n```xml\n<tool_call>\n```\n", "<tool_call>"));
        assert!(quoted_at("Use\n~~~~\n<tool_call>\n~~~\nstill\n", "still"), "a shorter fence does not close");
        assert!(!quoted_at("Use\n~~~\n<tool_call>\n~~~\nafter\n", "after"));
        assert!(quoted_at("the `<tool_call>` tag", "<tool_call>"));
        assert!(!quoted_at("the `x` then <tool_call>", "<tool_call>"));
        assert!(quoted_at("a ``x ` <tool_call>`` b", "<tool_call>"));
        assert!(!quoted_at("an odd ` here\n\n<tool_call>", "<tool_call>"), "a blank line ends a span");
        assert!(quoted_at("```\n```x <tool_call>", "<tool_call>"), "not a closing fence: text after it");
        assert!(!quoted_at("  ```\ncode\n  ```  \n<tool_call>", "<tool_call>"));
        assert!(!quoted_at("<tool_call>", "<tool_call>"));
    }

    #[test]
    fn xml_values_keep_literal_closing_tags() {
        let block = "\n<function=f>\n<parameter=a>\nx</parameter>y\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n";
        let call = parse_xml_call(block, true).unwrap();
        assert_eq!(call.params, vec![("a", "x</parameter>y"), ("b", "2")]);
        // Partially written, the first value is not decided until the next tag shows.
        let cut = block.find("<parameter=b>").unwrap();
        let partial = parse_xml_call(&block[..cut - 1], false).unwrap();
        assert_eq!(partial.params, Vec::<(&str, &str)>::new());
        assert_eq!(partial.open, Some(("a", "x</parameter>y\n</parameter>")));
        let partial = parse_xml_call(&block[..cut + 3], false).unwrap();
        assert_eq!(partial.params, Vec::<(&str, &str)>::new(), "`<pa` may still become text");
        let partial = parse_xml_call(&block[..cut + PARAMETER_START.len()], false).unwrap();
        assert_eq!(partial.params, vec![("a", "x</parameter>y")]);
    }

    #[test]
    fn unclosed_values_end_at_the_next_tag() {
        let call = parse_xml_call("<function=f>\n<parameter=a>\n1\n<parameter=b>\n2\n</parameter>\n</function>", true)
            .unwrap();
        assert_eq!(call.params, vec![("a", "1"), ("b", "2")]);
        let call = parse_xml_call("<function=f>\n<parameter=a>\n1\n</function>\n", true).unwrap();
        assert_eq!((call.params, call.unclosed), (vec![("a", "1")], false));
        let call = parse_xml_call("<function=f>\n<parameter=code>\nprint('", true).unwrap();
        assert_eq!((call.params, call.unclosed), (vec![("code", "print('")], true));
    }
}
