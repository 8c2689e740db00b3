"""Final-answer extraction from a completion: `extract_answer(text, mode=...)`.

Modes:
- "auto" (default): the last `\\boxed{...}` / `\\fbox{...}` / `\\boxed 5`, else GSM8K's
  `#### 42`, else "the (final) answer is ...".
- "boxed", "gsm8k", "answer_is": only that rule.
- "last_number": the last number in the text (explicit only, never a fallback, since it
  rewards any trailing number).

Every rule is a bounded linear scan (`str.rfind` plus a brace counter over at most
`MAX_ANSWER_CHARS` characters) over the last `MAX_SCAN_CHARS` of the text; there are no
backtracking regular expressions. Untrusted input never raises: it yields None.
"""

from __future__ import annotations

from rljax.rewards.limits import MAX_ANSWER_CHARS, MAX_DEPTH, MAX_DIGITS, MAX_SCAN_CHARS

MODES = ("auto", "boxed", "gsm8k", "answer_is", "last_number")
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_PHRASES = ("the final answer is", "the answer is", "final answer:")


def _braced(text: str, start: int) -> str | None:
    """Contents of the brace group opening at text[start] == '{', or None if unbalanced,
    deeper than MAX_DEPTH or longer than MAX_ANSWER_CHARS. `\\{` and `\\}` are literal."""
    depth, i, end = 0, start, min(len(text), start + MAX_ANSWER_CHARS + 2)
    while i < end:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
            if depth > MAX_DEPTH:
                return None
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return None


def _boxed_at(text: str, k: int, cmd: str) -> str | None:
    j = k + len(cmd)
    if j < len(text) and text[j].isalpha():
        return None  # a different command, e.g. \boxedeq
    while j < len(text) and text[j] == " ":
        j += 1
    if j < len(text) and text[j] == "{":
        inner = _braced(text, j)
        return inner.strip() or None if inner is not None else None
    # `\boxed 5`: the run of characters up to whitespace or `$`.
    e = j
    while e < len(text) and e - j <= MAX_ANSWER_CHARS and not text[e].isspace() \
            and text[e] != "$":
        e += 1
    token = text[j:e].rstrip(".,")
    return token if token and e - j <= MAX_ANSWER_CHARS else None


def _last_boxed(text: str) -> str | None:
    k, cmd = max((text.rfind(c), c) for c in _BOX_COMMANDS)
    return _boxed_at(text, k, cmd) if k >= 0 else None


def _line_after(text: str, k: int) -> str:
    end = text.find("\n", k, k + MAX_ANSWER_CHARS + 1)
    return text[k:end if end >= 0 else k + MAX_ANSWER_CHARS + 1]


def _clean(ans: str) -> str | None:
    prev = None
    while prev != ans:  # at most len(ans) passes over <= MAX_ANSWER_CHARS characters
        prev = ans
        ans = ans.strip().strip("$*").rstrip(".,;")  # $42$, **42** (Markdown bold)
    if not ans or len(ans) > MAX_ANSWER_CHARS:
        return None
    return ans


def _gsm8k(text: str) -> str | None:
    k = text.rfind("####")
    return _clean(_line_after(text, k + 4)) if k >= 0 else None


def _answer_is(text: str) -> str | None:
    low = text.lower()
    k, phrase = max(((low.rfind(p), p) for p in _ANSWER_PHRASES), key=lambda t: t[0])
    if k < 0:
        return None
    rest = _line_after(text, k + len(phrase)).lstrip(" :")
    # The sentence ends at ". " or a final "." (a decimal point is followed by a digit).
    stop = rest.find(". ")
    if stop >= 0:
        rest = rest[:stop]
    boxed = _last_boxed(rest)
    return boxed if boxed is not None else _clean(rest)


def _last_number(text: str) -> str | None:
    """The last `[-]digits[,ddd][.digits][/digits]` in the text, scanning backwards."""
    i = len(text) - 1
    while i >= 0 and not (text[i].isascii() and text[i].isdigit()):
        i -= 1
    if i < 0:
        return None
    end = i + 1
    while i >= 0 and end - i <= MAX_DIGITS + 2 and (
            (text[i].isascii() and text[i].isdigit()) or
            (text[i] in ",./" and i > 0 and text[i - 1].isdigit() and text[i - 1].isascii())):
        i -= 1
    start = i + 1
    if end - start > MAX_DIGITS + 1:
        return None
    if start > 0 and text[start - 1] in "-\u2212":
        start -= 1
    return text[start:end].replace("\u2212", "-")


def extract_answer(text: object, *, mode: str = "auto") -> str | None:
    """The final answer in `text` per `mode` (see the module docstring), or None.

    Reads only the last `MAX_SCAN_CHARS` characters; returns None for non-strings and
    for candidates longer than `MAX_ANSWER_CHARS`. Raises ValueError only for an unknown
    `mode` (a programming error, not bad model output).
    """
    if mode not in MODES:
        raise ValueError(f"extract_answer: mode={mode!r} is not one of {MODES}")
    if not isinstance(text, str):
        return None
    text = text[-MAX_SCAN_CHARS:]
    rules = {"boxed": (_last_boxed,), "gsm8k": (_gsm8k,), "answer_is": (_answer_is,),
             "last_number": (_last_number,), "auto": (_last_boxed, _gsm8k, _answer_is)}[mode]
    for rule in rules:
        ans = rule(text)
        if ans is not None:
            return ans
    return None
