"""pytest-benchmark helpers: providers measured in the same run, GB/s in ``extra_info``,
and a closing table of ratios (torch median / fastpar median) per group.

Run:  ``pytest benchmarks --benchmark-only --benchmark-json=results/benchmarks/<name>.json``
Compare two saved runs: ``pytest-benchmark compare results/benchmarks/a.json results/benchmarks/b.json``
(or ``--benchmark-storage=results/benchmarks --benchmark-save=NAME`` then
``--benchmark-compare``).
"""
from __future__ import annotations

import collections
import statistics
import time
import warnings


warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")

#: Provider measured as the baseline in each group, and the bandwidth ceiling.
BASELINE = "torch"
CEILING = "copy_"


#: Warm-up, the same for every provider: two calls, then as many more as fit in this many
#: seconds (counted from the end of the second call, see :func:`_warm_up`), so that the
#: rounds measure the steady state of a loop. Two calls were not enough on the VM these
#: figures come from:
#: * after a switch of workload, a 0.2 ms call of the tiny tensors took 0.6-0.9 ms for
#:   its first 3-6 calls (caches and TLB refilled) before settling;
#: * the guest returns free memory to the host (virtio-balloon free page reporting)
#:   about two seconds after it is freed, so a call that allocates 100+ MB after a pause
#:   takes host-side faults on its first 3-5 rounds (a fastpar LSTM pack: 140-180 ms,
#:   then 12 ms; a loop that allocates every step never pauses that long).
WARMUP_S = 0.5


def measure(benchmark, fn, nbytes: int, *, rounds: int = 10, setup=None, iterations: int = 1):
    """Time ``fn`` (median of ``rounds`` after the warm-up above; every provider of a
    group gets the same) and record GB/s, where ``nbytes`` counts bytes read plus
    written. ``iterations`` calls are timed together per round (and the median is per
    call): for calls of tens of microseconds, a single call per round is at the mercy of
    one timer tick or interrupt. Not with ``setup``, which runs before every call."""
    _warm_up(fn, setup)
    benchmark.pedantic(fn, setup=setup, rounds=rounds, warmup_rounds=0, iterations=iterations)
    median = benchmark.stats.stats.median
    benchmark.extra_info["bytes"] = nbytes
    benchmark.extra_info["GB/s"] = round(nbytes / median / 1e9, 3)
    return median


def _warm_up(fn, setup=None) -> None:
    """Two calls of ``fn``, then as many more as fit in ``WARMUP_S``. The window opens
    after the first two: a first call that compiles (the parallel plan check's first
    use by a 10,000-tensor list compiles for about a second) or builds a plan had used
    it all up, and the timed rounds then caught the cache and TLB refill instead (a
    0.1 ms tiny flatten measured 390, 315, 200, 145 ... 113 us over its 10 rounds)."""
    deadline = None
    calls = 0
    while calls < 2 or time.perf_counter() < deadline:
        if setup is not None:
            setup()
        fn()
        calls += 1
        if calls == 2:
            deadline = time.perf_counter() + WARMUP_S


#: Student's t 0.975 quantiles for 1-30 degrees of freedom (the 95% two-sided interval).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """Student's t 0.975 quantile for ``df`` degrees of freedom: the half-width factor of a
    95% interval of a mean from ``df + 1`` values (1.96, the normal one, only as ``df``
    grows: with the 6-10 rounds of the large groups it made the interval 13-24% too narrow).
    A table to 30, then the Cornish-Fisher expansion (within 1e-4 from there on)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 2 values, got df={df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959963984540054
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def interleaved(benchmark, steps: dict, *, rounds: int, iterations: int = 1,
                nbytes: dict | None = None, keep_values: bool = False) -> dict:
    """Time the providers of ``steps`` (``"fastpar"`` and ``"torch"`` and/or ``"copy_"``)
    alternately, the order rotated every round, so that load from other processes falls
    on all alike: the steadiest same-run comparison on a shared machine, where
    sequential rounds of one provider then another can land in different load (a
    DataParallel step measured 0.44-0.84x sequentially and 1.25x interleaved on the same
    VM within minutes; a 25 MB ``copy_`` took 0.9 ms in one run and 1.9 ms in the next).

    All are warmed up as in :func:`measure`, then ``rounds`` rounds each run every
    provider ``iterations`` times in a row (the per-call time is the round's mean).
    ``extra_info`` gets each provider's median per-call time (``<provider>_ms``); with
    both ``fastpar`` and ``torch``, their ratio (torch / fastpar) and the mean paired
    difference with its 95% interval (Student's t: how large a difference this run could
    resolve at all); with ``nbytes`` (bytes read plus written per call, per provider),
    each one's GB/s and, with ``copy_``, fastpar's share of ``copy_``'s bandwidth
    (``of_copy``).
    With ``keep_values``, returns each provider's per-round return values (of its last
    call in the round); otherwise every return value is dropped at once, as a loop
    calling the provider would drop it (a kept result would stop an allocator from
    reusing its memory)."""
    times = {k: [] for k in steps}
    values = {k: [] for k in steps}
    order = list(steps)

    def one_round():
        order.append(order.pop(0))  # rotate: every provider takes every position in turn
        for provider in order:
            fn = steps[provider]
            t0 = time.perf_counter()
            for _ in range(iterations):
                v = fn()
            times[provider].append((time.perf_counter() - t0) / iterations)
            if keep_values:
                values[provider].append(v)
            del v  # not alive during the next provider's call

    _warm_up(one_round)
    for v in (*times.values(), *values.values()):
        v.clear()
    benchmark.pedantic(one_round, rounds=rounds, warmup_rounds=0, iterations=1)
    med = {k: statistics.median(v) for k, v in times.items()}
    info = {f"{k}_ms": round(m * 1e3, 4) for k, m in med.items()}
    if "fastpar" in med and "torch" in med:
        diffs = [(t - f) * 1e3 for t, f in zip(times["torch"], times["fastpar"])]
        info.update(
            torch_minus_fastpar_ms=round(statistics.fmean(diffs), 4),
            ci95_ms=round(t975(len(diffs) - 1) * statistics.stdev(diffs) / len(diffs) ** 0.5, 4),
            ratio=round(med["torch"] / med["fastpar"], 3),
        )
    if nbytes is not None:
        gbs = {k: nbytes[k] / med[k] / 1e9 for k in med if k in nbytes}
        info.update({f"{k}_GB/s": round(v, 3) for k, v in gbs.items()})
        if "fastpar" in gbs and CEILING in gbs:
            info["of_copy"] = round(gbs["fastpar"] / gbs[CEILING], 3)
    benchmark.extra_info.update(info)
    return values


def _ratios(benchmarks):
    groups = collections.defaultdict(dict)
    for b in benchmarks:
        provider = (b.params or {}).get("provider") if hasattr(b, "params") else None
        if provider is None or not getattr(b, "stats", None):
            continue
        groups[b.group][provider] = b.stats.median
    rows = []
    for group, med in sorted(groups.items()):
        if BASELINE in med:
            for provider, m in sorted(med.items()):
                if provider not in (BASELINE, CEILING):
                    row = {"group": group, "provider": provider, "ratio": med[BASELINE] / m,
                           "median_ms": m * 1e3, "torch_ms": med[BASELINE] * 1e3}
                    if CEILING in med:
                        row["of_copy_ceiling"] = med[CEILING] / m
                    rows.append(row)
    return rows


def _interleaved_rows(benchmarks):
    keys = ("fastpar_ms", "torch_ms", "copy__ms", "ratio", "torch_minus_fastpar_ms", "ci95_ms", "of_copy")
    return [{"group": b.group, **{k: b.extra_info[k] for k in keys if k in b.extra_info}}
            for b in benchmarks if "fastpar_ms" in getattr(b, "extra_info", {})]


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["ratios"] = _ratios(benchmarks)
    output_json["interleaved"] = _interleaved_rows(benchmarks)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    tr = terminalreporter
    rows = _interleaved_rows(session.benchmarks)
    if rows:
        tr.section("fastpar vs torch / copy_, interleaved rounds (ratio = torch median / fastpar median)")
        tr.write_line(f"{'group':58s} {'fastpar ms':>11s} {'torch ms':>10s} {'ratio':>7s} "
                      f"{'torch - fastpar ms (95%)':>26s} {'of copy_':>9s}")
        for r in rows:
            torch_ms = f"{r['torch_ms']:10.3f}" if "torch_ms" in r else f"{'':10s}"
            ratio = f"{r['ratio']:7.2f}" if "ratio" in r else f"{'':7s}"
            diff = f"{r['torch_minus_fastpar_ms']:+.3f} +- {r['ci95_ms']:.3f}" if "ci95_ms" in r else ""
            ceil = f"{100 * r['of_copy']:8.0f}%" if "of_copy" in r else ""
            tr.write_line(f"{r['group']:58s} {r['fastpar_ms']:11.3f} {torch_ms} {ratio} {diff:>26s} {ceil:>9s}")
    rows = _ratios(session.benchmarks)
    if not rows:
        return
    tr.section("fastpar vs torch, same run (ratio = torch median / fastpar median)")
    tr.write_line(f"{'group':48s} {'provider':18s} {'fastpar ms':>11s} {'torch ms':>10s} {'ratio':>7s} {'of copy_':>9s}")
    for r in rows:
        ceil = f"{100 * r['of_copy_ceiling']:8.0f}%" if "of_copy_ceiling" in r else ""
        tr.write_line(f"{r['group']:48s} {r['provider']:18s} {r['median_ms']:11.3f} {r['torch_ms']:10.3f} {r['ratio']:7.2f} {ceil:>9s}")
