"""Names, defaults and goals shared by the benchmark modules."""

from __future__ import annotations

WORKLOADS = ("flat", "small")
OPS = ("save", "open", "read", "copy", "verify")
FORMATS = (
    "tdz_numba",
    "tdz_numba_nofsync",  # save only: durable=False, as safetensors and torch.save (no fsync)
    "td_tdz",
    "td_tdz_enabled",
    "td_dir",
    "td_consolidated",
    "torch",
    "safetensors",
    "floor",
)
#: Pseudo-format of the verify row: zlib-ng's single-thread crc32 over the same payload bytes.
CRC_FORMAT = "zlib_ng_crc32"

#: The compressed section (``--compression``): its workloads, ops and formats.
COMPRESSIONS = ("deflate",)
COMPRESSED_WORKLOADS = ("images_flat", "images_small", "flat", "small")
COMPRESSED_OPS = ("save", "load")
COMPRESSED_FORMATS = ("tdz_numba", "tdz_numba_1t", "td_tdz", "zlib_ng")
#: Image shape ``(C, H, W)`` of the images workloads and their number of leaves.
IMAGE_SHAPE = (3, 64, 64)
IMAGE_LEAVES = (100, 20)
#: Goals of the compressed section.
GOAL_SCALING = 0.8  # tdz_numba all threads vs 1 thread >= GOAL_SCALING x cores
GOAL_SINGLE = 1.2  # tdz_numba_1t / zlib_ng <= GOAL_SINGLE
GOAL_VS_TD = 2.0  # td_tdz save / tdz_numba save >= GOAL_VS_TD

DEFAULT_SIZE_MIB = 256.0
DEFAULT_REPEAT = 5
QUICK_SIZE_MIB = 16.0
QUICK_REPEAT = 3

COLORS = {
    "tdz_numba": "#d62728",
    "tdz_numba_nofsync": "#ff9896",
    "td_tdz": "#1f77b4",
    "td_tdz_enabled": "#e377c2",
    "td_dir": "#aec7e8",
    "td_consolidated": "#17becf",
    "torch": "#ff7f0e",
    "safetensors": "#2ca02c",
    "floor": "#7f7f7f",
    CRC_FORMAT: "#9467bd",
    "tdz_numba_1t": "#ff9896",
    "zlib_ng": "#9467bd",
}
