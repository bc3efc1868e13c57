"""Input preparation for kernels_ext (no numpy, no torch.compile; sys.modules untouched)."""
from __future__ import annotations

import torch


def contiguous_f32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor as a contiguous float32 tensor (a copy only where needed)."""
    return [t.contiguous() if t.dtype == torch.float32 else t.float().contiguous() for t in tensors]


if __name__ == "__main__":
    import numpy as np

    print(np.allclose(contiguous_f32(torch.ones(3))[0].numpy(), 1.0))
