"""Differential fuzzing of tpuc against eager PyTorch (see cli.py for long runs)."""
