"""flash_moe's package __init__ loaded on the CPU with a stub `._ops` (no native code): its
pure-Python parts (shape rules, preferred_bpc, fake kernels) as the real package has them. Tests
import it by name (conftest.py puts this folder on sys.path)."""

import functools
import pathlib
import re
import sys
import types

import kernel_package
import torch

MEMBER = pathlib.Path(__file__).resolve().parents[1]


def binding_schemas():
    """The op schemas of torch_binding.cpp's ops.def(...) calls (their string literals joined)."""
    src = (MEMBER / "torch-ext" / "torch_binding.cpp").read_text()
    calls = re.findall(r"ops\.def\(((?:\s*\"(?:[^\"\\]|\\.)*\")+)\s*\)", src)
    return ["".join(re.findall(r'"((?:[^"\\]|\\.)*)"', c)) for c in calls]


@functools.cache  # once per process: the stub library's ops can be defined only once
def load():
    """The package as module `flash_moe_cpu_pkg`, its ops defined in library `flash_moe_cpu_test`."""
    ops_mod = types.ModuleType("flash_moe_cpu_pkg._ops")
    lib = torch.library.Library("flash_moe_cpu_test", "FRAGMENT")
    for schema in binding_schemas():  # the package registers fake kernels for every op
        lib.define(schema)
    ops_mod.ops = torch.ops.flash_moe_cpu_test
    ops_mod.add_op_namespace_prefix = lambda name: f"flash_moe_cpu_test::{name}"
    ops_mod._lib = lib
    sys.modules["flash_moe_cpu_pkg._ops"] = ops_mod
    return kernel_package.load_file("flash_moe_cpu_pkg", MEMBER / "torch-ext" / "flash_moe" / "__init__.py",
                                    package=True)
