//! `tierzero bench memory`: peak device memory per rank, stage by stage.
//!
//! Trains a few steps of the same config at each requested ZeRO stage (offload settings
//! a stage cannot have are turned off) and reports each rank's measured peak next to the
//! plan's prediction, with the first stage's peak ÷ each stage's: the comparison a user
//! makes between DataParallel (stage 0) and ZeRO-3.

use crate::plan::memory::predict;
use crate::plan::{Plan, Tier};
use crate::run::{train, TrainError, TrainOptions};
use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct StageRow {
    pub stage: u8,
    pub predicted_bytes: u64,
    pub peak_bytes_per_rank: Vec<u64>,
    /// First stage's max peak ÷ this stage's.
    pub ratio_to_first: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct MemoryReport {
    pub devices: usize,
    pub parameters: usize,
    pub rows: Vec<StageRow>,
}

pub fn run(plan: &Plan, stages: &[u8]) -> Result<MemoryReport, TrainError> {
    let mut rows: Vec<StageRow> = Vec::new();
    for &stage in stages {
        if stage > 3 {
            return Err(TrainError::Stage(stage));
        }
        let mut p = plan.clone();
        p.zero.stage = stage;
        if stage < 3 {
            p.zero.offload_param.tier = Tier::Device;
        }
        if stage == 0 {
            p.zero.offload_optimizer.tier = Tier::Device;
        }
        let result = train(&p, TrainOptions::default())?;
        let peak = result.device_peaks.iter().copied().max().unwrap_or(0);
        let first = rows.first().map_or(peak, |r: &StageRow| {
            r.peak_bytes_per_rank.iter().copied().max().unwrap_or(0)
        });
        rows.push(StageRow {
            stage,
            predicted_bytes: predict(&p).reserved(),
            peak_bytes_per_rank: result.device_peaks,
            ratio_to_first: first as f64 / peak.max(1) as f64,
        });
    }
    Ok(MemoryReport {
        devices: plan.world_size,
        parameters: plan.model.config.num_parameters(),
        rows,
    })
}

impl MemoryReport {
    pub fn human(&self) -> String {
        let mut out = format!(
            "memory bench: {} parameters on {} devices\n{:>5} {:>14} {:>14} {:>8}\n",
            self.parameters, self.devices, "stage", "predicted MiB", "peak MiB/rank", "ratio"
        );
        for r in &self.rows {
            let peak = r.peak_bytes_per_rank.iter().copied().max().unwrap_or(0);
            out.push_str(&format!(
                "{:>5} {:>14.2} {:>14.2} {:>8.2}\n",
                r.stage,
                r.predicted_bytes as f64 / 1048576.0,
                peak as f64 / 1048576.0,
                r.ratio_to_first
            ));
        }
        out
    }
}
