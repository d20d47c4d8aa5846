"""Which end of a function a uprobe program sees."""

from __future__ import annotations

import enum


class LinkKind(enum.Enum):
    ENTRY = "uprobe"
    RETURN = "uretprobe"
