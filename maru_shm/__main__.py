"""`python -m maru_shm`: the `maru-shm` command, where the console script is not on PATH.

The command line is a client of the store (tools/, installed as maru_shm_tools): it is imported only when
this module runs as the program, so nothing that imports maru_shm reaches up to it.
"""

import sys

if __name__ == "__main__":
    from maru_shm_tools.cli import main
    sys.exit(main())
