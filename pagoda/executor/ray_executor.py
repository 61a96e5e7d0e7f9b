"""`RayExecutor`: tensor parallelism over one Ray actor per rank (vLLM's
RayDistributedExecutor, in small), so that the ranks may live on several machines.

The driver (the engine's process) joins Ray (`ray.init()` unless the caller already did; that
connects to $RAY_ADDRESS or a cluster started on this machine by `ray start`, else starts a
local instance) and creates `tensor_parallel_size` actors (`ray_worker.RayWorker`): on CUDA
each takes one GPU, inside a placement group of one GPU bundle per rank packed on as few nodes
as possible (PACK); on a CPU they take no CPU slot (the ranks share the cores, as worker
processes would), in a placement group of one CPU bundle per rank only when the cluster has
several nodes. Ranks go to the actors sorted by node (the driver's first) and GPU id, so a
node's ranks are neighbours; each sees all its node's GPUs and picks its own. The
torch.distributed rendezvous is rank 0's node address and a port free there (asked of the
actor), so it works across machines, not only on 127.0.0.1. The ranks themselves are
`TensorParallelWorker`s, the same as `MultiprocExecutor`'s worker processes.

Each step's `SchedulerOutput` (plain data: new requests whole, then per-step diffs) is pickled
once and passed to every actor's `execute_step` (through Ray's object store when it is large); its
future waits for every rank (rank 0 returns the sampled tokens), at most
$PAGODA_EXECUTE_MODEL_TIMEOUT_S (default 300 s). An actor that raised or died (Ray's
`RayTaskError`, `ActorDiedError`, ...) becomes a `WorkerError` naming the ranks and causes;
then the actors are killed and every later call raises.
`shutdown()` (also on garbage collection and at interpreter exit) kills the actors and removes
the placement group it made; it never shuts Ray down, whoever started it.
"""

from __future__ import annotations

import logging
import pickle
import re
import time
import weakref
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagoda import envs
from pagoda.config import EngineConfig
from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagoda.executor.multiproc import (
    TensorParallelExecutorBase,
    WorkerError,
    _worker_config,
)
from pagoda.executor.ray_worker import RayWorker

logger = logging.getLogger(__name__)

# Waiting for the cluster to place the actors (not for loading the model: that has no limit).
_PLACEMENT_TIMEOUT_S = 120.0
# Ray's own limit for arguments passed inside a call (max_direct_call_object_size).
_INLINE_STEP_BYTES = 100 * 1024
# After the first sign of a failure, how long to gather what the other ranks report.
_FAILURE_GRACE_S = 0.5


class RayStepFuture:
    """One launched step; `get()` waits for rank 0's `ModelRunnerOutput`."""

    def __init__(self, executor: RayExecutor, refs: list[ray.ObjectRef]) -> None:
        self._executor, self._refs = executor, refs
        self._output: ModelRunnerOutput | None = None

    def get(self) -> ModelRunnerOutput:
        if self._output is None:
            ex = self._executor
            self._output = ex._wait(self._refs, ex.step_timeout_s, "execute_model")[0]
            self._refs = []
        return self._output


class RayExecutor(TensorParallelExecutorBase):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.world_size = config.parallel_config.tensor_parallel_size
        self.step_timeout_s = envs.PAGODA_EXECUTE_MODEL_TIMEOUT_S
        self._error: BaseException | None = None
        if not ray.is_initialized():
            ray.init()  # $RAY_ADDRESS, a cluster started here, or a new local instance
        self._actors: list[Any] = []  # in rank order
        self._placement: list[PlacementGroup] = []  # the one this executor made, if any
        self._finalizer = weakref.finalize(self, _kill_actors, self._actors, self._placement)
        self.worker_pids: list[int] = []
        self.worker_nodes: list[str] = []  # each rank's node IP address
        try:
            self._bytes_per_block = self._start(_worker_config(config))
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "Tensor parallel: %d Ray actors (pids %s on %s) over %s",
            self.world_size,
            ", ".join(map(str, self.worker_pids)),
            ", ".join(sorted(set(self.worker_nodes))),
            "NCCL" if config.device_config.device == "cuda" else "gloo",
        )

    # -- the executor interface (the rest in TensorParallelExecutorBase) ----------------------
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> RayStepFuture:
        """Send the step to every actor now; `.get()` on the result waits for rank 0's
        output."""
        self._check_alive()
        try:
            buf = pickle.dumps(scheduler_output, pickle.HIGHEST_PROTOCOL)
            # Small steps travel inside the calls (a `ray.put` costs ~1 ms more); a large one
            # is put into the object store once rather than copied for each actor.
            arg = buf if len(buf) <= _INLINE_STEP_BYTES else ray.put(buf)
            refs = [actor.execute_step.remote(arg) for actor in self._actors]
        except Exception as e:  # noqa: BLE001 - the runners' requests would be out of step
            self._fail(WorkerError("cannot send the step to the tensor-parallel actors"), e)
        return RayStepFuture(self, refs)

    def collective_rpc(
        self, method: str, args: tuple[Any, ...] = (), timeout: float | None = None
    ) -> list[Any]:
        """Call `method(*args)` of every rank's runner (after the steps already sent); returns
        the results in rank order."""
        self._check_alive()
        refs = [actor.call.remote(method, args) for actor in self._actors]
        replies = self._wait(refs, timeout, method)
        return [replies[r] for r in range(self.world_size)]

    def shutdown(self) -> None:
        """Kill the actors (Ray itself keeps running)."""
        self._finalizer()

    # -- start-up -----------------------------------------------------------------------------
    def _start(self, worker_config: EngineConfig) -> int:
        tp, on_cuda = self.world_size, self.config.device_config.device == "cuda"
        if on_cuda:
            gpus = ray.cluster_resources().get("GPU", 0)
            if gpus < tp:
                raise ValueError(
                    f"tensor_parallel_size={tp} needs {tp} GPUs, the Ray cluster has {gpus:g}: "
                    "lower --tensor-parallel-size or add nodes to the cluster"
                )
        pg = None
        if on_cuda or _num_alive_nodes() > 1:
            pg = self._placement_group([{"GPU": 1} if on_cuda else {"CPU": 1}] * tp)
        actor_class = ray.remote(RayWorker)
        for i in range(tp):
            strategy = None
            if pg is not None:
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=pg,
                    placement_group_bundle_index=i,
                    placement_group_capture_child_tasks=True,
                )
            options = dict(num_cpus=0, num_gpus=1 if on_cuda else 0, max_restarts=0)
            actor = actor_class.options(scheduling_strategy=strategy, **options).remote()
            self._actors.append(actor)
        infos = self._wait(
            [a.node_info.remote() for a in self._actors], _PLACEMENT_TIMEOUT_S, "start"
        )
        # Ranks by node (the driver's first) and GPU id: a node's ranks are neighbours.
        driver_ip = ray.util.get_node_ip_address()

        def key(i: int) -> tuple[Any, ...]:
            _, ip, gpu_ids, _ = infos[i]
            return (ip != driver_ip, ip, [int(g) if g.isdigit() else g for g in gpu_ids])

        order = sorted(range(tp), key=key)
        self._actors[:] = [self._actors[i] for i in order]
        infos = [infos[i] for i in order]
        self.worker_nodes = [ip for _, ip, _, _ in infos]
        self.worker_pids = [pid for _, _, _, pid in infos]
        ip0 = infos[0][1]
        port = self._wait([self._actors[0].free_port.remote()], _PLACEMENT_TIMEOUT_S, "start")[0]
        init_method = f"tcp://{f'[{ip0}]' if ':' in ip0 else ip0}:{port}"
        forwarded = envs.pagoda_environment()
        starts = []
        for rank, (node_id, _, gpu_ids, _) in enumerate(infos):
            node_gpus = sorted(
                {g for n, _, ids, _ in infos if n == node_id for g in ids},
                key=lambda g: (not g.isdigit(), int(g) if g.isdigit() else 0, g),
            )
            env, device_index = dict(forwarded), None
            if on_cuda:  # every rank sees its node's GPUs (NCCL's peer-to-peer needs them)
                env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
                device_index = node_gpus.index(gpu_ids[0])
            ranks_on_node = sum(1 for n, _, _, _ in infos if n == node_id)
            args = (rank, tp, worker_config, init_method, ranks_on_node, device_index, env)
            starts.append(self._actors[rank].start.remote(*args))
        ready = self._wait(starts, None, "start", reraise=True)
        return sum(ready.values())

    def _placement_group(self, bundles: list[dict[str, float]]) -> PlacementGroup:
        pg = placement_group(bundles, strategy="PACK")
        self._placement.append(pg)
        ready, _ = ray.wait([pg.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            raise WorkerError(
                f"Ray could not place {len(bundles)} bundles of {bundles[0]} within "
                f"{_PLACEMENT_TIMEOUT_S:g} s (the cluster has {ray.cluster_resources()}, "
                f"{ray.available_resources()} free): free resources or lower "
                "--tensor-parallel-size"
            )
        return pg

    # -- waiting and failing ------------------------------------------------------------------
    def _wait(
        self, refs: list[Any], timeout: float | None, what: str, reraise: bool = False
    ) -> dict[int, Any]:
        """The result of each rank's call (`refs` in rank order), failing the executor on the
        first error, death or the timeout. With `reraise` (start-up: a bad checkpoint, an
        unshardable model) a rank's own exception is raised, else a `WorkerError`."""
        self._check_alive()
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
            if not ready:
                silent = ", ".join(str(r) for r in sorted(pending.values()))
                hint = (
                    "raise $PAGODA_EXECUTE_MODEL_TIMEOUT_S if steps are this slow"
                    if what == "execute_model"
                    else "is the cluster short of resources? see `ray status`"
                )
                self._fail(
                    WorkerError(
                        f"tensor-parallel step '{what}' got no answer within {timeout:g} s from "
                        f"rank(s) {silent} ({hint})"
                    )
                )
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - reported with what the others say
                    self._fail_actors(what, reraise, {rank: e}, pending)
        return results

    def _fail_actors(
        self,
        what: str,
        reraise: bool,
        errors: dict[int, BaseException],
        pending: dict[Any, int],
    ) -> None:
        """Raise for ranks that failed, after gathering for a moment what the other ranks say
        (one rank's death takes its peers' collectives down: name the cause first)."""
        if pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=_FAILURE_GRACE_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001
                    errors[pending[ref]] = e
        causes = {r: _cause(e) for r, e in errors.items()}
        if reraise:
            raised = {r: c for r, c in causes.items() if not isinstance(c, ray.exceptions.RayError)}
            if raised:
                rank, exc = min(raised.items())
                exc.add_note(f"(in tensor-parallel Ray actor rank {rank})")
                self._fail(exc)
        died = {r: e for r, e in errors.items() if isinstance(e, ray.exceptions.RayActorError)}
        lines = [f"rank {r}'s actor died ({_death_reason(e)})" for r, e in sorted(died.items())]
        lines += [f"rank {r} raised {causes[r]!r}" for r in sorted(errors) if r not in died]
        message = f"tensor-parallel Ray actors failed in '{what}': " + "; ".join(lines)
        for r, e in sorted(errors.items()):
            message += f"\n--- rank {r} ---\n{e}"
        self._fail(WorkerError(message), cause=causes[min(errors)])

    def _check_alive(self) -> None:
        if self._error is not None:
            raise WorkerError(
                f"the tensor-parallel actors are stopped after an earlier failure: {self._error}"
            )
        if not self._finalizer.alive:
            raise WorkerError("the tensor-parallel executor is shut down")

    def _fail(self, error: BaseException, cause: BaseException | None = None) -> None:
        self._error = error
        self.shutdown()
        if cause is not None:
            raise error from cause
        raise error


def _num_alive_nodes() -> int:
    return sum(1 for node in ray.nodes() if node["Alive"])


def _cause(e: BaseException) -> BaseException:
    """The exception the actor raised, out of Ray's `RayTaskError` wrapper."""
    if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        return e.cause
    return e


def _death_reason(e: BaseException) -> str:
    """Ray's one-line reason for an actor's death ("its worker process has died", "it was
    killed by `ray.kill`", ...)."""
    found = re.search(r"The actor is dead because ([^.]*)", str(e))
    return found.group(1) if found else str(e).splitlines()[0]


def _kill_actors(actors: list[Any], placement: list[PlacementGroup]) -> None:
    """Kill the actors and remove the placement group this executor made. Ray keeps running
    (if it is already down, at interpreter exit, the actors went with it)."""
    if not ray.is_initialized():
        return
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as e:  # noqa: BLE001 - an actor already gone
            logger.debug("ray.kill: %r", e)
    for pg in placement:
        try:
            remove_placement_group(pg)
        except Exception as e:  # noqa: BLE001
            logger.debug("remove_placement_group: %r", e)
