//! `"auto"` placements: which units' state goes to which tier when the config leaves it
//! to tierzero. In order: the optimizer state of as many units as fit the device
//! (`offload_optimizer.ratio: "auto"`, DeepSpeed's partial offload), then the parameters
//! of as many units as fit host memory (`offload_param.max_in_cpu: "auto"`; a byte of
//! parameters in host memory saves more NVMe traffic per step than a byte of optimizer
//! state: it is read every micro-batch), then the optimizer state of as many of the
//! remaining units as fit (`train.optimizer_max_in_cpu: "auto"`), the rest on NVMe. Each
//! choice is a prefix of the units in forward order, the largest whose prediction
//! (`memory::predict`, `host_memory::predict_host`) fits the budget, and `plan` prints it
//! with why.

use super::auto_batch::{budget, fits_budget};
use super::{AutoChoice, DeviceFacts, Plan, Tier};

/// Of host memory, what an `"auto"` placement may fill: the rest is left to the page
/// cache (the NVMe files are read through it when O_DIRECT is off) and whatever else the
/// machine runs.
pub const HOST_MARGIN: f64 = 0.9;

/// Element counts of every prefix of `numels`, longest first, down to none.
fn prefixes(numels: &[usize]) -> Vec<usize> {
    let mut sums = vec![0usize];
    for &n in numels {
        sums.push(sums.last().copied().unwrap_or(0) + n);
    }
    sums.reverse();
    sums
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / f64::from(1u32 << 30))
}

/// `offload_optimizer.ratio: "auto"`: the most units, in forward order, whose optimizer
/// state (and gradient partition) fits on the device beside everything else the plan
/// holds there (`after_speedups`: gradient sums, kept units and activations already
/// decided; else before them, with the sums only where the config asks for them).
/// Without a device budget (a CPU device without `train.device_memory`), DeepSpeed's
/// default: everything offloaded.
pub(super) fn fit_optimizer_on_device(plan: &mut Plan, facts: DeviceFacts, after_speedups: bool) {
    const KEY: &str = "zero_optimization.offload_optimizer.ratio";
    let offload = &plan.zero.offload_optimizer;
    if !offload.ratio_auto || offload.tier == Tier::Device {
        return;
    }
    let (Some(memory), what) = budget(plan, facts) else {
        plan.zero.offload_optimizer.ratio = 1.0;
        plan.auto.push(AutoChoice {
            key: KEY,
            value: 1.0,
            why: "the device's memory is unknown (a CPU device without train.device_memory): DeepSpeed's default, everything offloaded".into(),
        });
        return;
    };
    let n = plan.model.config.unit_numels().len();
    let with = |k: usize| {
        let mut p = plan.clone();
        if !after_speedups {
            p.zero.device_accumulation = plan.train.accumulate_on_device.unwrap_or(false);
        }
        // the fraction offloaded that leaves exactly k units on the device
        p.zero.offload_optimizer.ratio = (n - k) as f64 / n as f64;
        while super::rules::optimizer_tiers(&p)
            .iter()
            .filter(|&&t| t == Tier::Device)
            .count()
            < k
        {
            p.zero.offload_optimizer.ratio -= f64::EPSILON;
        }
        p
    };
    let k = (0..=n).rev().find(|&k| fits_budget(&with(k), facts)).unwrap_or(0);
    let chosen = with(k);
    plan.zero.offload_optimizer.ratio = chosen.zero.offload_optimizer.ratio;
    let device = super::memory::predict(&chosen).total;
    plan.auto.push(AutoChoice {
        key: KEY,
        value: chosen.zero.offload_optimizer.ratio,
        why: format!(
            "{k} of {n} units keep their optimizer state on the device, the most that fit {what}: it then holds {} of {}",
            gib(device),
            gib(memory)
        ),
    });
}

/// Places the first `n` elements' state of one kind in host memory.
type Set = fn(&mut Plan, usize);

/// The largest of `candidates` (element counts, largest first) whose placement, made by
/// `set`, keeps the process's host prediction within [`HOST_MARGIN`] of
/// `train.host_memory` and leaves a plan `rest_fits` accepts (the largest within the host
/// budget when none does); the choice and why, for `key`, with `what` the state placed.
fn fill_host(
    plan: &mut Plan,
    (key, what): (&'static str, &str),
    candidates: &[usize],
    (set, rest_fits): (Set, fn(&Plan) -> bool),
) {
    let Some(memory) = plan.train.host_memory else {
        return;
    };
    let budget = (memory as f64 * HOST_MARGIN) as u64;
    let share = format!("{:.0}% of train.host_memory", HOST_MARGIN * 100.0);
    let host_bytes = |n: usize| {
        let mut p = plan.clone();
        set(&mut p, n);
        super::host_memory::predict_host(&p).total
    };
    let within: Vec<usize> = candidates
        .iter()
        .copied()
        .filter(|&n| host_bytes(n) <= budget)
        .collect();
    let rest_fits_with = |n: usize| {
        let mut p = plan.clone();
        set(&mut p, n);
        rest_fits(&p)
    };
    let chosen = within
        .iter()
        .copied()
        .find(|&n| rest_fits_with(n))
        .or(within.first().copied());
    let value = chosen.unwrap_or(0);
    let why = match chosen {
        Some(n) => format!(
            "the units whose {what} fit in host memory, the rest within the NVMe path's room: the process then holds {} of {} ({share} {})",
            gib(host_bytes(n)),
            gib(budget),
            gib(memory)
        ),
        None => format!(
            "even with every unit's {what} on NVMe the process holds {}, over {} ({share} {}): none stays in host memory",
            gib(host_bytes(0)),
            gib(budget),
            gib(memory)
        ),
    };
    set(plan, value);
    plan.auto.push(AutoChoice {
        key,
        value: value as f64,
        why,
    });
}

/// Parameters on NVMe with `offload_param.max_in_cpu: "auto"`: the most units, in forward
/// order, whose parameters fit in host memory beside everything else the process holds
/// there (`host_memory::predict_host` at most [`HOST_MARGIN`] of `train.host_memory`);
/// without a known budget, DeepSpeed's default of 1e9 elements.
pub(super) fn fit_params_in_host(plan: &mut Plan) {
    const KEY: &str = "zero_optimization.offload_param.max_in_cpu";
    let param = &plan.zero.offload_param;
    if !param.max_in_cpu_auto || param.tier != Tier::Nvme {
        return;
    }
    if plan.train.host_memory.is_none() {
        plan.auto.push(AutoChoice {
            key: KEY,
            value: plan.zero.offload_param.max_in_cpu as f64,
            why: "the host memory is unknown (set train.host_memory): DeepSpeed's default".into(),
        });
        return;
    }
    let candidates = prefixes(&plan.model.config.unit_numels());
    // parameters in host memory save the most NVMe traffic, but take host memory the
    // optimizer state would otherwise keep off the disk: the most parameter units that
    // still leave the optimizer's placement within the NVMe path's room
    let set: Set = |p, n| p.zero.offload_param.max_in_cpu = n;
    let rest_fits: fn(&Plan) -> bool = |p| {
        let mut p = p.clone();
        fit_optimizer_in_host(&mut p);
        p.train
            .nvme_space
            .is_none_or(|room| super::report::nvme_bytes(&p) <= room)
    };
    fill_host(plan, (KEY, "parameters"), &candidates, (set, rest_fits));
}

/// Optimizer state on NVMe with `train.optimizer_max_in_cpu: "auto"`: the most units, in
/// forward order after those on the device, whose optimizer state (and gradient
/// partition) fits in host memory beside everything else the process holds there;
/// without a known budget, none (DeepSpeed swaps all of it).
pub(super) fn fit_optimizer_in_host(plan: &mut Plan) {
    const KEY: &str = "train.optimizer_max_in_cpu";
    let offload = &plan.zero.offload_optimizer;
    if !offload.max_in_cpu_auto || offload.tier != Tier::Nvme {
        return;
    }
    if plan.train.host_memory.is_none() {
        plan.zero.offload_optimizer.max_in_cpu = 0;
        plan.auto.push(AutoChoice {
            key: KEY,
            value: 0.0,
            why: "the host memory is unknown (set train.host_memory): all on NVMe, as DeepSpeed swaps it"
                .into(),
        });
        return;
    }
    let tiers = super::rules::optimizer_tiers(&{
        let mut p = plan.clone();
        p.zero.offload_optimizer.max_in_cpu = 0;
        p
    });
    let offloaded: Vec<usize> = plan
        .model
        .config
        .unit_numels()
        .into_iter()
        .zip(tiers)
        .filter(|(_, t)| *t != Tier::Device)
        .map(|(n, _)| n)
        .collect();
    let set: Set = |p, n| p.zero.offload_optimizer.max_in_cpu = n;
    fill_host(
        plan,
        (KEY, "optimizer state"),
        &prefixes(&offloaded),
        (set, |_| true),
    );
}
