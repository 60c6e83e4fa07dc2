"""`ster serve --replicas N`: N copies of the server app behind one HTTP endpoint, with Ray Serve.

Each replica is a Ray Serve replica (a Ray actor) that builds its own app with the builder it is
given, so each holds its own model copy and token engine (with --tp > 1, its own Ray worker group).
Serve's one HTTP proxy (on the head node) sends each request to one replica, chosen by power of two
choices on their queue lengths, and passes the response back as the replica sends it, so a
server-sent-event stream arrives token by token. Every response carries `x-ster-replica`, the id
of the replica that answered.

Serve and the app are started here and removed by ReplicaSet.shutdown; Ray itself is stopped only
when deploy started it (a local cluster), never a cluster it was pointed at.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from ster_dist import errors
from ster_dist.errors import Refusal
from ster_dist.events import progress
from ster_dist.serve.replica_app import REPLICA_HEADER, ASGIApp, build_replica_app
from ster_dist.serve.sockets import check_free, free_port
from ster_dist.workers.ray_group import start_ray

__all__ = ["REPLICA_HEADER", "ReplicaSet", "deploy", "free_port"]

# a replica's constructor loads a model: allow for a large checkpoint read from slow disks
READY_TIMEOUT_S = float(os.environ.get("STER_REPLICAS_READY_TIMEOUT", "1800"))
# the engine batches what it is given: let each replica hold many requests (Serve's default is 5)
MAX_ONGOING_REQUESTS = 256
WILDCARD_HOSTS = ("", "0.0.0.0", "::")  # the url names the proxy as 127.0.0.1 then
ROUTE_WAIT_S = 30.0


def _deployment(
    *,
    name: str,
    replicas: int,
    num_cpus: float,
    num_gpus: float,
    max_ongoing_requests: int,
    drain_s: float,
):
    from ray import serve

    @serve.ingress()
    class Replica:
        """One copy of the app, built and started in the replica's constructor."""

        def __init__(self, app_builder: Callable[[], ASGIApp]):
            _bind_replica_grpc_to_node()
            self.app_builder = app_builder

        async def __serve_build_asgi_app__(self) -> ASGIApp:
            return await build_replica_app(self.app_builder)

    # a constructor that fails (a model that does not load) fails the same way when retried:
    # give up after one failure per replica instead of Serve's 20 tries
    return serve.deployment(
        Replica,
        name=name,
        num_replicas=replicas,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        max_ongoing_requests=max_ongoing_requests,
        max_constructor_retry_count=replicas,
        graceful_shutdown_timeout_s=drain_s,
    )


def _bind_replica_grpc_to_node() -> None:
    """Make this replica's inter-deployment gRPC server listen on its node's cluster address.

    Serve starts that server in every replica, after the constructor, on "[::]:0": every interface,
    unauthenticated, although nothing here calls it (the proxy talks to replicas over Ray). Bound to
    the node address (127.0.0.1 on a local cluster) it stays where the rest of the cluster is.
    tests/serve/test_serve_replicas.py reads every listener of a served cluster, so a Serve that
    changes this is caught."""
    import ray
    from ray.serve._private import replica

    node = ray.util.get_node_ip_address()
    node = f"[{node}]" if ":" in node else node
    add_port = replica.add_port_to_grpc_server

    def add_port_on_node(server, address: str):
        return add_port(server, f"{node}:0" if address == "[::]:0" else address)

    replica.add_port_to_grpc_server = add_port_on_node


@dataclass
class ReplicaSet:
    """A running deployment: N replicas behind the proxy at `url`."""

    name: str
    host: str
    port: int
    replicas: int
    started_ray: bool  # deploy started a local Ray cluster: shutdown stops it
    # the app is ours to remove (never another deployment's of the same name)
    deployed: bool = False

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def shutdown(self) -> None:
        """Remove the app, stop Serve when no other app is left on the cluster, and stop Ray if
        deploy started it."""
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        try:
            if self.deployed:
                self.deployed = False
                serve.delete(self.name)
                # Serve is cluster-wide: another application on a shared cluster keeps it running
                if not serve.status().applications:
                    serve.shutdown()
        finally:
            if self.started_ray:
                ray.shutdown()
                self.started_ray = False

    def __enter__(self) -> ReplicaSet:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def deploy(
    app_builder: Callable[[], ASGIApp],
    *,
    replicas: int,
    host: str,
    port: int,
    address: str | None = None,
    num_cpus: float = 0.0,
    num_gpus: float = 0.0,
    name: str = "ster",
    max_ongoing_requests: int = MAX_ONGOING_REQUESTS,
    drain_s: float = 20.0,
) -> ReplicaSet:
    """Run `replicas` copies of the app `app_builder()` builds (each builds its own) behind one
    HTTP endpoint on host:port (port 0: a free one), on the Ray cluster at `address` (None: a local
    one started here). Returns once every replica has built its app and run its startup.

    `app_builder` travels to the replicas by pickle: a module-level function (or a partial of
    one) importable on every node. num_cpus / num_gpus are each replica's own reservation; a
    replica whose model runs on Ray ranks (--tp > 1) reserves nothing itself, its ranks do.
    max_ongoing_requests: requests one replica is given at once; Serve queues the rest. drain_s:
    how long a stopping replica waits for its requests in flight.
    """
    if replicas < 1:
        raise Refusal(f"--replicas {replicas} serves nothing; give 1 or more")
    if address is None and not _ray_running():
        # a cluster started on this machine: refuse now what would otherwise fail unseen later
        _check_fits_here(replicas, num_gpus)
        if port != 0:
            check_free(host, port)  # its fresh proxy would fail to bind a taken port
    if port == 0:
        port = free_port(host)
    started_ray = start_ray(address)
    running = ReplicaSet(
        name=name, host=host, port=port, replicas=replicas, started_ray=started_ray
    )
    try:
        _start(
            app_builder,
            running,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            max_ongoing_requests=max_ongoing_requests,
            drain_s=drain_s,
        )
    except BaseException:
        running.shutdown()
        raise
    return running


def _start(
    app_builder: Callable[[], ASGIApp],
    running: ReplicaSet,
    *,
    num_cpus: float,
    num_gpus: float,
    max_ongoing_requests: int,
    drain_s: float,
) -> None:
    from ray import serve
    from ray.serve.config import HTTPOptions
    from ray.serve.schema import ApplicationStatus

    # one proxy, on the head node: one endpoint to expose and to firewall
    serve.start(
        proxy_location="HeadOnly", http_options=HTTPOptions(host=running.host, port=running.port)
    )
    _check_proxy_port(running)
    if running.name in serve.status().applications:
        raise Refusal(
            f"a Serve application named {running.name} already runs on this cluster; stop that "
            "server first (or `serve delete` it)"
        )
    running.deployed = True
    app = _deployment(
        name=running.name,
        replicas=running.replicas,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        max_ongoing_requests=max_ongoing_requests,
        drain_s=drain_s,
    ).bind(app_builder)
    serve.run_many(
        [serve.RunTarget(target=app, name=running.name, route_prefix="/")],
        wait_for_ingress_deployment_creation=False,
        wait_for_applications_running=False,
    )
    deadline = time.monotonic() + READY_TIMEOUT_S
    said = ""
    while True:
        status = serve.status().applications.get(running.name)
        if status is not None and status.status == ApplicationStatus.RUNNING:
            break
        if status is not None and status.status != ApplicationStatus.DEPLOY_FAILED:
            # Serve's notes while it waits (replicas not yet placed, and on what resources) are the
            # user's only clue to a start that takes long: pass each new one on
            note = _first_lines(_deployment_message(status, running.name), lines=1)
            if note and note != said:
                progress(f"replicas: {note}")
                said = note
        if status is not None and status.status == ApplicationStatus.DEPLOY_FAILED:
            raise _start_failure(_deployment_message(status, running.name))
        if time.monotonic() > deadline:
            message = (
                _first_lines(_deployment_message(status, running.name))
                if status is not None
                else "no status"
            )
            raise Refusal(
                f"the replicas were not ready within {READY_TIMEOUT_S:.0f} s ({message}); "
                "check the cluster's free resources, or raise STER_REPLICAS_READY_TIMEOUT"
            )
        time.sleep(0.5)
    _wait_for_route(running)


def _deployment_message(status, name: str) -> str:
    """What Serve says of the deployment (a replica's constructor error), else of the app."""
    deployment = status.deployments.get(name)
    return (deployment.message if deployment is not None else "") or status.message


def _check_proxy_port(running: ReplicaSet) -> None:
    """Serve keeps the HTTP options it was first started with: refuse when a Serve already running
    on the cluster listens elsewhere than asked."""
    from ray.serve.context import _get_global_client

    config = _get_global_client().http_config
    if (config.host, config.port) != (running.host, running.port):
        raise Refusal(
            f"Ray Serve already runs on this cluster with its proxy on {config.host}:{config.port}, "
            f"not {running.host}:{running.port}; serve on that host and port, or `serve shutdown` it first"
        )


def _wait_for_route(running: ReplicaSet) -> None:
    """The proxy learns new routes asynchronously: wait (briefly; the app is already running) until
    it routes to the app, so the first request after deploy returns is not a 404. Skipped when the
    proxy runs on another machine (the head node), which this one may not reach."""
    import urllib.error
    import urllib.request

    if not _on_head_node():
        return
    deadline = time.monotonic() + ROUTE_WAIT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{running.url}/-/routes", timeout=5) as reply:
                if running.name in reply.read().decode():
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)


def _on_head_node() -> bool:
    import ray

    try:
        heads = {
            node["NodeID"]
            for node in ray.nodes()
            if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {})
        }
        return ray.get_runtime_context().get_node_id() in heads
    except Exception:  # a Ray Client connection (ray://) has no node of its own
        return False


def _start_failure(message: str) -> Refusal:
    """The replicas' constructor error as one refusal: a Refusal raised in a replica (the server
    could not load its model, say) is passed on as it was worded; anything else is named by the
    last line of its traceback."""
    last = next(
        (line.strip() for line in reversed((message or "").splitlines()) if line.strip()),
        "no message",
    )
    kind, _, text = last.partition(": ")
    module, _, name = kind.rpartition(".")
    refusal = getattr(errors, name, None) if module == "ster_dist.errors" else None
    if (
        isinstance(refusal, type)
        and issubclass(refusal, Refusal)
        and refusal is not errors.JobFailed
        and text
    ):
        return refusal(text)
    return Refusal(
        f"the replicas failed to start: {last}; their logs are in the Ray session's logs/serve/"
    )


def _check_fits_here(replicas: int, num_gpus: float) -> None:
    """On a cluster of this machine alone (no autoscaler to add a node), replicas that cannot all
    be placed would only wait for their timeout: refuse them now."""
    if not num_gpus:
        return
    import torch

    gpus = torch.cuda.device_count()
    if replicas * num_gpus > gpus:
        raise Refusal(
            f"{replicas} replicas holding {num_gpus:g} GPU each need {replicas * num_gpus:g} GPUs and "
            f"this machine has {gpus:g}; serve fewer replicas, or on a Ray cluster (--address)"
        )


def _ray_running() -> bool:
    import ray

    return ray.is_initialized()


def _first_lines(message: str, lines: int = 3) -> str:
    return " / ".join(
        line.strip() for line in (message or "").strip().splitlines()[:lines] if line.strip()
    )
