import sys

from sdpa.cli import main

sys.exit(main())
