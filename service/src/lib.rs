//! Nebula's HTTP service: the OpenAI-compatible API in front of the engine.
