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
# Characters mapped to their ASCII/LaTeX meaning.
_CHARS = {"\u2212": "-", "\u2012": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-",
          "\u00d7": "*", "\u00f7": "/", "\u221e": "\\infty", "\u2009": " ",
          "\u00a0": " ", "\u202f": " "}
_ALIASES = (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\cfrac", "\\frac"),
            ("{,}", ","), ("\\%", "%"), ("\\cdot", "*"), ("\\times", "*"),
            ("\\div", "/"), ("\\infinity", "\\infty"))
_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


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
    optionally strip units, drop a leading `x =`, a trailing period and all whitespace.
    """
    for a, b in _CHARS.items():
        if a in s:
            s = s.replace(a, b)
    s = s.replace("\\$", "$")
    s = _unwrap_commands(s)
    for a in _DROP:
        s = s.replace(a, " " if a.startswith("\\") and a != "\\!" else "")
    for a, b in _ALIASES:
        s = s.replace(a, b)
    s = s.replace("\\infty", "\u221e")  # one char, so unit stripping cannot eat it
    s = s.strip()
    if strip_units:
        s = _strip_units(s)
    s = _drop_assignment(s)
    s = "".join(s.split())
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
