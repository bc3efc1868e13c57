//! Activation checkpointing per decoder layer. A training pass normally keeps every layer's
//! intermediate tensors for the backward pass: for a 7B model that is about 1.3 GiB per
//! thousand tokens. Here the layers run forward without the autodiff graph, keeping only each
//! layer's input; the backward pass then goes layer by layer from the last, recomputing one
//! layer's forward with the graph from its saved input and backpropagating the gradient that
//! reached its output. Peak activation memory is the saved inputs plus one layer's, for one
//! more forward pass of compute.

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Bool, Int, Tensor};

use super::rope::RopeTables;
use super::transformer::{positions_and_mask, Backbone};

/// The gradients, by parameter of `module`, of `head`'s loss on `backbone`'s final hidden
/// states (after the final norm) for `tokens`, computed layer by layer as the module doc says.
/// One part per backward pass (the head, each layer, the embedding when it is trained); their
/// sum is the gradient a whole-graph backward pass gives.
pub fn layerwise_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    backbone: &Backbone<B>,
    tokens: Tensor<B, 2, Int>,
    valid: Tensor<B, 2, Bool>,
    rope: &RopeTables<B>,
    head: impl FnOnce(Tensor<B, 3>) -> Tensor<B, 1>,
) -> Vec<GradientsParams> {
    let pos = positions_and_mask(valid, None);
    let angles = rope.angles(&pos.positions);
    let (angles_in, mask_in) = (angles.inner(), pos.mask.clone().inner());

    // Forward without the graph, keeping each layer's input.
    let embed = backbone.embed_tokens.val();
    let mut x = burn::tensor::module::embedding(embed.clone().inner(), tokens.clone().inner());
    let mut inputs = Vec::with_capacity(backbone.layers.len());
    for layer in &backbone.layers {
        inputs.push(x.clone());
        x = layer.valid().forward(x, &angles_in, &mask_in, None);
    }

    let mut parts = Vec::with_capacity(backbone.layers.len() + 2);
    // The head: final norm, whatever `head` computes, and its loss.
    let last = Tensor::<B, 3>::from_inner(x).require_grad();
    let grads = head(backbone.norm.forward(last.clone())).backward();
    // No gradient means the loss does not depend on the hidden states: its gradient is zero.
    let mut g = last
        .grad(&grads)
        .unwrap_or_else(|| last.zeros_like().inner());
    parts.push(GradientsParams::from_grads(grads, module));

    // Each layer from the last: recomputed with the graph from its input, then the gradient
    // at its output pushed through (the gradient of sum(y · g) with respect to y is g).
    for (layer, input) in backbone.layers.iter().zip(inputs).rev() {
        let xa = Tensor::<B, 3>::from_inner(input).require_grad();
        let y = layer.forward(xa.clone(), &angles, &pos.mask, None);
        let grads = (y * Tensor::from_inner(g)).sum().backward();
        g = xa.grad(&grads).unwrap_or_else(|| xa.zeros_like().inner());
        parts.push(GradientsParams::from_grads(grads, module));
    }

    // The embedding, when it is trained (tied, its head part is summed in with this one).
    if embed.is_require_grad() {
        let e = burn::tensor::module::embedding(embed, tokens);
        let grads = (e * Tensor::from_inner(g)).sum().backward();
        parts.push(GradientsParams::from_grads(grads, module));
    }
    parts
}
