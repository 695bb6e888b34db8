"""Every signature the package calls a Numba kernel with, in one place (``tdz warmup`` compiles them).

Keys are the kernels (``module.name``), values the argument types of each
signature as Numba writes them (``repr`` of :mod:`numba.core.types`), e.g.
``("Array(uint8, 1, 'C', False, aligned=True)", "int64")`` (the fourth argument of
an ``Array`` is ``readonly``: a read-only and a writable buffer are two
signatures). A kernel called with a signature not listed here is compiled on a
user's first call (the first-use notice), so ``tests/test_warmup_complete.py``
runs the package's workloads after a warm-up into an empty cache and fails on
any compilation. When a kernel or its call sites change, regenerate the table:
``python tests/test_warmup_complete.py --record`` runs those workloads in this
process and prints the table (merged with this one: remove entries of
signatures no longer used by hand).
"""

from __future__ import annotations

__all__ = ["SIGNATURES"]

SIGNATURES: dict[str, tuple[tuple[str, ...], ...]] = {
    "tdz_numba.files.page_kernels.copy_spans": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "bool",
        ),
    ),
    "tdz_numba.files.page_kernels.touch_pages": (
        ("Array(uint8, 1, 'C', False, aligned=True)", "int64"),
        ("Array(uint8, 1, 'C', True, aligned=True)", "int64"),
    ),
    "tdz_numba.formats.gguf_kernels._bf16": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
            "Array(uint32, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.gguf_kernels._f16": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.gguf_kernels._q2_k": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.gguf_kernels._q3_k": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.gguf_kernels._q4_0": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.gguf_kernels._q4_1": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.gguf_kernels._q4_k": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.gguf_kernels._q5_0": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.gguf_kernels._q5_1": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.gguf_kernels._q5_k": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.gguf_kernels._q6_k": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.gguf_kernels._q8_0": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
            "Array(float32, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.gguf_scan.gather_rows": (
        (
            "Array(uint8, 1, 'C', True, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "int64",
            "int64",
            "Array(uint64, 2, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.gguf_scan.walk_infos": (
        (
            "Array(uint8, 1, 'C', True, aligned=True)",
            "int64",
            "int64",
            "int64",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.hdf5_headers._dtype_code": (
        ("Array(uint8, 1, 'C', False, aligned=True)", "int64", "int64"),
    ),
    "tdz_numba.formats.hdf5_headers._uint": (
        ("Array(uint8, 1, 'C', False, aligned=True)", "int64", "int64"),
    ),
    "tdz_numba.formats.hdf5_headers.global_heap": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "int64",
            "int64",
            "Array(int64, 2, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.hdf5_headers.header_messages": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "int64",
            "int64",
            "int64",
            "int64",
            "Array(int64, 2, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.hdf5_headers.scan_datasets": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "int64",
            "int64",
            "int64",
            "Array(int64, 2, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.hdf5_headers.symbol_table": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "int64",
            "int64",
            "int64",
            "int64",
            "Array(int64, 2, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.onnx_scan.scan_graph": (
        (
            "Array(uint8, 1, 'C', True, aligned=True)",
            "int64",
            "int64",
            "Array(int64, 2, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(uint8, 1, 'C', False, aligned=True)",
            "int64",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.pickle_shapes.shape_ids": (
        (
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.pt_records.record_rows": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(uint8, 1, 'C', True, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.safetensors_scan.scan_entries": (
        (
            "Array(uint8, 1, 'C', True, aligned=True)",
            "Array(int64, 2, 'C', False, aligned=True)",
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.tdz.metascan.scan_meta": (
        (
            "Array(uint8, 1, 'C', True, aligned=True)",
            "Array(uint8, 1, 'C', True, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int64, 2, 'C', False, aligned=True)",
            "Array(int64, 2, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.npz_scan.group_headers": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "int64",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.formats.pickle_scan.scan_state_dict": (
        (
            "Array(uint8, 1, 'C', True, aligned=True)",
            "Array(int64, 2, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int8, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.zipfmt.kernels.central._overlap_check": (
        (
            "Array(int64, 2, 'C', False, aligned=True)",
            "int64",
            "int64",
            "int64",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.zipfmt.kernels.central._sat_add": (("int64", "int64"),),
    "tdz_numba.zipfmt.kernels.central._u16": (
        ("Array(uint8, 1, 'C', False, aligned=True)", "int64"),
        ("Array(uint8, 1, 'C', True, aligned=True)", "int64"),
        ("Bytes(uint8, 1, 'C', readonly=True)", "int64"),
    ),
    "tdz_numba.zipfmt.kernels.central._u32": (
        ("Array(uint8, 1, 'C', False, aligned=True)", "int64"),
        ("Array(uint8, 1, 'C', True, aligned=True)", "int64"),
        ("Bytes(uint8, 1, 'C', readonly=True)", "int64"),
    ),
    "tdz_numba.zipfmt.kernels.central._u64": (("Bytes(uint8, 1, 'C', readonly=True)", "int64"),),
    "tdz_numba.zipfmt.kernels.central._zip64": (
        ("Bytes(uint8, 1, 'C', readonly=True)", "int64", "int64", "int64", "int64", "int64"),
    ),
    "tdz_numba.zipfmt.kernels.central.check_entry_header": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "int64",
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int64, 2, 'C', False, aligned=True)",
            "int64",
            "int64",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
        (
            "Array(uint8, 1, 'C', True, aligned=True)",
            "int64",
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int64, 2, 'C', False, aligned=True)",
            "int64",
            "int64",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.zipfmt.kernels.central.check_local_headers": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int64, 2, 'C', False, aligned=True)",
            "int64",
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int64, 2, 'C', False, aligned=True)",
            "int64",
            "Array(uint8, 1, 'C', True, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.zipfmt.kernels.central.parse_central": (
        (
            "Bytes(uint8, 1, 'C', readonly=True)",
            "int64",
            "int64",
            "Array(int64, 2, 'C', False, aligned=True)",
            "ByteArray(uint8, 1, 'C', readonly=False)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.zipfmt.kernels.central.resolve_local": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int64, 2, 'C', False, aligned=True)",
            "int64",
            "int64",
        ),
    ),
    "tdz_numba.zipfmt.kernels.crc._chunk_plan": (("Array(int64, 1, 'C', False, aligned=True)", "int64"),),
    "tdz_numba.zipfmt.kernels.crc._crc_table": ((),),
    "tdz_numba.zipfmt.kernels.crc._fold_chunks": (
        (
            "Array(uint32, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "int64",
        ),
    ),
    "tdz_numba.zipfmt.kernels.crc._multmodp": (
        ("uint32", "uint32"),
        ("uint64", "uint32"),
        ("uint64", "uint64"),
    ),
    "tdz_numba.zipfmt.kernels.crc._span_crc": (
        ("int64", "int64", "Array(uint32, 1, 'C', False, aligned=True)"),
    ),
    "tdz_numba.zipfmt.kernels.crc.crc32_combine": (
        ("int64", "uint32", "int64"),
        ("uint32", "uint32", "int64"),
        ("uint64", "uint32", "int64"),
        ("uint64", "uint64", "int64"),
    ),
    "tdz_numba.zipfmt.kernels.crc.crc32_spans": (
        ("Array(int64, 1, 'C', False, aligned=True)", "Array(int64, 1, 'C', False, aligned=True)", "int64"),
    ),
    "tdz_numba.zipfmt.kernels.crc.crc32_zeros": (("int64",),),
    "tdz_numba.zipfmt.kernels.crc.plan_layout": (
        (
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.zipfmt.kernels.deflate.deflate_bound": (("int64",),),
    "tdz_numba.zipfmt.kernels.deflate.deflate_segments": (
        (
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(bool, 1, 'C', False, aligned=True)",
            "int64",
        ),
    ),
    "tdz_numba.zipfmt.kernels.deflate.inflate_close": (("Array(uint64, 1, 'C', False, aligned=True)",),),
    "tdz_numba.zipfmt.kernels.deflate.inflate_open": (("Array(uint64, 1, 'C', False, aligned=True)",),),
    "tdz_numba.zipfmt.kernels.deflate.inflate_segments": (
        (
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(bool, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.zipfmt.kernels.deflate.inflate_step": (
        ("Array(uint64, 1, 'C', False, aligned=True)", "int64", "int64", "int64", "int64", "int64"),
    ),
    "tdz_numba.zipfmt.kernels.verify._crc_table": ((),),
    "tdz_numba.zipfmt.kernels.verify._multmodp": (
        ("uint32", "uint32"),
        ("uint64", "uint32"),
        ("uint64", "uint64"),
    ),
    "tdz_numba.zipfmt.kernels.verify._span_crc": (
        ("int64", "int64", "Array(uint32, 1, 'C', False, aligned=True)"),
    ),
    "tdz_numba.zipfmt.kernels.verify.check_entry_header": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "int64",
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int64, 2, 'C', False, aligned=True)",
            "int64",
            "int64",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
        (
            "Array(uint8, 1, 'C', True, aligned=True)",
            "int64",
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int64, 2, 'C', False, aligned=True)",
            "int64",
            "int64",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.zipfmt.kernels.verify.crc32_combine": (
        ("int64", "uint32", "int64"),
        ("uint32", "uint32", "int64"),
        ("uint64", "uint32", "int64"),
        ("uint64", "uint64", "int64"),
    ),
    "tdz_numba.zipfmt.kernels.verify.crc_worker": (
        (
            "Array(uint8, 1, 'C', False, aligned=True)",
            "Array(int64, 2, 'C', False, aligned=True)",
            "int64",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "int64",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(uint32, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
        ),
    ),
    "tdz_numba.zipfmt.kernels.verify.fold_pieces": (
        (
            "Array(uint32, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "Array(int64, 1, 'C', False, aligned=True)",
            "int64",
        ),
    ),
    "tdz_numba.zipfmt.kernels.verify.plan_pieces": (
        ("Array(int64, 1, 'C', False, aligned=True)", "int64", "int64"),
    ),
}
