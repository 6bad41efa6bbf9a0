"""A time and size budget for chat templates: they are code from the model file or from the user.

A template such as `{% for i in range(100000) %}{% for j in range(100000) %}...` must end in one
error line, not a hang, and `{{ 'x' * 10**10 }}` must not fill the memory. Jinja's sandbox already
forbids unsafe attributes and caps range() at 100,000 items; on top of it BudgetedEnvironment checks
- the clock at every call, attribute or item lookup, filter, operator and every 1,024 range() steps;
- the size of every value those produce (strings, lists, dicts) and of the output as it is generated;
- integer arguments that would make a huge value (`'x' * n`, `'x'.ljust(n)`, `x|center(n)`, `2 ** n`)
  before the value is made.
A loop over an already built list with an empty body passes none of these points, so in the main
thread a SIGALRM timer (no helper thread) interrupts the render at the deadline as well.
"""

from __future__ import annotations

import functools
import math
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from jinja2.sandbox import ImmutableSandboxedEnvironment

from .settings import TemplateSettings

_SIZED = (str, bytes, list, tuple, dict, set)


class BudgetExceeded(Exception):
    """The template ran past its time or size budget (templates have no try/except to catch it)."""


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with the budget checks above; `deadline` is set by `budget` around each render."""

    intercepted_binops = frozenset(["*", "+", "**"])

    def __init__(self, limits: TemplateSettings, **options) -> None:
        super().__init__(**options)
        self.limits = limits
        self.deadline = math.inf
        self.globals["range"] = self._range
        self.filters = {name: self.checked_filter(f) for name, f in self.filters.items()}

    # ---- the checks ------------------------------------------------------------------------------

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise BudgetExceeded(f"ran longer than {self.limits.seconds:g} s")

    def sized(self, value):
        """value, after checking the clock and that it is not bigger than the size budget."""
        self.tick()
        if isinstance(value, _SIZED) and len(value) > self.limits.max_chars:
            raise BudgetExceeded(f"built a value of {len(value):,} items (at most {self.limits.max_chars:,})")
        return value

    def small_ints(self, args) -> None:
        """Refuse an integer argument that could only make a value beyond the size budget."""
        for a in args:
            if isinstance(a, int) and abs(a) > self.limits.max_chars:
                raise BudgetExceeded(f"asked for a size of {a:,} (at most {self.limits.max_chars:,})")

    # ---- the sandbox's hooks -----------------------------------------------------------------------

    def call(self, context, obj, /, *args, **kwargs):
        if getattr(obj, "__func__", None) is not BudgetedEnvironment._range:  # range() has its own cap
            self.small_ints([*args, *kwargs.values()])
        return self.sized(super().call(context, obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        return self.sized(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        return self.sized(super().getitem(obj, argument))

    def call_binop(self, context, operator, left, right):
        if operator == "*" and (isinstance(left, _SIZED) or isinstance(right, _SIZED)):
            sized, count = (left, right) if isinstance(left, _SIZED) else (right, left)
            if isinstance(count, int) and len(sized) * count > self.limits.max_chars:
                raise BudgetExceeded(f"built a value of {len(sized) * count:,} items "
                                     f"(at most {self.limits.max_chars:,})")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64 and \
                isinstance(left, (int, float)) and abs(left) > 1:
            raise BudgetExceeded(f"raised a number to the power {right}")
        return self.sized(super().call_binop(context, operator, left, right))

    def checked_filter(self, f):
        # the filtered value is not a size: skip it (and the context/environment some filters take first)
        skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1

        @functools.wraps(f)  # copies jinja_pass_arg: context-taking filters still get their context
        def checked(*args, **kwargs):
            self.small_ints([*args[skip:], *kwargs.values()])
            return self.sized(f(*args, **kwargs))

        return checked

    def _range(self, *args) -> "BudgetedRange":
        r = range(*args)
        if len(r) > self.limits.max_range:
            raise BudgetExceeded(f"range of {len(r):,} items (at most {self.limits.max_range:,})")
        return BudgetedRange(r, self)


class BudgetedRange:
    """range() whose iteration checks the clock (nested loops over ranges end at the deadline)."""

    def __init__(self, r: range, env: BudgetedEnvironment) -> None:
        self._r, self._env = r, env

    def __iter__(self) -> Iterator[int]:
        for k, i in enumerate(self._r):
            if not k & 1023:
                self._env.tick()
            yield i

    def __reversed__(self) -> Iterator[int]:
        return iter(BudgetedRange(self._r[::-1], self._env))

    def __len__(self) -> int:
        return len(self._r)

    def __getitem__(self, i):
        item = self._r[i]
        return BudgetedRange(item, self._env) if isinstance(item, range) else item

    def __contains__(self, x) -> bool:
        return x in self._r

    def __repr__(self) -> str:
        return repr(self._r)


def render_budgeted(template, env: BudgetedEnvironment, **variables) -> str:
    """template.render(**variables) within env's budget; BudgetExceeded past it."""
    with within_budget(env):
        out: list[str] = []
        size = 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > env.limits.max_chars:
                raise BudgetExceeded(f"wrote more than {env.limits.max_chars:,} characters")
            out.append(chunk)
            env.tick()
        return "".join(out)


@contextmanager
def within_budget(env: BudgetedEnvironment):
    """Set env's deadline; in the main thread (with no other timer running) also a SIGALRM for it."""
    seconds = env.limits.seconds
    env.deadline = time.monotonic() + seconds
    use_alarm = (threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
                 and signal.getitimer(signal.ITIMER_REAL)[0] == 0)
    fired: list[bool] = []
    if use_alarm:
        def on_alarm(signum, frame):
            fired.append(True)
            raise BudgetExceeded(f"ran longer than {seconds:g} s")

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
        if fired:  # the alarm's exception was raised where Python drops it (a weakref callback, a __del__
            # run by the garbage collector: seen in CI), so the work went on to its end: refuse it here
            raise BudgetExceeded(f"ran longer than {seconds:g} s")
    finally:
        env.deadline = math.inf
        if use_alarm:
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
            finally:  # even if the alarm went off just now
                signal.signal(signal.SIGALRM, previous)
