"""Past one machine: engine replicas on a Ray cluster behind one `workbench.Engine`.

    from workbench import cluster
    c = cluster.start(replicas=2, name="lab", router="least_loaded", max_num_seqs=32)
    c.generate(["Hello", "Bonjour"], params)      # routed, one request per replica or as the router says
    c.replicas()                                  # name, node, pid, alive, served (in flight, queued tokens)
    c.replica("lab-r0").metrics()                 # one replica: an Engine of its own
    c.configure(max_num_batched_tokens=1024)      # every replica, one at a time
    c.configure(quantization="int8", replica="lab-r1")   # one replica
    c.configure(router="prefix_affinity")         # the routing policy, live
    workbench.sweep(c, grid={...})                # grid points in parallel, one per replica
    workbench.connect("cluster:lab")              # from another kernel
    c.shutdown()                                  # every replica, actor and placement group it started

Ray places, starts and restarts the replicas: each is a Ray actor (`replica.ReplicaServer`,
`num_cpus` / `num_gpus` each, one bundle of a SPREAD placement group, so one per node where
there are nodes) that runs an engine process on its node. Requests and tokens go between this
process and the engines over ZeroMQ (tcp, CURVE-encrypted and authenticated), never through
Ray. `address=None` starts a local Ray cluster (and `shutdown` stops it); "auto" or "HOST:PORT"
joins a running one; a local cluster listens on loopback only. Ray's token authentication is on
(`RAY_AUTH_MODE=token`): a local cluster makes its token; to join one, set `RAY_AUTH_TOKEN` (or
`RAY_AUTH_TOKEN_PATH`) to the cluster's token first (`ray get-auth-token` prints it on the head node).

Routing policies, fault handling and the merged timeline: `router.py`, `engine.py`.
"""

from __future__ import annotations

import os
from typing import Any

from .engine import ClusterEngine, Replica, attach, write_cluster_file
from .router import POLICIES, Router, check_policy

__all__ = ["start", "attach", "ClusterEngine", "Router", "POLICIES", "RAY_VERSION"]

RAY_VERSION = "2.60.0"  # the Ray this is built and tested with (pyproject's [cluster] extra pins it)
HOW_TO_GET = f"workbench.cluster needs Ray: pip install 'ray=={RAY_VERSION}' (or the [cluster] extra)"


def _ray(local: bool):
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report from an offline machine
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # before Ray starts: every RPC needs the cluster's token
    if local:  # a cluster of this machine alone listens on loopback (read when ray is imported)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError:
        raise ImportError(HOW_TO_GET) from None
    return ray


def start(
    replicas: int = 2,
    address: str | None = None,
    name: str | None = None,
    router: str = "least_loaded",
    model=None,
    *,
    num_cpus: float = 1,
    num_gpus: float = 0,
    restart: bool = False,
    host: str | None = None,
    timeout: float = 600.0,
    ray_init: dict[str, Any] | None = None,
    **settings: Any,
) -> ClusterEngine:
    """Start `replicas` engine replicas on Ray and return the `workbench.Engine` in front of them.

    address: None starts a local Ray cluster; "auto" or "HOST:PORT" joins one (a Ray already
    initialised in this process is used as it is). num_cpus / num_gpus: each replica's resources.
    restart: start a replica again when its engine or node dies. host: the address the engines
    listen on (default: each node's IP; tests pass 127.0.0.1). settings: engine settings, the
    same for every replica (`configure(replica=...)` changes one later)."""
    from ..settings import validate

    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    check_policy(router)
    settings = validate(settings)
    ray = _ray(local=address is None)
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ..ipc import connection as conn
    from ..ipc.client import EngineClient
    from .replica import ReplicaServer, connection_of

    name = conn.check_name(name) if name is not None else f"cluster-{os.getpid()}"
    ray_owned = False
    if not ray.is_initialized():
        kw = dict(ray_init or {})
        if address is None:
            kw.setdefault("num_cpus", max(os.cpu_count() or 1, int(replicas * num_cpus + 0.999)))
            kw.setdefault("include_dashboard", False)
            ray_owned = True
        # "local": a new cluster, never one a stale address file points at
        ray.init(address=address or "local", logging_level="WARNING", log_to_driver=False, **kw)
    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
    pg = placement_group([dict(bundle)] * replicas, strategy="SPREAD", name=f"workbench-{name}")
    ray.get(pg.ready(), timeout=timeout)
    Actor = ray.remote(ReplicaServer)

    def spawn_actor(index: int):
        return Actor.options(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
        ).remote(f"{name}-r{index}", model, settings, host)

    def connect(actor, index: int) -> Replica:
        info = ray.get(actor.info.remote(), timeout=timeout)
        return Replica(info["name"], EngineClient(connection_of(info), timeout=30.0), info, actor, index)

    actors = [spawn_actor(i) for i in range(replicas)]
    built = []
    try:
        built = [connect(a, i) for i, a in enumerate(actors)]
    except BaseException:
        for a in actors:
            ray.kill(a)
        ray.util.remove_placement_group(pg)
        if ray_owned:
            ray.shutdown()
        raise

    def respawn(old: Replica) -> Replica:
        """A fresh engine for a dead replica: its actor restarts it; a dead actor is replaced."""
        try:
            info = ray.get(old.actor.restart.remote(), timeout=timeout)
            return Replica(info["name"], EngineClient(connection_of(info), timeout=30.0), info, old.actor, old.bundle)
        except Exception:  # the actor (or its node) is gone: a new one, where Ray puts the bundle now
            return connect(spawn_actor(old.bundle), old.bundle)

    engine = ClusterEngine(
        name, built, router=router, owned=True, placement_group=pg, ray_owned=ray_owned, restart=restart, spawn=respawn
    )
    write_cluster_file(engine, address)
    return engine
