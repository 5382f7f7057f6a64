"""The lossy network between ranks: topology, algorithms, links, transports, delivery, statistics."""
from .network import LossyNetwork

__all__ = ["LossyNetwork"]
