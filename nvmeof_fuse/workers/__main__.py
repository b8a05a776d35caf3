"""``python -m nvmeof_fuse.workers``: a FUSE worker process, started by the main process."""

import sys

from .worker import main

sys.exit(main())
