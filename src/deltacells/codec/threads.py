"""Resolve ``n_threads`` the way scikit-learn does.

In a process forked from one that imported deltacells, ``None`` means one thread (see
:func:`effective_n_threads`).

``None`` means "as many as OpenMP would use": ``OMP_NUM_THREADS`` when set, otherwise the CPUs
this process may actually use (its affinity mask and any cgroup CPU quota, so a container limited
to 2 CPUs on a 64-core host gets 2). A negative count means "all but": ``-1`` is all usable CPUs,
``-2`` all but one, and so on.
"""

from __future__ import annotations

import functools
import math
import operator
import os
from pathlib import Path
from typing import Any

__all__ = ["check_n_threads", "effective_n_threads", "in_forked_child", "usable_cpu_count"]

_forked = False
#: Whether this process (or the one it was forked from) has asked for more than one thread,
#: i.e. may have started GNU OpenMP's thread pool.
_threads_started = False
_warned_in_child = False


def _after_fork_in_child() -> None:
    global _forked
    _forked = True
    usable_cpu_count.cache_clear()


def in_forked_child() -> bool:
    """Whether this process was forked from one that imported deltacells."""
    return _forked


def _cgroup_cpu_limit() -> float | None:
    """CPU quota of this process's cgroup (v2 ``cpu.max`` or v1 CFS quota), or None."""
    candidates = [
        (Path("/sys/fs/cgroup/cpu.max"), None),
        (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")),
        (Path("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us"),
         Path("/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us")),
    ]  # fmt: skip
    for quota_path, period_path in candidates:
        try:
            if period_path is None:
                quota, period = quota_path.read_text().split()[:2]
            else:
                quota, period = quota_path.read_text().strip(), period_path.read_text().strip()
        except (OSError, ValueError):
            continue
        if quota in ("max", "-1"):
            return None
        try:
            q, p = int(quota), int(period)
        except ValueError:
            continue
        if q > 0 and p > 0:
            return q / p
    return None


@functools.lru_cache(maxsize=1)
def usable_cpu_count() -> int:
    """CPUs this process may use: affinity mask, capped by the cgroup quota (at least 1).

    Computed once per process (reading cgroup files on every decode would cost more than
    decoding a small tile), like scikit-learn's cached CPU count.
    """
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        count = os.cpu_count() or 1
    limit = _cgroup_cpu_limit()
    if limit is not None:
        count = min(count, max(1, math.ceil(limit)))
    return max(1, count)


def _omp_num_threads() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n > 0 else None


os.register_at_fork(after_in_child=_after_fork_in_child)


def check_n_threads(n_threads: Any) -> int | None:
    """``n_threads`` as an int or None, refused by name if it is neither or is 0.

    Only a check: unlike :func:`effective_n_threads` it does not count as asking for threads,
    so a process that checks a loader's options (to give workers it forks later) leaves them
    free to decode on several threads.
    """
    if n_threads is not None:
        try:
            n_threads = operator.index(n_threads)
        except TypeError:
            raise TypeError(
                f"n_threads must be an int or None, not {type(n_threads).__name__}"
            ) from None
    if n_threads == 0:
        raise ValueError("n_threads=0 is not allowed; use None for the default or a count >= 1")
    return n_threads


def effective_n_threads(n_threads: int | None = None) -> int:
    """Number of threads to use for ``n_threads``.

    Parameters
    ----------
    n_threads
        ``None`` for the default (``OMP_NUM_THREADS``, else the usable CPUs), a positive count,
        or a negative count meaning "usable CPUs + 1 + n_threads" (``-1`` is all of them; at
        least 1, as scikit-learn resolves it; the command line refuses a count that leaves
        none).

    Returns
    -------
    int
        A count of at least 1.
    """
    n_threads = check_n_threads(n_threads)
    if n_threads is None:
        if _forked:
            # GNU OpenMP cannot start threads in a child forked from a process that already ran
            # a parallel region: it hangs. Default to one thread there (e.g. DataLoader workers
            # under fork); start workers with spawn to decode with several.
            return 1
        env = _omp_num_threads()
        count = env if env is not None else usable_cpu_count()
    elif n_threads < 0:
        count = max(1, usable_cpu_count() + 1 + n_threads)
    else:
        count = int(n_threads)
    if count > 1:
        if _forked and _threads_started:
            _warn_forked_child(count)
            return 1
        _note_threads_started()
    return count


def _note_threads_started() -> None:
    global _threads_started
    _threads_started = True


def _warn_forked_child(count: int) -> None:
    """An explicit thread count in a child forked after the parent ran parallel code: the
    child would hang in OpenMP, so it decodes on one thread, and says so once."""
    global _warned_in_child
    if _warned_in_child:
        return
    _warned_in_child = True
    import warnings

    warnings.warn(
        f"deltacells: n_threads={count} in a process forked after its parent decoded in "
        "parallel; GNU OpenMP would hang there, so one thread is used. Start workers with "
        "the 'spawn' or 'forkserver' method to decode with several threads.",
        RuntimeWarning,
        stacklevel=4,
    )
