"""A faster Triton interpreter for the tests (TRITON_INTERPRET=1), same results.

Triton's interpreter patches triton.language (its builtins made to run on numpy) at every launch
(GridExecutor, restored after the launch) and again at every call of a @triton.jit device function
inside it (InterpretedFunction.__call__): inspect.getmembers over the language modules each time,
which found nothing left to patch but took ~40% of a decode step's interpreter time (cProfile of
GraphDecoder.step: 3307 such calls, 28 s of 66 s). Here a device function's call skips that
re-patching when the launch running it has already patched every language module the function sees
(the re-patch would set the same stateless replacements again); anything else takes Triton's own
path. Checked against triton 3.x's interpreter.py (the names below are its own)."""

from __future__ import annotations

import inspect
import sys


def skip_repatching_in_launches() -> None:
    """Install the skip once per process, after collection (conftest's pytest_collection_finish):
    this never imports triton itself, since triton.language's own @triton.jit functions are made
    interpretable only if TRITON_INTERPRET=1 was set when triton was first imported (the Triton test
    modules set it before importing it). A no-op where the interpreter was not imported or lacks
    the names used here (then it runs as Triton wrote it)."""
    tl, interp = sys.modules.get("triton.language"), sys.modules.get("triton.runtime.interpreter")
    if tl is None or interp is None:
        return
    if getattr(interp, "_tests_skip_repatching", False):
        return
    original_patch = getattr(interp, "_patch_lang", None)
    grid_call = getattr(getattr(interp, "GridExecutor", None), "__call__", None)
    scope_class = getattr(interp, "_LangPatchScope", None)
    if original_patch is None or grid_call is None or scope_class is None:
        return
    launches: list[frozenset | None] = []  # per running launch: the language modules it patched

    def langs(fn) -> frozenset:  # what _patch_lang patches for fn: tl and/or tl.core in its globals
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        mine = langs(fn)
        if launches and launches[-1] is not None and mine <= launches[-1]:
            return scope_class()  # a device function inside a launch that patched all of these
        scope = original_patch(fn)
        if launches and launches[-1] is None:  # the launch's own patch (GridExecutor.__call__)
            launches[-1] = mine
        return scope

    def launch(self, *args, **kwargs):
        launches.append(None)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.pop()

    interp._patch_lang = patch_lang
    interp.GridExecutor.__call__ = launch
    interp._tests_skip_repatching = True
