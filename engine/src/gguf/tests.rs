//! Tests against fixtures written by gguf-py and hand-made hostile files.
