"""The one place that picks a backend: a table from device type to backend, and from
op to the file that implements it in every backend."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import os
import sys

import torch

from . import _cuda, _env
from .kernels._launch import fork_safe_lock

#: Backend name -> package of its kernels (same file and function names in each).
BACKENDS = {
    "triton": "fastpar.kernels.ops_triton",
    "numba": "fastpar.kernels.ops_numba",
    "torch": "fastpar.kernels.ops_torch",
}
#: Device type -> backend used by ``auto``.
AUTO = {"cuda": "triton", "cpu": "numba"}
#: Op -> file implementing it (in every backend).
OPS = {
    "flatten": "flatten",
    "unflatten_into": "flatten",
    "broadcast": "flatten",
    "reduce_add": "reduce_add",
    "scale": "scale",
}
#: Devices each backend can run on (triton on CPU tensors = the Triton interpreter).
RUNS_ON = {"triton": {"cuda", "cpu"}, "numba": {"cpu"}, "torch": None}

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("fastpar_backend", default=None)


def _requested() -> str:
    name = _override.get() or _env.text("FASTPAR_BACKEND", "auto")
    if name != "auto" and name not in BACKENDS:
        raise ValueError(
            f"FASTPAR_BACKEND must be one of auto, {', '.join(BACKENDS)}; got {name!r}"
        )
    return name


def request_state() -> tuple:
    """What :func:`backend_for_type` reads besides the device type: the
    :func:`use_backend` override in force and ``FASTPAR_BACKEND`` as set. While it is
    unchanged the answer is too, so a caller that keeps a resolved backend (the DDP
    hooks' passes) compares this instead of asking again."""
    return _override.get(), _env._get("FASTPAR_BACKEND")


def backend_for(device) -> str:
    """The backend that runs ops on ``device`` (a torch.device or a device string;
    ``FASTPAR_BACKEND`` or :func:`use_backend` override ``auto``)."""
    try:
        device_type = torch.device(device).type
    except (TypeError, RuntimeError) as e:
        # torch's own words named neither the argument nor what a device may be (for
        # None or 1.5 a list of torch.device's overloads).
        if isinstance(device, str):
            raise ValueError(f"device must name a device such as 'cpu' or 'cuda:0', got {device!r} ({e})") from None
        raise TypeError(
            f"device must be a torch.device or a device string such as 'cpu', got {type(device).__name__} {device!r}"
        ) from None
    return backend_for_type(device_type)


def backend_for_type(device_type: str) -> str:
    """:func:`backend_for` from the device type (``"cpu"``, ``"cuda"``...), for callers
    that keep it: ``torch.device.type`` makes a new string on every read."""
    name = _requested()
    if name == "auto":
        return AUTO.get(device_type, "torch")
    allowed = RUNS_ON[name]
    if allowed is not None and device_type not in allowed:
        # Name what asked for it: under use_backend(...), FASTPAR_BACKEND=auto changes nothing.
        fix = ("use fastpar.use_backend('auto') (the backend was requested by fastpar.use_backend)"
               if _override.get() is not None else "use FASTPAR_BACKEND=auto")
        raise RuntimeError(
            f"backend {name!r} cannot run on {device_type} tensors (it runs on {', '.join(sorted(allowed))}); {fix}"
        )
    return name


#: Held while a Triton kernel runs under the interpreter (CPU tensors). The interpreter
#: keeps its state in module globals (it patches ``triton.language`` for the duration
#: of a launch and sets the program id on one shared builder), so two threads launching
#: at once (replica threads, a DDP hook's callback thread, user threads) failed with
#: "Did you forget to add @triton.jit ?" or ran programs with the other launch's ids.
#: Reentrant: nothing a launch calls should launch again, but a wait here must never
#: be on the calling thread itself.
INTERPRETER_LOCK = fork_safe_lock()  # (an RLock, its default)


def _interpreted_one_at_a_time(launch):
    """``launch`` (a Triton launcher), holding :data:`INTERPRETER_LOCK` when its group
    (the first argument of every launcher) is on the CPU, i.e. interpreted."""

    @functools.wraps(launch)
    def run(group, *args, **kwargs):
        if group.device.type == "cuda":
            return launch(group, *args, **kwargs)
        with INTERPRETER_LOCK:
            return launch(group, *args, **kwargs)

    return run


#: ``(backend, op) -> launcher``: a plain dict, not ``functools.cache``, because dynamo
#: traces :func:`kernel` under ``torch.compile`` and warns at every cache-wrapped
#: function it meets. :func:`clear_launchers` empties it (tests that replace a launcher).
_LAUNCHERS: dict = {}


def _kernel(backend: str, op: str):
    launch = _LAUNCHERS.get((backend, op))
    if launch is None:
        module = importlib.import_module(f"{BACKENDS[backend]}.{OPS[op]}")
        launch = getattr(module, op)
        if backend == "triton":
            launch = _interpreted_one_at_a_time(launch)
        launch = _LAUNCHERS.setdefault((backend, op), launch)
    return launch


def _compile_opaque(backend: str, op: str):
    """:func:`_kernel`'s launcher, opaque to ``torch.compile``: dynamo can build no
    graph from a launch (raw addresses, a Numba or Triton call), and tracing on into the
    launchers' frames crashed it in its own bytecode rewriting (``fastpar.gather`` in a
    compiled function). Disabled, a launch is one graph break and runs eagerly."""
    # Wrapped per launcher object (opaque_to_compile's cache): a launcher _kernel hands
    # out in place of another (a test that replaced it) gets its own wrapper; keyed by
    # (backend, op), kernel() kept handing out the wrapper of the first one it saw.
    return opaque_to_compile(_kernel(backend, op))


#: function -> the same function under ``torch.compiler.disable`` (made at first need,
#: so that eager programs neither import dynamo nor pay its wrapper).
_OPAQUE: dict = {}


def opaque_to_compile(fn):
    """``fn`` under ``torch.compiler.disable``, made at first need and cached: the
    launchers :func:`kernel` hands out once dynamo is loaded. (Entry points called while
    dynamo traces use :func:`eager_entry`, made at import.)"""
    hit = _OPAQUE.get(fn)
    if hit is None:
        # A plain store, not setdefault: dynamo may trace this function (kernel() reached
        # from a traced autograd Function, say), and torch 2.11's cannot trace
        # dict.setdefault (a graph break and a warning). Two threads missing at once make
        # two equivalent wrappers.
        hit = _OPAQUE[fn] = torch.compiler.disable(fn)
    return hit


def eager_entry(fn):
    """``fn`` for the calls it receives while dynamo traces
    (``torch.compiler.is_dynamo_compiling()``): an entry point calls the result instead
    of going on, e.g.::

        if torch.compiler.is_dynamo_compiling():
            return _flatten_eagerly(tensors, dtype=dtype, scale=scale, out=out)

    dynamo does not trace the result (torch defines it in a module dynamo skips), so the
    call is one graph break, and it runs ``fn`` eagerly whole, under
    ``torch.compiler.disable``. ``torch._disable_dynamo`` makes it at import without
    importing dynamo (it does that at the first call). The wrapper must exist before
    tracing: made by :func:`opaque_to_compile` while dynamo traced the caller, it cost
    two more graph breaks at the first call of each op and guards on its cache.

    The guard is ``is_dynamo_compiling()``, not ``is_compiling()``: the latter is also
    true where Python runs eagerly under a torch tracer (``torch.export`` with
    ``strict=False``, a compile session's AOT tracing), so the eager ``fn`` met its own
    guard again and called the eager entry until a ``RecursionError``."""
    return torch._disable_dynamo(fn)


# The files of the frames an eager entry puts between its caller and ``fn``
# (torch._disable_dynamo's wrapper, then torch.compiler.disable's).
_ENTRY_FILES = tuple(
    os.path.join(os.path.dirname(torch.__file__), *parts) for parts in (("_compile.py",), ("_dynamo", "eval_frame.py"))
)


def user_stacklevel(stacklevel: int) -> int:
    """``stacklevel`` for a ``warnings.warn`` made by this function's caller, past an
    eager entry (:func:`eager_entry`) and the guard that called it, where the frame
    ``stacklevel`` names is one of them (``stacklevel`` >= 2).

    Called through its eager entry (under ``torch.compile``), a public function's
    caller is torch's wrapper, not the user's code: a warning with a plain
    ``stacklevel`` named ``torch/_dynamo/eval_frame.py`` instead of the line that
    called the function, as it does in eager mode. Call it only where the warning is
    made (dynamo cannot trace frame walks)."""
    below = f = sys._getframe(1)
    for _ in range(stacklevel - 1):
        if f.f_back is None:
            return stacklevel
        below, f = f, f.f_back
    extra = 0
    while f is not None and f.f_code.co_filename in _ENTRY_FILES:
        f = f.f_back
        extra += 1
    if extra and f is not None and f.f_code.co_filename == below.f_code.co_filename:
        # What called the eager entry: the function's own guard (or dynamo's resume of
        # it after the graph break), in the file of the function the entry ran.
        extra += 1
    return stacklevel + extra


def clear_launchers() -> None:
    """Forget the launchers looked up so far, and their compile-opaque wrappers (the next
    lookup imports them again)."""
    _LAUNCHERS.clear()
    _OPAQUE.clear()


@functools.cache
def _launcher_parameters(backend: str, op: str):
    """``inspect.signature(...).parameters`` of ``op``'s launcher on ``backend``."""
    return inspect.signature(_kernel(backend, op)).parameters


@functools.cache
def launcher_keywords(backend: str, op: str) -> dict:
    """``{name: default}`` of the keyword-only parameters with defaults of ``op``'s
    launcher on ``backend``: the launch parameters it accepts (tuned ones among them)."""
    sig = _launcher_parameters(backend, op)
    return {p: v.default for p, v in sig.items() if v.kind == v.KEYWORD_ONLY and v.default is not v.empty}


@functools.cache
def launcher_takes_any_keyword(backend: str, op: str) -> bool:
    """Whether ``op``'s launcher on ``backend`` has ``**kwargs`` (a wrapper standing in
    for it, say): then any keyword reaches it, and only what it passes on can tell."""
    return any(v.kind == v.VAR_KEYWORD for v in _launcher_parameters(backend, op).values())


def kernel(op: str, device: torch.device):
    """``(backend name, launcher)`` for ``op`` on ``device``. Ops call it before their
    first launch; on CUDA it raises if a graph is being captured (see
    :func:`fastpar._cuda.refuse_capture`)."""
    backend = backend_for(device)
    if device.type == "cuda" and backend == "triton":
        _cuda.refuse_capture(op, device)
    # Only once dynamo is loaded (torch.compile imports it before tracing anything) is
    # the disabled launcher handed out: importing dynamo takes ~2 s, and its wrapper
    # costs ~1 us a launch, which eager-only programs need not pay.
    if "torch._dynamo" in sys.modules:
        return backend, _compile_opaque(backend, op)
    return backend, _kernel(backend, op)


@contextlib.contextmanager
def use_backend(name: str):
    """Run the enclosed ops on backend ``name`` (``auto``, ``triton``, ``numba`` or
    ``torch``) in this thread/context, whatever ``FASTPAR_BACKEND`` says."""
    if not isinstance(name, str):  # (a list failed with a bare "unhashable type: 'list'")
        raise TypeError(
            f"use_backend: name must be a backend name (a str: auto, {', '.join(BACKENDS)}), "
            f"got {type(name).__name__} {name!r}"
        )
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"use_backend: backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}")
    token = _override.set(name)
    try:
        yield
    finally:
        _override.reset(token)
