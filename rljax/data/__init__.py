"""rljax.data: prompt sources for RL and SFT (host side, plain Python + numpy).

Procedural verifiable tasks (arithmetic, Countdown; their rewards, which use
`rljax.rewards`, are composed in `rljax.run.tasks`), local JSONL /
Parquet prompt sets with a field mapping, TFDS `array_record` datasets read without
TensorFlow, chat-template prompt building, length filtering with an explicit policy, a
deterministic resumable shuffled iterator, and prompt difficulty tracking.
A leaf: imports nothing from rljax but `rljax.objectives` (not even `rljax.rewards`).
"""

from rljax.data.arithmetic import OPS, ArithmeticProblem, ArithmeticTask, reverse_digits
from rljax.data.countdown import CountdownTask, check_countdown, evaluate_equation
from rljax.data.difficulty import DifficultyTracker, mixed_group_prob
from rljax.data.files import gsm8k_transform, load_jsonl, load_parquet, load_prompts, map_record
from rljax.data.iterator import IteratorState, ShuffledIterator
from rljax.data.prompts import (LengthPolicy, LengthReport, build_chat_prompt,
                                build_chat_prompts, chat_messages, filter_by_length)
from rljax.data.tfds_source import TfdsPromptSource, prepare_tfds_prompts

__all__ = [
    "OPS", "ArithmeticProblem", "ArithmeticTask", "reverse_digits",
    "CountdownTask", "check_countdown", "evaluate_equation",
    "DifficultyTracker", "mixed_group_prob",
    "gsm8k_transform", "load_jsonl", "load_parquet", "load_prompts", "map_record",
    "IteratorState", "ShuffledIterator",
    "LengthPolicy", "LengthReport", "build_chat_prompt", "build_chat_prompts",
    "chat_messages", "filter_by_length",
    "TfdsPromptSource", "prepare_tfds_prompts",
]
