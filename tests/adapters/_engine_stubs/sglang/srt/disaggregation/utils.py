"""Stand-in for ``sglang.srt.disaggregation.utils``: ``DisaggregationMode`` only."""

import enum


class DisaggregationMode(enum.Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"
