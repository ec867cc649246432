"""DADConfig: round trip through dicts, and clear errors that name the bad key."""
import pytest

from dad_integrations import DADConfig


def test_defaults_are_lossless_auto():
    cfg = DADConfig()
    assert cfg.mode == "auto" and cfg.rank is None


def test_round_trip():
    cfg = DADConfig(mode="rank", rank=4, power_iterations=2, warm_start=False, error_feedback=True,
                    adaptive_tolerance=0.9, wire_dtype="bfloat16", layer_kinds=("linear",),
                    exclude=("lm_head",), bucket_cap_mb=5, verify_first_step=False)
    d = cfg.to_dict()
    assert DADConfig.from_dict(d) == cfg
    assert d["layer_kinds"] == ["linear"] and d["exclude"] == ["lm_head"]


@pytest.mark.parametrize("values,key", [
    ({"mode": "fast"}, "mode"),
    ({"rank": 0}, "rank"),
    ({"rank": -3}, "rank"),
    ({"rank": 2.5}, "rank"),
    ({"rank": True}, "rank"),
    ({"mode": "rank"}, "rank"),
    ({"power_iterations": 0}, "power_iterations"),
    ({"warm_start": "yes"}, "warm_start"),
    ({"adaptive_tolerance": 1.5}, "adaptive_tolerance"),
    ({"adaptive_tolerance": 0}, "adaptive_tolerance"),
    ({"wire_dtype": "int8"}, "wire_dtype"),
    ({"layer_kinds": ["linear", "conv2d"]}, "layer_kinds"),
    ({"exclude": [3]}, "exclude"),
    ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
])
def test_bad_values_name_the_key(values, key):
    with pytest.raises(ValueError, match=key):
        DADConfig.from_dict(values)


def test_unknown_keys_are_named():
    with pytest.raises(ValueError, match="rnak"):
        DADConfig.from_dict({"mode": "auto", "rnak": 4})


def test_not_a_dict():
    with pytest.raises(ValueError, match="dict"):
        DADConfig.from_dict(["mode", "auto"])
