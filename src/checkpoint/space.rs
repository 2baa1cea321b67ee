//! Whether the checkpoints a run keeps fit on the disk beside its NVMe swap files: the
//! check `plan` and `train` make at start-up, so a long run does not learn at its first
//! save (or its last) that the file system holding `output_dir` is too small.
//!
//! A checkpoint holds every parameter four times (fp32 master weights and both Adam
//! moments, the parameters in the training precision) and, with
//! `stage3_gather_16bit_weights_on_model_save`, once more in the training precision; a
//! save stages the new one before pruning, so `keep_last + 1` exist for a moment. The NVMe
//! tier's swap files of this node's ranks count when they live on the same file system;
//! a final save frees the gradients' swap files before it writes.

use crate::plan::disk::{bytes_under, file_system};
use crate::plan::report::model_states;
use crate::plan::report::node_ranks;
use crate::plan::{Plan, Tier};

/// Bytes one checkpoint of `plan` takes.
pub fn checkpoint_bytes(plan: &Plan) -> u64 {
    let params = plan.model.config.num_parameters() as u64;
    let low = plan.precision.bytes() as u64;
    let model = if plan.zero.gather_16bit_weights_on_model_save {
        low
    } else {
        0
    };
    params * (3 * 4 + low + model)
}

/// A warning when `output_dir`'s file system cannot hold the checkpoints `keep_last`
/// asks for (`train` always saves after its last step) beside this node's NVMe swap
/// files on the same file system; `None` when it fits or the space cannot be read.
pub fn warning(plan: &Plan) -> Option<String> {
    let output = &plan.train.output_dir;
    let (device, free) = file_system(output)?;
    // a restart: the checkpoints already saved are among those kept, their space is ours
    let saved = bytes_under(&super::save::root(output));
    let available = free + saved;
    let ranks = node_ranks(plan);
    let mut swap = 0u64;
    // what a final save takes from the swap files as they are (`engine/snapshot.rs`),
    // and the gradients' files it frees before it writes
    let mut taken = 0u64;
    let mut dead = 0u64;
    for row in model_states(plan) {
        let path = match row.state {
            "parameters" => &plan.zero.offload_param.nvme_path,
            _ => &plan.zero.offload_optimizer.nvme_path,
        };
        let on_this_disk = path
            .as_deref()
            .and_then(file_system)
            .is_some_and(|(d, _)| d == device);
        if row.tier == Tier::Nvme && on_this_disk {
            swap += row.bytes_per_rank * ranks;
            if row.state == "gradients" {
                dead += row.bytes_per_rank * ranks;
            } else {
                taken += row.bytes_per_rank * ranks;
            }
        }
    }
    let each = checkpoint_bytes(plan);
    // a run that saves only after its last step makes one checkpoint, with the state on
    // NVMe taken into it without a copy
    let steps = plan.train.steps;
    let only_final = plan.train.save_interval == 0 || plan.train.save_interval >= steps;
    let kept = if only_final {
        1
    } else {
        plan.train.keep_last.max(1) as u64 + 1
    };
    let needed = if only_final {
        // the checkpoints a restart finds stay until the new one is committed; the
        // step runs with every swap file, the save with the gradients' freed
        saved + swap.max(swap - dead + each.saturating_sub(taken))
    } else {
        kept * each + swap
    };
    (needed > available).then(|| {
        let gb = |b: u64| b as f64 / 1e9;
        format!(
            "{} is on a file system with {:.2} GB free (its saved checkpoints counted as free); {}{} need {:.2} GB: free space, lower train.keep_last or set train.output_dir elsewhere",
            output.display(),
            gb(available),
            if only_final {
                format!(
                    "the final checkpoint of {:.2} GB ({:.2} GB of it the swap files, taken as they are)",
                    gb(each),
                    gb(taken)
                )
            } else {
                format!(
                    "{kept} checkpoints of {:.2} GB (train.keep_last {} and the one being saved)",
                    gb(each),
                    plan.train.keep_last
                )
            },
            if swap > 0 {
                format!(" beside {:.2} GB of NVMe swap files on the same file system", gb(swap))
            } else {
                String::new()
            },
            gb(needed)
        )
    })
}
