//! AdamW with micro-batch gradient accumulation and global-norm clipping (burn's own clipping
//! is per tensor; the recipe clips the norm over all parameters together).

use std::path::Path;

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::record::AdaptorRecord;
use burn::optim::{AdamW, AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, ElementConversion, Tensor};

use crate::error::ModelError;

/// An optimiser for one module, accumulating gradients until `step`.
pub struct Trainable<B: AutodiffBackend, M: AutodiffModule<B>> {
    optim: OptimizerAdaptor<AdamW, M, B>,
    accum: GradientsAccumulator<M>,
    pending: usize,
    max_norm: f32,
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> Trainable<B, M> {
    /// AdamW (betas 0.9/0.999, eps 1e-8) with decoupled weight decay; `max_norm` 0 disables clipping.
    pub fn new(weight_decay: f32, max_norm: f32) -> Self {
        let optim = AdamWConfig::new()
            .with_weight_decay(weight_decay)
            .init::<B, M>();
        Self {
            optim,
            accum: GradientsAccumulator::new(),
            pending: 0,
            max_norm,
        }
    }

    /// Adds the gradients of one micro-batch's loss.
    pub fn backward(&mut self, module: &M, loss: Tensor<B, 1>) {
        let grads = GradientsParams::from_grads(loss.backward(), module);
        self.accum.accumulate(module, grads);
        self.pending += 1;
    }

    /// Adds the gradients of one micro-batch's loss given in parts (a layer-by-layer backward
    /// pass: see [`crate::model::recompute`]).
    pub fn backward_parts(&mut self, module: &M, parts: Vec<GradientsParams>) {
        for grads in parts {
            self.accum.accumulate(module, grads);
        }
        self.pending += 1;
    }

    /// Applies the accumulated gradients at learning rate `lr`; returns the module and the
    /// gradient norm before clipping (`None` when nothing was accumulated).
    pub fn step(&mut self, lr: f64, module: M) -> (M, Option<f32>) {
        if self.pending == 0 {
            return (module, None);
        }
        self.pending = 0;
        let mut grads = self.accum.grads();
        let norm = clip_global_norm::<B, M>(&module, &mut grads, self.max_norm);
        (self.optim.step(lr, module, grads), Some(norm))
    }

    /// Saves the optimiser state (moments and step counts) exactly.
    pub fn save(&self, path: &Path) -> Result<(), ModelError> {
        NamedMpkFileRecorder::<FullPrecisionSettings>::new()
            .record(self.optim.to_record(), path.to_path_buf())
            .map_err(|e| ModelError::Record(path.to_path_buf(), e))
    }

    /// Restores a state written by `save` (the module's parameter ids must be the saved ones,
    /// which they are when the module was loaded from the same checkpoint, and for adapters
    /// always). Moments come back in each parameter's own precision: burn reads every float
    /// of a record in the backend's default type, which for f32 adapters on a bf16 model
    /// would round them and mix types in the update.
    pub fn load(mut self, path: &Path, module: &M, device: &B::Device) -> Result<Self, ModelError> {
        let mut rec: Record<B, M> = NamedMpkFileRecorder::<FullPrecisionSettings>::new()
            .load(path.to_path_buf(), device)
            .map_err(|e| ModelError::Record(path.to_path_buf(), e))?;
        module.visit(&mut MomentDtypes::<B, M> { records: &mut rec });
        self.optim = self.optim.load_record(rec);
        Ok(self)
    }
}

/// Scales all gradients so their joint L2 norm is at most `max_norm` (0: no clipping);
/// returns the norm before scaling.
pub fn clip_global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    max_norm: f32,
) -> f32 {
    let mut sq = SquaredNorm::<B> { grads, total: None };
    module.visit(&mut sq);
    let norm = sq
        .total
        .map(|t| t.into_scalar().elem::<f32>().sqrt())
        .unwrap_or(0.0);
    if max_norm > 0.0 && norm > max_norm && norm.is_finite() {
        let mut scale = Scale::<B> {
            grads,
            factor: max_norm / (norm + 1e-6),
            _backend: std::marker::PhantomData,
        };
        module.visit(&mut scale);
    }
    norm
}

/// The optimiser's state: per-parameter records (burn keys them in its own map type).
type Record<B, M> = <OptimizerAdaptor<AdamW, M, B> as Optimizer<M, B>>::Record;

/// Casts each parameter's saved moments to the parameter's own float type.
struct MomentDtypes<'a, B: AutodiffBackend, M: AutodiffModule<B>> {
    records: &'a mut Record<B, M>,
}

impl<B: AutodiffBackend, M: AutodiffModule<B>> ModuleVisitor<B> for MomentDtypes<'_, B, M> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(record) = self.records.remove(&param.id) else {
            return;
        };
        let dtype = param.val().dtype();
        let mut state = record.into_state::<D>();
        let m = &mut state.momentum;
        m.moment_1 = m.moment_1.clone().cast(dtype);
        m.moment_2 = m.moment_2.clone().cast(dtype);
        m.max_moment_2 = m.max_moment_2.take().map(|t| t.cast(dtype));
        self.records
            .insert(param.id, AdaptorRecord::from_state::<D>(state));
    }
}

struct SquaredNorm<'a, B: AutodiffBackend> {
    grads: &'a GradientsParams,
    total: Option<Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for SquaredNorm<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            // In f32: adapters (f32) and a bf16 model's other parameters meet in one sum.
            let s = g.cast(DType::F32).powi_scalar(2).sum();
            self.total = Some(match self.total.take() {
                Some(t) => t + s,
                None => s,
            });
        }
    }
}

struct Scale<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    factor: f32,
    _backend: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.grads
                .register::<B::InnerBackend, D>(param.id, g * self.factor);
        }
    }
}
