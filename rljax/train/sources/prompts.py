"""The single-turn sources' shared part (``Rollouts``, ``DeviceRewardSource``): each
process reads its own block of a window's prompts, encodes and left-pads them, the sampler
runs one SPMD program over every process's rows (bucketed widths), and each process
detokenises only the rows it holds."""

from __future__ import annotations

import jax
import numpy as np

from rljax.sampling import generate
from rljax.train import hosts
from rljax.train.batch import PromptSource
from rljax.train.batching import decode_completions, encode_text, pad_left, special_ids, stop_ids
from rljax.train.config import SamplingConfig

__all__ = ["PromptRows", "eval_rows"]


class PromptRows:
    """Prompts -> the sampler's rows for one policy and tokenizer.

    ``prompt_len``: the prompt width cap (a longer prompt is an error naming its index);
    ``prompt_multiple``: prompts are left-padded to a multiple of it (the compiled
    buckets); ``group_size``: completions per prompt. Completions end at any of the
    tokenizer's ``stop_ids`` (``rljax.train.batching.stop_ids``).
    """

    on_device = False

    def __init__(self, graphdef, tokenizer, *, sampling: SamplingConfig, prompt_len: int,
                 group_size: int, mesh=None, prompt_multiple: int = 16):
        self.gd, self.tok, self.sampling, self.mesh = graphdef, tokenizer, sampling, mesh
        self.prompt_len, self.group_size = prompt_len, group_size
        self.prompt_multiple = prompt_multiple
        self.pad_id, self.eos_id = special_ids(tokenizer)
        self.stop_ids = stop_ids(tokenizer)

    def own_prompts(self, source: PromptSource, pos: int, n: int):
        """This process's block of prompts ``pos .. pos + n`` (whole groups of its rows
        ``[lo, hi)``) -> ``(lo, hi, own metadata, ids [n, prompt_len], masks)``, the ids and
        masks every process's, placed by position."""
        g = self.group_size
        lo, hi = hosts.own_groups(n * g, g, self.mesh)
        prompts, meta = source(pos + lo // g, (hi - lo) // g)
        ids = [encode_text(self.tok, p) for p in prompts]
        for i, x in enumerate(ids):
            if not 0 < len(x) <= self.prompt_len:
                raise ValueError(f"prompt {pos + lo // g + i} has {len(x)} tokens; allowed: "
                                 f"1..{self.prompt_len} (prompt_len)")
        tok, mask = pad_left(ids, self.prompt_len, self.pad_id)
        return (lo, hi, list(meta), hosts.gather_blocks(tok, lo // g, n),
                hosts.gather_blocks(mask, lo // g, n))

    def encode_all(self, prompts: list) -> tuple[np.ndarray, np.ndarray]:
        """Every row's ids and masks of held-out ``prompts`` (every process the same)."""
        return pad_left([encode_text(self.tok, p) for p in prompts], self.prompt_len,
                        self.pad_id)

    def generate(self, params, tok_NxW, mask_NxW, key, *, greedy: bool = False,
                 num_samples: int = 1):
        """The sampler on padded prompts, bucketed: ``min(bucket_length(longest,
        prompt_multiple), prompt_len)`` columns (the sampler's ``SampleResult``, global
        arrays)."""
        # The sampler's entry is the step's "prompt ids in" transfer: it packs the ids on
        # the host and places them on the mesh (rljax.sampling has its own tests).
        with jax.transfer_guard("allow"):
            return generate((self.gd, params), tok_NxW, prompt_mask=mask_NxW > 0, key=key,
                            mesh=self.mesh, **self.decode_args(greedy, num_samples))

    def decode_args(self, greedy: bool = False, num_samples: int = 1) -> dict:
        """The sampler's settings (``generate`` / ``prepare`` keywords) for these
        prompts: ``SamplingConfig.sampler_args``, stop ids, padding and buckets."""
        return dict(**self.sampling.sampler_args(greedy=greedy), stop_ids=self.stop_ids,
                    num_samples=num_samples, pad_id=self.pad_id,
                    length_multiple=self.prompt_multiple,
                    # Buckets never exceed prompt_len: the last one is prompt_len itself.
                    max_len=self.prompt_len + self.sampling.max_new_tokens - 1)

    def own_texts(self, out, lo: int, hi: int) -> list:
        """Detokenise rows ``[lo, hi)`` (this process's) of the sampler's output."""
        tokens = hosts.host_rows(out.tokens, lo, hi)
        mask = hosts.host_rows(out.completion_mask, lo, hi)
        return decode_completions(self.tok, tokens, mask, self.stop_ids)


def eval_rows(n: int, mesh) -> tuple[int, int]:
    """This process's rows of an evaluation batch: its shard block when the rows split
    over the devices; otherwise the sampler replicates them and each process takes an
    equal contiguous part (so every row is scored exactly once)."""
    n_dev = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    if n % n_dev == 0:
        return hosts.own_rows(n, mesh)
    p, k = jax.process_index(), jax.process_count()
    return p * n // k, (p + 1) * n // k


def sum_rows(sums: dict) -> dict:
    """``{name: this process's sum}`` -> ``{name: every process's sum}`` (one transfer)."""
    names = sorted(sums)
    tot = hosts.gather_rows(np.asarray([[sums[k] for k in names]], np.float64)).sum(axis=0)
    return {k: float(v) for k, v in zip(names, tot)}
