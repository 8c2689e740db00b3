"""Work bounds shared by every verifier.

Model output is untrusted input. Every check in `rljax.rewards` and the task checkers in
`rljax.data` bounds the size of what it reads and the work it does, so that a hostile
completion (megabytes of text, deep nesting, `1e999999`, power towers) is scored quickly
and never raises out of a reward function. The numbers are deliberately generous for real
answers and small for adversarial ones.
"""

# Extraction reads at most this many trailing characters of a completion: final answers
# sit at the end, and scanning is linear in this window.
MAX_SCAN_CHARS = 200_000
# A single extracted answer (the contents of one \boxed{...}, one "#### ..." line) is
# at most this long; longer candidates are rejected, not truncated.
MAX_ANSWER_CHARS = 1_000
# math_equal refuses inputs longer than this (after extraction).
MAX_EXPR_CHARS = 1_000
# Digits in one numeric literal.
MAX_DIGITS = 1_000
# |exponent| allowed in 10^k, a^k and 1e k.
MAX_EXPONENT = 1_000
# Bit length allowed for any numerator or denominator met while evaluating.
MAX_BITS = 16_384
# Nesting depth of braces, parentheses and \frac arguments.
MAX_DEPTH = 50
# Text that constraint checks accept at all; longer text fails every constraint.
MAX_CONSTRAINT_CHARS = 2_000_000
# JSON output check: size and nesting bounds before json.loads is called.
MAX_JSON_CHARS = 200_000
MAX_JSON_DEPTH = 64


def json_depth_ok(text: str, max_depth: int) -> bool:
    """Whether the bracket nesting of `text` outside JSON strings stays <= `max_depth`:
    one linear pass, run before `json.loads` so deep nesting never reaches its recursion."""
    depth, in_str, esc = 0, False, False
    for c in text:
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
            if depth > max_depth:
                return False
        elif c in "]}":
            depth -= 1
    return True
