"""python -m fastpar: info (environment and backends), bench [--quick] (fastpar vs
torch on the real workloads: table, JSON and plot under <results>/bench/) and autotune
[--quick] (tune launch parameters; saved under <results>/autotune/). <results> is
--results-dir, else $FASTPAR_RESULTS_DIR, else the source checkout's results/, else
~/.cache/fastpar."""
from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path


def _info(args) -> int:
    import warnings

    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    import numba
    import torch
    import triton

    import fastpar
    from fastpar import _dispatch

    print(f"fastpar {fastpar.__version__}  python {platform.python_version()}  {platform.machine()}")
    print(f"torch {torch.__version__}  triton {triton.__version__}  numba {numba.__version__}")
    devices = [torch.device("cpu")] + [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    print("devices:")
    from fastpar import _tuning

    for d in devices:
        # The CPU's model name as the tuned files name it (platform.processor() is "" on
        # most Linux systems, which printed "cpu" as the name).
        name = torch.cuda.get_device_name(d) if d.type == "cuda" else _tuning.device_info(d)["name"]
        try:
            backend = _dispatch.backend_for(d)
        except (ValueError, RuntimeError) as e:  # a bad FASTPAR_BACKEND, or one that cannot run on this
            # device (numba on CUDA): the diagnostic says so, not a traceback
            backend = f"none ({e})"
        print(f"  {str(d):8s} {name:40s} backend={backend}")
    if torch.cuda.device_count() > 1:
        n = torch.cuda.device_count()
        peers = [f"{i}->{j}" for i in range(n) for j in range(n) if i != j and torch.cuda.can_device_access_peer(i, j)]
        print(f"  peer access: {', '.join(peers) or 'none'}")
    from fastpar import _tuning

    print(f"tuned launch parameters (results dir {_tuning.results_dir()}):")
    for d in devices:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", _tuning.TuningWarning)  # shown as the state below
            st = _tuning.status(d)
        print(f"  {str(d):8s} {st['state']}: {st['reason']}")
    print("triton ahead-of-time compile (no GPU needed):")
    from fastpar.kernels.ops_triton import aot

    for cc in (80, 90):
        try:
            ptx = aot.compile_copy(cc)
            vec = "128-bit vector loads" if "ld.global.v4" in ptx else "scalar loads"
            print(f"  sm_{cc}: ok ({vec} on the aligned fp32 copy)")
        except Exception as e:  # report, don't crash: this is a diagnostic
            print(f"  sm_{cc}: FAILED: {type(e).__name__}: {e}")
    return 0


def writable_or_exit(folder, flag: str = "--results-dir") -> int | None:
    """Create ``folder`` and write a scratch file there before any measuring starts, so
    an unwritable results folder costs a message, not a whole run; return 2 (after
    printing why, starting with ``flag``: what chose the folder, :func:`results_source`)
    when it fails, else None."""
    import tempfile

    folder = Path(folder)
    created = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        for attempt in range(3):
            folder.mkdir(parents=True, exist_ok=True)
            try:
                fd, name = tempfile.mkstemp(dir=folder, prefix=".write-test-")
                break
            except FileNotFoundError:  # a concurrent run's clean-up (below) removed it: again
                if attempt == 2:
                    raise
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        print(f"{flag}: cannot write results to {folder} ({type(e).__name__}: {e}); pass --results-dir "
              "(or set FASTPAR_RESULTS_DIR) to a writable folder", file=sys.stderr)
        return 2
    for p in created:  # leave no empty folders behind: the run makes them again
        try:
            p.rmdir()
        except OSError:  # another run is writing there now: its folder, not a failure
            break
    return None


def results_source(value) -> str:
    """What chose the results folder, as :func:`writable_or_exit` names it: the flag when
    ``value`` (``--results-dir``) was given, else ``FASTPAR_RESULTS_DIR`` when set, else
    the default folder. (Every refusal said ``--results-dir`` and told a user who had
    set only the variable to "set FASTPAR_RESULTS_DIR".)"""
    if value is not None:
        return "--results-dir"
    if os.environ.get("FASTPAR_RESULTS_DIR", "").strip():
        return "FASTPAR_RESULTS_DIR"
    return "the default results folder"


def blank_folder_or_exit(value, flag: str = "--results-dir") -> int | None:
    """Return 2 (after printing why) when ``value`` was given but is blank: ``""`` (an
    unset shell variable) is no folder; bench read the default one's tuned files but
    wrote to the working folder, autotune wrote to the working folder. Else None."""
    if value is not None and not value.strip():
        print(f"{flag}: expected a folder, got {value!r}; leave {flag} out for the default "
              "($FASTPAR_RESULTS_DIR, else the source checkout's results/, else ~/.cache/fastpar)", file=sys.stderr)
        return 2
    return None


def expand_folder(value):
    """``value`` with a leading ``~`` expanded, as ``FASTPAR_RESULTS_DIR`` is; None for
    None. The shell leaves ``--results-dir=~/r`` as it is: bench then read the tuned
    files of ``$HOME/r`` and wrote ``./~/r/bench``, autotune wrote ``./~/r/autotune``."""
    return None if value is None else os.path.expanduser(value)


def comma_list(text, flag: str):
    """``"a, b"`` -> ``["a", "b"]``; None for None; raises ``ValueError`` naming ``flag``
    for a list with no names in it (``","`` or ``""``), which would otherwise mean all."""
    if text is None:
        return None
    items = [w.strip() for w in text.split(",") if w.strip()]
    if not items:
        raise ValueError(f"{flag}: expected a comma-separated list of names, got {text!r}")
    return items


def device_types_or_exit(text, present, prefix: str = ""):
    """``--devices`` read: ``(types, None)``, with ``types`` None when the flag was left
    out; ``(None, 2)`` after printing why when it names no device type, an unknown one,
    or only types of which ``present(types)`` (the devices the command would use) finds
    none here. bench and autotune share it, so both refuse the same values alike."""
    try:
        types = comma_list(text, "--devices")
    except ValueError as e:
        print(f"{prefix}{e}", file=sys.stderr)
        return None, 2
    if types is None:
        return None, None
    bad = [t for t in types if t not in ("cpu", "cuda")]
    if bad:
        print(f"{prefix}--devices: unknown {bad}; expected some of cpu, cuda", file=sys.stderr)
        return None, 2
    if not present(types):
        print(f"{prefix}--devices: none of {types} is present here (found: "
              f"{', '.join(str(d) for d in present(None))})", file=sys.stderr)
        return None, 2
    return types, None


def _quiet_triton() -> None:
    import warnings

    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")


def _bench(args) -> int:
    _quiet_triton()
    from . import bench

    return bench.main(args)


def _autotune(args) -> int:
    import logging

    _quiet_triton()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    from . import _tuning, autotune

    try:
        ops = comma_list(args.ops, "--ops")
    except ValueError as e:
        print(f"autotune: {e}", file=sys.stderr)
        return 2
    types, bad = device_types_or_exit(args.devices, autotune.default_devices, "autotune: ")
    if bad:
        return bad
    devices = None if types is None else autotune.default_devices(types)
    bad = blank_folder_or_exit(args.results_dir)
    if bad:
        return bad
    if args.space is not None and not args.space.strip():
        # `--space "$UNSET"` read the working folder as the space: "search space .: cannot
        # read it as JSON (IsADirectoryError ...)", naming neither the flag nor the value.
        print(f"autotune: --space: expected a search-space JSON file, got {args.space!r}; leave --space out "
              "for the packaged one (fastpar/tuning_space.json)", file=sys.stderr)
        return 2
    args.results_dir = expand_folder(args.results_dir)
    root = args.results_dir if args.results_dir is not None else _tuning.results_dir()
    bad = writable_or_exit(_tuning.autotune_path("probe", Path(root)).parent, results_source(args.results_dir))
    if bad:
        return bad
    try:
        result = autotune.tune(ops, quick=args.quick, space=args.space, devices=devices, root=args.results_dir,
                               progress=not args.no_progress)
    except (_tuning.TuningFileError, ValueError) as e:
        print(f"autotune: {e}", file=sys.stderr)
        return 2
    if not result:  # (all([]) is True: a run that tuned nothing exited 0 after a bare table header)
        print("autotune: nothing was tuned: the search space has no backend for the devices tuned "
              f"({', '.join(str(d) for d in devices or autotune.default_devices())}); nothing was written",
              file=sys.stderr)
        return 1
    autotune.print_summary(result)
    return 0 if all(r["path"] is not None for r in result.values()) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastpar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices, the backend of each, Triton AOT check")
    pb = sub.add_parser("bench", help="fastpar vs torch on the real workloads: table, JSON and plot in <results>/bench/")
    from .bench import add_arguments

    add_arguments(pb)
    pa = sub.add_parser("autotune", help="tune launch parameters for this machine; saved in <results>/autotune/")
    pa.add_argument("--quick", action="store_true", help="fewer sizes and a shorter budget per key")
    pa.add_argument("--ops", default=None, help="comma-separated ops of the search space (default: all)")
    pa.add_argument("--space", default=None, help="search-space JSON (default: fastpar/tuning_space.json)")
    pa.add_argument("--devices", default=None,
                    help="comma-separated device types to tune, of cpu and cuda (default: every one present)")
    pa.add_argument("--results-dir", default=None,
                    help="results folder to write autotune/<device>.json in (default: $FASTPAR_RESULTS_DIR, else the "
                         "source checkout's results/, else ~/.cache/fastpar)")
    pa.add_argument("--no-progress", action="store_true", help="no progress bar")
    pa.add_argument("-v", "--verbose", action="store_true", help="log what is tuned and skipped")
    args = parser.parse_args(argv)
    try:
        return {"info": _info, "bench": _bench, "autotune": _autotune}[args.command](args)
    except KeyboardInterrupt:
        print(f"\n{parser.prog} {args.command}: interrupted; nothing more was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
