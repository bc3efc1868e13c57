//! Next-token statistics (`model::vocab::token_stats`) on burn's CUDA backend as two kernels
//! (`vocab.cu`): the forward reads the `[rows, vocab]` logits once, in their own dtype, and
//! writes each row's log-probability, entropy and log-sum-exp; the backward reads them once
//! more and writes their gradient. Each direction is one custom operation of the fusion
//! stream; on the autodiff backend the pair is one tracked operation whose state is the
//! logits, the targets and the forward's per-row results.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::NoCheckpointing;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_autodiff::Autodiff;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::FloatElement;
use burn_fusion::stream::{Operation, OperationStreams};
use burn_ir::{CustomOpIr, OperationIr, TensorIr};
use std::marker::PhantomData;

use super::module::Source;
use super::stream::{
    enabled, queue, rows_contiguous, stride, Cube, Cuda, FusionTensor as Tensor, Handles, Runtime,
};
use crate::model::vocab::register_token_stats;

pub(super) static SOURCE: Source = Source {
    name: "vocab.cu",
    code: concat!(include_str!("common.cuh"), include_str!("vocab.cu")),
    kernels: &[
        "token_stats_f32",
        "token_stats_bf16",
        "token_stats_grad_f32",
        "token_stats_grad_bf16",
    ],
};

/// Threads per row: a 151,936-entry row is 37 vectors of 8 bf16 per thread.
const THREADS: u32 = 512;

/// Makes `token_stats` on burn's CUDA backends (f32 and bf16, with and without autodiff) run
/// these kernels, and returns true; false (nothing registered) when
/// `CUDA_AGENT_VOCAB=decomposed` asks for burn operations or the kernels do not compile.
pub fn install() -> bool {
    if !enabled(&SOURCE, "CUDA_AGENT_VOCAB", "next-token statistics") {
        return false;
    }
    register_token_stats::<Cuda<f32>>(|z, t, temp| forward(&z, &t, temp).map(|(stats, _)| stats));
    register_token_stats::<Cuda<half::bf16>>(|z, t, temp| {
        forward(&z, &t, temp).map(|(stats, _)| stats)
    });
    register_token_stats::<Autodiff<Cuda<f32>>>(tracked::<f32>);
    register_token_stats::<Autodiff<Cuda<half::bf16>>>(tracked::<half::bf16>);
    true
}

/// Whether the kernels take these inputs: f32 or bf16 logits `[rows, vocab]`, i32 targets
/// `[rows]`, rows countable by a grid.
fn supported(logits: &Tensor, targets: &Tensor) -> bool {
    let (ls, ts) = (logits.shape.as_slice(), targets.shape.as_slice());
    matches!(logits.dtype, DType::F32 | DType::BF16)
        && targets.dtype == DType::I32
        && ls.len() == 2
        && ts.len() == 1
        && ts[0] == ls[0]
        && ls[0] > 0
        && ls[0] <= i32::MAX as usize
        && ls[1] > 0
}

/// `([rows, 2]` statistics, `[rows]` log-sum-exp`)`, both f32.
fn forward(logits: &Tensor, targets: &Tensor, temperature: f64) -> Option<(Tensor, Tensor)> {
    if !supported(logits, targets) || temperature.is_nan() || temperature <= 0.0 {
        return None;
    }
    let rows = logits.shape[0];
    let client = logits.client.clone();
    let outputs = [
        TensorIr::uninit(
            client.create_empty_handle(),
            Shape::new([rows, 2]),
            DType::F32,
        ),
        TensorIr::uninit(client.create_empty_handle(), Shape::new([rows]), DType::F32),
    ];
    let streams = OperationStreams::with_inputs([logits, targets]);
    let desc = CustomOpIr::new(
        "cuda_agent_token_stats",
        &[logits.clone().into_ir(), targets.clone().into_ir()],
        &outputs,
    );
    let op = StatsOp {
        desc: desc.clone(),
        temperature,
        backward: false,
    };
    let mut out = client
        .register(streams, OperationIr::Custom(desc), op)
        .into_iter();
    Some((out.next()?, out.next()?))
}

/// The logits' gradient from the statistics' gradient `[rows, 2]`.
fn backward(
    logits: &Tensor,
    targets: &Tensor,
    lse: &Tensor,
    stats: &Tensor,
    grad: &Tensor,
    temperature: f64,
) -> Tensor {
    let client = logits.client.clone();
    let output = TensorIr::uninit(
        client.create_empty_handle(),
        logits.shape.clone(),
        logits.dtype,
    );
    let inputs = [logits, targets, lse, stats, grad];
    let streams = OperationStreams::with_inputs(inputs);
    let desc = CustomOpIr::new(
        "cuda_agent_token_stats_backward",
        &inputs.map(|t| t.clone().into_ir()),
        &[output],
    );
    let op = StatsOp {
        desc: desc.clone(),
        temperature,
        backward: true,
    };
    #[allow(
        clippy::expect_used,
        reason = "the fusion client returns one tensor per output the description names: one"
    )]
    let out = client
        .register(streams, OperationIr::Custom(desc), op)
        .pop()
        .expect("one output registered");
    out
}

/// The tracked operation on the autodiff backend.
fn tracked<F: FloatElement>(
    logits: FloatTensor<Autodiff<Cuda<F>>>,
    targets: Tensor,
    temperature: f64,
) -> Option<FloatTensor<Autodiff<Cuda<F>>>> {
    let (stats, lse) = forward(&logits.primitive, &targets, temperature)?;
    let prep = StatsBackward::<F>(PhantomData)
        .prepare::<NoCheckpointing>([logits.node.clone()])
        .compute_bound()
        .stateful();
    Some(match prep {
        OpsKind::Tracked(prep) => prep.finish(
            (logits.primitive, targets, lse, stats.clone(), temperature),
            stats,
        ),
        OpsKind::UnTracked(prep) => prep.finish(stats),
    })
}

#[derive(Debug)]
struct StatsBackward<F>(PhantomData<F>);

impl<F: FloatElement> Backward<Cuda<F>, 1> for StatsBackward<F> {
    /// Logits, targets, log-sum-exp, statistics, temperature.
    type State = (Tensor, Tensor, Tensor, Tensor, f64);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<Cuda<F>>(&ops.node);
        let [parent] = ops.parents;
        if let Some(parent) = parent {
            let (logits, targets, lse, stats, temperature) = ops.state;
            grads.register::<Cuda<F>>(
                parent.id,
                backward(&logits, &targets, &lse, &stats, &grad, temperature),
            );
        }
    }
}

/// One direction as an operation of the fusion stream.
#[derive(Debug)]
struct StatsOp {
    desc: CustomOpIr,
    temperature: f64,
    backward: bool,
}

impl Operation<Runtime> for StatsOp {
    fn execute(&self, handles: &mut Handles) {
        let inputs = &self.desc.inputs;
        // The element type of the backend does not matter to these handles: every tensor
        // carries its own dtype.
        let logits = rows_contiguous(handles.get_float_tensor::<Cube<f32>>(&inputs[0]));
        let targets = handles.get_int_tensor::<Cube<f32>>(&inputs[1]);
        let [rows, vocab] = [logits.meta.shape()[0], logits.meta.shape()[1]];
        let bf16 = u64::from(logits.dtype == DType::BF16);
        let inv_temp = (1.0 / self.temperature).to_bits();
        let (client, device) = (logits.client.clone(), logits.device.clone());
        if !self.backward {
            let stats = empty_device_contiguous_dtype(
                client.clone(),
                device.clone(),
                Shape::new([rows, 2]),
                DType::F32,
            );
            let lse = empty_device_contiguous_dtype(
                client.clone(),
                device,
                Shape::new([rows]),
                DType::F32,
            );
            let scalars = [
                vocab as u64,
                stride(&logits, 0),
                stride(&targets, 0),
                stride(&stats, 0),
                stride(&lse, 0),
                inv_temp,
            ];
            let buffers = [&logits, &targets, &stats, &lse]
                .map(|t| t.handle.clone().binding())
                .into();
            queue(
                &client,
                &SOURCE,
                bf16 as usize,
                rows as u64,
                THREADS,
                buffers,
                0,
                &scalars,
            );
            handles.register_float_tensor::<Cube<f32>>(&self.desc.outputs[0].id, stats);
            handles.register_float_tensor::<Cube<f32>>(&self.desc.outputs[1].id, lse);
        } else {
            let lse = handles.get_float_tensor::<Cube<f32>>(&inputs[2]);
            let stats = handles.get_float_tensor::<Cube<f32>>(&inputs[3]);
            let grad = handles.get_float_tensor::<Cube<f32>>(&inputs[4]);
            // The statistics are f32, and so is their gradient unless a caller cast it.
            let grad = if grad.dtype == DType::F32 {
                grad
            } else {
                burn_cubecl::kernel::cast(grad, DType::F32)
            };
            let dz = empty_device_contiguous_dtype(
                client.clone(),
                device,
                Shape::new([rows, vocab]),
                logits.dtype,
            );
            let scalars = [
                vocab as u64,
                stride(&logits, 0),
                stride(&targets, 0),
                stride(&lse, 0),
                stride(&stats, 0),
                stride(&grad, 0),
                stride(&grad, 1),
                stride(&dz, 0),
                inv_temp,
            ];
            let buffers = [&logits, &dz, &targets, &lse, &stats, &grad]
                .map(|t| t.handle.clone().binding())
                .into();
            queue(
                &client,
                &SOURCE,
                (2 + bf16) as usize,
                rows as u64,
                THREADS,
                buffers,
                0,
                &scalars,
            );
            handles.register_float_tensor::<Cube<f32>>(&self.desc.outputs[0].id, dz);
        }
    }
}
