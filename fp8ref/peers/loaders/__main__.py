"""``python -m fp8ref.peers.loaders``: certify the loader rows (docs/certified-loaders.md)."""

import sys

from . import main

sys.exit(main())
