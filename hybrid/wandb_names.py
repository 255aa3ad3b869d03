"""``--wandb-project`` / ``--wandb-entity`` checked before training, not found bad after it.

wandb refuses an invalid name only inside ``wandb.init``, where the metrics path catches the
failure and goes on untracked with a warning (after the process groups, model and data are
built). So the names are checked up front:

* **locally, in every mode** (:func:`check_names`, part of the config validation, before any
  process group): the wandb SDK's own rule for a project name (at most 128 characters, none of
  ``/ \\ # ? % :``; ``wandb.sdk.wandb_settings.Settings.validate_project``), applied to the
  entity too (both form the path ``entity/project`` of every run URL), and neither empty nor
  blank;
* **online only** (:func:`check_entity_online`, global rank 0 before the process groups start,
  when :func:`hybrid.metrics.wandb_mode` is ``online``): the entity must be the logged-in user
  or one of its teams, asked from the W&B API (one GraphQL request, bounded by
  ``--wandb-init-timeout``). When the server cannot be reached the check is skipped and the run
  logs offline as before. A project needs no online check: ``wandb.init`` creates a missing one.

Offline (no credentials, or ``WANDB_MODE=offline``) only the local rule applies: a wrong
entity is found when the offline run is uploaded with ``wandb sync``.
"""

from __future__ import annotations

from hybrid.config_fields import ConfigError

FORBIDDEN = "/\\#?%:"
"""Characters the wandb SDK refuses in a project name."""
MAX_LENGTH = 128


def name_problem(value: str) -> str | None:
    """Why ``value`` is not a valid wandb project/entity name; None when it is."""
    if not value.strip():
        return "must not be empty or blank"
    if len(value) > MAX_LENGTH:
        return f"is {len(value)} characters long; wandb allows at most {MAX_LENGTH}"
    bad = sorted({c for c in value if c in FORBIDDEN})
    if bad:
        return (f"contains {' '.join(repr(c) for c in bad)}; wandb names cannot contain any of "
                f"{' '.join(repr(c) for c in FORBIDDEN)}")
    return None


def check_names(project: str | None, entity: str | None) -> None:
    """The local rule (every mode).

    Raises:
        ConfigError: naming the flag, the value and the rule; also an entity without a project
            (wandb is off without ``--wandb-project``).
    """
    for flag, value in (("--wandb-project", project), ("--wandb-entity", entity)):
        if value is not None and (why := name_problem(value)):
            raise ConfigError(f"{flag} {value!r} {why} (use letters, digits, '-', '_' or '.')")
    if entity is not None and project is None:
        raise ConfigError(f"--wandb-entity {entity!r} without --wandb-project: wandb is off "
                          "unless --wandb-project names a project")


def check_entity_online(entity: str | None, timeout_s: float) -> str | None:
    """The online rule: refuse an entity that is neither the logged-in user nor one of its
    teams. Returns a note when the check could not be made (server unreachable), else None.

    Raises:
        ConfigError: the entity is not the user's, naming the entities the user has.
    """
    if entity is None:
        return None
    try:
        import wandb

        viewer = wandb.Api(timeout=max(1, int(timeout_s))).viewer
        mine = [e for e in (getattr(viewer, "entity", None), getattr(viewer, "username", None))
                if e] + list(viewer.teams)
    except Exception as e:  # no network, server down, bad key: wandb.init decides later
        return f"could not ask W&B whether --wandb-entity {entity!r} exists ({e})"
    if entity not in mine:
        raise ConfigError(f"--wandb-entity {entity!r} is neither your W&B user nor one of your "
                          f"teams (yours: {', '.join(dict.fromkeys(mine)) or 'none'}); runs "
                          "there would be refused by the server")
    return None


def preflight(project: str | None, entity: str | None, timeout_s: float) -> None:
    """Global rank 0, before the process groups: the online rule when wandb will run online
    (prints a warning when the server could not be asked).

    Raises:
        ConfigError: see :func:`check_entity_online`.
    """
    import sys

    from hybrid.metrics import wandb_mode

    if project is None or wandb_mode() != "online":
        return
    note = check_entity_online(entity, timeout_s)
    if note:
        print(f"warning: {note}; wandb.init will decide", file=sys.stderr, flush=True)
