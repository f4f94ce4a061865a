"""``python -m fastpar``: the subcommands exist and bad arguments fail cleanly."""
from __future__ import annotations

import pytest

from fastpar.__main__ import main


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


def test_bench_unknown_workload_is_a_clear_error(capsys, tmp_path):
    assert main(["bench", "--workloads", "resnet", "--results-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "resnet" in err and "transformer" in err
