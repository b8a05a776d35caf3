"""Where devices sit on the PCIe tree: distances in NCCL's words between two PCI devices,
or a device and a NUMA node (``pcie.py``, pure), read from sysfs under a root tests replace
(``sysfs.py``)."""
