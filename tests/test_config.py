"""Configuration from MPITRAIN_* variables, with HOROVOD_* accepted too."""

import pytest

import mpitrain as mt
from mpitrain.runtime import config


def test_defaults_without_variables():
    settings = config.from_environ({})
    assert settings.cache_capacity == 1024 and settings.cycle_time_ms == 1.0
    assert settings.stall_check_time == 60 and settings.stall_shutdown_time > 0


def test_mpitrain_names_and_horovod_aliases():
    settings = config.from_environ({"HOROVOD_FUSION_THRESHOLD": "1048576",
                                    "HOROVOD_CYCLE_TIME": "5",
                                    "MPITRAIN_CYCLE_TIME": "2.5",
                                    "HOROVOD_TIMELINE": "/tmp/t.json",
                                    "MPITRAIN_TIMELINE_MARK_CYCLES": "1",
                                    "HOROVOD_STALL_CHECK_DISABLE": "true"})
    assert settings.fusion_threshold == 1048576
    assert settings.cycle_time_ms == 2.5          # the MPITRAIN_ name wins
    assert settings.timeline == "/tmp/t.json" and settings.timeline_mark_cycles
    assert settings.stall_check_disable


@pytest.mark.parametrize("name,value,accepts", [
    ("MPITRAIN_FUSION_THRESHOLD", "64MB", "bytes"),
    ("MPITRAIN_FUSION_THRESHOLD", "-1", "bytes"),
    ("HOROVOD_CYCLE_TIME", "fast", "milliseconds"),
    ("MPITRAIN_CACHE_CAPACITY", "1.5", "entries"),
    ("MPITRAIN_STALL_CHECK_TIME_SECONDS", "0", "seconds > 0"),
    ("MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS", "never", "seconds >= 0"),
    ("MPITRAIN_TIMELINE_MARK_CYCLES", "maybe", "0 or 1"),
])
def test_a_bad_value_names_the_variable_and_what_it_accepts(name, value, accepts):
    with pytest.raises(ValueError) as caught:
        config.from_environ({name: value})
    assert name in str(caught.value) and repr(value) in str(caught.value)
    assert accepts in str(caught.value)


@pytest.mark.parametrize("value", ["1000000", "1e12", "1000.5", "inf"])
def test_a_cycle_time_beyond_a_second_is_refused(value):
    with pytest.raises(ValueError) as caught:
        config.from_environ({"MPITRAIN_CYCLE_TIME": value})
    assert str(caught.value) == (f"MPITRAIN_CYCLE_TIME={value!r} is not valid: it accepts "
                                 "a number of milliseconds >= 0 and <= 1000")
    assert config.from_environ({"MPITRAIN_CYCLE_TIME": "1000"}).cycle_time_ms == 1000


def test_init_rejects_a_bad_value_before_starting_mpi(monkeypatch):
    monkeypatch.setenv("MPITRAIN_CYCLE_TIME", "soon")
    with pytest.raises(ValueError, match="MPITRAIN_CYCLE_TIME"):
        mt.init()
    assert not mt.is_initialized()
