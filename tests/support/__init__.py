"""Helpers the tests share (one place each): ``deps`` says which optional dependency is missing,
``ports`` finds free ports, ``channels`` is a control-channel owner of the test's own."""
