"""Throughput metrics of one RL step: tokens/s (whole mesh and per chip), phase times,
model FLOP/s and MFU.

``step_throughput`` is a pure function of the step's token counts, phase times and the
chip count; ``RLTrainer`` calls it once per step (``rljax.train.rl``). Names of the
metrics it returns:

- ``rollout_tok_s``: generated tokens / rollout seconds, over the whole mesh;
  ``rollout_tok_s_per_chip`` the same divided by the number of chips.
- ``train_tok_s``: epochs x (prompt + completion) tokens / learning-program seconds;
  ``train_tok_s_per_chip`` per chip.
- ``step_tok_s`` (instead of the two above when the step is one program, with a device
  reward): generated tokens / step seconds; ``step_tok_s_per_chip`` per chip.
- ``time_<phase>``: wall-clock seconds of each phase (rollout, reward, learn, ...).
- ``model_flops_s``: model FLOPs of the step (``step_model_flops``; an MoE model counts
  its active parameters) / the step's seconds, over the whole mesh;
  ``model_flops_s_per_chip`` per chip.
- ``mfu``: ``model_flops_s_per_chip`` / the chip's peak, only when the peak is known
  (``peak_flops_per_chip``: the table below, or ``RLConfig.peak_flops``). On CPU or an
  unknown accelerator there is no ``mfu``, only FLOP/s.

Per-chip figures divide by every device of the mesh (all processes): the step is one SPMD
program over all of them. A device is a chip on every accelerator in the table but TPU7x,
where it is one of the chip's two TensorCores (so there, "per chip" reads per TensorCore).
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Mapping

import jax

from rljax.models.moe import active_params

__all__ = ["PEAK_BF16_FLOPS", "PhaseTimes", "active_count", "chips_and_kind",
           "peak_flops_per_chip", "step_model_flops", "step_throughput"]


@dataclasses.dataclass
class PhaseTimes:
    """Wall-clock seconds per phase of one step."""

    times: dict = dataclasses.field(default_factory=dict)

    def timed(self, name: str, fn, *args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        jax.block_until_ready(out)
        self.add(name, time.perf_counter() - t0)
        return out

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to phase ``name``."""
        self.times[name] = self.times.get(name, 0.0) + seconds


# Dense (no sparsity) bfloat16 matmul peak per chip, by `jax.Device.device_kind`, first
# match wins (patterns are matched against the lower-cased kind). MFU is measured against
# this peak whatever dtype the model computes in (float32 matmuls run as bf16 passes on TPU
# by default). Vendors' published per-chip figures:
# - Google Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p,
#   v6e), "peak compute per chip (bf16)": v4 275 TFLOP/s, v5e 197, v5p 459, v6e 918.
#   JAX names v5e "TPU v5 lite", v5p "TPU v5", v6e "TPU v6 lite".
# - TPU7x (Ironwood; JAX's kind "TPU7x"): 2307 TFLOP/s bf16 per chip (cloud.google.com/
#   tpu/docs/tpu7x), but a chip's two TensorCores are two JAX devices (no megacore:
#   jax.experimental.pallas.tpu.ChipVersion), and this module's "chip" is a device, so its
#   entry is half the chip's figure. (v4 and v5p chips are one device: megacore.)
# - NVIDIA data sheets, BF16 Tensor Core, halved from the "with sparsity" figures they
#   print: A100 (SXM and PCIe) 312 TFLOP/s; H100 SXM 989, H100 NVL 835, H100 PCIe 756;
#   H200 SXM 989, H200 NVL 835.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"^tpu v4$", 275e12),
    (r"^tpu v5 ?(lite|e)$", 197e12),
    (r"^tpu v5p?$", 459e12),
    (r"^tpu v6 ?(lite|e)$|trillium", 918e12),
    (r"^tpu ?7x$|ironwood", 2307e12 / 2),
    (r"a100", 312e12),
    (r"h100.*pcie", 756e12),
    (r"h[12]00.*nvl", 835e12),
    (r"h[12]00", 989e12),
)


def peak_flops_per_chip(device_kind: str) -> float | None:
    """The chip's dense bf16 peak FLOP/s from ``PEAK_BF16_FLOPS``, or None for a kind the
    table does not know (CPU, older or newer chips)."""
    kind = device_kind.strip().lower()
    for pattern, peak in PEAK_BF16_FLOPS:
        if re.search(pattern, kind):
            return peak
    return None


def chips_and_kind(mesh) -> tuple[int, str]:
    """``(number of devices, device kind)`` of ``mesh`` (every process's devices), or of
    the one default device when ``mesh`` is None."""
    if mesh is None:
        return 1, jax.devices()[0].device_kind
    return int(mesh.devices.size), mesh.devices.flat[0].device_kind


def active_count(num_params: int, config) -> int:
    """The parameters a token computes with, of a model of ``num_params`` parameters and
    ``ModelConfig`` ``config`` (`rljax.models.moe.active_params`: an MoE layer's idle
    experts left out); ``num_params`` for a dense model or no config."""
    return num_params if config is None else active_params(num_params, config)


def step_model_flops(num_params: int, *, gen_tokens: float, seq_tokens: float,
                     extra_forwards: int, epochs: int, teacher_params: int = 0,
                     prefill_tokens: float = 0.0, value_params: int = 0,
                     trainable_params: int | None = None) -> float:
    """Model FLOPs of one RL step: every pass the algorithm needs, counted once (Kaplan et
    al. 2020, "Scaling Laws for Neural Language Models", Sec. 2.1: 2N per token for a
    forward, 6N for forward + backward; attention FLOPs left out). Recomputation by
    rematerialisation is not counted (that would make it hardware FLOPs, not MFU).

    ====================================  ==============================================
    pass                                  FLOPs
    ====================================  ==============================================
    sampler prefill                       2N x ``prefill_tokens`` (each prompt once)
    sampler decode                        2N x ``gen_tokens``
    policy-sized forwards before or       2N x ``seq_tokens`` x ``extra_forwards``
    between updates: reference, old
    policy (a recompute, or PPO's
    self-mode forward for GAE),
    Clip-Cov / KL-Cov selection (one per
    epoch: each update's minibatch)
    policy updates                        (4N + 2 N_train) x ``seq_tokens`` x ``epochs``
    value model (PPO): values before the  2 N_value x ``seq_tokens`` + 6 N_value x
    updates, then trained each epoch      ``seq_tokens`` x ``epochs``
    distillation teacher                  2 N_teacher x ``seq_tokens``
    ====================================  ==============================================

    N counts the parameters a token computes with: an MoE model's active parameters
    (``active_count``), not its idle experts. ``seq_tokens`` are the tokens the learning
    program's forwards compute: with shared prompts (``RLConfig.share_prompts``) each
    group's prompt tokens count once. An update
    is a forward (2N), the activations' gradients (2N) and the weights' gradients of the
    ``trainable_params`` N_train (None: all N, 6N in all); with LoRA, N counts base and
    adapters and N_train the adapters, whose frozen base forms no weight gradient.
    """
    n, nv = num_params, value_params
    nt = n if trainable_params is None else trainable_params
    return (2 * n * (gen_tokens + prefill_tokens) + 2 * n * seq_tokens * extra_forwards
            + (4 * n + 2 * nt) * seq_tokens * epochs + 2 * teacher_params * seq_tokens
            + (2 + 6 * epochs) * nv * seq_tokens)


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def step_throughput(*, gen_tokens: float, seq_tokens: float, epochs: int,
                    times: Mapping[str, float], flops: float, num_chips: int,
                    peak_per_chip: float | None) -> dict[str, float]:
    """The throughput metrics of one step (names in the module docstring).

    Args:
      gen_tokens: completion tokens generated in the step (the whole mesh).
      seq_tokens: prompt + completion tokens of the learning batch.
      epochs: passes of the learning program over the batch.
      times: wall-clock seconds per phase; "rollout" and "learn" give the token rates and
        the sum of all phases the FLOP rate; a one-program step (a device reward) has only
        "step", whose rate ``step_tok_s`` counts completion tokens per second of the step.
      flops: model FLOPs of the step (``step_model_flops``).
      num_chips: devices the step ran on (>= 1).
      peak_per_chip: the chip's peak FLOP/s, or None (no ``mfu``).
    """
    if num_chips < 1:
        raise ValueError(f"step_throughput: num_chips must be >= 1, got {num_chips}")
    if "step" in times:  # one program from prompts to update: no phase split exists
        rates = {"step_tok_s": _rate(gen_tokens, times["step"])}
    else:
        rates = {"rollout_tok_s": _rate(gen_tokens, times.get("rollout", 0.0)),
                 "train_tok_s": _rate(epochs * seq_tokens, times.get("learn", 0.0))}
    m: dict[str, float] = {}
    for k, v in {"model_flops_s": _rate(flops, sum(times.values())), **rates}.items():
        m.update({k: v, f"{k}_per_chip": v / num_chips})
    m.update({f"time_{k}": float(v) for k, v in times.items()})
    if peak_per_chip:
        m["mfu"] = m["model_flops_s_per_chip"] / peak_per_chip
    return m
