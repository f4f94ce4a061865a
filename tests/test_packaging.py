"""The built wheel (``pyproject.toml``): ``kernels/`` ships only as the subpackage
``fastpar.kernels`` (a different PyPI project owns the top-level name ``kernels``), and
an installed, non-editable copy imports and runs its kernels from where it is installed.

The rest of the suite runs against the editable install, which maps the source tree and
would not notice a package missing from ``[tool.setuptools] packages``."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Every Python file under these source folders must be in the wheel, under its package.
SOURCES = {"fastpar": ROOT / "fastpar", "fastpar/kernels": ROOT / "kernels"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the sources: setuptools leaves a build/ folder beside them,
    # whose stale files a later build of the checkout itself would pack.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("fastpar", "kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    # No build isolation and no index: the build uses this environment's setuptools
    # (CI machines have no route to PyPI for a fresh build environment).
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = list(out.glob("fastpar-*.whl"))
    assert len(wheels) == 1, f"expected one fastpar wheel in {out}, found {[w.name for w in out.iterdir()]}"
    return wheels[0]


def _names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def test_wheel_has_kernels_only_under_fastpar(wheel):
    names = _names(wheel)
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"fastpar"}, f"the wheel's top-level entries should be fastpar only, got {sorted(top)}"
    missing = sorted(
        f"{pkg}/{f.relative_to(src).as_posix()}"
        for pkg, src in SOURCES.items() for f in src.rglob("*.py")
        if "__pycache__" not in f.parts and f"{pkg}/{f.relative_to(src).as_posix()}" not in names
    )
    assert not missing, f"source files missing from the wheel: {missing}"
    assert "fastpar/tuning_space.json" in names, "the autotuner's search space is missing from the wheel"


def test_installed_wheel_imports_and_runs(wheel, tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"pip install --target failed:\n{proc.stdout}\n{proc.stderr}"
    assert not (target / "kernels").exists(), "a top-level 'kernels' package was installed"
    # From an empty folder, with the installed copy first on the path (the editable
    # install's finder comes after it), flatten runs the Numba kernel from that copy.
    script = (
        "import fastpar, fastpar.kernels.ops_numba.flatten as k, torch\n"
        "ts = [torch.arange(5.0), torch.ones(2, 3)]\n"
        "flat = fastpar.flatten(ts)\n"
        "assert torch.equal(flat, torch._utils._flatten_dense_tensors(ts)), flat\n"
        "print(fastpar.__file__); print(k.__file__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target), "FASTPAR_BACKEND": "numba"}
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"the installed copy failed:\n{run.stdout}\n{run.stderr}"
    files = run.stdout.split()
    assert len(files) == 2 and all(Path(f).is_relative_to(target) for f in files), (
        f"imported from {files}, expected both under {target}"
    )


def test_every_third_party_import_is_a_declared_dependency(wheel):
    # fastpar/_fastcheck.py and the Numba kernels import llvmlite directly; it was not in
    # `dependencies` (it only arrived as numba's own requirement).
    import ast
    import re

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        declared = {
            re.split(r"[\s<>=!~;\[(]", line.split(":", 1)[1].strip(), maxsplit=1)[0].lower().replace("_", "-")
            for line in z.read(meta).decode().splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line
        }
        imported = {}
        for name in z.namelist():
            if not name.endswith(".py"):
                continue
            for node in ast.walk(ast.parse(z.read(name), name)):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    mods = [node.module]
                else:
                    continue
                for mod in mods:
                    top = mod.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ("fastpar", "__future__"):
                        imported.setdefault(top.lower().replace("_", "-"), name)
    undeclared = {mod: where for mod, where in imported.items() if mod not in declared}
    assert not undeclared, f"imported but not declared in [project] dependencies: {undeclared} (declared: {sorted(declared)})"
