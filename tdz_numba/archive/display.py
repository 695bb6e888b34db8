"""What an :class:`~tdz_numba.Archive` looks like: ``repr`` tree lines and the Jupyter HTML tree.

Nothing here creates a leaf tensor or inflates a payload: only level
descriptions (meta.json) and the index are read (plus the small size table of
a nested leaf, for its shape). Non-tensor data shows its value (truncated),
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
    "<style>.tdz-archive table{border-collapse:collapse;margin:0;font-family:monospace}"
    ".tdz-archive td{text-align:left;padding:0 0.9em 0 0;white-space:nowrap;"
    "vertical-align:top}.tdz-archive summary{cursor:pointer}</style>"
)


def archive_html(ar: Any, max_rows: int = 500) -> str:
    """A collapsible HTML tree for Jupyter: one ``<details>`` per level (class
    name, batch size), one row per leaf (key, dtype, shape, size, codec), one
    row per non-tensor value.

    At most ``max_rows`` rows are drawn; the rest is summarized as
    "... N more keys" per level. Never raises: on any error the plain
    :func:`repr` is shown in a ``<pre>``.
    """
    esc = html.escape
    human = human_bytes

    def level_label(node: Any) -> str:
        bs = node.batch_size
        text = f'<span style="color:#276">{esc(node.type_name)}</span>'
        if bs is not None:
            text += f' <span style="color:#777">batch_size={esc(str(bs))}</span>'
        return text + f' <span style="color:#777">&middot; {len(children_of(node))} keys</span>'

    budget = [max_rows]

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
                leaf = spec.leaf
                try:
                    info = owner._leaf_info(leaf)
                    nested = " nested" if info.nested else ""
                    codec = info.compression
                    if info.stored_nbytes != info.nbytes:
                        codec += f" ({human(info.stored_nbytes)} stored)"
                    cols = [
                        dtype_text(info.dtype) + nested,
                        shape_text(owner, leaf),
                        human(info.nbytes),
                        codec,
                    ]
                except Exception as exc:  # one bad leaf does not hide the others
                    cols = [dtype_text(leaf.dtype), str(list(leaf.shape)), "?", f"error: {exc}"]
                rows.append(
                    f"<tr><td>{name}</td><td>{esc(cols[0])}</td><td>{esc(cols[1])}</td>"
                    f'<td style="text-align:right">{esc(cols[2])}</td>'
                    f"<td>{esc(cols[3])}</td></tr>"
                )
            elif spec.kind == "file":
                rows.append(
                    f'<tr><td>{name}</td><td colspan="4" style="color:#777">file {esc(spec.path)}</td></tr>'
                )
            elif spec.kind == "value":
                rows.append(f'<tr><td>{name}</td><td colspan="4">{esc(value_text(spec.leaf))}</td></tr>')
            else:
                sub = owner._sub(spec.path)
                shown, value = level_value(sub)
                if shown:
                    label = "" if sub._plain_value()[0] else f"{sub.type_name} "
                    rows.append(
                        f'<tr><td>{name}</td><td colspan="4">{esc(label + value_text(value))}</td></tr>'
                    )
                else:
                    inner = render(sub)
                    subs.append(
                        f"<details><summary><b>{esc(key)}/</b> {level_label(sub)}</summary>"
                        f'<div style="margin-left:1.2em">{inner}</div></details>'
                    )
        table = f"<table>{''.join(rows)}</table>" if rows else ""
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
                f"{human(int(index.table['size'].sum()))} payload</span>"
            )
        fmt = "" if ar.format == "tdz" else f' <span style="color:#777">({esc(ar.format)})</span>'
        return (
            f'<div class="tdz-archive">{_STYLE}<details open><summary><b>Archive</b> {where}{fmt} '
            f"{level_label(ar)}{extra}</summary>"
            f'<div style="margin-left:1.2em">{body}</div></details></div>'
        )
    except Exception:
        try:
            text = repr(ar)
        except Exception:
            text = "<tdz_numba.Archive>"
        return f"<pre>{esc(text)}</pre>"
