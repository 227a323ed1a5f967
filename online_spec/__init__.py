"""online-spec: keeps an EAGLE-3 draft head in step with live traffic.

Shared parts: target loading (`target`), the EAGLE-3 head (`head`) and its checkpoint codec
(`checkpoint`), the capture record (`capture`), sampling rules (`sampling`), data (`data`), the
command line (`cli`). See ../shared/ARCHITECTURE.md for how the packages fit together.
"""

import os

# The server and the trainer share the CPU: OpenMP workers that spin while waiting turn any
# oversubscription into 10-50x slowdowns of small matmuls (measured here: 16 ms vs 0.4 ms for a
# [37x576]x[576x1536] bf16 linear with another busy process). Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
