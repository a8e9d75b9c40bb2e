"""dflash-ds: distributed online trainer for DFlash speculative-decoding drafters."""

__version__ = "0.1.0"
