"""One GRPO step, rljax vs TRL's GRPOTrainer, on the reference model, interleaved in one run.

The workload (issue 19): the reference benchmark model (random Qwen2: hidden 256, 4
layers, 8 heads, 4 kv heads, intermediate 704, vocab 32000, float32, initialised as
transformers does), written as an HF checkpoint by ``_bench.build_checkpoint`` in a
temporary folder with a byte-level BPE tokenizer trained here (32,000 ids); 8 prompts of
32 tokens x 8 completions x 128 new tokens sampled at temperature 1 with no early stop (TRL:
``min_new_tokens=128``; rljax has fixed shapes and stops only when every row has drawn
EOS, which a random model does with probability ~1/32000 per token), GRPO with beta 0.04
against a frozen reference model (k3 in the loss), one AdamW step at lr 1e-6, a cheap
host reward (``_bench.vowel_fraction``) on both sides.

Each side is used as a user would: rljax's ``from_pretrained`` + ``load_tokenizer`` +
``RLTrainer.step``; TRL 1.16 ``GRPOTrainer`` (CPU, no vLLM, the settings in docs/design.md)
on the same folder. Both sides warm up first (``--warmup`` steps: compilation, lazy
init), then run interleaved: each TRL step is followed by one rljax step, the
reference forward timed apart and the matmul peak, all inside a TRL callback, so the
machine's state is the same for both. Phases:

- rljax: generation (the sampler), rewards (detokenise + score), learning program (the
  reference forward, advantages and the update in one compiled program); the reference
  forward is also timed apart (the same log-prob function, jitted alone, on the step's
  shapes) and "update" is the learning program minus it.
- TRL: measured by wrapping the trainer's own methods: generation (``_generate``),
  reference / old forwards (``_get_per_token_logps_and_entropies`` called inside
  ``_generate_and_score_completions``; TRL skips the old forward when
  ``steps_per_generation=1``, and so does rljax's single update), rewards
  (``_calculate_rewards``), update = the step (``on_step_begin`` to ``on_step_end``)
  minus ``_generate_and_score_completions``: forward, backward, clipping, AdamW.

Beside each figure: other processes' CPU use during it, in cores (these 2 cores are
shared), and the benchmark process's own kernel time in seconds (on a CPU backend mostly
the zeroing of fresh pages for large buffers: an OS cost, not a compute one). rljax's
FLOP floor: the step's matmul FLOPs (sampling with the KV cache, the reference forward,
forward + backward of the update = 3 forwards; each group's prompt counted once, as rljax
computes it: ``_bench``) over the float32 matmul peak (median of 2048^3 ``jnp.dot``
calls) measured in each round.

    pip install -e .[bench]   # torch==2.13.0 first, so pip keeps the CPU build
    python experiments/bench_grpo_step.py [--steps 5] [--warmup 2] [--quick]

Last line: ``RESULT rljax_step_s=... trl_step_s=... ratio=... floor_s=... over_floor=...``
(ratio = TRL's step time / rljax's; over_floor = rljax's step time / its floor).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _bench as B  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rljax.models import from_pretrained, load_tokenizer  # noqa: E402
from rljax.train import (AlgorithmConfig, OptimConfig, RLConfig, RLTrainer,  # noqa: E402
                         SamplingConfig, policy_logprobs)

TRL_VERSION = "1.16.0"
INSTALL = ("pip install -e .[bench]  (install torch==2.13.0 first so pip keeps the CPU "
           "build; scripts/env.sh does both with RLJAX_BENCH=1)")


@dataclasses.dataclass(frozen=True)
class Workload:
    """The shapes of one GRPO step."""

    sizes: dict
    prompts: int
    group: int
    prompt_len: int
    new_tokens: int
    beta: float = 0.04
    lr: float = 1e-6
    peak_n: int = 2048  # the matmul peak's square size

    @property
    def rows(self) -> int:
        return self.prompts * self.group


FULL = Workload(B.REFERENCE, prompts=8, group=8, prompt_len=32, new_tokens=128)
QUICK = Workload(B.TINY, prompts=2, group=4, prompt_len=8, new_tokens=8, peak_n=256)


def require_trl():
    """Import TRL or exit naming the install command."""
    try:
        import trl
    except ImportError:
        raise SystemExit(f"bench_grpo_step: TRL is not installed; it is the baseline. "
                         f"Install the bench extra: {INSTALL}") from None
    if trl.__version__ != TRL_VERSION:
        print(f"warning: TRL {trl.__version__} installed; the bench extra pins {TRL_VERSION}")
    return trl


def prepare(w: Workload, folder, n_prompts: int) -> list[str]:
    """The checkpoint and tokenizer in ``folder``; returns ``n_prompts`` prompt texts."""
    B.build_checkpoint(folder, w.sizes)
    tok = B.train_tokenizer(w.sizes["vocab_size"], folder)
    return B.make_prompts(tok, n_prompts, w.prompt_len)


def reward_batch(completions, metadata):
    """rljax's batch reward: ``(completions, metadata) -> float32[B]``."""
    return np.asarray([B.vowel_fraction(c) for c in completions], np.float32)


def vowel_reward(completions, **kwargs):
    """TRL's reward function (the same reward)."""
    return [B.vowel_fraction(c) for c in completions]


class RljaxSide:
    """rljax's GRPO step through the public API, and its reference forward alone."""

    def __init__(self, w: Workload, folder, prompts: list[str], steps: int):
        tok = load_tokenizer(folder)
        model = from_pretrained(folder)
        self.config = model.config
        graphdef, params = nnx.split(model)
        self.tr = RLTrainer(
            graphdef, tok, reward_batch,
            algorithm=AlgorithmConfig(name="grpo", group_size=w.group, kl_coef=w.beta),
            optim=OptimConfig(lr=w.lr), rl=RLConfig(steps=steps, prompts_per_step=w.prompts),
            sampling=SamplingConfig(max_new_tokens=w.new_tokens, temperature=1.0),
            prompt_len=w.prompt_len)
        self.state = self.tr.init_state(params, seed=0)
        self.prompts = prompts
        chunk, g = self.tr.rl.logp_chunk, self.tr.share_group
        self._ref = jax.jit(lambda p, s: policy_logprobs(graphdef, p, s, chunk=chunk,
                                                         group=g)[0])
        rng = np.random.default_rng(1)
        v = self.config.vocab_size
        prompt_NxP = rng.integers(2, v, (w.prompts, w.prompt_len))
        self._seqs = {"prompt_BxP": jnp.asarray(np.repeat(prompt_NxP, w.group, axis=0)),
                      "prompt_mask_BxP": jnp.ones((w.rows, w.prompt_len), jnp.float32),
                      "completion_BxT": jnp.asarray(rng.integers(2, v, (w.rows, w.new_tokens))),
                      "completion_mask_BxT": jnp.ones((w.rows, w.new_tokens), jnp.float32)}

    def source(self, start: int, n: int):
        """The prompt source: prompts by global position (cycling)."""
        ps = [self.prompts[(start + i) % len(self.prompts)] for i in range(n)]
        return ps, [{} for _ in ps]

    def step(self) -> dict:
        with B.CpuMeter() as meter:
            self.state, m = self.tr.step(self.state, self.source)
        return {"step": meter.wall, "generation": m["time_rollout"],
                "rewards": m.get("time_reward", 0.0), "learn": m["time_learn"],
                "others": meter.others_cores, "kernel": meter.kernel_s,
                "tokens": m["completion_tokens"]}

    def ref_forward_seconds(self) -> float:
        """One reference forward on the step's shapes, jitted alone (compiled at the first
        call, so call it once before timing)."""
        t = time.perf_counter()
        jax.block_until_ready(self._ref(self.state.ref_params, self._seqs))
        return time.perf_counter() - t

    def step_flops(self, w: Workload) -> dict:
        """Matmul FLOPs of one step by phase (the floor's numerator): the training forwards
        compute each group's prompt once where the trainer shares prompts, as the sampler's
        prefill does."""
        seq = w.prompt_len + w.new_tokens
        fwd = (B.grouped_forward_flops(self.config, w.prompts, w.group, w.prompt_len,
                                       w.new_tokens) if self.tr.share_group > 1
               else B.forward_flops(self.config, w.rows, seq, w.new_tokens))
        return {"generation": B.decode_flops(self.config, w.rows, w.prompt_len, w.new_tokens,
                                             prefill_rows=w.prompts),
                "reference": fwd, "update": 3 * fwd}


class TrlSide:
    """TRL's GRPOTrainer on the same checkpoint, its phases timed by wrapping its methods;
    ``after_step(i)`` runs after each step's timing (the other side's turn)."""

    def __init__(self, w: Workload, folder, prompts: list[str], max_steps: int, out_dir,
                 after_step):
        import torch
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        self.rows: list[dict] = []
        self.acc: dict = {}
        self._inside = False
        side = self

        class Timer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                side.acc = dict.fromkeys(("prepare", "generation", "reference", "rewards"), 0.0)
                side.meter = B.CpuMeter().start()

            def on_step_end(self, args, state, control, **kw):
                m = side.meter.stop()
                side.rows.append(dict(side.acc, step=m.wall, update=m.wall - side.acc["prepare"],
                                      others=m.others_cores, kernel=m.kernel_s))
                after_step(len(side.rows) - 1)

        args = GRPOConfig(
            output_dir=str(out_dir), max_steps=max_steps, per_device_train_batch_size=w.rows,
            num_generations=w.group, steps_per_generation=1, gradient_accumulation_steps=1,
            max_completion_length=w.new_tokens,
            generation_kwargs={"min_new_tokens": w.new_tokens}, temperature=1.0, top_p=1.0,
            top_k=0, beta=w.beta, loss_type="grpo", learning_rate=w.lr,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
            bf16=False, gradient_checkpointing=False, use_cpu=True, report_to="none",
            logging_steps=max_steps + 1, save_strategy="no", shuffle_dataset=False, seed=0,
            disable_tqdm=True, dataloader_num_workers=0)
        self.trainer = GRPOTrainer(
            model=str(folder), reward_funcs=vowel_reward, args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts[:w.prompts * max_steps]}),
            processing_class=load_tokenizer(folder), callbacks=[Timer()])
        self.torch_threads = torch.get_num_threads()
        self._wrap("_generate_and_score_completions", "prepare", inside=True)
        self._wrap("_generate", "generation")
        self._wrap("_calculate_rewards", "rewards")
        self._wrap("_get_per_token_logps_and_entropies", "reference", only_inside=True)

    def _wrap(self, name: str, phase: str, inside: bool = False, only_inside: bool = False):
        fn = getattr(self.trainer, name)

        def timed(*a, **k):
            if only_inside and not self._inside:
                return fn(*a, **k)  # the policy's forward in the loss: part of the update
            t = time.perf_counter()
            if inside:
                self._inside = True
            try:
                return fn(*a, **k)
            finally:
                self._inside = self._inside and not inside
                self.acc[phase] += time.perf_counter() - t

        setattr(self.trainer, name, timed)

    def train(self):
        self.trainer.train()


def _fmt(row: dict, keys) -> str:
    return " + ".join(f"{k} {row[k]:.2f}" for k in keys)


def run(w: Workload, steps: int, warmup: int, with_trl: bool = True, log=print) -> dict:
    """Warm both sides up, run ``steps`` interleaved timed steps; returns the medians."""
    if steps < 1 or warmup < 1:
        raise ValueError(f"run: steps and warmup must be >= 1, got {steps}, {warmup}")
    total = warmup + steps
    ours, refs, peaks = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp) / "model"
        prompts = prepare(w, folder, w.prompts * total)
        rl = RljaxSide(w, folder, prompts, total)
        for i in range(warmup):
            log(f"rljax warm-up step {i}: {rl.step()['step']:.2f} s")
        rl.ref_forward_seconds()  # compile
        B.matmul_peak_flops(w.peak_n, 1)

        def rljax_turn(i: int):
            if i < warmup:
                return
            ours.append(rl.step())
            refs.append(rl.ref_forward_seconds())
            peaks.append(B.matmul_peak_flops(w.peak_n))
            r = ours[-1]
            log(f"round {i - warmup}: rljax {r['step']:.2f} s = "
                f"{_fmt(r, ('generation', 'rewards', 'learn'))} (reference alone {refs[-1]:.2f}; "
                f"others {r['others']:.2f} cores; kernel {r['kernel']:.2f} s)" + (
                    f" | TRL {trl.rows[i]['step']:.2f} s = "
                    f"{_fmt(trl.rows[i], ('generation', 'reference', 'rewards', 'update'))} "
                    f"(others {trl.rows[i]['others']:.2f} cores; kernel "
                    f"{trl.rows[i]['kernel']:.2f} s)" if with_trl else ""))

        if with_trl:
            trl = TrlSide(w, folder, prompts, total, pathlib.Path(tmp) / "trl", rljax_turn)
            log(f"torch threads {trl.torch_threads}")
            trl.train()
        else:
            for i in range(warmup, total):
                rljax_turn(i)
        flops = rl.step_flops(w)
    med = lambda rows, k: B.median(r[k] for r in rows)  # noqa: E731
    out = {"rljax": {k: med(ours, k) for k in ours[0]}, "reference_alone": B.median(refs),
           "peak": B.median(peaks), "flops": flops}
    if with_trl:
        out["trl"] = {k: med(trl.rows[warmup:], k) for k in trl.rows[0]}
    out["floor"] = sum(flops.values()) / out["peak"]
    return out


def report(w: Workload, res: dict, log=print) -> str:
    """Print the medians and return the RESULT line."""
    r, peak, fl = res["rljax"], res["peak"], res["flops"]
    upd = r["learn"] - res["reference_alone"]
    log(f"rljax median: step {r['step']:.3f} s = generation {r['generation']:.3f} + rewards "
        f"{r['rewards']:.3f} + learning program {r['learn']:.3f} (reference forward alone "
        f"{res['reference_alone']:.3f}, so update ~{upd:.3f}); others' CPU {r['others']:.2f} "
        f"cores; own kernel time {r['kernel']:.2f} s; {r['tokens']:.0f} completion tokens")
    floors = {k: v / peak for k, v in fl.items()}
    log(f"float32 matmul peak {peak / 1e9:.1f} GFLOP/s (median of 2048^3 jnp.dot, each "
        f"round); step matmul FLOPs {sum(fl.values()) / 1e9:.1f} G: floors generation "
        f"{floors['generation']:.2f} s (rljax {r['generation']:.2f}), reference "
        f"{floors['reference']:.2f} s ({res['reference_alone']:.2f}), update "
        f"{floors['update']:.2f} s ({upd:.2f}); step floor {res['floor']:.2f} s")
    trl_s = float("nan")
    if "trl" in res:
        t = res["trl"]
        trl_s = t["step"]
        log(f"TRL median: step {t['step']:.3f} s = generation {t['generation']:.3f} + "
            f"reference forward {t['reference']:.3f} + rewards {t['rewards']:.3f} + update "
            f"{t['update']:.3f} (+ other preparation "
            f"{t['prepare'] - t['generation'] - t['reference'] - t['rewards']:.3f}); "
            f"others' CPU {t['others']:.2f} cores; own kernel time {t['kernel']:.2f} s")
        log(f"rljax is {trl_s / r['step']:.2f}x TRL per step: generation "
            f"{t['generation'] / r['generation']:.2f}x, reference forward "
            f"{t['reference'] / res['reference_alone']:.2f}x, update {t['update'] / upd:.2f}x")
    return (f"RESULT rljax_step_s={r['step']:.3f} trl_step_s={trl_s:.3f} "
            f"ratio={trl_s / r['step']:.2f} floor_s={res['floor']:.3f} "
            f"over_floor={r['step'] / res['floor']:.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per side (after warm-up)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be >= 1")
    trl = require_trl()
    import torch

    w = QUICK if args.quick else FULL
    print(f"jax {jax.__version__} {jax.devices()} | torch {torch.__version__} | trl "
          f"{trl.__version__} | cpus {os.cpu_count()} loadavg {os.getloadavg()}")
    print(f"workload: {w.prompts} prompts x {w.group} completions x {w.new_tokens} new tokens, "
          f"prompts of {w.prompt_len} tokens, beta {w.beta}, lr {w.lr}; model {w.sizes}")
    res = run(w, args.steps, args.warmup)
    print(report(w, res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
