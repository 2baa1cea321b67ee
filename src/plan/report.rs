//! The human form of a [`Plan`]: what `tierzero plan` prints.
//!
//! Model-state bytes per rank follow the ZeRO paper's accounting (Rajbhandari et al.,
//! 2020, §5): low-precision parameters, gradients and the fp32 optimizer state (master,
//! exp_avg, exp_avg_sq: 12 bytes per parameter), each divided by the world size from the
//! stage that shards it, and placed on the tier the config chooses.

use super::{Data, DataSource, EvalSplit, Plan, Scheduler, Tier};
use std::fmt::Write;

/// One row of the model-state table.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct StateRow {
    pub state: &'static str,
    pub tier: Tier,
    pub bytes_per_rank: u64,
    pub sharded: bool,
}

/// Model-state bytes per rank and where they live: a row per state and tier that holds
/// some of it (units are placed per tier: `rules::param_tiers`, `rules::optimizer_tiers`).
pub fn model_states(plan: &Plan) -> Vec<StateRow> {
    let world = plan.world_size as u64;
    let stage = plan.zero.stage;
    let numels = plan.model.config.unit_numels();
    // bytes_per_param: of each unit
    let rows =
        |state: &'static str, tiers: &[Tier], bytes_per_param: &[u64], sharded: bool| -> Vec<StateRow> {
            [Tier::Device, Tier::Cpu, Tier::Nvme]
                .into_iter()
                .filter_map(|tier| {
                    let units = || (0..numels.len()).filter(|&u| tiers[u] == tier);
                    let elements: u64 = units().map(|u| numels[u] as u64).sum();
                    let bytes: u64 = units().map(|u| numels[u] as u64 * bytes_per_param[u]).sum();
                    (elements > 0).then(|| StateRow {
                        state,
                        tier,
                        bytes_per_rank: if sharded { bytes.div_ceil(world) } else { bytes },
                        sharded,
                    })
                })
                .collect()
        };
    let low = vec![plan.precision.bytes() as u64; numels.len()];
    let optimizer_tiers = super::rules::optimizer_tiers(plan);
    let mut out: Vec<StateRow> = rows("parameters", &super::rules::param_tiers(plan), &low, stage >= 3);
    if stage >= 2 {
        // a unit's gradient shard sits next to its optimizer state, on NVMe too (as
        // DeepSpeed's optimizer swapper keeps it), in bf16 where `rules::bf16_gradients`
        // says so; a sum held on the device until the optimizer reads it
        // (`rules::held_gradients`) is there, in fp32
        let grad: Vec<u64> = crate::plan::rules::bf16_gradients(plan)
            .into_iter()
            .map(|bf16| if bf16 { 2 } else { 4 })
            .collect();
        let grad_tiers: Vec<Tier> = (optimizer_tiers.iter())
            .zip(crate::plan::rules::held_gradients(plan))
            .map(|(&tier, held)| if held { Tier::Device } else { tier })
            .collect();
        out.extend(rows("gradients", &grad_tiers, &grad, true));
    } else {
        out.extend(rows("gradients", &vec![Tier::Device; numels.len()], &low, false));
    }
    out.extend(rows(
        "optimizer states",
        &optimizer_tiers,
        &vec![12; numels.len()],
        stage >= 1,
    ));
    out
}

/// The local ranks of this node: this process's, or every process torchrun started here.
pub fn node_ranks(plan: &Plan) -> u64 {
    let local_processes = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(1);
    plan.train.devices as u64 * local_processes
}

/// Bytes of this node's NVMe swap files: every NVMe row of the model states, for each of
/// its ranks.
pub fn nvme_bytes(plan: &Plan) -> u64 {
    let per_rank: u64 = model_states(plan)
        .iter()
        .filter(|row| row.tier == Tier::Nvme)
        .map(|row| row.bytes_per_rank)
        .sum();
    per_rank * node_ranks(plan)
}

/// The tiers that hold some units, in forward order, as one name: "nvme", "cpu+nvme",
/// "device+cpu+nvme".
pub fn tiers_name(tiers: &[Tier]) -> String {
    let mut names: Vec<&str> = Vec::new();
    for t in tiers {
        if !names.contains(&t.name()) {
            names.push(t.name());
        }
    }
    names.join("+")
}

/// "units 0–6 on the device, 7–20 in host memory, 21–33 on nvme": the runs of units on
/// each tier in forward order; None when every unit is on one tier.
pub fn placement(tiers: &[Tier]) -> Option<String> {
    let place = |t: Tier| match t {
        Tier::Device => "on the device",
        Tier::Cpu => "in host memory",
        Tier::Nvme => "on nvme",
    };
    let mut runs: Vec<(usize, usize, Tier)> = Vec::new();
    for (u, &t) in tiers.iter().enumerate() {
        match runs.last_mut() {
            Some(run) if run.2 == t => run.1 = u,
            _ => runs.push((u, u, t)),
        }
    }
    (runs.len() > 1).then(|| {
        let parts: Vec<String> = runs
            .iter()
            .enumerate()
            .map(|(i, &(a, b, t))| {
                let units = if a == b {
                    format!("{a}")
                } else {
                    format!("{a}–{b}")
                };
                if i == 0 {
                    format!("units {units} {}", place(t))
                } else {
                    format!("{units} {}", place(t))
                }
            })
            .collect();
        parts.join(", ")
    })
}

pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// The plan as an aligned text table: the model, the batch, the training, and where
/// ZeRO puts the state with the memory each tier holds.
pub fn plan_table(plan: &Plan) -> String {
    let mut out = String::new();
    let m = &plan.model.config;
    let params = m.num_parameters();
    let units = m.unit_numels();
    let largest = units.iter().copied().max().unwrap_or(0);
    let _ = writeln!(out, "model");
    row(&mut out, "source", plan.model.source.clone());
    row(
        &mut out,
        "shape",
        format!(
            "{:?}: hidden {}, layers {}, heads {} (kv {}), ffn {}, vocab {}",
            m.architecture,
            m.hidden_size,
            m.num_hidden_layers,
            m.num_attention_heads,
            m.num_key_value_heads,
            m.intermediate_size,
            m.vocab_size
        ),
    );
    row(
        &mut out,
        "parameters",
        format!("{params} ({:.3} B)", params as f64 / 1e9),
    );
    row(
        &mut out,
        "units",
        format!("{} (largest {largest} parameters)", units.len()),
    );
    batch_rows(&mut out, plan);
    training_rows(&mut out, plan);
    zero_rows(&mut out, plan);
    out
}

/// One aligned row of the table.
fn row(out: &mut String, k: &str, v: String) {
    let _ = writeln!(out, "  {k:<28} {v}");
}

fn batch_rows(out: &mut String, plan: &Plan) {
    let _ = writeln!(out, "batch");
    let b = &plan.batch;
    row(
        out,
        "train_batch_size",
        format!(
            "{} = micro {} × accumulation {} × devices {}",
            b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps, plan.world_size
        ),
    );
    for choice in &plan.auto {
        row(
            out,
            &format!("\"auto\" {}", choice.key),
            format!("{} ({})", choice.value, choice.why),
        );
    }
    if plan.train.layered_accumulation {
        row(
            out,
            "accumulation order",
            "unit by unit (train.layered_accumulation): each unit fetched once each way a step, \
             every micro-batch's checkpoints held at once"
                .to_string(),
        );
    }
    row(out, "seq_len", plan.data.seq_len.to_string());
    row(out, "tokens per step", plan.tokens_per_step().to_string());
}

fn training_rows(out: &mut String, plan: &Plan) {
    let _ = writeln!(out, "training");
    row(out, "steps", plan.train.steps.to_string());
    row(out, "precision", plan.precision.name().to_string());
    let o = &plan.optimizer;
    row(
        out,
        "optimizer",
        format!(
            "{} lr {:e} betas ({}, {}) eps {:e} weight_decay {}",
            if o.decoupled { "AdamW" } else { "Adam (L2)" },
            o.lr,
            o.beta1,
            o.beta2,
            o.eps,
            o.weight_decay
        ),
    );
    let scheduler = match plan.scheduler {
        Scheduler::Constant => "constant".to_string(),
        other => format!("{other:?}"),
    };
    row(out, "scheduler", scheduler);
    row(
        out,
        "gradient_clipping",
        if plan.gradient_clipping > 0.0 {
            plan.gradient_clipping.to_string()
        } else {
            "off".into()
        },
    );
    row(
        out,
        "communication_data_type",
        format!("{} (gradients between ranks)", plan.communication.name()),
    );
    row(out, "data", describe_data(&plan.data));
}

/// The stage and the ranks, each state's bytes per tier, the parameters' placement, the
/// NVMe paths, and the device and host predictions (with the host budget's headroom).
fn zero_rows(out: &mut String, plan: &Plan) {
    let launch = &plan.train.launch;
    let nodes = if launch.nnodes > 1 {
        format!(
            " over {} nodes; this is node {} at {}:{}",
            launch.nnodes, launch.node_rank, launch.master_addr, launch.master_port
        )
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "zero (stage {}, {} ranks{nodes})",
        plan.zero.stage, plan.world_size
    );
    for s in model_states(plan) {
        row(
            out,
            s.state,
            format!(
                "{:>10.3} GiB per rank on {}{}",
                gib(s.bytes_per_rank),
                s.tier.name(),
                if s.sharded { " (sharded)" } else { "" }
            ),
        );
    }
    let tiers = super::rules::param_tiers(plan);
    if let Some(placed) = placement(&tiers) {
        let why = format!("offload_param.max_in_cpu {}", plan.zero.offload_param.max_in_cpu);
        row(out, "param placement", format!("{placed} ({why})"));
    }
    let offload = &plan.zero.offload_optimizer;
    if let Some(placed) = placement(&super::rules::optimizer_tiers(plan)) {
        let mut why = Vec::new();
        if offload.ratio < 1.0 {
            why.push(format!("offload_optimizer.ratio {}", offload.ratio));
        }
        if offload.tier == Tier::Nvme && offload.max_in_cpu > 0 {
            why.push(format!("train.optimizer_max_in_cpu {}", offload.max_in_cpu));
        }
        row(
            out,
            "optimizer placement",
            format!("{placed} ({})", why.join(", ")),
        );
    }
    for (what, path) in [
        ("offload_param.nvme_path", &plan.zero.offload_param.nvme_path),
        (
            "offload_optimizer.nvme_path",
            &plan.zero.offload_optimizer.nvme_path,
        ),
    ] {
        if let Some(p) = path {
            // parameters on NVMe that max_in_cpu keeps in host memory, or whose shards stay
            // on the device (`train.shards_on_device`), leave theirs unused
            let unused = what == "offload_param.nvme_path"
                && plan.zero.offload_param.tier == Tier::Nvme
                && !tiers.contains(&Tier::Nvme);
            let note = match (unused, tiers.contains(&Tier::Cpu), tiers.contains(&Tier::Device)) {
                (false, ..) => "",
                (true, true, true) => {
                    " (unused: every unit fits offload_param.max_in_cpu or keeps its shard on the device)"
                }
                (true, false, true) => " (unused: every unit keeps its shard on the device)",
                (true, ..) => " (unused: every unit fits offload_param.max_in_cpu)",
            };
            row(out, what, format!("{}{note}", p.display()));
        }
    }
    let device = crate::plan::memory::predict(plan);
    row(
        out,
        "device memory per rank",
        format!(
            "{:.3} GiB (params {:.3}, grads {:.3}, optimizer {:.3}, gathered units + activations {:.3}, compute temporaries {:.3})",
            gib(device.total),
            gib(device.parameters),
            gib(device.gradients),
            gib(device.optimizer),
            gib(device.working),
            gib(device.transient)
        ),
    );
    let host = crate::plan::host_memory::predict_host(plan);
    row(
        out,
        "host memory per process",
        format!(
            "{:.3} GiB (runtime {:.3}, params {:.3}, grads {:.3}, optimizer {:.3}, buffers {:.3}, working {:.3})",
            gib(host.total),
            gib(host.runtime),
            gib(host.parameters),
            gib(host.gradients),
            gib(host.optimizer),
            gib(host.buffers),
            gib(host.working)
        ),
    );
    if let Some(memory) = plan.train.host_memory {
        row(
            out,
            "host memory available",
            format!(
                "{:.3} GiB (train.host_memory): {:.3} GiB {}",
                gib(memory),
                gib(memory.abs_diff(host.total)),
                if memory >= host.total { "left" } else { "short" }
            ),
        );
    }
    let nvme = nvme_bytes(plan);
    if nvme > 0 {
        let room = match plan.train.nvme_space {
            Some(room) => format!(
                " of {:.3} GiB (train.nvme_space): {:.3} GiB {}",
                gib(room),
                gib(room.abs_diff(nvme)),
                if room >= nvme { "left" } else { "short" }
            ),
            None => String::new(),
        };
        row(
            out,
            "nvme swap files per node",
            format!("{:.3} GiB{room}", gib(nvme)),
        );
    }
    row(out, "sub_group_size", plan.zero.sub_group_size.to_string());
    row(out, "output_dir", plan.train.output_dir.display().to_string());
}

/// The data source in words, with the record options where they apply.
fn describe_data(data: &Data) -> String {
    let r = &data.records;
    match &data.source {
        DataSource::Synthetic { name } => format!("synthetic {name}"),
        DataSource::Tokens { path, dtype } => format!("{} ({dtype:?} tokens)", path.display()),
        DataSource::Text { path, tokenizer } => {
            let eval = match &r.eval {
                EvalSplit::Train => String::new(),
                EvalSplit::Fraction { fraction } => format!(", {:.0}% held out for eval", 100.0 * fraction),
                EvalSplit::Path { path } => format!(", eval on {}", path.display()),
            };
            if path.extension().and_then(|e| e.to_str()) == Some("txt") {
                return format!("{} (tokenizer {}{eval})", path.display(), tokenizer.display());
            }
            let records = format!(
                "records {}, {}",
                if r.packing { "packed" } else { "padded" },
                if r.train_on_prompt {
                    "every token trained"
                } else {
                    "completions and assistant turns trained"
                }
            );
            format!(
                "{} (tokenizer {}; {records}{eval})",
                path.display(),
                tokenizer.display()
            )
        }
    }
}
