"""torch.distributed for precision gates: the process group, and one exchange that also carries failures.

Every collective the plugin runs is an `exchange`: each rank sends a small picklable payload and an error
(None when it is well) and gets every rank's payload back, on a gloo group of the plugin's own with a timeout.
A rank that fails sends its error in place of its payload, at the point where the others wait for it, so every
rank raises the same RankFailure instead of one waiting forever; a rank that died ends the others' wait at the
timeout with a message saying so.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import Any

from pytest_precision.base.errors import PrecisionError

#: Seconds a rank waits for the others in one of the plugin's collectives (and, where the plugin creates the
#: default process group, in the model's own): the `PYTEST_PRECISION_TIMEOUT` environment variable or 300.
TIMEOUT_ENV = "PYTEST_PRECISION_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0


class RankFailure(PrecisionError):
    """A rank of a distributed comparison failed (or stopped answering); raised on every rank alike."""


def timeout_s() -> float:
    """The collective timeout in seconds (see TIMEOUT_ENV)."""
    text = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise PrecisionError(f"{TIMEOUT_ENV}={text!r}: give the collective timeout as a positive number of seconds")
    return value


def active() -> bool:
    """Whether this process is one rank of an initialised process group of more than one rank."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def rank() -> int:
    """This process's rank (0 without a process group)."""
    import torch.distributed as dist

    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks (1 without a process group)."""
    import torch.distributed as dist

    return int(dist.get_world_size()) if dist.is_available() and dist.is_initialized() else 1


_GROUPS: dict[int, Any] = {}


def plugin_group() -> Any:
    """A gloo group over every rank with the plugin's timeout, made once per default group (every rank makes
    it at the same point: the first exchange)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    key = id(world)
    if key not in _GROUPS:
        _GROUPS.clear()
        timeout = datetime.timedelta(seconds=timeout_s())
        _GROUPS[key] = dist.new_group(backend="gloo", timeout=timeout)
    return _GROUPS[key]


def exchange(payload: Any, *, error: str | None = None) -> list[Any]:
    """Every rank's `payload`, in rank order; a RankFailure on every rank when any rank sent an `error`, or
    when the others did not answer within the timeout."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * world_size()
    try:
        dist.all_gather_object(gathered, (error, payload), group=plugin_group())
    except RuntimeError as failure:
        own = f"; this rank's own error: {error}" if error else ""
        raise RankFailure(
            f"rank {rank()}: the other ranks did not answer within {timeout_s():g} s (a rank died or is stuck in "
            f"another collective; {TIMEOUT_ENV} sets the wait){own} [{type(failure).__name__}: {failure}]"
        ) from None
    failures = [(index, sent[0]) for index, sent in enumerate(gathered) if sent[0] is not None]
    if failures:
        raise RankFailure(failure_message(failures, len(gathered)))
    return [sent[1] for sent in gathered]


def failure_message(failures: list[tuple[int, str]], ranks: int) -> str:
    """One message for the ranks' errors: once when every rank failed alike."""
    messages = {message for _, message in failures}
    if len(failures) == ranks and len(messages) == 1:
        return f"every rank failed: {failures[0][1]}"
    return "; ".join(f"rank {index} failed: {message}" for index, message in failures)


@contextlib.contextmanager
def failures_shared() -> Iterator[None]:
    """Run a block (or, as a decorator, a function) on every rank; an exception on one rank is sent to the
    others' next exchange and the block raises the same RankFailure on every rank. Without a process group, a
    plain block."""
    if not active():
        yield
        return
    try:
        yield
    except RankFailure:
        raise
    except Exception as error:
        exchange(None, error=f"{type(error).__name__}: {error}")
        raise AssertionError("unreachable: exchange raises when a rank sent an error") from error  # pragma: no cover


def init_from_environment() -> bool:
    """Initialise the default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)
    or the plugin's launcher's (PYTEST_PRECISION_STORE, a file store), unless one is initialised already;
    whether this call created it. gloo on CPU, nccl when CUDA is available and PYTEST_PRECISION_BACKEND
    does not say otherwise."""
    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available() or dist.is_initialized():
        return False
    backend = os.environ.get("PYTEST_PRECISION_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
    timeout = datetime.timedelta(seconds=timeout_s())
    store = os.environ.get("PYTEST_PRECISION_STORE")
    if store:
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    else:
        dist.init_process_group(backend, timeout=timeout)
    return True


def shut_down() -> None:
    """Destroy the default process group (and the plugin's group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # Every rank past its last collective before any tears a group down: on torch 2.6, gloo groups
        # destroyed while a peer was still finishing left both ranks waiting in destroy_process_group until
        # the timeout (seen: 3 of 9 torchrun runs on a loaded 2-core machine; none in 20 with the barriers).
        try:
            for group in _GROUPS.values():
                dist.barrier(group=group)
            dist.barrier()
        except RuntimeError:
            pass  # a peer that is gone (its failure is reported by the test): nothing left to wait for
        for group in _GROUPS.values():
            dist.destroy_process_group(group)
        dist.destroy_process_group()
    _GROUPS.clear()


__all__ = ["RankFailure", "active", "exchange", "failures_shared", "rank", "world_size"]
