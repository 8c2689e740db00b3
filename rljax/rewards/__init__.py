"""rljax.rewards: verifiable rewards, safe against hostile model output.

Math answers (`extract_answer`, `math_equal`), exact-string answers (`string_equal`,
`StringAccuracy`; `answer_verifier` picks one for a task's answers), the R1-Zero format reward, IFEval-style
constraints, composition (weighted sums, Tülu 3's 10/0), and `score_batch`, the batch
interface the trainer calls (in process, or in a worker pool with per-call time limits),
a user's function by import path (`load_function`, `ImportedFunction`) and a batch
reward run in the pool (`PooledBatchReward`).
Host-side plain Python + numpy; imports nothing from rljax above `rljax.objectives`.
"""

from rljax.rewards.answers import is_number, math_equal
from rljax.rewards.batch import (BatchScores, Batched, RewardError, RewardPool, RewardTimeout,
                                 batched, score_batch)
from rljax.rewards.compose import (BatchReward, ConstraintReward, FormatReward, ItemReward,
                                   MathAccuracy, RewardFn, StringAccuracy, Verified,
                                   WeightedSum,
                                   accuracy_plus_format, reward_name)
from rljax.rewards.constraints import (CONSTRAINT_TYPES, AllLowercase, AllOf, AnyOf,
                                       BulletCount, Constraint, EndsWith, ForbiddenKeywords,
                                       IncludeKeywords, NoCommas, ValidJson, WordCount,
                                       constraint_from_dict)
from rljax.rewards.extract import MODES as EXTRACT_MODES
from rljax.rewards.extract import extract_answer
from rljax.rewards.format import TagFormat, follows_format, format_reward, tagged_answer
from rljax.rewards.imported import ImportedFunction, load_function
from rljax.rewards.pooled import PooledBatchReward, RemoteRewardError
from rljax.rewards.strings import VERIFIERS, answer_verifier, normalize_text, string_equal
from rljax.rewards import limits

__all__ = [
    "math_equal", "is_number", "extract_answer", "EXTRACT_MODES", "limits",
    "string_equal", "normalize_text", "answer_verifier", "VERIFIERS", "StringAccuracy",
    "TagFormat", "follows_format", "format_reward", "tagged_answer",
    "Constraint", "WordCount", "IncludeKeywords", "ForbiddenKeywords", "NoCommas",
    "AllLowercase", "BulletCount", "EndsWith", "ValidJson", "AllOf", "AnyOf",
    "CONSTRAINT_TYPES", "constraint_from_dict",
    "ItemReward", "RewardFn", "MathAccuracy", "FormatReward", "ConstraintReward",
    "WeightedSum", "Verified", "BatchReward", "accuracy_plus_format", "Batched", "batched", "reward_name",
    "score_batch", "BatchScores", "RewardError", "RewardPool", "RewardTimeout",
    "ImportedFunction", "load_function", "PooledBatchReward", "RemoteRewardError",
]
