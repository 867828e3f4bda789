"""The version gate of tokenfab's patches of its dependencies' internals.

Each dependency's patches and private-API uses live in one module (pools/vllm_compat.py,
tokenfab/ray_compat.py, kvtransfer/nixl_tuning.py), which names the versions they were written
for. Before a patch is applied, `require` checks the installed version: an unknown one fails at
start, naming the patch, instead of breaking a request path silently. tests/unit/test_compat.py
checks each patched thing's shape in the installed version.
"""

from __future__ import annotations

from tokenfab.errors import CompatError


def require(dependency: str, installed: str, written_for: tuple[str, ...], patch: str) -> None:
    """Example: require("vLLM", "0.33.0", ("0.32.0",), "AsyncLLM.generate, traced") raises
    CompatError naming the patch; a local version label (0.32.0+cpu) is ignored."""
    base = installed.split("+", 1)[0]
    if base not in written_for:
        raise CompatError(
            f"tokenfab patches {dependency} ({patch}) and was written for {dependency} "
            f"{' or '.join(written_for)}; {installed} is installed. Install one of those, or "
            f"check the patch against {installed}'s source and add the version where it is "
            "declared")
