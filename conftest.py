# Makes the shim (torch-ext/) and the workspace test helpers (tests/) importable without
# installing anything; `pip install -e .` provides the shim the same way.
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT / "torch-ext"), str(ROOT / "tests")]
