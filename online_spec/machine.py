"""What machine this process runs on: CPU model, cores, threads, versions, GPU.

Stored with every benchmark's JSON and used as part of the key of a stored engine calibration
(serving/calibrate.py), so a figure or a calibration is never read as another machine's.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def machine_info() -> dict:
    """CPU model, cores, torch threads, Python/torch/transformers versions, platform, load average
    at the call, and the GPU's name where one is visible."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "platform": platform.platform(),
            "load_avg_at_start": os.getloadavg()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
