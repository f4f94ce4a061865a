"""``python -m fastpar``: the subcommands exist and bad arguments fail cleanly."""
from __future__ import annotations

import os

import pytest
import torch

from fastpar import _tuning
from fastpar.__main__ import main, writable_or_exit


@pytest.fixture(autouse=True)
def _restore_results_dir():
    """``bench --results-dir`` sets ``FASTPAR_RESULTS_DIR`` for the process and re-reads
    the tuned files: undo both, so later tests see the session's results folder again
    (conftest's empty one)."""
    before = os.environ.get("FASTPAR_RESULTS_DIR")
    yield
    if before is None:
        os.environ.pop("FASTPAR_RESULTS_DIR", None)
    else:
        os.environ["FASTPAR_RESULTS_DIR"] = before
    _tuning.reload()


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("info", "bench", "autotune"):
        assert cmd in out


def test_autotune_unknown_op_is_a_clear_error(capsys, tmp_path):
    assert main(["autotune", "--ops", "nonsense", "--results-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "nonsense" in err and "flatten" in err
    assert not (tmp_path / "autotune").exists()


@pytest.mark.parametrize("value, want", [
    ("gpu", "--devices: unknown ['gpu']; expected some of cpu, cuda"),
    (",", "--devices: expected a comma-separated list of names, got ','"),
    pytest.param("cuda", "--devices: none of ['cuda'] is present here (found: cpu)",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")),
])
def test_autotune_devices_refused_before_anything_is_written(capsys, tmp_path, value, want):
    assert main(["autotune", "--devices", value, "--results-dir", str(tmp_path), "--no-progress"]) == 2
    assert want in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_autotune_devices_picks_the_devices_tuned(monkeypatch, tmp_path):
    """``--devices cpu`` tunes the CPU alone (on a lent GPU machine, ``--devices cuda``
    leaves the host's CPU untuned); without it every device present is tuned."""
    from fastpar import autotune

    seen = []

    def tune(ops, *, devices, **kw):
        seen.append(devices)
        return {"stub": {"path": "stub.json", "entries": {}, "error": None}}  # (one saved file)

    monkeypatch.setattr(autotune, "tune", tune)
    monkeypatch.setattr(autotune, "print_summary", lambda result: None)
    assert main(["autotune", "--devices", " cpu ", "--results-dir", str(tmp_path), "--no-progress"]) == 0
    assert main(["autotune", "--results-dir", str(tmp_path), "--no-progress"]) == 0
    assert seen == [[torch.device("cpu")], None]
    assert autotune.default_devices(["cpu"]) == [torch.device("cpu")]
    assert autotune.default_devices()[0] == torch.device("cpu")


def test_autotune_default_devices_take_one_gpu_per_name(monkeypatch):
    """A tuned file is per kind of GPU: of three GPUs, two of one name, the first of each
    name is tuned; ``types`` keeps those device types."""
    from fastpar import autotune

    names = ["NVIDIA H100", "NVIDIA H100", "NVIDIA A100"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
    cuda = [torch.device("cuda", 0), torch.device("cuda", 2)]
    assert autotune.default_devices() == [torch.device("cpu")] + cuda
    assert autotune.default_devices(["cuda"]) == cuda
    assert autotune.default_devices(["cpu"]) == [torch.device("cpu")]


def test_bench_unknown_workload_is_a_clear_error(capsys, tmp_path):
    assert main(["bench", "--workloads", "resnet", "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "resnet" in err and "transformer" in err


@pytest.mark.parametrize("argv", [["autotune", "--ops", ","], ["autotune", "--ops", ""],
                                  ["bench", "--workloads", ","], ["bench", "--workloads", " "]])
def test_an_empty_name_list_is_an_error_not_everything(capsys, tmp_path, argv):
    # An empty list used to mean "all" (bench) or "nothing, exit 0" (autotune).
    assert main([*argv, "--results-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{argv[1]}: expected a comma-separated list of names, got {argv[2]!r}" in err, err
    assert not any(tmp_path.iterdir())


def _blocked_results_dir(tmp_path, monkeypatch):
    """A path no folder can be made at (a file is there), with bench's run and
    autotune's tune made to fail if they are reached."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    import fastpar.autotune
    import fastpar.bench

    def must_not_run(*a, **k):
        raise AssertionError("measured before checking the results folder")

    monkeypatch.setattr(fastpar.bench, "run", must_not_run)
    monkeypatch.setattr(fastpar.autotune, "tune", must_not_run)
    return blocker


@pytest.mark.parametrize("command", ["bench", "autotune"])
def test_an_unwritable_results_dir_fails_before_measuring(capsys, tmp_path, monkeypatch, command):
    blocker = _blocked_results_dir(tmp_path, monkeypatch)
    assert main([command, "--results-dir", str(blocker), "--no-progress", "--quick"]) == 2
    err = capsys.readouterr().err
    assert f"--results-dir: cannot write results to {blocker}" in err and "writable folder" in err, err


@pytest.mark.parametrize("command", ["bench", "autotune"])
@pytest.mark.parametrize("source", ["FASTPAR_RESULTS_DIR", "the default results folder"])
def test_an_unwritable_results_dir_names_what_chose_it(capsys, tmp_path, monkeypatch, command, source):
    # Without --results-dir the refusal still began "--results-dir: cannot write results
    # to ...", a flag the user had not passed, and told one who had set
    # FASTPAR_RESULTS_DIR to "set FASTPAR_RESULTS_DIR".
    blocker = _blocked_results_dir(tmp_path, monkeypatch)
    if source == "FASTPAR_RESULTS_DIR":
        monkeypatch.setenv("FASTPAR_RESULTS_DIR", str(blocker))
    else:
        monkeypatch.delenv("FASTPAR_RESULTS_DIR", raising=False)
        monkeypatch.setattr(_tuning, "results_dir", lambda: blocker)
    assert main([command, "--no-progress", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{source}: cannot write results to {blocker}"), err
    assert "--results-dir" in err and "writable folder" in err, err


@pytest.mark.parametrize("value, want", [
    ("bogus", "bench: FASTPAR_BACKEND must be one of auto, triton, numba, torch; got 'bogus'"),
    ("numba", "bench: backend 'numba' cannot run on cpu tensors"),
])
def test_bench_refuses_a_backend_it_cannot_run_before_measuring(capsys, tmp_path, monkeypatch, value, want):
    # A misspelt FASTPAR_BACKEND raised from bench.run as a traceback (exit 1); numba on a
    # GPU machine (simulated here: the CPU refused) only after the whole CPU run.
    import fastpar.bench
    from fastpar import _dispatch

    def must_not_run(*a, **k):
        raise AssertionError("measured with a backend that cannot run")

    monkeypatch.setattr(fastpar.bench, "run", must_not_run)
    monkeypatch.setenv("FASTPAR_BACKEND", value)
    if value == "numba":
        monkeypatch.setitem(_dispatch.RUNS_ON, "numba", {"cuda"})
    assert main(["bench", "--results-dir", str(tmp_path), "--no-progress", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(want) and "Traceback" not in err, err
    assert not any(tmp_path.iterdir())


def test_ctrl_c_exits_130_with_one_line(capsys, monkeypatch, tmp_path):
    import fastpar.bench

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(fastpar.bench, "run", interrupted)
    assert main(["bench", "--results-dir", str(tmp_path), "--no-progress", "--quick"]) == 130
    err = capsys.readouterr().err
    assert "python -m fastpar bench: interrupted" in err and "Traceback" not in err


def test_autotune_exits_1_when_a_device_was_not_saved(capsys, monkeypatch, tmp_path):
    import fastpar.autotune

    slug = _tuning.device_info("cpu")["slug"]
    monkeypatch.setattr(fastpar.autotune, "tune", lambda *a, **k: {
        slug: {"path": None, "entries": {}, "error": "cannot write the tuned results (PermissionError)"}})
    assert main(["autotune", "--results-dir", str(tmp_path), "--no-progress", "--quick"]) == 1
    out = capsys.readouterr().out
    assert f"{slug}: NOT saved: cannot write" in out, out


def test_autotune_exits_0_when_every_device_was_saved(capsys, monkeypatch, tmp_path):
    import fastpar.autotune

    slug = _tuning.device_info("cpu")["slug"]
    monkeypatch.setattr(fastpar.autotune, "tune", lambda *a, **k: {
        slug: {"path": tmp_path / "autotune" / f"{slug}.json", "entries": {}, "error": None}})
    assert main(["autotune", "--results-dir", str(tmp_path), "--no-progress", "--quick"]) == 0


def test_write_check_leaves_no_folders_behind(tmp_path):
    target = tmp_path / "a" / "b" / "bench"
    assert writable_or_exit(target) is None
    assert list(tmp_path.iterdir()) == [], "the write check must not leave empty folders behind"


@pytest.mark.parametrize("command", ["bench", "autotune"])
@pytest.mark.parametrize("value", ["", " "])
def test_a_blank_results_dir_is_an_error(capsys, tmp_path, monkeypatch, command, value):
    # `--results-dir "$UNSET"`: bench checked and read the default results folder (this
    # checkout's results/) but wrote to ./bench; autotune wrote to ./autotune. Both exited 0.
    import fastpar.autotune
    import fastpar.bench

    def must_not_run(*a, **k):
        raise AssertionError("measured with a blank --results-dir")

    monkeypatch.setattr(fastpar.bench, "run", must_not_run)
    monkeypatch.setattr(fastpar.autotune, "tune", must_not_run)
    monkeypatch.chdir(tmp_path)
    assert main([command, "--results-dir", value, "--no-progress", "--quick"]) == 2
    err = capsys.readouterr().err
    assert f"--results-dir: expected a folder, got {value!r}" in err, err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("value", ["", " "])
def test_a_blank_space_is_an_error_naming_the_flag(capsys, tmp_path, value):
    # `--space "$UNSET"` was read as the working folder: "search space .: cannot read it
    # as JSON (IsADirectoryError ...)".
    assert main(["autotune", "--space", value, "--results-dir", str(tmp_path), "--no-progress", "--quick"]) == 2
    err = capsys.readouterr().err
    assert f"autotune: --space: expected a search-space JSON file, got {value!r}" in err, err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("command", ["bench", "autotune"])
def test_a_tilde_in_results_dir_is_the_home_folder(capsys, tmp_path, monkeypatch, command):
    # `--results-dir=~/r` reaches us unexpanded (no shell expands it after `=`): bench read
    # the tuned files of $HOME/r (FASTPAR_RESULTS_DIR is expanded) but wrote ./~/r/bench;
    # autotune wrote ./~/r/autotune, which no later run read.
    import fastpar.autotune
    import fastpar.bench

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    seen = {}
    monkeypatch.setattr(fastpar.bench, "run", lambda *a, root=None, **k: seen.setdefault("root", root) and [])
    saved = {"stub": {"path": "stub.json", "entries": {}, "error": None}}  # (one saved file)
    monkeypatch.setattr(fastpar.autotune, "tune", lambda *a, root=None, **k: seen.setdefault("root", root) and saved)
    assert main([command, "--results-dir=~/r", "--no-progress", "--quick"]) == 0
    assert seen["root"] == str(home / "r")
    if command == "bench":
        assert _tuning.results_dir() == home / "r"
    assert list(cwd.iterdir()) == [], "wrote under a folder named '~'"


def test_write_check_passes_when_another_run_is_writing_there(tmp_path, monkeypatch):
    # Two runs into a fresh results folder: the first one's clean-up found the second's
    # scratch file in the folder it had made (rmdir: not empty) and reported the folder
    # as unwritable.
    from pathlib import Path

    def busy(self):
        raise OSError(39, "Directory not empty", str(self))

    monkeypatch.setattr(Path, "rmdir", busy)
    assert writable_or_exit(tmp_path / "new" / "bench") is None


def test_write_check_passes_when_another_run_removes_the_folder_it_made(tmp_path, monkeypatch):
    # The other side of the same race: a concurrent run that made the folder removes it
    # (its own write check's clean-up) between our mkdir and our scratch file; mkstemp
    # then failed with FileNotFoundError and the folder was reported unwritable.
    import tempfile

    folder = tmp_path / "new" / "bench"
    real = tempfile.mkstemp
    calls = []

    def other_run_cleans_up(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            folder.rmdir()
            folder.parent.rmdir()
        return real(*a, **k)

    monkeypatch.setattr(tempfile, "mkstemp", other_run_cleans_up)
    assert writable_or_exit(folder) is None
    assert not (tmp_path / "new").exists(), "left the folders it made"


@pytest.mark.parametrize("error", [ValueError, RuntimeError])
def test_info_reports_a_backend_refusal_instead_of_crashing(capsys, monkeypatch, error):
    # FASTPAR_BACKEND=numba on a CUDA machine: backend_for raises RuntimeError ("cannot run
    # on cuda tensors"), which info let through as a traceback (it caught ValueError only,
    # a misspelt name). Simulated here on the CPU device.
    from fastpar import _dispatch
    from fastpar.kernels.ops_triton import aot

    def refuse(device):
        raise error(f"backend 'x' cannot run on {device} tensors")

    monkeypatch.setattr(_dispatch, "backend_for", refuse)
    monkeypatch.setattr(aot, "compile_copy", lambda cc: "ld.global.v4.f32")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "backend=none (backend 'x' cannot run on cpu tensors)" in out, out


def test_help_names_no_fixed_results_folder(capsys):
    # The help said bench/autotune write to results/bench/ and results/autotune/: true in
    # a source checkout only; an installed copy writes under ~/.cache/fastpar (or
    # $FASTPAR_RESULTS_DIR, or --results-dir).
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert " results/bench/" not in out and " results/autotune/" not in out, out
    assert "~/.cache/fastpar" in out and "$FASTPAR_RESULTS_DIR" in out, out


def test_info_names_the_cpu_model(capsys, monkeypatch):
    # platform.processor() is "" on most Linux systems: info printed "cpu" as the CPU's name.
    import platform

    from fastpar.kernels.ops_triton import aot

    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(aot, "compile_copy", lambda cc: "ld.global.v4.f32")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("  cpu ") and "backend=" in ln)
    assert _tuning.device_info("cpu")["name"] in line, line


def test_autotune_that_tunes_nothing_fails(capsys, tmp_path):
    """A search space with no backend for the devices here (a Triton-only space on a
    machine without CUDA) tuned nothing and exited 0 after a bare table header."""
    import json
    from pathlib import Path

    space = json.loads(Path(_tuning.__file__).with_name("tuning_space.json").read_text())
    for op in space["ops"].values():
        op["backends"] = {k: v for k, v in op["backends"].items() if k == "triton"}
    path = tmp_path / "space.json"
    path.write_text(json.dumps(space))
    assert main(["autotune", "--devices", "cpu", "--space", str(path), "--results-dir", str(tmp_path / "r"),
                 "--no-progress", "--quick"]) == 1
    assert "nothing was tuned" in capsys.readouterr().err
    assert not (tmp_path / "r" / "autotune").exists() or not any((tmp_path / "r" / "autotune").iterdir())
