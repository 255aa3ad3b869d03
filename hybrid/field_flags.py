"""An :func:`hybrid.config_fields.arg` field as an argparse flag.

``hybrid.pretrain`` (:mod:`hybrid.job.cli`) turns every field of its config tree into a flag with
:func:`add_field`: its name, help, type, choices and aliases come from the field, and each flag's
action carries its field (``action.field``).

Rules: a field ``num_layers`` is ``--num-layers`` unless it names its Megatron-LM flag; booleans
get ``--flag`` / ``--no-flag`` (a field named ``no_...`` only ``--no-...``); alias flags set the
field to a constant (``--bf16`` sets ``precision``), and an alias with the field's own flag or
another alias of another value conflicts (:class:`Alias`, :func:`check_aliases`). Defaults stay
out of the namespace (``argparse.SUPPRESS``), so that an alias conflicts only with what the
command line gave (``hybrid.pretrain``'s sections keep their own defaults).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from hybrid.config_fields import ConfigError, flag_of


def annotation(f: dataclasses.Field):
    """The type annotation of field ``f`` (ours are strings under postponed evaluation:
    ``"int | None"``, ``"list[str]"``)."""
    return eval(f.type, {"list": list}) if isinstance(f.type, str) else f.type


def is_list(f: dataclasses.Field) -> bool:
    """A list field, optional or not (``list[str]``, ``list[str] | None``)."""
    a = annotation(f)
    return typing.get_origin(a) is list or any(typing.get_origin(x) is list
                                               for x in typing.get_args(a))


def base_type(annotation) -> type:
    """The scalar type of an annotation: ``int`` of ``int | None``, ``str`` of ``list[str]``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return base_type(args[0])
    if typing.get_origin(annotation) is list:
        return (typing.get_args(annotation) or (str,))[0]
    return annotation


def key_of(f: dataclasses.Field) -> str:
    """The flat name of a field: its flag without dashes (``zero_stage`` for ``zero.stage``),
    the ``dest`` of its flag."""
    return flag_of(f)[2:].replace("-", "_")


def default_of(f: dataclasses.Field):
    """The default value of field ``f`` (a fresh list for a list field)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


class Alias(argparse.Action):
    """``--bf16``-style flag: sets the field to a constant; another alias or the field's own
    flag (``--precision``) with a different value conflicts, in either order (see
    :func:`check_aliases`).

    Raises:
        ConfigError: naming both flags.
    """

    def __init__(self, option_strings, dest, const, main_flag: str = "", **kwargs):
        super().__init__(option_strings, dest, nargs=0, const=const, **kwargs)
        self.main_flag = main_flag

    def __call__(self, parser, namespace, values, option_string=None):
        set_by = namespace.__dict__.setdefault("_set_by", {})
        if hasattr(namespace, self.dest) and getattr(namespace, self.dest) != self.const:
            given = f"{self.main_flag} {getattr(namespace, self.dest)}"
            previous = set_by.get(self.dest, (given, None))[0]
            raise ConfigError(f"{previous} and {option_string} are mutually exclusive")
        set_by[self.dest] = (option_string, self.const, self.main_flag)
        setattr(namespace, self.dest, self.const)


def check_aliases(ns: dict) -> None:
    """An alias flag followed by its field's own flag with another value (``--fp16 --precision
    bf16``) conflicts as the other order does; ``ns`` is the parsed namespace's ``vars``, from
    which the aliases' record is removed.

    Raises:
        ConfigError: naming both flags.
    """
    for dest, (alias, const, main_flag) in ns.pop("_set_by", {}).items():
        if ns.get(dest) != const:
            raise ConfigError(f"{alias} and {main_flag} {ns[dest]} are mutually exclusive")


def field_help(f: dataclasses.Field) -> str:
    """The field's one-line help with its default, ``(default: 50000000)``, unless it says its
    default itself."""
    text = f.metadata["help"]
    return text if "default" in text else f"{text} (default: {default_of(f)!r})"


def add_field(group, f: dataclasses.Field) -> list[argparse.Action]:
    """Add field ``f``'s flag (and its alternative and alias flags) to ``group`` (a parser or an
    argument group) with no default in the namespace (``argparse.SUPPRESS``); returns the
    actions, each carrying ``field``."""
    kind = base_type(annotation(f))
    meta = {k: v for k, v in f.metadata.items()
            if k not in ("help", "flag", "aliases", "alt_flags")}
    flags = (flag_of(f), *f.metadata.get("alt_flags", ()))  # --norm-epsilon, --layernorm-...
    key, help_ = key_of(f), field_help(f)
    if kind is bool and f.name.startswith("no_"):  # --no-load-optim: no --no-no-load-optim
        actions = [group.add_argument(flag_of(f), dest=key, action="store_true", help=help_,
                                      default=argparse.SUPPRESS)]
    elif kind is bool:
        actions = [group.add_argument(*flags, dest=key, action=argparse.BooleanOptionalAction,
                                      help=help_, default=argparse.SUPPRESS)]
    else:
        actions = [group.add_argument(*flags, dest=key, type=kind, help=help_,
                                      default=argparse.SUPPRESS, **meta)]
    for alias, const in f.metadata.get("aliases", {}).items():
        actions.append(group.add_argument(alias, dest=key, action=Alias, const=const,
                                          main_flag=flag_of(f), default=argparse.SUPPRESS,
                                          help=f"same as {flag_of(f)} {const}"))
    for action in actions:
        action.field = f
    return actions
