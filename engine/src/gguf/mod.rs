//! GGUF v3 reader and writer (placeholder until the GGUF module lands).
