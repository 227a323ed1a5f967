"""online-spec: keeps an EAGLE-3 draft head in step with live traffic.

Shared parts: target loading (`target`), the EAGLE-3 head (`head`) and its checkpoint codec
(`checkpoint`), the capture record (`capture`), sampling rules (`sampling`), data (`data`), the
command line (`cli`). See ../shared/ARCHITECTURE.md for how the packages fit together.
"""

# OpenMP wait policy: left to the runtime (libgomp spins a while before sleeping). Measured on
# 2 cores (docs/engine.md, "CPU notes"): a 2-thread process alone decodes 1.5-1.8x faster
# spinning than with OMP_WAIT_POLICY=PASSIVE (batch 1: 20 vs 30 ms a step; batch 16 x 4 tokens:
# 59 vs 106 ms), and PASSIVE with 2 threads is slower than 1 thread. Where processes share the
# cores (server + trainer daemon), each runs with its own threads (the demo, `bench e2e` and
# `train` default to 1 each), where the policy does not matter; a multi-threaded process on a
# shared CPU should set OMP_WAIT_POLICY=PASSIVE itself (spinning there: 2.4x slower).

__version__ = "0.1.0"
