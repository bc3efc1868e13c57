"""Rewrites the shared-extension block of every case from shared_ext.py, or checks them.

    python tests/redteam/sync_shared.py          # rewrite
    python tests/redteam/sync_shared.py --check  # exit 1 if any case differs

A case's model_new.py marks where the block goes with two lines:
    # ---- shared extension: begin ----
    # ---- shared extension: end ----
(or "shared cuda extension" for the CUDA block). Everything between them is replaced.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from shared_ext import SHARED_BLOCK, SHARED_CUDA_BLOCK  # noqa: E402

BLOCKS = {"shared extension": SHARED_BLOCK, "shared cuda extension": SHARED_CUDA_BLOCK}


def render(text: str) -> str:
    for label, block in BLOCKS.items():
        pattern = re.compile(rf"(# ---- {label}: begin ----\n).*?(# ---- {label}: end ----\n)", re.S)
        text = pattern.sub(lambda m: m.group(1) + block.strip("\n") + "\n" + m.group(2), text)
    return text


def case_files() -> list[Path]:
    return sorted((HERE / "cases").glob("*/model_new.py"))


def main() -> int:
    check = "--check" in sys.argv
    stale = []
    for path in case_files():
        text = path.read_text()
        new = render(text)
        if new != text:
            stale.append(path)
            if not check:
                path.write_text(new)
    if check and stale:
        print("out of date:", *[str(p.relative_to(HERE)) for p in stale], sep="\n  ")
        return 1
    if not check:
        print(f"rewrote {len(stale)} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
