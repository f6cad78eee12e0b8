//! [`StreamDecoder`]: detokenization one id at a time, for streamed responses.

use super::{TextTokenizer, TokenizerError};

/// Turns generated ids into text as they arrive, never splitting a UTF-8 character.
///
/// Each token contributes its bytes (byte-level BPE tokens are arbitrary byte strings: an emoji is often two or
/// more tokens). [`push`](Self::push) returns the text completed so far and holds back the bytes of a character
/// that is not complete yet. Bytes that can never become a character are emitted as U+FFFD as soon as that is
/// certain, one U+FFFD per maximal invalid subsequence, exactly as [`TextTokenizer::decode`] (Rust's
/// `String::from_utf8_lossy`, the HF `ByteLevel` decoder's rule) shows them; [`finish`](Self::finish) flushes an
/// incomplete tail the same way. So the concatenation of every `push` and `finish` equals `decode` of all ids with
/// the same `skip_special`.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a TextTokenizer,
    skip_special: bool,
    /// Bytes of a character not yet complete (at most 3).
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    pub(super) fn new(tokenizer: &'a TextTokenizer, skip_special: bool) -> Self {
        Self { tokenizer, skip_special, pending: Vec::with_capacity(4) }
    }

    /// Adds token `id`; returns the text it completes (possibly empty).
    ///
    /// An id with no token adds nothing, as in [`TextTokenizer::decode`]. Never fails today; the `Result` is kept
    /// for callers.
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        let Some(bytes) = self.tokenizer.token_bytes(id) else { return Ok(String::new()) };
        if self.skip_special && self.tokenizer.is_control(id) {
            return Ok(String::new());
        }
        self.pending.extend_from_slice(bytes);
        Ok(self.drain_complete())
    }

    /// Bytes held back, waiting for the rest of their character.
    pub fn pending_bytes(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: an incomplete character left over becomes U+FFFD.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }

    /// Emits every complete character and every invalid sequence of `pending`, keeping only a tail that may still
    /// become a character.
    fn drain_complete(&mut self) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(text) => {
                    out.push_str(text);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // `valid` is valid UTF-8 by construction; lossy conversion is a plain copy here.
                    out.push_str(&String::from_utf8_lossy(valid));
                    match e.error_len() {
                        Some(invalid) => {
                            out.push('\u{FFFD}');
                            rest = &after[invalid..];
                        }
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let start = self.pending.len() - keep;
        self.pending.drain(..start);
        out
    }
}
