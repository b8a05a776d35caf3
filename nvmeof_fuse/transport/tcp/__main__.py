"""``python -m nvmeof_fuse.transport.tcp HOST PORT``: probe a port, print its ICResp."""

from .transport import main

raise SystemExit(main())
