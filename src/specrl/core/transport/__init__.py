"""Transport between pipeline stages beside the schedule: :class:`TapChannel` (target taps to the
draft's stage over dedicated links, preallocated landing slots, bounded waits)."""

from specrl.core.transport.tap_channel import (
    HEADER_FIELDS,
    TapChannel,
    TapChannelError,
    TapPlan,
    TapShapeError,
    TapSpec,
    TapStats,
)

__all__ = [
    "HEADER_FIELDS",
    "TapChannel",
    "TapChannelError",
    "TapPlan",
    "TapShapeError",
    "TapSpec",
    "TapStats",
]
