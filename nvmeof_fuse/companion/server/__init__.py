"""The companion server: the side of the companion socket that runs in the mount daemon."""
