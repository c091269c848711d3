"""`python -m tinydist.cli ...`: the same command line as the `tinydist` script."""

import sys

from tinydist.cli import main

if __name__ == "__main__":  # importing the module (tests import every module) runs nothing
    sys.exit(main())
