//! TEMPORARY stub until the tokenizer branch lands.
pub mod tokenizer;
