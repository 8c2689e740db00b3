"""Normalisation of answer strings: strip LaTeX wrappers, spacing and (optionally) units.

Every function here is a linear scan or a fixed sequence of `str.replace` calls over a
string already bounded by `limits.MAX_EXPR_CHARS`; nothing is evaluated.
"""

from __future__ import annotations

# Commands whose braced argument is kept and the command itself dropped.
_UNWRAP = ("\\text", "\\textbf", "\\textrm", "\\textit", "\\mathrm", "\\mathbf",
           "\\mbox", "\\boxed", "\\fbox", "\\operatorname", "\\mathit")
# Spacing and sizing commands that carry no value. Longer names first, so "\\left"
# is removed before a shorter prefix could match inside it.
_DROP = ("\\displaystyle", "\\left", "\\right", "\\bigl", "\\bigr", "\\big", "\\Big",
         "\\!", "\\,", "\\;", "\\:", "\\ ", "\\quad", "\\qquad", "$", "~")
# Those of _DROP that are spaces: they become " ", so `4\\,2` is not 42 (see
# _drop_spaces); the others go without a trace.
_SPACES = frozenset(("\\,", "\\;", "\\:", "\\ ", "\\quad", "\\qquad", "~"))
# Characters mapped to their ASCII/LaTeX meaning.
_CHARS = {"\u2212": "-", "\u2012": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-",
          "\u00d7": "*", "\u00f7": "/", "\u221e": "\\infty", "\u2009": " ",
          "\u00a0": " ", "\u202f": " "}
_ALIASES = (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\cfrac", "\\frac"),
            ("{,}", ","), ("\\%", "%"), ("\\cdot", "*"), ("\\times", "*"),
            ("\\div", "/"), ("\\infinity", "\\infty"))
_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_SEPARATORS = frozenset("._,")  # in or after a number; whitespace beside one is kept
_NUMBER_CHARS = _SEPARATORS | frozenset("0123456789")


def _unwrap_commands(s: str) -> str:
    """Remove `\\text{...}`-style commands but keep their contents; one linear pass.

    A stack records, for each open brace, whether it opened a wrapper argument (dropped
    with its matching close) or a plain group (kept). Unbalanced input is left as is
    past the point where it stops balancing.
    """
    out: list[str] = []
    stack: list[bool] = []
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if c == "\\":
            j = i + 1
            while j < n and s[j] in _LETTERS:
                j += 1
            name = s[i:j]
            if name in _UNWRAP:
                k = j
                while k < n and s[k] == " ":
                    k += 1
                if k < n and s[k] == "{":
                    stack.append(True)
                    i = k + 1
                    continue
                i = j  # \boxed 5: drop the command, keep the argument
                continue
            out.append(s[i:max(j, i + 2)])
            i = max(j, i + 2)
            continue
        if c == "{":
            stack.append(False)
        elif c == "}" and stack:
            if stack.pop():
                i += 1
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _strip_units(s: str) -> str:
    """Drop a trailing unit: letters, spaces, '/', '.', and a ^2/^3 or degree after them.

    Only a run that contains a letter, follows a digit somewhere before it, and is not the
    tail of a LaTeX command is removed: `1/2 cup` -> `1/2`, `5 m/s` -> `5`,
    `90^\\circ` -> `90`, but `\\infty` and a word answer such as `yes` stay.
    """
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\u00b0", "")
    for sup in ("^2", "^3", "^{2}", "^{3}"):
        if s.endswith(sup) and len(s) > len(sup) and s[-len(sup) - 1] in _LETTERS:
            s = s[: -len(sup)]
            break
    j = len(s)
    while j > 0 and (s[j - 1] in _LETTERS or s[j - 1] in " /."):
        j -= 1
    tail, head = s[j:], s[:j]
    # Strip only a unit after a value: never a whole word answer or a command's tail.
    has_value = any(c.isdigit() or c == "\u221e" for c in head)
    if any(c in _LETTERS for c in tail) and has_value and not head.endswith("\\"):
        s = head
    return s.rstrip(" /.")


def normalize_answer(s: str, *, strip_units: bool = False) -> str:
    """Canonical form of an answer string (a bounded, linear rewrite; never evaluates).

    Steps: map Unicode minus/times/infinity, unwrap `\\text{}`/`\\boxed{}`-like commands,
    drop `\\left`/`\\right`/spacing/`$`, alias `\\dfrac`/`\\tfrac` to `\\frac`, `\\%` to `%`,
    optionally strip units, drop a leading `x =` and a trailing period, and drop whitespace,
    except that between digits it becomes `,` where it separates thousands (`12 345`) and
    one space elsewhere (`4 2`, `1, 234`: not one number).
    """
    for a, b in _CHARS.items():
        if a in s:
            s = s.replace(a, b)
    s = s.replace("\\$", "$")
    s = _unwrap_commands(s)
    for a in _DROP:
        s = s.replace(a, " " if a in _SPACES else "")
    for a, b in _ALIASES:
        s = s.replace(a, b)
    s = s.replace("\\infty", "\u221e")  # one char, so unit stripping cannot eat it
    s = s.strip()
    if strip_units:
        s = _strip_units(s)
    s = _drop_assignment(s)
    s = _drop_spaces(s)
    return s.rstrip(".,").replace("\u221e", "\\infty")


def _drop_assignment(s: str) -> str:
    """`x = 5` -> `5`; only when the left side is a short name (letters, digits, _)."""
    k = s.find("=")
    if 0 < k <= 12:
        left = s[:k].strip()
        if left and left[0] in _LETTERS and all(c in _LETTERS or c.isdigit() or c == "_"
                                               for c in left):
            return s[k + 1:]
    return s


def _is_digit(c: str) -> bool:
    return c.isascii() and c.isdigit()


def _digit_runs(s: str, i: int) -> tuple[list[str], int]:
    """From the digit at s[i]: the digit runs joined only by whitespace, and where they end."""
    runs, n = [], len(s)
    while True:
        k = i
        while k < n and _is_digit(s[k]):
            k += 1
        runs.append(s[i:k])
        w = k
        while w < n and s[w].isspace():
            w += 1
        if w == k or w == n or not _is_digit(s[w]):
            return runs, k
        i = w


def _digit_group(s: str, i: int, runs: list[str], end: int) -> str:
    """The digit runs found at s[i:end], joined as a comma would join them: by "," when
    they are thousands groups (a first group of 1-3 digits not starting with 0, then groups
    of exactly 3, no `.`, `,` or `_` glued on either side), else by one space (`4 2` is
    not a number).
    After `\\frac` they are its arguments, as in LaTeX (`\\frac 1 2`)."""
    j = i
    while j > 0 and s[j - 1].isspace():
        j -= 1
    if s.endswith("\\frac", 0, j):
        return "".join(runs)
    glued = (i > 0 and s[i - 1] in _SEPARATORS) or (
        end + 1 < len(s) and s[end] in "_," and _is_digit(s[end + 1]))
    grouped = (len(runs[0]) <= 3 and runs[0][0] != "0" and all(len(r) == 3 for r in runs[1:])
               and not glued)
    return ("," if grouped else " ").join(runs)


def _drop_spaces(s: str) -> str:
    """`s` without whitespace, except between digits (`_digit_group`) and between a digit
    and a separator (`1, 234` and `3 .5` stay apart: one space). One linear pass."""
    out, i, n = [], 0, len(s)
    while i < n:
        if _is_digit(s[i]):
            runs, end = _digit_runs(s, i)
            out.append(_digit_group(s, i, runs, end))
            i = end
        elif s[i].isspace():
            j = i
            while j < n and s[j].isspace():
                j += 1
            left, right = s[i - 1:i], s[j:j + 1]
            if left and right and {left, right} <= _NUMBER_CHARS and (
                    _is_digit(left) or _is_digit(right)):
                out.append(" ")
            i = j
        else:
            out.append(s[i])
            i += 1
    return "".join(out)
