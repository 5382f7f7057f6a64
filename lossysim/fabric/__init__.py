"""The fabric under the nodes: NICs, switches and cables (``graph``), presets and files (``presets``),
the routes flows take (``routes``) and which cables lose packets (``cables``)."""
from .cables import CORROPT_BANDS, cable_losses
from .graph import Cable, Fabric
from .presets import SUPERPOD_SU, leaf_spine, load_fabric, parse_fabric, superpod
from .routes import Route, Routes

__all__ = ["CORROPT_BANDS", "Cable", "Fabric", "Route", "Routes", "SUPERPOD_SU", "cable_losses", "leaf_spine",
           "load_fabric", "parse_fabric", "superpod"]
