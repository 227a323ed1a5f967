"""Shared fixtures. Tests keep to 1-2 threads: CI has 2 cores."""

import os

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
