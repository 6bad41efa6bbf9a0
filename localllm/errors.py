"""User-facing errors: one clear line, a non-zero exit, never a traceback (cli.py catches these)."""


class LocalLLMError(Exception):
    """A problem with the user's input (file, model, prompt, option) that the CLI prints as one line."""
