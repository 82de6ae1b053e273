import sys

from vlp.cli import main

if __name__ == "__main__":  # guarded: `vlp compare` worker processes (spawn) import this module again
    sys.exit(main())
