"""An :func:`hybrid.config_fields.arg` field as an argparse flag, for every command line.

``hybrid.pretrain`` (:mod:`hybrid.job.cli`) turns every field of its config tree into a flag with
:func:`add_field`; ``hybrid.plan`` (:mod:`hybrid.planner.cli_args`, :mod:`hybrid.model_flags`)
turns the fields it shares with it (the ZeRO, grid, batch, model and device settings) into its
flags with the same function, so a shared flag has one declaration: its name, help, type,
choices and aliases come from the field, and the planner changes only what searching means
(:func:`add_field`'s keywords). Each flag's action carries its field (``action.field``): a test
proves through it that the two commands declare each shared flag once.

Rules: a field ``num_layers`` is ``--num-layers`` unless it names its Megatron-LM flag; booleans
get ``--flag`` / ``--no-flag`` (a field named ``no_...`` only ``--no-...``); alias flags set the
field to a constant (``--bf16`` sets ``precision``), and an alias with the field's own flag or
another alias of another value conflicts (:class:`Alias`, :func:`check_aliases`). Defaults stay
out of the namespace (``argparse.SUPPRESS``), so that an alias conflicts only with what the
command line gave; ``hybrid.plan`` fills them afterwards (:func:`fill_defaults`),
``hybrid.pretrain`` takes only what was given (its sections keep their own defaults).
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


_NO_DEFAULT = object()


def add_field(group, f: dataclasses.Field, *, flags: tuple[str, ...] = (),
              default=_NO_DEFAULT, negation: str | None = None, **override
              ) -> list[argparse.Action]:
    """Add field ``f``'s flag (and its alternative and alias flags) to ``group`` (a parser or an
    argument group) with no default in the namespace (``argparse.SUPPRESS``); returns the
    actions, each carrying ``field`` and ``field_default`` (:func:`fill_defaults`).

    What a command may change of the field's declaration (``hybrid.plan`` where it searches):
        flags: more option strings, before the field's (``--tp`` before
            ``--tensor-model-parallel-size``).
        default: the command's default instead of the field's (None: searched).
        negation: a boolean's ``--no-`` flag as its own action with this help, exclusive with
            the flag (the default None: ``--flag`` / ``--no-flag`` is one action).
        override: ``argparse.add_argument`` keywords over the field's (``dest``, ``help``,
            ``action="append"``, ``type``, ``metavar``).
    """
    kind = base_type(annotation(f))
    names = (*flags, flag_of(f), *f.metadata.get("alt_flags", ()))  # --layernorm-epsilon
    kw = dict(dest=key_of(f), help=field_help(f), default=argparse.SUPPRESS)
    if kind is bool and f.name.startswith("no_"):  # --no-load-optim: no --no-no-load-optim
        names, kw["action"] = (*flags, flag_of(f)), "store_true"
    elif kind is bool and negation is None:
        kw["action"] = argparse.BooleanOptionalAction
    elif kind is not bool:
        kw.update(type=kind, **{k: v for k, v in f.metadata.items()
                                if k not in ("help", "flag", "aliases", "alt_flags")})
    kw.update(override)
    if kind is bool and negation is not None:
        group = group.add_mutually_exclusive_group()
        kw.update(action="store_const", const=True)
        actions = [group.add_argument(*names, **kw),
                   group.add_argument("--no-" + flag_of(f)[2:], **{
                       **kw, "const": False, "help": negation})]
    else:
        actions = [group.add_argument(*names, **kw)]
    for alias, const in f.metadata.get("aliases", {}).items():
        actions.append(group.add_argument(alias, dest=kw["dest"], action=Alias, const=const,
                                          main_flag=flag_of(f), default=argparse.SUPPRESS,
                                          help=f"same as {flag_of(f)} {const}"))
    for action in actions:
        action.field = f
        action.field_default = default_of(f) if default is _NO_DEFAULT else default
    return actions


def fill_defaults(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Give every field flag of ``parser`` that the command line left out its default
    (``action.field_default``: the command's, else the field's), for a command whose flags each
    keep a value (``hybrid.plan``; ``hybrid.pretrain`` takes only the given ones)."""
    for action in parser._actions:
        if hasattr(action, "field_default") and not hasattr(ns, action.dest):
            setattr(ns, action.dest, action.field_default)


def field_argv(f: dataclasses.Field, value) -> list[str]:
    """The flags that set field ``f`` to ``value`` on a generated command line: ``[]`` for None,
    ``--flag`` / ``--no-flag`` for a boolean, else ``--flag VALUE`` (a list: its items)."""
    if value is None:
        return []
    if isinstance(value, bool):
        if f.name.startswith("no_"):
            return [flag_of(f)] if value else []
        return [flag_of(f) if value else "--no-" + flag_of(f)[2:]]
    return [flag_of(f), *map(str, value if isinstance(value, list) else [value])]


def section_argv(section, always: tuple[str, ...] = ()) -> list[str]:
    """The flags that give config section ``section`` (a dataclass instance of ``arg()`` fields)
    its values on a generated command line: every field whose value is not its default, and the
    fields named in ``always`` (:func:`field_argv`)."""
    out = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if f.name in always or value != default_of(f):
            out += field_argv(f, value)
    return out
