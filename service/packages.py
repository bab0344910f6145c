"""pie installs two import names, `pie` (pie.engine, pie.kernels, pie.model, pie.service,
pie.training and the generated stubs, pie.v1) and `pie_client` (README "Import names"), so packages
with generic names (Hugging Face's `kernels`, PyPI's `service`, ...) install beside it unharmed.
What can still collide is another distribution that also installs a top-level `pie` or
`pie_client`: pip lets the later install overwrite the other's files. `check_own_packages` finds
such a distribution at start and names it."""

from __future__ import annotations

import importlib.metadata

OWN_NAMES = ("pie", "pie_client")
DISTRIBUTIONS = {"pie", "pie-client"}  # ours: the server, and the client installed on its own


def check_own_packages() -> list[str]:
    """One warning for each of our import names that another installed distribution provides too."""
    providers = importlib.metadata.packages_distributions()
    warnings = []
    for name in OWN_NAMES:
        others = sorted({d for d in providers.get(name, []) if d.lower().replace("_", "-") not in DISTRIBUTIONS})
        if others:
            warnings.append(f"the distribution(s) {', '.join(others)} also install a package named {name!r}; "
                            f"installing either again may overwrite the other's files (pip uninstall {others[0]})")
    return warnings
