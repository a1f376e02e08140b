"""Reading fastgen options from the two surfaces fairseq parses: argparse and Hydra.

``--fastgen-<name>`` flags on an argparse parser (one per user field of :class:`FastGenConfig`,
and the developer options ``--fastgen-disable`` / ``--fastgen-tune``) and
a top-level ``fastgen`` node in a fairseq Hydra/OmegaConf tree. Which one a run uses is
decided once per entry point by :mod:`fairseq_fastgen.run_config`.
"""
from dataclasses import fields
from typing import Any, Dict, Optional

from . import developer_options
from .config import FastGenConfig, active


def cli_flag(name: str) -> str:
    return "--fastgen-" + name.replace("_", "-")


def add_args(parser) -> None:
    """Add one ``--fastgen-*`` flag per field to an argparse parser (idempotent)."""
    if any(a.dest == "fastgen_enabled" for a in parser._actions):
        return
    group = parser.add_argument_group("fairseq-fastgen")
    for f in fields(FastGenConfig):
        if "fairseq_flag" in f.metadata or f.metadata.get("developer"):
            continue  # fairseq's own flag (--bf16) or a developer option below sets it
        dest = "fastgen_" + f.name
        help_ = f.metadata.get("help", "")
        if f.type in (bool, "bool"):
            if f.default:
                flag = "--fastgen-off" if f.name == "enabled" else "--fastgen-no-" + f.name.replace("_", "-")
                group.add_argument(
                    flag, dest=dest,
                    action="store_false", help="switch off: " + help_,
                )
            else:
                group.add_argument(cli_flag(f.name), dest=dest, action="store_true", help=help_)
            parser.set_defaults(**{dest: f.default})
        else:
            group.add_argument(
                cli_flag(f.name), dest=dest, default=f.default,
                choices=f.metadata.get("choices"), help=help_,
                type=int if f.type in (int, "int") else None,
            )
    group.add_argument(
        "--fastgen-disable", dest="fastgen_disable", action="append", metavar="NAME[,NAME]",
        help="developer option (ablations, docs/developer-options.md): switch off these "
        "optimizations: " + ", ".join(developer_options.disable_names(FastGenConfig.developer_fields())))
    group.add_argument(
        "--fastgen-tune", dest="fastgen_tune", action="append", metavar="KEY=VALUE[,...]",
        help="developer option (docs/developer-options.md): set these knobs: "
        + ", ".join(FastGenConfig.developer_fields()))


def from_namespace(args) -> Optional[FastGenConfig]:
    """FastGenConfig from parsed ``--fastgen-*`` flags, or None if the parser had none."""
    values = namespace_values(args)
    return FastGenConfig.from_mapping(values) if values else None


def namespace_values(args) -> Dict[str, Any]:
    """The ``--fastgen-*`` values on a parsed Namespace, by option name; an option that
    fairseq's own flag sets (``--bf16``) only where that flag is on."""
    values = {f.name: getattr(args, "fastgen_" + f.name)
              for f in fields(FastGenConfig) if hasattr(args, "fastgen_" + f.name)}
    if values:
        # expanded (and checked) with the rest by FastGenConfig.from_mapping
        values.update(disable=getattr(args, "fastgen_disable", None),
                      tune=getattr(args, "fastgen_tune", None))
        values.update(_fairseq_flags(lambda name: getattr(args, name, False)))
    return values


def _fairseq_flags(read) -> Dict[str, Any]:
    """The options fairseq's own flags switch on, ``read(flag)`` giving each flag's value."""
    return {f.name: True for f in fields(FastGenConfig)
            if "fairseq_flag" in f.metadata and read(f.metadata["fairseq_flag"]) is True}


def from_hydra(cfg) -> Optional[FastGenConfig]:
    """FastGenConfig from the ``fastgen`` node at the root of a fairseq Hydra config.

    ``cfg`` may be any node of the config tree (fairseq hands generator builders only
    ``cfg.generation``); the root is found through OmegaConf's parent links.
    """
    values = hydra_values(cfg)
    return None if values is None else FastGenConfig.from_mapping(values, base=active())


def is_node(cfg) -> bool:
    """Whether ``cfg`` is an OmegaConf node (of a fairseq config tree)."""
    try:
        from omegaconf import DictConfig
    except ImportError:  # pragma: no cover - fairseq always brings omegaconf
        return False
    return isinstance(cfg, DictConfig)


def hydra_values(cfg) -> Optional[Dict[str, Any]]:
    """The root ``fastgen`` node of ``cfg``'s tree as a dict, or None without one."""
    if not is_node(cfg):
        return None
    from omegaconf import OmegaConf

    root = cfg._get_root()
    common = root.get("common", None) if "common" in root else None
    flags = _fairseq_flags(lambda name: common.get(name, False)) if is_node(common) else {}
    node = root.get("fastgen", None) if "fastgen" in root else None
    if node is None:
        return flags or None
    return {**flags, **OmegaConf.to_container(node, resolve=True)}
