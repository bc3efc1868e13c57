//! Low-rank adapters (LoRA): a frozen base layer `W` plus `scale · (x A) B`, with `A` `[in, r]`
//! and `B` `[r, out]` trained in f32 while the base stays in the model's precision. `B` starts
//! at zero, so an adapted model starts as its base.
//!
//! The trainer fuses the query, key and value projections into one layer, and the gate and up
//! projections into another; an adapter on such a layer holds one `A`/`B` pair per adapted
//! part (Hugging Face's PEFT adapts each projection on its own, and the export is its layout).

use burn::module::{Module, Param, ParamId};
use burn::tensor::{backend::Backend, DType, Distribution, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use super::transformer::{Backbone, Block, Dense};
use super::weights::NamedTensors;
use crate::error::ModelError;

/// A projection of a decoder layer an adapter can sit on (PEFT's module names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoraTarget {
    /// Attention query projection.
    QProj,
    /// Attention key projection.
    KProj,
    /// Attention value projection.
    VProj,
    /// Attention output projection.
    OProj,
    /// MLP gate projection.
    GateProj,
    /// MLP up projection.
    UpProj,
    /// MLP down projection.
    DownProj,
}

impl LoraTarget {
    /// Every projection, in the order of a decoder layer.
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::QProj,
        LoraTarget::KProj,
        LoraTarget::VProj,
        LoraTarget::OProj,
        LoraTarget::GateProj,
        LoraTarget::UpProj,
        LoraTarget::DownProj,
    ];

    /// The module name (`q_proj`, ...), as PEFT and Hugging Face write it.
    pub fn name(self) -> &'static str {
        match self {
            LoraTarget::QProj => "q_proj",
            LoraTarget::KProj => "k_proj",
            LoraTarget::VProj => "v_proj",
            LoraTarget::OProj => "o_proj",
            LoraTarget::GateProj => "gate_proj",
            LoraTarget::UpProj => "up_proj",
            LoraTarget::DownProj => "down_proj",
        }
    }

    /// Where the module sits in a decoder layer (`self_attn` or `mlp`).
    pub fn block(self) -> &'static str {
        match self {
            LoraTarget::QProj | LoraTarget::KProj | LoraTarget::VProj | LoraTarget::OProj => {
                "self_attn"
            }
            LoraTarget::GateProj | LoraTarget::UpProj | LoraTarget::DownProj => "mlp",
        }
    }
}

/// The shape of the adapters: rank, scaling, dropout and which projections carry one.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    /// Rank `r` of every adapter (at least 1).
    pub rank: usize,
    /// The update is scaled by `alpha / rank`.
    pub alpha: f64,
    /// Dropout on the adapter's input while training (0: none).
    pub dropout: f64,
    /// The adapted projections.
    pub targets: Vec<LoraTarget>,
}

impl LoraSpec {
    /// PEFT's `adapter_config.json` for these adapters on the base checkpoint `base`.
    pub fn peft_config(&self, base: Option<&std::path::Path>) -> serde_json::Value {
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": self.targets.iter().map(|t| t.name()).collect::<Vec<_>>(),
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "use_rslora": false,
            "use_dora": false,
            "modules_to_save": null,
            "base_model_name_or_path": base.map(|b| b.display().to_string()),
        })
    }

    /// Reads a PEFT `adapter_config.json` (LoRA on the projections this trainer adapts, with
    /// one rank and alpha for all, as this trainer writes them).
    pub fn from_peft_config(path: &std::path::Path) -> Result<Self, ModelError> {
        #[derive(Deserialize)]
        struct Peft {
            peft_type: String,
            r: usize,
            lora_alpha: f64,
            #[serde(default)]
            lora_dropout: f64,
            target_modules: Vec<String>,
            #[serde(default)]
            use_rslora: bool,
            #[serde(default)]
            use_dora: bool,
            #[serde(default)]
            rank_pattern: serde_json::Map<String, serde_json::Value>,
            #[serde(default)]
            alpha_pattern: serde_json::Map<String, serde_json::Value>,
        }
        let text =
            std::fs::read_to_string(path).map_err(|e| ModelError::Io(path.to_path_buf(), e))?;
        let c: Peft = serde_json::from_str(&text).map_err(ModelError::Json)?;
        let unsupported =
            |what: &str| ModelError::Config(format!("{}: {what} is not supported", path.display()));
        if c.peft_type != "LORA" {
            return Err(unsupported(&format!("peft_type {}", c.peft_type)));
        }
        if c.use_rslora || c.use_dora {
            return Err(unsupported("rsLoRA or DoRA"));
        }
        if !c.rank_pattern.is_empty() || !c.alpha_pattern.is_empty() {
            return Err(unsupported("a rank or alpha per module"));
        }
        let targets = c
            .target_modules
            .iter()
            .map(|m| {
                LoraTarget::ALL
                    .into_iter()
                    .find(|t| t.name() == m)
                    .ok_or_else(|| unsupported(&format!("target module {m}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if c.r == 0 || targets.is_empty() {
            return Err(unsupported("rank 0 or no target modules"));
        }
        Ok(Self {
            rank: c.r,
            alpha: c.lora_alpha,
            dropout: c.lora_dropout,
            targets,
        })
    }

    /// `alpha / rank`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank.max(1) as f64
    }

    /// Whether `target` carries an adapter.
    pub fn adapts(&self, target: LoraTarget) -> bool {
        self.targets.contains(&target)
    }
}

/// The adapter of one (possibly fused) dense layer.
#[derive(Module, Debug)]
pub struct Adapter<B: Backend> {
    /// `[in, parts · rank]`: the `A` of each adapted part side by side, in f32.
    pub a: Param<Tensor<B, 2>>,
    /// `[rank, width]`: the `B` of each adapted part, in f32.
    pub b: Vec<Param<Tensor<B, 2>>>,
    /// The first output column of each adapted part in the layer's output.
    pub offsets: Vec<usize>,
    /// The layer's whole output width.
    pub out_width: usize,
    /// Rank of each part.
    pub rank: usize,
    /// `alpha / rank`.
    pub scale: f64,
    /// Input dropout while training.
    pub dropout: f64,
}

impl<B: Backend> Adapter<B> {
    /// Adapters for the parts `(offset, width)` of a layer with `d_in` inputs and `out_width`
    /// outputs. `A` is drawn as PEFT draws it (Kaiming-uniform, bound `1/sqrt(d_in)`), `B` is
    /// zero.
    pub fn new(
        d_in: usize,
        parts: &[(usize, usize)],
        out_width: usize,
        spec: &LoraSpec,
        device: &B::Device,
    ) -> Self {
        let r = spec.rank.max(1);
        let bound = 1.0 / (d_in as f64).sqrt();
        let a = Tensor::<B, 2>::random(
            [d_in, parts.len() * r],
            Distribution::Uniform(-bound, bound),
            (device, DType::F32),
        );
        let b = parts
            .iter()
            .map(|&(_, w)| Param::from_tensor(Tensor::zeros([r, w], (device, DType::F32))))
            .collect();
        Self {
            a: Param::from_tensor(a),
            b,
            offsets: parts.iter().map(|&(o, _)| o).collect(),
            out_width,
            rank: r,
            scale: spec.scale(),
            dropout: spec.dropout,
        }
    }

    /// The update `scale · (x A) B` of input rows `[n, in]`, as `[n, out_width]` in the rows'
    /// precision (zero in the columns of parts without an adapter). The product runs in the
    /// rows' precision with `A` and `B` cast to it, as mixed-precision training does: the f32
    /// copies stay the parameters and their gradients come back in f32, and the backward pass
    /// keeps no f32 copy of the input.
    pub fn delta(&self, rows: Tensor<B, 2>) -> Tensor<B, 2> {
        let dtype = rows.dtype();
        let device = rows.device();
        let [n, _] = rows.dims();
        let mut x = rows;
        if self.dropout > 0.0 && B::ad_enabled(&device) {
            let keep = 1.0 - self.dropout;
            let mask =
                Tensor::<B, 2>::random(x.dims(), Distribution::Bernoulli(keep), (&device, dtype));
            x = x * mask / keep;
        }
        let h = x.matmul(self.a.val().cast(dtype));
        let r = self.rank;
        let outs: Vec<Tensor<B, 2>> = self
            .b
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let hi = if self.b.len() == 1 {
                    h.clone()
                } else {
                    h.clone().narrow(1, i * r, r)
                };
                hi.matmul(b.val().cast(dtype))
            })
            .collect();
        // The parts in output order, zeros between them where a part has no adapter.
        let mut pieces = Vec::with_capacity(2 * outs.len() + 1);
        let mut col = 0;
        for (out, &offset) in outs.into_iter().zip(&self.offsets) {
            if offset > col {
                pieces.push(Tensor::zeros([n, offset - col], (&device, dtype)));
            }
            col = offset + out.dims()[1];
            pieces.push(out);
        }
        if col < self.out_width {
            pieces.push(Tensor::zeros([n, self.out_width - col], (&device, dtype)));
        }
        let delta = match <[_; 1]>::try_from(pieces) {
            Ok([one]) => one,
            Err(pieces) => Tensor::cat(pieces, 1),
        };
        delta * self.scale
    }

    /// `scale · A B` of each adapted part, `[in, width]` in f32, for merging into the base.
    pub fn products(&self) -> Vec<(usize, Tensor<B, 2>)> {
        let r = self.rank;
        let a = self.a.val().detach();
        self.b
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let ai = a.clone().narrow(1, i * r, r);
                (self.offsets[i], ai.matmul(b.val().detach()) * self.scale)
            })
            .collect()
    }

    /// Parameters in the adapter (all trained).
    pub fn num_params(&self) -> usize {
        let [d_in, ar] = self.a.dims();
        d_in * ar
            + self
                .b
                .iter()
                .map(|b| b.dims().iter().product::<usize>())
                .sum::<usize>()
    }
}

/// Adapter tensors by name, as f32 (`(name, shape, values)`), in PEFT's layout: `lora_A` is
/// `[rank, in]`, `lora_B` is `[out, rank]`.
pub type AdapterTensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// The adapted slots of a decoder layer: `(slot, its parts as targets)`.
fn layer_slots(spec: &LoraSpec) -> [(usize, Vec<LoraTarget>); 4] {
    let keep = |ts: &[LoraTarget]| -> Vec<LoraTarget> {
        ts.iter().copied().filter(|t| spec.adapts(*t)).collect()
    };
    [
        (
            0,
            keep(&[LoraTarget::QProj, LoraTarget::KProj, LoraTarget::VProj]),
        ),
        (1, keep(&[LoraTarget::OProj])),
        (2, keep(&[LoraTarget::GateProj, LoraTarget::UpProj])),
        (3, keep(&[LoraTarget::DownProj])),
    ]
}

impl<B: Backend> Block<B> {
    /// The layer of `slot` (0: qkv, 1: o, 2: gate/up, 3: down) and the targets its output
    /// columns hold, with their widths.
    fn slot(&self, slot: usize) -> (&Dense<B>, Vec<(LoraTarget, usize)>) {
        let a = &self.self_attn;
        let [q, k, v] = a.qkv_widths();
        let inner = self.mlp.down_proj.weight.dims()[0];
        let d = a.o_proj.weight.dims()[1];
        match slot {
            0 => (
                &a.qkv_proj,
                vec![
                    (LoraTarget::QProj, q),
                    (LoraTarget::KProj, k),
                    (LoraTarget::VProj, v),
                ],
            ),
            1 => (&a.o_proj, vec![(LoraTarget::OProj, d)]),
            2 => (
                &self.mlp.gate_up_proj,
                vec![(LoraTarget::GateProj, inner), (LoraTarget::UpProj, inner)],
            ),
            _ => (&self.mlp.down_proj, vec![(LoraTarget::DownProj, d)]),
        }
    }

    fn slot_mut(&mut self, slot: usize) -> &mut Dense<B> {
        match slot {
            0 => &mut self.self_attn.qkv_proj,
            1 => &mut self.self_attn.o_proj,
            2 => &mut self.mlp.gate_up_proj,
            _ => &mut self.mlp.down_proj,
        }
    }
}

/// `(offset, width)` of each of `targets` among a layer's `columns`.
fn parts_of(columns: &[(LoraTarget, usize)], targets: &[LoraTarget]) -> Vec<(usize, usize)> {
    let mut offset = 0;
    let mut parts = Vec::new();
    for &(t, w) in columns {
        if targets.contains(&t) {
            parts.push((offset, w));
        }
        offset += w;
    }
    parts
}

/// Stable parameter ids for adapters (an optimiser's state is keyed by them, and a resumed run
/// rebuilds the adapters): from the owner's tag, the layer, the slot and the tensor.
fn adapter_id(tag: u64, layer: usize, slot: usize, tensor: usize) -> ParamId {
    ParamId::from(crate::seeds::derive(
        tag,
        (layer * 8 + slot) as u64,
        tensor as u64 + 1,
    ))
}

impl<B: Backend> Backbone<B> {
    /// The backbone with every weight frozen and fresh adapters on `spec`'s targets. `tag`
    /// tells the adapters of different owners apart (the policy's and the critic's), so each
    /// gets parameter ids of its own, stable across runs.
    pub fn with_adapters(self, spec: &LoraSpec, tag: u64) -> Self {
        let mut frozen = self.no_grad();
        for (i, layer) in frozen.layers.iter_mut().enumerate() {
            for (slot, targets) in layer_slots(spec) {
                let (_, columns) = layer.slot(slot);
                let parts = parts_of(&columns, &targets);
                let dense = layer.slot_mut(slot);
                dense.adapt(&parts, spec);
                if let Some(adapter) = dense.lora.as_mut() {
                    adapter.a = Param::initialized(adapter_id(tag, i, slot, 0), adapter.a.val());
                    for (k, b) in adapter.b.iter_mut().enumerate() {
                        *b = Param::initialized(adapter_id(tag, i, slot, k + 1), b.val());
                    }
                }
            }
        }
        frozen
    }

    /// Whether any layer carries an adapter.
    pub fn has_adapters(&self) -> bool {
        self.layers
            .iter()
            .any(|l| (0..4).any(|s| l.slot(s).0.lora.is_some()))
    }

    /// A copy without adapters: the base model (its weights are shared, not copied).
    pub fn without_adapters(&self) -> Self {
        let mut base = self.clone();
        for layer in &mut base.layers {
            for slot in 0..4 {
                layer.slot_mut(slot).lora = None;
            }
        }
        base
    }

    /// A copy with every adapter's update merged into its layer's weight.
    pub fn merged(&self) -> Self {
        let mut out = self.clone();
        for layer in &mut out.layers {
            for slot in 0..4 {
                let dense = layer.slot_mut(slot);
                *dense = dense.merged();
            }
        }
        out
    }

    /// Parameters in the adapters.
    pub fn adapter_params(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| (0..4).filter_map(|s| l.slot(s).0.lora.as_ref().map(Adapter::num_params)))
            .sum()
    }

    /// The adapters' tensors named `{prefix}.layers.{i}.{block}.{proj}.lora_{A,B}.weight`.
    pub fn adapter_tensors(&self, prefix: &str) -> AdapterTensors {
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            for slot in 0..4 {
                let (dense, columns) = layer.slot(slot);
                let Some(adapter) = &dense.lora else { continue };
                let r = adapter.rank;
                let a = adapter.a.val().detach();
                for (k, b) in adapter.b.iter().enumerate() {
                    let target = target_at(&columns, adapter.offsets[k]);
                    let name = format!("{prefix}.layers.{i}.{}.{}", target.block(), target.name());
                    let ak = a.clone().narrow(1, k * r, r).transpose();
                    let bk = b.val().detach().transpose();
                    out.push(as_named(format!("{name}.lora_A.weight"), ak));
                    out.push(as_named(format!("{name}.lora_B.weight"), bk));
                }
            }
        }
        out
    }

    /// Sets the adapters' values from tensors named as [`Self::adapter_tensors`] writes them
    /// (the adapters' shapes and parameter ids stay); every adapter must be found.
    pub fn load_adapter_tensors(
        mut self,
        prefix: &str,
        tensors: &mut NamedTensors,
    ) -> Result<Self, ModelError> {
        for (i, layer) in self.layers.iter_mut().enumerate() {
            for slot in 0..4 {
                let (dense, columns) = layer.slot(slot);
                let Some(adapter) = &dense.lora else { continue };
                let (r, d_in) = (adapter.rank, adapter.a.dims()[0]);
                let device = adapter.a.device();
                // Built on the host in the adapter's own layout, so that each is a leaf the
                // optimiser can track.
                let mut a = vec![0f32; d_in * r * adapter.b.len()];
                let width = r * adapter.b.len();
                let mut bs = Vec::new();
                for (k, b) in adapter.b.iter().enumerate() {
                    let target = target_at(&columns, adapter.offsets[k]);
                    let name = format!("{prefix}.layers.{i}.{}.{}", target.block(), target.name());
                    let w = b.dims()[1];
                    // lora_A [r, in] into columns k·r.. of A [in, parts·r].
                    let ak = take(tensors, &format!("{name}.lora_A.weight"), [r, d_in])?;
                    for (j, row) in ak.chunks_exact(d_in).enumerate() {
                        for (x, v) in row.iter().enumerate() {
                            a[x * width + k * r + j] = *v;
                        }
                    }
                    // lora_B [w, r] to B [r, w].
                    let bk = take(tensors, &format!("{name}.lora_B.weight"), [w, r])?;
                    bs.push(transposed(&bk, w, r));
                }
                // The same slot as above, which has an adapter.
                let Some(adapter) = layer.slot_mut(slot).lora.as_mut() else {
                    continue;
                };
                adapter.a = Param::initialized(adapter.a.id, f32_leaf(a, [d_in, width], &device));
                for (b, v) in adapter.b.iter_mut().zip(bs) {
                    let shape = [r, v.len() / r];
                    *b = Param::initialized(b.id, f32_leaf(v, shape, &device));
                }
            }
        }
        Ok(self)
    }
}

/// The target whose columns start at `offset`.
fn target_at(columns: &[(LoraTarget, usize)], offset: usize) -> LoraTarget {
    let mut start = 0;
    for &(t, w) in columns {
        if start == offset {
            return t;
        }
        start += w;
    }
    columns[0].0
}

fn as_named<B: Backend>(name: String, t: Tensor<B, 2>) -> (String, Vec<usize>, Vec<f32>) {
    let (shape, data) = super::lm::tensor_f32(t);
    (name, shape, data)
}

/// Removes tensor `name` of `shape` from `tensors`.
fn take(tensors: &mut NamedTensors, name: &str, shape: [usize; 2]) -> Result<Vec<f32>, ModelError> {
    let (s, data) = tensors
        .remove(name)
        .ok_or_else(|| ModelError::Weights(format!("the adapter lacks tensor {name}")))?;
    if s != shape {
        return Err(ModelError::Weights(format!(
            "adapter tensor {name}: shape {s:?}, the model expects {shape:?}"
        )));
    }
    Ok(data)
}

/// `[rows, cols]` row-major to `[cols, rows]`.
pub(crate) fn transposed(data: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; data.len()];
    for i in 0..rows {
        for j in 0..cols {
            out[j * rows + i] = data[i * cols + j];
        }
    }
    out
}

/// A trainable f32 tensor made from host values (a leaf of the autodiff graph).
pub(crate) fn f32_leaf<B: Backend>(
    data: Vec<f32>,
    shape: [usize; 2],
    device: &B::Device,
) -> Tensor<B, 2> {
    Tensor::<B, 2>::from_data(TensorData::new(data, shape), (device, DType::F32)).require_grad()
}
