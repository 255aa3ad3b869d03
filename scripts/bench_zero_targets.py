"""bench_zero's verdicts: per-launch-pair ratios against the peers and the floor, their median
and min-max spread, and which targets the whole spread clears (imported by
``scripts/bench_zero.py`` and ``scripts/bench_zero_report.py``).

Launches run in rounds, every configuration once per round (ours, peer, ours, peer, ...), so
round i's ratio compares two launches made minutes apart under the same machine load. A
speed-up is the peer's ms/step over ours (above 1: we are faster); the floor ratio is our
ms/step over our compute-only floor's plus the same step's data-parallel collectives replayed
alone (1: the step costs exactly its compute plus its collectives). A target is "met" only when
every round clears it, "missed" when none does, and "within noise" otherwise.
"""

from __future__ import annotations

import statistics

TARGETS = (
    # (our configurations: "tp1" = every tp1 stage, "tp2", or a name; peer; minimum speed-up)
    ("tp1", "ddp", 1.0),
    ("tp1", "deepspeed", 1.2),
    ("hybrid_z3", "fsdp2", 1.2),
    ("tp2", "tp2d", 1.5),
)
FLOOR_TARGET = 1.05
"""Our ms/step over (floor + collectives alone) must stay at or below this in every round."""


def _ours(launches: dict) -> list[str]:
    return [n for n in launches if n.startswith("hybrid_z") and not n.endswith("_floor")]


def _pairs(launches: dict) -> list[tuple[str, str, float]]:
    """``(ours, peer, minimum speed-up)`` for every target whose configurations ran or were
    meant to (a peer that never ran still gets its row, saying why)."""
    out = []
    for which, peer, target in TARGETS:
        for name in _ours(launches):
            tp2 = "_tp" in name
            if which == "tp1" and tp2 or which == "tp2" and not tp2:
                continue
            if which not in ("tp1", "tp2") and name != which:
                continue
            out.append((name, f"deepspeed_z{name[8]}" if peer == "deepspeed" else peer, target))
    return out


def round_values(launches: dict, num: str, den: str, add_alone: bool = False) -> list[float]:
    """Per round: ``num``'s ms/step over ``den``'s, or with ``add_alone`` ``num`` over
    (``den`` + ``num``'s collectives replayed alone); rounds where either failed are left out.

    Args:
        launches: ``{config: [result of round 0 or None, result of round 1, ...]}``.
    """
    out = []
    for a, b in zip(launches.get(num, []), launches.get(den, []), strict=False):
        if a is None or b is None:
            continue
        extra = a.get("dp_collectives_alone_ms", 0.0) if add_alone else 0.0
        out.append(a["ms_step_median"] / (b["ms_step_median"] + extra))
    return out


def verdict(values: list[float], target: float, at_least: bool = True) -> str:
    """``met`` when every value clears ``target`` (``>=``, or ``<=`` with ``at_least=False``),
    ``missed`` when none does, ``within noise`` otherwise; ``no data`` for no values."""
    if not values:
        return "no data"
    ok = [v >= target if at_least else v <= target for v in values]
    return "met" if all(ok) else "missed" if not any(ok) else "within noise"


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def missed_phase(results: dict, name: str) -> str:
    """The phase our profile names for a miss: the phase most above the compute-only floor's
    (collective waits show there), else our largest phase; '-' without a profile."""
    ours = results.get(name, {}).get("profile_ms")
    if not ours:
        return "-"
    floor = results.get(name + "_floor", {}).get("profile_ms", {})
    excess = {p: ours[p] - floor.get(p, 0.0) for p in ours}
    phase = max(excess, key=excess.get)
    if floor and excess[phase] > 0.05 * sum(ours.values()):
        return f"{phase} +{excess[phase]:.0f} ms over the floor's"
    big = max(ours, key=ours.get)
    return f"{big} {ours[big]:.0f} ms of {sum(ours.values()):.0f} (compute-bound)"


def targets_table(launches: dict, results: dict, skipped: dict[str, str]) -> list[str]:
    """Markdown rows: each target with its median ratio, spread and verdict; the phase our
    profile names where it is not met; a skipped peer with its reason."""
    lines = ["| ours | against | target | median (min-max) over launch pairs | verdict | "
             "phase where not met |", "|---|---|---|---|---|---|"]
    for name, peer, target in _pairs(launches):
        if peer in skipped:
            lines.append(f"| {name} | {peer} | >= {target:.2f}x | - | skipped: "
                         f"{skipped[peer]} | - |")
            continue
        vals = [1 / v for v in round_values(launches, name, peer)]  # speed-ups
        v = verdict(vals, target)
        lines.append(f"| {name} | {peer} | >= {target:.2f}x | "
                     f"{_spread(vals) if vals else '-'} | {v} | "
                     f"{missed_phase(results, name) if v != 'met' else '-'} |")
    for name in _ours(launches):
        if name + "_floor" not in launches:
            continue
        vals = round_values(launches, name, name + "_floor", add_alone=True)
        v = verdict(vals, FLOOR_TARGET, at_least=False)
        lines.append(f"| {name} | floor + collectives alone | <= {FLOOR_TARGET:.2f}x | "
                     f"{_spread(vals) if vals else '-'} | {v} | "
                     f"{missed_phase(results, name) if v != 'met' else '-'} |")
    return lines
