"""What a chat template reads from outside the request -- the clock, or randomness -- found in
its Jinja syntax tree, and the tag that puts the clock's part of the render in the key.

transformers gives templates ``strftime_now(format)`` (local time). A template that calls it
with constant formats renders the same text for as long as each format's output stays the
same, so the key holds exactly those outputs (``ClockUse.tag``): a date for ``%Y-%m-%d``, the
hour and minute for ``%H:%M``. Anything finer than a minute (``%S``, ``%T``, ``%f`` ...), a
directive not known here, a format that is not a constant string, ``strftime_now`` passed
around as a value, Jinja's ``random`` filter and ``lipsum()`` make a render that the next
request cannot reproduce (or only for a second): such a template is not cached at all
(``ClockUse.uncacheable`` says why), every request is computed as on a miss and nothing is
stored.

The syntax tree cannot see every way to reach randomness (``map('random')``, ``lipsum`` passed
as a value, a filter name built from strings), so randomness is also caught where it happens:
the environment's ``random`` filter and ``lipsum`` global record each call made inside
``randomness_seen()`` (``watch_randomness``), and a render that drew is never stored.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import nodes

# strftime directives by what they print (glibc, which Python's strftime calls on Linux).
_DAY_OR_COARSER = frozenset("aAbBCdDeFgGhjmnuUVwWxyYzZt%")
_MINUTE = frozenset("HIklMpPR")
_FINER = frozenset("cfrsSTX+N")   # seconds or finer
# ``%``, glibc flags and width, an E/O modifier, then the directive's letter.
_DIRECTIVE = re.compile(r"%[-_0^#]*[0-9]*[EO]?(.|$)", re.DOTALL)

DAY_FORMAT = "%Y-%m-%d"


@dataclass(frozen=True, slots=True)
class ClockUse:
    """The ``strftime_now`` formats a template renders, or why it cannot be cached."""

    formats: tuple[str, ...] = ()
    uncacheable: str | None = None

    def tag(self) -> str | None:
        """The formats' outputs now: the part of the key the clock fixes (None: no clock)."""
        if not self.formats:
            return None
        now = datetime.now()
        return "\x00".join(now.strftime(f) for f in self.formats)


NO_CLOCK = ClockUse()


def clock_use(environment: Any, source: str) -> ClockUse:
    """How the template ``source`` (parsed in ``environment``, transformers' own) reads the
    clock or randomness."""
    try:
        tree = environment.parse(source)
    except Exception:  # a template that does not parse fails in its own render, with its message
        return NO_CLOCK
    for node in tree.find_all(nodes.Filter):
        if node.name == "random":
            return ClockUse(uncacheable="the template uses the random filter")
    formats: list[str] = []
    called: set[int] = set()
    for call in tree.find_all(nodes.Call):
        callee = call.node
        if isinstance(callee, nodes.Name) and callee.name == "lipsum":
            return ClockUse(uncacheable="the template calls lipsum()")
        if not (isinstance(callee, nodes.Name) and callee.name == "strftime_now"):
            continue
        called.add(id(callee))
        arg = call.args[0] if len(call.args) == 1 and not call.kwargs else None
        if not (isinstance(arg, nodes.Const) and isinstance(arg.value, str)):
            return ClockUse(uncacheable="the template calls strftime_now with a format that is "
                                        "not a constant string")
        why = _too_fine(arg.value)
        if why is not None:
            return ClockUse(uncacheable=why)
        if arg.value not in formats:
            formats.append(arg.value)
    tested = {id(test.node) for test in tree.find_all(nodes.Test)}
    for name in tree.find_all(nodes.Name):
        if name.name == "strftime_now" and id(name) not in called and id(name) not in tested:
            return ClockUse(uncacheable="the template uses strftime_now other than by calling "
                                        "it with a constant format")
    return ClockUse(tuple(formats)) if formats else NO_CLOCK


def _too_fine(fmt: str) -> str | None:
    """Why ``fmt`` cannot key a cache entry (finer than a minute, or unknown); None if it can."""
    for match in _DIRECTIVE.finditer(fmt):
        letter = match.group(1)
        if letter in _FINER:
            return f"the template formats the time finer than a minute (strftime_now({fmt!r}))"
        if letter not in _DAY_OR_COARSER and letter not in _MINUTE:
            return f"the template formats the time with an unknown directive (strftime_now({fmt!r}))"
    return None


# -- randomness, caught where it happens ----------------------------------------------------------

_WATCHED = "__prefix_cache_random__"
_drawn: ContextVar[list[str] | None] = ContextVar("prefix_cache_random_drawn", default=None)


def watch_randomness(environment: Any) -> None:
    """Wrap ``environment``'s ``random`` filter and ``lipsum`` global in place (once) so that a
    call made inside ``randomness_seen()`` is recorded there; they behave as before."""
    found = environment.filters.get("random")
    if found is not None and not getattr(found, _WATCHED, False):
        environment.filters["random"] = _recorded(found, "the template draws with the random "
                                                         "filter")
    found = environment.globals.get("lipsum")
    if found is not None and not getattr(found, _WATCHED, False):
        environment.globals["lipsum"] = _recorded(found, "the template calls lipsum()")


class randomness_seen:  # noqa: N801 - used as a function: ``with randomness_seen() as drawn``
    """A list that collects why, for each random draw made by a watched template inside (a
    class, not ``@contextmanager``: it wraps every render, a hit's included)."""

    __slots__ = ("drawn", "token")

    def __enter__(self) -> list[str]:
        self.drawn: list[str] = []
        self.token = _drawn.set(self.drawn)
        return self.drawn

    def __exit__(self, *exc: object) -> None:
        _drawn.reset(self.token)


def _recorded(function: Callable[..., Any], why: str) -> Callable[..., Any]:
    @functools.wraps(function)  # keeps Jinja's pass_context/pass_environment marks
    def call(*args: Any, **kwargs: Any) -> Any:
        drawn = _drawn.get()
        if drawn is not None:
            drawn.append(why)
        return function(*args, **kwargs)

    setattr(call, _WATCHED, True)
    return call
