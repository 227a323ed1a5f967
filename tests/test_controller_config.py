"""The adaptive JSON config: SGLang's format read unchanged, every error naming its key."""

from __future__ import annotations

import json

import pytest

from online_spec.config import ConfigError
from online_spec.controller import AdaptiveConfig, adaptive_config_path, configs_dir, load_adaptive_config


def test_configs_dir_is_the_repo_configs_folder():
    assert configs_dir().name == "configs"
    assert (configs_dir().parent / "online_spec" / "controller" / "config.py").exists()


@pytest.mark.parametrize("preset, keys, union", [
    ("sglang_default", [1, 8, 32, 64], [0, 1, 3, 5, 7]),
    ("aggressive", [1, 8, 64, 128], [1, 3, 7]),
    ("conservative", [1, 8, 32], [1, 3, 7]),
])
def test_shipped_presets_load(preset, keys, union):
    cfg = load_adaptive_config(adaptive_config_path(preset))
    assert cfg.keys == keys
    assert cfg.candidate_steps == union


def test_aggressive_preset_ceilings():
    cfg = load_adaptive_config(adaptive_config_path("aggressive"))
    assert [s.ceiling_coeff for s in cfg.slots] == [0, 3.0, 1.67, 1.2]


def test_globals_apply_to_every_slot_and_slots_override_them():
    cfg = AdaptiveConfig.from_dict({
        "ema_alpha": 0.5, "warmup_batches": 3, "update_interval": 2, "down_hysteresis": 0.1,
        "1": {"candidate_steps": [7, 1, 3, 3]},
        "8": {"candidate_steps": [1], "ema_alpha": 0.9, "update_interval": 7},
    })
    a, b = cfg.slots
    assert a.candidate_steps == (1, 3, 7)  # sorted and de-duplicated, as SGLang does
    assert (a.ema_alpha, a.warmup_batches, a.update_interval, a.down_hysteresis) == (0.5, 3, 2, 0.1)
    assert (b.ema_alpha, b.warmup_batches, b.update_interval, b.down_hysteresis) == (0.9, 3, 7, 0.1)


def test_defaults_match_sglang():
    (slot,) = AdaptiveConfig.from_dict({"1": {"candidate_steps": [1]}}).slots
    assert (slot.ema_alpha, slot.warmup_batches, slot.update_interval, slot.down_hysteresis,
            slot.up_hysteresis, slot.ceiling_coeff) == (0.2, 10, 5, -0.25, 0.0, 0)


def test_to_dict_round_trips():
    cfg = load_adaptive_config(adaptive_config_path("aggressive"))
    assert AdaptiveConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("batch_size, key", [(0, 1), (1, 1), (7, 1), (8, 8), (63, 8), (64, 64), (10_000, 128)])
def test_slot_for_routes_to_largest_key_at_or_below(batch_size, key):
    cfg = load_adaptive_config(adaptive_config_path("aggressive"))
    assert cfg.slot_for(batch_size).min_batch_size == key


@pytest.mark.parametrize("raw, field", [
    ({"8": {"up_hysteresis": 0.0}}, r'slots\["8"\]\.candidate_steps: is required'),
    ({"8": {"candidate_steps": []}}, r'slots\["8"\]\.candidate_steps: must be a non-empty list'),
    ({"8": {"candidate_steps": [1, -1]}}, r'slots\["8"\]\.candidate_steps'),
    ({"8": {"candidate_steps": [1, 2.5]}}, r'slots\["8"\]\.candidate_steps'),
    ({"8": {"candidate_steps": [True]}}, r'slots\["8"\]\.candidate_steps'),
    ({"8": {"candidate_steps": "1,3"}}, r'slots\["8"\]\.candidate_steps'),
    ({"8": [1, 3]}, r'slots\["8"\]: must be an object'),
    ({"8": {"candidate_steps": [1], "ceilling_coeff": 2}}, r'slots\["8"\]\.ceilling_coeff: unknown key'),
    ({"8": {"candidate_steps": [1], "ema_alpha": 0}}, r'slots\["8"\]\.ema_alpha: must be a number in \(0, 1\]'),
    ({"8": {"candidate_steps": [1], "ceiling_coeff": -1}}, r'slots\["8"\]\.ceiling_coeff'),
    ({"8": {"candidate_steps": [1], "down_hysteresis": "low"}}, r'slots\["8"\]\.down_hysteresis'),
    ({"8": {"candidate_steps": [1]}, "update_interval": 0}, r'slots\["8"\]\.update_interval: must be an int >= 1'),
    ({"8": {"candidate_steps": [1]}, "warmup_batches": 2.5}, r'slots\["8"\]\.warmup_batches'),
    ({"8": {"candidate_steps": [1]}, "ema_aplha": 0.3}, r"ema_aplha: unknown key"),
    ({"candidate_steps": [1, 3, 7], "ema_alpha": 0.2}, r"candidate_steps: belongs inside each integer batch-size slot"),
    ({"ema_alpha": 0.2}, r"slots: needs at least one integer batch-size key"),
    ({"1": {"candidate_steps": [1]}, "01": {"candidate_steps": [3]}}, r'slots\["01"\]: same batch size as slots\["1"\]'),
    ([{"candidate_steps": [1]}], r"adaptive config: must be a JSON object"),
])
def test_errors_name_the_bad_key(raw, field):
    with pytest.raises(ConfigError, match=field):
        AdaptiveConfig.from_dict(raw)


def test_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"4": {"candidate_steps": [1]},')
    with pytest.raises(ConfigError, match=r"bad\.json: not valid JSON"):
        load_adaptive_config(bad)
    with pytest.raises(ConfigError, match=r"missing\.json: cannot read"):
        load_adaptive_config(tmp_path / "missing.json")
    bad.write_text('{"4": {}}')
    with pytest.raises(ConfigError, match=r'bad\.json: slots\["4"\]\.candidate_steps'):
        load_adaptive_config(bad)
