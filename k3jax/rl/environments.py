"""Environments of multi-turn tool-using rollouts: what answers the model's tool calls between its turns.

A rollout alternates model turns and environment steps. After each model turn the rollout hands the
conversation so far (OpenAI-style messages, ``k3jax.data.chat``), ending with the model's assistant
message and its parsed ``tool_calls`` (``k3jax.serving.assistant_reply.parse_reply``), to
:meth:`Environment.step`, which returns an :class:`EnvTurn`: the ``tool`` messages to append, and whether
the episode has ended (with the environment's own reward, if it has one). One environment instance
serves one rollout (:data:`EnvFactory` makes it from the prompt record), so it may keep state, and
:meth:`Environment.close` frees what it holds.

The rule the built-in environments share (:class:`ToolEnvironment`): an assistant message without tool
calls ends the episode; otherwise each call gets exactly one tool message with its ``tool_call_id``, in
order, and a call the model got wrong (an unknown tool, arguments that are not a JSON object, a missing,
unexpected or mistyped argument) gets an error text as its content, never an exception, so the model
sees its mistake as it would at serving time.

Built-ins (:func:`load_environment` by name):

- ``calculator``: :class:`Calculator`, the tool ``calculator(expression)`` (arithmetic, evaluated by
  walking its syntax tree, never ``eval``, within bounds a ``9**9**9`` cannot get past);
- ``python``: ``k3jax.rl.sandbox.PythonSandbox``, the tool ``python(code)``, run in a separate process
  whose state persists over the rollout's turns.

Any other name is ``package.module:function``: ``function(record, **options)`` returns a fresh
:class:`Environment` for the rollout of prompt record ``record`` (its fields: ``k3jax.rl.prompts``).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import math
import operator
from typing import Any, Callable, Protocol

from k3jax.config.callables import import_callable
from k3jax.config.fields import ConfigError

FIELD = "train.rl.environment"  # the config field errors name


@dataclasses.dataclass(frozen=True)
class EnvTurn:
    """An environment's answer to a model turn."""

    messages: tuple[dict, ...] = ()  # the tool messages answering the turn's calls (role "tool", tool_call_id, content)
    done: bool = False  # the episode ends: no more model turns
    reward: float | None = None  # with done: the environment's reward for the episode (None: reward functions decide)

    def to_json(self) -> dict:
        """The turn as JSON values (what process 0 sends the others: ``k3jax.rl.episodes``)."""
        return {"messages": [dict(m) for m in self.messages], "done": bool(self.done),
                "reward": None if self.reward is None else float(self.reward)}

    @classmethod
    def from_json(cls, value: dict) -> "EnvTurn":
        return cls(tuple(value["messages"]), value["done"], value["reward"])


class Environment(Protocol):
    tools: list[dict]  # OpenAI tool schemas ({"type": "function", "function": {...}}) the prompt advertises

    def step(self, messages: list[dict]) -> EnvTurn:
        """Answer the last message of ``messages`` (the conversation so far), the model's assistant turn."""

    def close(self) -> None:
        """Free what the environment holds (processes, files); called once the rollout is over."""


EnvFactory = Callable[[dict], Environment]  # a prompt record's fields -> a fresh environment for one rollout


def function_tool(name: str, description: str, **parameters: str) -> dict:
    """The OpenAI schema of tool ``name`` whose parameters (keyword: its description) are required strings."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": list(parameters),
                       "properties": {k: {"type": "string", "description": v} for k, v in parameters.items()}}}}


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
               "array": list, "null": type(None)}


def tool_arguments(raw: Any, parameters: dict) -> dict | str:
    """A call's arguments (a JSON string or an already parsed object) checked against its tool's
    ``parameters`` schema (required keys, no unknown keys, top-level JSON types): the arguments, or an
    error text for the model."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            return f"error: the arguments are not valid JSON ({e})"
    if not isinstance(raw, dict):
        return f"error: the arguments must be a JSON object, got {type(raw).__name__}"
    properties = parameters.get("properties", {})
    missing = [k for k in parameters.get("required", ()) if k not in raw]
    if missing:
        return f"error: missing argument{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}"
    unknown = [k for k in raw if k not in properties]
    if unknown:
        return (f"error: unknown argument{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))} "
                f"(expected: {', '.join(map(repr, properties))})")
    for key, value in raw.items():
        kind = properties[key].get("type")
        expected = _JSON_TYPES.get(kind)
        if expected is not None and (not isinstance(value, expected)
                                     or (isinstance(value, bool) and kind != "boolean")):
            return f"error: argument {key!r} must be a {kind}, got {json.dumps(value)[:100]}"
    return raw


class ToolEnvironment:
    """Base of environments whose tools are answered by :meth:`run_tool`: :meth:`step` applies the shared
    rule (module docstring) and hands each well-formed call to :meth:`run_tool`."""

    tools: list[dict] = []

    def step(self, messages: list[dict]) -> EnvTurn:
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("step: the conversation must end with the model's assistant message")
        calls = messages[-1].get("tool_calls") or []
        if not calls:
            return EnvTurn(done=True)
        return EnvTurn(tuple({"role": "tool", "tool_call_id": call.get("id"), "content": self._answer(call["function"])}
                             for call in calls))

    def _answer(self, function: dict) -> str:
        name = function.get("name")
        schema = next((t["function"] for t in self.tools if t["function"]["name"] == name), None)
        if schema is None:
            names = ", ".join(t["function"]["name"] for t in self.tools)
            return f"error: unknown tool {name!r}; the tools are: {names}"
        arguments = tool_arguments(function.get("arguments"), schema.get("parameters", {}))
        return arguments if isinstance(arguments, str) else self.run_tool(name, arguments)

    def run_tool(self, name: str, arguments: dict) -> str:
        """The content of the tool message answering a call of tool ``name`` with checked ``arguments``."""
        raise NotImplementedError

    def close(self) -> None:
        pass


# --- calculator ---------------------------------------------------------------------------------------

MAX_EXPRESSION = 1000  # characters of an expression
MAX_DIGITS = 1000  # of an integer result (floats are bounded by their own range)
_MAX_INT = 10 ** MAX_DIGITS
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class _CalculatorError(ValueError):
    pass


def _bounded(value):
    if isinstance(value, complex):
        raise _CalculatorError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise _CalculatorError("the result is out of range")
    if isinstance(value, int) and abs(value) >= _MAX_INT:
        raise _CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    return value


def _power(base, exponent):
    """``base ** exponent``, refused before computing an integer result of more than MAX_DIGITS digits."""
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        if exponent * math.log10(abs(base)) >= MAX_DIGITS:
            raise _CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    return base ** exponent


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and (type(node.op) in _BINARY or isinstance(node.op, ast.Pow)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        op = _power if isinstance(node.op, ast.Pow) else _BINARY[type(node.op)]
        return _bounded(op(left, right))
    raise _CalculatorError(f"{ast.unparse(node)!r} is not arithmetic: only numbers, + - * / // % ** and "
                           "parentheses are allowed")


def calculate(expression: str) -> str:
    """The value of arithmetic ``expression`` as text (Python's operators and number syntax), or an error
    text: a syntax error, division by zero, a result out of bounds, anything but arithmetic."""
    if len(expression) > MAX_EXPRESSION:
        return f"error: the expression is longer than {MAX_EXPRESSION} characters"
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    except SyntaxError as e:
        return f"error: invalid expression ({e.msg})"
    except ZeroDivisionError:
        return "error: division by zero"
    except OverflowError:
        return "error: the result is out of range"
    except RecursionError:
        return "error: the expression is nested too deeply"
    except _CalculatorError as e:
        return f"error: {e}"
    return repr(value)


class Calculator(ToolEnvironment):
    """The ``calculator`` tool: :func:`calculate`. Stateless."""

    tools = [function_tool("calculator", "Evaluate an arithmetic expression: numbers, + - * / // % ** (power) and "
                           "parentheses, with Python's precedence.",
                           expression="the expression, e.g. (3 + 4) * 2 ** 10 / 7")]

    def run_tool(self, name: str, arguments: dict) -> str:
        return calculate(arguments["expression"])


# --- loading ------------------------------------------------------------------------------------------

BUILTINS = {"calculator": "k3jax.rl.environments:Calculator", "python": "k3jax.rl.sandbox:PythonSandbox"}


def _check_signature(name: str, fn: Callable, *args, **options) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without a signature: its call will tell
        return
    try:
        signature.bind(*args, **options)
    except TypeError as e:
        raise ConfigError(f"{FIELD}: {name!r}: options {options}: {e}") from None


def load_environment(name: str, **options) -> EnvFactory:
    """The factory of environment ``name``: a built-in (:data:`BUILTINS`; ``options`` are its
    constructor's keywords, checked here by building and closing one) or ``package.module:function``
    (called as ``function(record, **options)``). An unknown name, a missing module or attribute, or
    options the environment does not take raise ``ConfigError`` naming ``train.rl.environment``."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{FIELD}: an environment name must be a non-empty string, got {name!r}")
    name = name.strip()
    if name in BUILTINS:
        cls = import_callable(BUILTINS[name], FIELD)
        _check_signature(name, cls, **options)
        try:
            cls(**options).close()
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{FIELD}: {name!r}: {e}") from None
        return lambda record: cls(**options)
    if ":" in name:
        fn = import_callable(name, FIELD)
        _check_signature(name, fn, {}, **options)
        return lambda record: fn(record, **options)
    close = difflib.get_close_matches(name, BUILTINS, n=2, cutoff=0.6)
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
    raise ConfigError(f"{FIELD}: unknown environment {name!r}{hint}; a built-in ({', '.join(BUILTINS)}) or "
                      "'package.module:function'")
