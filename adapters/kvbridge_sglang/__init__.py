"""kvbridge for SGLang (work in progress; see README.md here)."""
