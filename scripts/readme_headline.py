"""Rewrite the README's headline figure from a `layerlift bench ttft` record.

    python scripts/readme_headline.py README.md bench/results/ttft_quick.json

The headline paragraph starts with ``**Headline:**``; its first bold
``**A to B×**`` (or ``**A×**``) span is replaced by the record's speed-up span
(``layerlift.bench.results.headline``). Run by ``make results``; the test
``test_readme_headline_is_the_make_bench_record`` checks the two agree.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from layerlift.bench.results import headline

SPAN = re.compile(r"\*\*[0-9.]+(?: to [0-9.]+)?×\*\*")


def main(readme: str, record: str) -> int:
    text = Path(readme).read_text()
    start = text.find("**Headline:**")
    if start < 0:
        print(f"{readme} has no '**Headline:**' paragraph", file=sys.stderr)
        return 2
    match = SPAN.search(text, start)
    if match is None:
        print(f"{readme}'s headline has no bold '**A to B×**' figure", file=sys.stderr)
        return 2
    figure = f"**{headline(json.loads(Path(record).read_text()))}**"
    Path(readme).write_text(text[: match.start()] + figure + text[match.end():])
    print(f"{readme}: headline {match.group(0)} -> {figure}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
