"""The PyTorch side of `trainer bench-ppo`: one multi-turn PPO step of the same Hugging Face
architecture (Qwen2.5-0.5B's shape by default, random weights), with the same synthetic
episodes and the same parts, timed the same way.

- Rollout: each turn continues every episode from its kept cache (`generate` with the
  episode's DynamicCache), samples exactly `--new-tokens`, then appends the observation.
- Adapters: PEFT's LoRA (its `LoraLayer` math: base(x) + B(A(x)) * alpha / r on every
  projection), one adapter for the actor and one for the critic on the one frozen base, the
  critic with a value head; PEFT itself where it is installed, else those layers written out.
- Update: old log-probabilities and values with the pre-update models, GAE (gamma 1,
  lambda 0.95 as the trainer's defaults), whitened advantages, then one epoch of the clipped
  surrogate and the clipped value loss over micro-batches, one AdamW step each.

Prints one JSON object.

usage: bench_ppo_torch.py [--shape config.json] [--episodes 8] [--context 8192] ...
"""
import argparse
import json
import time

import torch
from torch import nn
from transformers import DynamicCache

from torch_shape import qwen_model

p = argparse.ArgumentParser()
p.add_argument("--shape")
p.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
p.add_argument("--episodes", type=int, default=8)
p.add_argument("--context", type=int, default=8192)
p.add_argument("--prompt", type=int, default=1024)
p.add_argument("--turns", type=int, default=8)
p.add_argument("--new-tokens", type=int, default=256)
p.add_argument("--lora-rank", type=int, default=16)
p.add_argument("--checkpointing", action="store_true")
p.add_argument("--micro-batch", type=int, default=1)
p.add_argument("--steps", type=int, default=2)
p.add_argument("--device", default="cuda", help="cuda, or cpu to check the script on a small shape")
a = p.parse_args()
DEV = a.device

cfg, model = qwen_model(a.shape, a.dtype, DEV)
for q in model.parameters():
    q.requires_grad_(False)
V = cfg.vocab_size
per_turn = (a.context - a.prompt) // a.turns
observation = per_turn - a.new_tokens
assert observation > 0, "the context leaves no room for observations"

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
try:
    import peft  # noqa: F401
    HAVE_PEFT = True
except ImportError:
    HAVE_PEFT = False


class Lora(nn.Module):
    """A frozen projection with one low-rank adapter per name, one of them active (or none)."""
    active = None

    def __init__(self, base, rank, alpha):
        super().__init__()
        self.base, self.scale = base, alpha / rank
        self.a, self.b = nn.ParameterDict(), nn.ParameterDict()
        for name in ("actor", "critic"):
            A = torch.empty(rank, base.in_features, device=DEV)
            nn.init.kaiming_uniform_(A, a=5 ** 0.5)
            self.a[name] = nn.Parameter(A)
            self.b[name] = nn.Parameter(torch.zeros(base.out_features, rank, device=DEV))

    def forward(self, x):
        y = self.base(x)
        n = Lora.active
        if n is None or a.lora_rank == 0:
            return y
        return y + (x.to(torch.float32) @ self.a[n].t() @ self.b[n].t() * self.scale).to(y.dtype)


if a.lora_rank > 0 and HAVE_PEFT:
    from peft import LoraConfig, get_peft_model
    lc = LoraConfig(r=a.lora_rank, lora_alpha=2 * a.lora_rank, target_modules=TARGETS, lora_dropout=0.0)
    model = get_peft_model(model, lc, adapter_name="actor")
    model.add_adapter("critic", lc)
    for n_, q in model.named_parameters():
        if "lora_" in n_:
            q.data = q.data.float()

    def use(name):
        if name is None:
            model.base_model.disable_adapter_layers()
        else:
            model.base_model.enable_adapter_layers()
            model.base_model.set_adapter(name)
            # set_adapter marks only the active adapter trainable; both stay trainable here.
            for n_, q in model.named_parameters():
                if "lora_" in n_:
                    q.requires_grad_(True)

    def adapter_params(name):
        return [q for n_, q in model.named_parameters() if "lora_" in n_ and f".{name}." in n_]
    lora_kind = f"peft {peft.__version__}"
elif a.lora_rank > 0:
    layers = []
    for mod in list(model.modules()):
        for t in TARGETS:
            if isinstance(getattr(mod, t, None), nn.Linear):
                wrapped = Lora(getattr(mod, t), a.lora_rank, 2 * a.lora_rank)
                setattr(mod, t, wrapped)
                layers.append(wrapped)

    def use(name):
        Lora.active = name

    def adapter_params(name):
        return [q for layer in layers for q in (layer.a[name], layer.b[name])]
    lora_kind = "LoRA written out (PEFT not installed)"
else:
    raise SystemExit("this script measures adapters (--lora-rank > 0)")

backbone = model.get_base_model().model if HAVE_PEFT else model.model
lm_head = model.get_base_model().lm_head if HAVE_PEFT else model.lm_head
value_head = nn.Linear(cfg.hidden_size, 1, device=DEV, dtype=torch.float32)
if a.checkpointing:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
actor_opt = torch.optim.AdamW(adapter_params("actor"), lr=1e-6)
critic_opt = torch.optim.AdamW(adapter_params("critic") + list(value_head.parameters()), lr=1e-5)
REWARDS = [-1.0, 1.0, 2.0, 3.0]


def logprobs(ids):
    h = backbone(input_ids=ids).last_hidden_state
    lp = torch.log_softmax(lm_head(h[:, :-1]).float(), -1)
    return lp.gather(-1, ids[:, 1:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)


def values(ids):
    h = backbone(input_ids=ids).last_hidden_state
    return value_head(h[:, :-1].float()).squeeze(-1)


def gae(rewards, vals, mask, gamma=1.0, lam=0.95):
    """GAE over one episode's policy tokens (lists on the host, as the trainer computes it)."""
    adv = [0.0] * len(vals)
    last, nxt = 0.0, 0.0
    for t in reversed(range(len(vals))):
        if not mask[t]:
            continue
        delta = rewards[t] + gamma * nxt - vals[t]
        last = delta + gamma * lam * last
        adv[t], nxt = last, vals[t]
    return adv, [x + v for x, v in zip(adv, vals)]


def peak_gib():
    return torch.cuda.max_memory_allocated() / 2 ** 30 if DEV == "cuda" else None


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


steps = []
for step in range(a.steps):
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    i = torch.arange(a.prompt, device=DEV)
    ctx = torch.stack([(i * 7919 + 13 + e + step) % V for e in range(a.episodes)])
    policy = torch.zeros_like(ctx, dtype=torch.bool)
    sampled_lp = torch.zeros(ctx.shape, device=DEV)
    cache = DynamicCache()
    use("actor")
    model.eval()
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        for turn in range(a.turns):
            out = model.generate(ctx, attention_mask=torch.ones_like(ctx), past_key_values=cache, do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=a.new_tokens,
                                 min_new_tokens=a.new_tokens, eos_token_id=None, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True)
            new = out.sequences[:, ctx.shape[1]:]
            lp = torch.stack([torch.log_softmax(s.float(), -1).gather(-1, new[:, k:k + 1]).squeeze(-1)
                              for k, s in enumerate(out.scores)], 1)
            cache = out.past_key_values
            ctx = out.sequences
            policy = torch.cat([policy, torch.ones_like(new, dtype=torch.bool)], 1)
            sampled_lp = torch.cat([sampled_lp, lp], 1)
            if turn + 1 < a.turns:
                j = torch.arange(observation, device=DEV)
                obs = torch.stack([(j * 104_729 + turn * 31 + e) % V for e in range(a.episodes)])
                ctx = torch.cat([ctx, obs], 1)
                policy = torch.cat([policy, torch.zeros_like(obs, dtype=torch.bool)], 1)
                sampled_lp = torch.cat([sampled_lp, torch.zeros(obs.shape, device=DEV)], 1)
    sync()
    rollout_s = time.perf_counter() - t0
    rollout_peak = peak_gib()
    del cache, out
    if DEV == "cuda":
        torch.cuda.empty_cache()
    sampled = a.episodes * a.turns * a.new_tokens
    t1 = time.perf_counter()
    mask = policy[:, 1:]
    old_lp, old_v = [], []
    with torch.no_grad():
        for s in range(0, a.episodes, a.micro_batch):
            ids = ctx[s:s + a.micro_batch]
            use("actor")
            old_lp.append(logprobs(ids)[0])
            use("critic")
            old_v.append(values(ids))
    old_lp, old_v = torch.cat(old_lp), torch.cat(old_v)
    mask_h, v_h = mask.tolist(), old_v.float().tolist()
    adv, ret = [], []
    for e in range(a.episodes):
        r = [0.0] * len(v_h[e])
        r[max(t for t, on in enumerate(mask_h[e]) if on)] = REWARDS[e % 4]
        ad, rt = gae(r, v_h[e], mask_h[e])
        adv.append(ad)
        ret.append(rt)
    adv, ret = torch.tensor(adv, device=DEV), torch.tensor(ret, device=DEV)
    m = adv[mask]
    adv = (adv - m.mean()) / (m.std() + 1e-8)
    n_tok = mask.sum()
    model.train()
    for s in range(0, a.episodes, a.micro_batch):
        sl = slice(s, s + a.micro_batch)
        ids, mk = ctx[sl], mask[sl].float()
        use("actor")
        lp, ent = logprobs(ids)
        ratio = (lp - old_lp[sl]).exp()
        surr = -torch.min(ratio * adv[sl], ratio.clamp(0.8, 1.28) * adv[sl])
        ((surr * mk).sum() / n_tok - 0.0 * (ent * mk).sum() / n_tok).backward()
        use("critic")
        v = values(ids)
        vc = old_v[sl] + (v - old_v[sl]).clamp(-0.2, 0.2)
        vl = torch.max((v - ret[sl]) ** 2, (vc - ret[sl]) ** 2)
        (0.5 * (vl * mk).sum() / n_tok).backward()
    actor_opt.step()
    critic_opt.step()
    actor_opt.zero_grad(set_to_none=True)
    critic_opt.zero_grad(set_to_none=True)
    sync()
    update_s = time.perf_counter() - t1
    tokens = ctx.numel()
    row = {"step": step, "rollout_s": rollout_s, "sampled_tokens": sampled,
           "sampled_tokens_per_s": sampled / rollout_s, "update_s": update_s, "episode_tokens": tokens,
           "trained_tokens_per_s": tokens / update_s, "step_s": rollout_s + update_s,
           "rollout_peak_gib": rollout_peak, "peak_memory_gib": peak_gib(),
           "sampling_logprob_mismatch": float(((sampled_lp[:, 1:] - old_lp).abs() * mask).sum() / n_tok)}
    print(json.dumps(row), flush=True)
    steps.append(row)

print(json.dumps({
    "engine": f"pytorch eager (sdpa), {lora_kind}",
    "torch": torch.__version__,
    "params": sum(q.numel() for q in model.parameters()),
    "episodes": a.episodes, "context": a.context, "prompt": a.prompt, "turns": a.turns,
    "new_tokens": a.new_tokens, "observation": observation, "lora_rank": a.lora_rank,
    "checkpointing": a.checkpointing, "micro_batch": a.micro_batch, "steps": steps,
}, indent=2))
