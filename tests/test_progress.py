"""No silent minute: a long step that reports nothing (the first C++ build, the first parse of a large
vocabulary) shows a spinner with the elapsed time on a terminal, and on a pipe (a CI log) a plain line
with the elapsed seconds every PROGRESS_LINE_SECONDS (none for quick work)."""

from __future__ import annotations

import io
import re
import time
from functools import partial

import pytest
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


def elapsed_seconds(text: str, description: str) -> list[int]:
    """The N of every "description: N s elapsed" line of text; asserts every line is one of those."""
    lines = text.splitlines()
    pattern = re.compile(re.escape(description) + r": (\d+) s elapsed")
    assert all(pattern.fullmatch(line) for line in lines), lines
    return [int(pattern.fullmatch(line).group(1)) for line in lines]


def test_pipe_gets_an_elapsed_line_every_interval_and_none_after():
    """On a non-terminal: plain lines (no cursor codes) while the step runs, about one per `every`
    seconds, their seconds rising; nothing once the block has ended. (every 0.5 s here: the real
    interval, settings.PROGRESS_LINE_SECONDS, is 10 s.)"""
    from localllm.progress import elapsed_spinner

    pipe = io.StringIO()
    with elapsed_spinner("slow step", console=Console(file=pipe, force_terminal=False), every=0.5):
        time.sleep(1.8)
    shown = pipe.getvalue()
    seconds = elapsed_seconds(shown, "slow step")
    assert 2 <= len(seconds) <= 4 and seconds == sorted(seconds) and seconds[-1] >= 1, shown
    time.sleep(0.7)
    assert pipe.getvalue() == shown  # the ticker stopped with the block


def test_cpu_kernel_build_prints_elapsed_lines_on_a_pipe(tmp_path, monkeypatch, capsys):
    """The first-use C++ build on a non-terminal stderr (a CI log): its one announcing line, then
    elapsed lines while the (fake, slow: nothing is compiled) build runs, as llama.cpp-style tools do."""
    from torch.utils import cpp_extension

    import localllm.progress as progress
    from localllm.kernels.cpu import extension

    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):  # stderr is a pipe here, whatever CI says
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(progress, "elapsed_spinner", partial(progress.elapsed_spinner, every=0.25))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: time.sleep(1.1) or "module")
    assert extension.__wrapped__(tmp_path / "cpu_ext" / "abc") == "module"
    first, *rest = capsys.readouterr().err.splitlines()
    assert first.startswith("building localllm's CPU kernels into ") and first.endswith("(about a minute, once) ...")
    seconds = elapsed_seconds("\n".join(rest), "building localllm's CPU kernels (once)")
    assert len(seconds) >= 2 and seconds == sorted(seconds), rest


def test_first_items_wait_under_the_spinner_and_it_ends_before_they_are_handed_on(monkeypatch):
    """progress.first_items_announced: the first `count` items are awaited inside the spinner, which has
    ended when the first one is handed on; the rest stream after it; an error ends it too."""
    from contextlib import contextmanager

    import localllm.progress as progress

    events = []

    @contextmanager
    def spinner(description, **kw):
        events.append(("start", description, kw["delay"]))
        try:
            yield
        finally:
            events.append(("end",))

    def pieces(n):
        for i in range(n):
            events.append(("made", i))
            yield f"p{i}"

    monkeypatch.setattr(progress, "elapsed_spinner", spinner)
    got = []
    for item in progress.first_items_announced(pieces(4), "compiling", count=2, delay=1.5):
        events.append(("handed", item))
        got.append(item)
    assert got == ["p0", "p1", "p2", "p3"]
    assert events == [("start", "compiling", 1.5), ("made", 0), ("made", 1), ("end",), ("handed", "p0"),
                      ("handed", "p1"), ("made", 2), ("handed", "p2"), ("made", 3), ("handed", "p3")]
    events.clear()
    assert list(progress.first_items_announced(pieces(1), "x", count=2)) == ["p0"]  # fewer than count

    def failing():
        yield "a"
        raise RuntimeError("boom")

    events.clear()
    with pytest.raises(RuntimeError, match="boom"):
        list(progress.first_items_announced(failing(), "x", count=3))
    assert events[-1] == ("end",)


def test_first_tokens_spinner_only_where_the_runtime_compiles(monkeypatch):
    """Runtime.first_tokens_compile decides (CUDA's runtimes set it; the CPU's not)."""
    from types import SimpleNamespace

    import localllm.progress as progress
    from localllm.backends.cpu import CpuRuntime
    from localllm.backends.cuda import CudaEagerRuntime, CudaRuntime
    from localllm.commands import cli_output

    seen = []
    monkeypatch.setattr(progress, "first_items_announced", lambda items, description: seen.append(description)
                        or items)
    pieces = iter(["a", "b"])
    assert not CpuRuntime.first_tokens_compile and CudaRuntime.first_tokens_compile
    assert CudaEagerRuntime.first_tokens_compile
    assert cli_output.first_tokens_shown(SimpleNamespace(first_tokens_compile=False), pieces) is pieces and not seen
    shown = cli_output.first_tokens_shown(SimpleNamespace(first_tokens_compile=True), pieces)
    assert list(shown) == ["a", "b"] and seen == [cli_output.FIRST_TOKENS_COMPILE]
