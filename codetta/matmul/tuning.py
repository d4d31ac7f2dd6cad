"""Autotuning: time the candidate configs once per problem key, remember the winner on disk.

The cache is a JSON file (``$CODETTA_CACHE_DIR/tuning.json``, default
``~/.cache/codetta``) mapping a key (GPU, Triton version, program fingerprint,
layout, dtype, N, K, M rounded up to a power of two, the candidate list and the way they
were timed) to a config, so a second process does not re-tune. ``CODETTA_AUTOTUNE=0`` (or
false, no, off) skips timing and takes the first candidate.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import random
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..cache import cache_root, write_atomically
from .config import Config

_LOCK = threading.Lock()
_LOG = logging.getLogger("codetta")  # INFO: each tuning, its time and its choice
TIMING = "graph replay ~25 ms x 1"  # how candidates are timed (:func:`graph_ms`); part of the cache key
_MEMORY: dict[Path, dict] = {}  # cache file -> its table as this process knows it


def cache_file() -> Path:
    return cache_root() / "tuning.json"


def _read() -> dict:
    """The cache file's table; empty when it is missing, damaged or not a table. OSError when it
    is there but cannot be read (another user's, an I/O error): saving over it would drop its
    entries."""
    try:
        table = json.loads(cache_file().read_text())
    except (FileNotFoundError, ValueError, RecursionError):  # RecursionError: nested too deep to be a table
        return {}
    return table if isinstance(table, dict) else {}


def _load() -> dict:
    """The table of the cache file ``CODETTA_CACHE_DIR`` names now, read once per process."""
    file = cache_file()
    if file not in _MEMORY:
        try:
            _MEMORY[file] = _read()
        except OSError:  # tuned anew, and kept in memory (_save warns)
            _MEMORY[file] = {}
    return _MEMORY[file]


def _cached_config(entry, configs):
    """The config an entry of the table names, if it is one of ``configs`` (anything else: None)."""
    if not isinstance(entry, dict):
        return None
    try:
        cfg = Config(**entry)
    except (TypeError, ValueError):  # not a config's fields or values (an older or damaged file)
        return None
    return cfg if cfg in configs else None


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock between processes (``flock`` on ``path`` + ".lock"), held while the cache
    file is read, merged and replaced: without it, of two processes saving at once the last one's
    file would drop the other's new entries."""
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _save(key: str, entry: dict):
    """Add ``key`` to the cache file, keeping what other processes wrote since it was read (a
    process that tunes other shapes at the same time); an unwritable cache stays in memory."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            write_atomically(path, json.dumps({**_read(), key: entry}, indent=1, sort_keys=True))
    except OSError as exc:
        warnings.warn(f"codetta: cannot write the tuning cache {path} ({exc}); set CODETTA_CACHE_DIR to a writable "
                      "folder to keep tuning results across processes", stacklevel=3)


def compile_in_parallel(compiles):
    """Run ``compiles`` (functions that each compile a kernel through Triton's warmup) in a
    thread pool under Triton's AsyncCompileMode, and wait for them. Triton's compiler
    releases the GIL, so the candidates of a tuning compile side by side instead of one
    after the other (the tuning of a new shape is mostly compilation). A compile that fails
    here is left to fail again, and be skipped, when the tuner times it; where Triton has
    no AsyncCompileMode the kernels compile when first timed, as before."""
    try:
        from triton.runtime import _async_compile
    except ImportError:
        return
    if _async_compile.active_mode.get() is not None:  # the caller's own: leave it alone
        return
    workers = max(1, min(len(compiles), os.cpu_count() or 1, 16))
    try:
        with ThreadPoolExecutor(workers) as pool, _async_compile.AsyncCompileMode(pool, ignore_errors=True):
            for compile_one in compiles:
                try:
                    compile_one()
                except Exception:  # noqa: BLE001 - as the tuner: a config that does not compile is not a candidate
                    continue
    except Exception:  # noqa: BLE001 - a speed-up only: the tuner compiles what is missing when it times it
        return


def graph_ms(fn, *, budget_ms: float = 25.0, replays: int = 1) -> float:
    """The GPU time in ms of one call of ``fn``, launched back to back as a training step
    launches its kernels: the median of ``replays`` replays of a CUDA graph of as many calls
    as take about ``budget_ms`` (one replay for the tuner: its rounds repeat the timing).

    The H200 slows under a steady load: cuBLAS's 16384 x 4096 x 4096 GEMM took 0.709 ms in
    ~5 ms graphs after an idle pause, 0.758 ms after a second of load, 0.821 ms in ~25 ms
    graphs and 0.839 ms in ~100 ms graphs (bench/results/tuner_timing.md). Configs do not
    slow alike: in short graphs (and with ``triton.testing.do_bench``, which flushes the L2
    cache between calls) two CTAs per SM ranked ahead for the O-projection + residual +
    norm-statistics GEMM, in ~25 ms graphs the 128 x 256 tiles did, as they do in long runs
    (4.6% ahead in ~100 ms graphs, 3.8% inside the operator: config_ab.md). Short of
    ~100 ms graphs, which would make a tuning several seconds long, ~25 ms ones rank the
    best first; the tuner's rounds keep the GPU loaded.
    """
    import torch

    torch.cuda.synchronize()  # the inputs are ready (their producers may still be queued)
    fn()  # compiled and launched once outside the graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    calls = max(1, min(200, int(budget_ms / max(start.elapsed_time(end), 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


_SWITCH = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def autotune_enabled() -> bool:
    """``CODETTA_AUTOTUNE``: 1, true, yes, on (the default, also when empty) or 0, false, no, off."""
    value = os.environ.get("CODETTA_AUTOTUNE") or "1"
    if value.strip().lower() not in _SWITCH:
        raise ValueError(f"CODETTA_AUTOTUNE={value!r}: expected 1 or 0 (true, yes, on; false, no, off)")
    return _SWITCH[value.strip().lower()]


_ROUNDS = 3
_KEPT_WITHIN = 1.15  # after the first round, only candidates this close to its best are timed again


def _timed_in_rounds(configs: list[Config], bench) -> dict:
    """config -> median of its times over _ROUNDS rounds, each timing the candidates in its own
    shuffled order (seeded: reproducible); after the first round only those within
    _KEPT_WITHIN of its best go on; without the candidates that failed.

    A GPU timed from idle runs at boost clocks for a while and slows under a long tensor-core
    load. Timed once each in table order, the H200 measured the first candidate of a
    16384 x 28672 x 4096 GEMM 10% faster than it runs in a training step, and the tuner kept
    picking it; with rounds in a fixed rotation it picked a config 7% slower than the best
    (bench/config_sweep.py times them all side by side)."""
    times = {cfg: [] for cfg in configs}
    failed = set()
    alive = list(configs)
    for r in range(_ROUNDS):
        random.Random(r).shuffle(alive)
        for cfg in alive:
            try:
                times[cfg].append(bench(cfg))
            except Exception:  # a config that does not compile or run here is not a candidate  # noqa: BLE001
                failed.add(cfg)
        alive = [cfg for cfg in alive if cfg not in failed]
        if r == 0 and alive:
            best = min(times[cfg][0] for cfg in alive)
            alive = [cfg for cfg in alive if times[cfg][0] <= _KEPT_WITHIN * best]
    return {cfg: sorted(times[cfg])[len(times[cfg]) // 2] for cfg in alive}


def _log_timings(key: str, timings: dict, best: Config):
    """Append the times of the candidates that went through every round to the file named by
    CODETTA_TUNE_LOG, if set (for the benchmarks: which configs come close, not only which won);
    a file that cannot be written gets a warning."""
    path = os.environ.get("CODETTA_TUNE_LOG")
    if not path:
        return
    record = {"key": key, "best": best.as_dict(),
              "ms": sorted(([t, c.as_dict()] for c, t in timings.items()), key=lambda x: x[0])}
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as exc:
        warnings.warn(f"codetta: cannot append to CODETTA_TUNE_LOG={path!r} ({exc})", stacklevel=3)


def cache_key(key: str, configs: list[Config]) -> str:
    """The cache file's key of a tuning: a new candidate list, or a new way of timing them, tunes again."""
    return f"{key}|{TIMING}|{hashlib.sha256(repr(configs).encode()).hexdigest()[:8]}"


def choose(key: str, configs: list[Config], bench, prepare=None, cannot_time: str | None = None) -> Config:
    """The best of ``configs`` for ``key``; ``bench(cfg)`` returns its time in ms (or raises).

    ``prepare(configs)``, if given, runs before the timings when they are needed (e.g. to
    compile every candidate at once). ``cannot_time``: why the candidates cannot be timed
    now (a CUDA graph being captured); then a choice made before is taken, else the first
    candidate, with a warning, and nothing is written.
    """
    if len(configs) == 1 or not autotune_enabled():
        return configs[0]
    key = cache_key(key, configs)
    with _LOCK:
        hit = _load().get(key)
        cfg = _cached_config(hit, configs)
        if cfg is not None:
            return cfg
        if cannot_time is not None:
            warnings.warn(f"codetta: a GEMM runs untuned, with its first candidate config: {cannot_time}",
                          stacklevel=2)
            return configs[0]
        start = time.perf_counter()
        if prepare is not None:
            prepare(configs)
        timings = _timed_in_rounds(configs, bench)
        if not timings:
            return configs[0]
        best = min(timings, key=timings.get)
        _LOG.info("codetta: tuned %s in %.1f s over %d candidates: %s, %.4f ms", key, time.perf_counter() - start,
                  len(configs), best, timings[best])
        _load()[key] = best.as_dict()
        _save(key, best.as_dict())
        _log_timings(key, timings, best)
        return best
