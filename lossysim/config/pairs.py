"""The checks between settings: each fine alone, together not (``ExperimentConfig.validate`` runs
them, for every command), and a loss model no traffic can meet."""
from __future__ import annotations

from ..net.recovery import require
from .choices import CP_MODES, EP_CLASSES, check_choice


def validate_pairs(config) -> None:
    """Settings each fine alone that do not go together: checked here only, for every command."""
    fsdp, pp, ep = config.dp_mode == "fsdp" and config.dp_size > 1, config.pp_size > 1, config.ep_size > 1
    if ep and config.cp_size > 1 and config.ep_size % config.cp_size:
        raise ValueError(f"ep_size={config.ep_size} with cp_size={config.cp_size}: experts beside context "
                         "parallelism need ep_size a multiple of cp_size (a replica's context ranks, members of "
                         "one ep group)")
    validate_context(config, fsdp)
    for used, setting, collective in ((fsdp, "dp_mode=fsdp", "reduce_scatter"),
                                      (pp, f"pp_size={config.pp_size}", "send"),
                                      (ep, f"ep_size={config.ep_size}", "all_to_all"),
                                      (config.cp_size > 1, f"cp_size={config.cp_size}", "kv_exchange")):
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


def validate_context(config, fsdp: bool) -> None:
    """Context parallelism's settings and their pairs (``lossysim.cp``)."""
    check_choice("cp_mode", config.cp_mode, CP_MODES)
    cp = config.cp_size
    if config.recovery == "mask" and cp == 1:
        raise ValueError("recovery=mask leaves lost keys out of attention: it needs cp_size > 1 (on other "
                         "traffic it is zero); use recovery=zero")
    if cp == 1:
        return
    if config.max_length % (2 * cp):
        raise ValueError(f"max_length={config.max_length} is not a multiple of 2 x cp_size = {2 * cp}: context "
                         "parallelism cuts every sequence into 2 x cp_size equal chunks")
    if fsdp:
        raise ValueError(f"cp_size={cp} with dp_mode=fsdp: FSDP's gathers beside context parallelism are not "
                         "modelled; use dp_mode=ddp")
    if config.activation_checkpointing:
        raise ValueError(f"cp_size={cp} with activation_checkpointing: a recomputed block's key/value "
                         "exchange is not modelled; set activation_checkpointing=false")


def check_something_can_lose(config) -> None:
    """A loss model that no traffic can meet is a mistake (the run would lose 0 packets, and say
    nothing): the traffic it may hit (lossy, lossy_traffic) never crosses a lossy link."""
    spec = config.network_spec()
    if spec.loss.lossless or spec.cables is not None:   # a fabric's lossy cables: the blast radius says who crosses
        return
    mesh, settings = config.mesh(), config.network_settings()
    networks = [spec] + ([mesh.network_spec("dp_cp", 0, settings, config.dp_lossy())] if config.dp_size > 1 else []) + \
        [mesh.network_spec("tp", mesh.rank(pp=s), settings) for s in range(1, config.pp_size)] + \
        [mesh.network_spec("pp", mesh.rank(pp=b), settings, config.pp_lossy()) for b in range(config.pp_size - 1)] + \
        [mesh.network_spec("ep", 0, settings, config.lossy_directions(c), c) for c in EP_CLASSES
         if config.ep_size > 1] + \
        ([mesh.network_spec("cp", 0, settings, config.lossy_directions("cp"))] if config.cp_size > 1 else [])
    if not any(net.lossy and net.topology.has_lossy_link for net in networks):
        raise ValueError(f"loss={config.loss} but no traffic can lose packets (tp_size={config.tp_size}, "
                         f"pp_size={config.pp_size}, dp_size={config.dp_size}, ep_size={config.ep_size}, "
                         f"cp_size={config.cp_size}, lossy={config.lossy}, "
                         f"lossy_traffic={config.lossy_traffic}, "
                         f"lossy_links={config.lossy_links}, ranks_per_node={config.ranks_per_node}): "
                         "use loss=none for a loss-free run, or make some traffic cross a lossy link")
