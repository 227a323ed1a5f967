"""online-spec: keeps an EAGLE-3 draft head in step with live traffic.

Shared parts: target loading (`target`), the EAGLE-3 head (`head`) and its checkpoint codec
(`checkpoint`), the capture record (`capture`), sampling rules (`sampling`), data (`data`), the
command line (`cli`). See ../shared/ARCHITECTURE.md for how the packages fit together.
"""

__version__ = "0.1.0"
