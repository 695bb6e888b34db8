"""What an :class:`~tdz_numba.Archive` looks like: ``repr`` tree lines and the Jupyter HTML tree.

Nothing here inflates a payload: the text repr reads only level descriptions
(meta.json) and the index (plus the small size table of a nested leaf, for its
shape); the HTML repr also previews the first and last values of mapped
(stored) leaves, a page or two of each. Non-tensor data shows its value (truncated),
a tensorclass shows its fields (its ``_tensordict`` level is seen through),
and a nested leaf shows its component shapes (``float32[2, 2..5] nested``).

Examples
--------
>>> import tempfile, pathlib, torch, tdz_numba
>>> with tempfile.TemporaryDirectory() as d:
...     p = tdz_numba.save({"x": torch.zeros(2, 3), "tag": "run"}, pathlib.Path(d) / "x.tdz")
...     with tdz_numba.open(p) as ar:
...         print("\\n".join(repr(ar).splitlines()[1:]))
  x: float32[2, 3]
  tag: 'run'
"""

from __future__ import annotations

import html
from typing import Any

from ..files.progress import human_bytes
from ..tdz.tree import NON_TENSOR_DATA_TYPE, NON_TENSOR_STACK_TYPE

__all__ = [
    "children_of",
    "archive_repr",
    "archive_html",
    "tree_lines",
    "value_text",
    "level_value",
    "shape_text",
    "dtype_text",
    "value_preview",
    "level_nbytes",
    "MAX_VALUE_CHARS",
]

#: Longest value text shown for a non-tensor value (longer ones end in "...").
MAX_VALUE_CHARS = 80
_INNER = "_tensordict"


def value_text(value: Any, limit: int = MAX_VALUE_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters (``...`` marks the cut)."""
    try:
        text = repr(value)
    except Exception:  # a repr never raises
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def level_value(node: Any) -> tuple[bool, Any]:
    """``(True, value)`` when a level is non-tensor data whose value should be shown
    in place of the level (NonTensorData of any value, NonTensorStack of a JSON list)."""
    plain, value = node._plain_value()
    if plain:
        return True, value
    meta = node._level()[2]
    typ = meta.get("_type")
    if typ == NON_TENSOR_DATA_TYPE and isinstance(meta.get("data"), dict):
        return True, meta["data"]
    if typ == NON_TENSOR_STACK_TYPE and isinstance(meta.get("data"), list):
        return True, meta["data"]
    return False, None


def dtype_text(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def shape_text(node: Any, leaf: Any) -> str:
    """``[2, 3]``, or for a nested leaf its components' shape: ``[2, 2..5]``."""
    shapes = None
    if getattr(leaf, "nested", False):
        get = getattr(node._state.source, "nested_shapes", None)
        try:
            shapes = get(leaf) if get is not None else None
        except Exception:
            shapes = None
        if shapes is None:
            return "[?] nested"
        return nested_shape_text(shapes)
    return str(list(leaf.shape))


def nested_shape_text(shapes: list[list[int]]) -> str:
    """``[n, d0, d1..]`` of a nested tensor's components; a ragged dim shows ``lo..hi``."""
    if not shapes:
        return "[0]"
    dims = []
    for col in zip(*shapes):
        lo, hi = min(col), max(col)
        dims.append(str(lo) if lo == hi else f"{lo}..{hi}")
    return "[" + ", ".join([str(len(shapes)), *dims]) + "]"


def children_of(node: Any) -> list[tuple[str, Any, Any]]:
    """``(key, spec, owner)`` of a level's children; a tensorclass's fields come from
    its ``_tensordict`` level (the owner), its other children stay."""
    keyed, children, _ = node._level()
    inner = node._inner()
    if inner is None:
        return [(k, s, node) for k, s in children.items()]
    out = [(k, s, inner) for k, s in inner._level()[1].items()]
    out += [(k, s, node) for k, s in children.items() if k != _INNER]
    return out


def tree_lines(node: Any, depth: int, budget: int) -> list[str]:
    """Indented ``key: dtype[shape]`` lines of a level (at most about ``budget``)."""
    lines: list[str] = []
    pad = "  " * (depth + 1)
    for key, spec, owner in children_of(node):
        if len(lines) >= budget:
            lines.append(pad + "...")
            break
        if spec.kind == "leaf":
            leaf = spec.leaf
            kind = " nested" if getattr(leaf, "nested", False) else ""
            lines.append(f"{pad}{key}: {dtype_text(leaf.dtype)}{shape_text(owner, leaf)}{kind}")
        elif spec.kind == "file":
            lines.append(f"{pad}{key}: file")
        elif spec.kind == "value":
            lines.append(f"{pad}{key}: {value_text(spec.leaf)}")
        else:
            sub = owner._sub(spec.path)
            shown, value = level_value(sub)
            if shown:
                label = "" if sub._plain_value()[0] else f"{sub.type_name} "
                lines.append(f"{pad}{key}: {label}{value_text(value)}")
            else:
                lines.append(f"{pad}{key}/ ({sub.type_name})")
                lines.extend(tree_lines(sub, depth + 1, budget - len(lines)))
    return lines


def archive_repr(ar: Any) -> str:
    """``Archive(path, Class, mode='r'[, batch_size=..])`` and the tree lines below it."""
    state = ar._state
    if state.closed:
        return f"<tdz_numba.Archive {state.source.path} (closed)>"
    try:
        lines = tree_lines(ar, 0, 40)
        head = f"Archive({state.source.path}"
        if ar.format != "tdz":
            head += f", format={ar.format!r}"
        head += f", {ar.type_name}, mode={ar.mode!r}"
        bs = ar.batch_size
        head += f", batch_size={bs})" if bs else ")"
    except Exception as exc:  # a repr never raises
        return f"<tdz_numba.Archive {ar._prefix or '/'} (unreadable: {exc})>"
    return "\n".join([head, *lines])


_STYLE = (
    "<style>.tdz-archive table{border-collapse:collapse;margin:0.2em 0;font-family:monospace}"
    ".tdz-archive th{text-align:left;padding:0 0.9em 0 0;color:#555;font-weight:normal;"
    "border-bottom:1px solid #ccc}"
    ".tdz-archive td{text-align:left;padding:0 0.9em 0 0;white-space:nowrap;"
    "vertical-align:top}.tdz-archive td.tdz-n{text-align:right}"
    ".tdz-archive td.tdz-v{color:#555}.tdz-archive summary{cursor:pointer}"
    ".tdz-archive .tdz-meta{font-family:monospace;color:#555;margin:0.1em 0}</style>"
)
#: Leaves with at most this many values show them all in the preview; larger ones their
#: first and last :data:`PREVIEW_EDGE` values (an ellipsis stands for at least three values).
PREVIEW_EDGE = 3
PREVIEW_ALL = 2 * PREVIEW_EDGE + 2
_HEAD = (
    '<thead><tr class="tdz-head"><th>key</th><th>dtype</th><th>shape</th>'
    '<th style="text-align:right">size</th><th>storage</th><th>values</th></tr></thead>'
)


def _num(x: Any) -> str:
    if isinstance(x, float):
        text = f"{x:.4g}"
        return text if any(c in text for c in ".eni") else text + "."  # 1., 0.5, 1e+20, nan, inf
    return str(x)


def value_preview(t: Any) -> str:
    """First and last values of a tensor, flattened, like xarray's preview: ``0 1 2 ... 97 98 99``.

    Examples
    --------
    >>> import torch
    >>> value_preview(torch.arange(100))
    '0 1 2 ... 97 98 99'
    >>> value_preview(torch.arange(8)), value_preview(torch.tensor([0.5, 2.0]))
    ('0 1 2 3 4 5 6 7', '0.5 2.')
    """
    flat = t.reshape(-1)
    n = int(flat.numel())
    if n == 0:
        return ""
    if t.is_complex():
        return "complex"
    if n <= PREVIEW_ALL:
        return " ".join(_num(v) for v in flat.tolist())
    head = flat[:PREVIEW_EDGE].tolist()
    tail = flat[n - PREVIEW_EDGE :].tolist()
    return " ".join(_num(v) for v in head) + " ... " + " ".join(_num(v) for v in tail)


def level_nbytes(node: Any, limit: int = 1_000_000) -> int | None:
    """Bytes of every leaf below a level (uncompressed), or None past ``limit`` leaves."""
    total = seen = 0
    stack = [node]
    while stack:
        level = stack.pop()
        for _, spec, owner in children_of(level):
            if spec.kind == "leaf":
                seen += 1
                if seen > limit:
                    return None
                total += owner._leaf_info(spec.leaf).nbytes
            elif spec.kind == "level":
                stack.append(owner._sub(spec.path))
    return total


def archive_html(ar: Any, max_rows: int = 500) -> str:
    """A collapsible HTML tree for Jupyter: one ``<details>`` per level (class name, batch
    size, keys, the bytes of its leaves, its metadata), one table per level with column
    headers (key, dtype, shape, size, storage, values): one row per leaf, with its first and
    last values when it is mapped (a stored leaf: two pages read; compressed ones are not
    inflated for it), one row per non-tensor value.

    At most ``max_rows`` rows are drawn; the rest is summarized as
    "... N more keys" per level. Never raises: on any error the plain
    :func:`repr` is shown in a ``<pre>``.
    """
    esc = html.escape
    human = human_bytes

    def level_label(node: Any) -> str:
        bs = node.batch_size
        n = len(children_of(node))
        text = f'<span style="color:#276">{esc(node.type_name)}</span>'
        if bs is not None:
            text += f' <span style="color:#777">batch_size={esc(str(bs))}</span>'
        size = level_nbytes(node)
        extra = f" &middot; {human(size)}" if size is not None else ""
        return text + f' <span style="color:#777">&middot; {n} key{"s" if n != 1 else ""}{extra}</span>'

    def metadata_div(node: Any) -> str:
        try:
            meta = node.metadata
        except Exception:  # a description only
            meta = {}
        if not meta:
            return ""
        items = "; ".join(f"{esc(str(k))} = {esc(value_text(v, 60))}" for k, v in list(meta.items())[:20])
        more = f"; ... {len(meta) - 20} more" if len(meta) > 20 else ""
        return f'<div class="tdz-meta">metadata: {items}{more}</div>'

    budget = [max_rows]

    def leaf_row(name: str, owner: Any, spec: Any) -> str:
        leaf = spec.leaf
        preview = ""
        try:
            info = owner._leaf_info(leaf)
            nested = " nested" if info.nested else ""
            codec = info.compression
            if info.stored_nbytes != info.nbytes:
                codec += f" ({human(info.stored_nbytes)} stored)"
            cols = [dtype_text(info.dtype) + nested, shape_text(owner, leaf), human(info.nbytes), codec]
            if info.zero_copy and not info.nested:
                try:
                    preview = value_preview(owner._value(spec))
                except Exception:  # the preview only: the row stays
                    preview = "?"
        except Exception as exc:  # one bad leaf does not hide the others
            cols = [dtype_text(leaf.dtype), str(list(leaf.shape)), "?", f"error: {exc}"]
        return (
            f"<tr><td>{name}</td><td>{esc(cols[0])}</td><td>{esc(cols[1])}</td>"
            f'<td class="tdz-n">{esc(cols[2])}</td><td>{esc(cols[3])}</td>'
            f'<td class="tdz-v">{esc(preview)}</td></tr>'
        )

    def render(node: Any) -> str:
        rows: list[str] = []
        subs: list[str] = []
        items = children_of(node)
        for i, (key, spec, owner) in enumerate(items):
            if budget[0] <= 0:
                rest = len(items) - i
                subs.append(
                    f'<div style="color:#777;font-family:monospace">... {rest} more '
                    f"key{'s' if rest != 1 else ''}</div>"
                )
                break
            budget[0] -= 1
            name = f"<b>{esc(key)}</b>"
            if spec.kind == "leaf":
                rows.append(leaf_row(name, owner, spec))
            elif spec.kind == "file":
                rows.append(
                    f'<tr><td>{name}</td><td colspan="5" style="color:#777">file {esc(spec.path)}</td></tr>'
                )
            elif spec.kind == "value":
                rows.append(f'<tr><td>{name}</td><td colspan="5">{esc(value_text(spec.leaf))}</td></tr>')
            else:
                sub = owner._sub(spec.path)
                shown, value = level_value(sub)
                if shown:
                    label = "" if sub._plain_value()[0] else f"{sub.type_name} "
                    rows.append(
                        f'<tr><td>{name}</td><td colspan="5">{esc(label + value_text(value))}</td></tr>'
                    )
                else:
                    inner = render(sub)
                    subs.append(
                        f"<details><summary><b>{esc(key)}/</b> {level_label(sub)}</summary>"
                        f'<div style="margin-left:1.2em">{metadata_div(sub)}{inner}</div></details>'
                    )
        table = f"<table>{_HEAD}<tbody>{''.join(rows)}</tbody></table>" if rows else ""
        return table + "".join(subs)

    try:
        ar._check_open()
        body = render(ar)
        where = esc(str(ar.path))
        if ar._prefix:
            where += f" : {esc(ar._prefix.rstrip('/'))}"
        extra = ""
        index = getattr(ar._state.source, "index", None)
        if not ar._prefix and index is not None and len(index.names):
            extra = (
                f' <span style="color:#777">&middot; {len(index.names)} entries, '
                f"{human(int(index.table['csize'].sum()))} stored</span>"
            )
        fmt = "" if ar.format == "tdz" else f' <span style="color:#777">({esc(ar.format)})</span>'
        return (
            f'<div class="tdz-archive">{_STYLE}<details open><summary><b>Archive</b> {where}{fmt} '
            f"{level_label(ar)}{extra}</summary>"
            f'<div style="margin-left:1.2em">{metadata_div(ar)}{body}</div></details></div>'
        )
    except Exception:
        try:
            text = repr(ar)
        except Exception:
            text = "<tdz_numba.Archive>"
        return f"<pre>{esc(text)}</pre>"
