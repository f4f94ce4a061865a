"""Tuned launch parameters, read once from saved autotune results, and defaults for
anything not tuned.

Every multi-tensor launch asks :func:`params` for the keyword arguments to pass its
launcher (``chunk``/``parallel_min_bytes`` for Numba, ``block``/``num_warps`` for
Triton). The answer comes from ``<results>/autotune/<device-slug>.json``, written by
``python -m fastpar autotune`` (:mod:`fastpar.autotune`), where ``<results>`` is

1. ``$FASTPAR_RESULTS_DIR`` when set (``~`` expanded; a relative path is taken from
   the working folder of the process at its first launch), else
2. the ``results/`` folder of the source checkout the package runs from (an editable
   install), when present, else
3. a per-user cache folder: ``$XDG_CACHE_HOME/fastpar`` (default ``~/.cache/fastpar``;
   ``%LOCALAPPDATA%\\fastpar`` on Windows).

The file is read once per device and process, lazily on the first launch. Keys are
``(op, backend, source dtype, destination dtype, size bucket)``; a key that was not
tuned gets ``{}``, i.e. the launcher's defaults. A missing, unreadable, corrupt,
wrong-schema, hand-edited (its SHA-256 digest no longer matches), other-device or
other-version (fastpar, its kernel sources, torch, triton or numba) file never fails an op: it is ignored
with one :class:`TuningWarning` per device and process, and every launch uses the
defaults. Files are JSON, validated field by field before use; nothing is unpickled.

The Triton interpreter (``FASTPAR_BACKEND=triton`` on CPU tensors) and the ``torch``
reference backend are never tuned: they always get ``{}`` (logged once at INFO level on
the ``fastpar.tuning`` logger).

Hook for end-to-end parameters (the coalesced comm ops' bucket size): such an op asks
for its own key and reads the parameter with its default, e.g.::

    buffer_size = _tuning.params("reduce_add_coalesced", backend, dtype, dtype, total_numel,
                                 device).get("buffer_size", DEFAULT_BUFFER_SIZE)

and its entry in ``fastpar/tuning_space.json`` lists ``buffer_size`` values under
``params``, the default under ``defaults`` and ``"end_to_end": true`` (the runner then
times the whole coalesced call, as Horovod tunes its fusion threshold). No code here
changes for a new op or parameter.
"""
from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import os
import platform
import re
import sys
import warnings
from pathlib import Path

import torch

from . import _dispatch
from .kernels._launch import fork_safe_lock

log = logging.getLogger("fastpar.tuning")

#: Schema tag of the tuned-results files (bump on any incompatible change).
SCHEMA = "fastpar.autotune/1"
#: Schema tag of the search-space file.
SPACE_SCHEMA = "fastpar.tuning_space/1"
#: The packaged search space.
SPACE_PATH = Path(__file__).with_name("tuning_space.json")
#: Backends whose launchers are tuned, and the device type each is tuned on.
TUNED_BACKENDS = {"numba": "cpu", "triton": "cuda"}

_EMPTY: dict = {}


class TuningWarning(UserWarning):
    """A tuned-results file was missing or ignored; default launch parameters are used.

    Silence it with ``warnings.filterwarnings("ignore", category=fastpar.TuningWarning)``."""


class TuningFileError(ValueError):
    """A tuned-results or search-space file failed validation (the message says which
    field, what it held and what was expected)."""


class TuningVersionError(TuningFileError):
    """A tuned-results file was tuned with other versions than the running ones (a file
    of another version, not a broken one: set aside as ``.prev``, reported as
    ``foreign version``)."""


# --------------------------------------------------------------------------- places


def results_dir() -> Path:
    """Folder that holds ``autotune/`` and ``bench/`` (see the module docstring)."""
    env = os.environ.get("FASTPAR_RESULTS_DIR", "")
    if env.strip():  # blank means unset, as for every FASTPAR_* variable (fastpar._env)
        return Path(env).expanduser()
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "results").is_dir() and (checkout / "pyproject.toml").is_file():
        return checkout / "results"
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "fastpar"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "fastpar"


def autotune_path(slug: str, root: Path | None = None) -> Path:
    """``<results>/autotune/<slug>.json``."""
    return (root or results_dir()) / "autotune" / f"{slug}.json"


def slugify(text: str) -> str:
    text = re.sub(r"\((r|tm)\)|@.*$", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-") or "unknown"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _cpu_id() -> str:
    """``f<family>m<model>s<stepping>`` from ``/proc/cpuinfo``, or "" (VMs often report
    a bare "AMD EPYC" as the model name, whatever the generation behind it)."""
    want = {"cpu family": "f", "model": "m", "stepping": "s"}
    got = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                k = k.strip()
                if k in want and k not in got:
                    got[k] = v.strip()
                if not line.strip() and got:  # the first processor's block is enough
                    break
    except OSError:
        return ""
    if set(got) != set(want) or not all(v.isdigit() for v in got.values()):
        return ""
    return "".join(want[k] + got[k] for k in want)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_threads() -> int:
    """Threads the Numba kernels' parallel regions use (``NUMBA_NUM_THREADS``, by default
    the CPUs this process may run on)."""
    import numba

    return int(numba.config.NUMBA_NUM_THREADS)


_device_info_cache: dict = {}


def device_info(device) -> dict:
    """``{"type", "name", "slug"}`` of ``device`` (a ``torch.device`` or string). The CPU
    slug names the model, its family/model/stepping numbers and the Numba thread count
    (``cpu-amd-epyc-f25m17s1-2t``): tuning depends on each."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    hit = _device_info_cache.get(device)
    if hit is None:
        if device.type == "cpu":
            name = _cpu_name()
            cpu_id = _cpu_id()
            slug = f"cpu-{slugify(name)}{'-' + cpu_id if cpu_id else ''}-{_cpu_threads()}t"
        elif device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            slug = f"cuda-{slugify(name)}"
        else:
            name = device.type
            slug = slugify(device.type)
        hit = _device_info_cache[device] = {"type": device.type, "name": name, "slug": slug}
    return dict(hit)


#: The kernel folder each device type's tuned backend runs.
KERNEL_FOLDERS = {device: f"ops_{backend}" for backend, device in TUNED_BACKENDS.items()}

_kernels_digests: dict = {}


def kernels_digest(device_type: str | None = None, root: Path | None = None) -> str:
    """SHA-256 (16 hex digits) of the kernel and launcher sources (``fastpar.kernels``):
    a winner is only as good as the code it was timed on, and the package version does
    not change with every commit.

    With ``device_type`` (``"cpu"``, ``"cuda"``), only the sources that device's tuned
    backend runs: its ``ops_<backend>`` folder (:data:`KERNEL_FOLDERS`) and the shared
    modules outside every ``ops_*`` folder. Editing the Numba kernels then leaves a GPU's
    tuned file valid (and the Triton kernels a CPU's): a GPU's file can only be tuned
    again on that GPU. ``root`` is the kernels folder (tests)."""
    key = (device_type, root)
    hit = _kernels_digests.get(key)
    if hit is None:
        if root is None:
            from . import kernels

            root = Path(kernels.__file__).resolve().parent
        mine = KERNEL_FOLDERS.get(device_type)
        h = hashlib.sha256()
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root)
            top = rel.parts[0]
            if device_type is not None and top.startswith("ops_") and top != mine:
                continue
            h.update(rel.as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
        hit = _kernels_digests[key] = h.hexdigest()[:16]
    return hit


def versions(device_type: str | None = None) -> dict:
    """Versions a tuned file must match to be used: the kernels' by source digest, of
    the sources ``device_type``'s backend runs (all of them without it, as a benchmark
    run records)."""
    import numba
    import triton

    from . import __version__

    return {"fastpar": __version__, "kernels": kernels_digest(device_type), "torch": torch.__version__,
            "triton": triton.__version__, "numba": numba.__version__}


def dtype_name(dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (names as in the JSON files)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, where: str) -> torch.dtype:
    d = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(d, torch.dtype):
        raise TuningFileError(f"{where}: expected a torch dtype name such as 'float32', got {name!r}")
    return d


def key_str(op: str, backend: str, src: str, dst: str, bucket: int) -> str:
    """The entry key in a tuned file: ``op/backend/src->dst/b<bucket>``."""
    return f"{op}/{backend}/{src}->{dst}/b{bucket}"


def bucket_of(bounds, numel: int) -> int:
    """Bucket of a call moving ``numel`` elements: the first ``i`` with
    ``numel <= bounds[i]``, or ``len(bounds)``."""
    return bisect.bisect_left(bounds, numel)


def bucket_range(bounds, bucket: int) -> list:
    """``[lo, hi]`` numel (inclusive; ``hi`` None = unbounded) of ``bucket``."""
    lo = 0 if bucket == 0 else bounds[bucket - 1] + 1
    hi = bounds[bucket] if bucket < len(bounds) else None
    return [lo, hi]


# --------------------------------------------------------------------------- validation


def _expect(cond: bool, where: str, got, expected: str) -> None:
    if not cond:
        shown = repr(got)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise TuningFileError(f"{where}: expected {expected}, got {shown}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_param_spec(spec, where: str) -> None:
    """``{"values": [ints], "min": int, "pow2": bool}`` (values optional in results)."""
    _expect(isinstance(spec, dict), where, spec, "an object with 'min' (and 'values', 'pow2')")
    _expect(_is_int(spec.get("min")), f"{where}.min", spec.get("min"), "an integer")
    _expect(isinstance(spec.get("pow2", False), bool), f"{where}.pow2", spec.get("pow2"), "true or false")
    if "values" in spec:
        vals = spec["values"]
        _expect(isinstance(vals, list) and len(vals) > 0, f"{where}.values", vals, "a non-empty list")
        for i, v in enumerate(vals):
            check_param_value(v, spec, f"{where}.values[{i}]")


def check_param_value(value, spec: dict, where: str) -> None:
    _expect(_is_int(value), where, value, "an integer")
    _expect(value >= spec["min"], where, value, f"an integer >= {spec['min']}")
    if spec.get("pow2"):
        _expect(value > 0 and value & (value - 1) == 0, where, value, "a power of two")


def check_bounds(bounds, where: str) -> None:
    _expect(isinstance(bounds, list) and all(_is_int(b) and b > 0 for b in bounds), where, bounds,
            "a list of positive integers")
    _expect(all(a < b for a, b in zip(bounds, bounds[1:])), where, bounds, "strictly increasing bounds")


def load_space(path: str | os.PathLike | None = None) -> dict:
    """Read and validate a search-space file (default: the packaged
    ``fastpar/tuning_space.json``). Raises :class:`TuningFileError` naming the field."""
    # ``~`` expanded, as for the results folder (``--space=~/s.json`` reaches here as is).
    path = Path(path).expanduser() if path is not None else SPACE_PATH
    try:
        # Strict, as tuned files are read: a NaN would reach the tuned file's digest
        # (parts of the space are saved with the results) and fail only at the end of
        # a run. (UnicodeDecodeError is a ValueError.)
        doc = parse_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TuningFileError(f"search space {path}: cannot read it as JSON ({type(e).__name__}: {e})") from e
    validate_space(doc, str(path), floors=path.resolve() != SPACE_PATH.resolve())
    return doc


_floors_cache: dict | None = None


def _floors() -> dict:
    """``(op, backend, param) -> {"min", "pow2"}`` of the packaged search space: limits
    no other space or tuned file may go below (a chunk of 0 would launch nothing)."""
    global _floors_cache
    if _floors_cache is None:
        doc = json.loads(SPACE_PATH.read_text())
        validate_space(doc, str(SPACE_PATH), floors=False)
        _floors_cache = {
            (op, b, p): {"min": spec["min"], "pow2": spec.get("pow2", False)}
            for op, e in doc["ops"].items() for b, be in e["backends"].items() for p, spec in be["params"].items()
        }
    return _floors_cache


def check_floor(value, op: str, backend: str, param: str, where: str) -> None:
    """Raise unless ``value`` respects the packaged space's limits for ``param``."""
    floor = _floors().get((op, backend, param))
    if floor is not None:
        check_param_value(value, floor, where)


def validate_space(doc, where: str = "search space", *, floors: bool = True) -> None:
    _expect(isinstance(doc, dict), where, type(doc).__name__, "a JSON object")
    _expect(doc.get("schema") == SPACE_SCHEMA, f"{where}: schema", doc.get("schema"), repr(SPACE_SCHEMA))
    check_bounds(doc.get("size_buckets"), f"{where}: size_buckets")
    _expect(_is_num(doc.get("min_gain", 0.0)) and doc.get("min_gain", 0.0) >= 0, f"{where}: min_gain",
            doc.get("min_gain"), "a number >= 0")
    ops = doc.get("ops")
    _expect(isinstance(ops, dict) and ops, f"{where}: ops", ops, "a non-empty object of op entries")
    for op, e in ops.items():
        w = f"{where}: ops.{op}"
        _expect(isinstance(e, dict), w, e, "an object")
        r = e.get("runner")
        _expect(isinstance(r, str) and re.fullmatch(r"[\w.]+:\w+", r) is not None, f"{w}.runner", r,
                "'package.module:function'")
        dts = e.get("dtypes")
        _expect(isinstance(dts, list) and dts, f"{w}.dtypes", dts, "a non-empty list of {src, dst[, scale]}")
        for i, d in enumerate(dts):
            _expect(isinstance(d, dict), f"{w}.dtypes[{i}]", d, "an object {src, dst[, scale]}")
            parse_dtype(d.get("src"), f"{w}.dtypes[{i}].src")
            parse_dtype(d.get("dst"), f"{w}.dtypes[{i}].dst")
            if "scale" in d:
                _expect(_is_num(d["scale"]), f"{w}.dtypes[{i}].scale", d["scale"], "a number")
        for k in ("sizes", "quick_sizes"):
            s = e.get(k, e.get("sizes"))
            _expect(isinstance(s, list) and s and all(_is_int(v) and v > 0 for v in s), f"{w}.{k}", s,
                    "a non-empty list of positive integers (elements)")
        _expect(isinstance(e.get("end_to_end", False), bool), f"{w}.end_to_end", e.get("end_to_end"), "true or false")
        bks = e.get("backends")
        _expect(isinstance(bks, dict) and bks, f"{w}.backends", bks, "a non-empty object")
        for b, be in bks.items():
            wb = f"{w}.backends.{b}"
            _expect(b in TUNED_BACKENDS, wb, b, f"one of {', '.join(TUNED_BACKENDS)}")
            _expect(isinstance(be, dict), wb, be, "an object")
            _expect(be.get("device") == TUNED_BACKENDS[b], f"{wb}.device", be.get("device"),
                    repr(TUNED_BACKENDS[b]))
            ps = be.get("params")
            _expect(isinstance(ps, dict) and ps, f"{wb}.params", ps, "a non-empty object")
            for p, spec in ps.items():
                check_param_spec(spec, f"{wb}.params.{p}")
                _expect("values" in spec, f"{wb}.params.{p}.values", None, "a list of candidate values")
                if floors:
                    for i, v in enumerate(spec["values"]):
                        check_floor(v, op, b, p, f"{wb}.params.{p}.values[{i}]")
            defaults = be.get("defaults", e.get("defaults", {}))
            _expect(isinstance(defaults, dict), f"{wb}.defaults", defaults, "an object")
            for p, v in defaults.items():
                _expect(p in ps, f"{wb}.defaults", p, f"a parameter listed under params ({', '.join(ps)})")
                check_param_value(v, ps[p], f"{wb}.defaults.{p}")


def digest(doc: dict) -> str:
    """SHA-256 of the canonical JSON of ``doc`` without its ``digest`` field: any edit
    made by hand (not through :mod:`fastpar.autotune`) changes it."""
    body = {k: v for k, v in doc.items() if k != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


_TIMING_FIELDS = ("median_s", "q25_s", "q75_s")


def validate_results(doc, *, slug: str | None = None, current_versions: dict | None = None) -> None:
    """Validate a tuned-results document; raise :class:`TuningFileError` on the first
    problem. Checked in this order: JSON object, ``schema``, ``digest`` (hand edits),
    the ``device``, ``versions`` and ``updated`` fields, device ``slug``, ``versions``
    (when given), then the structure of every entry (winners: within the packaged
    limits, and names the launcher takes). The device and versions come before the
    entries: the packaged limits and the launchers' parameters are this version's, so a
    file tuned by another version is refused as that ("versions: ..."), not as a file
    whose winners break today's limits."""
    _expect(isinstance(doc, dict), "document", type(doc).__name__, "a JSON object")
    _expect(doc.get("schema") == SCHEMA, "schema", doc.get("schema"), repr(SCHEMA))
    got = doc.get("digest")
    try:
        want = digest(doc)
    except RecursionError:  # parse_json's depth, reached again a few frames deeper
        raise TuningFileError("document: nested too deeply to be a tuned-results file") from None
    if got != want:
        raise TuningFileError(
            f"digest: the content does not match its digest (got {str(got)[:20]!r}...): the file was "
            "edited by hand or truncated; tuned files are written only by `python -m fastpar autotune`"
        )
    dev = doc.get("device")
    _expect(isinstance(dev, dict) and all(isinstance(dev.get(k), str) for k in ("type", "name", "slug")),
            "device", dev, "an object with string type, name and slug")
    vers = doc.get("versions")
    _expect(isinstance(vers, dict) and all(isinstance(vers.get(k), str) for k in ("fastpar", "torch", "triton", "numba")),
            "versions", vers, "an object with string fastpar, torch, triton and numba versions")
    _expect(isinstance(doc.get("updated"), str), "updated", doc.get("updated"), "an ISO-8601 timestamp string")
    if slug is not None:
        _expect(dev["slug"] == slug, "device.slug", dev["slug"], f"{slug!r} (this device)")
    if current_versions is not None and vers != current_versions:
        diff = ", ".join(f"{k} {vers.get(k)} (running {v})" for k, v in current_versions.items() if vers.get(k) != v)
        raise TuningVersionError(f"versions: tuned with {diff}")
    bounds = doc.get("size_buckets")
    check_bounds(bounds, "size_buckets")
    space = doc.get("space")
    _expect(isinstance(space, dict), "space", space, "an object {op: {backend: {params: {...}}}}")
    for op, bks in space.items():
        _expect(isinstance(bks, dict), f"space.{op}", bks, "an object of backends")
        for b, be in bks.items():
            _expect(isinstance(be, dict) and isinstance(be.get("params"), dict), f"space.{op}.{b}", be,
                    "an object with params")
            for p, spec in be["params"].items():
                check_param_spec(spec, f"space.{op}.{b}.params.{p}")
    runs = doc.get("runs")
    _expect(isinstance(runs, list) and all(isinstance(r, dict) for r in runs), "runs", runs, "a list of objects")
    entries = doc.get("entries")
    _expect(isinstance(entries, dict), "entries", entries, "an object keyed by op/backend/src->dst/bucket")
    for key, e in entries.items():
        w = f"entries[{key!r}]"
        _expect(isinstance(e, dict), w, e, "an object")
        for f in ("op", "backend", "src_dtype", "dst_dtype"):
            _expect(isinstance(e.get(f), str), f"{w}.{f}", e.get(f), "a string")
        parse_dtype(e["src_dtype"], f"{w}.src_dtype")
        parse_dtype(e["dst_dtype"], f"{w}.dst_dtype")
        _expect(_is_int(e.get("bucket")) and 0 <= e["bucket"] <= len(bounds), f"{w}.bucket", e.get("bucket"),
                f"an integer in [0, {len(bounds)}]")
        expect_key = key_str(e["op"], e["backend"], e["src_dtype"], e["dst_dtype"], e["bucket"])
        _expect(key == expect_key, f"{w}: key", key, repr(expect_key))
        pspecs = space.get(e["op"], {}).get(e["backend"], {}).get("params")
        _expect(isinstance(pspecs, dict), f"{w}: op/backend", (e["op"], e["backend"]), "one listed under space")
        cands = e.get("candidates")
        _expect(isinstance(cands, list) and cands, f"{w}.candidates", cands, "a non-empty list")
        for i, c in enumerate(cands):
            _expect(isinstance(c, dict) and isinstance(c.get("params"), dict), f"{w}.candidates[{i}]", c,
                    "an object with params")
            for t in _TIMING_FIELDS:
                _expect(_is_num(c.get(t)) and c[t] >= 0, f"{w}.candidates[{i}].{t}", c.get(t), "seconds >= 0")
        win = e.get("winner")
        _expect(isinstance(win, dict) and isinstance(win.get("params"), dict), f"{w}.winner", win,
                "an object with params")
        _expect(_is_num(win.get("median_s")) and win["median_s"] >= 0, f"{w}.winner.median_s",
                win.get("median_s"), "seconds >= 0")
        for p, v in win["params"].items():
            _expect(p in pspecs, f"{w}.winner.params", p, f"one of {', '.join(pspecs)}")
            check_param_value(v, pspecs[p], f"{w}.winner.params.{p}")
            # The file's own space is no guard (it is written by the same hand): the
            # packaged limits are.
            check_floor(v, e["op"], e["backend"], p, f"{w}.winner.params.{p}")
        if (e["op"] in _dispatch.OPS and e["backend"] in _dispatch.BACKENDS
                and not _dispatch.launcher_takes_any_keyword(e["backend"], e["op"])):
            # Winners are passed to the launcher as keyword arguments: a name it does not
            # take would raise TypeError from every launch (the file's space is no guard).
            accepted = _dispatch.launcher_keywords(e["backend"], e["op"])
            for p in win["params"]:
                _expect(p in accepted, f"{w}.winner.params", p,
                        f"a parameter of the {e['backend']} {e['op']} launcher ({', '.join(accepted)})")


# --------------------------------------------------------------------------- lookup


class _Table:
    """The validated winners of one device's file, with a per-key cache."""

    def __init__(self, doc: dict, path: Path):
        self.path = path
        self.bounds = list(doc["size_buckets"])
        self.winners = {
            (e["op"], e["backend"], e["src_dtype"], e["dst_dtype"], e["bucket"]): dict(e["winner"]["params"])
            for e in doc["entries"].values()
        }
        self._cache: dict = {}

    def lookup(self, op, backend, src_dtype, dst_dtype, numel) -> dict:
        key = (op, backend, src_dtype, dst_dtype, bisect.bisect_left(self.bounds, numel))
        hit = self._cache.get(key)
        if hit is None:
            hit = self.winners.get((op, backend, dtype_name(src_dtype), dtype_name(dst_dtype), key[4]), _EMPTY)
            self._cache[key] = hit
        return hit


_lock = fork_safe_lock()  # (an RLock)
#: (backend, device) -> _Table or None (defaults), filled on first use.
_tables: dict = {}
#: slug -> _Table or None, so two devices of one kind read the file once.
_by_slug: dict = {}
#: slug -> {"path", "state", "reason"} for :func:`status`.
_status: dict = {}
#: Set by :func:`forced` (measurement only): (op, backend) -> params for every call.
_forced: dict | None = None
#: Bumped whenever a table is read or forgotten (see :func:`state`).
generation = 0


def _untunable(backend: str, device) -> str | None:
    if backend not in TUNED_BACKENDS:
        return f"the {backend!r} backend has no launch parameters"
    want = TUNED_BACKENDS[backend]
    if device is None:
        if want == "cuda" and not torch.cuda.is_available():
            return "Triton runs under its interpreter here (no CUDA device)"
        return None
    if torch.device(device).type != want:
        return f"{backend} on {torch.device(device).type} tensors runs under an interpreter"
    return None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_json(text: str):
    """``text`` parsed as JSON as tuned files are written: NaN and Infinity, which
    Python's json reads, raise ValueError (the digest's ``json.dumps(allow_nan=False)``
    would otherwise raise on them later, from every op); so does nesting too deep for
    the parser (``json`` raises RecursionError, which no caller expects)."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError("nested too deeply to be a tuned-results or search-space file") from None


def _load(slug: str, path: Path, device_type: str) -> _Table | None:
    """Read and validate ``path`` (the tuned file of a ``device_type`` device) once; on
    any problem warn once and return None."""
    problem = None
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        problem = ("missing", f"no tuned launch parameters for this device (looked for {path})")
    except (OSError, UnicodeDecodeError) as e:
        problem = ("invalid", f"cannot read {path} ({type(e).__name__}: {e})")
    if problem is None:
        try:
            doc = parse_json(text)
        except ValueError as e:
            problem = ("invalid", f"ignoring {path}: not valid JSON ({e})")
        else:
            try:
                validate_results(doc, slug=slug, current_versions=versions(device_type))
            except TuningFileError as e:
                kind = "foreign version" if isinstance(e, TuningVersionError) else "invalid"
                problem = (kind, f"ignoring {path}: {e}")
    if problem is not None:
        state, msg = problem
        _status[slug] = {"path": str(path), "state": state, "reason": msg}
        warnings.warn(
            f"fastpar: {msg}; every launch on this device uses the default launch parameters. "
            "Run `python -m fastpar autotune` to tune them for this machine.",
            TuningWarning, stacklevel=4,
        )
        return None
    table = _Table(doc, path)
    _status[slug] = {"path": str(path), "state": "ok", "reason": f"{len(table.winners)} tuned keys"}
    log.info("fastpar: using %d tuned keys from %s", len(table.winners), path)
    return table


def _table_for(backend: str, device) -> _Table | None:
    global generation
    with _lock:
        key = (backend, device)
        if key in _tables:
            return _tables[key]
        why = _untunable(backend, device)
        if why is not None:
            log.info("fastpar: %s: launch parameters are never tuned there; using defaults", why)
            table = None
        else:
            dev = TUNED_BACKENDS[backend] if device is None else device
            info = device_info(dev)
            slug = info["slug"]
            if slug not in _by_slug:
                _by_slug[slug] = _load(slug, autotune_path(slug), info["type"])
            table = _by_slug[slug]
        _tables[key] = table
        generation += 1
        return table


def params(op: str, backend: str, src_dtype, dst_dtype, numel: int, device=None) -> dict:
    """Keyword arguments for one launch of ``op`` on ``backend``: the tuned winner for
    ``(op, backend, src_dtype, dst_dtype, size bucket of numel)`` on this device, or
    ``{}`` (the launcher's defaults). Do not mutate the returned dict.

    Args:
        op (str): op name as in ``fastpar/tuning_space.json`` (``"flatten"``...).
        backend (str): ``"numba"``, ``"triton"`` or ``"torch"``.
        src_dtype, dst_dtype (torch.dtype): element types read and written.
        numel (int): elements the whole call moves (picks the size bucket).
        device (torch.device, optional): the tensors' device. Default: CPU for Numba,
            the current CUDA device for Triton.
    """
    if _forced is not None:
        return _forced.get((op, backend), _EMPTY)
    try:
        table = _tables[(backend, device)]
    except KeyError:
        table = _table_for(backend, device)
    if table is None:
        return _EMPTY
    return table.lookup(op, backend, src_dtype, dst_dtype, numel)


def state() -> tuple:
    """What :func:`params` reads besides its arguments: the forced table and the
    generation of the tables read. While it is unchanged the answers are too (callers
    that keep resolved launches compare it instead of asking again)."""
    return _forced, generation


def resolution_state() -> tuple:
    """What a launch resolved once and kept (its backend, launcher and tuned parameters,
    as the DDP hooks' passes and the ops' bound calls keep them) depends on besides its
    tensors: the backend request (:func:`fastpar._dispatch.request_state`), the tuning
    state (:func:`state`) and torch's thread count (where torch runs on one thread the
    Numba launch is bound serial). Keepers compare it and resolve again when it changed."""
    return _dispatch.request_state(), state(), torch.get_num_threads()


@contextlib.contextmanager
def forced(table: dict):
    """Within the block, every launch of ``(op, backend)`` in ``table`` gets
    ``table[(op, backend)]`` and every other launch the defaults (``forced({})`` = all
    defaults: the untuned baseline). For measurement: process-wide, not thread-local."""
    global _forced
    prev = _forced
    _forced = dict(table)
    try:
        yield
    finally:
        _forced = prev


def reload() -> None:
    """Forget what was read, so the next launch reads the results files again (after a
    tuning run, or after ``FASTPAR_RESULTS_DIR`` changed)."""
    global generation
    with _lock:
        generation += 1
        _tables.clear()
        _by_slug.clear()
        _status.clear()


def status(device) -> dict:
    """``{"path", "state", "reason"}`` of the tuned file for ``device`` (reading it if
    not read yet); state is ``ok``, ``missing``, ``invalid``, ``foreign version`` or
    ``untuned`` (a device type fastpar does not tune)."""
    device = torch.device(device)
    backend = {"cpu": "numba", "cuda": "triton"}.get(device.type)
    if backend is None:
        return {"path": None, "state": "untuned", "reason": f"{device.type} devices are not tuned"}
    _table_for(backend, device)
    slug = device_info(device)["slug"]
    return dict(_status.get(slug, {"path": None, "state": "untuned", "reason": "not read"}))
