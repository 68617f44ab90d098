"""Transport options as data (``kvxfer.transport.options``): each transport's frozen options
dataclass refuses an unknown key, a value of the wrong type (a bool is no int) and a value out of
range, with a ``ConfigError`` that names the transport and the option."""
from __future__ import annotations

import importlib.util

import pytest

from kvxfer.errors import ConfigError
from transports.zmq import ZMQOptions

CLASSES = [("zmq", ZMQOptions)]
if importlib.util.find_spec("ucxx") is not None:
    from transports.ucx import UCXOptions
    CLASSES.append(("ucx", UCXOptions))


@pytest.mark.parametrize("name,cls", CLASSES)
def test_unknown_option_is_named_with_the_known_ones(name, cls):
    with pytest.raises(ConfigError, match=rf"unknown {name} option\(s\) \['heartbeet'\]; known: .*"):
        cls.of({"heartbeet": 1.0})


@pytest.mark.parametrize("name,cls", CLASSES)
def test_wrong_type_and_out_of_range_are_named(name, cls):
    key = "connect_timeout"
    with pytest.raises(ConfigError, match=rf"{name} option {key}=True: give .*not bool"):
        cls.of({key: True})
    with pytest.raises(ConfigError, match=rf"{name} option {key}=-1.0: must be"):
        cls.of({key: -1.0})
    assert getattr(cls.of({key: 2.5}), key) == 2.5
