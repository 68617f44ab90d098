"""kvxfer as an SGLang transfer backend (being built; see issue 37)."""


def register() -> None:
    """SGLang's plugin entry point (``sglang.srt.plugins``); inert until the backend is built."""
