"""Benchmark of reading a tree of large text files at ingest: the peak memory of reading them whole (what the
ingester did until 2026-12-06, and still does with no size limit) against reading only what could be indexed (their
starts, up to twice ONTOFABRIC_INGEST_MAX_FILE_BYTES), each in a process of its own, over the same files. A tester's
six 80 MB logs took an ingest to 1.2 GB, and a 50 GB file ran it out of memory.

Run: .venv/bin/python -m tests.benchmarks.bench_large_files [--files 6] [--megabytes 80]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from ontofabric.shared.settings import Settings

LINE = "2026-12-06T12:00:00Z INFO a line of a log, with a few words in it and a number 12345\n"
READ = """
import resource, sys
from pathlib import Path
from ontofabric.services.ingest.ingester import read_tree
sources = read_tree(Path(sys.argv[1]), max_read_bytes=int(sys.argv[2]))
print(sum(len(text) for text in sources.values()), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def peak(tree: Path, max_read_bytes: int) -> tuple[int, int]:
    """Characters read and the peak resident memory (KiB) of a process reading ``tree``."""
    done = subprocess.run(
        [sys.executable, "-c", READ, str(tree), str(max_read_bytes)], capture_output=True, text=True, check=True
    )
    characters, kib = done.stdout.split()
    return int(characters), int(kib)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=6)
    parser.add_argument("--megabytes", type=int, default=80)
    args = parser.parse_args()
    settings = Settings()
    limit = 2 * max(settings.ingest_max_file_bytes, settings.max_content_bytes) + 1  # as the ingester reads
    with tempfile.TemporaryDirectory() as directory:
        tree = Path(directory)
        block = LINE * (args.megabytes * 1024 * 1024 // len(LINE))
        for number in range(args.files):
            (tree / f"log{number}.txt").write_text(block)
        (tree / "small.py").write_text("def f():\n    return 1\n")
        empty = tree / "empty"
        empty.mkdir()
        baseline = peak(empty, 0)[1]  # the interpreter and the ingester's imports
        whole = peak(tree, 0)
        starts = peak(tree, limit)
    print(f"{args.files} files of {args.megabytes} MB; a process importing the ingester: {baseline / 1024:.0f} MB")
    for name, (characters, kib) in (("whole", whole), (f"starts ({limit:,} bytes)", starts)):
        print(f"  read {name}: {characters:,} characters, peak {kib / 1024:.0f} MB")
    print(f"  peak reading starts / peak reading whole: {starts[1] / whole[1]:.2f}")


if __name__ == "__main__":
    main()
