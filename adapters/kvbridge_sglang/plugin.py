"""Entry point of the ``sglang.srt.plugins`` group (placeholder until the backend lands)."""


def register() -> None:
    return None
