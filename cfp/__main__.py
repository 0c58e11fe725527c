"""``python -m cfp``: see ``cfp.cli``."""
import sys

from cfp.cli import main

sys.exit(main())
