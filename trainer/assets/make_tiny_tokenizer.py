"""Builds tiny-tokenizer.json: a byte-level BPE vocabulary of 512 tokens with the ChatML
special tokens, trained on text shaped like the tiny task family's conversations. It lets a
small random policy (tests, throughput runs) tokenise any text in few tokens.

usage: python make_tiny_tokenizer.py OUT.json
"""
import json
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

WORDS = ["red", "blue", "green", "amber", "violet", "cyan", "olive", "pearl"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus():
    system = "You are an agent in a sandboxed workspace. Act only through tool calls, one per turn."
    for i, w in enumerate(WORDS):
        task = f"Task tiny/{i}_{w}: Write the word {w} into answer.txt, then call Submit. Limits: 4 tool calls."
        write = json.dumps({"name": "Write", "arguments": {"file_path": "answer.txt", "content": w}}, separators=(",", ":"), sort_keys=True)
        submit = json.dumps({"name": "Submit", "arguments": {}}, separators=(",", ":"), sort_keys=True)
        for _ in range(20):
            yield (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{task}<|im_end|>\n"
                   f"<|im_start|>assistant\n<tool_call>\n{write}\n</tool_call><|im_end|>\n"
                   f"<|im_start|>user\n<tool_response>\nWrote {len(w) + 1} bytes to answer.txt\n</tool_response><|im_end|>\n"
                   f"<|im_start|>assistant\n<tool_call>\n{submit}\n</tool_call><|im_end|>")
    code = ("import torch\nimport torch.nn as nn\n\nclass Model(nn.Module):\n    def __init__(self):\n"
            "        super().__init__()\n\n    def forward(self, x):\n        return torch.relu(x)\n\n"
            "def get_inputs():\n    return [torch.randn(16, 16384)]\n\ndef get_init_inputs():\n    return []\n")
    for _ in range(5):
        yield code
        yield "Error: no tool call found. Read SKILL.md, write model_new.py, python verify.py, python profile.py"


tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIALS,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train_from_iterator(corpus(), trainer)
tok.save(sys.argv[1])
print(tok.get_vocab_size(), "tokens")
