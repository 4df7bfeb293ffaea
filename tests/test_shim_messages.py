"""What a newcomer reads: `prime-kernels status` answers in one line per problem (never a
traceback), each fact once, no line of its table wider than 120 characters."""

import json

import pytest

from prime_kernels import builder
from prime_kernels.registry import SKIP_MARKER
from prime_kernels.workspace import read_workspace
from toy_workspace import REPO, make_workspace, run_python

STATUS = "from prime_kernels.cli import main; raise SystemExit(main(['status']))"


def _offline(tmp_path) -> dict[str, str]:
    empty = str(tmp_path / "empty-cache")
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": empty, "KERNELS_CACHE": empty}


def _status(root, tmp_path, **env):
    result = run_python(STATUS, root, cwd=tmp_path, **{**_offline(tmp_path), **env})
    assert "Traceback" not in result.stderr, result.stderr
    return result


def test_capability_in_sm_form_is_a_manifest_error_not_a_traceback(tmp_path):
    root = make_workspace(tmp_path / "ws", capabilities='"sm_100a"')
    result = _status(root, tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        f"prime-kernels: {root / 'toy' / 'build.toml'}: field `kernel.toy.cuda-capabilities`: 'sm_100a' is not a "
        "CUDA capability in kernel-builder's form (major.minor plus an optional a/f suffix, e.g. \"10.0a\"): "
        "write \"10.0a\"\n"
    )


def test_folder_name_message_names_the_python_package_and_the_folder(tmp_path):
    root = make_workspace(tmp_path / "ws")
    folder = (root / "toy").rename(root / "my-op")
    (folder / "build.toml").write_text((folder / "build.toml").read_text().replace('name = "toy"', 'name = "my-op"'))
    (root / "build.toml").write_text('[workspace]\nmembers = ["my-op"]\n\n[hub.my-op]\nversion = 1\n')
    result = _status(root, tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        f"prime-kernels: {folder / 'build.toml'}: field `general.name` ('my-op') gives the Python package `my_op`, "
        "which must also be the member's folder name; the folder is 'my-op': rename it to 'my_op' "
        "(and list 'my_op' in `workspace.members`)\n"
    )


def test_malformed_local_kernels_is_reported_as_malformed(tmp_path):
    root = make_workspace(tmp_path / "ws")
    code = "import prime_kernels; print(prime_kernels.unavailable_reason('toy'))"
    result = run_python(code, root, LOCAL_KERNELS="garbage", **_offline(tmp_path))
    assert "LOCAL_KERNELS is malformed: 'garbage' (expected `org/name=/path[:org/name=/path...]`)" in result.stdout
    assert "names prime-intellect/toy" not in result.stdout, result.stdout + result.stderr
    assert _status(root, tmp_path, LOCAL_KERNELS="garbage").returncode == 0


def test_local_kernels_pointing_at_nothing_names_the_path(tmp_path):
    root = make_workspace(tmp_path / "ws")
    code = "import prime_kernels; print(prime_kernels.unavailable_reason('toy'))"
    result = run_python(code, root, LOCAL_KERNELS=f"prime-intellect/toy={tmp_path / 'nowhere'}", **_offline(tmp_path))
    assert f"LOCAL_KERNELS points prime-intellect/toy at {tmp_path / 'nowhere'}, which holds no usable build (" in result.stdout, result.stderr


def test_hub_version_zero_is_refused(tmp_path):
    root = make_workspace(tmp_path / "ws", pin="version = 0")
    result = _status(root, tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        f"prime-kernels: {root / 'build.toml'}: field `hub.toy.version` must be an integer >= 1 "
        "(release branches are v1, v2, ...), got 0\n"
    )


# A CPU-only torch, as on a laptop: torch.version.cuda is None. (This machine's torch may have CUDA.)
_CPU_TORCH = "import torch\ntorch.version.cuda = None\ntorch.__version__ = '2.14.1+cpu'\n"


@pytest.mark.parametrize("offline", [False, True])
def test_cpu_only_torch_states_each_fact_once(tmp_path, offline):
    root = make_workspace(tmp_path / "ws")
    spec = read_workspace(root)["toy"]
    cpu = builder.Toolchain(cuda_home=tmp_path, nvcc_version=(13, 0), torch_version="2.14.1+cpu",
                            torch_cuda=None, cxx11_abi=True)
    skip = builder.skip_reason(spec, cpu)  # what `prime-kernels build` leaves behind with that torch
    assert skip.startswith("torch 2.14.1+cpu is built without CUDA")
    spec.build_dir.mkdir()
    (spec.build_dir / SKIP_MARKER).write_text(skip + "\n")
    env = _offline(tmp_path) if offline else {}
    code = _CPU_TORCH + "import prime_kernels; print(prime_kernels.unavailable_reason('toy'))"
    reason = run_python(code, root, **env).stdout.strip()
    assert reason.count("built without CUDA") == 1 and reason.count("install a CUDA build of torch") == 1, reason
    assert "not built: `prime-kernels build toy` skipped it for the same reason" in reason
    if offline:
        assert reason.count("offline") + reason.count("OFFLINE") == 1, reason  # kernels' own "offline mode" echo dropped
    table = run_python(_CPU_TORCH + STATUS, root, **env).stdout
    assert " ".join(table.split()).count("built without CUDA") == 1, table


def _status_cells(table: str) -> dict[str, str]:
    """{kernel: the status column's text, its wrapped lines joined}."""
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("kernel "))
    column = lines[header].index("status")
    cells, kernel = {}, None
    for line in lines[header + 2:]:
        if not line.strip():
            break
        kernel = line.split()[0] if not line.startswith(" ") else kernel
        cells[kernel] = (cells.get(kernel, "") + " " + line[column:]).strip()
    return cells


@pytest.mark.parametrize("where", ["repo", "no workspace", "long LOCAL_KERNELS path"])
def test_status_lines_stay_within_120_characters_and_status_keeps_full_reasons(tmp_path, where):
    env = _offline(tmp_path)
    workspace = None if where == "no workspace" else REPO
    if where == "long LOCAL_KERNELS path":
        deep = tmp_path.joinpath(*["a-rather-long-directory-name"] * 6)
        env["LOCAL_KERNELS"] = f"prime-intellect/rmsnorm={deep}:prime-intellect/flash_moe={deep}"
    table = run_python(STATUS, workspace, cwd=tmp_path, **env)
    assert table.returncode == 0, table.stderr
    assert max(len(line) for line in table.stdout.splitlines()) <= 120, table.stdout
    code = "import json, prime_kernels; print(json.dumps(prime_kernels.status()))"
    reasons = json.loads(run_python(code, workspace, cwd=tmp_path, **env).stdout)
    cells = _status_cells(table.stdout)
    assert set(cells) == set(reasons)
    for name, reason in reasons.items():
        assert "\n" not in reason
        # Wrapping only moves the words: the table holds the whole reason.
        assert "".join(cells[name].split()) == "".join(reason.split()), (cells[name], reason)
