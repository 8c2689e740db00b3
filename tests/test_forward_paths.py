"""Paths chosen once, visibly (issue 41, item 3): the attention implementation, head form,
prompt layout and layer layout are resolved when the trainer is built
(`rljax.train.programs.paths.resolve_paths`) into the step's spec; a default that falls back says
why, an explicit choice that cannot be taken is an error; the start-up line prints them
and the run directory's config.json records them without a resume counting them."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

from _train_common import CharTok, tiny_config
from test_cli_train import EXPERIMENT
from rljax.cli import main
from rljax.models import Decoder
from rljax.run.run_dir import RunDir
from rljax.train.config import OptimConfig, RLConfig, SamplingConfig, algorithm_preset
from rljax.train.learn import algorithms as alg
from rljax.train.programs.paths import ForwardPaths, resolve_paths
from rljax.train.rl import RLTrainer


def _gd(**kw):
    return nnx.split(nnx.eval_shape(lambda: Decoder(tiny_config(**kw), rngs=nnx.Rngs(0))))[0]


XLA, CUDNN = _gd(), _gd(attention="cudnn", compute_dtype="bfloat16")
SPLASH_SCANNED = _gd(attention="splash", scan_layers=True, remat="dots_saveable")
NO_HEAD = nnx.split(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))[0]  # not a rljax Decoder


def _objective(name="grpo", **kw):
    return alg.make_objective(algorithm_preset(name, group_size=4, **kw), 8)


def _resolve(gd=XLA, *, name="grpo", one_pass=None, share=None, group=4, rows=8, **kw):
    return resolve_paths(gd, objective=_objective(name), one_pass_head=one_pass,
                         share_prompts=share, group_size=group, rows_per_micro=rows, **kw)


def test_defaults_take_the_fast_paths_and_say_nothing():
    p = _resolve()
    assert (p.attention, p.head, p.prompt_group, p.layers, p.remat) == (
        "xla", "one-pass", 4, "unrolled", "none")
    assert p.notes == ()
    assert p.line() == "attention=xla head=one-pass prompts=shared(G=4) layers=unrolled(remat=none)"


@pytest.mark.parametrize("kw, field, value, why", [
    (dict(name="gspo"), "head", "chunked", "one-pass needs a token-separable objective; gspo"),
    (dict(gd=NO_HEAD), "head", "chunked", "the policy has no linear output head"),
    (dict(gd=NO_HEAD, one_pass=False), "prompts", "per-row", "a model is not a rljax Decoder"),
    (dict(rows=2), "prompts", "per-row", "micro-batches of 2 rows split the groups of 4"),
    (dict(group=1), "prompts", "per-row", "group_size=1: one completion per prompt"),
    (dict(gd=CUDNN), "prompts", "per-row", "attention cudnn has no prefix path"),
    (dict(other_gds=(CUDNN,)), "prompts", "per-row", "attention cudnn/xla has no prefix path"),
])
def test_a_default_that_falls_back_says_why_and_an_explicit_choice_is_an_error(
        kw, field, value, why):
    p = _resolve(**kw)
    assert p.choices()[field] == value
    assert why in dict(p.notes)[field]
    assert f"{field}={value} ({why}" in p.line()
    explicit = "one_pass" if field == "head" else "share"
    rl_field = "one_pass_head" if field == "head" else "share_prompts"
    with pytest.raises(ValueError, match=rf"RLConfig\.{rl_field}=True was set explicitly, "
                                         rf"but .*{why}.*allowed: None \(auto"):
        _resolve(**kw, **{explicit: True})
    off = _resolve(**kw, **{explicit: False})  # switched off: no fallback, no note
    assert field not in dict(off.notes)


def test_explicit_choices_that_apply_and_explicit_off():
    assert _resolve(one_pass=True, share=True) == _resolve()
    p = _resolve(one_pass=False, share=False)
    assert (p.head, p.prompt_layout, p.notes) == ("chunked", "per-row", ())
    seq = resolve_paths(XLA, objective=_objective(is_level="sequence", tis_cap=2.0),
                        one_pass_head=None, share_prompts=None, group_size=4, rows_per_micro=8)
    assert "grpo with is_level='sequence' is not" in seq.line()


def test_attention_and_layers_are_the_models_with_a_note_off_their_backend():
    p = _resolve(SPLASH_SCANNED, remat=True, backend="cpu")
    assert (p.attention, p.layers, p.remat, p.prompt_group) == ("splash", "scanned",
                                                               "dots_saveable", 4)
    assert "layers=scanned(remat=dots_saveable)" in p.line()
    assert "attention=splash (Pallas interpret mode: the backend is cpu, not tpu)" in p.line()
    assert "attention" not in dict(_resolve(SPLASH_SCANNED, backend="tpu").notes)
    assert _resolve(remat=True).remat == "full"  # RLConfig.remat on a "none" model
    assert "cuDNN needs a gpu backend" in dict(_resolve(CUDNN).notes)["attention"]


def test_a_packed_batch_is_its_prompt_layout():
    """rl.tokens_per_micro_batch packs rows (every row's prompt in its packed row): the
    line and the record say so, with no note (packing is asked for, not a fallback)."""
    p = _resolve(tokens_per_micro_batch=64)
    assert (p.prompt_group, p.prompt_layout, p.notes) == (1, "packed(tokens=64)", ())
    assert "prompts=packed(tokens=64)" in p.line()
    assert p.record()["prompts"] == "packed(tokens=64)" and p != _resolve(share=False)


def test_notes_do_not_split_programs_and_the_record_is_json():
    a, b = ForwardPaths(head="chunked"), ForwardPaths(head="chunked", notes=(("head", "x"),))
    assert a == b and hash(a) == hash(b)
    rec = json.loads(json.dumps(_resolve(name="gspo").record()))
    assert rec["head"] == "chunked" and rec["prompts"] == "shared(G=4)"
    assert "token-separable" in rec["notes"]["head"]


def _trainer(rl: RLConfig, name="grpo") -> RLTrainer:
    return RLTrainer(XLA, CharTok(), lambda c, m: np.zeros(len(c), np.float32),
                     algorithm=algorithm_preset(name, group_size=2), optim=OptimConfig(),
                     sampling=SamplingConfig(max_new_tokens=3), prompt_len=6, rl=rl)


def test_the_resolved_paths_are_in_the_step_spec():
    base = RLConfig(steps=2, prompts_per_step=4, logp_chunk=2)
    tr = _trainer(base)
    assert tr.base_spec.paths == tr.paths and tr.base_spec.paths.notes == tr.paths.notes
    assert tr.base_spec.share_group == tr.paths.prompt_group == tr.share_group == 2
    two_pass = _trainer(dataclasses.replace(base, one_pass_head=False))
    assert two_pass.paths.head == "chunked" and two_pass.base_spec != tr.base_spec
    with pytest.raises(ValueError, match="one_pass_head=True was set explicitly"):
        _trainer(dataclasses.replace(base, one_pass_head=True), "gmpo")


def test_the_start_up_line_and_config_json_record_the_paths(tmp_path, monkeypatch, capsys):
    """`rljax train` of test_cli_train's tiny experiment as GSPO (not token-separable: the
    head falls back) with no steps: the paths are resolved and recorded with the trainer;
    asked for explicitly, the one-pass head is an error that leaves nothing behind."""
    (tmp_path / "tiny.py").write_text(EXPERIMENT)
    monkeypatch.chdir(tmp_path)
    # An explicit choice that cannot be taken fails at set-up and leaves no run directory,
    # so the corrected command below is not refused as "a different run".
    assert main(["train", str(tmp_path / "tiny.py"), "--set", "algorithm.name=gspo",
                 "--set", "rl.one_pass_head=true", "--set", "sft=none",
                 "--set", "run.dir=runs/fwdpaths"]) != 0
    assert "one_pass_head=True was set explicitly" in capsys.readouterr().err
    assert not (tmp_path / "runs/fwdpaths").exists()
    assert main(["train", str(tmp_path / "tiny.py"), "--set", "algorithm.name=gspo",
                 "--set", "rl.steps=0", "--set", "sft=none",
                 "--set", "run.dir=runs/fwdpaths"]) == 0
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if "forward paths:" in x]
    assert line == ["[rljax] forward paths: attention=xla head=chunked (one-pass needs a "
                    "token-separable objective; gspo is not) prompts=shared(G=4) "
                    "layers=unrolled(remat=none)"], err
    saved = json.loads((tmp_path / "runs/fwdpaths/config.json").read_text())
    rec = saved["resolved"]["forward_paths"]
    assert (rec["attention"], rec["head"], rec["prompt_group"], rec["layers"]) == (
        "xla", "chunked", 4, "unrolled")
    assert "forward_paths" not in json.dumps(saved["config"])
    # A resume compares the config only: the recorded paths are no changed field, and
    # they survive the resume's rewrite of config.json.
    with RunDir(tmp_path / "runs/fwdpaths", saved["config"], resume=True) as rd:
        assert rd.changed == [] and rd.config_hash == saved["config_hash"]
        rd.record_resolved("forward_paths", rec)
        rd.begin()
    again = json.loads((tmp_path / "runs/fwdpaths/config.json").read_text())
    assert again["resolved"] == saved["resolved"] and again["config"] == saved["config"]
