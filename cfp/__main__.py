"""``python -m cfp``: see ``cfp.cli``."""
import sys

from cfp.host_memory import run_pooled

run_pooled()

from cfp.cli import main  # noqa: E402

sys.exit(main())
