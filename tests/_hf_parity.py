"""Helpers shared by the parity tests against transformers' PyTorch models."""

import numpy as np
import torch
from flax import nnx

PARITY_TOL = 1e-4  # float32 logits vs transformers (issue 3 acceptance)


@nnx.jit
def logits(model, ids):
    """The rljax model's float32 logits of ``ids`` (one compile per model graph)."""
    return model(ids)


def hf_logits(model, ids):
    """The transformers model's logits of ``ids`` as numpy."""
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def max_diff(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())
