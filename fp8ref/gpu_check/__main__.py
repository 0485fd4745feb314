"""``python -m fp8ref.gpu_check``: see the package docstring."""

import sys

from .cli import main

sys.exit(main())
