"""Every number the vLLM connector reads from ``kv_connector_extra_config`` is finite and bounded (issue 49,
item 5).

Round 6 found ``transfer_timeout_s: Infinity`` (what vLLM's JSON parser makes of it), ``1e999`` and ``1e308``
accepted, and a load against a stopped producer still pending at 40 s with no error; ``pin_grace_s`` took
``inf`` too. The settings are iterated from the dataclass, so a numeric setting added without a range fails
here, not in a deployment. Pure: the config is parsed as the connector parses it, from the JSON text vLLM hands
over (``json.loads``, which reads ``Infinity`` and ``NaN``).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, fields

import pytest

from kvxfer.integrations.vllm.config import ConnectorConfigError, KvxferConfig, numeric_settings

NUMERIC = [f.name for f in numeric_settings()]
#: JSON texts that must be refused for every numeric setting: non-finite, huge, negative, a bool, text, null.
BAD_JSON = ["Infinity", "-Infinity", "NaN", "1e999", "1e308", "-1", "true", "false", '"5"', '"inf"', "null", "[]"]


def parse(name: str, json_value: str) -> KvxferConfig:
    return KvxferConfig.from_extra_config(json.loads(f'{{"{name}": {json_value}}}'))


def test_every_numeric_setting_is_listed_and_has_a_range():
    """A field whose default is a number is a numeric setting and carries its range (``_bounded``)."""
    numbers = [f.name for f in fields(KvxferConfig)
               if f.default is not MISSING and isinstance(f.default, (int, float)) and not isinstance(f.default, bool)]
    assert numbers and sorted(numbers) == sorted(NUMERIC)
    for setting in numeric_settings():
        low, high = setting.metadata["range"]
        assert low <= setting.default <= high, setting.name
        if setting.name.endswith("_s"):
            assert high <= 86400, setting.name  # a day at most: no wait is "forever"


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("json_value", BAD_JSON)
def test_a_non_finite_or_out_of_range_number_is_refused_naming_the_setting_and_its_range(name, json_value):
    setting = next(f for f in numeric_settings() if f.name == name)
    low, high = setting.metadata["range"]
    figure = str if setting.type in ("int", int) else "{:g}".format
    with pytest.raises(ConnectorConfigError) as refused:
        parse(name, json_value)
    message = str(refused.value)
    assert repr(name) in message, message
    assert f"from {figure(low)} to {figure(high)}" in message, message


@pytest.mark.parametrize("name", NUMERIC)
def test_the_range_is_closed_and_nothing_past_it_passes(name):
    setting = next(f for f in numeric_settings() if f.name == name)
    low, high = setting.metadata["range"]
    integral = setting.type in ("int", int)
    for edge in (low, high):
        assert getattr(parse(name, json.dumps(edge)), name) == edge
    for past in ((low - 1, high + 1) if integral else (low / 2 if low > 0 else -0.001, high * 1.001)):
        with pytest.raises(ConnectorConfigError, match=repr(name)):
            parse(name, json.dumps(past))


def test_the_issue_figures():
    """The round 6 figures, as vLLM's parser hands them over, and an int setting given a whole float."""
    for text in ('{"transfer_timeout_s": Infinity}', '{"transfer_timeout_s": 1e999}', '{"transfer_timeout_s": 1e308}',
                 '{"pin_grace_s": Infinity}', '{"handshake_timeout_s": NaN}', '{"lease_slots": 1e308}'):
        with pytest.raises(ConnectorConfigError, match="is not a finite number|is out of range"):
            KvxferConfig.from_extra_config(json.loads(text))
    cfg = KvxferConfig.from_extra_config({"lease_slots": 4096.0, "transfer_timeout_s": 3600})
    assert cfg.lease_slots == 4096 and isinstance(cfg.lease_slots, int)
    with pytest.raises(ConnectorConfigError, match="'lease_slots'.*not a whole number"):
        KvxferConfig.from_extra_config({"lease_slots": 4096.5})
