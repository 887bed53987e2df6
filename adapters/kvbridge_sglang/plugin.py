"""Registers the kvbridge transfer backend with SGLang (entry point group ``sglang.srt.plugins``).

SGLang has no backend registry: backends are members of ``TransferBackend`` and
``get_kv_class`` maps them to classes. ``register()`` (run by SGLang's ``load_plugins()`` in
every process) adds a ``KVBRIDGE = "kvbridge"`` member, accepts
``--disaggregation-transfer-backend kvbridge``, and wraps ``get_kv_class`` (an AROUND hook)
so the new member resolves to :mod:`kvbridge_sglang.conn`'s classes.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["register", "BACKEND"]

BACKEND = "kvbridge"


def _add_enum_member(enum_cls: Any, name: str, value: str) -> Any:
    """Add ``name = value`` to an existing Enum (what ``TransferBackend("kvbridge")`` needs)."""
    if value in enum_cls._value2member_map_:
        return enum_cls._value2member_map_[value]
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    type.__setattr__(enum_cls, name, member)
    return member


def get_kv_class_hook(original: Callable[..., Any], transfer_backend: Any, class_type: Any) -> Any:
    if getattr(transfer_backend, "value", None) != BACKEND:
        return original(transfer_backend, class_type)
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import KVClassType

    from .conn import KVBridgeKVBootstrapServer, KVBridgeKVManager, KVBridgeKVReceiver, KVBridgeKVSender
    return {KVClassType.KVARGS: KVArgs, KVClassType.MANAGER: KVBridgeKVManager,
            KVClassType.SENDER: KVBridgeKVSender, KVClassType.RECEIVER: KVBridgeKVReceiver,
            KVClassType.BOOTSTRAP_SERVER: KVBridgeKVBootstrapServer}[class_type]


def register() -> None:
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _add_enum_member(utils.TransferBackend, "KVBRIDGE", BACKEND)
    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.DISAGG_TRANSFER_BACKEND_CHOICES.append(BACKEND)
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", get_kv_class_hook, HookType.AROUND)
