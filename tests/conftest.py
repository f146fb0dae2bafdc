"""Suite-wide setup. TRITON_INTERPRET must be set before anything imports triton, so that the
Triton kernels themselves run (interpreted) on CPU tensors when there is no GPU."""

import os

try:  # probing CUDA without importing torch first would be nicer, but torch is cheap enough here
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_cuda = False

if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
