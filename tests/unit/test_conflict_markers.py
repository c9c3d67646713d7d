"""No tracked file holds a merge's conflict markers (a merge once committed them into README.md)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(rb"^(<<<<<<< |>>>>>>> |=======$)", re.MULTILINE)


def test_no_tracked_file_holds_conflict_markers() -> None:
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    marked = [
        name
        for name in tracked.decode().split("\0")
        if name and (ROOT / name).is_file() and MARKER.search((ROOT / name).read_bytes())
    ]
    assert marked == []
