r"""Tune launch parameters on this machine and save every run under ``results/``.

``python -m fastpar autotune [--quick] [--ops flatten,unflatten_into]`` (or
:func:`tune`) times every candidate of the search space (``fastpar/tuning_space.json``)
for each op, backend, dtype pair and size bucket, on the devices present, and merges the
results into ``<results>/autotune/<device-slug>.json`` (see :mod:`fastpar._tuning` for
where ``<results>`` is and how ops read it back).

Timing:

* CPU: candidates are measured in interleaved rounds (round ``r`` runs every candidate
  once, in a rotated order), so a neighbour's load on a shared machine hits all of them
  alike; each call is timed with ``time.perf_counter`` after warm-up rounds, and a
  candidate's figure is the median (spread: the interquartile range). Inputs rotate over
  several sets, and when all sets together would fit in the last-level cache a scratch
  buffer twice its size is written (untimed) before each call, so caches do not flatter
  small sizes; such a call is then the second with its candidate's parameters (the first,
  untimed, before the flush), since the ops re-resolve their bound launches when the
  forced parameters change, which no steady-state call pays (:func:`time_cpu`).
* CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls) in
  interleaved rounds too (:data:`CUDA_ROUNDS`, after an untimed one; round ``r`` times
  every candidate in a rotated order): a candidate's figure is the median of its rounds'
  medians. Timed one after another, the default first, in a full run on an H200, the
  float32 ``flatten`` and ``unflatten_into`` keys of the smallest bucket gave the default
  twice the others' time (67 and 75 against 30-35 us; in ``flatten`` the next two
  candidates took 60 us too: presumably the GPU's clocks ramping up from idle), and such
  order and drift effects picked winners. The default's host time per call is
  measured too (:func:`host_per_call`): where it reaches 90% of the call's median the
  GPU waits on the host, the kernels' parameters do not show, and the default is kept.
* The Triton interpreter (CPU tensors) and the ``torch`` backend are never tuned.

A candidate replaces the launcher's default only if, in the same run, its median beats
the default's by at least ``min_gain`` (3 %) and it was faster than the default in
clearly more than half of the rounds (a sign test, see :func:`_pick`);
otherwise the default is kept (and the file says why), so noise does not install a
config that is not clearly faster.

The results file keeps, per key ``op/backend/src->dst/b<bucket>``: the size and inputs
it was tuned at, every candidate with its median and quartiles, the default, and the
winner with its gain over the default, the reason it won and ``rounds_won`` (the rounds
in which the fastest candidate beat the default, also when that was too few and the
default was kept); plus a log of runs (timestamp, versions, load average). Writes hold a lock file (``filelock``) while they re-read, merge and replace
the file (temp file + ``os.replace``), so concurrent tuners never lose each other's keys
and readers never see half a file.

Adding an op (data, plus a runner if no existing one fits): add an entry to
``tuning_space.json``::

    "reduce_add_coalesced": {
      "runner": "fastpar.comm:autotune_runner",     # module:function, see below
      "end_to_end": true,                            # time the whole call; params are read
      "dtypes": [{"src": "float32", "dst": "float32"}],   #   by the op, not its launcher
      "sizes": [4194304, 33554432], "quick_sizes": [4194304],
      "backends": {"numba": {"device": "cpu",
                             "params": {"buffer_size": {"values": [1048576, 10485760, 67108864], "min": 1}},
                             "defaults": {"buffer_size": 10485760}}}}

A runner is ``runner(device, src_dtype, dst_dtype, scale, numel, n_sets) -> Work``: it
builds ``n_sets`` independent input sets of about ``numel`` elements on ``device`` and
returns one zero-argument callable per set, each running the public op once (which asks
:func:`fastpar._tuning.params` for its parameters: the tuner forces each candidate
there), and the bytes one call reads plus writes. For launcher parameters (not
``end_to_end``) the names are checked against the launcher's keyword arguments, and the
default comes from its signature.
"""
from __future__ import annotations

import datetime
import errno
import functools
import importlib
import itertools
import json
import logging
import math
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

from . import _dispatch, _tuning
from ._tuning import TuningWarning

log = logging.getLogger("fastpar.autotune")

#: Runs kept in a results file's log (the entries themselves are kept per key).
MAX_RUNS = 50
#: Input sets rotated through per key (the plan cache holds 8 plans by default: more
#: sets would time plan rebuilding, which a training loop never does).
MAX_SETS = 4
#: Rotate until the sets together exceed this many bytes, when memory allows.
ROTATE_BYTES = 128 << 20
#: Per-key time budget in seconds (full, quick) and rounds bounds.
BUDGET_S = {"full": 4.0, "quick": 1.0}
MIN_ROUNDS, MAX_ROUNDS, WARMUP_ROUNDS = 7, 60, 2
#: CUDA: rounds per key (full, quick), and ``do_bench``'s warm-up and measuring time in
#: ms per round. The sign test needs ``n/2 + sqrt(n)`` wins of ``n`` rounds: 8 of 9, 5 of 5.
#: One more round runs first, untimed (:data:`CUDA_WARMUP_ROUNDS`).
CUDA_ROUNDS = {"full": 9, "quick": 5}
#: Rounds of every candidate run and discarded before the timed ones: the first
#: ``do_bench`` of a key (on the H200, the first few) ran slow, and a timed first round
#: would always give that slot to the default (round 0 starts with it).
CUDA_WARMUP_ROUNDS = 1
CUDA_ROUND_MS = {"full": (4, 12), "quick": (2, 8)}
#: A call whose host time per call is at least this share of its median is host-bound
#: (``bench`` marks such rows by it too): its kernel's launch parameters cannot be told apart.
HOST_BOUND = 0.9


class Work(NamedTuple):
    """What a runner returns: one callable per input set, bytes moved per call, and the
    tensors ``fns[0]`` writes (each candidate must write them as the defaults do)."""

    fns: list
    nbytes: int
    n_tensors: int
    outputs: list = []


# --------------------------------------------------------------------------- runners


def param_like_sizes(numel: int, seed: int = 0) -> list[int]:
    """Tensor sizes (elements) summing to ``numel``, log-uniform between 64 and
    ``numel / 8``: a mix of biases and weight matrices, as in a model's parameters."""
    rng = np.random.default_rng(seed)
    hi = max(64, numel // 8)
    sizes, total = [], 0
    while total < numel:
        s = int(math.exp(rng.uniform(math.log(64), math.log(hi)))) if hi > 64 else 64
        s = min(s, numel - total)
        sizes.append(s)
        total += s
    return sizes


def _tensor_sets(device, dtype, numel: int, n_sets: int) -> list[list[torch.Tensor]]:
    sizes = param_like_sizes(numel)
    return [[torch.randn(s, device=device).to(dtype) for s in sizes] for _ in range(n_sets)]


def flatten_runner(device, src_dtype, dst_dtype, scale, numel: int, n_sets: int) -> Work:
    """``fastpar.flatten(tensors, dtype=dst, scale=scale, out=buf)`` into a reused,
    already touched buffer (as the comm and DDP layers call it)."""
    import fastpar

    fns = []
    for ts in _tensor_sets(device, src_dtype, numel, n_sets):
        out = torch.zeros(numel, dtype=dst_dtype, device=device)
        fns.append(functools.partial(fastpar.flatten, ts, dtype=dst_dtype, scale=scale, out=out))
    return Work(fns, numel * (src_dtype.itemsize + dst_dtype.itemsize), len(param_like_sizes(numel)),
                [fns[0].keywords["out"]])


def unflatten_into_runner(device, src_dtype, dst_dtype, scale, numel: int, n_sets: int) -> Work:
    """``fastpar.unflatten_into(flat, tensors, scale=scale)``: ``flat`` of ``src`` dtype
    back into tensors of ``dst`` dtype."""
    import fastpar

    fns = []
    for ts in _tensor_sets(device, dst_dtype, numel, n_sets):
        flat = torch.randn(numel, device=device).to(src_dtype)
        fns.append(functools.partial(fastpar.unflatten_into, flat, ts, scale=scale))
    return Work(fns, numel * (src_dtype.itemsize + dst_dtype.itemsize), len(param_like_sizes(numel)),
                list(fns[0].args[1]))


#: Replicas a reduce_add candidate is timed with (the issue's headline K).
REDUCE_REPLICAS = 4


def reduce_add_runner(device, src_dtype, dst_dtype, scale, numel: int, n_sets: int) -> Work:
    """``fastpar.comm.reduce_add_coalesced(copies, device, out=out)`` of
    ``REDUCE_REPLICAS`` copies of one parameter-like list into reused, already touched
    ``out`` tensors (as DataParallel's backward reuses its gradients' memory)."""
    from fastpar import comm

    fns, outs = [], None
    for ts in _tensor_sets(device, src_dtype, numel, n_sets):
        copies = [ts] + [[t.clone() for t in ts] for _ in range(REDUCE_REPLICAS - 1)]
        out = [torch.zeros_like(t) for t in ts]
        outs = outs or out
        fns.append(functools.partial(comm.reduce_add_coalesced, copies, device, out=out))
    return Work(fns, numel * src_dtype.itemsize * (REDUCE_REPLICAS + 1), len(param_like_sizes(numel)), outs)


def _resolve(dotted: str) -> Callable:
    mod, _, name = dotted.partition(":")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise _tuning.TuningFileError(f"runner {dotted!r}: cannot import it ({type(e).__name__}: {e})") from e


def launcher_defaults(op: str, backend: str, names) -> dict:
    """Defaults of ``names`` from the launcher's signature; raises if it lacks one."""
    accepted = _dispatch.launcher_keywords(backend, op)
    missing = [n for n in names if n not in accepted]
    if missing:
        fn = _dispatch._kernel(backend, op)
        raise _tuning.TuningFileError(
            f"search space lists {', '.join(missing)} for the {backend} {op} launcher, but it accepts "
            f"only {', '.join(accepted) or 'no keyword parameters'} ({fn.__module__}.{fn.__qualname__})"
        )
    return {n: accepted[n] for n in names}


# --------------------------------------------------------------------------- timing


@functools.cache
def llc_bytes() -> int:
    """Largest CPU cache (bytes), from sysfs; 32 MiB when unknown."""
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in base.glob("index*"):
        try:
            text = (idx / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best or 32 << 20


def _stats(times: list[float]) -> dict:
    """Median, quartiles, minimum and count; ``_times`` keeps the per-round times (in
    round order, for paired comparisons; not saved)."""
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [times[0]] * 3
    return {"median_s": statistics.median(times), "q25_s": q[0], "q75_s": q[2], "min_s": min(times),
            "reps": len(times), "_times": list(times)}


def time_cpu(variants, *, budget_s: float, flush: Callable | None = None,
             min_rounds: int = MIN_ROUNDS, max_rounds: int = MAX_ROUNDS, warmup: int = WARMUP_ROUNDS,
             progress=None, settle: bool = False) -> list[dict]:
    """Time ``variants`` (each ``(prepare, fns)``: ``prepare()`` untimed, then one of
    ``fns`` timed, rotating) in interleaved rounds; return per-variant statistics.

    With ``flush`` (inputs small enough to stay cached), the chosen ``fns`` entry is first
    called once untimed after ``prepare()``, then ``flush()`` runs and the same entry is
    timed. The ops keep their launches bound with the tuned parameters resolved
    (:mod:`fastpar._flatten`'s bound calls, the DDP hooks' passes) and resolve them again
    when the forced parameters change, which a steady-state call never sees: timed
    straight after the switch, a 2.6 MB flatten took 66 us with the default and 85 us
    serial, against 36 and 58 us in a loop, and on those inflated, flushed figures a
    serial winner that ran 20-30% slower than the default was picked. Without ``flush``
    (inputs that together overflow the cache: calls of hundreds of microseconds or more,
    which the same few tens of microseconds only dilute), the timed call is the first
    after the switch, so that it does not find its own inputs cached by an untimed one;
    ``settle=True`` makes the untimed call anyway (``python -m fastpar bench``, whose
    providers each reuse one set of inputs: every one, torch's included, is then timed
    on the second of two calls in a row)."""
    perf = time.perf_counter
    for _ in range(warmup):
        for prepare, fns in variants:
            prepare()
            for f in fns:
                f()
    times: list[list[float]] = [[] for _ in variants]
    n = len(variants)
    start = perf()
    r = 0
    while r < max_rounds and (r < min_rounds or perf() - start < budget_s):
        for k in range(n):
            i = (k + r) % n  # rotate the order: no candidate always runs first
            prepare, fns = variants[i]
            prepare()
            f = fns[r % len(fns)]
            if settle or flush is not None:
                f()  # untimed: resolves the op's bound launch for these parameters
            if flush is not None:
                flush()
            t0 = perf()
            f()
            times[i].append(perf() - t0)
        r += 1
        if progress is not None:
            progress()
    return [_stats(t) for t in times]


def host_per_call(fn, sync, *, calls: int = 20, bursts: int = 3) -> float:
    """Seconds of the caller's time per call of ``fn``: the best of ``bursts`` bursts of
    ``calls`` calls with nothing synchronised inside a burst (``sync()`` before each, and
    once at the end). Where it reaches the device's time per call, the device waits on
    the host between calls, and ``do_bench`` times the host, not the kernels (on an H200
    a K=4 Transformer reduce took 340 us a call around a kernel of 204 us)."""
    best = math.inf
    for _ in range(bursts):
        sync()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    sync()
    return best


def cuda_host_per_call(prepare, fns) -> float:
    """:func:`host_per_call` of one variant (``prepare()``, then its ``fns`` in turn) on
    CUDA, where the bursts are synchronised with the device."""
    prepare()
    cyc = itertools.cycle(fns)
    return host_per_call(lambda: next(cyc)(), torch.cuda.synchronize)


def time_cuda(variants, *, quick: bool, host: bool = False, rounds: int = 1) -> list[dict]:
    """Time ``variants`` (each ``(prepare, fns)``) with ``triton.testing.do_bench``
    (median and quartiles); with ``host``, also the host's time per call (``host_s``,
    :func:`host_per_call`). ``rounds`` > 1 times them in interleaved rounds
    (:func:`time_rounds`, :data:`CUDA_ROUND_MS` per round), with the per-round medians
    kept for :func:`_pick`'s sign test; 1 times each once, with 25 ms of warm-up and
    100 ms measured (10 and 40 with ``quick``; ``bench``)."""
    import triton.testing

    def warm(prepare, fns):
        prepare()
        for f in fns:  # compile this candidate's kernel before do_bench sizes its loop
            f()
        torch.cuda.synchronize()

    def measure(fns, warmup, rep):
        cyc = itertools.cycle(fns)
        q25, med, q75 = triton.testing.do_bench(lambda: next(cyc)(), warmup=warmup, rep=rep,
                                                quantiles=[0.25, 0.5, 0.75])
        return q25 / 1e3, med / 1e3, q75 / 1e3

    if rounds > 1:
        warmup, rep = CUDA_ROUND_MS["quick" if quick else "full"]
        out = time_rounds(variants, warm, lambda fns: measure(fns, warmup, rep), rounds,
                          warmup_rounds=CUDA_WARMUP_ROUNDS)
        if host:
            for v, o in zip(variants, out):
                o["host_s"] = cuda_host_per_call(*v)
        return out
    out = []
    for prepare, fns in variants:
        warm(prepare, fns)
        q25, med, q75 = measure(fns, 10 if quick else 25, 40 if quick else 100)
        out.append({"median_s": med, "q25_s": q25, "q75_s": q75, "min_s": q25, "reps": None})
        if host:  # right after its do_bench, as bench has always measured it
            out[-1]["host_s"] = cuda_host_per_call(prepare, fns)
    return out


def time_rounds(variants, warm: Callable, measure: Callable, rounds: int, *,
                warmup_rounds: int = 0) -> list[dict]:
    """Per-variant statistics of ``rounds`` interleaved rounds: ``warm(prepare, fns)`` once
    each, then round ``r`` runs ``prepare()`` and ``measure(fns) -> (q25, median, q75)``
    seconds for every variant, in an order rotated by ``r`` (no candidate always runs
    first, as in :func:`time_cpu`). ``warmup_rounds`` rounds (``r`` < 0) run first and
    are discarded. A variant's ``median_s``/``q25_s``/``q75_s`` are the medians over its
    timed rounds; ``_times`` keeps its per-round medians in round order."""
    for prepare, fns in variants:
        warm(prepare, fns)
    per: list[list[tuple]] = [[] for _ in variants]
    n = len(variants)
    for r in range(-warmup_rounds, rounds):
        for k in range(n):
            i = (k + r) % n
            prepare, fns = variants[i]
            prepare()
            m = measure(fns)
            if r >= 0:
                per[i].append(m)
    out = []
    for rs in per:
        meds = [m for _, m, _ in rs]
        out.append({"median_s": statistics.median(meds), "q25_s": statistics.median(q for q, _, _ in rs),
                    "q75_s": statistics.median(q for _, _, q in rs), "min_s": min(q for q, _, _ in rs),
                    "reps": len(rs), "_times": meds})
    return out


# --------------------------------------------------------------------------- tuning


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _candidates(param_specs: dict, default: dict) -> list[dict]:
    names = list(param_specs)
    combos = [dict(zip(names, vals)) for vals in itertools.product(*(param_specs[n]["values"] for n in names))]
    rest = [c for c in combos if c != default]
    return [dict(default)] + rest  # the default first: it is the reference


def _pick(cands: list[dict], default: dict, min_gain: float) -> dict:
    """The winner: the fastest median, if it beats the default's by ``min_gain`` and, when
    per-round times exist (CPU; CUDA in rounds), is faster than the default in clearly
    more than half of the rounds (the same round ran both on the same inputs): at least
    ``n/2 + sqrt(n)`` of ``n``, two standard deviations above a coin toss. A sign test,
    because a thread pool on a shared machine gives bimodal times (worker awake or
    descheduled) whose quartiles overlap even when the medians are far apart. The
    default is kept, whatever the figures, when its ``host_s`` (host time per call)
    reaches :data:`HOST_BOUND` of its median: the call then times the host."""
    d = next(c for c in cands if c["params"] == default)
    best = min(cands, key=lambda c: c["median_s"])
    gain = d["median_s"] / best["median_s"] if best["median_s"] > 0 else 1.0
    out = {"params": dict(best["params"]), "median_s": best["median_s"], "gain_vs_default": round(gain, 4)}
    if best["params"] == default:
        return {**out, "reason": "the default is the fastest"}
    why = None
    host = d.get("host_s")
    if host is not None and host >= HOST_BOUND * d["median_s"]:
        why = (f"{100 * (gain - 1):.1f}% faster in median, but the default's call is host-bound "
               f"({1e6 * host:.1f} us of host time per call of a {1e6 * d['median_s']:.1f} us median): "
               "the launch parameters do not show")
    elif gain < 1 + min_gain:
        why = f"only {100 * (gain - 1):.1f}% faster (< min_gain {100 * min_gain:.0f}%)"
    elif best.get("_times") and d.get("_times"):
        n = min(len(best["_times"]), len(d["_times"]))
        wins = sum(b < a for b, a in zip(best["_times"][:n], d["_times"][:n]))
        out["rounds_won"] = f"{wins}/{n}"
        if wins < n / 2 + math.sqrt(n):
            why = (f"{100 * (gain - 1):.1f}% faster in median but faster in only {wins} of {n} rounds "
                   f"(needs {math.ceil(n / 2 + math.sqrt(n))}): within the noise")
    if why is not None:
        return {**out, "params": dict(default), "median_s": d["median_s"], "gain_vs_default": 1.0,
                "reason": f"default kept: the fastest candidate {best['params']} was {why}"}
    return {**out, "reason": f"{100 * (gain - 1):.1f}% faster than the default (median)"
            + (f", faster in {out['rounds_won']} rounds" if "rounds_won" in out else "")}


def _plan_jobs(space: dict, ops, device_type: str, quick: bool) -> list[dict]:
    jobs = []
    bounds = space["size_buckets"]
    for op, e in space["ops"].items():
        if ops is not None and op not in ops:
            continue
        for backend, be in e["backends"].items():
            if be["device"] != device_type:
                continue
            sizes = e.get("quick_sizes", e["sizes"]) if quick else e["sizes"]
            buckets = [_tuning.bucket_of(bounds, s) for s in sizes]
            if len(set(buckets)) != len(buckets):
                raise _tuning.TuningFileError(
                    f"search space ops.{op}: sizes {sizes} fall in buckets {buckets}; expected one size per bucket"
                )
            for d in e["dtypes"]:
                for size, bucket in zip(sizes, buckets):
                    jobs.append({"op": op, "backend": backend, "entry": e, "spec": be, "dtypes": d,
                                 "numel": size, "bucket": bucket})
    return jobs


def _poison(t: torch.Tensor) -> None:
    t.fill_(float("nan") if t.is_floating_point() else -123)


def verify_candidates(work: Work, cands: list, op: str, backend: str) -> None:
    """Run ``work.fns[0]`` once per candidate, untimed, into poisoned outputs, and raise
    ``RuntimeError`` unless each writes exactly what the launcher defaults write: a
    candidate that skips or garbles elements must never be timed, let alone win."""
    if not work.outputs:
        return
    ref = None
    for c in [None, *cands]:
        for t in work.outputs:
            _poison(t)
        with _tuning.forced({} if c is None else {(op, backend): c}):
            work.fns[0]()
        got = [t.clone() for t in work.outputs]
        if ref is None:
            ref = got
            continue
        bad = next((i for i, (a, b) in enumerate(zip(got, ref)) if not torch.equal(a, b)), None)
        if bad is not None:
            wrong = int((got[bad] != ref[bad]).sum())
            raise RuntimeError(
                f"autotune: {op} on {backend} with {c} wrote different values from the defaults "
                f"(output {bad}: {wrong} of {ref[bad].numel()} elements differ); the search space "
                "holds a candidate the launcher does not run correctly"
            )


def _tune_one(job: dict, device: torch.device, *, quick: bool, min_gain: float, bar) -> dict:
    op, backend, be, e = job["op"], job["backend"], job["spec"], job["entry"]
    pspecs = be["params"]
    if e.get("end_to_end", False):
        default = dict(be.get("defaults", e.get("defaults", {})))
        missing = [p for p in pspecs if p not in default]
        if missing:
            raise _tuning.TuningFileError(
                f"search space ops.{op}.backends.{backend}: end-to-end parameters {missing} need a "
                "value under 'defaults' (the op's own default)")
    else:
        default = launcher_defaults(op, backend, list(pspecs))
    src = _tuning.parse_dtype(job["dtypes"]["src"], "src")
    dst = _tuning.parse_dtype(job["dtypes"]["dst"], "dst")
    scale = job["dtypes"].get("scale")
    numel = job["numel"]
    runner = _resolve(e["runner"])
    set_bytes = numel * (src.itemsize + dst.itemsize)
    n_sets = max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / max(set_bytes, 1))))
    cands = _candidates(pspecs, default)
    with _dispatch.use_backend(backend):
        work = runner(device, src, dst, scale, numel, n_sets)
        verify_candidates(work, cands, op, backend)
        flush = None
        if device.type == "cpu" and set_bytes * len(work.fns) < 2 * llc_bytes():
            scratch = torch.empty(2 * llc_bytes(), dtype=torch.uint8)

            def flush(scratch=scratch):
                scratch.fill_(1)

        def prep(p):
            return lambda: setattr(_tuning, "_forced", {(op, backend): p})

        variants = [(prep(c), work.fns) for c in cands]
        bar.set_postfix_str(f"{op} {backend} {job['dtypes']['src']}->{job['dtypes']['dst']} "
                            f"{numel:,} el x{len(cands)}")
        try:
            if device.type == "cuda":
                stats = time_cuda(variants, quick=quick, rounds=CUDA_ROUNDS["quick" if quick else "full"])
                # The default's host time per call (cands[0] is the default).
                stats[0]["host_s"] = cuda_host_per_call(*variants[0])
            else:
                stats = time_cpu(variants, budget_s=BUDGET_S["quick" if quick else "full"], flush=flush)
        finally:
            _tuning._forced = None
    results = [{"params": c, **s, "gbps": round(work.nbytes / s["median_s"] / 1e9, 3) if s["median_s"] else None}
               for c, s in zip(cands, stats)]
    winner = _pick(results, default, min_gain)
    for r in results:  # per-round times served the paired test; the file keeps the summary
        r.pop("_times", None)
        for k, v in r.items():
            if isinstance(v, float):
                r[k] = float(f"{v:.4g}")
    winner["median_s"] = float(f"{winner['median_s']:.4g}")
    bounds = job["bounds"]
    return {
        "op": op, "backend": backend, "src_dtype": _tuning.dtype_name(src), "dst_dtype": _tuning.dtype_name(dst),
        "scale": scale, "bucket": job["bucket"], "bucket_numel": _tuning.bucket_range(bounds, job["bucket"]),
        "numel": numel, "tensors": work.n_tensors, "bytes": work.nbytes, "input_sets": len(work.fns),
        "cache_flushed": flush is not None,
        "timer": (f"triton.testing.do_bench, median of {CUDA_ROUNDS['quick' if quick else 'full']} interleaved "
                  f"rounds' medians (after {CUDA_WARMUP_ROUNDS} untimed); the default's host time per call "
                  "beside it") if device.type == "cuda"
        else "time.perf_counter median of interleaved rounds after warm-up"
        # (how time_cpu timed it: files tuned before the untimed call read as unflushed ones)
        + (", each timed call the second of two with its candidate's parameters (the first "
           "untimed, before the flush)" if flush is not None else ""),
        "timestamp": _now(), "default": default, "candidates": results,
        "winner": winner,
    }


def _space_subset(space: dict, jobs) -> dict:
    out: dict = {}
    for j in jobs:
        out.setdefault(j["op"], {})[j["backend"]] = {
            "params": j["spec"]["params"], "runner": j["entry"]["runner"],
            "end_to_end": j["entry"].get("end_to_end", False)}
    return out


def default_devices(types=None) -> list[torch.device]:
    """The devices :func:`tune` tunes by default: the CPU and one CUDA device per distinct
    GPU name (a tuned file is per kind of device); ``types`` (e.g. ``["cuda"]``) keeps
    those device types only."""
    found = [torch.device("cpu")]
    seen = set()
    for i in range(torch.cuda.device_count()):
        name = torch.cuda.get_device_name(i)
        if name not in seen:
            seen.add(name)
            found.append(torch.device("cuda", i))
    return [d for d in found if types is None or d.type in types]


def tune(ops=None, *, quick: bool = False, space=None, devices=None, root=None, progress: bool = True) -> dict:
    """Tune every op of the search space on every device present and save the results.

    Args:
        ops (list of str, optional): only these ops. Default: all in the space.
        quick (bool): ``quick_sizes`` and a shorter time budget per key.
        space (path, optional): search-space file. Default: the packaged one.
        devices (list of str or torch.device, optional): default ``cpu`` plus every
            CUDA device kind present (one device per distinct name,
            :func:`default_devices`).
        root (path, optional): results folder. Default: :func:`fastpar._tuning.results_dir`.
        progress (bool): show a tqdm progress bar (on stderr).

    Returns:
        dict: device slug -> ``{"path": saved file or None, "entries": {key: entry},
        "error": why it was not saved or None}``.
    """
    from tqdm.auto import tqdm

    space_doc = _tuning.load_space(space)
    known = set(space_doc["ops"])
    if ops is not None:
        unknown = [o for o in ops if o not in known]
        if unknown:
            raise ValueError(f"ops: {unknown} not in the search space; expected some of {sorted(known)}")
    root = Path(root).expanduser() if root is not None else _tuning.results_dir()
    min_gain = float(space_doc.get("min_gain", 0.03))
    devices = default_devices() if devices is None else [torch.device(d) for d in devices]
    if not torch.cuda.is_available():
        log.info("fastpar autotune: no CUDA device; Triton (its interpreter on CPU tensors) is never tuned: "
                 "its defaults are used")
    out = {}
    for device in devices:
        info = _tuning.device_info(device)
        jobs = _plan_jobs(space_doc, ops, device.type, quick)
        for j in jobs:
            j["bounds"] = space_doc["size_buckets"]
        if not jobs:
            continue
        # Validate the whole space against the launchers before spending any time.
        for j in jobs:
            if not j["entry"].get("end_to_end", False):
                launcher_defaults(j["op"], j["backend"], list(j["spec"]["params"]))
        t0 = time.perf_counter()
        load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        entries: dict = {}
        with tqdm(total=len(jobs), desc=f"autotune {info['slug']}", unit="key", disable=not progress,
                  dynamic_ncols=True) as bar:
            for j in jobs:
                ent = _tune_one(j, device, quick=quick, min_gain=min_gain, bar=bar)
                entries[_tuning.key_str(ent["op"], ent["backend"], ent["src_dtype"], ent["dst_dtype"],
                                        ent["bucket"])] = ent
                bar.update(1)
        run = {"timestamp": _now(), "quick": quick, "wall_s": round(time.perf_counter() - t0, 1),
               "versions": _tuning.versions(info["type"]), "keys": sorted(entries),
               "cpus": _tuning._cpu_count(), "numba_threads": _numba_threads(), "torch_threads": torch.get_num_threads(),
               "loadavg_1min": [load0, os.getloadavg()[0] if hasattr(os, "getloadavg") else None]}
        path, error = None, None
        try:
            path = save(entries, device=info, bounds=space_doc["size_buckets"],
                        space=_space_subset(space_doc, jobs), run=run, root=root)
        except (OSError, TimeoutError) as e:
            error = (f"cannot write the tuned results to {_tuning.autotune_path(info['slug'], root)} "
                     f"({type(e).__name__}: {e}); nothing was saved. Give a writable folder (--results-dir, "
                     "tune(root=...) or FASTPAR_RESULTS_DIR).")
            warnings.warn(f"fastpar autotune: {error}", TuningWarning, stacklevel=2)
        out[info["slug"]] = {"path": path, "entries": entries, "error": error}
    _tuning.reload()  # this process picks the new winners up on its next launch
    return out


def _numba_threads() -> int:
    import numba

    return numba.get_num_threads()


# --------------------------------------------------------------------------- saving


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_atomic(path: Path, text: str | bytes, *, exclusive: bool = False) -> None:
    """Write ``text`` (or bytes) to a temp file beside ``path``, fsync it, and rename it
    over ``path``: readers see the old file or the new one, never a partial one.

    ``exclusive``: never replace a file; raise ``FileExistsError`` when ``path`` exists
    (another run took the name first). The temp file is hard-linked to ``path``, which
    fails when the name exists, atomically; where the filesystem has no hard links, the
    name is claimed with ``O_EXCL`` and the temp file renamed over the empty claim."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    claimed = False
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; results are meant to be shared
        f = os.fdopen(fd, "wb") if isinstance(text, bytes) else os.fdopen(fd, "w", encoding="utf-8")
        with f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if not exclusive:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:  # no hard links here (FAT, some network filesystems)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            claimed = True
            os.replace(tmp, path)
            return
    except BaseException:
        for p in ((tmp, path) if claimed else (tmp,)):
            try:
                os.unlink(p)
            except OSError:
                pass
        raise
    try:  # linked: the temp name is left to drop
        os.unlink(tmp)
    except OSError:
        pass


def dumps(obj, indent: int = 0, width: int = 140) -> str:
    """JSON with every object or list that fits in ``width`` columns on one line (one
    candidate per line), so tuned files read well in review and diff by candidate."""
    flat = json.dumps(obj, allow_nan=False)
    if len(flat) + indent <= width or not isinstance(obj, (dict, list)) or not obj:
        return flat
    pad = " " * (indent + 1)
    if isinstance(obj, dict):
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 1, width)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [f"{pad}{dumps(v, indent + 1, width)}" for v in obj]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def _entry_fits(entry: dict, space: dict) -> bool:
    specs = space.get(entry["op"], {}).get(entry["backend"], {}).get("params")
    if specs is None:
        return False
    try:
        for p, v in entry["winner"]["params"].items():
            if p not in specs:
                return False
            _tuning.check_param_value(v, specs[p], p)
    except _tuning.TuningFileError:
        return False
    return True


def save(entries: dict, *, device: dict, bounds: list, space: dict, run: dict, root=None,
         lock_timeout: float = 300.0) -> Path:
    """Merge ``entries`` into ``<root>/autotune/<slug>.json`` under a lock and replace it
    atomically. An existing file that fails validation is kept beside it as
    ``<slug>.json.rejected`` (one warning); one from other versions or other size
    buckets as ``<slug>.json.prev``. Returns the path written."""
    from filelock import FileLock

    root = Path(root).expanduser() if root is not None else _tuning.results_dir()
    path = _tuning.autotune_path(device["slug"], root)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(path.parent, os.W_OK):  # fail before taking the lock, with a clear message
        raise PermissionError(errno.EACCES, "the results folder is not writable", str(path.parent))
    current = _tuning.versions(device["type"])
    with FileLock(str(path.parent / f".{path.name}.lock"), timeout=lock_timeout):
        old, aside = None, None  # aside: (suffix, text) of a file to keep beside the new one
        if path.exists():
            text = path.read_bytes()  # kept aside byte for byte, whatever it holds
            try:
                old = _tuning.parse_json(text.decode("utf-8"))
                # With the versions: a file another version tuned is set aside as that
                # (.prev), before its winners are held to this version's limits (which
                # it may not meet: it would have been called invalid, .rejected).
                _tuning.validate_results(old, slug=device["slug"], current_versions=current)
            except ValueError as e:  # UnicodeDecodeError and TuningFileError among them
                if isinstance(e, _tuning.TuningVersionError):
                    aside, old = (".prev", text), None
                    log.info("fastpar autotune: %s was tuned with other versions; keeping it as %s.prev",
                             path, path.name)
                else:
                    aside, old = (".rejected", text), None
                    warnings.warn(f"fastpar autotune: {path} was not a valid tuned file ({e}); keeping it as "
                                  f"{path.name}.rejected and starting a new one", TuningWarning, stacklevel=3)
            else:
                if old["size_buckets"] != bounds:
                    aside, old = (".prev", text), None
                    log.info("fastpar autotune: %s was tuned with other size buckets; keeping it as %s.prev",
                             path, path.name)
        merged_space = {op: dict(b) for op, b in (old or {}).get("space", {}).items()}
        for op, bks in space.items():
            merged_space.setdefault(op, {}).update(bks)
        merged_entries = {k: v for k, v in (old or {}).get("entries", {}).items() if _entry_fits(v, merged_space)}
        merged_entries.update(entries)
        runs = list((old or {}).get("runs", [])) + [run]
        doc = {
            "schema": _tuning.SCHEMA,
            "device": device,
            "versions": current,
            "updated": _now(),
            "size_buckets": list(bounds),
            "space": merged_space,
            "runs": runs[-MAX_RUNS:],
            "entries": dict(sorted(merged_entries.items())),
        }
        doc["digest"] = _tuning.digest(doc)
        _tuning.validate_results(doc, slug=device["slug"], current_versions=current)
        # Copy the old file aside first, so a failed write leaves it where it was.
        if aside is not None:
            _write_atomic(path.with_name(path.name + aside[0]), aside[1])
        _write_atomic(path, dumps(doc) + "\n")
    return path


# --------------------------------------------------------------------------- report


def summary_rows(result: dict) -> list[dict]:
    """One row per tuned key: default and winner medians and the gain."""
    rows = []
    for slug, r in result.items():
        for key, e in r["entries"].items():
            d = next(c for c in e["candidates"] if c["params"] == e["default"])
            rows.append({"device": slug, "key": key, "numel": e["numel"], "default_ms": d["median_s"] * 1e3,
                         "winner_ms": e["winner"]["median_s"] * 1e3, "gain": e["winner"]["gain_vs_default"],
                         "winner": e["winner"]["params"] if e["winner"]["params"] != e["default"] else "default"})
    return rows


def print_summary(result: dict, file=None) -> None:
    """Print where each device's results went and a Markdown table of the keys."""
    if not torch.cuda.is_available():
        print("triton: not tuned (no CUDA device; the Triton interpreter is never tuned, its defaults are used)",
              file=file)
    for slug, r in result.items():
        print(f"{slug}: {'saved ' + str(r['path']) if r['path'] else 'NOT saved: ' + str(r['error'])}", file=file)
    print("| key | numel | default ms | tuned ms | gain | winner |", file=file)
    print("| --- | ---: | ---: | ---: | ---: | --- |", file=file)
    for row in summary_rows(result):
        w = row["winner"] if isinstance(row["winner"], str) else ", ".join(f"{k}={v}" for k, v in row["winner"].items())
        print(f"| {row['key']} | {row['numel']:,} | {row['default_ms']:.3f} | {row['winner_ms']:.3f} | "
              f"{row['gain']:.2f}x | {w} |", file=file)
