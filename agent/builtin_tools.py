"""The built-in tools: `ToolSpec(function="calculator")` and `ToolSpec(function="python")`.

They run in the sandbox's child like any declared tool, loaded there by this file's path, so
this module imports the standard library only. Their docstrings are their JSON schemas
(transformers.utils.get_json_schema reads the summary and the Args: section).
"""

from __future__ import annotations

import ast
import contextlib
import io
import sys
from decimal import Decimal, localcontext
from fractions import Fraction

MAX_DIGITS = 10_000                    # of any number the calculator computes, result or intermediate
_MAX_BITS = int(MAX_DIGITS * 3.3220)   # log2(10) bits per decimal digit
_MAX_EXPRESSION = 10_000               # characters
_SIGNIFICANT = 30                      # digits of a division that does not come out exact

_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly: integers of any size, + - * / // % ** and parentheses.
    Division (/) is exact: an integer when it divides evenly, else a decimal.

    Args:
        expression: The expression, e.g. "123456789 * 987654321" or "(2 ** 100 - 1) // 3".
    """
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(f"the expression is longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        if "integer string conversion" in str(e):   # a literal past sys.get_int_max_str_digits()
            raise ValueError(f"a number in it has more than {sys.get_int_max_str_digits()} digits") from None
        raise ValueError(f"not an arithmetic expression ({getattr(e, 'msg', e)})") from None
    try:
        value = _evaluate(tree.body, expression)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    return _format(value)


def _evaluate(node: ast.AST, source: str) -> Fraction:
    # Fractions throughout: / stays exact, and ints are Fractions with denominator 1.
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        # a decimal literal from its text (Fraction(0.1) would be the binary float's value)
        return _checked(Fraction(ast.get_source_segment(source, node) or str(node.value)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand, source)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _checked(_power(_evaluate(node.left, source), _evaluate(node.right, source)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _checked(_BINARY[type(node.op)](_evaluate(node.left, source), _evaluate(node.right, source)))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ValueError("^ is not a power here: write ** (e.g. 2 ** 10)")
    if isinstance(node, ast.Name):
        raise ValueError(f"names are not allowed ({node.id}): only numbers and + - * / // % ** ( )")
    raise ValueError(f"not allowed: {type(node).__name__}; only numbers and + - * / // % ** ( )")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ValueError("only integer exponents are allowed")
    # Refuse before computing (10 ** 10 ** 9 would take the process's memory and time) when
    # even a lower bound on its size is too big; _checked then applies the exact limit.
    bits = max(base.numerator.bit_length(), base.denominator.bit_length()) - 1
    if abs(base) not in (0, 1) and abs(exponent.numerator) * max(1, bits) > _MAX_BITS:
        raise ValueError(f"the result would have more than {MAX_DIGITS} digits")
    return base ** exponent.numerator


def _checked(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > _MAX_BITS:
        raise ValueError(f"a number would have more than {MAX_DIGITS} digits")
    return value


def _format(value: Fraction) -> str:
    # Decimal, not str(int): str refuses ints past sys.get_int_max_str_digits() (4300 digits)
    num, den = value.numerator, value.denominator
    if den == 1:
        return str(Decimal(num))
    twos = fives = 0
    rest = den
    while rest % 2 == 0:
        rest, twos = rest // 2, twos + 1
    while rest % 5 == 0:
        rest, fives = rest // 5, fives + 1
    places = max(twos, fives)
    if rest == 1 and places <= MAX_DIGITS:   # a terminating decimal: all its digits, exactly
        digits = str(Decimal(abs(num) * 10 ** places // den)).rjust(places + 1, "0")
        return ("-" if num < 0 else "") + digits[:-places] + "." + digits[-places:]
    with localcontext() as ctx:
        ctx.prec = _SIGNIFICANT
        return str(Decimal(num) / Decimal(den))


def python(code: str) -> str:
    """Run Python code and return what it printed. Use print() to see a value.

    Args:
        code: The Python source to run, e.g. "import math\\nprint(math.factorial(20))".
    """
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<python tool>", "exec"), {"__name__": "__main__"})
    except BaseException:
        # what it printed before the error still reaches the caller (the sandbox reads stdout)
        sys.stdout.write(out.getvalue())
        raise
    return out.getvalue()
