import sys
from vlp.cli import main

sys.exit(main())
