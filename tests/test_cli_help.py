"""Every command-line option that takes one of a fixed set of values lists exactly that set in its help."""
import argparse
import importlib
import re

import pytest

from lossysim.cli import SUBCOMMANDS
from lossysim.config import ExperimentConfig, load_config
from lossysim.data import MNLI, SYNTHETIC
from lossysim.data.pydoc_text import PYDOC
from lossysim.models import NAMED_SHAPES
from lossysim.models.pretrained import PACKAGED

BOGUS = "no-such-value"
# Options that take a name from a list or anything else (a path, a hub name): their named values.
NAMED = {("train", "model"): (*NAMED_SHAPES, *PACKAGED), ("train", "dataset"): (SYNTHETIC, MNLI, PYDOC)}


def _options():
    """(subcommand, argparse action) for every option of every subcommand, built as ``lossysim`` builds them."""
    for name, (module, _) in SUBCOMMANDS.items():
        parser = argparse.ArgumentParser()
        importlib.import_module(module).add_arguments(parser)
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                yield name, action


def _listed(help_text: str) -> tuple:
    """The values after ``one of`` in a help text (``lossysim.util.one_of``), up to ``;``, ``(`` or the end."""
    found = re.findall(r"one of ([^;()]+)", help_text or "")
    assert len(found) <= 1, help_text
    return tuple(v.strip() for v in found[0].split(",")) if found else ()


def _allowed(key: str) -> tuple:
    """The values the config accepts for ``key``, as its validation says when given another; () when
    the key takes no fixed set (or is no config key)."""
    if key not in ExperimentConfig.__dataclass_fields__:
        return ()
    try:
        load_config(None, {key: BOGUS})
    except ValueError as err:
        found = re.search(rf"{key}='{BOGUS}' must be one of (.+)$", str(err))
        return tuple(found.group(1).split(", ")) if found else ()
    return ()


@pytest.mark.parametrize("command, action", list(_options()),
                         ids=lambda x: x if isinstance(x, str) else x.option_strings[-1])
def test_help_lists_exactly_the_values_an_option_takes(command, action):
    expected = NAMED.get((command, action.dest)) or _allowed(action.dest)
    if action.choices is not None:  # argparse lists them itself and refuses any other
        assert not expected or tuple(action.choices) == expected
        return
    assert _listed(action.help) == expected, f"lossysim {command} {action.option_strings[-1]}: {action.help!r}"


def test_every_fixed_set_was_found():
    """The probe above finds the sets it must (else the test would pass by checking nothing)."""
    fixed = {(command, action.dest) for command, action in _options() if _allowed(action.dest)}
    assert {("train", k) for k in ("dp_mode", "backend", "lossy", "recovery", "algorithm", "transport", "nic",
                                          "pp_schedule")} <= fixed
    assert {("estimate", k) for k in ("transport", "nic", "algorithm", "lossy_links", "recovery", "lossy")} <= fixed
