"""Math reward: extract the final answer from a response and compare it with the reference.

Extraction, first that applies:
1. the last `\\boxed{...}` (nested braces allowed);
2. the last marked final answer: `#### 42`, `Answer: 42`, `final answer is 42`; when it is
   a worked line (`#### 6 * 7 = 42`), what follows its last `=`;
3. the last number in the text.
A `-` is a sign only where it cannot be a binary minus: not after a digit, a letter or `)`
("pages 12-15" ends in 15, not -15).
Comparison: equal after light normalisation (spaces, `$`, a trailing period, thousands
commas, the typeset minus U+2212, a leading `x=`, a trailing `\\%`, `\\frac34`), or numerically equal (integers, decimals, `a/b` and signed `\\frac{a}{b}` fractions)
within 1e-6 relative.
"""

from __future__ import annotations

import re
from fractions import Fraction

_MARKED = re.compile(r"(?:####|final answer(?: is)?\s*[:=]?|answer(?: is)?\s*[:=])\s*([^\n]+)", re.IGNORECASE)
# Commas only as thousands groups: "Answer: 12, since ..." is 12, not "12," (no number).
# A minus after a digit, letter or ")" is a subtraction ("12-15", "f(2)-3"), not a sign.
_SIGN = r"(?:(?<![\w)])-)?"
_NUMBER = re.compile(_SIGN + r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|" + _SIGN + r"\.\d+")
# An "=" of a worked answer line ("6 * 7 = 42"); not the one of <=, >=, !=.
_EQUALS = re.compile(r"(?<![<>!])=")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unclosed: not an answer


def extract_answer(text: str) -> str | None:
    """The response's final answer as a string, or None when there is none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    marked = _MARKED.findall(text)
    if marked:
        value = marked[-1].strip()
        equals = list(_EQUALS.finditer(value))
        if equals:   # "Answer: 1/2 + 1/3 = 5/6" -> "5/6", not the first term
            value = value[equals[-1].end():].strip()
        num = _NUMBER.match(value.replace("$", "").strip())
        # "Answer: 42 apples" -> "42"; "Answer: x+1" stays as written
        return num.group(0).strip() if num else value.rstrip(".").strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def normalize(ans: str) -> str:
    s = ans.strip().replace("$", "").replace(" ", "").replace("\u2212", "-")   # U+2212, the typeset minus
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if s.startswith("\\text{") and s.endswith("}"):
        s = s[len("\\text{"):-1]
    # Written-out forms of one answer: "x=5" for 5, "50\%" for 50, "\frac34" for \frac{3}{4}.
    s = re.sub(r"^[A-Za-z]=(?!=)", "", s)
    s = re.sub(r"\\?%$", "", s)
    s = re.sub(r"\\([dt]?frac)(\d)(\d)$", r"\\\1{\2}{\3}", s)
    return s


def to_number(ans: str) -> Fraction | None:
    s = normalize(ans)
    m = re.fullmatch(r"([+-]?\d+(?:\.\d+)?|[+-]?\.\d+)(?:/(\d+))?", s)
    if m is None:
        # -\frac{1}{2} as well as \frac{-1}{2}: the sign usually stands before the fraction
        frac = re.fullmatch(r"([+-]?)\\(?:d|t)?frac\{(-?\d+)\}\{(\d+)\}", s)
        if frac is None:
            return None
        sign, num, den = frac.groups()
        if sign == "-":
            num = num[1:] if num.startswith("-") else "-" + num
    else:
        num, den = m.group(1), m.group(2) or "1"
    if int(den) == 0:
        return None
    return Fraction(num) / Fraction(den)


def answers_match(predicted: str | None, reference: str, rel_tol: float = 1e-6) -> bool:
    if predicted is None:
        return False
    if normalize(predicted) == normalize(reference):
        return True
    a, b = to_number(predicted), to_number(reference)
    if a is None or b is None:
        return False
    return abs(a - b) <= rel_tol * max(1, abs(b))


def math_reward(sample, response: str) -> float:
    """1.0 when the extracted answer matches `sample.answer`, else 0.0 (also without one)."""
    if sample.answer is None:
        return 0.0
    return 1.0 if answers_match(extract_answer(response), sample.answer) else 0.0
