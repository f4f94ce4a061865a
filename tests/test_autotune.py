"""Autotune: a small search space tuned here is picked up by a fresh process; bad,
foreign or hand-edited results files and read-only results dirs never fail an op (one
warning each); concurrent tuners never lose or half-write a file.

Every test points ``FASTPAR_RESULTS_DIR`` at a temporary folder: nothing is written into
the repository's ``results/``.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

import fastpar
from fastpar import _tuning, autotune
from fastpar._tuning import TuningFileError, TuningWarning

SLUG = _tuning.device_info("cpu")["slug"]
F32 = torch.float32
SPACE = {"flatten": {"numba": {"params": {"chunk": {"values": [4096, 65536], "min": 1},
                                          "parallel_min_bytes": {"values": [16777216], "min": 4194304}}}}}
BOUNDS = [65536, 1048576]


@pytest.fixture
def results(tmp_path, monkeypatch):
    """A fresh results dir for this test, read afresh by ``_tuning``."""
    monkeypatch.setenv("FASTPAR_RESULTS_DIR", str(tmp_path))
    _tuning.reload()
    yield tmp_path
    _tuning.reload()


def _entry(bucket: int, chunk: int, op: str = "flatten") -> dict:
    cand = {"median_s": 1e-3, "q25_s": 9e-4, "q75_s": 1.1e-3, "min_s": 8e-4, "reps": 9}
    return {
        "op": op, "backend": "numba", "src_dtype": "float32", "dst_dtype": "float32", "scale": None,
        "bucket": bucket, "numel": 1000, "default": {"chunk": 65536, "parallel_min_bytes": 4194304},
        "candidates": [{"params": {"chunk": 65536, "parallel_min_bytes": 4194304}, **cand},
                       {"params": {"chunk": chunk, "parallel_min_bytes": 16777216}, **cand, "median_s": 5e-4}],
        "winner": {"params": {"chunk": chunk, "parallel_min_bytes": 16777216}, "median_s": 5e-4, "gain_vs_default": 2.0},
    }


def _save(root, entries: dict, **run) -> str:
    info = _tuning.device_info("cpu")
    return str(autotune.save(entries, device=info, bounds=BOUNDS, space=SPACE, run={"timestamp": "t", **run},
                             root=root))


def _key(bucket: int, op: str = "flatten") -> str:
    return _tuning.key_str(op, "numba", "float32", "float32", bucket)


def _fresh_process(root, code: str) -> dict:
    """Run ``code`` in a new interpreter reading ``root``; it prints one JSON line."""
    env = dict(os.environ, FASTPAR_RESULTS_DIR=str(root))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, f"fresh process failed (rc {r.returncode}):\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


# A fresh process records what the Numba flatten launcher receives.
_SPY = """
    import json, warnings
    import torch
    warnings.simplefilter("always")
    from fastpar.kernels.ops_numba import flatten as nf
    seen = []
    real = nf.flatten
    def spy(group, out, scale, **kw):
        seen.append(kw)
        return real(group, out, scale, **kw)
    nf.flatten = spy  # before the first call: dispatch caches the attribute it finds
    import fastpar
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        small = [torch.randn(1000) for _ in range(4)]                 # bucket 0
        big = [torch.randn(100_000) for _ in range(2)]                # bucket 1, not tuned
        ok = bool(torch.equal(fastpar.flatten(small), torch.cat(small)))
        fastpar.flatten(big)
    print(json.dumps({"kwargs": seen, "ok": ok,
                      "warnings": [str(x.message) for x in w if x.category.__name__ == "TuningWarning"]}))
"""


def test_small_space_winner_is_used_by_a_fresh_process(results, tmp_path_factory):
    """A deterministic runner (its cost depends on the chunk the op is given) makes chunk
    4096 the winner; a fresh process's flatten launches then receive chunk=4096."""
    mod = tmp_path_factory.mktemp("runner")
    (mod / "fake_runner.py").write_text(textwrap.dedent("""
        import time, torch, fastpar
        from fastpar import _tuning
        from fastpar.autotune import Work

        def runner(device, src, dst, scale, numel, n_sets):
            fns = []
            for _ in range(n_sets):
                ts = [torch.randn(numel // 4, dtype=src) for _ in range(4)]
                out = torch.empty(numel, dtype=dst)
                def fn(ts=ts, out=out):
                    fastpar.flatten(ts, out=out)
                    chunk = _tuning.params("flatten", "numba", src, dst, numel).get("chunk")
                    time.sleep(0 if chunk == 4096 else 0.01)   # the tuner must find 4096 (10 ms: above load noise)
                fns.append(fn)
            return Work(fns, 2 * numel * src.itemsize, 4)
    """))
    space = {"schema": _tuning.SPACE_SCHEMA, "size_buckets": BOUNDS, "min_gain": 0.03, "ops": {"flatten": {
        "runner": "fake_runner:runner", "dtypes": [{"src": "float32", "dst": "float32"}],
        "sizes": [4000], "quick_sizes": [4000],
        "backends": {"numba": {"device": "cpu", "params": {"chunk": {"values": [4096, 16384], "min": 1}}}}}}}
    space_path = mod / "space.json"
    space_path.write_text(json.dumps(space))
    sys.path.insert(0, str(mod))
    try:
        result = autotune.tune(quick=True, space=space_path, devices=["cpu"], progress=False)
    finally:
        sys.path.remove(str(mod))
    path = result[SLUG]["path"]
    assert path is not None and path.parent == results / "autotune", result[SLUG]["error"]
    doc = json.loads(path.read_text())
    _tuning.validate_results(doc, slug=SLUG, current_versions=_tuning.versions("cpu"))
    entry = doc["entries"][_key(0)]
    assert entry["default"] == {"chunk": 65536}
    assert sorted(c["params"]["chunk"] for c in entry["candidates"]) == [4096, 16384, 65536]
    assert all(c["median_s"] > 0 and c["q25_s"] <= c["median_s"] <= c["q75_s"] for c in entry["candidates"])
    assert entry["winner"]["params"] == {"chunk": 4096}, entry["winner"]
    assert entry["winner"]["gain_vs_default"] > 1.5
    assert doc["runs"][-1]["keys"] == [_key(0)]
    assert not list((results / "autotune").glob("*.tmp")), "a temp file was left behind"

    seen = _fresh_process(results, _SPY)
    assert seen["ok"] and not seen["warnings"], seen
    assert seen["kwargs"] == [{"chunk": 4096}, {}], "bucket 0 tuned, bucket 1 on defaults"


def _tune_one_candidate(results, op: str, **entry) -> dict:
    """Tune the packaged ``op`` at 8192 elements on one Numba candidate (chunk 1024) and
    return the results file (``entry`` overrides fields of the op's space entry)."""
    space = json.loads(_tuning.SPACE_PATH.read_text())
    space["ops"] = {op: dict(space["ops"][op], sizes=[8192], quick_sizes=[8192], **entry)}
    space["ops"][op]["backends"] = {"numba": {"device": "cpu", "params": {
        "chunk": {"values": [1024], "min": 1}, "parallel_min_bytes": {"values": [4194304], "min": 0}}}}
    p = results / "space.json"
    p.write_text(json.dumps(space))
    result = autotune.tune([op], quick=True, space=p, devices=["cpu"], progress=False)
    return json.loads(result[SLUG]["path"].read_text())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton's tuning runs on the GPU)")
def test_cuda_tuning_times_in_rounds_and_records_the_defaults_host_time(results):
    """The CUDA path end to end on a two-candidate space: every candidate timed in
    :data:`autotune.CUDA_ROUNDS` rounds, the default's host time per call kept beside
    its figures, and a valid file whose winner the op then reads."""
    space = json.loads(_tuning.SPACE_PATH.read_text())
    space["ops"] = {"flatten": dict(space["ops"]["flatten"], sizes=[65536 * 4], quick_sizes=[65536 * 4],
                                    dtypes=[{"src": "float32", "dst": "float32"}])}
    space["ops"]["flatten"]["backends"] = {"triton": {"device": "cuda", "params": {
        "block": {"values": [512, 2048], "min": 16, "pow2": True},
        "num_warps": {"values": [4], "min": 1, "pow2": True}}}}
    p = results / "space.json"
    p.write_text(json.dumps(space))
    result = autotune.tune(["flatten"], quick=True, space=p, devices=["cuda"], progress=False)
    slug = _tuning.device_info(torch.device("cuda"))["slug"]
    doc = json.loads(result[slug]["path"].read_text())
    _tuning.validate_results(doc, slug=slug, current_versions=_tuning.versions("cuda"))
    (e,) = doc["entries"].values()
    assert e["timer"].startswith(f"triton.testing.do_bench, median of {autotune.CUDA_ROUNDS['quick']} interleaved")
    assert [c["reps"] for c in e["candidates"]] == [autotune.CUDA_ROUNDS["quick"]] * 2
    assert e["candidates"][0]["params"] == e["default"] and e["candidates"][0]["host_s"] > 0
    assert "host_s" not in e["candidates"][1]
    assert all(0 < c["q25_s"] <= c["median_s"] <= c["q75_s"] for c in e["candidates"]), e["candidates"]
    got = _tuning.params("flatten", "triton", torch.float32, torch.float32, 65536 * 4, torch.device("cuda"))
    assert got == e["winner"]["params"], (got, e["winner"])


def _params_in_fresh_process(results, op: str, dst: str) -> dict:
    return _fresh_process(results, f"""
        import json, torch
        from fastpar import _tuning
        print(json.dumps(_tuning.params("{op}", "numba", torch.float32, torch.{dst}, 8192)))
    """)


def test_real_flatten_runner_quick(results):
    """The packaged runner on a two-candidate space: a valid file whose winner a fresh
    process's ``_tuning.params`` returns."""
    doc = _tune_one_candidate(results, "flatten", dtypes=[{"src": "float32", "dst": "bfloat16", "scale": 0.5}])
    _tuning.validate_results(doc, slug=SLUG, current_versions=_tuning.versions("cpu"))
    e = doc["entries"]["flatten/numba/float32->bfloat16/b0"]
    assert len(e["candidates"]) == 2 and e["input_sets"] >= 2 and e["cache_flushed"] is True
    assert _params_in_fresh_process(results, "flatten", "bfloat16") == e["winner"]["params"]


@pytest.mark.parametrize("flushed", [True, False], ids=["flushed", "unflushed"])
def test_cpu_entry_timer_says_how_the_timed_call_was_made(results, monkeypatch, flushed):
    """A flushed candidate's timed call is the second of two with its parameters (the
    first untimed, before the flush); an unflushed one is the first after prepare(). The
    entry's timer says which, as the bench JSON's timer does: files tuned before the
    untimed call was added read "after warm-up" alone and cannot be told apart otherwise."""
    if not flushed:  # a last-level cache too small for the inputs: no flush
        monkeypatch.setattr(autotune, "llc_bytes", lambda: 1)
    doc = _tune_one_candidate(results, "unflatten_into")
    _tuning.validate_results(doc, slug=SLUG, current_versions=_tuning.versions("cpu"))
    assert doc["entries"]
    for e in doc["entries"].values():
        assert e["cache_flushed"] is flushed
        assert e["timer"].startswith("time.perf_counter median of interleaved rounds after warm-up")
        assert ("each timed call the second of two with its candidate's parameters" in e["timer"]) is flushed, e["timer"]


def test_real_reduce_add_runner_quick(results):
    """The packaged reduce_add runner: its candidates write what the defaults write, and
    the winner is what a fresh process's ``_tuning.params`` returns for reduce_add."""
    work = autotune.reduce_add_runner(torch.device("cpu"), F32, F32, None, 5000, 2)
    assert len(work.fns) == 2 and work.nbytes == 5000 * 4 * (autotune.REDUCE_REPLICAS + 1)
    autotune.verify_candidates(work, [{"chunk": 1024}], "reduce_add", "numba")
    copies = work.fns[0].args[0]
    for i in (0, len(copies[0]) - 1):
        expected = sum(c[i].double() for c in copies)
        torch.testing.assert_close(work.outputs[i].double(), expected)
    doc = _tune_one_candidate(results, "reduce_add")
    winner = doc["entries"]["reduce_add/numba/float32->float32/b0"]["winner"]["params"]
    assert _params_in_fresh_process(results, "reduce_add", "float32") == winner


# ----------------------------------------------------------------------------- bad files


def _rewrite(path, mutate, *, redigest: bool):
    doc = json.loads(open(path).read())
    mutate(doc)
    if redigest:
        doc["digest"] = _tuning.digest(doc)
    open(path, "w").write(json.dumps(doc))


def _set(d, keys, value):
    for k in keys[:-1]:
        d = d[k]
    d[keys[-1]] = value


def _edit_text(path, edit) -> None:
    with open(path) as f:
        text = f.read()
    assert edit(text) != text, "the edit must change the file"
    with open(path, "w") as f:
        f.write(edit(text))


BAD_FILES = {
    "corrupt JSON": (lambda p: open(p, "w").write('{"schema": "fastpar.autotune/1", '), "not valid JSON"),
    # (Read before the file is opened for writing: open(p, "w").write(open(p).read()[:200])
    # truncates it first and wrote an empty file.)
    "truncated": (lambda p: _edit_text(p, lambda t: t[:200]), "not valid JSON"),
    "empty": (lambda p: open(p, "w").close(), "not valid JSON"),
    "not an object": (lambda p: open(p, "w").write("[1, 2]"), "expected a JSON object"),
    # Found by review: both raised from every op (UnicodeDecodeError is no OSError; json
    # reads NaN, which the digest's json.dumps(allow_nan=False) then refused).
    "not UTF-8": (lambda p: open(p, "wb").write(b"\xff\xfe\x00 not utf-8"), "UnicodeDecodeError"),
    "NaN inside": (lambda p: _edit_text(p, lambda t: t.replace('"median_s": ', '"median_s": NaN, "x": ', 1)),
                   "NaN is not a JSON value"),
    "wrong schema": (lambda p: _rewrite(p, lambda d: _set(d, ["schema"], "other/9"), redigest=True), "schema"),
    "hand-edited": (lambda p: _rewrite(p, lambda d: _set(d, ["entries", _key(0), "winner", "params", "chunk"], 8),
                                       redigest=False), "edited by hand"),
    "bad value": (lambda p: _rewrite(p, lambda d: _set(d, ["entries", _key(0), "winner", "params", "chunk"], -5),
                                     redigest=True), "expected an integer >= 1"),
    "unknown parameter": (lambda p: _rewrite(p, lambda d: _set(d, ["entries", _key(0), "winner", "params"],
                                                                  {"blocksize": 4}), redigest=True), "blocksize"),
    "wrong types": (lambda p: _rewrite(p, lambda d: _set(d, ["entries", _key(0), "candidates"], "fast"),
                                       redigest=True), "candidates"),
    "other device": (lambda p: _rewrite(p, lambda d: _set(d, ["device", "slug"], "cpu-elsewhere"), redigest=True),
                     "this device"),
    "other version": (lambda p: _rewrite(p, lambda d: _set(d, ["versions", "torch"], "1.0.0"), redigest=True),
                      "tuned with torch 1.0.0"),
    # The package version stays 0.1.0 across commits; the kernels' source digest does not.
    "other kernel sources": (lambda p: _rewrite(p, lambda d: _set(d, ["versions", "kernels"], "0123abcd"),
                                                redigest=True), "tuned with kernels 0123abcd"),
    # The file's own space allowing it is no excuse: a chunk of 0 would launch nothing.
    "below the packaged floor": (lambda p: _rewrite(p, lambda d: (
        _set(d, ["space", "flatten", "numba", "params", "chunk", "min"], 0),
        _set(d, ["entries", _key(0), "winner", "params", "chunk"], 0)), redigest=True),
        "expected an integer >= 1"),
    # Winners are the launcher's keyword arguments: a name it does not take raised
    # TypeError from every launch, since the file's own space listed it (found by review).
    "parameter the launcher does not take": (lambda p: _rewrite(p, lambda d: (
        _set(d, ["space", "flatten", "numba", "params", "bogus"], {"values": [4], "min": 1}),
        _set(d, ["entries", _key(0), "winner", "params", "bogus"], 4)), redigest=True),
        "expected a parameter of the numba flatten launcher (chunk, parallel_min_bytes, stream_min_bytes), got 'bogus'"),
    # json raises RecursionError, no ValueError, on deep nesting: it escaped every op.
    "nested too deeply": (lambda p: open(p, "w").write("[" * 100000), "nested too deeply"),
    # A thread-pool threshold below the launchers' default: 10-20x slower than the default
    # under a neighbour's load on a 2-core VM, for a 1.1-1.2x gain when idle.
    "parallel threshold below the default": (lambda p: _rewrite(p, lambda d: (
        _set(d, ["space", "flatten", "numba", "params", "parallel_min_bytes", "min"], 0),
        _set(d, ["entries", _key(0), "winner", "params", "parallel_min_bytes"], 0)), redigest=True),
        "parallel_min_bytes: expected an integer >= 4194304, got 0"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_results_file_one_warning_and_defaults(results, case):
    path = _save(results, {_key(0): _entry(0, 4096)})
    spoil, reason = BAD_FILES[case]
    spoil(path)
    ts = [torch.randn(100) for _ in range(5)]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            out = fastpar.flatten(ts)
        p = _tuning.params("flatten", "numba", F32, F32, 500)
    assert torch.equal(out, torch.cat(ts))
    assert p == {}, "an ignored file must leave every launch on defaults"
    tw = [x for x in w if issubclass(x.category, TuningWarning)]
    assert len(tw) == 1, [str(x.message) for x in tw]
    msg = str(tw[0].message)
    assert path in msg and reason in msg and "default launch parameters" in msg, msg
    assert _tuning.status("cpu")["state"] in ("invalid", "foreign version")


def test_missing_file_one_warning(results):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            fastpar.flatten([torch.randn(10), torch.randn(3)])
    tw = [str(x.message) for x in w if issubclass(x.category, TuningWarning)]
    assert len(tw) == 1 and "no tuned launch parameters" in tw[0] and SLUG in tw[0], tw
    assert _tuning.status("cpu")["state"] == "missing"


def test_valid_file_used_without_warning(results):
    _save(results, {_key(0): _entry(0, 4096), _key(2): _entry(2, 262144)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningWarning)
        assert _tuning.params("flatten", "numba", F32, F32, 65536) == {"chunk": 4096, "parallel_min_bytes": 16777216}
        assert _tuning.params("flatten", "numba", F32, F32, 65537) == {}  # bucket 1: not tuned
        assert _tuning.params("flatten", "numba", F32, F32, 10**8)["chunk"] == 262144
        assert _tuning.params("flatten", "numba", F32, torch.bfloat16, 100) == {}  # other dtype pair
        assert _tuning.params("unflatten_into", "numba", F32, F32, 100) == {}  # other op
        # Never tuned: the Triton interpreter on CPU tensors and the torch reference.
        assert _tuning.params("flatten", "triton", F32, F32, 100, torch.device("cpu")) == {}
        assert _tuning.params("flatten", "torch", F32, F32, 100) == {}
        with _tuning.forced({}):
            assert _tuning.params("flatten", "numba", F32, F32, 100) == {}
        with _tuning.forced({("flatten", "numba"): {"chunk": 7}}):
            assert _tuning.params("flatten", "numba", F32, F32, 10**8) == {"chunk": 7}
    assert _tuning.status("cpu")["state"] == "ok"


def test_interpreter_launches_on_cpu_tensors_read_no_cuda_table(results, monkeypatch):
    """The ops asked for the Triton backend's launch parameters without a device, which
    means the current CUDA device: on a machine with CUDA, CPU tensors run under the
    Triton interpreter read the GPU's tuned file (its winners used, a TuningWarning naming
    it where it is missing or stale) and initialised CUDA. They pass their tensors'
    device, and the interpreter is never tuned. (CUDA is simulated: any question about
    the CUDA device fails the test.)"""
    from fastpar import comm, rnn

    def asked(*a, **k):
        raise AssertionError("a launch on CPU tensors asked about the CUDA device")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", asked)
    monkeypatch.setattr(torch.cuda, "get_device_name", asked)
    ts = [torch.randn(5), torch.randn(3, 2)]
    lstm = torch.nn.LSTM(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningWarning)
        with fastpar.use_backend("triton"):
            flat = fastpar.flatten(ts)
            fastpar.unflatten_into(flat, [torch.empty_like(t) for t in ts])
            comm.reduce_add_coalesced([ts, ts], "cpu")
            comm.broadcast_coalesced(ts, ["cpu", "cpu"])
            rnn.pack(list(lstm._flat_weights), rnn.RNNLayout.for_module(lstm))
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in ts]))
    assert all(backend != "triton" or (dev is not None and dev.type == "cpu") for backend, dev in _tuning._tables)


def _ro_dir(path, monkeypatch):
    """Make ``path`` read-only; as root (permissions do not apply) make writes there fail
    the way they would for a user."""
    os.chmod(path, 0o555)
    if os.access(path, os.W_OK):
        real = autotune.tempfile.mkstemp

        def mkstemp(*a, dir=None, **k):
            if dir is not None and str(dir).startswith(str(path)):
                raise PermissionError(13, "Permission denied", str(dir))
            return real(*a, dir=dir, **k)

        monkeypatch.setattr(autotune.tempfile, "mkstemp", mkstemp)


def test_read_only_results_dir(results, monkeypatch):
    path = _save(results, {_key(0): _entry(0, 4096)})
    before = open(path).read()
    ro = results / "autotune"
    _ro_dir(ro, monkeypatch)
    try:
        # Reading works from a read-only dir.
        assert _tuning.params("flatten", "numba", F32, F32, 100) == {"chunk": 4096, "parallel_min_bytes": 16777216}
        # Tuning into it: no crash, one warning, the old file intact, nothing left over.
        space = json.loads(_tuning.SPACE_PATH.read_text())
        space["ops"] = {"flatten": dict(space["ops"]["flatten"], sizes=[2048], quick_sizes=[2048],
                                        dtypes=[{"src": "float32", "dst": "float32"}])}
        space["ops"]["flatten"]["backends"] = {"numba": {"device": "cpu", "params": {
            "chunk": {"values": [65536], "min": 1}}}}
        sp = results / "space.json"
        sp.write_text(json.dumps(space))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            result = autotune.tune(quick=True, space=sp, devices=["cpu"], progress=False)
        tw = [str(x.message) for x in w if issubclass(x.category, TuningWarning)]
        assert result[SLUG]["path"] is None and "cannot write" in result[SLUG]["error"]
        assert len(tw) == 1 and "FASTPAR_RESULTS_DIR" in tw[0] and "Permission" in tw[0], tw
        assert open(path).read() == before
        assert sorted(p.name for p in ro.iterdir() if not p.name.endswith(".lock")) == [os.path.basename(path)]
    finally:
        os.chmod(ro, 0o755)


@pytest.mark.parametrize("garbage", [b"garbage", b"\xff\xfe\x00 not utf-8", b'{"schema": NaN}'],
                         ids=["text", "not UTF-8", "NaN"])
def test_invalid_file_is_kept_aside_when_tuning(results, garbage):
    path = _save(results, {_key(0): _entry(0, 4096)})
    open(path, "wb").write(garbage)
    with pytest.warns(TuningWarning, match="not a valid tuned file"):
        _save(results, {_key(1): _entry(1, 16384)})
    assert open(path + ".rejected", "rb").read() == garbage, "kept aside byte for byte"
    doc = json.loads(open(path).read())
    assert list(doc["entries"]) == [_key(1)]


def test_deeply_nested_file_is_kept_aside_when_tuning(results):
    # RecursionError escaped save(): a whole tuning run lost at its very end.
    path = _save(results, {_key(0): _entry(0, 4096)})
    open(path, "w").write("[" * 100000)
    with pytest.warns(TuningWarning, match="nested too deeply"):
        _save(results, {_key(1): _entry(1, 16384)})
    assert list(json.loads(open(path).read())["entries"]) == [_key(1)]


def test_save_refuses_a_winner_the_launcher_does_not_take(results):
    space = {"flatten": {"numba": {"params": dict(SPACE["flatten"]["numba"]["params"],
                                                  bogus={"values": [4], "min": 1})}}}
    e = _entry(0, 4096)
    e["winner"]["params"]["bogus"] = 4
    with pytest.raises(TuningFileError, match="got 'bogus'"):
        _save_as(results, {_key(0): e}, space=space)
    assert not (results / "autotune" / f"{SLUG}.json").exists()


def test_other_version_file_is_superseded(results):
    path = _save(results, {_key(0): _entry(0, 4096)})
    _rewrite(path, lambda d: _set(d, ["versions", "numba"], "0.1"), redigest=True)
    _save(results, {_key(1): _entry(1, 16384)})
    doc = json.loads(open(path).read())
    assert list(doc["entries"]) == [_key(1)] and doc["versions"] == _tuning.versions("cpu")
    assert json.loads(open(path + ".prev").read())["versions"]["numba"] == "0.1"


def test_older_versions_file_below_todays_limits_is_called_other_version(results):
    # A file tuned with older kernels, whose winner was allowed then and is below the
    # packaged limits now (results/autotune/cpu-intel-xeon-processor-f6m167s1-2t.json:
    # a parallel_min_bytes of 0, kernels b3dad162...). Its entries were checked before
    # its versions: it was reported "invalid" (a winner "expected an integer >= 4194304,
    # got 0"), and the tuner set it aside as .rejected with a warning, not as .prev.
    path = _save(results, {_key(0): _entry(0, 4096)})
    _rewrite(path, lambda d: (
        _set(d, ["versions", "kernels"], "0123abcd"),
        _set(d, ["space", "flatten", "numba", "params", "parallel_min_bytes", "min"], 0),
        _set(d, ["entries", _key(0), "winner", "params", "parallel_min_bytes"], 0)), redigest=True)
    p, tw = _params_and_warnings()
    assert p == {}
    assert len(tw) == 1 and "tuned with kernels 0123abcd" in tw[0], tw
    assert _tuning.status("cpu")["state"] == "foreign version"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _save(results, {_key(1): _entry(1, 16384)})
    assert not [str(x.message) for x in w if issubclass(x.category, TuningWarning)]
    assert os.path.exists(path + ".prev") and not os.path.exists(path + ".rejected")
    assert json.loads(open(path + ".prev").read())["versions"]["kernels"] == "0123abcd"


# ----------------------------------------------------------------------------- concurrency


def _writer(root: str, offset: int, n: int, barrier) -> None:
    """Save ``n`` runs, each re-tuning one of three keys (both writers share keys, so
    merging must keep every key and log every run)."""
    barrier.wait(timeout=120)  # start together, so the writes really overlap
    for i in range(n):
        autotune.save({_key(i % 3): _entry(i % 3, 1 << (10 + (offset + i) % 8))},
                      device=_tuning.device_info("cpu"), bounds=BOUNDS, space=SPACE,
                      run={"timestamp": "t", "writer": offset, "i": i}, root=root)


def _reader(root: str, stop, barrier) -> int:
    """Read the file in a loop; return how many complete, valid reads it made (raises on
    a partial or invalid file)."""
    path = os.path.join(root, "autotune", f"{SLUG}.json")
    good = 0
    barrier.wait(timeout=120)
    while not stop.is_set():
        try:
            text = open(path).read()
        except FileNotFoundError:
            continue
        _tuning.validate_results(json.loads(text), slug=SLUG)
        good += 1
    return good


def test_concurrent_writers_merge_and_never_tear(results):
    ctx = multiprocessing.get_context("spawn")
    n = 20  # x 2 writers: within MAX_RUNS, so every run must still be in the log
    assert 2 * n <= autotune.MAX_RUNS
    with ctx.Manager() as m:
        stop, barrier = m.Event(), m.Barrier(3)
        with ctx.Pool(3) as pool:
            reader = pool.apply_async(_reader, (str(results), stop, barrier))
            writers = [pool.apply_async(_writer, (str(results), k, n, barrier)) for k in (0, 100)]
            for w in writers:
                w.get(timeout=300)
            stop.set()
            good_reads = reader.get(timeout=60)
    path = results / "autotune" / f"{SLUG}.json"
    doc = json.loads(path.read_text())
    _tuning.validate_results(doc, slug=SLUG, current_versions=_tuning.versions("cpu"))
    runs = [(r["writer"], r["i"]) for r in doc["runs"]]
    assert sorted(runs) == sorted([(0, i) for i in range(n)] + [(100, i) for i in range(n)]), \
        "a concurrent writer's run was lost"
    assert set(doc["entries"]) == {_key(0), _key(1), _key(2)}
    assert good_reads > 0
    assert not [p for p in (results / "autotune").iterdir() if p.name.endswith(".tmp")]


# ----------------------------------------------------------------------------- space


def test_space_file_is_valid_and_matches_the_launchers():
    space = _tuning.load_space()
    for op, e in space["ops"].items():
        for backend, be in e["backends"].items():
            if not e.get("end_to_end", False):
                defaults = autotune.launcher_defaults(op, backend, list(be["params"]))
                assert set(defaults) == set(be["params"])


def test_space_naming_an_unknown_launcher_parameter_is_refused():
    with pytest.raises(TuningFileError, match=r"num_threads .*accepts only chunk, parallel_min_bytes"):
        autotune.launcher_defaults("flatten", "numba", ["chunk", "num_threads"])


@pytest.mark.parametrize("mutate, match", [
    (lambda s: s.update(size_buckets=[10, 5]), "strictly increasing"),
    (lambda s: s["ops"]["flatten"].update(runner="no colon"), "module:function"),
    (lambda s: s["ops"]["flatten"]["dtypes"].append({"src": "float33", "dst": "float32"}), "float33"),
    (lambda s: s["ops"]["flatten"]["backends"]["triton"]["params"]["block"]["values"].append(1000), "power of two"),
    (lambda s: s["ops"]["flatten"]["backends"].update(cuda={}), "one of numba, triton"),
])
def test_bad_space_is_refused(mutate, match):
    space = json.loads(_tuning.SPACE_PATH.read_text())
    mutate(space)
    with pytest.raises(TuningFileError, match=match):
        _tuning.validate_space(space)


def test_param_like_sizes():
    for n in (1, 64, 1000, 4096, 10**6):
        s = autotune.param_like_sizes(n)
        assert sum(s) == n and all(x > 0 for x in s)
    assert len(autotune.param_like_sizes(10**6)) >= 8


def _cand(params, times):
    s = autotune._stats(times)
    return {"params": params, **s}


def test_pick_sign_test():
    d = {"chunk": 65536}
    # Bimodal default (thread pool worker awake or not), candidate steadily faster in
    # every round: the candidate wins although the quartiles overlap.
    bimodal = [1.3, 8.0] * 15
    steady = [1.2] * 30
    w = autotune._pick([_cand(d, bimodal), _cand({"chunk": 4096}, steady)], d, 0.03)
    assert w["params"] == {"chunk": 4096} and w["rounds_won"] == "30/30"
    # Same distribution, faster median by luck of ordering only: the default stays.
    a = [1.0, 1.1, 1.2, 1.3] * 8
    b = [1.3, 1.2, 1.0, 1.05] * 8
    w = autotune._pick([_cand(d, a), _cand({"chunk": 4096}, b)], d, 0.0)
    assert w["params"] == d and "default kept" in w["reason"]
    # Under min_gain: the default stays.
    w = autotune._pick([_cand(d, [1.0] * 9), _cand({"chunk": 1}, [0.99] * 9)], d, 0.03)
    assert w["params"] == d and "min_gain" in w["reason"]


def test_space_below_the_packaged_floor_is_refused(tmp_path):
    space = json.loads(_tuning.SPACE_PATH.read_text())
    space["ops"]["flatten"]["backends"]["numba"]["params"]["chunk"] = {"values": [0, 65536], "min": 0}
    p = tmp_path / "space.json"
    p.write_text(json.dumps(space))
    with pytest.raises(TuningFileError, match=r"numba\.params\.chunk\.values\[0\]: expected an integer >= 1, got 0"):
        _tuning.load_space(p)


def test_space_path_expands_the_home_folder(tmp_path, monkeypatch):
    """``--space=~/s.json`` reaches load_space as is (no shell expands ``~`` after
    ``=``); it was read as ``./~/s.json``, as ``--results-dir`` once was."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "s.json").write_text(_tuning.SPACE_PATH.read_text())
    assert _tuning.load_space("~/s.json") == _tuning.load_space(_tuning.SPACE_PATH)


def test_tuning_warning_is_public():
    """Users without a tuned file see it once; they filter it by its public class."""
    assert fastpar.TuningWarning is _tuning.TuningWarning and "TuningWarning" in fastpar.__all__
    assert issubclass(fastpar.TuningWarning, UserWarning)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_space_with_a_non_json_constant_is_refused_when_read(tmp_path, constant):
    """Python's json reads NaN and Infinity; a space holding one (here in a parameter's
    note, which validation does not look at) used to pass, and the run it drove failed
    only when saving (the tuned file's digest refuses them)."""
    text = _tuning.SPACE_PATH.read_text(encoding="utf-8")
    space = json.loads(text)
    space["ops"]["flatten"]["backends"]["numba"]["params"]["chunk"]["note"] = float("nan")
    p = tmp_path / "space.json"
    p.write_text(json.dumps(space).replace("NaN", constant))
    with pytest.raises(TuningFileError, match=rf"cannot read it as JSON \(ValueError: {constant} is not a JSON value"):
        _tuning.load_space(p)
    p.write_bytes(b"\xff\xfe" + text.encode("utf-16-le"))  # not UTF-8
    with pytest.raises(TuningFileError, match=r"cannot read it as JSON \(UnicodeDecodeError"):
        _tuning.load_space(p)


def test_packaged_space_searches_no_parallel_threshold_below_the_default():
    from fastpar.kernels.ops_numba import flatten as nf, reduce_add as nr

    space = _tuning.load_space(_tuning.SPACE_PATH)
    for op, launcher in (("flatten", nf), ("unflatten_into", nf), ("reduce_add", nr)):
        spec = space["ops"][op]["backends"]["numba"]["params"]["parallel_min_bytes"]
        assert spec["min"] == launcher.DEFAULT_PARALLEL_MIN_BYTES, op
        assert min(spec["values"]) >= launcher.DEFAULT_PARALLEL_MIN_BYTES, op


def test_a_zero_chunk_raises_instead_of_writing_nothing():
    ts = [torch.randn(10), torch.randn(7)]
    out = torch.full((17,), float("nan"))
    with _tuning.forced({("flatten", "numba"): {"chunk": 0}}):
        with pytest.raises(ValueError, match="must be a positive int, got 0"):
            fastpar.flatten(ts, out=out)
    assert out.isnan().all()


def test_a_candidate_that_computes_wrong_values_is_never_timed(monkeypatch):
    from fastpar.kernels.ops_numba import flatten as nf

    real = nf.flatten

    def sloppy(group, out, scale, **kw):
        if kw.get("chunk") == 4096:
            return None  # pretends to run, writes nothing
        return real(group, out, scale, **kw)

    monkeypatch.setattr(nf, "flatten", sloppy)
    monkeypatch.setattr(fastpar._dispatch, "_kernel", lambda backend, op: sloppy if op == "flatten" else None)
    work = autotune.flatten_runner(torch.device("cpu"), F32, torch.bfloat16, 0.5, 20000, 1)
    autotune.verify_candidates(work, [{"chunk": 1024}], "flatten", "numba")  # a correct one passes
    with pytest.raises(RuntimeError, match=r"with \{'chunk': 4096\} wrote different values from the defaults "
                                           r"\(output 0: 20000 of 20000 elements differ\)"):
        autotune.verify_candidates(work, [{"chunk": 1024}, {"chunk": 4096}], "flatten", "numba")


def test_cpu_slug_names_the_cpu_generation_and_thread_count(monkeypatch):
    import numba

    slug = _tuning.device_info("cpu")["slug"]
    assert slug.startswith("cpu-") and slug.endswith(f"-{numba.config.NUMBA_NUM_THREADS}t"), slug
    cpu_id = _tuning._cpu_id()
    if cpu_id:  # Linux: family, model and stepping numbers
        assert f"-{cpu_id}-" in slug and cpu_id[0] == "f" and "m" in cpu_id and "s" in cpu_id


# --- found by mutation testing: versions, digests, keys, places, timing, saving


def _save_as(root, entries: dict, *, device=None, bounds=BOUNDS, space=SPACE, **run) -> str:
    """:func:`_save` with the device, size buckets and space given."""
    info = device or _tuning.device_info("cpu")
    return str(autotune.save(entries, device=info, bounds=bounds, space=space, run={"timestamp": "t", **run},
                             root=root))


def _params_and_warnings(numel=500):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        p = _tuning.params("flatten", "numba", F32, F32, numel)
    return p, [str(x.message) for x in w if issubclass(x.category, TuningWarning)]


def _kernels_copy(tmp_path):
    import shutil
    from pathlib import Path

    src = Path(fastpar.kernels.__file__).resolve().parent
    dst = tmp_path / "kernels"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _digests(root):
    _tuning._kernels_digests.clear()  # (cached per folder; a test edits the folder in place)
    return {t: _tuning.kernels_digest(t, root) for t in (None, "cpu", "cuda")}


@pytest.mark.parametrize("edited, voids", [
    ("ops_numba/flatten.py", {None, "cpu"}),
    ("ops_triton/flatten.py", {None, "cuda"}),
    ("ops_torch/flatten.py", {None}),  # the reference backend is never tuned
    ("_launch.py", {None, "cpu", "cuda"}),
])
def test_kernel_digest_covers_the_sources_of_the_devices_backend(tmp_path, edited, voids):
    # A tuned file records the digest of the sources its device's backend runs: editing
    # the Numba kernels must not void a GPU's file, which only that GPU can tune again
    # (the digest covered every backend's sources: any CPU kernel edit voided them all).
    root = _kernels_copy(tmp_path)
    try:
        before = _digests(root)
        with open(root / edited, "a") as f:
            f.write("\n# edited\n")
        after = _digests(root)
    finally:
        _tuning._kernels_digests.clear()
    assert {t for t in before if before[t] != after[t]} == voids
    assert before["cpu"] != before["cuda"] != before[None]


def test_versions_record_the_digest_of_the_devices_backend():
    assert _tuning.versions("cpu")["kernels"] == _tuning.kernels_digest("cpu")
    assert _tuning.versions("cuda")["kernels"] == _tuning.kernels_digest("cuda")
    assert _tuning.versions()["kernels"] == _tuning.kernels_digest()  # a bench run: all of them
    assert len({_tuning.kernels_digest(t) for t in (None, "cpu", "cuda")}) == 3


def test_saved_file_records_the_cpu_kernels_digest(results):
    path = _save_as(results, {_key(0): _entry(0, 4096)})
    doc = json.loads(open(path).read())
    assert doc["versions"]["kernels"] == _tuning.kernels_digest("cpu")
    p, tw = _params_and_warnings()
    assert p == {"chunk": 4096, "parallel_min_bytes": 16777216} and not tw, (p, tw)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("lib", ["numba", "triton", "fastpar"])
def test_file_from_another_numba_or_triton_version_is_ignored(results, lib):
    # every recorded version is compared, not only some of them.
    path = _save_as(results, {_key(0): _entry(0, 4096)})
    _rewrite(path, lambda d: d["versions"].__setitem__(lib, "0.0.1"), redigest=True)
    p, tw = _params_and_warnings()
    assert p == {}
    assert len(tw) == 1 and f"tuned with {lib} 0.0.1" in tw[0], tw
    assert _tuning.status("cpu")["state"] == "foreign version"


def test_another_machines_file_with_its_slug_edited_by_hand_is_refused(results):
    # the device block is covered by the digest: a file tuned on another machine,
    # copied here and renamed (slug edited), must not be applied.
    other = dict(_tuning.device_info("cpu"), slug="cpu-some-other-machine-64t", name="Other CPU")
    src = _save_as(results, {_key(0): _entry(0, 4096)}, device=other)
    doc = json.loads(open(src).read())
    doc["device"]["slug"] = SLUG
    (results / "autotune" / f"{SLUG}.json").write_text(json.dumps(doc))
    p, tw = _params_and_warnings()
    assert p == {}, "another machine's winners were applied here"
    assert len(tw) == 1 and "edited by hand" in tw[0], tw


def test_entry_with_bucket_outside_the_size_buckets_is_refused(results):
    path = _save_as(results, {_key(0): _entry(0, 4096)})
    doc = json.loads(open(path).read())
    e = doc["entries"].pop(_key(0))
    e["bucket"] = 7
    doc["entries"][_key(7)] = e
    doc["digest"] = _tuning.digest(doc)
    with pytest.raises(TuningFileError, match=r"\.bucket: expected an integer in \[0, 2\], got 7"):
        _tuning.validate_results(doc, slug=SLUG)


def test_entry_filed_under_another_key_is_refused(results):
    # the key must say what the entry holds (bucket 0 filed under b1).
    path = _save_as(results, {_key(0): _entry(0, 4096)})
    doc = json.loads(open(path).read())
    doc["entries"][_key(1)] = doc["entries"].pop(_key(0))
    doc["digest"] = _tuning.digest(doc)
    with pytest.raises(TuningFileError, match=r": key: expected 'flatten/numba/float32->float32/b0'"):
        _tuning.validate_results(doc, slug=SLUG)


# ---------------------------------------------------------------- places


def test_results_dir_env_expands_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FASTPAR_RESULTS_DIR", "~/fp-results")
    assert _tuning.results_dir() == tmp_path / "fp-results"


@pytest.mark.parametrize("blank", [" ", "\t\n"])
def test_a_blank_results_dir_env_means_unset(monkeypatch, blank):
    # It named a folder "   " in the working folder, where autotune and bench wrote.
    monkeypatch.delenv("FASTPAR_RESULTS_DIR", raising=False)
    default = _tuning.results_dir()
    monkeypatch.setenv("FASTPAR_RESULTS_DIR", blank)
    assert _tuning.results_dir() == default


def test_results_dir_outside_a_checkout_is_the_user_cache(monkeypatch, tmp_path):
    # an installed package (no results/ + pyproject.toml beside it) uses
    # $XDG_CACHE_HOME/fastpar, else ~/.cache/fastpar.
    monkeypatch.delenv("FASTPAR_RESULTS_DIR", raising=False)
    monkeypatch.setattr(_tuning, "__file__", str(tmp_path / "site-packages" / "fastpar" / "_tuning.py"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _tuning.results_dir() == tmp_path / "xdg" / "fastpar"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _tuning.results_dir() == tmp_path / "home" / ".cache" / "fastpar"


# ---------------------------------------------------------------- timing


def test_stats_report_the_median_not_the_mean():
    s = autotune._stats([1.0, 1.0, 1.0, 1.0, 100.0])  # one descheduled round
    assert s["median_s"] == 1.0 and s["min_s"] == 1.0 and s["reps"] == 5


def test_host_per_call_is_the_best_burst_per_call_with_a_sync_around_each():
    log = []
    delays = iter([0.004] * 5 + [0.001] * 5 + [0.004] * 5)  # the second burst is the fastest

    def fn():
        log.append("call")
        time.sleep(next(delays))

    got = autotune.host_per_call(fn, lambda: log.append("sync"), calls=5, bursts=3)
    assert 0.0009 <= got < 0.003, got
    assert log == (["sync"] + ["call"] * 5) * 3 + ["sync"]


def test_time_cpu_rotates_which_variant_runs_first():
    order = []
    variants = [(lambda: None, [lambda i=i: order.append(i)]) for i in range(3)]
    autotune.time_cpu(variants, budget_s=0.0, min_rounds=3, max_rounds=3, warmup=0)
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1]


def test_time_cpu_times_the_call_after_an_untimed_one_when_it_flushes():
    """With a flush, each timed call follows an untimed call of the same entry with the
    same parameters (which resolves an op's bound launch), then the flush; without one,
    the timed call is the first after prepare()."""
    for flush in (None, True):
        log = []
        variants = [(lambda i=i: log.append(("prepare", i)), [lambda i=i: log.append(("call", i))]) for i in range(2)]
        autotune.time_cpu(variants, budget_s=0.0, min_rounds=2, max_rounds=2, warmup=0,
                          flush=None if flush is None else (lambda: log.append(("flush",))))
        if flush is None:
            assert log == [("prepare", 0), ("call", 0), ("prepare", 1), ("call", 1),
                           ("prepare", 1), ("call", 1), ("prepare", 0), ("call", 0)]
        else:
            assert log == [("prepare", 0), ("call", 0), ("flush",), ("call", 0),
                           ("prepare", 1), ("call", 1), ("flush",), ("call", 1),
                           ("prepare", 1), ("call", 1), ("flush",), ("call", 1),
                           ("prepare", 0), ("call", 0), ("flush",), ("call", 0)]


def test_time_rounds_rotates_the_order_and_keeps_each_rounds_median():
    """CUDA's rounds (``do_bench`` per candidate per round): every variant warmed once,
    then each round in an order rotated by the round; the per-round medians feed the
    sign test."""
    log = []
    variants = [(lambda i=i: log.append(("prepare", i)), [i]) for i in range(3)]
    times = {0: [3.0, 1.0, 2.0], 1: [5.0, 4.0, 6.0], 2: [1.0, 1.0, 1.0]}

    def measure(fns):
        i = fns[0]
        log.append(("measure", i))
        m = times[i].pop(0)
        return m - 0.5, m, m + 0.5

    out = autotune.time_rounds(variants, lambda prepare, fns: log.append(("warm", fns[0])), measure, 3)
    assert [x for x in log if x[0] == "warm"] == [("warm", 0), ("warm", 1), ("warm", 2)]
    assert [x[1] for x in log if x[0] == "measure"] == [0, 1, 2, 1, 2, 0, 2, 0, 1]
    assert log.index(("measure", 1)) == log.index(("prepare", 1)) + 1, "prepare right before its measure"
    assert out[0] == {"median_s": 2.0, "q25_s": 1.5, "q75_s": 2.5, "min_s": 0.5, "reps": 3,
                      "_times": [3.0, 1.0, 2.0]}
    assert out[1]["_times"] == [5.0, 4.0, 6.0] and out[1]["median_s"] == 5.0


@pytest.mark.parametrize("rounds", [1, 3])
def test_time_cuda_glue_with_do_bench_stubbed(monkeypatch, rounds):
    """``time_cuda``'s own code, runnable without a GPU: ``do_bench`` and the CUDA sync
    stubbed. Each variant is prepared and warmed (every input set called once) before
    it is timed; ``do_bench`` gets one round's budget per round, or 25/100 ms once
    (``bench``'s figures, with no ``_times``: the sign test needs rounds); quantiles in ms
    come back in seconds; ``host`` adds each variant's host time per call."""
    import triton.testing

    log, calls = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))

    def do_bench(fn, warmup, rep, quantiles):
        assert quantiles == [0.25, 0.5, 0.75]
        fn()
        log.append(("bench", warmup, rep))
        v = float(calls[-1])
        return [v, v + 1, v + 2]

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    variants = [(lambda i=i: log.append(("prepare", i)), [lambda i=i, k=k: calls.append(10 * i + k) for k in (1, 2)])
                for i in range(2)]
    out = autotune.time_cuda(variants, quick=False, host=True, rounds=rounds)
    want = (autotune.CUDA_ROUND_MS["full"] if rounds > 1 else (25, 100))
    if rounds > 1:  # all warmed first, then each round prepares and times every variant
        # (the untimed round first: r = -1, so variant 1 leads it)
        assert log[:6] == [("prepare", 0), "sync", ("prepare", 1), "sync", ("prepare", 1), ("bench", *want)]
    else:  # each warmed, timed, then its host time taken (3 bursts, a sync around each), as bench always did
        one = lambda i: [("prepare", i), "sync", ("bench", *want), ("prepare", i)] + ["sync"] * 4  # noqa: E731
        assert log == one(0) + one(1)
    # Every input set of a variant is called in its warm-up (with one round, do_bench's
    # call and the host bursts' 60 calls of variant 0 come between).
    warmed = calls[:4] if rounds > 1 else calls[:2] + calls[63:65]
    assert warmed == [1, 2, 11, 12], calls[:6]
    benches = [x for x in log if isinstance(x, tuple) and x[0] == "bench"]
    assert benches == [("bench", *want)] * (2 * (rounds + autotune.CUDA_WARMUP_ROUNDS if rounds > 1 else 1))
    assert [o["reps"] for o in out] == ([rounds] * 2 if rounds > 1 else [None, None])
    assert ("_times" in out[0]) is (rounds > 1)
    for i, o in enumerate(out):
        assert 10 * i + 1 <= o["median_s"] * 1e3 - 1 <= 10 * i + 2 and o["q25_s"] < o["median_s"] < o["q75_s"], o
        assert o["host_s"] > 0


def test_rounds_keep_the_default_when_only_the_first_timed_is_slower():
    """On an H200 the first candidate timed, the default, took twice the others' time
    (the GPU's clocks ramping up from idle) and a candidate no faster than it won. In
    rotated rounds the slow first slot falls on every candidate in turn: the default's
    median is the others', and the sign test keeps it."""
    slot = []

    def measure(fns):
        slot.append(fns[0])
        first = len(slot) % 4 == 1  # the first of the round's four
        m = 2.0 if first else 1.0
        return m, m, m

    variants = [(lambda: None, [i]) for i in range(4)]
    stats = autotune.time_rounds(variants, lambda p, f: None, measure, autotune.CUDA_ROUNDS["full"])
    cands = [{"params": {"block": b}, **s} for b, s in zip((2048, 512, 1024, 4096), stats)]
    assert cands[0]["_times"][0] == 2.0 and cands[0]["median_s"] == 1.0
    w = autotune._pick(cands, {"block": 2048}, 0.03)
    assert w["params"] == {"block": 2048}, w


def test_rounds_discard_the_untimed_round_where_the_first_call_of_a_key_ran_slow():
    """On the H200 the first ``do_bench`` of a key ran slow, and round 0 starts with the
    default: timed, that round would give every challenger a free win over the default
    in the sign test (5 of 5 with --quick then needs only 4 of the other 4). The
    untimed round takes the slow start."""
    def run(warmup_rounds):
        seen = []

        def measure(fns):
            seen.append(fns[0])
            m = 2.0 if len(seen) == 1 else 1.0
            return m, m, m

        variants = [(lambda: None, [i]) for i in range(3)]
        return seen, autotune.time_rounds(variants, lambda p, f: None, measure, 5, warmup_rounds=warmup_rounds)

    seen, stats = run(0)
    assert seen[0] == 0 and stats[0]["_times"][0] == 2.0  # without it, the default pays
    seen, stats = run(1)
    assert len(seen) == 3 * 6 and seen[:3] == [2, 0, 1]
    assert all(s["_times"] == [1.0] * 5 and s["reps"] == 5 for s in stats), stats


def test_pick_keeps_the_default_when_its_call_is_host_bound():
    """A host-bound default (host time per call at least 90% of its median: the GPU waits
    on the host) keeps its parameters even when a candidate looks faster in every round;
    below the bound the sign test decides."""
    d = {"block": 2048, "num_warps": 4}
    fast = _cand({"block": 512, "num_warps": 4}, [30e-6] * 9)
    slow = _cand(d, [60e-6] * 9)
    w = autotune._pick([{**slow, "host_s": 55e-6}, fast], d, 0.03)
    assert w["params"] == d and w["gain_vs_default"] == 1.0
    assert "host-bound" in w["reason"] and "55.0 us of host time" in w["reason"], w["reason"]
    w = autotune._pick([{**slow, "host_s": 20e-6}, fast], d, 0.03)
    assert w["params"] == {"block": 512, "num_warps": 4} and w["rounds_won"] == "9/9", w


def test_pick_needs_clearly_more_than_half_the_rounds():
    # A 2x faster median but faster in only 16 of 30 rounds (needs 16 >= 15 + sqrt(30)).
    d = {"chunk": 65536}
    best = [1.0] * 16 + [3.0] * 14
    w = autotune._pick([_cand(d, [2.0] * 30), _cand({"chunk": 4096}, best)], d, 0.03)
    assert w["params"] == d and "faster in only 16 of 30 rounds" in w["reason"], w
    assert w["rounds_won"] == "16/30"


def test_tune_uses_the_spaces_min_gain(monkeypatch, tmp_path):
    class Seen(Exception):
        pass

    def spy(job, device, *, quick, min_gain, bar):
        raise Seen(min_gain)

    space = json.loads(_tuning.SPACE_PATH.read_text())
    space["min_gain"] = 0.25
    p = tmp_path / "space.json"
    p.write_text(json.dumps(space))
    monkeypatch.setattr(autotune, "_tune_one", spy)
    with pytest.raises(Seen) as e:
        autotune.tune(["flatten"], quick=True, space=p, devices=["cpu"], root=tmp_path, progress=False)
    assert e.value.args[0] == 0.25


# ---------------------------------------------------------------- saving


def test_run_log_keeps_the_newest_runs(results):
    n = autotune.MAX_RUNS + 3
    for i in range(n):
        path = _save_as(results, {_key(0): _entry(0, 4096)}, i=i)
    runs = json.loads(open(path).read())["runs"]
    assert len(runs) == autotune.MAX_RUNS
    assert [r["i"] for r in runs] == list(range(3, n)), "the newest runs must be kept, the oldest dropped"


def test_file_with_other_size_buckets_is_superseded(results):
    path = _save_as(results, {_key(1): _entry(1, 4096)})
    _save_as(results, {_key(0): _entry(0, 16384)}, bounds=[1000, 2000000])
    doc = json.loads(open(path).read())
    # Bucket 1 meant 65537..1048576 elements before; it is another range now.
    assert list(doc["entries"]) == [_key(0)] and doc["size_buckets"] == [1000, 2000000]
    assert json.loads(open(path + ".prev").read())["size_buckets"] == BOUNDS


def test_retuning_a_key_replaces_its_winner(results):
    _save_as(results, {_key(0): _entry(0, 4096)})
    path = _save_as(results, {_key(0): _entry(0, 16384)})
    doc = json.loads(open(path).read())
    assert doc["entries"][_key(0)]["winner"]["params"]["chunk"] == 16384
    assert _tuning.params("flatten", "numba", F32, F32, 500)["chunk"] == 16384


def test_old_entries_outside_a_narrower_space_are_dropped_not_fatal(results):
    _save_as(results, {_key(0): _entry(0, 4096)})
    narrow = {"flatten": {"numba": {"params": {"chunk": {"values": [16384], "min": 1}}}}}
    e1 = _entry(1, 16384)
    e1["winner"]["params"] = {"chunk": 16384}
    path = _save_as(results, {_key(1): e1}, space=narrow)
    doc = json.loads(open(path).read())
    assert list(doc["entries"]) == [_key(1)]
