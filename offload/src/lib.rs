//! tierzero-offload: everything tierzero keeps off the GPU.
//!
//! - [`adam`]: the CPU AdamW step (scalar reference, portable, AVX2, AVX-512 kernels;
//!   rayon across cores) that updates fp32 master weights and moments in host memory.
//! - [`convert`]: fp32 ↔ bf16/fp16 conversions shared by the kernels.
//! - [`crc`]: crc32c summed in pieces and joined, for checksums taken where the bytes pass.
//! - [`host`]: page-aligned host buffers (O_DIRECT- and DMA-ready).
//! - [`pool`]: I/O buffers that move into an operation and back, and their bounded pool.
//! - [`nvme`]: block I/O (io_uring with O_DIRECT and fixed buffers; a pread fallback)
//!   and the swap store that keeps optimizer state in NVMe files, checksummed.
//! - [`pipeline`]: the optimizer step over NVMe-resident state: read i+1 | update i | write i−1.
//!
//! This crate links neither libtorch nor CUDA: it builds and tests on any machine.

pub mod adam;
pub mod arena;
pub mod convert;
pub mod crc;
pub mod host;
pub mod nvme;
pub mod pipeline;
pub mod pool;

#[cfg(test)]
mod pipeline_tests;
