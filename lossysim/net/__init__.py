"""The lossy network between ranks: topology, algorithms, links, transports, delivery, statistics.

``spec`` holds its settings, checked once; ``network`` is the one object a model talks to.
"""
from .network import LossyNetwork
from .spec import NetworkSpec

__all__ = ["LossyNetwork", "NetworkSpec"]
