"""Transports: one module per fabric (``rdma``, ``tcp``)."""
