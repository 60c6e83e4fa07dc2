"""Rank extensions: rank-side work that packages above the workers add without growing Rank.

An extension is a class; each rank makes one instance of it on first use and keeps it until the
rank closes, so whatever the work leaves behind (steering hooks, attached adapters, a training
run) is that instance's state, on that rank, closed with it. The driver names the class and one
of its methods:

    group.on(StandingModifiers).steer(token, vectors, strength)   # -> one result per rank

The class travels by reference (pickle and cloudpickle send its module and name, and the rank
imports it), so this module and the rest of workers/ import nothing from the packages whose
extensions they run: the arrows point down.
"""

from __future__ import annotations

from ster_dist.errors import Refusal


class RankExtension:
    """Base class: made by `Rank.extension(cls)` as cls(rank), once per class per rank."""

    def __init__(self, rank):
        self.rank = rank

    @property
    def model(self):
        """This rank's decoder; refused before a model is loaded (nothing to hook or read yet)."""
        if self.rank.loaded is None:
            raise Refusal(
                f"{type(self).__name__} was called on rank {self.rank.rank} before a model was loaded"
            )
        return self.rank.loaded.model

    def first_rank_only(self, value):
        """`value` on the group's lead rank (Rank.lead: rank 0, or the last pipeline stage's first),
        None elsewhere: for results every rank of a stage holds alike (the residual and the gathered
        logits are replicated), so only one copy travels back to the driver (group.lead_result picks
        it)."""
        return value if self.rank.lead else None

    def stage_lead_only(self, value):
        """`value` on each pipeline stage's first rank, None elsewhere: for what each stage holds of
        its own (the residual after its layers); the driver merges the stages' parts."""
        return value if self.rank.stage_lead else None

    def close(self) -> None:
        """Release what this extension holds on its rank; called once, when the rank closes."""


def check_extension(cls) -> None:
    if not (isinstance(cls, type) and issubclass(cls, RankExtension)):
        raise Refusal(f"{cls!r} is not a RankExtension class, so ranks cannot run it")


def check_method(cls: type, method: str) -> None:
    """Refuse, in one line naming both, a method the driver may not call on `cls`: an unknown name,
    a private one, or close (the rank calls that itself)."""
    check_extension(cls)
    if method.startswith("_") or method == "close" or not callable(getattr(cls, method, None)):
        raise Refusal(f"rank extension {cls.__name__} has no method {method!r} the driver can call")


def describe(method: str, args: tuple) -> str:
    """How a group names a call in its errors: 'StandingModifiers.steer' rather than
    'call_extension'."""
    if method == "call_extension" and len(args) >= 2 and isinstance(args[0], type):
        return f"{args[0].__name__}.{args[1]}"
    return method


class OnRanks:
    """`group.on(cls)`: `.method(*args)` runs cls's method on every rank of the group, in rank
    order."""

    def __init__(self, group, cls: type):
        check_extension(cls)
        self._group, self._cls = group, cls

    def __getattr__(self, method: str):
        cls = self.__dict__.get("_cls")
        # copy and pickle probing a half-made proxy for hooks
        if cls is None or method.startswith("__"):
            raise AttributeError(method)
        check_method(cls, method)  # refused here, before anything is sent to the ranks

        def call(*args) -> list:
            return self._group.call("call_extension", cls, method, *args)

        call.__name__ = method
        return call

    def __repr__(self) -> str:
        return f"<{self._cls.__name__} on {type(self._group).__name__}>"
