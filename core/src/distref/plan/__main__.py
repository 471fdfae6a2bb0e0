"""python -m distref.plan"""

import os
import sys

from distref.plan.cli import main

try:
    code = main()
    sys.stdout.flush()  # (here, so that a reader gone away is seen here: `... --json | head -1`)
except BrokenPipeError:
    # The reader closed the pipe: end quietly, as Unix tools do (141: killed by SIGPIPE, as the shell
    # reports them); stdout goes to /dev/null so that the interpreter's own flush at exit stays silent.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    code = 128 + 13
sys.exit(code)
