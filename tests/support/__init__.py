"""Helpers the tests share (one place each): ``deps`` says which optional dependency is missing."""
