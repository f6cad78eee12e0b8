//! GPT-2's reversible byte ↔ character map, in which byte-level BPE vocabularies (tokenizer.json `model.vocab`,
//! GGUF `tokenizer.ggml.tokens`) spell their tokens (GPT-2's `bytes_to_unicode`).
//!
//! The 188 printable bytes `!`..=`~`, `¡`..=`¬` and `®`..=`ÿ` stand for themselves (as the Latin-1 character of the
//! same value); the other 68 bytes map, in increasing byte order, to U+0100, U+0101, … (space 0x20 is `Ġ` U+0120).

/// First character used for the non-printable bytes.
const SHIFTED_BASE: u32 = 0x100;
/// Number of non-printable bytes (256 − 188).
const SHIFTED_COUNT: u32 = 68;

fn is_printable(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// The character that spells byte `b`.
pub(crate) fn char_of(b: u8) -> char {
    if is_printable(b) {
        return char::from(b);
    }
    let shifted_below = (0..b).filter(|&x| !is_printable(x)).count() as u32;
    char::from_u32(SHIFTED_BASE + shifted_below).unwrap_or('\u{FFFD}')
}

/// `bytes` spelled in map characters (how a byte-level vocabulary writes a token).
#[cfg(test)]
pub(crate) fn spell(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| char_of(b)).collect()
}

/// The character → byte direction, built once per tokenizer (a few hundred bytes).
#[derive(Clone, Debug)]
pub(crate) struct ByteLevelMap {
    /// Indexed by character value `0..SHIFTED_BASE + SHIFTED_COUNT`.
    to_byte: Vec<Option<u8>>,
}

impl ByteLevelMap {
    pub(crate) fn new() -> Self {
        let mut to_byte = vec![None; (SHIFTED_BASE + SHIFTED_COUNT) as usize];
        for b in 0..=255u8 {
            to_byte[char_of(b) as usize] = Some(b);
        }
        Self { to_byte }
    }

    /// The byte spelled by `c`, if `c` is one of the 256 map characters.
    pub(crate) fn byte_of(&self, c: char) -> Option<u8> {
        self.to_byte.get(c as usize).copied().flatten()
    }

    /// The bytes a token stands for, as the HF `ByteLevel` decoder computes them: every character mapped back to
    /// its byte when all of them are map characters, otherwise the token's own UTF-8 bytes (added tokens such as
    /// `<|im_end|>` are printable ASCII, so both rules give the same bytes for them).
    pub(crate) fn token_bytes(&self, token: &str) -> Vec<u8> {
        token.chars().map(|c| self.byte_of(c)).collect::<Option<Vec<u8>>>().unwrap_or_else(|| token.as_bytes().to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_is_a_bijection_with_gpt2_spellings() {
        let m = ByteLevelMap::new();
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = char_of(b);
            assert!(seen.insert(c), "char {c:?} used twice");
            assert_eq!(m.byte_of(c), Some(b));
        }
        assert_eq!(char_of(b' '), 'Ġ');
        assert_eq!(char_of(b'\n'), 'Ċ');
        assert_eq!(char_of(b'\t'), 'ĉ');
        assert_eq!(char_of(0), 'Ā');
        assert_eq!(char_of(b'!'), '!');
        assert_eq!(char_of(0xAD), 'Ń');
        assert_eq!(char_of(0xA0), 'ł');
        assert_eq!(spell("é".as_bytes()), "Ã©");
        assert_eq!(m.token_bytes("Ã©"), "é".as_bytes());
        assert_eq!(m.token_bytes("<|im_end|>"), b"<|im_end|>");
        // a character outside the map: the token's own UTF-8 bytes
        assert_eq!(m.token_bytes("中"), "中".as_bytes());
        assert_eq!(m.byte_of('中'), None);
    }
}
