"""NVMe/RDMA: the transport and its queues (``transport.py``), and the queue its callers'
threads drive themselves (``polled.py``, which registers the transport as ``rdma``)."""
