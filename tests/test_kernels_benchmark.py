"""Each member's benchmarks/benchmark.py under `kernels benchmark`'s own runner
(kernels.cli.benchmark: its class discovery and `run_benchmark_class`), on the CPU: the member's
pure-PyTorch reference stands in for the kernel and every shape is made small. Every class the
runner discovers has a workload (the runner fails a whole script on one without), every workload's
verify passes, and each verify can fail (a stand-in off by a few ulps is refused)."""

import pathlib
import sys
import types

import pytest
import torch
from kernels.cli import benchmark as runner

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "common"))
sys.path.append(str(REPO / "flash_moe" / "tests"))
import kernel_package  # noqa: E402
import reference_kernel  # noqa: E402 (flash_moe/tests/)


def _flash_moe_stand_in():
    return types.SimpleNamespace(**vars(reference_kernel.load()))  # a copy: a test may replace its ops


def _rmsnorm_stand_in():
    ref = kernel_package.load_reference(REPO / "rmsnorm")

    def backward(*args):  # the op returns bf16
        return tuple(t.to(torch.bfloat16) for t in ref.fused_rmsnorm_residual_backward(*args))

    return types.SimpleNamespace(__name__="rmsnorm_standin", fused_rmsnorm_residual=ref.fused_rmsnorm_residual,
                                 fused_rmsnorm_residual_backward=backward)


def _small(cls):
    """cls with its shapes made CPU-sized (same kinds of shape: top_k, experts, dims)."""
    if hasattr(cls, "shape"):  # flash_moe: (tokens, dim, hidden, experts, top_k)
        return type(cls.__name__, (cls,), {"shape": (48, 128, 64, 8, cls.shape[4])})
    return type(cls.__name__, (cls,), {"SHAPES": {w: (24, 64 * (1 + i)) for i, w in enumerate(cls.SHAPES)}})


MEMBERS = {"flash_moe": _flash_moe_stand_in, "rmsnorm": _rmsnorm_stand_in}


def _run(monkeypatch, member, stand_in, cls):
    import kernels

    monkeypatch.setattr(kernels, "get_local_kernel", lambda path: stand_in)
    monkeypatch.setattr(runner, "_backend", lambda: types.SimpleNamespace(name="cpu"))
    return runner.run_benchmark_class(_small(cls), iterations=1, warmup=0, repo_id=str(REPO / member),
                                      is_local=True, revision="")


def _classes(member):
    path = REPO / member / "benchmarks" / "benchmark.py"
    return runner.discover_benchmark_classes(path, path.parent)


@pytest.mark.parametrize("member", MEMBERS)
def test_the_runner_runs_and_verifies_every_workload(member, monkeypatch):
    stand_in = MEMBERS[member]()
    classes = _classes(member)
    assert classes
    workloads = []
    for cls in classes:
        results, _ = _run(monkeypatch, member, stand_in, cls)  # raises on a failed verify
        workloads += [f"{cls.__name__}.{w}" for w in results]
    if member == "flash_moe":
        assert {w.split(".")[1] for w in workloads} == {"fused_moe_bf16", "fused_moe_mxfp8", "fused_moe_bf16_backward"}
        assert sum(w.endswith("fused_moe_bf16_backward") for w in workloads) == 5  # compare.py's backward shapes
    else:
        assert sorted(workloads) == ["FusedRMSNormResidualBackward.n65536_c4096",
                                     "FusedRMSNormResidualForward.n16384_c7168",
                                     "FusedRMSNormResidualForward.n65536_c4096"]


@pytest.mark.parametrize("member,cls_name", [("flash_moe", "MoE8k2048x768E64"), ("flash_moe", "MoEMxfp8_8k2048x768E64"),
                                             ("flash_moe", "MoEBackward8k2048x768E64"),
                                             ("rmsnorm", "FusedRMSNormResidualForward"),
                                             ("rmsnorm", "FusedRMSNormResidualBackward")])
def test_a_wrong_output_fails_verification(member, cls_name, monkeypatch):
    """The stand-in's output nudged after the op (e4m3: one byte's low bit; else its largest element
    by 10 %, 0.02 to 0.4 at these magnitudes) makes the runner refuse it."""
    cls = next(c for c in _classes(member) if c.__name__ == cls_name)
    stand_in = MEMBERS[member]()

    def nudged(op):
        def call(*args, **kwargs):
            result = op(*args, **kwargs)
            first = result[0] if isinstance(result, tuple) else result
            flat = first.view(-1)
            if first.dtype == torch.float8_e4m3fn:
                flat.view(torch.uint8)[0] ^= 1
            else:
                i = flat.float().abs().argmax()
                flat[i] = flat[i] * 1.1
            return result
        return call

    if member == "rmsnorm":
        name = "fused_rmsnorm_residual" if "Forward" in cls_name else "fused_rmsnorm_residual_backward"
        setattr(stand_in, name, nudged(getattr(stand_in, name)))
    elif "Backward" in cls_name:
        stand_in.functional = types.SimpleNamespace(fused_backward=nudged(stand_in.functional.fused_backward))
    else:
        name = "fused_moe_mxfp8" if "Mxfp8" in cls_name else "fused_moe_bf16"
        setattr(stand_in, name, nudged(getattr(stand_in, name)))
    with pytest.raises(RuntimeError, match="Verification failed"):
        _run(monkeypatch, member, stand_in, cls)
