//! What a run starts from: the model, the data, the swap stores and where the state
//! starts (seeded init, Hugging Face weights, a checkpoint); and `eval` on the same.

use super::comms::local_comms;
use super::error::TrainError;
use super::stores::open_stores;
use crate::checkpoint::Checkpoint;
use crate::comm::Collective;
use crate::data::Dataset;
use crate::device::cpu::CpuDevice;
use crate::engine::context::{LaneOptions, RankContext};
use crate::engine::rank::{kind_for, RankEngine};
use crate::engine::start::Start;
use crate::metrics::timeline::Timeline;
use crate::model::Model;
use crate::plan::simulate::profile::Profile;
use crate::plan::Plan;
use tierzero_offload::nvme::swap::SwapStore;

/// The model's starting weights per unit: `model.hf_dir`'s, or the seeded init.
pub fn initial_weights(plan: &Plan) -> Result<Vec<Vec<f32>>, TrainError> {
    if let Some(dir) = &plan.model.hf_dir {
        return Ok(crate::model::hf::load(dir, &plan.model.config)?);
    }
    Ok(crate::model::layout::units(&plan.model.config)
        .iter()
        .map(|u| {
            let mut flat = vec![0f32; u.numel];
            u.init(plan.train.seed, &mut flat);
            flat
        })
        .collect())
}

/// Trains `plan.train.steps` steps on `plan.world_size` CPU ranks.
/// What every rank of a run shares, built once per run.
pub(super) struct Prepared {
    pub(super) model: Model,
    pub(super) dataset: Dataset,
    pub(super) optimizer_store: Option<SwapStore>,
    pub(super) param_store: Option<SwapStore>,
    pub(super) start: Start,
}

impl Prepared {
    pub(super) fn new(plan: &Plan, resume: Option<&std::path::Path>) -> Result<Prepared, TrainError> {
        let head = if plan.train.low_precision_head {
            crate::model::head::Matmul::Low
        } else {
            crate::model::head::Matmul::Fp32
        };
        let model = Model::new(plan.model.config.clone(), kind_for(&plan.precision)).with_head(head);
        let dataset = Dataset::open(plan)?;
        if dataset.vocab_needed() > model.config.vocab_size {
            return Err(TrainError::VocabTooSmall {
                needed: dataset.vocab_needed(),
                vocab: model.config.vocab_size,
            });
        }
        let (optimizer_store, param_store) = open_stores(plan, &model)?;
        let start = match (resume, &plan.model.hf_dir) {
            (Some(dir), _) => {
                let checkpoint = Checkpoint::open(dir)?;
                checkpoint.manifest.check_model(dir, &model.config)?;
                let saved = &checkpoint.manifest.data;
                if saved.train_batch_size != plan.batch.train_batch_size || saved.seq_len != plan.data.seq_len
                {
                    tracing::warn!(
                        "{} was saved with {} sequences × {} tokens per step; this run uses {} × {}, so the data after step {} differs from the original run's",
                        dir.display(),
                        saved.train_batch_size,
                        saved.seq_len,
                        plan.batch.train_batch_size,
                        plan.data.seq_len,
                        saved.step
                    );
                }
                Start::Checkpoint(Box::new(checkpoint))
            }
            (None, Some(hf_dir)) => Start::Hf(crate::model::hf::HfWeights::open(hf_dir, &model.config)?),
            (None, None) => Start::Init {
                seed: plan.train.seed,
            },
        };
        Ok(Prepared {
            model,
            dataset,
            optimizer_store,
            param_store,
            start,
        })
    }

    pub(super) fn context<'a>(
        &'a self,
        plan: &'a Plan,
        timeline: Option<&'a Timeline>,
        overlap: bool,
        lanes: LaneOptions,
        simulate: Option<&'a Profile>,
    ) -> RankContext<'a> {
        RankContext {
            plan,
            model: &self.model,
            dataset: &self.dataset,
            optimizer_store: self.optimizer_store.as_ref(),
            param_store: self.param_store.as_ref(),
            start: &self.start,
            timeline,
            overlap,
            lanes,
            simulate,
        }
    }
}

/// Mean loss over `train.eval_batches` held-out batches, on every rank, without training,
/// of `checkpoint`'s weights or the plan's starting ones.
pub fn evaluate(plan: &Plan, checkpoint: Option<&std::path::Path>) -> Result<f64, TrainError> {
    if plan.train.launch.nnodes > 1 {
        return Err(TrainError::OneProcess(
            "tierzero eval runs in one process; drop --nnodes (or train.nnodes)",
        ));
    }
    let prepared = Prepared::new(plan, checkpoint)?;
    let world = plan.world_size;
    let losses: Vec<Result<f64, TrainError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = local_comms(world, false)
            .into_iter()
            .map(|comms| {
                let context = prepared.context(plan, None, true, LaneOptions::from_env(), None);
                scope.spawn(move || -> Result<f64, TrainError> {
                    let guard = comms.clone();
                    let run = || -> Result<f64, TrainError> {
                        let device =
                            CpuDevice::new(comms.main.rank(), plan.train.device_memory.unwrap_or(u64::MAX));
                        let mut engine = RankEngine::new(comms, context, device)?;
                        Ok(engine.eval(plan.train.eval_batches)?)
                    };
                    run().inspect_err(|e| guard.abort(&e.to_string()))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(Err(TrainError::ThreadPanicked)))
            .collect()
    });
    losses.into_iter().next().unwrap_or(Ok(f64::NAN))
}
