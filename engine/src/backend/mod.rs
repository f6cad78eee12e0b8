//! Compute backends beside the CPU model in [`crate::model`]: today CUDA ([`cuda`]), all weights on one GPU.

pub mod cuda;
