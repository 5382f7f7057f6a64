"""The checks between settings: each fine alone, together not (``ExperimentConfig.validate`` runs
them, for every command), and a loss model no traffic can meet."""
from __future__ import annotations

from .. import traffic
from ..axes import AXES
from ..net.recovery import require


def validate_pairs(config) -> None:
    """Settings each fine alone that do not go together: checked here only, for every command."""
    fsdp, pp = config.dp_mode == "fsdp" and config.dp_size > 1, config.pp_size > 1
    for axis in AXES:   # each axis's own pairs (``Axis.pairs``), in the axes' order
        if axis.pairs is not None:
            axis.pairs(config)
    # the collective each used axis's messages are (``Axis.requires``), FSDP's reduce-scatter first
    needs = [(fsdp, "dp_mode=fsdp", "reduce_scatter")] + \
        [(axis.used(config), f"{axis.size}={getattr(config, axis.size)}", axis.requires)
         for axis in AXES if axis.requires is not None]
    for used, setting, collective in needs:
        try:
            require(config.recovery, collective, used, works=lambda name: config.accepts(recovery=name))
        except ValueError as err:
            raise ValueError(f"{setting}: {err}") from None
    if fsdp and config.dp_sync_every:
        raise ValueError("dp_sync_every with dp_mode=fsdp: FSDP's replicas share one exact master copy and never drift")
    if pp and config.dp_sync_every:
        raise ValueError(f"dp_sync_every with pp_size={config.pp_size}: synchronising pipelined replicas is not "
                         "modelled; set dp_sync_every=0")
    # (what training does not model beside experts, recomputed blocks, the estimate does:
    # lossysim.ep refuses it where training builds it)


_OWN = ("tp", "pp", "dp")   # the axes whose networks the check places itself: every stage's, every boundary's


def check_something_can_lose(config) -> None:
    """A loss model that no traffic can meet is a mistake (the run would lose 0 packets, and say
    nothing): the traffic it may hit (lossy, lossy_traffic) never crosses a lossy link."""
    spec = config.network_spec()
    if spec.loss.lossless or spec.cables is not None:   # a fabric's lossy cables: the blast radius says who crosses
        return
    mesh, settings = config.mesh(), config.network_settings()
    networks = [spec] + ([mesh.network_spec("dp_cp", 0, settings, config.dp_lossy())]
                  if mesh.size("dp_cp") > 1 else []) + \
        [mesh.network_spec("tp", mesh.rank(pp=s), settings) for s in range(1, config.pp_size)] + \
        [mesh.network_spec("pp", mesh.rank(pp=b), settings, config.pp_lossy()) for b in range(config.pp_size - 1)] + \
        [mesh.network_spec(c.axis, 0, settings, config.lossy_directions(c.name), mesh.class_of(c.axis, c.name))
         for c in traffic.CLASSES if c.axis not in _OWN and mesh.sizes.get(c.axis, 1) > 1]
    if not any(net.lossy and net.topology.has_lossy_link for net in networks):
        sizes = sorted((a for a in AXES if a.size), key=lambda a: _OWN.index(a.name) if a.name in _OWN else len(_OWN))
        raise ValueError(f"loss={config.loss} but no traffic can lose packets "
                         f"({', '.join(f'{a.size}={getattr(config, a.size)}' for a in sizes)}, lossy={config.lossy}, "
                         f"lossy_traffic={config.lossy_traffic}, "
                         f"lossy_links={config.lossy_links}, ranks_per_node={config.ranks_per_node}): "
                         "use loss=none for a loss-free run, or make some traffic cross a lossy link")
