"""The SFT warm-up's stop rules (`sft.stop_accuracy`, `sft.stop_loss`) on a tiny model."""

import io

from flax import nnx

from rljax.models import ModelConfig
from rljax.run import builders
from rljax.train.config import SamplingConfig, SFTConfig
from rljax.run.experiment import ExperimentConfig, RunConfig, TaskConfig
from rljax.run.run_dir import RunDir, read_metrics
from rljax.run.runner import _sft_warmup
from rljax.run.preemption import StopSignal
from rljax.run.warmup_stop import WarmupStop


class ScriptedVerifier:
    """Stands in for the RL trainer's greedy evaluation with scripted accuracies, so the
    stop point is known in advance; the SFT steps themselves run for real."""

    def __init__(self, accuracies):
        self.accuracies, self.prompts = list(accuracies), []

    def evaluate(self, params, prompts, metadata):
        self.prompts.append(list(prompts))
        return {"accuracy": self.accuracies[len(self.prompts) - 1], "reward_mean": 0.0}


def _warm_up(tmp_path, sft, verifier):
    cfg = ExperimentConfig(
        model=ModelConfig(vocab_size=100, hidden_size=16, intermediate_size=32,
                          num_layers=1, num_heads=2, num_kv_heads=1,
                          max_position_embeddings=32),
        task=TaskConfig(name="arithmetic", difficulty=1, max_prompt_tokens=8),
        sampling=SamplingConfig(max_new_tokens=4), sft=sft,
        run=RunConfig(dir=str(tmp_path / "run"), plots=False))
    tok = builders.build_tokenizer(cfg)
    graphdef, params = nnx.split(builders.build_model(cfg, tok))
    task = builders.build_task(cfg, tok)
    rd, out = RunDir(cfg.run.dir, cfg, tensorboard=False), io.StringIO()
    try:
        _sft_warmup(cfg, graphdef, params, task, tok, None, rd, verifier, out,
                    WarmupStop(rd, StopSignal(), False, out))
    finally:
        rd.close()
    rows = [r for r in read_metrics(rd.path) if r["phase"] == "sft"]
    return task, rows, out.getvalue()


def test_accuracy_stop_ends_at_the_first_check_that_reaches_it(tmp_path):
    verifier = ScriptedVerifier([0.1, 0.3, 0.5, 0.9])
    sft = SFTConfig(steps=20, batch_size=8, stop_accuracy=0.5, stop_every=2, stop_prompts=16)
    task, rows, out = _warm_up(tmp_path, sft, verifier)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # third check: 0.5 >= 0.5
    assert [r.get("sft/val_accuracy") for r in rows] == [None, 0.1, None, 0.3, None, 0.5]
    assert verifier.prompts == [task.val_prompts] * 3 and len(task.val_prompts) == 16
    assert "validation accuracy 0.500 >= sft.stop_accuracy=0.5; warm-up stops at step 6" in out


def test_without_a_target_every_step_runs_and_nothing_is_evaluated(tmp_path):
    verifier = ScriptedVerifier([])
    task, rows, out = _warm_up(tmp_path, SFTConfig(steps=4, batch_size=8), verifier)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert verifier.prompts == [] and task.val_prompts == [] and "stops" not in out
