"""A stand-in daemon for tests/cluster/test_zygote.py: `python -m zygote_target CODE`
prints its argv and environment marker, then exits with CODE, or with
`wait` blocks until a signal ends it."""

import os
import signal
import sys

if __name__ == "__main__":
    print(
        "argv",
        " ".join(sys.argv[1:]),
        "marker",
        os.environ.get("ZYGOTE_MARKER"),
        "sid",
        os.getsid(0) == os.getpid(),
    )
    if sys.argv[1] == "wait":
        print("ready")
        signal.pause()
    sys.exit(int(sys.argv[1]))
