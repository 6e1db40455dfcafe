import sys

from sdpa.view.cli import main

sys.exit(main())
