//! The next token of each generated row chosen in one kernel (`sample.cu`): greedy or a draw
//! from the whole distribution at a temperature, with the token's log-probability, where the
//! composition of burn operations (`generate::draw_on_device`) took about twenty operations
//! and two reads of the device per decode step. One custom operation of the fusion stream;
//! the caller reads its `[rows, 2]` ints once.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::FloatElement;
use burn_fusion::stream::{Operation, OperationStreams};
use burn_ir::{CustomOpIr, OperationIr, TensorIr};
use std::marker::PhantomData;

use super::module::Source;
use super::stream::{
    enabled, queue, rows_contiguous, Cube, Cuda, FusionTensor as Tensor, Handles, Runtime,
};
use crate::generate::FusedChoice;
use crate::model::fused;

pub(super) static SOURCE: Source = Source {
    name: "sample.cu",
    code: concat!(include_str!("common.cuh"), include_str!("sample.cu")),
    kernels: &["sample_f32", "sample_bf16"],
};

const THREADS: u32 = 1024;
/// `sample.cu`'s `DRAW_BLOCK` and `MAX_DRAW_BLOCKS`: the widest vocabulary its shared
/// memory holds the block masses of.
const MAX_VOCAB: usize = 128 * 4096;

/// Makes generation on burn's CUDA backend (f32 and bf16) choose its tokens with this kernel,
/// and returns true; false (nothing registered) when `CUDA_AGENT_SAMPLE=decomposed` asks for
/// burn operations or the kernel does not compile.
pub fn install() -> bool {
    if !enabled(&SOURCE, "CUDA_AGENT_SAMPLE", "choosing the next token") {
        return false;
    }
    fused::register::<Cuda<f32>, FusedChoice<Cuda<f32>>>(choose::<f32>);
    fused::register::<Cuda<half::bf16>, FusedChoice<Cuda<half::bf16>>>(choose::<half::bf16>);
    true
}

fn choose<F: FloatElement>(
    logits: FloatTensor<Cuda<F>>,
    temperature: f64,
    draws: IntTensor<Cuda<F>>,
) -> Option<IntTensor<Cuda<F>>> {
    let s = logits.shape.as_slice();
    let supported = s.len() == 2
        && s[1] > 0
        && s[1] <= MAX_VOCAB
        && u32::try_from(s[0]).is_ok()
        && matches!(logits.dtype, DType::F32 | DType::BF16)
        && draws.shape.as_slice() == [s[0], 2]
        && draws.dtype == DType::I32;
    if !supported {
        return None;
    }
    let client = logits.client.clone();
    let out = TensorIr::uninit(
        client.create_empty_handle(),
        Shape::new([s[0], 2]),
        DType::I32,
    );
    let inputs: [&Tensor; 2] = [&logits, &draws];
    let streams = OperationStreams::with_inputs(inputs);
    let desc = CustomOpIr::new(
        "cuda_agent_sample",
        &inputs.map(|t| t.clone().into_ir()),
        &[out],
    );
    let op = ChooseOp::<F> {
        desc: desc.clone(),
        temperature,
        _f: PhantomData,
    };
    client
        .register(streams, OperationIr::Custom(desc), op)
        .pop()
}

/// The choice as an operation of the fusion stream.
#[derive(Debug)]
struct ChooseOp<F> {
    desc: CustomOpIr,
    temperature: f64,
    _f: PhantomData<F>,
}

impl<F: FloatElement> Operation<Runtime> for ChooseOp<F> {
    fn execute(&self, handles: &mut Handles) {
        let inputs = &self.desc.inputs;
        let logits = rows_contiguous(handles.get_float_tensor::<Cube<F>>(&inputs[0]));
        let draws =
            burn_cubecl::kernel::into_contiguous(handles.get_int_tensor::<Cube<F>>(&inputs[1]));
        let [rows, vocab] = [logits.meta.shape()[0], logits.meta.shape()[1]];
        let (client, device) = (logits.client.clone(), logits.device.clone());
        let out = empty_device_contiguous_dtype(
            client.clone(),
            device,
            Shape::new([rows, 2]),
            DType::I32,
        );
        let row_stride = if rows == 1 {
            0
        } else {
            logits.meta.strides()[0] as u64
        };
        let scalars = [vocab as u64, row_stride, self.temperature.to_bits()];
        let buffers = [&logits, &draws, &out]
            .map(|t| t.handle.clone().binding())
            .into();
        queue(
            &client,
            &SOURCE,
            usize::from(logits.dtype == DType::BF16),
            rows as u64,
            THREADS,
            buffers,
            0,
            &scalars,
        );
        handles.register_int_tensor::<Cube<F>>(&self.desc.outputs[0].id, out);
    }
}
