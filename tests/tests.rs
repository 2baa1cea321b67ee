//! tierzero's integration tests, one binary; the module list is the table of contents.

mod adam_torch;
mod cli;
mod config;
mod estimate;
mod hf_reference;
mod model;
mod zero_equivalence;
