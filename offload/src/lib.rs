//! tierzero-offload: everything tierzero keeps off the GPU.
//!
//! - [`adam`]: the CPU AdamW step (scalar reference, portable, AVX2, AVX-512 kernels;
//!   rayon across cores) that updates fp32 master weights and moments in host memory.
//! - [`convert`]: fp32 ↔ bf16/fp16 conversions shared by the kernels.
//! - [`host`]: page-aligned host buffers (O_DIRECT- and DMA-ready).
//!
//! This crate links neither libtorch nor CUDA: it builds and tests on any machine.

pub mod adam;
pub mod convert;
pub mod host;
