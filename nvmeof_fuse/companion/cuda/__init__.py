"""CUDA memory for the companion: the driver calls, contexts and streams, dma-bufs."""
