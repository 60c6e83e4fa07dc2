"""Rank extensions: one instance per class per rank keeping its state across calls, group.on(cls)
on the in-process group and on two spawned ranks (gloo), closing with the group, one-line
refusals for a method the driver may not call, and workers/ importing none of the packages whose
extensions it runs; every group implementing the WorkerGroup protocol."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ster_dist.errors import Refusal
from ster_dist.workers.extension import RankExtension, describe
from ster_dist.workers.group import LocalGroup
from ster_dist.workers.rank import Rank
from ster_dist.workers.spawn import SpawnGroup


class Tally(RankExtension):
    """Keeps a running total on its rank; closing writes the total to `closed_to`, when one was
    set."""

    def __init__(self, rank):
        super().__init__(rank)
        self.total = 0
        self.closed_to: str | None = None
        self.closed = False

    def add(self, n: int) -> int:
        self.total += n
        return self.total

    def where(self) -> tuple[int, int]:
        return self.rank.rank, os.getpid()

    def summed_over_ranks(self) -> int:
        """The totals of every rank, summed on the real process group: the extension runs inside
        it."""
        value = torch.tensor([self.total])
        if dist.is_initialized():
            dist.all_reduce(value)
        return int(value)

    def report_close_to(self, directory: str) -> None:
        self.closed_to = os.path.join(directory, f"rank{self.rank.rank}")

    def close(self) -> None:
        self.closed = True
        if self.closed_to is not None:
            Path(self.closed_to).write_text(str(self.total))


class Other(RankExtension):
    def total_of_tally(self) -> int:
        return self.rank.extension(Tally).total


def test_one_instance_per_class_per_rank_keeps_its_state():
    with LocalGroup() as group:
        assert group.on(Tally).add(2) == [2]
        assert group.on(Tally).add(3) == [5]
        rank = group.rank
        assert rank.extension(Tally) is rank.extension(Tally)
        # another extension reaches the same instance
        assert group.on(Other).total_of_tally() == [5]
        assert Rank(0, 1).extension(Tally).total == 0  # another rank has its own


def test_closing_the_group_closes_its_extensions():
    group = LocalGroup()
    group.on(Tally).add(1)
    tally = group.rank.extension(Tally)
    group.close()
    assert tally.closed
    assert group.rank.extension(Tally) is not tally  # a closed rank forgot it


def test_a_method_the_driver_may_not_call_is_refused_in_one_line():
    with LocalGroup() as group:
        for method in ("nope", "close", "_private"):
            with pytest.raises(
                Refusal,
                match=f"^rank extension Tally has no method '{method}' the driver can call$",
            ):
                getattr(group.on(Tally), method)()
        with pytest.raises(Refusal, match="is not a RankExtension class"):
            group.on(dict)
        # the rank refuses alike when called directly (not through group.on)
        with pytest.raises(Refusal, match="^rank extension Tally has no method 'nope'"):
            group.rank.call_extension(Tally, "nope")
    # how groups name it in errors
    assert describe("call_extension", (Tally, "add", 1)) == "Tally.add"
    assert describe("generate", ()) == "generate"


def test_two_spawned_ranks_each_keep_their_own_extension(tmp_path):
    with SpawnGroup(2) as group:
        assert group.on(Tally).add(2) == [2, 2]
        assert group.on(Tally).add(3) == [5, 5]
        where = group.on(Tally).where()
        assert [r for r, _ in where] == [0, 1] and where[0][1] != where[1][1] != os.getpid()
        assert group.on(Tally).summed_over_ranks() == [10, 10]
        with pytest.raises(Refusal, match="^rank extension Tally has no method 'nope'"):
            group.on(Tally).nope()  # refused on the driver: the group stays usable
        group.on(Tally).report_close_to(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    assert (tmp_path / "rank1").read_text() == "5"


def test_workers_import_none_of_the_packages_above_them():
    above = ("steer", "adapters", "tune", "decide", "sched", "commands", "jobs", "moe")
    workers = Path(__file__).resolve().parents[2] / "ster_dist" / "workers"
    for path in workers.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert not name.startswith(tuple(f"ster_dist.{p}" for p in above)), (
                    f"{path.name} imports {name}"
                )


def test_every_group_implements_the_worker_group_protocol_itself():
    """The three groups subclass WorkerGroup so a reader sees the seam; a method one of them lacked
    would be the Protocol's empty stub, answering None, so each must define every method of its
    own."""
    from ster_dist.workers.ray_group import RayGroup
    from ster_dist.workers.worker_group import WorkerGroup

    methods = [
        name
        for name in vars(WorkerGroup)
        if not name.startswith("_") and callable(vars(WorkerGroup)[name])
    ]
    assert set(methods) == {"call", "submit", "collect", "on", "close"}
    for group in (LocalGroup, SpawnGroup, RayGroup):
        assert [m for m in methods if m not in vars(group)] == [], group.__name__
    with LocalGroup() as local:
        assert isinstance(local, WorkerGroup) and local.lead == 0
