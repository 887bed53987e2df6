"""kvbridge for SGLang: a PD transfer backend (``--disaggregation-transfer-backend kvbridge``)
conforming to ``sglang.srt.disaggregation.base``, registered through SGLang's plugin entry
point. Push mode: decode pre-allocates and reserves, prefill writes. See ``README.md`` here."""

__all__ = ["BACKEND"]

BACKEND = "kvbridge"
