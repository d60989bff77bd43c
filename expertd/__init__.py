"""expertd: remote mixture-of-experts shards over gRPC."""

import os as _os

__version__ = "0.1.0"


def _checkout_path() -> list[str]:
    """The folders of a source checkout that hold this namespace's subpackages.

    pyproject.toml's package-dir maps server/, client/, kernels/ and proto/expertd/v1 into
    `expertd`; a wheel has them inside this folder. When this folder is imported straight
    from a checkout (`python -m pytest` at the root, with a non-editable install or none),
    the subpackages sit beside it instead, so the package path names them too.
    """
    here = _os.path.dirname(_os.path.abspath(__file__))
    root = _os.path.dirname(here)
    if _os.path.isdir(_os.path.join(here, "server")) or not _os.path.isfile(
        _os.path.join(root, "pyproject.toml")
    ):
        return []
    found = []
    for folder in (root, _os.path.join(root, "proto", "expertd")):
        if any(
            _os.path.isfile(_os.path.join(folder, sub, "__init__.py")) for sub in ("server", "v1")
        ):
            found.append(folder)
    return found


__path__ += _checkout_path()
