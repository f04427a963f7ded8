"""A chat template compiled with a budget. A template comes with the model and is code: transformers
runs it in jinja's sandbox, which stops it reaching Python's internals but not using the machine
up. Nested `range(100000)` loops, or `'x' * 10**9`, grew adapt's tokenizer workers past 8-10 GB.
Here every render has a time limit (checked at each call, attribute lookup, operator and piece of
output) and an output limit (the rendering, and any one string or list that `*` or `+` would
make); a template past either fails that render with `TemplateBudgetExceeded`, a jinja
TemplateError, which the renderer turns into one line naming the template. adapt renders every
chat this way; eval, whose chats lm-eval renders through transformers, first renders a short chat
this way (`check_template_budget`).

The environment is transformers' own (its filters, globals such as `raise_exception` and
`namespace`, and extensions such as `{% generation %}`), rebuilt on a sandbox that keeps count."""

from __future__ import annotations

import math
import operator
import time
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ladder.errors import UsageError

# Far above what a chat template makes of one chat (a few kB of markup around its messages).
MAX_RENDER_CHARS = 16 << 20
MAX_RENDER_SECONDS = 10.0

_OPERATORS = {"*": operator.mul, "+": operator.add, "**": operator.pow}


class TemplateBudgetExceeded(TemplateError):
    """A render went past MAX_RENDER_CHARS or MAX_RENDER_SECONDS."""


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox that checks the clock at every call, lookup and intercepted operator,
    and refuses `*`, `+` and `**` whose result would exceed the output limit."""

    intercepted_binops = frozenset(_OPERATORS)

    def start(self) -> None:
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS

    def check_clock(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBudgetExceeded(f"it ran past {MAX_RENDER_SECONDS:g} s on one chat")

    def call_binop(self, context, operator_name: str, left: Any, right: Any) -> Any:
        self.check_clock()
        size = _result_size(operator_name, left, right)
        if size > MAX_RENDER_CHARS:
            raise TemplateBudgetExceeded(
                f"`{operator_name}` would make a value of about {size:.3g} items, past {MAX_RENDER_CHARS:,}"
            )
        return _OPERATORS[operator_name](left, right)

    def call(self, context, obj, /, *args, **kwargs):  # positional: a template's keywords may be any name
        self.check_clock()
        return super().call(context, obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.check_clock()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.check_clock()
        return super().getitem(obj, argument)


def _result_size(operator_name: str, left: Any, right: Any) -> float:
    """About how many characters or items (for `**`: digits) the operator's result holds."""
    sized = (str, list, tuple, bytes)
    if operator_name == "*":
        for sequence, count in ((left, right), (right, left)):
            if isinstance(sequence, sized) and isinstance(count, int):
                return len(sequence) * max(count, 0)
    if operator_name == "+" and isinstance(left, sized) and isinstance(right, sized):
        return len(left) + len(right)
    if operator_name == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        return right * math.log10(abs(left))
    return 0


def compile_budgeted(template: str):
    """`template` compiled as transformers compiles a chat template, in a `BudgetedEnvironment`."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    # transformers' environment, from an empty template: compiling `template` there would run its
    # constant expressions ('x' * 10**9) at compile time, where nothing intercepts them.
    reference = _compile_jinja_template("").environment
    environment = BudgetedEnvironment(
        trim_blocks=reference.trim_blocks,
        lstrip_blocks=reference.lstrip_blocks,
        extensions=[type(extension) for extension in reference.extensions.values()],
    )
    environment.filters.update(reference.filters)
    environment.globals.update(reference.globals)
    return environment.from_string(template)


def render_budgeted(compiled, **context: Any) -> str:
    """`compiled.render(**context)` within the budget, output counted as it is produced."""
    environment = compiled.environment
    environment.start()
    pieces, length = [], 0
    for piece in compiled.generate(**context):
        length += len(piece)
        if length > MAX_RENDER_CHARS:
            raise TemplateBudgetExceeded(f"it rendered past {MAX_RENDER_CHARS:,} characters of one chat")
        environment.check_clock()
        pieces.append(piece)
    return "".join(pieces)


# A short chat that any chat template renders.
PROBE_CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]


def check_template_budget(template: str, owner: str) -> None:
    """Render PROBE_CHAT with `template` within the budget: one past it is a UsageError naming
    `owner`. Any other failure is left to the rendering that meets it (a template may refuse a
    chat without a system message, say)."""
    try:
        render_budgeted(compile_budgeted(template), messages=PROBE_CHAT, add_generation_prompt=True)
    except TemplateBudgetExceeded as error:
        raise UsageError(f"the chat template of {owner} exceeds its budget: {error}") from None
    except (TemplateError, TypeError, ValueError, RecursionError, OverflowError):
        pass


__all__ = [
    "MAX_RENDER_CHARS",
    "MAX_RENDER_SECONDS",
    "TemplateBudgetExceeded",
    "check_template_budget",
    "compile_budgeted",
    "render_budgeted",
]
