//! Text in and out of the model: the chat template that turns a conversation into the prompt, and the parser
//! that splits generated text into reasoning, answer and tool calls.

pub mod chat_template;
pub mod output;
