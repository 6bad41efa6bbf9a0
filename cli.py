"""The `localllm` command line: the typer app (the console script `localllm` and `python -m localllm`
run it). Each command's options and body live in commands/cli_*.py, registered here in the order
--help lists them; a command parses options, calls library functions and prints, nothing else."""

from __future__ import annotations

from functools import wraps

import typer
from typer.core import TyperGroup

from localllm.commands import cli_bench, cli_generate, cli_models, cli_quantize
from localllm.commands.cli_output import err, print_error
from localllm.errors import LocalLLMError, out_of_memory
from localllm.signals import Terminated, sigterm_interrupts

# click's usage error class, as the click that typer runs on defines it (recent typers carry their own copy).
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


class OneLineUsageErrors(TyperGroup):
    """click's usage errors (an option value that is not a number, an unknown option or command) as one
    `error:` line naming the command's --help, not a boxed usage panel; exit status 2 as click's."""

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `localllm` alone: the help, as no_args_is_help says
                raise
            raise one_line(e) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UsageError as e:
            raise one_line(e) from None


def one_line(e: Exception) -> typer.Exit:
    ctx = getattr(e, "ctx", None)
    hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
    print_error(" ".join(e.format_message().split()).rstrip(".") + hint)
    return typer.Exit(e.exit_code)


app = typer.Typer(
    cls=OneLineUsageErrors,
    help="Run local LLMs (GGUF or safetensors) as llama.cpp's tools do; every command is listed below.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, powershell
)


def user_errors(fn):
    """Turn LocalLLMError, running out of memory (and Ctrl-C, SIGTERM) into one line on stderr and a non-zero exit: never a traceback."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with sigterm_interrupts():  # SIGTERM cleans up as Ctrl-C does (partial files removed)
                return fn(*args, **kwargs)
        except LocalLLMError as e:
            print_error(str(e))
            raise typer.Exit(1) from None
        except (KeyboardInterrupt, Terminated) as e:
            err.print("interrupted")
            raise typer.Exit(143 if isinstance(e, Terminated) else 130) from None
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            message = out_of_memory(e)  # partial output files are already gone (the writers' own cleanup)
            if message is None:
                raise
            print_error(message)
            raise typer.Exit(1) from None

    return wrapper


def show_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"localllm {version('localllm')}")
        except PackageNotFoundError:  # a source checkout that was never installed
            print("localllm (not installed)")
        raise typer.Exit()


@app.callback()
def main(
    _version: bool = typer.Option(False, "--version", callback=show_version, is_eager=True,
                                  help="print the version and exit"),
):
    """Run local LLMs (GGUF or safetensors): complete, inspect, tokenize."""


COMMANDS = (  # (name, function), in the order --help lists them
    ("complete", cli_generate.complete), ("info", cli_models.info), ("tokenize", cli_models.tokenize),
    ("chat", cli_generate.chat), ("quantize", cli_quantize.quantize), ("perplexity", cli_quantize.perplexity),
    ("bench", cli_bench.bench), ("serve", cli_generate.serve), ("pull", cli_models.pull),
    ("list", cli_models.list_models), ("rm", cli_models.remove), ("ps", cli_models.ps), ("stop", cli_models.stop),
)
for name, command in COMMANDS:
    app.command(name)(user_errors(command))


if __name__ == "__main__":
    app()
