"""The server's importable packages have generic top-level names (engine, kernels, model, service,
training; README "Why the packages are not namespaced"). PyPI has packages named `kernels` and
`service`: installed next to pie, one would shadow or overwrite ours and fail somewhere deep.
`check_own_packages` finds that at start and says what to do."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

OWN_PACKAGES = ("engine", "kernels", "model", "service", "training")
DISTRIBUTION = "pie"


class ForeignPackageError(RuntimeError):
    pass


def check_own_packages() -> list[str]:
    """Raises ForeignPackageError when one of our package names imports from somewhere else than
    this one's folder; returns warnings for another installed distribution that also provides one
    of the names (harmless while ours comes first, as here, but it can overwrite ours on the next
    install)."""
    home = Path(__file__).resolve().parents[1]  # the folder holding service/ and its siblings
    for name in OWN_PACKAGES:
        spec = importlib.util.find_spec(name)
        origin = None if spec is None or spec.origin is None else Path(spec.origin).resolve()
        if origin is None or origin.parent.parent != home:
            raise ForeignPackageError(
                f"the package {name!r} imports from {origin or 'nowhere'}, not from pie's {home / name}: another "
                f"distribution installs a package named {name!r}. Uninstall it (pip uninstall {name}) or install "
                "pie in a virtual environment of its own.")
    providers = importlib.metadata.packages_distributions()
    warnings = []
    for name in OWN_PACKAGES:
        others = sorted({d for d in providers.get(name, []) if d.lower() != DISTRIBUTION})
        if others:
            warnings.append(f"the distribution(s) {', '.join(others)} also install a package named {name!r}; "
                            f"pie's is imported now, but installing either again may overwrite the other")
    return warnings
