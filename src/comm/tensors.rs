//! Collectives on tensors for communicators that move host memory (`Local`, `Gloo`):
//! CPU tensors — device memory on CPU devices — are read and written in place through
//! host views of their storage; tensors on another device go through host memory, one
//! copy each way (NCCL takes device tensors directly instead). 16-bit values are reduced
//! in fp32 and rounded once to their kind (NCCL sums them in their own kind).

use super::{Collective, CommError, Element, ReduceOp};
use crate::torch;
use tch::{Device, Tensor};
use tierzero_offload::convert::{f32_to_bf16, f32_to_f16};

/// An fp32 tensor all-reduced in place: a CPU tensor through a host view of its storage,
/// another device's through a host copy each way.
pub fn all_reduce<C: Collective + ?Sized>(comm: &C, data: &Tensor, op: ReduceOp) -> Result<(), CommError> {
    let fail = failure(comm.rank(), "all_reduce");
    let torch_err = |e: tch::TchError| fail(e.to_string());
    if data.kind() != tch::Kind::Float || !data.is_contiguous() {
        return Err(fail(format!(
            "an all-reduce of a tensor takes contiguous fp32; got {:?}",
            data.kind()
        )));
    }
    let n = data.numel();
    if comm.world() == 1 {
        // one rank's values are their own sum and mean
        return Ok(());
    }
    if data.device() == Device::Cpu {
        // SAFETY: the caller owns the tensor's elements for the collective.
        let values = unsafe { torch::host_slice_mut::<f32>(data, n) }.map_err(torch_err)?;
        return comm.all_reduce(values, op);
    }
    let mut host = vec![0f32; n];
    torch::copy_to_host(data, torch::pod_bytes_mut(&mut host)).map_err(torch_err)?;
    comm.all_reduce(&mut host, op)?;
    torch::copy_from_host(data, torch::pod_bytes(&host)).map_err(torch_err)
}

/// `out` (world × shard's elements, same kind) receives every rank's `shard` in rank
/// order, through host memory.
pub fn all_gather<C: Collective + ?Sized>(comm: &C, shard: &Tensor, out: &Tensor) -> Result<(), CommError> {
    let fail = failure(comm.rank(), "all_gather");
    let torch_err = |e: tch::TchError| fail(e.to_string());
    check_sizes(comm, "all_gather", shard, out)?;
    if comm.world() == 1 {
        // nothing to exchange: a copy on the device
        return out
            .shallow_clone()
            .f_copy_(&shard.f_view_as(out).map_err(torch_err)?)
            .map_err(torch_err);
    }
    if shard.device() != Device::Cpu || out.device() != Device::Cpu {
        let host_shard = shard
            .f_to(Device::Cpu)
            .map_err(torch_err)?
            .f_contiguous()
            .map_err(torch_err)?;
        let host_out = Tensor::f_empty([out.numel() as i64], (out.kind(), Device::Cpu)).map_err(torch_err)?;
        all_gather(comm, &host_shard, &host_out)?;
        let mut out = out.shallow_clone();
        return out
            .f_copy_(&host_out.f_view_as(&out).map_err(torch_err)?)
            .map_err(torch_err);
    }
    match shard.kind().elt_size_in_bytes() {
        4 => gather_as::<f32, C>(comm, shard, out),
        8 => gather_as::<f64, C>(comm, shard, out),
        2 => gather_as::<u16, C>(comm, shard, out),
        _ => Err(fail(format!("no all-gather of {:?}", shard.kind()))),
    }
}

/// The error of collective `op` on `rank`, with a message.
fn failure(rank: usize, op: &'static str) -> impl Fn(String) -> CommError {
    move |message| CommError::Shape { rank, op, message }
}

/// Checks that `whole` holds world × `piece`'s elements, of the same kind.
pub(super) fn check_sizes<C: Collective + ?Sized>(
    comm: &C,
    op: &'static str,
    piece: &Tensor,
    whole: &Tensor,
) -> Result<(), CommError> {
    if piece.kind() == whole.kind() && whole.numel() == piece.numel() * comm.world() {
        return Ok(());
    }
    Err(failure(comm.rank(), op)(format!(
        "this rank's piece has {} {:?}, the whole {} {:?}, world {}",
        piece.numel(),
        piece.kind(),
        whole.numel(),
        whole.kind(),
        comm.world()
    )))
}

/// Host views of two CPU tensors as `T`s of their element size: `input` to read, `out`
/// to write.
///
/// # Safety
/// `input` is only read for the views' lifetime (its owner does not write it while a
/// collective reads it); `out` is the caller's alone until the collective returns (the
/// lanes' contract: a gathered or reduced buffer is read only after its job's event).
// A tensor handle shares its storage, so the mutable view comes from a shared handle;
// exclusivity is the caller's contract (as for `torch::host_slice_mut`).
#[allow(clippy::mut_from_ref)]
pub(super) unsafe fn host_views<'t, T: Element>(
    rank: usize,
    op: &'static str,
    input: &'t Tensor,
    out: &'t Tensor,
) -> Result<(&'t [T], &'t mut [T]), CommError> {
    let torch_err = |e: tch::TchError| failure(rank, op)(e.to_string());
    // SAFETY: the caller's contract above.
    unsafe {
        Ok((
            torch::host_slice::<T>(input, input.numel()).map_err(torch_err)?,
            torch::host_slice_mut::<T>(out, out.numel()).map_err(torch_err)?,
        ))
    }
}

/// The all-gather on host views of two CPU tensors.
fn gather_as<T: Element, C: Collective + ?Sized>(
    comm: &C,
    shard: &Tensor,
    out: &Tensor,
) -> Result<(), CommError> {
    // SAFETY: the shard is only read; the output is this collective's (see `host_views`).
    let (shard, out) = unsafe { host_views::<T>(comm.rank(), "all_gather", shard, out) }?;
    comm.all_gather(shard, out)
}

/// Reduces `full` (world × out's elements, same kind) across ranks; this rank's slice
/// into `out`, through host memory.
pub fn reduce_scatter<C: Collective + ?Sized>(
    comm: &C,
    full: &Tensor,
    out: &Tensor,
    op: ReduceOp,
) -> Result<(), CommError> {
    let fail = failure(comm.rank(), "reduce_scatter");
    let torch_err = |e: tch::TchError| fail(e.to_string());
    check_sizes(comm, "reduce_scatter", out, full)?;
    if comm.world() == 1 {
        // one rank's values are their own reduction (a 16-bit value widened, reduced
        // alone and rounded back is itself): a copy on the device
        return out
            .shallow_clone()
            .f_copy_(&full.f_view_as(out).map_err(torch_err)?)
            .map_err(torch_err);
    }
    let on_host = full.device() == Device::Cpu && out.device() == Device::Cpu;
    match full.kind() {
        tch::Kind::Float if on_host => reduce_as::<f32, C>(comm, full, out, op),
        tch::Kind::Double if on_host => reduce_as::<f64, C>(comm, full, out, op),
        _ => WIDE.with(|wide| {
            // fp32 copies in host memory (16-bit values widened), the result rounded once
            // into `out`'s kind
            let (full32, out32, rounded) = &mut *wide.borrow_mut();
            full32.resize(full.numel(), 0.0);
            out32.resize(out.numel(), 0.0);
            torch::widen_to_f32(full, full32).map_err(torch_err)?;
            comm.reduce_scatter(full32, out32, op)?;
            let round: fn(f32) -> u16 = match out.kind() {
                tch::Kind::Float => {
                    return torch::copy_from_host(out, torch::pod_bytes(out32)).map_err(torch_err)
                }
                tch::Kind::BFloat16 => f32_to_bf16,
                tch::Kind::Half => f32_to_f16,
                other => return Err(fail(format!("no reduce-scatter of {other:?}"))),
            };
            rounded.clear();
            rounded.extend(out32.iter().map(|&x| round(x)));
            torch::copy_from_host(out, torch::pod_bytes(rounded)).map_err(torch_err)
        }),
    }
}

thread_local! {
    /// The fp32 input and output and the rounded result of a 16-bit reduction, kept per
    /// thread (the collectives lane calls one at a time) so that a step does not
    /// allocate a chunk's worth for each call.
    static WIDE: std::cell::RefCell<(Vec<f32>, Vec<f32>, Vec<u16>)> = Default::default();
}

/// The reduce-scatter on host views of two CPU tensors.
fn reduce_as<T: Element, C: Collective + ?Sized>(
    comm: &C,
    full: &Tensor,
    out: &Tensor,
    op: ReduceOp,
) -> Result<(), CommError> {
    // SAFETY: the input is only read; the output is this collective's (see `host_views`).
    let (full, out) = unsafe { host_views::<T>(comm.rank(), "reduce_scatter", full, out) }?;
    comm.reduce_scatter(full, out, op)
}
