"""export / sample from a run directory and from an HF folder, through the CLI."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rljax.cli import main
from rljax.models import Decoder, ModelConfig
from rljax.models.hf_io import from_pretrained, save_pretrained
from rljax.models.tokenizer import build_char_tokenizer
from rljax.run.artifacts import is_run_dir, load_policy, sample_texts
from rljax.train.checkpoint import Checkpointer
from rljax.run.experiment import ExperimentConfig, RunConfig
from rljax.run.run_dir import RunDir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tok = build_char_tokenizer()
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, max_position_embeddings=64,
                      architecture="qwen2", qkv_bias=True)
    root = tmp_path_factory.mktemp("art")
    trained = Decoder(cfg, rngs=nnx.Rngs(7))  # stands for a trained policy
    # A run directory as the trainer leaves it: config.json + a checkpoint of TrainState-like
    # params["policy"] (+ other entries the loader must ignore) + the run's tokenizer.
    run_dir = root / "run"
    exp = ExperimentConfig(name="t", model=cfg, run=RunConfig(dir=str(run_dir)))
    RunDir(run_dir, exp).close()
    tok.save_pretrained(str(run_dir / "tokenizer"))
    with Checkpointer(run_dir / "checkpoints") as ck:
        ck.save(3, {"params": {"policy": nnx.state(trained)}, "step": jnp.int32(3),
                    "opt_state": {"policy": {"mu": jnp.zeros(4)}}}, {"data_pos": 24})
    hf_dir = root / "hf"
    save_pretrained(trained, hf_dir)
    tok.save_pretrained(str(hf_dir))
    return dataclasses.make_dataclass("Tiny", ["cfg", "tok", "trained", "run_dir", "hf_dir", "root"])(
        cfg, tok, trained, run_dir, hf_dir, root)


def _logits(model, ids):
    return np.asarray(model(jnp.asarray(ids, jnp.int32)))


def test_load_policy_from_run_dir_matches_trained(tiny):
    assert is_run_dir(tiny.run_dir) and not is_run_dir(tiny.hf_dir)
    model, tok, cfg = load_policy(tiny.run_dir)
    assert cfg.name == "t" and tok.eos_token_id == tiny.tok.eos_token_id
    ids = [tiny.tok.encode("12+30=", add_special_tokens=False)]
    np.testing.assert_array_equal(_logits(model, ids), _logits(tiny.trained, ids))
    with pytest.raises(FileNotFoundError, match="step 9"):
        load_policy(tiny.run_dir, step=9)


def test_export_command_round_trips(tiny, capsys):
    out = tiny.root / "exported"
    assert main(["export", str(tiny.run_dir), str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    back = from_pretrained(out)
    ids = [tiny.tok.encode("7*8=", add_special_tokens=False)]
    np.testing.assert_allclose(_logits(back, ids), _logits(tiny.trained, ids), rtol=1e-6, atol=1e-6)
    assert (out / "tokenizer_config.json").exists()
    assert main(["export", str(tiny.run_dir), str(out)]) == 2  # refuses a non-empty folder
    assert "not empty" in capsys.readouterr().err


def test_sample_command_from_both_sources(tiny, capsys):
    greedy_run = sample_texts(tiny.run_dir, ["1+1=", "abc"], max_new_tokens=6, temperature=0.0)
    greedy_hf = sample_texts(tiny.hf_dir, ["1+1=", "abc"], max_new_tokens=6, temperature=0.0)
    assert greedy_run == greedy_hf and len(greedy_run) == 2 and len(greedy_run[0]) == 1
    assert main(["sample", str(tiny.hf_dir), "--prompt", "1+1=", "--num-samples", "3",
                 "--max-new-tokens", "5", "--sampling-seed", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("=== prompt: '1+1=' sample") == 3
    assert main(["sample", str(tiny.root / "missing"), "--prompt", "x"]) == 2


def test_eval_command(tiny, capsys):
    import json

    argv = ["eval", str(tiny.run_dir), "--k", "4", "--num-prompts", "6", "--set",
            "sampling.max_new_tokens=4", "--set", "rl.eval_prompts=6"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["n"] == 6 and res["k"] == 4
    for key in ("accuracy", "pass@4", "sample_accuracy"):
        assert 0.0 <= res[key] <= 1.0
    assert res["pass@4"] >= res["sample_accuracy"]  # any-of-k >= mean-of-k, per prompt
    # A model folder has no task of its own.
    assert main(["eval", str(tiny.hf_dir)]) == 2
    assert "--experiment" in capsys.readouterr().err
    assert main(argv[:2] + ["--k", "0"]) == 2
    assert main(argv[:2] + ["--pass-threshold", "0.3"]) == 2  # for a reward without a verifier
    assert "this run's reward has a verifier" in capsys.readouterr().err
    assert main(argv[:2] + ["--num-prompts", "99", "--set", "rl.eval_prompts=6"]) == 2


def test_sample_takes_its_defaults_from_the_runs_config(tiny, capsys):
    from rljax.run.artifacts import _sampling_defaults
    from rljax.train.config import SamplingConfig

    # The model has 64 positions: the old fixed default of 64 new tokens left no room.
    run_dir = tiny.root / "run_short"
    exp = ExperimentConfig(name="short", model=tiny.cfg, run=RunConfig(dir=str(run_dir)),
                           sampling=SamplingConfig(max_new_tokens=4, temperature=0.5, top_k=3))
    RunDir(run_dir, exp).close()
    tiny.tok.save_pretrained(str(run_dir / "tokenizer"))
    with Checkpointer(run_dir / "checkpoints") as ck:
        ck.save(1, {"params": {"policy": nnx.state(tiny.trained)}}, {})
    assert main(["sample", str(run_dir), "--prompt", "12+34=", "--num-samples", "2"]) == 0
    assert capsys.readouterr().out.count("=== prompt: '12+34=' sample") == 2
    greedy = sample_texts(run_dir, ["12+34="], temperature=0.0)
    assert greedy == sample_texts(tiny.run_dir, ["12+34="], max_new_tokens=4, temperature=0.0)
    _, _, cfg = load_policy(run_dir)
    assert _sampling_defaults(cfg, None, None) == dict(max_new_tokens=4, temperature=0.5,
                                                       top_k=3, top_p=None)
    assert _sampling_defaults(None, None, None) == dict(max_new_tokens=64, temperature=1.0,
                                                        top_k=None, top_p=None)
    assert _sampling_defaults(cfg, 2, 0.0)["max_new_tokens"] == 2


def test_several_seed_runs_pick_a_seed(tiny, capsys):
    import jax

    from rljax.run.builders import model_prompt
    from rljax.run.experiment import TaskConfig

    # A run of seeds 3 and 4 keeps them stacked [2, ...] in one checkpoint (rljax.run.seed_runs).
    other = Decoder(tiny.cfg, rngs=nnx.Rngs(8))
    run_dir = tiny.root / "run_seeds"
    exp = ExperimentConfig(name="two", model=tiny.cfg, run=RunConfig(dir=str(run_dir), seed=3,
                                                                    seeds=2),
                           task=TaskConfig(chat_template=True, system_prompt="Add."))
    RunDir(run_dir, exp).close()
    tiny.tok.save_pretrained(str(run_dir / "tokenizer"))
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), nnx.state(tiny.trained), nnx.state(other))
    with Checkpointer(run_dir / "checkpoints") as ck:
        ck.save(2, {"params": {"policy": stacked}}, {"seeds": [3, 4]})
    ids = [tiny.tok.encode("12+30=", add_special_tokens=False)]
    for seed, want in ((None, tiny.trained), (3, tiny.trained), (4, other)):
        model, _, cfg = load_policy(run_dir, run_seed=seed)
        np.testing.assert_array_equal(_logits(model, ids), _logits(want, ids))
        assert cfg.run.seeds == 1 and cfg.run.seed == (3 if seed is None else seed)
    with pytest.raises(ValueError, match="--seed 5: this run trained seeds 3, 4"):
        load_policy(run_dir, run_seed=5)
    assert main(["eval", str(run_dir), "--seed", "5"]) == 2
    assert "seeds 3, 4" in capsys.readouterr().err
    out = tiny.root / "exported_seed4"
    assert main(["export", str(run_dir), str(out), "--seed", "4"]) == 0
    np.testing.assert_allclose(_logits(from_pretrained(out), ids), _logits(other, ids),
                               rtol=1e-6, atol=1e-6)
    # sample wraps a prompt as the run's training prompts were; --raw keeps it as given.
    wrapped = model_prompt(load_policy(run_dir)[2], tiny.tok, "1+1=")
    assert wrapped != "1+1=" and "Add." in wrapped and "1+1=" in wrapped
    kw = dict(max_new_tokens=4, temperature=0.0)  # seed 3's weights are tiny.run_dir's
    assert sample_texts(run_dir, ["1+1="], **kw) == sample_texts(run_dir, [wrapped], raw=True, **kw)
    assert sample_texts(run_dir, ["1+1="], raw=True, **kw) == sample_texts(tiny.run_dir, ["1+1="], **kw)
    assert main(["sample", str(tiny.hf_dir), "--prompt", "x", "--seed", "1"]) == 2  # no seeds
