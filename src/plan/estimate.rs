//! DeepSpeed's ZeRO-3 model-state memory estimate, reproduced exactly.
//!
//! Source: `deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs` (its
//! documentation's golden table for 2851M parameters, 32M largest layer, 1 node × 8 GPUs
//! is a test). Per CPU it counts the node's host memory; per GPU one rank's device memory.
//! `additional_buffer_factor` is DeepSpeed's 1.5.

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct EstimateRow {
    pub offload_param: bool,
    pub offload_optimizer: bool,
    pub zero_init: bool,
    pub cpu_bytes: u64,
    pub gpu_bytes: u64,
}

const ADDITIONAL_BUFFER_FACTOR: f64 = 1.5;

/// One row of DeepSpeed's table.
pub fn estimate_row(
    params: u64,
    largest_layer: u64,
    gpus_per_node: u64,
    nodes: u64,
    offload_param: bool,
    offload_optimizer: bool,
    zero_init: bool,
) -> EstimateRow {
    let total_gpus = (gpus_per_node * nodes).max(1) as f64;
    let gpus_factor = 1.0 / nodes.max(1) as f64;
    let p = params as f64;
    let largest_layer_memory = 4.0 * largest_layer as f64;
    let per_node = 4.0 * gpus_per_node as f64;
    let (cpu, gpu) = if offload_optimizer {
        if offload_param {
            let factor = if zero_init {
                18.0 * gpus_factor
            } else {
                per_node.max(18.0 * gpus_factor)
            };
            (p * factor * ADDITIONAL_BUFFER_FACTOR, largest_layer_memory)
        } else {
            let factor = if zero_init {
                16.0 * gpus_factor
            } else {
                per_node.max(16.0 * gpus_factor)
            };
            (
                p * factor * ADDITIONAL_BUFFER_FACTOR,
                largest_layer_memory + (2.0 * p / total_gpus).floor(),
            )
        }
    } else {
        let cpu = if zero_init {
            largest_layer as f64 * per_node * ADDITIONAL_BUFFER_FACTOR
        } else {
            p * per_node * ADDITIONAL_BUFFER_FACTOR
        };
        (cpu, largest_layer_memory + (18.0 * p / total_gpus).floor())
    };
    EstimateRow {
        offload_param,
        offload_optimizer,
        zero_init,
        cpu_bytes: cpu as u64,
        gpu_bytes: gpu as u64,
    }
}

/// The full table in DeepSpeed's order.
pub fn estimate_table(params: u64, largest_layer: u64, gpus_per_node: u64, nodes: u64) -> Vec<EstimateRow> {
    let mut rows = Vec::new();
    for (offload_param, offload_optimizer) in [(true, true), (false, true), (false, false)] {
        for zero_init in [true, false] {
            rows.push(estimate_row(
                params,
                largest_layer,
                gpus_per_node,
                nodes,
                offload_param,
                offload_optimizer,
                zero_init,
            ));
        }
    }
    rows
}

/// The table as DeepSpeed prints it.
pub fn render(
    params: u64,
    largest_layer: u64,
    gpus_per_node: u64,
    nodes: u64,
    rows: &[EstimateRow],
) -> String {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let mut out = format!(
        "Estimated memory needed for params, optim states and gradients for a:\n\
         HW: Setup with {nodes} node(s), {gpus_per_node} GPU(s) per node.\n\
         SW: Model with {}M total params, {}M largest layer params.\n\
         \x20 per CPU  |  per GPU |   Options\n",
        params / 1_000_000,
        largest_layer / 1_000_000
    );
    for r in rows {
        let device = |on: bool| if on { "cpu " } else { "none" };
        out.push_str(&format!(
            "  {:>7.2}GB | {:>6.2}GB | offload_param={}, offload_optimizer={}, zero_init={}\n",
            gib(r.cpu_bytes),
            gib(r.gpu_bytes),
            device(r.offload_param),
            device(r.offload_optimizer),
            u8::from(r.zero_init)
        ));
    }
    out
}
