//! Weight block formats (placeholder until the quant module lands).
