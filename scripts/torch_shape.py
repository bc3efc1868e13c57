"""The model both PyTorch benchmarks build: a Hugging Face Qwen2 of a config.json's shape (or
Qwen2.5-0.5B's, the trainer's default), random weights drawn from seed 0, in a precision."""
import torch
from transformers import AutoModelForCausalLM, Qwen2Config


def qwen_model(shape, dtype, device, attn="sdpa"):
    """(config, model): `shape` is a config.json path or None; `dtype` is "bf16" or "f32"."""
    if shape:
        cfg = Qwen2Config.from_json_file(shape)
    else:
        cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                          rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    return cfg, AutoModelForCausalLM.from_config(cfg).to(device, dt)
