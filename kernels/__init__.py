"""fastpar's kernels and their thin launchers (installed as ``fastpar.kernels``).

One op, one file, the same file and function names in every backend:

* ``ops_triton/<op>.py`` - Triton kernels for CUDA tensors (and, through the Triton
  interpreter, for CPU tensors in tests),
* ``ops_numba/<op>.py`` - Numba kernels for CPU tensors,
* ``ops_torch/<op>.py`` - plain torch ops, the reference.

Launchers take already validated arguments and a pointer plan (``fastpar._plan``):
they pick a grid, launch once, and record the launch in :data:`launches`.
Validation, allocation and dispatch live in ``fastpar``.
"""
from ._launch import launches

__all__ = ["launches"]
