"""The companion client: the library that runs in a user's process (``nvmeof_fuse.File``)."""
