"""`python -m tinydist ...`: the same command line as the `tinydist` script (and `python -m tinydist.cli`)."""

import sys

from tinydist.cli import main

if __name__ == "__main__":  # importing the module (tests import every module) runs nothing
    sys.exit(main())
