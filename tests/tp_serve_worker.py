"""One process of the two-process serving test (tests/test_server_parallel.py): `jaxserve serve`
itself (jaxserve.cli.main with the arguments given), with one change: messages between the
processes go in 256-byte chunks instead of 16 KiB, so the test's prompts span several
broadcasts (with the default a whole step's events fit one).

    python tests/tp_serve_worker.py serve --model DIR --tp 4 --coordinator ... --process-id K ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str]) -> int:
    from jaxserve.cli import main as jaxserve_main
    from sharding import host_messages
    host_messages.CHUNK_BYTES = 256
    return jaxserve_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
