"""Selection policies of the offloading engine, by mode name (``OffloadConfig.mode``).

============  ===================================================================================
mode          policy
============  ===================================================================================
``herald``    :class:`~herald.offload.policies.herald.HeraldPolicy`: representative query on the
              CPU, ahead of time from the draft (HERALD §IV)
``mage``      :class:`~herald.offload.policies.mage.MagePolicy`: the block's B queries at step 0,
              exact, on the GPU or the CPU
``infinigen`` :class:`~herald.offload.policies.infinigen.InfiniGenPolicy`: proxy channels at
              step 0 against a GPU partial-key cache
============  ===================================================================================

The interface is :class:`~herald.offload.policies.base.SelectionPolicy`; to add a policy, write
its module and add it here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from herald.offload.policies.base import NextBlock, SelectionPolicy
from herald.offload.policies.herald import HeraldPolicy
from herald.offload.policies.infinigen import InfiniGenPolicy
from herald.offload.policies.mage import MagePolicy

if TYPE_CHECKING:
    from herald.offload.engine import OffloadEngine

POLICIES: dict[str, type[SelectionPolicy]] = {
    "herald": HeraldPolicy,
    "mage": MagePolicy,
    "infinigen": InfiniGenPolicy,
}

__all__ = ["POLICIES", "NextBlock", "SelectionPolicy", "make_policy"]


def make_policy(core: OffloadEngine) -> SelectionPolicy:
    """The policy of ``core.offload.mode``. KeyError for a mode with no policy."""
    assert core.offload is not None
    return POLICIES[core.offload.mode](core)
