"""No silent minute: a long step that reports nothing (the first C++ build, the first parse of a large
vocabulary) shows a spinner with the elapsed time on a terminal, and nothing on a pipe."""

from __future__ import annotations

import io
import time

from rich.console import Console

from _bad_files import write_tiny_model


def terminal() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=True, width=100), buf


def test_spinner_shows_the_step_and_time_on_a_terminal():
    from localllm.progress import elapsed_spinner

    console, buf = terminal()
    with elapsed_spinner("building the kernels", console=console):
        time.sleep(0.4)
    shown = buf.getvalue()
    assert "building the kernels" in shown and "0:00:00" in shown, repr(shown)


def test_spinner_quiet_for_quick_work_and_pipes():
    from localllm.progress import elapsed_spinner

    console, buf = terminal()
    with elapsed_spinner("quick", delay=5.0, console=console):
        pass
    assert buf.getvalue() == ""
    pipe = io.StringIO()
    with elapsed_spinner("slow", console=Console(file=pipe, force_terminal=False)):
        time.sleep(0.2)
    assert pipe.getvalue() == ""


def test_first_parse_of_a_gguf_is_announced(tmp_path, monkeypatch):
    """open_gguf wraps the uncached parse (what takes 19 s for qwen2's vocabulary) in the spinner."""
    import localllm.gguf_file as gf

    seen = []
    real = gf.elapsed_spinner
    monkeypatch.setattr(gf, "elapsed_spinner", lambda description, **kw: seen.append(description) or real(
        description, **kw))
    path = write_tiny_model(tmp_path / "tiny.gguf")
    gf.open_gguf(path, cache_dir=tmp_path / "cache")
    assert seen == ["reading tiny.gguf's metadata (once: cached for later runs)"]


def test_cpu_kernel_build_is_announced(tmp_path, monkeypatch):
    """The first-use C++ build (68 s on the 2-core machine) runs inside the spinner (the compiler
    replaced by a stand-in: this test builds nothing)."""
    from contextlib import contextmanager

    from torch.utils import cpp_extension

    import localllm.progress as progress
    from localllm.kernels.cpu import extension

    events = []

    @contextmanager
    def spinner(description, **kw):
        events.append(("start", description))
        yield
        events.append(("end", description))

    monkeypatch.setattr(progress, "elapsed_spinner", spinner)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: events.append(("load", kw["name"])) or "module")
    assert extension.__wrapped__(tmp_path / "cpu_ext" / "abc") == "module"
    assert [e[0] for e in events] == ["start", "load", "end"] and "CPU kernels" in events[0][1]
