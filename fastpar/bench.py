r"""``python -m fastpar bench [--quick]``: fastpar against torch on the real workloads,
on the CPU and the first CUDA device (``cuda:0``) when there is one, as a table, a JSON
file and a plot.

For each case of :data:`CASES` and each workload of :data:`fastpar._workloads.WORKLOADS`
(the parameters of ``torch.nn.Transformer()``, of ``LSTM(1024, 1024, 4,
bidirectional=True)``, and 10,000 tensors of 64 floats; ``--quick`` uses the small
variants), the providers are measured in the same run, in interleaved rounds (round
``r`` calls each provider once, in a rotated order, so a neighbour's load on a shared
machine hits all of them alike; on the CPU each timed call is the second of two calls
of its provider in a row, the steady state of a loop):

* ``fastpar``: the op as users call it, with the tuned launch parameters when
  ``results/autotune/<device>.json`` has them;
* ``fastpar untuned``: the same call with the launchers' defaults (only when the tuned
  parameters differ from them): the same-run gain of tuning;
* ``torch``: the same baselines as ``benchmarks/test_bench_flatten.py``;
* ``copy_``: one ``Tensor.copy_`` of the workload's numel (fp32) into a touched buffer:
  the bandwidth ceiling.

Figures are GB/s = bytes read plus written per call / median time (CPU: median of
``time.perf_counter`` after warm-up; CUDA: ``triton.testing.do_bench``). The table is
printed as Markdown; ``<results>/bench/<device-slug>-<UTC timestamp>.json`` and ``.png``
(GB/s against the workload's bytes, one line per provider, the copy ceiling dashed) are
written (``<results>`` as in :mod:`fastpar._tuning`, or ``--results-dir``). Files are
never replaced: a second run stamped the same second writes ``...Z-2.json`` and
``...Z-2.png``.

Adding an op is a few lines: a setup function that receives the workload's tensors and
returns a :class:`Setup` (the fastpar call, the torch baseline, bytes per call), and a
:class:`Case` appended to :data:`CASES`::

    def _reduce_add(ts):
        import fastpar.comm
        copies = [ts, [t.clone() for t in ts]]          # two CPU "replicas"
        out = [torch.empty_like(t) for t in ts]
        def base():
            torch._foreach_add(copies[0], copies[1])    # torch's best equivalent
        return Setup(lambda: fastpar.comm.reduce_add_coalesced(copies, "cpu", out=out), base,
                     3 * nbytes(ts))

    CASES.append(Case("reduce_add_coalesced", "fp32", _reduce_add,
                      tuned=("reduce_add", torch.float32, torch.float32)))
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from . import _dispatch, _tuning
from . import autotune as _autotune
from ._workloads import WORKLOADS, nbytes

#: Schema tag of the bench JSON (bump on an incompatible change).
SCHEMA = "fastpar.bench/1"
PROVIDERS = ("fastpar", "fastpar untuned", "torch", "copy_")
#: Time budget per (case, workload) in seconds, and rounds bounds, per size setting.
BUDGET = {"full": (3.0, 10, 60), "quick": (0.4, 5, 30), "tiny": (0.02, 3, 5)}


class Setup(NamedTuple):
    """What a case's setup returns for one workload."""

    #: One call of the fastpar op (tuned parameters apply).
    fastpar: Callable
    #: One call of torch's equivalent.
    torch: Callable
    #: Bytes read plus written by one call.
    nbytes: int


@dataclass(frozen=True)
class Case:
    """One row kind of the table."""

    #: Op label shown in the table.
    op: str
    #: Dtype label shown in the table (``"fp32"``, ``"fp32->bf16"``).
    dtype: str
    #: ``setup(tensors) -> Setup`` (tensors: the workload, on the benchmarked device).
    setup: Callable
    #: ``(tuning op, source dtype, destination dtype)`` of the fastpar call, to look up
    #: its tuned parameters and measure the untuned default beside them; None: skip.
    tuned: tuple | None = None
    #: What the torch side does, in a few words (recorded in each row and printed under
    #: the table: some baselines allocate every call where fastpar reuses a buffer).
    baseline: str = ""


def _flatten_alloc(ts):
    return Setup(lambda: __import__("fastpar").flatten(ts), lambda: torch._utils._flatten_dense_tensors(ts),
                 2 * nbytes(ts))


def _flatten_out(ts):
    import fastpar

    n = sum(t.numel() for t in ts)
    out = torch.zeros(n, dtype=ts[0].dtype, device=ts[0].device)
    views = [t.reshape(-1) for t in ts]
    return Setup(lambda: fastpar.flatten(ts, out=out), lambda: torch.cat(views, out=out), 2 * nbytes(ts))


def _flatten_bf16_scale(ts):
    import fastpar

    n = sum(t.numel() for t in ts)
    dev = ts[0].device
    out = torch.zeros(n, dtype=torch.bfloat16, device=dev)
    views = [t.reshape(-1) for t in ts]
    buf = torch.zeros(n, device=dev)

    def base():  # torch's best three-pass equivalent: cat into a reused buffer, scale, cast
        torch.cat(views, out=buf)
        buf.mul_(0.125)
        out.copy_(buf)

    return Setup(lambda: fastpar.flatten(ts, dtype=torch.bfloat16, scale=0.125, out=out), base,
                 nbytes(ts) + 2 * n)


def _unflatten_into(ts):
    import fastpar

    n = sum(t.numel() for t in ts)
    flat = torch.randn(n, device=ts[0].device)
    dst = [torch.zeros_like(t) for t in ts]
    views = list(fastpar.unflatten(flat, dst))
    return Setup(lambda: fastpar.unflatten_into(flat, dst), lambda: torch._foreach_copy_(dst, views),
                 2 * nbytes(ts))


def _reduce_add_coalesced(ts, k=4):
    """K = 4 CPU replicas of the gradients, summed into reused ``out=`` tensors, against
    torch's algorithm (which allocates its buckets and result every call)."""
    import fastpar
    from ._baselines import reduce_add_coalesced as torch_way

    copies = [ts] + [[t.clone() for t in ts] for _ in range(k - 1)]
    out = [torch.empty_like(t) for t in ts]
    dev = ts[0].device
    return Setup(lambda: fastpar.comm.reduce_add_coalesced(copies, dev, out=out), lambda: torch_way(copies),
                 (k + 1) * nbytes(ts))


def _replicate(ts, k=2):
    """``replicate`` of a module holding the workload's tensors as parameters onto K = 2
    CPU replicas (steady state: buffers refilled), against torch's own ``replicate`` with
    its broadcast steps replayed on CPU (fresh bucket buffers every call)."""
    import fastpar
    from ._baselines import torch_replicate_algorithm

    holder = torch.nn.ParameterList([torch.nn.Parameter(t, requires_grad=False) for t in ts])
    if ts[0].device.type == "cuda":  # real GPUs: torch's own replicate, unchanged
        if torch.cuda.device_count() < k:
            return None
        gpus = list(range(k))
        return Setup(lambda: fastpar.replicate(holder, gpus, detach=True),
                     lambda: torch.nn.parallel.replicate(holder, gpus, detach=True), k * nbytes(ts))

    def base():
        with torch_replicate_algorithm() as rep:
            rep(holder, k)

    def ours():  # the replicas are dropped before the next call, as in a training loop
        fastpar.replicate(holder, ["cpu"] * k, detach=True)

    return Setup(ours, base, k * nbytes(ts))


F32, BF16 = torch.float32, torch.bfloat16
#: The cases benchmarked, in table order (see the module docstring to add one).
CASES: list[Case] = [
    Case("flatten", "fp32", _flatten_alloc, ("flatten", F32, F32),
         "torch._utils._flatten_dense_tensors (both allocate)"),
    Case("flatten out=", "fp32", _flatten_out, ("flatten", F32, F32),
         "torch.cat(views, out=) into the same reused buffer"),
    Case("flatten bf16+scale out=", "fp32->bf16", _flatten_bf16_scale, ("flatten", F32, BF16),
         "cat(out=) + mul_ + copy_ into reused buffers (three passes)"),
    Case("unflatten_into", "fp32", _unflatten_into, ("unflatten_into", F32, F32),
         "torch._foreach_copy_ from prebuilt views"),
    Case("reduce_add_coalesced K=4 out=", "fp32", _reduce_add_coalesced, ("reduce_add", F32, F32),
         "torch.nn.parallel.comm's algorithm on CPU tensors, allocating its buckets and results every "
         "call (fastpar sums into reused out= tensors)"),
    # replicate's buffers are filled by flatten's launches with flatten's tuned parameters
    # (pack_bytes: one buffer on the CPU with K = 2, the staging one on CUDA: the
    # workload's numel); without its key here the row said "defaults" for a tuned call.
    Case("replicate K=2", "fp32", _replicate, ("flatten", F32, F32),
         "torch.nn.parallel.replicate with its broadcast replayed on CPU, fresh buckets every call "
         "(fastpar refills persistent replica buffers)"),
]

#: A row is flagged noisy when a provider's interquartile range exceeds this fraction
#: of its median (a neighbour's load on a shared machine; see the README).
NOISY_IQR = 0.25
#: A CUDA provider is flagged host-bound when the host's time per call is at least this
#: fraction of its median: the GPU then waits on the host between calls, and the median
#: (and the GB/s) measure the Python side and the launch, not the kernels. (The tuner's
#: bound, where it keeps the default: one number for both.)
HOST_BOUND = _autotune.HOST_BOUND


def _flagged(stats: dict) -> dict:
    """The row's flags: ``noisy`` (providers whose quartiles spread by more than
    ``NOISY_IQR`` of the median) and, where the host was timed (CUDA), ``host_bound``
    (providers whose host time per call is at least ``HOST_BOUND`` of the median)."""
    flags = {"noisy": sorted(k for k, v in stats.items()
                             if v["median_s"] > 0 and (v["q75_s"] - v["q25_s"]) > NOISY_IQR * v["median_s"])}
    if any("host_s" in v for v in stats.values()):
        flags["host_s"] = {k: _sig(v["host_s"]) for k, v in stats.items() if "host_s" in v}
        flags["host_bound"] = sorted(k for k, v in stats.items()
                                     if "host_s" in v and v["host_s"] >= HOST_BOUND * v["median_s"])
    return flags


def _tiny_workloads():
    def transformer(device="cpu"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = torch.nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                     dim_feedforward=32)
        return [p.detach().to(device) for p in m.parameters()]

    return {
        "transformer": transformer,
        "lstm": lambda device="cpu": [p.detach().to(device) for p in torch.nn.LSTM(16, 16, 1, bidirectional=True).parameters()],
        "tiny": lambda device="cpu": [torch.randn(64, device=device) for _ in range(100)],
    }


def workloads(sizes: str) -> dict:
    """Workload name -> builder(device) for ``sizes`` = ``full``, ``quick`` or ``tiny``."""
    if sizes == "tiny":
        return _tiny_workloads()
    i = {"full": 0, "quick": 1}[sizes]
    return {name: b[i] for name, b in WORKLOADS.items()}


def devices(types=None) -> list[torch.device]:
    """CPU, plus the first CUDA device when present; ``types`` (e.g. ``["cuda"]``)
    keeps those device types only."""
    found = [torch.device("cpu")] + ([torch.device("cuda", 0)] if torch.cuda.is_available() else [])
    return [d for d in found if types is None or d.type in types]


def _backend_of(device) -> str:
    return _dispatch.backend_for(device)


def _untuned_differs(case: Case, device, numel: int) -> dict | None:
    """The tuned parameters of ``case``'s call on ``device`` if they differ from the
    launcher's defaults, else None."""
    if case.tuned is None:
        return None
    op, src, dst = case.tuned
    backend = _backend_of(device)
    tuned = _tuning.params(op, backend, src, dst, numel, device)
    if not tuned:
        return None
    try:
        from .autotune import launcher_defaults

        if launcher_defaults(op, backend, list(tuned)) == tuned:
            return None
    except (_tuning.TuningFileError, ImportError, AttributeError, KeyError):
        pass  # an end-to-end parameter: no launcher default to compare with; measure both
    return dict(tuned)


def _measure(device, providers: dict, sizes: str) -> dict:
    """``{provider: stats}`` for ``providers`` (name -> (prepare, fn))."""
    from .autotune import time_cpu, time_cuda

    names = list(providers)
    variants = [(providers[n][0], [providers[n][1]]) for n in names]
    try:
        if device.type == "cuda":
            stats = time_cuda(variants, quick=sizes != "full", host=True)
        else:
            budget, lo, hi = BUDGET[sizes]
            # settle: each timed call follows an untimed one of the same provider. The
            # tuned and untuned fastpar providers force different parameters, and each
            # switch made fastpar's bound launches resolve again inside the timed call
            # (a 2.6 MB flatten into out= timed 58 us against 34 us in a loop, 0.73x
            # torch's cat instead of 1.2x).
            stats = time_cpu(variants, budget_s=budget, min_rounds=lo, max_rounds=hi,
                             warmup=1 if sizes == "tiny" else 2, settle=True)
    finally:
        _tuning._forced = None
    return dict(zip(names, stats))


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (what the timer's noise allows)."""
    return float(f"{x:.4g}")


def _gbps(nb: int, s: float) -> float:
    return _sig(nb / s / 1e9) if s > 0 else float("inf")


def run_device(device, sizes: str, *, cases=None, only=None, progress: bool = True) -> list[dict]:
    """Benchmark every case on every workload on ``device``; return the table rows."""
    from tqdm.auto import tqdm

    cases = CASES if cases is None else cases
    wls = workloads(sizes)
    if only:
        wls = {k: v for k, v in wls.items() if k in only}
    rows = []
    tuned_on = lambda: setattr(_tuning, "_forced", None)  # noqa: E731 (a prepare hook)
    untuned_on = lambda: setattr(_tuning, "_forced", {})  # noqa: E731
    with tqdm(total=len(cases) * len(wls), desc=f"bench {device}", unit="case", disable=not progress,
              dynamic_ncols=True) as bar:
        for wname, build in wls.items():
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # nn.Transformer's enable_nested_tensor notice
                ts = build(device)
            n = sum(t.numel() for t in ts)
            src = torch.randn(n, device=device)
            dst = torch.zeros(n, device=device)
            copy = lambda: dst.copy_(src)  # noqa: E731
            for case in cases:
                bar.set_postfix_str(f"{case.op}: {wname}")
                s = case.setup(ts)
                if s is None:  # not measurable here (e.g. replicate K=2 on one GPU)
                    bar.update(1)
                    continue
                providers = {"fastpar": (tuned_on, s.fastpar), "torch": (tuned_on, s.torch),
                             "copy_": (tuned_on, copy)}
                tuned = _untuned_differs(case, device, n)
                if tuned is not None:
                    providers["fastpar untuned"] = (untuned_on, s.fastpar)
                st = _measure(device, providers, sizes)
                med = {k: v["median_s"] for k, v in st.items()}
                fp, tg = _gbps(s.nbytes, med["fastpar"]), _gbps(s.nbytes, med["torch"])
                cg = _gbps(2 * 4 * n, med["copy_"])
                row = {
                    "op": case.op, "workload": wname, "dtype": case.dtype, "tensors": len(ts), "numel": n,
                    "bytes": nbytes(ts), "moved_bytes": s.nbytes,
                    "fastpar_gbps": fp, "torch_gbps": tg, "ratio": _sig(med["torch"] / med["fastpar"]),
                    "copy_gbps": cg, "of_copy": _sig(fp / cg),
                    "untuned_gbps": None, "tuned_gain": None, "tuned_params": tuned,
                    "median_s": {k: _sig(v) for k, v in med.items()},
                    "q25_s": {k: _sig(v["q25_s"]) for k, v in st.items()},
                    "q75_s": {k: _sig(v["q75_s"]) for k, v in st.items()},
                    "rounds": st["fastpar"]["reps"],
                    "baseline": case.baseline,
                    **_flagged(st),
                }
                if tuned is not None:
                    row["untuned_gbps"] = _gbps(s.nbytes, med["fastpar untuned"])
                    row["tuned_gain"] = _sig(med["fastpar untuned"] / med["fastpar"])
                rows.append(row)
                del s, providers
                bar.update(1)
            del ts, src, dst
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    def size(b):
        return f"{b / 1e6:.1f} MB" if b >= 1e6 else f"{b / 1e3:.1f} kB"

    out = ["| op | workload | dtype | size | fastpar GB/s | torch GB/s | ratio | copy_ GB/s (ceiling) | "
           "fastpar / copy_ | tuned vs untuned |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        gain = f"{r['tuned_gain']:.2f}x" if r.get("tuned_gain") is not None else "defaults"
        noisy = " (noisy)" if r.get("noisy") else ""
        if "fastpar" in r.get("host_bound", ()):
            noisy += " (host-bound)"
        out.append(f"| {r['op']} | {r['workload']} | {r['dtype']} | {size(r['bytes'])} | "
                   f"{r['fastpar_gbps']:.2f} | {r['torch_gbps']:.2f} | {r['ratio']:.2f}x{noisy} | {r['copy_gbps']:.2f} | "
                   f"{100 * r['of_copy']:.0f}% | {gain} |")
    baselines = {r["op"]: r["baseline"] for r in rows if r.get("baseline")}
    if baselines:
        out.append("")
        out.extend(f"* {op}: torch = {b}" for op, b in baselines.items())
    if any(r.get("noisy") for r in rows):
        out.append(f"* (noisy): a provider's quartiles spread by more than {NOISY_IQR:.0%} of its median "
                   "in that row (load from other processes); read its ratio with care")
    if any("fastpar" in r.get("host_bound", ()) for r in rows):
        out.append(f"* (host-bound): fastpar's host time per call (Python and launch, in bursts of calls "
                   f"with no synchronisation) was at least {HOST_BOUND:.0%} of its median: the GPU waited on "
                   "the host, and the GB/s measure the host, not the kernels")
    return "\n".join(out)


def render_png(doc: dict) -> bytes:
    """The run's plot as PNG bytes (Agg backend): GB/s against the workload's bytes, one
    panel per op, one line per provider (the ``copy_`` ceiling dashed). Rendered before
    anything is written (it takes seconds), so an interrupted run leaves no file; see
    :func:`_publish`."""
    import io

    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    ops = list(dict.fromkeys((r["op"], r["dtype"]) for r in rows))
    ncol = 2 if len(ops) > 1 else 1
    nrow = math.ceil(len(ops) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6 * ncol, 4 * nrow), squeeze=False)
    styles = {"fastpar": dict(marker="o", color="C0"), "fastpar untuned": dict(marker="o", ls=":", color="C0", alpha=0.6),
              "torch": dict(marker="s", color="C1"), "copy_": dict(ls="--", color="0.4", marker="")}
    keys = {"fastpar": "fastpar_gbps", "fastpar untuned": "untuned_gbps", "torch": "torch_gbps", "copy_": "copy_gbps"}
    for ax, (op, dt) in zip(axes.flat, ops):
        rs = sorted((r for r in rows if r["op"] == op and r["dtype"] == dt), key=lambda r: r["bytes"])
        x = [r["bytes"] for r in rs]
        for prov, key in keys.items():
            ys = [r.get(key) for r in rs]
            if all(y is None for y in ys):
                continue
            if prov == "fastpar untuned":  # not measured where the tuned config is the default
                ys = [r["fastpar_gbps"] if y is None else y for r, y in zip(rs, ys)]
            label = "copy_ (ceiling)" if prov == "copy_" else prov
            ax.plot([a for a, y in zip(x, ys) if y is not None], [y for y in ys if y is not None], label=label,
                    **styles[prov])
        for r in rs:
            ax.annotate(r["workload"], (r["bytes"], r["fastpar_gbps"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
        ax.set_xscale("log")
        ax.set_title(f"{op} ({dt})")
        ax.set_xlabel("workload bytes")
        ax.set_ylabel("GB/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(ops):]:
        ax.axis("off")
    fig.suptitle(f"fastpar vs torch: {doc['device']['name']} ({doc['device']['slug']}), {doc['sizes']} sizes, "
                 f"{doc['timestamp']}", fontsize=10)
    fig.tight_layout()
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=110)
    finally:
        plt.close(fig)
    return png.getvalue()


def _expect(cond, where, got, expected):
    if not cond:
        raise ValueError(f"bench JSON {where}: expected {expected}, got {got!r}")


def validate_bench(doc) -> None:
    """Check a bench JSON document; raise ``ValueError`` naming the first bad field."""
    _expect(isinstance(doc, dict), "document", type(doc).__name__, "an object")
    _expect(doc.get("schema") == SCHEMA, "schema", doc.get("schema"), repr(SCHEMA))
    for k in ("timestamp", "sizes", "png"):
        _expect(isinstance(doc.get(k), str), k, doc.get(k), "a string")
    _expect(doc["sizes"] in BUDGET, "sizes", doc["sizes"], f"one of {list(BUDGET)}")
    dev = doc.get("device")
    _expect(isinstance(dev, dict) and all(isinstance(dev.get(k), str) for k in ("type", "name", "slug")), "device",
            dev, "an object with type, name, slug")
    _expect(isinstance(doc.get("versions"), dict), "versions", doc.get("versions"), "an object")
    rows = doc.get("rows")
    _expect(isinstance(rows, list) and rows, "rows", rows, "a non-empty list")
    for i, r in enumerate(rows):
        w = f"rows[{i}]"
        _expect(isinstance(r, dict), w, r, "an object")
        for k in ("op", "workload", "dtype"):
            _expect(isinstance(r.get(k), str), f"{w}.{k}", r.get(k), "a string")
        for k in ("tensors", "numel", "bytes", "moved_bytes"):
            _expect(isinstance(r.get(k), int) and r[k] > 0, f"{w}.{k}", r.get(k), "a positive integer")
        # do_bench (CUDA) does not report its repetitions: rounds is null there.
        _expect(r.get("rounds") is None or (isinstance(r["rounds"], int) and r["rounds"] > 0), f"{w}.rounds",
                r.get("rounds"), "a positive integer or null")
        for k in ("fastpar_gbps", "torch_gbps", "ratio", "copy_gbps", "of_copy"):
            _expect(isinstance(r.get(k), (int, float)) and r[k] > 0 and math.isfinite(r[k]), f"{w}.{k}", r.get(k),
                    "a positive finite number")
        med = r.get("median_s")
        _expect(isinstance(med, dict) and all(p in med for p in ("fastpar", "torch", "copy_")), f"{w}.median_s", med,
                "medians of fastpar, torch and copy_")
        _expect(math.isclose(r["ratio"], med["torch"] / med["fastpar"], rel_tol=0.01), f"{w}.ratio", r["ratio"],
                f"torch / fastpar median = {med['torch'] / med['fastpar']:.3f}")
        if r.get("tuned_gain") is not None:
            _expect("fastpar untuned" in med, f"{w}.median_s", med, "the fastpar untuned median beside tuned_gain")


#: Environment variables that change what a run measures (recorded in its JSON).
_ENV_VARS = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "THP_MEM_ALLOC_ENABLE",
             "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "TRITON_INTERPRET")


def run_environment() -> dict:
    """The settings behind a run: the source commit (when run from a git checkout), the
    variables above and every ``FASTPAR_*`` one, and the kernel's transparent huge page
    mode."""
    import subprocess

    commit = None
    src = Path(__file__).resolve().parent.parent
    if (src / ".git").exists():
        try:
            r = subprocess.run(["git", "-C", str(src), "describe", "--always", "--dirty", "--abbrev=12"],
                               capture_output=True, text=True, timeout=10)
            commit = r.stdout.strip() or None if r.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            commit = None
    env = {k: v for k, v in sorted(os.environ.items()) if k in _ENV_VARS or k.startswith("FASTPAR_")}
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        thp = None
    return {"commit": commit, "env": env, "transparent_hugepage": thp}


def _stamp() -> tuple[str, str]:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.isoformat(timespec="seconds"), now.strftime("%Y%m%dT%H%M%SZ")


def run(sizes: str = "full", *, root=None, note: str | None = None, only=None, progress: bool = True,
        out=sys.stdout, device_types=None) -> list[Path]:
    """Benchmark the CPU and ``cuda:0`` when present (of ``device_types``, when given);
    print each table; write JSON + PNG per device. Returns the JSON paths written."""
    import numba

    root = Path(root).expanduser() if root is not None else _tuning.results_dir()
    bench_dir = root / "bench"
    paths = []
    for device in devices(device_types):
        info = _tuning.device_info(device)
        iso, stamp = _stamp()
        load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        backend = _dispatch.backend_for(device)
        if _tuning.TUNED_BACKENDS.get(backend) == device.type:
            tuning = _tuning.status(device)
        else:  # FASTPAR_BACKEND=torch, or triton on the CPU (the interpreter): no file applies
            tuning = {"path": None, "state": "untuned",
                      "reason": f"the {backend} backend on {device.type} tensors is never tuned"}
        rows = run_device(device, sizes, only=only, progress=progress)
        doc = {
            "schema": SCHEMA, "timestamp": iso, "device": info, "versions": _tuning.versions(), "sizes": sizes,
            "backend": backend, **run_environment(),
            "host": {"python": platform.python_version(), "cpus": _tuning._cpu_count(),
                     "numba_threads": numba.get_num_threads(), "torch_threads": torch.get_num_threads(),
                     "loadavg_1min": [load0, os.getloadavg()[0] if hasattr(os, "getloadavg") else None]},
            "note": note,
            "tuning": tuning,
            "timer": "triton.testing.do_bench median" if device.type == "cuda"
            else "time.perf_counter median of interleaved rounds after warm-up, each timed call the second of "
            "two in a row (no cache flush, as in benchmarks/)",
            "rows": rows,
            "png": f"{info['slug']}-{stamp}.png",
        }
        validate_bench(doc)
        print(f"\n{info['name']} ({info['slug']}), {sizes} sizes, fastpar backend {backend}, "
              f"tuned parameters: {tuning['state']}"
              f"{' (' + tuning['path'] + ')' if tuning.get('path') else ''}", file=out)
        print(table(rows), file=out)
        # The plot first (seconds): interrupted there, the run leaves nothing.
        png = render_png(doc)
        bench_dir.mkdir(parents=True, exist_ok=True)
        path = _publish(bench_dir, f"{info['slug']}-{stamp}", doc, png)
        print(f"wrote {path} and {bench_dir / doc['png']}", file=out)
        paths.append(path)
    return paths


def _publish(bench_dir: Path, stem: str, doc: dict, png: bytes) -> Path:
    """Write ``<stem>.png`` and ``<stem>.json`` (``doc``, naming the PNG) under
    ``bench_dir``, each created exclusively and atomically; where another run has one of
    the names (two runs started in the same second), take ``<stem>-2``, ``-3``...: no
    run's files are replaced, and a run's JSON and PNG share one stem. Returns the JSON
    path."""
    from .autotune import _write_atomic

    for n in itertools.count(1):
        name = stem if n == 1 else f"{stem}-{n}"
        png_path, path = bench_dir / f"{name}.png", bench_dir / f"{name}.json"
        doc["png"] = png_path.name
        text = json.dumps(doc, indent=1, allow_nan=False) + "\n"
        try:
            _write_atomic(png_path, png, exclusive=True)
        except FileExistsError:
            continue
        try:
            _write_atomic(path, text, exclusive=True)
        except BaseException as e:  # the JSON's name is taken, or the run stops: drop our PNG
            png_path.unlink(missing_ok=True)
            if isinstance(e, FileExistsError):
                continue
            raise
        return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small variants of the workloads (under a minute)")
    p.add_argument("--sizes", choices=list(BUDGET), default=None, help=argparse.SUPPRESS)  # tests: --sizes tiny
    p.add_argument("--workloads", default=None,
                   help=f"comma-separated subset of {', '.join(WORKLOADS)} (default: all)")
    p.add_argument("--results-dir", default=None,
                   help="results folder: tuned parameters are read from its autotune/, the run is written to its "
                        "bench/ (default: $FASTPAR_RESULTS_DIR, else the source checkout's results/, else "
                        "~/.cache/fastpar)")
    p.add_argument("--devices", default=None,
                   help="comma-separated device types to benchmark, of cpu and cuda (default: every one present)")
    p.add_argument("--note", default=None, help="free text stored in the JSON (e.g. 'machine shared')")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args) -> int:
    sizes = args.sizes or ("quick" if args.quick else "full")
    from .__main__ import (blank_folder_or_exit, comma_list, device_types_or_exit, expand_folder, results_source,
                           writable_or_exit)

    bad = blank_folder_or_exit(args.results_dir)
    if bad:
        return bad
    args.results_dir = expand_folder(args.results_dir)
    only = None
    if args.workloads is not None:
        try:
            only = comma_list(args.workloads, "--workloads")
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        bad = [w for w in only if w not in WORKLOADS]
        if bad:
            print(f"--workloads: unknown {bad}; expected some of {', '.join(WORKLOADS)}", file=sys.stderr)
            return 2
    types, bad = device_types_or_exit(args.devices, devices)  # "" or "," is refused, not "every device"
    if bad:
        return bad
    for device in devices(types):
        # A misspelt FASTPAR_BACKEND (ValueError), or one that cannot run on a device
        # benchmarked (RuntimeError: numba on CUDA), raised from run() as a traceback:
        # the second after the whole CPU run on a GPU machine.
        try:
            _dispatch.backend_for(device)
        except (ValueError, RuntimeError) as e:
            hint = "" if isinstance(e, ValueError) else f" (or leave {device.type} out with --devices)"
            print(f"bench: {e}{hint}", file=sys.stderr)
            return 2
    source = results_source(args.results_dir)
    if args.results_dir:
        os.environ["FASTPAR_RESULTS_DIR"] = args.results_dir
        _tuning.reload()
    bad = writable_or_exit(Path(args.results_dir or _tuning.results_dir()) / "bench", source)
    if bad:
        return bad
    run(sizes, root=args.results_dir, note=args.note, only=only, progress=not args.no_progress,
        device_types=types)
    return 0
