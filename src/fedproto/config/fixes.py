"""How a refused option value is fixed, in the words of the file or flag it came from:
:func:`bound_fix` (the bound to respect, a number without its quotes, the nearest of a field's
choices), :func:`pattern_message` (a field pattern as its alternatives) and :func:`toml_value` (a
value as a TOML file writes it). :mod:`fedproto.config.run_config` words its ConfigErrors with them.
"""

from __future__ import annotations

from typing import Any

from fedproto.errors import RawValue, opt


def toml_value(value: Any) -> str:
    """``value`` as a TOML file writes it: ``"3"`` (a string keeps its quotes), ``true``,
    ``["cnn"]``, ``1979-05-27``, ``{a = 1}``."""
    import json
    import math

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and not isinstance(value, RawValue):  # JSON's escapes are TOML's, but for DEL
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)


def bound_fix(option: str, err: dict, key: str | None = None) -> str:
    """The fix of a pydantic error ``err`` (one of ``ValidationError.errors()``) about ``option``'s
    value, as ``; use --clients 1 or more`` (worded per front end; for a value read from a TOML file,
    its ``key`` as written there: ``; use clients = 1 or more``): a bound (ge, gt, le, lt), a number
    that is not finite or not whole, a number in quotes (``; write it without quotes: lr=0.1``), a
    name not among a field's choices or pattern (the nearest, else the first: ``; did you mean
    distance='mse'?``, ``device='gpu'`` -> ``device='cuda'``); '' for other errors."""
    ctx = {k: (int(v) if isinstance(v, float) and v.is_integer() else v)  # 100, not 100.0
           for k, v in (err.get("ctx") or {}).items()}
    kind = err.get("type", "")

    def word(v: Any) -> str:
        return f"{key} = {toml_value(v)}" if key else opt(option, v)

    name = key or opt(option)
    if kind == "greater_than_equal":
        return f"; use {word(ctx['ge'])} or more"
    if kind == "greater_than":
        return f"; give {name} a value above {ctx['gt']}"
    if kind == "less_than_equal":
        return f"; use {word(ctx['le'])} or less"
    if kind == "less_than":
        return f"; give {name} a value below {ctx['lt']}"
    if kind == "finite_number":
        return f"; give {name} a finite number"
    given = err.get("input")
    if kind in ("int_parsing", "float_parsing", "int_type", "float_type") and isinstance(given, str):
        number = _number(given)  # "0.1" in quotes: the number meant
        if number is not None and (kind.startswith("float") or isinstance(number, int)):
            return f"; write it without quotes: {word(number)}"
    if kind in ("int_from_float", "int_parsing", "int_type"):
        return f"; give {name} a whole number"
    if kind in ("float_parsing", "float_type"):
        return f"; give {name} a number"
    if kind in ("literal_error", "string_pattern_mismatch") and isinstance(given, str):  # a name from a list
        import difflib
        import re

        choices = (re.findall(r"'([^']*)'", str(ctx.get("expected", ""))) if kind == "literal_error" else
                   [c for c in _pattern_choices(str(ctx.get("pattern", ""))) if "N" not in c])
        near = {"gpu": "cuda"}.get(given.lower()) if "cuda" in choices else None  # a GPU is torch's cuda
        near = [near] if near else difflib.get_close_matches(given, choices, n=1)
        if near:
            return f"; did you mean {word(near[0])}?"
        return f"; give one of those, e.g. {word(choices[0])}" if choices else ""
    return ""


def _number(text: str) -> int | float | None:
    """The number a quoted value spells (``"3"`` -> 3, ``"0.1"`` -> 0.1), or None."""
    for kind in (int, float):
        try:
            return kind(text.strip())
        except ValueError:
            pass
    return None


def _pattern_choices(pattern: str) -> list[str]:
    """The alternatives of a field pattern ``^(a|b|c:\\d{1,3})$`` as a user writes them: a, b, c:N."""
    import re

    m = re.fullmatch(r"\^\((.*)\)\$", pattern)
    return [re.sub(r"\\d(\{[^}]*\}|\+)?", "N", a) for a in m.group(1).split("|")] if m else []


def pattern_message(err: dict) -> str:
    """pydantic's message for ``err``, a pattern ``^(a|b)$`` worded as its alternatives
    ("should be one of auto, cpu, cuda, cuda:N, mps"), not as the regular expression."""
    msg = err["msg"].removeprefix("Value error, ")
    choices = _pattern_choices(str((err.get("ctx") or {}).get("pattern", "")))
    if err.get("type") == "string_pattern_mismatch" and choices:
        return "should be one of " + ", ".join(choices)
    return msg
