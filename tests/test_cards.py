"""Each member's Hub card (CARD.md) carries the H200 table rendered from its committed results."""

import subprocess
import sys

from toy_workspace import REPO


def test_card_tables_match_the_committed_results():
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "card_tables.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_cards_have_the_sections_a_consumer_needs():
    for member in ("flash_moe", "rmsnorm"):
        text = (REPO / member / "CARD.md").read_text()
        assert text.startswith("---\nlicense: apache-2.0\n")
        for heading in ("## API", "## Numerics", "## GPUs", "## H200 results", "## Pinning"):
            assert heading in text, (member, heading)


def test_each_design_doc_names_every_kernel_source():
    """A member's DESIGN.md has a row for each source its build.toml compiles (as `name` in the
    table's first column), so a newcomer finds what every file does."""
    from prime_kernels.workspace import read_workspace

    for member, spec in read_workspace(REPO).items():
        lines = (REPO / member / "DESIGN.md").read_text().splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("| source"))  # the sources table
        table = ""
        for line in lines[start + 2:]:  # past its header and rule, to its end
            if not line.startswith("|"):
                break
            table += line.split("|")[1] + "\n"
        for kernel in spec.kernels:
            for src in kernel.sources:
                name = src.rsplit("/", 1)[-1]
                assert f"`{name}`" in table or f"`{src}`" in table, (member, src)
