"""Argument checks shared by the ops. Every check runs before any launch, so a rejected
call writes nothing; every message names the argument, what it got and what it expected."""
from __future__ import annotations

import numbers

import torch

#: dtypes the kernels can convert between (same-dtype copies accept any 1/2/4/8-byte dtype).
CAST_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
)
FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
#: Quantized dtypes: a tensor's values are its integers with a scale and zero point held
#: by its quantizer, which a tensor made from copied bytes does not get (it has none).
QUANTIZED_DTYPES = frozenset((torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4))


def check_not_quantized(dtype: torch.dtype, what: str) -> None:
    if dtype in QUANTIZED_DTYPES:
        raise TypeError(
            f"{what}: quantized tensors ({dtype}) are not supported (the copies would have no "
            "quantizer, so no scale or zero point); pass t.int_repr() or t.dequantize()"
        )


def check_dtype(dtype, name: str) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    return dtype


def check_conversion(src: torch.dtype, dst: torch.dtype, scale, what: str) -> None:
    """Raise unless the kernels can copy ``src`` to ``dst`` (with ``scale``)."""
    if src == dst and scale is None:
        check_not_quantized(src, what)
        if src.itemsize not in (1, 2, 4, 8):
            raise TypeError(f"{what}: dtype {src} ({src.itemsize}-byte elements) is not supported")
        return
    if src not in CAST_DTYPES or dst not in CAST_DTYPES:
        if src == dst:  # only the scale makes it more than a copy
            floats = ", ".join(str(x).replace("torch.", "") for x in CAST_DTYPES if x.is_floating_point)
            raise TypeError(f"{what}: scale is not supported for {src} tensors; it needs one of {floats}")
        supported = ", ".join(str(x).replace("torch.", "") for x in CAST_DTYPES)
        raise TypeError(f"{what}: cannot convert {src} to {dst}; conversions and scaling support {supported}")
    if scale is not None and not (src.is_floating_point and dst.is_floating_point):
        raise TypeError(
            f"{what}: scale needs floating-point tensors, got {src} -> {dst}"
        )


def check_scale(scale, name: str = "scale"):
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):  # (a GradScaler keeps its scale as one)
        if scale.dim() != 0 or scale.is_complex() or scale.dtype == torch.bool or scale.is_meta:
            raise TypeError(
                f"{name} must be a real number, a 0-dim real tensor or None, got a tensor of shape "
                f"{tuple(scale.shape)} and dtype {scale.dtype}{' on meta' if scale.is_meta else ''}"
            )
        return float(scale.item())
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name} must be a real number, a 0-dim real tensor or None, got {type(scale).__name__} {scale!r}")
    try:
        return float(scale)
    except OverflowError:  # (an int or Fraction beyond float64's range)
        try:
            text = str(scale)
        except ValueError:  # (an int of more digits than Python converts)
            text = "of too many digits to print"
        raise ValueError(
            f"{name} must be a real number within float64's range, got {type(scale).__name__} "
            f"{text[:40]}{'...' if len(text) > 40 else ''}"
        ) from None


def check_flat(t, name: str, *, numel: int, dtype: torch.dtype | None, device: torch.device | None,
               written: bool = False) -> torch.Tensor:
    """A 1-D contiguous dense tensor of ``numel`` elements (on ``device`` and of ``dtype``
    unless those are None); with ``written``, one this call may write (see
    :func:`check_writable`)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense tensor, got layout {t.layout}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got a tensor on {t.device}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.is_conj() or t.is_neg():
        raise ValueError(
            f"{name} is a lazily {'conjugated' if t.is_conj() else 'negated'} view (its bits are not "
            f"its values); pass {name}.resolve_conj() / .resolve_neg(), or a plain tensor"
        )
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)} with strides {t.stride()}"
        )
    if t.numel() != numel:
        raise ValueError(
            f"{name} must have exactly {numel} elements (the total of the tensors), got {t.numel()} "
            f"({'too small' if t.numel() < numel else 'too large'})"
        )
    check_memory(t, name)
    if written:
        check_not_inference(t, name)
        check_not_recorded(t, name)
    return t


def check_not_recorded(t: torch.Tensor, name: str) -> None:
    """With grad mode on, an output requiring grad is refused, as torch's ``out=``
    functions refuse it: a kernel writes it where autograd cannot see, which would leave
    its history (or a leaf's gradient) wrong."""
    if t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            f"{name} requires grad; fastpar's kernels write it outside autograd, which would leave its "
            "gradient wrong (torch's out= functions refuse it too): write it under torch.no_grad(), "
            "or pass a tensor that does not require grad"
        )


def check_not_inference(t: torch.Tensor, name: str) -> None:
    """An inference tensor can only be written inside ``torch.inference_mode()`` (as
    torch's in-place ops require)."""
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(f"{name} is an inference tensor; it can only be written inside torch.inference_mode()")


def no_memory_error(t: torch.Tensor, name: str) -> Exception:
    """The error for a tensor with elements but data pointer 0: a wrapper subclass
    (``TypeError``) or a storage freed with ``resize_(0)`` (``ValueError``)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return ValueError(f"{name} has no memory to address: its storage was freed (resize_(0), as FSDP does)")
    return TypeError(
        f"{name} is a {type(t).__name__} with no memory of its own to address (data pointer 0); "
        "fastpar takes plain tensors: pass the local/inner tensor (e.g. DTensor.to_local())"
    )


def check_memory(t: torch.Tensor, name: str) -> None:
    """Raise unless the memory a kernel would address through ``t`` exists: a wrapper
    subclass (DTensor, FakeTensor) or a storage freed with ``resize_(0)`` (as FSDP does)
    reports data pointer 0, and a storage shrunk below the tensor's extent would be
    written past its end. Meta tensors have no memory and are never addressed."""
    if t.numel() == 0 or t.device.type == "meta":
        return
    if t.data_ptr() == 0:
        raise no_memory_error(t, name)
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))  # elements spanned
    need = (t.storage_offset() + extent) * t.element_size()
    have = t.untyped_storage().nbytes()
    if have < need:
        raise ValueError(
            f"{name} reaches byte {need} of its storage, which holds {have} bytes (resized smaller?)"
        )


def check_no_overlap(plan, t: torch.Tensor, name: str, tensors_name: str) -> None:
    i = plan.overlaps(t)
    if i >= 0:
        raise ValueError(f"{name} overlaps the memory of {tensors_name}[{i}]; it must be a separate buffer")


def check_writable(plan, name: str) -> None:
    """Inference tensors can only be written inside ``torch.inference_mode()`` (as torch's
    in-place ops require), and no tensor may reach past the end of its storage (one
    shrunk in place, which a kernel would write past); checked before any launch."""
    if plan.has_inference and not torch.is_inference_mode_enabled():
        i = next(i for i, t in enumerate(plan.tensors) if t.is_inference())
        check_not_inference(plan.tensors[i], f"{name}[{i}]")
    i = plan.first_short()
    if i >= 0:
        check_memory(plan.tensors[i], f"{name}[{i}]")  # raises, with the sizes
