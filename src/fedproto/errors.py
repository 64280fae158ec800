"""Exception types. Every error a user can cause derives from :class:`FedprotoError`.

The CLI turns any :class:`FedprotoError` into one message on stderr and exit code 2,
without a traceback. Messages name the bad value and say how to fix it.
"""

from __future__ import annotations

import copy
import difflib
import json
from collections.abc import Callable, Iterable
from typing import Any

_REF = "\x1f"  # delimits an option reference inside a message (never in user text: not printable)
_VAL = "\x1e"  # separates the option's name from its JSON-encoded value
NO_VALUE: Any = type("NoValue", (), {"__repr__": lambda self: "NO_VALUE"})()
"""Marks an option reference without a value (``opt("lr")``) and an error without a value."""

Wording = Callable[[str, Any], str]
"""``wording(option, value)`` -> how a front end names a run option (value may be NO_VALUE)."""


_RAW = "\x1d"  # marks a value JSON cannot hold (a TOML date or time, any object): kept as its text


class RawValue(str):
    """A value that JSON cannot hold (a TOML date or time, any other object), carried as its
    text: worded bare (``1979-05-27``), not as a quoted string."""

    def __repr__(self) -> str:
        return str(self)


class TypedFloat(float):
    """A float read from text, which keeps that text (``typed``), so a message names the value as
    the user typed it (``--participation 0``, not ``0.0``); otherwise a float."""

    typed: str = ""

    @classmethod
    def of(cls, value: float, typed: str) -> TypedFloat:
        """``value`` remembering ``typed``."""
        out = cls(value)
        out.typed = typed
        return out


def _encode(value: Any) -> str:
    if isinstance(value, TypedFloat) and value.typed:
        return json.dumps({_RAW: value.typed})

    def other(o: Any) -> dict:
        return {_RAW: o.isoformat() if hasattr(o, "isoformat") else str(o)}

    try:
        return json.dumps(value, default=other)
    except (TypeError, ValueError):  # keys JSON cannot hold, a value that contains itself
        return json.dumps({_RAW: repr(value)})


def _decode(encoded: str) -> Any:
    return json.loads(encoded, object_hook=lambda d: RawValue(d[_RAW]) if set(d) == {_RAW} else d)


def first_line(e: BaseException) -> str:
    """The first non-empty line of ``str(e)``, else ``"no message"`` (``EOFError()`` of an empty
    file, a bare ``raise RuntimeError``): for messages that quote a cause in one line."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else "no message"


def same_value(a: Any, b: Any) -> bool:
    """Whether two option values are the same as :func:`opt` carries them (a value decoded
    from a reference compared with the one given)."""
    try:
        x, y = _decode(_encode(a)), _decode(_encode(b))
    except (TypeError, ValueError):
        return False
    if isinstance(x, float) and isinstance(y, float) and x != x and y != y:  # NaN is NaN here (nan != nan)
        return True
    return x == y and isinstance(x, bool) == isinstance(y, bool)


UNKNOWN = "?"
"""Prefix of an :func:`opt` reference to an unknown option key (``opt("?Rounds")``): each front
end words it as its own suggestion ("did you mean 'rounds'?") or its list of known keys."""


def suggestion(key: str, candidates: list[str]) -> str | None:
    """The candidate closest to the unknown ``key`` (case ignored first), or None."""
    lowered = {c.lower(): c for c in candidates}
    if str(key).lower() in lowered:
        return lowered[str(key).lower()]
    close = difflib.get_close_matches(str(key), candidates, n=1, cutoff=0.6)
    if not close:
        close = [lowered[c] for c in difflib.get_close_matches(str(key).lower(), list(lowered), n=1, cutoff=0.6)]
    return close[0] if close else None


def unknown_text(key: str, candidates: list[str], shown: Callable[[str], str] = repr) -> str:
    """How a front end continues "unknown option 'x'": a suggestion, else the known names."""
    near = suggestion(key, candidates)
    if near is not None:
        return f"; did you mean {shown(near)}?"
    return "; known options: " + ", ".join(candidates)


def opt(option: str, value: Any = NO_VALUE) -> str:
    """A reference to the run option ``option`` (a RunConfig field name; ``a|b`` for two
    alternatives), optionally with the value to give, for use inside an error message.

    Each front end words it its own way (:meth:`FedprotoError.render`): ``--shots 10`` on the
    command line, ``--set shots=10`` in ``fedproto reproduce``, ``shots=10`` in Python and in a
    Flower run config. The reference is kept as data, not parsed back out of prose.
    """
    encoded = "" if value is NO_VALUE else _VAL + _encode(value)
    return f"{_REF}{option}{encoded}{_REF}"


_OPTION_NAMES: list[Callable[[], Iterable[str]]] = []


def register_option_names(names: Callable[[], Iterable[str]]) -> None:
    """Tell :func:`python_wording` which names are run options (``fedproto.config.run_config`` registers
    RunConfig's fields when it is imported; this module imports nothing of the package above it)."""
    _OPTION_NAMES.append(names)


def _option_names() -> list[str]:
    return [n for names in _OPTION_NAMES for n in names()]


def python_wording(option: str, value: Any = NO_VALUE) -> str:
    """An option as a Python keyword: ``shots``, ``shots=10``, ``noise='gaussian'``; a switch that
    is no run option (``resume``) as ``resume=True``."""
    fields = _option_names()
    if option.startswith(UNKNOWN):
        return unknown_text(option[1:], fields)
    names = option.split("|")
    if value is NO_VALUE:
        return " / ".join(n if n in fields else f"{n}=True" for n in names)
    return f"{names[0]}={value!r}"


def render(text: str, wording: Wording = python_wording) -> str:
    """``text`` with every :func:`opt` reference worded by ``wording``."""
    return rewrite(text, wording)


def rewrite(text: str, wording: Callable[[str, Any], str | None]) -> str:
    """``text`` with each :func:`opt` reference replaced by ``wording(option, value)``; a
    reference for which it returns None stays a reference."""
    if _REF not in text:
        return text
    parts = text.split(_REF)
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            out.append(part)
            continue
        name, _, encoded = part.partition(_VAL)
        worded = wording(name, _decode(encoded) if encoded else NO_VALUE)
        out.append(f"{_REF}{part}{_REF}" if worded is None else worded)
    return "".join(out)


class FedprotoError(Exception):
    """Base class of all user-facing errors (bad config, missing data, impossible partition).

    Args:
        message: what is wrong; may hold :func:`opt` references, which :meth:`render` words
            for the front end at hand (``str(error)`` words them as Python keywords).
        option: the run option at fault (a RunConfig field name), when there is one.
        value: the value given for it (:data:`NO_VALUE` when not known).
        hint: how to fix it (may hold :func:`opt` references too); appended as "; hint".
    """

    def __init__(self, message: str = "", *args: Any, option: str | None = None, value: Any = NO_VALUE,
                 hint: str | None = None):
        super().__init__(message, *args)
        self.message, self.option, self.value, self.hint = str(message), option, value, hint

    def render(self, wording: Wording = python_wording) -> str:
        """The message (and hint) with option references worded by ``wording``."""
        text = self.message if not self.hint else f"{self.message}; {self.hint}"
        return render(text, wording)

    def __str__(self) -> str:
        return self.render(python_wording)

    def prefixed(self, prefix: str) -> FedprotoError:
        """A copy of this error (same class, option, value and hint) whose message starts with
        ``prefix``, e.g. ``"cell mnist-n3-fedproto-s1: "``; option references stay references."""
        new = copy.copy(self)
        new.message = prefix + self.message
        new.args = (new.message,)
        return new

    def rewritten(self, wording: Callable[[str, Any], str | None]) -> FedprotoError:
        """A copy whose option references in message and hint are replaced by ``wording``
        where it returns a text (see :func:`rewrite`), e.g. to name a value by where it came from."""
        new = copy.copy(self)
        new.message = rewrite(self.message, wording)
        new.hint = None if self.hint is None else rewrite(self.hint, wording)
        new.args = (new.message,)
        return new


class ConfigError(FedprotoError, ValueError):
    """A run configuration value is invalid (raised before any training starts).

    ``option``, ``value`` and ``hint`` say which option, what was given and how to fix it; a
    front end words the message with :meth:`~FedprotoError.render`.
    """


class DataError(FedprotoError):
    """A dataset file is missing, corrupt, or cannot be downloaded."""


class PartitionError(FedprotoError, ValueError):
    """The dataset cannot supply the requested partition (names the class and the shortfall).

    A training-sample shortfall of :func:`fedproto.data.partition.fewshot_partition` also carries
    it as data, so each front end can word its own advice: ``short_class`` (the class that runs
    shortest), ``needed`` and ``available`` (its training samples), ``short_classes`` (how many
    classes run short), ``fitting_shots`` (the largest shots that fits with this seed, or 0).
    Other partition errors leave them None."""

    def __init__(self, message: str, *, short_class: int | None = None, needed: int | None = None,
                 available: int | None = None, short_classes: int | None = None, fitting_shots: int | None = None):
        super().__init__(message)
        self.short_class, self.needed, self.available = short_class, needed, available
        self.short_classes, self.fitting_shots = short_classes, fitting_shots


class ModelError(FedprotoError, ValueError):
    """Client models are incompatible (e.g. different embedding sizes) or a model name is unknown."""


class TrainingError(FedprotoError):
    """Training cannot go on (e.g. the loss became NaN or infinite)."""


class CheckpointError(DataError):
    """A checkpoint file is damaged, of another format, or does not fit the run's models."""


class CheckpointMismatch(ConfigError):
    """A checkpoint was written by a run with other options (names the fields that differ)."""
