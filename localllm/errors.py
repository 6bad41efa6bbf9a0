"""User-facing errors: one clear line, a non-zero exit, never a traceback (cli.py catches these)."""


class LocalLLMError(Exception):
    """A problem with the user's input (file, model, prompt, option) that the CLI prints as one line."""


def out_of_memory(e: BaseException) -> str | None:
    """The one line for an allocation that failed (torch's CUDA OutOfMemoryError, the CPU allocator's
    or MPS's RuntimeError, Python's MemoryError), naming the device and what to try; None for any other
    exception. torch is looked up, not imported: a command that never imported it cannot have hit it."""
    import re
    import sys

    torch = sys.modules.get("torch")
    text = str(e)
    if torch is not None and isinstance(e, torch.OutOfMemoryError):  # CUDA (torch.cuda.OutOfMemoryError)
        need = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
        card = re.search(r"GPU (\d+) has a total capacity of ([\d.]+ [KMGT]?i?B) of which ([\d.]+ [KMGT]?i?B) is free", text)
        what = (f" allocating {need.group(1)}" if need else "") + (
            f" (GPU {card.group(1)}: {card.group(2)}, {card.group(3)} free)" if card else "")
        return (f"out of GPU memory on cuda{what}: try --device cpu, a smaller --ctx, or a smaller model"
                " (or free the GPU of other processes)")
    if isinstance(e, RuntimeError) and "MPS backend out of memory" in text:
        return "out of GPU memory on mps: try --device cpu, a smaller --ctx, or a smaller model"
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in text):
        need = re.search(r"tried to allocate (\d+) bytes", text)
        what = f" allocating {int(need.group(1)) / 2**30:.2f} GiB" if need else ""
        return f"out of memory on the CPU{what}: try a smaller --ctx or a smaller model (or close other programs)"
    return None
