"""What of a model's forward still runs on PyTorch once it is patched: the ops it runs,
counted by a ``TorchDispatchMode`` and sorted by kind (the Qwen3-block chapter's table).
"""

import sys

_MATMULS = {"mm", "addmm", "bmm", "matmul", "linear", "baddbmm"}
_LAYOUT = {
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "expand",
    "slice",
    "unsqueeze",
    "squeeze",
    "reshape",
    "as_strided",
    "select",
    "detach",
    "alias",
    "permute",
}
_ALLOCATION = {
    "empty",
    "empty_strided",
    "new_empty",
    "empty_like",
    "zeros",
    "new_zeros",
    "zeros_like",
    "full",
    "new_full",
}


def _caller() -> str:
    """Where the op came from: the first frame outside torch (the Triton interpreter,
    this package's wrappers, transformers' or normbook.hf's code)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/triton/" in name:
            return "interpreter"
        if "/torch/" not in name and "/contextlib" not in name:
            ours = (
                "/normbook/" in name
                and "/normbook/lab/" not in name
                and "/normbook/hf/" not in name
            )
            return "kernels" if ours else "model"
        frame = frame.f_back
    return "model"


def torch_ops(fn, *args, **kwargs):
    """(result, counts): ``fn(*args, **kwargs)`` and the PyTorch ops it ran, recorded by
    a ``TorchDispatchMode``, as a ``collections.Counter`` of (kind, op name). Kinds:
    "matmul", "embedding", "elementwise" (the model's remaining arithmetic), "layout"
    (views, transposes, a ``contiguous`` copy), "cache" (the KV cache's concatenation),
    "kernels" (this package's operators, ``torch.ops.normbook``, one op per call),
    "kernel outputs" (the buffers a Triton kernel writes), "wrappers" (argument checks
    and views in this package's wrappers), and on the CPU "interpreter" (Triton's
    interpreter copying arguments: not a GPU op)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    counts = collections.Counter()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = func.overloadpacket.__name__
            where = _caller()
            if func.namespace == "normbook":
                kind = "kernels"  # one of this package's operators: a kernel's call
            elif where == "interpreter":
                kind = "interpreter"
            elif where == "kernels":
                kind = "kernel outputs" if op in _ALLOCATION else "wrappers"
            elif op in _MATMULS:
                kind = "matmul"
            elif op == "embedding":
                kind = "embedding"
            elif op in _LAYOUT or op == "clone":
                kind = "layout"
            elif op == "cat" and _in_cache_update():
                kind = "cache"
            elif op in _ALLOCATION:
                kind = "allocation"
            else:
                kind = "elementwise" if "attention" not in op else "attention"
            counts[kind, op] += 1
            return func(*args, **(kwargs or {}))

    with Record():
        result = fn(*args, **kwargs)
    return result, counts


def _in_cache_update() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "update" and "cache_utils" in code.co_filename:
            return True
        frame = frame.f_back
    return False
