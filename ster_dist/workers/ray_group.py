"""The Ray worker group: N ranks as Ray actors, forming one torch.distributed group (gloo on CPU,
NCCL on CUDA) at an address rank 0 chooses.

Placement follows the traffic: a tensor-parallel group all-reduces in every layer, so each one is a
placement group of its own, STRICT_PACK (all its ranks on one node); pipeline stages and
expert-parallel groups, which exchange far less, are free to land on other nodes. A cluster without
a node able to host a whole tensor-parallel group is refused in one line.

`ray.init()` starts an embedded local cluster when no --address / RAY_ADDRESS is
given, bound to 127.0.0.1. Any rank failing surfaces as one Refusal naming it,
after the whole group (actors, placement group, and the cluster if we started
it) has been shut down.
"""

from __future__ import annotations

import contextlib
import os
import time

from ster_dist.errors import OutOfMemory, Refusal, WorkerLost
from ster_dist.workers.extension import OnRanks, describe
from ster_dist.workers.worker_group import WorkerGroup

CALL_TIMEOUT_S = float(os.environ.get("STER_RANK_TIMEOUT", "1800"))
# how long a healthy group's ranks get to close their extensions before the kill
CLOSE_GRACE_S = 10.0


def start_ray(address: str | None, num_cpus: int | None = None) -> bool:
    """Connect to (or start) Ray; True when this process started a local cluster it must stop."""
    # Ray reads this once, at import: set before importing it, so a 127.0.0.1 address stays loopback
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        try:
            ray.init(address=address, log_to_driver=False)
        except Exception as exc:
            raise Refusal(
                f"failed to connect to the Ray cluster at {address}: {exc}; check --address"
            ) from None
        return False
    dashboard = os.environ.get("STER_RAY_DASHBOARD", "0") == "1"
    with _loopback_node():
        ray.init(
            num_cpus=num_cpus or os.cpu_count(),
            include_dashboard=dashboard,
            dashboard_host="127.0.0.1",
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            configure_logging=False,
        )
    node = ray.util.get_node_ip_address()
    if not node.startswith("127."):
        ray.shutdown()
        raise Refusal(
            f"the local Ray cluster came up on {node}, not loopback; start one with "
            "`ray start --head --node-ip-address 127.0.0.1` and pass --address"
        )
    return True


@contextlib.contextmanager
def _loopback_node():
    """Keep a local cluster's node on 127.0.0.1 even where Ray was imported before start_ray.

    Ray turns _node_ip_address="127.0.0.1" into the host's routable address unless
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER was "0" when it was imported; every server of the cluster
    (GCS, raylet, agents, workers) then listens on that address or on all interfaces."""
    from ray._private import ray_constants

    was = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = was


def cpus_per_rank(world: int, cluster_cpus: float) -> float:
    """The CPUs each rank of a CPU group reserves in Ray: one where the cluster has CPUs to spare,
    else an even share of all its CPUs but one. Why never all of them: a pooled group stays loaded,
    idle, for the next job (for its idle timeout; a served one for good), and Ray work queued behind
    it (a batch merge's shard tasks, num_cpus=1 each) would wait for a CPU that whole time.
    Releasing idle groups instead (the job queue also does that, jobqueue/pool.py make_room) cannot
    free a pinned group or one in use, and costs the next job a reload; a reservation is only Ray's
    bookkeeping (an idle rank uses no CPU, a busy one its threads), so leaving one CPU unreserved
    costs nothing. (On a one-CPU cluster no share leaves a whole CPU: there only released groups
    make room.)"""
    return max(0.01, min(1.0, (cluster_cpus - 1) / world))


class RayGroup(WorkerGroup):
    def __init__(
        self,
        world: int,
        device: str = "cpu",
        address: str | None = None,
        threads: int | None = None,
        ep: int = 1,
        pp: int = 1,
    ):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ster_dist.workers.rank import Rank

        self.world = world
        self.lead = (pp - 1) * (world // pp)  # the rank whose answer is the group's (Rank.lead)
        tp = world // (ep * pp)
        self._remove_pg = remove_placement_group
        self.started_ray = start_ray(address)
        self.actors = []
        self.pgs = []  # one per tensor-parallel group, in rank order
        # False once a call failed: its ranks may be dead or stuck, so close only kills
        self.healthy = True
        # what its placement group holds of the cluster's CPUs (the pool makes room by it)
        self.reserved_cpus = 0.0
        try:
            if device == "cuda":
                bundle, options = {"GPU": 1, "CPU": 1}, {"num_gpus": 1, "num_cpus": 1}
                backend = "nccl"
            else:
                cpus = ray.cluster_resources().get("CPU", 1)
                share = cpus_per_rank(world, cpus)
                bundle, options = {"CPU": share}, {"num_cpus": share}
                backend = "gloo"
                threads = threads or max(1, int(cpus // world))
            _check_a_node_holds(bundle, tp)
            self.pgs = [
                placement_group([bundle] * tp, strategy="STRICT_PACK") for _ in range(world // tp)
            ]
            self.reserved_cpus = bundle["CPU"] * world
            ready, _ = ray.wait(
                [pg.ready() for pg in self.pgs], num_returns=len(self.pgs), timeout=120
            )
            if len(ready) < len(self.pgs):
                raise Refusal(
                    f"the Ray cluster cannot place {world // tp} tensor-parallel groups of {tp} ranks "
                    f"of {bundle}, each on one node; add nodes or lower --tp / --ep / --pp"
                )
            actor_cls = ray.remote(Rank)
            self.actors = [
                actor_cls.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pgs[i // tp], i % tp),
                    max_concurrency=1,
                    **options,
                ).remote(i, world, threads, ep, pp)
                for i in range(world)
            ]
            host, port = self._get([self.actors[0].address.remote()], "address")[0]
            self.call("join", host, port, backend)
        except BaseException:
            self.healthy = False
            self.close()
            raise

    def _get(self, refs: list, method: str) -> list:
        import ray

        pending = list(refs)
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while pending:
            done, pending = ray.wait(
                pending, num_returns=1, timeout=max(1.0, deadline - time.monotonic())
            )
            if not done:
                self.healthy = False
                self.close()
                raise WorkerLost(
                    f"ranks did not finish {method} within {CALL_TIMEOUT_S:.0f} s; "
                    "the group was shut down"
                )
            try:
                ray.get(done[0])
            except BaseException as exc:
                # a rank's collective fails when a peer dies: blame the dead one, not the messenger
                failure = _as_refusal(exc, refs.index(done[0]), method)
                if not isinstance(getattr(exc, "cause", None), Refusal):
                    failure = _dead_rank(refs, method) or failure
                self.healthy = False
                self.close()
                raise failure from None
        return ray.get(refs)

    def on(self, cls: type) -> OnRanks:
        return OnRanks(self, cls)

    def call(self, method: str, *args) -> list:
        return self.collect(self.submit(method, *args))

    def submit(self, method: str, *args) -> tuple[list, str]:
        """Start a call on every rank without waiting (its handle for collect); each actor runs its
        calls one at a time, in the order they were made."""
        import ray

        shared = [ray.put(a) if _large(a) else a for a in args]
        return [getattr(actor, method).remote(*shared) for actor in self.actors], describe(
            method, args
        )

    def collect(self, handle: tuple[list, str]) -> list:
        refs, method = handle
        return self._get(refs, method)

    def close(self) -> None:
        import ray

        if self.actors and self.healthy:
            # Rank.close closes the rank's extensions (training runs, hooks); a kill alone would
            # skip it
            try:
                ray.wait(
                    [actor.close.remote() for actor in self.actors],
                    num_returns=len(self.actors),
                    timeout=CLOSE_GRACE_S,
                )
            except Exception:
                pass
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
        self.actors = []
        for pg in self.pgs:
            try:
                self._remove_pg(pg)
            except Exception:
                pass
        self.pgs = []
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
            self.started_ray = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_a_node_holds(bundle: dict, tp: int) -> None:
    """Refuse at once, rather than after the placement wait, a tensor-parallel group no node can
    hold."""
    import ray

    need = {key: value * tp for key, value in bundle.items()}
    for node in ray.nodes():
        if node.get("Alive") and all(
            node["Resources"].get(key, 0) >= value for key, value in need.items()
        ):
            return
    raise Refusal(
        f"no node of the Ray cluster has {need} for a tensor-parallel group of {tp} ranks, which must "
        "sit inside one node; lower --tp, or add a node that large"
    )


def _large(value) -> bool:
    return hasattr(value, "numel") and value.numel() > 1 << 16


def _dead_rank(refs: list, method: str, grace_s: float = 2.0) -> WorkerLost | None:
    """WorkerLost for the first rank whose actor died during this call (within a short grace, for
    the death to reach Ray), or None when every failure is a rank's own error."""
    import ray

    done, _ = ray.wait(refs, num_returns=len(refs), timeout=grace_s)
    for ref in done:
        try:
            ray.get(ref)
        except Exception as exc:
            failure = _as_refusal(exc, refs.index(ref), method)
            if isinstance(failure, WorkerLost):
                return failure
    return None


def _as_refusal(exc: BaseException, rank: int, method: str) -> Refusal:
    import ray

    cause = getattr(exc, "cause", None)
    if isinstance(cause, Refusal):
        return cause
    if _out_of_memory(exc, cause):
        if isinstance(cause, BaseException) and not isinstance(
            exc, getattr(ray.exceptions, "OutOfMemoryError", ())
        ):
            whole = (
                f"{type(cause).__name__}: {cause}"
                if str(cause)
                else f"{type(cause).__name__} (an allocation failed)"
            )
        # Ray's memory monitor killed the worker: its message names the node's memory, kept whole
        else:
            whole = " ".join(str(exc).split())
        return OutOfMemory(
            f"rank {rank} ran out of memory during {method}: {whole}; the group was shut down. "
            "Give the ranks more memory, spread them over more nodes (--tp / --ep), or load a "
            "smaller precision"
        )
    if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return WorkerLost(
            f"rank {rank} died during {method}: {detail[:200]}; the group was shut down"
        )
    text = str(cause if cause is not None else exc).strip().splitlines()
    detail = text[-1] if text else type(exc).__name__
    return Refusal(f"rank {rank} failed during {method}: {detail}; the group was shut down")


def _out_of_memory(exc: BaseException, cause) -> bool:
    """Ray's memory monitor killed the worker, or the rank itself raised a memory error."""
    import ray

    if isinstance(exc, getattr(ray.exceptions, "OutOfMemoryError", ())):
        return True
    return isinstance(cause, MemoryError) or type(cause).__name__ == "OutOfMemoryError"
