"""Types of the compiled helper ``keychain.c`` (see its top comment)."""
import numpy as np

def chain(prev: bytes, tokens: np.ndarray, page_size: int, /) -> list[bytes]: ...
