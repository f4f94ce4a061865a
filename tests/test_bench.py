"""``python -m fastpar bench`` end to end at tiny sizes: a table, a JSON file that
validates and a PNG that opens, with the tuned-vs-untuned column when a tuned file is
present. Written to a temporary results dir, never the repository's ``results/``."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from fastpar import _tuning, autotune, bench


def _tuned_file(root) -> None:
    """A tuned file whose flatten winner (bucket 0, fp32) differs from the defaults."""
    space = {"flatten": {"numba": {"params": {"chunk": {"values": [4096], "min": 1},
                                              "parallel_min_bytes": {"values": [16777216], "min": 4194304}}}}}
    stats = {"median_s": 1e-3, "q25_s": 1e-3, "q75_s": 1e-3, "min_s": 1e-3, "reps": 7}
    win = {"chunk": 4096, "parallel_min_bytes": 16777216}
    entry = {"op": "flatten", "backend": "numba", "src_dtype": "float32", "dst_dtype": "float32", "bucket": 0,
             "default": {"chunk": 65536, "parallel_min_bytes": 4194304},
             "candidates": [{"params": win, **stats}], "winner": {"params": win, "median_s": 1e-3}}
    autotune.save({_tuning.key_str("flatten", "numba", "float32", "float32", 0): entry},
                  device=_tuning.device_info("cpu"), bounds=[65536], space=space, run={"timestamp": "t"},
                  root=root)


def test_bench_cli_tiny_end_to_end(tmp_path):
    _tuned_file(tmp_path)
    env = dict(os.environ, FASTPAR_RESULTS_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "fastpar", "bench", "--sizes", "tiny", "--no-progress",
                        "--devices", "cpu", "--note", "test run"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"bench failed (rc {r.returncode}):\n{r.stdout}\n{r.stderr}"
    assert "| op | workload | dtype |" in r.stdout and "tuned parameters: ok" in r.stdout, r.stdout
    assert "TuningWarning" not in r.stderr, r.stderr
    files = sorted((tmp_path / "bench").iterdir())
    js = [p for p in files if p.suffix == ".json"]
    pngs = [p for p in files if p.suffix == ".png"]
    assert len(js) == 1 and len(pngs) == 1, files
    slug = _tuning.device_info("cpu")["slug"]
    assert js[0].name.startswith(slug + "-")
    doc = json.loads(js[0].read_text())
    bench.validate_bench(doc)
    assert doc["png"] == pngs[0].name and doc["note"] == "test run" and doc["sizes"] == "tiny"
    assert doc["tuning"]["state"] == "ok"
    # What a reader needs to reproduce the run: backend, source commit, settings.
    assert doc["backend"] == "numba" and "fastpar backend numba" in r.stdout
    assert doc["env"]["FASTPAR_RESULTS_DIR"] == str(tmp_path)
    assert "commit" in doc and "transparent_hugepage" in doc
    # Each row says what torch's side does (some baselines allocate, fastpar's call not)
    # and which providers' timings spread too widely to trust.
    assert all(row["baseline"] and isinstance(row["noisy"], list) for row in doc["rows"])
    assert "* reduce_add_coalesced K=4 out=: torch = torch.nn.parallel.comm's algorithm" in r.stdout
    got = {(row["op"], row["workload"]) for row in doc["rows"]}
    assert got == {(c.op, w) for c in bench.CASES for w in bench.workloads("tiny")}
    # Every workload is in bucket 0, where the tuned file differs from the defaults: the
    # fp32 flatten rows (and replicate's, whose buffers flatten fills) carry the same-run
    # tuned-vs-untuned gain, the others do not.
    for row in doc["rows"]:
        tuned = row["op"] in ("flatten", "flatten out=", "replicate K=2")
        assert (row["tuned_gain"] is not None) == tuned, row
        if tuned:
            assert row["tuned_params"] == {"chunk": 4096, "parallel_min_bytes": 16777216}
    import matplotlib.image

    img = matplotlib.image.imread(pngs[0])
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200 and img.std() > 0


def test_bench_on_an_untuned_backend_does_not_report_the_tuned_file(tmp_path):
    # FASTPAR_BACKEND=torch: the header said "tuned parameters: ok (<file>)" and the JSON
    # recorded that state, for a run whose fastpar calls never read the file.
    _tuned_file(tmp_path)
    env = dict(os.environ, FASTPAR_RESULTS_DIR=str(tmp_path), FASTPAR_BACKEND="torch")
    r = subprocess.run([sys.executable, "-m", "fastpar", "bench", "--sizes", "tiny", "--no-progress",
                        "--devices", "cpu", "--workloads", "tiny"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"bench failed (rc {r.returncode}):\n{r.stdout}\n{r.stderr}"
    assert "fastpar backend torch, tuned parameters: untuned" in r.stdout, r.stdout
    (js,) = (tmp_path / "bench").glob("*.json")
    doc = json.loads(js.read_text())
    assert doc["tuning"]["state"] == "untuned" and doc["tuning"]["path"] is None, doc["tuning"]
    assert all(row["tuned_gain"] is None for row in doc["rows"])


@pytest.fixture(scope="module")
def good_doc():
    row = {"op": "flatten", "workload": "tiny", "dtype": "fp32", "tensors": 3, "numel": 30, "bytes": 120,
           "moved_bytes": 240, "fastpar_gbps": 2.0, "torch_gbps": 1.0, "ratio": 2.0, "copy_gbps": 4.0,
           "of_copy": 0.5, "median_s": {"fastpar": 1.0, "torch": 2.0, "copy_": 0.5}, "rounds": 5,
           "tuned_gain": None}
    return {"schema": bench.SCHEMA, "timestamp": "t", "sizes": "tiny", "png": "x.png",
            "device": {"type": "cpu", "name": "n", "slug": "s"}, "versions": {}, "rows": [row]}


@pytest.mark.parametrize("path, value, match", [
    (["schema"], "fastpar.bench/0", "schema"),
    (["rows"], [], "rows"),
    (["rows", 0, "ratio"], 3.0, "ratio"),
    (["rows", 0, "torch_gbps"], float("nan"), "torch_gbps"),
    (["rows", 0, "tensors"], 0, "tensors"),
    (["rows", 0, "tuned_gain"], 1.5, "untuned"),
    (["sizes"], "huge", "sizes"),
])
def test_validate_bench_names_the_bad_field(good_doc, path, value, match):
    bench.validate_bench(good_doc)
    doc = copy.deepcopy(good_doc)
    d = doc
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    with pytest.raises(ValueError, match=match):
        bench.validate_bench(doc)


def test_table_is_markdown(good_doc):
    t = bench.table(good_doc["rows"]).splitlines()
    assert t[0].startswith("| op |") and t[1].startswith("| ---") and "2.00x" in t[2] and "defaults" in t[2]


def test_a_host_bound_row_is_flagged_and_explained(good_doc, monkeypatch):
    """CUDA rows carry the host's time per call; where fastpar's reaches HOST_BOUND of
    its median, the GPU waited on the host, and the table says so (an H200 run read a
    host-bound reduce's 45% of copy_ as the kernel's)."""
    stats = {"fastpar": dict(_stats(1e-3), host_s=0.95e-3), "torch": dict(_stats(2e-3), host_s=0.1e-3),
             "copy_": _stats(5e-4)}
    flags = bench._flagged(stats)
    assert flags["host_bound"] == ["fastpar"] and flags["host_s"] == {"fastpar": 0.00095, "torch": 0.0001}
    assert "host_s" not in bench._flagged({"fastpar": _stats(1e-3)}), "CPU rows: no host timing"
    rows = [dict(good_doc["rows"][0], **flags)]
    t = bench.table(rows)
    assert "2.00x (host-bound)" in t and "* (host-bound): fastpar's host time per call" in t
    stats["fastpar"]["host_s"] = 0.5e-3
    rows = [dict(good_doc["rows"][0], **bench._flagged(stats))]
    assert "host-bound" not in bench.table(rows)


@pytest.mark.parametrize("arg, match", [("tpu", "unknown \\['tpu'\\]"),
                                        (",", "expected a comma-separated list of names, got ','"),
                                        ("", "expected a comma-separated list of names, got ''"),  # was every device, exit 0
                                        ("cuda", "none of \\['cuda'\\] is present")])
def test_bench_cli_rejects_bad_devices(arg, match, tmp_path, capsys):
    import argparse
    import re

    if arg == "cuda" and bench.devices(["cuda"]):
        pytest.skip("CUDA present")
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    assert bench.main(p.parse_args(["--devices", arg, "--results-dir", str(tmp_path)])) == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "bench").exists()


def _stats(median):
    return {"median_s": median, "q25_s": median, "q75_s": median, "min_s": median, "reps": 5}


@pytest.fixture
def row(monkeypatch):
    medians = {"fastpar": 1e-3, "fastpar untuned": 2e-3, "torch": 3e-3, "copy_": 5e-4}
    monkeypatch.setattr(bench, "_measure", lambda device, providers, sizes: {k: _stats(medians[k]) for k in providers})
    monkeypatch.setattr(bench, "_untuned_differs", lambda case, device, numel: {"chunk": 4096})
    case = bench.Case("flatten", "fp32", lambda ts: bench.Setup(lambda: None, lambda: None, 51200),
                      ("flatten", torch.float32, torch.float32), "x")
    rows = bench.run_device(torch.device("cpu"), "tiny", cases=[case], only=["tiny"], progress=False)
    assert len(rows) == 1
    return rows[0]


def test_measure_times_each_provider_on_its_second_call_in_a_row():
    """The tuned and untuned providers force different launch parameters, and fastpar's
    bound launches resolve again after each switch: each timed call follows an untimed
    call of the same provider (for every provider alike), so no timed call pays that."""
    calls = []
    providers = {name: (lambda: None, lambda name=name: calls.append(name)) for name in ("fastpar", "torch")}
    stats = bench._measure(torch.device("cpu"), providers, "tiny")
    assert set(stats) == {"fastpar", "torch"} and all(s["reps"] >= 3 for s in stats.values())
    warm = 1 * len(providers)  # the warm-up round of the "tiny" setting
    runs = calls[warm:]
    assert len(runs) % 2 == 0 and all(a == b for a, b in zip(runs[::2], runs[1::2])), runs
    assert len(runs) // 2 == sum(s["reps"] for s in stats.values()), (runs, stats)


@pytest.mark.parametrize("case", bench.CASES, ids=lambda c: c.op)
def test_each_case_looks_up_the_tuned_key_its_call_reads(case, monkeypatch):
    # The "tuned vs untuned" column measures the untuned call only where bench's own
    # look-up (Case.tuned, the workload's numel) finds tuned parameters. replicate had no
    # key: its row said "defaults" while its buffers were filled with flatten's tuned
    # parameters (chunk 4096 in the Zen 5 VM's file, for the full tiny workload).
    ts = bench.workloads("tiny")["tiny"]("cpu")
    n = sum(t.numel() for t in ts)
    s = case.setup(ts)
    s.fastpar()  # plans and buffers made: the next call is a steady-state one
    read = []
    real = _tuning.params

    def spy(op, backend, src, dst, numel, device=None):
        read.append((op, src, dst, numel))
        return real(op, backend, src, dst, numel, device)

    monkeypatch.setattr(_tuning, "params", spy)
    with _tuning.forced({}):  # the bound launches resolve again, asking params
        s.fastpar()
    assert read, f"{case.op}: its call read no tuned parameters"
    assert case.tuned is not None, f"{case.op}: its call reads {read[0][:3]} but bench looks up no key"
    assert set(read) == {(*case.tuned, n)}, (case.tuned, read)


def test_row_ratio_gain_and_ceiling_are_the_right_way_up(row):
    n = row["numel"]  # tiny: 100 tensors of 64 floats
    assert n == 6400
    assert row["fastpar_gbps"] == pytest.approx(51200 / 1e-3 / 1e9, rel=1e-3)
    assert row["torch_gbps"] == pytest.approx(51200 / 3e-3 / 1e9, rel=1e-3)
    assert row["ratio"] == pytest.approx(3.0)          # torch median / fastpar median: >1 = fastpar faster
    assert row["tuned_gain"] == pytest.approx(2.0)     # untuned median / tuned median: >1 = tuning helped
    assert row["untuned_gbps"] == pytest.approx(51200 / 2e-3 / 1e9, rel=1e-3)
    # copy_ reads and writes n fp32 elements: 8 n bytes per call.
    assert row["copy_gbps"] == pytest.approx(8 * n / 5e-4 / 1e9, rel=1e-3)
    assert row["of_copy"] == pytest.approx(row["fastpar_gbps"] / row["copy_gbps"], rel=1e-3)
    assert row["of_copy"] == pytest.approx(0.5, rel=1e-3)  # half the copy_ ceiling


def test_a_run_interrupted_while_plotting_leaves_no_partial_files(good_doc, tmp_path, monkeypatch):
    # Plotting takes seconds at the end of a run; the PNG was written in place, after the
    # JSON naming it: Ctrl-C there left a truncated PNG and a JSON pointing at it.
    import io
    import warnings

    import matplotlib.figure

    monkeypatch.setenv("FASTPAR_RESULTS_DIR", str(tmp_path))
    _tuning.reload()
    monkeypatch.setattr(bench, "run_device", lambda *a, **k: copy.deepcopy(good_doc["rows"]))

    def savefig(self, target, *a, **k):
        if isinstance(target, (str, os.PathLike)):
            with open(target, "wb") as f:
                f.write(b"\x89PNG\r\n\x1a\n cut short")
        else:
            target.write(b"\x89PNG\r\n\x1a\n cut short")
        raise KeyboardInterrupt

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    try:
        with pytest.raises(KeyboardInterrupt), warnings.catch_warnings():
            warnings.simplefilter("ignore", _tuning.TuningWarning)  # no tuned file there
            bench.run("tiny", root=tmp_path, progress=False, out=io.StringIO(), device_types=["cpu"])
    finally:
        _tuning.reload()
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == [], f"an interrupted run left {left}"


def _run_with_stamp(tmp_path, monkeypatch, good_doc, note, stamp="20260101T000000Z"):
    """One ``bench.run`` with canned rows, stamped ``stamp`` (the same second)."""
    import io
    import warnings

    monkeypatch.setattr(bench, "run_device", lambda *a, **k: copy.deepcopy(good_doc["rows"]))
    monkeypatch.setattr(bench, "_stamp", lambda: ("2026-01-01T00:00:00+00:00", stamp))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", _tuning.TuningWarning)  # no tuned file there
        return bench.run("tiny", root=tmp_path, note=note, progress=False, out=io.StringIO(), device_types=["cpu"])


def test_runs_in_the_same_second_never_replace_each_others_files(good_doc, tmp_path, monkeypatch):
    # Both runs wrote <slug>-<stamp>.json/.png with os.replace: the second run's files
    # silently replaced the first's.
    monkeypatch.setenv("FASTPAR_RESULTS_DIR", str(tmp_path))
    _tuning.reload()
    try:
        paths = [_run_with_stamp(tmp_path, monkeypatch, good_doc, note)[0] for note in ("one", "two", "three")]
    finally:
        _tuning.reload()
    stem = f"{_tuning.device_info('cpu')['slug']}-20260101T000000Z"
    assert [p.name for p in paths] == [f"{stem}.json", f"{stem}-2.json", f"{stem}-3.json"]
    names = sorted(p.name for p in (tmp_path / "bench").iterdir())
    assert names == sorted([p.name for p in paths] + [p.with_suffix(".png").name for p in paths]), names
    for p, note in zip(paths, ("one", "two", "three")):
        doc = json.loads(p.read_text())
        bench.validate_bench(doc)
        # Each run's JSON keeps its own note and names the PNG of the same stem.
        assert doc["note"] == note and doc["png"] == p.with_suffix(".png").name, doc


def test_a_json_name_already_taken_moves_the_whole_run_to_the_next_stem(good_doc, tmp_path, monkeypatch):
    # A JSON whose PNG was removed (by hand, say): not replaced, and no PNG of ours
    # is left under its stem.
    monkeypatch.setenv("FASTPAR_RESULTS_DIR", str(tmp_path))
    _tuning.reload()
    stem = f"{_tuning.device_info('cpu')['slug']}-20260101T000000Z"
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / f"{stem}.json").write_text("an earlier run")
    try:
        (path,) = _run_with_stamp(tmp_path, monkeypatch, good_doc, "new")
    finally:
        _tuning.reload()
    assert path.name == f"{stem}-2.json"
    assert (tmp_path / "bench" / f"{stem}.json").read_text() == "an earlier run"
    assert sorted(p.name for p in (tmp_path / "bench").iterdir()) == [
        f"{stem}-2.json", f"{stem}-2.png", f"{stem}.json"]


def test_exclusive_write_without_hard_links(tmp_path, monkeypatch):
    # Filesystems without hard links (FAT, some network mounts): O_EXCL claims the name.
    def no_link(*a, **k):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(autotune.os, "link", no_link)
    target = tmp_path / "a.json"
    autotune._write_atomic(target, "first", exclusive=True)
    with pytest.raises(FileExistsError):
        autotune._write_atomic(target, "second", exclusive=True)
    assert target.read_text() == "first" and [p.name for p in tmp_path.iterdir()] == ["a.json"]


# The torch baselines (``fastpar._baselines``) are what every benchmark ratio divides by
# and what the tables call "torch.nn.parallel.comm's algorithm": they must compute what
# torch's comm computes, or a faster, wrong baseline skews every ratio unnoticed.
_BASELINE_SHAPES = [((5, 3), torch.float32), ((7,), torch.float64), ((), torch.float32), ((0,), torch.float32),
                    ((9,), torch.float16), ((40,), torch.float32), ((4,), torch.int64), ((3, 3), torch.float64)]


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("buffer_size", [64, 10485760], ids=["many-buckets", "one-bucket"])
def test_baseline_reduce_add_coalesced_sums_every_replica(k, buffer_size):
    from fastpar._baselines import reduce_add_coalesced

    gen = torch.Generator().manual_seed(k)
    lists = [[(torch.randn(s, generator=gen, dtype=torch.float64) * 8).to(d) for s, d in _BASELINE_SHAPES]
             for _ in range(k)]
    got = reduce_add_coalesced(lists, buffer_size)
    assert len(got) == len(_BASELINE_SHAPES)
    for i, (r, (shape, dtype)) in enumerate(zip(got, _BASELINE_SHAPES)):
        # torch's root + pairwise adds, in the tensor's dtype: (x0 + x1) + x2 + ...
        exp = lists[0][i] + lists[1][i]
        for lst in lists[2:]:
            exp = exp + lst[i]
        assert r.dtype == dtype and r.shape == shape, f"position {i}: {r.dtype} {tuple(r.shape)}"
        assert torch.equal(r, exp), f"K={k}, position {i}: baseline sum differs from torch's adds"


@pytest.mark.parametrize("k", [2, 3])
def test_baseline_broadcast_coalesced_copies_every_tensor(k):
    from fastpar._baselines import broadcast_coalesced

    src = [torch.randn(s).to(d) for s, d in _BASELINE_SHAPES]
    got = broadcast_coalesced(src, k, buffer_size=64)
    assert len(got) == k and all(a is b for a, b in zip(got[0], src))
    for j, copies in enumerate(got[1:], 1):
        assert len(copies) == len(src)
        for i, (c, s) in enumerate(zip(copies, src)):
            assert c.dtype == s.dtype and c.shape == s.shape and torch.equal(c, s), f"device {j}, tensor {i}"
            assert c.numel() == 0 or c.data_ptr() != s.data_ptr(), f"device {j}, tensor {i} is not a copy"


def test_baseline_replicate_gives_replicas_that_compute_as_the_module():
    from fastpar._baselines import torch_replicate_algorithm

    net = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    x = torch.randn(6, 5)
    with torch_replicate_algorithm() as rep:
        replicas = rep(net, 3)
    assert len(replicas) == 3
    for j, m in enumerate(replicas):
        assert torch.equal(m(x), net(x)), f"replica {j}"
        assert m[0].weight.requires_grad, f"replica {j}: weight detached from autograd"


def test_baseline_broadcast_coalesced_buckets_as_torchs_cpp_take_tensors():
    """torch's broadcast_coalesced is C++ (torch/csrc/cuda/comm.cpp), bucketed by
    ``torch::utils::take_tensors``: a tensor joins its bucket, which is spilled once it
    holds ``buffer_size`` bytes or more. Python's ``_take_tensors`` (reduce_add_coalesced's)
    spills before the tensor that would cross the limit instead, and bucketed so, the
    baseline left an LSTM's weight matrices alone in their buckets (flattened as views,
    no copy) where torch copies them through ``cat``."""
    from fastpar._baselines import _take_tensors_cpp, broadcast_coalesced

    def positions(chunks, ts):
        return [[next(i for i, x in enumerate(ts) if x is t) for t in c] for c in chunks]

    # 12, 12, 4, 4, 12 bytes with a 16-byte limit: torch's C++ spills [a, b] (24 >= 16)
    # and [c, d, e] (20 >= 16); Python's _take_tensors would give [a], [b, c], [d, e].
    src = [torch.randn(n) for n in (3, 3, 1, 1, 3)]
    assert positions(_take_tensors_cpp(src, 16), src) == [[0, 1], [2, 3, 4]]
    a, b, c, d, e = broadcast_coalesced(src, 2, buffer_size=16)[1]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert c.untyped_storage().data_ptr() == d.untyped_storage().data_ptr() == e.untyped_storage().data_ptr()
    assert a.untyped_storage().data_ptr() != c.untyped_storage().data_ptr()
    # A bucket is spilled at the limit exactly, and a lone tensor above it is a bucket.
    big = [torch.randn(4), torch.randn(8), torch.randn(1)]
    assert [len(c) for c in _take_tensors_cpp(big, 16)] == [1, 1, 1]
    # Per type: float64 tensors fill their own bucket between float32 ones.
    mixed = [torch.randn(2), torch.randn(1, dtype=torch.float64), torch.randn(2), torch.randn(1, dtype=torch.float64)]
    assert positions(_take_tensors_cpp(mixed, 16), mixed) == [[0, 2], [1, 3]]
    copies = broadcast_coalesced(mixed, 3, buffer_size=16)
    for j in (1, 2):
        assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(copies[j], mixed)), f"device {j}"


def _benchmarks_conftest():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "conftest.py"
    spec = importlib.util.spec_from_file_location("fastpar_benchmarks_conftest", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_interleaved_statistics_on_synthetic_timings(monkeypatch):
    """``benchmarks/conftest.interleaved`` on a fake clock: per-provider medians, the
    ratio torch / fastpar of the medians, the mean of the per-round paired differences
    and its 95% interval with Student's t (8 rounds: t = 2.365, where the normal 1.96
    made it 17% too narrow), GB/s and the share of copy_ from each provider's bytes."""
    import statistics
    import types

    bc = _benchmarks_conftest()
    clock = [0.0]
    monkeypatch.setattr(bc, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(bc, "WARMUP_S", 0.0)
    rounds = 8
    f_ms = [10, 11, 12, 10, 13, 10, 11, 12]
    t_ms = [20, 19, 25, 21, 20, 30, 22, 21]
    warm = 2  # _warm_up's two rounds, then the window (0 s here) is over
    seq = {"fastpar": iter([1.0] * warm + f_ms), "torch": iter([1.0] * warm + t_ms),
           "copy_": iter([1.0] * warm + [5.0] * rounds)}

    def step(name):
        def run():
            clock[0] += next(seq[name]) * 1e-3
        return run

    class Bench:
        extra_info: dict = {}

        def pedantic(self, fn, rounds, warmup_rounds, iterations):
            assert warmup_rounds == 0 and iterations == 1
            for _ in range(rounds):
                fn()

    b = Bench()
    b.extra_info = {}
    bc.interleaved(b, {k: step(k) for k in seq}, rounds=rounds,
                   nbytes={"fastpar": 3_000_000, "torch": 3_000_000, "copy_": 2_000_000})
    info = b.extra_info
    diffs = [t - f for t, f in zip(t_ms, f_ms)]
    assert info["fastpar_ms"] == statistics.median(f_ms) and info["torch_ms"] == statistics.median(t_ms)
    assert info["ratio"] == round(statistics.median(t_ms) / statistics.median(f_ms), 3)
    assert info["torch_minus_fastpar_ms"] == round(statistics.fmean(diffs), 4)
    assert info["ci95_ms"] == round(2.365 * statistics.stdev(diffs) / rounds ** 0.5, 4)
    gbs_f = 3_000_000 / (statistics.median(f_ms) * 1e-3) / 1e9
    assert info["fastpar_GB/s"] == round(gbs_f, 3)
    assert info["of_copy"] == round(gbs_f / (2_000_000 / 5e-3 / 1e9), 3)


def test_benchmark_t975_matches_students_t():
    bc = _benchmarks_conftest()
    known = {1: 12.706, 5: 2.571, 7: 2.365, 9: 2.262, 29: 2.045, 40: 2.021, 59: 2.001, 99: 1.984, 10_000: 1.960}
    for df, t in known.items():
        assert abs(bc.t975(df) - t) < 1e-3, f"df={df}: {bc.t975(df)} against {t}"
