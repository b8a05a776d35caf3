"""NVMe/TCP: the transport (``transport.py``, registered as ``tcp``), a queue's commands and
sends (``queue.py``), its incoming PDUs (``reader.py``), caller memory and H2CData
(``data.py``), a command in flight (``request.py``) and spliced sends (``splice.py``)."""
