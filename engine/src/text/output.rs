//! Model output parsing (reasoning, content, tool calls).
