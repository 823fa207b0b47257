"""`speculators datagen --ray-address`: the N shards of one job as Ray tasks, one bar over all.

Each shard is one Ray task that asks for what one copy of the target needs (tensor x pipeline
parallel size GPUs; on a cluster without GPUs, that many CPUs) and runs the shard as its own
process (`shard_process`), its output appended to `<output-dir>/logs/shard-I-of-N.log`. The
shards write into one folder by the ordinary folder protocol, so the result equals an unsharded
run's sample files, and a failed or killed shard is simply started again: it resumes where it
stopped. A shard that fails more than `max_retries` times, or stops on a mistake in the flags or
the data (which any retry would repeat), fails the run with its error and its log.

Ray is optional: it is imported only here and only when asked for.

The target's config.json is read once here and once in each shard (#49 item 2 leaves it so):
here to refuse a wrong model path or `--layer-ids` in one line before Ray and N tasks start;
in each shard because a shard is its own `speculators datagen` process, started from flags on
whichever node Ray picks, that reads the model folder on that node (its engine loads it there
anyway). Handing the driver's reading on would take a flag no user should give, or a file, and
would check the driver's copy of the model instead of the node's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculators_vllm016.data_generation.completeness import expected_sample_names
from speculators_vllm016.data_generation.manifest import read_manifest
from speculators_vllm016.data_generation.options import DatagenOptions
from speculators_vllm016.data_generation.output_folder import DatagenFolder
from speculators_vllm016.data_generation.preflight import inspect_model
from speculators_vllm016.data_generation.resume import STATE_FILE
from speculators_vllm016.data_generation.shard_process import (
    AttemptResult,
    run_shard_attempt,
    shard_arguments,
    shard_log_path,
)
from speculators_vllm016.utils.errors import (
    InvalidInputError,
    RunFailedError,
    SpeculatorsError,
    type_and_first_line,
)
from speculators_vllm016.utils.stop_signals import StopSignals

__all__ = [
    "LOCAL",
    "RAY_MISSING",
    "FolderProgress",
    "ShardedRunSummary",
    "run_shards_on_ray",
    "shard_resources",
]

logger = logging.getLogger(__name__)

LOCAL = "local"  # --ray-address local: start a Ray instance on this machine for the run
RAY_MISSING = (
    "--ray-address needs Ray, which is not installed; install it with "
    "pip install 'speculators-vllm016[ray]' (or pip install 'ray>=2.40')"
)
POLL_SECONDS = 1.0
CONNECT_SECONDS = 10.0  # to find a cluster's address listening
CANCEL_SECONDS = 30.0  # for cancelled shard tasks to kill their processes and end
# Ray's object store only carries the tasks' small results (hidden states go through the folder).
LOCAL_OBJECT_STORE_BYTES = 128 * 2**20


class ShardFailed(RunFailedError):
    """A shard stopped on a mistake, or failed more often than the retries allow."""


class StopRequested(SpeculatorsError):
    """SIGTERM reached the command (a scheduler, `timeout`): the running shards were cancelled."""


@contextlib.contextmanager
def sigterm_handler_kept() -> Iterator[None]:
    """SIGTERM's handler back as the caller had it when the block ends: Ray's start-up sets one
    of its own (it exits the process) and its shutdown leaves it: a caller that goes on running (a
    notebook, a pipeline) would meet Ray's handler at its next SIGTERM instead of its own."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


def require_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise InvalidInputError(RAY_MISSING) from None
    return ray


@dataclass
class ShardedRunSummary:
    """What the N shards did together."""

    output_dir: str
    num_shards: int
    samples_total: int
    samples_written: int
    samples_already_present: int
    tokens_extracted: int
    seconds: float  # the whole run, cluster start and every retry included
    retries: int
    shards: list[dict] = field(default_factory=list)  # each shard's own SUMMARY

    def describe(self) -> str:
        return (
            f"{self.num_shards} shards on Ray: {self.samples_written} samples written "
            f"({self.samples_already_present} already present) of {self.samples_total}; "
            f"{self.tokens_extracted} tokens extracted; {self.retries} retries; "
            f"{self.seconds:.1f} s in all; data in {self.output_dir}, logs in "
            f"{shard_log_path(self.output_dir, 0, self.num_shards).parent}"
        )

    @classmethod
    def of(
        cls, output_dir: str, results: list[AttemptResult], seconds: float, retries: int
    ) -> ShardedRunSummary:
        shards = [result.summary or {} for result in results]

        def total(key: str) -> int:
            return sum(int(shard.get(key, 0)) for shard in shards)

        return cls(
            output_dir=output_dir,
            num_shards=len(results),
            samples_total=total("samples_total"),
            samples_written=total("samples_written"),
            samples_already_present=total("samples_already_present"),
            tokens_extracted=total("tokens_extracted"),
            seconds=seconds,
            retries=retries,
            shards=shards,
        )


class FolderProgress:
    """One bar over every shard: the samples the folder's manifests list as whole, out of the
    samples its run record lists (known once the first shard has started its engine)."""

    def __init__(self, folder: Path, show: bool) -> None:
        from tqdm import tqdm

        self.folder = folder
        self.bar = tqdm(total=None, unit="sample", desc="Extracting", disable=not show)
        self.shown: tuple[int, int, int | None] | None = None

    def counts(self) -> tuple[int, int, int | None]:
        """(samples done, their tokens, samples in all or None while unknown)."""
        records = read_manifest(self.folder)
        expected = expected_sample_names(self.folder)
        if expected:
            records = {name: record for name, record in records.items() if name in expected}
        tokens = sum(record.length for record in records.values())
        recorded = (self.folder / STATE_FILE).is_file()
        return len(records), tokens, len(expected) if recorded else None

    def refresh(self) -> bool:
        """Redraw the bar if the counts changed (a bar redrawn every wait of the scheduler would
        print `100%` again and again where the terminal keeps no carriage return); True if so."""
        counts = self.counts()
        if counts == self.shown:
            return False
        self.shown = counts
        done, tokens, total = counts
        if total is not None and self.bar.total != total:
            self.bar.total = total
        self.bar.n = done
        self.bar.set_postfix(tokens=tokens, refresh=False)
        self.bar.refresh()
        return True

    def close(self) -> None:
        self.refresh()
        self.bar.close()


def shard_resources(nodes: list[dict], per_shard: int) -> dict[str, int]:
    """Ray resources of one shard task: `per_shard` GPUs, or CPUs on a cluster without GPUs.

    Refused when no live node has that many: the task would wait for ever.
    """
    alive = [node.get("Resources", {}) for node in nodes if node.get("Alive", True)]
    kind = "GPU" if any(resources.get("GPU", 0) > 0 for resources in alive) else "CPU"
    largest = max((int(resources.get(kind, 0)) for resources in alive), default=0)
    if largest < per_shard:
        raise InvalidInputError(
            f"each shard needs {per_shard} {kind}s (--tensor-parallel-size x "
            f"--pipeline-parallel-size) on one node, but the largest node of the Ray cluster has "
            f"{largest}; lower the parallel sizes or add larger nodes"
        )
    if kind == "GPU":
        return {"num_gpus": per_shard, "num_cpus": 1}
    return {"num_cpus": per_shard}


def refuse_unreachable(address: str) -> None:
    """A `host:port` nobody listens on is refused at once (Ray itself retries it for minutes)."""
    if address in (LOCAL, "auto") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        where = (host.strip("[]") or "localhost", int(port))  # [::1]:6379 too
        with socket.create_connection(where, timeout=CONNECT_SECONDS):
            return
    except ValueError:
        problem = "not host:port"
    except OSError as error:
        problem = error.strerror or type(error).__name__
    raise InvalidInputError(
        f"cannot reach the Ray cluster at --ray-address {address} ({problem}); give the address "
        f"`ray start --head` printed, or --ray-address {LOCAL} to start Ray on this machine"
    )


def _connect(ray: Any, address: str) -> None:
    quiet = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}
    if address == LOCAL:
        ray.init(address=LOCAL, object_store_memory=LOCAL_OBJECT_STORE_BYTES, **quiet)
    else:
        try:
            ray.init(address=address, **quiet)
        except ConnectionError as error:
            raise InvalidInputError(
                f"cannot reach the Ray cluster at --ray-address {address} "
                f"({type_and_first_line(error)}); start it with `ray start --head` or use "
                f"--ray-address {LOCAL}"
            ) from None


def refuse_other_shard_count(output_dir: str, num_shards: int) -> None:
    """A folder whose record names another --num-shards, refused before Ray or an engine
    starts (each shard would refuse it only after both); the record is the folder's own."""
    import json

    record = Path(output_dir) / STATE_FILE
    try:
        recorded = json.loads(record.read_text()).get("num_shards")
    except (OSError, ValueError, AttributeError):
        return  # none, or unreadable: the shards' own check says so
    if isinstance(recorded, int) and recorded != num_shards:
        raise InvalidInputError(
            f"--num-shards {num_shards}: --output-dir {output_dir} holds a run of {recorded} "
            f"shards ({record}); give --num-shards {recorded} to resume it, or another --output-dir"
        )


def run_shards_on_ray(
    options: DatagenOptions,
    address: str,
    max_retries: int = 2,
    verbose: bool = False,
) -> ShardedRunSummary:
    """Run every shard of the job `options` describe on the Ray cluster at `address`."""
    options.validate()
    if options.output.shard_index != 0:
        raise InvalidInputError("--ray-address runs every shard itself; leave out --shard-index")
    if max_retries < 0:
        raise InvalidInputError(f"--ray-max-retries must be at least 0, got {max_retries}")
    refuse_other_shard_count(options.output.output_dir, options.output.num_shards)
    ray = require_ray()
    engine, output = options.engine, options.output
    inspect_model(engine.target_model_path, output.layer_ids, engine.trust_remote_code)
    output.output_dir = os.path.abspath(output.output_dir)
    refuse_unreachable(address)
    started = time.perf_counter()
    with sigterm_handler_kept():
        _connect(ray, address)
        try:
            # After Ray's start-up, which sets a SIGTERM handler too. SIGTERM only sets the flag,
            # which the scheduler checks between its waits (raising in the handler would land
            # inside Ray's C code); Ctrl-C stays Python's KeyboardInterrupt, which ends the wait.
            sigterm = StopSignals(doing="cancelling the running shards", signals=(signal.SIGTERM,))
            with sigterm.installed() as stop:
                return _run_connected(ray, options, max_retries, verbose, started, stop)
        finally:
            ray.shutdown()


def _run_connected(
    ray: Any,
    options: DatagenOptions,
    max_retries: int,
    verbose: bool,
    started: float,
    stop: threading.Event,
) -> ShardedRunSummary:
    """The run once connected: each shard's resources, the folder, the shards."""
    engine, output = options.engine, options.output
    per_shard = engine.tensor_parallel_size * engine.pipeline_parallel_size
    resources = shard_resources(ray.nodes(), per_shard)
    DatagenFolder(output.output_dir).prepare()
    scheduler = ShardScheduler(ray, options, resources, max_retries, verbose)
    results = scheduler.run(stop)
    return ShardedRunSummary.of(
        output.output_dir, results, time.perf_counter() - started, scheduler.retries
    )


class ShardScheduler:
    """Starts a task per shard, starts a failed shard again while retries are left, and keeps
    the bar up to date while waiting."""

    def __init__(
        self,
        ray: Any,
        options: DatagenOptions,
        resources: dict[str, int],
        max_retries: int,
        verbose: bool,
    ) -> None:
        self.ray, self.options, self.max_retries, self.verbose = ray, options, max_retries, verbose
        self.task = ray.remote(run_shard_attempt).options(max_retries=0, **resources)
        self.output_dir = Path(options.output.output_dir)
        self.num_shards = options.output.num_shards
        self.cwd = os.getcwd()
        self.retries = 0
        self.pending: dict[Any, tuple[int, int]] = {}  # task -> (shard, attempt)

    def log_path(self, shard: int) -> Path:
        return shard_log_path(self.output_dir, shard, self.num_shards)

    def submit(self, shard: int, attempt: int) -> None:
        arguments = shard_arguments(self.options, shard, self.verbose)
        reference = self.task.remote(shard, attempt, arguments, str(self.log_path(shard)), self.cwd)
        self.pending[reference] = (shard, attempt)

    def outcome(self, reference: Any, shard: int, attempt: int) -> AttemptResult:
        try:
            return self.ray.get(reference)
        except self.ray.exceptions.RayError as error:  # the worker or its node died
            return AttemptResult(shard, attempt, None, "?", error=type_and_first_line(error))

    def run(self, stop: StopSignals | None = None) -> list[AttemptResult]:
        """Every shard to its end; `stop` set (SIGTERM) cancels the running ones and raises."""
        finished: dict[int, AttemptResult] = {}
        progress = FolderProgress(self.output_dir, self.options.output.show_progress)
        try:
            for shard in range(self.num_shards):
                self.submit(shard, 1)
            while self.pending:
                ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=POLL_SECONDS)
                progress.refresh()
                if stop is not None and stop.requested:
                    raise StopRequested(
                        "SIGTERM: the running shards were stopped; run the same command to resume"
                    )
                for reference in ready:
                    shard, attempt = self.pending.pop(reference)
                    result = self.outcome(reference, shard, attempt)
                    if result.ok:
                        finished[shard] = result
                    else:
                        self.retry_or_fail(result)
        finally:
            self.cancel_pending()
            progress.close()
        return [finished[shard] for shard in range(self.num_shards)]

    def cancel_pending(self) -> None:
        """Stop the shards still running when the run fails or is interrupted. A cancelled task
        kills its shard's process group on its way out; one that does not end in time loses its
        worker (Ray kills a dead worker's child processes)."""
        references = list(self.pending)
        if not references:
            return
        for reference in references:
            self.ray.cancel(reference)
        _ended, running = self.ray.wait(
            references, num_returns=len(references), timeout=CANCEL_SECONDS
        )
        for reference in running:
            self.ray.cancel(reference, force=True)

    def retry_or_fail(self, result: AttemptResult) -> None:
        shard, log = result.shard_index, self.log_path(result.shard_index)
        which = f"shard {shard} of {self.num_shards}"
        if not result.retryable:
            raise ShardFailed(f"{which} stopped: {result.why()} (its log: {log})")
        if result.attempt > self.max_retries:
            times = "once" if result.attempt == 1 else f"{result.attempt} times"
            raise ShardFailed(
                f"{which} failed {times} (--ray-max-retries {self.max_retries}), "
                f"the last {result.why()}; see its log {log}"
            )
        self.retries += 1
        logger.warning(
            "%s failed on %s (%s); starting it again, retry %d of %d (log: %s)",
            which,
            result.host,
            result.why(),
            result.attempt,
            self.max_retries,
            log,
        )
        self.submit(shard, result.attempt + 1)
