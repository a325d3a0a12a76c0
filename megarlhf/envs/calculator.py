"""`calculator`, a tool for `environment: tools` (`tools: [megarlhf.envs.calculator:calculator]`):
arithmetic on numbers with + - * / ** and parentheses, evaluated from the expression's syntax
tree (no eval: nothing but arithmetic can run)."""

from __future__ import annotations

import ast
import operator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg,
              ast.UAdd: operator.pos}
_MAX_EXPONENT = 64


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers with + - * / ** and parentheses, e.g. "37 * (23 + 4)".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponents above {_MAX_EXPONENT} are not allowed")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"only numbers and + - * / ** ( ) are allowed, got "
                     f"{ast.unparse(node)!r}")
