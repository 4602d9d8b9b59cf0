"""``python -m safelens_tl.fixes [--markdown | --write docs/fixes.md]``: the table of fixes."""

from safelens_tl.fixes import main

raise SystemExit(main())
