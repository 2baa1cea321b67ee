//! tierzero's integration tests, one binary; the module list is the table of contents.

mod adam_torch;
mod breakdown;
mod checkpoint;
mod checkpoint_crash;
mod checkpoint_process;
mod cli;
mod config;
mod cuda;
mod default_run;
mod disk_faults;
mod estimate;
mod hf_reference;
mod host_memory;
mod launch;
mod memory;
mod model;
mod monitors;
mod multiprocess;
mod precision;
mod preemption;
mod recall;
mod rendezvous;
mod simulate;
mod text_data;
mod torch_reference;
mod zero_equivalence;
