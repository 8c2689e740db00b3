"""Verifiers that reward worker processes import (tests/test_stop_ids_and_flops.py): a
module of its own, so a worker loads it without the test module's imports."""

import dataclasses
import time


@dataclasses.dataclass(frozen=True)
class MetaVerdict:
    """The verdict written in the metadata (``meta["ok"]``), after sleeping
    ``meta["sleep"]`` seconds (a verifier that hangs on one input)."""

    name: str = "meta_verdict"

    def __call__(self, completion, meta) -> bool:
        time.sleep(meta.get("sleep", 0.0))
        return bool(meta["ok"])
