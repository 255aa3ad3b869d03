"""wandb names checked before training (issue 27, kind 10): an invalid project or entity is
refused before any process group starts (locally, by the wandb SDK's own rule), and online an
entity that is not the user's; offline only the local rule applies."""

from __future__ import annotations

import pytest
import wandb

from hybrid.config_fields import ConfigError
from hybrid.job.cli import parse_config
from hybrid.pretrain import pretrain as main
from hybrid.wandb_names import check_entity_online, check_names, preflight

BAD = ["team/run", "a:b", "50%", "what?", "#1", "back\\slash", "x" * 129, "", "  "]
GOOD = ["gpt-355m", "my_project.v2", "Runs 2026", "x" * 128]


def sdk_accepts(project: str) -> bool:
    try:
        wandb.Settings(project=project)
    except Exception:
        return False
    return True


def test_local_rule_is_the_sdks_and_refuses_before_training(capsys):
    for name in BAD:
        with pytest.raises(ConfigError, match="--wandb-project"):
            check_names(name, None)
        with pytest.raises(ConfigError, match="--wandb-entity"):
            check_names("ok", name)
    for name in GOOD:
        check_names(name, name)
    # the SDK agrees wherever it has a rule (it accepts blank names, which no server does)
    assert all(not sdk_accepts(n) for n in BAD if n.strip())
    assert all(sdk_accepts(n) for n in GOOD)
    with pytest.raises(ConfigError, match=r"--wandb-project 'team/run' contains '/'"):
        parse_config(["--mock-data", "--vocab-size", "64", "--wandb-project", "team/run"])
    with pytest.raises(ConfigError, match="without --wandb-project"):
        parse_config(["--mock-data", "--vocab-size", "64", "--wandb-entity", "lab"])
    assert main(["--mock-data", "--vocab-size", "64", "--wandb-project", "a:b"]) == 2
    err = capsys.readouterr().err
    assert "--wandb-project 'a:b' contains ':'" in err and "iteration" not in err


class Viewer:
    entity, username, teams = "alice", "alice", ["lab", "ops"]


def test_online_entity_must_be_the_users(monkeypatch, capsys):
    calls = []

    class Api:
        def __init__(self, timeout):
            calls.append(timeout)
            self.viewer = Viewer()

    monkeypatch.setattr(wandb, "Api", Api)
    assert check_entity_online("lab", 30.0) is None and check_entity_online("alice", 5) is None
    with pytest.raises(ConfigError, match=r"'bob' is neither .* \(yours: alice, lab, ops\)"):
        check_entity_online("bob", 30.0)
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(ConfigError, match="'bob'"):
        preflight("p", "bob", 30.0)
    monkeypatch.setenv("WANDB_MODE", "offline")  # offline: no request, no refusal
    n = len(calls)
    preflight("p", "bob", 30.0)
    assert len(calls) == n and calls[0] == 30

    class Down:
        def __init__(self, timeout):
            raise ConnectionError("no route to host")

    monkeypatch.setattr(wandb, "Api", Down)
    assert "no route to host" in check_entity_online("bob", 3.0)
    monkeypatch.setenv("WANDB_MODE", "online")
    preflight("p", "bob", 3.0)  # unreachable: the run starts and logs offline, as before
    assert "could not ask W&B" in capsys.readouterr().err
