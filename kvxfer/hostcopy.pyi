"""Types of the compiled helper ``hostcopy.c`` (see its top comment)."""
import numpy as np

def copy_runs(src_addr: np.ndarray, src_size: np.ndarray, dst_addr: np.ndarray, dst_size: np.ndarray,
              src_region: np.ndarray, src_offset: np.ndarray, dst_region: np.ndarray, dst_offset: np.ndarray,
              nbytes: np.ndarray, release_gil_from: int, stream_from: int = -1) -> None: ...
def copy_staged(block_addr: int, block_size: int, addr: np.ndarray, size: np.ndarray, region: np.ndarray,
                offset: np.ndarray, nbytes: np.ndarray, gather: bool, release_gil_from: int,
                stream_from: int = -1) -> None: ...
def copy_group(src_addr: np.ndarray, src_size: np.ndarray, dst_addr: np.ndarray, dst_size: np.ndarray,
               src_region: np.ndarray, src_base: np.ndarray, dst_region: np.ndarray, dst_base: np.ndarray,
               row_src: np.ndarray, row_dst: np.ndarray, row_len: np.ndarray, heads: int, src_head_stride: int,
               dst_head_stride: int, release_gil_from: int, stream_from: int = -1) -> None: ...
