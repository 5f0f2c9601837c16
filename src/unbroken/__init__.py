"""unbroken: PyTorch training runs and sweeps that survive crashes and resume exactly."""

__version__ = "0.1.0"
