"""Helpers of the tests that drive `localllm quantize` through typer's runner."""

from __future__ import annotations

from typer.testing import CliRunner


def invoke_quantize(*args):
    """Run `localllm quantize ARGS` in-process; only a SystemExit may escape (no traceback)."""
    from localllm.cli import app

    # wide, so that rich never folds a table row we parse
    result = CliRunner().invoke(app, ["quantize", *[str(a) for a in args]], env={"COLUMNS": "200"})
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def assert_one_error(result, needle: str):
    """A failure shown as one `error:` line naming `needle`, and no traceback."""
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout
