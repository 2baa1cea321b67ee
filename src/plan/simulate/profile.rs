//! Hardware profiles: the rates the simulated step costs its work with, one file per
//! machine, each number with its source.
//!
//! A profile is data (`profiles/<name>.json`, or the file `tierzero bench profile`
//! writes). Compute is a table of measured or published rates by the work's shape:
//! the FLOP/s a unit's forward, its backward by recompute and the LM head reach at a
//! number of tokens and a hidden size (and, for the head, a vocabulary). A lookup takes
//! the nearest point in log space, so a profile measured at a config's own shapes
//! predicts that config exactly and one measured elsewhere predicts it approximately.
//! Copies, collectives, NVMe and the CPU AdamW are bandwidths and rates.

use serde::{Deserialize, Serialize};
use std::path::Path;

/// A number and where it came from (a measurement's command, or a public figure).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Figure {
    pub value: f64,
    pub source: String,
}

impl Figure {
    pub fn new(value: f64, source: impl Into<String>) -> Figure {
        Figure {
            value,
            source: source.into(),
        }
    }
}

/// What the work of a compute rate is.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Work {
    /// A unit's forward.
    Forward,
    /// A unit's backward by recompute: its forward again, then its backward.
    Backward,
    /// The final unit with the LM head and the loss: forward and backward.
    Head,
}

/// A compute rate at one shape.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Rate {
    pub work: Work,
    /// "fp32" or "bf16" (fp16 runs at bf16's rates).
    pub dtype: String,
    pub tokens: usize,
    pub hidden: usize,
    /// The head's vocabulary (0 for blocks).
    #[serde(default)]
    pub vocab: usize,
    /// Sequence length the rate was measured at (attention's share grows with it).
    #[serde(default)]
    pub seq_len: usize,
    /// FLOP/s as `simulate::flops` counts the work: with several ranks, at the pace they
    /// keep meeting after each run (the slowest of them each time).
    pub flops_per_s: f64,
    /// With several ranks, FLOP/s of a rank's own runs, without its waits for the others
    /// (the ranks' mean): what compute is priced at, as a run's ranks do not meet after
    /// every piece.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub own_flops_per_s: Option<f64>,
    pub source: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Compute {
    /// Torch threads per rank the CPU rates were measured with (0: a GPU's).
    #[serde(default)]
    pub threads: usize,
    /// Fixed cost of one piece of compute (a unit's forward or backward): kernel
    /// launches, framework overhead.
    pub overhead_s: Figure,
    /// The device's dense peak in the training precisions, what MFU divides by.
    pub peak_flops_bf16: Figure,
    pub peak_flops_fp32: Figure,
    pub rates: Vec<Rate>,
    /// On a CPU device, the share of compute's rate lost while another thread keeps a
    /// core busy beside it (torch's threads work in step, so the one that shares its
    /// core holds the others back; a second busy thread takes little more). None in a
    /// profile that predates it: one core's share of compute's cores.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost_beside_a_thread: Option<Figure>,
}

/// Bandwidths of every kind of copy, GB/s (10⁹ bytes per second).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Copies {
    pub h2d_pinned: Figure,
    pub h2d_pageable: Figure,
    pub d2h_pinned: Figure,
    pub d2h_pageable: Figure,
    pub device_to_device: Figure,
    /// One thread's memcpy between host buffers.
    pub host_memcpy: Figure,
    /// Every core's memcpy.
    pub host_memcpy_parallel: Figure,
    /// One thread's fp32 `a += b` over host buffers, in bytes of `b` per second.
    pub host_add: Figure,
    /// Every core's fp32 `a += b` (the engine's accumulator add on long stretches).
    pub host_add_parallel: Figure,
    /// What a blocking copy out of the device costs the host thread beyond the transfer
    /// (its wake-up once the copy has landed), once per staged stretch; none where a
    /// profile does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub d2h_wait_s: Option<Figure>,
    /// One thread's crc32c, GB/s: what the swap files' checksums cost the host per byte
    /// written or read (a memcpy's rate where a profile does not say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checksum: Option<Figure>,
}

/// The link collectives run over: a ring's bus bandwidth and a per-call latency.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Link {
    pub name: String,
    pub bus_gb_s: Figure,
    pub latency_s: Figure,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Nvme {
    pub read_gb_s: Figure,
    pub write_gb_s: Figure,
    /// The disk's rates over files of several sizes, where they differ: a virtual
    /// machine's disk whose host caches a few GB reads and writes a small file several
    /// times faster than a run's swap files. A run takes the row of the smallest file at
    /// least as large as its machine's swap files, else the largest; without rows, the
    /// figures above hold for any size.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub by_file_size: Vec<NvmeAt>,
    /// What the engine's transfers take beyond their bytes at the rates above. Absent:
    /// nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency: Option<NvmeLatency>,
    /// What the disk's transfers take from the host's cores beside their checksums.
    /// Absent: nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cores: Option<NvmeCores>,
}

/// The host's cores the disk takes while it reads and while it writes, every core busy:
/// the kernel's submissions and completions, and on a virtual machine the hypervisor's
/// work for its disk, taken from the guest's cores (`bench/disk_cores.rs`). The
/// simulation asks them for each transfer's time on the disk at the rates above.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct NvmeCores {
    pub while_reading: Figure,
    pub while_writing: Figure,
}

/// The engine's NVMe transfers beyond their bytes: a small transfer's way through the
/// store's ring threads and the drive's own latency, and the NVMe AdamW pipeline's own
/// time for a unit (its threads started and joined, the hand-offs between its legs).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct NvmeLatency {
    pub read_s: Figure,
    pub write_s: Figure,
    pub pipeline_s: Figure,
    /// A read and a write beside compute that holds the cores (a CPU device's torch
    /// threads): the store's threads wake into cores compute holds and wait for the
    /// scheduler to give them one. Absent (a GPU's compute needs no host core): as
    /// `read_s` and `write_s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_beside_compute_s: Option<Figure>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_beside_compute_s: Option<Figure>,
}

/// The disk's rates over one file size.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct NvmeAt {
    pub file_bytes: u64,
    pub read_gb_s: Figure,
    pub write_gb_s: Figure,
}

impl Nvme {
    /// (read, write) GB/s of the machine's disk for swap files of `bytes` in all.
    pub fn rates_for(&self, bytes: u64) -> (f64, f64) {
        let fits = self
            .by_file_size
            .iter()
            .filter(|r| r.file_bytes >= bytes)
            .min_by_key(|r| r.file_bytes);
        match fits.or_else(|| self.by_file_size.iter().max_by_key(|r| r.file_bytes)) {
            Some(r) => (r.read_gb_s.value, r.write_gb_s.value),
            None => (self.read_gb_s.value, self.write_gb_s.value),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CpuAdam {
    /// Parameters per second of the CPU AdamW with every core (fp32 master and moments).
    pub params_per_s: Figure,
    /// The same sweep as the NVMe pipeline's update runs it, on sub-groups just read,
    /// summing (crc32c) the state it reads and writes as it passes it, and the gradient
    /// where the profiled config stores it beside the state (`bench profile`):
    /// `params_per_s` where a profile does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summed_params_per_s: Option<Figure>,
}

/// One machine: its device, copies, link, disk and CPU optimizer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Profile {
    pub name: String,
    pub about: String,
    /// "cpu" (compute on the issuing thread, lanes as threads) or "cuda".
    pub device: String,
    pub device_memory_bytes: Figure,
    pub host_cores: usize,
    pub compute: Compute,
    pub copies: Copies,
    pub link: Link,
    pub nvme: Nvme,
    pub cpu_adam: CpuAdam,
}

/// The profiles shipped with tierzero (`profiles/*.json`).
pub const BUILT_IN: &[(&str, &str)] = &[
    ("h100-pcie5", include_str!("../../../profiles/h100-pcie5.json")),
    ("h200", include_str!("../../../profiles/h200.json")),
    ("rtx4090", include_str!("../../../profiles/rtx4090.json")),
];

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("profile {name:?}: no such built-in profile and no such file; built-in: {known}")]
    Unknown { name: String, known: String },
    #[error("profile {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("profile {path}: {source}; see profiles/h100-pcie5.json for the form")]
    Parse { path: String, source: serde_json::Error },
    #[error("profile {path}: {what}")]
    Invalid { path: String, what: String },
}

impl Profile {
    /// A built-in profile by name, or a profile file by path.
    pub fn load(name_or_path: &str) -> Result<Profile, ProfileError> {
        if let Some((_, text)) = BUILT_IN.iter().find(|(n, _)| *n == name_or_path) {
            return Profile::parse(text, name_or_path);
        }
        let path = Path::new(name_or_path);
        if !path.exists() {
            return Err(ProfileError::Unknown {
                name: name_or_path.into(),
                known: BUILT_IN.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
            });
        }
        let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Read {
            path: name_or_path.into(),
            source,
        })?;
        Profile::parse(&text, name_or_path)
    }

    /// Parses and checks a profile's JSON (`path` names it in errors).
    pub fn parse(text: &str, path: &str) -> Result<Profile, ProfileError> {
        let profile: Profile = serde_json::from_str(text).map_err(|source| ProfileError::Parse {
            path: path.into(),
            source,
        })?;
        let invalid = |what: String| ProfileError::Invalid {
            path: path.into(),
            what,
        };
        if profile.device != "cpu" && profile.device != "cuda" {
            return Err(invalid(format!(
                "device {:?}: use \"cpu\" or \"cuda\"",
                profile.device
            )));
        }
        for work in [Work::Forward, Work::Backward, Work::Head] {
            if !profile.compute.rates.iter().any(|r| r.work == work) {
                return Err(invalid(format!("compute.rates has no {work:?} rate")));
            }
        }
        if let Some(r) = profile.compute.rates.iter().find(|r| {
            [Some(r.flops_per_s), r.own_flops_per_s]
                .into_iter()
                .flatten()
                .any(|f| f.is_nan() || f <= 0.0)
        }) {
            return Err(invalid(format!(
                "compute.rates: {:?} at {} tokens × hidden {} has flops_per_s {} and own_flops_per_s {:?} (each must be > 0)",
                r.work, r.tokens, r.hidden, r.flops_per_s, r.own_flops_per_s
            )));
        }
        Ok(profile)
    }

    /// The machine as the plan's `"auto"` choices see it: a CUDA profile has bf16 and
    /// as many GPUs as a config asks for, each with the profile's memory.
    pub fn facts(&self) -> crate::plan::DeviceFacts {
        if self.is_cpu() {
            return crate::plan::DeviceFacts::default();
        }
        crate::plan::DeviceFacts {
            cuda_bf16: true,
            cpu_bf16: false,
            cuda_devices: 1024,
            cuda_memory: Some(self.device_memory_bytes.value as u64),
            host_memory: None,
        }
    }

    pub fn is_cpu(&self) -> bool {
        self.device == "cpu"
    }

    /// The rate of `work` in `dtype` nearest to the shape (tokens, hidden, vocab, seq) in
    /// log space; rates of the other dtype only when the profile has none of this one.
    pub fn rate(&self, work: Work, dtype: &str, shape: Shape) -> f64 {
        self.nearest(work, dtype, shape).map_or(1.0, |r| r.flops_per_s)
    }

    /// [`Self::rate`]'s own FLOP/s of one rank (`Rate::own_flops_per_s`, its pace
    /// where the profile has none).
    pub fn own_rate(&self, work: Work, dtype: &str, shape: Shape) -> f64 {
        self.nearest(work, dtype, shape)
            .map_or(1.0, |r| r.own_flops_per_s.unwrap_or(r.flops_per_s))
    }

    /// The rate [`Self::rate`] takes.
    fn nearest<'a>(&'a self, work: Work, dtype: &str, shape: Shape) -> Option<&'a Rate> {
        let dtype = if dtype == "fp16" { "bf16" } else { dtype };
        let of = |d: &str| -> Vec<&'a Rate> {
            self.compute
                .rates
                .iter()
                .filter(|r| r.work == work && r.dtype == d)
                .collect()
        };
        let distance = |r: &Rate| {
            let log = |a: usize, b: usize| ((a.max(1) as f64) / (b.max(1) as f64)).ln().abs();
            log(r.tokens, shape.tokens)
                + log(r.hidden, shape.hidden)
                + if work == Work::Head {
                    log(r.vocab, shape.vocab)
                } else {
                    0.0
                }
                + if r.seq_len > 0 {
                    0.5 * log(r.seq_len, shape.seq_len)
                } else {
                    0.0
                }
        };
        let nearest = |rates: Vec<&'a Rate>| {
            rates
                .into_iter()
                .min_by(|a, b| distance(a).total_cmp(&distance(b)))
        };
        nearest(of(dtype)).or_else(|| nearest(of(if dtype == "fp32" { "bf16" } else { "fp32" })))
    }

    /// The dense peak MFU is measured against, in the training precision: the profile's
    /// stated peak, or the fastest rate it measured at a shape where that is higher (a
    /// CPU's 1024³ matmul timed on a busy machine can come in under the blocks' own
    /// rates, and a utilisation above 100% tells nothing).
    pub fn peak_flops(&self, dtype: &str) -> f64 {
        let (stated, rates) = if dtype == "fp32" {
            (self.compute.peak_flops_fp32.value, "fp32")
        } else {
            (self.compute.peak_flops_bf16.value, "bf16")
        };
        let rates = self.compute.rates.iter().filter(|r| r.dtype == rates);
        rates.map(|r| r.flops_per_s).fold(stated, f64::max)
    }
}

/// The shape a compute rate is looked up at.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub tokens: usize,
    pub hidden: usize,
    pub vocab: usize,
    pub seq_len: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_built_in_profile_parses() {
        for (name, _) in BUILT_IN {
            let p = Profile::load(name).unwrap();
            assert_eq!(&p.name, name);
            assert!(!p.is_cpu());
        }
    }

    #[test]
    fn a_run_takes_the_disk_rates_of_the_smallest_file_that_holds_its_swap_files() {
        let figure = |v: f64| Figure::new(v, "test");
        let at = |gib: u64, read: f64| NvmeAt {
            file_bytes: gib << 30,
            read_gb_s: figure(read),
            write_gb_s: figure(2.0 * read),
        };
        let mut nvme = Nvme {
            read_gb_s: figure(9.0),
            write_gb_s: figure(9.5),
            by_file_size: Vec::new(),
            latency: None,
            cores: None,
        };
        assert_eq!(nvme.rates_for(100 << 30), (9.0, 9.5), "no rows: any size");
        nvme.by_file_size = vec![at(24, 1.0), at(2, 3.0), at(3, 2.0)];
        assert_eq!(nvme.rates_for(1 << 20), (3.0, 6.0));
        assert_eq!(nvme.rates_for(2 << 30), (3.0, 6.0));
        assert_eq!(nvme.rates_for((2 << 30) + 1), (2.0, 4.0));
        assert_eq!(nvme.rates_for(20 << 30), (1.0, 2.0));
        assert_eq!(
            nvme.rates_for(100 << 30),
            (1.0, 2.0),
            "beyond every row: the largest"
        );
    }

    #[test]
    fn an_unknown_profile_names_the_built_in_ones() {
        let e = Profile::load("h100-sxm9").unwrap_err().to_string();
        assert!(e.contains("h100-pcie5") && e.contains("rtx4090"), "{e}");
    }

    /// MFU's peak is never under a rate the profile measured: a CPU's peak matmul timed
    /// low beside the blocks' rates made a simulated step's MFU read 104%.
    #[test]
    fn the_peak_is_at_least_every_measured_rate() {
        let mut p = Profile::load("h100-pcie5").unwrap();
        let (fp32, bf16) = (p.peak_flops("fp32"), p.peak_flops("bf16"));
        assert_eq!(
            fp32, p.compute.peak_flops_fp32.value,
            "the shipped rates are under it"
        );
        let mut fast = p.compute.rates[0].clone();
        fast.dtype = "fp32".into();
        fast.flops_per_s = 2.0 * fp32;
        p.compute.rates.push(fast);
        assert_eq!(p.peak_flops("fp32"), 2.0 * fp32);
        assert_eq!(
            p.peak_flops("bf16"),
            bf16,
            "another precision's rates do not count"
        );
    }
}
