"""The host side: controller, namespaces, memory, statistics (like ``drivers/nvme/host``)."""
