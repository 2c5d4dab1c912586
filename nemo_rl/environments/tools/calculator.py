"""The ``calculator`` tool: arithmetic on numbers, evaluated by walking Python's syntax tree (no ``eval``).

Only numbers, ``+ - * / // % **``, unary signs and parentheses are accepted; names, calls, attributes and
everything else are refused. Sizes are bounded so a call cannot stall the rollout: the expression's
length, exponents, and the digits of every intermediate integer.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from nemo_rl.environments.tools.base import Tool

Number = int | float

MAX_EXPRESSION_CHARS = 500
"""Longest expression accepted."""

MAX_EXPONENT = 1000
"""Largest absolute exponent of ``**``."""

MAX_INTEGER_DIGITS = 1000
"""Most decimal digits of any integer the evaluation produces."""

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value is out of bounds."""


def _checked(value: Number) -> Number:
    # bit_length bounds the digits without converting (str() of a huge int is itself slow).
    if isinstance(value, int) and value.bit_length() > MAX_INTEGER_DIGITS * math.log2(10) + 1:
        raise CalculatorError(f"the result has more than {MAX_INTEGER_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    return value


def _evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    # bool is an int subclass; True is a name to the model, not a number.
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponents are limited to {MAX_EXPONENT}")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
    raise CalculatorError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text (``"12 * (3 + 4)"`` -> ``"84"``).

    Raises:
        CalculatorError: the expression is not plain arithmetic, is too long, or its value is out of bounds.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise CalculatorError(f"not an arithmetic expression ({err.msg})") from None
    value = _evaluate(tree)
    return (
        str(int(value))
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53
        else str(value)
    )


def calculator_tool() -> Tool:
    """The ``calculator`` tool."""
    return Tool(
        name="calculator",
        description="Evaluate an arithmetic expression with + - * / // % ** and parentheses; returns its value.",
        parameters={
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "The expression, e.g. '1234 * 5678'."}
            },
            "required": ["expression"],
        },
        fn=calculate,
    )
