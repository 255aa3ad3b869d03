"""The building blocks of the config tree: a documented field, its flag, and the one error type.

Every section of :class:`hybrid.config.PretrainConfig` (``ZeroConfig``, ``OptimizerConfig``,
``ActivationConfig``, ...) declares its fields with :func:`arg`, so the one-line help, the
Megatron-LM flag name and any alias flags live next to the default, and ``hybrid.job.cli`` generates
``--help`` from them. This module imports nothing from the project, so every subpackage can use
it without an import cycle.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field


class ConfigError(ValueError):
    """An inconsistent or impossible setting; the message names the flag, the field and the
    value."""


def arg(default, help: str, *, flag: str | None = None, aliases: dict[str, object] | None = None,
        **extra):
    """A config field with its ``default`` and one-line ``help`` (also the CLI help).

    Args:
        default: the default value (a list is copied per instance).
        help: one line, with units.
        flag: the command-line flag when it differs from ``--field-name`` (Megatron-LM's name).
        aliases: extra flags that set this field to a constant, e.g. ``{"--bf16": "bf16"}``.
        extra: passed to ``argparse.add_argument`` (``choices``, ``nargs``), except
            ``alt_flags``: more flags that take a value for this field, e.g. Megatron-LM's older
            ``("--layernorm-epsilon",)`` beside ``--norm-epsilon``.
    """
    meta = dict(help=help, **extra)
    if flag is not None:
        meta["flag"] = flag
    if aliases:
        meta["aliases"] = dict(aliases)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of field ``f`` (``--num-layers`` for ``num_layers`` unless renamed)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def fail(obj, name: str, why: str):
    """Raise :class:`ConfigError` for field ``name`` of dataclass ``obj``: flag, value, field,
    reason."""
    f = next(f for f in dataclasses.fields(obj) if f.name == name)
    raise ConfigError(f"{flag_of(f)} {getattr(obj, name)!r} ({type(obj).__name__}.{name}): {why}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_int(obj, name: str, low: int = 1, optional: bool = False) -> None:
    """Field ``name`` must be an integer >= ``low`` (or None when ``optional``)."""
    v = getattr(obj, name)
    if optional and v is None:
        return
    if not _is_int(v) or v < low:
        fail(obj, name, f"must be an integer >= {low}" + (" or unset" if optional else ""))


def check_number(obj, name: str, low: float = 0.0, strict: bool = False, high: float | None = None,
                 optional: bool = False) -> None:
    """Field ``name`` must be a finite number >= ``low`` (> with ``strict``, < ``high`` if
    given)."""
    v = getattr(obj, name)
    if optional and v is None:
        return
    ok = (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
          and (v > low if strict else v >= low) and (high is None or v < high))
    if not ok:
        bounds = f"{'>' if strict else '>='} {low}" + (f" and < {high}" if high is not None else "")
        fail(obj, name, f"must be a finite number {bounds}" + (" or unset" if optional else ""))


def check_choice(obj, name: str, choices) -> None:
    """Field ``name`` must be one of ``choices``."""
    if getattr(obj, name) not in choices:
        fail(obj, name, f"valid values are {', '.join(map(str, choices))}")


def flag_hints(message: str, flags: list[str]) -> list[str]:
    """``["--bad: did you mean --good?"]`` for every flag in an argparse error ``message`` that
    is not one of ``flags`` but plausibly the same flag: a typo (difflib ratio >= 0.75, after
    ``_`` -> ``-``) or the start of one (``--zero`` of ``--zero-stage``); shared by every CLI."""
    import difflib
    import re

    hints = []
    for bad in re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", message.split(":", 1)[-1]):
        if bad in flags:
            continue
        name = bad.split("=")[0].replace("_", "-")
        close = ([f for f in flags if f.startswith(name + "-")][:1]
                 or difflib.get_close_matches(name, flags, n=1, cutoff=0.75))
        if close:
            hints.append(f"{bad}: did you mean {close[0]}?")
    return hints


def choices_hints(message: str, actions) -> list[str]:
    """``["--kernel-fusion: valid values are auto, on, off"]`` when argparse's error
    ``message`` says a flag was given without its value ("expected one argument") and that
    flag, among ``actions`` (a parser's ``_actions``), takes one of a few choices; shared by
    every CLI whose errors are one line without the usage (which would have listed them)."""
    import re

    given = re.match(r"argument (\S+): expected (?:one|at least one) argument", message)
    if given is None:
        return []
    names = given.group(1).split("/")
    for action in actions:
        if action.choices and set(names) & set(action.option_strings):
            return [f"{names[0]}: valid values are {', '.join(map(str, action.choices))}"]
    return []
