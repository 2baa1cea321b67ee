//! A step's micro-batches unit by unit (`train.layered_accumulation`, "layered gradient
//! accumulation"): each unit is fetched once for the forward of every micro-batch and
//! once for their backward, where the micro-batch-major step fetches it for each
//! micro-batch both ways, and its gradient is summed over the micro-batches on the
//! compute device (fp32) and reduced once a step instead of once per micro-batch. So a
//! unit's gathers and reductions cost a step what one micro-batch's cost, for the
//! activation checkpoints of every micro-batch held at once; every unit recomputes its
//! forward in backward. With one rank the sums add the values the micro-batch-major
//! step adds, in the same order: the same bits, untied embeddings (a tied embedding adds
//! the head's share of every micro-batch first).

use super::error::EngineError;
use super::prefetch::Prefetcher;
use super::rank::RankEngine;
use crate::comm::Collective;
use crate::device::sim;
use crate::metrics::timeline::Phase;
use crate::plan::simulate::costs::Work;
use tch::{Kind, Tensor};

/// A unit's gradient summed over the step's micro-batches, in fp32 on the compute device.
#[derive(Default)]
struct Sum(Option<Tensor>);

impl Sum {
    /// Adds `g` (a flat gradient, or a tied head's share: the first elements of the
    /// unit's) into the sum; the first contribution is the sum, widened.
    fn add(&mut self, g: &Tensor, numel: usize) -> Result<(), tch::TchError> {
        match &mut self.0 {
            None if g.numel() == numel => self.0 = Some(g.f_to_kind(Kind::Float)?.f_contiguous()?),
            None => {
                let sum = Tensor::f_zeros([numel as i64], (Kind::Float, g.device()))?;
                let _ = sum.f_narrow(0, 0, g.numel() as i64)?.f_add_(g)?;
                self.0 = Some(sum);
            }
            Some(sum) => {
                let _ = sum.f_narrow(0, 0, g.numel() as i64)?.f_add_(g)?;
            }
        }
        // a GPU's add reads 2 or 4 bytes and writes 4 a gradient element
        sim::charge(Work::OnDevice(4 * g.numel() as u64));
        Ok(())
    }
}

impl<'a, C: Collective + Clone> RankEngine<'a, C> {
    /// Every micro-batch of `step` unit by unit: the forward of each unit for all of them,
    /// the final unit's loss and backward for all of them, the backward of each unit in
    /// reverse for all of them, each unit's summed gradient accumulated once. Returns the
    /// step's loss.
    pub(super) fn layered(
        &mut self,
        mut prefetch: Option<&mut Prefetcher<'a, C>>,
        step: u64,
        loss_scale: f64,
    ) -> Result<f64, EngineError> {
        let (world, rank) = (self.comms.main.world(), self.site.rank);
        let accumulation = self.plan.batch.gradient_accumulation_steps;
        self.checked_round = step << 24;
        let mut data = Vec::with_capacity(accumulation);
        let mut kept = Vec::new();
        for micro in 0..accumulation {
            let micro_data = self.micro_data(step, (micro * world + rank) as u64, loss_scale)?;
            kept.extend(self.reserve_tokens(&micro_data)?);
            data.push(micro_data);
        }
        let torch_err = self.torch_err();
        let numels: Vec<usize> = self.units.parts().iter().map(|p| p.numel).collect();
        let last = self.units.len() - 1;
        // forward: each micro-batch's input of every unit (its activation checkpoints)
        let mut inputs: Vec<Vec<Tensor>> = data.iter().map(|d| vec![d.tokens.shallow_clone()]).collect();
        for u in 0..last {
            let (params, _gathered) = self.fetch(prefetch.as_deref_mut(), u)?;
            for (m, d) in data.iter().enumerate() {
                let y = self.compute_span((Phase::Forward, Some(u)), |engine| {
                    engine.checked_delay(u, false)?;
                    let y = engine
                        .model
                        .forward_unit(u, &params, &inputs[m][u], d.segments.as_ref())?;
                    sim::charge(Work::Forward(u));
                    Ok(y)
                })?;
                let bytes = (y.numel() * self.plan.precision.bytes()) as u64;
                let what = format!("activation checkpoint of unit {} (micro-batch {m})", u + 1);
                kept.push(self.site.device.reserve(bytes, &what)?);
                inputs[m].push(y);
            }
        }
        // the final unit (and the tied embedding), each micro-batch's loss and backward
        let (params, gathered) = self.fetch(prefetch.as_deref_mut(), last)?;
        let tied = if self.model.config.tie_word_embeddings {
            Some(self.fetch(prefetch.as_deref_mut(), 0)?)
        } else {
            None
        };
        let (mut head, mut embedding) = (Sum::default(), Sum::default());
        let mut grad_outs = Vec::with_capacity(accumulation);
        let mut loss = 0.0;
        for (m, d) in data.iter().enumerate() {
            let out = self.compute_span((Phase::Backward, Some(last)), |engine| {
                engine.checked_delay(last, true)?;
                let tied = tied.as_ref().map(|t| &t.0);
                let out =
                    engine
                        .model
                        .backward_final(&params, tied, &inputs[m][last], &d.targets, d.weight)?;
                sim::charge(Work::Head);
                Ok(out)
            })?;
            head.add(&out.params, numels[last]).map_err(&torch_err)?;
            if let Some(t) = &out.tied {
                // the embedding's own gradient follows in backward
                embedding.add(&t.reshape([-1]), numels[0]).map_err(&torch_err)?;
            }
            loss += d.loss_share(out.loss_sum, out.count);
            grad_outs.push(out.input);
        }
        drop((params, gathered, tied));
        self.accumulate_sum(last, head)?;
        if self.overlap {
            self.optimizer.read_first_ahead();
        }
        // backward in reverse by recompute, each unit's checkpoints dropped after it
        for u in (0..last).rev() {
            let (params, _gathered) = self.fetch(prefetch.as_deref_mut(), u)?;
            let mut sum = if u == 0 {
                std::mem::take(&mut embedding)
            } else {
                Sum::default()
            };
            for (m, d) in data.iter().enumerate() {
                let (g, grad_in) = self.compute_span((Phase::Backward, Some(u)), |engine| {
                    engine.checked_delay(u, true)?;
                    let out = engine.model.backward_unit(
                        u,
                        &params,
                        &inputs[m][u],
                        &grad_outs[m],
                        d.segments.as_ref(),
                    )?;
                    sim::charge(Work::Backward(u));
                    Ok(out)
                })?;
                sum.add(&g, numels[u]).map_err(&torch_err)?;
                if let Some(d) = grad_in {
                    grad_outs[m] = d;
                }
                inputs[m].truncate(u);
            }
            self.accumulate_sum(u, sum)?;
        }
        drop(kept);
        Ok(loss)
    }

    /// Unit `u`'s gradient summed over the step into its accumulator, once.
    fn accumulate_sum(&mut self, u: usize, sum: Sum) -> Result<(), EngineError> {
        let Some(sum) = sum.0 else {
            return Err(EngineError::Invariant {
                rank: self.site.rank,
                what: "a unit with no gradient in a layered step",
            });
        };
        self.grads
            .accumulate(u, &sum, (&self.comms.main, &self.tracks.compute), false)
    }
}
