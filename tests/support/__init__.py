"""Helpers the tests share (one place each): ``deps`` says which optional dependency is missing
(and which transport pregrants by default), ``ports`` finds free ports, ``channels`` is a
control-channel owner of the test's own, ``fixtures`` holds the fixtures several files use
(registered by ``conftest.py``)."""
