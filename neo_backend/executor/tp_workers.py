"""The engine's tensor-parallel ranks: rank 0 is the engine's own process (scheduler, shard 0, sampling); ranks
1..size-1 are worker processes (spawned) that each hold a shard, its device KV pool and its host KV pool, and carry
out every step rank 0 carries out: the same swaps, the same forwards (whose collectives join the ranks), no
sampling.

The control channel is one `multiprocessing` pipe per worker rather than torch.distributed's object broadcast: a
send to a dead worker fails at once (EPIPE), a worker whose rank 0 is gone sees EOF and exits, a worker's own error
comes back as an object, and the channel never queues behind the model's collectives. Commands need no answer
except `state`: the pipe keeps them in order and the forward's collectives keep the ranks in step. A dead worker
closes its gloo connections, so a collective on rank 0 fails at once too; `COLLECTIVE_TIMEOUT_S` bounds the wait
on one that is alive but stuck. Rank 0 then names the dead rank in an `EngineDeadError`.

Every rank takes the start-up profile at once (its dense forwards need the collectives, and each rank's CPU
attention then runs beside the others' as in serving); rank 0 keeps its own, and only rank 0 caches it. Device KV
block counts are the minimum over ranks; host pools are sized alike on every rank by the same arithmetic.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing.spawn
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import EngineConfig, ModelConfig
from ..core.perf_model import PerfModel
from ..core.scheduler_output import SchedulerOutput, SwapOut
from ..cpu.affinity import attention_cpus
from ..errors import ConfigError, EngineDeadError, NeoError
from ..layers.parallel import TensorParallel
from ..layers.sampler import PendingSample
from ..models.loader import ModelSource
from .model_runner import LaunchedStep, ModelRunner, resolve_device
from .step_mirror import SequenceMirror, StepSender

COLLECTIVE_TIMEOUT_S = 300.0  # a rank that is alive but stuck; weight loading on every rank fits in it
DEATH_GRACE_S = 5.0  # after a failed step: how long a worker that is dying may take to exit
STOP_TIMEOUT_S = 10.0


@dataclass
class RankSpec:
    """What a worker needs to build its shard's ModelRunner."""

    rank: int
    size: int
    rendezvous: str
    config: EngineConfig
    model_cfg: ModelConfig
    source: ModelSource
    max_model_len: int


@dataclass
class RankState:
    """A worker's view, for checks: requests it mirrors and swap-outs it has in flight."""

    num_sequences: int
    swaps_in_flight: list[str]


@dataclass
class _Worker:
    rank: int
    process: BaseProcess
    conn: Connection


def join_group(spec: RankSpec) -> TensorParallel:
    device = resolve_device(spec.config)
    if device.type == "cuda":
        torch.cuda.set_device(spec.rank)
    else:  # each rank's forward on its share of the cores: ranks that each take every core slow down tenfold
        torch.set_num_threads(len(attention_cpus(spec.config.engine_cpu, spec.rank, spec.size)))
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=spec.rendezvous,
        rank=spec.rank,
        world_size=spec.size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    return TensorParallel(spec.rank, spec.size)


def serve_rank(spec: RankSpec, conn: Connection) -> None:
    """A worker process: build the shard, then carry out rank 0's commands until `stop` or until rank 0 is gone.
    Any error goes back to rank 0 and ends the process (its collectives can no longer be in step)."""
    try:
        runner = ModelRunner(spec.config, spec.model_cfg, spec.source, spec.max_model_len, (), join_group(spec))
        conn.send(("ready", None))
        _RankLoop(runner).serve(conn)
        runner.close()
        dist.destroy_process_group()
    except EOFError:  # rank 0 is gone
        os._exit(1)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", exc if isinstance(exc, NeoError) else RuntimeError(f"{type(exc).__name__}: {exc}")))
        os._exit(1)  # threads stuck on a collective must not hold the exit


class _RankLoop:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.mirror = SequenceMirror()
        self.handlers: dict[str, Callable[[Any], Any]] = {
            "swap": runner.swap,
            "start_swap_outs": runner.start_swap_outs,
            "land_swap_outs": lambda request_ids: runner.land_swap_outs(wait=True, only=request_ids),
            "execute": lambda order: runner.execute(self.mirror.batch(order)),
            "profile": lambda _: runner.profile(),
            "state": self.state,
        }

    def serve(self, conn: Connection) -> None:
        with self.runner.device_scope():
            while (message := conn.recv())[0] != "stop":
                command, payload, answer = message
                result = self.handlers[command](payload)
                if answer:
                    conn.send(("reply", result))

    def state(self, finished: list[str]) -> RankState:
        self.mirror.forget(finished)
        return RankState(len(self.mirror.seqs), self.runner.swaps_in_flight)


class TensorParallelRunner:
    """Rank 0's ModelRunner (`local`, whose attributes it shows) with every step relayed to the worker ranks."""

    def __init__(
        self,
        config: EngineConfig,
        model_cfg: ModelConfig,
        source: ModelSource,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        size = config.tensor_parallel_size
        TensorParallel(0, size).rank_config(model_cfg)  # head counts that do not divide fail before any process
        if dist.is_initialized():
            raise ConfigError(
                "torch.distributed is already initialized in this process: one tensor-parallel engine per process "
                "(close the other first)"
            )
        self.workers: list[_Worker] = []
        self.local: ModelRunner | None = None
        self.sender = StepSender()
        self._torch_threads = torch.get_num_threads()  # join_group sets this process's share; close restores it
        self._directory = tempfile.mkdtemp(prefix="neo-tp-")
        specs = [
            RankSpec(rank, size, f"file://{self._directory}/rendezvous", config, model_cfg, source, max_model_len)
            for rank in range(size)
        ]
        try:
            with _spawn_executable(_interpreter()):
                self.workers = [_spawn(spec) for spec in specs[1:]]
            self.local = ModelRunner(config, model_cfg, source, max_model_len, eos_token_ids, join_group(specs[0]))
            for worker in self.workers:
                self._receive(worker)  # its "ready", or the error it stopped with
        except BaseException as exc:
            error = None if isinstance(exc, NeoError) else self._worker_error()  # a NeoError is typed already
            self.close()
            if error is not None:
                raise error from exc
            raise

    def __getattr__(self, name: str) -> Any:
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    # The steps, relayed -------------------------------------------------------------------------------------

    def swap(self, batch: SchedulerOutput) -> None:
        with self._in_step():
            if batch.swap_in or batch.land_swap_outs or batch.swap_out:
                swaps = SchedulerOutput(
                    swap_in=batch.swap_in, land_swap_outs=batch.land_swap_outs, swap_out=batch.swap_out
                )
                self._tell("swap", swaps)
            self.local.swap(batch)

    def start_swap_outs(self, swaps: list[SwapOut]) -> None:
        with self._in_step():
            if swaps:
                self._tell("start_swap_outs", swaps)
            self.local.start_swap_outs(swaps)

    def land_swap_outs(self, wait: bool) -> list[str]:
        """Rank 0 lands what it lands; the workers then land exactly those."""
        with self._in_step():
            landed = self.local.land_swap_outs(wait)
            if landed:
                self._tell("land_swap_outs", landed)
            return landed

    def execute(self, batch: SchedulerOutput, previous: PendingSample | None = None) -> LaunchedStep:
        """`previous` is always None: steps run one at a time here (`overlap_steps`), so the workers' mirrored
        sequences hold every token."""
        with self._in_step():
            self._tell("execute", self.sender.order(batch))
            return self.local.execute(batch, previous)

    def profile(self) -> PerfModel:
        with self._in_step():
            self._tell("profile", None)
            return self.local.profile()

    def rank_states(self) -> list[RankState]:
        """Every worker's state, in rank order (after the requests finished so far are dropped)."""
        with self._in_step():
            finished = self.sender.finished()
            for worker in self.workers:
                worker.conn.send(("state", finished, True))
            return [self._receive(worker) for worker in self.workers]

    # Failure and shutdown -----------------------------------------------------------------------------------

    @property
    def lost_rank(self) -> str | None:
        """Why a worker is gone, if one is (safe from any thread: reads no pipe)."""
        dead = next((w for w in self.workers if w.process.exitcode is not None), None)
        return None if dead is None else _death(dead, None)

    def close(self) -> None:
        """Stop every worker (killed if it does not stop in time), then this process's side of the group."""
        workers, self.workers = self.workers, []
        for worker in workers:
            with contextlib.suppress(OSError):
                worker.conn.send(("stop", None, False))
        if dist.is_initialized():
            dist.destroy_process_group()  # a worker waiting on a collective with rank 0 fails and exits
        for worker in workers:
            worker.process.join(STOP_TIMEOUT_S)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
        if self.local is not None:
            self.local.close()
        torch.set_num_threads(self._torch_threads)
        shutil.rmtree(self._directory, ignore_errors=True)

    def _tell(self, command: str, payload: Any) -> None:
        for worker in self.workers:
            worker.conn.send((command, payload, False))

    def _receive(self, worker: _Worker) -> Any:
        wait([worker.conn, worker.process.sentinel])
        kind, value = worker.conn.recv()  # EOFError where the worker died without a word
        if kind == "error":
            raise value
        return value

    @contextlib.contextmanager
    def _in_step(self) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            raise EngineDeadError(self._failure(exc)) from exc

    def _failure(self, exc: Exception) -> str:
        dead = self._dead_worker()
        if dead is not None:
            return _death(dead, _sent_error(dead))
        return (
            f"tensor-parallel rank 0 failed mid-step ({type(exc).__name__}: {exc}); the ranks' collectives are out "
            f"of step, so the engine stops: restart it"
        )

    def _worker_error(self) -> NeoError | None:
        """At start-up: the error a worker sent (typed, as it raised it), or its death, if one has failed."""
        dead = self._dead_worker()
        if dead is None:
            return None
        sent = _sent_error(dead)
        return sent if isinstance(sent, NeoError) else EngineDeadError(_death(dead, sent))

    def _dead_worker(self) -> _Worker | None:
        """A worker that has exited, waiting up to DEATH_GRACE_S for one that is exiting."""
        sentinels = {w.process.sentinel: w for w in self.workers}
        ready = wait(list(sentinels), DEATH_GRACE_S) if sentinels else []
        if not ready:
            return None
        dead = sentinels[ready[0]]
        dead.process.join(DEATH_GRACE_S)  # its sentinel closes before the kernel has its exit status to give
        return dead


def _interpreter() -> str:
    """The Python the workers run: a program that embeds Python (Triton's python-backend stub) has for
    sys.executable whichever `python3` its PATH finds first, so there it is this environment's own interpreter.
    The stub's `__main__` is no file: a worker imports no main module, so not the stub's model.py."""
    if os.path.realpath(sys.executable) == os.path.realpath("/proc/self/exe"):
        return sys.executable
    interpreter = Path(sys.prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    if not os.access(interpreter, os.X_OK):
        raise ConfigError(
            f"tensor_parallel_size > 1 needs a Python interpreter for its worker ranks, and this process "
            f"({os.path.realpath('/proc/self/exe')}) embeds Python without {interpreter}: run it from an "
            f"environment that has one, or set tensor_parallel_size=1"
        )
    return str(interpreter)


@contextlib.contextmanager
def _spawn_executable(interpreter: str) -> Iterator[None]:
    """multiprocessing's spawn executable is process-wide: ours only while the workers (and the resource tracker
    they may start) are launched, so other code in this process keeps its own."""
    previous = multiprocessing.spawn.get_executable()
    multiprocessing.spawn.set_executable(interpreter)
    try:
        yield
    finally:
        multiprocessing.spawn.set_executable(previous)


def _spawn(spec: RankSpec) -> _Worker:
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=serve_rank, args=(spec, theirs), name=f"neo-tp-rank{spec.rank}", daemon=True)
    process.start()
    theirs.close()  # the worker holds the only other end: its death is EOF here, and a send fails
    return _Worker(spec.rank, process, ours)


def _sent_error(worker: _Worker) -> Exception | None:
    """The error a worker sent before it exited, if it sent one."""
    with contextlib.suppress(EOFError, OSError):
        while worker.conn.poll():
            kind, value = worker.conn.recv()
            if kind == "error":
                return value
    return None


def _death(worker: _Worker, error: Exception | None) -> str:
    code = worker.process.exitcode
    how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with code {code}"
    cause = f": {type(error).__name__}: {error}" if error is not None else ""
    return (
        f"tensor-parallel rank {worker.rank} (pid {worker.process.pid}) {how}{cause}; the engine cannot go on "
        f"without it: restart it"
    )
