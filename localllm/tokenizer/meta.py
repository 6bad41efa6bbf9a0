"""Typed reads of a GGUF's tokenizer metadata: the trust boundary between the file and the tokenizer.

Each function returns the value of one key with the type the tokenizer needs, or raises one
LocalLLMError naming the key, what it holds and what was expected. A missing key gives the default.
"""

from __future__ import annotations

from typing import Any

from ..errors import LocalLLMError


def _kind(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"an array of {len(value)}"
    return f"{type(value).__name__} {value!r}"[:80]


def _wrong(key: str, value: Any, expected: str) -> LocalLLMError:
    return LocalLLMError(f"bad tokenizer metadata {key}: {_kind(value)}, expected {expected}")


def _all_text(items: list) -> bool:
    """Every item a str that encodes as UTF-8, checked in C (a 50k-token vocabulary: ~0.2 s less at
    each load than the loop below, which then only runs to find the bad item)."""
    if not all(type(x) is str for x in items):
        return False
    try:
        "".join(items).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bad_item(items: list, ok) -> int | None:
    """Index of the first item of items that fails ok, None if all pass."""
    if ok is _is_text and _all_text(items):
        return None
    if ok is _is_int and all(type(x) is int for x in items):
        return None
    for i, item in enumerate(items):
        if not ok(item):
            return i
    return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_text(x: Any) -> bool:
    """A str that can be written as UTF-8 (no lone surrogate)."""
    if not isinstance(x, str):
        return False
    try:
        x.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def typed_list(metadata: dict[str, Any], key: str, item: str) -> list | None:
    """The array at key with items of kind item ("text", "int" or "number"); None if missing."""
    value = metadata.get(key)
    if value is None:
        return None
    ok = {"text": _is_text, "int": _is_int,
          "number": lambda x: (_is_int(x) or isinstance(x, float))}[item]
    if not isinstance(value, (list, tuple)):
        raise _wrong(key, value, f"an array of {item}s")
    bad = _bad_item(value, ok)
    if bad is not None:
        what = "UTF-8 text" if item == "text" else f"{item}s"
        raise LocalLLMError(f"bad tokenizer metadata {key}[{bad}]: {_kind(value[bad])}, expected {what}")
    return list(value)


def optional_int(metadata: dict[str, Any], key: str, default: int | None = None) -> int | None:
    value = metadata.get(key, default)
    if value is None or _is_int(value):
        return value
    raise _wrong(key, value, "a token id (an integer)")


def optional_text(metadata: dict[str, Any], key: str) -> str | None:
    value = metadata.get(key)
    if value is None or _is_text(value):
        return value
    raise _wrong(key, value, "a UTF-8 string")


def optional_bool(metadata: dict[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(key, default)
    if isinstance(value, (bool, int)) and not isinstance(value, float):
        return bool(value)
    raise _wrong(key, value, "a boolean")
