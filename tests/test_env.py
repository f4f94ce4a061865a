"""fastpar's environment variables: read with errors that name them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fastpar
from fastpar import _env


def test_numbers_flags_and_text(monkeypatch):
    monkeypatch.setenv("FASTPAR_X", " 12 ")
    assert _env.number("FASTPAR_X", 3) == 12
    monkeypatch.setenv("FASTPAR_X", "")
    assert _env.number("FASTPAR_X", 3) == 3 and _env.flag("FASTPAR_X", True) is True
    assert _env.text("FASTPAR_X", "auto") == "auto"
    monkeypatch.setenv("FASTPAR_X", "1.5")
    assert _env.number("FASTPAR_X", 1.0, float) == 1.5
    for raw, want in [("0", False), ("off", False), ("No", False), ("FALSE", False), ("1", True), ("on", True)]:
        monkeypatch.setenv("FASTPAR_X", raw)
        assert _env.flag("FASTPAR_X", not want) is want, raw


@pytest.mark.parametrize("raw,call,match", [
    ("abc", lambda: _env.number("FASTPAR_X", 3), r"environment variable FASTPAR_X must be a whole number, got 'abc'"),
    ("1.5", lambda: _env.number("FASTPAR_X", 3), r"must be a whole number, got '1.5'"),
    ("-1", lambda: _env.number("FASTPAR_X", 3), r"FASTPAR_X must be at least 0, got '-1'"),
    ("lots", lambda: _env.number("FASTPAR_X", 1.0, float), r"FASTPAR_X must be a number, got 'lots'"),
    ("maybe", lambda: _env.flag("FASTPAR_X", True), r"FASTPAR_X must be one of 1, true, yes, on, 0, false, no, off"),
])
def test_bad_values_are_named(monkeypatch, raw, call, match):
    monkeypatch.setenv("FASTPAR_X", raw)
    with pytest.raises(ValueError, match=match):
        call()


def test_reads_follow_every_change_to_os_environ(monkeypatch):
    # _env reads os.environ's own dict (a miss through os.environ.get costs 1.5 us);
    # it must still see what setenv, putenv-through-assignment and del do, at once.
    monkeypatch.delenv("FASTPAR_X", raising=False)
    assert _env.text("FASTPAR_X", "d") == "d"
    os.environ["FASTPAR_X"] = " caf\u00e9 "  # encoded as the filesystem encoding, decoded back
    try:
        assert _env.text("FASTPAR_X", "d") == "caf\u00e9"
        os.environ.update(FASTPAR_X="7")
        assert _env.number("FASTPAR_X", 3) == 7
        del os.environ["FASTPAR_X"]
        assert _env.number("FASTPAR_X", 3) == 3
        monkeypatch.setenv("FASTPAR_X", "off")
        assert _env.flag("FASTPAR_X", True) is False
    finally:
        os.environ.pop("FASTPAR_X", None)


def test_an_os_environ_replaced_by_a_mapping_is_read_through_it(monkeypatch):
    monkeypatch.setattr(os, "environ", {"FASTPAR_BACKEND": "torch", "FASTPAR_X": "5"})
    assert _env.number("FASTPAR_X", 3) == 5 and fastpar.backend_for("cpu") == "torch"


def test_empty_backend_means_auto_and_backend_for_takes_strings(monkeypatch):
    monkeypatch.setenv("FASTPAR_BACKEND", "")
    assert fastpar.backend_for("cpu") == fastpar.backend_for(torch.device("cpu")) == "numba"


def test_bad_plan_cache_size_fails_import_naming_it():
    r = subprocess.run([sys.executable, "-c", "import fastpar"], capture_output=True, text=True,
                       env={**os.environ, "FASTPAR_PLAN_CACHE": "abc"}, timeout=120)
    assert r.returncode != 0 and "FASTPAR_PLAN_CACHE must be a whole number, got 'abc'" in r.stderr


def test_info_reports_a_bad_backend_instead_of_failing():
    r = subprocess.run([sys.executable, "-m", "fastpar", "info"], capture_output=True, text=True,
                       env={**os.environ, "FASTPAR_BACKEND": "bogus"}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "backend=none (FASTPAR_BACKEND must be one of auto, triton, numba, torch; got 'bogus')" in r.stdout


def test_the_minimum_itself_is_allowed(monkeypatch):
    monkeypatch.setenv("FASTPAR_X", "0")
    assert _env.number("FASTPAR_X", 3) == 0
    monkeypatch.setenv("FASTPAR_X", "2")
    assert _env.number("FASTPAR_X", 3, minimum=2) == 2
    monkeypatch.setenv("FASTPAR_X", "1")
    with pytest.raises(ValueError, match="at least 2"):
        _env.number("FASTPAR_X", 3, minimum=2)


@pytest.mark.parametrize("raw, want", [(" on ", True), ("yes\n", True), ("\tOFF ", False), ("   ", None)])
def test_flag_ignores_surrounding_blanks(monkeypatch, raw, want):
    monkeypatch.setenv("FASTPAR_X", raw)
    default = object()
    assert _env.flag("FASTPAR_X", default) is (default if want is None else want)


def test_text_strips_and_blank_means_default(monkeypatch):
    monkeypatch.setenv("FASTPAR_X", "   ")
    assert _env.text("FASTPAR_X", "auto") == "auto"
    monkeypatch.setenv("FASTPAR_X", " numba\n")
    assert _env.text("FASTPAR_X", "auto") == "numba"


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "1e400"])
def test_a_non_finite_number_is_named(monkeypatch, raw):
    # float() reads these, and "nan" passed the minimum check: FASTPAR_RESULT_CACHE_MB=nan
    # then failed `import fastpar` with "cannot convert float NaN to integer", no name.
    monkeypatch.setenv("FASTPAR_X", raw)
    with pytest.raises(ValueError, match=rf"environment variable FASTPAR_X must be a finite number, got '{raw}'"):
        _env.number("FASTPAR_X", 1.0, float)


def test_a_nan_result_cache_size_fails_import_naming_it():
    r = subprocess.run([sys.executable, "-c", "import fastpar"], capture_output=True, text=True,
                       env={**os.environ, "FASTPAR_RESULT_CACHE_MB": "nan"}, timeout=120)
    assert r.returncode != 0 and "FASTPAR_RESULT_CACHE_MB must be a finite number, got 'nan'" in r.stderr, r.stderr
