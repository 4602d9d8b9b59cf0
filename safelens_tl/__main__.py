"""``python -m safelens_tl`` runs the ``safelens-tl`` command."""

import sys

from safelens_tl.cli import main

sys.exit(main())
