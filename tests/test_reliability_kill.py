"""Issue 20's short kill -9 campaign: `experiments/kill_campaign.py` with 3 kills on one
process (one in a rollout, one in an update, one during an asynchronous checkpoint save),
each followed by a resume, then a final resume to the end.

It also is the determinism test (issue 20, item 4): the killed run's metric lines, all of
them, before and after every kill, and its final checkpoint (parameters, optimiser state,
counters) equal, bit for bit, those of the uninterrupted run with the same seed on the
same process count.
"""

from __future__ import annotations

import json
import os

import pytest
from _experiments import load_experiment

pytestmark = pytest.mark.slow


def test_three_kills_lose_nothing_and_read_no_half_checkpoint(tmp_path, capsys):
    campaign = load_experiment("kill_campaign")
    out = campaign.main(["--kills", "3", "--processes", "1", "--kills-per-run", "3",
                         "--kinds", "rollout,update,save", "--root", str(tmp_path)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT kills=3 runs=1 lost_runs=0 half_checkpoints_read=0 "), last
    assert out["problems"] == {}, out["problems"]
    records = [json.loads(x) for x in (tmp_path / "campaign.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["rollout", "update", "save"]
    for r in records:  # each attempt died by its own planned SIGKILL
        assert r["exit"] == [-9] and len(r["killed"]) == 1, r
        assert r["killed"][0]["planned"] == r["plan"], r
    # the save kill struck while orbax's write was in flight (its delay is shorter than
    # the write here); a kill that leaves a half checkpoint is what the next resume skips
    assert records[2]["killed"][0]["unfinished"], records[2]
    assert any(r["during_save"] for r in records)


class _Tok:
    """Writes two files; `fail` raises between them (a kill mid-save, in effect)."""

    def __init__(self, fail=False):
        self.fail = fail

    def save_pretrained(self, path):
        os.makedirs(path, exist_ok=True)
        open(os.path.join(path, "tokenizer.json"), "w").write("{}")
        if self.fail:
            raise KeyboardInterrupt
        open(os.path.join(path, "tokenizer_config.json"), "w").write("{}")


def test_tokenizer_is_never_half_written(tmp_path):
    from etils import epath

    from rljax.run.runner import _save_tokenizer

    dest = epath.Path(tmp_path) / "tokenizer"
    with pytest.raises(KeyboardInterrupt):
        _save_tokenizer(_Tok(fail=True), dest)
    assert not dest.exists()  # what a resumed run checks before saving it again
    _save_tokenizer(_Tok(), dest)  # over the interrupted attempt's leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer"]
    assert sorted(p.name for p in dest.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
