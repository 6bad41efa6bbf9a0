"""Wheel build hook: the folders and files the repository keeps at its top go inside the one import
package `localllm` (kernels/ -> localllm/kernels, ...). Only for a real wheel: an editable install
runs the checkout itself (localllm/__init__.py adds the checkout's top to the package's path)."""

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

INSIDE = ("kernels", "quantize", "commands", "cli.py", "models.toml")


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        if version == "standard":
            build_data["force_include"].update({name: f"localllm/{name}" for name in INSIDE})
