"""Where the kernels run: a CUDA GPU if there is one, else Triton's interpreter on the
CPU.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function, so this
module must be imported before any kernel is defined. The package's ``__init__``
imports it first.

Something else may have imported Triton earlier (``transformers`` does): then Triton's
own ``@jit`` library functions (``tl.sum``, ``tl.max``, ``tl.cdiv``, ...) were already
built for compiled mode and refuse to run inside an interpreted kernel.
:func:`_interpret_triton_library` rebuilds them as the interpreter would have built
them, so the import order does not matter. Two more repairs of the interpreter are
installed with it: :func:`_interpreter_index_fix` (numpy 2.4 and Triton 3.6) and
:func:`_interpreter_nested_call_fix` (the language patched once per launch, not once per
call of a ``@triton.jit`` helper: the CPU path about a quarter faster).
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # No GPU: run every kernel in Triton's interpreter, on CPU tensors.
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpret_triton_library() -> int:
    """Turn Triton's compiled-mode ``@jit`` library functions into interpreted ones, in
    place.

    ``@triton.jit`` makes a ``JITFunction`` (compiled mode) or, when
    ``TRITON_INTERPRET`` is set, an ``InterpretedFunction``. If ``triton.language`` was
    imported before the variable was set, ``tl.sum`` and its siblings are
    ``JITFunction`` objects, and calling one from an interpreted kernel raises "Cannot
    call @triton.jit'd outside of the scope of a kernel". The decorator is the only
    import-time use of the variable in Triton (3.x: ``runtime/jit.py``; the interpreter
    patches ``triton.language`` afresh at every launch), so building the
    ``InterpretedFunction`` that the decorator would have returned, and putting it
    wherever the ``JITFunction`` was (the ``triton.language`` modules, whose globals the
    interpreted bodies look names up in, and the ``tensor`` methods such as ``x.sum``),
    gives the state a fresh import would have given. Returns how many were replaced (0
    when Triton was imported after the variable was set).
    """
    import sys

    if "triton.language" not in sys.modules:
        # imported later, with TRITON_INTERPRET already set: nothing was built yet
        return 0
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    # one replacement per function, shared by every name
    rebuilt: dict[int, InterpretedFunction] = {}

    def interpreted(value):
        # Exactly JITFunction (not a subclass) defined by Triton itself: leave user
        # kernels alone.
        if type(value) is not JITFunction or not value.fn.__module__.startswith(
            "triton."
        ):
            return None
        if id(value) not in rebuilt:
            rebuilt[id(value)] = InterpretedFunction(value.fn)
        return rebuilt[id(value)]

    modules = [
        m
        for name, m in list(sys.modules.items())
        if m is not None
        and (name == "triton.language" or name.startswith("triton.language."))
    ]
    namespaces = []
    for module in modules:
        namespaces.append(module)
        # Classes of triton.language carry jit functions as methods (tensor.sum =
        # tl.sum).
        namespaces.extend(
            v
            for v in vars(module).values()
            if isinstance(v, type) and v.__module__ == module.__name__
        )
    for ns in namespaces:
        for name, value in list(vars(ns).items()):
            new = interpreted(value)
            if new is not None:
                setattr(ns, name, new)
    return len(rebuilt)


def _interpreter_index_fix() -> bool:
    """Let interpreted loops ``for i in range(0, n_blocks)`` run under numpy >= 2.4
    (Triton 3.6).

    The interpreter holds a scalar as a numpy array of shape (1,), and Triton 3.6 turns
    it into a Python int (``range`` asks for ``__index__``) with ``int(array)``, which
    numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars").
    Newer Triton squeezes the array first; this installs that same one-line fix where
    the installed Triton lacks it. Returns whether it was needed."""
    import inspect

    import triton.runtime.interpreter as interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "kernels_index_fix", False):
        return False
    try:
        source = inspect.getsource(original)
    except (OSError, TypeError):
        return False
    if "int(self.handle.data))" not in source:
        return False  # this Triton already converts a shape-(1,) scalar correctly

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(
            tensor, "__index__", lambda self: int(self.handle.data.squeeze())
        )

    patch_lang_tensor.kernels_index_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


def _interpreter_nested_call_fix() -> bool:
    """Let the interpreter patch ``triton.language`` once per launch, not once per
    call of a ``@triton.jit`` helper.

    A launch (``GridExecutor.__call__``) patches the language modules that the kernel's
    globals name and restores them when its grid is done. A call of a ``@jit`` helper
    inside it (``InterpretedFunction.__call__``: ``tl.sum``, ``tl.cdiv``, the kernels'
    own device functions) patches them again, about a millisecond of
    ``inspect.getmembers`` each time, and keeps nothing from it: the second patch finds
    the builtins already replaced and sets the same attributes to equivalent values.
    Measured on a 2-core CPU (Triton 3.9, 2026-12-07), 4,231 such calls were 4.2 s of
    a 14.4 s engine run. This makes a
    helper's patch a no-op when the launch in progress has already patched the same
    language modules (``_patch_lang`` reads nothing of the function but which of
    ``triton.language`` and ``triton.language.core`` its globals hold); a helper that
    names another one (Triton's ``standard.py`` names ``core``) is patched as before.
    Outside a launch nothing changes. Returns whether it was installed."""
    import inspect
    import threading

    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    original = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    function = getattr(interpreter, "InterpretedFunction", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if None in (original, executor, function, scope_type):
        return False
    if getattr(original, "normbook_fix", False):
        return False
    try:
        nested = inspect.getsource(function.__call__)
        launch = inspect.getsource(executor.__call__)
    except (OSError, TypeError):
        return False
    if "_patch_lang(self.fn)" not in nested or "_patch_lang(self.fn)" not in launch:
        return False  # another interpreter than the one this was written for

    state = threading.local()  # the language modules patched by the launch in progress

    def patch_lang(fn):
        patched = getattr(state, "patched", None)
        langs = frozenset(
            id(v) for v in fn.__globals__.values() if v is tl or v is tl.core
        )
        # none named: Triton's own patch refuses the function, as it should
        if patched is not None and langs and langs <= patched:
            return scope_type()  # an empty scope: nothing to restore
        scope = original(fn)
        if patched is not None:
            patched.update(langs)
        return scope

    launch_call = executor.__call__

    def call(self, *args, **kwargs):
        outer = getattr(state, "patched", None)
        state.patched = set()
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            state.patched = outer

    patch_lang.normbook_fix = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = call
    return True


if INTERPRET:
    _interpret_triton_library()
    _interpreter_index_fix()
    _interpreter_nested_call_fix()

DEVICE = torch.device("cuda" if HAS_CUDA and not INTERPRET else "cpu")


def default_dtype() -> torch.dtype:
    """The low-precision dtype a chapter should use on this device.

    bf16 where the GPU supports it (Ampere and newer), fp16 on older GPUs such as a T4,
    and bf16 on the CPU interpreter (it emulates every dtype).
    """
    # Not torch.cuda.is_bf16_supported(): since torch 2.3 it also counts emulated bf16
    # and says yes on a T4. Native bf16 arrived with compute capability 8.0 (Ampere).
    if DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE) < (8, 0):
        return torch.float16
    return torch.bfloat16


def device_name() -> str:
    if DEVICE.type == "cuda":
        return torch.cuda.get_device_name(DEVICE)
    return "CPU (Triton interpreter)"


def device_guard(t: torch.Tensor):
    """Context for a launch on ``t``'s device: Triton launches on the *current* CUDA
    device, so a tensor on ``cuda:1`` must make ``cuda:1`` current while its kernel is
    launched. A no-op on the CPU (the interpreter)."""
    import contextlib

    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
