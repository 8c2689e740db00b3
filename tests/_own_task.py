"""A user's task as the CLI tests make it in a folder: `data/` (train, test and another
held-out file), a reward module with no reference answers (`own_reward:score`) and an
experiment file (`own_exp.py`: a tiny char-level GRPO run, 2 steps, a checkpoint each)."""

import json
import textwrap

# Spreads over [0, 1] whatever a tiny random policy writes (a record's `shift` moves it),
# so thresholds separate samples and greedy rewards differ from prompt to prompt.
REWARD = textwrap.dedent('''
    def score(completions, metadata):
        return [(ord(c[0]) + m["shift"]) % 5 / 4 if c else 0.0
                for c, m in zip(completions, metadata)]
''')

EXPERIMENT = textwrap.dedent('''
    from rljax.models import ModelConfig
    from rljax.run.experiment import ExperimentConfig, RewardConfig, RunConfig, TaskConfig
    from rljax.train.config import AlgorithmConfig, RLConfig, SamplingConfig


    def config():
        return ExperimentConfig(
            name="own_reward",
            model=ModelConfig(vocab_size=100, hidden_size=16, intermediate_size=32,
                              num_layers=1, num_heads=2, num_kv_heads=1,
                              max_position_embeddings=32),
            tokenizer="char",
            task=TaskConfig(name="jsonl", path="data", prompt_field="q",
                            prompt_template="{q}=", max_prompt_tokens=8),
            reward=RewardConfig(function="own_reward:score", workers=0),
            algorithm=AlgorithmConfig(name="grpo", group_size=2),
            sampling=SamplingConfig(max_new_tokens=2),
            rl=RLConfig(steps=2, prompts_per_step=8, eval_prompts=4, logp_chunk=4),
            run=RunConfig(dir="runs/own", plots=False, tensorboard=False, save_every=1),
        )
''')

#: Record ranges of the data files.
SPLITS = {"train": (0, 24), "test": (30, 34), "other": (40, 46)}


def records(lo: int, hi: int) -> list[dict]:
    """Records ``lo..hi``: a prompt field ``q`` and the reward's ``shift``."""
    return [{"q": f"{i}+{i % 3}", "shift": i % 5} for i in range(lo, hi)]


def write_task(root) -> None:
    """Write ``data/``, ``own_reward.py`` and ``own_exp.py`` into the folder ``root``."""
    (root / "data").mkdir()
    for name, (lo, hi) in SPLITS.items():
        (root / "data" / f"{name}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records(lo, hi)))
    (root / "own_reward.py").write_text(REWARD)
    (root / "own_exp.py").write_text(EXPERIMENT)
