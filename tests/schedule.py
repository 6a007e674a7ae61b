"""The order the session runs its test modules in: a serving module once its server answers.

A serving test module (``SERVER = ServerSpec(...)``: tests/deployments/shared_servers.py) waits
~35 s for `serve run` to start, a start that keeps the 2-core CI machine busy while most other
modules' tests use one core. So `run` (the session's ``pytest_runtestloop``) keeps the collected
order except for the serving modules: the next serving module's server starts in the background
while the modules after it run, and the serving module runs at the first module boundary after
its server answers (or when no other module is left). A server starts only at the start of a
module that serves nothing, one at a time, and only while no ``tests.prestart`` run is going.
A serving module, or one that says it ``RUNS_ALONE`` (it starts a Ray cluster of its own, whose
raylet must register within 30 s), never runs beside a server start, and no prestart run starts
while it runs (some of its tests time what they serve). Each module still runs whole, its tests
in their order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def _modules(items) -> list[list]:
    """The items in runs of one module each, in collection order."""
    groups: list[list] = []
    last = object()
    for item in items:
        key = getattr(item, "module", None) or item.path
        if groups and key == last:
            groups[-1].append(item)
        else:
            groups.append([item])
        last = key
    return groups


@dataclass
class Servers:
    """What `run` needs to know of the servers: a group's spec (None: it serves nothing), whether a spec's
    server was started / answers, how to start one, and whether the machine is free for a start."""

    spec_of: Callable[[list], object]
    alone: Callable[[list], bool]
    started: Callable[[object], bool]
    ready: Callable[[object], bool]
    start: Callable[[object], None]
    may_start: Callable[[], bool]
    hold_runs: Callable[[bool], None]


def run(session, servers: Servers) -> bool:
    """pytest's run loop in the order described above (``nextitem`` is the item that really runs next,
    so that module fixtures are torn down where their module ends)."""
    groups = _modules(session.items)
    serving = [g for g in groups if servers.spec_of(g) is not None]
    others = [g for g in groups if servers.spec_of(g) is None]

    def choose() -> list | None:
        if serving and (servers.ready(servers.spec_of(serving[0])) or not others):
            return serving.pop(0)
        if serving and servers.started(servers.spec_of(serving[0])):  # starting: only modules that do not mind
            beside = next((g for g in others if not servers.alone(g)), None)
            if beside is None:
                return serving.pop(0)
            others.remove(beside)
            return beside
        return others.pop(0) if others else None

    group = choose()
    while group is not None:
        spec = servers.spec_of(group)
        quiet = spec is not None or servers.alone(group)
        servers.hold_runs(quiet)
        if not quiet and serving:
            upcoming = servers.spec_of(serving[0])
            if not servers.started(upcoming) and servers.may_start():
                servers.start(upcoming)
        following = None
        for i, item in enumerate(group):
            if i == len(group) - 1:
                following = choose()  # decided before the module's last test: its fixtures' teardown needs it
            nextitem = group[i + 1] if i + 1 < len(group) else (following[0] if following else None)
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        group = following
    servers.hold_runs(False)
    return True
