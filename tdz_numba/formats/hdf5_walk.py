"""The walk of an HDF5 file's group tree, from its own bytes; h5py only for what it must read.

:class:`Walk` lists every group's links itself (:mod:`~tdz_numba.formats.hdf5_objects`),
reads the object headers of a group's children in one kernel call
(:func:`~tdz_numba.formats.hdf5_headers.scan_datasets`) and makes a
:class:`~tdz_numba.tdz.sources.TensorSpec` for each plain contiguous dataset
without h5py, and reads attributes itself (:mod:`~tdz_numba.formats.hdf5_attrs`:
a plain dataset with attributes is still mapped without h5py). The rest is
decided from the headers before libhdf5 opens anything: a virtual dataset or
one with external storage is refused (unless ``allow_external=True``), external
links are left out; only then are the other datasets (chunked, strings...) and
the attributes of types not decoded here read through h5py, each
object reached hop by hop with every link's address checked against the one
this walk read (so a damaged name index cannot send libhdf5 to an object this
walk did not check).
"""

from __future__ import annotations

import os
from functools import cache, partial
from itertools import repeat
from typing import Any

import numpy as np

from ..errors import BadArchiveError, TdzError
from ..files.confine import MAX_SYMLINKS
from ..files.scanadvice import header_scan, mean_spacing
from ..tdz.sources import MAX_DEPTH, MappedFile, TensorSpec
from ..tdz.specbulk import SpecColumns
from .hdf5_attrs import read_attributes
from .hdf5_h5py import BufferReader, Ctx, Group, attrs_of, described, follow, refused, walk_h5py
from .hdf5_headers import COLS, DTYPES, FAST, FAST_ATTRS, scan_datasets
from .hdf5_objects import (
    DATASPACE,
    DTYPE,
    EXTERNAL,
    LAYOUT,
    LINFO,
    LINK,
    SYMTAB,
    Header,
    Layout,
    Links,
    dtype_of,
)
from .hdf5_vlen import VlenCheck

__all__ = ["Walk", "MAX_OBJECTS", "is_group", "probe_in_child", "PROBE_TIMEOUT"]

#: Most links followed in one file.
MAX_OBJECTS = 1_000_000

#: Seconds a child process may take to open a virtual dataset (``allow_external=True``) before
#: the reader gives up on it.
PROBE_TIMEOUT = 20.0

_PROBE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
import h5py
f = h5py.File(sys.argv[1], "r")
obj = f
for name in sys.argv[2:]:
    obj = h5py.h5o.open(obj.id, name.encode("utf-8", "surrogateescape"))
    obj = h5py.Dataset(obj) if isinstance(obj, h5py.h5d.DatasetID) else h5py.Group(obj)
obj.id.get_create_plist().get_layout()
print("PROBE OK")
"""


def probe_in_child(path: str, chain: tuple[tuple[str, int], ...], where: str) -> None:
    """Opens the dataset at ``chain`` with h5py in a child process (timeout :data:`PROBE_TIMEOUT`,
    4 GiB of address space): a damaged virtual dataset that sends libhdf5 into a loop or a crash
    is refused here instead of hanging or killing this process."""
    import subprocess
    import sys

    cmd = [sys.executable, "-c", _PROBE, os.fspath(path), *(n for n, _a in chain)]
    name = "/" + "/".join(n for n, _a in chain)
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=PROBE_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BadArchiveError(
            f"{where}: virtual dataset {name[:80]!r}: libhdf5 did not finish opening it in {PROBE_TIMEOUT:g} s"
        ) from None
    if b"PROBE OK" not in proc.stdout:
        tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise BadArchiveError(
            f"{where}: virtual dataset {name[:80]!r}: libhdf5 cannot open it: {tail[0][:200]}"
        )


_SKIP = object()
#: TensorSpec's fields after ``type_name`` at their defaults (codec, size, crc, loader).
_TAIL = tuple(TensorSpec._field_defaults[k] for k in TensorSpec._fields[8:])
_NAMES_ARR = np.array(DTYPES, dtype=object)
_SPEC = partial(tuple.__new__, TensorSpec)

#: A hop of an object's path from the root: (link name, absolute address).
Chain = tuple[tuple[str, int], ...]


def _torch_dtypes() -> list[Any]:
    from ..tdz.dtypes import from_numpy_dtype

    return [None] + [from_numpy_dtype(np.dtype(s)) for s in DTYPES[1:]]


@cache
def _torch_table() -> np.ndarray:
    """:func:`_torch_dtypes` as a read-only object array (made once a process, not per walk: 11
    dtype conversions, ~15 us of a one-dataset open)."""
    arr = np.array(_torch_dtypes() + [None], dtype=object)[:-1]
    arr.flags.writeable = False
    return arr


#: Most links of a group whose datasets :meth:`Walk._children` reads row by row in Python (its
#: numpy calls, ~20 of them whatever the count, cost more below it).
SMALL = 16


def is_group(h: Header) -> bool:
    return h.has(SYMTAB) or h.has(LINFO) or (h.has(LINK) and not h.has(LAYOUT))


class Walk:
    """One file's walk: ``run()`` returns the root :class:`Group` (levels, specs, values)."""

    def __init__(
        self, lay: Layout, f: MappedFile, ctx: Ctx, path: str, scan: header_scan | None = None
    ) -> None:
        self.lay = lay
        self.f = f
        #: The open's :class:`~tdz_numba.files.scanadvice.header_scan` of ``f``: each group's
        #: object headers read page by page where they lie far apart.
        self.scan = lay.scan = scan
        self.ctx = ctx
        self.path = path
        self.where = ctx.where
        self.attrs: dict[str, dict[str, Any]] = {}
        #: Attributes left out, by tree path: name -> why.
        self.skipped: dict[str, dict[str, str]] = {}
        self._heaps: dict[int, Any] = {}
        self.h5: Any = None
        self._links: dict[int, Links] = {}
        self._index: dict[int, dict[str, int]] = {}
        self._headers: dict[int, Header] = {}
        self._torch_arr = _torch_table()

    # -- h5py, reached hop by hop ----------------------------------------------------------------
    def _file(self) -> Any:
        if self.h5 is None:
            import h5py  # type: ignore[import-untyped]

            try:
                if self.f.remote:  # a URL: libhdf5 reads the fetched bytes through a file object
                    self.h5 = h5py.File(BufferReader(self.f.buffer), "r")
                else:
                    self.h5 = h5py.File(self.path, "r")
            except Exception as e:  # noqa: BLE001 - OSError for most, others on odd files
                raise BadArchiveError(f"{self.where}: not a readable HDF5 file: {e}") from None
            self.ctx.h5 = self.h5
        return self.h5

    def open_h5(self, chain: Chain) -> Any:
        """The h5py object at the end of ``chain``, each link's address checked before the object opens."""
        import h5py  # type: ignore[import-untyped]

        cur = self._file()
        for name, addr in chain:
            raw = name.encode("utf-8", "surrogateescape")
            try:
                info = cur.id.links.get_info(raw)
                ok = info.type == h5py.h5l.TYPE_HARD and info.u + self.lay.base == addr
                nxt = h5py.h5o.open(cur.id, raw) if ok else None
            except Exception as e:  # noqa: BLE001
                raise BadArchiveError(f"{self.where}: h5py cannot open {name!r}: {e}") from None
            if nxt is None:
                raise BadArchiveError(
                    f"{self.where}: link {name[:60]!r}: libhdf5 finds another object than the group's links name"
                )
            if isinstance(nxt, h5py.h5g.GroupID):
                cur = h5py.Group(nxt)
            elif isinstance(nxt, h5py.h5d.DatasetID) and (name, addr) == chain[-1]:
                cur = h5py.Dataset(nxt)
            else:
                raise BadArchiveError(
                    f"{self.where}: {name[:60]!r}: libhdf5 reads another kind of object than its header says"
                )
        return cur

    def _attrs(self, h: Header, chain: Chain, tree_path: str, h5py_ok: bool = True) -> dict[str, Any]:
        """The attributes of a checked object, read by :mod:`~tdz_numba.formats.hdf5_attrs`; h5py
        reads only those of a type not decoded there (and dense storage), ``h5py_ok`` allowing."""
        got = read_attributes(self.lay, h, "/" + tree_path, self._heaps)
        skipped = dict(got.skipped)
        own = got.values
        if got.dense or got.h5py:
            if not h5py_ok:
                why = "read through h5py, which does not open this object"
                skipped.update(dict.fromkeys(got.h5py or ["(dense attribute storage)"], why))
            elif got.dense:
                own = attrs_of(self.open_h5(chain), self.where)
            else:
                extra = attrs_of(self.open_h5(chain), self.where, got.h5py)
                own = {
                    n: got.values[n] if n in got.values else extra[n]
                    for n in got.order
                    if n in got.values or n in extra
                }
        if skipped:
            self.skipped[tree_path] = skipped
        if own:
            self.attrs[tree_path] = own
        return own

    # -- links -----------------------------------------------------------------------------------
    def header(self, addr: int) -> Header:
        h = self._headers.get(addr)
        if h is None:
            h = self._headers[addr] = self.lay.header(addr)
        return h

    def links(self, addr: int, chain: Chain) -> Links:
        """The links of the group at ``addr`` in h5py's order."""
        got = self._links.get(addr)
        if got is not None:
            return got
        path = "/" + "/".join(n for n, _a in chain)
        listed = self.lay.links(addr, path, self.header(addr))
        if listed is None:  # dense storage: h5py reads the link index, opens no object
            listed = Links.of(self._dense(chain, path))
        self._links[addr] = listed
        return listed

    def link(self, addr: int, chain: Chain, name: str) -> tuple[str, Any]:
        """``(kind, value)`` of the link ``name`` of the group at ``addr`` (``("none", None)``)."""
        links = self.links(addr, chain)
        if name in links.other:
            return links.other[name]
        index = self._index.get(addr)
        if index is None:
            index = self._index[addr] = dict(zip(links.names, links.addrs))
        target = index.get(name)
        return ("none", None) if target is None else ("hard", target)

    def _dense(self, chain: Chain, path: str) -> list[tuple[str, str, Any]]:
        import h5py  # type: ignore[import-untyped]

        group = self.open_h5(chain)
        out: list[tuple[str, str, Any]] = []
        try:
            for name in group.keys():
                if len(out) >= MAX_OBJECTS:
                    raise BadArchiveError(f"{self.where}: group {path!r}: more than {MAX_OBJECTS} links")
                raw = name.encode("utf-8", "surrogateescape")
                info = group.id.links.get_info(raw)
                if info.type == h5py.h5l.TYPE_HARD:
                    target = info.u + self.lay.base
                    if not 0 <= target < self.lay.size:
                        raise BadArchiveError(f"{self.where}: link {name[:60]!r}: address outside the file")
                    out.append((name, "hard", target))
                elif info.type == h5py.h5l.TYPE_SOFT:
                    out.append((name, "soft", group.id.links.get_val(raw).decode("utf-8", "surrogateescape")))
                elif info.type == h5py.h5l.TYPE_EXTERNAL:
                    out.append((name, "external", None))
        except BadArchiveError:
            raise
        except Exception as e:  # noqa: BLE001
            raise BadArchiveError(f"{self.where}: cannot list group {path!r}: {e}") from None
        return out

    def resolve(self, target: str, chain: Chain) -> tuple[str, Chain] | None:
        """Where a soft link's ``target`` (from the group at the end of ``chain``) leads:
        ``("hard", chain)``, ``("external", chain so far)``, or None (dangling)."""
        todo = [c for c in target.split("/") if c not in ("", ".")]
        todo.reverse()
        cur: Chain = () if target.startswith("/") else chain
        hops = 0
        while todo:
            name = todo.pop()
            addr = cur[-1][1] if cur else self.lay.root
            if not is_group(self.header(addr)):
                return None
            kind, value = self.link(addr, cur, name)
            if kind == "hard":
                cur = (*cur, (name, value))
            elif kind == "soft":
                hops += 1
                if hops > MAX_SYMLINKS:
                    raise BadArchiveError(
                        f"{self.where}: soft link {target[:60]!r}: more than {MAX_SYMLINKS} hops"
                    )
                if value.startswith("/"):
                    cur = ()
                todo.extend(reversed([c for c in value.split("/") if c not in ("", ".")]))
            elif kind == "external":
                return "external", cur
            else:
                return None
        return "hard", cur

    # -- the walk --------------------------------------------------------------------------------
    def run(self) -> tuple[Group, dict[str, Any]]:
        lay = self.lay
        rh = self.header(lay.root)
        if not is_group(rh):
            raise BadArchiveError(f"{self.where}: the root object is not a group")
        root = Group()
        root.meta = self._attrs(rh, (), "")
        visited = {lay.root}
        stack: list[tuple[Chain, Group, str]] = [((), root, "")]
        count = 0
        while stack:
            chain, node, prefix = stack.pop()
            if len(chain) > MAX_DEPTH:
                raise BadArchiveError(f"{self.where}: groups nested deeper than {MAX_DEPTH}")
            links = self.links(chain[-1][1] if chain else lay.root, chain)
            count += len(links.names)
            if count > MAX_OBJECTS:
                raise BadArchiveError(f"{self.where}: more than {MAX_OBJECTS} objects")
            plain = not links.other and len(links.names) > SMALL  # then _children places the names
            if not plain:
                node.update(dict.fromkeys(links.names, _SKIP))  # each name's place, in h5py's order
            names, addrs, resolved = links.names, links.addrs, {}
            if links.other:
                names = [n for n in links.names if n not in links.other]
                addrs = [a for n, a in zip(links.names, links.addrs) if n not in links.other]
            for name, (kind, value) in links.other.items():
                if kind == "soft":
                    got = self.resolve(value, chain)
                    if got is None:
                        continue  # dangling
                    if got[0] == "hard":
                        if got[1]:
                            resolved[name] = got[1]
                            names.append(name)
                            addrs.append(got[1][-1][1])
                        continue
                if kind in ("soft", "external") and self.ctx.allow_external:
                    self._external(chain, name, node, prefix)
                # otherwise another file (not followed) or a user-defined link: left out
            arr = links.array if names is links.names else None  # (every link hard: the kernel's column)
            if names and self._children(names, addrs, chain, resolved, node, prefix, visited, stack, arr):
                plain = False
            if not plain:
                for k in [k for k, v in node.items() if v is _SKIP]:
                    del node[k]
        return root, root.meta

    def _children(
        self,
        names: list,
        addrs: list,
        parent: Chain,
        resolved: dict,
        node: Group,
        prefix: str,
        visited: set,
        stack: list,
        array: np.ndarray | None = None,
    ) -> bool:
        """The nodes of the links ``names`` (at ``addrs``) of the group ``node``: datasets the
        kernel maps as specs made in one pass, the others one by one (:meth:`_others`). An empty
        ``node`` gets each name's place first (``_SKIP``, True returned) unless every link is such
        a dataset; then ``node.columns`` holds the specs' columns (the bulk view path's checks).
        ``array``: ``addrs`` as int64 when the caller has them so."""
        lay = self.lay
        arr = (np.array(addrs, np.int64) if array is None else array) - lay.base
        if self.scan is not None:
            self.scan.decide(mean_spacing(arr, self.f.size))
        out = np.empty((len(names), COLS), np.int64)
        scan_datasets(lay.buf, arr, lay.base, lay.osz, lay.lsz, out)
        if len(names) <= SMALL:  # row by row: the same specs, in the same order
            self._rows(names, addrs, out, parent, resolved, node, prefix, visited, stack)
            return False
        status = out[:, 0]
        mapped = (status == FAST) | (status == FAST_ATTRS)
        fast = np.flatnonzero(mapped)
        placed = not node and fast.size < len(names)
        if placed:
            node.update(dict.fromkeys(names, _SKIP))  # each name's place, in h5py's order
        if fast.size:
            rows = out if fast.size == len(names) else out[fast]
            ranks = rows[:, 2]
            shapes: list[Any]
            if (ranks == ranks[0]).all():
                block = rows[:, 5 : 5 + int(ranks[0])]
                if (block == block[0]).all():  # one shape: one tuple for every spec
                    shapes = [tuple(block[0].tolist())] * len(rows)
                else:
                    shapes = list(map(tuple, block.tolist()))
            else:
                shapes = [None] * len(rows)
                for r in np.unique(ranks).tolist():
                    sel = np.flatnonzero(ranks == r)
                    for i, dims in zip(sel.tolist(), rows[sel, 5 : 5 + r].tolist()):
                        shapes[i] = tuple(dims)
            codes = rows[:, 1]
            every = fast.size == len(names)
            keys = names if every else [names[i] for i in fast.tolist()]
            dtypes, offsets, nbytes = (
                self._torch_arr[codes].tolist(),
                rows[:, 3].tolist(),
                rows[:, 4].tolist(),
            )
            specs = list(
                map(
                    tuple.__new__,  # TensorSpec(key, dtype, shape, None, 0, offset, nbytes, type name) in C
                    repeat(TensorSpec, len(keys)),
                    zip(
                        keys,
                        dtypes,
                        shapes,
                        repeat(None),
                        repeat(0),
                        offsets,
                        nbytes,
                        _NAMES_ARR[codes].tolist(),
                        *map(repeat, _TAIL),
                    ),
                )
            )
            fresh = every and not node
            node.update(zip(keys, specs))
            if fresh and len(node) == len(specs):  # the node's values are these specs, in order
                node.columns = SpecColumns(specs, dtypes, shapes, 0, offsets, nbytes)
        attrs = np.flatnonzero(status == FAST_ATTRS).tolist()
        self._others(
            names,
            addrs,
            attrs,
            np.flatnonzero(~mapped).tolist(),
            parent,
            resolved,
            node,
            prefix,
            visited,
            stack,
        )
        return placed

    def _rows(
        self,
        names: list,
        addrs: list,
        out: np.ndarray,
        parent: Chain,
        resolved: dict,
        node: Group,
        prefix: str,
        visited: set,
        stack: list,
    ) -> None:
        """:meth:`_children` of a few links, from the kernel's rows as Python lists."""
        rows = out.tolist()
        torch_of = self._torch_arr
        attrs, others = [], []
        for i, row in enumerate(rows):
            if row[0] != FAST and row[0] != FAST_ATTRS:
                others.append(i)
                continue
            code = row[1]
            shape = tuple(row[5 : 5 + row[2]])
            node[names[i]] = _SPEC(
                (names[i], torch_of[code], shape, None, 0, row[3], row[4], DTYPES[code], *_TAIL)
            )
            if row[0] == FAST_ATTRS:
                attrs.append(i)
        self._others(names, addrs, attrs, others, parent, resolved, node, prefix, visited, stack)

    def _others(
        self,
        names: list,
        addrs: list,
        attrs: list,
        others: list,
        parent: Chain,
        resolved: dict,
        node: Group,
        prefix: str,
        visited: set,
        stack: list,
    ) -> None:
        """The links ``_children`` did not map from the kernel's rows alone: the attributes of
        ``attrs`` (mapped datasets with compact attributes), then groups and other datasets."""
        for i in attrs:  # mapped, with compact attributes
            name, addr = names[i], addrs[i]
            self._attrs(self.header(addr), resolved.get(name) or (*parent, (name, addr)), prefix + name)
        for i in others:
            name, addr = names[i], addrs[i]
            chain = resolved.get(name) or (*parent, (name, addr))
            h = self.header(addr)  # a damaged header raises here
            if is_group(h):
                if addr in visited:
                    continue  # a link back to a group already walked
                visited.add(addr)
                sub = Group()
                sub.meta = self._attrs(h, chain, prefix + name)
                node[name] = sub
                stack.append((chain, sub, f"{prefix}{name}/"))
            elif h.has(LAYOUT):
                node[name] = self._dataset(h, name, chain, prefix + name)
            # committed datatypes are not data: left out

    def _dataset(self, h: Header, key: str, chain: Chain, tree_path: str) -> Any:
        lay = self.lay
        classes = [lay.layout(p, s)[1] for _f, p, s in h.find(LAYOUT)]
        virtual, external = 3 in classes, h.has(EXTERNAL)
        if (virtual or external) and not self.ctx.allow_external:
            self._attrs(h, chain, tree_path, h5py_ok=False)  # libhdf5 never opens it
            why = "a virtual dataset" if virtual else "external raw storage"
            reason = (
                f"{why} (its data live in other files): open with allow_external=True to read files "
                f"inside {str(self.ctx.folder)!r}"
            )
            return self._refusal(h, key, chain, reason)
        # variable-length data: every global heap collection its references name is walked here
        # before libhdf5 reads one (it loops on some damaged ones); the fill value is checked now
        vlen = VlenCheck(lay, h, "/" + tree_path, self._heaps)
        if vlen.has_vlen and (virtual or vlen.limit):
            self._attrs(h, chain, tree_path, h5py_ok=False)
            why = "its global heap is in other files" if virtual else vlen.limit
            return self._refusal(h, key, chain, f"variable-length data not checked ({why})")
        if virtual:  # allowed: libhdf5 loops forever on some damaged ones, so it opens it in a child first
            probe_in_child(self.path, chain, self.where)
        checked = vlen.contiguous() if vlen.has_vlen else 0
        self._attrs(h, chain, tree_path)
        obj = self.open_h5(chain)
        if checked is None:  # chunked: libhdf5's chunk index says where the chunks are
            vlen.chunked(obj)
            if vlen.limit:
                return self._refusal(h, key, chain, f"variable-length data not checked ({vlen.limit})")
        return described(self.ctx, obj, key, self.f, tree_path, None, foreign=False)

    def _refusal(self, h: Header, key: str, chain: Chain, reason: str) -> Any:
        """A leaf that refuses when read (:class:`~tdz_numba.UnsupportedError` saying ``reason``),
        of the dataset's shape and, when numeric, dtype; None for a null dataspace."""
        lay = self.lay
        space = h.find(DATASPACE)
        shape = lay.dataspace(space[0][1], space[0][2]) if space else ()
        if shape is None:  # a null dataspace: no data
            return None
        dts = h.find(DTYPE)
        dtype = dtype_of(lay, dts[0][1], dts[0][2]) if dts and not dts[0][0] & 2 else None
        import torch

        from ..tdz.dtypes import from_numpy_dtype

        tdtype = from_numpy_dtype(dtype.newbyteorder("=")) if dtype is not None else torch.uint8
        name = "/" + "/".join(n for n, _a in chain)
        return TensorSpec(
            key,
            tdtype,
            shape,
            None,
            0,
            0,
            0,
            dtype.str if dtype is not None else "",
            loader=refused(name, reason),
        )

    def _external(self, chain: Chain, name: str, node: Group, prefix: str) -> None:
        """An external link, or a soft link through one, with ``allow_external=True``: h5py follows it
        once its file passed the inside-the-folder rule."""
        import h5py  # type: ignore[import-untyped]

        group = self.open_h5(chain)
        try:
            link = group.get(name, getlink=True)
            if not follow(self.ctx, group, name, link):
                return
            obj = group.get(name)
        except TdzError:
            raise
        except Exception as e:  # noqa: BLE001
            raise BadArchiveError(f"{self.where}: cannot open {group.name}/{name}: {e}") from None
        if isinstance(obj, h5py.Group):
            sub = Group()
            sub.meta = attrs_of(obj, self.where)
            if sub.meta:
                self.attrs[prefix + name] = sub.meta
            node[name] = sub
            walk_h5py(self.ctx, obj, sub, len(chain) + 1, f"{prefix}{name}/", self.attrs, self.f)
        elif isinstance(obj, h5py.Dataset):
            node[name] = described(self.ctx, obj, name, self.f, prefix + name, self.attrs, foreign=True)
