"""The PyTorch eager side of the model benchmark: the same Hugging Face architecture as the
trainer's `bench-model` (Qwen2.5-0.5B's shape by default, random weights), timed the same
way: forward + backward of next-token log-probabilities at a sequence length, and batched
sampling from fixed prompts. Prints one JSON object.

usage: bench_model_torch.py [--shape config.json] [--dtype bf16|f32] [--seq 2048] ...
"""
import argparse
import json
import time

import torch

from torch_shape import qwen_model

p = argparse.ArgumentParser()
p.add_argument("--shape")
p.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
p.add_argument("--seq", type=int, default=2048)
p.add_argument("--train-batch", type=int, default=1)
p.add_argument("--train-iters", type=int, default=5)
p.add_argument("--gen-batch", default="1,32")
p.add_argument("--prompt", type=int, default=128)
p.add_argument("--new-tokens", type=int, default=128)
p.add_argument("--attn", default="sdpa", help="attention implementation (sdpa or eager)")
a = p.parse_args()

cfg, model = qwen_model(a.shape, a.dtype, "cuda", a.attn)
V = cfg.vocab_size


def tokens(b, t):
    i = torch.arange(b * t, device="cuda")
    return ((i * 7919 + 13) % V).reshape(b, t)


times = []
for it in range(a.train_iters + 1 if a.train_iters else 0):  # 0: generation only
    ids = tokens(a.train_batch, a.seq)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = model(input_ids=ids).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -lp.mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    if it > 0:
        times.append(time.perf_counter() - t0)
times.sort()
train_s = times[len(times) // 2] if times else None

gen = []
model.eval()
for gb in [int(x) for x in a.gen_batch.split(",")]:
    base = tokens(1, a.prompt)[0]
    prompts = torch.stack([(base + r) % V for r in range(gb)])
    best = None
    for rep in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                                 eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if rep == 1:
            n = (out.shape[1] - a.prompt) * gb
            gen.append({"batch": gb, "prompt": a.prompt, "new_tokens": a.new_tokens, "seconds": dt, "tokens_per_s": n / dt})

print(json.dumps({
    "engine": f"pytorch eager ({a.attn})",
    "torch": torch.__version__,
    "params": sum(p.numel() for p in model.parameters()),
    "train": {"batch": a.train_batch, "seq": a.seq, "seconds": train_s, "tokens_per_s": a.train_batch * a.seq / train_s} if train_s else None,
    "generate": gen,
}, indent=2))
