import sys

from expertd.cli import main

sys.exit(main())
