"""``python -m nvmeof_fuse.cli``: what the ``--daemon`` parent starts."""

import sys

from nvmeof_fuse.cli.entry import main

sys.exit(main())
