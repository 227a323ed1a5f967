"""SGLang's own adaptive step policy, loaded on CPU as the reference for parity tests.

`import sglang` needs triton and a GPU stack, so this executes the installed file
`sglang/srt/speculative/adaptive_spec_params.py` unchanged, with its four imports that serve
only server-arg checks and rank-0 logging (`arg_groups.overrides`, `runtime_context`,
`speculative.spec_info`, `utils.log_info_on_rank0`) replaced by inert stand-ins for the
duration of the load. `AdaptiveStepSlot` and `AdaptiveSpeculativeParams` run as shipped.

Install: `pip install --no-deps sglang==0.5.23`. Tests using it fail when it is absent (CI installs it).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

SGLANG_VERSION_COMPARED = "0.5.23"  # the version these parity tests were written and run against


def _stub(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []  # importable as a package
    mod.__dict__.update(attrs)
    return mod


def load_sglang_adaptive():
    """(module, installed version), or (None, reason) when SGLang is not installed."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None, "sglang is not installed (pip install --no-deps sglang==%s)" % SGLANG_VERSION_COMPARED
    path = Path(list(spec.submodule_search_locations)[0]) / "srt" / "speculative" / "adaptive_spec_params.py"
    if not path.exists():
        return None, f"{path} not found in the installed sglang"

    def _unused(*_a, **_k):
        raise AssertionError("server-arg helpers are not part of the step policy")

    stubs = {
        "sglang": _stub("sglang"),
        "sglang.srt": _stub("sglang.srt"),
        "sglang.srt.arg_groups": _stub("sglang.srt.arg_groups"),
        "sglang.srt.arg_groups.overrides": _stub("sglang.srt.arg_groups.overrides",
                                                 resolved_view=_unused, resolving_view=_unused),
        "sglang.srt.runtime_context": _stub("sglang.srt.runtime_context", attn_dp_enabled_of=_unused),
        "sglang.srt.speculative": _stub("sglang.srt.speculative"),
        "sglang.srt.speculative.spec_info": _stub("sglang.srt.speculative.spec_info", SpeculativeAlgorithm=object),
        "sglang.srt.utils": _stub("sglang.srt.utils", log_info_on_rank0=lambda logger, msg: None),
    }
    saved = {name: sys.modules.get(name) for name in stubs}
    try:
        sys.modules.update(stubs)
        mspec = importlib.util.spec_from_file_location("_sglang_adaptive_spec_params", path)
        module = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(module)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return module, importlib.metadata.version("sglang")
