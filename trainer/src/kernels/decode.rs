//! The decode step ([`crate::model::decode::DecodeStep`]) on burn's CUDA backend.
//!
//! Token-by-token decoding through burn costs a few hundred operations per step (a norm, a
//! product, the rotation, the cache write, the attention's pieces, ... per layer), each paying
//! the fusion stream's bookkeeping and a queued launch on the host: about 20 ms a step for
//! Qwen2.5-0.5B's 24 layers whatever the batch, measured on an H100, against 0.3 ms to read
//! its weights. Here the whole step is one operation of the fusion stream and one external
//! launch: when its turn comes on cubecl's device thread, [`run`] queues every layer's kernels
//! (`decode.cu`, `norm.cu`, `swiglu.cu`) and cuBLAS products straight onto cubecl's stream.
//! Keys and values are written into the cache's storage in place; the logits are what
//! `CausalLm::forward_last` returns, up to rounding (residual additions are accumulated by the
//! products, rounded once instead of twice).

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use burn::tensor::{DType, Int, Shape, Tensor, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::FloatElement;
use burn_fusion::stream::{Operation, OperationStreams};
use burn_ir::{CustomOpIr, OperationIr, TensorIr};
use cubecl_cuda::external;
use env_api::ErrorChain;

use super::module::{self, Source};
use super::stream::{enabled, Cube, Cuda, CudaTensor, FusionTensor, Handles, Runtime};
use crate::blas::cublas::{self, RawGemm};
use crate::model::cache::KvCache;
use crate::model::decode::plan::{
    attention_splits, AdapterPlan, LayerPlan, SharedBuffers, StepPlan, NONE,
};
use crate::model::decode::{DecodeStep, FusedDecoder};
use crate::model::fused;
use crate::model::lm::{Architecture, CausalLm};
use crate::model::transformer::Dense;

pub(super) static SOURCE: Source = Source {
    name: "decode.cu",
    code: concat!(include_str!("common.cuh"), include_str!("decode.cu")),
    kernels: &[
        "embed_f32",
        "embed_bf16",
        "decode_positions",
        "qkv_f32",
        "qkv_bf16",
        "attention_f32",
        "attention_bf16",
        "combine_f32",
        "combine_bf16",
    ],
};

// Kernel numbers in `SOURCE` (the bf16 variant is the next one).
const EMBED: usize = 0;
const POSITIONS: usize = 2;
const QKV: usize = 3;
const ATTENTION: usize = 5;
const COMBINE: usize = 7;

/// Query heads per key head the attention kernel holds (`MAXG` in `decode.cu`).
const MAX_GROUPS: usize = 8;
/// Widest head (`MAXD`).
const MAX_HEAD_DIM: usize = 256;
/// Keys an attention split covers at least.
const MIN_SPLIT_KEYS: usize = 128;
/// Most splits of one (row, key head).
const MAX_SPLITS: usize = 64;

static STEPS: AtomicU64 = AtomicU64::new(0);
static DECLINED: AtomicU64 = AtomicU64::new(0);
/// Host time spent queueing the steps' launches on cubecl's device thread, in nanoseconds.
static QUEUE_NS: AtomicU64 = AtomicU64::new(0);

/// Decode steps this process ran as one operation, and steps declined (run by burn
/// operations instead).
pub fn counts() -> (u64, u64) {
    (
        STEPS.load(Ordering::Relaxed),
        DECLINED.load(Ordering::Relaxed),
    )
}

/// Seconds the device thread spent queueing the steps' launches (kernels and cuBLAS calls):
/// the host's share of a step, which the GPU's share hides only where it is longer.
pub fn queue_seconds() -> f64 {
    QUEUE_NS.load(Ordering::Relaxed) as f64 * 1e-9
}

/// Makes generation on burn's CUDA backend (f32 and bf16 models) decode through these
/// kernels, and returns true; false (nothing registered) without cuBLAS, when
/// `CUDA_AGENT_DECODE=decomposed` asks for burn operations, or when a source does not compile.
pub fn install() -> bool {
    if !cublas::installed() {
        tracing::info!("the decode step's products need cuBLAS: burn operations decode");
        return false;
    }
    if !enabled(&SOURCE, "CUDA_AGENT_DECODE", "the decode step") {
        return false;
    }
    for source in [&super::norm::SOURCE, &super::swiglu::SOURCE] {
        if let Err(e) = module::check(source) {
            tracing::warn!(
                "{}; the decode step: burn operations instead",
                ErrorChain(&e)
            );
            return false;
        }
    }
    fused::register::<Cuda<f32>, FusedDecoder<Cuda<f32>>>(prepare::<f32>);
    fused::register::<Cuda<half::bf16>, FusedDecoder<Cuda<half::bf16>>>(prepare::<half::bf16>);
    true
}

/// A float tensor's primitive.
fn prim<const D: usize, F: FloatElement>(t: Tensor<Cuda<F>, D>) -> FusionTensor {
    t.into_primitive().tensor()
}

/// An adapter's tensors in the model's element type (cast once per generation).
struct AdapterWeights {
    a: FusionTensor,
    b: Vec<FusionTensor>,
    offsets: Vec<usize>,
    rank: usize,
    scale: f64,
}

/// One projection: its weight and its adapter.
struct Projection {
    weight: FusionTensor,
    adapter: Option<AdapterWeights>,
}

struct LayerWeights {
    input_norm: FusionTensor,
    qkv: Projection,
    qkv_bias: Option<FusionTensor>,
    o: Projection,
    post_norm: FusionTensor,
    gate_up: Projection,
    down: Projection,
}

/// The model's shapes the step needs.
#[derive(Debug, Clone, Copy)]
struct Dims {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    inter: usize,
    vocab: usize,
    eps: f64,
}

struct Decoder<F: FloatElement> {
    dims: Dims,
    dtype: DType,
    embed: FusionTensor,
    final_norm: FusionTensor,
    head: Option<FusionTensor>,
    cos: FusionTensor,
    sin: FusionTensor,
    positions: usize,
    layers: Vec<LayerWeights>,
    device: burn::tensor::Device<Cuda<F>>,
    _f: PhantomData<F>,
}

/// A projection the step runs: no bias (the query/key/value bias is the kernel's), an adapter
/// cast to `dtype`.
fn projection<F: FloatElement>(dense: &Dense<Cuda<F>>, dtype: DType) -> Projection {
    let adapter = dense.lora.as_ref().map(|a| AdapterWeights {
        a: prim(a.a.val().cast(dtype)),
        b: a.b.iter().map(|b| prim(b.val().cast(dtype))).collect(),
        offsets: a.offsets.clone(),
        rank: a.rank,
        scale: a.scale,
    });
    Projection {
        weight: prim(dense.weight.val()),
        adapter,
    }
}

/// The decoder for `lm`, or `None` where the model is outside what the kernels run: a head
/// width or grouping they do not take, biases other than the query/key/value one, an adapter
/// on the output head, mixed element types.
fn prepare<F: FloatElement>(
    lm: &CausalLm<Cuda<F>>,
    arch: &Architecture<Cuda<F>>,
) -> Option<Box<dyn DecodeStep<Cuda<F>>>> {
    let c = &arch.config;
    let d = c.head_dim;
    let fits = c.num_key_value_heads > 0
        && c.num_attention_heads.is_multiple_of(c.num_key_value_heads)
        && c.num_attention_heads / c.num_key_value_heads <= MAX_GROUPS
        && d.is_multiple_of(2)
        && d <= MAX_HEAD_DIM
        && (128 % d == 0 || d == MAX_HEAD_DIM);
    let backbone = &lm.backbone;
    let embed = backbone.embed_tokens.val();
    let dtype = embed.dtype();
    let plain = |dense: &Dense<Cuda<F>>| dense.bias.is_none();
    let uniform = |dense: &Dense<Cuda<F>>| dense.weight.val().dtype() == dtype;
    let layers_fit = backbone.layers.iter().all(|l| {
        plain(&l.self_attn.o_proj)
            && plain(&l.mlp.gate_up_proj)
            && plain(&l.mlp.down_proj)
            && [
                &l.self_attn.qkv_proj,
                &l.self_attn.o_proj,
                &l.mlp.gate_up_proj,
                &l.mlp.down_proj,
            ]
            .into_iter()
            .all(uniform)
            && l.self_attn.n_heads == c.num_attention_heads
            && l.self_attn.n_kv_heads == c.num_key_value_heads
            && l.self_attn.head_dim == d
    });
    let head_fits = lm
        .lm_head
        .as_ref()
        .is_none_or(|h| h.bias.is_none() && h.lora.is_none() && uniform(h));
    let (cos, sin) = arch.rope.tables();
    let tables_fit = cos.dtype() == dtype && sin.dtype() == dtype;
    if !(fits && layers_fit && head_fits && tables_fit && matches!(dtype, DType::F32 | DType::BF16))
    {
        tracing::info!("the decode step does not take this model: burn operations decode");
        return None;
    }
    let layers = backbone
        .layers
        .iter()
        .map(|l| LayerWeights {
            input_norm: prim(l.input_layernorm.weight.val()),
            qkv: projection(&l.self_attn.qkv_proj, dtype),
            qkv_bias: l.self_attn.qkv_proj.bias.as_ref().map(|b| prim(b.val())),
            o: projection(&l.self_attn.o_proj, dtype),
            post_norm: prim(l.post_attention_layernorm.weight.val()),
            gate_up: projection(&l.mlp.gate_up_proj, dtype),
            down: projection(&l.mlp.down_proj, dtype),
        })
        .collect();
    Some(Box::new(Decoder::<F> {
        dims: Dims {
            hidden: c.hidden_size,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: d,
            inter: c.intermediate_size,
            vocab: embed.dims()[0],
            eps: c.rms_norm_eps,
        },
        dtype,
        device: embed.device(),
        embed: prim(embed),
        final_norm: prim(backbone.norm.weight.val()),
        head: lm.lm_head.as_ref().map(|h| prim(h.weight.val())),
        cos: prim(cos.clone()),
        sin: prim(sin.clone()),
        positions: arch.rope.len(),
        layers,
        _f: PhantomData,
    }))
}

/// What an input of the step's operation is, for how it is read when the step executes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// The token ids (an int tensor).
    Tokens,
    /// The slot flags (a bool tensor, read with its strides).
    Valid,
    /// A projection's weight, read in either order.
    Projection,
    /// A key or value storage, written in place.
    Storage,
    /// Anything else, read row-major.
    Plain,
}

/// Inputs of the step's operation in order, with the plan's buffer numbers.
struct Inputs {
    tensors: Vec<FusionTensor>,
    roles: Vec<Role>,
}

impl Inputs {
    fn push(&mut self, t: FusionTensor, role: Role) -> u64 {
        self.tensors.push(t);
        self.roles.push(role);
        self.tensors.len() as u64 - 1
    }

    fn adapter(&mut self, p: &Projection) -> Option<AdapterPlan> {
        let a = p.adapter.as_ref()?;
        let a_index = self.push(a.a.clone(), Role::Plain);
        let parts =
            a.b.iter()
                .zip(&a.offsets)
                .map(|(b, &offset)| {
                    let width = b.shape[1];
                    (self.push(b.clone(), Role::Plain), offset, width)
                })
                .collect();
        Some(AdapterPlan {
            a: a_index,
            rank: a.rank,
            scale: a.scale,
            parts,
        })
    }
}

/// Multiprocessors of CUDA device 0 (the attention's split count aims at filling them).
fn multiprocessors() -> usize {
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT.get_or_init(|| {
        use cudarc::driver::{result as driver, sys};
        // SAFETY: attribute queries on a device cubecl already opened.
        unsafe {
            driver::device::get(0)
                .and_then(|dev| {
                    driver::device::get_attribute(
                        dev,
                        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                    )
                })
                .map(|n| n.max(1) as usize)
                .unwrap_or(132)
        }
    })
}

impl<F: FloatElement> DecodeStep<Cuda<F>> for Decoder<F> {
    fn step(
        &self,
        tokens: Tensor<Cuda<F>, 1, Int>,
        cache: &mut KvCache<Cuda<F>>,
    ) -> Option<Tensor<Cuda<F>, 2>> {
        let rows = tokens.dims()[0];
        let past = cache.len();
        let applies = rows > 0
            && past > 0
            && past < self.positions
            && cache.layers.len() == self.layers.len()
            && cache.valid().is_some_and(|v| v.dims()[0] == rows)
            && cache
                .layers
                .iter()
                .all(|l| l.len() == past && l.storage_dims().is_some_and(|s| s[0] == rows));
        if !applies {
            DECLINED.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let valid = cache.push_real_tokens(&self.device)?;
        let slots = past + 1;
        let dm = self.dims;
        let groups = dm.heads / dm.kv_heads;
        let splits = attention_splits(
            rows * dm.kv_heads,
            slots,
            multiprocessors(),
            MIN_SPLIT_KEYS,
            MAX_SPLITS,
        );

        let mut inputs = Inputs {
            tensors: Vec::new(),
            roles: Vec::new(),
        };
        let tokens_at = inputs.push(tokens.into_primitive(), Role::Tokens);
        let valid_at = inputs.push(valid.into_primitive(), Role::Valid);
        let cos = inputs.push(self.cos.clone(), Role::Plain);
        let sin = inputs.push(self.sin.clone(), Role::Plain);
        let embed = inputs.push(self.embed.clone(), Role::Plain);
        let final_norm = inputs.push(self.final_norm.clone(), Role::Plain);
        let head = match &self.head {
            Some(h) => inputs.push(h.clone(), Role::Projection),
            None => NONE,
        };
        let mut layers = Vec::with_capacity(self.layers.len());
        for (w, lc) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let (k, v) = lc.take_storage(1)?;
            let input_norm = inputs.push(w.input_norm.clone(), Role::Plain);
            let qkv = inputs.push(w.qkv.weight.clone(), Role::Projection);
            let qkv_bias = match &w.qkv_bias {
                Some(b) => inputs.push(b.clone(), Role::Plain),
                None => NONE,
            };
            let o = inputs.push(w.o.weight.clone(), Role::Projection);
            let post_norm = inputs.push(w.post_norm.clone(), Role::Plain);
            let gate_up = inputs.push(w.gate_up.weight.clone(), Role::Projection);
            let down = inputs.push(w.down.weight.clone(), Role::Projection);
            let k = inputs.push(prim(k), Role::Storage);
            let v = inputs.push(prim(v), Role::Storage);
            let adapters = [
                inputs.adapter(&w.qkv),
                inputs.adapter(&w.o),
                inputs.adapter(&w.gate_up),
                inputs.adapter(&w.down),
            ];
            layers.push(LayerPlan {
                input_norm,
                qkv,
                qkv_bias,
                o,
                post_norm,
                gate_up,
                down,
                k,
                v,
                k_strides: [0; 3],
                v_strides: [0; 3],
                adapters,
                transposed: 0,
            });
        }
        // Scratch buffers are numbered after the inputs, in the order of the fields below
        // (`StepOp::execute` allocates them in the same order).
        let mut next = inputs.tensors.len() as u64;
        let mut scratch = || {
            next += 1;
            next - 1
        };
        let adapter_width = layers
            .iter()
            .flat_map(|l| l.adapters.iter().flatten())
            .map(|a| a.parts.len() * a.rank)
            .max();
        let shared = SharedBuffers {
            tokens: tokens_at,
            valid: valid_at,
            cos,
            sin,
            embed,
            final_norm,
            head,
            head_transposed: false,
            x: scratch(),
            normed: scratch(),
            qkv_out: scratch(),
            q: scratch(),
            attn: scratch(),
            gate_up_out: scratch(),
            act: scratch(),
            inv_rms: scratch(),
            positions: scratch(),
            logits: scratch(),
            adapter_rows: if adapter_width.is_some() {
                scratch()
            } else {
                NONE
            },
            partial: if splits > 1 { scratch() } else { NONE },
        };
        let plan = StepPlan {
            device: 0,
            bf16: self.dtype == DType::BF16,
            rows,
            slots,
            hidden: dm.hidden,
            heads: dm.heads,
            kv_heads: dm.kv_heads,
            head_dim: dm.head_dim,
            inter: dm.inter,
            vocab: dm.vocab,
            eps: dm.eps,
            splits,
            valid_strides: [0; 2],
            shared,
            layers,
        };

        let client = self.embed.client.clone();
        let mut outputs = vec![TensorIr::uninit(
            client.create_empty_handle(),
            Shape::new([rows, dm.vocab]),
            self.dtype,
        )];
        for l in &plan.layers {
            for at in [l.k, l.v] {
                let t = &inputs.tensors[at as usize];
                outputs.push(TensorIr::uninit(
                    client.create_empty_handle(),
                    t.shape.clone(),
                    t.dtype,
                ));
            }
        }
        let streams = OperationStreams::with_inputs(inputs.tensors.iter());
        let irs: Vec<TensorIr> = inputs.tensors.into_iter().map(|t| t.into_ir()).collect();
        let desc = CustomOpIr::new("cuda_agent_decode_step", &irs, &outputs);
        let op = StepOp::<F> {
            desc: desc.clone(),
            plan,
            roles: inputs.roles,
            adapter_width: adapter_width.unwrap_or(0),
            groups,
            _f: PhantomData,
        };
        let mut out = client
            .register(streams, OperationIr::Custom(desc), op)
            .into_iter();
        let logits = out.next()?;
        for lc in cache.layers.iter_mut() {
            let (k, v) = (out.next()?, out.next()?);
            let t = |p| Tensor::<Cuda<F>, 4>::from_primitive(TensorPrimitive::Float(p));
            lc.put_storage(t(k), t(v), 1);
        }
        STEPS.fetch_add(1, Ordering::Relaxed);
        Some(Tensor::from_primitive(TensorPrimitive::Float(logits)))
    }
}

/// The step as an operation of the fusion stream.
#[derive(Debug)]
struct StepOp<F> {
    desc: CustomOpIr,
    /// Buffer numbers of the inputs and scratch; strides filled in at execution.
    plan: StepPlan,
    /// What each input is.
    roles: Vec<Role>,
    adapter_width: usize,
    groups: usize,
    _f: PhantomData<F>,
}

/// Whether a 2-D tensor is row-major (`Some(false)`), column-major (`Some(true)`), or neither.
fn matrix_order(t: &CudaTensor) -> Option<bool> {
    let (shape, strides) = (t.meta.shape(), t.meta.strides());
    if shape.len() != 2 {
        return None;
    }
    let ([r, c], [s0, s1]) = ([shape[0], shape[1]], [strides[0], strides[1]]);
    if (s1 == 1 || c == 1) && (s0 == c || r == 1) {
        Some(false)
    } else if (s0 == 1 || r == 1) && (s1 == r || c == 1) {
        Some(true)
    } else {
        None
    }
}

/// `t` contiguous in row-major order, copied only when it is not.
fn row_major(t: CudaTensor) -> CudaTensor {
    let contiguous = {
        let (shape, strides) = (t.meta.shape(), t.meta.strides());
        let mut want = 1;
        let mut ok = true;
        for d in (0..shape.len()).rev() {
            if shape[d] != 1 && strides[d] != want {
                ok = false;
            }
            want *= shape[d];
        }
        ok
    };
    if contiguous {
        t
    } else {
        into_contiguous(t)
    }
}

impl<F: FloatElement> Operation<Runtime> for StepOp<F> {
    fn execute(&self, handles: &mut Handles) {
        let ins = &self.desc.inputs;
        let mut plan = self.plan.clone();
        let mut t: Vec<CudaTensor> = Vec::with_capacity(ins.len() + 12);
        // Per input: whether a projection weight is stored transposed (column-major).
        let mut transposed = vec![false; ins.len()];
        for ((ir, &role), flipped) in ins.iter().zip(&self.roles).zip(transposed.iter_mut()) {
            t.push(match role {
                Role::Tokens => row_major(handles.get_int_tensor::<Cube<F>>(ir)),
                Role::Valid => handles.get_bool_tensor::<Cube<F>>(ir),
                Role::Plain => row_major(handles.get_float_tensor::<Cube<F>>(ir)),
                Role::Projection => {
                    let w = handles.get_float_tensor::<Cube<F>>(ir);
                    match matrix_order(&w) {
                        Some(column_major) => {
                            *flipped = column_major;
                            w
                        }
                        None => into_contiguous(w),
                    }
                }
                Role::Storage => {
                    // Written in place: a storage someone else still reads is copied first.
                    let mut x = handles.get_float_tensor::<Cube<F>>(ir);
                    if !x.can_mut() {
                        x = x.copy();
                    }
                    if x.meta.strides()[3] != 1 {
                        x = into_contiguous(x);
                    }
                    x
                }
            });
        }
        let bit = |at: u64| transposed[at as usize];
        for l in plan.layers.iter_mut() {
            l.transposed = [l.qkv, l.o, l.gate_up, l.down]
                .into_iter()
                .enumerate()
                .filter(|&(_, at)| bit(at))
                .fold(0, |bits, (i, _)| bits | 1 << i);
        }
        if plan.shared.head != NONE {
            plan.shared.head_transposed = bit(plan.shared.head);
        }
        for l in plan.layers.iter_mut() {
            let s = |x: &CudaTensor| {
                let st = x.meta.strides();
                [st[0], st[1], st[2]]
            };
            l.k_strides = s(&t[l.k as usize]);
            l.v_strides = s(&t[l.v as usize]);
        }
        {
            let v = &t[plan.shared.valid as usize];
            let bytes = v.dtype.size();
            let st = v.meta.strides();
            plan.valid_strides = [st[0] * bytes, st[1] * bytes];
        }
        plan.device = t[0].device.index;

        let (client, device) = (t[0].client.clone(), t[0].device.clone());
        let rows = plan.rows;
        let (h, kvh, d) = (plan.heads, plan.kv_heads, plan.head_dim);
        let empty = |shape: Vec<usize>, dtype: DType| {
            empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::from(shape), dtype)
        };
        let dt = self.desc.outputs[0].dtype;
        // In the order `step` numbered them.
        t.push(empty(vec![rows, plan.hidden], dt));
        t.push(empty(vec![rows, plan.hidden], dt));
        t.push(empty(vec![rows, (h + 2 * kvh) * d], dt));
        t.push(empty(vec![rows, h * d], dt));
        t.push(empty(vec![rows, h * d], dt));
        t.push(empty(vec![rows, 2 * plan.inter], dt));
        t.push(empty(vec![rows, plan.inter], dt));
        t.push(empty(vec![rows], DType::F32));
        t.push(empty(vec![rows], DType::I32));
        t.push(empty(vec![rows, plan.vocab], dt));
        if plan.shared.adapter_rows != NONE {
            t.push(empty(vec![rows, self.adapter_width.max(1)], dt));
        }
        if plan.shared.partial != NONE {
            t.push(empty(
                vec![rows * kvh * plan.splits * self.groups * (d + 2)],
                DType::F32,
            ));
        }
        let bindings = t.iter().map(|x| x.handle.clone().binding()).collect();
        external::launch_external(&client, op(), bindings, &plan.to_words());

        let mut outputs = self.desc.outputs.iter();
        if let Some(o) = outputs.next() {
            handles.register_float_tensor::<Cube<F>>(&o.id, t[plan.shared.logits as usize].clone());
        }
        for at in plan.layers.iter().flat_map(|l| [l.k, l.v]) {
            if let Some(o) = outputs.next() {
                handles.register_float_tensor::<Cube<F>>(&o.id, t[at as usize].clone());
            }
        }
    }
}

/// The step as registered with cubecl.
static OP: OnceLock<external::ExternalOpId> = OnceLock::new();

fn op() -> external::ExternalOpId {
    *OP.get_or_init(|| external::register_external_op(run))
}

/// On cubecl's device thread: the whole step queued on `call.stream`.
fn run(call: external::ExternalCall<'_>) -> Result<(), String> {
    let plan = StepPlan::from_words(call.data).ok_or("decode step: malformed plan")?;
    let step = Queued {
        plan: &plan,
        pointers: call.pointers,
        stream: call.stream,
        clock: tracing::enabled!(tracing::Level::DEBUG).then(Clock::default),
    };
    let start = std::time::Instant::now();
    let queued = step.queue();
    QUEUE_NS.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    if let Some(clock) = &step.clock {
        clock.finish(step.stream);
    }
    queued
}

/// The parts of a step whose GPU time [`part_seconds`] reports.
const PARTS: [&str; 10] = [
    "embedding, positions",
    "RMSNorm",
    "q/k/v product",
    "bias, rotation, cache write",
    "attention",
    "output product",
    "gate/up product",
    "SwiGLU",
    "down product",
    "output head",
];
const EMBEDDING: usize = 0;
const NORM: usize = 1;
const QKV_PRODUCT: usize = 2;
const ROTATION: usize = 3;
const ATTEND: usize = 4;
const O_PRODUCT: usize = 5;
const GATE_UP: usize = 6;
const GATE: usize = 7;
const DOWN: usize = 8;
const HEAD: usize = 9;

/// GPU milliseconds by part over every step timed, and the steps timed.
static PART_MS: std::sync::Mutex<([f64; PARTS.len()], u64)> =
    std::sync::Mutex::new(([0.0; PARTS.len()], 0));

/// Each part's GPU time per step, in seconds, over the steps timed: at debug level only (each
/// timed step waits for the device, so the split costs speed). Empty when none was timed.
pub fn part_seconds() -> Vec<(&'static str, f64)> {
    let (ms, steps) = *PART_MS.lock().unwrap_or_else(|p| p.into_inner());
    if steps == 0 {
        return Vec::new();
    }
    PARTS
        .iter()
        .zip(ms)
        .map(|(name, ms)| (*name, ms * 1e-3 / steps as f64))
        .collect()
}

/// Events recorded on the stream where each part of a step begins (diagnosis: see
/// [`part_seconds`]). A failed event call drops the step's timing, never the step.
#[derive(Default)]
struct Clock {
    marks: std::cell::RefCell<Vec<(usize, cudarc::driver::sys::CUevent)>>,
    failed: std::cell::Cell<bool>,
}

impl Clock {
    fn mark(&self, part: usize, stream: cudarc::driver::sys::CUstream) {
        use cudarc::driver::{result::event, sys::CUevent_flags};
        let Ok(e) = event::create(CUevent_flags::CU_EVENT_DEFAULT) else {
            self.failed.set(true);
            return;
        };
        // SAFETY: a live event on the stream cubecl handed this operation.
        if unsafe { event::record(e, stream) }.is_err() {
            self.failed.set(true);
        }
        self.marks.borrow_mut().push((part, e));
    }

    /// Waits for the step's end and adds each part's time to [`PART_MS`].
    fn finish(&self, stream: cudarc::driver::sys::CUstream) {
        use cudarc::driver::result::event;
        self.mark(PARTS.len(), stream);
        let marks = self.marks.take();
        let mut ms = [0.0; PARTS.len()];
        // SAFETY: the events were created and recorded above; each is destroyed once.
        unsafe {
            let ended = marks
                .last()
                .is_some_and(|&(_, e)| event::synchronize(e).is_ok());
            for pair in marks.windows(2) {
                let ((part, a), (_, b)) = (pair[0], pair[1]);
                match event::elapsed(a, b) {
                    Ok(t) if part < PARTS.len() => ms[part] += f64::from(t),
                    Ok(_) => {}
                    Err(_) => self.failed.set(true),
                }
            }
            for (_, e) in marks {
                let _ = event::destroy(e);
            }
            if !ended || self.failed.get() {
                return;
            }
        }
        let mut total = PART_MS.lock().unwrap_or_else(|p| p.into_inner());
        for (sum, t) in total.0.iter_mut().zip(ms) {
            *sum += t;
        }
        total.1 += 1;
    }
}

/// One step's launches.
struct Queued<'a> {
    plan: &'a StepPlan,
    pointers: &'a [u64],
    stream: cudarc::driver::sys::CUstream,
    /// Where the parts' GPU time is measured (debug level).
    clock: Option<Clock>,
}

impl Queued<'_> {
    fn mark(&self, part: usize) {
        if let Some(clock) = &self.clock {
            clock.mark(part, self.stream);
        }
    }

    fn ptr(&self, at: u64) -> Result<u64, String> {
        if at == NONE {
            return Ok(0);
        }
        self.pointers
            .get(at as usize)
            .copied()
            .ok_or_else(|| format!("decode step: no buffer {at}"))
    }

    fn elem(&self) -> u64 {
        if self.plan.bf16 {
            2
        } else {
            4
        }
    }

    fn dtype(&self) -> DType {
        if self.plan.bf16 {
            DType::BF16
        } else {
            DType::F32
        }
    }

    fn launch(
        &self,
        source: &'static Source,
        kernel: usize,
        blocks: usize,
        threads: u32,
        args: &[u64],
    ) -> Result<(), String> {
        let blocks = u32::try_from(blocks)
            .map_err(|_| format!("decode step: {blocks} blocks do not fit a grid"))?;
        module::launch(source, kernel, blocks, threads, self.stream, args)
            .map_err(|e| ErrorChain(&e).to_string())
    }

    fn gemm(&self, g: RawGemm) -> Result<(), String> {
        cublas::raw_gemm(self.plan.device, self.stream, self.dtype(), &g)
    }

    /// `out[rows, width] (+)= input[rows, width_in] · W` and its adapter's update.
    #[allow(clippy::too_many_arguments)]
    fn project(
        &self,
        input: u64,
        weight: u64,
        transposed: bool,
        adapter: &Option<AdapterPlan>,
        out: u64,
        width: usize,
        width_in: usize,
        accumulate: bool,
    ) -> Result<(), String> {
        let rows = self.plan.rows;
        let x = self.ptr(input)?;
        let y = self.ptr(out)?;
        self.gemm(RawGemm {
            transpose_a: transposed,
            m: width,
            n: rows,
            k: width_in,
            a: (self.ptr(weight)?, if transposed { width_in } else { width }),
            b: (x, width_in),
            c: (y, width),
            alpha: 1.0,
            beta: if accumulate { 1.0 } else { 0.0 },
        })?;
        let Some(a) = adapter else {
            return Ok(());
        };
        let packed = a.parts.len() * a.rank;
        let t = self.ptr(self.plan.shared.adapter_rows)?;
        self.gemm(RawGemm {
            transpose_a: false,
            m: packed,
            n: rows,
            k: width_in,
            a: (self.ptr(a.a)?, packed),
            b: (x, width_in),
            c: (t, packed),
            alpha: 1.0,
            beta: 0.0,
        })?;
        for (i, &(b, offset, part_width)) in a.parts.iter().enumerate() {
            self.gemm(RawGemm {
                transpose_a: false,
                m: part_width,
                n: rows,
                k: a.rank,
                a: (self.ptr(b)?, part_width),
                b: (t + (i * a.rank) as u64 * self.elem(), packed),
                c: (y + offset as u64 * self.elem(), width),
                alpha: a.scale as f32,
                beta: 1.0,
            })?;
        }
        Ok(())
    }

    fn norm(&self, input: u64, scale: u64, out: u64) -> Result<(), String> {
        self.mark(NORM);
        let p = self.plan;
        let args = [
            self.ptr(input)?,
            self.ptr(scale)?,
            self.ptr(out)?,
            self.ptr(p.shared.inv_rms)?,
            p.hidden as u64,
            p.hidden as u64,
            p.hidden as u64,
            1,
            1,
            p.eps.to_bits(),
        ];
        self.launch(
            &super::norm::SOURCE,
            usize::from(p.bf16),
            p.rows,
            128,
            &args,
        )
    }

    fn queue(&self) -> Result<(), String> {
        let p = self.plan;
        let s = &p.shared;
        let v = usize::from(p.bf16);
        let (rows, hidden) = (p.rows, p.hidden);
        let (h, kvh, d) = (p.heads, p.kv_heads, p.head_dim);
        let groups = h / kvh.max(1);
        let half = d / 2;
        let slot = (p.slots - 1) as u64;
        self.mark(EMBEDDING);
        self.launch(
            &SOURCE,
            EMBED + v,
            rows,
            128,
            &[
                self.ptr(s.embed)?,
                self.ptr(s.tokens)?,
                self.ptr(s.x)?,
                hidden as u64,
                p.vocab as u64,
            ],
        )?;
        self.launch(
            &SOURCE,
            POSITIONS,
            rows,
            128,
            &[
                self.ptr(s.valid)?,
                self.ptr(s.positions)?,
                p.slots as u64,
                p.valid_strides[0] as u64,
                p.valid_strides[1] as u64,
            ],
        )?;
        let attention_threads = d.max(128) as u32;
        for l in &p.layers {
            let tr = |bit: u64| l.transposed & (1 << bit) != 0;
            let [kb, kh, ks] = l.k_strides.map(|x| x as u64);
            let [vb, vh, vs] = l.v_strides.map(|x| x as u64);
            self.norm(s.x, l.input_norm, s.normed)?;
            self.mark(QKV_PRODUCT);
            self.project(
                s.normed,
                l.qkv,
                tr(0),
                &l.adapters[0],
                s.qkv_out,
                (h + 2 * kvh) * d,
                hidden,
                false,
            )?;
            let pairs = rows * (h + 2 * kvh) * half;
            self.mark(ROTATION);
            self.launch(
                &SOURCE,
                QKV + v,
                pairs.div_ceil(256),
                256,
                &[
                    self.ptr(s.qkv_out)?,
                    self.ptr(l.qkv_bias)?,
                    self.ptr(s.cos)?,
                    self.ptr(s.sin)?,
                    self.ptr(s.positions)?,
                    self.ptr(s.q)?,
                    self.ptr(l.k)?,
                    self.ptr(l.v)?,
                    rows as u64,
                    h as u64,
                    kvh as u64,
                    half as u64,
                    slot,
                    kb,
                    kh,
                    ks,
                    vb,
                    vh,
                    vs,
                ],
            )?;
            self.mark(ATTEND);
            self.launch(
                &SOURCE,
                ATTENTION + v,
                rows * kvh * p.splits,
                attention_threads,
                &[
                    self.ptr(s.q)?,
                    self.ptr(l.k)?,
                    self.ptr(l.v)?,
                    self.ptr(s.valid)?,
                    self.ptr(s.attn)?,
                    self.ptr(s.partial)?,
                    p.slots as u64,
                    kvh as u64,
                    groups as u64,
                    d as u64,
                    kb,
                    kh,
                    ks,
                    vb,
                    vh,
                    vs,
                    p.valid_strides[0] as u64,
                    p.valid_strides[1] as u64,
                    p.splits as u64,
                    (1.0 / (d as f64).sqrt()).to_bits(),
                ],
            )?;
            if p.splits > 1 {
                self.launch(
                    &SOURCE,
                    COMBINE + v,
                    rows * kvh * groups,
                    d as u32,
                    &[
                        self.ptr(s.partial)?,
                        self.ptr(s.attn)?,
                        kvh as u64,
                        groups as u64,
                        d as u64,
                        p.splits as u64,
                    ],
                )?;
            }
            self.mark(O_PRODUCT);
            self.project(s.attn, l.o, tr(1), &l.adapters[1], s.x, hidden, h * d, true)?;
            self.norm(s.x, l.post_norm, s.normed)?;
            self.mark(GATE_UP);
            self.project(
                s.normed,
                l.gate_up,
                tr(2),
                &l.adapters[2],
                s.gate_up_out,
                2 * p.inter,
                hidden,
                false,
            )?;
            self.mark(GATE);
            self.launch(
                &super::swiglu::SOURCE,
                v,
                (rows * p.inter).div_ceil(256),
                256,
                &[
                    self.ptr(s.gate_up_out)?,
                    self.ptr(s.act)?,
                    rows as u64,
                    p.inter as u64,
                    2 * p.inter as u64,
                    p.inter as u64,
                ],
            )?;
            self.mark(DOWN);
            self.project(
                s.act,
                l.down,
                tr(3),
                &l.adapters[3],
                s.x,
                hidden,
                p.inter,
                true,
            )?;
        }
        self.norm(s.x, s.final_norm, s.normed)?;
        self.mark(HEAD);
        if s.head == NONE {
            // Tied: the embedding `[vocab, hidden]` read transposed.
            self.gemm(RawGemm {
                transpose_a: true,
                m: p.vocab,
                n: rows,
                k: hidden,
                a: (self.ptr(s.embed)?, hidden),
                b: (self.ptr(s.normed)?, hidden),
                c: (self.ptr(s.logits)?, p.vocab),
                alpha: 1.0,
                beta: 0.0,
            })
        } else {
            self.project(
                s.normed,
                s.head,
                s.head_transposed,
                &None,
                s.logits,
                p.vocab,
                hidden,
                false,
            )
        }
    }
}
