"""Prints the model benchmark as a Markdown table: burn (the trainer) beside PyTorch eager.

usage: bench_model_table.py BURN.json TORCH.json
"""
import json
import sys

burn, torch = (json.load(open(p)) for p in sys.argv[1:3])
rows = []
if burn.get("train") and torch.get("train"):  # absent when a side ran generation only
    rows.append(("train fwd+bwd, batch %d x seq %d" % (burn["train"]["batch"], burn["train"]["seq"]),
                 burn["train"]["tokens_per_s"], torch["train"]["tokens_per_s"]))
tg = {g["batch"]: g for g in torch["generate"]}
for g in burn["generate"]:
    t = tg.get(g["batch"])
    if t:
        rows.append(("generate, batch %d (%d prompt + %d new)" % (g["batch"], g["prompt"], g["new_tokens"]),
                     g["tokens_per_s"], t["tokens_per_s"]))
print(f"| workload | {burn['engine']} tokens/s | {torch['engine']} tokens/s | burn / torch |")
print("|---|---:|---:|---:|")
for name, b, t in rows:
    print(f"| {name} | {b:,.0f} | {t:,.0f} | {b / t:.2f} |")
