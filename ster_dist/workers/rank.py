"""One rank: joins the process group (and its tensor- and expert-parallel subgroups), stream-loads
its shard, runs the decoder.

The same class runs as a Ray actor (workers/ray_group.py) and in a spawned process
(workers/spawn.py); it never decides placement, only does what its rank is told. Work that
packages above add (capture, steering, adapters, training) runs as rank extensions
(workers/extension.py), each owning its state on this rank, closed when the rank closes.
"""

from __future__ import annotations

import os
import resource
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ster_dist.checkpoint import Checkpoint
from ster_dist.load import LoadedModel, load_model
from ster_dist.parallel.ctx import ParallelCtx
from ster_dist.workers.bind import bind_collectives_to
from ster_dist.workers.extension import RankExtension, check_extension, check_method


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rendezvous_store(
    host: str, port: int, rank: int, world: int, timeout: timedelta
) -> dist.TCPStore:
    """The group's rendezvous store, rank 0 listening on host alone.

    init_method="tcp://HOST:PORT" makes rank 0's TCPStore listen on every interface (*:PORT)
    whatever HOST is, so anyone who can reach the node could join or poison the group. TCPStore
    cannot be told an address to bind, but it takes a listening socket: rank 0 binds host:port
    itself and hands the descriptor over (master_listen_fd); the other ranks connect as before."""
    if rank != 0:
        return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family)
    return dist.TCPStore(
        host, port, world, is_master=True, timeout=timeout, master_listen_fd=listener.detach()
    )


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> int:
    """Restart the resident-memory high-water mark at the current RSS; returns that RSS.

    ru_maxrss cannot measure a load: it survives fork and exec, so a spawned rank starts
    with its parent's peak. Linux resets VmHWM through /proc/self/clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass
    current = _status_bytes("VmRSS")
    return current if current is not None else peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's resident-memory high-water mark (VmHWM; ru_maxrss where /proc is absent)."""
    peak = _status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Rank:
    def __init__(self, rank: int, world: int, threads: int | None = None, ep: int = 1, pp: int = 1):
        """world = pp stages of tp x ep ranks; within its stage this one is tensor-parallel rank r %
        tp and expert-parallel rank r // tp (parallel/ctx.py)."""
        if ep < 1 or pp < 1 or world % (ep * pp):
            raise ValueError(
                f"{world} ranks do not split into {pp} stages of {ep} expert-parallel groups"
            )
        self.rank, self.world, self.ep, self.pp = rank, world, ep, pp
        self._ctx = ParallelCtx(rank, world, None)
        self.loaded: LoadedModel | None = None
        # one per class, in the order they were made
        self._extensions: dict[type, RankExtension] = {}
        if threads:
            torch.set_num_threads(threads)

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the group's rendezvous: this node's address and a free port."""
        host = os.environ.get("STER_RENDEZVOUS_HOST")
        if host is None:
            try:
                import ray

                host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
            except ImportError:
                host = "127.0.0.1"
        return host, free_port(host)

    def join(self, host: str, port: int, backend: str, timeout_s: float = 120.0) -> int:
        if self.world > 1:
            timeout = timedelta(seconds=timeout_s)
            if backend == "gloo":
                bind_collectives_to(host)
            store = rendezvous_store(host, port, self.rank, self.world, timeout)
            dist.init_process_group(
                backend, store=store, rank=self.rank, world_size=self.world, timeout=timeout
            )
            if self.ep > 1 or self.pp > 1:
                self._ctx = self._subgroups()
        return self.rank

    def _subgroups(self) -> ParallelCtx:
        """Per stage, tensor-parallel groups of tp consecutive ranks and expert-parallel groups
        across them. Every rank creates every group, in the same order, as torch.distributed
        requires."""
        per_stage = self.world // self.pp
        tp = per_stage // self.ep
        stage, local = divmod(self.rank, per_stage)
        tp_rank, ep_rank = local % tp, local // tp
        tp_group = ep_group = None
        for s in range(self.pp):
            base = s * per_stage
            for e in range(self.ep):
                group = dist.new_group([base + e * tp + t for t in range(tp)]) if tp > 1 else None
                if (s, e) == (stage, ep_rank):
                    tp_group = group
            for t in range(tp):
                group = (
                    dist.new_group([base + e * tp + t for e in range(self.ep)])
                    if self.ep > 1
                    else None
                )
                if (s, t) == (stage, tp_rank):
                    ep_group = group
        if tp == 1:
            tp_group = None
        return ParallelCtx(
            tp_rank,
            tp,
            tp_group,
            ep_rank,
            self.ep,
            ep_group,
            pp_rank=stage,
            pp_size=self.pp,
            pp_prev=self.rank - per_stage if stage > 0 else None,
            pp_next=self.rank + per_stage if stage < self.pp - 1 else None,
            sampler=(self.pp - 1) * per_stage,
        )

    def ctx(self) -> ParallelCtx:
        return self._ctx

    def load(
        self, checkpoint: Checkpoint, precision: str, device: str, weights: str = "dequantize"
    ) -> dict:
        rss_before = reset_peak_rss()
        start = time.perf_counter()
        self.loaded = load_model(checkpoint, precision, device, self.ctx(), weights)
        return {
            "rank": self.rank,
            "load_seconds": time.perf_counter() - start,
            "bytes_read": self.loaded.bytes_read,
            "peak_rss_before": rss_before,
            "peak_rss_after": peak_rss_bytes(),
        }

    @property
    def lead(self) -> bool:
        """Whether this rank answers for the group: the one whose logits choose the tokens (rank 0,
        or the last pipeline stage's first rank)."""
        return self.rank == self._ctx.sampler

    @property
    def stage_lead(self) -> bool:
        """Whether this rank answers for its pipeline stage (its first rank): what a stage alone
        holds, such as the residual after its layers, travels back from it."""
        return self.rank % (self.world // self.pp) == 0

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor) -> torch.Tensor | None:
        out = self.loaded.model(ids)
        return out if self.lead else None

    def compile_layers(self) -> str | None:
        """Compile this rank's layers (model/compiled.py); why not, where they cannot be."""
        return self.loaded.model.compile_layers()

    def parity(self, length: int, seed: int) -> dict | None:
        from ster_dist.parity import against_reference, ours

        ids, captured, logits = ours(self.loaded, length, seed)
        if not self.lead:
            return None
        return against_reference(self.loaded, ids, captured, logits, tp=self.world)

    def whereabouts(self) -> dict:
        """Where this rank's process is, so a test or an operator can find it: its Ray node too,
        when it is an actor (several nodes may share one host)."""
        out = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname()}
        try:
            import ray

            if ray.is_initialized():
                out["node"] = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return out

    def extension(self, cls: type) -> RankExtension:
        """This rank's instance of extension `cls`, made on first use."""
        made = self._extensions.get(cls)
        if made is None:
            check_extension(cls)
            made = self._extensions[cls] = cls(self)
        return made

    def call_extension(self, cls: type, method: str, *args):
        """What `group.on(cls).method(*args)` runs on each rank; returns the method's result."""
        # the driver checked too; a rank called directly must refuse alike
        check_method(cls, method)
        return getattr(self.extension(cls), method)(*args)

    def close(self) -> None:
        """Close the extensions (newest first: a later one may use an earlier one's state), then
        leave the process group; an extension failing to close stops neither."""
        failure = None
        extensions, self._extensions = list(self._extensions.values()), {}
        for made in reversed(extensions):
            try:
                made.close()
            except Exception as exc:
                failure = failure or exc
        if dist.is_initialized():
            dist.destroy_process_group()
        if failure is not None:
            raise failure
