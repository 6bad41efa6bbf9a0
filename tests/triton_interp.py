"""A faster Triton interpreter for the tests (TRITON_INTERPRET=1), same results.

Triton's interpreter patches triton.language (its builtins made to run on numpy) at every launch
(GridExecutor, restored after the launch) and again at every call of a @triton.jit device function
inside it (InterpretedFunction.__call__): inspect.getmembers over the language modules each time.
The replacements are stateless and the same every time, and in a process that runs Triton only
through the interpreter nothing uses triton.language between launches, so here each language module
is patched once, at the first launch that sees it, and left patched; every later launch and device
call finds nothing to do. cProfile of a decode-step test (test_triton_kernels'
test_decode_step_matches_model_forward[Q8_0]): the per-call re-patching of device functions was
~40% of the interpreter's time (3307 such calls, 28 s of 66 s; the first version of this file skipped
those), the per-launch patching and its module scan ~12% of what was left. Checked against triton
3.x's interpreter.py (the names below are its own)."""

from __future__ import annotations

import inspect
import sys


def skip_repatching_in_launches() -> None:
    """Install the patch-once rule once per process, after collection (conftest's
    pytest_collection_finish): this never imports triton itself, since triton.language's own
    @triton.jit functions are made interpretable only if TRITON_INTERPRET=1 was set when triton was
    first imported (the Triton test modules set it before importing it). A no-op where the interpreter
    was not imported or lacks the names used here (then it runs as Triton wrote it)."""
    tl, interp = sys.modules.get("triton.language"), sys.modules.get("triton.runtime.interpreter")
    if tl is None or interp is None:
        return
    if getattr(interp, "_tests_skip_repatching", False):
        return
    original_patch = getattr(interp, "_patch_lang", None)
    scope_class = getattr(interp, "_LangPatchScope", None)
    if original_patch is None or scope_class is None or not hasattr(interp, "GridExecutor"):
        return
    patched: set[int] = set()  # ids of the language modules (tl, tl.core) patched for good
    seen: dict[object, frozenset] = {}  # fn -> the language modules its globals hold

    def langs(fn) -> frozenset:  # what _patch_lang patches for fn: tl and/or tl.core in its globals
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                 if inspect.ismodule(v) and v in (tl, tl.core))
        return seen[fn]

    def patch_lang(fn):
        mine = langs(fn)
        if not mine <= patched:
            original_patch(fn)  # its scope is dropped: the replacements stay
            patched.update(mine)
        return scope_class()  # nothing to restore after the launch

    interp._patch_lang = patch_lang
    interp._tests_skip_repatching = True
