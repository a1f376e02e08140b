"""The two developer options: ``disable`` (ablations) and ``tune`` (the knobs behind them).

Users see a dozen switches (README, "Switches"). Each optimization can still be turned off
for an ablation, and each of its knobs set, through two options that take lists
(docs/developer-options.md)::

    --fastgen-disable native_step,kv_cache      +fastgen.disable=[native_step,kv_cache]
    --fastgen-tune gemm=onednn,margin_guard=0   configure(tune="continuous_rows=64")

Both expand into fields of :class:`~fairseq_fastgen.config.FastGenConfig` that carry
``developer`` in their metadata; Hydra and ``configure()`` also take those fields by name.
An unknown name or a bad value raises :class:`~fairseq_fastgen.config.FastGenConfigError`.
"""
from dataclasses import fields
from typing import Any, Dict, Iterable, List, Union

from .config import FastGenConfig, FastGenConfigError

Items = Union[None, str, Iterable[str]]

# What ``disable`` sets a non-boolean developer field to (a boolean one is set to False).
_OFF_VALUES = {"packed_gemm_mb": 0, "margin_guard": 0.0, "ngram_blocker": "stock", "gemm": "mkl"}


def developer_fields() -> Dict[str, Any]:
    """Developer field name -> dataclass field."""
    return {f.name: f for f in fields(FastGenConfig) if f.metadata.get("developer")}


def disable_names() -> List[str]:
    """The names ``disable`` takes: every developer field that is on by default."""
    return [name for name, f in developer_fields().items()
            if (f.type in (bool, "bool") and f.default) or name in _OFF_VALUES]


def expand(disable: Items = None, tune: Items = None) -> Dict[str, Any]:
    """Field values from ``disable`` and ``tune`` items (strings with commas, or lists).

    ``tune`` values stay strings here: :meth:`FastGenConfig.from_mapping` coerces them.
    """
    known = developer_fields()
    values: Dict[str, Any] = {}
    for name in _items(disable):
        if name not in disable_names():
            raise FastGenConfigError(
                f"fastgen option 'disable': unknown name {name!r}; known: {', '.join(disable_names())}")
        values[name] = False if known[name].type in (bool, "bool") else _OFF_VALUES[name]
    for item in _items(tune):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in known:
            raise FastGenConfigError(
                f"fastgen option 'tune': {item!r} is not KEY=VALUE with KEY one of "
                f"{', '.join(known)}")
        values[name] = value.strip()
    return values


def _items(spec: Items) -> List[str]:
    if spec is None:
        return []
    parts = [spec] if isinstance(spec, str) else list(spec)
    return [item.strip() for part in parts for item in str(part).split(",") if item.strip()]
