"""DADConfig: round trip through dicts, and clear errors that name the bad key."""
import dataclasses

import pytest

from dad_integrations import DADConfig


def test_defaults_are_lossless_auto():
    cfg = DADConfig()
    assert cfg.mode == "auto" and cfg.rank is None


def test_lossless_steps_default_and_its_environment_variable(monkeypatch):
    """10 lossless steps by default (the early-training study); $DAD_LOSSLESS_STEPS sets it for
    configs that do not name it (this suite sets 0); a bad value is an error naming both."""
    from dad_integrations.config import DEFAULT_LOSSLESS_STEPS, LOSSLESS_STEPS_ENV

    monkeypatch.delenv(LOSSLESS_STEPS_ENV, raising=False)
    assert DEFAULT_LOSSLESS_STEPS == 10 and DADConfig().lossless_steps == 10
    assert DADConfig.from_dict({"mode": "rank", "rank": 2}).lossless_steps == 10
    monkeypatch.setenv(LOSSLESS_STEPS_ENV, "3")
    assert DADConfig().lossless_steps == 3 and DADConfig(lossless_steps=0).lossless_steps == 0
    monkeypatch.setenv(LOSSLESS_STEPS_ENV, "ten")
    with pytest.raises(ValueError, match=r"lossless_steps.*DAD_LOSSLESS_STEPS"):
        DADConfig()
    monkeypatch.setenv(LOSSLESS_STEPS_ENV, "-2")
    with pytest.raises(ValueError, match=r"lossless_steps.*-2.*DAD_LOSSLESS_STEPS"):
        DADConfig()


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
    ({"route_trial_steps": -1}, "route_trial_steps"),
    ({"route_trial_steps": 2.5}, "route_trial_steps"),
    ({"route_trial_steps": 3}, "route_trial_steps"),
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


# -- sequences: a bare string is an error, never split into characters ----------------------------
@pytest.mark.parametrize("key,value", [("exclude", "out"), ("layer_kinds", "linear")])
def test_string_for_a_list_names_the_key(key, value):
    with pytest.raises(ValueError, match=rf"'{key}'.*list of strings.*the string '{value}'"):
        DADConfig(**{key: value})
    with pytest.raises(ValueError, match=key):
        DADConfig.from_dict({key: value})


@pytest.mark.parametrize("key,value", [("exclude", None), ("exclude", 5), ("layer_kinds", None), ("layer_kinds", 1)])
def test_non_sequence_for_a_list_names_the_key(key, value):
    with pytest.raises(ValueError, match=rf"'{key}'.*list of strings"):
        DADConfig(**{key: value})


def test_lists_and_tuples_of_strings_are_stored_as_tuples():
    cfg = DADConfig(exclude=["lm_head", "wte*"], layer_kinds=("linear",))
    assert cfg.exclude == ("lm_head", "wte*") and cfg.layer_kinds == ("linear",)
    assert DADConfig(exclude=["a"]) == DADConfig(exclude=("a",))


# -- numbers: finite and in range ------------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 0, 0.0, -1, True, "25"])
def test_bad_bucket_cap_names_the_key(value):
    with pytest.raises(ValueError, match="'bucket_cap_mb'"):
        DADConfig(bucket_cap_mb=value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5, True])
def test_bad_adaptive_tolerance_names_the_key(value):
    with pytest.raises(ValueError, match="'adaptive_tolerance'"):
        DADConfig(mode="rank", rank=4, adaptive_tolerance=value)


@pytest.mark.parametrize("key", ["rank", "power_iterations"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 2.0])
def test_integer_keys_reject_floats(key, value):
    with pytest.raises(ValueError, match=f"'{key}'"):
        DADConfig(**{key: value})


def test_good_numbers_are_kept():
    cfg = DADConfig(mode="rank", rank=2, adaptive_tolerance=1, bucket_cap_mb=0.5)
    assert cfg.bucket_cap_mb == 0.5 and cfg.adaptive_tolerance == 1


# -- frozen: derive, never mutate -------------------------------------------------------------------
def test_frozen_assignment_raises():
    cfg = DADConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.mode = "rank"
    with pytest.raises(AttributeError):  # FrozenInstanceError is an AttributeError
        cfg.exclude = ("x",)
    assert cfg.mode == "auto" and cfg.exclude == ()


def test_frozen_config_is_hashable_and_equal_by_value():
    a, b = DADConfig(exclude=["x"]), DADConfig(exclude=("x",))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1


def test_replace_validates_again():
    cfg = DADConfig(mode="rank", rank=4)
    assert dataclasses.replace(cfg, rank=8).rank == 8
    assert dataclasses.replace(cfg, exclude=["head"]).exclude == ("head",)
    with pytest.raises(ValueError, match="'rank'"):
        dataclasses.replace(cfg, rank=0)
    with pytest.raises(ValueError, match="'exclude'"):
        dataclasses.replace(cfg, exclude="head")
    with pytest.raises(ValueError, match="'bucket_cap_mb'"):
        dataclasses.replace(cfg, bucket_cap_mb=float("nan"))


def test_from_dict_of_to_dict_derives_a_changed_config():
    cfg = DADConfig(mode="rank", rank=4, exclude=["head"])
    derived = DADConfig.from_dict({**cfg.to_dict(), "wire_dtype": "bfloat16"})
    assert derived.wire_dtype == "bfloat16" and derived.exclude == ("head",) and cfg.wire_dtype is None


# -- unknown keywords: ValueError naming them, as from_dict ----------------------------------------
def test_unknown_keyword_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"\['bogus'\].*known keys.*'bucket_cap_mb'"):
        DADConfig(bogus=1)
    with pytest.raises(ValueError, match="rnak"):
        DADConfig(mode="rank", rnak=4)


def test_positional_arguments_still_work():
    assert DADConfig("rank", 4) == DADConfig(mode="rank", rank=4)
