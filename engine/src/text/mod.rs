//! Text in and out of the model: the Qwen3.8 tokenizer (`tokenizer.rs`), the chat template
//! that turns a conversation into the prompt, and the parser that splits generated text into reasoning, answer
//! and tool calls.

pub mod chat_template;
pub mod output;
pub mod tokenizer;
