"""The README's Quickstart command lines, read from the README itself.

Why a script: `.ci/run` runs these lines verbatim, as a new user would paste them, and compares its copy with this
script's output before running it, so the README cannot promise one install and CI test another. `tests/test_quickstart.py` checks the block's shape (two lines: the main job, the tests).

Usage: python scripts/quickstart.py [README]     prints one command line per line
"""

import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart_lines(readme_text: str) -> list[str]:
    """The command lines of the first fenced block under the `## Quickstart` heading, in order."""
    lines = readme_text.splitlines()
    try:
        start = lines.index("## Quickstart")
    except ValueError:
        raise ValueError("README.md has no '## Quickstart' heading: .ci/run runs the commands under it") from None
    body = lines[start + 1 :]
    fences = [i for i, line in enumerate(body) if line.startswith("```")]
    if len(fences) < 2 or any(line.startswith("## ") for line in body[: fences[0]]):
        raise ValueError("the README's Quickstart section has no fenced code block before the next section")
    commands = [line.strip() for line in body[fences[0] + 1 : fences[1]]]
    return [c for c in commands if c and not c.startswith("#")]


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else README
    print("\n".join(quickstart_lines(path.read_text())))
