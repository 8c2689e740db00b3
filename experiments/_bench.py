"""Helpers shared by the benchmark scripts in experiments/ (not a benchmark itself).

- the reference benchmark model of docs/design.md (random Qwen2: hidden 256, 4 layers, 8 heads,
  4 kv heads, intermediate 704, vocab 32000, float32) and the larger one of issue 19
  (hidden 512, intermediate 1408, 8 layers), as size dicts and as rljax ``ModelConfig``s;
- an HF checkpoint of such a model (transformers' initialisation, numpy seed 0, written
  by rljax) and a byte-level BPE tokenizer trained here on a synthetic corpus, so nothing
  is downloaded;
- ``CpuMeter``: the CPU time other processes used during a block (these 2 cores are
  shared: two processes timing at once slow each other several-fold), and this process's
  own kernel time and page faults;
- ``matmul_peak_flops``: the float32 matmul FLOP/s of this machine under XLA;
- ``forward_flops`` / ``grouped_forward_flops`` / ``decode_flops``: matmul FLOPs of a
  forward / of a shared-prompt forward / of sampling.

The scripts import it as ``_bench`` (``sys.path`` gets this folder first; see
``import_bench`` at the top of each script).
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models import ModelConfig, weight_map
from rljax.models.hf_io import write_pretrained

REFERENCE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, intermediate_size=704, vocab_size=32000)
LARGER = dict(REFERENCE, hidden_size=512, intermediate_size=1408, num_hidden_layers=8)
# --quick: a model that compiles and runs in a second or two (smoke tests).
TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=512)


def model_config(sizes: dict) -> ModelConfig:
    """The rljax ``ModelConfig`` of a benchmark model (what ``from_pretrained`` reads)."""
    return ModelConfig(vocab_size=sizes["vocab_size"], hidden_size=sizes["hidden_size"],
                       intermediate_size=sizes["intermediate_size"],
                       num_layers=sizes["num_hidden_layers"],
                       num_heads=sizes["num_attention_heads"],
                       num_kv_heads=sizes["num_key_value_heads"], qkv_bias=True,
                       architecture="qwen2", max_position_embeddings=512)


def build_checkpoint(path, sizes: dict = REFERENCE, seed: int = 0) -> ModelConfig:
    """A random Qwen2 written as an HF checkpoint in ``path`` by rljax's own writer, so no
    torch is needed (a machine that runs rljax's side alone may have none); returns its
    ``ModelConfig``. Its weights follow transformers' initialisation of a Qwen2 (every
    matrix N(0, 0.02), biases 0, norm scales 1), drawn from numpy seed ``seed`` one tensor
    at a time in the writer's order, so only one is in memory at once. The config names
    no EOS, so neither side stops a sample early."""
    config = model_config(sizes)
    rng = np.random.default_rng(seed)
    names = {spath: (name, shape, to_ours) for name, spath, shape, (to_ours, _) in
             weight_map(config)}

    def tensor(spath):
        name, shape, to_ours = names[spath]
        if name.endswith("norm.weight"):
            hf = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            hf = np.zeros(shape, np.float32)
        else:
            hf = 0.02 * rng.standard_normal(shape, np.float32)
        return to_ours(hf)

    write_pretrained(config, tensor, path)
    return config


def _corpus(rng, words: int, lines: int) -> tuple[list[str], list[str]]:
    """Lines of Zipf-distributed pseudo-words (skewed letter frequencies, like a language)."""
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    p = rng.dirichlet(np.full(26, 0.5))
    vocab = ["".join(rng.choice(letters, size=rng.integers(3, 11), p=p)) for _ in range(words)]
    ranks = rng.zipf(1.2, size=lines * 20) % words
    return vocab, [" ".join(vocab[r] for r in ranks[i:i + 20]) for i in range(0, len(ranks), 20)]


def train_tokenizer(vocab_size: int, path=None, seed: int = 0):
    """A byte-level BPE tokenizer with exactly ``vocab_size`` ids, trained here on a
    synthetic corpus (2-3 s for 32,000): ``<pad>`` is id 0 and ``<eos>`` id 1, no BOS.
    Every id decodes (byte-level), so a random model's samples always detokenise. With
    ``path`` it is saved there (``AutoTokenizer.from_pretrained(path)`` loads it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = np.random.default_rng(seed)
    n_words = max(vocab_size * 2, 2000)
    _, lines = _corpus(rng, n_words, max(vocab_size, 2000))
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if core.get_vocab_size() != vocab_size:
        raise RuntimeError(f"train_tokenizer: the corpus gave {core.get_vocab_size()} ids, "
                           f"not {vocab_size}")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                                  eos_token="<eos>", padding_side="left")
    if path is not None:
        tok.save_pretrained(str(path))
    return tok


def make_prompts(tok, n: int, length: int, seed: int = 0) -> list[str]:
    """``n`` prompt texts of whole-word tokens that encode to exactly ``length`` ids."""
    rng = np.random.default_rng(seed)
    words = [t for t, i in tok.get_vocab().items()
             if t.startswith("\u0120") and t[1:].isalpha() and i > 1]
    out = []
    for _ in range(200 * n):
        text = "".join(words[i] for i in rng.integers(0, len(words), length)).replace(
            "\u0120", " ")
        if len(tok.encode(text, add_special_tokens=False)) == length:
            out.append(text)
            if len(out) == n:
                return out
    raise RuntimeError(f"make_prompts: could not make {n} prompts of {length} tokens")


def vowel_fraction(text: str) -> float:
    """The benchmarks' reward: the share of vowels among a completion's letters (cheap,
    host-side, and varied within a group, so advantages are not all zero)."""
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


class CpuMeter:
    """CPU use during a block: other processes' CPU time in cores (jiffies / wall), and this
    process's own kernel time (``kernel_s``, seconds) and minor page faults (``faults``):
    on a CPU backend the kernel time is mostly the zeroing of fresh pages for large
    buffers. A context manager, or ``start()`` / ``stop()``."""

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _machine_busy():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + v[4]  # idle + iowait
        return sum(v[:8]) - idle  # user nice system idle iowait irq softirq steal

    @staticmethod
    def _self_stat() -> tuple[int, int, int]:
        """This process's (utime + stime, stime) in jiffies and its minor faults."""
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # fields 10 (minflt), 14 (utime), 15 (stime) of proc(5), counted from field 3
        return int(fields[11]) + int(fields[12]), int(fields[12]), int(fields[7])

    def start(self) -> "CpuMeter":
        self.t0, self.m0, self.s0 = time.perf_counter(), self._machine_busy(), self._self_stat()
        return self

    def stop(self) -> "CpuMeter":
        self.wall = time.perf_counter() - self.t0
        busy, kernel, faults = (b - a for a, b in zip(self.s0, self._self_stat()))
        others = (self._machine_busy() - self.m0) - busy
        self.others_cores = max(others, 0) / self.hz / self.wall
        self.self_cores = busy / self.hz / self.wall
        self.kernel_s = kernel / self.hz
        self.faults = faults
        return self

    __enter__ = start

    def __exit__(self, *exc):
        self.stop()


def matmul_peak_flops(n: int = 2048, reps: int = 5, reduce=statistics.median) -> float:
    """Float32 FLOP/s of a jitted ``[n, n] @ [n, n]`` ``jnp.dot`` on the default device:
    ``2 n^3`` over ``reduce`` (median by default; ``min`` for the best) of ``reps`` timed
    calls after one warm-up."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dot(a, a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / reduce(times)


def _layer_matmul_flops(cfg: ModelConfig) -> int:
    """Multiply-adds of one layer's projections and MLP, per token."""
    h, n, k, d = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
    return d * (2 * n * h + 2 * k * h) + 3 * d * cfg.intermediate_size


def forward_flops(cfg: ModelConfig, rows: int, seq_len: int, head_positions: int) -> int:
    """Matmul FLOPs of a causal forward of ``rows`` sequences of ``seq_len`` tokens with the
    output projection on their last ``head_positions`` positions: projections and MLP,
    attention's q.k and p.v over the causal prefix only (``seq_len (seq_len + 1) / 2``
    pairs), and the head. Element-wise work, norms and softmax are not counted."""
    pairs = seq_len * (seq_len + 1) // 2
    per_row = (cfg.num_layers * (seq_len * _layer_matmul_flops(cfg)
                                 + 2 * cfg.num_heads * cfg.head_dim * pairs)
               + head_positions * cfg.hidden_size * cfg.vocab_size)
    return 2 * rows * per_row


def grouped_forward_flops(cfg: ModelConfig, prompts: int, group: int, prompt_len: int,
                          new_tokens: int) -> int:
    """Matmul FLOPs of the shared-prompt forward (``Decoder.grouped_hidden_states``) that
    gives ``prompts x group`` rows their log-probs: each prompt's ``prompt_len`` tokens
    once, each row's first ``new_tokens - 1`` tokens against the prompt's keys and its own
    (the last token predicts nothing), and the head on ``new_tokens`` positions a row."""
    rows, p, t = prompts * group, prompt_len, new_tokens - 1
    prompt = forward_flops(cfg, prompts, p, 0)
    pairs = t * p + t * (t + 1) // 2  # completion query i sees p + i + 1 keys
    per_row = (cfg.num_layers * (t * _layer_matmul_flops(cfg)
                                 + 2 * cfg.num_heads * cfg.head_dim * pairs)
               + new_tokens * cfg.hidden_size * cfg.vocab_size)
    return prompt + 2 * rows * per_row


def decode_flops(cfg: ModelConfig, rows: int, prompt_len: int, new_tokens: int,
                 prefill_rows: int | None = None) -> int:
    """Matmul FLOPs of sampling ``new_tokens`` per row after a ``prompt_len`` prompt: the
    prefill of ``prefill_rows`` prompts (default ``rows``; a group's prompt is shared)
    with the head on its last position, then ``new_tokens - 1`` decode steps of ``rows``
    rows, each attending to the cache so far (the last token is drawn, never fed)."""
    prefill = forward_flops(cfg, rows if prefill_rows is None else prefill_rows, prompt_len, 1)
    per_step = cfg.num_layers * _layer_matmul_flops(cfg) + cfg.hidden_size * cfg.vocab_size
    ctx = sum(prompt_len + t for t in range(1, new_tokens))  # cache length at each step
    attn = cfg.num_layers * 2 * cfg.num_heads * cfg.head_dim * ctx
    return prefill + 2 * rows * ((new_tokens - 1) * per_step + attn)


def median(xs) -> float:
    return statistics.median(list(xs))
