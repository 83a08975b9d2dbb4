"""`python -m lmledger.sweep point PARENT_PID LMLEDGER_ARGS...`: one sweep point's process (runner.point_command)."""

import sys

from lmledger.sweep.runner import point_main

if __name__ == "__main__":
    if sys.argv[1:2] != ["point"]:
        sys.exit("usage: python -m lmledger.sweep point PARENT_PID LMLEDGER_ARGS... (run by `lmledger sweep`)")
    sys.exit(point_main(sys.argv[2:]))
