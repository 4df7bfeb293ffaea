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
