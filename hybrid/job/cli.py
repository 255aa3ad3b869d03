"""Command line of the pretraining job, generated from :class:`hybrid.config.PretrainConfig`.

Each leaf field becomes its flag (``--name-with-dashes``, or the Megatron-LM name the field
declares, e.g. ``zero.stage`` is ``--zero-stage``); booleans get ``--flag`` / ``--no-flag``;
alias flags set a field to a constant (``--bf16`` / ``--fp16`` set ``zero.precision``).
``--config FILE`` (YAML or TOML) supplies the same fields, either flat by flag name
(``num_layers: 12``, ``num-layers: 12``, ``zero_stage: 3``, ``bf16: true``) or by section
(``model: {num_layers: 12}``, ``zero: {stage: 3}``); flags on the command line win over the file,
the file over the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import tomllib

from hybrid.config import PretrainConfig
from hybrid.config_fields import ConfigError, choices_hints, flag_hints, flag_of
from hybrid.field_flags import (
    add_field,
    annotation,
    base_type,
    check_aliases,
    is_list,
    key_of,
)

# torchrun's options that make hybrid-pretrain a launcher (hybrid.job.launch): flag -> has a value
LAUNCH_OPTIONS = {
    "--nproc-per-node": True, "--nnodes": True, "--node-rank": True, "--master-addr": True,
    "--master-port": True, "--rdzv-backend": True, "--rdzv-endpoint": True, "--rdzv-id": True,
    "--max-restarts": True, "--standalone": False,
}


class _ListPresets(argparse.Action):
    """``--list-presets``: print every preset's shape and parameter count, then exit 0."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from models.presets import preset_table

        print(preset_table())
        parser.exit(0)


class _Parser(argparse.ArgumentParser):
    """Raises :class:`ConfigError` (one short line, printed once per node by ``main``) instead
    of printing the whole usage on every rank, and names the closest valid flag, or the valid
    values of a flag given without one."""

    def error(self, message: str):
        flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        hints = [*flag_hints(message, flags), *choices_hints(message, self._actions)]
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
    parser.add_argument("--list-presets", action=_ListPresets,
                        help="print every --preset with its layers, hidden size, heads (/ K/V "
                        "heads) and parameters, then exit")
    _add_launch_options(parser)
    groups = {s: parser.add_argument_group(s, " ".join(kind.__doc__.split("\n\n")[0].split()))
              for s, kind in PretrainConfig.sections().items()}
    for section, f in PretrainConfig.flat_fields():
        add_field(groups[section], f)
    from hybrid.job.megatron_flags import add_help_group

    add_help_group(parser)
    return parser


def _add_launch_options(parser: argparse.ArgumentParser) -> None:
    """torchrun's options that make ``hybrid-pretrain`` a launcher (:mod:`hybrid.job.launch`
    takes them out of the flags before parsing; listed here for ``--help``)."""
    g = parser.add_argument_group(
        "launch", "hybrid-pretrain --nproc-per-node N [...]: check the flags once in this process, "
        "then start torchrun with these options; SIGTERM/SIGINT reach the workers, which save "
        "and exit 0, whatever torchrun's shutdown timeout")
    for flag, takes_value in LAUNCH_OPTIONS.items():
        kind = {"metavar": flag[2:].upper()} if takes_value else {"action": "store_true"}
        g.add_argument(flag, dest=f"launch_{flag[2:]}", help=f"torchrun's {flag}", **kind)


def _file_keys() -> dict[str, tuple[str, dataclasses.Field]]:
    return {key_of(f): (s, f) for s, f in PretrainConfig.flat_fields()}


def _alt_keys() -> dict[str, str]:
    """``{alternative flag's flat name: its field's flat name}`` (``layernorm_epsilon``)."""
    return {a[2:].replace("-", "_"): key_of(f) for _, f in PretrainConfig.flat_fields()
            for a in f.metadata.get("alt_flags", ())}


def load_config_file(path: str) -> dict:
    """Flat ``{flat field name: value}`` from a YAML (.yaml/.yml) or TOML (.toml) file.

    Raises:
        ConfigError: missing file, unknown suffix, unparsable content, or an unknown field or
            section (the message lists the valid names).
    """
    keys, aliases, alt = _file_keys(), _alias_keys(), _alt_keys()
    flat, unknown, sections = {}, [], []
    for key, value in _entries(_read_config_file(path)):
        key = alt.get(key, key)
        if key in aliases:
            target, const = aliases[key]
            if value:
                flat[target] = const
        elif key in keys:
            flat[key] = value
        else:
            (sections if isinstance(value, dict) else unknown).append(key)
    if sections:
        s = "s" if len(sections) > 1 else ""
        raise ConfigError(f"--config {path}: unknown section{s} {', '.join(sorted(sections))} (the "
                          f"sections are {', '.join(PretrainConfig.sections())}; fields can also "
                          "be given by flag name at the top level)")
    if unknown:
        raise ConfigError(_unknown_fields(path, unknown, sorted(set(keys) | set(aliases))))
    return flat


def _entries(raw: dict):
    """``(flat name, value)`` for each entry of a config file's mapping: a section's entries
    (``zero: {stage: 3}``) by their field name or their flat name, the others by flat name."""
    sections = PretrainConfig.sections()
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in sections and isinstance(value, dict):
            by_name = {f.name: key_of(f) for f in dataclasses.fields(sections[name])}
            for k, v in value.items():
                k = k.replace("-", "_")
                yield by_name.get(k, k), v
        else:
            yield name, value


def _read_config_file(path: str) -> dict:
    """The file's mapping as parsed (YAML or TOML by suffix), before any field is checked."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: file not found")
    try:
        if p.suffix == ".toml":
            raw = tomllib.loads(p.read_text())
        elif p.suffix in (".yaml", ".yml"):
            raw = _read_yaml(p, path)
        else:
            raise ConfigError(f"--config {path}: use a .yaml, .yml or .toml file")
    except (tomllib.TOMLDecodeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"--config {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping of field names to values")
    return raw


def _read_yaml(p: Path, path: str):
    import yaml

    try:
        return yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:  # e.g. a bad indent: "mapping values are not allowed here"
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"--config {path}: not valid YAML{where}: "
                          f"{getattr(e, 'problem', None) or e}") from None


def _alias_keys() -> dict[str, tuple[str, object]]:
    """``{alias flag's flat name: (its field's flat name, the value it sets)}`` (``bf16``)."""
    return {a[2:].replace("-", "_"): (key_of(f), c) for _, f in PretrainConfig.flat_fields()
            for a, c in f.metadata.get("aliases", {}).items()}


def _unknown_fields(path: str, unknown: list[str], valid: list[str]) -> str:
    """The error for unknown fields: each with the closest ``valid`` name, if any."""
    import difflib

    hints = [f"{k} (did you mean {close[0]}?)"
             if (close := difflib.get_close_matches(k, valid, n=1)) else k
             for k in sorted(unknown)]
    tail = ("" if all("did you mean" in h for h in hints)
            else "; valid fields are the flag names without their leading -- (see --help)")
    s = "s" if len(hints) > 1 else ""
    return f"--config {path}: unknown field{s} {', '.join(hints)}{tail}"


def parse_config(argv: list[str] | None = None, ignored: list[str] | None = None,
                 hf_flags: list[str] | None = None, given: set[str] | None = None
                 ) -> PretrainConfig:
    """Parse ``argv`` (and its ``--config`` file) into a :class:`PretrainConfig`.

    Megatron-LM flags without a field here are answered first
    (:func:`hybrid.job.megatron_flags.translate`); those accepted without effect are appended
    to ``ignored`` when given. ``given`` (when given) receives the flat name of every field set
    by a flag or the file (``zero_stage``), the others keeping their defaults. Every section
    validates its own fields as it is built.
    ``--init-from-hf DIR`` without ``--preset`` or shape flags takes the model flags of
    ``DIR/config.json`` before the given ones (:mod:`hybrid.hf.config_flags`); they are appended
    to ``hf_flags`` when given.

    Raises:
        ConfigError: a bad config file, two conflicting alias flags, a bad field value, or an
            unknown or malformed flag (the message names the closest valid flag), or Megatron-LM
            flags for features this trainer does not have (one line each). ``--help`` prints
            the usage and exits 0.
    """
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = _parse(argv, ignored, given)
    m = cfg.model
    if cfg.checkpoint.init_from_hf and m.preset is None and all(
            v is None for v in (m.num_layers, m.hidden_size, m.num_attention_heads)):
        from hybrid.hf.config_flags import hf_model_flags

        try:
            derived = hf_model_flags(cfg.checkpoint.init_from_hf)
        except (FileNotFoundError, ValueError) as e:
            flag = "" if str(e).startswith("--init-from-hf") else "--init-from-hf "
            raise ConfigError(flag + str(e)) from None
        if hf_flags is not None:
            hf_flags += derived
        cfg = _parse(derived + argv, None, given)
    return cfg


def _parse(argv: list[str], ignored: list[str] | None, given: set[str] | None = None
           ) -> PretrainConfig:
    from hybrid.job.megatron_flags import translate

    argv, no_ops = translate(argv)
    if ignored is not None:
        ignored += no_ops
    ns = vars(build_parser().parse_args(argv))
    check_aliases(ns)
    values = load_config_file(ns.pop("config")) if "config" in ns else {}
    values.update(ns)
    if given is not None:
        given.update(values)
    sections = {}
    for name, kind in PretrainConfig.sections().items():
        kwargs = {f.name: _coerce(f, values[key_of(f)]) for f in dataclasses.fields(kind)
                  if key_of(f) in values}
        sections[name] = kind(**kwargs)
    return PretrainConfig(**sections)


def _coerce(f: dataclasses.Field, value):
    """Give a config-file value the field's type (YAML reads ``3e-4`` as a string)."""
    if is_list(f):
        items = value.split() if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"{flag_of(f)}: expected a list, got {value!r}")
        kind = base_type(annotation(f))  # list[int]: --profile-ranks
        try:
            return [kind(v) for v in items]
        except (TypeError, ValueError):
            raise ConfigError(f"{flag_of(f)}: {value!r} is not a list of "
                              f"{kind.__name__}") from None
    if value is None or isinstance(value, bool):
        return value
    kind = base_type(annotation(f))
    if isinstance(value, list | dict):
        raise ConfigError(f"{flag_of(f)}: expected one {kind.__name__}, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag_of(f)}: {value!r} is not a valid {kind.__name__}") from None
