"""The built-in tool: a calculator the policy calls inline, `<calc>123 + 456 * 7</calc>`, answered with
`<result>3315</result>` (Toolformer's inline calls, Schick et al. 2023). The expression is parsed, never run:
only numbers, + - * / // % ** and parentheses, each intermediate value bounded, so no call can take time
or memory (9 ** 9 ** 9 is refused, not computed), reach a name, a file or the shell."""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_CHARS = 200  # an expression longer than this is refused
MAX_ABS = 10**30  # every intermediate value stays within this
MAX_EXPONENT = 64


class CalcError(ValueError):
    pass


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression as text (exact: fractions stay fractions until shown)."""
    if len(expression) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalcError("not an arithmetic expression") from None
    value = _eval(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def _eval(node) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
            raise CalcError("division by zero")
        if isinstance(node.op, ast.Pow):
            if b.denominator != 1 or abs(b) > MAX_EXPONENT or (a == 0 and b < 0):
                raise CalcError(f"exponent must be a whole number within ±{MAX_EXPONENT} (and 0 has no negative power)")
            return _bounded(a ** int(b))  # |a| <= MAX_ABS and |b| <= 64: at most ~2,000 digits before the bound
        return _bounded(Fraction(OPS[type(node.op)](a, b)))
    raise CalcError(f"{type(node).__name__} is not allowed: numbers, + - * / // % ** and parentheses only")


def _bounded(value: Fraction) -> Fraction:
    if abs(value) > MAX_ABS:
        raise CalcError("a value exceeds 1e30")
    return value


class Calculator:
    """One episode's calculator: each `<calc>...</calc>` gets its `<result>`; a malformed call gets an
    `<error>` observation (the policy may try again; the episode is not ended for a wrong call)."""

    stop = ("</calc>",)

    def reset(self, problem: dict) -> None:
        self.calls = 0

    def step(self, turn: str) -> tuple[str | None, float, bool]:
        end = turn.rfind("</calc>")
        start = turn.rfind("<calc>", 0, max(end, 0))
        if end < 0 or start < 0:
            return None, 0.0, True
        self.calls += 1
        try:
            return f"<result>{evaluate(turn[start + 6 : end])}</result>", 0.0, False
        except CalcError as e:
            return f"<error>{e}</error>", 0.0, False
