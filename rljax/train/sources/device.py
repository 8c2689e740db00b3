"""The device-reward source: single-turn completions scored by a JAX reward
(``rljax.rewards.device``) inside the step's one program.

Nothing of its step needs the host between the prompt ids and the metrics, so the driver
runs ``rljax.train.programs.step.fused_step`` (sample -> score -> learn) on the inputs
this source prepares (:meth:`DeviceRewardSource.inputs`); several seeds run the same
program vmapped (``seeds_step``). Its held-out evaluation scores on device too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rljax.sampling.generate import config_of, prepare
from rljax.train import hosts
from rljax.train.batch import PromptSource
from rljax.train.config import SamplingConfig
from rljax.train.programs import program_signature
from rljax.train.programs.device import device_scores, seeds_evaluate
from rljax.train.sources.prompts import PromptRows, eval_rows, sum_rows

__all__ = ["DeviceRewardSource"]


class DeviceRewardSource(PromptRows):
    """Prompts and task arrays for the one-program step with the device ``reward``
    (``reward.task_arrays(metadata)``: per-prompt arrays). The held-out accuracy is
    ``accuracy_fn(completion, meta)``'s where one is given, else, for a reward with
    ``verifier = True``, the fraction of positive scores (as in the step's metrics)."""

    on_device = True

    def __init__(self, graphdef, tokenizer, reward, *, sampling: SamplingConfig,
                 prompt_len: int, group_size: int, mesh=None, prompt_multiple: int = 16,
                 accuracy_fn=None):
        super().__init__(graphdef, tokenizer, sampling=sampling, prompt_len=prompt_len,
                         group_size=group_size, mesh=mesh, prompt_multiple=prompt_multiple)
        self.reward, self.accuracy_fn = reward, accuracy_fn
        self.seed_programs: set = set()  # the seed form's evaluation programs (signatures)

    def inputs(self, params, source: PromptSource, pos: int, n_prompts: int, *,
               on_host: bool = False):
        """The one-program step's inputs for prompts ``pos .. pos + n_prompts`` (this
        process reads its own block): ``(DecodeSpec, (tokens, mask, positions), task
        arrays)``, the arrays placed on the mesh by rows (numpy, every process's rows,
        with ``on_host``)."""
        g = self.group_size
        lo, _, meta, tok, mask = self.own_prompts(source, pos, n_prompts)
        task = {k: hosts.gather_blocks(np.asarray(v), lo // g, n_prompts)
                for k, v in self.reward.task_arrays(meta).items()}
        batch, spec = prepare(config_of(self.gd, params), tok, prompt_mask=mask > 0,
                              **self.decode_args(num_samples=g))
        arrays = (batch.tokens_BxP, batch.mask_BxP, batch.positions_BxP)
        if on_host:
            return spec, arrays, task
        return (spec, tuple(hosts.put_rows(x, self.mesh) for x in arrays),
                {k: hosts.put_rows(v, self.mesh) for k, v in task.items()})

    def collect(self, params, window, key, ph):
        raise TypeError("DeviceRewardSource: its step is one program "
                        "(rljax.train.programs.step.fused_step); it collects nothing on "
                        "the host")

    def _sums(self, rewards_N: np.ndarray, correct_N=None) -> dict:
        """A batch's sums; ``correct_N``: the host verifier's outcomes, if any."""
        sums = {"reward": float(np.sum(rewards_N))}
        if correct_N is not None:
            sums["accuracy"] = float(np.sum(correct_N))
        elif self.reward.verifier:
            sums["accuracy"] = float(np.sum(rewards_N > 0))
        return sums

    def eval_batch(self, params, prompts: list, metadata: list, first: int) -> dict:
        """Greedy completions of held-out ``prompts`` scored by the device reward (every
        row in the program; each process sums its own): sums over every process's rows."""
        tok, mask = self.encode_all(prompts)
        lo, hi = eval_rows(len(prompts), self.mesh)
        out = self.generate(params, tok, mask, jax.random.key(0), greedy=True)
        with jax.transfer_guard("allow"):
            all_rows = device_scores(self.reward, out, self.reward.task_arrays(metadata))
        correct = None
        if self.accuracy_fn is not None:
            correct = [bool(self.accuracy_fn(c, m))
                       for c, m in zip(self.own_texts(out, lo, hi), metadata[lo:hi])]
        return sum_rows(self._sums(hosts.host_rows(all_rows, lo, hi), correct))

    def eval_seeds(self, params_S, prompts_S: list, metadata_S: list) -> list[dict]:
        """The seed form (one device): seed ``i``'s parameters (leading axis of
        ``params_S``) on its prompts ``prompts_S[i]``; all seeds sample and score in one
        vmapped program (``seeds_evaluate``, its signatures in ``seed_programs``); the
        ``S * b`` rows are packed together, so all seeds share the widest prompt's
        bucket. One dict of sums per seed."""
        s = len(metadata_S)  # config_of: the config is static, stacked parameters merge too
        tok, mask = self.encode_all([p for ps in prompts_S for p in ps])
        batch, spec = prepare(config_of(self.gd, params_S), tok, prompt_mask=mask > 0,
                              **self.decode_args(greedy=True))
        args = [jnp.asarray(x.reshape(s, -1, x.shape[1]))
                for x in (batch.tokens_BxP, batch.mask_BxP, batch.positions_BxP)]
        tasks = [self.reward.task_arrays(m) for m in metadata_S]
        task = {k: jnp.asarray(np.stack([t[k] for t in tasks])) for k in tasks[0]}
        self.seed_programs.add(program_signature(spec, (params_S, args, task)))
        r_Sxb = np.asarray(seeds_evaluate(self.gd, self.reward, spec, params_S, *args, task))
        return [self._sums(r) for r in r_Sxb]
