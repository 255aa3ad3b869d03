"""Command line of the pretraining job, generated from :class:`hybrid.config.PretrainConfig`.

Each leaf field ``name`` becomes ``--name-with-dashes`` (Megatron-LM's flag names); booleans
get ``--flag`` / ``--no-flag``. ``--config FILE`` (YAML or TOML) supplies the same fields,
either flat (``num_layers: 12`` or ``num-layers: 12``) or by section (``model: {num_layers: 12}``);
flags on the command line win over the file, the file over the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path

import tomllib

from hybrid.config import PretrainConfig
from hybrid.config_checks import ConfigError


def _annotation(f: dataclasses.Field):
    # Our own annotations ("int | None", "list[str]") are strings under postponed evaluation.
    return eval(f.type, {"list": list}) if isinstance(f.type, str) else f.type


def _is_list(f: dataclasses.Field) -> bool:
    return typing.get_origin(_annotation(f)) is list


def _base_type(annotation) -> type:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return _base_type(args[0])
    if typing.get_origin(annotation) is list:
        return str
    return annotation


class _Parser(argparse.ArgumentParser):
    """Raises :class:`ConfigError` (one short line, printed once per node by ``main``) instead
    of printing the whole usage on every rank, and names the closest valid flag."""

    def error(self, message: str):
        import difflib
        import re

        flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        hints = []
        for bad in re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", message.split(":", 1)[-1]):
            if bad in flags:
                continue
            close = difflib.get_close_matches(bad.split("=")[0], flags, n=1, cutoff=0.5)
            if close:
                hints.append(f"{bad}: did you mean {close[0]}?")
        raise ConfigError("; ".join([message, *hints]) + " (see --help)")


def build_parser() -> argparse.ArgumentParser:
    """The ``hybrid.pretrain`` argument parser (all defaults suppressed; see :func:`parse_config`).

    Flags are never abbreviated (``--zero 3`` is an error, not ``--zero-stage 3``); a bad flag
    raises :class:`ConfigError` naming the closest valid one.
    """
    parser = _Parser(
        prog="hybrid-pretrain",
        description="GPT pretraining with tensor parallelism x ZeRO data parallelism.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument("--config", help="YAML or TOML file with the same fields as the flags")
    cfg = PretrainConfig()
    groups = {s: parser.add_argument_group(s) for s in cfg.SECTIONS}
    for section, f in cfg.flat_fields():
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(_annotation(f))
        meta = dict(f.metadata)
        help_ = meta.pop("help")
        aliases = meta.pop("aliases", ())
        if "default" not in help_:
            help_ += f" (default: {_default(f)!r})"
        if kind is bool and f.name.startswith("no_"):  # --no-load-optim: no --no-no-load-optim
            groups[section].add_argument(flag, dest=f.name, action="store_true", help=help_)
        elif kind is bool:
            groups[section].add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=help_)
        else:
            groups[section].add_argument(flag, dest=f.name, type=kind, help=help_, **meta)
        for alias in aliases:  # another spelling of the flag (Megatron-LM's), same field
            groups[section].add_argument(alias, dest=f.name, action="store_true" if kind is bool else "store",
                                         **({} if kind is bool else dict(type=kind)), help=f"same as {flag}")
    return parser


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def load_config_file(path: str) -> dict:
    """Flat ``{field_name: value}`` from a YAML (.yaml/.yml) or TOML (.toml) file.

    Raises:
        ConfigError: missing file, unknown suffix, unparsable content, or an unknown field
            (the message lists the valid names).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: file not found")
    try:
        if p.suffix == ".toml":
            raw = tomllib.loads(p.read_text())
        elif p.suffix in (".yaml", ".yml"):
            import yaml

            raw = yaml.safe_load(p.read_text()) or {}
        else:
            raise ConfigError(f"--config {path}: use a .yaml, .yml or .toml file")
    except (tomllib.TOMLDecodeError, ValueError) as e:
        raise ConfigError(f"--config {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping of field names to values")
    cfg = PretrainConfig()
    valid = {f.name: s for s, f in cfg.flat_fields()}
    flat: dict = {}
    for key, value in raw.items():
        key = key.replace("-", "_")
        if key in cfg.SECTIONS and isinstance(value, dict):
            for k, v in value.items():
                flat[k.replace("-", "_")] = v
        else:
            flat[key] = value
    unknown = sorted(set(flat) - set(valid))
    if unknown:
        raise ConfigError(f"--config {path}: unknown fields {unknown}; valid fields: {sorted(valid)}")
    return flat


def parse_config(argv: list[str] | None = None) -> PretrainConfig:
    """Parse ``argv`` (and its ``--config`` file) into a :class:`PretrainConfig`.

    Raises:
        ConfigError: a bad config file, an unknown or malformed flag (the message names the
            closest valid flag). ``--help`` prints the usage and exits 0.
    """
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    values = load_config_file(ns.pop("config")) if "config" in ns else {}
    values.update(ns)
    cfg = PretrainConfig()
    for section, f in cfg.flat_fields():
        if f.name in values:
            value = _coerce(f, values[f.name])
            setattr(getattr(cfg, section), f.name, value)
    return cfg


def _coerce(f: dataclasses.Field, value):
    """Give a config-file value the field's type (YAML reads ``3e-4`` as a string)."""
    if _is_list(f):
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"{f.name}: expected a list, got {value!r}")
        return [str(v) for v in items]
    if value is None or isinstance(value, bool):
        return value
    kind = _base_type(_annotation(f))
    if isinstance(value, list | dict):
        raise ConfigError(f"{f.name}: expected one {kind.__name__}, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{f.name}: {value!r} is not a valid {kind.__name__}") from None


def config_json(cfg: PretrainConfig) -> str:
    """The resolved config as indented JSON (printed at start, stored with runs)."""
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=False, default=str)
