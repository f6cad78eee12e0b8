//! The CPU routed-expert kernel (placeholder while the kernel is written).
