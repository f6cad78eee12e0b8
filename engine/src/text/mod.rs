//! Text ↔ token ids: the Qwen3.8 tokenizer (design/tokenizer-and-template.md §1).

pub mod tokenizer;
