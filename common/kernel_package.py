"""Load a member's Python files from its source tree, without its native extension.

A member's package, torch-ext/<kernel>/, imports the built extension in its __init__.py, which a
CPU test or a benchmark reading the reference cannot (or need not) do. `load_reference` loads
torch-ext/<kernel>/reference.py as a submodule of a stand-in package: a module object whose
__path__ is that folder, its __init__.py never run, so the reference's relative imports (its
sibling mxfp8_rules.py) resolve as they do in the built package.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
import types


def stand_in_package(name: str, folder: pathlib.Path, **attributes) -> types.ModuleType:
    """`folder` as package `name` (registered in sys.modules) WITHOUT running its __init__.py;
    `attributes` are set on it (what a submodule imports from its package)."""
    package = types.ModuleType(name)
    package.__path__ = [str(folder)]
    package.__dict__.update(attributes)
    sys.modules[name] = package
    return package


def load_submodule(name: str, folder: pathlib.Path, submodule: str, **attributes) -> types.ModuleType:
    """Module `submodule` of `folder` loaded as `name.submodule` under `stand_in_package`."""
    stand_in_package(name, folder, **attributes)
    return importlib.import_module(f"{name}.{submodule}")


def load_reference(member_dir: pathlib.Path) -> types.ModuleType:
    """The member's pure-PyTorch reference, module `<kernel>_source.reference`: the member folder
    is named after its package, torch-ext/<kernel>/."""
    kernel = pathlib.Path(member_dir).name
    return load_submodule(f"{kernel}_source", pathlib.Path(member_dir) / "torch-ext" / kernel, "reference")


def load_file(name: str, path: pathlib.Path, *, package: bool = False) -> types.ModuleType:
    """The file at `path` run as module `name` (registered in sys.modules, as torch.compile
    needs). package=True: `path` is a package's __init__.py, its folder the package's __path__."""
    path = pathlib.Path(path)
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=[str(path.parent)] if package else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
