"""A code problem's unit tests, split so that the solution never decides whether it passed.

A test is an ``assert`` statement (the data's format, ``"assert add(1, 2) == 3"``). It is split, in the
trusted process, into the part the solution computes (``add(1, 2)``) and the check against a literal
(``== 3``). The sandbox receives only the computed parts: it evaluates each one after loading the solution
and prints the value as *plain data* (``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes`` and lists,
tuples, sets, frozensets and dicts of those, by exact type; anything else, such as an object whose ``__eq__``
always says yes, is refused). The trusted process decodes those values into fresh builtin objects and applies
the check itself. So the expected values never enter the solution's process, a forged line can only claim a
value (which is what an honest function returns anyway), and a test passes only when its value satisfies the
check. The accepted forms (:func:`parse_test`):

- ``assert <expr> <op> <literal>`` or ``assert <literal> <op> <expr>``, ``<op>`` one of ``==``, ``!=``, ``is``,
  ``is not``, ``<``, ``<=``, ``>``, ``>=``, ``in``, ``not in`` and ``<literal>`` a Python literal (numbers,
  strings, bytes, ``None``, ``True``, ``False`` and containers of them, a leading ``-`` allowed);
- ``assert math.isclose(<expr>, <number>[, rel_tol=<number>, abs_tol=<number>])`` and
  ``assert abs(<expr> - <number>) < <number>`` (or ``<=``): the closeness is checked outside too;
- ``assert <call>`` (passes when the value is truthy) and ``assert not <call>``, ``<call>`` a call such as
  ``is_prime(7)`` (not a predicate like ``isinstance``, whose verdict the solution's process would decide).

``<expr>`` holds no comparison or condition (``and``, ``or``, ``if``): whatever it computes is computed by the
solution's process, so it must be the solution's answer, never a verdict.
``is`` compares type and value (``x is True`` needs a ``bool``), as an identity check of those literals does.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

RESULT_MARK = "@@nemo_rl_value"
"""Starts each line on which the harness reports a computed value: ``<mark> <index> <encoded value>``."""

_HARNESS_BODY = """\
import json, sys
def _plain(value):
    kind = type(value)
    if value is None or kind in (bool, str):
        return value
    if kind is int:
        return ["int", str(value)]
    if kind is float:
        return ["float", repr(value)]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind in (list, tuple, set, frozenset):
        return [kind.__name__, [_plain(item) for item in value]]
    if kind is dict:
        return ["dict", [[_plain(k), _plain(v)] for k, v in value.items()]]
    raise TypeError(f"{kind.__module__}.{kind.__qualname__} is not plain data")
def _report(index, encoded):
    sys.__stdout__.write(f"\\n{_MARK} {index} {encoded}\\n")
    sys.__stdout__.flush()
def _run():
    spec = json.loads(open("tests.json").read())
    namespace = {"__name__": "solution"}
    exec(compile(spec["setup"] + "\\n" + open("solution.py").read(), "solution.py", "exec"), namespace)
    for index, expression in enumerate(spec["expressions"]):
        try:
            encoded = json.dumps(_plain(eval(compile(expression, "test", "eval"), namespace)))
        except BaseException as err:
            print(f"test {index} failed: {type(err).__name__}: {err}", file=sys.stderr)
            continue
        _report(index, encoded)
_run()
"""
HARNESS = f"_MARK = {RESULT_MARK!r}\n" + _HARNESS_BODY
"""Runs as ``main.py`` in the sandbox beside ``solution.py`` and ``tests.json`` (the setup and the expressions
to evaluate, never the expected values). Nothing in it is trusted: the solution may replace any of it."""


def _is(value: Any, expected: Any) -> bool:
    return type(value) is type(expected) and value == expected


_CHECKS: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Is: _is,
    ast.IsNot: lambda a, b: not _is(a, b),
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}


@dataclass(frozen=True)
class UnitTest:
    """One test: an expression the solution's process evaluates, and the check the trusted side applies."""

    source: str
    """The statement as the data wrote it."""

    expression: str
    """What the sandbox evaluates (the solution's part of the statement)."""

    op: str
    """``truthy``, ``falsy`` or the comparison's ``ast`` name (``Eq``, ``In``...)."""

    literal: Any = None
    """The other operand of a comparison (a plain Python value)."""

    value_on_left: bool = True
    """The computed value is the comparison's left operand."""

    def passes(self, value: Any) -> bool:
        """Whether ``value`` (plain data decoded by :func:`decode_value`) satisfies the check."""
        if self.op == "truthy":
            return bool(value)
        if self.op == "falsy":
            return not value
        if self.op in ("isclose", "abs_close"):
            return _close(self.op, value, self.literal)
        check = _CHECKS[getattr(ast, self.op)]
        left, right = (value, self.literal) if self.value_on_left else (self.literal, value)
        try:
            return bool(check(left, right))
        except TypeError:  # an order or membership between unrelated types: the assert would have raised
            return False


def _close(op: str, value: Any, literal: tuple[float, float, float]) -> bool:
    if type(value) not in (int, float):
        return False
    expected, first, second = literal
    if op == "isclose":
        return math.isclose(value, expected, rel_tol=first, abs_tol=second)
    gap = abs(value - expected)
    return gap <= first if second else gap < first


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _number(node: ast.expr) -> float | None:
    is_literal, value = _literal(node)
    return float(value) if is_literal and type(value) in (int, float) else None


_VERDICT_NODES = (ast.Compare, ast.BoolOp, ast.IfExp, ast.Lambda, ast.NamedExpr)
_PREDICATES = {"isinstance", "issubclass", "callable", "hasattr", "all", "any", "bool"}


def _computed(node: ast.expr, statement: str) -> str:
    """The source of the part the sandbox evaluates; refused when it would decide the verdict itself."""
    if any(isinstance(n, _VERDICT_NODES) for n in ast.walk(node)):
        raise ValueError(
            f"a code test compares outside the solution's value, got {statement!r}: write one comparison with a "
            "literal (assert f(1) == 2), not comparisons or conditions inside it"
        )
    return ast.unparse(node)


def _closeness(test: ast.expr, statement: str) -> UnitTest | None:
    """``math.isclose(<expr>, <number>[, rel_tol=, abs_tol=])`` or ``abs(<expr> - <number>) < <number>``."""
    if (
        isinstance(test, ast.Call)
        and ast.unparse(test.func) in ("math.isclose", "isclose")
        and len(test.args) == 2
    ):
        options = {k.arg: _number(k.value) for k in test.keywords}
        if set(options) <= {"rel_tol", "abs_tol"} and None not in options.values():
            for computed, expected in (test.args, test.args[::-1]):
                number = _number(expected)
                if number is not None:
                    tolerances = (options.get("rel_tol", 1e-9), options.get("abs_tol", 0.0))
                    return UnitTest(
                        statement, _computed(computed, statement), "isclose", (number, *tolerances)
                    )
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Lt | ast.LtE)
        and isinstance(test.left, ast.Call)
        and ast.unparse(test.left.func) == "abs"
        and len(test.left.args) == 1
        and isinstance(test.left.args[0], ast.BinOp)
        and isinstance(test.left.args[0].op, ast.Sub)
    ):
        tolerance, difference = _number(test.comparators[0]), test.left.args[0]
        for computed, expected in ((difference.left, difference.right), (difference.right, difference.left)):
            number = _number(expected)
            if number is not None and tolerance is not None:
                inclusive = float(isinstance(test.ops[0], ast.LtE))
                return UnitTest(
                    statement, _computed(computed, statement), "abs_close", (number, tolerance, inclusive)
                )
    return None


def parse_test(statement: str) -> UnitTest:
    """Split an ``assert`` statement into its computed part and its check (the module docstring's forms).

    Raises:
        ValueError: the statement is not one ``assert`` of those forms.
    """
    try:
        body = ast.parse(statement).body
    except SyntaxError as err:
        raise ValueError(f"a code test does not parse: {statement!r} ({err.msg})") from None
    if len(body) != 1 or not isinstance(body[0], ast.Assert):
        raise ValueError(f"a code test must be one assert statement, got {statement!r}")
    test = body[0].test
    close = _closeness(test, statement)
    if close is not None:
        return close
    if isinstance(test, ast.Compare):
        return _comparison(test, statement)
    negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
    operand = test.operand if isinstance(test, ast.UnaryOp) and negated else test
    if not isinstance(operand, ast.Call) or ast.unparse(operand.func) in _PREDICATES:
        raise ValueError(
            f"a truth test calls the solution's function (assert is_prime(7)), got {statement!r}; compare "
            "anything else with a literal (assert f(1) == 2), so that the check runs outside the solution"
        )
    return UnitTest(statement, _computed(operand, statement), "falsy" if negated else "truthy")


def _comparison(test: ast.Compare, statement: str) -> UnitTest:
    if len(test.ops) != 1:
        raise ValueError(f"a code test compares once (no chains like a < b < c), got {statement!r}")
    (op,), left, right = test.ops, test.left, test.comparators[0]
    if isinstance(left, ast.Call) and ast.unparse(left.func) == "abs":
        # A distance computed in the solution's process is a value it can claim (0) without an answer.
        raise ValueError(
            f"a closeness test measures from a number (assert abs(f(x) - 2.5) < 1e-9), got {statement!r}"
        )
    right_is_literal, right_value = _literal(right)
    if right_is_literal:
        return UnitTest(
            statement, _computed(left, statement), type(op).__name__, right_value, value_on_left=True
        )
    left_is_literal, left_value = _literal(left)
    if left_is_literal:
        return UnitTest(
            statement, _computed(right, statement), type(op).__name__, left_value, value_on_left=False
        )
    raise ValueError(
        f"a code test compares the solution's value with a literal (assert f(1) == 2), got {statement!r}: "
        "the expected side must not run in the solution's process"
    )


_CONTAINERS: dict[str, Callable[[Iterable[Any]], Any]] = {
    "list": list,
    "tuple": tuple,
    "set": set,
    "frozenset": frozenset,
}


def _decode(node: Any, depth: int) -> Any:
    if depth > 100:
        raise ValueError("nested too deep")
    if node is None or type(node) in (bool, str):
        return node
    if type(node) is not list or len(node) != 2 or type(node[0]) is not str:
        raise ValueError(f"not an encoded value: {type(node).__name__}")
    kind, payload = node
    if kind == "int" and type(payload) is str:
        return int(payload)
    if kind == "float" and type(payload) is str:
        return float(payload)
    if kind == "bytes" and type(payload) is str:
        return bytes.fromhex(payload)
    if type(payload) is not list:
        raise ValueError(f"bad payload for {kind!r}")
    if kind == "dict":
        if not all(type(pair) is list and len(pair) == 2 for pair in payload):
            raise ValueError("a dict's items are [key, value] pairs")
        return {_decode(k, depth + 1): _decode(v, depth + 1) for k, v in payload}
    if kind not in _CONTAINERS:
        raise ValueError(f"unknown kind {kind!r}")
    return _CONTAINERS[kind](_decode(item, depth + 1) for item in payload)


def decode_value(encoded: str) -> Any:
    """The plain value a harness line reports, built from builtin types only.

    Raises:
        ValueError: ``encoded`` is not a value the harness encodes (unhashable keys, unknown kinds...).
    """
    try:
        return _decode(json.loads(encoded), 0)
    except (json.JSONDecodeError, TypeError, RecursionError) as err:
        raise ValueError(f"not an encoded value: {err}") from None


def reported_values(stdout: str, num_tests: int) -> dict[int, Any]:
    """The values reported for each test index in ``stdout``; an index reported twice, or a line that does
    not decode, counts as not reported (a solution may print anything, harness lines included)."""
    values: dict[int, Any] = {}
    seen: set[int] = set()
    for line in stdout.split("\n"):
        if not line.startswith(RESULT_MARK + " "):
            continue
        index_text, _, encoded = line[len(RESULT_MARK) + 1 :].partition(" ")
        if not (index_text.isascii() and index_text.isdigit() and len(index_text) < 10):
            continue
        if int(index_text) >= num_tests:
            continue
        index = int(index_text)
        if index in seen:
            values.pop(index, None)
            continue
        seen.add(index)
        try:
            values[index] = decode_value(encoded)
        except ValueError:
            continue
    return values
