//! tierzero's integration tests, one binary; the module list is the table of contents.

mod adam_torch;
mod cli;
mod config;
mod estimate;
mod model;
mod zero_equivalence;
