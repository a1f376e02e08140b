"""The two developer options: ``disable`` (ablations) and ``tune`` (the knobs behind them).

Users see a dozen switches (README, "Switches"). Each optimization can still be turned off
for an ablation, and each of its knobs set, through two options that take lists
(docs/developer-options.md)::

    --fastgen-disable native_step,vocab_pad     +fastgen.disable=[native_step,vocab_pad]
    --fastgen-tune gemm=onednn,margin_guard=0   configure(tune="continuous_rows=64")

Both expand into the fields of :class:`~fairseq_fastgen.config.FastGenConfig` that carry
``developer`` in their metadata (handed in as ``developer``: name -> dataclass field);
Hydra and ``configure()`` also take those fields by name.  ``disable`` sets an on/off
field to False and a valued one to the ``off`` value of its metadata (stock's choice).
An unknown name or a malformed item raises ``ValueError`` naming it.
"""
from dataclasses import MISSING, Field
from typing import Any, Dict, Iterable, List, Mapping, Union

Items = Union[None, str, Iterable[str]]


def disable_names(developer: Mapping[str, Field]) -> List[str]:
    """The names ``disable`` takes: every developer field that is on by default."""
    return [name for name, f in developer.items()
            if (f.type in (bool, "bool") and f.default) or f.metadata.get("off", MISSING) is not MISSING]


def expand(disable: Items, tune: Items, developer: Mapping[str, Field]) -> Dict[str, Any]:
    """Field values from ``disable`` and ``tune`` items (strings with commas, or lists).
    ``tune`` values stay strings: the config's validation coerces them."""
    names = disable_names(developer)
    values: Dict[str, Any] = {}
    for name in _items(disable):
        if name not in names:
            raise ValueError(f"fastgen option 'disable': unknown name {name!r}; known: {', '.join(names)}")
        f = developer[name]
        values[name] = False if f.type in (bool, "bool") else f.metadata["off"]
    for item in _items(tune):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in developer:
            raise ValueError(f"fastgen option 'tune': {item!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join(developer)}")
        values[name] = value.strip()
    return values


def _items(spec: Items) -> List[str]:
    if spec is None:
        return []
    parts = [spec] if isinstance(spec, str) else list(spec)
    return [item.strip() for part in parts for item in str(part).split(",") if item.strip()]
