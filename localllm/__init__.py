"""localllm: local LLM inference (GGUF and safetensors models, mixed-precision quantization, fast decode).

One import package. The repository keeps `kernels/`, `quantize/`, `commands/`, `cli.py` and
`models.toml` at its top (the layout the project card names); the wheel installs them inside this
package (pyproject's force-include), as `localllm.kernels`, `localllm.quantize`, `localllm.commands`,
`localllm.cli`. Run from a source checkout, the checkout's top is added to this package's search
path so the same names import from there.
"""

from pathlib import Path as _Path

_TOP = _Path(__file__).resolve().parent.parent
if (_TOP / "pyproject.toml").is_file() and (_TOP / "kernels").is_dir() and (_TOP / "cli.py").is_file():
    __path__.append(str(_TOP))  # noqa: F821 (a package's __path__)


def data_path(name: str) -> _Path:
    """A data file shipped with the package (models.toml): inside it when installed, at the top of a
    source checkout otherwise."""
    inside = _Path(__file__).resolve().parent / name
    return inside if inside.exists() else _TOP / name
